"""The guard: VTC's plan is kept only where it pays against plain ``jax.jit``.

A drop-in replacement for ``jax.jit`` must never lose. The greedy prices edges one at a time with
a local model; what XLA then does with the whole program — which movement it materialises next to
an opaque Pallas call, which scalars it must compute for a kernel, which fusions a kernel splits —
only shows in the program VTC emits. So the guard prices *that program*, after lowering, with the
one model of XLA (:func:`xla.xla_program`: the emitted jaxpr traced back into a graph, each Pallas
kernel a kernel call that fuses with nothing), against the same model of plain ``jax.jit(fn)``,
and compares a roofline time (bytes at HBM bandwidth + a fixed cost per launch) and buffer memory.

Why price the emitted program and not the plan: the launches a template emits (split-K and its
reduce, the decode attention's split and combine), the producers that die because a kernel
recomputes them (RoPE tables, masks), and the scalars XLA must materialise for the kernels are all
facts of the lowered program; modelling them from the plan counted up to +47% more launches than
XLA's compile showed. The emitted program has them by construction.

Where VTC loses, :func:`blame` ranks the kernel clusters by what each costs in VTC's program
beyond what XLA's fusions of the same ops cost in jit's, and the build loop (``program.build``)
undoes the worst ones (they go back to the selection as ``rejected``, with the reason) until the
program no longer loses; if it still does, the function runs as plain ``jax.jit``. Where VTC wins,
the kernels that each lose more than :data:`PRUNE_MIN` of jit's time by :func:`blame` are undone
too, and the pruned program replaces the winning one only if it prices faster still.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from .compat import abstract, varying_axes, vary
from .costmodel import ENGINE_OF_KIND, GPU, GPUS, cluster_math, kernel_flops, kernel_waste, strategy_oracles
from .graph import Graph, trace
from .offline import compile_program, h100_devices
from .primitives import KERNEL_CALLS, is_movement_op
from .profiling import MAX_CALLS, device_inputs, handed_on, last_positions, threaded, time_interleaved
from .xla import Price, xla_clusters, xla_program

__all__ = ["GUARDS", "PLAIN", "UNDONE", "PRUNE_MIN", "WIN_MARGIN", "Verdict", "price_plain", "price_ops", "price_emitted", "kernel_math", "emitted_graph", "judge", "clear", "blame", "compiled", "measured", "room_to_time", "calls_that_fit", "timed_loss", "MiB", "apart"]

GUARDS = ("model", "compile", "measure", None)
PLAIN = "plain jax.jit"          # how the guard's note starts when the whole program runs as jit
UNDONE = "undone by the guard"   # how a cluster's verdict starts when the guard gave it back to XLA
MiB = 2 ** 20
# Buffer memory within this fraction of jit's counts as equal: the model of XLA's buffer assignment
# is within a few per cent of the compile on the examples (BENCHMARKS.md), and a 0.05% difference
# (a scalar buffer) is not worth giving up a plan that saves launches and bytes.
MEMORY_SLACK = 0.01
MEMORY_SLACK_BYTES = 64 * 1024   # and so is a few scalars' worth on a tiny program
TIME_TRUST = 0.25     # the model decides alone only on a win larger than this (see clear())
# A roofline win (the model's or the compile's counts) under this is no win: on an H100 the vLLM
# sampler's plan, priced 3% ahead, ran level, and Swin's, priced 18% ahead, ran 13% behind
# (benchmarks/measured/h100-2026-11-27-corpus.jsonl): the roofline's error is larger than this,
# and a win inside it is not worth a plan that may lose
WIN_MARGIN = 0.03
MEASURE_MARGIN = 0.03  # a timed win below this is run-to-run spread (medians of repeated jit runs on an H100/H200 differ by 1-3%)
# A kernel of a winning program is undone when it costs more than XLA's fusions of its ops by
# more than this fraction of jit's time (guard.blame is a model: a smaller loss is within its error)
PRUNE_MIN = 0.02
MEMORY_TRUST = 0.50   # buffers: the model misses what XLA's buffer assignment keeps (DenseNet: -6% modelled, +7% compiled)


@dataclass(frozen=True)
class Verdict:
    """The guard's comparison of one emitted program with plain jit (``loses``: why not kept)."""
    plain: Price
    vtc: Price
    seconds_plain: float
    seconds_vtc: float
    loses: str | None
    by: str = "model"        # "model" (xla.xla_program) or "compile" (XLA's deviceless compile)


