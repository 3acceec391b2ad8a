"""Pointwise template: an n-ary elementwise ``fn`` over a logical output shape, with virtual I/O.

The three stages of the paper's Listing 1 (§2.3, §4.2):

1. every input block is ``VRef.load``-ed at the program's origin — whether the input is a plain
   array, a transposed/sliced/concatenated view or a broadcast bias is its layout's business;
2. ``fn(*blocks)`` runs in registers, untouched (in the compiler it is the compute cluster's
   elementwise ops re-bound; it must therefore be shape-polymorphic: elementwise ops and scalar
   constants only, no op that names a shape);
3. every result block is ``VRef.store``-d — possibly into a slice of a bigger buffer at a runtime
   ``pos`` (aliased), into several concat buffers, or onto three physical tensors.

16-bit floats: Triton cannot divide bf16/f16 tensors ("unsupported types") and its LLVM step
fails on tanh, log1p, expm1, pow, tan, atan(2), asin, sinh, cbrt of them (erf_inv, nextafter do not
lower). :func:`f32_math` re-runs ``fn`` op by op and computes exactly those ops (and the other
transcendentals) in f32, rounding each result back — XLA's own per-op float normalisation, so the
numerics are the ones ``jax.jit`` gives.

Blocking: the grid is 1-D over power-of-two blocks of ~``_TARGET`` elements, filled from the last
dim outwards (last dim at most 128 wide for 4-byte types, 256 for 2-byte ones); the leading dims
the budget does not reach have block 1, i.e. are collapsed into the grid. Ragged edges are masked
by ``vio``; padded lanes compute garbage that is never stored.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ..indexmap import Layout
from .vio import Plan, VTensor, next_pow2

__all__ = ["pointwise", "choose_block", "as_vtensor", "grid_origin", "f32_math", "F32_MATH_PRIMITIVES"]

_TARGET = 2048          # elements per block (fits 4 warps comfortably for a few live values)
_MAX_1D = 1024          # block of a rank-1 tensor


# Primitives computed in f32 (inputs upcast, result rounded back) when they see 16-bit floats.
F32_MATH_PRIMITIVES = frozenset({
    "div", "rem", "pow", "atan2", "nextafter", "logistic", "tanh", "tan", "sin", "cos", "asin",
    "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "exp", "exp2", "expm1", "log",
    "log1p", "sqrt", "rsqrt", "cbrt", "erf", "erfc", "erf_inv", "lgamma", "digamma",
})
_LOW = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def f32_math(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` evaluated primitive by primitive, with :data:`F32_MATH_PRIMITIVES` on bf16/f16
    operands computed in f32 and rounded back (call-like primitives — jit, custom_jvp/vjp — are
    inlined). Everything else is re-bound unchanged. A no-op for f32 programs."""
    def wrapped(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _eval_f32_math(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)
    return wrapped


def _eval_f32_math(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                      if isinstance(eqn.params.get(k), jcore.ClosedJaxpr)), None)
        if inner is not None and eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call",
                                                         "custom_jvp_call", "custom_vjp_call",
                                                         "custom_vjp_call_jaxpr", "remat", "checkpoint"):
            outs = _eval_f32_math(inner.jaxpr, inner.consts, invals)
        elif eqn.primitive.name in F32_MATH_PRIMITIVES and any(
                np.dtype(v.aval.dtype) in _LOW for v in eqn.invars if hasattr(v.aval, "dtype")):
            up = [jnp.asarray(x).astype(jnp.float32) if np.dtype(v.aval.dtype) in _LOW else x
                  for v, x in zip(eqn.invars, invals)]
            outs = eqn.primitive.bind(*up, **eqn.params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            outs = [o.astype(v.aval.dtype) if np.dtype(v.aval.dtype) in _LOW else o
                    for o, v in zip(outs, eqn.outvars)]
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def choose_block(shape: Sequence[int], itemsize: int = 4, target: int = _TARGET) -> tuple[int, ...]:
    """Power-of-two block for ``shape``, filled from the innermost dim outwards up to ~``target``
    elements: the last dim at most 128 (4-byte) / 256 (2-byte) wide, outer dims get what is left
    of the budget (1 once it is spent: those dims are collapsed into the grid)."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return ()
    if len(shape) == 1:
        return (min(next_pow2(shape[0]), _MAX_1D),)
    last = min(next_pow2(shape[-1]), 256 if itemsize <= 2 else 128)
    out, budget = [last], max(1, target // last)
    for n in reversed(shape[:-1]):
        b = min(next_pow2(n), budget)
        out.append(b)
        budget = max(1, budget // b)
    return tuple(reversed(out))


def grid_origin(shape: Sequence[int], block: Sequence[int], pid: Any) -> tuple[tuple[Any, ...], int]:
    """(origin of program ``pid``'s block, grid size) for a 1-D grid over blocks, last dim fastest.

    Dims covered by a single block get the static origin ``0`` (vio then skips their masks when
    the block also fits exactly). Returns the grid size as the second element.
    """
    counts = [max(1, -(-int(n) // int(b))) for n, b in zip(shape, block)]
    origin: list[Any] = []
    stride = 1
    for n, b in reversed(list(zip(counts, block))):
        if n == 1:
            origin.append(0)
        else:
            q = pid if stride == 1 else pid // stride
            origin.append((q % n) * b if stride * n < math.prod(counts) else q * b)
        stride *= n
    return tuple(reversed(origin)), math.prod(counts)


def as_vtensor(x: Any, shape: Sequence[int]) -> VTensor:
    """An input of logical ``shape``: a VTensor (broadcast if its shape is smaller) or an array
    (numpy broadcasting rules, expressed as a broadcast layout onto the array itself)."""
    shape = tuple(int(n) for n in shape)
    if isinstance(x, VTensor):
        if x.shape == shape:
            return x
        return VTensor(_broadcast_layout(x.layout, shape), x.dtype, x.buffers, x.symbols)
    x = jnp.asarray(x)
    if tuple(x.shape) == shape:
        return VTensor.physical(x)
    if x.ndim == 0:
        x = x.reshape(1)
    return VTensor(_broadcast_layout(Layout.physical(0, x.shape), shape), x.dtype, (x,))


def _broadcast_layout(layout: Layout, shape: tuple[int, ...]) -> Layout:
    src = layout.shape
    try:
        ok = len(src) <= len(shape) and np.broadcast_shapes(src, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"cannot broadcast {src} to {shape}")
    return layout.broadcast(shape, tuple(range(len(shape) - len(src), len(shape))))


def _lift_rank0(v: VTensor) -> VTensor:
    return VTensor(v.layout.expand_dims((0,)), v.dtype, v.buffers, v.symbols)


def pointwise(fn: Callable[..., Any], inputs: Sequence[Any], *, out_shape: Sequence[int] | None = None,
              out_dtypes: Any = None, outs: Any = None, block: Sequence[int] | None = None,
              num_warps: int = 4, num_stages: int = 1, backend: str = "interpret",
              name: str = "pointwise", upcast_math: bool = True) -> Any:
    """Elementwise ``fn(*blocks) -> block | tuple of blocks`` over a logical output shape.

    inputs      VTensors, arrays (broadcast to the output shape by numpy rules, through a
                broadcast layout — no copy) or Python scalars (passed to ``fn`` unchanged).
    out_shape   logical output shape; default: ``outs``' shape, else the broadcast input shape.
    out_dtypes  dtype or sequence (one per result of ``fn``); default: what ``fn`` returns.
    outs        VTensor or sequence (one per result of ``fn``) to write into — virtual outputs,
                buffers written in place; default fresh physical arrays.
    block       power-of-two block over the logical shape; default :func:`choose_block`.
    upcast_math run ``fn`` through :func:`f32_math` (needed on Triton for bf16/f16 division and
                most transcendentals; same numerics as XLA's per-op normalisation).

    Returns, per result of ``fn``, its output's physical buffer (or the tuple of its buffers when
    the output VTensor has several); a single result is returned bare, a tuple result as a tuple.
    """
    arrays = [x for x in inputs if not _is_scalar(x)]
    if out_shape is None:
        if outs is not None:
            out_shape = (outs if isinstance(outs, VTensor) else outs[0]).shape
        else:
            out_shape = np.broadcast_shapes(*[tuple(np.shape(x)) if not isinstance(x, VTensor) else x.shape
                                              for x in arrays]) if arrays else ()
    out_shape = tuple(int(n) for n in out_shape)

    # Inputs: VTensors of the logical output shape; Python scalars stay in fn's closure.
    vins: list[VTensor] = []
    slots: list[tuple[bool, Any]] = []  # per fn argument: (True, index into vins) or (False, scalar)
    for x in inputs:
        if _is_scalar(x):
            slots.append((False, x))
        else:
            slots.append((True, len(vins)))
            vins.append(as_vtensor(x, out_shape))

    # What fn returns: count, dtypes (abstract evaluation on the logical shape).
    def call_fn(blocks: Sequence[Any]) -> Any:
        return fn(*[blocks[v] if is_in else v for is_in, v in slots])

    abstract = jax.eval_shape(lambda *b: call_fn(b),
                              *[jax.ShapeDtypeStruct(out_shape, v.dtype) for v in vins])
    tuple_result = isinstance(abstract, (tuple, list))
    results = tuple(abstract) if tuple_result else (abstract,)
    for r in results:  # a result may also be a scalar (a constant output of re-bound ops)
        if tuple(r.shape) not in (out_shape, ()):
            raise ValueError(f"fn returns shape {tuple(r.shape)}, expected {out_shape}: fn must be elementwise")
    n_out = len(results)
    if out_dtypes is None:
        dtypes = [np.dtype(r.dtype) for r in results]
    elif isinstance(out_dtypes, (list, tuple)):
        dtypes = [np.dtype(d) for d in out_dtypes]
    else:
        dtypes = [np.dtype(out_dtypes)] * n_out
    if len(dtypes) != n_out:
        raise ValueError(f"{len(dtypes)} out_dtypes for {n_out} results")

    # Outputs.
    lifted_fresh = [False] * n_out
    if outs is None:
        vouts = []
        for i, d in enumerate(dtypes):
            if out_shape == ():
                lifted_fresh[i] = True
                vouts.append(VTensor.fresh((1,), d))
            else:
                vouts.append(VTensor.fresh(out_shape, d))
    else:
        vouts = [outs] if isinstance(outs, VTensor) else list(outs)
        if len(vouts) != n_out:
            raise ValueError(f"{len(vouts)} outs for {n_out} results of fn")
        for v in vouts:
            if v.shape != out_shape:
                raise ValueError(f"output VTensor of shape {v.shape}, expected {out_shape}")

    shape = out_shape
    if shape == ():  # rank 0: a (1,) view of everything
        shape = (1,)
        vins = [_lift_rank0(v) for v in vins]
        vouts = [v if lifted_fresh[i] else _lift_rank0(v) for i, v in enumerate(vouts)]

    itemsize = max([np.dtype(v.dtype).itemsize for v in vins + vouts] + [1])
    blk = tuple(int(b) for b in block) if block is not None else choose_block(shape, itemsize)
    if len(blk) != len(shape) or any(b & (b - 1) or b < 1 for b in blk):
        raise ValueError(f"block {blk} must be powers of two, one per dim of {shape}")

    _, n_programs = grid_origin(shape, blk, 0)
    plan = Plan.build(vins, vouts)

    compute = f32_math(lambda *b: call_fn(b)) if upcast_math else (lambda *b: call_fn(b))

    def body(ins: Sequence[Any], outs_: Sequence[Any]) -> None:
        origin, _ = grid_origin(shape, blk, pl.program_id(0))
        blocks = [r.load(origin, blk) for r in ins]        # stage 1
        res = compute(*blocks)                             # stage 2 (untouched)
        res = tuple(res) if tuple_result else (res,)
        for o, v in zip(outs_, res):                       # stage 3
            o.store(origin, blk, jnp.broadcast_to(v, blk))

    bufs = plan.call(body, grid=(n_programs,), backend=backend, num_warps=num_warps,
                     num_stages=num_stages, name=name)
    packed = []
    for i, b in enumerate(bufs):
        if lifted_fresh[i]:
            b = (b[0].reshape(()),)
        packed.append(b[0] if len(b) == 1 else tuple(b))
    return tuple(packed) if tuple_result else packed[0]


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex))
