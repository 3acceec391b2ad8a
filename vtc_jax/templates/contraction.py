"""Matmul and convolution clusters: the contraction plus its elementwise epilogue as one kernel
(a matmul also applies a unary prologue to the tiles it loads: a ReLU on an operand).

The epilogue is the cluster's other primitives re-bound on the accumulator tile
(:func:`stage2.block_fn`). The accumulator is first rounded to the contraction's own output
dtype — what the traced program's dot returns — so a bf16 epilogue sees bf16 values and bf16
literals, exactly like ``jax.jit``; 16-bit math runs op by op in f32 (``f32_math``), XLA's own
float normalisation.

The kernel's dot computes at the op's own ``precision`` param (resolved against
``jax_default_matmul_precision`` when the kernel is built, :func:`kernels.tiling.dot_precision`):
an f32 dot at jax's default runs on TF32 tensor cores as ``jax.jit``'s does, one at ``HIGHEST`` is
IEEE f32. An op asking for an algorithm Pallas' Triton dot lacks (FP8, F64) stays in XLA.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..cluster import Cluster
from ..graph import Graph
from ..kernels.conv import conv
from ..kernels.matmul import matmul
from ..kernels.pointwise import f32_math
from ..kernels.tiling import dtype_unsupported, precision_unsupported
from ..primitives import Kind
from .base import Decline, Run, Step, Template
from .stage2 import block_fn, block_supported, broadcast_input, buffers_of, kernel_inputs

__all__ = ["MATMUL", "CONV"]


@dataclass(frozen=True)
class ContractionMatch:
    op: int                       # the dot_general / conv op
    rest: tuple[int, ...]         # epilogue ops
    extras: tuple[int, ...]       # epilogue operands read from outside (bias, residual rows)
    operands: tuple[int, ...] = ()                  # what the kernel loads for lhs, rhs
    prologue: tuple[tuple[int, ...], ...] = ((), ())   # per operand: its unary chain's ops


def _prologue(graph: Graph, c: Cluster, x: int) -> tuple[int, tuple[int, ...]]:
    """(the tensor the kernel loads, the cluster's ops between it and the dot operand ``x``)."""
    own, chain = set(c.ops), []
    while (p := graph.producer(x)) is not None and p.id in own:
        chain.append(p.id)
        x = next(t for t in p.inputs if graph.tensors[t].size > 1 or graph.tensors[t].const is None)
    return x, tuple(reversed(chain))


def _match(primitive: str) -> Callable[[Graph, Cluster], ContractionMatch]:
    def match(graph: Graph, c: Cluster) -> ContractionMatch:
        found = [o for o in c.ops if graph.ops[o].primitive == primitive]
        if len(found) != 1 or len(c.outputs) != 1:
            raise Decline(f"needs exactly one {primitive} and one output")
        op = graph.ops[found[0]]
        if primitive == "conv_general_dilated" and op.params.get("batch_group_count", 1) != 1:
            raise Decline("batch_group_count != 1")
        why = precision_unsupported(op.params.get("precision"))
        if why:
            raise Decline(why)
        (lhs, pa), (rhs, pb) = (_prologue(graph, c, x) for x in op.inputs[:2])
        for t in dict.fromkeys((lhs, rhs, *op.inputs[:2])):   # what the kernel loads and what it dots
            dt = np.dtype(graph.tensors[t].dtype)
            if not jnp.issubdtype(dt, jnp.floating):
                raise Decline(f"{primitive} of {dt.name} operands: the kernel's dot takes floating "
                              "operands only (integer and boolean dots run in XLA)")
            if primitive == "conv_general_dilated" and (why := dtype_unsupported(dt)):
                raise Decline(why)
        rest = tuple(o for o in c.ops if o != op.id and o not in pa and o not in pb)
        why = block_supported(graph, rest + pa + pb)
        if why:
            raise Decline(why)
        if pa and pb and not all(_keeps_zero(graph, ch, base, x) for ch, base, x in
                                 ((pa, lhs, op.inputs[0]), (pb, rhs, op.inputs[1]))):
            raise Decline("both operands' prologues map 0 elsewhere (masked lanes would count)")
        extras = kernel_inputs(graph, c, exclude=(lhs, rhs))
        return ContractionMatch(op.id, rest, extras, (lhs, rhs), (pa, pb))
    return match


def _keeps_zero(graph: Graph, chain: tuple[int, ...], base: int, x: int) -> bool:
    f = block_fn(graph, chain, [base], [x])
    with jax.ensure_compile_time_eval():   # matched while jit traces the program: evaluate now
        return bool(np.asarray(f(jnp.zeros((), graph.tensors[base].dtype))) == 0)


def _build(call_kernel: Callable[..., Any]) -> Callable[[Graph, Cluster, ContractionMatch, str], Step]:
    def build(graph: Graph, c: Cluster, m: ContractionMatch, backend: str) -> Step:
        op = graph.ops[m.op]
        lhs, rhs = m.operands or op.inputs[:2]
        pro = tuple(f32_math(block_fn(graph, ch, [base], [x])) if ch else None
                    for ch, base, x in zip(m.prologue, (lhs, rhs), op.inputs[:2]))
        kw_pro = {"prologue": pro} if any(f is not None for f in pro) else {}
        after = tuple(graph.tensors[x].dtype for x in op.inputs[:2])   # a prologue may cast
        if any(f is not None for f in pro) and after != tuple(graph.tensors[t].dtype for t in (lhs, rhs)):
            kw_pro["prologue_dtypes"] = after
        o = c.outputs[0]
        epi = f32_math(block_fn(graph, m.rest, [op.outputs[0], *m.extras], [o])) if m.rest else None
        shape = tuple(graph.tensors[o].shape)

        def step(run: Run) -> None:
            out = run.out_vtensor(o)
            res = call_kernel(run.vtensor(lhs), run.vtensor(rhs), op.params, backend, out=out, epilogue=epi,
                              epilogue_args=[broadcast_input(run.vtensor(t), shape) for t in m.extras],
                              **kw_pro)
            run.written(o, out, buffers_of(res))

        return step
    return build


def _matmul(a: Any, b: Any, p: Mapping[str, Any], backend: str, **kw: Any) -> Any:
    return matmul(a, b, dimension_numbers=p["dimension_numbers"],
                  preferred_element_type=p.get("preferred_element_type"), precision=p.get("precision"),
                  backend=backend, **kw)


def _conv(x: Any, w: Any, p: Mapping[str, Any], backend: str, **kw: Any) -> Any:
    return conv(x, w, window_strides=p["window_strides"], padding=p["padding"],
                lhs_dilation=p.get("lhs_dilation"), rhs_dilation=p.get("rhs_dilation"),
                dimension_numbers=p["dimension_numbers"], feature_group_count=p["feature_group_count"],
                preferred_element_type=p.get("preferred_element_type"), precision=p.get("precision"),
                backend=backend, **kw)


MATMUL = Template(Kind.MATMUL, library=True, match=_match("dot_general"), build=_build(_matmul))
CONV = Template(Kind.CONV, library=True, match=_match("conv_general_dilated"), build=_build(_conv))
