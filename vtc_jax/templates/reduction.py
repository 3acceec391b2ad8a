"""Reduction / norm clusters (RMSNorm, LayerNorm, softmax, sums): the row-reduction kernel.

The matcher reads the cluster as the kernel's computation (``kernels/reduction.py``): every reduce
op reduces the same single axis of the same row space ``S``; every other tensor is a *row*
(broadcastable to ``S`` along that axis) or a *row statistic* (``S`` without the axis, with or
without keepdims). Reduce ops are grouped into passes by dependency (a centred variance needs the
mean first); each pass's prologue, the epilogue (row outputs) and the reduced outputs re-bind the
cluster's own primitives on blocks, with the view ops that only move the size-1 statistic axis
(keepdims broadcast, reshape, squeeze) as identities: in block space a statistic is
already ``(rows, 1)``. Math stays in the program's dtypes (``upcast=False``: the kernel
accumulates in whatever dtype the traced reduce does).

A tensor may be laid out in another factorisation of ``S`` — flax's ``nn.GroupNorm`` reduces
``(N, H, W, G, C/G)`` and applies the statistics and its per-channel scale to ``(N, H, W, C)`` —:
its axes are split into S's (:func:`_refine`; where such a tensor is finer than ``S``, the row
space is their common refinement, :func:`_row_space`), and a statistic broadcast and reshaped into
it must still hold each element's own row's value (:func:`_statistic_rows`, checked numerically
with row indices), so that in block space it is a ``(rows, 1)`` statistic like any other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..cluster import Cluster
from ..graph import Graph
from ..kernels.reduction import Stat, row_reduce
from ..kernels.vio import VTensor
from ..primitives import TABLE, Kind, Role, block_safe, role_of
from .base import Decline, Run, Step, Template
from .stage2 import broadcast_input, buffers_of, const_value, kernel_inputs

__all__ = ["TEMPLATE"]

_COMBINE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
# the views that only move the size-1 statistic axis: identities in block space (PrimInfo.stat_view)
_STAT_VIEWS = frozenset(n for n, r in TABLE.items() if r.stat_view)


@dataclass(frozen=True)
class ReductionMatch:
    shape: tuple[int, ...]                 # the row space S
    axes: tuple[int, ...]                  # reduced axes of S (contiguous; merged into one for the kernel)
    inputs: tuple[int, ...]                # kernel inputs (rows or statistics)
    stat_inputs: tuple[int, ...]           # of those, statistic-shaped without keepdims
    passes: tuple[tuple[int, ...], ...]    # reduce op ids, pass by pass
    row_outputs: tuple[int, ...]
    red_outputs: tuple[int, ...]
    keepdims: bool
    perm: tuple[int, ...] | None = None    # reduced axes not adjacent (GroupNorm's (H, W, C/G) of
                                           # (N, H, W, G, C/G)): the kernel reads and writes S
                                           # through this transpose, the reduced axes last
    refined: tuple[tuple[int, tuple[int, ...]], ...] = ()   # inputs / outputs laid out in another
                                           # factorisation of S (flax's GroupNorm applies its
                                           # statistics to (N, H, W, C), S being (N, H, W, G, C/G)):
                                           # their shape with its axes split into S's

    @property
    def space(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The kernel's row space and its reduced axes (adjacent): S, or S transposed by ``perm``."""
        if self.perm is None:
            return self.shape, self.axes
        k = len(self.shape) - len(self.axes)
        return tuple(self.shape[a] for a in self.perm), tuple(range(k, len(self.shape)))

    @property
    def merged(self) -> tuple[int, ...]:
        """S with the reduced axes merged into one (the kernel's row space)."""
        shape, axes = self.space
        a0, a1 = axes[0], axes[-1]
        n = 1
        for a in axes:
            n *= shape[a]
        return shape[:a0] + (n,) + shape[a1 + 1:]


def _klass(shape: tuple[int, ...], s: tuple[int, ...], axes: tuple[int, ...]) -> str | None:
    """'row', 'stat' (no keepdims), 'kstat' (keepdims) or None."""
    if shape == tuple(n for i, n in enumerate(s) if i not in axes):
        return "stat"
    if len(shape) > len(s) or not all(a in (1, b) for a, b in zip(shape[::-1], s[::-1])):
        return None
    full = (1,) * (len(s) - len(shape)) + shape
    along = [full[a] for a in axes]
    if all(n == s[a] for n, a in zip(along, axes)):
        return "row"
    if all(n == 1 for n in along) and len(shape) == len(s):
        return "kstat"
    return None


