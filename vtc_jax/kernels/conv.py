"""Convolution template: ``lax.conv_general_dilated`` as an implicit GEMM over virtual tensors (§4.2).

No im2col matrix, no layout transpose and no padded copy is ever materialised: all three are index
maps that :mod:`vio` evaluates inside the kernel's loads. The template only asks for blocks of three
*logical* tensors, built with :class:`~vtc_jax.indexmap.Layout` movement methods from whatever
layouts ``x``, ``w`` and ``out`` already have (a channel slice of a bigger buffer, a channel shuffle
``reshape -> transpose -> reshape``, a concat buffer — all the same to the kernel)::

    X (N, H.., C)        = x.layout.transpose(lhs_spec -> N, spatial, C)           # NCHW or NHWC
                             .pad(lo, hi, interior=lhs_dilation - 1, fill=0)         # padding
    P (N, O.., K.., C)   = X.compose(n, o*stride + k*rhs_dilation, c)               # the windows
    A (M, K.., G, Cg)    = P.reshape(...)      M = N*prod(O): the im2col matrix, rows flattened
    B (K.., Cg, G, OCg)  = w.layout.transpose(rhs_spec -> spatial, I, O).reshape(...)  # OIHW/HWIO
    Y (M, G, OCg)        = out.layout.transpose(out_spec -> N, O.., OC).reshape(...)

Padding is the pad's mask (lanes outside the input read 0), so the shifted windows need no
negative origins. Each program computes one ``(bm, bn)`` tile of ``Y[:, g, :]``::

    grid = (cdiv(M, bm), cdiv(OCg, bn), G)
    acc = 0
    for kk in range(tiles(K.., Cg)):                  # fori_loop: taps x input-channel blocks
        a = A.load((m0, taps(kk), g, c0(kk)), (bm, kb.., 1, bc))   -> (bm, bk)
        b = B.load((taps(kk), c0(kk), g, n0), (kb.., bc, 1, bn))   -> (bk, bn)
        acc += dot(a, b)                               # 2-D tt.dot, f32 accumulation
    Y.store((m0, g, n0), (bm, 1, bn), epilogue(acc, *extras))

The K group ``(K.., Cg)`` is tiled like a matmul's contracting group (``bk`` split from the
innermost dim): with many input channels a block is ``(1, 1, bk)`` — one tap, ``bk`` channels —
while a 3-channel stem conv packs several taps into one 16-deep block instead of padding 3 to 16.

Depthwise and any grouping with one input channel per group (``C == G``, channel multiplier
``OC / C``) would be a dot with K = 1 per group; it gets its own elementwise path instead::

    A (M, K.., OC)  = P (channel c -> oc // multiplier, a broadcast layout)   B (K.., OC)
    grid = (cdiv(M, bm), cdiv(OC, bn))
    acc (bm, bn) += A.load(tap) * B.load(tap)[None, :]    # fori_loop over taps, f32

The epilogue ``epilogue(acc, *extra)`` sees (bm, bn) tiles of the output's ``(N*OH*OW, OC)`` view
(columns are output channels ``g*OCg + n`` of group ``g``), as in :mod:`matmul`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..indexmap import IndexMap, Layout, dim
from .tiling import (Group, cdiv, check_pow2, choose_blocks, dot_precision, fori, fori_prefetch, interpreter_dtype,
                     next_pow2,
                     pipeline_stages, program_id, split_block)
from .vio import Plan, VTensor, epilogue_input, output, pack_results

__all__ = ["conv", "conv_views"]

# Depthwise tiles hold an f32 accumulator plus the loaded window in registers (no tt.dot to spread
# them): 256 elements per warp (8 accumulators per thread) keeps 4 warps at 32-56 registers
# (ptxas, sm_90; jax 0.12's Triton spilled 4 B at 512 per warp when the window is read through a
# channel shuffle's map), and more of the smaller CTAs fit on an SM to keep loads in flight.
_DW_TILE_PER_WARP = 256


# --------------------------------------------------------------------------------------------
# Static planning
# --------------------------------------------------------------------------------------------

def _normalise_padding(padding: Any, in_spatial: Sequence[int], k_spatial: Sequence[int],
                       strides: Sequence[int], lhs_dilation: Sequence[int],
                       rhs_dilation: Sequence[int]) -> tuple[tuple[int, int], ...]:
    if isinstance(padding, str):
        if any(d != 1 for d in lhs_dilation):
            raise ValueError("string padding is not defined for lhs_dilation != 1 (as in lax)")
        eff = [(k - 1) * r + 1 for k, r in zip(k_spatial, rhs_dilation)]
        padding = lax.padtype_to_pads(in_spatial, eff, strides, padding)
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    if len(pads) != len(in_spatial):
        raise ValueError(f"padding {padding} has {len(pads)} pairs for {len(in_spatial)} spatial dims")
    return pads


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """Everything static about one convolution, in canonical (N, spatial.., C) terms."""
    n: int
    in_spatial: tuple[int, ...]
    out_spatial: tuple[int, ...]
    k_spatial: tuple[int, ...]
    c: int
    oc: int
    groups: int
    strides: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    dn: lax.ConvDimensionNumbers
    out_shape: tuple[int, ...]          # logical, in out_spec order

    @property
    def m(self) -> int:
        return self.n * math.prod(self.out_spatial)

    @property
    def cg(self) -> int:
        return self.c // self.groups

    @property
    def ocg(self) -> int:
        return self.oc // self.groups

    @property
    def depthwise(self) -> bool:
        """One input channel per group: the elementwise path (no K = 1 dots)."""
        return self.cg == 1


def _geometry(x_shape: Sequence[int], w_shape: Sequence[int], dtype: Any, *, window_strides: Any,
              padding: Any, lhs_dilation: Any, rhs_dilation: Any, dimension_numbers: Any,
              feature_group_count: int) -> ConvGeometry:
    nsp = len(x_shape) - 2
    if nsp < 0 or len(w_shape) != len(x_shape):
        raise ValueError(f"conv needs operands of equal rank >= 2, got {tuple(x_shape)} and {tuple(w_shape)}")
    dn = lax.conv_dimension_numbers(tuple(x_shape), tuple(w_shape), dimension_numbers)
    strides = tuple(int(s) for s in window_strides)
    ld = tuple(int(d) for d in (lhs_dilation or (1,) * nsp))
    rd = tuple(int(d) for d in (rhs_dilation or (1,) * nsp))
    in_sp = tuple(int(x_shape[d]) for d in dn.lhs_spec[2:])
    k_sp = tuple(int(w_shape[d]) for d in dn.rhs_spec[2:])
    pads = _normalise_padding(padding, in_sp, k_sp, strides, ld, rd)
    # lax's own shape rule (and its checks: group divisibility, feature counts, window sizes).
    sds = jax.ShapeDtypeStruct
    res = jax.eval_shape(functools.partial(
        lax.conv_general_dilated, window_strides=strides, padding=pads, lhs_dilation=ld,
        rhs_dilation=rd, dimension_numbers=dn, feature_group_count=int(feature_group_count)),
        sds(tuple(x_shape), dtype), sds(tuple(w_shape), dtype))
    out_shape = tuple(int(s) for s in res.shape)
    return ConvGeometry(
        n=int(x_shape[dn.lhs_spec[0]]), in_spatial=in_sp,
        out_spatial=tuple(out_shape[d] for d in dn.out_spec[2:]), k_spatial=k_sp,
        c=int(x_shape[dn.lhs_spec[1]]), oc=int(w_shape[dn.rhs_spec[0]]),
        groups=int(feature_group_count), strides=strides, pads=pads, lhs_dilation=ld,
        rhs_dilation=rd, dn=dn, out_shape=out_shape)


def _y_view(layout: Layout, g: ConvGeometry) -> Layout:
    """An output-shaped layout (out_spec order) as the kernel's Y: (M, G, OCg), depthwise (M, OC)."""
    o = g.dn.out_spec
    yc = layout.transpose((o[0], *o[2:], o[1]))                        # (N, O.., OC)
    return yc.reshape((g.m, g.oc)) if g.depthwise else yc.reshape((g.m, g.groups, g.ocg))


