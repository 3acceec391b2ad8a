"""Stage 5: the points-to graph — which tensors become virtual (paper §5.2, Algorithm 2).

``greedy(vtog, savings)`` is the paper's global greedy algorithm: keep an anchor set ``A`` and a
chosen edge set ``C``; in each iteration give every non-anchor node ``v`` its best compatible edge
set ``P(v)`` (MaxEdges) with the sum ``s(v)`` of the edges' marginal savings ``w(e)``, pick the node
with the largest sum, add it to ``A`` and ``P`` to ``C``, and re-estimate ``w`` of the edges pointing
to the picked node. Stop when no pick saves anything.

Where this implementation deliberately departs from the pseudo-code, and why:

* **Edge targets need not be anchors.** Read literally, MaxEdges only considers edges into ``A``,
  and ``A`` starts as the nodes without outgoing edges. A tensor between two compute kernels (a
  transpose between two matmuls) has edges both ways, so neither end would ever enter ``A`` and
  nothing could be chosen. We allow an edge to any node, as long as ``C`` stays acyclic; a target
  not yet decided is physical *for now*, and if it later becomes virtual itself the edges into it
  are re-estimated (Algorithm 2, line 19) — the layouts simply compose. ``A`` keeps its role of
  "decided": a picked node is never reconsidered. Acyclicity is checked per pick (the picked node
  has no chosen out-edge yet, so a cycle exists iff a target already reaches it through ``C``).
* **Exact cover.** A tensor is either physical or fully virtual: the boxes of its chosen edges must
  partition its index space (a half-virtual tensor still needs its whole buffer and the movement op
  still runs). MaxEdges therefore returns the best-weight set of pairwise compatible edges whose
  boxes cover the node exactly: any full-box edge alone, or a combination of disjoint pieces
  (e.g. every slab of a concat). Pairwise-disjoint boxes inside the node cover it exactly iff their
  volumes add up to the node's volume, which keeps the search a small subset enumeration.
* **Only strictly positive picks** (``s > 0``): a zero-saving virtual tensor is pure risk.
* **Re-estimation** also covers the sibling edges of the picked edges' movement ops (whether an op
  and its launch are gone can depend on edges of other nodes: each input of a concat written into
  the output buffer) and the out-edges of the undecided tensors the new virtual tensor now lives
  in (if such a tensor later becomes virtual, the new one moves with it: a transposed view that
  then reads through a broadcast reads fewer bytes).
  A savings function may name further edges to re-estimate (``refresh``) and edges its estimate
  assumed would be taken along (``companions``, the cost model's bitcast lookahead); the greedy
  takes those in the same pick, so ``total_saving`` stays the exact sum of what was chosen.
* **Ties** (equal to 9 significant digits) go to picks made of read-direction edges: a consumer
  reading through a map leaves the producer side free, e.g. the broadcast behind a transposed
  KV-head repeat can still be eliminated; writing the repeat transposed would materialise it.
* **Near-linear time.** Instead of rescanning every node per iteration (``O(|V|^2)``), candidate
  nodes sit in a max-heap keyed by their last computed sum (lazy greedy). A popped node is
  re-evaluated; if its value dropped (a cycle became possible) it is pushed back, otherwise it is
  the true maximum. Keys only go stale downwards (``C`` growing only removes options), except when
  weights are re-estimated — those nodes are recomputed eagerly and re-keyed.

``greedy(..., anchored=True)`` runs the pseudo-code literally instead (targets must be anchors;
when nothing positive is left the next undecided node is anchored physical), for comparison.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .indexmap import Layout
from .movement import Edge
from .primitives import Direction, EdgeClass, Kind, data_inputs, inplace_operand, is_view
from .vtog import VTOG, box_volume, boxes_overlap

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph import Graph

__all__ = ["Strategy", "Pick", "Resolution", "plan", "resolve", "greedy", "max_edges", "SavingsFn", "StrategyError"]

SavingsFn = Callable[[Edge, frozenset[int]], float]
EPS = 1e-15           # picks must save more than this (seconds or bytes: both far above it)
MAX_PIECES = 24       # partial-box edges per node searched exhaustively (more: per-op groups only)


class StrategyError(ValueError):
    """A points-to graph that is not a valid virtual tensor strategy."""


@dataclass(frozen=True)
class Pick:
    """One greedy iteration: ``node`` became virtual through ``edges``, saving ``saving``.

    ``companion_of`` is set for an edge taken together with another pick because the savings
    function's estimate of that pick assumed it (see ``companions`` in :func:`greedy`); its own
    saving is already included in that pick's.
    """
    node: int
    edges: tuple[int, ...]
    saving: float
    weights: tuple[float, ...] = ()
    companion_of: int | None = None


@dataclass(frozen=True, eq=False)
class Strategy:
    """A points-to graph over a VTOG: the chosen edges (indices into ``vtog.edges``).

    A tensor with chosen out-edges is virtual; its layout is the composition of its edges' maps
    with its targets' layouts (paper §4.1 ``F_new = F_outer ∘ F_base``), piecewise over the boxes.
    ``total_saving`` is Algorithm 2's ``tot_saving``: the sum of the picks' ``w`` when they were
    picked (with the cost model bound via ``CostModel.bind`` it equals the model's
    ``T(∅) - T(C)``; ``trace`` lists the picks in order).
    """
    chosen: tuple[int, ...]
    total_saving: float
    trace: tuple[Pick, ...]
    vtog: VTOG
    _memo: dict[int, Layout] = field(default_factory=dict, repr=False, compare=False)
    _by_src: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    resolution: "Resolution | None" = None   # set by :func:`plan` (what lower/report/accounting read)

    def __post_init__(self) -> None:
        by: dict[int, list[int]] = {}
        for i in self.chosen:
            by.setdefault(self.vtog.edges[i].src, []).append(i)
        self._by_src.update({k: tuple(v) for k, v in by.items()})

    # -- queries ------------------------------------------------------------------------------
    @property
    def virtual(self) -> frozenset[int]:
        return frozenset(self._by_src)

    def is_virtual(self, t: int) -> bool:
        return t in self._by_src

    def points_to(self, t: int) -> tuple[Edge, ...]:
        """The chosen edges out of ``t`` (empty when ``t`` is physical)."""
        return tuple(self.vtog.edges[i] for i in self._by_src.get(t, ()))

    def layout(self, t: int) -> Layout:
        """``t``'s layout over physical tensors, composing chosen edges recursively (memoised)."""
        if t in self._memo:
            return self._memo[t]
        lay = _compose_layout(t, self.vtog, self.points_to(t), self.layout)
        self._memo[t] = lay
        return lay

    # -- checking -----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`StrategyError` unless this is a valid points-to graph.

        Checked: chosen edges exist and are unique; no pinned tensor is virtual; no conflicting
        pair is chosen; the chosen edges are acyclic; every virtual tensor is covered exactly once
        by its edges' boxes; every layout resolves to physical tensors only.
        """
        v = self.vtog
        if len(set(self.chosen)) != len(self.chosen):
            raise StrategyError("an edge is chosen twice")
        if any(not 0 <= i < len(v.edges) for i in self.chosen):
            raise StrategyError("chosen edge index out of range")
        for t in self._by_src:
            if t in v.physical:
                raise StrategyError(f"t{t} is pinned physical ({v.reasons.get(t)}) but virtual")
        chosen = set(self.chosen)
        for i, j in v.conflicts:
            if i in chosen and j in chosen:
                raise StrategyError(f"conflicting edges e{i} and e{j} (t{v.edges[i].src}) both chosen")
        # acyclic: iterative DFS with colours over chosen edges
        colour: dict[int, int] = {}
        for root in self._by_src:
            if colour.get(root):
                continue
            stack: list[tuple[int, Any]] = [(root, iter(self._by_src.get(root, ())))]
            colour[root] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    colour[node] = 2
                    stack.pop()
                    continue
                d = v.edges[nxt].dst
                if colour.get(d) == 1:
                    raise StrategyError(f"cycle through t{node} -> t{d}")
                if not colour.get(d):
                    colour[d] = 1
                    stack.append((d, iter(self._by_src.get(d, ()))))
        for t, idxs in self._by_src.items():
            if not exact_cover(v, idxs, t):
                raise StrategyError(f"the chosen edges of t{t} do not cover it exactly once: "
                                    f"{[v.edges[i].box for i in idxs]}")
        for t in self._by_src:
            try:
                lay = self.layout(t)
            except Exception as exc:  # NotComposable and friends
                raise StrategyError(f"t{t}'s layout does not compose: {exc}") from exc
            bad = [p.target for p in lay.pieces if self.is_virtual(p.target)]
            if bad:
                raise StrategyError(f"t{t} resolves to virtual tensors {bad}")

    def summary(self) -> str:
        lines = [f"strategy: {len(self.chosen)} edges, {len(self._by_src)} virtual tensors, "
                 f"saving {self.total_saving:.6g}"]
        for p in self.trace:
            es = ", ".join(f"t{self.vtog.edges[i].src}⇢t{self.vtog.edges[i].dst} ({self.vtog.edges[i].primitive})"
                           for i in p.edges)
            how = f"  (with t{p.companion_of})" if p.companion_of is not None else f"  saving {p.saving:.6g}"
            lines.append(f"  pick t{p.node}: {es}{how}")
        return "\n".join(lines)


def _compose_layout(t: int, vtog: VTOG, edges: Sequence[Edge], layout_of: Callable[[int], Layout]) -> Layout:
    """Layout of ``t`` given its chosen out-edges and a way to get the targets' layouts."""
    shape = tuple(vtog.shapes[t])
    if not edges:
        return Layout.physical(t, shape)
    return Layout.assemble(shape, [(layout_of(e.dst), e.map, e.box) for e in edges])