def _groupings(s: tuple[int, ...], shapes: Sequence[tuple[int, ...]]) -> list[list[list[int]]]:
    """The ways the cluster's full-size tensors of another rank factor S: for each such shape (as
    many elements as S), its axes as consecutive runs of S's axes with the same products, matched
    from the minor end (``(N, H, W, C)`` over ``(N, H, W, G, C/G)``: ``[[0], [1], [2], [3, 4]]``)."""
    out = []
    size = math.prod(s)
    for sh in {tuple(x) for x in shapes if math.prod(x) == size and len(x) != len(s) and len(x) > 0}:
        runs: list[list[int]] = []
        j = len(s)
        for n in reversed(sh):
            run, prod = [], 1
            while j > 0 and (prod < n or (n == 1 and not run)) and prod * s[j - 1] <= n:
                j -= 1
                run.insert(0, j)
                prod *= s[j]
            while j > 0 and s[j - 1] == 1 and run and prod == n and len(runs) + 1 == len(sh):
                j -= 1
                run.insert(0, j)
            if prod != n:
                break
            runs.insert(0, run)
        else:
            if j == 0 and len(runs) == len(sh):
                out.append(runs)
    return out


def _row_space(s: tuple[int, ...], axes: tuple[int, ...], shapes: Sequence[tuple[int, ...]]
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The kernel's row space: S, or — where a full-size tensor of the cluster splits S's reduced
    axes more finely (a PyTorch-style GroupNorm reduces ``(N, G, C/G·H·W)`` and applies its scale
    to ``(N, C, H, W)``) — the common refinement of S and those shapes, with the reduced axes
    those S's reduced axes split into. S where there is no refinement, or where it would split a
    kept axis (the statistics' own shape must stay)."""
    size = math.prod(s)
    fulls = {tuple(x) for x in shapes if math.prod(x) == size and tuple(x) != tuple(s)}
    if not fulls or all(_groupings(s, [x]) or len(x) == len(s) for x in fulls):
        return s, axes

    def suffixes(x: Sequence[int]) -> set[int]:
        out, p = set(), 1
        for n in reversed(x):
            p *= n
            out.add(p)
        return out
    marks = sorted(suffixes(s).union(*(suffixes(x) for x in fulls)) - {1})
    if any(b % a for a, b in zip(marks, marks[1:])):
        return s, axes
    fine = tuple(b // a for a, b in zip([1] + marks[:-1], marks))[::-1]   # major to minor
    # S's axis a covers the refined axes whose suffix products lie in [inner(a), inner(a) * S[a]);
    # S's size-1 axes stay where they are (the statistics keep their shape)
    inner = [math.prod(s[a + 1:]) for a in range(len(s))]
    fine_inner = [math.prod(fine[i + 1:]) for i in range(len(fine))]
    owner = [next(a for a in range(len(s)) if inner[a] <= ri < inner[a] * s[a]) for ri in fine_inner]
    ref: list[int] = []
    ref_owner: list[int] = []
    for a in range(len(s)):
        dims = [n for n, o in zip(fine, owner) if o == a] if s[a] != 1 else [1]
        ref += dims
        ref_owner += [a] * len(dims)
    if any(len([o for o in ref_owner if o == a]) != 1 for a in range(len(s)) if a not in axes):
        return s, axes   # a kept axis split: the statistics would change shape
    return tuple(ref), tuple(i for i, a in enumerate(ref_owner) if a in axes)


def _refine(shape: tuple[int, ...], s: tuple[int, ...], groupings: Sequence[list[list[int]]]
            ) -> tuple[int, ...] | None:
    """``shape`` with its axes split into S's by one of ``groupings`` (an axis of size 1 into 1s),
    where it has that grouping's rank and broadcasts against it; S's rank: itself; else None."""
    if len(shape) == len(s) and all(n in (1, m) for n, m in zip(shape, s)):
        return tuple(shape)
    for runs in groupings:
        if len(runs) != len(shape):
            continue
        full = [math.prod(s[a] for a in r) for r in runs]
        if all(n in (1, f) for n, f in zip(shape, full)):
            return tuple(d for n, r in zip(shape, runs) for d in ((s[a] for a in r) if n != 1 else (1,) * len(r)))
    return None


def _statistic_rows(graph: Graph, ops: Sequence[Any], reds: Sequence[Any], s: tuple[int, ...],
                    axes: tuple[int, ...], groupings: Sequence[list[list[int]]]) -> set[int]:
    """The tensors computed from the statistics alone (element-wise work and broadcasts /
    reshapes of them, scalar constants beside), each checked to hold, for every element of S it
    is applied to, the statistic of that element's row — numerically: a row index carried through
    the views (flax's GroupNorm broadcasts its ``(N, G)`` statistics to ``(N, G, C/G)``, reshapes
    them to ``(N, C)`` and to ``(N, 1, 1, C)`` before applying them to ``(N, H, W, C)``, each a
    statistic in block space). A tensor of S's factorisation that does not is a Decline."""
    stat_shape = tuple(n for i, n in enumerate(s) if i not in axes)
    rows = np.arange(math.prod(stat_shape), dtype=np.int64).reshape(stat_shape)
    want = rows.reshape(tuple(1 if i in axes else n for i, n in enumerate(s)))
    ids: dict[int, np.ndarray] = {op.outputs[0]: rows for op in reds}

    def scalar(t: int) -> bool:
        return graph.tensors[t].const is not None and graph.tensors[t].size == 1

    made = {t for op in ops for t in op.outputs}
    for op in ops:   # statistics read from outside (another cluster's): one value per row, by shape
        for t in op.inputs:
            if t not in made and tuple(graph.tensors[t].shape) in (stat_shape, want.shape):
                ids[t] = rows.reshape(graph.tensors[t].shape)

    for op in ops:
        if op in reds or not op.inputs or not all(x in ids or scalar(x) for x in op.inputs):
            continue
        vals = [ids[x] for x in op.inputs if x in ids]
        if op.primitive in _STAT_VIEWS:
            p = op.params
            src = vals[0]
            if op.primitive == "broadcast_in_dim":
                shape = tuple(p["shape"])
                src = src.reshape(tuple(shape[d] if src.shape[i] != 1 else 1
                                        for i, d in enumerate(p["broadcast_dimensions"])))
                src = np.broadcast_to(np.expand_dims(src, tuple(a for a in range(len(shape))
                                                                 if a not in p["broadcast_dimensions"])), shape)
                out = src
            else:
                out = np.reshape(src, graph.tensors[op.outputs[0]].shape)
        elif len(op.outputs) == 1 and block_safe(op.primitive):
            shape = tuple(graph.tensors[op.outputs[0]].shape)
            b = [np.broadcast_to(v, shape) for v in vals]
            if any(not np.array_equal(b[0], v) for v in b[1:]):
                raise Decline(f"{op.primitive} combines statistics of different rows")
            out = b[0]
        else:
            continue
        ids[op.outputs[0]] = out
        r = _refine(out.shape, s, groupings)
        # both sides are broadcasts of S: compared over their joint shape, not all of S's elements
        joint = np.broadcast_shapes(r, want.shape) if r is not None else None
        if r is not None and not np.array_equal(np.broadcast_to(out.reshape(r), joint), np.broadcast_to(want, joint)):
            raise Decline(f"{op.primitive} lays statistics of shape {stat_shape} out over {out.shape} "
                          f"other than along their rows of {s}")
    return set(ids)


def _match(graph: Graph, c: Cluster) -> ReductionMatch:
    ops = [graph.ops[o] for o in c.ops]
    reds = [op for op in ops if role_of(op, graph) is Role.REDUCTION]
    if not reds:
        raise Decline("no reduce op")
    bad = [op.primitive for op in reds if op.primitive not in _COMBINE]
    if bad:
        raise Decline(f"{bad[0]} has no row-reduction form")
    axes_set = {tuple(sorted(op.params["axes"])) for op in reds}
    shapes = {tuple(graph.tensors[op.inputs[0]].shape) for op in reds}
    if len(axes_set) != 1 or len(shapes) != 1:
        raise Decline("reduce ops over different axes or row spaces")
    axes, s = next(iter(axes_set)), next(iter(shapes))
    if not axes:
        raise Decline("reduces no axis")
    every = [tuple(graph.tensors[t].shape) for op in ops for t in (*op.inputs, *op.outputs)]
    s, axes = _row_space(s, axes, every)
    perm = None
    if list(axes) != list(range(axes[0], axes[-1] + 1)):   # read through a transpose: reduced axes last
        perm = tuple(a for a in range(len(s)) if a not in axes) + tuple(axes)
    if all(s[a] == 1 for a in axes):
        raise Decline("reduces size-1 axes")
    groupings = _groupings(s, every)
    stat_rows = _statistic_rows(graph, ops, reds, s, axes, groupings)
    klass: dict[int, str] = {}
    refined: dict[int, tuple[int, ...]] = {}
    for op in ops:
        for t in (*op.inputs, *op.outputs):
            if graph.tensors[t].const is not None and graph.tensors[t].size == 1:
                continue
            shape = tuple(graph.tensors[t].shape)
            if shape == () and t in c.inputs:   # a runtime scalar (a dequantisation scale): a row
                klass[t] = "row"                # broadcast to S, read through its layout
                continue
            r = _refine(shape, s, groupings)
            k = _klass(r if r is not None else shape, s, axes)
            if k is None and t in stat_rows:
                k = "sview"   # statistics laid out another way, checked row by row: (rows, 1) in blocks
            elif k is None and r is not None and t not in stat_rows and all(
                    a in (1, b) for a, b in zip(r, s)):
                k = "row"     # broadcast along some reduced axes (a per-channel scale of a GroupNorm)
            if k is None:
                what = op.primitive if t in op.outputs else "an input"
                raise Decline(f"a {shape} value ({what}) is neither a row of {s} nor a statistic over "
                              f"axes {axes}")
            klass[t] = k
            if r is not None and r != shape:
                refined[t] = r
    for op in ops:
        if op in reds:
            continue
        if op.primitive in _STAT_VIEWS:
            a, b = klass.get(op.inputs[0]), klass.get(op.outputs[0])
            src, dst = (refined.get(t, tuple(graph.tensors[t].shape)) for t in (op.inputs[0], op.outputs[0]))
            if a == "row" and (b != "row" or src != dst) and op.primitive != "broadcast_in_dim":
                raise Decline(f"{op.primitive} reshapes the rows")
            continue
        if not block_safe(op.primitive) or op.primitive == "broadcast_in_dim":
            raise Decline(f"{op.primitive} inside the cluster cannot be computed on blocks")
    # passes: a reduce's level is one more than the deepest statistic its input depends on
    producer = {t: op for op in ops for t in op.outputs}
    level: dict[int, int] = {}

    def depth(t: int, seen: frozenset[int] = frozenset()) -> int:
        op = producer.get(t)
        if op is None or t in seen:
            return 0
        if op in reds:
            return lvl(op) + 1
        return max((depth(x, seen | {t}) for x in op.inputs), default=0)

    def lvl(op: Any) -> int:
        if op.id not in level:
            level[op.id] = depth(op.inputs[0])
        return level[op.id]

    for op in reds:
        lvl(op)
    n_pass = max(level.values()) + 1
    passes = tuple(tuple(op.id for op in reds if level[op.id] == k) for k in range(n_pass))
    if any(not p for p in passes):
        raise Decline("statistics depend on each other in an order the kernel cannot follow")
    inputs = kernel_inputs(graph, c)
    row_out = tuple(t for t in c.outputs if klass.get(t) == "row")
    red_out = tuple(t for t in c.outputs if klass.get(t) in ("stat", "kstat"))
    if any(klass.get(t) == "sview" for t in c.outputs):
        raise Decline("a statistic output laid out over other axes than the statistics'")
    if any(refined.get(t, tuple(graph.tensors[t].shape)) != s for t in row_out):
        raise Decline("a row output smaller than the row space")
    if len({klass[t] for t in red_out}) > 1:
        raise Decline("statistic outputs with and without keepdims")
    stat_in = tuple(t for t in inputs if klass.get(t) == "stat")
    # reduced outputs may only depend on statistics (the kernel computes them after the row loop)
    stats = {op.outputs[0] for op in reds}

    def only_stats(t: int) -> bool:
        if t in stats or (graph.tensors[t].const is not None and graph.tensors[t].size == 1):
            return True
        op = producer.get(t)
        return op is not None and all(only_stats(x) for x in op.inputs)

    if not all(only_stats(t) for t in red_out):
        raise Decline("a statistic output depends on more than the statistics")
    return ReductionMatch(s, axes, inputs, stat_in, passes, row_out, red_out,
                          bool(red_out) and klass[red_out[0]] == "kstat", perm,
                          tuple(sorted((t, r) for t, r in refined.items() if t in inputs or t in c.outputs)))


def _evaluator(graph: Graph, c: Cluster, m: ReductionMatch, stats: Sequence[int],
               n_inputs: int, targets: Sequence[int]) -> Callable[..., Any]:
    """``f(*input_blocks, *stat_blocks) -> target block(s)``: the cluster's ops in block space."""
    ops = [graph.ops[o] for o in c.ops]

    def f(*vals: Any) -> Any:
        env: dict[int, Any] = {}
        for t, v in zip(m.inputs, vals[:n_inputs]):
            d = graph.tensors[t].dtype
            env[t] = v.astype(d) if v.dtype != d else v
        for t, v in zip(stats, vals[n_inputs:]):
            env[t] = v
        for op in ops:
            if role_of(op, graph) is Role.REDUCTION or all(t in env for t in op.outputs) or any(
                    x not in env and not _inline(graph, x) for x in op.inputs):
                continue
            vals_ = [env[x] if x in env else const_value(graph, x).reshape(()) for x in op.inputs]
            if op.primitive in _STAT_VIEWS:
                out = vals_[0]
            else:
                out = op.prim.bind(*vals_, **op.params)
            env.update(zip(op.outputs, out if op.prim.multiple_results else (out,)))
        res = tuple(env[t] for t in targets)
        return res if len(res) > 1 else res[0]

    return f


def _inline(graph: Graph, t: int) -> bool:
    return graph.tensors[t].const is not None and graph.tensors[t].size == 1


def _build(graph: Graph, c: Cluster, m: ReductionMatch, backend: str) -> Step:
    n_in = len(m.inputs)
    order = [graph.ops[o].outputs[0] for p in m.passes for o in p]   # statistics in kernel order
    passes, done = [], 0
    for p in m.passes:
        stats = []
        for o in p:
            op = graph.ops[o]
            stats.append(Stat(_evaluator(graph, c, m, order[:done], n_in, [op.inputs[0]]), _COMBINE[op.primitive]))
        passes.append(stats)
        done += len(p)
    epi = _evaluator(graph, c, m, order, n_in, m.row_outputs) if m.row_outputs else None
    red = None
    if m.red_outputs:
        ev = _evaluator(graph, c, m, order, 0, m.red_outputs)
        red = lambda *stats: ev(*stats)   # noqa: E731 - statistics only
    outs_t = (*m.row_outputs, *m.red_outputs)
    dtypes = [graph.tensors[t].dtype for t in outs_t]

    s, merged = m.shape, m.merged
    ps, paxes = m.space
    a0 = paxes[0]
    kmerged = merged[:a0] + (1,) + merged[a0 + 1:]

    def view(x: Any, shape: tuple[int, ...]) -> Any:
        return x if tuple(x.shape) == shape else VTensor(x.layout.reshape(shape), x.dtype, x.buffers, x.symbols)

    def moved(x: Any) -> Any:
        """A tensor of S's rank into the kernel's space (the reduced axes last when ``perm``)."""
        x = VTensor.of(x)
        return x if m.perm is None else VTensor(x.layout.transpose(m.perm), x.dtype, x.buffers, x.symbols)

    refined = dict(m.refined)

    def in_s(t: int, x: Any) -> Any:
        """``x`` (tensor ``t``) with its axes split into S's where it is laid out in another factorisation."""
        return view(VTensor.of(x), refined[t]) if t in refined else x

    def step(run: Run) -> None:
        ins = []
        for t in m.inputs:
            x = in_s(t, VTensor.of(run.vtensor(t)))
            if t in m.stat_inputs:   # S without the axes: a size-1 axis to broadcast along
                x = VTensor(x.layout.expand_dims((a0,)), x.dtype, x.buffers, x.symbols)
            elif len(x.shape) == len(s) and all(x.shape[a] == 1 for a in m.axes):
                x = moved(x)
                x = view(x, tuple(n for i, n in enumerate(x.shape) if i not in paxes[1:]))
            else:                    # a row: broadcast to S, then merge the reduced axes
                x = view(moved(broadcast_input(x, s)), merged)
            ins.append(x)
        outs = [view(moved(in_s(t, run.out_vtensor(t))), merged) for t in m.row_outputs]
        outs += [view(moved(run.out_vtensor(t)), kmerged) if m.keepdims else run.out_vtensor(t)
                 for t in m.red_outputs]
        res = row_reduce(ins, passes, epi, reduced=red, axis=a0, keepdims=m.keepdims, outs=outs,
                         out_dtypes=dtypes, upcast=False, backend=backend, name="reduction")
        res = (res,) if len(outs) == 1 else res
        for t, v, r in zip(outs_t, outs, res):
            run.written(t, v, buffers_of(r))

    return step


def _match_checked(graph: Graph, c: Cluster) -> ReductionMatch:
    m = _match(graph, c)
    refined = dict(m.refined)

    def spans(t: int) -> bool:
        return refined.get(t, tuple(graph.tensors[t].shape)) == m.shape
    if not m.inputs or not spans(m.inputs[0]):
        first = [t for t in m.inputs if spans(t)]
        if not first:
            raise Decline("no input spans the whole row space")
        m = ReductionMatch(m.shape, m.axes, (first[0], *(t for t in m.inputs if t != first[0])),
                           m.stat_inputs, m.passes, m.row_outputs, m.red_outputs, m.keepdims, m.perm, m.refined)
    return m


TEMPLATE = Template(Kind.REDUCTION, library=False, match=_match_checked, build=_build)