def conv_views(x: Layout, w: Layout, out: Layout, g: ConvGeometry) -> tuple[Layout, Layout, Layout]:
    """The three logical tensors the kernel reads/writes, as layouts over the callers' buffers.

    Dot path: A (M, K.., G, Cg), B (K.., Cg, G, OCg), Y (M, G, OCg).
    Depthwise path (Cg == 1): A (M, K.., OC), B (K.., OC), Y (M, OC).
    """
    nsp = len(g.k_spatial)
    lhs, rhs = g.dn.lhs_spec, g.dn.rhs_spec
    xc = x.transpose((lhs[0], *lhs[2:], lhs[1]))                       # (N, H.., C)
    lo = tuple(p[0] for p in g.pads)
    hi = tuple(p[1] for p in g.pads)
    interior = tuple(d - 1 for d in g.lhs_dilation)
    if any(lo) or any(hi) or any(interior):
        xc = xc.pad((0, *lo, 0), (0, *hi, 0), (0, *interior, 0), 0.0)
    # windows: P[n, o.., k.., c] = X[n, o*stride + k*rhs_dilation, c]
    exprs = [dim(0)]
    for i in range(nsp):
        exprs.append(dim(1 + i) * g.strides[i] + dim(1 + nsp + i) * g.rhs_dilation[i])
    exprs.append(dim(1 + 2 * nsp))
    win = IndexMap((g.n, *g.out_spatial, *g.k_spatial, g.c), tuple(exprs), xc.shape)
    p = xc.compose(win)
    wc = w.transpose((*rhs[2:], rhs[1], rhs[0]))                       # (K.., I, O)
    if g.depthwise:
        mult = g.ocg
        if mult > 1:  # output channel oc reads input channel oc // mult: a broadcast, no copy
            rank = len(p.shape)
            p = p.expand_dims((rank,)).broadcast((*p.shape, mult), tuple(range(rank + 1)))
        a = p.reshape((g.m, *g.k_spatial, g.oc))
        b = wc.reshape((*g.k_spatial, g.oc))
    else:
        a = p.reshape((g.m, *g.k_spatial, g.groups, g.cg))
        b = wc.reshape((*g.k_spatial, g.cg, g.groups, g.ocg))
    return a, b, _y_view(out, g)


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    """Everything static about one convolution kernel (dot path or depthwise path)."""
    bm: int
    bn: int
    tiles_m: int
    tiles_n: int
    k: Group                 # dot: the K group (K.., Cg) and its blocks; depthwise: the taps, block 1
    groups: int              # G (grid axis 2 of the dot path; 1 for depthwise)
    depthwise: bool
    compute_dtype: np.dtype
    acc_dtype: np.dtype
    precision: Any
    store_dtype: np.dtype
    epilogue: Callable[..., jax.Array] | None

    @property
    def grid(self) -> tuple[int, ...]:
        return (self.tiles_m, self.tiles_n) if self.depthwise else (self.tiles_m, self.tiles_n, self.groups)