def exact_cover(vtog: VTOG, idxs: Sequence[int], node: int) -> bool:
    """True when the boxes of ``idxs`` are pairwise disjoint and together cover ``node``."""
    boxes = [vtog.edges[i].box for i in idxs]
    for a, b in itertools.combinations(range(len(idxs)), 2):
        if vtog.in_conflict(idxs[a], idxs[b]) or boxes_overlap(boxes[a], boxes[b]):
            return False
    return sum(box_volume(b) for b in boxes) == vtog.volume(node)


# --------------------------------------------------------------------------------------------
# MaxEdges
# --------------------------------------------------------------------------------------------

def max_edges(vtog: VTOG, node: int, weight: Mapping[int, float] | Callable[[int], float],
              allowed: Callable[[int], bool] = lambda i: True) -> tuple[float, tuple[int, ...]]:
    """Best exact cover of ``node`` by compatible out-edges: ``(sum of weights, edge indices)``.

    ``allowed(i)`` filters edges (the greedy passes its cycle check). Returns ``(-inf, ())`` when
    no allowed edge set covers the node. Full-box edges are single candidates; partial-box edges
    are searched as subsets (branch and bound on remaining volume and weight), capped at
    ``MAX_PIECES`` — beyond that only the pieces of one movement op are combined.
    """
    w = weight if callable(weight) else weight.__getitem__
    total = vtog.volume(node)
    best: tuple[float, tuple[int, ...]] = (float("-inf"), ())
    partial: list[tuple[int, int, float]] = []   # (edge, volume, weight)
    for i in vtog.out_edges(node):
        if not allowed(i):
            continue
        wi = w(i)
        if wi != wi or wi == float("-inf"):   # NaN or infeasible
            continue
        vol = box_volume(vtog.edges[i].box)
        if vol == total:
            if wi > best[0]:
                best = (wi, (i,))
        elif vol > 0:
            partial.append((i, vol, wi))
    if not partial:
        return best
    if len(partial) > MAX_PIECES:
        groups: dict[int, list[tuple[int, int, float]]] = {}
        for p in partial:
            groups.setdefault(vtog.edges[p[0]].op, []).append(p)
        for g in groups.values():
            if len(g) <= MAX_PIECES:
                best = max(best, _best_cover(vtog, g, total), key=lambda x: x[0])
        return best
    return max(best, _best_cover(vtog, partial, total), key=lambda x: x[0])


