"""Whole-program accounting: modelled HBM bytes and peak memory of a program, plain XLA vs VTC.

Split from the cost model: the greedy's marginal savings live in :mod:`costmodel`; this module
walks the whole program once for the report and the benchmarks (``Report.modeled``). Every figure
here is *modelled* from the jaxpr: compare with XLA's own compile before publishing one.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .costmodel import Context, cluster_cost, strategy_oracles
from .primitives import Kind, inplace_operand
from .xla import xla_clusters, xla_plain

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph import Graph
    from .strategy import Strategy

__all__ = ["modeled_bytes"]



def modeled_bytes(graph: "Graph", clusters: Sequence["Cluster"], strategy: "Strategy | None" = None,
                  donated: Iterable[int] = ()) -> dict[str, int]:
    """HBM bytes and peak memory, plain XLA (``*_baseline``) vs under ``strategy`` (``*_optimized``).

    * ``bytes_baseline``: every cluster reads its inputs and writes its outputs once (a fused
      cluster's internal tensors never reach memory); a movement op moves ``B(op)`` (bitcasts 0).
    * ``bytes_optimized``: eliminated movement ops move nothing, the rest move what no chosen edge
      absorbed; kernels read/write through their maps (a broadcast input costs its physical bytes).
      ``bytes_optimized_effective`` adds the sector waste of non-contiguous maps.
    * ``bytes_compulsory``: graph inputs read once plus graph outputs written once (an output
      updated in place in a donated input only writes its update).
    * ``peak_*``: a liveness walk over the clusters in order: a tensor is allocated when produced
      and freed after its last consumer; graph inputs, constants and outputs live throughout;
      virtual tensors take no memory; a bitcast (or in-place dynamic_update_slice) output shares
      its operand's buffer, as XLA's buffer assignment does.
    * ``kernels_*``: kernel launches (clusters plus movement ops that still run).
    * ``kernels_xla`` / ``bytes_xla``: plain ``jax.jit`` as XLA's GPU pipeline fuses it
      (:func:`xla_plain` from :func:`xla.xla_clusters`, the guard's ``price_plain``: not from
      ``clusters``, whose kernels VTC's selection merged) — the baseline to compare with; ``*_baseline`` above is the unfused
      upper bound (every movement op and cluster a kernel) that the greedy's savings start from.

    ``donated`` graph inputs are updated in place by dynamic_update_slice (no copy); a kernel
    writing in place into an input that is *not* donated costs a copy of that input (XLA makes one
    so the caller's array survives).
    """
    ctx = Context(graph, clusters, strategy.vtog if strategy is not None else None, donated)
    zero = lambda k: 0.0  # noqa: E731 - bytes only
    phys = (lambda t: None)
    none = (lambda o: ())
    base = [cluster_cost(ctx, k, phys, none, zero) for k in range(len(ctx.clusters))]
    if strategy is None:
        opt = base
        lay, by_op = phys, none
    else:
        lay, by_op = strategy_oracles(strategy)
        opt = [cluster_cost(ctx, k, lay, by_op, zero) for k in range(len(ctx.clusters))]
    copies = 0
    if strategy is not None:  # an in-place write into an input the caller did not donate:
        for i in strategy.chosen:  # XLA copies that input first (input_output_aliases)
            e = strategy.vtog.edges[i]
            if e.inplace and e.dst in set(graph.inputs) and e.dst not in ctx.donated:
                copies += 2 * ctx.nbytes[e.dst]
    written = graph.as_written or graph   # (the program as written: what jit compiles)
    comp_in = [t for t in dict.fromkeys(graph.inputs)]
    comp_out = [t for t in dict.fromkeys(graph.outputs) if t not in set(graph.inputs)]
    out_bytes = {t: ctx.nbytes[t] for t in comp_out}
    for oid, copy in ctx.dus_copy.items():   # an output updated in place in a donated input:
        op = graph.ops[oid]                   # only the update has to be written
        if not copy and op.inputs[0] in ctx.donated and op.outputs[0] in out_bytes:
            out_bytes[op.outputs[0]] = ctx.nbytes[op.inputs[1]]
    return {
        **xla_plain(written, xla_clusters(written), donated),   # (plain jit: not VTC's clusters)
        "bytes_baseline": int(sum(c.raw for c in base)),
        "bytes_optimized": int(sum(c.raw for c in opt)) + copies,
        "bytes_optimized_effective": int(round(sum(c.eff for c in opt))) + copies,
        "bytes_compulsory": int(sum(ctx.nbytes[t] for t in comp_in) + sum(out_bytes.values())),
        "peak_baseline": _peak(ctx, None),
        "peak_optimized": _peak(ctx, strategy),
        "kernels_baseline": int(sum(c.launches for c in base)),
        "kernels_optimized": int(sum(c.launches for c in opt)),
    }


def _peak(ctx: Context, strategy: "Strategy | None") -> int:
    """Peak live bytes of a walk over the clusters (see :func:`modeled_bytes`).

    A physical buffer that virtual tensors live in is allocated from the first time any of them
    is produced (a kernel writing into a concat buffer ahead of the other slabs) until the last
    time any of them is read (a kernel reading a transposed view after the original's last use).
    """
    g = ctx.graph
    virtual = strategy.is_virtual if strategy is not None else (lambda t: False)
    _, chosen_of_op = strategy_oracles(strategy) if strategy is not None else (None, lambda o: ())
    parent: dict[int, int] = {}

    def find(t: int) -> int:
        while parent.get(t, t) != t:
            parent[t] = parent.get(parent[t], parent[t])
            t = parent[t]
        return t

    for c in ctx.clusters:
        if c.kind != Kind.MOVEMENT:
            continue
        for oid in c.ops:
            op = g.ops[oid]
            alias = ctx.bitcast.get(oid) or (inplace_operand(op.primitive) is not None and not ctx.dus_copy.get(oid))
            if alias and not chosen_of_op(oid) and not virtual(op.inputs[0]) and not virtual(op.outputs[0]):
                parent[find(op.outputs[0])] = find(op.inputs[0])
    pinned = set(g.inputs) | set(g.outputs) | {t.id for t in g.tensors if t.const is not None}
    tensors = pinned | set(ctx.producer)
    n = len(ctx.clusters)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    size: dict[int, int] = {}
    always: set[int] = set()
    for t in tensors:
        if virtual(t):
            continue
        r = find(t)
        size[r] = max(size.get(r, 0), ctx.nbytes[t])
        if t in pinned:
            always.add(r)
        born = ctx.producer.get(t, -1)
        start[r] = min(start.get(r, n), born)
        end[r] = max(end.get(r, -1), born, *ctx.users.get(t, ()))
    if strategy is not None:
        for t in strategy.virtual:
            born = ctx.producer.get(t)
            uses = ctx.users.get(t, ())
            for tgt in strategy.layout(t).targets:
                r = find(tgt)
                if r not in size:
                    continue
                if born is not None:
                    start[r] = min(start[r], born)
                end[r] = max(end[r], *(uses or (-1,)), born if born is not None else -1)
    live = sum(size[r] for r in always)
    peak = live
    born_at: dict[int, list[int]] = {}
    dies_at: dict[int, list[int]] = {}
    for r in size:
        if r in always:
            continue
        born_at.setdefault(start[r], []).append(r)
        dies_at.setdefault(end[r], []).append(r)
    for k in range(n):
        live += sum(size[r] for r in born_at.get(k, ()))
        peak = max(peak, live)
        live -= sum(size[r] for r in dies_at.get(k, ()))
    return int(peak)
