"""Stage 2 of every template: a cluster's own primitives re-bound on register blocks.

The paper leaves the compute stage of a kernel untouched; here that means the cluster's jaxpr
equations are bound again, unchanged, on the blocks the template loaded. Blocks arrive in the
program's own dtypes (:func:`block_fn` casts each input block to its tensor's dtype first), so a
bf16 epilogue with bf16 literals computes exactly what the traced program computes. Elementwise
primitives are shape-agnostic and jax's binary primitives accept rank-0 and size-1 operands, so a
scalar broadcast stays a scalar and everything else binds as traced.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..graph import Graph
from ..kernels.vio import VTensor
from ..primitives import TABLE, Role, block_safe

__all__ = ["block_supported", "block_fn", "const_value", "kernel_inputs", "broadcast_input", "buffers_of"]


def block_supported(graph: Graph, op_ids: Sequence[int]) -> str | None:
    """Why the ops cannot be re-bound on blocks (None when they can): only shape-agnostic ones."""
    for oid in op_ids:
        op = graph.ops[oid]
        if not block_safe(op.primitive):
            if op.primitive in TABLE and TABLE[op.primitive].role is Role.ELEMENTWISE:   # (lgamma, ...)
                return f"{op.primitive} inside the cluster: Pallas' Triton lowering has no rule for it"
            return f"{op.primitive} inside the cluster cannot be computed on register blocks"
        if op.primitive == "broadcast_in_dim" and graph.tensors[op.inputs[0]].shape != ():
            return "a non-scalar broadcast inside the cluster"
    return None


def block_fn(graph: Graph, op_ids: Sequence[int], inputs: Sequence[int],
             outputs: Sequence[int], views: frozenset[str] = frozenset({"broadcast_in_dim"})) -> Callable[..., Any]:
    """``f(*input_blocks) -> output block(s)``: the ops re-bound on blocks, in the program's dtypes.
    The primitives named in ``views`` are identities on blocks (a broadcast of a block loaded
    broadcast already; a row statistic's size-1 axis moved by a reshape)."""
    ops = [graph.ops[i] for i in op_ids]
    dtypes = [graph.tensors[t].dtype for t in inputs]

    def f(*blocks: Any) -> Any:
        env: dict[int, Any] = {t: b.astype(d) if b.dtype != d else b
                               for t, b, d in zip(inputs, blocks, dtypes)}
        for op in ops:
            vals = [env[t] if t in env else const_value(graph, t).reshape(()) for t in op.inputs]
            if op.primitive in views:
                out = vals[0]
            else:
                out = op.prim.bind(*vals, **op.params)
            env.update(zip(op.outputs, out if op.prim.multiple_results else (out,)))
        res = tuple(env[t] for t in outputs)
        return res if len(res) > 1 else res[0]

    return f


def kernel_inputs(graph: Graph, c: Any, exclude: Sequence[int] = ()) -> tuple[int, ...]:
    """The tensors a cluster's kernel loads as blocks: every input except ``exclude`` and
    single-element constants (those are inlined as scalars). A closed-over array constant is a
    kernel operand like any other: binding it whole inside a block computation would be wrong."""
    return tuple(t for t in c.inputs if t not in exclude
                 and not (graph.tensors[t].const is not None and graph.tensors[t].size == 1))


def const_value(graph: Graph, t: int) -> Any:
    """A compile-time constant's value (literals, closed-over arrays)."""
    c = graph.tensors[t].const
    if c is None:
        raise KeyError(f"t{t} has no value")
    return c


def broadcast_input(x: Any, shape: tuple[int, ...]) -> Any:
    """Numpy-rule broadcast of a kernel input to ``shape`` — through its layout, never a copy."""
    if not isinstance(x, VTensor) or tuple(x.shape) == shape:
        return x
    lay = x.layout
    if len(lay.shape) < len(shape):
        lay = lay.reshape((1,) * (len(shape) - len(lay.shape)) + tuple(lay.shape))
    return VTensor(lay.broadcast(shape, tuple(range(len(shape)))), x.dtype, x.buffers, x.symbols)


def buffers_of(res: Any) -> tuple[Any, ...]:
    """A kernel entry point's result for one output as the tuple of its physical buffers."""
    return tuple(res) if isinstance(res, (tuple, list)) else (res,)
