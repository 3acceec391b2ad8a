"""Virtual tensor I/O: the one place where kernels touch global memory (paper §4.2, Listing 1).

A kernel template is written against *logical* tensors: stage 1 asks ``VRef.load(origin, block)``
for a block of its input, stage 2 computes in registers, stage 3 calls ``VRef.store``. Whether
that logical tensor is a plain array, a transpose of a KV cache, the concatenation of three
buffers or a padded window is the layout's business, decided here and nowhere else.

Contract for someone adding a template
--------------------------------------
* Inputs/outputs are :class:`VTensor` (or plain arrays, meaning physical). Build a :class:`Plan`
  with ``Plan.build(inputs, outputs)`` and launch with ``plan.call(body, grid=..., backend=...)``;
  ``body(ins, outs)`` gets one :class:`VRef` per input and output. Read program ids inside.
* Blocks are tuples of powers of two; ``origin`` entries may be traced int32 and must be
  non-negative (padding is a ``Layout.pad``, not a negative origin). Lanes outside the logical
  shape read ``fill`` and are never written: templates do not mask ragged edges themselves. A
  traced origin costs a bounds mask along its dim unless the template wraps it in
  :class:`tiling.InBounds` (it proves ``origin + block <= size``; ``Group.origins(t, mark=True)``).
* A load may cover several pieces (a QKV block straddling Q and the K cache): every piece is
  loaded under its own mask and merged. A store only touches the pieces whose static box meets
  the block (``pl.when``), each under its own mask.
* Never accumulate into one output block from several grid programs (they race on a GPU).
* A kernel may perform a pending row update of a buffer it reads (:class:`Update`: new cache rows
  handed to the step): its programs write the rows (:func:`land`), the buffer is passed once and
  aliased (``Plan.build(over=...)``), and what it computes from its loads takes the rows where
  they land (:class:`Overlay`), whatever order its programs run in.
* Re-view operands with the :class:`VTensor` methods, never by copying: ``with_layout``,
  ``transpose``, ``reshape``, ``expand_dims``, ``broadcast_to`` (numpy rules) only change the
  layout; ``with_symbol`` adds a runtime scalar the body reads as ``VRef.syms[name]``.
* Inputs and outputs of an entry point: :func:`broadcast_input` (inputs of a logical shape),
  :func:`epilogue_input` (matmul/conv epilogue arguments), :func:`output` (one ``out``, checked or
  fresh), :func:`outputs` + :func:`out_dtypes` (several, fresh rank-0 ones lifted to ``(1,)``) and
  :func:`pack_results` (what the entry point returns). Blocks, grids and loops:
  :mod:`vtc_jax.kernels.tiling`.
* Shape of a template (as JAX's Pallas GPU ops): a kernel body ``_kernel(cfg, ins, outs)`` taking
  a frozen static configuration, a planning step that checks arguments, re-views operands and
  builds that configuration, and a thin public wrapper that launches
  ``Plan.build(...).call(functools.partial(_kernel, cfg), grid=...)`` and packs the results.

How a piece is accessed (cheapest first)
----------------------------------------
0. *A whole row-major reshape* of an input's buffer (``(B, S, H, D)`` read as ``(B·S, H·D)``):
   the buffer is passed reshaped (a bitcast in XLA) and read as physical (:func:`_reshaped`).
1. *Strided box with unit strides* (identity, transpose, slice, dynamic_slice at ``pos``, reshape
   that merges cleanly, broadcast): the buffer keeps its shape and the block is read with
   ``ref.at[pl.ds(start, n), ...]``, then transposed/broadcast in registers. For a physical,
   contiguous operand this is exactly what a ``BlockSpec`` lowers to in Triton (pointer plus
   ``arange`` offsets, masked), so templates need no second code path for the plain case.
   A map that is a strided box only for the block at hand takes this path too
   (:func:`_block_strided`): a contiguous merge ``(B, 1, H, D) -> (B, H*D)`` (also a concat piece
   of it, e.g. Q | K-cache | V-cache) read or written in blocks of at most ``D`` columns at
   aligned origins is a window with scalar ``//``/``%`` on the origin, not a per-lane gather.
2. *General*: the buffer is passed flattened (a free bitcast in XLA) and the block's flat offsets
   are the map's own ``IndexMap.flat_offsets`` evaluated on the block's int32 lane indices (``//``
   and ``%`` only where simplification could not remove them) — a masked gather/scatter. Lane
   masks are ``Piece.holds`` / ``FillRegion.holds`` on the same lanes, the block's in-bounds mask
   first in the one chain of ``all_of``. Masked-off scatter lanes point past the end of the buffer,
   because the interpreter writes the old value back on masked lanes and would clobber element 0.
3. *General, on an unflattened buffer*: buffers of 2^31 elements or more (flat int32 offsets
   would overflow, and int64 values do not exist in a kernel traced without x64), and buffers of
   merge-shaped pieces whose block at hand does not make a window (path 1 serves the others). The
   buffer keeps its shape and the block is
   gathered/scattered with one int32 index array per buffer dim (each below its dim's size); the
   Pallas Triton lowering multiplies them by the strides in i64 whenever the buffer has more than
   2^32 bytes (it does the same for path 1's ``pl.ds`` starts); below, its signed i32 element
   offsets reach 2^31 - 1, enough for 2^31 elements of 16 bits. Where an offset would wrap — a
   1-byte dtype with more than 2^31 elements, up to 2^32 — or a dim has 2^31 elements, ``Plan.build`` raises
   (the template's cluster then falls back to XLA) rather than emit wrapping offsets.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..compat import manual_axis_type, triton_compiler_params, vary, varying_axes
from ..indexmap import (Atom, Dim, Expr, FloorDiv, IndexMap, Layout, Load, Mod, Piece, Sym, all_of,
                        box_conds, conds_mask, finish_read, normalise_start, point, row_major_strides)
from ..primitives import READS_IN_PLACE
from .tiling import InBounds, next_pow2

__all__ = ["VTensor", "VRef", "Plan", "Update", "Overlay", "OverlayError", "compiler_params", "next_pow2", "broadcast_input",
           "epilogue_input", "out_dtypes", "output", "outputs", "pack_results", "land"]


def compiler_params(num_warps: int = 4, num_stages: int = 2) -> Any:
    """Triton compiler params: without them jax 0.10.2 routes pallas_call to Mosaic GPU. On jax
    >= 0.11 their lowering names an abstract H100 where no GPU is given (``compat.triton_compiler_params``),
    so a program of vtc_jax kernels lowers for CUDA on any machine, in any mesh, with no context."""
    return triton_compiler_params(num_warps, num_stages)


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class VTensor:
    """A logical tensor: a layout onto physical buffers plus the runtime scalars its map uses.

    Buffers that are ``jax.ShapeDtypeStruct`` (outputs only) are created by the kernel that
    writes them; array buffers of an output are written in place (``input_output_aliases``).
    """
    layout: Layout
    dtype: np.dtype
    buffers: tuple[Any, ...]
    symbols: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        n = len(self.buffers)
        for p in self.layout.pieces:
            if not 0 <= p.target < n:
                raise ValueError(f"layout piece targets buffer {p.target}, but only {n} buffers given")
            if len(p.map.target) != len(self.buffers[p.target].shape) or \
                    tuple(p.map.target) != tuple(self.buffers[p.target].shape):
                raise ValueError(f"piece maps onto shape {p.map.target}, buffer {p.target} has shape "
                                 f"{tuple(self.buffers[p.target].shape)}")
        missing = {s.name for p in self.layout.pieces for s in p.map.syms} - {k for k, _ in self.symbols}
        if missing:
            raise ValueError(f"layout uses runtime symbols {sorted(missing)} that were not supplied")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @staticmethod
    def physical(x: Any) -> "VTensor":
        return VTensor(Layout.physical(0, x.shape), x.dtype, (x,))

    @staticmethod
    def fresh(shape: Sequence[int], dtype: Any) -> "VTensor":
        """A new physical output buffer, allocated by the kernel that writes it."""
        shape = tuple(int(s) for s in shape)
        return VTensor(Layout.physical(0, shape), np.dtype(dtype), (jax.ShapeDtypeStruct(shape, dtype),))

    @staticmethod
    def of(x: Any) -> "VTensor":
        return x if isinstance(x, VTensor) else VTensor.physical(jnp.asarray(x))

    # -- views: the same buffers and symbols under another layout (no data movement) ----------
    def with_layout(self, layout: Layout) -> "VTensor":
        """The same buffers and symbols seen through ``layout`` (re-validated)."""
        return dataclasses.replace(self, layout=layout)

    def with_symbol(self, name: str, value: Any) -> "VTensor":
        """One more runtime symbol (an int32 scalar the kernel can read as ``VRef.syms[name]``)."""
        if name in dict(self.symbols):
            raise ValueError(f"VTensor already carries a runtime symbol named {name!r}")
        return dataclasses.replace(self, symbols=self.symbols + ((name, value),))

    def transpose(self, perm: Sequence[int]) -> "VTensor":
        """``lax.transpose`` as a layout (``self`` when ``perm`` is the identity)."""
        perm = tuple(int(p) for p in perm)
        return self if perm == tuple(range(len(self.shape))) else self.with_layout(self.layout.transpose(perm))

    def reshape(self, shape: Sequence[int]) -> "VTensor":
        """Row-major ``reshape`` as a layout."""
        return self.with_layout(self.layout.reshape(tuple(int(n) for n in shape)))

    def expand_dims(self, axes: Sequence[int]) -> "VTensor":
        """New size-1 dims at ``axes`` (positions in the result), as a layout."""
        return self.with_layout(self.layout.expand_dims(tuple(axes)))

    def broadcast_to(self, shape: Sequence[int]) -> "VTensor":
        """Numpy broadcasting to ``shape`` as a broadcast layout (``self`` when the shape matches):
        the broadcast tensor is never materialised."""
        shape = tuple(int(n) for n in shape)
        src = self.shape
        if src == shape:
            return self
        try:
            ok = len(src) <= len(shape) and np.broadcast_shapes(src, shape) == shape
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"cannot broadcast {src} to {shape}")
        return self.with_layout(self.layout.broadcast(shape, tuple(range(len(shape) - len(src), len(shape)))))

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (self.buffers, tuple(v for _, v in self.symbols)), (self.layout, self.dtype,
                                                                   tuple(k for k, _ in self.symbols))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> "VTensor":
        layout, dtype, names = aux
        buffers, values = children
        return cls(layout, dtype, tuple(buffers), tuple(zip(names, values)))


def _is_fresh(b: Any) -> bool:
    return isinstance(b, jax.ShapeDtypeStruct)


# --------------------------------------------------------------------------------------------
# A template's inputs and outputs (shared by every entry point)
# --------------------------------------------------------------------------------------------

def broadcast_input(x: Any, shape: Sequence[int]) -> VTensor:
    """An input of logical ``shape``: a VTensor (broadcast if its shape is smaller) or an array
    (numpy broadcasting rules, expressed as a broadcast layout onto the array itself; a rank-0
    array is viewed as a (1,) buffer)."""
    shape = tuple(int(n) for n in shape)
    if isinstance(x, VTensor):
        return x.broadcast_to(shape)
    x = jnp.asarray(x)
    if tuple(x.shape) != shape and x.ndim == 0:
        x = x.reshape(1)
    return VTensor.physical(x).broadcast_to(shape)


def epilogue_input(x: Any, shape: Sequence[int]) -> VTensor:
    """An epilogue argument of a kernel whose output has logical ``shape`` (matmul, conv): a
    VTensor of exactly that shape, or an array broadcast to it (numpy rules) through a broadcast
    layout — a bias vector is never materialised at the output's size."""
    shape = tuple(int(n) for n in shape)
    if isinstance(x, VTensor):
        if tuple(x.shape) != shape:
            raise ValueError(f"epilogue VTensor has shape {x.shape}, the output is {shape}: "
                             "give it a broadcast layout")
        return x
    return VTensor.physical(jnp.asarray(x)).broadcast_to(shape)