def _best_cover(vtog: VTOG, pieces: list[tuple[int, int, float]], total: int) -> tuple[float, tuple[int, ...]]:
    """Max-weight subset of pairwise compatible pieces whose volumes sum to ``total``."""
    pieces = sorted(pieces, key=lambda p: -p[2])
    n = len(pieces)
    suffix_vol = [0] * (n + 1)
    suffix_pos = [0.0] * (n + 1)
    for k in range(n - 1, -1, -1):
        suffix_vol[k] = suffix_vol[k + 1] + pieces[k][1]
        suffix_pos[k] = suffix_pos[k + 1] + max(0.0, pieces[k][2])
    best: list[Any] = [float("-inf"), ()]
    chosen: list[int] = []

    def compatible(i: int) -> bool:
        bi = vtog.edges[i].box
        return all(not vtog.in_conflict(i, j) and not boxes_overlap(bi, vtog.edges[j].box) for j in chosen)

    def rec(k: int, vol: int, wsum: float) -> None:
        if vol == total:
            if wsum > best[0]:
                best[0], best[1] = wsum, tuple(chosen)
            return
        if k == n or vol + suffix_vol[k] < total or wsum + suffix_pos[k] <= best[0]:
            return
        i, v, wi = pieces[k]
        if vol + v <= total and compatible(i):
            chosen.append(i)
            rec(k + 1, vol + v, wsum + wi)
            chosen.pop()
        rec(k + 1, vol, wsum)

    rec(0, 0, 0.0)
    return best[0], tuple(sorted(best[1]))


# --------------------------------------------------------------------------------------------
# Algorithm 2
# --------------------------------------------------------------------------------------------

