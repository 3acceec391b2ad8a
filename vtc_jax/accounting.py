"""Whole-program accounting: modelled HBM bytes and peak memory of a program, plain XLA vs VTC.

Split from the cost model: the greedy's marginal savings live in :mod:`costmodel`; this module
walks the whole program once for the report and the benchmarks (``Report.modeled``). Every figure
here is *modelled* from the jaxpr: compare with XLA's own compile before publishing one.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .costmodel import _Ctx, _cluster_cost, _strategy_oracles
from .primitives import inplace_operand

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph import Graph
    from .strategy import Strategy

__all__ = ["modeled_bytes", "xla_plain"]



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
      (:func:`xla_plain`) — the baseline to compare with; ``*_baseline`` above is the unfused
      upper bound (every movement op and cluster a kernel) that the greedy's savings start from.

    ``donated`` graph inputs are updated in place by dynamic_update_slice (no copy); a kernel
    writing in place into an input that is *not* donated costs a copy of that input (XLA makes one
    so the caller's array survives).
    """
    ctx = _Ctx(graph, clusters, strategy.vtog if strategy is not None else None, donated)
    zero = lambda k: 0.0  # noqa: E731 - bytes only
    phys = (lambda t: None)
    none = (lambda o: ())
    base = [_cluster_cost(ctx, k, phys, none, zero) for k in range(len(ctx.clusters))]
    if strategy is None:
        opt = base
        lay, by_op = phys, none
    else:
        lay, by_op = _strategy_oracles(strategy)
        opt = [_cluster_cost(ctx, k, lay, by_op, zero) for k in range(len(ctx.clusters))]
    copies = 0
    if strategy is not None:  # an in-place write into an input the caller did not donate:
        for i in strategy.chosen:  # XLA copies that input first (input_output_aliases)
            e = strategy.vtog.edges[i]
            if e.inplace and e.dst in set(graph.inputs) and e.dst not in ctx.donated:
                copies += 2 * ctx.nbytes[e.dst]
    comp_in = [t for t in dict.fromkeys(graph.inputs)]
    comp_out = [t for t in dict.fromkeys(graph.outputs) if t not in set(graph.inputs)]
    out_bytes = {t: ctx.nbytes[t] for t in comp_out}
    for oid, copy in ctx.dus_copy.items():   # an output updated in place in a donated input:
        op = graph.ops[oid]                   # only the update has to be written
        if not copy and op.inputs[0] in ctx.donated and op.outputs[0] in out_bytes:
            out_bytes[op.outputs[0]] = ctx.nbytes[op.inputs[1]]
    return {
        **xla_plain(graph, clusters, donated),
        "bytes_baseline": int(sum(c.raw for c in base)),
        "bytes_optimized": int(sum(c.raw for c in opt)) + copies,
        "bytes_optimized_effective": int(round(sum(c.eff for c in opt))) + copies,
        "bytes_compulsory": int(sum(ctx.nbytes[t] for t in comp_in) + sum(out_bytes.values())),
        "peak_baseline": _peak(ctx, None),
        "peak_optimized": _peak(ctx, strategy),
        "kernels_baseline": int(sum(c.launches for c in base)),
        "kernels_optimized": int(sum(c.launches for c in opt)),
    }


def _peak(ctx: _Ctx, strategy: "Strategy | None") -> int:
    """Peak live bytes of a walk over the clusters (see :func:`modeled_bytes`).

    A physical buffer that virtual tensors live in is allocated from the first time any of them
    is produced (a kernel writing into a concat buffer ahead of the other slabs) until the last
    time any of them is read (a kernel reading a transposed view after the original's last use).
    """
    g = ctx.graph
    virtual = strategy.is_virtual if strategy is not None else (lambda t: False)
    _, chosen_of_op = _strategy_oracles(strategy) if strategy is not None else (None, lambda o: ())
    parent: dict[int, int] = {}

    def find(t: int) -> int:
        while parent.get(t, t) != t:
            parent[t] = parent.get(parent[t], parent[t])
            t = parent[t]
        return t

    for c in ctx.clusters:
        if c.kind != "movement":
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




