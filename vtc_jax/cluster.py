"""Stage 2: group the ops of a `Graph` into kernel-shaped clusters (see docs/INTERNALS.md).

The paper's input is "a computation graph after operator fusion": VTC removes the data movement
*between* fused kernels. This module plays the fusion pass. Every op lands in exactly one cluster:

* attention — dot_general -> (scale / mask / soft-cap / transpose) -> softmax -> dot_general, found
  by pattern: nothing inside may be used outside (a flash kernel never materialises the scores).
  It also takes the element-wise chains that widen q, K or V from what is stored (a dequantised
  int8 cache, ``k.astype(jnp.float32)``: :func:`operand_chain`), which the kernel applies to the
  blocks it loads; after islands are fused, the island making its query (a rotary embedding:
  :func:`query_prologue_islands`, merged by :func:`fuse_islands`).
* matmul / conv — dot_general / conv_general_dilated plus an elementwise epilogue whose other
  operands are small or broadcast (bias); a matmul also takes a unary elementwise prologue on an
  operand only it reads (a ReLU on q or k). The epilogue may branch (SiLU reads the dot output twice)
  but the cluster keeps a single escaping tensor, so fusion never duplicates work.
* reduction — a reduce op with its elementwise prologue/epilogue (RMSNorm, LayerNorm, softmax).
  The keepdims re-broadcast of a reduced value is part of it: it never touches memory.
* pointwise — connected elementwise ops with equal or broadcast-compatible shapes (incl. iota).
* movement — each data-movement op alone, *including* broadcasts of scalars/iotas: eliminating
  those is exactly the VTOG's job (an Expand read edge), so fusion must not hide them.
* glue — scalar/tiny integer index arithmetic (clamping `pos`, ...), left to XLA.
* opaque — everything else (sort, control flow, custom calls), with a reason naming the primitive.

Merges are checked so the cluster graph stays acyclic; clusters come out in topological order.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from .graph import Graph, Op, is_extended
from .indexmap import union_shape
from .primitives import TABLE, Kind, cluster_kind, is_movement_op

# Movement ops a reduction cluster may keep inside (the keepdims re-broadcast of a reduced value).
_STAT_VIEWS = frozenset(n for n, r in TABLE.items() if r.stat_view)
GLUE_MAX_ELEMENTS = 32  # "tiny": integer tensors up to this size are index arithmetic, not kernels


@dataclass(frozen=True)
class Cluster:
    id: int
    kind: Kind  # matmul | attention | pointwise | reduction | conv | movement | glue | opaque
    ops: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    reason: str = ""


def _is_glue(op: Op, graph: Graph) -> bool:
    """Index arithmetic: every tensor tiny, outputs integer/bool (or all scalars)."""
    ts = [graph.tensors[t] for t in (*op.inputs, *op.outputs)]
    outs = [graph.tensors[t] for t in op.outputs]
    small = all(t.size <= GLUE_MAX_ELEMENTS for t in ts)
    indexy = all(np.issubdtype(t.dtype, np.integer) or t.dtype == np.bool_ for t in outs)
    return small and (indexy or all(t.shape == () for t in ts))


def _role(op: Op, graph: Graph) -> Kind:
    """The kind of cluster the op seeds (``primitives.cluster_kind``), refined: opaque when the
    tracer kept it opaque or it is a width-changing bitcast, glue for PRNG-key ops and tiny index
    arithmetic. Never attention (a pattern of ops, found by :func:`_attention`)."""
    if op.opaque_reason is not None:
        return Kind.OPAQUE
    if any(is_extended(graph.tensors[t].dtype) for t in (*op.inputs, *op.outputs)):
        return Kind.GLUE  # PRNG-key ops (random_seed/bits/split, slices of key arrays): plain XLA
    if op.primitive == "bitcast_convert_type" and \
            graph.tensors[op.inputs[0]].shape != graph.tensors[op.outputs[0]].shape:
        return Kind.OPAQUE  # a width-changing bitcast adds/drops a minor dim: not elementwise
    kind = cluster_kind(op, graph)
    if kind in (Kind.MATMUL, Kind.CONV, Kind.OPAQUE):
        return kind
    return Kind.GLUE if _is_glue(op, graph) else kind


def _broadcastable(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    return len(small) <= len(big) and all(s in (1, b) for s, b in zip(small[::-1], big[::-1]))


class _Groups:
    """Working state of one `cluster` call: op -> group, with merges that keep the DAG acyclic."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.of: list[int | None] = [None] * len(graph.ops)
        self.members: dict[int, set[int]] = {}
        self.kind: dict[int, Kind] = {}
        self._next_id = 0
        # consumer op ids of each op, computed once: the cycle check walks them constantly
        self.succ: list[tuple[int, ...]] = [
            tuple(dict.fromkeys(c.id for t in op.outputs for c in graph.consumers(t))) for op in graph.ops]
        # Where op ids are a topological order (a jaxpr's), the cycle check stops at a cut: see
        # `_cut`. Each group's smallest and largest op id, kept as bounds: a removal leaves them
        # wider than the group, which only makes the cut later (never wrong).
        self.ordered = all(c > o for o, cs in enumerate(self.succ) for c in cs)
        self.lo: dict[int, int] = {}
        self._reach_up = [-1] * (len(graph.ops) + 1)   # Fenwick tree: max hi over groups with lo <= i

    def _span(self, gid: int, ops: set[int]) -> None:
        """Widen ``gid``'s bounds by ``ops``, now among its members."""
        if not ops:
            return
        lo, hi = min(ops), max(ops)
        self.lo[gid] = min(self.lo.get(gid, lo), lo)
        i = self.lo[gid] + 1
        while i < len(self._reach_up):
            self._reach_up[i] = max(self._reach_up[i], hi)
            i += i & -i

    def _cut(self, top: int) -> int:
        """The first op id ``>= top`` that no group straddles (none has members on both sides):
        nothing after such a cut reaches an op at or before it, since every edge goes to a later
        id and a group is entered only at a member after the cut. The cycle check need not walk
        past it."""
        cut = top
        while True:
            i, reach = cut + 1, cut
            while i > 0:               # the largest member of a group that starts at or before `cut`
                reach = max(reach, self._reach_up[i])
                i -= i & -i
            if reach <= cut:
                return cut
            cut = reach

    def free(self, op: int) -> bool:
        return self.of[op] is None

    def new(self, kind: Kind, ops: set[int]) -> int | None:
        """A new group of free `ops`, or None if contracting them would create a cycle."""
        return self.make(kind, ops) if len(ops) == 1 or self._acyclic(ops) else None

    def make(self, kind: Kind, ops: set[int]) -> int:
        """Unchecked `new`: a single op can never close a cycle."""
        gid = self._next_id
        self._next_id += 1
        self.kind[gid], self.members[gid] = kind, set(ops)
        for o in ops:
            self.of[o] = gid
        self._span(gid, ops)
        return gid

    def try_add(self, gid: int, op: int) -> bool:
        if not self.free(op) or not self._acyclic(self.members[gid] | {op}):
            return False
        self.members[gid].add(op)
        self.of[op] = gid
        self._span(gid, {op})
        return True

    def remove(self, gid: int, op: int) -> None:
        self.members[gid].discard(op)
        self.of[op] = None

    def try_merge(self, a: int, b: int) -> bool:
        if a == b or not self._acyclic(self.members[a] | self.members[b]):
            return a == b
        self.absorb(a, b)
        return True

    def absorb(self, a: int, b: int) -> None:
        """Unchecked merge: group ``b``'s ops join group ``a``."""
        moved = self.members.pop(b)
        for o in moved:
            self.of[o] = a
        self.members[a] |= moved
        self._span(a, moved)
        del self.kind[b]
        self.lo.pop(b, None)

    def _acyclic(self, ops: set[int]) -> bool:
        """No path leaves `ops` and re-enters it (other groups count as contracted nodes)."""
        succ, of, members = self.succ, self.of, self.members
        stack = [c for o in ops for c in succ[o] if c not in ops]
        cut = self._cut(max(ops)) if self.ordered else len(of)
        seen: set[int] = set()
        while stack:
            o = stack.pop()
            if o in seen:
                continue
            gid = of[o]
            if (o if gid is None else self.lo[gid]) > cut:
                continue   # wholly after the cut: cannot lead back into `ops`
            unit = members[gid] if gid is not None else (o,)
            seen.update(unit)
            for u in unit:
                for c in succ[u]:
                    if c in ops:
                        return False
                    if c not in seen:
                        stack.append(c)
        return True

    def escaping(self, gid: int) -> list[int]:
        """Tensors made inside the group and used outside it (or returned by the graph)."""
        g, ops = self.graph, self.members[gid]
        return [t for o in sorted(ops) for t in g.ops[o].outputs
                if t in g.outputs or any(c.id not in ops for c in g.consumers(t))]