def greedy(vtog: VTOG, savings: SavingsFn, *, anchored: bool = False) -> Strategy:
    """Algorithm 2 (global greedy) with lazy re-evaluation; see the module docstring.

    ``savings(edge, C)`` is ``w(e) = ℓ(C ∪ {e}) - ℓ(C)``: the cost model's estimate or a
    profiler's measurement. It is called once per edge up front and again for the edges a pick
    affects (edges into the picked node and sibling edges of the same movement ops).

    If ``savings`` has a ``companions(picked_edges, C) -> edge indices`` method, the edges it names
    are taken together with each pick (when still legal): a savings estimate that assumed them
    (the cost model's bitcast lookahead) is then exactly the saving of what was chosen. If it has
    ``refresh(new_edges, C) -> edge indices``, those edges are re-estimated after each pick too
    (dependencies only the savings function knows about).

    ``anchored=True`` runs the pseudo-code literally: a node may only point to anchors, and when
    no node has a positive pick the first undecided node (in ``vtog.nodes`` order) is anchored as
    physical (MaxEdges' empty set, saving 0), until every node is decided. The default relaxes
    the target rule to "any node, keeping C acyclic" (module docstring).
    """
    edges = vtog.edges
    chosen: list[int] = []
    chosen_set: set[int] = set()
    chosen_out: dict[int, list[int]] = {}
    anchors: set[int] = {v for v in vtog.nodes if not vtog.out_edges(v)}
    frozen_c: frozenset[int] = frozenset()
    w: dict[int, float] = {i: float(savings(e, frozen_c)) for i, e in enumerate(edges)}
    companions = getattr(savings, "companions", None)
    refresh = getattr(savings, "refresh", None)

    by_op: dict[int, list[int]] = {}
    for i, e in enumerate(edges):
        by_op.setdefault(e.op, []).append(i)

    def reaches(u: int, target: int) -> bool:
        """Does ``u`` reach ``target`` through chosen edges (u == target counts)?"""
        if u == target:
            return True
        seen, stack = {u}, [u]
        while stack:
            x = stack.pop()
            for i in chosen_out.get(x, ()):
                d = edges[i].dst
                if d == target:
                    return True
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return False

    def roots(starts: Sequence[int]) -> set[int]:
        """Undecided tensors reached from ``starts`` through chosen edges."""
        seen, stack, out = set(starts), list(starts), set()
        while stack:
            x = stack.pop()
            if x not in anchors:
                out.add(x)
            for i in chosen_out.get(x, ()):
                d = edges[i].dst
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return out

    if anchored:
        def evaluate(v: int) -> tuple[float, tuple[int, ...]]:
            return max_edges(vtog, v, w, allowed=lambda i: edges[i].dst in anchors)
    else:
        def evaluate(v: int) -> tuple[float, tuple[int, ...]]:
            return max_edges(vtog, v, w, allowed=lambda i: not reaches(edges[i].dst, v))

    heap: list[tuple[float, int, int, int, float]] = []   # (-saving, rank, version, node, saving)
    version: dict[int, int] = {}

    def key(val: float, picked: tuple[int, ...], v: int) -> tuple:
        """Heap order: larger saving first (equal to 9 significant digits counts as a tie); on a
        tie, a pick made of read-direction edges first (the consumer reads through a map and the
        producer side keeps its options: a broadcast, which has only a read edge, can still be
        eliminated behind it), then by version and node id for determinism."""
        rank = 0 if all(edges[i].direction == Direction.READ for i in picked) else 1
        return (-float(f"{val:.9g}"), rank, version[v], v, val)

    def push(v: int) -> None:
        val, picked = evaluate(v)
        version[v] = version.get(v, 0) + 1
        if val > EPS:
            heapq.heappush(heap, key(val, picked, v))

    for v in vtog.nodes:
        if v not in anchors:
            push(v)

    trace: list[Pick] = []
    total = 0.0
    order = iter(vtog.nodes)     # anchored mode: next node to decide as physical

    def anchor(v: int) -> None:
        anchors.add(v)
        if anchored:             # new targets for the nodes pointing at v
            for u in {edges[i].src for i in vtog.in_edges(v)} - anchors:
                push(u)

    while True:
        if not heap:
            if not anchored:
                break
            v = next((u for u in order if u not in anchors), None)
            if v is None:
                break
            anchor(v)            # nothing positive left: v stays physical (P = {}, s = 0)
            continue
        _, _, ver, v, stored = heapq.heappop(heap)
        if v in anchors or ver != version.get(v):
            continue
        val, picked = evaluate(v)          # lazy check: cycles may have removed options
        if val < stored - 1e-12 * max(1.0, abs(stored)):
            version[v] += 1
            if val > EPS:
                heapq.heappush(heap, key(val, picked, v))
            continue
        if val <= EPS:
            continue
        before = frozen_c
        for i in picked:
            chosen.append(i)
            chosen_set.add(i)
            chosen_out.setdefault(v, []).append(i)
        total += val
        trace.append(Pick(v, picked, val, tuple(w[i] for i in picked)))
        anchor(v)
        new_nodes, new_edges = [v], list(picked)
        for f in (companions(picked, before) if companions is not None else ()):
            u = edges[f].src
            if (u in anchors or u in vtog.physical or f in chosen_set or reaches(edges[f].dst, u)
                    or box_volume(edges[f].box) != vtog.volume(u)):
                continue
            chosen.append(f)
            chosen_set.add(f)
            chosen_out.setdefault(u, []).append(f)
            trace.append(Pick(u, (f,), 0.0, (w[f],), companion_of=v))
            anchor(u)
            new_nodes.append(u)
            new_edges.append(f)
        frozen_c = frozenset(chosen_set)
        # Re-estimate w(e) for the edges whose marginal saving this pick may have changed: the
        # edges into the new virtual tensors (the paper's line 19), the other edges of their
        # movement ops, and the options of the undecided tensors they now live in (whatever
        # those do next moves the new virtual tensors too).
        affected = {i for n in new_nodes for i in vtog.in_edges(n)}
        for i in new_edges:
            affected.update(by_op[edges[i].op])
        for r in roots(new_nodes):
            affected.update(vtog.out_edges(r))
        if refresh is not None:
            affected.update(refresh(tuple(new_edges), frozen_c))
        dirty: set[int] = set()
        for i in affected:
            src = edges[i].src
            if i in chosen_set or src in anchors:
                continue
            nw = float(savings(edges[i], frozen_c))
            if nw != w[i]:
                w[i] = nw
                dirty.add(src)
        for u in dirty:
            push(u)
    return Strategy(tuple(chosen), total, tuple(trace), vtog)


def from_edges(vtog: VTOG, chosen: Sequence[int], total_saving: float = 0.0) -> Strategy:
    """A strategy from an explicit edge set (tests, hand-written strategies, the paper's Fig. 7)."""
    return Strategy(tuple(chosen), total_saving, (), vtog)