def xla_plain(graph: "Graph", clusters: Sequence["Cluster"], donated: Iterable[int] = ()) -> dict[str, int]:
    """Launches and HBM bytes of plain ``jax.jit`` as XLA's GPU pipeline fuses it (a model).

    Why a second baseline: ``bytes_baseline``/``kernels_baseline`` charge every movement op and
    every cluster a kernel — an upper bound that XLA's H100 compile beats by 2–6× (BENCHMARKS.md),
    so a saving measured against it is mostly movement XLA never materialises. The rules, each
    read off XLA's compiled programs (``benchmarks/compiled.json``):

    * **movement fuses into its consumer**: a transpose / slice / concat / broadcast / reshape /
      pad costs no launch; the fusion reading it reads its source (a broadcast: its small input,
      a slice: what it keeps). It costs a launch and a write only where it is a program output.
    * **dynamic_update_slice is in place**: one launch writing the update (plus a copy of the
      operand where XLA must keep it: not donated, or read later).
    * **element-wise work fuses**: pointwise clusters joined directly or through movement are one
      loop fusion; a lone cast, and pointwise work feeding only a reduction or an update, fold
      into that consumer (input fusion / DUS fusion) — no launch of their own.
    * **GEMM / conv / reduction**: one launch each (gemm fusion, cuDNN call, input fusion), and
      one more per GEMM operand computed by an elementwise prologue (XLA's loop fusion). cuDNN
      fuses a conv's bias + ReLU only: any other epilogue is one more loop fusion when another
      conv reads the result directly; it runs NHWC, so each NCHW program input a conv reads (and
      each output one writes) is transposed once, and each OIHW filter larger than 1×1 (not
      depthwise); movement in front of a conv (a split half, a concat) is materialised.
    * **attention left to XLA**: one fusion per reduction (the M=1 dots become reductions) and one
      element-wise fusion between each pair, ``2 n - 1``; each writes its intermediate once.
    """
    from .costmodel import _Ctx
    from .primitives import data_inputs as _data
    ctx = _Ctx(graph, clusters, None, donated)
    g, cl = graph, ctx.clusters
    outs = set(g.outputs)
    kind = [str(c.kind) for c in cl]
    parent = list(range(len(cl)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def is_dus(k: int) -> bool:
        return kind[k] == "movement" and any(inplace_operand(g.ops[o].primitive) is not None for o in cl[k].ops)

    def fused_movement(k: int) -> bool:
        return kind[k] in ("movement", "glue") and not is_dus(k)

    def producers_through_movement(t: int, seen: set[int]) -> set[int]:
        k = ctx.producer.get(t)
        if k is None or k in seen:
            return set()
        seen.add(k)
        if not fused_movement(k):
            return {k}
        return set().union(*[producers_through_movement(x, seen) for o in cl[k].ops for x in _data(g.ops[o])] or [set()])

    def consumers_through_movement(t: int, seen: set[int]) -> set[int]:
        found: set[int] = set()
        for k in ctx.users.get(t, ()):
            if k in seen:
                continue
            seen.add(k)
            if fused_movement(k):
                for o in cl[k].outputs:
                    found |= consumers_through_movement(o, seen)
            else:
                found.add(k)
        return found

    for k, c in enumerate(cl):   # pointwise islands: one loop fusion
        if kind[k] != "pointwise":
            continue
        for t in c.inputs:
            for p in producers_through_movement(t, set()):
                if kind[p] == "pointwise":
                    parent[find(p)] = find(k)
    for k, c in enumerate(cl):   # folded into the consumer: lone casts, prologues of reductions/updates
        if kind[k] != "pointwise" or any(t in outs for t in c.outputs):
            continue
        users = set().union(*[consumers_through_movement(t, set()) for t in c.outputs] or [set()])
        users = {u for u in users if find(u) != find(k)}
        cast = all(g.ops[o].primitive in ("convert_element_type", "broadcast_in_dim", "reshape") for o in c.ops)
        if users and (cast or all(kind[u] == "reduction" or is_dus(u) for u in users)) and len(users) == 1:
            parent[find(k)] = find(next(iter(users)))

    def read_bytes(t: int, seen: set[int]) -> int:
        """Bytes a fusion reads for ``t``: through fused movement, what its sources hold."""
        k = ctx.producer.get(t)
        if k is None or not fused_movement(k) or k in seen:
            return ctx.nbytes[t]
        seen.add(k)
        src = sum(read_bytes(x, seen) for o in cl[k].ops for x in _data(g.ops[o]))
        return min(ctx.nbytes[t], src) if kind[k] != "glue" else 0

    inputs = set(g.inputs)

    def read_src_is_input(t: int) -> bool:
        """``t`` is (a movement op's view of) a program input with more than one dimension."""
        if t in inputs:
            return len(g.tensors[t].shape) >= 3
        k = ctx.producer.get(t)
        return k is not None and fused_movement(k) and kind[k] == "movement" and any(
            read_src_is_input(x) for o in cl[k].ops for x in _data(g.ops[o]))

    def _inputs_behind(t: int) -> set[int]:
        if t in inputs:
            return {t}
        k = ctx.producer.get(t)
        if k is None or not fused_movement(k):
            return set()
        return set().union(*[_inputs_behind(x) for o in cl[k].ops for x in _data(g.ops[o])] or [set()])

    launches, nbytes = 0, 0
    groups: dict[int, list[int]] = {}
    for k in range(len(cl)):
        groups.setdefault(find(k), []).append(k)
    for members in groups.values():
        head = members[0]
        if len(members) == 1 and fused_movement(head):
            if kind[head] == "movement":
                for o in cl[head].ops:
                    op = g.ops[o]
                    if any(t in outs for t in op.outputs) and not ctx.bitcast.get(o):
                        launches += 1
                        nbytes += sum(ctx.nbytes[t] for t in op.outputs) + sum(read_bytes(x, set()) for x in _data(op))
            continue
        if len(members) == 1 and is_dus(head):
            launches += 1
            nbytes += sum(ctx.base.get(o, 0) for o in cl[head].ops)
            continue
        inside = {t for m in members for t in cl[m].outputs}
        ins = {t for m in members for t in cl[m].inputs if t not in inside}
        out = {t for m in members for t in cl[m].outputs
               if t in outs or any(find(u) != find(m) for u in ctx.users.get(t, ()))}
        n = 1
        for m in members:
            if kind[m] != "conv":
                continue
            epi = {g.ops[o].primitive for o in cl[m].ops} - {"conv_general_dilated"}
            direct = [u for t in cl[m].outputs for u in ctx.users.get(t, ()) if kind[u] == "conv"]
            if epi and not {"add", "max"} <= epi and (direct or any(t in outs for t in cl[m].outputs)):
                n += 1   # cuDNN fuses bias + ReLU only; another epilogue is a loop fusion of its
                # own where nothing else reads the result (else it fuses into that reader)
        for m in members:   # a matmul prologue (cluster._grow_prologue) is XLA's loop fusion
            if kind[m] != "matmul":   # of its own: it writes the operand the GEMM then reads
                continue
            dots = [o for o in cl[m].ops if g.ops[o].primitive == "dot_general"]
            made_in = {t for o in cl[m].ops if o not in dots for t in g.ops[o].outputs}
            for x in (x for o in dots for x in g.ops[o].inputs[:2] if x in made_in):
                n += 1
                nbytes += 2 * ctx.nbytes[x]
        if any(kind[m] == "attention" for m in members):
            red = [o for m in members for o in cl[m].ops
                   if g.ops[o].primitive == "dot_general" or g.ops[o].primitive.startswith("reduce_")]
            n = max(1, 2 * len(red) - 1)
            nbytes += 2 * sum(ctx.nbytes[g.ops[o].outputs[0]] for o in red[:-1])
        if any(is_dus(m) for m in members):   # the update fused into the in-place DUS fusion:
            for m in members:                    # it writes the update (and the copy, if any)
                for o in cl[m].ops if is_dus(m) else ():
                    op = g.ops[o]
                    ins.discard(op.inputs[0])
                    nbytes += ctx.nbytes[op.inputs[1]] + (ctx.base.get(o, 0) - 2 * ctx.nbytes[op.inputs[1]])
            out = {t for t in out if not any(is_dus(m) and t in cl[m].outputs for m in members)}
        launches += n
        nbytes += sum(read_bytes(t, set()) for t in ins) + sum(ctx.nbytes[t] for t in out)
    convs = [k for k in range(len(cl)) if kind[k] == "conv"]
    if convs:   # cuDNN runs NHWC: each NCHW program input a conv reads, and each output a conv
        # produces, is transposed once (one launch reading and writing it)
        lhs = [g.ops[o].inputs[0] for k in convs for o in cl[k].ops
               if g.ops[o].primitive == "conv_general_dilated"]
        srcs = {x for t in lhs if read_src_is_input(t) for x in _inputs_behind(t)}
        made = {t for t in outs if len(g.tensors[t].shape) >= 3
                and any(kind[p] == "conv" for p in producers_through_movement(t, set()))}
        launches += len(srcs) + len(made)
        nbytes += sum(2 * ctx.nbytes[t] for t in srcs | made)
        # a conv reads a buffer: movement (a split half, a concat) in front of it is materialised
        # by one fusion, unless it only reshapes or reads a program input (the layout transpose
        # above does it)
        fed = set()
        for t in lhs:
            p = ctx.producer.get(t)
            if p is None or kind[p] != "movement" or is_dus(p) or t in fed:
                continue
            if all(ctx.bitcast.get(o) for o in cl[p].ops) or _inputs_behind(t) & inputs:
                continue
            fed.add(t)
        launches += len(fed)
        nbytes += sum(read_bytes(t, set()) + ctx.nbytes[t] for t in fed)
        # filters are OIHW; cuDNN wants them transposed (free for 1x1 and depthwise filters)
        for k in convs:
            for o in cl[k].ops:
                op = g.ops[o]
                if op.primitive != "conv_general_dilated" or op.inputs[1] not in inputs:
                    continue
                shape = g.tensors[op.inputs[1]].shape
                if len(shape) == 4 and shape[0] > 1 and shape[1] > 1 and shape[2] * shape[3] > 1:
                    launches += 1
                    nbytes += 2 * ctx.nbytes[op.inputs[1]]
    return {"kernels_xla": int(launches), "bytes_xla": int(nbytes)}
