"""What the analysis found and decided, for people: a table, JSON, and a Graphviz picture.

The report is the contract of ``vtc_jax.explain``: every data-movement op with its fate and the
reason, the VTOG with its conflicts, the edges the greedy chose in the order it chose them, and
the modelled bytes and peak memory. Numbers here are *modelled* (see ``costmodel``): no timing on
this machine says anything about a GPU.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import movement
from .accounting import modeled_bytes
from .analysis import Analysis
from .cluster import Cluster
from .graph import Graph
from .guard import UNDONE
from .primitives import Kind, Role, data_inputs, is_fill, is_movement_op, is_view, role_of
from .strategy import Strategy
from .templates import Match, Reject
from .vtog import VTOG


@dataclass(frozen=True)
class MovementInfo:
    """One data-movement op of the traced program and what VTC does with it."""
    op: int
    primitive: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    eliminated: bool
    reason: str
    edges: tuple[int, ...] = ()     # VTOG edge indices offered by this op
    chosen: tuple[int, ...] = ()    # of those, the ones in the points-to graph


@dataclass(frozen=True)
class Modeled:
    """Modelled HBM traffic and peak memory, in bytes (see ``accounting.modeled_bytes``)."""
    bytes_baseline: int
    bytes_optimized: int
    bytes_compulsory: int
    peak_baseline: int
    peak_optimized: int


@dataclass(frozen=True, eq=False)
class Report:
    name: str
    graph: Graph
    clusters: tuple[Cluster, ...]
    vtog: VTOG
    strategy: Strategy
    movement: tuple[MovementInfo, ...]
    modeled: Modeled
    analysis_seconds: float
    opaque: tuple[tuple[str, str], ...] = ()     # (primitive, reason) for ops left to XLA unanalysed
    templates: tuple[tuple[int, str, str], ...] = ()   # (cluster, kind, "kernel" | why it runs in XLA)
    guard: tuple[str, ...] = ()     # what the guard decided against plain jit (explain(guard=...), optimize)

    @property
    def eliminated(self) -> tuple[MovementInfo, ...]:
        return tuple(m for m in self.movement if m.eliminated)

    @property
    def kept(self) -> tuple[MovementInfo, ...]:
        return tuple(m for m in self.movement if not m.eliminated)

    # -- text ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        g, v, s, m = self.graph, self.vtog, self.strategy, self.modeled
        lines = [
            f"VTC analysis of {self.name}: {len(g.ops)} ops, {len(self.clusters)} clusters, "
            f"{len(self.movement)} movement ops, {len(self.eliminated)} eliminated "
            f"(analysis {self.analysis_seconds:.3f} s)",
            f"VTOG: {len(v.nodes)} tensors, {len(v.edges)} edges, {len(v.conflicts)} conflicting pairs; "
            f"points-to graph: {len(s.chosen)} edges",
            "",
            "Data-movement ops",
            _table(["op", "primitive", "in -> out", "status", "reason"],
                   [[f"#{x.op}", x.primitive, f"{_shapes(x.in_shapes)} -> {_shape(x.out_shape)}",
                     "eliminated" if x.eliminated else "kept", x.reason] for x in self.movement]),
            "",
            "Chosen points-to edges (in greedy order)",
        ]
        rows = []
        for step in s.trace:
            for e_idx in step.edges:
                e = v.edges[e_idx]
                rows.append([f"t{e.src} {_tensor(g, e.src)}", f"t{e.dst} {_tensor(g, e.dst)}",
                             f"{e.primitive} #{e.op}", e.direction, f"Type {e.klass}", e.note,
                             f"{step.saving * 1e6:.2f}"])
        lines.append(_table(["virtual", "points to", "via", "dir", "class", "why", "saving µs (model)"], rows)
                     if rows else "  (none)")
        lines += [
            "",
            "Modelled HBM traffic and peak memory (analytical model, not a measurement)",
            _table(["", "baseline (plain XLA)", "optimized", "compulsory"], [
                ["bytes moved", _mb(m.bytes_baseline), _mb(m.bytes_optimized), _mb(m.bytes_compulsory)],
                ["peak memory", _mb(m.peak_baseline), _mb(m.peak_optimized), ""],
            ]),
        ]
        if self.templates:
            lines += ["", "Compute clusters and their templates (matched before the strategy)",
                      _table(["cluster", "kind", "template"],
                             [[f"#{c}" if c >= 0 else "-", k, why] for c, k, why in self.templates])]
        if self.opaque:
            lines += ["", "Left to XLA without analysis"] + [f"  {p}: {r}" for p, r in self.opaque]
        if self.guard:
            lines += ["", "The guard (the emitted program priced against plain jax.jit)"] + [f"  {x}" for x in self.guard]
        return "\n".join(lines)

    # -- machine-readable ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        g, v, s = self.graph, self.vtog, self.strategy
        return {
            "name": self.name,
            "analysis_seconds": self.analysis_seconds,
            "ops": len(g.ops),
            "clusters": [{"id": c.id, "kind": c.kind, "ops": list(c.ops), "reason": c.reason} for c in self.clusters],
            "movement": [{"op": x.op, "primitive": x.primitive, "in_shapes": [list(a) for a in x.in_shapes],
                          "out_shape": list(x.out_shape), "eliminated": x.eliminated, "reason": x.reason,
                          "edges": list(x.edges), "chosen": list(x.chosen)} for x in self.movement],
            "vtog": {
                "nodes": [{"id": t, "shape": list(g.tensors[t].shape), "dtype": str(g.tensors[t].dtype),
                           "physical": t in v.physical, "reason": v.reasons.get(t, "")} for t in v.nodes],
                "edges": [{"index": i, "src": e.src, "dst": e.dst, "op": e.op, "primitive": e.primitive,
                           "direction": e.direction, "class": e.klass, "box": [list(b) for b in e.box],
                           "map": str(e.map), "inplace": e.inplace, "note": e.note}
                          for i, e in enumerate(v.edges)],
                "conflicts": sorted([list(p) for p in v.conflicts]),
            },
            "strategy": {"chosen": list(s.chosen), "total_saving": s.total_saving,
                         "trace": [{"node": st.node, "edges": list(st.edges), "saving": st.saving} for st in s.trace]},
            "modeled": {k: int(getattr(self.modeled, k)) for k in self.modeled.__dataclass_fields__},
            "opaque": [list(p) for p in self.opaque],
            "templates": [{"cluster": c, "kind": k, "template": why} for c, k, why in self.templates],
            "guard": list(self.guard),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **({"indent": 1} | kwargs))

    def to_dot(self) -> str:
        """Graphviz DOT of the VTOG: physical tensors grey, chosen points-to edges bold red."""
        g, v, s = self.graph, self.vtog, self.strategy
        chosen = set(s.chosen)
        touched = {e.src for e in v.edges} | {e.dst for e in v.edges}
        out = ["digraph VTOG {", '  rankdir=LR; node [shape=box, fontname="Helvetica", fontsize=10];']
        for t in v.nodes:
            if t not in touched:
                continue
            virtual = s.is_virtual(t)
            style = 'style=filled, fillcolor="#dddddd"' if not virtual else 'style=dashed'
            out.append(f'  t{t} [label="t{t}\\n{_tensor(g, t)}", {style}];')
        for i, e in enumerate(v.edges):
            attrs = (f'color=red, penwidth=2.5' if i in chosen else 'color="#888888", style=dashed')
            out.append(f'  t{e.src} -> t{e.dst} [label="{e.primitive}#{e.op} {e.klass}", {attrs}];')
        out.append("}")
        return "\n".join(out)


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ",".join(str(x) for x in s) + "]"


def _shapes(ss: tuple[tuple[int, ...], ...]) -> str:
    return " ".join(_shape(s) for s in ss)


def _tensor(g: Graph, t: int) -> str:
    info = g.tensors[t]
    try:
        name = np.dtype(info.dtype).name
    except TypeError:   # extended dtypes (PRNG keys)
        name = str(info.dtype)
    return f"{name}{_shape(info.shape)}"


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _table(header: list[str], rows: list[list[str]]) -> str:
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


# --------------------------------------------------------------------------------------------
# Building the report from an Analysis
# --------------------------------------------------------------------------------------------

def build_report(name: str, a: Analysis) -> Report:
    """The report of one analysis: every stage's decision read off the Analysis, nothing re-run."""
    g, v, s = a.graph, a.vtog, a.strategy
    res = s.resolution
    by_op: dict[int, list[int]] = {}
    for i, e in enumerate(v.edges):
        by_op.setdefault(e.op, []).append(i)
    chosen = set(s.chosen)
    gone_ops = res.eliminated if res is not None else frozenset()
    home = {oid: c for c in a.clusters for oid in c.ops}
    infos = []
    for op in g.ops:
        if not is_movement_op(op, g) or all(g.tensors[t].const is not None for t in op.inputs):
            continue
        edges = tuple(by_op.get(op.id, ()))
        c = home.get(op.id)
        if c is not None and c.kind not in (Kind.MOVEMENT, Kind.GLUE, Kind.OPAQUE):
            gone, reason = True, f"fused into {c.kind} cluster #{c.id}: a register-level view, never in memory"
        else:
            gone = op.id in gone_ops
            reason = _reason(g, v, s, op, edges, gone)
        infos.append(MovementInfo(op.id, op.primitive,
                                  tuple(g.tensors[t].shape for t in op.inputs if g.tensors[t].const is None),
                                  g.tensors[op.outputs[0]].shape, gone, reason, edges,
                                  tuple(i for i in edges if i in chosen)))
    mb = modeled_bytes(g, a.clusters, s, donated=a.donated)
    modeled = Modeled(**{k: int(mb[k]) for k in Modeled.__dataclass_fields__})
    opaque = tuple((g.ops[c.ops[0]].primitive, c.reason) for c in a.clusters if c.kind == Kind.OPAQUE)
    templates = tuple((cid, m.kind.value, "kernel" if isinstance(m, Match) else m.reason)
                      for cid, m in sorted(a.matches.items()))
    templates += tuple((-1, Kind.ATTENTION.value, f"region from dot #{op}: {why}; clustered as its parts instead")
                       for op, why in a.declined)
    return Report(name, g, a.clusters, v, s, tuple(infos), modeled, a.seconds, opaque, templates=templates,
                  guard=a.guard)