def _plan(g: ConvGeometry, compute_dtype: np.dtype, store_dtype: np.dtype, precision: Any,
          epilogue: Callable[..., jax.Array] | None, block_m: int, block_n: int, block_k: int,
          num_warps: int) -> _Config:
    """Blocks and grid: (bm, bn) output tiles; the dot path splits ``bk`` over (K.., Cg)."""
    precision, acc_dtype = dot_precision(precision, compute_dtype)
    if g.depthwise:
        bm = min(block_m, max(16, next_pow2(g.m)))
        bn = min(block_n, max(16, next_pow2(g.oc)))
        while bm * bn > _DW_TILE_PER_WARP * num_warps and max(bm, bn) > 16:  # registers: no dot
            if bm >= bn:
                bm //= 2
            else:
                bn //= 2
        k = Group(g.k_spatial, (1,) * len(g.k_spatial))
        return _Config(bm, bn, cdiv(g.m, bm), cdiv(g.oc, bn), k, 1, True, compute_dtype, acc_dtype,
                       precision, store_dtype, epilogue)
    k_sizes = (*g.k_spatial, g.cg)
    bm, bn, bk = choose_blocks(g.m, g.ocg, math.prod(k_sizes), block_m=block_m,
                               block_n=block_n, block_k=block_k)
    k = Group(k_sizes, split_block(k_sizes, bk))
    return _Config(bm, bn, cdiv(g.m, bm), cdiv(g.ocg, bn), k, g.groups, False, compute_dtype, acc_dtype,
                   precision, store_dtype, epilogue)


# --------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------

