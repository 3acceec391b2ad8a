"""Movement *inside* a pointwise cluster: recomputed through index maps, never copied.

``cluster.fuse_islands`` groups pointwise clusters joined only by movement ops (RoPE: a cast and
multiplies, a negation and an add, joined by two slices and a concat) into one cluster. A Pallas
kernel cannot slice or concatenate register values (``PALLAS-TRITON-NOTES.md``: index the ref
instead), so the kernel never materialises what a movement op inside the cluster produces:
elementwise ops commute with movement, and every value the cluster needs at output index ``i``
is its producer recomputed at ``map(i)`` — the index-map composition TorchInductor applies when
it inlines a pointwise producer into its consumer, and what XLA's loop fusion does for the same
island. :func:`plan` walks each cluster output back to the cluster's inputs:

* an elementwise op at map ``m`` is the op on its operands at ``m`` (a size-1 or rank-0 operand
  through a broadcast map);
* a movement op at ``m`` is its operand at ``edge.map ∘ m`` (``movement.rules``' read edges, the
  same maps the VTOG uses); a concat is one read per piece, chosen by the piece's membership; a
  pad is its operand where the pad's mask holds, else the pad value;
* a cluster input at ``m`` is a kernel input: that tensor's layout composed with ``m`` — a
  virtual tensor like any other, loaded by ``vio`` (masked outside the piece it belongs to);
* a membership test is a ``Mask`` input: a one-element buffer read through the membership
  conditions composed with ``m`` (``vio`` turns conditions into lane masks);
* an iota at ``m`` is ``Index``: the iota's own index, ``m``'s expression evaluated on the block's
  output indices in registers; a small table a cluster input is computed from (RoPE's
  cos/sin(pos·θ): scalars, constants and iotas only) is recomputed the same way
  (:func:`_table_ops`) instead of being loaded.

The result is a static :class:`IslandPlan`: kernel inputs (``Load``/``Mask``) and a straight-line
program over their blocks that the pointwise kernel runs as its stage 2. Values are recomputed
once per distinct map (RoPE reads its input twice: at ``j`` and at ``j ± D/2``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from ..graph import Graph
from ..indexmap import IndexMap, Layout, NotComposable, Piece, box_conds, const, dim, point, union_shape
from ..kernels.vio import VTensor
from ..movement import rules
from ..primitives import TABLE, Direction, block_safe, is_movement_op
from .base import Decline

__all__ = ["ISLAND_BLOCK", "IslandPlan", "Load", "Mask", "Index", "Apply", "Select", "Fill", "Partial", "Summed", "plan", "summed",
           "program", "leaf_vtensor"]

ISLAND_BLOCK = 256   # elements per program of an island kernel (tiling._TARGET is the default)

# movement primitives whose value is a pure read of their operand(s): what a kernel can recompute
READ_ONLY = frozenset(n for n, r in TABLE.items() if r.read_only)


@dataclass(frozen=True)
class Load:
    """Kernel input: cluster input ``tensor`` read at ``map(i)`` for output index ``i``."""
    tensor: int
    map: IndexMap


@dataclass(frozen=True)
class Mask:
    """Kernel input: True where ``where`` (a layout over a one-element buffer) holds a piece."""
    where: Layout


@dataclass(frozen=True)
class Apply:
    """An elementwise op re-bound on earlier values (``args``: step index, or a Python scalar)."""
    op: int
    out: int          # which of the op's results
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Index:
    """An iota at ``map``: the output index mapped onto the iota's index space, along
    ``dimension`` (computed in registers from the block's indices; no load)."""
    map: IndexMap
    dimension: int
    dtype: Any


@dataclass(frozen=True)
class Select:
    """``where(mask, then, other)`` over earlier steps."""
    mask: int
    then: int
    other: int


@dataclass(frozen=True)
class Fill:
    """A constant (a pad's value) in the tensor's dtype."""
    value: float
    dtype: Any


@dataclass(frozen=True)
class Partial:
    """Kernel input: split ``split``'s f32 partial sums of a split-K GEMM's result ``tensor`` at
    ``map(i)`` — or, ``stat``, that split's partial statistic of the row a folded norm scales
    (``kernels.matmul``'s workspaces; :func:`summed`)."""
    tensor: int
    map: IndexMap
    split: int
    stat: bool = False


@dataclass(frozen=True)
class Summed:
    """A split-K GEMM's result ``tensor`` at one map: its partials (steps) summed in split order
    in f32, scaled by the folded norm's row factor of the summed statistics (``stats``, when the
    GEMM folds one), rounded to the tensor's dtype — what the GEMM's reduce kernel stores."""
    tensor: int
    parts: tuple[int, ...]
    stats: tuple[int, ...] = ()


@dataclass(frozen=True)
class IslandPlan:
    shape: tuple[int, ...]        # the grid's: the outputs' union (indexmap.union_shape)
    steps: tuple[Load | Mask | Partial | Apply | Select | Fill | Summed, ...]
    outputs: tuple[int, ...]      # step holding each cluster output, in the cluster's order

    @property
    def inputs(self) -> tuple[Load | Mask | Partial, ...]:
        """Kernel inputs, in the order :func:`program` takes their blocks."""
        return tuple(s for s in self.steps if isinstance(s, (Load, Mask, Partial)))

    @property
    def uses_index(self) -> bool:
        """Does the program take the block's indices (after the input blocks)?"""
        return any(isinstance(s, Index) for s in self.steps)


def _scalar_const(graph: Graph, t: int) -> Any | None:
    info = graph.tensors[t]
    if info.const is not None and info.size == 1:
        return np.asarray(info.const).reshape(())
    return None


def _operand_map(op_shape: tuple[int, ...], x_shape: tuple[int, ...]) -> IndexMap:
    """Map from an elementwise op's index space onto one operand (numpy-style size-1 broadcast;
    jax binary primitives also take rank-0 operands)."""
    if x_shape == op_shape:
        return IndexMap.identity(op_shape)
    if len(x_shape) == 0:
        return IndexMap(op_shape, (), ())
    if len(x_shape) != len(op_shape) or any(a not in (1, b) for a, b in zip(x_shape, op_shape)):
        raise Decline(f"an elementwise operand of shape {x_shape} in an op of shape {op_shape}")
    return IndexMap(op_shape, tuple(const(0) if a == 1 else dim(i) for i, a in enumerate(x_shape)), x_shape)


def _with_box(m: IndexMap, box: Sequence[tuple[int, int]]) -> IndexMap:
    """``m`` masked to ``box`` (indices outside read nothing); fills are the plan's business, so
    every mask's own fill is 0 (two masks then always compose)."""
    conds = tuple(dict.fromkeys(m.conds + box_conds(box, m.domain)))
    return dataclasses.replace(m, conds=conds, fill=0.0 if conds else None)


def _indicator(shape: tuple[int, ...], conds: Sequence[Any]) -> Layout:
    """A layout over one one-element buffer that holds exactly where ``conds`` hold."""
    return Layout(shape, (Piece(0, IndexMap(shape, (const(0),), (1,)), tuple(conds)),))


TABLE_LIMIT = 4096   # a position table recomputed in the kernel has at most this many elements
INLINE_OPS = 32      # ... and is made by at most this many ops


def _table_ops(graph: Graph, t: int) -> set[int] | None:
    """The ops computing ``t`` from scalars, constants and iotas only — RoPE's cos/sin tables
    (``cos(pos · θ_j)``) — when ``t`` is small enough to recompute per element (else None).

    Why: XLA computes such a table inside every fusion that reads it; a kernel that loads it
    makes XLA launch a fusion of its own for it (two for cos and sin). Recomputing it in the
    kernel is a few transcendentals per element, from a scalar and a constant-folded iota."""
    found: set[int] = set()
    stack = [t]
    while stack:
        x = stack.pop()
        info = graph.tensors[x]
        op = graph.producer(x)
        if info.const is not None or op is None:
            continue
        if info.size <= 1 and (op.primitive not in ("convert_element_type", "mul", "add", "sub")
                               or any(graph.tensors[y].size > 1 for y in op.inputs)):
            continue   # a scalar from elsewhere (the clamped position): loaded
        if info.size > TABLE_LIMIT or op.opaque_reason is not None:
            return None
        if op.id in found:
            continue
        if op.primitive == "iota":
            found.add(op.id)
            continue
        movement = is_movement_op(op, graph)
        if (movement and op.primitive not in READ_ONLY) or (not movement and not block_safe(op.primitive)):
            return None
        try:
            if any(not np.issubdtype(np.dtype(graph.tensors[y].dtype), np.number)
                   and np.dtype(graph.tensors[y].dtype) != np.bool_ for y in (*op.inputs, *op.outputs)):
                return None
        except TypeError:   # an extended dtype (PRNG key)
            return None
        found.add(op.id)
        if len(found) > INLINE_OPS:
            return None
        stack.extend(op.inputs)
    return found


# Values one island may recompute (distinct (tensor, index map) pairs). Each one costs index-map
# compositions at analysis time and registers in the kernel; Mamba's associative scan over 2,048
# steps asked for ~10,000 (20 s of analysis, tests/zoo/corpus.py) where RoPE needs a few dozen.
MAX_VALUES = 1024


def plan(graph: Graph, ops: Sequence[int], inputs: Sequence[int], outputs: Sequence[int]) -> IslandPlan:
    """The straight-line program of a pointwise cluster whose ops include movement (see module
    docstring). Raises :class:`Decline` for what it cannot recompute."""

    made: dict[int, tuple[Any, int]] = {}
    for oid in ops:
        op = graph.ops[oid]
        for k, t in enumerate(op.outputs):
            made[t] = (op, k)
    leaves = set(inputs)
    shape = union_shape(graph.tensors[t].shape for t in outputs)
    if shape is None:
        raise Decline("outputs of different shapes with no common grid (indexmap.union_shape)")
    steps: list[Any] = []
    memo: dict[tuple[Any, ...], int] = {}

    def add(step: Any, key: tuple[Any, ...]) -> int:
        if key not in memo:
            memo[key] = len(steps)
            steps.append(step)
        return memo[key]

    visits = [0]

    def value(t: int, m: IndexMap, depth: int = 0) -> int:
        if depth > 200:
            raise Decline("movement chain inside the cluster too deep")
        key = ("v", t, m)
        if key in memo:
            return memo[key]
        visits[0] += 1
        if visits[0] > MAX_VALUES:
            raise Decline(f"recomputing the movement inside the cluster takes more than {MAX_VALUES} values "
                          "(an associative scan's slice/pad tree): XLA's fusions do it once")
        if t in leaves or t not in made:
            c = _scalar_const(graph, t)
            if c is not None:
                return add(Fill(c.item(), graph.tensors[t].dtype), ("fill", t))
            if m.syms:
                raise Decline("a runtime offset inside the fused cluster")
            table = _table_ops(graph, t)
            if not table:
                return add(Load(t, m), key)
            for oid in table:   # recomputed here: the table's ops join this plan
                for j, y in enumerate(graph.ops[oid].outputs):
                    made.setdefault(y, (graph.ops[oid], j))
            leaves.discard(t)
        op, k = made[t]
        if op.primitive == "iota":   # the index itself, in registers
            return add(Index(m, int(op.params["dimension"]), graph.tensors[t].dtype), key)
        if not is_movement_op(op, graph):
            if not block_safe(op.primitive):
                raise Decline(f"{op.primitive} inside the cluster cannot be computed on register blocks")
            op_shape = tuple(graph.tensors[op.outputs[0]].shape)
            args = []
            for x in op.inputs:
                c = _scalar_const(graph, x)
                if c is not None:
                    args.append(c)
                    continue
                xm = _operand_map(op_shape, tuple(graph.tensors[x].shape)).compose(m)
                args.append(("step", value(x, xm, depth + 1)))
            return add(Apply(op.id, k, tuple(args)), key)
        if op.primitive not in READ_ONLY:
            raise Decline(f"{op.primitive} inside the cluster writes data: not a read it can recompute")
        edges = [e for e in rules(op, graph) if e.src == t and e.direction == Direction.READ
                 and e.dst in op.inputs]
        if not edges:
            raise Decline(f"{op.primitive} offers no read map")
        if any(e.map.syms for e in edges):
            raise Decline("a runtime offset inside the fused cluster")
        t_shape = tuple(graph.tensors[t].shape)
        try:
            if len(edges) == 1 and not edges[0].map.conds and \
                    tuple(edges[0].box) == tuple((0, n) for n in t_shape):
                return memo.setdefault(key, value(edges[0].dst, edges[0].map.compose(m), depth + 1))
            if op.primitive == "pad":
                (e,) = edges
                inner = value(e.dst, _with_box(e.map, e.box).compose(m), depth + 1)
                mask = add(Mask(_indicator(t_shape, e.map.conds).compose(m)), ("mask", t, m, 0))
                fill = add(Fill(float(e.map.fill or 0.0), graph.tensors[t].dtype), ("fillv", t, e.map.fill))
                return add(Select(mask, inner, fill), key)
            # pieces (concat, split): the last piece is the default, earlier ones selected in
            acc = value(edges[-1].dst, _with_box(edges[-1].map, edges[-1].box).compose(m), depth + 1)
            for j, e in reversed(list(enumerate(edges[:-1]))):
                v = value(e.dst, _with_box(e.map, e.box).compose(m), depth + 1)
                mask = add(Mask(_indicator(t_shape, box_conds(e.box, t_shape)).compose(m)), ("mask", t, m, j))
                acc = add(Select(mask, v, acc), ("sel", t, m, j))
            memo[key] = acc
            return acc
        except NotComposable as exc:
            raise Decline(f"{op.primitive} inside the cluster: {exc}") from exc

    outs = tuple(value(o, _within(shape, tuple(graph.tensors[o].shape))) for o in outputs)
    return IslandPlan(shape, tuple(steps), outs)


def summed(p: IslandPlan, columns: Mapping[int, tuple[int, int]], shape: Sequence[int], splits: int,
           stats: bool = False) -> IslandPlan:
    """``p`` reading the tensors of ``columns`` — a split-K GEMM's result, or the results of sibling
    dots it computes side by side, each at ``(axis, offset)`` in the GEMM's result of ``shape`` — from
    the GEMM's split partials instead: each ``Load`` of one becomes ``splits`` :class:`Partial`
    loads (and, with ``stats``, as many of the folded norm's partial row statistics, the leading
    dims of ``shape`` being its rows) and their :class:`Summed`.

    Why: the GEMM's reduce kernel would sum the partials and write the result for this kernel to
    read back (a Llama decode layer's QKV projection before its rotary embedding and cache-row
    writes); summed where they are read, the reduce kernel and the result's round trip go. Each
    value is read ``splits`` times in f32 instead of once in its own dtype: a decode step's
    projection is a few hundred KB."""
    steps: list[Any] = []
    at: dict[int, int] = {}

    def moved(s: Any) -> Any:
        if isinstance(s, Apply):
            return dataclasses.replace(s, args=tuple(("step", at[a[1]]) if isinstance(a, tuple) else a for a in s.args))
        if isinstance(s, Select):
            return Select(at[s.mask], at[s.then], at[s.other])
        return s

    for i, s in enumerate(p.steps):
        if isinstance(s, Load) and s.tensor in columns:
            axis, offset = columns[s.tensor]
            exprs = tuple(e + offset if k == axis and offset else e for k, e in enumerate(s.map.exprs))
            at_result = dataclasses.replace(s.map, exprs=exprs, target=tuple(shape))
            parts, rows = [], []
            for flag, into in ((False, parts), (True, rows)) if stats else ((False, parts),):
                for k in range(splits):
                    into.append(len(steps))
                    steps.append(Partial(s.tensor, at_result, k, flag))
            steps.append(Summed(s.tensor, tuple(parts), tuple(rows)))
        else:
            steps.append(moved(s))
        at[i] = len(steps) - 1
    return IslandPlan(p.shape, tuple(steps), tuple(at[i] for i in p.outputs))


def _within(grid: tuple[int, ...], shape: tuple[int, ...]) -> IndexMap:
    """An output of ``shape`` at the origin of the kernel's ``grid`` (their union): the identity,
    reading nothing beyond the output's own extent (those lanes are never stored)."""
    if shape == grid:
        return IndexMap.identity(grid)
    return _with_box(IndexMap(grid, tuple(dim(i) for i in range(len(grid))), shape), [(0, n) for n in shape])


def program(graph: Graph, p: IslandPlan, scale: Callable[[Any], Any] | None = None) -> Callable[..., Any]:
    """``f(*input blocks) -> output block(s)``: the plan's steps on the kernel's blocks, in the
    program's dtypes (loads are cast to their tensor's dtype, as ``stage2.block_fn`` does).
    ``scale``: a folded norm's row factor from its summed statistic (plans with :class:`Summed`
    statistics)."""
    n_in = len(p.inputs)

    def f(*blocks: Any) -> Any:
        it = iter(blocks[:n_in])
        index = point(blocks[n_in:])   # the block's lane indices, where Index steps evaluate
        env: list[Any] = []
        for s in p.steps:
            if isinstance(s, Index):
                v = s.map.exprs[s.dimension].evaluate(index, jnp, s.map.bounds)
                env.append(jnp.asarray(v, jnp.int32).astype(s.dtype))
            elif isinstance(s, Load):
                b = next(it)
                d = graph.tensors[s.tensor].dtype
                env.append(b.astype(d) if b.dtype != d else b)
            elif isinstance(s, Mask):
                env.append(next(it) != 0)
            elif isinstance(s, Partial):   # f32, summed before any rounding
                env.append(next(it))
            elif isinstance(s, Summed):
                acc = env[s.parts[0]]
                for k in s.parts[1:]:
                    acc = acc + env[k]
                if s.stats:
                    stat = env[s.stats[0]]
                    for k in s.stats[1:]:
                        stat = stat + env[k]
                    acc = acc * scale(stat).astype(jnp.float32)
                env.append(acc.astype(graph.tensors[s.tensor].dtype))
            elif isinstance(s, Fill):
                env.append(jnp.asarray(s.value, s.dtype))
            elif isinstance(s, Select):
                env.append(jnp.where(env[s.mask], env[s.then], env[s.other]))
            else:
                op = graph.ops[s.op]
                vals = [env[a[1]] if isinstance(a, tuple) else a for a in s.args]
                big = max((np.shape(v) for v in vals), key=len, default=())
                if any(np.shape(v) != big for v in vals):   # a Fill or constant among blocks
                    vals = [jnp.broadcast_to(v, big) if np.ndim(v) == 0 else v for v in vals]
                out = op.prim.bind(*vals, **op.params)
                env.append(out[s.out] if op.prim.multiple_results else out)
        res = tuple(env[i] for i in p.outputs)
        return res if len(res) > 1 else res[0]

    return f


def leaf_vtensor(x: Any, load: Load | Mask | Partial) -> Any:
    """The kernel input of a ``Load`` (``x``: the cluster input as the lowering gives it, an array
    or a VTensor), a ``Mask`` (``x`` ignored) or a ``Partial`` (``x``: the split-K workspace,
    ``(splits, *result shape)``, or the partial statistics, ``(splits, 1, *row dims)``, of a result
    whose leading dims are its rows): a VTensor over the same buffers, read through the composed
    map."""
    if isinstance(load, Mask):
        return VTensor(load.where, np.dtype(np.int32), (jnp.ones((1,), jnp.int32),))
    v = VTensor.of(x)
    m = load.map
    if isinstance(load, Partial):
        lead = (const(load.split), const(0)) if load.stat else (const(load.split),)
        exprs = m.exprs[:len(v.shape) - len(lead)]
        m = IndexMap(m.domain, (*lead, *exprs), tuple(v.shape), m.conds, m.fill, m.syms)
        return v.with_layout(v.layout.compose(m))
    if v.shape == ():   # a scalar: seen as one element of shape (1,)
        v = v.reshape((1,))
        m = IndexMap(m.domain, (const(0),), (1,), m.conds, m.fill, m.syms)
    return v.with_layout(v.layout.compose(m))