def _attention(graph: Graph, roles: list[Kind], d1: Op) -> set[int] | None:
    """Ops of dot -> ... softmax ... -> dot starting at `d1`, if no intermediate escapes."""
    region: set[int] = set()
    dots: set[int] = set()
    stack = [d1]
    while stack:
        for c in (c for t in stack.pop().outputs for c in graph.consumers(t)):
            if roles[c.id] is Kind.MATMUL:
                dots.add(c.id)
            elif roles[c.id] in (Kind.POINTWISE, Kind.REDUCTION, Kind.MOVEMENT) and c.id not in region:
                region.add(c.id)
                stack.append(c)
    for d2 in sorted(dots):
        path: set[int] = set()
        stack = [graph.ops[d2]]
        while stack:
            for p in (graph.producer(t) for t in stack.pop().inputs):
                if p is not None and p.id in region and p.id not in path:
                    path.add(p.id)
                    stack.append(p)
        if not {"exp", "reduce_sum"} <= {graph.ops[o].primitive for o in path}:
            continue
        d2_other = {_behind_views(graph, t) for t in graph.ops[d2].inputs
                    if (p := graph.producer(t)) is None or p.id not in path}
        if d2_other & {_behind_views(graph, t) for t in d1.inputs} and _gradient_of_softmax(graph, path, d1):
            # keys and values one tensor, a softmax's gradient between: an LM head's logits and
            # the input gradient through them (``dlogits @ W.T``), no attention. One tensor
            # through a softmax is attention: MLA's absorbed latent cache, a cache read as keys
            # and as values
            continue
        ops = path | {d1.id, d2}
        scores = {t for o in ops - {d2} for t in graph.ops[o].outputs}
        if not scores & set(graph.outputs) and all(c.id in ops for t in scores for c in graph.consumers(t)):
            # the output's dtype casts (``o.astype(q.dtype)``) are the kernel's store: a cast left
            # outside is a launch of its own between the Pallas kernel and whatever reads it
            t = graph.ops[d2].outputs[0]
            while t not in graph.outputs and len(users := graph.consumers(t)) == 1 \
                    and users[0].primitive == "convert_element_type":
                ops.add(users[0].id)
                t = users[0].outputs[0]
            return ops | _attention_prologues(graph, roles, ops, d1, graph.ops[d2])
    return None


def _gradient_of_softmax(graph: Graph, path: set[int], d1: Op) -> bool:
    """Whether, past an ``exp`` on ``path``, two tensors of the scores' size are added or
    subtracted: a softmax's gradient (``p * sum(g) - g``, the labels' one-hot or scatter added),
    where attention only scales its probabilities (the normalisation, dropout's mask)."""
    size = graph.tensors[d1.outputs[0]].size
    after = set(_walk_forward(graph, [o for o in path if graph.ops[o].primitive == "exp"], path))
    return any(graph.ops[o].primitive in ("add", "sub", "add_any")
               and sum(graph.tensors[t].size == size for t in graph.ops[o].inputs) >= 2 for o in after)


def _walk_forward(graph: Graph, starts: list[int], within: set[int]) -> set[int]:
    """Ops of ``within`` reading, directly or through others of ``within``, the ops ``starts``."""
    seen: set[int] = set()
    stack = list(starts)
    while stack:
        for c in (c for t in graph.ops[stack.pop()].outputs for c in graph.consumers(t)):
            if c.id in within and c.id not in seen:
                seen.add(c.id)
                stack.append(c.id)
    return seen


def _behind_views(graph: Graph, t: int) -> int:
    """The tensor ``t`` is a transpose, reshape or copy of (through any number of them), or ``t``."""
    while (p := graph.producer(t)) is not None and p.primitive in ("transpose", "reshape", "copy") and len(p.inputs) == 1:
        t = p.inputs[0]
    return t


