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

Decode shape (M <= 64, :func:`tiling.gemm_config`): the kernel is weight-bandwidth bound, so it
takes ~16 KB weight tiles (``bk = 128`` for bf16), 4 pipeline stages and split-K. With
``split_k = S > 1`` there are two kernels, deterministic (no atomics)::

    vtc_matmul_splitk  grid (B*S, tiles(M), tiles(N)): program (b*S + s, m, n) sums its K range
                       [s*kps, (s+1)*kps) tiles into acc and stores it, f32, at ws[s, tile]
    vtc_matmul_reduce  grid (B, tiles(M), tiles(N)): acc = ws[0] + ws[1] + ... (fixed order),
                       then the epilogue and the (virtual) output store, exactly once per tile

The workspace ``ws`` has the output's logical shape with a leading split dim (only valid lanes
are written or read), so an output that lands in Q and the K/V caches at ``pos`` is written by
the reduce kernel only, after the whole sum.

Gated GEMM (``rhs_parts``): a program may dot its A tile with several B operands of one shape —
``x @ W[:, :F]`` and ``x @ W[:, F:]``, the gate and up halves of a merged projection, read through
slices of ``W`` — and hand all the accumulators to the epilogue (``silu(g) * u``). XLA runs such
a step as its GEMM writing ``g`` and ``u`` plus a loop fusion reading them back (the epilogue reads
two parts of one GEMM result); here it is one launch and the product is never written. With
split-K the workspace holds each part's partial sums (``ws[s * parts + p]``).

Folded row norm (``fold``): the A operand is a row norm of what the kernel loads — RMSNorm's
``(x * rsqrt(mean(x²) + eps) * w).astype(bf16)`` — whose row statistic spans all of K, the
contraction. The statistic's row factor commutes with the dot (``(r ⊙ y) · B = r ⊙ (y · B)``), so
the kernel loads ``x`` (and the norm's other rows, ``w``) tile by tile, dots ``y = f(x, w)`` (the
norm with the factor taken as 1), sums the statistic's summand (``x²``) over the same tiles, and
scales the accumulator rows by the factor in the epilogue: the norm is never written, and the
statistic costs no extra read. With split-K each split's partial statistic goes to a second
workspace (written by the programs of the first N tile) and the reduce sums them. The rounding
of the dot's operand moves (``y`` rounded, not ``r ⊙ y``): within the operand dtype's precision.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .tiling import (MIN_DOT_BLOCK, GemmConfig, Group, InBounds, check_pow2, choose_blocks, dot_precision, fori,
                     gemm_config, interpreter_dtype, normalize_split, program_id, split_block)
from .vio import Plan, VTensor, epilogue_input, output, pack_results

__all__ = ["matmul", "splits", "MIN_DOT_BLOCK", "choose_blocks"]


# --------------------------------------------------------------------------------------------
# Static planning
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Operand:
    """How one operand's own dims map onto the groups: role per dim and its position in the group."""
    roles: tuple[tuple[str, int], ...]   # per operand dim: ("B"|"M"|"N"|"K", index in group)

    @staticmethod
    def of(ndim: int, spec: dict[str, Sequence[int]]) -> "_Operand":
        r: list[tuple[str, int] | None] = [None] * ndim
        for g, dims in spec.items():
            for i, d in enumerate(dims):
                r[d] = (g, i)
        assert all(x is not None for x in r)
        return _Operand(tuple(r))  # type: ignore[arg-type]

    def origin_block(self, groups: dict[str, Group], origins: dict[str, tuple[Any, ...]]
                     ) -> tuple[tuple[Any, ...], tuple[int, ...]]:
        return (tuple(origins[g][i] for g, i in self.roles),
                tuple(groups[g].blocks[i] for g, i in self.roles))

    def to_2d(self, x: jax.Array, rows: str, cols: str, groups: dict[str, Group]) -> jax.Array:
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


@dataclass(frozen=True, eq=False)
class Fold:
    """A row norm folded into the A operand (module docstring): ``prologue(*tiles)`` is the A tile
    with the statistic's factor taken as 1, ``statistic(*tiles)`` the summand of the row statistic
    (summed over K), ``scale(stat)`` the factor from the whole row's sum, a ``(bm, 1)`` block.
    ``inputs``: the norm's rows besides A itself, each of A's shape (broadcast views); the tiles are
    A's and theirs, in that order, in A's dim order."""
    prologue: Callable[..., jax.Array]
    statistic: Callable[..., jax.Array]
    scale: Callable[[jax.Array], jax.Array]
    inputs: tuple[Any, ...] = ()