def out_dtypes(spec: Any, defaults: Sequence[Any]) -> list[np.dtype]:
    """One dtype per output: ``spec`` None (``defaults``), one dtype for all, or a sequence."""
    if spec is None:
        dtypes = [np.dtype(d) for d in defaults]
    elif isinstance(spec, (list, tuple)):
        dtypes = [np.dtype(d) for d in spec]
    else:
        dtypes = [np.dtype(spec)] * len(defaults)
    if len(dtypes) != len(defaults):
        raise ValueError(f"{len(dtypes)} out_dtypes for {len(defaults)} outputs")
    return dtypes


def output(out: VTensor | None, shape: Sequence[int], dtype: Any, what: str = "expected") -> VTensor:
    """A single-output kernel's output: ``out`` (checked to have logical ``shape``; the error says
    ``out has logical shape .., {what} {shape}``) or a fresh physical array of ``dtype``."""
    shape = tuple(int(n) for n in shape)
    if out is None:
        return VTensor.fresh(shape, np.dtype(dtype))
    if tuple(out.shape) != shape:
        raise ValueError(f"out has logical shape {out.shape}, {what} {shape}")
    return out


def outputs(outs: Any, shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]
            ) -> tuple[list[VTensor], list[bool]]:
    """(output VTensors, lifted) for a kernel with one output per entry of ``shapes``.

    ``outs``: None (fresh physical arrays of ``dtypes``), a VTensor or a sequence of them, checked
    against ``shapes``. A fresh rank-0 output gets a (1,) buffer (``lifted``; blocks have rank >= 1)
    that :func:`pack_results` turns back into a rank-0 array.
    """
    shapes = [tuple(int(n) for n in s) for s in shapes]
    if outs is None:
        lifted = [s == () for s in shapes]
        return [VTensor.fresh((1,) if s == () else s, d) for s, d in zip(shapes, dtypes)], lifted
    vouts = [outs] if isinstance(outs, VTensor) else list(outs)
    if len(vouts) != len(shapes):
        raise ValueError(f"{len(vouts)} outs for {len(shapes)} outputs")
    for i, (v, s) in enumerate(zip(vouts, shapes)):
        if v.shape != s:
            raise ValueError(f"output {i} has shape {v.shape}, expected {s}")
    return vouts, [False] * len(vouts)


def pack_results(bufs: Sequence[tuple[Any, ...]], lifted: Sequence[bool] = ()) -> list[Any]:
    """What entry points return per output, from ``Plan.call``'s buffers: its physical buffer, or
    the tuple of its buffers when the output VTensor has several; lifted outputs as rank 0."""
    packed = []
    for i, b in enumerate(bufs):
        if i < len(lifted) and lifted[i]:
            b = (b[0].reshape(()),)
        packed.append(b[0] if len(b) == 1 else tuple(b))
    return packed


def _unit_strided(p: Piece) -> tuple[tuple[int | None, int, Expr], ...] | None:
    """The piece's strided-box form when every mapped stride is +1 (what ``pl.ds`` can serve).

    Window starts must be provably non-negative: a piece of a concatenation seen from a block
    that starts before the piece (start ``d - 8`` at ``d = 0``) would need a negative ``pl.ds``
    start, which the interpreter clamps; such pieces take the gather path instead.
    """
    sb = p.map.strided_box()
    if sb is None or any(j is not None and k != 1 for j, k, _ in sb):
        return None
    bounds = p.map.bounds
    if any(off.range(bounds)[0] < 0 for _, _, off in sb):
        return None
    return sb


def _reads_where_written(read: Sequence[IndexMap], wrote: Sequence[IndexMap], shape: tuple[int, ...]) -> bool:
    """Whether an input reads a buffer only where, at the same lane, an output of ``shape`` writes
    it: the same maps, or — the output smaller than the grid (islands over a union of shapes,
    ``kernels.pointwise``) — the output's maps read over the grid, masked to the output's extent:
    every element read is written by the program reading it, after the read."""
    if tuple(read) == tuple(wrote):
        return True
    if len(read) != len(wrote):
        return False
    for r, w in zip(read, wrote):
        if len(r.domain) != len(shape) or any(a < b for a, b in zip(r.domain, shape)):
            return False
        box = set(box_conds([(0, n) for n in shape], r.domain))
        if (r.exprs, r.target, r.syms) != (w.exprs, w.target, w.syms) or not set(w.conds) | box <= set(r.conds) \
                or not set(r.conds) <= set(w.conds) | box:
            return False
    return True