def complete_inplace(strategy: Strategy) -> Strategy:
    """Add the in-place edge of every cache update whose update is already written by its producer.

    Once the producer writes the update into ``dynamic_update_slice``'s output buffer, that buffer
    must *be* the operand's (``out ⇢ operand``), or the update op still copies the whole operand.
    The VTOG only offers the in-place edge where it is legal (no later reader of the old
    contents), so taking it is always a saving; the additive cost model cannot see that, because
    the saving only exists in combination. Each addition is kept only if the result validates.
    """
    v = strategy.vtog
    candidates, companion = [], {}
    for i in strategy.chosen:
        e = v.edges[i]
        if inplace_operand(e.primitive) is not None and e.direction == Direction.WRITE:
            for j in v.out_edges(e.dst):  # e.dst is the update op's output
                if v.edges[j].inplace and v.edges[j].op == e.op:
                    candidates.append(j)
                    companion[j] = e.src
    return _add_edges(strategy, candidates, companion)


def complete_views(strategy: Strategy, graph: "Graph", kept_ops: Sequence[int],
                   keep_physical: frozenset[int] = frozenset()) -> Strategy:
    """Also take the Type I edges of view ops (:func:`primitives.is_view`: reshape, squeeze,
    expand_dims, size-preserving broadcast, same-dtype convert, copy) that the greedy left, when
    they still validate.

    XLA runs such an op as a free bitcast, so the cost model credits it nothing and the greedy
    (strictly positive picks) leaves it; but once its neighbours are kernels reading or writing
    through maps, the op is one more tensor that needs its own buffer. Taking the edge costs
    nothing at run time (the map composes into the neighbour's) and removes the op. Read edges
    (the view's output becomes virtual of its input) are tried first. ``keep_physical`` tensors
    are never made virtual here: the operands of decode GEMMs and reductions the greedy left to
    XLA (a free reshape read through a map would make the ``w_o`` projection a Pallas kernel
    nobody priced; a norm's weight broadcast, a Pallas norm beside XLA's weight cast).
    """
    v = strategy.vtog
    kept = set(kept_ops)
    candidates = sorted((i for i, e in enumerate(v.edges)
                         if e.op in kept and is_view(graph.ops[e.op], graph) and e.klass == EdgeClass.I
                         and v.volume(e.src) == v.volume(e.dst) and e.src not in keep_physical),
                        key=lambda i: (v.edges[i].direction != Direction.READ, i))
    return _add_edges(strategy, candidates)


def _add_edges(strategy: Strategy, candidates: Sequence[int], companion_of: Mapping[int, int] | None = None) -> Strategy:
    """Add each candidate edge that keeps the points-to graph valid, checking locally.

    Each candidate covers its source whole, so validity reduces to: source not virtual or pinned,
    no conflict with a chosen edge, no cycle (the target must not reach the source). Layout
    composition is checked once at the end by ``validate``; if that fails nothing is added.
    """
    v = strategy.vtog
    chosen = list(strategy.chosen)
    picks = list(strategy.trace)
    out: dict[int, list[int]] = {}
    for i in chosen:
        out.setdefault(v.edges[i].src, []).append(v.edges[i].dst)

    def reaches(a: int, b: int) -> bool:
        stack, seen = [a], {a}
        while stack:
            t = stack.pop()
            if t == b:
                return True
            for d in out.get(t, ()):
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return False

    added = 0
    for i in candidates:
        e = v.edges[i]
        if e.src in out or e.src in v.physical or not exact_cover(v, [i], e.src):
            continue
        if any(v.in_conflict(i, j) for j in chosen) or reaches(e.dst, e.src):
            continue
        chosen.append(i)
        out.setdefault(e.src, []).append(e.dst)
        picks.append(Pick(e.src, (i,), 0.0, (0.0,), companion_of=(companion_of or {}).get(i)))
        added += 1
    if not added:
        return strategy
    trial = Strategy(tuple(chosen), strategy.total_saving, tuple(picks), v)
    try:
        trial.validate()
    except StrategyError:
        return strategy
    return trial


def physical_inplace(strategy: Strategy) -> Strategy:
    """Keep an in-place update (``out ⇢ operand``) only when the operand owns its memory.

    Writing "in place" into a virtual operand writes into whatever its map points at: the input
    behind a transpose (which the caller may still hold), the fill region of a pad, the one
    element a broadcast repeats. Only a physical operand is a buffer the update may land in.
    """
    v = strategy.vtog
    bad = {i for i in strategy.chosen if v.edges[i].inplace and strategy.is_virtual(v.edges[i].dst)}
    if not bad:
        return strategy
    chosen = tuple(i for i in strategy.chosen if i not in bad)
    picks = tuple(p for p in strategy.trace if not set(p.edges) & bad)
    return physical_inplace(Strategy(chosen, strategy.total_saving, picks, v))


def _read_and_reverse(strategy: Strategy, x: int) -> tuple[int, int] | None:
    """``(read, write)``: the one chosen edge of a virtual ``x``, when it is a read edge ``x ⇢ y``,
    and the same op's write edge ``y ⇢ x`` that would let ``y``'s producer write ``x`` instead
    (the flip both :func:`producer_writes` and :func:`update_by_producer` make); else None."""
    v = strategy.vtog
    held = [i for i in strategy.chosen if v.edges[i].src == x]
    if len(held) != 1 or v.edges[held[0]].direction != Direction.READ:
        return None
    e = v.edges[held[0]]
    back = [i for i, w in enumerate(v.edges) if w.op == e.op and w.direction == Direction.WRITE
            and w.src == e.dst and w.dst == x]
    return (held[0], back[0]) if len(back) == 1 else None