def _conv_kernel(c: _Config, ins: list[Any], outs: list[Any]) -> None:
    """Program (m, n, g): the (bm, bn) tile of Y[:, g, :], the K group (K.., Cg) looped inside."""
    a_ref, b_ref, e_refs = ins[0], ins[1], ins[2:]
    (y_ref,) = outs
    bm, bn, kb, bk = c.bm, c.bn, c.k.blocks, c.k.block
    m0 = program_id(0, c.tiles_m) * bm
    n0 = program_id(1, c.tiles_n) * bn
    gi = program_id(2, c.groups)

    def step(kk: Any, acc: jax.Array) -> jax.Array:
        *k, c0 = c.k.origins(kk)
        xa = a_ref.load((m0, *k, gi, c0), (bm, *kb[:-1], 1, kb[-1]), fill=0.0)
        wb = b_ref.load((*k, c0, gi, n0), (*kb, 1, bn), fill=0.0)
        xa = xa.reshape(bm, bk).astype(c.compute_dtype)
        wb = wb.reshape(bk, bn).astype(c.compute_dtype)
        return acc + jnp.dot(xa, wb, preferred_element_type=c.acc_dtype, precision=c.precision)

    # Triton stages both operands with cp.async (num_stages) where their lanes run >= 4 aligned
    # bytes; a 16-bit NCHW input read through a window or a stride does not, and stays one tile in
    # flight: register prefetch (tiling.fori_prefetch) was tried there and is not used — ptxas gave
    # 50% more registers and the weight tile's shared-memory layout change still waited in-iteration.
    acc = fori(c.k.ntiles, step, jnp.zeros((bm, bn), c.acc_dtype))
    if c.epilogue is not None:
        extra = [e.load((m0, gi, n0), (bm, 1, bn), fill=0.0).reshape(bm, bn) for e in e_refs]
        acc = c.epilogue(acc, *extra)
    y_ref.store((m0, gi, n0), (bm, 1, bn), acc.astype(c.store_dtype).reshape(bm, 1, bn))


def _depthwise_kernel(c: _Config, ins: list[Any], outs: list[Any]) -> None:
    """Program (m, n): the (bm, bn) tile of Y, f32 multiply-adds over the taps (no dot)."""
    a_ref, b_ref, e_refs = ins[0], ins[1], ins[2:]
    (y_ref,) = outs
    bm, bn, ones = c.bm, c.bn, c.k.blocks
    m0 = program_id(0, c.tiles_m) * bm
    c0 = program_id(1, c.tiles_n) * bn

    def load(t: Any) -> tuple[jax.Array, jax.Array]:
        k = c.k.origins(t)
        xa = a_ref.load((m0, *k, c0), (bm, *ones, bn), fill=0.0).reshape(bm, bn)
        wb = b_ref.load((*k, c0), (*ones, bn), fill=0.0).reshape(1, bn)
        return xa, wb

    def step(t: Any, tiles: tuple[jax.Array, jax.Array], acc: jax.Array) -> jax.Array:
        xa, wb = tiles
        return acc + xa.astype(c.acc_dtype) * wb.astype(c.acc_dtype)

    # no tt.dot: Triton's pipeliner leaves these loads alone, so the next tap is prefetched in registers
    acc = fori_prefetch(c.k.ntiles, load, step, jnp.zeros((bm, bn), c.acc_dtype))
    if c.epilogue is not None:
        extra = [e.load((m0, c0), (bm, bn), fill=0.0) for e in e_refs]
        acc = c.epilogue(acc, *extra)
    y_ref.store((m0, c0), (bm, bn), acc.astype(c.store_dtype))


# --------------------------------------------------------------------------------------------
# The template
# --------------------------------------------------------------------------------------------