def _reshaped(v: VTensor, written: frozenset[int]) -> VTensor:
    """``v`` re-viewed as a physical reshape of its buffer where its one piece is a row-major
    reshape of the whole buffer (the map's flat offset is the row-major index of ``v``'s logical
    shape, no condition, symbol or table): the buffer is passed ``reshape``d (a free bitcast in
    XLA) and read through path 1. Read through the map, the merged dims' ``floordiv``/``mod``
    make a gather (path 3) of every block that is not aligned with them — a matmul's K loop: T5's
    output projection read the attention output ``(B, S, H, D) -> (B·S, H·D)`` with 32 scalar
    2-byte ``ld.global`` per thread and K step, where a plain operand takes ``cp.async``
    (deviceless sm_90 PTX). Buffers an output writes (``written``) keep their identity: the
    in-place aliasing of :meth:`Plan.build` matches them by object."""
    if len(v.layout.pieces) != 1 or v.layout.fills:
        return v
    p = v.layout.pieces[0]
    m, b = p.map, v.buffers[p.target]
    if (m.is_identity or id(b) in written or _is_fresh(b) or p.where or m.conds or m.syms
            or _has_loads(p) or math.prod(m.domain) != math.prod(tuple(b.shape))):
        return v
    if m.flat_expr() != IndexMap.identity(m.domain).flat_expr():
        return v
    return VTensor(Layout.physical(0, m.domain), v.dtype, (b.reshape(m.domain),), v.symbols)


# --------------------------------------------------------------------------------------------
# Plan: how a template's VTensors become pallas_call operands
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Binding:
    """Static description of one VTensor inside a kernel: layout, dtype and its buffers' slots."""
    layout: Layout
    dtype: np.dtype
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    flat: tuple[bool, ...]           # buffer passed flattened (general gather/scatter path)
    slots: tuple[int, ...]           # input: arg index; output: output index