def _stuck(v: VTOG, op: Any) -> list[str]:
    """Why the op's data tensors must stay physical, outputs first (the sources of its read edges):
    a pad's constant fill or a dynamic_slice's start index is pinned too, but says nothing."""
    return [f"t{t} stays physical: {v.reasons[t]}" for t in (*op.outputs, *data_inputs(op)) if t in v.reasons]


def _reason(g: Graph, v: VTOG, s: Strategy, op: Any, edges: tuple[int, ...], gone: bool) -> str:
    chosen = [v.edges[i] for i in edges if i in set(s.chosen)]
    if gone:
        parts = sorted({f"{'t%d ⇢ t%d' % (e.src, e.dst)} ({e.direction}, Type {e.klass})" for e in chosen})
        return "virtual: " + "; ".join(parts) if parts else "virtual through composed edges"
    if not edges:
        why = movement.explain_no_edges(op, g)
        if why:
            return why
        stuck = _stuck(v, op)
        return stuck[0] if stuck else "no virtual-tensor rule applies"
    for i in edges:
        for x, y in v.conflicts:
            other = y if x == i else x if y == i else None
            if other is not None and other in set(s.chosen):
                return f"edge {i} conflicts with chosen edge {other} ({v.edges[other].primitive} #{v.edges[other].op})"
    stuck = _stuck(v, op)
    if stuck and not chosen:
        return stuck[0]
    return "not profitable under the cost model (no edge with positive modelled saving)" if not chosen \
        else "partially virtual: some outputs still need a physical copy"