def conv(x: Any, w: Any, *, window_strides: Sequence[int], padding: Any,
         lhs_dilation: Sequence[int] | None = None, rhs_dilation: Sequence[int] | None = None,
         dimension_numbers: Any, feature_group_count: int = 1, batch_group_count: int = 1,
         out: VTensor | None = None, epilogue: Callable[..., jax.Array] | None = None,
         epilogue_args: Sequence[Any] = (), preferred_element_type: Any = None,
         precision: Any = None, block_m: int = 64, block_n: int = 64, block_k: int = 32,
         num_warps: int = 4, num_stages: int | None = None, backend: str = "interpret") -> Any:
    """``lax.conv_general_dilated`` (+ ``epilogue``) as one Pallas Triton kernel with virtual I/O.

    x, w: :class:`vio.VTensor` or arrays, in any layout their index maps describe; which dim is
        batch / feature / spatial is ``dimension_numbers`` (a ``lax.ConvDimensionNumbers``, a
        ``("NCHW", "OIHW", "NCHW")``-style tuple, or None for lax's default). Any number of spatial
        dims. Floating dtypes; mixed dtypes are promoted in registers.
    window_strides, padding (``((lo, hi), ...)`` or "SAME"/"SAME_LOWER"/"VALID"), lhs_dilation,
        rhs_dilation, feature_group_count: as in lax. Dilations are index maps (lhs dilation is the
        pad's interior), so every value is supported. ``batch_group_count`` must be 1.
    out: VTensor of the result's logical shape (``out_spec`` order) saying where it goes — e.g. a
        channel slab of a concat buffer, written in place when its buffer is an array. Default: a
        fresh physical array in ``out_spec`` layout.
    epilogue: ``epilogue(acc, *extra) -> block`` in registers before the store, elementwise over
        (bm, bn) tiles of the output's ``(N*prod(O), OC)`` view: ``acc`` is the f32 accumulator,
        ``extra`` the matching tiles of ``epilogue_args`` (VTensors of the output's logical shape,
        or arrays broadcast to it by numpy rules: a channel bias is ``(OC,)`` for NHWC outputs and
        ``(OC, 1, 1)`` for NCHW ones).
    preferred_element_type: result dtype when ``out`` is None (default: the promoted input dtype).
    precision: the replaced convolution's ``precision`` param, with lax's meaning (None:
        ``jax_default_matmul_precision``, else ``DEFAULT``); the in-kernel dot follows it as XLA
        does on the GPU (:func:`tiling.dot_precision`): f32 at ``DEFAULT``/``HIGH`` on TF32 tensor
        cores, at ``HIGHEST`` IEEE f32. The depthwise path has no dot: f32 FMAs at any level (as
        exact as ``HIGHEST``). Interpret mode computes exact f32 at every level.
    block_m/n/k: caps (powers of two >= 16) on the output-rows, output-channels and K blocks; the
        effective block is ``max(16, next_pow2(size))`` capped here (depthwise: no K block).
    backend: "interpret" (CPU) or "triton".

    Returns what ``Plan.unflatten`` gives for ``out``: the array for a single-buffer output
    (fresh or updated in place), else the tuple of ``out``'s physical buffers.
    """
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check_pow2(name, v)
    if int(batch_group_count) != 1:
        raise NotImplementedError("conv template: batch_group_count != 1")
    x, w = VTensor.of(x), VTensor.of(w)
    for v in (x, w):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise NotImplementedError(f"conv template supports floating dtypes, got {v.dtype}")
    compute_dtype = np.dtype(jnp.promote_types(x.dtype, w.dtype))
    g = _geometry(x.shape, w.shape, compute_dtype, window_strides=window_strides, padding=padding,
                  lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                  dimension_numbers=dimension_numbers, feature_group_count=feature_group_count)
    out = output(out, g.out_shape, preferred_element_type or compute_dtype, "the convolution gives")
    extras = [epilogue_input(e, g.out_shape) for e in epilogue_args]

    a_l, b_l, y_l = conv_views(x.layout, w.layout, out.layout, g)
    a, b, y = x.with_layout(a_l), w.with_layout(b_l), out.with_layout(y_l)
    extras = [e.with_layout(_y_view(e.layout, g)) for e in extras]

    cfg = _plan(g, compute_dtype, out.dtype, precision, epilogue, block_m, block_n, block_k, num_warps)
    cfg = dataclasses.replace(cfg, compute_dtype=interpreter_dtype(cfg.compute_dtype, backend))
    kernel, name = (_depthwise_kernel, "vtc_conv_depthwise") if g.depthwise else (_conv_kernel, "vtc_conv")
    if num_stages is None:  # depthwise: no tt.dot, whose operands are all Triton's pipeliner stages
        num_stages = 1 if g.depthwise else pipeline_stages(precision, compute_dtype)
    plan = Plan.build([a, b, *extras], [y])
    bufs = plan.call(functools.partial(kernel, cfg), grid=cfg.grid, backend=backend,
                     num_warps=num_warps, num_stages=num_stages, name=name)
    return pack_results(bufs)[0]
