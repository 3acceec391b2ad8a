"""Stage 3: the virtual-tensor rules of each data-movement primitive (paper §4.4, Algorithm 1's VTRules).

``rules(op, graph)`` lists the VTOG edges one movement op offers: ``src ⇢ dst`` means "src can be
made a virtual tensor of dst by eliminating only this op". Every map is built with the
:mod:`indexmap` movement methods (never by hand), maps *src* indices to *dst* indices, and its
profitability class comes from its contiguity (paper §4.3: full contiguity is Type I, always
profitable; anything else is Type II, for the cost model to decide):

* the direction is ``read`` when src is the op's output (its consumers read through the map) and
  ``write`` when src is an input (its producer writes through the map);
* broadcasts, pads and repeat-gathers are read side only (one-to-one restriction, paper §4.1);
* a transpose/rev that keeps the innermost dim in place is Type I when each run still covers a
  32-byte sector (paper: partial contiguity "does not break the minimal transfer granularity");
* a piece of a concat/split is Type I only if the piece is itself one row-major run of src.

Runtime starts (dynamic_slice, dynamic_update_slice) become symbols named ``s{tensor id}`` whose
value is the start *after* lax's clamping to ``[0, dim - size]``; the SymInfo carries that range.
Starts that are compile-time constants (also when computed from constants) are folded.

A gather whose indices are computed from a runtime integer table (a paged KV cache's
``pages[block_table[:, t // page], t % page]``) maps through :class:`indexmap.Load` atoms: the
index computation is probed with coded tables (:func:`_probe_indices`), which tells which index
coordinates read which table element and how a negative entry is normalised; indices computed
from input tables by more than views (a page write at ``block_table[b, (len[b] - 1) // page]``)
are read from the index array XLA computes (:func:`_computed_table`). A scatter of whole rows at
such indices (a cache row per sequence at its own position, a page write) is an in-place update
whose rows are written through the same atoms, where the index is in bounds (:func:`_scatter`).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from .graph import Graph, Op
from .indexmap import Cond, Dim, Expr, IndexMap, Layout, Load, SymInfo, const, dim, sym
from .primitives import CONTROL_FLOW, Direction, EdgeClass

__all__ = ["Edge", "rules", "explain_no_edges", "static_value", "RULES"]

SECTOR_BYTES = 32          # a partially contiguous run covers at least one 32-byte sector
STATIC_FOLD_LIMIT = 1 << 16  # fold compile-time-constant tensors up to this many elements
PROBE_LIMIT = 1 << 23        # largest index computation probed with coded tables (elements)
TABLE_LIMIT = 1 << 22        # largest runtime index table a kernel reads
# ops a value read from an index table may pass through on its way to a gather's indices: views
# (with static indices/starts), integer casts, and jnp's normalisation of negative indices
# (``where(v < 0, v + n, v)``). With these alone the index is ``v`` or ``v + c`` on each side of
# 0, so two probes (non-negative and negative codes) determine it for every table value.
_TABLE_VIEWS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "concatenate",
                          "slice", "transpose", "gather", "copy", "copy_p", "dynamic_slice"})


@dataclass(frozen=True)
class Edge:
    src: int              # tensor that becomes virtual
    dst: int              # tensor it points to
    op: int               # the movement op eliminated
    primitive: str
    direction: Direction  # READ (src is the op's output) | WRITE (src is an input)
    box: tuple[tuple[int, int], ...]  # the part of src's index space this edge covers
    map: IndexMap         # src index -> dst index, domain = src.shape (meaningful inside box)
    klass: EdgeClass      # I (always profitable) | II (the cost model decides)
    inplace: bool = False  # dynamic_update_slice out ⇢ operand: needs the legality check
    note: str = ""        # why this class (for the report)


class NoEdges(Exception):
    """Raised by a rule that offers no edge; the message is the reason shown in the report."""


class NotMovement(NoEdges):
    """Raised by a rule whose op turns out not to move data (a dtype-changing convert)."""


# --------------------------------------------------------------------------------------------
# Rule context: what every rule needs, so each rule is a few lines
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Ctx:
    op: Op
    graph: Graph

    @property
    def x(self) -> int:
        return self.op.inputs[0]

    @property
    def y(self) -> int:
        return self.op.outputs[0]

    @property
    def p(self):
        return self.op.params

    def shape(self, t: int) -> tuple[int, ...]:
        return self.graph.tensors[t].shape

    def ident(self, t: int) -> IndexMap:
        return IndexMap.identity(self.shape(t))

    def start(self, t: int, dim: int, size: int) -> tuple[Expr, tuple[SymInfo, ...]]:
        """A dynamic start as lax uses it: clamped to ``[0, dim - size]``; a symbol unless static."""
        v = static_value(t, self.graph)
        if v is not None:
            return const(int(np.clip(int(v), 0, dim - size))), ()
        t = self.graph.same_value(t)   # one symbol for one value (jax recomputes index normalisation)
        raw = _wrapped_start(t, dim, self.graph)
        if raw is not None:   # the kernels wrap and clamp the raw index: no XLA launch for a scalar
            name = f"s{raw}w{dim}"
            return sym(name), (SymInfo(name, 0, dim - size, source=raw, wrap=dim),)
        name = f"s{t}"
        return sym(name), (SymInfo(name, 0, dim - size, source=t),)

    def starts(self, ts, dims, sizes) -> tuple[list[Expr], tuple[SymInfo, ...]]:
        pairs = [self.start(t, d, s) for t, d, s in zip(ts, dims, sizes)]
        return [e for e, _ in pairs], tuple(s for _, ss in pairs for s in ss)

    def edge(self, src: int, dst: int, m: IndexMap, box=None, *, innermost: bool = False,
             klass: str | None = None, note: str = "", inplace: bool = False) -> Edge:
        full = tuple((0, n) for n in self.shape(src))
        box = full if box is None else tuple(box)
        if klass is None:
            klass, note = _classify(m, box, self.graph.tensors[src].dtype.itemsize, innermost)
        return Edge(src, dst, self.op.id, self.op.primitive, Direction.READ if src in self.op.outputs else Direction.WRITE,
                    box, m, klass, inplace, note)

    def pair(self, out_to_in: IndexMap, in_to_out: IndexMap, innermost: bool = False) -> tuple[Edge, ...]:
        """The two edges of a bijective movement op (out ⇢ in read, in ⇢ out write)."""
        return (self.edge(self.y, self.x, out_to_in, innermost=innermost),
                self.edge(self.x, self.y, in_to_out, innermost=innermost))


def _box_run(box, shape) -> int:
    """Length of the row-major runs a box makes in a tensor of ``shape`` (box volume if one run)."""
    run = 1
    for (lo, hi), n in reversed(list(zip(box, shape))):
        run *= hi - lo
        if hi - lo != n:
            break
    return run


def _classify(m: IndexMap, box, itemsize: int, innermost: bool) -> tuple[EdgeClass, str]:
    shape = m.domain
    whole = all(b == (0, n) for b, n in zip(box, shape))
    c = (m if whole else m.restrict(box)).contiguity(itemsize)
    vol = math.prod(hi - lo for lo, hi in box)
    if not whole and _box_run(box, shape) != vol:
        run = min(c.run_elems, _box_run(box, shape)) * itemsize
        return EdgeClass.II, f"piece is a strided slab of src ({run} B runs)"
    if c.full:
        return EdgeClass.I, "fully contiguous"
    if innermost and c.run_elems > 1 and c.partial(SECTOR_BYTES):
        return EdgeClass.I, f"innermost dim kept ({c.run_bytes} B runs)"
    why = "masked (pad) " if m.conds else ""
    return EdgeClass.II, f"{why}min contiguous dim {c.min_contiguous_dim}, {c.run_bytes} B runs"


def _inverse(perm) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for k, p in enumerate(perm):
        inv[p] = k
    return tuple(inv)


def _norm(dims, rank: int) -> tuple[int, ...]:
    return tuple(int(d) % rank for d in dims)


# --------------------------------------------------------------------------------------------
# Compile-time constants (pad values, static starts, gather indices)
# --------------------------------------------------------------------------------------------

_STATIC: "weakref.WeakKeyDictionary[Graph, dict[int, np.ndarray | None]]" = weakref.WeakKeyDictionary()


def _wrapped_start(t: int, dim: int, graph: Graph) -> int | None:
    """``x`` when ``t`` is lax's normalisation of a dynamic start ``x`` against a dim of ``dim``
    (``select_n(x < 0, x, x + dim)``, what ``lax.dynamic_slice``/``dynamic_update_slice`` trace for
    a traced index), else None."""
    op = graph.producer(t)
    if op is None or op.primitive != "select_n" or len(op.inputs) != 3:
        return None
    pred, wrapped = graph.producer(op.inputs[0]), graph.producer(op.inputs[2])
    x = _uncast(op.inputs[1], graph)   # select_n(p, on_false, on_true)
    if pred is None or pred.primitive != "lt" or wrapped is None or wrapped.primitive != "add":
        return None
    zero = static_value(pred.inputs[1], graph)
    if _uncast(pred.inputs[0], graph) != x or zero is None or zero.shape != () or int(zero) != 0:
        return None
    a, b = (_uncast(u, graph) for u in wrapped.inputs)
    other = b if a == x else a if b == x else None
    c = None if other is None else static_value(other, graph)
    if c is None or c.shape != () or int(c) != dim:
        return None
    return x


def _uncast(t: int, graph: Graph) -> int:
    """``t``'s value behind casts that keep its dtype (jax's weak-type ``convert_element_type``),
    as :meth:`Graph.same_value` names it."""
    while True:
        op = graph.producer(t)
        if op is None or op.primitive != "convert_element_type" or \
                graph.tensors[op.inputs[0]].dtype != graph.tensors[t].dtype:
            return graph.same_value(t)
        t = op.inputs[0]


def static_value(t: int, graph: Graph) -> np.ndarray | None:
    """The value of tensor ``t`` if it is a compile-time constant (a literal, or computed from
    literals by small side-effect-free ops, e.g. ``jnp.take``'s index normalisation), else None."""
    memo = _STATIC.setdefault(graph, {})
    if t not in memo:
        memo[t] = _fold(t, graph)
    return memo[t]


def _fold(t: int, graph: Graph) -> np.ndarray | None:
    info = graph.tensors[t]
    if info.const is not None:
        return np.asarray(info.const)
    op = graph.producer(t)
    if (op is None or info.size > STATIC_FOLD_LIMIT or op.primitive in CONTROL_FLOW
            or any(k in op.primitive for k in ("callback", "rng", "random"))):
        return None
    vals = [static_value(i, graph) for i in op.inputs]
    if any(v is None for v in vals):
        return None
    try:
        with jax.ensure_compile_time_eval():
            outs = op.bind(*vals)
    except Exception:  # noqa: BLE001 - anything that does not fold is simply not static
        return None
    outs = outs if op.prim.multiple_results else (outs,)
    return np.asarray(outs[op.outputs.index(t)])


# --------------------------------------------------------------------------------------------
# One rule per primitive
# --------------------------------------------------------------------------------------------

def _transpose(c: _Ctx) -> tuple[Edge, ...]:
    perm = c.p["permutation"]
    return c.pair(c.ident(c.x).transpose(perm), c.ident(c.y).transpose(_inverse(perm)), innermost=True)


def _reshape(c: _Ctx) -> tuple[Edge, ...]:
    dims, xs, ys = c.p.get("dimensions"), c.shape(c.x), c.shape(c.y)
    if dims is None:
        return c.pair(c.ident(c.x).reshape(ys), c.ident(c.y).reshape(xs))
    moved = tuple(xs[d] for d in dims)  # lax: reshape(transpose(x, dimensions), new_sizes)
    return c.pair(c.ident(c.x).transpose(dims).reshape(ys),
                  c.ident(c.y).reshape(moved).transpose(_inverse(dims)), innermost=True)


def _squeeze(c: _Ctx) -> tuple[Edge, ...]:
    dims = _norm(c.p["dimensions"], len(c.shape(c.x)))
    return c.pair(c.ident(c.x).squeeze(dims), c.ident(c.y).expand_dims(dims))


def _broadcast_in_dim(c: _Ctx) -> tuple[Edge, ...]:
    if len(c.op.inputs) != 1:
        raise NoEdges("broadcast_in_dim with dynamic shape operands")
    xs, ys = c.shape(c.x), c.shape(c.y)
    if math.prod(xs) == math.prod(ys):  # only inserts size-1 dims: an expand_dims, a reshape
        return c.pair(c.ident(c.x).reshape(ys), c.ident(c.y).reshape(xs))
    m = c.ident(c.x).broadcast(ys, c.p["broadcast_dimensions"])
    return (c.edge(c.y, c.x, m, klass=EdgeClass.II, note="broadcast: repeated reads, read side only"),)


def _slice(c: _Ctx) -> tuple[Edge, ...]:
    m = c.ident(c.x).slice(c.p["start_indices"], c.p["limit_indices"], c.p["strides"])
    return (c.edge(c.y, c.x, m),)


def _dynamic_slice(c: _Ctx) -> tuple[Edge, ...]:
    sizes = c.p["slice_sizes"]
    starts, syms = c.starts(c.op.inputs[1:], c.shape(c.x), sizes)
    return (c.edge(c.y, c.x, c.ident(c.x).dynamic_slice(starts, sizes, syms)),)


def _dynamic_update_slice(c: _Ctx) -> tuple[Edge, ...]:
    upd = c.op.inputs[1]
    starts, syms = c.starts(c.op.inputs[2:], c.shape(c.x), c.shape(upd))
    return (c.edge(c.y, c.x, c.ident(c.x), klass=EdgeClass.I, inplace=True,
                   note="in place: out is operand's buffer after the update (legality check)"),
            c.edge(upd, c.y, c.ident(c.y).dynamic_slice(starts, c.shape(upd), syms)))


def _slabs(c: _Ctx, whole: int, parts, axis: int, stacked: bool) -> tuple[Edge, ...]:
    """concatenate/stack (whole = out) and split/unstack (whole = in): whole ⇢ each part
    piecewise (box = the part's slab), and each part ⇢ whole (a window of whole)."""
    lays = [Layout.physical(t, c.shape(t)) for t in parts]
    lays = [l.expand_dims([axis]) for l in lays] if stacked else lays
    pieces = Layout.concatenate(lays, axis).pieces
    edges = [c.edge(whole, p.target, p.map, p.box()) for p in pieces]
    off = 0
    for t, l in zip(parts, lays):
        m = c.ident(whole).offset(axis, off, l.shape[axis])
        edges.append(c.edge(t, whole, m.squeeze([axis]) if stacked else m))
        off += l.shape[axis]
    return tuple(edges)


def _concatenate(c: _Ctx) -> tuple[Edge, ...]:
    return _slabs(c, c.y, c.op.inputs, c.p["dimension"], stacked=False)


def _split(c: _Ctx) -> tuple[Edge, ...]:
    return _slabs(c, c.x, c.op.outputs, c.p["axis"], stacked=False)


def _stack(c: _Ctx) -> tuple[Edge, ...]:
    return _slabs(c, c.y, c.op.inputs, c.p["axis"] % len(c.shape(c.y)), stacked=True)


def _unstack(c: _Ctx) -> tuple[Edge, ...]:
    return _slabs(c, c.x, c.op.outputs, c.p["axis"] % len(c.shape(c.x)), stacked=True)


def _rev(c: _Ctx) -> tuple[Edge, ...]:
    dims = c.p["dimensions"]
    return c.pair(c.ident(c.x).rev(dims), c.ident(c.y).rev(dims), innermost=True)


def _pad(c: _Ctx) -> tuple[Edge, ...]:
    fill = static_value(c.op.inputs[1], c.graph)
    if fill is None:
        raise NoEdges("pad value is computed at runtime (a mask needs a compile-time fill)")
    lo, hi, interior = zip(*c.p["padding_config"]) if c.p["padding_config"] else ((), (), ())
    m = c.ident(c.x).pad(lo, hi, interior, fill.item())
    return (c.edge(c.y, c.x, m),)


def _copy(c: _Ctx) -> tuple[Edge, ...]:
    return c.pair(c.ident(c.x), c.ident(c.y))


def _convert_element_type(c: _Ctx) -> tuple[Edge, ...]:
    if c.graph.tensors[c.x].dtype != c.graph.tensors[c.y].dtype:
        raise NotMovement("convert_element_type changes the dtype: compute, not movement")
    return _copy(c)


def _device_put(c: _Ctx) -> tuple[Edge, ...]:
    if any(d is not None for d in c.p.get("devices", ())):
        raise NoEdges("device_put to an explicit device")
    return tuple(e for x, y in zip(c.op.inputs, c.op.outputs)
                 for e in (c.edge(y, x, c.ident(x)), c.edge(x, y, c.ident(y))))


def _sharding_constraint(c: _Ctx) -> tuple[Edge, ...]:
    """``jax.lax.with_sharding_constraint`` (``jax.sharding.reshard``: ``dst_sharding``) on one
    device: the identity (XLA drops the annotation), so both sides may live in the other's buffer.
    Across devices it may reshard: no edge."""
    sharding = c.p.get("sharding", c.p.get("dst_sharding"))
    n = getattr(getattr(sharding, "mesh", None), "size", None)   # a mesh, concrete or abstract
    if n is None:
        devices = getattr(sharding, "device_set", None)
        n = None if devices is None else len(devices)
    if n != 1:
        raise NoEdges(f"{c.op.primitive} across devices (a resharding)")
    return _copy(c)


def _gather(c: _Ctx) -> tuple[Edge, ...]:
    """``x[..., idx, ...]`` / ``jnp.take`` with static indices forming ``i0 + st*(j // r)``: a
    strided slice (r = 1) or a repeat (r > 1, read side only) along one axis."""
    dn, xs = c.p["dimension_numbers"], c.shape(c.x)
    idx = static_value(c.op.inputs[1], c.graph)
    if idx is None:
        return _indirect_gather(c)
    (a,) = dn.start_index_map if len(dn.start_index_map) == 1 else (None,)
    sizes = tuple(1 if j == a else n for j, n in enumerate(xs))
    if (a is None or tuple(dn.collapsed_slice_dims) != (a,) or dn.operand_batching_dims
            or tuple(c.p["slice_sizes"]) != sizes or idx.shape[-1:] != (1,)):
        raise NoEdges("gather is not a take along one axis")
    batch, v = idx.shape[:-1], idx.reshape(-1).astype(np.int64)
    if "CLIP" in str(c.p["mode"]):
        v = np.clip(v, 0, xs[a] - 1)
    if v.size == 0 or v.min() < 0 or v.max() >= xs[a]:
        raise NoEdges("gather indices empty or out of bounds")
    r = int(np.argmax(v != v[0])) or v.size  # length of the first run of equal indices
    n, mm = v.size, -(-v.size // r)
    st = int(v[r] - v[0]) if mm > 1 else 1
    if st == 0 or not np.array_equal(v, v[0] + st * (np.arange(n) // r)):
        raise NoEdges("gather indices are not a strided run or a repeat")
    m, i0 = c.ident(c.x), int(v[0])
    if st < 0:
        m, i0, st = m.rev([a]), xs[a] - 1 - i0, -st
    shp = list(xs)
    lo, hi, step = [0] * len(xs), list(xs), [1] * len(xs)
    lo[a], hi[a], step[a] = i0, i0 + (mm - 1) * st + 1, st
    m = m.slice(lo, hi, step)
    if r > 1:  # repeat each index r times: expand, broadcast, merge, trim
        shp[a] = mm
        m = m.expand_dims([a + 1]).broadcast(shp[:a + 1] + [r] + shp[a + 1:], range(len(xs) + 1))
        shp[a] = mm * r
        m = m.reshape(shp)
        if mm * r != n:
            shp[a] = n
            m = m.slice([0] * len(xs), shp)
    shp[a:a + 1] = batch
    m = m.reshape(shp)  # the gathered axis becomes the index batch dims
    # output dims: offset_dims hold x's other dims in order, the rest the batch dims in order
    rest = [j if j < a else j + len(batch) - 1 for j in range(len(xs)) if j != a]
    bdims = iter(range(a, a + len(batch)))
    perm = [rest[dn.offset_dims.index(o)] if o in dn.offset_dims else next(bdims)
            for o in range(len(c.shape(c.y)))]
    m = m.transpose(perm)
    if r > 1:
        return (c.edge(c.y, c.x, m, klass=EdgeClass.II, note="repeat-gather: repeated reads, read side only"),)
    return (c.edge(c.y, c.x, m),)


def _indirect_gather(c: _Ctx) -> tuple[Edge, ...]:
    """``x[idx]`` with whole-row slices at indices computed from a runtime integer table: the
    output reads ``x`` through :class:`Load` atoms (read side only: a gather may repeat rows).
    Each index coordinate is either table-independent (an expression of the output's batch
    dims, found from its values) or one table element, wrapped if negative as jnp normalises it
    and clamped as XLA clamps a gather's starts (``PROMISE_IN_BOUNDS``/``CLIP``; a gather that
    fills out-of-bounds rows is declined: the map has no fill that depends on a table)."""
    dn, xs, t_idx = c.p["dimension_numbers"], c.shape(c.x), c.op.inputs[1]
    a_dims = tuple(dn.start_index_map)
    if (dn.operand_batching_dims or sorted(dn.collapsed_slice_dims) != sorted(a_dims)
            or tuple(c.p["slice_sizes"]) != tuple(1 if j in a_dims else n for j, n in enumerate(xs))
            or c.shape(t_idx)[-1:] != (len(a_dims),)):
        raise NoEdges("gather indices are not a compile-time constant (and not whole rows at table-read indices)")
    if "FILL" in str(c.p["mode"]):
        raise NoEdges("gather fills out-of-bounds rows at runtime indices")
    table, coords = _probe_indices(t_idx, c.graph)
    tinfo = c.graph.tensors[table]
    name = f"t{table}"
    batch = c.shape(t_idx)[:-1]
    y_shape = c.shape(c.y)
    offset_dims = tuple(dn.offset_dims)
    batch_y = [o for o in range(len(y_shape)) if o not in offset_dims]
    b = {Dim(i): (0, n - 1) for i, n in enumerate(y_shape)}
    to_y = {Dim(j): dim(o) for j, o in enumerate(batch_y)}
    kept = iter(offset_dims)
    exprs = []
    for j, n in enumerate(xs):
        if j not in a_dims:
            exprs.append(dim(next(kept)))
            continue
        k = a_dims.index(j)
        kind, val = coords[k]
        if kind == "static":
            e = _fit(np.clip(val, 0, n - 1))
        else:
            e = Expr.of(Load(name, _table_index(val, tinfo.shape, to_y, b, "gather"), 0, n - 1, kind))
        if e is None:
            raise NoEdges("gather indices read a table in a pattern not modelled (not a repeat or stride of the output's indices)")
        exprs.append(e if kind != "static" else e.substitute(to_y, b))
    assert len(batch_y) == len(batch)
    info = SymInfo(name, 0, 0, source=table, shape=tuple(tinfo.shape))
    m = IndexMap(tuple(y_shape), tuple(exprs), tuple(xs), syms=(info,))
    return (c.edge(c.y, c.x, m, klass=EdgeClass.II,
                   note=f"indirect gather through table t{table}, read side only: {m}"),)


UNCLAMPED = (-(2 ** 31), 2 ** 31 - 1)   # a table read's range when only a condition tests it


def _scatter(c: _Ctx) -> tuple[Edge, ...]:
    """``x.at[idx].set(rows)`` writing whole rows at indices read from one runtime table (a cache
    row per sequence at its own position, ``cache.at[arange(B), pos].set(row)``; a paged cache's
    ``pages.at[blk, off].set(row)`` where ``blk`` reads the block table): out ⇢ operand in place
    (as ``dynamic_update_slice``), and the rows ⇢ out through :class:`Load` atoms, under the
    condition that the index is in bounds (XLA skips an update whose row is out of bounds; a
    negative index is wrapped first, as jnp does). Where the table sends two updates to one row
    (two sequences given one page), jax leaves which update lands unspecified (``.at[].set`` is a
    scatter with ``unique_indices=False``: XLA writes the rows in no defined order, element by
    element), and so does a kernel writing the rows from several programs. With
    ``mode="clip"`` XLA clamps an index into bounds instead of dropping its row: the map then
    clamps (its :class:`Load` atoms' own range) and has no condition."""
    dn, xs = c.p["dimension_numbers"], c.shape(c.x)
    clip = "CLIP" in str(c.p.get("mode"))
    t_idx, upd = c.op.inputs[1], c.op.inputs[2]
    a_dims = tuple(dn.scatter_dims_to_operand_dims)
    window = tuple(dn.update_window_dims)
    us = c.shape(upd)
    kept = [j for j in range(len(xs)) if j not in dn.inserted_window_dims]
    if (dn.operand_batching_dims or sorted(dn.inserted_window_dims) != sorted(a_dims)
            or c.shape(t_idx)[-1:] != (len(a_dims),) or c.p.get("update_jaxpr") is not None
            or [us[w] for w in window] != [xs[j] for j in kept]):
        raise NoEdges("scatter writes at data-dependent indices (not whole rows at table-read indices)")
    if static_value(t_idx, c.graph) is not None:
        raise NoEdges("scatter writes at data-dependent indices (constant indices: not modelled)")
    table, coords = _probe_indices(t_idx, c.graph)
    tinfo = c.graph.tensors[table]
    name = f"t{table}"
    batch_u = [o for o in range(len(us)) if o not in window]
    b = {Dim(i): (0, n - 1) for i, n in enumerate(us)}
    to_u = {Dim(j): dim(o) for j, o in enumerate(batch_u)}
    win = iter(window)
    exprs, conds = [], []
    for j, n in enumerate(xs):
        if j not in a_dims:
            exprs.append(dim(next(win)))
            continue
        kind, val = coords[a_dims.index(j)]
        if kind == "static":
            val = np.clip(val, 0, n - 1) if clip else val
            if np.asarray(val).min() < 0 or np.asarray(val).max() >= n:
                raise NoEdges("scatter rows out of bounds at constant indices")
            e = _fit(val)
            if e is None:
                raise NoEdges("scatter indices not a repeat or stride of the updates' indices")
            exprs.append(e.substitute(to_u, b))
            continue
        index = _table_index(val, tinfo.shape, to_u, b, "scatter")
        exprs.append(Expr.of(Load(name, index, 0, n - 1, kind)))
        if not clip:
            conds.append(Cond(Expr.of(Load(name, index, *UNCLAMPED, kind)), 0, n))
    info = SymInfo(name, 0, 0, source=table, shape=tuple(tinfo.shape))
    m = IndexMap(tuple(us), tuple(exprs), tuple(xs), tuple(conds), None, (info,))
    return (c.edge(c.y, c.x, c.ident(c.x), klass=EdgeClass.I, inplace=True,
                   note="in place: out is operand's buffer after the update (legality check)"),
            c.edge(upd, c.y, m, klass=EdgeClass.II,
                   note=f"indirect scatter through table t{table}, "
                        f"{'indices clamped' if clip else 'rows in bounds only'}: {m}"))


def _table_index(positions: np.ndarray, shape: tuple[int, ...], to: dict, bounds: dict, what: str
                 ) -> tuple[Expr, ...]:
    """The index expressions (over the moved tensor's dims, ``to`` renaming the index batch dims)
    of the table elements at flat ``positions`` (one per index batch element): each coordinate a
    repeat/stride/period of the batch dims (:func:`_fit`)."""
    parts = [_fit(v) for v in np.unravel_index(positions, shape)]
    if any(p is None for p in parts):
        raise NoEdges(f"{what} indices read a table in a pattern not modelled (not a repeat or stride of "
                      "the indices' batch dims)")
    return tuple(p.substitute(to, bounds) for p in parts)


def _probe_indices(t: int, graph: Graph) -> tuple[int, list[tuple[Any, np.ndarray]]]:
    """Which table the gather/scatter indices ``t`` are read from, and per index coordinate either
    ``("static", values)`` or ``(wrap, flat table positions)``: one input table seen through views
    (:func:`_probe_input_table`), else the indices themselves as XLA computes them
    (:func:`_computed_table`)."""
    try:
        return _probe_input_table(t, graph)
    except NoEdges as first:
        try:
            return _computed_table(t, graph)
        except NoEdges as second:
            raise NoEdges(f"{first}; read as computed indices: {second}") from None


def _computed_table(t: int, graph: Graph) -> tuple[int, list[tuple[Any, np.ndarray]]]:
    """The indices ``t`` as the table, where they are computed from input tables by more than
    views: a paged cache's page write at ``(block_table[b, (len[b] - 1) // page], (len[b] - 1) %
    page)`` reads two tables through integer arithmetic. XLA computes them — a few integers per
    row, as it does for its own scatter — and a kernel reads each row's index from that array as
    it is (the computation holds jnp's wrapping of negative indices; the Load's clamp and the
    scatter's bounds condition are XLA's). A coordinate computed from constants alone
    (``arange(B)`` in ``.at[arange(B), f(pos)]``) stays static. The computation reads only program
    inputs and constants, so it can run before any kernel (``lower._Run.value``), and is small."""
    info = graph.tensors[t]
    if not _integer_or_bool(info.dtype) or info.dtype == np.bool_ or not 0 < info.size <= TABLE_LIMIT:
        raise NoEdges("indices computed in the program that are not a small integer array")
    _, leaves = _index_computation(t, graph, _check_index_op)
    if not leaves <= set(graph.inputs):
        raise NoEdges("indices computed from a value that is not a program input")
    parts: list[Any] = [None] * info.shape[-1]      # coordinate -> (its part, column) when static
    op = graph.producer(t)
    if op is not None and op.primitive == "concatenate" and op.params["dimension"] == len(info.shape) - 1:
        k = 0
        for x in op.inputs:
            for j in range(graph.tensors[x].shape[-1]):
                parts[k] = (x, j)
                k += 1
    positions = np.arange(info.size).reshape(info.shape)
    coords: list[tuple[Any, np.ndarray]] = []
    for k in range(info.shape[-1]):
        val = None if parts[k] is None else static_value(parts[k][0], graph)
        coords.append(("static", np.asarray(val)[..., parts[k][1]]) if val is not None
                      else (0, positions[..., k]))
    return t, coords


def _check_index_op(op: Op, graph: Graph) -> None:
    """An op of an index computation :func:`_computed_table` lets XLA run: small integer or
    boolean arithmetic, no control flow."""
    if op.primitive in CONTROL_FLOW or any(graph.tensors[o].size > PROBE_LIMIT
                                           or not _integer_or_bool(graph.tensors[o].dtype) for o in op.outputs):
        raise NoEdges(f"indices computed by {op.primitive} (integer index arithmetic on input tables "
                      "is modelled)")


def _index_computation(t: int, graph: Graph, check: Callable[[Op, Graph], None]) -> tuple[dict[int, Op], set[int]]:
    """The ops computing the indices ``t`` from runtime values (constants folded away), each one
    ``check`` accepts, and the runtime tensors they start from (no producer: program inputs, or
    values bound inside a body)."""
    ops: dict[int, Op] = {}
    leaves: set[int] = set()
    stack, seen = [t], set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if static_value(u, graph) is not None:
            continue
        op = graph.producer(u)
        if op is None:
            leaves.add(u)
            continue
        check(op, graph)
        ops[op.id] = op
        stack.extend(i for i in op.inputs if i not in seen)
        if len(ops) > 256:
            raise NoEdges("gather indices: index computation too large to probe")
    return ops, leaves


def _integer_or_bool(dtype: Any) -> bool:
    """An integer or boolean numpy dtype (not a PRNG key's extended dtype, which numpy cannot read)."""
    return isinstance(dtype, np.dtype) and (np.issubdtype(dtype, np.integer) or dtype == np.bool_)


def _probe_input_table(t: int, graph: Graph) -> tuple[int, list[tuple[Any, np.ndarray]]]:
    """Which input table the gather indices ``t`` are read from, and per index coordinate either
    ``("static", values)`` or ``(wrap, flat table positions)``.

    The index computation is evaluated three times with the table replaced by codes (its flat
    positions; those plus its size; those minus its size): a coordinate that moves with the
    codes reads the table at the position its first probe shows, and the negative probe shows
    what a negative entry becomes (``v + wrap``). Only the ops of ``_TABLE_VIEWS``, integer
    casts and ``where(v < 0, v + c, v)`` may touch table values, so those three probes are the
    whole function for every table content; anything else is declined."""
    ops, leaves = _index_computation(t, graph, _check_table_op)
    if len(leaves) != 1:
        raise NoEdges(f"gather indices depend on {len(leaves)} runtime tensors (one index table is modelled)")
    (table,) = leaves
    info = graph.tensors[table]
    if table not in graph.inputs:
        raise NoEdges("gather indices read a table computed in the program (tables that are inputs are modelled)")
    if not np.issubdtype(info.dtype, np.integer) or not 0 < info.size <= TABLE_LIMIT or \
            np.iinfo(info.dtype).max < 2 * info.size or np.iinfo(info.dtype).min > -info.size:
        raise NoEdges("gather indices read a table that is not a small integer array")
    if any(graph.tensors[o].size > PROBE_LIMIT for op in ops.values() for o in op.outputs):
        raise NoEdges("gather indices: index computation too large to probe")
    codes = np.arange(info.size, dtype=np.int64).reshape(info.shape)
    order = sorted(ops.values(), key=lambda o: o.id)

    def run(tbl: np.ndarray) -> np.ndarray:
        env = {table: tbl.astype(info.dtype)}
        try:
            with jax.ensure_compile_time_eval():
                for op in order:
                    vals = [env[i] if i in env else static_value(i, graph) for i in op.inputs]
                    out = op.bind(*vals)
                    env.update(zip(op.outputs, out if op.prim.multiple_results else (out,)))
        except Exception as e:  # noqa: BLE001 - an index computation that does not evaluate is not modelled
            raise NoEdges(f"gather indices could not be probed ({type(e).__name__})") from None
        return np.asarray(env[t]).astype(np.int64)

    va, vb, vn = run(codes), run(codes + info.size), run(codes - info.size)
    coords: list[tuple[Any, np.ndarray]] = []
    for k in range(va.shape[-1]):
        a, b2, n = va[..., k], vb[..., k], vn[..., k]
        if np.array_equal(a, b2) and np.array_equal(a, n):
            coords.append(("static", a))
            continue
        wrap = n - a + info.size
        if not (np.all(b2 - a == info.size) and a.min() >= 0 and a.max() < info.size
                and np.all(wrap == wrap.flat[0])):
            raise NoEdges("gather indices mix table values with other terms (an index that is not one table element)")
        coords.append((int(wrap.flat[0]), a))
    return table, coords


def _check_table_op(op: Op, graph: Graph) -> None:
    """An op between an index table and a gather's indices must be one :func:`_probe_indices`
    can see through (see ``_TABLE_VIEWS``)."""
    p = op.primitive
    dyn = [i for i in op.inputs[1:] if static_value(i, graph) is None]
    if p in _TABLE_VIEWS and not (p in ("gather", "dynamic_slice") and dyn):
        return
    if p == "convert_element_type" and np.issubdtype(graph.tensors[op.outputs[0]].dtype, np.integer):
        return
    if p == "select_n":
        return
    if p == "lt":
        v = static_value(op.inputs[1], graph)
        if v is not None and not np.any(v):
            return
    if p == "add":
        if any(static_value(i, graph) is not None for i in op.inputs):
            return
    raise NoEdges(f"gather indices computed from a table by {p} (only views, casts and negative-index "
                  "normalisation are modelled)")


def _fit(v: np.ndarray) -> Expr | None:
    """An index expression over the dims of ``v`` whose value at each index is ``v``'s there:
    a sum over dims of ``s·((d floordiv r) mod m)`` (repeats, strides, periods), or None."""
    v = np.asarray(v, np.int64)
    if v.ndim == 0:
        return const(int(v))
    b = {Dim(i): (0, n - 1) for i, n in enumerate(v.shape)}
    base = int(v.flat[0])
    e = const(base)
    for i, n in enumerate(v.shape):
        prof = v[tuple(slice(None) if j == i else 0 for j in range(v.ndim))] - base
        if not prof.any():
            continue
        r = int(np.argmax(prof != 0))
        q = prof[::r]
        if not np.array_equal(prof, np.repeat(q, r)[:n]):
            return None
        zeros = np.flatnonzero(q[1:] == 0)
        m = int(zeros[0]) + 1 if zeros.size else len(q)
        s = int(q[1])
        if not np.array_equal(q, s * (np.arange(len(q)) % m)):
            return None
        e = e + dim(i).floordiv(r, b).mod(m, b) * s
    got = e.evaluate({Dim(i): x for i, x in enumerate(np.indices(v.shape))}, np) if v.ndim else None
    return e if np.array_equal(np.broadcast_to(got, v.shape), v) else None


def _opaque(reason: str) -> Callable[[_Ctx], tuple[Edge, ...]]:
    def rule(c: _Ctx) -> tuple[Edge, ...]:
        raise NoEdges(reason)
    return rule


RULES: dict[str, Callable[[_Ctx], tuple[Edge, ...]]] = {
    "transpose": _transpose, "reshape": _reshape, "squeeze": _squeeze,
    "broadcast_in_dim": _broadcast_in_dim, "slice": _slice, "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice, "concatenate": _concatenate, "split": _split,
    "stack": _stack, "unstack": _unstack, "rev": _rev, "pad": _pad, "copy": _copy, "copy_p": _copy,
    "convert_element_type": _convert_element_type, "device_put": _device_put, "gather": _gather,
    "sharding_constraint": _sharding_constraint,
    "reshard": _sharding_constraint,
    # the identity on values, but the type of its result (varying over a manual axis) is what the
    # ops reading it require: a kernel reads the typed buffer, so its outputs are typed alike
    "pvary": _opaque("pvary changes the varying manual axes of the type (shard_map), not the data"),
    "scatter": _scatter,
    **{s: _opaque(f"{s} writes at data-dependent indices") for s in
       ("scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
        "scatter_min", "scatter-max", "scatter_max", "scatter-sub", "scatter_sub")},
}


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------

def _analyse(op: Op, graph: Graph) -> tuple[tuple[Edge, ...], str | None]:
    """(edges, why there are none)."""
    rule = RULES.get(op.primitive)
    if rule is None:
        return (), op.opaque_reason or f"{op.primitive} is not a data-movement primitive"
    if op.opaque_reason:
        return (), op.opaque_reason
    if any(graph.tensors[t].size == 0 for t in (*op.inputs, *op.outputs)):
        return (), "empty tensor"
    try:
        return rule(_Ctx(op, graph)), None
    except NoEdges as e:
        return (), str(e)


def rules(op: Op, graph: Graph) -> tuple[Edge, ...]:
    """The VTOG edges this op offers (empty for non-movement ops and movement ops it cannot drop)."""
    return _analyse(op, graph)[0]


def explain_no_edges(op: Op, graph: Graph) -> str | None:
    """Why ``op`` offers no edge (for the report), or None when it offers some."""
    edges, why = _analyse(op, graph)
    return None if edges else why
