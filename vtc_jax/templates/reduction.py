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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

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
    perm = None
    if list(axes) != list(range(axes[0], axes[-1] + 1)):   # read through a transpose: reduced axes last
        perm = tuple(a for a in range(len(s)) if a not in axes) + tuple(axes)
    if all(s[a] == 1 for a in axes):
        raise Decline("reduces size-1 axes")
    klass: dict[int, str] = {}
    for op in ops:
        for t in (*op.inputs, *op.outputs):
            if graph.tensors[t].const is not None and graph.tensors[t].size == 1:
                continue
            k = _klass(tuple(graph.tensors[t].shape), s, axes)
            if k is None:
                raise Decline(f"t{t} of shape {graph.tensors[t].shape} is neither a row of {s} "
                              f"nor a statistic over axes {axes}")
            klass[t] = k
    for op in ops:
        if op in reds:
            continue
        if op.primitive in _STAT_VIEWS:
            a, b = klass.get(op.inputs[0]), klass.get(op.outputs[0])
            if a == "row" and (b != "row" or graph.tensors[op.inputs[0]].shape != graph.tensors[op.outputs[0]].shape) \
                    and op.primitive != "broadcast_in_dim":
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
    if any(tuple(graph.tensors[t].shape) != s for t in row_out):
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
                          bool(red_out) and klass[red_out[0]] == "kstat", perm)


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

    def step(run: Run) -> None:
        ins = []
        for t in m.inputs:
            x = VTensor.of(run.vtensor(t))
            if t in m.stat_inputs:   # S without the axes: a size-1 axis to broadcast along
                x = VTensor(x.layout.expand_dims((a0,)), x.dtype, x.buffers, x.symbols)
            elif len(x.shape) == len(s) and all(x.shape[a] == 1 for a in m.axes):
                x = moved(x)
                x = view(x, tuple(n for i, n in enumerate(x.shape) if i not in paxes[1:]))
            else:                    # a row: broadcast to S, then merge the reduced axes
                x = view(moved(broadcast_input(x, s)), merged)
            ins.append(x)
        outs = [view(moved(run.out_vtensor(t)), merged) for t in m.row_outputs]
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
    if not m.inputs or tuple(graph.tensors[m.inputs[0]].shape) != m.shape:
        first = [t for t in m.inputs if tuple(graph.tensors[t].shape) == m.shape]
        if not first:
            raise Decline("no input spans the whole row space")
        m = ReductionMatch(m.shape, m.axes, (first[0], *(t for t in m.inputs if t != first[0])),
                           m.stat_inputs, m.passes, m.row_outputs, m.red_outputs, m.keepdims, m.perm)
    return m


TEMPLATE = Template(Kind.REDUCTION, library=False, match=_match_checked, build=_build)
