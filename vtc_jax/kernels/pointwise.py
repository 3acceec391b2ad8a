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

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .tiling import F32_MATH_PRIMITIVES, choose_block, f32_math, grid_origin
from .vio import Plan, VTensor, broadcast_input, outputs, pack_results
from .vio import out_dtypes as out_dtypes_of

__all__ = ["pointwise", "choose_block", "as_vtensor", "grid_origin", "f32_math", "F32_MATH_PRIMITIVES"]

as_vtensor = broadcast_input  # the name this module exported before vio owned it


@dataclass(frozen=True, eq=False)
class _Config:
    shape: tuple[int, ...]                 # logical output shape (rank >= 1)
    block: tuple[int, ...]
    compute: Callable[..., Any]            # fn on the input blocks (scalars bound)
    tuple_result: bool
    index_args: bool = False               # fn also takes the block's indices, one array per dim


def _pointwise_kernel(c: _Config, ins: Sequence[Any], outs: Sequence[Any]) -> None:
    """Program ``pid`` of the 1-D grid: one block of every input and output."""
    origin, _ = grid_origin(c.shape, c.block, pl.program_id(0))
    blocks = [r.load(origin, c.block) for r in ins]        # stage 1
    if c.index_args:   # the output indices of this block (an iota recomputed in registers)
        blocks += [jax.lax.broadcasted_iota(jnp.int32, c.block, k) + o for k, o in enumerate(origin)]
    res = c.compute(*blocks)                               # stage 2 (untouched)
    res = tuple(res) if c.tuple_result else (res,)
    for o, v in zip(outs, res):                            # stage 3
        o.store(origin, c.block, jnp.broadcast_to(v, c.block))


def pointwise(fn: Callable[..., Any], inputs: Sequence[Any], *, out_shape: Sequence[int] | None = None,
              out_dtypes: Any = None, outs: Any = None, block: Sequence[int] | None = None,
              num_warps: int = 4, num_stages: int = 1, backend: str = "interpret",
              name: str = "pointwise", upcast_math: bool = True, index_args: bool = False) -> Any:
    """Elementwise ``fn(*blocks) -> block | tuple of blocks`` over a logical output shape.

    inputs      VTensors, arrays (broadcast to the output shape by numpy rules, through a
                broadcast layout — no copy) or Python scalars (passed to ``fn`` unchanged).
    out_shape   logical output shape; default: ``outs``' shape, else the broadcast input shape.
    out_dtypes  dtype or sequence (one per result of ``fn``); default: what ``fn`` returns.
    outs        VTensor or sequence (one per result of ``fn``) to write into — virtual outputs,
                buffers written in place; default fresh physical arrays. An output smaller than
                ``out_shape`` (same rank) is written within its own extent only.
    block       power-of-two block over the logical shape; default :func:`choose_block`.
    upcast_math run ``fn`` through :func:`f32_math` (needed on Triton for bf16/f16 division and
                most transcendentals; same numerics as XLA's per-op normalisation).
    index_args  ``fn`` also receives, after the blocks, the block's output indices (int32, one
                array per dim): values that depend on the position (an iota) computed in registers.

    Returns, per result of ``fn``, its output's physical buffer (or the tuple of its buffers when
    the output VTensor has several); a single result is returned bare, a tuple result as a tuple.
    """
    out_shape = _out_shape(inputs, outs) if out_shape is None else tuple(int(n) for n in out_shape)
    vins, call_fn = _bind(fn, inputs, out_shape)
    tuple_result, results = _results(call_fn, vins, out_shape, len(out_shape) if index_args else 0)
    dtypes = out_dtypes_of(out_dtypes, [r.dtype for r in results])
    vouts, lifted = outputs(outs, _out_shapes(outs, out_shape, len(results)), dtypes)

    shape = out_shape
    if shape == ():  # rank 0: a (1,) view of everything
        shape = (1,)
        vins = [v.expand_dims((0,)) for v in vins]
        vouts = [v if lifted[i] else v.expand_dims((0,)) for i, v in enumerate(vouts)]

    itemsize = max([np.dtype(v.dtype).itemsize for v in vins + vouts] + [1])
    blk = tuple(int(b) for b in block) if block is not None else choose_block(shape, itemsize)
    if len(blk) != len(shape) or any(b & (b - 1) or b < 1 for b in blk):
        raise ValueError(f"block {blk} must be powers of two, one per dim of {shape}")

    if out_shape == () and index_args:
        raise ValueError("index_args needs an output of rank >= 1")
    cfg = _Config(shape, blk, f32_math(call_fn) if upcast_math else call_fn, tuple_result, index_args)
    _, n_programs = grid_origin(shape, blk, 0)
    plan = Plan.build(vins, vouts, same_place=True)
    bufs = plan.call(functools.partial(_pointwise_kernel, cfg), grid=(n_programs,), backend=backend,
                     num_warps=num_warps, num_stages=num_stages, name=name)
    packed = pack_results(bufs, lifted)
    return tuple(packed) if tuple_result else packed[0]