def price_plain(graph: Graph, donated: frozenset[int]) -> Price:
    """Plain ``jax.jit`` of the traced function, as XLA fuses it (modelled): the program as
    written (``Graph.as_written``), not a trace with convolutions rewritten channels-last."""
    graph = graph.as_written or graph
    return xla_program(graph, xla_clusters(graph), donated)


def price_ops(graph: Graph, donated: frozenset[int], plain: Price) -> Price:
    """XLA's fusions of ``graph``'s own ops, what :func:`blame` compares cluster by cluster (op
    ids of this trace): ``plain`` itself unless ``graph`` is a channels-last re-trace, whose ops
    are not those of the program as written that ``plain`` prices."""
    return plain if graph.as_written is None else xla_program(graph, xla_clusters(graph), donated)


def emitted_graph(closed: Any) -> Graph:
    """The program VTC emits, traced back into a graph (each Pallas kernel one kernel-call op).
    Inputs keep their varying manual axes (``compat.abstract``): inside a shard_map body under
    ``check_vma``, a re-trace without them mixes varying and unvarying operands and jax refuses."""
    avals = [abstract(v.aval) for v in closed.jaxpr.invars]
    return trace(lambda *xs: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs), *avals)


def kernel_math(graph: Graph, clusters: Sequence[Any], kernel_clusters: Sequence[int | None],
                strategy: Any) -> list[tuple[int, str, str, int]]:
    """``(flops, template, math class, waste)`` of each kernel call of the emitted program, in
    program order (``kernel_clusters``: the cluster each call came from): the flops the kernel
    issues for the dots and convolutions of the cluster it replaces (``costmodel.kernel_flops``: a
    GEMM's padded to whole tiles), and the sector bytes its reads and writes through ``strategy``'s
    virtual layouts waste (``costmodel.kernel_waste``; none where ``strategy`` is None), both charged to
    the cluster's first call (a split-K reduce or an attention combine does none of them)."""
    by_id = {c.id: c for c in clusters}
    layout_of = strategy_oracles(strategy)[0] if strategy is not None else (lambda t: None)
    out, seen = [], set()
    for cid in kernel_clusters:
        c = by_id.get(cid) if cid is not None else None
        if c is None or cid in seen:
            out.append((0, "xla", "", 0))
            continue
        seen.add(cid)
        flops = kernel_flops(graph, c)
        out.append((flops, ENGINE_OF_KIND.get(c.kind, str(c.kind)), cluster_math(graph, c)[1] if flops else "",
                    kernel_waste(graph, c, layout_of)))
    return out


def price_emitted(graph: Graph, emitted: Graph, donated: frozenset[int],
                  math: Sequence[tuple[int, str, str, int]] = ()) -> Price:
    """The emitted program as XLA fuses it around its kernel calls (modelled). ``donated`` are
    tensor ids of ``graph``'s inputs; the emitted program takes the same flat inputs; ``math`` is
    :func:`kernel_math` of its kernel calls."""
    don = frozenset(emitted.inputs[graph.inputs.index(t)] for t in donated if t in graph.inputs)
    return xla_program(emitted, xla_clusters(emitted), don, math)


def judge(plain: Price, vtc: Price, gpu: GPU = GPUS["h100-sxm"], by: str = "model") -> Verdict:
    """Compare the two prices: VTC loses on a roofline time not at least :data:`WIN_MARGIN` shorter
    than jit's, or on more buffer memory (by the model, beyond its slack; by the compile, by a
    single byte)."""
    tp, tv = plain.seconds(gpu), vtc.seconds(gpu)
    why = []
    if tv > tp * (1 - WIN_MARGIN):
        cp, cv = plain.compute_seconds(gpu), vtc.compute_seconds(gpu)
        math = f", math beyond the bytes {cv * 1e6:,.1f} µs against {cp * 1e6:,.1f} µs" if cp or cv else ""
        near = f"; a win under {WIN_MARGIN:.0%} is within the roofline's error" if tv <= tp else ""
        (sv, sp), (bv, bp) = apart(tv, tp, "µs"), apart(vtc.bytes, plain.bytes, "MiB")
        why.append(f"{sv} against jit's {sp} ({vtc.launches} launches and {bv} against {plain.launches} and "
                   f"{bp}{math}, {gpu.name}{near})")
    slack = (plain.buffers * MEMORY_SLACK + MEMORY_SLACK_BYTES) if by == "model" else 0
    if vtc.buffers > plain.buffers + slack:
        bv, bp = apart(vtc.buffers, plain.buffers, "MiB")
        why.append(f"{bv} of buffers against jit's {bp}")
    return Verdict(plain, vtc, tp, tv, "; ".join(why) or None, by)