@dataclass(frozen=True, eq=False)
class _Config:
    """Everything static about one matmul kernel."""
    groups: dict[str, Group]          # "B", "M", "N", "K"
    op_a: _Operand
    op_b: _Operand
    op_o: _Operand                    # the output (and the epilogue arguments)
    compute_dtype: np.dtype
    acc_dtype: np.dtype
    precision: Any
    store_dtype: np.dtype
    epilogue: Callable[..., jax.Array] | None
    launch: GemmConfig                # blocks, stages, split_k (what the cost model reads too)
    prologue: tuple[Callable[[jax.Array], jax.Array] | None, ...] = (None, None)   # per operand
    parts: int = 1                    # B operands dotted with each A tile (gated GEMM: gate, up)
    fold: Fold | None = None          # a row norm folded into A (its statistic summed in the K loop)

    @property
    def split(self) -> int:
        return normalize_split(self.groups["K"].ntiles, self.launch.split_k)

    @property
    def k_per_split(self) -> int:
        return -(-self.groups["K"].ntiles // self.split)

    @property
    def out_grid(self) -> tuple[int, int, int]:
        """One program per output tile (the single kernel, or the split-K reduce kernel)."""
        return self.groups["B"].ntiles, self.groups["M"].ntiles, self.groups["N"].ntiles

    @property
    def grid(self) -> tuple[int, int, int]:
        """The main kernel's grid: split-K programs share grid axis 0 with the batch tiles."""
        nb, nm, nn = self.out_grid
        return nb * self.split, nm, nn


def _plan(a: VTensor, bs: Sequence[VTensor], dimension_numbers: Any, out: VTensor | None,
          epilogue: Callable[..., jax.Array] | None, epilogue_args: Sequence[Any],
          preferred_element_type: Any, precision: Any, block_m: int | None, block_n: int | None,
          block_k: int | None, num_warps: int | None, num_stages: int | None, split_k: int | None,
          prologue_dtypes: tuple[Any, Any] = (None, None)
          ) -> tuple[VTensor, list[VTensor], list[VTensor], VTensor, _Config]:
    """Check the operands, normalise the dimension numbers into groups and view every operand so
    that each group has at least one dim (size-1 dims through the layout, no data movement).
    ``bs``: the B operand and the other parts of a gated GEMM (one shape and dtype).

    Returns the viewed ``(a, bs, epilogue args, out)`` and the kernel's configuration."""
    b = bs[0]
    for x in bs[1:]:
        if x.shape != b.shape or x.dtype != b.dtype:
            raise ValueError(f"the parts of a gated GEMM differ: {x.shape} {x.dtype} against {b.shape} {b.dtype}")
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
    da, db = (v.dtype if d is None else np.dtype(d) for v, d in zip((a, b), prologue_dtypes))
    for d in (da, db):
        if not jnp.issubdtype(d, jnp.floating):
            raise NotImplementedError(f"matmul template supports floating dtypes, got {d}")
    compute_dtype = jnp.promote_types(da, db)
    out = output(out, out_shape, preferred_element_type or compute_dtype, "dot_general gives")
    extras = [epilogue_input(x, out_shape) for x in epilogue_args]

    # Degenerate groups get a size-1 dim through the layout (no data movement): every dot is 2-D.
    nb = len(lb)
    if not lf:  # no lhs free dim: new lhs dim at the end, output dim after the batch dims
        a = a.expand_dims((len(a.shape),))
        lf = (len(a.shape) - 1,)
        out = out.expand_dims((nb,))
        extras = [e.expand_dims((nb,)) for e in extras]
    bs = list(bs)
    if not rf:
        bs = [x.expand_dims((len(x.shape),)) for x in bs]
        b = bs[0]
        rf = (len(b.shape) - 1,)
        out = out.expand_dims((len(out.shape),))
        extras = [e.expand_dims((len(e.shape),)) for e in extras]
    if not lc:
        a = a.expand_dims((len(a.shape),))
        bs = [x.expand_dims((len(x.shape),)) for x in bs]
        b = bs[0]
        lc, rc = (len(a.shape) - 1,), (len(b.shape) - 1,)

    # Contracting pairs in lhs dim order: the innermost lhs contracting dim gets the K block.
    pairs = sorted(zip(lc, rc))
    lc, rc = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    m_sizes = tuple(a.shape[d] for d in lf)
    n_sizes = tuple(b.shape[d] for d in rf)
    k_sizes = tuple(a.shape[d] for d in lc)
    launch = gemm_config(math.prod(m_sizes), math.prod(n_sizes), math.prod(k_sizes),
                         batch=math.prod(a.shape[d] for d in lb), a_itemsize=a.dtype.itemsize,
                         b_itemsize=b.dtype.itemsize, block_m=block_m, block_n=block_n,
                         block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                         split_k=split_k, b_parts=len(bs),
                         pieces=(len(a.layout.pieces), max(len(x.layout.pieces) for x in bs)))
    bm, bn, bk = launch.block_m, launch.block_n, launch.block_k
    groups = {
        "B": Group(tuple(a.shape[d] for d in lb), (1,) * nb),
        "M": Group(m_sizes, split_block(m_sizes, bm)),
        "N": Group(n_sizes, split_block(n_sizes, bn)),
        "K": Group(k_sizes, split_block(k_sizes, bk)),
    }
    nm = len(lf)
    precision, acc_dtype = dot_precision(precision, compute_dtype)
    cfg = _Config(
        groups,
        _Operand.of(len(a.shape), {"B": lb, "M": lf, "K": lc}),
        _Operand.of(len(b.shape), {"B": rb, "N": rf, "K": rc}),
        _Operand.of(len(out.shape), {"B": range(nb), "M": range(nb, nb + nm),
                                     "N": range(nb + nm, len(out.shape))}),
        np.dtype(compute_dtype), acc_dtype, precision, out.dtype, epilogue, launch, parts=len(bs))
    return a, bs, extras, out, cfg


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------

def _tile_origins(c: _Config, pb: Any, pm: Any, pn: Any) -> dict[str, tuple[Any, ...]]:
    """Per-group origins of an output tile; program ids are in range, so dims whose block divides
    the size are marked :class:`tiling.InBounds` (vio emits no bounds mask there)."""
    g = c.groups
    return {"B": g["B"].origins(pb, mark=True), "M": g["M"].origins(pm, mark=True),
            "N": g["N"].origins(pn, mark=True)}


def _accumulate(c: _Config, a_ref: Any, b_refs: Sequence[Any], origins: dict[str, tuple[Any, ...]],
                k_first: Any, k_steps: int, f_refs: Sequence[Any] = ()) -> tuple[jax.Array, ...]:
    """Stages 1-2: the (bm, bn) f32 sums over K tiles ``k_first .. k_first + k_steps - 1``, one
    per B part (the A tile loaded once for all of them), then — with a folded norm — the (bm, 1)
    sum of its statistic over the same tiles (``f_refs``: the norm's other rows).

    K tiles past the end (the last split of an uneven split-K) read zeros through vio's masks;
    when every tile index is below ``ntiles`` the K origins are marked in bounds (no K mask)."""
    g = c.groups
    exact = not isinstance(k_first, int) and c.split * c.k_per_split == g["K"].ntiles or \
        isinstance(k_first, int) and k_first + k_steps <= g["K"].ntiles

    def step(i: Any, accs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        kk = i if isinstance(k_first, int) and k_first == 0 else k_first + i
        org = dict(origins, K=g["K"].origins(kk, mark=exact))
        a_org, a_blk = c.op_a.origin_block(g, org)
        b_org, b_blk = c.op_b.origin_block(g, org)
        xa = a_ref.load(a_org, a_blk, fill=0.0)
        fa, fb = c.prologue
        out = []
        if c.fold is not None:
            tiles = [xa, *(f.load(a_org, a_blk, fill=0.0) for f in f_refs)]
            xa = c.fold.prologue(*tiles)
            summand = c.fold.statistic(*tiles)
            stat = jnp.sum(summand, axis=-1, keepdims=True).reshape(g["M"].block, 1)
        x = c.op_a.to_2d(xa if fa is None else fa(xa), "M", "K", g).astype(c.compute_dtype)
        for b_ref, acc in zip(b_refs, accs):
            yb = b_ref.load(b_org, b_blk, fill=0.0)
            y = c.op_b.to_2d(yb if fb is None else fb(yb), "K", "N", g).astype(c.compute_dtype)
            out.append(acc + jnp.dot(x, y, preferred_element_type=c.acc_dtype, precision=c.precision))
        if c.fold is not None:
            out.append(accs[-1] + stat.astype(accs[-1].dtype))
        return tuple(out)

    zero = jnp.zeros((g["M"].block, g["N"].block), c.acc_dtype)
    init = (zero,) * len(b_refs) + ((jnp.zeros((g["M"].block, 1), jnp.float32),) if c.fold is not None else ())
    return fori(k_steps, step, init)


def _finish(c: _Config, accs: Sequence[jax.Array], e_refs: Sequence[Any], o_ref: Any,
            origins: dict[str, tuple[Any, ...]]) -> None:
    """Stage 3: epilogue in registers (given every part's accumulator), then the store through
    the output's layout."""
    g = c.groups
    bm, bn = g["M"].block, g["N"].block
    o_org, o_blk = c.op_o.origin_block(g, origins)
    if c.fold is not None:   # the norm's row factor, from the whole row's statistic
        *accs, stat = accs
        r = c.fold.scale(stat).astype(jnp.float32)
        accs = [a * r for a in accs]
    acc = accs[0]
    if c.epilogue is not None:
        extra = [e.load(o_org, o_blk, fill=0.0).reshape(bm, bn) for e in e_refs]
        acc = c.epilogue(*accs, *extra)
    o_ref.store(o_org, o_blk, acc.astype(c.store_dtype).reshape(o_blk))


def _matmul_kernel(c: _Config, ins: list[Any], outs: list[Any]) -> None:
    """Program (b, m, n): the (bm, bn) output tile, K looped inside (Listing 1's three stages)."""
    nf = len(c.fold.inputs) if c.fold is not None else 0
    a_ref, b_refs = ins[0], ins[1:1 + c.parts]
    f_refs, e_refs = ins[1 + c.parts:1 + c.parts + nf], ins[1 + c.parts + nf:]
    (o_ref,) = outs
    nb, nm, nn = c.out_grid
    origins = _tile_origins(c, *(program_id(i, n) for i, n in enumerate((nb, nm, nn))))
    _finish(c, _accumulate(c, a_ref, b_refs, origins, 0, c.groups["K"].ntiles, f_refs), e_refs, o_ref, origins)


def _splitk_kernel(c: _Config, ins: list[Any], outs: list[Any]) -> None:
    """Program (b * S + s, m, n): split ``s``'s partial sums of the tile (one per part, at
    ``s * parts + p``), to the f32 workspace."""
    a_ref, b_refs, f_refs = ins[0], ins[1:1 + c.parts], ins[1 + c.parts:]
    ws_ref = outs[0]
    nb, nm, nn = c.out_grid
    p0 = pl.program_id(0)
    pb, s = (0, p0) if nb == 1 else (jax.lax.div(p0, jnp.int32(c.split)), jax.lax.rem(p0, jnp.int32(c.split)))
    pn = program_id(2, nn)
    origins = _tile_origins(c, pb, program_id(1, nm), pn)
    accs = _accumulate(c, a_ref, b_refs, origins, s * c.k_per_split, c.k_per_split, f_refs)
    o_org, o_blk = c.op_o.origin_block(c.groups, origins)
    for p, acc in enumerate(accs[:c.parts]):
        ws_ref.store((InBounds(s * c.parts + p), *o_org), (1, *o_blk), acc.reshape((1, *o_blk)))
    if c.fold is not None:   # the split's partial statistic, once per row tile
        g = c.groups
        def put() -> None:
            outs[1].store((InBounds(s), InBounds(pb), *origins["M"]), (1, 1, *g["M"].blocks),
                          accs[-1].reshape((1, 1, *g["M"].blocks)))
        if nn == 1:
            put()
        else:
            pl.when(pn == 0)(put)


def _reduce_kernel(c: _Config, ins: list[Any], outs: list[Any]) -> None:
    """Program (b, m, n): the split partials summed in split order (deterministic), then stage 3."""
    nf = 1 if c.fold is not None else 0
    ws_ref, e_refs = ins[0], ins[1 + nf:]
    (o_ref,) = outs
    g = c.groups
    nb, nm, nn = c.out_grid
    pb = program_id(0, nb)
    origins = _tile_origins(c, pb, program_id(1, nm), program_id(2, nn))
    o_org, o_blk = c.op_o.origin_block(g, origins)
    accs = []
    for p in range(c.parts):
        acc = None
        for s in range(c.split):
            part = ws_ref.load((s * c.parts + p, *o_org), (1, *o_blk), fill=0.0).reshape(g["M"].block, g["N"].block)
            acc = part if acc is None else acc + part
        accs.append(acc)
    if c.fold is not None:
        stat = None
        for s in range(c.split):
            part = ins[1].load((s, InBounds(pb), *origins["M"]), (1, 1, *g["M"].blocks), fill=0.0)
            part = part.reshape(g["M"].block, 1)
            stat = part if stat is None else stat + part
        accs.append(stat)
    _finish(c, accs, e_refs, o_ref, origins)


def _splitk(c: _Config, a: VTensor, bs: Sequence[VTensor], folded: Sequence[VTensor], out: VTensor,
            backend: str) -> list[VTensor]:
    """The split-K kernel's workspaces: the partial sums ``(split * parts, *out.shape)`` (f32) and,
    with a folded norm, each split's partial statistic per row ``(split, batch tiles, *M dims)``."""
    wss = [VTensor.fresh((c.split * c.parts, *out.shape), c.acc_dtype)]
    if c.fold is not None:
        wss.append(VTensor.fresh((c.split, c.groups["B"].ntiles, *c.groups["M"].sizes), jnp.float32))
    got = Plan.build([a, *bs, *folded], wss).call(
        functools.partial(_splitk_kernel, c), grid=c.grid, backend=backend,
        num_warps=c.launch.num_warps, num_stages=c.launch.num_stages, name="vtc_matmul_splitk")
    return [VTensor.physical(x[0]) for x in got]


def splits(m: int, n: int, k: int, *, batch: int = 1, a_itemsize: int = 2, b_itemsize: int = 2,
           pieces: tuple[int, int] = (1, 1)) -> int:
    """How many K splits :func:`matmul` launches for a GEMM of these sizes with one weight, its
    operands read from ``pieces`` buffers each (weights side by side), left to its own choice
    (1: one kernel, no reduce)."""
    launch = gemm_config(m, n, k, batch=batch, a_itemsize=a_itemsize, b_itemsize=b_itemsize, pieces=pieces)
    return normalize_split(-(-k // launch.block_k), launch.split_k)


# --------------------------------------------------------------------------------------------
# The template
# --------------------------------------------------------------------------------------------

def matmul(a: Any, b: Any, *, dimension_numbers: Any, out: VTensor | None = None,
           epilogue: Callable[..., jax.Array] | None = None, epilogue_args: Sequence[Any] = (),
           preferred_element_type: Any = None, precision: Any = None,
           block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None, split_k: int | None = None,
           prologue: tuple[Any, Any] = (None, None), prologue_dtypes: tuple[Any, Any] = (None, None),
           rhs_parts: Sequence[Any] = (), fold: Fold | None = None, partial_sums: bool = False,
           backend: str = "interpret") -> Any:
    """``lax.dot_general(a, b, dimension_numbers)`` (+ ``epilogue``) as Pallas Triton kernels:
    one kernel, or a split-K kernel plus a reduce kernel (decode shapes, see the module docstring).

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
        computed but never stored. With split-K it runs once, on the full sum.
    preferred_element_type: result dtype when ``out`` is None (default: the promoted input dtype,
        as ``lax.dot_general``); accumulation is f32 regardless for 16/32-bit floats.
    precision: the replaced ``dot_general``'s ``precision`` param, with ``lax.dot_general``'s
        meaning (None: ``jax_default_matmul_precision``, else ``DEFAULT``); the in-kernel dot
        follows it as XLA does on the GPU (:func:`tiling.dot_precision`): f32 operands at
        ``DEFAULT``/``HIGH`` run on TF32 tensor cores, at ``HIGHEST`` as IEEE f32 FMAs. Interpret
        mode computes exact f32 at every level.
    block_m/n/k: caps on the block of each group (powers of two >= 16); the effective block is
        ``max(16, next_pow2(group size))`` capped here (see :func:`choose_blocks`). All None (and
        ``num_warps`` None): :func:`tiling.gemm_config`'s choice — a big prefill GEMM takes
        :func:`tiling.prefill_tiles` (128 x 256 x 64 and 8 warps for 16-bit operands), others
        64 x 64 with ``bk`` 32 / 3 stages (M > 64), or ~16 KB weight tiles, 4 stages and enough
        splits for two waves of SMs (M <= 64).
    prologue: per operand, ``None`` or an elementwise ``f(tile) -> tile`` applied to each loaded
        tile before the dot (a ReLU on q or k). Masked lanes (ragged edges, read as 0) go
        through it too: at most one operand's ``f`` may map 0 elsewhere than 0.
    prologue_dtypes: per operand, the dtype its ``prologue`` returns when it casts (a bf16 operand
        cast to f32 before the dot): the dot computes in the promoted type of these, as
        ``lax.dot_general`` on the cast operands does. None: the operand's own dtype.
    rhs_parts: more B operands of ``b``'s shape and dtype (a gated GEMM: ``b`` and these are views
        of one weight's gate and up halves). The kernel computes ``a · b`` and ``a · part`` for
        each, and the epilogue, required then, takes all the accumulators before the extras:
        ``epilogue(acc_b, *acc_parts, *extra)``; only its result is stored.
    fold: a row norm folded into ``a`` (:class:`Fold`; ``a`` is then the norm's input, and
        ``prologue_dtypes[0]`` the dtype of the norm's result the dot reads): ``a``'s only
        contracting dim is its last, and it has no batch dims.
    partial_sums: launch only the split-K kernel and return its workspaces as VTensors (the f32
        partial sums ``(split, *result shape)``, and with ``fold`` the partial row statistics
        ``(split, 1, *M dims)``) for a kernel that sums them where it reads the result
        (``templates.contraction``: an island epilogue); needs sizes that split (:func:`splits`),
        no ``rhs_parts``, no epilogue. ``out`` then only names the result's shape and dtype.
    backend: "interpret" (CPU) or "triton".

    Returns what ``Plan.unflatten`` gives for ``out``: the array for a fresh physical output,
    else the tuple of ``out``'s physical buffers (updated).
    """
    if partial_sums and (rhs_parts or epilogue is not None):
        raise ValueError("partial_sums takes a GEMM of one weight and no epilogue")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if v is not None:
            check_pow2(name, v)
    if rhs_parts and epilogue is None:
        raise ValueError("rhs_parts needs an epilogue combining the parts' products")
    a, bs, extras, out, cfg = _plan(VTensor.of(a), [VTensor.of(x) for x in (b, *rhs_parts)], dimension_numbers,
                                    out, epilogue, epilogue_args, preferred_element_type, precision,
                                    block_m, block_n, block_k, num_warps, num_stages, split_k,
                                    prologue_dtypes)
    if any(f is not None for f in prologue):
        cfg = dataclasses.replace(cfg, prologue=tuple(prologue))
    folded: list[VTensor] = []
    if fold is not None:
        (lc, _), (lb, _) = dimension_numbers
        if tuple(lb) or tuple(lc) != (len(a.shape) - 1,) or len(a.shape) != len(VTensor.of(a).shape):
            raise ValueError("a folded norm needs an operand contracted along its last dim only, no batch dims")
        folded = [VTensor.of(x) for x in fold.inputs]
        if any(x.shape != a.shape for x in folded):
            raise ValueError(f"a folded norm's rows must have the operand's shape {a.shape}")
        cfg = dataclasses.replace(cfg, fold=fold)
    cfg = dataclasses.replace(cfg, compute_dtype=interpreter_dtype(cfg.compute_dtype, backend))
    if cfg.split == 1:
        if partial_sums:
            raise ValueError("partial_sums asks for a split-K GEMM; these sizes take one kernel")
        plan = Plan.build([a, *bs, *folded, *extras], [out])
        bufs = plan.call(functools.partial(_matmul_kernel, cfg), grid=cfg.grid, backend=backend,
                         num_warps=cfg.launch.num_warps, num_stages=cfg.launch.num_stages, name="vtc_matmul")
        return pack_results(bufs)[0]
    sums = _splitk(cfg, a, bs, folded, out, backend)
    if partial_sums:
        return tuple(sums)
    plan = Plan.build([*sums, *extras], [out])
    bufs = plan.call(functools.partial(_reduce_kernel, cfg), grid=cfg.out_grid, backend=backend,
                     num_warps=4, num_stages=1, name="vtc_matmul_reduce")
    return pack_results(bufs)[0]