def producer_writes(strategy: Strategy, op_id: int) -> Strategy:
    """Let the producer of a movement op's input write every output instead (all write edges).

    When the greedy makes some outputs of a split read back from its input and another output
    write onward (into a cache, say), nobody produces that last output and the op has to run.
    Taking the op's write edges for *all* outputs (the input becomes virtual over them) removes
    it. When the input is itself a view read through one chosen edge, that edge is flipped to
    the view op's write edge (the producer writes through both). Returns ``strategy`` unchanged
    when that does not validate.
    """
    v = strategy.vtog
    writes = [i for i, e in enumerate(v.edges) if e.op == op_id and e.direction == Direction.WRITE]
    srcs = {v.edges[i].src for i in writes}
    if not writes or len(srcs) != 1:
        return strategy
    src = next(iter(srcs))
    reads = {i for i in strategy.chosen if v.edges[i].op == op_id and v.edges[i].direction == Direction.READ}
    flip: list[int] = []
    if strategy.is_virtual(src):
        # the input is a view read through one edge (a transpose of a GEMM's output): its
        # producer can write through that view instead — the op's reverse write edge — and on
        # through this op's write edges (Gemma's fused K/V projection: kv transposed, split, the
        # V part into the cache at pos)
        pair = _read_and_reverse(strategy, src)
        if pair is None:
            return strategy
        read, back = pair
        y = v.edges[read].dst
        if strategy.is_virtual(y) or any(v.edges[i].src == y for i in strategy.chosen):
            return strategy
        reads.add(read)
        flip = [back]
    base = Strategy(tuple(i for i in strategy.chosen if i not in reads), strategy.total_saving,
                    tuple(p for p in strategy.trace if not set(p.edges) & reads), v)
    group = [i for i in writes if v.edges[i].src == src]
    if not exact_cover(v, group, src) or any(v.in_conflict(i, j) for i in group for j in base.chosen):
        return strategy
    if any(v.in_conflict(i, j) for i in flip for j in (*base.chosen, *group)):
        return strategy
    trial = Strategy(base.chosen + tuple(group) + tuple(flip), strategy.total_saving,
                     base.trace + (Pick(src, tuple(group), 0.0, (0.0,) * len(group)),)
                     + tuple(Pick(v.edges[i].src, (i,), 0.0, (0.0,)) for i in flip), v)
    try:
        trial.validate()
    except StrategyError:
        return strategy
    return trial


def update_by_producer(strategy: Strategy, op_id: int) -> Strategy:
    """Let the producer of an in-place update's row write it into the cache: flip the chain of
    chosen read edges behind the update to the same ops' write edges, and take the update's own.

    Why: BLOOM's fused QKV (HF ``modeling_bloom``) is GEMM -> reshape -> split -> squeeze ->
    transpose -> reshape -> ``dynamic_update_slice`` into each cache. Each view's read edge saves
    as much as the update's write edge, and the greedy takes the reads first: the row is then a
    view of the GEMM's output and XLA still runs the update (one launch per cache, copying the
    row). Walking back from the row, each single read edge ``x ⇢ y`` becomes the op's write edge
    ``y ⇢ x``; a piece of a split read back from the whole makes the split write every piece (the
    other pieces become the buffers the producer fills, as in :func:`producer_writes`). The walk
    ends at a tensor that is not virtual: its producer writes through the composed layout. Returns
    ``strategy`` unchanged when the move does not apply or does not validate; ``plan`` keeps it
    only where the cost model is not slower (it can turn a library GEMM into a kernel).
    """
    v = strategy.vtog
    own = [i for i, e in enumerate(v.edges)
           if e.op == op_id and e.direction == Direction.WRITE and not e.inplace]
    if len(own) != 1 or own[0] in strategy.chosen or not strategy.is_virtual(v.edges[own[0]].src):
        return strategy
    drop: set[int] = set()
    add = [own[0]]
    x = v.edges[own[0]].src
    while strategy.is_virtual(x):
        pair = _read_and_reverse(strategy, x)
        if pair is None:
            return strategy
        read, back = pair
        e = v.edges[read]
        drop.add(read)
        if box_volume(v.edges[back].box) == v.volume(e.dst):
            add.append(back)
        else:   # x is one piece of e.dst (a split's output): the producer writes every piece
            group = [i for i, w in enumerate(v.edges) if w.op == e.op and w.direction == Direction.WRITE
                     and w.src == e.dst]
            if not exact_cover(v, group, e.dst):
                return strategy
            drop |= {i for i in strategy.chosen
                     if v.edges[i].op == e.op and v.edges[i].direction == Direction.READ}
            add += group
        x = e.dst
    # the update's output must be the operand's buffer (complete_inplace's rule): its in-place
    # edge, which the VTOG only offers where no later reader needs the old contents
    add += [i for i, e in enumerate(v.edges) if e.op == op_id and e.inplace and i not in strategy.chosen]
    base = tuple(i for i in strategy.chosen if i not in drop)
    if any(v.in_conflict(i, j) for i in add for j in (*base, *add) if i != j):
        return strategy
    trial = Strategy(base + tuple(add), strategy.total_saving,
                     tuple(p for p in strategy.trace if not set(p.edges) & drop)
                     + tuple(Pick(v.edges[i].src, (i,), 0.0, (0.0,)) for i in add), v)
    try:
        trial.validate()
    except StrategyError:
        return strategy
    return trial