def blame(graph: Graph, clusters: Sequence[Any], plain: Price, emitted: Graph, vtc: Price,
          kernel_clusters: Sequence[int | None], gpu: GPU = GPUS["h100-sxm"]) -> list[tuple[int, float, str]]:
    """``[(cluster id, seconds lost, why)]`` of the kernel clusters that cost more in VTC's program
    than XLA's fusions of the same ops cost in jit's, worst first.

    ``kernel_clusters``: the cluster id of each kernel call of ``emitted``, in program order (from
    the lowering's name stack). A kernel is charged its own launches and bytes plus the copies XLA
    makes to feed it (movement materialised in front of it); jit is charged, for each of its
    fusions, the share of that fusion's ops that belong to the cluster."""
    sec = lambda f: (max(f.memory_seconds(gpu), f.flops / gpu.flop_rate(f.engine, f.math) if f.flops else 0.0)  # noqa: E731
                     + f.launches * gpu.launch_overhead)
    calls = [op for op in emitted.ops if op.primitive in KERNEL_CALLS]
    if len(calls) != len(kernel_clusters):
        return []
    owner = {op.id: cid for op, cid in zip(calls, kernel_clusters) if cid is not None}
    vcl = xla_clusters(emitted)
    cost: dict[int, float] = {}
    what: dict[int, list[str]] = {}
    readers: dict[int, set[int]] = {}   # tensor -> clusters whose kernels read it
    for op in calls:
        if op.id in owner:
            for t in op.inputs:
                readers.setdefault(t, set()).add(owner[op.id])
    for f in vtc.fusions:
        ops = [o for k in f.clusters for o in vcl[k].ops]
        mine = {owner[o] for o in ops if o in owner}
        if not mine and f.what == "copy":
            made = {t for k in f.clusters for t in vcl[k].outputs}
            mine = set().union(*(readers.get(t, set()) for t in made)) if made else set()
        for cid in mine:
            cost[cid] = cost.get(cid, 0.0) + sec(f) / len(mine)
            what.setdefault(cid, []).append(f"{f.what} {f.bytes / MiB:,.2f} MiB")
    by_id = {c.id: c for c in clusters}
    pcl = xla_clusters(graph)
    for f in plain.fusions:
        ops = {o for k in f.clusters for o in pcl[k].ops if not is_movement_op(graph.ops[o], graph)}
        if not ops:
            continue
        for cid in cost:
            share = len(ops & set(by_id[cid].ops)) / len(ops) if cid in by_id else 0.0
            if share:
                cost[cid] -= share * sec(f)
    out = [(cid, loss, ", ".join(what.get(cid, ()))) for cid, loss in cost.items() if loss > 0]
    return sorted(out, key=lambda x: -x[1])


def _abstract_inputs(closed: Any) -> list[Any]:
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]