def _kept_by_rejections(a: Analysis, kept: Sequence[Any]) -> set[int]:
    """The tensors of the data movement XLA still runs (``kept``) other than what stays because the
    guard undid a kernel next to it: movement ops linked by the tensors they share, a chain that
    reaches a cluster the guard gave back to XLA left out — its movement is the guard's choice,
    not a fallback (no warning: ``optimize``'s contract) — and a chain of fills and views only,
    which moves no data (the ``jnp.ones`` of a ``tril`` mask, BatchNorm's ``[C] -> [1, 1, 1, C]``:
    XLA makes a fill inside its reader and runs a view as a bitcast)."""
    g = a.graph
    undone = {t for c in a.clusters if isinstance(v := a.matches.get(c.id), Reject) and v.reason.startswith(UNDONE)
              for t in (*c.inputs, *c.outputs)}
    chains: list[tuple[set[int], bool, bool]] = []    # (tensors, reaches an undone cluster, moves data)
    for op in kept:
        ts = set((*op.inputs, *op.outputs))
        joined = [ch for ch in chains if ch[0] & ts]
        chains = [ch for ch in chains if not ch[0] & ts]
        chains.append((ts.union(*(ch[0] for ch in joined)), bool(ts & undone) or any(ch[1] for ch in joined),
                       not (is_fill(op, g) or is_view(op, g)) or any(ch[2] for ch in joined)))
    return {t for ts, guarded, moves in chains if moves and not guarded for t in ts}


