"""Stage 4: the Virtual Tensor Opportunity Graph (paper §5.1, Algorithm 1) and its conflict sets.

A VTOG node is a tensor; an edge ``src ⇢ dst`` (a :class:`movement.Edge`) says "src can be made a
virtual tensor of dst by eliminating one movement op". This module only *collects* the options;
choosing among them is :mod:`strategy`'s job.

Why each rule below:

* **Pinned physical tensors** (no outgoing edges, reason recorded in ``VTOG.reasons``):
  graph inputs and outputs (the caller hands over / receives real buffers — Algorithm 1, line 11),
  compile-time constants (literals live in their own buffers), and every tensor read or written by
  a cluster that stays ordinary XLA (``opaque``, ``glue``): XLA cannot read through an index map.
  Algorithm 1 only filters on the *source*; an edge may still point *to* a pinned tensor — that is
  exactly how a virtual tensor ends up in the KV cache.
* **Conflicts** (paper Fig. 6): two outgoing edges of one node conflict when their boxes overlap,
  because an element in the overlap would get two homes (the mapping must stay one-to-one).
  Disjoint boxes (the pieces of a concat/split) are compatible. A read-direction and a
  write-direction edge out of the same node conflict by the same rule whenever their boxes overlap
  (they always do for full-box edges). Cycles are not a static property of the VTOG (``a ⇢ b`` and
  ``b ⇢ a`` are both fine options, just not together): the strategy rejects a pick that closes one.
* **In-place legality** (``Edge.inplace``, dynamic_update_slice ``out ⇢ operand``): making the
  output live in the operand's buffer overwrites the operand's old contents at the update. That is
  only legal when nothing reads those old contents afterwards — neither a direct consumer of the
  operand scheduled after the update, nor a consumer of any tensor that could be made virtual of
  the operand (it would then read the buffer after the update). The check is static and
  conservative (the cluster order is the emitted order); dropped edges are listed in ``VTOG.dropped``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .cluster import Cluster
from .graph import Graph, Op
from .movement import Edge
from .movement import rules as movement_rules
from .primitives import Kind, inplace_operand
from .templates import Match, match_all

__all__ = ["VTOG", "build_vtog", "build_vtog_from_edges", "boxes_overlap", "box_volume", "piece_group"]

Box = tuple[tuple[int, int], ...]

def box_volume(box: Box) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in box)


def boxes_overlap(a: Box, b: Box) -> bool:
    """True when the two boxes share at least one index (rank-0 boxes always overlap)."""
    return all(max(alo, blo) < min(ahi, bhi) for (alo, ahi), (blo, bhi) in zip(a, b))


@dataclass(frozen=True, eq=False)
class VTOG:
    """The opportunity graph: nodes (tensor ids), candidate edges and their pairwise conflicts.

    ``conflicts`` holds pairs ``(i, j)`` of edge indices with ``i < j`` (both leave the same node).
    ``physical`` are the pinned tensors (never sources of an edge), ``reasons[t]`` says why.
    ``shapes`` gives every node's shape (needed to describe physical tensors as layouts).
    ``dropped`` lists candidate edges Algorithm 1 or the legality check removed, with the reason.
    """
    nodes: tuple[int, ...]
    edges: tuple[Edge, ...]
    conflicts: frozenset[tuple[int, int]]
    physical: frozenset[int]
    reasons: Mapping[int, str]
    shapes: Mapping[int, tuple[int, ...]]
    dropped: tuple[tuple[Edge, str], ...] = ()
    _out: Mapping[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    _in: Mapping[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    _index: Mapping[Edge, int] = field(default_factory=dict, repr=False)
    _conflict_of: Mapping[int, frozenset[int]] = field(default_factory=dict, repr=False)

    def out_edges(self, node: int) -> tuple[int, ...]:
        """Indices of the edges leaving ``node`` (the ways to make it virtual)."""
        return self._out.get(node, ())

    def in_edges(self, node: int) -> tuple[int, ...]:
        """Indices of the edges pointing to ``node`` (the tensors that could live in it)."""
        return self._in.get(node, ())

    def index(self, edge: Edge) -> int:
        """Position of ``edge`` in ``edges`` (edges are unique values)."""
        return self._index[edge]

    def conflicting(self, i: int) -> frozenset[int]:
        """Edge indices that conflict with edge ``i``."""
        return self._conflict_of.get(i, frozenset())

    def in_conflict(self, i: int, j: int) -> bool:
        return (min(i, j), max(i, j)) in self.conflicts

    def volume(self, node: int) -> int:
        return math.prod(self.shapes[node])

    def __str__(self) -> str:
        lines = [f"VTOG: {len(self.nodes)} nodes, {len(self.edges)} edges, {len(self.conflicts)} conflicts"]
        for i, e in enumerate(self.edges):
            lines.append(f"  e{i}: t{e.src} ⇢ t{e.dst} via {e.primitive}#{e.op} {e.direction} "
                         f"type {e.klass} box={list(e.box)}")
        return "\n".join(lines)


def build_vtog_from_edges(nodes: Iterable[int], edges: Iterable[Edge], physical: Iterable[int] = (),
                          reasons: Mapping[int, str] | None = None,
                          shapes: Mapping[int, Sequence[int]] | None = None,
                          dropped: Sequence[tuple[Edge, str]] = ()) -> VTOG:
    """The VTOG of an explicit edge list (Algorithm 1 lines 8-16 minus the rule calls).

    Edges out of ``physical`` nodes are dropped (recorded in ``dropped``), duplicates are merged,
    conflicts are computed from box overlap. Shapes not given are read off the edges' maps.
    Tests build the paper's figures with this; :func:`build_vtog` feeds it from a traced graph.
    """
    nodes_t = tuple(dict.fromkeys(int(n) for n in nodes))
    phys = frozenset(int(p) for p in physical)
    reasons = dict(reasons or {})
    for p in phys:
        reasons.setdefault(p, "pinned physical")
    shp: dict[int, tuple[int, ...]] = {int(k): tuple(int(n) for n in v) for k, v in (shapes or {}).items()}
    kept: dict[Edge, None] = {}
    drops = list(dropped)
    for e in edges:
        shp.setdefault(e.src, tuple(e.map.domain))
        shp.setdefault(e.dst, tuple(e.map.target))
        if e.src in phys:
            drops.append((e, f"t{e.src} must stay physical: {reasons[e.src]}"))
        elif e.src == e.dst:
            drops.append((e, "self edge"))
        else:
            kept.setdefault(e, None)
    all_nodes = tuple(dict.fromkeys((*nodes_t, *(n for e in kept for n in (e.src, e.dst)))))
    missing = [n for n in all_nodes if n not in shp]
    if missing:
        raise ValueError(f"no shape known for nodes {missing}: pass shapes=")
    edge_t = tuple(kept)
    out: dict[int, list[int]] = {}
    inn: dict[int, list[int]] = {}
    for i, e in enumerate(edge_t):
        out.setdefault(e.src, []).append(i)
        inn.setdefault(e.dst, []).append(i)
    conflicts: set[tuple[int, int]] = set()
    for idxs in out.values():
        for a_pos, i in enumerate(idxs):
            for j in idxs[a_pos + 1:]:
                if boxes_overlap(edge_t[i].box, edge_t[j].box):
                    conflicts.add((i, j) if i < j else (j, i))
    conflict_of: dict[int, set[int]] = {}
    for i, j in conflicts:
        conflict_of.setdefault(i, set()).add(j)
        conflict_of.setdefault(j, set()).add(i)
    return VTOG(
        nodes=all_nodes, edges=edge_t, conflicts=frozenset(conflicts), physical=phys,
        reasons=MappingProxyType(reasons), shapes=MappingProxyType(shp), dropped=tuple(drops),
        _out=MappingProxyType({k: tuple(v) for k, v in out.items()}),
        _in=MappingProxyType({k: tuple(v) for k, v in inn.items()}),
        _index=MappingProxyType({e: i for i, e in enumerate(edge_t)}),
        _conflict_of=MappingProxyType({k: frozenset(v) for k, v in conflict_of.items()}))


def piece_group(vtog: VTOG, i: int) -> tuple[int, ...]:
    """The edges that must be chosen together with edge ``i`` to cover its source exactly.

    A full-box edge stands alone. A piece (a slab of a concat output or split input) needs the
    other pieces *of the same op* out of the same node: a half-virtual tensor is no strategy.
    Savings functions evaluate the group and credit each piece its share (by volume), so that
    "all pieces together" is what gets measured. Falls back to ``(i,)`` if the op's pieces do
    not tile the node.
    """
    e = vtog.edges[i]
    total = vtog.volume(e.src)
    if box_volume(e.box) == total:
        return (i,)
    group = [j for j in vtog.out_edges(e.src) if vtog.edges[j].op == e.op
             and box_volume(vtog.edges[j].box) < total]
    disjoint = all(not boxes_overlap(vtog.edges[a].box, vtog.edges[b].box)
                   for k, a in enumerate(group) for b in group[k + 1:])
    if disjoint and sum(box_volume(vtog.edges[j].box) for j in group) == total:
        return tuple(group)
    return (i,)


def xla_pin_reason(c: Cluster, why: str) -> str:
    """The pin reason of a tensor touching a compute cluster no template took."""
    return f"touches {c.kind} cluster #{c.id}, which runs in XLA: {why}"


def pinned_tensors(graph: Graph, clusters: Sequence[Cluster],
                   matches: Mapping[int, Any]) -> dict[int, str]:
    """Tensors that must stay physical, each with the reason (first reason wins).

    A graph output written by an in-place update is the exception: its only edge is the
    in-place one (identity map onto the operand), so returning it returns the operand's buffer
    updated in place — the KV cache a decode step hands back. Every tensor of a compute cluster
    whose template did not match (``matches[c.id]`` is a ``templates.Reject``) stays physical:
    XLA cannot read or write through a map, and a kernel that will not exist must not be
    planned for.
    """
    reasons: dict[int, str] = {}
    for t in graph.inputs:
        reasons.setdefault(t, "graph input")
    for t in graph.outputs:
        producer = graph.producer(t)
        if producer is None or inplace_operand(producer.primitive) is None or graph.outputs.count(t) > 1:
            reasons.setdefault(t, "graph output")
    for info in graph.tensors:
        if info.const is not None:
            reasons.setdefault(info.id, "compile-time constant")
    for c in clusters:
        if c.kind == Kind.MOVEMENT or isinstance(matches.get(c.id), Match):
            continue
        verdict = matches.get(c.id)
        if verdict is not None:
            why = xla_pin_reason(c, verdict.reason)
        else:
            why = f"touches {c.kind} cluster #{c.id}" + (f" ({c.reason})" if c.reason else "")
        for t in (*c.inputs, *c.outputs):
            reasons.setdefault(t, why)
    return reasons


def _inplace_problem(e: Edge, op: Op, graph: Graph, candidates: Sequence[Edge],
                     order: Mapping[int, int]) -> str | None:
    """Why the in-place edge ``out ⇢ operand`` of ``op`` is illegal, or None when it is legal.

    Readers of the operand's *old* contents after the update would see it. Those readers are
    the operand's direct consumers and the consumers of every tensor that could be made virtual of
    the operand through other candidate edges (found by walking the edges backwards). "After"
    is by ``order`` (op id -> position in the emitted order: the cluster order), counted from the
    earliest op that may write the update into the operand's buffer: ``op`` itself, or the
    producer of a tensor that may live in the update's result (its row written there by the
    kernel that makes it, a write edge). Why: ``c.at[1].set(x), c.at[2].set(x)`` (a cache forked
    for two draft tokens) — the second update in place, its row written into ``c``'s buffer by the
    kernel that computes both rows, ran before XLA's copy of ``c`` for the first, which then
    returned both rows."""
    operand = e.dst
    if operand in graph.outputs:
        return f"operand t{operand} is a graph output: its old contents are returned"
    into: dict[int, list[int]] = {}
    for c in candidates:
        if c is not e and c.src != e.src:
            into.setdefault(c.dst, []).append(c.src)

    def living_in(t: int, into: Mapping[int, Sequence[int]]) -> set[int]:
        seen, stack = {t}, [t]
        while stack:
            for s in into.get(stack.pop(), ()):
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return seen

    into_out: dict[int, list[int]] = {}
    for c in candidates:
        if c is not e:
            into_out.setdefault(c.dst, []).append(c.src)
    at = order.get(op.id, op.id)
    writer = op
    for t in living_in(e.src, into_out):
        p = graph.producer(t)
        if p is not None and order.get(p.id, p.id) < at:
            at, writer = order.get(p.id, p.id), p
    for t in living_in(operand, into):
        for user in graph.consumers(t):
            if user.id != op.id and order.get(user.id, user.id) > at:
                via = "" if t == operand else f" (via t{t}, which may live in it)"
                by = "" if writer is op else f", which op #{writer.id} may write there first"
                return f"op #{user.id} reads t{operand}'s old contents after the update{by}{via}"
    return None


def build_vtog(graph: Graph, clusters: Sequence[Cluster],
               rules: Callable[[Op, Graph], Sequence[Edge]] | None = None,
               matches: Mapping[int, Any] | None = None) -> VTOG:
    """Algorithm 1: every tensor is a node; every movement op contributes its rule edges.

    Only ops of ``movement`` clusters are asked for edges: a movement op fused inside a compute
    cluster (a reduction's keepdims re-broadcast) never touches memory, so there is nothing to
    eliminate. A movement op that offers no edge (a gather at runtime indices) stays an XLA op, so
    its tensors are pinned like an opaque cluster's. Edges whose source is pinned physical are
    dropped (the reason is kept). ``matches`` are the templates' verdicts
    (``templates.match_all``; computed here when not given).
    """
    if rules is None:
        rules = movement_rules
    if matches is None:
        matches = match_all(graph, clusters)
    reasons = pinned_tensors(graph, clusters, matches)
    order = {oid: pos for pos, c in enumerate(clusters) for oid in c.ops}
    movement_ops = [oid for c in clusters if c.kind == Kind.MOVEMENT for oid in c.ops]
    candidates: list[Edge] = []
    for oid in sorted(movement_ops):
        op = graph.ops[oid]
        found = tuple(rules(op, graph))
        if not found:  # stays an XLA op, which cannot read or write through a map
            for t in (*op.inputs, *op.outputs):
                reasons.setdefault(t, f"touches movement op #{oid} ({op.primitive}) that offers no edge")
        candidates.extend(found)
    dropped: list[tuple[Edge, str]] = []
    edges: list[Edge] = []
    for e in candidates:
        if e.inplace:
            why = _inplace_problem(e, graph.ops[e.op], graph, candidates, order)
            if why:
                dropped.append((e, f"in-place update illegal: {why}"))
                continue
        edges.append(e)
    shapes = {t.id: tuple(t.shape) for t in graph.tensors}
    return build_vtog_from_edges(range(len(graph.tensors)), edges, physical=reasons.keys(),
                                 reasons=reasons, shapes=shapes, dropped=dropped)