def room_to_time(closed: Any, device: Any = None) -> bool:
    """Whether this GPU has room to time both programs beside what is already on it: three times
    the inputs' bytes free (one set of inputs, a fresh copy of the donated ones, and room for the
    programs' temporaries and outputs). A device that does not report its memory is not timed on
    unasked: the default guard must not run the user out of memory while tracing."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats:
        return False
    need = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in closed.jaxpr.invars)
    return 3 * need <= stats["bytes_limit"] - stats.get("bytes_in_use", 0)


# The most memory a timing sample's extra calls may hold (copies of donated inputs, outputs).
TIMING_BYTES = 1 << 30


def calls_that_fit(closed: Any, donate: tuple[int, ...], device: Any = None) -> int:
    """How many calls one timing sample may issue back to back (``profiling.time_interleaved``):
    the calls in flight hold their outputs until the sample ends, and, where the donated inputs
    cannot be handed on from one call to the next (``profiling.carried``: no output of their shape
    and dtype), a fresh copy of those per call; together they may take half of what is free beside
    one set of inputs, and at most ``TIMING_BYTES`` (the timing raises the user's first-call peak
    memory: bounded); at least one, at most ``profiling.MAX_CALLS``. Outputs that take a donated
    input's place in the next call (a decode step's caches) are the next call's inputs, not extra."""
    stats = (device or jax.devices()[0]).memory_stats() or {}
    nbytes = lambda v: int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize  # noqa: E731
    ins, outs = closed.jaxpr.invars, closed.jaxpr.outvars
    on = handed_on([v.aval for v in ins], donate, [v.aval for v in outs])
    inputs = sum(nbytes(v) for v in ins)
    per_call = (sum(nbytes(v) for j, v in enumerate(outs) if j not in on) if on else
                sum(nbytes(v) for i, v in enumerate(ins) if i in donate) + sum(nbytes(v) for v in outs))
    if "bytes_limit" not in stats or per_call == 0:
        return MAX_CALLS if per_call == 0 else 1
    room = min((stats["bytes_limit"] - stats.get("bytes_in_use", 0) - inputs) // 2, TIMING_BYTES)
    return int(max(1, min(MAX_CALLS, room // per_call)))


def clear(v: Verdict) -> bool:
    """The model shows VTC winning by more than its own error: a roofline time at most
    ``1 - TIME_TRUST`` of jit's and buffers at most ``1 - MEMORY_TRUST`` of jit's. Anything closer
    is decided by XLA's compile (``benchmarks/guard.py`` has the model's error on the corpus: up
    to tens of per cent on bytes, several launches, and buffer memory it cannot see)."""
    return (v.loses is None and v.seconds_vtc <= (1 - TIME_TRUST) * v.seconds_plain
            and v.vtc.buffers <= (1 - MEMORY_TRUST) * v.plain.buffers)


def compiled(plain: Price, vtc: Price, plain_fn: Any, vtc_fn: Any, closed: Any, donate: tuple[int, ...],
             gpu: GPU = GPUS["h100-sxm"], cache: dict[str, Any] | None = None) -> Verdict:
    """The verdict by XLA's own compile for the target (deviceless for an H100 when there is no GPU,
    ``offline.compile_program``): launches, buffer bytes and buffer assignment of both programs.
    The modelled prices' launch groups are kept for :func:`blame`. ``cache["jit"]`` holds the plain
    program's compile between the guard's steps (it does not change)."""
    args = _abstract_inputs(closed)
    cache = {} if cache is None else cache
    manual = _manual_axes()
    placed = bool(manual)
    if manual:   # a shard_map body: compiled as the program each device of its mesh runs
        mesh, plain_fn, vtc_fn = _alone(plain_fn, vtc_fn, manual, closed)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in args]
    if "jit" not in cache:
        cache["jit"] = compile_program(jax.jit(plain_fn, donate_argnums=donate), *args, kernels=False, placed=placed)
    cj = cache["jit"]
    cv = compile_program(jax.jit(vtc_fn, donate_argnums=donate), *args, kernels=False, placed=placed)
    as_price = lambda c, m: Price(len(c.launches), c.bytes, c.memory["total"], m.fusions)  # noqa: E731
    v = judge(as_price(cj, plain), as_price(cv, vtc), gpu, by="compile")
    return v


def _manual_axes() -> tuple[tuple[str, int], ...]:
    """The context mesh's axes (name, size) when tracing a shard_map body (some are Manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    types = getattr(mesh, "axis_types", ())
    if not any("Manual" in str(t) for t in types):
        return ()
    return tuple(zip(mesh.axis_names, mesh.axis_sizes))


def _alone(plain_fn: Any, vtc_fn: Any, axes: tuple[tuple[str, int], ...], closed: Any) -> tuple[Any, Any, Any]:
    """A shard_map body's programs (plain and VTC's) as whole programs, with the mesh they run on:
    one shard_map over compile-only H100s shaped as the body's own mesh (``offline.h100_devices``),
    each device given the body's per-shard inputs (replicated) typed as in the body (varying over
    the axes they vary over there: its collectives need them so), each varying output stacked
    along a new leading axis (no copy). Each device runs the body: its launches, bytes and
    buffers, the collectives alike on both sides."""
    names, sizes = zip(*axes)
    mesh = jax.sharding.Mesh(np.array(h100_devices(int(np.prod(sizes)))).reshape(sizes), names)
    vin = [varying_axes(v.aval) for v in closed.jaxpr.invars]
    vout = [varying_axes(getattr(v, "aval", None)) for v in closed.jaxpr.outvars]
    out_specs = tuple(P(tuple(sorted(a))) if a else P() for a in vout)
    checked = any(vin) or any(vout)   # a body traced without replication checks has no varying types

    def whole(fn: Any) -> Any:
        def body(*xs: Any) -> tuple[Any, ...]:
            ys = fn(*(vary(x, a) for x, a in zip(xs, vin)))
            return tuple(y[None] if a else y for y, a in zip(ys, vout))

        def program(*xs: Any) -> Any:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return jax.shard_map(body, mesh=mesh, in_specs=(P(),) * len(vin), out_specs=out_specs,
                                     check_vma=checked)(*xs)
        return program

    return mesh, whole(plain_fn), whole(vtc_fn)


def measured(plain: Price, vtc: Price, plain_fn: Any, vtc_fn: Any, closed: Any, donate: tuple[int, ...],
             gpu: GPU = GPUS["h100-sxm"], repeats: int = 20) -> Verdict:
    """The verdict by timing both programs on this GPU (``profiling.time_interleaved``: medians of
    ``repeats`` interleaved rounds of back-to-back calls after a warm-up, as many calls per sample
    as :func:`calls_that_fit`) and by their compiled buffer assignment.

    It runs while the user's function is being traced and sees only the call's shapes, so its inputs
    are ``profiling.device_inputs``: floats normal × 0.05, an integer that indexes an axis at the
    last value its uses accept (``profiling.last_positions``: a decode position at the cache's last
    row, where VTC's attention reads every key block and jit's no more than at any other), other
    integers zero. Donated inputs are donated in both programs, as in the user's call, and handed on
    from call to call as a loop does (``profiling.threaded``: a decode step's updated caches are
    the next step's), or, where no output can take a donated input's place, re-made outside the
    timed region before every call: an in-place cache update then costs its row, not a copy of the
    cache."""
    args = _abstract_inputs(closed)
    base = device_inputs(args, ints=last_positions(closed))

    def fresh() -> list[Any]:
        with jax.ensure_compile_time_eval():   # on the device now, not values of the trace around us
            return jax.block_until_ready([x.copy() if i in donate else x for i, x in enumerate(base)])

    exes = [jax.jit(fn, donate_argnums=donate).lower(*args).compile() for fn in (plain_fn, vtc_fn)]
    mem = [int(e.memory_analysis().temp_size_in_bytes) for e in exes]
    # jit's program is timed twice in each round: its two medians are the spread of this machine now
    outs = [v.aval for v in closed.jaxpr.outvars]
    plain_s, vtc_s, slow = timed_loss(time_interleaved([exes[0], exes[1], exes[0]], fresh, repeats,
                                                       calls_that_fit(closed, donate),
                                                       threaded(args, donate, outs)))
    why = [slow] if slow else []
    if mem[1] > mem[0]:
        tv, tp = apart(mem[1], mem[0], "MiB")
        why.append(f"{tv} of temporaries against jit's {tp}")
    return Verdict(plain, vtc, plain_s, vtc_s, "; ".join(why) or None, "measure")


def timed_loss(seconds: Sequence[float]) -> tuple[float, float, str | None]:
    """jit's time, VTC's, and why VTC loses (None where it wins), from the medians of jit's
    program, VTC's and jit's again, timed interleaved. A win counts only past
    :data:`MEASURE_MARGIN` and past the spread between jit's two medians. Why: on a lent H200 the
    same program read 0.261 and 0.288 ms back to back in one process (10%), and a plan the guard
    kept on a 3.5% timed win then ran 0.80× of jit in the benchmark's own timing
    (``benchmarks/measured/h200-2026-11-27-examples.jsonl``): a fixed 3% margin trusted noise."""
    first, vtc_s, again = seconds
    plain_s = (first + again) / 2
    spread = abs(first - again) / min(first, again)
    margin = max(MEASURE_MARGIN, spread)
    if vtc_s <= (1 - margin) * plain_s:
        return plain_s, vtc_s, None
    sv, sp = apart(vtc_s, plain_s, "µs")
    return plain_s, vtc_s, (f"{sv} against jit's {sp} (timed; a win under "
                            f"{margin:.0%} is within the run-to-run spread: jit's program timed twice "
                            f"read {first * 1e6:,.1f} and {again * 1e6:,.1f} µs)")


def apart(a: float, b: float, unit: str) -> tuple[str, str]:
    """``a`` and ``b`` (bytes for ``unit`` "MiB", seconds for "µs") written with as many decimals
    as tell them apart (up to 3), and past that ``a``'s difference in bytes or ns: a verdict never
    reads "lost (2.0 µs against 2.0 µs)" (a compile's buffers 240 B over jit's: "128.776 MiB (+240
    B)"). Sizes under 10 MiB in KiB."""
    scale, unit_ = ((1e-6, "µs") if unit == "µs" else (MiB, "MiB") if max(a, b) >= 10 * MiB else (1024, "KiB"))
    for d in (1, 2, 3):
        x, y = f"{a / scale:,.{d}f} {unit_}", f"{b / scale:,.{d}f} {unit_}"
        if x != y or a == b:
            break
    else:
        x += f" ({(a - b) * 1e9:+,.1f} ns)" if unit == "µs" else f" ({a - b:+,.0f} B)"
    return x, y