def operand_chain(graph: Graph, x: int, member: Callable[[Op], bool]) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(base, chain, side)``: the element-wise ops (``member``) that make a dot operand ``x`` from
    one tensor ``base`` of its shape, in program order, and the other tensors they read — each
    fewer elements broadcast to ``x``'s shape (a per-token scale: by the op's size-1 dims, or by a
    ``broadcast_in_dim`` and rearrangements); scalar constants are inlined. A chain with a dtype
    change is what a kernel loads narrow and widens in registers (``cache.astype(jnp.bfloat16) *
    scale``). The one definition, for the attention cluster's growth and the attention template's
    prologues."""
    chain: list[int] = []
    side: list[int] = []
    shape = tuple(graph.tensors[x].shape)
    size = graph.tensors[x].size
    while (p := graph.producer(x)) is not None and len(p.outputs) == 1 and member(p):
        ins = list(dict.fromkeys(t for t in p.inputs if not (graph.tensors[t].const is not None and graph.tensors[t].size == 1)))
        if not ins or not all(len(graph.tensors[t].shape) == len(shape) and _broadcastable(graph.tensors[t].shape, shape)
                              for t in ins):
            break
        roots = [_root_size(graph, t) for t in ins]
        base = ins[roots.index(max(roots))]
        if tuple(graph.tensors[base].shape) != shape or sorted(roots)[-2:-1] == [max(roots)] or \
                any(r >= size for t, r in zip(ins, roots) if t != base):
            break   # no one tensor of x's shape with the others broadcast smaller
        chain.append(p.id)
        side.extend(t for t in ins if t != base)
        x = base
    return x, tuple(reversed(chain)), tuple(dict.fromkeys(side))


def _root_size(graph: Graph, t: int) -> int:
    """The elements ``t`` is made of through broadcasts and rearrangements (a GQA repeat of a
    cache: the cache's; of a per-token scale: the scale's)."""
    while (p := graph.producer(t)) is not None and len(p.inputs) == 1 and (
            p.primitive == "broadcast_in_dim" or (TABLE.get(p.primitive) is not None and TABLE[p.primitive].sinkable)):
        t = p.inputs[0]
    return graph.tensors[t].size


def _attention_prologues(graph: Graph, roles: list[Kind], ops: set[int], d1: Op, d2: Op) -> set[int]:
    """The element-wise chains (:func:`operand_chain`) with a dtype change that make the attention's
    q, K and V from narrower tensors, each op read only by its chain: the kernel loads the narrow
    tensor (and its scales) and applies the chain to every block, so the widened copy never
    exists. A chain without a cast (``q * scale``) stays where it is: nothing narrower to load."""
    taken: set[int] = set()

    def member(p: Op) -> bool:
        x = p.outputs[0]
        return (p.id not in ops and p.id not in taken and roles[p.id] is Kind.POINTWISE
                and x not in graph.outputs and len(graph.consumers(x)) == 1)
    v = [t for t in d2.inputs if (p := graph.producer(t)) is None or p.id not in ops]
    for x in (*d1.inputs, *v):
        _, chain, _ = operand_chain(graph, x, member)
        if any(graph.ops[o].primitive == "convert_element_type" for o in chain):
            taken.update(chain)
    return taken


def _small_operand(graph: Graph, t: int, size: int) -> bool:
    """Bias-like operand of an epilogue: a const, smaller than the output, or an explicit broadcast."""
    p = graph.producer(t)
    info = graph.tensors[t]
    return info.const is not None or info.size < size or (p is not None and p.primitive == "broadcast_in_dim")


def _grow_epilogue(graph: Graph, roles: list[Kind], groups: _Groups, gid: int, root: Op) -> None:
    """Absorb elementwise consumers of a dot/conv, then shrink back to one escaping tensor."""
    shape = graph.tensors[root.outputs[0]].shape
    size = graph.tensors[root.outputs[0]].size
    changed = True
    while changed:
        changed = False
        made = {t for o in groups.members[gid] for t in graph.ops[o].outputs}
        for c in sorted({c.id for t in made for c in graph.consumers(t)}):
            op = graph.ops[c]
            if (groups.free(c) and roles[c] is Kind.POINTWISE
                    and all(graph.tensors[t].shape == shape for t in op.outputs)
                    and all(t in made or _small_operand(graph, t, size) for t in op.inputs)):
                changed |= groups.try_add(gid, c)
    while len(groups.escaping(gid)) > 1:  # the last op has no dependents inside: drop it first
        groups.remove(gid, max(groups.members[gid] - {root.id}))


def _grow_prologue(graph: Graph, roles: list[Kind], groups: _Groups, gid: int, root: Op) -> None:
    """Absorb a unary elementwise chain feeding one operand of a dot (EfficientViT's ReLU on q and
    k): the kernel applies it to each loaded tile, so its result never touches memory. Only ops
    whose other operands are scalar constants, that keep shape and dtype, and whose result the
    dot alone reads; the template checks that the chain maps 0 to 0 (masked lanes stay 0). A
    widening float cast may change the dtype (``v.astype(jnp.float32) @ k`` on bf16 values: the
    kernel loads the bf16 tile and casts it in registers instead of XLA writing an f32 copy)."""
    for x in root.inputs[:2]:
        while True:
            p = graph.producer(x)
            if p is None or not groups.free(p.id) or roles[p.id] is not Kind.POINTWISE or len(p.outputs) != 1:
                break
            if x in graph.outputs or len(graph.consumers(x)) != 1:
                break
            big = [t for t in p.inputs if graph.tensors[t].size > 1 or graph.tensors[t].const is None]
            if len(big) != 1 or any(graph.tensors[t].const is None for t in p.inputs if t not in big):
                break
            src, info = graph.tensors[big[0]], graph.tensors[x]
            # a widening float cast only: loading the narrow tile is the saving (a narrowing cast
            # stays with its producer, whose store it halves); jnp: numpy's misses bfloat16
            recast = p.primitive == "convert_element_type" and all(
                jnp.issubdtype(d, jnp.floating) for d in (src.dtype, info.dtype)) and \
                np.dtype(src.dtype).itemsize < np.dtype(info.dtype).itemsize
            if src.shape != info.shape or (src.dtype != info.dtype and not recast) or not groups.try_add(gid, p.id):
                break
            x = big[0]


def _grow_reduction(graph: Graph, roles: list[Kind], groups: _Groups, gid: int, seed: Op,
                    siblings: bool = True) -> None:
    """Absorb the row-wise prologue/epilogue of a reduce op (norms, softmax) and, with
    ``siblings``, its sibling statistics (:func:`_sibling_statistic`)."""
    domain = graph.tensors[seed.inputs[0]].size

    def fits(o: int) -> bool:  # stays within the row space of the reduction's input
        return all(graph.tensors[t].size <= domain for t in graph.ops[o].outputs)

    changed = True
    while changed:
        changed = False
        members = groups.members[gid]
        made = {t for o in members for t in graph.ops[o].outputs}
        forward = {c.id for t in made for c in graph.consumers(t)}
        for c in sorted(forward):
            op = graph.ops[c]
            ok = roles[c] in (Kind.POINTWISE, Kind.REDUCTION) or (
                op.primitive in _STAT_VIEWS and roles[c] is Kind.MOVEMENT and set(op.inputs) <= made)
            if groups.free(c) and ok and fits(c):
                changed |= groups.try_add(gid, c)
        backward = {p.id for o in members for t in graph.ops[o].inputs if (p := graph.producer(t))}
        for p in sorted(backward, reverse=True):
            users = {c.id for t in graph.ops[p].outputs for c in graph.consumers(t)}
            if (groups.free(p) and fits(p) and users <= members
                    and (roles[p] is Kind.POINTWISE or siblings and _sibling_statistic(graph, roles, p, seed))
                    and not set(graph.ops[p].outputs) & set(graph.outputs)):
                changed |= groups.try_add(gid, p)
    _drop_escaping_movement(graph, groups, gid)


def _sibling_statistic(graph: Graph, roles: list[Kind], o: int, seed: Op) -> bool:
    """A reduce over the seed's axes of a tensor of the seed's input shape, read only by the
    seed's cluster: another statistic of the same rows (``E[x²]`` beside ``E[x]``, as flax's
    GroupNorm and LayerNorm compute the variance), computed in the same pass over the rows."""
    op = graph.ops[o]
    return (roles[o] is Kind.REDUCTION and op.primitive == seed.primitive
            and tuple(op.params.get("axes", ())) == tuple(seed.params.get("axes", ()))
            and graph.tensors[op.inputs[0]].shape == graph.tensors[seed.inputs[0]].shape)


def _drop_escaping_movement(graph: Graph, groups: _Groups, gid: int) -> None:
    """A movement op whose result is needed outside is a real tensor: give it back, with its dependents."""
    while bad := [o for o in sorted(groups.members[gid]) if is_movement_op(graph.ops[o], graph)
                  and set(graph.ops[o].outputs) & set(groups.escaping(gid))]:
        drop = {bad[0]}
        for o in sorted(groups.members[gid]):
            if any((p := graph.producer(t)) is not None and p.id in drop for t in graph.ops[o].inputs):
                drop.add(o)
        for o in drop:
            groups.remove(gid, o)


def _merge_connected(graph: Graph, roles: list[Kind], groups: _Groups, kind: Kind, same_shape: bool) -> None:
    """Union producer/consumer pairs of free ops of role `kind` into `kind` groups.

    With `same_shape`, only pairs whose output shapes are equal or broadcast-compatible merge
    (a pointwise kernel iterates over one index space)."""
    def compatible(a: Op, b: Op) -> bool:
        sa, sb = graph.tensors[a.outputs[0]].shape, graph.tensors[b.outputs[0]].shape
        return not same_shape or _broadcastable(sa, sb) or _broadcastable(sb, sa)

    for op in graph.ops:
        if roles[op.id] is not kind or not groups.free(op.id):
            continue
        groups.make(kind, {op.id})
        for p in (graph.producer(t) for t in op.inputs):
            pg = None if p is None else groups.of[p.id]
            if pg is not None and roles[p.id] is kind and groups.kind[pg] is kind and compatible(p, op):
                groups.try_merge(pg, groups.of[op.id])


def cluster(graph: Graph, *, not_attention: frozenset[int] = frozenset(),
            siblings: bool = True) -> tuple[Cluster, ...]:
    """Partition `graph.ops` into kernel-shaped clusters, in topological order.

    ``not_attention``: first-dot op ids whose attention region the attention template declined;
    their ops are clustered as matmuls, reductions and pointwise ops instead. ``siblings``: a
    reduction cluster takes its sibling statistics (one kernel computes both in a pass); the
    model of XLA starts from clusters without them (``xla.xla_clusters``: XLA fuses sibling
    reductions by its own rule, and its normalisation is a launch apart)."""
    roles = [_role(op, graph) for op in graph.ops]
    groups = _Groups(graph)
    for op in graph.ops:
        if roles[op.id] is Kind.MATMUL and groups.free(op.id) and op.id not in not_attention:
            ops = _attention(graph, roles, op)
            if ops is not None and all(groups.free(o) for o in ops):
                groups.new(Kind.ATTENTION, ops)
    for op in graph.ops:
        if roles[op.id] in (Kind.MATMUL, Kind.CONV) and groups.free(op.id):
            gid = groups.make(roles[op.id], {op.id})
            if roles[op.id] is Kind.MATMUL:
                _grow_prologue(graph, roles, groups, gid, op)
            _grow_epilogue(graph, roles, groups, gid, op)
    while seeds := [op for op in graph.ops if roles[op.id] is Kind.REDUCTION and groups.free(op.id)]:
        _grow_reduction(graph, roles, groups, groups.make(Kind.REDUCTION, {seeds[0].id}), seeds[0], siblings)
    _merge_connected(graph, roles, groups, Kind.POINTWISE, same_shape=True)
    _merge_connected(graph, roles, groups, Kind.GLUE, same_shape=False)
    for op in graph.ops:
        if groups.free(op.id):
            groups.make(roles[op.id], {op.id})
    return _finalise(graph, groups)


def _reason(graph: Graph, kind: Kind, ops: tuple[int, ...]) -> str:
    if kind is Kind.GLUE:
        if any(is_extended(graph.tensors[t].dtype) for o in ops for t in (*graph.ops[o].inputs, *graph.ops[o].outputs)):
            return "PRNG-key ops (and index arithmetic) left to XLA"
        return "scalar index arithmetic left to XLA"
    if kind is Kind.OPAQUE:
        op = graph.ops[ops[0]]
        return op.opaque_reason or f"unsupported primitive '{op.primitive}' kept opaque"
    return ""


def _finalise(graph: Graph, groups: _Groups) -> tuple[Cluster, ...]:
    """Build `Cluster`s with inputs/outputs and order them topologically (ties: earliest op first)."""
    gids = [g for g in groups.kind if groups.members.get(g)]
    deps = {g: {groups.of[p.id] for o in groups.members[g] for t in graph.ops[o].inputs
                if (p := graph.producer(t)) is not None} - {g} for g in gids}
    users: dict[int, set[int]] = {g: set() for g in gids}
    for g, ds in deps.items():
        for d in ds:
            users[d].add(g)
    heap = [(min(groups.members[g]), g) for g in gids if not deps[g]]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        order.append(g := heapq.heappop(heap)[1])
        for u in users[g]:
            deps[u].discard(g)
            if not deps[u]:
                heapq.heappush(heap, (min(groups.members[u]), u))
    assert len(order) == len(gids), "cluster graph has a cycle"  # _Groups merges prevent this
    out: list[Cluster] = []
    for cid, g in enumerate(order):
        ops = tuple(sorted(groups.members[g]))
        made = {t for o in ops for t in graph.ops[o].outputs}
        inputs = tuple(dict.fromkeys(t for o in ops for t in graph.ops[o].inputs if t not in made))
        kind = groups.kind[g]
        out.append(Cluster(cid, kind, ops, inputs, tuple(groups.escaping(g)), _reason(graph, kind, ops)))
    return tuple(out)


def fuse_islands(graph: Graph, clusters: Sequence[Cluster], islands: Sequence[Sequence[int]], *,
                 union: bool = False) -> tuple[tuple[Cluster, ...], dict[int, str]]:
    """Re-cluster after elimination (the paper's kernels around *vanished* movement): each island
    of pointwise clusters joined only through movement clusters (``costmodel.pointwise_islands``:
    RoPE's convert/mul, neg and mul/add joined by slices and a concat) becomes ONE pointwise
    cluster holding the movement ops between its members. Its kernel recomputes a member's values
    at the indices a movement op maps to (templates/pointwise.py: movement inside a pointwise
    cluster is an index map, never a copy), so one launch replaces one per member — what XLA's
    loop fusion does for the same island.

    An island may also hold one attention cluster (:func:`query_prologue_islands`: the query's
    rotary embedding, which the attention kernel then recomputes on the blocks it loads); the
    fused cluster has the kind of its member that is not pointwise.

    The island takes the movement clusters between its members and the concats/stacks that join
    them (a complex RoPE's real and imaginary parts meet in a stack); it is fused only when its
    escaping tensors — members' or movement results — share one shape (one kernel, one grid) and
    contracting it keeps the cluster graph acyclic (``union``: shapes of one rank whose
    ``indexmap.union_shape`` exists, one grid over it — :func:`sibling_islands`). Returns the new clusters (renumbered, in
    topological order) and, per island left alone, why (keyed by the smallest op id in it: cluster
    ids change when clusters are regrouped)."""
    made_by = {t: c for c in clusters for t in c.outputs}
    by_id = {c.id: c for c in clusters}
    groups = _Groups(graph)
    gid_of: dict[int, int] = {}
    for c in clusters:
        gid_of[c.id] = groups.make(Kind(c.kind), set(c.ops))
    left: dict[int, str] = {}
    for members in islands:
        members = set(members)
        inner = _between(graph, by_id, made_by, members)
        island = members | inner
        ops = {o for k in island for o in by_id[k].ops}
        why = None
        if not groups._acyclic(ops):
            why = "fusing it would close a cycle through another kernel"
        else:
            escaping = [t for o in sorted(ops) for t in graph.ops[o].outputs
                        if t in graph.outputs or any(u.id not in ops for u in graph.consumers(t))]
            shapes = {tuple(graph.tensors[t].shape) for t in escaping}
            if len(shapes) > 1 and not (union and union_shape(shapes) is not None):
                why = ("its results have different shapes with no common grid (one kernel has one grid; "
                       "indexmap.union_shape: one rank, a union no larger than they are together)")
        if why is not None:
            left[min(o for k in members for o in by_id[k].ops)] = why
            continue
        keep = gid_of[min(members, key=lambda k: (_KEEPS_KIND.get(by_id[k].kind, 0), k))]
        for k in island:
            g = gid_of[k]
            if g == keep:
                continue
            groups.absorb(keep, g)
            gid_of[k] = keep
    if len(left) == len(islands):
        return tuple(clusters), left
    return _finalise(graph, groups), left


def query_prologue_islands(graph: Graph, clusters: Sequence[Cluster], queries: dict[int, int],
                           kernels: frozenset[int]) -> list[set[int]]:
    """``{attention cluster, pointwise clusters...}`` groups where the pointwise clusters (kernels,
    ``kernels``) and the movement between them make the attention's query and nothing else, with
    movement among them (a rotary embedding: the query rotated by halves or by pairs, GPT-NeoX's
    partial rotary ``concat([rope(q[..., :r]), q[..., r:]])``, DeepSeek's MLA ``concat([q_nope,
    rope(q_pe)])``). The attention kernel loads each query block once per program (decode: its
    group of heads; prefill: its query rows), so it recomputes them there and the rotated query is
    never written: a launch fewer per pointwise kernel (:func:`fuse_islands` merges each group;
    the template declines what costs its kernel more, ``templates.attention._REGISTER_HEAVY``). ``queries``: attention cluster id -> its query operand, as the attention
    template matched it. Walked back from the query through pointwise kernels and read-only
    movement (transposes, reshapes, slices, concatenates; the attention's own chain on q first),
    keeping only clusters whose results nothing else reads. K's rotation (written to a cache,
    read by every query block) is not taken."""
    cluster_of = {o: c for c in clusters for o in c.ops}

    def part(c: Cluster) -> bool:
        return c.id in kernels and c.kind == Kind.POINTWISE or c.kind == Kind.MOVEMENT and all(
            (r := TABLE.get(graph.ops[o].primitive)) is not None and r.read_only for o in c.ops)

    def reach(t0: int, within: set[int] | None) -> set[int]:
        """Clusters making ``t0`` through :func:`part` clusters (only ``within``, when given)."""
        found: set[int] = set()
        todo = [t0]
        while todo:
            p = graph.producer(todo.pop())
            if p is None:
                continue
            c = cluster_of[p.id]
            if c.id in found or not part(c) or within is not None and c.id not in within:
                continue
            found.add(c.id)
            todo.extend(c.inputs)
        return found

    by_id = {c.id: c for c in clusters}
    out: list[set[int]] = []
    for a in clusters:
        if a.kind != Kind.ATTENTION or a.id not in queries:
            continue
        t = queries[a.id]   # back through the attention's own chain on q (a widening cast)
        while (p := graph.producer(t)) is not None and p.id in a.ops and len(p.outputs) == 1 \
                and len(_non_scalar(graph, p)) == 1 and len(graph.consumers(t)) == 1:
            t = _non_scalar(graph, p)[0]
        group = reach(t, None)
        while True:   # drop what something else reads, and what then no longer makes the query
            inside = {o for k in group for o in by_id[k].ops} | set(a.ops)
            kept = {k for k in group if not any(
                x in graph.outputs or any(u.id not in inside for u in graph.consumers(x)) for x in by_id[k].outputs)}
            kept = reach(t, kept)
            if kept == group:
                break
            group = kept
        pointwise = {k for k in group if by_id[k].kind == Kind.POINTWISE}
        if pointwise and any(is_movement_op(graph.ops[o], graph) for k in group for o in by_id[k].ops):
            out.append({a.id} | pointwise)
    return out


def sibling_islands(graph: Graph, clusters: Sequence[Cluster], kernels: frozenset[int]) -> list[set[int]]:
    """Groups of pointwise kernels with movement inside (islands, ``kernels``) that read one
    computed tensor through movement and share no path — a decode step's q and k rotations, each
    cut out of one QKV projection: XLA runs them as one loop fusion, and VTC as one kernel over
    the union of their output shapes (``indexmap.union_shape``; each output's lanes beyond its own
    extent masked) instead of a launch each. Greedy in cluster order; a group is kept only where
    its outputs have a union shape. :func:`fuse_islands` (``union=True``) merges each group."""
    by_id = {c.id: c for c in clusters}
    made_by = {t: c for c in clusters for t in c.outputs}

    def sources(t: int, seen: set[int]) -> set[int]:
        """The computed tensors behind ``t`` through movement clusters (``t`` itself if computed)."""
        c = made_by.get(t)
        if c is None or c.id in seen or c.kind != Kind.MOVEMENT:
            return {t} if c is not None else set()
        seen.add(c.id)
        return set().union(*[sources(x, seen) for x in c.inputs] or [set()])

    islands = [c for c in clusters if c.id in kernels and c.kind == Kind.POINTWISE
               and any(is_movement_op(graph.ops[o], graph) for o in c.ops)]
    reach = _reachability(clusters, made_by)
    groups: list[set[int]] = []
    taken: set[int] = set()
    for i, a in enumerate(islands):
        if a.id in taken:
            continue
        src = set().union(*[sources(x, set()) for x in a.inputs] or [set()])
        group, shapes = {a.id}, [tuple(graph.tensors[t].shape) for t in a.outputs]
        for b in islands[i + 1:]:
            if b.id in taken or any(b.id in reach[k] or k in reach[b.id] for k in group):
                continue
            if not src & set().union(*[sources(x, set()) for x in b.inputs] or [set()]):
                continue
            more = shapes + [tuple(graph.tensors[t].shape) for t in b.outputs]
            if union_shape(more) is None:
                continue
            group.add(b.id)
            shapes = more
        if len(group) > 1:
            groups.append(group)
            taken |= group
    return groups


def residual_epilogues(graph: Graph, clusters: Sequence[Cluster], kernels: frozenset[int]) -> list[set[int]]:
    """``{matmul cluster, pointwise cluster}`` pairs where the pointwise kernel is element-wise over
    the matmul's result, which nothing else reads, and reads other tensors of that size (a residual
    stream: ``x + (attn @ W_o).astype(x.dtype)``). Clustering keeps such operands out of a matmul's
    epilogue (:func:`_grow_epilogue` takes bias-like ones), so the sum is a launch of its own —
    XLA's, beside a Pallas kernel; merged (:func:`fuse_islands`), the matmul template reads the
    residual in its epilogue (its split-K reduce's, for a decode projection). ``kernels``: the
    clusters with a kernel verdict."""
    of_op = {o: c.id for c in clusters for o in c.ops}
    by_id = {c.id: c for c in clusters}
    out: list[set[int]] = []
    for m in clusters:
        if m.kind != Kind.MATMUL or m.id not in kernels or len(m.outputs) != 1 or m.outputs[0] in graph.outputs:
            continue
        t = m.outputs[0]
        users = {of_op[u.id] for u in graph.consumers(t)}
        if len(users) != 1:
            continue
        (p,) = users
        c = by_id[p]
        shape = tuple(graph.tensors[t].shape)
        if p in kernels and c.kind == Kind.POINTWISE and not any(is_movement_op(graph.ops[o], graph) for o in c.ops) \
                and all(tuple(graph.tensors[x].shape) == shape for x in c.outputs):
            out.append({m.id, p})
    return out


# which member's kind a fused group takes: the contraction's (or attention's), then a reduction's
_KEEPS_KIND = {Kind.REDUCTION: 1, Kind.POINTWISE: 2}


def norm_prologues(graph: Graph, clusters: Sequence[Cluster], kernels: frozenset[int]) -> list[set[int]]:
    """``{matmul cluster, reduction cluster, pointwise clusters...}`` groups where the reduction
    kernel computes the matmul's A operand (that of each of its dots: a gated MLP's two
    projections) and nothing else (a pre-norm's ``rms_norm(x) @ W``),
    with the pointwise kernels that make only its rows (the norm weight's cast, read through a
    broadcast). XLA runs the norm as one or two fusions before its GEMM (it fuses no reduction into
    a GEMM); merged (:func:`fuse_islands`), the matmul template folds the norm into its K loop
    (``templates.contraction``: ``ContractionMatch.fold``), or declines and the group stays apart.
    ``kernels``: the clusters with a kernel verdict."""
    made_by = {t: c for c in clusters for t in c.outputs}
    of_op = {o: c.id for c in clusters for o in c.ops}
    out: list[set[int]] = []
    for m in clusters:
        if m.kind != Kind.MATMUL or m.id not in kernels:
            continue
        h = _dot_lhs(graph, m)
        if h is None or (r := made_by.get(h)) is None:
            continue
        if r.kind != Kind.REDUCTION or r.id not in kernels or tuple(r.outputs) != (h,) or h in graph.outputs \
                or any(of_op[u.id] != m.id for u in graph.consumers(h)):
            continue
        group = {m.id, r.id}
        for t in r.inputs:   # a weight cast feeding only the norm (through a broadcast, say)
            c = made_by.get(t)
            while c is not None and c.kind == Kind.MOVEMENT and len(c.inputs) == 1:
                c = made_by.get(c.inputs[0])
            if c is not None and c.kind == Kind.POINTWISE and c.id in kernels and _only_into(graph, c, r, made_by, of_op):
                group.add(c.id)
        out.append(group)
    return out


def _only_into(graph: Graph, c: Cluster, r: Cluster, made_by: dict[int, Cluster], of_op: dict[int, int]) -> bool:
    """Whether everything ``c`` makes reaches nothing but ``r``, directly or through movement alone."""
    stack = list(c.outputs)
    while stack:
        t = stack.pop()
        if t in graph.outputs:
            return False
        for u in graph.consumers(t):
            k = made_by.get(u.outputs[0]) if u.outputs else None
            if of_op[u.id] == r.id:
                continue
            if k is None or k.kind != Kind.MOVEMENT:
                return False
            stack.extend(k.outputs)
    return True


# the movement ops that cut a GEMM's result into the parts a gated epilogue reads
_PART_CUTS = frozenset({"split", "slice"})


def gated_epilogues(graph: Graph, clusters: Sequence[Cluster], kernels: frozenset[int]) -> list[set[int]]:
    """``{matmul cluster, pointwise cluster}`` pairs where the pointwise kernel reads the matmul's
    result only through the parts a split or slices cut out of it, and nothing else reads that
    result: a gated MLP's ``gate, up = split(x @ W_gate_up)``, ``silu(gate) * up``; and
    ``{matmul clusters..., pointwise cluster}`` groups where the pointwise kernel reads the results
    of several matmul kernels dotting one A operand, which nothing else reads (Meta's and Hugging
    Face's ``silu(h @ w1) * (h @ w3)``, two weights). XLA runs such
    a step as a GEMM writing both halves and a loop fusion reading them back (an epilogue reading
    two parts of one GEMM result is no GEMM epilogue); merged (:func:`fuse_islands`), the matmul
    template dots each A tile with both halves of the weight and applies the product as its
    epilogue (``templates.contraction``: ``ContractionMatch.parts``): one launch, and the f32
    product is never written. ``kernels``: the clusters with a kernel verdict."""
    by_id = {c.id: c for c in clusters}
    of_op = {o: c.id for c in clusters for o in c.ops}
    out: list[set[int]] = []
    for m in clusters:
        if m.kind != Kind.MATMUL or m.id not in kernels or len(m.outputs) != 1 or m.outputs[0] in graph.outputs:
            continue
        t = m.outputs[0]
        cuts = {of_op[op.id] for op in graph.consumers(t)}
        if any(by_id[k].kind != Kind.MOVEMENT or any(graph.ops[o].primitive not in _PART_CUTS or graph.ops[o].inputs[0] != t
                                                     for o in by_id[k].ops) for k in cuts):
            continue
        pieces = [x for k in cuts for x in by_id[k].outputs]
        readers = {of_op[op.id] for x in pieces for op in graph.consumers(x)}
        if not cuts or any(x in graph.outputs for x in pieces) or len(readers) != 1:
            continue
        (p,) = readers
        if p in kernels and by_id[p].kind == Kind.POINTWISE and t not in by_id[p].inputs:
            out.append({m.id, p})
    made_by = {t: c for c in clusters for t in c.outputs}
    for p in clusters:   # two projections of one A operand: silu(h @ w1) * (h @ w3)
        if p.kind != Kind.POINTWISE or p.id not in kernels or any(is_movement_op(graph.ops[o], graph) for o in p.ops):
            continue
        ms = {made_by[t].id: made_by[t] for t in p.inputs
              if t in made_by and made_by[t].kind == Kind.MATMUL and made_by[t].id in kernels}
        lhs = {_dot_lhs(graph, m) for m in ms.values()}
        if len(ms) < 2 or len(lhs) != 1 or None in lhs:
            continue
        if all(len(m.outputs) == 1 and m.outputs[0] not in graph.outputs
               and {of_op[u.id] for u in graph.consumers(m.outputs[0])} == {p.id} for m in ms.values()):
            out.append({*ms, p.id})
    return out


# movement that only views a GEMM result's parts: what carries each part to where it goes
_PART_VIEWS = frozenset({"split", "slice", "reshape", "squeeze", "expand_dims"})


def reduce_islands(graph: Graph, clusters: Sequence[Cluster], kernels: frozenset[int]) -> list[set[int]]:
    """``{matmul cluster, island kernels, view clusters...}`` groups where island kernels (pointwise
    kernels with movement inside: a decode step's q and k rotations, one kernel or two,
    :func:`sibling_islands`) read a one-dot matmul kernel's result (or the results of sibling dots
    side by side, :func:`sibling_projections`: q, k and v of three weights) through views of its parts
    (split, slices, reshapes), and the result's other parts only go through views to movement
    outside (the v part's reshape into its cache row's write). A decode GEMM splits K, and its
    reduce kernel writes the result the island kernel reads back; merged (:func:`fuse_islands`,
    ``union=True``: the island's outputs and the other parts' views are one grid), the matmul
    template runs the split-K kernel and the island's kernel summing the partials where it reads
    the result (``templates.contraction``: ``ContractionMatch.island``), the views carrying the
    other parts into the island's outputs — or declines (the GEMM does not split) and the group
    stays apart. ``kernels``: the clusters with a kernel verdict."""
    by_id = {c.id: c for c in clusters}
    of_op = {o: c.id for c in clusters for o in c.ops}
    out: list[set[int]] = []
    for m in clusters:
        if m.kind != Kind.MATMUL or m.id not in kernels or any(t in graph.outputs for t in m.outputs) \
                or sum(graph.ops[o].primitive == "dot_general" for o in m.ops) not in (1, len(m.outputs)):
            continue   # (one dot, or sibling dots each with its result: sibling_projections)
        group, islands, ok = {m.id}, set(), True
        stack = list(m.outputs)
        while stack and ok:
            t = stack.pop()
            for u in graph.consumers(t):
                k = by_id[of_op[u.id]]
                if k.id in group or k.id in islands:
                    continue
                if k.kind == Kind.MOVEMENT and all(graph.ops[o].primitive in _PART_VIEWS for o in k.ops):
                    group.add(k.id)
                    stack.extend(k.outputs)
                elif k.kind == Kind.POINTWISE and k.id in kernels and any(is_movement_op(graph.ops[o], graph)
                                                                         for o in k.ops):
                    islands.add(k.id)
                else:
                    ok = k.kind == Kind.MOVEMENT and t not in m.outputs   # a part's view ends in a write
        if ok and islands:   # (q's and k's rotations of three weights' results: two islands, one grid)
            out.append(group | islands)
    return out


def sibling_projections(graph: Graph, clusters: Sequence[Cluster], kernels: frozenset[int]) -> list[set[int]]:
    """Groups of matmul kernels that are one dot each of one A operand, with weights of one shape
    but along one dim, each followed by the same epilogue (:func:`epilogue_chain`: none, a bias,
    a cast): a layer's ``h @ wq``, ``h @ wk``, ``h @ wv`` written with three weights (Qwen's and
    flax ``nn.Dense``'s with a bias each). XLA merges such dots into one GEMM over the weights side
    by side and then copies each result out of it for a kernel that reads one (a slice fusion
    each); merged (:func:`fuse_islands`, ``union=True``), the matmul template dots ``h`` with the
    weights read side by side and writes each result where it goes — Q, the K and V cache rows
    (``templates.contraction``: ``ContractionMatch.side``). ``kernels``: the clusters with a kernel
    verdict."""
    groups: dict[tuple, list[Cluster]] = {}
    for m in clusters:
        dots = [graph.ops[o] for o in m.ops if graph.ops[o].primitive == "dot_general"]
        if m.kind != Kind.MATMUL or m.id not in kernels or len(dots) != 1 or len(m.outputs) != 1:
            continue
        d = dots[0]
        chain = epilogue_chain(graph, m.ops, d)
        if chain is None or len(chain[0]) + 1 != len(m.ops) or m.outputs[0] != (graph.ops[chain[0][-1]].outputs[0]
                                                                               if chain[0] else d.outputs[0]):
            continue
        w = graph.tensors[d.inputs[1]]
        key = (d.inputs[0], repr(d.params["dimension_numbers"]), repr(d.params.get("precision")),
               repr(d.params.get("preferred_element_type")), str(w.dtype), len(w.shape), chain[1])
        groups.setdefault(key, []).append(m)
    out = []
    for ms in groups.values():
        if len(ms) < 2:
            continue
        shapes = [tuple(graph.tensors[graph.ops[next(o for o in m.ops if graph.ops[o].primitive == "dot_general")]
                                      .inputs[1]].shape) for m in ms]
        differ = {k for sh in shapes for k in range(len(sh)) if sh[k] != shapes[0][k]}
        if len(differ) <= 1:
            out.append({m.id for m in ms})
    return out


def epilogue_chain(graph: Graph, ops: Sequence[int], dot: Op) -> tuple[tuple[int, ...], tuple, tuple[int, ...]] | None:
    """``(the ops of ops computed from the dot's result, in program order; their signature; the
    tensors they read from elsewhere, in order)``: two dots' epilogues with one signature compute
    the same function of their results and of their other operands taken in that order (the
    constants equal). None when an op of the chain reads a non-scalar constant."""
    inside: dict[int, tuple] = {dot.outputs[0]: ("dot",)}
    chain, sig, extras = [], [], []
    for o in sorted(ops):
        op = graph.ops[o]
        if op.id == dot.id or not any(t in inside for t in op.inputs):
            continue
        roles = []
        for t in op.inputs:
            info = graph.tensors[t]
            if t in inside:
                roles.append(inside[t])
            elif info.const is not None:
                if info.size != 1:
                    return None
                roles.append(("const", str(info.dtype), repr(np.asarray(info.const).tolist())))
            else:
                if t not in extras:
                    extras.append(t)
                roles.append(("extra", extras.index(t)))
        for k, t in enumerate(op.outputs):
            inside[t] = ("op", len(chain), k)
        chain.append(o)
        sig.append((op.primitive, repr(sorted((k, repr(v)) for k, v in op.params.items())), tuple(roles)))
    return tuple(chain), tuple(sig), tuple(extras)


def _dot_lhs(graph: Graph, m: Cluster) -> int | None:
    """The A operand of every dot of matmul cluster ``m``, when they share one (None otherwise)."""
    lhs = {graph.ops[o].inputs[0] for o in m.ops if graph.ops[o].primitive == "dot_general"}
    return next(iter(lhs)) if len(lhs) == 1 else None


def _reachability(clusters: Sequence[Cluster], made_by: dict[int, Cluster]) -> dict[int, set[int]]:
    """Per cluster id, the ids of the clusters it depends on, directly or not."""
    out: dict[int, set[int]] = {}
    for c in clusters:   # (clusters are in topological order)
        deps: set[int] = set()
        for t in c.inputs:
            p = made_by.get(t)
            if p is not None and p.id != c.id:
                deps |= {p.id} | out.get(p.id, set())
        out[c.id] = deps
    return out


def _non_scalar(graph: Graph, op: Op) -> list[int]:
    """The operands of ``op`` that are not single-element constants."""
    return [t for t in op.inputs if not (graph.tensors[t].const is not None and graph.tensors[t].size == 1)]


def _between(graph: Graph, by_id: dict[int, Cluster], made_by: dict[int, Cluster], members: set[int]) -> set[int]:
    """Movement clusters on a path from one island member to another (through movement only)."""
    def up(c: Cluster, seen: dict[int, bool]) -> bool:
        """Does a member lie above movement cluster ``c`` (through movement only)?"""
        if c.id in seen:
            return seen[c.id]
        seen[c.id] = False
        hit = False
        for t in c.inputs:
            p = made_by.get(t)
            if p is None:
                continue
            if p.id in members or (p.kind == Kind.MOVEMENT and up(p, seen)):
                hit = True
        seen[c.id] = hit
        return hit

    found: set[int] = set()
    seen: dict[int, bool] = {}
    stack = [made_by[t] for k in members for t in by_id[k].inputs if t in made_by]
    visited: set[int] = set()
    while stack:
        c = stack.pop()
        if c.id in visited or c.kind != Kind.MOVEMENT:
            continue
        visited.add(c.id)
        if up(c, seen):
            found.add(c.id)
            stack.extend(made_by[t] for t in c.inputs if t in made_by)
    inside = members | found
    for c in by_id.values():   # joins: a concat/stack whose operands all come from the island
        if c.kind == Kind.MOVEMENT and c.id not in inside and len(c.inputs) >= 2 and \
                all(t in made_by and made_by[t].id in inside for t in c.inputs):
            found.add(c.id)
    return found