def consumer_reads(strategy: Strategy, edge: int) -> Strategy:
    """Trade a chosen write edge ``u ⇢ d`` (``u`` written in ``d``'s layout by its producer) for
    the same op's read edge ``d ⇢ u`` plus a full read edge out of ``u`` through another op.

    Why: the greedy is myopic where three edges tie. EfficientViT's Kᵀ: the transpose's write
    edge (K written transposed), its read edge (Kᵀ read through K) and the split's read edge (K
    read from the qkv buffer) each save the same; taking the write edge first makes the other two
    illegal, and XLA still runs the split to produce K (transposed) — a whole-tensor copy. The
    pair of read edges removes both ops. Returns ``strategy`` unchanged when the move does not
    apply or does not validate; ``plan`` keeps it only where the cost model is not slower."""
    v = strategy.vtog
    w = v.edges[edge]
    if edge not in strategy.chosen or w.direction != Direction.WRITE or w.inplace:
        return strategy
    u, d = w.src, w.dst
    if strategy.is_virtual(d) or any(v.edges[i].src == u for i in strategy.chosen if i != edge):
        return strategy
    back = [i for i, r in enumerate(v.edges) if r.op == w.op and r.direction == Direction.READ
            and r.src == d and r.dst == u and box_volume(r.box) == v.volume(d)]
    alts = [i for i in v.out_edges(u) if i != edge and v.edges[i].op != w.op
            and v.edges[i].direction == Direction.READ and box_volume(v.edges[i].box) == v.volume(u)]
    if len(back) != 1 or not alts:
        return strategy
    base = tuple(i for i in strategy.chosen if i != edge)
    trace = tuple(p for p in strategy.trace if edge not in p.edges)
    for a in alts:
        new = (back[0], a)
        if any(v.in_conflict(i, j) for i in new for j in base) or v.in_conflict(*new):
            continue
        trial = Strategy(base + new, strategy.total_saving,
                         trace + tuple(Pick(v.edges[i].src, (i,), 0.0, (0.0,)) for i in new), v)
        try:
            trial.validate()
        except StrategyError:
            continue
        return trial
    return strategy


# --------------------------------------------------------------------------------------------
# The whole stage, and what it decided (read by lower, report and accounting)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Resolution:
    """Everything later stages need from a strategy, computed once.

    ``layouts``: every virtual tensor's layout over physical tensors. ``eliminated``: movement
    ops nobody executes. ``inplace``: update ops whose output is their operand's buffer (the
    in-place edge is chosen). ``executed``: movement ops XLA still runs, an in-place update
    (which only writes its update) not counted.
    """
    layouts: Mapping[int, Layout]
    eliminated: frozenset[int]
    inplace: frozenset[int]
    executed: tuple[int, ...]


def plan(vtog: VTOG, graph: "Graph", clusters: Sequence["Cluster"], savings: SavingsFn) -> Strategy:
    """The strategy stage, whole: Algorithm 2, then the completion passes, then the resolution.

    Pass order and why: ``complete_inplace`` (an update written by its producer needs its output
    to be the operand's buffer), ``complete_views`` (free views next to kernels vanish),
    ``physical_inplace`` (only a physical operand may be updated in place), ``producer_writes``
    for movement ops whose outputs nobody would produce, and views once more. When ``savings``
    is a bound cost model (``.time``), ``producer_writes``'s additions are kept only if the
    modelled program is not slower: it makes a producer write every output of a split, which can
    turn a library GEMM the greedy left alone into a Pallas kernel (views and in-place edges are
    free by construction and stay unpriced).
    """
    time = getattr(savings, "time", None)   # the bound cost model's whole-program time, if any

    def priced(before: Strategy, after: Strategy) -> Strategy:
        """``after`` unless the cost model says it is slower (the pass must not undo a refusal of
        the greedy's, e.g. turn a decode GEMM into a Pallas kernel: costmodel.decode_gemm_loss)."""
        if after is before or time is None:
            return after
        near = getattr(savings, "near", None)
        if near is None:
            return after if time(after) <= time(before) * (1 + 1e-12) + 1e-15 else before
        ks = near(set(after.chosen) ^ set(before.chosen))
        t0, t1 = savings.time_of(before, ks), savings.time_of(after, ks)
        return after if t1 <= t0 * (1 + 1e-12) + 1e-15 else before

    s = complete_inplace(greedy(vtog, savings))
    keep = _kept_library(s, clusters, getattr(savings, "prefers_library", None))
    s = physical_inplace(complete_views(s, graph, _kept_edge_ops(graph, vtog, s), keep(s)))
    gone = eliminated_ops(graph, s)
    for c in clusters:
        if c.kind != Kind.MOVEMENT:
            continue
        for oid in c.ops:   # outputs left for nobody to produce: let the producer write them all
            op = graph.ops[oid]
            if oid in gone or any(e.inplace and e.op == oid for e in s.points_to(op.outputs[0])):
                continue
            if any(e.direction == Direction.WRITE for o in op.outputs for e in s.points_to(o)):
                s = priced(s, producer_writes(s, oid))
    for c in clusters:   # a cache row still copied by its in-place update: written by its producer
        if c.kind != Kind.MOVEMENT:
            continue
        for oid in c.ops:
            op = graph.ops[oid]
            if inplace_operand(op.primitive) is not None and oid not in eliminated_ops(graph, s):
                s = priced(s, update_by_producer(s, oid))
    for i in [i for i in s.chosen if vtog.edges[i].direction == Direction.WRITE]:
        if i in s.chosen:   # a write edge the greedy took over two read edges that tie with it
            s = priced(s, consumer_reads(s, i))
    s = complete_views(s, graph, _kept_edge_ops(graph, vtog, s), keep(s))
    return resolve(s, graph, clusters)