def fallback_messages(a: Analysis, always: frozenset[int] = frozenset(),
                      bodies: Sequence[str] = ()) -> list[str]:
    """One line per reason VTC left part of the program to XLA where it mattered: opaque
    primitives, and compute clusters next to data movement that no template took (grouped by
    reason, so 32 identical layers give one line)."""
    g = a.graph
    msgs: list[str] = []
    for c in a.clusters:
        if c.kind == Kind.OPAQUE and role_of(g.ops[c.ops[0]], g) is Role.KERNEL:
            continue   # a compiled kernel (a Pallas call: an optimised function's own) runs as it is
        if c.kind == Kind.OPAQUE and f"{g.ops[c.ops[0]].primitive} #{c.ops[0]}" not in bodies:
            msgs.append(f"unsupported primitive {g.ops[c.ops[0]].primitive} left to XLA "
                        f"({c.reason}); tensors around it stay physical")
    res = a.strategy.resolution
    kept = [a.graph.ops[o] for o in (res.executed if res is not None else ())]
    kept_tensors = _kept_by_rejections(a, kept)
    by_reason: dict[tuple[str, str], list[Cluster]] = {}
    for c in a.clusters:   # a rejection matters where data movement next to the cluster still runs
        verdict = a.matches.get(c.id)
        if c.id in a.xla_fused:   # XLA's by choice: not a fallback
            continue
        if isinstance(verdict, Reject) and verdict.reason.startswith(UNDONE):   # the guard's choice
            continue
        if isinstance(verdict, Reject) and (c.id in always or set((*c.inputs, *c.outputs)) & kept_tensors):
            by_reason.setdefault((c.kind, verdict.reason), []).append(c)
    for (kind, reason), cs in by_reason.items():
        prims = ", ".join(dict.fromkeys(g.ops[o].primitive for o in cs[0].ops))
        ids = ", ".join(f"#{c.id}" for c in cs)
        what = f"{kind} cluster {ids} ({prims}) runs" if len(cs) == 1 else \
            f"{len(cs)} {kind} clusters ({ids}; {prims}) run"
        msgs.append(f"{what} in XLA: {reason}; the data movement next to it stays")
    return msgs