@dataclass(frozen=True, eq=False)
class Plan:
    inputs: tuple[_Binding, ...]
    outputs: tuple[_Binding, ...]
    sym_names: tuple[str, ...]
    # per symbol, the range a map's SymInfo gives it (lax's clamp of a dynamic start), applied in
    # the kernel to the value passed (None: a symbol no map declares, passed as it is)
    sym_ranges: tuple[tuple[int, int, int] | None, ...]   # SymInfo.bounds: (lo, hi, wrap)
    args: tuple[Any, ...]
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    input_output_aliases: dict[int, int]
    tables: tuple[tuple[str, tuple[int, ...]], ...] = ()   # symbols that are index tables: shapes
    reads_in_place: tuple[int, ...] = ()   # aliased args the kernel reads whole (``over``)

    @staticmethod
    def build(inputs: Sequence[Any], outputs: Sequence[VTensor], *, same_place: bool = False,
              over: frozenset[int] = frozenset()) -> "Plan":
        """``same_place``: the kernel computes each output element from the input elements at the
        same logical index, in the same program (an element-wise kernel over one logical shape).
        An input that reads a buffer an output updates in place, through the same map, then
        passes that buffer once, as the aliased operand: every element is read before it is
        written, by the program that writes it. Passed twice (read, and aliased), XLA must copy
        the whole buffer first (it cannot see inside the kernel), and again for the program's
        output: a guarded cache write (``canonical``'s scatter form reads the window it writes)
        cost two cache copies.

        ``over``: ids of buffers an input reads and an :class:`Update` output writes in place (the
        kernel performs a pending row update of a buffer it reads: :class:`Overlay`). Such a
        buffer is passed once, as the aliased operand, in the input's shape: the kernel's loads
        take every updated element from the update's rows, whatever order the programs run in."""
        args: list[Any] = []
        out_shape: list[jax.ShapeDtypeStruct] = []
        aliases: dict[int, int] = {}
        syms: dict[str, Any] = {}

        def flat_flags(v: VTensor) -> tuple[bool, ...]:
            flags = [False] * len(v.buffers)
            for b in v.buffers:
                _check_index_width(tuple(b.shape), np.dtype(b.dtype))
            for p in v.layout.pieces:
                if _unit_strided(p) is None and not _maybe_block_strided(p) and \
                        math.prod(v.buffers[p.target].shape) < _WIDE_ELEMENTS:
                    flags[p.target] = True
            return tuple(flags)

        def collect_syms(v: VTensor) -> None:
            for k, val in v.symbols:
                syms.setdefault(k, val)

        def pieces_on(v: VTensor, k: int) -> tuple[Any, ...]:
            return tuple(p.map for p in v.layout.pieces if p.target == k)

        # buffers written in place that an input reads exactly where an output writes them
        written = {id(b): (pieces_on(w, k), f, tuple(w.shape)) for w in outputs
                   for k, (b, f) in enumerate(zip(w.buffers, flat_flags(w))) if not _is_fresh(b)} if same_place else {}
        in_place_arg: dict[int, int] = {}   # id(buffer) -> its (aliased) argument index
        in_flat: dict[int, bool] = {}       # id(buffer) -> how the aliased operand is passed
        read_arg: dict[tuple[int, bool], int] = {}   # (id(buffer), flat) -> its argument index
        in_b = []
        outs_b = frozenset(id(b) for w in outputs for b in w.buffers)
        for x in inputs:
            v = _reshaped(VTensor.of(x), outs_b)
            collect_syms(v)
            flat = list(flat_flags(v))
            slots = []
            for k, b in enumerate(v.buffers):
                f = flat[k]
                if _is_fresh(b):
                    raise ValueError("an input VTensor cannot have unallocated (ShapeDtypeStruct) buffers")
                if id(b) in in_place_arg:
                    slots.append(in_place_arg[id(b)])
                    continue
                if (id(b), f) in read_arg and id(b) not in outs_b:   # one buffer read through two
                    slots.append(read_arg[(id(b), f)])               # views (a gated GEMM's halves
                    continue                                         # of one weight) is passed once
                if id(b) in written and v.shape == outputs[0].shape and (written[id(b)][:2] == (pieces_on(v, k), f) or (
                        _reads_where_written(pieces_on(v, k), written[id(b)][0], written[id(b)][2]))):
                    f = flat[k] = written[id(b)][1]   # (read as the output passes it: per-dim indices)
                if id(b) in over or (id(b) in written and v.shape == outputs[0].shape
                                     and _reads_where_written(pieces_on(v, k), written[id(b)][0], written[id(b)][2])):
                    in_place_arg[id(b)] = len(args)
                    in_flat[id(b)] = f
                read_arg[(id(b), f)] = len(args)
                slots.append(len(args))
                args.append(b.reshape(-1) if f else b)
            in_b.append(_Binding(v.layout, v.dtype, tuple(tuple(b.shape) for b in v.buffers),
                                 tuple(np.dtype(b.dtype) for b in v.buffers), tuple(flat), tuple(slots)))
        # One output slot per distinct buffer object: two outputs written into one buffer (the
        # pieces of a concatenation a multi-output kernel produces) share it, or each would come
        # back as its own copy holding only its own pieces.
        shared_flat: dict[int, bool] = {}
        for v in outputs:
            for b, f in zip(v.buffers, flat_flags(v)):
                shared_flat[id(b)] = shared_flat.get(id(b), False) or f
        slot_of: dict[int, int] = {}
        out_b = []
        for v in outputs:
            collect_syms(v)
            flat = tuple(in_flat.get(id(b), shared_flat[id(b)]) for b in v.buffers)
            slots = []
            for b, f in zip(v.buffers, flat):
                if id(b) in slot_of:
                    slots.append(slot_of[id(b)])
                    continue
                shape = (math.prod(b.shape),) if f else tuple(b.shape)
                slot_of[id(b)] = len(out_shape)
                slots.append(len(out_shape))
                if id(b) in in_place_arg:
                    aliases[in_place_arg[id(b)]] = len(out_shape)
                elif not _is_fresh(b):
                    aliases[len(args)] = len(out_shape)
                    args.append(b.reshape(-1) if f else b)
                out_shape.append(jax.ShapeDtypeStruct(shape, b.dtype))
            out_b.append(_Binding(v.layout, v.dtype, tuple(tuple(b.shape) for b in v.buffers),
                                  tuple(np.dtype(b.dtype) for b in v.buffers), flat, tuple(slots)))
        names = tuple(sorted(syms))
        ranges, tables = {}, {}
        for v in list(inputs) + list(outputs):
            if isinstance(v, VTensor):
                for p in v.layout.pieces:
                    for s in p.map.syms:
                        if s.is_table:
                            tables[s.name] = tuple(s.shape)
                        else:   # the first range wins, as the first VTensor's value does (collect_syms)
                            ranges.setdefault(s.name, s.bounds)
        # a scalar symbol is passed as a (1,) array, an index table flattened (read by Load atoms)
        sym_args = [jnp.asarray(syms[k], jnp.int32).reshape(-1 if k in tables else 1) for k in names]
        # Inside a shard_map (check_vma): the outputs vary over every manual axis an input varies
        # over, and a buffer updated in place (aliased) is typed so too (compat.manual_axis_type)
        varying = frozenset().union(*(varying_axes(a) for a in (*args, *sym_args)))
        args = [vary(a, varying) if i in aliases else a for i, a in enumerate(args)]
        out_shape = [jax.ShapeDtypeStruct(s.shape, s.dtype, **manual_axis_type(varying)) for s in out_shape]
        read_whole = tuple(sorted(i for b, i in in_place_arg.items() if b in over))
        return Plan(tuple(in_b), tuple(out_b), names, tuple(ranges.get(k) for k in names),
                    tuple(args) + tuple(sym_args), tuple(out_shape), aliases, tuple(sorted(tables.items())),
                    read_whole)

    @property
    def n_args(self) -> int:
        return len(self.args)

    def refs(self, *refs: Any) -> tuple[list["VRef"], list["VRef"]]:
        """Group pallas_call refs back into one VRef per input and output VTensor."""
        n_in = self.n_args
        in_refs, out_refs = refs[:n_in], refs[n_in:]
        n_sym = len(self.sym_names)
        tables = dict(self.tables)
        sym_vals = {k: _TableRef(in_refs[n_in - n_sym + i], tables[k]) if k in tables
                    else _clamped(in_refs[n_in - n_sym + i][0], r)
                    for i, (k, r) in enumerate(zip(self.sym_names, self.sym_ranges))}
        ins = [VRef(b, tuple(in_refs[s] for s in b.slots), sym_vals) for b in self.inputs]
        outs = [VRef(b, tuple(out_refs[s] for s in b.slots), sym_vals) for b in self.outputs]
        return ins, outs

    def unflatten(self, results: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Per output VTensor, its physical buffers in their own shapes."""
        return [tuple(results[s].reshape(shape) for s, shape in zip(b.slots, b.shapes)) for b in self.outputs]

    def call(self, body: Callable[[list["VRef"], list["VRef"]], None], *, grid: tuple[int, ...],
             backend: str = "interpret", num_warps: int = 4, num_stages: int = 2,
             name: str | None = None) -> list[tuple[Any, ...]]:
        """Launch ``body(ins, outs)`` over ``grid``; returns ``unflatten`` of the results."""
        if backend not in ("interpret", "triton"):
            raise ValueError(f"backend must be 'interpret' or 'triton', got {backend!r}")
        if backend == "interpret" and any(varying_axes(a) for a in self.args):
            # jax's interpreter evaluates the body typed: varying blocks against its own invariant
            # indices and constants fail when it lowers (shard_map, check_vma=True): fail here,
            # where the cluster falls back, not in XLA's lowering of the whole program
            raise NotImplementedError("Pallas's interpreter cannot run a kernel on values that vary over "
                                      "shard_map's manual axes (check_vma=True)")

        def kernel(*refs: Any) -> None:
            ins, outs = self.refs(*refs)
            body(ins, outs)

        any_spec = pl.BlockSpec(memory_space=pl.ANY)
        res = pl.pallas_call(
            kernel, grid=grid, out_shape=self.out_shape,
            in_specs=[any_spec] * self.n_args, out_specs=[any_spec] * len(self.out_shape),
            input_output_aliases=self.input_output_aliases,
            compiler_params=compiler_params(num_warps, num_stages),
            interpret=backend == "interpret", name=name,
            # what the model of XLA and the compile's count charge it (primitives.kernel_reads_in_place)
            metadata={READS_IN_PLACE: ",".join(map(str, self.reads_in_place))} if self.reads_in_place else None,
        )(*self.args)
        return self.unflatten(res)


# --------------------------------------------------------------------------------------------
# In-kernel access
# --------------------------------------------------------------------------------------------

def _clamped(v: Any, bounds: tuple[int, int, int] | None) -> Any:
    """A scalar symbol read in the kernel, wrapped and clamped as its SymInfo says
    (``indexmap.normalise_start``; None: as passed)."""
    return v if bounds is None else normalise_start(v, bounds, jnp)


def _iota(block: Sequence[int], k: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, tuple(block), k)


@dataclass(frozen=True, eq=False)
class VRef:
    """A VTensor inside a kernel: its static layout, its buffer refs and the symbol values."""
    binding: _Binding
    refs: tuple[Any, ...]
    syms: dict[str, Any]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.binding.layout.shape

    def _env(self, origin: Sequence[Any], block: Sequence[int], proven: Sequence[bool] = ()
             ) -> tuple[dict[Atom, Any], Any]:
        """Index values of the block's lanes per logical dim, and the logical bounds mask: only
        along dims where ``origin + block <= size`` is not known (a static origin that fits, or a
        :class:`tiling.InBounds` origin, needs none)."""
        proven = tuple(proven) or (False,) * len(origin)
        idx = [jnp.asarray(o, jnp.int32) + _iota(block, k) for k, o in enumerate(origin)]
        inb = all_of([None if ok else
                      (i < n) if n < b or not isinstance(o, int) or o + b > n else None
                      for i, n, b, o, ok in zip(idx, self.shape, block, origin, proven)])
        lanes = None
        if any(isinstance(v, _TableRef) for v in self.syms.values()):
            lanes = [jnp.asarray(o, jnp.int32) + _iota(tuple(b if j == k else 1 for j, b in enumerate(block)), k)
                     for k, o in enumerate(origin)]
        return self._env_at(idx, lanes), inb

    def _env_at(self, idx: Sequence[Any], lanes: Sequence[Any] | None = None) -> dict[Atom, Any]:
        """The point of logical indices ``idx`` (int32 arrays that broadcast together). Index
        tables are read at ``lanes`` (each dim's indices, 1 along every other dim: a table entry
        indexed by a block's row is loaded once per row), by default at ``idx`` itself."""
        scalars = {k: v.astype(jnp.int32) for k, v in self.syms.items() if not isinstance(v, _TableRef)}
        at = point(idx, scalars)
        if len(scalars) < len(self.syms):
            tl = point(idx if lanes is None else lanes, scalars)
            for k, v in self.syms.items():
                if isinstance(v, _TableRef):
                    at[Sym(k)] = tl[Sym(k)] = _KernelTable(v.ref, v.shape, tl)
        return at

    def _piece_mask(self, p: Piece, env: dict[Atom, Any], inb: Any, block: Sequence[int]) -> Any:
        """The piece's lanes in this block (None: all). Conditions on runtime symbols alone (a
        concat piece picked by ``pos``) give a scalar: broadcast to the block."""
        m = p.holds(env, jnp, given=inb)
        return m if m is None or tuple(jnp.shape(m)) == tuple(block) else jnp.broadcast_to(m, tuple(block))

    def _strided_index(self, p: Piece, sb: Any, origin: Sequence[Any], block: Sequence[int],
                       env: dict[Atom, Any], starts: Any = None) -> tuple[Any, ...]:
        if starts is not None:   # a block-strided box: the first lane's index per target dim
            return tuple(pl.ds(jnp.asarray(st, jnp.int32), block[j] if j is not None else 1)
                         for (j, _, _), st in zip(sb, starts))
        bounds = p.map.bounds
        out = []
        for k, (j, _, off) in enumerate(sb):
            start = off.evaluate(env, jnp, bounds)
            if j is not None:
                out.append(pl.ds(jnp.asarray(start + origin[j], jnp.int32), block[j]))
            else:
                out.append(pl.ds(jnp.asarray(start, jnp.int32), 1))
        return tuple(out)

    def load(self, origin: Sequence[Any], block: Sequence[int], fill: float = 0.0, lanes: Any = None) -> jax.Array:
        """Stage 1: a ``block`` of the logical tensor at ``origin``; ``fill`` outside its shape,
        and outside ``lanes`` (a mask that broadcasts to the block; None: every lane) — lanes
        left out of the load itself, not selected after it (a load feeding a dot stays one)."""
        block = tuple(int(b) for b in block)
        origin, proven = _unwrap(origin)
        aligned = _aligned(origin, block, proven)
        env, inb = self._env(origin, block, proven)
        if lanes is not None:
            inb = all_of([inb, jnp.broadcast_to(lanes, block)])
        dtype = self.binding.dtype
        layout = self.binding.layout
        access = [self._access(p, origin, block, aligned) for p in layout.pieces]
        if len(layout.pieces) == 1 and all(_is_plus_zero(r.value) for r in layout.fills) and \
                _is_plus_zero(fill) and self._zeroes_masked_lanes(layout.pieces[0], block, access[0]):
            # The masked load itself reads +0 on exactly the masked lanes (a zero pad's border
            # included): nothing to merge, and no select waits on the loaded value (a prefetching
            # loop, ``tiling.fori_prefetch``, consumes it only in the next iteration).
            p = layout.pieces[0]
            return self._load_piece(p, origin, block, env, self._piece_mask(p, env, inb, block),
                                    access[0]).astype(dtype)
        result = jnp.full(block, fill, dtype)
        for r in reversed(layout.fills):   # borders of pads: the first region containing a lane wins
            rmask = r.holds(env, jnp, given=inb)
            result = jnp.full(block, r.value, dtype) if rmask is None else \
                jnp.where(rmask, jnp.asarray(r.value, dtype), result)
        for p, acc in zip(layout.pieces, access):
            mask = self._piece_mask(p, env, inb, block)
            val = self._load_piece(p, origin, block, env, mask, acc).astype(dtype)
            result = val if mask is None else jnp.where(mask, val, result)
        return result

    def _access(self, p: Piece, origin: Sequence[Any], block: tuple[int, ...], aligned: Sequence[bool]
                ) -> tuple[str, Any]:
        """How piece ``p`` is read/written for this block: ``("flat", None)`` (path 2),
        ``("box", (sb, starts))`` (path 1: the piece's own strided box, or one that holds for this
        block only, see :func:`_block_strided`), or ``("dims", None)`` (path 3)."""
        if self.binding.flat[p.target]:
            return "flat", None
        sb = _unit_strided(p)
        if sb is not None:
            return "box", (sb, None)
        bs = _block_strided(p, origin, block, aligned, self.syms)
        return ("box", bs) if bs is not None else ("dims", None)

    def _zeroes_masked_lanes(self, p: Piece, block: tuple[int, ...], access: tuple[str, Any]) -> bool:
        """Whether ``_load_piece``'s masked load alone gives what the merge with a zero fill would.

        It reads 0 on every lane outside its mask: always for a gather; for a strided box unless a
        block dim wider than 1 has no home in the buffer (a broadcast read, whose folded mask lets
        lanes outside the block's mask read the shared element). A strided box that is transposed
        in registers also keeps the select: without it XLA:CPU folds the transpose into a consuming
        dot, whose summation order then changes and interpret mode would no longer be bit-identical
        (on Triton the select is a few cheap ops next to a register transpose).
        """
        kind, box = access
        if kind != "box":
            return True
        sb = box[0]
        mapped = [j for j, _, _ in sb if j is not None]
        if any(b > 1 for k, b in enumerate(block) if k not in mapped):
            return False
        big = [j for j in mapped if block[j] > 1]   # target order of the dims that really move
        return big == sorted(big)

    def _load_piece(self, p: Piece, origin: Sequence[Any], block: tuple[int, ...], env: dict[Atom, Any],
                    mask: Any, access: tuple[str, Any]) -> jax.Array:
        ref = self.refs[p.target]
        kind, box = access
        sb = box[0] if kind == "box" else None
        if kind == "dims":   # unflattened buffer: per-dim indices
            idx = _dim_indices(p, env, self.binding.shapes[p.target], block)
            if mask is not None:
                idx = tuple(jnp.where(mask, i, 0) for i in idx)
            return _masked_load(ref.at[idx], mask)
        if sb is None:
            offs = _flat_offsets(p, env, self.binding.shapes[p.target], block)
            return _masked_load(ref.at[offs], mask)
        idx = self._strided_index(p, sb, origin, block, env, box[1])
        tmask = None if mask is None else _to_target_order(mask, sb, block)
        val = _masked_load(ref.at[idx], tmask)
        return _from_target_order(val, sb, block)

    def store(self, origin: Sequence[Any], block: Sequence[int], value: jax.Array) -> None:
        """Stage 3: write ``value`` (shape ``block``) at ``origin``; lanes outside the shape are dropped."""
        block = tuple(int(b) for b in block)
        origin, proven = _unwrap(origin)
        aligned = _aligned(origin, block, proven)
        env, inb = self._env(origin, block, proven)
        for p in self.binding.layout.pieces:
            box = p.box()
            hit = _box_hit(box, origin, block)
            if hit is False:
                continue

            def write(p: Piece = p) -> None:
                mask = self._piece_mask(p, env, inb, block)
                self._store_piece(p, origin, block, env, mask, value,
                                  self._access(p, origin, block, aligned))

            if hit is None:
                write()
            else:
                pl.when(hit)(write)

    def _store_piece(self, p: Piece, origin: Sequence[Any], block: tuple[int, ...], env: dict[Atom, Any],
                     mask: Any, value: jax.Array, access: tuple[str, Any]) -> None:
        ref = self.refs[p.target]
        val = value.astype(self.binding.dtypes[p.target])
        kind, box = access
        sb = box[0] if kind == "box" else None
        if kind == "dims":   # unflattened buffer: per-dim indices
            shape = self.binding.shapes[p.target]
            idx = _dim_indices(p, env, shape, block)
            if mask is not None:   # masked lanes point past the end along dim 0
                idx = (jnp.where(mask, idx[0], shape[0]),) + idx[1:]
            plgpu.store(ref.at[idx], val, mask=mask)
            return
        if sb is None:
            shape = self.binding.shapes[p.target]
            offs = _flat_offsets(p, env, shape, block)
            if mask is not None:
                offs = jnp.where(mask, offs, math.prod(shape))  # masked lanes point past the end
            plgpu.store(ref.at[offs], val, mask=mask)
            return
        idx = self._strided_index(p, sb, origin, block, env, box[1])
        if mask is not None:  # lanes folded together below: only the valid one may contribute
            val = jnp.where(mask, val, jnp.zeros((), val.dtype))
        tmask = None if mask is None else _to_target_order(mask, sb, block, fold_first=True)
        plgpu.store(ref.at[idx], _to_target_order(val, sb, block, fold_first=True), mask=tmask)


@dataclass(frozen=True, eq=False)
class _TableRef:
    """An index table inside a kernel: its flattened ref and its logical shape."""
    ref: Any
    shape: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class _KernelTable:
    """An index table as a :class:`Load` atom reads it in a kernel (``indexmap._read`` calls
    ``read``): the index is evaluated on ``lanes`` — each block dim's lane indices in a shape
    that is 1 along every other dim — so a table entry indexed by the block's row is loaded once
    per row, not once per element (``block_table[b, t floordiv page]`` for a K block of
    ``(1, 1, 64, 128)`` is 64 loads, broadcast along D)."""
    ref: Any
    shape: tuple[int, ...]
    lanes: dict[Atom, Any]

    def read(self, a: Load, bounds: Any) -> jax.Array:
        flat: Any = 0
        for e, n, st in zip(a.index, self.shape, row_major_strides(self.shape)):
            i = jnp.clip(jnp.asarray(e.evaluate(self.lanes, jnp, bounds), jnp.int32), 0, n - 1)
            flat = flat + i * st
        flat = jnp.asarray(flat, jnp.int32)
        v = self.ref[flat] if flat.ndim == 0 else plgpu.load(self.ref.at[flat])
        return finish_read(a, v.astype(jnp.int32), jnp)


# --------------------------------------------------------------------------------------------
# A pending row update, performed by a kernel that reads the buffer it updates
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UpdateSpec:
    """The static shape of ``buffer.at[index].set(rows)`` (whole windows at runtime indices), read
    off its write map: which buffer dims an index picks, which the window covers whole (and the
    rows' dim covering each), and the table of rows a kernel enumerates (a power-of-two block of
    the rows' index dims, 1 along the window)."""
    shape: tuple[int, ...]
    scattered: tuple[int, ...]
    kept: tuple[tuple[int, int], ...]
    row_dims: tuple[int, ...]
    row_block: tuple[int, ...]

    @property
    def n_rows(self) -> int:
        return math.prod(self.row_block)

    @staticmethod
    def of(dest: VTensor) -> "UpdateSpec":
        lay = dest.layout
        if len(lay.pieces) != 1 or lay.fills or lay.pieces[0].where:
            raise ValueError("an update's destination must be one piece onto its buffer")
        m = lay.pieces[0].map
        # the window: rows' dims landing whole on a buffer dim that no index depends on
        indexed = frozenset().union(*(e.dims() for e in m.exprs if _only_dim(e) is None))
        kept, scattered = [], []
        for j, e in enumerate(m.exprs):
            d = _only_dim(e)
            if d is not None and d not in indexed and m.domain[d] == m.target[j]:
                kept.append((j, d))
            else:
                scattered.append(j)
        window = {d for _, d in kept}
        if not scattered or len(window) != len(kept) or any(m.exprs[j].dims() & window for j in scattered) \
                or any(c.expr.dims() & window for c in m.conds):
            raise ValueError(f"not an update of whole windows at indices read per row: {m}")
        rows = tuple(j for j in range(len(m.domain)) if j not in window)
        block = tuple(1 if j in window else next_pow2(n) for j, n in enumerate(m.domain))
        return UpdateSpec(tuple(m.domain), tuple(scattered), tuple(kept), rows, block)


class OverlayError(ValueError):
    """A kernel cannot perform this :class:`Update` (its caller runs it before the kernel)."""


@dataclass(frozen=True, eq=False)
class Update:
    """``buffer.at[index].set(rows)`` still to be performed, by a kernel that reads ``buffer``.

    Why: where the new rows are program inputs (a serving step handed the new K/V rows of a paged
    or per-sequence cache), no kernel produces them to write them home, and XLA's in-place
    scatter is one more launch before the attention. The kernel reading the cache instead
    performs it: what it computes from its loads sees the rows (:class:`Overlay`, whatever order
    its programs run in)
    and its programs write them (:func:`land`) into the buffer, passed once and aliased
    (``Plan.build(over=...)``). ``rows``: the update, a physical array; ``dest``: a VTensor of the
    rows' shape whose one piece maps them onto the buffer (the scatter's write map, its index
    table a runtime symbol, its in-bounds condition the map's own)."""
    rows: Any
    dest: VTensor

    def __post_init__(self) -> None:
        if tuple(self.rows.shape) != tuple(self.dest.shape) or np.dtype(self.rows.dtype) != self.dest.dtype:
            raise ValueError(f"update rows {self.rows.dtype}{tuple(self.rows.shape)} do not match their "
                             f"destination {self.dest.dtype}{tuple(self.dest.shape)}")
        if np.dtype(self.dest.buffers[0].dtype) != self.dest.dtype or _is_fresh(self.dest.buffers[0]):
            raise ValueError("an update writes an existing buffer of its own dtype")
        object.__setattr__(self, "spec", UpdateSpec.of(self.dest))

    @property
    def buffer(self) -> Any:
        return self.dest.buffers[0]

    def flat_rows(self) -> VTensor:
        """The rows as the kernel reads them: flattened (a bitcast), gathered element-wise."""
        return VTensor.physical(jnp.reshape(self.rows, (-1,)))

    def pieces_reading(self, x: VTensor) -> tuple[int, ...]:
        """The pieces of ``x`` that read this update's buffer."""
        return tuple(k for k, p in enumerate(x.layout.pieces) if x.buffers[p.target] is self.buffer)

    def check_overlay(self, x: VTensor, piece: int, index_dims: Sequence[int], elem_dims: Sequence[int]) -> None:
        """Raise ValueError unless a kernel reading ``x`` in blocks that are 1 along every dim but
        ``index_dims`` and ``elem_dims`` can see this update through an :class:`Overlay`: which
        row lands on a lane does not depend on ``elem_dims``, which element of it not on
        ``index_dims``, and no condition of the piece on both."""
        p = x.layout.pieces[piece]
        ix, el = frozenset(index_dims), frozenset(elem_dims)
        on_rows = frozenset().union(*(p.map.exprs[j].dims() for j in self.spec.scattered))
        on_window = frozenset().union(*(p.map.exprs[j].dims() for j, _ in self.spec.kept))
        if on_rows & el or on_window & ix or any(c.expr.dims() & ix and c.expr.dims() & el
                                                 for c in p.where + p.map.conds):
            raise OverlayError(f"the update of this buffer cannot be seen per row of dims {sorted(ix)}: {p.map}")


def _row_table(dest: VRef, spec: UpdateSpec) -> tuple[list[jax.Array], jax.Array]:
    """Per row of the update (``spec.n_rows``, padded; row ``r`` is the rows' element at
    ``r``'s row-major index in ``spec.row_block``): its index along each scattered buffer dim, and
    whether it lands (inside the rows' shape, and its index in bounds: XLA drops the others)."""
    p = dest.binding.layout.pieces[0]
    block = spec.row_block
    env, inb = dest._env((0,) * len(block), block)
    coords = [jnp.broadcast_to(jnp.asarray(p.map.exprs[j].evaluate(env, jnp, p.map.bounds), jnp.int32),
                               block).reshape(-1) for j in spec.scattered]
    valid = all_of([inb, p.holds(env, jnp)])
    valid = jnp.ones((spec.n_rows,), jnp.bool_) if valid is None else jnp.broadcast_to(valid, block).reshape(-1)
    return coords, valid


@dataclass(frozen=True, eq=False)
class Overlay:
    """A pending :class:`Update` as a kernel reading the buffer sees it, block by block: which
    row lands on each lane (:meth:`hits`) and the rows' elements there (:meth:`at_lanes`), for
    piece ``piece`` of ``x``, which reads the buffer. The kernel folds the rows into what it computes from the block it
    loaded (the attention's scores and P·V, :func:`.flash.softmax_block`) rather than patching the
    block: a load that flows straight into a dot stays an asynchronous copy the loop pipelines
    (patched in registers, the decode kernel's K/V lost their ``cp.async`` stages).

    Legal where each lane's row depends on other dims than the window's elements do
    (:meth:`Update.check_overlay`): a K block's keys pick the row, its head dim the element."""
    x: "VRef"
    piece: int
    source: "VRef"   # the rows (flattened)
    dest: "VRef"
    spec: UpdateSpec

    def table(self) -> tuple[list[jax.Array], jax.Array]:
        """Where the rows land (:func:`_row_table`): read once per program, before its loop."""
        return _row_table(self.dest, self.spec)

    def hits(self, origin: Sequence[Any], block: Sequence[int], index_dims: Sequence[int],
             table: tuple[list[jax.Array], jax.Array] | None = None) -> jax.Array:
        """Per lane of ``block`` along ``index_dims`` (1 along the others): the row that lands
        there (the later of two), or -1 — none, or a lane outside the piece or the shape.
        ``table``: :meth:`table`, read once (else here)."""
        p = self.x.binding.layout.pieces[self.piece]
        block = tuple(int(b) for b in block)
        origin, _ = _unwrap(origin)
        red = tuple(b if k in index_dims else 1 for k, b in enumerate(block))
        n = math.prod(red)
        env, inb = self.x._env(origin, red)
        coords, valid = table if table is not None else self.table()
        R = self.spec.n_rows
        match = valid.reshape(1, R)
        for j, c in zip(self.spec.scattered, coords):
            kc = jnp.broadcast_to(jnp.asarray(p.map.exprs[j].evaluate(env, jnp, p.map.bounds), jnp.int32), red)
            match = match & (kc.reshape(n, 1) == c.reshape(1, R))
        best = jnp.max(jnp.where(match, jax.lax.broadcasted_iota(jnp.int32, (n, R), 1), -1), axis=1).reshape(red)
        el = frozenset(k for k, b in enumerate(block) if b > 1 and k not in index_dims)
        ours = [c for c in p.where + p.map.conds if not c.expr.dims() & el]
        lanes = all_of([inb, conds_mask(tuple(ours), env, jnp, p.map.bounds)])
        return best if lanes is None else jnp.where(jnp.broadcast_to(lanes, red), best, -1)

    def at_lanes(self, hits: jax.Array, origin: Sequence[Any], block: Sequence[int],
                 index_dims: Sequence[int]) -> jax.Array:
        """A ``block`` whose lanes hold the element of the row that lands there (``hits``, as
        :meth:`hits` returns it), 0 elsewhere: one gather from the rows, nothing from the buffer."""
        p = self.x.binding.layout.pieces[self.piece]
        block = tuple(int(b) for b in block)
        origin, _ = _unwrap(origin)
        wblock = tuple(1 if k in index_dims else b for k, b in enumerate(block))
        env, inb = self.x._env(origin, wblock)
        strides = row_major_strides(self.spec.shape)
        rstr = row_major_strides(self.spec.row_block)
        base = sum((((hits // rstr[j]) % self.spec.row_block[j]) * strides[j] for j in self.spec.row_dims),
                   jnp.zeros(hits.shape, jnp.int32))
        woff = sum((jnp.asarray(p.map.exprs[j].evaluate(env, jnp, p.map.bounds), jnp.int32) * strides[d]
                    for j, d in self.spec.kept), jnp.zeros(wblock, jnp.int32))
        el = frozenset(k for k, b in enumerate(block) if b > 1 and k not in index_dims)
        theirs = [c for c in p.where + p.map.conds if c.expr.dims() & el]
        mask = all_of([jnp.broadcast_to(hits >= 0, block), inb, conds_mask(tuple(theirs), env, jnp, p.map.bounds)])
        mask = jnp.broadcast_to(mask, block)
        return _masked_load(self.source.refs[0].at[jnp.where(mask, base + woff, 0)], mask)


def land(rows: VRef, dest: VRef, spec: UpdateSpec, pid: Any, nprog: int) -> None:
    """Write an update's rows home: program ``pid`` of ``nprog`` writes its share of the rows'
    elements (up to 1024 lanes a step). A row that a later row overwrites is not written: jax
    leaves which of two updates of one place lands unspecified, and the readers (:class:`Overlay`)
    take the later, so the buffer written and the values read agree."""
    E = math.prod(spec.shape)
    C = min(next_pow2(-(-E // nprog)), 1024)
    n_iter = -(-E // (nprog * C))
    coords, valid = _row_table(dest, spec)
    p = dest.binding.layout.pieces[0]
    strides = row_major_strides(spec.shape)
    rstr = row_major_strides(spec.row_block)
    R = spec.n_rows
    shape = dest.binding.shapes[0]

    def step(i: Any, carry: Any) -> Any:
        e = (i * nprog + pid) * C + jax.lax.broadcasted_iota(jnp.int32, (C,), 0)
        inb = e < E
        idx = [(e // st) % n for st, n in zip(strides, spec.shape)]
        env = dest._env_at(idx)
        r = sum((idx[j] * rstr[j] for j in spec.row_dims), jnp.zeros((C,), jnp.int32))
        later = (jax.lax.broadcasted_iota(jnp.int32, (C, R), 1) > r.reshape(C, 1)) & valid.reshape(1, R)
        for j, c in zip(spec.scattered, coords):
            lc = jnp.broadcast_to(jnp.asarray(p.map.exprs[j].evaluate(env, jnp, p.map.bounds), jnp.int32), (C,))
            later = later & (lc.reshape(C, 1) == c.reshape(1, R))
        shadowed = jnp.max(later.astype(jnp.int32), axis=1) > 0
        keep = jnp.broadcast_to(all_of([inb, p.holds(env, jnp), ~shadowed]), (C,))
        val = _masked_load(rows.refs[0].at[jnp.where(inb, e, 0)], inb)
        ref = dest.refs[0]
        if dest.binding.flat[0]:
            offs = _flat_offsets(p, env, shape, (C,))
            plgpu.store(ref.at[jnp.where(keep, offs, math.prod(shape))], val, mask=keep)
        else:   # masked lanes point past the end along dim 0
            di = _dim_indices(p, env, shape, (C,))
            plgpu.store(ref.at[(jnp.where(keep, di[0], shape[0]),) + di[1:]], val, mask=keep)
        return carry

    if n_iter == 1:
        step(0, 0)
    else:
        jax.lax.fori_loop(0, n_iter, step, 0)


def _has_loads(p: Piece) -> bool:
    return any(e.loads() for e in p.map.exprs) or any(c.expr.loads() for c in p.where + p.map.conds)


def _aligned(origin: Sequence[Any], block: Sequence[int], proven: Sequence[bool]) -> tuple[bool, ...]:
    """Per dim: the origin is known to be a multiple of the block (static, or InBounds)."""
    return tuple(ok or isinstance(o, int) and o % b == 0 for o, b, ok in zip(origin, block, proven))


def _only_dim(e: Expr) -> int | None:
    """``i`` when ``e`` is exactly ``d_i``."""
    if e.const == 0 and len(e.terms) == 1 and isinstance(e.terms[0][0], Dim) and e.terms[0][1] == 1:
        return e.terms[0][0].i
    return None


def _dim_plus(e: Expr, c: int) -> int | None:
    """``i`` when ``e`` is ``d_i + m*c`` (then ``e floordiv c = d_i floordiv c + m`` and
    ``e mod c = d_i mod c``: a piece of a concatenation at an offset that is a multiple of c)."""
    terms = e.terms
    if len(terms) == 1 and isinstance(terms[0][0], Dim) and terms[0][1] == 1 and e.const % c == 0:
        return terms[0][0].i
    return None


def _maybe_block_strided(p: Piece) -> bool:
    """Whether ``p`` may be a strided box for some blocks (:func:`_block_strided`): its only
    non-affine parts are ``d_i floordiv D`` / ``d_i mod D`` (a contiguous merge of dims, e.g.
    ``(B, 1, H, D) -> (B, H*D)``). Its buffer is then not flattened; blocks that do not qualify
    take path 3 (per-dim indices) on the unflattened buffer."""
    if p.map.conds or _has_loads(p):
        return False
    found = False
    for e in p.map.exprs:
        for a, _ in e.terms:
            if isinstance(a, (FloorDiv, Mod)):
                if _dim_plus(a.expr, a.c) is None:
                    return False
                found = True
    return found


def _sdiv(x: Any, c: int) -> Any:
    return x // c if isinstance(x, int) else jax.lax.div(x, jnp.int32(c))


def _srem(x: Any, c: int) -> Any:
    return x % c if isinstance(x, int) else jax.lax.rem(x, jnp.int32(c))


def _block_strided(p: Piece, origin: Sequence[Any], block: Sequence[int], aligned: Sequence[bool],
                   syms: dict[str, Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """A strided box that holds for this block only: ``(sb, starts)`` or None.

    Within a block, a dim of block 1 is a scalar (its origin), and ``d_i floordiv D`` /
    ``d_i mod D`` (also ``(d_i + m*D) floordiv/mod D``, a concatenated piece) with
    ``D % block_i == 0`` and an origin that is a multiple of ``block_i`` are a scalar and
    ``o_i mod D + lane``: a contiguous merge ``(H, D) -> H*D`` read or written in
    blocks of at most ``D`` is a ``pl.ds`` window, not a gather with per-lane ``//`` and ``%``.
    Every target index must then be ``start + lane`` of at most one block dim (stride +1, each
    block dim used once). ``starts`` are the first lane's indices. The piece's own conditions
    (which part of a concatenation) must not split a block, so a block is wholly in the piece —
    its first lane maps to valid, non-negative indices — or wholly masked, where the start is
    clamped to 0 (interpret mode clamps ``pl.ds`` starts; the GPU touches no masked lane).
    """
    if p.map.conds or _has_loads(p):
        return None
    for c in p.where:
        if all(block[d] == 1 for d in c.expr.dims()):
            continue
        i = _only_dim(c.expr)
        if i is None or not aligned[i] or c.lo % block[i] or c.hi % block[i]:
            return None

    def scalar(a: Atom) -> Any:   # an atom of block-1 dims and symbols: its value at the origin
        used = a.expr.symbols()
        at = point(origin, {k: v.astype(jnp.int32) for k, v in syms.items() if k in used})
        return Expr.of(a).evaluate(at, jnp, p.map.bounds)

    sb, starts, used = [], [], set()
    for e in p.map.exprs:
        lane, start = None, e.const
        for a, k in e.terms:
            if isinstance(a, Dim):
                i = a.i
                if block[i] > 1:
                    if k != 1 or lane is not None:
                        return None
                    lane = i
                start = start + k * origin[i]
            elif isinstance(a, Sym):
                start = start + k * syms[a.name].astype(jnp.int32)
            else:
                if all(block[d] == 1 for d in a.expr.dims()):
                    start = start + k * scalar(a)
                    continue
                i = _dim_plus(a.expr, a.c)
                if i is None or not aligned[i] or a.c % block[i]:
                    return None
                if isinstance(a, FloorDiv):
                    start = start + k * (_sdiv(origin[i], a.c) + a.expr.const // a.c)
                else:
                    if k != 1 or lane is not None:
                        return None
                    lane = i
                    start = start + _srem(origin[i], a.c)
        if lane is not None:
            if lane in used:
                return None
            used.add(lane)
        sb.append((lane, 1, None))
        starts.append(max(start, 0) if isinstance(start, int) else jnp.maximum(start, 0))
    return tuple(sb), tuple(starts)


def _unwrap(origin: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
    """(plain origins, which were :class:`tiling.InBounds`)."""
    return (tuple(o.value if isinstance(o, InBounds) else o for o in origin),
            tuple(isinstance(o, InBounds) for o in origin))


def _is_plus_zero(x: Any) -> bool:
    """A static fill of +0 (what a masked load's ``other`` gives; -0.0 and traced fills are not)."""
    if not isinstance(x, (bool, int, float, np.integer, np.floating)):
        return False
    return float(x) == 0.0 and math.copysign(1.0, float(x)) > 0


def _masked_load(ref: Any, mask: Any) -> jax.Array:
    """``other`` carries the ref's dtype: an int 0 for a bool ref breaks the interpreter's select."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=np.zeros((), ref.dtype).item())


_WIDE_ELEMENTS = 2 ** 31   # buffers this large are never flattened (int32 flat offsets overflow)
_I32 = 2 ** 31


def _check_index_width(shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raise where a kernel's index arithmetic would wrap: a dim of 2^31 elements or more (vio's
    per-dim indices are int32), or a buffer the Pallas lowering still addresses with i32 offsets
    although its last element's offset is 2^31 or more (it switches to i64 above 2^32 *bytes*: a
    1-byte dtype with more than 2^31 elements). The offsets are of elements, signed: a 16-bit
    buffer of exactly 2^31 elements (2^32 bytes, a bf16 KV cache of 64 x 16,384 x 8 x 256) is
    addressed in i32 up to 2^31 - 1, which fits."""
    n = math.prod(shape)
    if any(d >= _I32 for d in shape):
        raise NotImplementedError(f"buffer {shape}: a dim of 2^31 elements or more cannot be "
                                  "indexed by a Pallas Triton kernel (int32 indices)")
    if n > _I32 and n * dtype.itemsize <= 2 ** 32:
        raise NotImplementedError(
            f"buffer {shape} {dtype} has {n} > 2^31 elements but only {n * dtype.itemsize} bytes: "
            "the Pallas Triton lowering would address it with wrapping 32-bit offsets")


def _dim_indices(p: Piece, env: dict[Atom, Any], shape: Sequence[int], block: Sequence[int]
                 ) -> tuple[jax.Array, ...]:
    """One int32 index array per buffer dim (each < that dim's size), broadcast to the block."""
    return p.map.targets(env, jnp, each=lambda t: jnp.broadcast_to(jnp.asarray(t, jnp.int32), tuple(block)))


def _flat_offsets(p: Piece, env: dict[Atom, Any], shape: Sequence[int], block: Sequence[int]) -> jax.Array:
    """The block's flat offsets into the flattened buffer (path 2): the algebra's own
    :meth:`IndexMap.flat_offsets` on the block's int32 lane indices, accumulated from an int32
    block of zeros (``Plan.build`` flattens only buffers below 2^31 elements, so no lane
    overflows)."""
    off = p.map.flat_offsets(env, jnp, row_major_strides(shape), jnp.zeros(tuple(block), jnp.int32))
    return jnp.broadcast_to(off, tuple(block)).astype(jnp.int32)


def _box_hit(box: Any, origin: Sequence[Any], block: Sequence[int]) -> Any:
    """Whether the block meets the piece's static box: True/False when static, traced otherwise."""
    if box is None:
        return None
    conds = []
    for (lo, hi), o, b in zip(box, origin, block):
        if isinstance(o, int):
            if o >= hi or o + b <= lo:
                return False
            continue
        conds.append((o < hi) & (o + b > lo))
    return all_of(conds)


def _to_target_order(x: jax.Array, sb: Any, block: Sequence[int], fold_first: bool = False) -> jax.Array:
    """Rearrange a block from virtual dim order into the buffer's dim order (size 1 for unmapped).

    Virtual dims with no physical home are folded away. Masks fold with a max (a physical
    element is touched if any virtual lane that maps to it is valid: broadcast reads). Stored
    values (``fold_first``) fold with a sum: a one-to-one layout only leaves a dim unmapped where
    at most one lane per physical element is valid, and the caller zeroed the others — a masked
    sum, since value-level slices do not lower on Triton.
    """
    mapped = [j for j, _, _ in sb if j is not None]
    extra = tuple(k for k in range(len(block)) if k not in mapped)
    wide = tuple(k for k in extra if block[k] > 1)  # only these need folding; size-1 ones reshape away
    if wide:
        if x.dtype == jnp.bool_:
            x = jnp.max(x.astype(jnp.int32), axis=wide, keepdims=True) > 0
        elif fold_first:
            x = jnp.sum(x, axis=wide, keepdims=True).astype(x.dtype)
        elif x.dtype == jnp.bool_:
            x = jnp.max(x.astype(jnp.int32), axis=wide, keepdims=True) > 0
        else:
            raise ValueError("a stored block dim has no home in the buffer")
    if extra:
        x = x.reshape([b for k, b in enumerate(x.shape) if k not in extra])
    kept = sorted(mapped)
    x = _permute(x, [kept.index(j) for j in mapped])
    return x.reshape([block[j] if j is not None else 1 for j, _, _ in sb])


def _permute(x: jax.Array, perm: Sequence[int]) -> jax.Array:
    """Transpose, but as a free reshape when only size-1 dims move (a real in-register transpose
    of a 3-D/4-D tile goes through local memory in Triton and costs registers and spills)."""
    if list(perm) == list(range(len(perm))):
        return x
    big = [p for p in perm if x.shape[p] > 1]
    if big == sorted(big):
        return x.reshape([x.shape[p] for p in perm])
    return jnp.transpose(x, perm)


def _from_target_order(val: jax.Array, sb: Any, block: Sequence[int]) -> jax.Array:
    """Inverse of ``_to_target_order`` for loads: transpose back and broadcast unmapped dims."""
    mapped = [j for j, _, _ in sb if j is not None]
    x = val.reshape([block[j] for j in mapped])
    kept = sorted(mapped)
    x = _permute(x, [mapped.index(j) for j in kept])
    shape = [block[k] if k in mapped else 1 for k in range(len(block))]
    return jnp.broadcast_to(x.reshape(shape), tuple(block))