def _kept_library(s: Strategy, clusters: Sequence["Cluster"],
                  prefers: Callable[[int], bool] | None) -> Callable[[Strategy], frozenset[int]]:
    """``strategy -> tensors to keep physical``: the operands of the GEMMs and convolutions the
    cost model prefers as library calls (``prefers(cluster position)``) and of reductions, that
    touch no virtual tensor yet (the greedy left them to XLA; a free view must not make them kernels)."""
    if prefers is None:
        return lambda s: frozenset()
    # reductions too: a norm whose only virtual operand would be its weight's free broadcast is
    # one XLA input fusion with the weight's cast; as a Pallas kernel it is two launches
    lib = [c for k, c in enumerate(clusters) if c.kind in (Kind.MATMUL, Kind.CONV) and prefers(k)]
    norms = [c for c in clusters if c.kind == Kind.REDUCTION]
    made_by = {t: c for c in clusters for t in c.outputs}

    def weight_broadcast(t: int) -> bool:   # (1, d) view of a weight vector: a norm's scale
        c = made_by.get(t)
        return c is not None and c.kind == Kind.MOVEMENT and len(c.inputs) == 1 and len(c.outputs) == 1 \
            and c.inputs[0] in made_by and made_by[c.inputs[0]].kind != Kind.MOVEMENT

    def keep(s: Strategy) -> frozenset[int]:
        out = {t for c in lib for t in (*c.inputs, *c.outputs)
               if not any(s.is_virtual(x) for x in (*c.inputs, *c.outputs))}
        out |= {t for c in norms if not any(s.is_virtual(x) for x in (*c.inputs, *c.outputs))
                for t in c.inputs if weight_broadcast(t)}
        return frozenset(out)
    return keep


def _kept_edge_ops(graph: "Graph", vtog: VTOG, s: Strategy) -> list[int]:
    gone = eliminated_ops(graph, s)
    return [e.op for e in vtog.edges if e.op not in gone]


def resolve(strategy: Strategy, graph: "Graph", clusters: Sequence["Cluster"]) -> Strategy:
    """``strategy`` with its :class:`Resolution` attached."""
    gone = eliminated_ops(graph, strategy)
    inplace = frozenset(e.op for t in strategy.virtual for e in strategy.points_to(t) if e.inplace)
    executed = tuple(oid for c in clusters if c.kind == Kind.MOVEMENT for oid in c.ops
                     if oid not in gone and oid not in inplace)
    layouts = {t: strategy.layout(t) for t in sorted(strategy.virtual)}
    return Strategy(strategy.chosen, strategy.total_saving, strategy.trace, strategy.vtog,
                    resolution=Resolution(layouts, gone, inplace, executed))


def eliminated_ops(graph: "Graph", strategy: Strategy) -> frozenset[int]:
    """Movement ops no one has to execute under ``strategy``."""
    v = strategy.vtog
    by_op: dict[int, list[Edge]] = {}    # grouped once: a scan of every chosen edge per op is
    for i in strategy.chosen:            # quadratic in the layers of an unrolled model
        by_op.setdefault(v.edges[i].op, []).append(v.edges[i])
    out: set[int] = set()
    for oid, chosen in by_op.items():
        op = graph.ops[oid]
        ok = True
        for o in op.outputs:
            if strategy.is_virtual(o) and all(e.direction == Direction.READ for e in strategy.points_to(o)):
                continue  # read through its map from data that exists elsewhere
            # physical, or itself written through a map: its producers (the op's inputs, through
            # this op's write edges) must fill all of it, or the op has to run
            covered = sum(box_volume(e.box) for e in chosen
                          if e.dst == o and e.direction == Direction.WRITE)
            if covered < graph.tensors[o].size:
                ok = False
                break
        k = inplace_operand(op.primitive)
        if ok and k is not None and any(e.inplace for e in strategy.points_to(op.outputs[0])):
            # in place: the updates still have to land, unless their producers write them there
            updates = [t for t in data_inputs(op) if t != op.inputs[k]]
            ok = all(any(e.src == u for e in chosen) for u in updates)
        if ok:
            out.add(oid)
    return frozenset(out)
