"""Row-reduction template (reductions, norms, softmax) with virtual I/O.

One engine, :func:`row_reduce`, and thin wrappers (:func:`reduce_sum`, :func:`reduce_max`,
:func:`mean`, :func:`softmax`, :func:`rms_norm`, :func:`layer_norm`).

The logical input (every input has the same logical shape ``S``; smaller arrays/VTensors are
broadcast through their layout) is reduced over ``axis``. The template never moves data itself:
it re-views every operand's *layout* so that the reduced axis is last — ``transpose`` to move the
axis last, then ``reshape`` to ``(rows, cols)`` — and asks ``vio`` for blocks of that view. The
flattening reshape is only used when it keeps every piece a strided box (otherwise it would turn
a plain ``pl.ds`` load into a div/mod gather); then the leading dims stay separate grid dims with
block 1 instead.

Computation, for a ``(BR, BC)`` block of rows:

* ``passes``: a sequence of passes, each a sequence of :class:`Stat` ``(prologue, combine)``. A
  stat is ``combine``-reduced over the row of ``prologue(*blocks, *earlier_stats)`` — earlier
  stats are those of previous passes, shaped ``(.., BR, 1)`` so they broadcast against blocks.
  Lanes past the row end are replaced by the combine's identity before reducing.
* ``epilogue(*blocks, *stats)`` gives outputs of the input's logical shape (softmax, norms);
  ``reduced(*stats)`` gives outputs with ``axis`` reduced (sums, means, ...).

A whole row per program when it fits (``cols <= max_row_block``, one power-of-two block, lanes
masked): inputs are loaded once and every pass runs in registers; several short rows share a
program (``BR * BC ~ 2048``). Longer rows loop over column blocks: one loop per pass re-reading
the inputs (per-lane partial accumulators, reduced across lanes after the loop — f32 for 16-bit
inputs), then one loop for the epilogue. Each row is owned by one program: nothing accumulates
across the grid.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..indexmap import Layout
from .tiling import f32_math, grid_origin, next_pow2
from .vio import Plan, VTensor, broadcast_input, outputs, pack_results
from .vio import out_dtypes as out_dtypes_of

__all__ = ["Stat", "row_reduce", "reduce_sum", "reduce_max", "reduce_min", "mean", "softmax",
           "rms_norm", "layer_norm", "choose_row_blocks"]

_TARGET = 2048           # elements per block when several rows share a program
_LOOP_BLOCK = 2048       # column block of the looped (long-row) path
MAX_ROW_BLOCK = 8192     # longest row kept as one block in registers


@dataclass(frozen=True)
class Stat:
    """One row statistic: ``combine``-reduce ``prologue(*blocks, *earlier_stats)`` over the row."""
    prologue: Callable[..., Any]
    combine: str = "sum"   # "sum" | "max" | "min"

    def __post_init__(self) -> None:
        if self.combine not in ("sum", "max", "min"):
            raise ValueError(f"combine must be sum, max or min, got {self.combine!r}")


def _identity(combine: str, dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if combine == "sum":
        return np.zeros((), dtype)
    big = np.inf if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype).max
    return np.asarray(-big if combine == "max" else big, dtype)


def _combine2(combine: str, a: Any, b: Any) -> Any:
    return a + b if combine == "sum" else (jnp.maximum(a, b) if combine == "max" else jnp.minimum(a, b))


def _reduce(combine: str, v: Any) -> Any:
    f = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[combine]
    return f(v, axis=-1, keepdims=True)


def choose_row_blocks(rows: int, cols: int, max_row_block: int = MAX_ROW_BLOCK,
                      target: int = _TARGET) -> tuple[int, int, bool]:
    """(BR, BC, looped): a whole row per block when ``cols <= max_row_block``."""
    if cols <= max_row_block:
        bc = next_pow2(cols)
        return min(next_pow2(rows), max(1, target // bc)), bc, False
    return 1, min(_LOOP_BLOCK, next_pow2(max_row_block)), True


def _default_warps(elems: int) -> int:
    return int(min(16, max(4, elems // 512)))


def _strided(p: Any) -> bool:
    sb = p.map.strided_box()
    return sb is not None and all(j is None or k == 1 for j, k, _ in sb)


def _clean(before: Layout, after: Layout) -> bool:
    """The reshape keeps a strided-box layout strided (or the layout was a gather already)."""
    return all(_strided(p) for p in after.pieces) or not all(_strided(p) for p in before.pieces)


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _acc_dtype(dtype: Any, upcast: bool) -> np.dtype:
    dtype = np.dtype(dtype)
    if upcast and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(jnp.float32)
    return dtype


# --------------------------------------------------------------------------------------------
# Static planning
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Abstract:
    """What the user functions give, by abstract evaluation on small blocks."""
    cdt: tuple[np.dtype, ...]           # compute dtype per input
    stat_sds: tuple[Any, ...]           # per stat: ShapeDtypeStruct of its (rows, 1) value
    n_epi: int
    n_red: int
    epi_tuple: bool
    red_tuple: bool


def _abstract(vins: Sequence[VTensor], passes: Sequence[Sequence[Stat]], epilogue: Any, reduced: Any,
              upcast: bool) -> _Abstract:
    cdt = [np.dtype(jnp.float32) if upcast and jnp.issubdtype(v.dtype, jnp.floating) and
           np.dtype(v.dtype).itemsize < 4 else np.dtype(v.dtype) for v in vins]
    blk_sds = [jax.ShapeDtypeStruct((2, 8), d) for d in cdt]
    stat_sds: list[Any] = []
    for ps in passes:
        new = []
        for st in ps:
            r = jax.eval_shape(st.prologue, *blk_sds, *stat_sds)
            new.append(jax.ShapeDtypeStruct((2, 1), _acc_dtype(r.dtype, upcast)))
        stat_sds += new
    epi_abs = jax.eval_shape(epilogue, *blk_sds, *stat_sds) if epilogue is not None else ()
    red_abs = jax.eval_shape(reduced, *stat_sds) if reduced is not None else ()
    return _Abstract(tuple(cdt), tuple(stat_sds), len(_as_list(epi_abs)), len(_as_list(red_abs)),
                     isinstance(epi_abs, (tuple, list)), isinstance(red_abs, (tuple, list)))


def _row_views(vins: list[VTensor], vouts: list[VTensor], lifted: Sequence[bool], n_epi: int,
               axis: int, keepdims: bool) -> tuple[list[VTensor], list[VTensor], tuple[int, ...]]:
    """Re-view every operand so that the reduced axis is last: ``(lead..., C)`` and ``(lead..., 1)``,
    flattened to ``(rows, C)`` when every view stays a strided box. Returns the views and their
    common logical shape ``view`` (rank >= 2)."""
    rank = len(vins[0].shape)
    perm = tuple(d for d in range(rank) if d != axis) + (axis,)
    tshape = tuple(vins[0].shape[d] for d in perm)
    C, R = tshape[-1], math.prod(tshape[:-1])

    def red_view(v: VTensor, was_lifted: bool) -> VTensor:
        if was_lifted:                      # (1,) buffer of a rank-0 result (rank-1 input)
            return v
        return v.transpose(perm) if keepdims else v.expand_dims((rank - 1,))

    vins = [v.transpose(perm) for v in vins]
    vouts = [v.transpose(perm) if i < n_epi else red_view(v, lifted[i]) for i, v in enumerate(vouts)]
    if rank == 1:
        return [v.expand_dims((0,)) for v in vins], [v.expand_dims((0,)) for v in vouts], (1, C)
    if rank == 2:
        return vins, vouts, (R, C)
    flat_in = [v.reshape((R, C)) for v in vins]
    flat_out = [v.reshape((R, C if i < n_epi else 1)) for i, v in enumerate(vouts)]
    if all(_clean(a.layout, b.layout) for a, b in zip(vins + vouts, flat_in + flat_out)):
        return flat_in, flat_out, (R, C)
    return vins, vouts, tshape


@dataclass(frozen=True, eq=False)
class _Config:
    """Everything static about one row-reduction kernel."""
    view: tuple[int, ...]               # logical shape of every input view: (lead..., rows, C)
    br: int
    bc: int
    looped: bool
    passes: tuple[tuple[Stat, ...], ...]
    epilogue: Callable[..., Any] | None
    reduced: Callable[..., Any] | None
    abstract: _Abstract
    upcast: bool

    @property
    def cols(self) -> int:
        return self.view[-1]

    @property
    def block(self) -> tuple[int, ...]:
        return (1,) * (len(self.view) - 2) + (self.br, self.bc)

    @property
    def red_block(self) -> tuple[int, ...]:
        return (1,) * (len(self.view) - 2) + (self.br, 1)

    @property
    def n_programs(self) -> int:
        return grid_origin(self.view[:-1], self.block[:-1], 0)[1]


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------

def _row_kernel(c: _Config, ins: Sequence[Any], outs: Sequence[Any]) -> None:
    """Program ``pid``: ``BR`` rows, whole (one block in registers) or looped over column blocks."""
    blk, rblk, bc, C, n_epi = c.block, c.red_block, c.bc, c.cols, c.abstract.n_epi
    row_origin, _ = grid_origin(c.view[:-1], blk[:-1], pl.program_id(0))
    col = lax.broadcasted_iota(jnp.int32, blk, len(blk) - 1)

    def load_all(c0: Any) -> list[Any]:
        return [r.load(row_origin + (c0,), blk).astype(d) for r, d in zip(ins, c.abstract.cdt)]

    def col_mask(c0: Any) -> Any:
        if isinstance(c0, int) and c0 + bc <= C:
            return None
        return col + c0 < C

    def prep(st: Stat, blocks: list[Any], stats: list[Any], mask: Any) -> Any:
        v = st.prologue(*blocks, *stats)
        v = jnp.broadcast_to(v, blk).astype(_acc_dtype(v.dtype, c.upcast))
        return v if mask is None else jnp.where(mask, v, _identity(st.combine, v.dtype))

    stats: list[Any] = []
    if not c.looped:
        blocks = load_all(0)                                   # stage 1
        mask = col_mask(0)
        for ps in c.passes:                                    # stage 2
            stats += [_reduce(st.combine, prep(st, blocks, stats, mask)) for st in ps]
        if c.epilogue is not None:
            res = _as_list(c.epilogue(*blocks, *stats))
            for o, v in zip(outs[:n_epi], res):                # stage 3
                o.store(row_origin + (0,), blk, v)
    else:
        n_cb = -(-C // bc)
        for ps in c.passes:
            inits = tuple(jnp.full(blk, _identity(st.combine, s.dtype), s.dtype)
                          for st, s in zip(ps, c.abstract.stat_sds[len(stats):len(stats) + len(ps)]))

            def step(j: Any, accs: tuple[Any, ...], ps: Sequence[Stat] = ps, done: list[Any] = list(stats)) -> Any:
                c0 = j * bc
                blocks, mask = load_all(c0), col_mask(c0)
                return tuple(_combine2(st.combine, a, prep(st, blocks, done, mask)) for st, a in zip(ps, accs))

            accs = lax.fori_loop(0, n_cb, step, inits)
            stats += [_reduce(st.combine, a) for st, a in zip(ps, accs)]
        if c.epilogue is not None:
            def write(j: Any, carry: Any) -> Any:
                c0 = j * bc
                res = _as_list(c.epilogue(*load_all(c0), *stats))
                for o, v in zip(outs[:n_epi], res):
                    o.store(row_origin + (c0,), blk, v)
                return carry

            lax.fori_loop(0, n_cb, write, 0)
    if c.reduced is not None:
        res = _as_list(c.reduced(*stats))
        for o, v in zip(outs[n_epi:], res):
            o.store(row_origin + (0,), rblk, jnp.broadcast_to(v, rblk))


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------

def row_reduce(inputs: Sequence[Any], passes: Sequence[Stat | Sequence[Stat]],
               epilogue: Callable[..., Any] | None = None, *, reduced: Callable[..., Any] | None = None,
               axis: int = -1, keepdims: bool = False, outs: Any = None, out_dtypes: Any = None,
               upcast: bool = True, block_rows: int | None = None, block_cols: int | None = None,
               max_row_block: int = MAX_ROW_BLOCK, num_warps: int | None = None, num_stages: int = 1,
               backend: str = "interpret", name: str = "row_reduce") -> Any:
    """The one reduction engine. See the module docstring for the computation.

    inputs      VTensors or arrays; the first fixes the logical shape ``S``, the others are
                broadcast to ``S`` (numpy rules, through a broadcast layout).
    passes      sequence of passes; a pass is a :class:`Stat` or a sequence of them. Stats of a
                pass only see stats of earlier passes (a long row is re-read once per pass).
    epilogue    ``(*blocks, *stats) -> block | tuple``: outputs of logical shape ``S``.
    reduced     ``(*stats) -> value | tuple``: outputs of shape ``S`` without ``axis``
                (``keepdims``: with ``axis`` of size 1).
    outs        VTensors to write, epilogue outputs first then reduced ones (default fresh).
    out_dtypes  one dtype, or one per output; default the first input's dtype.
    upcast      compute in f32 for 16-bit float inputs (f32 accumulation); with ``False`` the
                functions run through ``f32_math`` (per-op f32 for division/transcendentals).
    block_rows, block_cols, max_row_block: blocking overrides (powers of two).

    Returns one entry per output (its physical buffer, or the tuple of its buffers when the
    output VTensor has several); a single output is returned bare.
    """
    if not inputs:
        raise ValueError("row_reduce needs at least one input")
    first = inputs[0] if isinstance(inputs[0], VTensor) else jnp.asarray(inputs[0])
    shape = tuple(first.shape)
    rank = len(shape)
    if rank == 0:
        raise ValueError("cannot reduce a rank-0 tensor")
    axis = axis % rank
    vins = [broadcast_input(x, shape) for x in inputs]
    passes = [[p] if isinstance(p, Stat) else list(p) for p in passes]
    if epilogue is None and reduced is None:
        raise ValueError("row_reduce needs an epilogue and/or a reduced output function")
    if not upcast:  # 16-bit math stays 16-bit: make it Triton-compilable op by op
        passes = [[Stat(f32_math(st.prologue), st.combine) for st in ps] for ps in passes]
        epilogue = f32_math(epilogue) if epilogue is not None else None
        reduced = f32_math(reduced) if reduced is not None else None

    # Abstract evaluation: how many outputs, which dtypes.
    ab = _abstract(vins, passes, epilogue, reduced, upcast)
    n_out = ab.n_epi + ab.n_red
    dtypes = out_dtypes_of(out_dtypes, [vins[0].dtype] * n_out)

    # Outputs (fresh physical by default). A fresh rank-0 reduced output gets a (1,) buffer.
    red_shape = tuple(n for d, n in enumerate(shape) if d != axis) if not keepdims else \
        tuple(1 if d == axis else n for d, n in enumerate(shape))
    vouts, lifted = outputs(outs, [shape] * ab.n_epi + [red_shape] * ab.n_red, dtypes)
    vins, vouts, view = _row_views(vins, vouts, lifted, ab.n_epi, axis, keepdims)

    br, bc, looped = choose_row_blocks(view[-2], view[-1], max_row_block)
    if block_cols is not None:
        bc = int(block_cols)
        looped = bc < view[-1]
    if block_rows is not None:
        br = int(block_rows)
    cfg = _Config(view, br, bc, looped, tuple(tuple(ps) for ps in passes), epilogue, reduced, ab, upcast)
    plan = Plan.build(vins, vouts)
    bufs = plan.call(functools.partial(_row_kernel, cfg), grid=(cfg.n_programs,), backend=backend,
                     num_warps=num_warps or _default_warps(br * bc), num_stages=num_stages, name=name)
    packed = pack_results(bufs, lifted)
    if n_out == 1 and not ((epilogue is not None and ab.epi_tuple) or (reduced is not None and ab.red_tuple)):
        return packed[0]
    return tuple(packed)


# --------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------

def _reduction(x: Any, combine: str, axis: int, keepdims: bool, out: Any, dtype: Any,
               finish: Callable[[Any, int], Any] | None, name: str, **kw: Any) -> Any:
    shape = x.shape if isinstance(x, VTensor) else np.shape(x)
    n = shape[axis % len(shape)] if shape else 1
    fin = (lambda s: finish(s, n)) if finish else (lambda s: s)
    return row_reduce([x], [Stat(lambda v: v, combine)], reduced=fin, axis=axis, keepdims=keepdims,
                      outs=None if out is None else [out], out_dtypes=dtype, **{"name": name, **kw})


def reduce_sum(x: Any, axis: int = -1, *, keepdims: bool = False, out: VTensor | None = None,
               dtype: Any = None, **kw: Any) -> Any:
    """``jnp.sum(x, axis)`` (f32 accumulation for 16-bit floats; result in ``dtype`` or x's)."""
    return _reduction(x, "sum", axis, keepdims, out, dtype, None, "reduce_sum", **kw)


def reduce_max(x: Any, axis: int = -1, *, keepdims: bool = False, out: VTensor | None = None,
               dtype: Any = None, **kw: Any) -> Any:
    """``jnp.max(x, axis)``."""
    return _reduction(x, "max", axis, keepdims, out, dtype, None, "reduce_max", **kw)


def reduce_min(x: Any, axis: int = -1, *, keepdims: bool = False, out: VTensor | None = None,
               dtype: Any = None, **kw: Any) -> Any:
    """``jnp.min(x, axis)``."""
    return _reduction(x, "min", axis, keepdims, out, dtype, None, "reduce_min", **kw)


def mean(x: Any, axis: int = -1, *, keepdims: bool = False, out: VTensor | None = None,
         dtype: Any = None, **kw: Any) -> Any:
    """``jnp.mean(x, axis)``: f32 sum, then divided by the row length."""
    return _reduction(x, "sum", axis, keepdims, out, dtype, lambda s, n: s / n, "mean", **kw)


def softmax(x: Any, axis: int = -1, *, out: VTensor | None = None, dtype: Any = None, **kw: Any) -> Any:
    """``jax.nn.softmax(x, axis)``: max pass, sum-of-exp pass, normalised write (f32 inside)."""
    return row_reduce(
        [x], [Stat(lambda v: v, "max"), Stat(lambda v, m: jnp.exp(v - m), "sum")],
        lambda v, m, s: jnp.exp(v - m) / s, axis=axis,
        outs=None if out is None else [out], out_dtypes=dtype, **{"name": "softmax", **kw})


def _last_axis_param(p: Any, shape: tuple[int, ...]) -> Any:
    """A per-feature parameter of shape (C,) (or broadcastable) as an input of logical ``shape``."""
    return broadcast_input(p, shape)


def rms_norm(x: Any, w: Any = None, eps: float = 1e-6, *, out: VTensor | None = None,
             dtype: Any = None, **kw: Any) -> Any:
    """``x * rsqrt(mean(x**2, -1) + eps) * w`` over the last axis, f32 inside, cast at the end."""
    shape = tuple(x.shape)
    n = shape[-1]
    ins = [x] + ([_last_axis_param(w, shape)] if w is not None else [])

    def epi(v: Any, *rest: Any) -> Any:
        *wv, ss = rest
        y = v * lax.rsqrt(ss / n + eps)
        return y * wv[0] if wv else y

    return row_reduce(ins, [Stat(lambda v, *_: v * v, "sum")], epi, axis=-1,
                      outs=None if out is None else [out], out_dtypes=dtype, **{"name": "rms_norm", **kw})


def layer_norm(x: Any, w: Any = None, b: Any = None, eps: float = 1e-5, *, out: VTensor | None = None,
               dtype: Any = None, **kw: Any) -> Any:
    """``(x - mean) * rsqrt(var + eps) * w + b`` over the last axis; two-pass (mean, then
    centred sum of squares) for accuracy, f32 inside, cast at the end."""
    shape = tuple(x.shape)
    n = shape[-1]
    ins = [x] + [_last_axis_param(p, shape) for p in (w, b) if p is not None]
    has_w, has_b = w is not None, b is not None

    def centred_sq(v: Any, *rest: Any) -> Any:
        d = v - rest[-1] / n
        return d * d

    def epi(v: Any, *rest: Any) -> Any:
        params, (s, ss) = rest[:-2], rest[-2:]
        y = (v - s / n) * lax.rsqrt(ss / n + eps)
        if has_w:
            y = y * params[0]
        if has_b:
            y = y + params[int(has_w)]
        return y

    return row_reduce(ins, [Stat(lambda v, *_: v, "sum"), Stat(centred_sq, "sum")], epi, axis=-1,
                      outs=None if out is None else [out], out_dtypes=dtype, **{"name": "layer_norm", **kw})