def _out_shapes(outs: Any, out_shape: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """Each output's shape: ``out_shape``, or a given output's own where it lies inside it (one
    rank, no extent larger): one grid over a union of output shapes, each output's store dropping
    the lanes beyond its extent (``VRef.store``) — sibling islands in one launch."""
    given = [] if outs is None else [outs] if isinstance(outs, VTensor) else list(outs)
    if len(given) == n and all(len(v.shape) == len(out_shape) and all(a <= b for a, b in zip(v.shape, out_shape))
                               for v in given):
        return [tuple(v.shape) for v in given]
    return [out_shape] * n


def _out_shape(inputs: Sequence[Any], outs: Any) -> tuple[int, ...]:
    """Default logical output shape: ``outs``' shape, else the broadcast shape of the inputs."""
    if outs is not None:
        return tuple(int(n) for n in (outs if isinstance(outs, VTensor) else outs[0]).shape)
    shapes = [x.shape if isinstance(x, VTensor) else tuple(np.shape(x)) for x in inputs if not _is_scalar(x)]
    return tuple(int(n) for n in np.broadcast_shapes(*shapes)) if shapes else ()


def _bind(fn: Callable[..., Any], inputs: Sequence[Any], out_shape: tuple[int, ...]
          ) -> tuple[list[VTensor], Callable[..., Any]]:
    """Inputs as VTensors of the logical output shape, and ``fn`` of their blocks only: Python
    scalars stay in its closure."""
    vins: list[VTensor] = []
    slots: list[tuple[bool, Any]] = []  # per fn argument: (True, index into vins) or (False, scalar)
    for x in inputs:
        if _is_scalar(x):
            slots.append((False, x))
        else:
            slots.append((True, len(vins)))
            vins.append(broadcast_input(x, out_shape))

    def call_fn(*blocks: Any) -> Any:
        return fn(*[blocks[v] if is_in else v for is_in, v in slots], *blocks[len(vins):])

    return vins, call_fn


def _results(call_fn: Callable[..., Any], vins: Sequence[VTensor], out_shape: tuple[int, ...],
             n_index: int = 0) -> tuple[bool, tuple[Any, ...]]:
    """(tuple result?, abstract results) of ``call_fn`` on the logical shape; checks elementwise."""
    abstract = jax.eval_shape(call_fn, *[jax.ShapeDtypeStruct(out_shape, v.dtype) for v in vins],
                              *[jax.ShapeDtypeStruct(out_shape, jnp.int32)] * n_index)
    tuple_result = isinstance(abstract, (tuple, list))
    results = tuple(abstract) if tuple_result else (abstract,)
    for r in results:  # a result may also be a scalar (a constant output of re-bound ops)
        if tuple(r.shape) not in (out_shape, ()):
            raise ValueError(f"fn returns shape {tuple(r.shape)}, expected {out_shape}: fn must be elementwise")
    return tuple_result, results


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex))
