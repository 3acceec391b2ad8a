"""Matmul / ``dot_general`` template with an elementwise epilogue (paper §2.4 Listing 1, §4.2).

One template for every operand and output layout: the kernel asks :mod:`vio` for blocks of the
*logical* operands, in each operand's own dim order, and never looks at layouts. A transposed
operand is a VTensor whose layout is a transpose; a concat of buffers along K, a column slice of a
wider buffer, a broadcast bias, an output written as Q plus K/V-cache slabs at a runtime ``pos``:
all of it is vio's business.

The three stages of Listing 1::

    acc = 0
    for k in range(cdiv(K, bk)):               # lax.fori_loop inside the kernel (never the grid)
        a = A.load(a_origin(k), a_block)       # stage 1: vio, masked, 0 outside K/M
        b = B.load(b_origin(k), b_block)
        acc += dot(to2d(a), to2d(b))           # stage 2: untouched 2-D tt.dot, f32 accumulation
    out = epilogue(acc, *[E.load(...)])        # in registers (bias, activation, scale, convert)
    OUT.store(o_origin, o_block, out)          # stage 3: vio, masked

Dimension numbers are normalised into four groups of logical dims: batch (B), lhs free (M), rhs free
(N) and contracting (K). Each group is tiled as a whole: its block (``bm``, ``bn`` or ``bk``, a power
of two) is split over the group's dims greedily from the innermost dim out, e.g. lhs free dims
``(batch=2, seq=3)`` with ``bm=16`` get blocks ``(4, 4)``. A group's tile index (a program id, or
the K-loop counter) is decomposed into per-dim origins with ``//`` and ``%`` on scalars. A loaded
block has the operand's own dim order; size-1 block dims are dropped, the rest transposed into
(M, K) / (K, N) group order and reshaped to 2-D in registers (``tt.trans``/``tt.reshape`` lower).
Batch dims have block 1 and live on grid axis 0: ``grid = (B, tiles(M), tiles(N))``.

A dot with no lhs (rhs) free dims (matrix-vector) or no contracting dims (outer product) gets a
size-1 dim added through the layout (``expand_dims``, no data movement), so that every in-kernel
dot is at least 16x16x16 (``tt.dot``'s minimum) with masked lanes.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..indexmap import Layout
from .vio import VTensor, next_pow2, Plan

__all__ = ["matmul", "MIN_DOT_BLOCK", "choose_blocks"]

MIN_DOT_BLOCK = 16  # tt.dot needs M, N, K >= 16 (and K >= 16 for 16-bit types in the front end)


# --------------------------------------------------------------------------------------------
# Static planning
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Group:
    """A group of logical dims tiled together (B, M, N or K): sizes, blocks, tiles per dim."""
    sizes: tuple[int, ...]
    blocks: tuple[int, ...]

    @property
    def tiles(self) -> tuple[int, ...]:
        return tuple(-(-s // b) for s, b in zip(self.sizes, self.blocks))

    @property
    def ntiles(self) -> int:
        return math.prod(self.tiles)

    @property
    def block(self) -> int:
        return math.prod(self.blocks)

    def origins(self, t: Any) -> tuple[Any, ...]:
        """Per-dim origins of tile ``t`` (traced int32 or Python int), innermost dim fastest."""
        out: list[Any] = [0] * len(self.sizes)
        stride = 1
        for i in reversed(range(len(self.sizes))):
            n, b = self.tiles[i], self.blocks[i]
            if n > 1:
                # lax.div/rem on int32 (operands are non-negative): jnp's floor-mod expands into
                # selects whose constants the Triton lowering mistypes (i1 vs i32).
                q = t if stride == 1 else _div(t, stride)
                if stride * n < self.ntiles:
                    q = _rem(q, n)
                out[i] = q * b
            stride *= n
        return tuple(out)


def _div(x: Any, c: int) -> Any:
    return x // c if isinstance(x, int) else lax.div(x, jnp.int32(c))


def _rem(x: Any, c: int) -> Any:
    return x % c if isinstance(x, int) else lax.rem(x, jnp.int32(c))


def _split_block(sizes: Sequence[int], cap: int, minimum: int = MIN_DOT_BLOCK) -> tuple[int, ...]:
    """Blocks (powers of two) for a group: the total is ``min(cap, max(minimum, padded size))``,
    handed out from the innermost dim; any surplus (group smaller than ``minimum``) is masked lanes
    on the innermost dim."""
    if not sizes:
        return ()
    total = min(int(cap), max(minimum, math.prod(next_pow2(s) for s in sizes)))
    blocks = [1] * len(sizes)
    rem = total
    for i in reversed(range(len(sizes))):
        b = min(next_pow2(sizes[i]), rem)
        blocks[i] = b
        rem //= b
    # Surplus lanes go on the innermost dim that has more than one element: a block wider than
    # 1 on a size-1 dim is a dim with no physical home, which stores cannot serve strided.
    big = [i for i, s in enumerate(sizes) if s > 1]
    blocks[big[-1] if big else -1] *= rem
    return tuple(blocks)


def choose_blocks(m: int, n: int, k: int, *, block_m: int = 64, block_n: int = 64,
                  block_k: int = 32) -> tuple[int, int, int]:
    """The effective (bm, bn, bk) for logical sizes M, N, K: ``max(16, next_pow2(size))`` capped
    at the requested block (the M = 1..16 decode case gets bm = 16)."""
    return tuple(min(cap, max(MIN_DOT_BLOCK, next_pow2(s)))  # type: ignore[return-value]
                 for s, cap in ((m, block_m), (n, block_n), (k, block_k)))


def _check_pow2(name: str, v: int) -> None:
    if v < MIN_DOT_BLOCK or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two >= {MIN_DOT_BLOCK}")


def _with_layout(v: VTensor, layout: Layout) -> VTensor:
    return dataclasses.replace(v, layout=layout)


def _expand(v: VTensor, axis: int) -> VTensor:
    return _with_layout(v, v.layout.expand_dims((axis,)))


def _broadcast_arg(x: Any, shape: tuple[int, ...]) -> VTensor:
    """An epilogue argument: a VTensor of the output's logical shape, or an array broadcast to it
    (numpy rules) through a broadcast layout — the bias vector is never materialised at (M, N)."""
    if isinstance(x, VTensor):
        if tuple(x.shape) != shape:
            raise ValueError(f"epilogue VTensor has shape {x.shape}, the output is {shape}: "
                             "give it a broadcast layout")
        return x
    x = jnp.asarray(x)
    if tuple(x.shape) == shape:
        return VTensor.physical(x)
    np.broadcast_shapes(x.shape, shape)  # raises if not broadcastable
    if x.ndim > len(shape):
        raise ValueError(f"epilogue array of shape {x.shape} does not broadcast to {shape}")
    dims = tuple(range(len(shape) - x.ndim, len(shape)))
    return VTensor(Layout.physical(0, x.shape).broadcast(shape, dims), x.dtype, (x,))


@dataclass(frozen=True)
class _Operand:
    """How one operand's own dims map onto the groups: role per dim and its position in the group."""
    roles: tuple[tuple[str, int], ...]   # per operand dim: ("B"|"M"|"N"|"K", index in group)

    def origin_block(self, groups: dict[str, _Group], origins: dict[str, tuple[Any, ...]]
                     ) -> tuple[tuple[Any, ...], tuple[int, ...]]:
        return (tuple(origins[g][i] for g, i in self.roles),
                tuple(groups[g].blocks[i] for g, i in self.roles))

    def to_2d(self, x: jax.Array, rows: str, cols: str, groups: dict[str, _Group]) -> jax.Array:
        """Block in operand dim order -> (rows-group block, cols-group block) in registers."""
        block = x.shape
        keep = [d for d, b in enumerate(block) if b > 1]
        if len(keep) != len(block):
            x = x.reshape([block[d] for d in keep])
        order = sorted(keep, key=lambda d: ((0 if self.roles[d][0] == rows else 1), self.roles[d][1]))
        perm = [keep.index(d) for d in order]
        if perm != list(range(len(perm))):
            x = jnp.transpose(x, perm)
        return x.reshape(groups[rows].block, groups[cols].block)


# --------------------------------------------------------------------------------------------
# The template
# --------------------------------------------------------------------------------------------

def matmul(a: Any, b: Any, *, dimension_numbers: Any, out: VTensor | None = None,
           epilogue: Callable[..., jax.Array] | None = None, epilogue_args: Sequence[Any] = (),
           preferred_element_type: Any = None, precision: Any = None,
           block_m: int = 64, block_n: int = 64, block_k: int = 32,
           num_warps: int = 4, num_stages: int = 2, backend: str = "interpret") -> Any:
    """``lax.dot_general(a, b, dimension_numbers)`` (+ ``epilogue``) as one Pallas Triton kernel.

    a, b: :class:`vio.VTensor` or arrays (any layout: transposes, slices, concats, broadcasts are
        read through the layout's index map). Floating dtypes (f32, bf16, f16); mixed dtypes are
        promoted in registers.
    dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`` as in lax.
    out: VTensor of the result's logical shape (batch, lhs free, rhs free) saying where the result
        goes — possibly several buffers (Q, K-cache at ``pos``, V-cache at ``pos``), written in place
        when they are arrays. Default: a fresh physical array.
    epilogue: ``epilogue(acc, *extra) -> block`` applied in registers before the store; ``acc`` is
        the (bm, bn) accumulator tile (f32 for floating inputs), ``extra`` the matching (bm, bn)
        tiles of ``epilogue_args`` (VTensors of the output's logical shape, or arrays broadcast to
        it by numpy rules), in their own dtypes. Must be elementwise over the tile: its rows/cols
        are the flattened M/N groups, and lanes outside the logical shape (acc 0, extras 0) are
        computed but never stored.
    preferred_element_type: result dtype when ``out`` is None (default: the promoted input dtype,
        as ``lax.dot_general``); accumulation is f32 regardless for 16/32-bit floats.
    precision: in-kernel dot precision. None means ``HIGHEST`` for f32 operands (IEEE f32 FMA on
        the GPU, as exact as interpret mode; only the summation order differs); pass the original dot_general's
        precision (``DEFAULT``: TF32 tensor cores on Ampere+) to match XLA's own GPU numerics.
    block_m/n/k: caps on the block of each group (powers of two >= 16); the effective block is
        ``max(16, next_pow2(group size))`` capped here (see :func:`choose_blocks`).
    backend: "interpret" (CPU) or "triton".

    Returns what ``Plan.unflatten`` gives for ``out``: the array for a fresh physical output,
    else the tuple of ``out``'s physical buffers (updated).
    """
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check_pow2(name, v)
    a, b = VTensor.of(a), VTensor.of(b)
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"bad dimension_numbers {dimension_numbers}")
    for d_l, d_r in list(zip(lc, rc)) + list(zip(lb, rb)):
        if a.shape[d_l] != b.shape[d_r]:
            raise ValueError(f"dimension mismatch: lhs dim {d_l} ({a.shape[d_l]}) vs rhs dim {d_r} "
                             f"({b.shape[d_r]})")
    for v in (a, b):
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise NotImplementedError(f"matmul template supports floating dtypes, got {v.dtype}")

    lf = tuple(d for d in range(len(a.shape)) if d not in lc and d not in lb)
    rf = tuple(d for d in range(len(b.shape)) if d not in rc and d not in rb)
    out_shape = (tuple(a.shape[d] for d in lb) + tuple(a.shape[d] for d in lf)
                 + tuple(b.shape[d] for d in rf))
    compute_dtype = jnp.promote_types(a.dtype, b.dtype)
    if out is None:
        out_dtype = np.dtype(preferred_element_type or compute_dtype)
        out = VTensor.fresh(out_shape, out_dtype)
    elif tuple(out.shape) != out_shape:
        raise ValueError(f"out has logical shape {out.shape}, dot_general gives {out_shape}")
    extras = [_broadcast_arg(x, out_shape) for x in epilogue_args]

    # Degenerate groups get a size-1 dim through the layout (no data movement): every dot is 2-D.
    nb = len(lb)
    if not lf:  # no lhs free dim: new lhs dim at the end, output dim after the batch dims
        a = _expand(a, len(a.shape))
        lf = (len(a.shape) - 1,)
        out = _expand(out, nb)
        extras = [_expand(e, nb) for e in extras]
    if not rf:
        b = _expand(b, len(b.shape))
        rf = (len(b.shape) - 1,)
        out = _expand(out, len(out.shape))
        extras = [_expand(e, len(e.shape)) for e in extras]
    if not lc:
        a = _expand(a, len(a.shape))
        b = _expand(b, len(b.shape))
        lc, rc = (len(a.shape) - 1,), (len(b.shape) - 1,)

    # Contracting pairs in lhs dim order: the innermost lhs contracting dim gets the K block.
    pairs = sorted(zip(lc, rc))
    lc, rc = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    m_sizes = tuple(a.shape[d] for d in lf)
    n_sizes = tuple(b.shape[d] for d in rf)
    k_sizes = tuple(a.shape[d] for d in lc)
    bm, bn, bk = choose_blocks(math.prod(m_sizes), math.prod(n_sizes), math.prod(k_sizes),
                               block_m=block_m, block_n=block_n, block_k=block_k)
    groups = {
        "B": _Group(tuple(a.shape[d] for d in lb), (1,) * nb),
        "M": _Group(m_sizes, _split_block(m_sizes, bm)),
        "N": _Group(n_sizes, _split_block(n_sizes, bn)),
        "K": _Group(k_sizes, _split_block(k_sizes, bk)),
    }

    def roles(ndim: int, spec: dict[str, Sequence[int]]) -> _Operand:
        r: list[tuple[str, int] | None] = [None] * ndim
        for g, dims in spec.items():
            for i, d in enumerate(dims):
                r[d] = (g, i)
        assert all(x is not None for x in r)
        return _Operand(tuple(r))  # type: ignore[arg-type]

    op_a = roles(len(a.shape), {"B": lb, "M": lf, "K": lc})
    op_b = roles(len(b.shape), {"B": rb, "N": rf, "K": rc})
    nbo, nmo = nb, len(lf)
    op_o = roles(len(out.shape), {"B": range(nbo), "M": range(nbo, nbo + nmo),
                                  "N": range(nbo + nmo, len(out.shape))})

    if precision is None and compute_dtype == np.float32:
        precision = lax.Precision.HIGHEST
    acc_dtype = jnp.float32 if np.dtype(compute_dtype).itemsize <= 4 else compute_dtype
    store_dtype = out.dtype
    n_k = groups["K"].ntiles
    bm_, bn_ = groups["M"].block, groups["N"].block

    def body(ins: list[Any], outs: list[Any]) -> None:
        a_ref, b_ref, e_refs = ins[0], ins[1], ins[2:]
        (o_ref,) = outs
        pb, pm, pn = (pl.program_id(i) for i in range(3))
        origins = {"B": groups["B"].origins(pb), "M": groups["M"].origins(pm),
                   "N": groups["N"].origins(pn)}

        def step(kk: Any, acc: jax.Array) -> jax.Array:
            org = dict(origins, K=groups["K"].origins(kk))
            a_org, a_blk = op_a.origin_block(groups, org)
            b_org, b_blk = op_b.origin_block(groups, org)
            x = op_a.to_2d(a_ref.load(a_org, a_blk, fill=0.0), "M", "K", groups)
            y = op_b.to_2d(b_ref.load(b_org, b_blk, fill=0.0), "K", "N", groups)
            x, y = x.astype(compute_dtype), y.astype(compute_dtype)
            return acc + jnp.dot(x, y, preferred_element_type=acc_dtype, precision=precision)

        acc = jnp.zeros((bm_, bn_), acc_dtype)
        acc = step(0, acc) if n_k == 1 else lax.fori_loop(0, n_k, step, acc)

        o_org, o_blk = op_o.origin_block(groups, origins)
        if epilogue is not None:
            extra = [e.load(o_org, o_blk, fill=0.0).reshape(bm_, bn_) for e in e_refs]
            acc = epilogue(acc, *extra)
        o_ref.store(o_org, o_blk, acc.astype(store_dtype).reshape(o_blk))

    plan = Plan.build([a, b, *extras], [out])
    grid = (groups["B"].ntiles, groups["M"].ntiles, groups["N"].ntiles)
    (res,) = plan.call(body, grid=grid, backend=backend, num_warps=num_warps,
                       num_stages=num_stages, name="vtc_matmul")
    return res[0] if len(res) == 1 else res
