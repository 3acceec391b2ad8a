"""Building the optimised program for one input signature, and for the bodies of control flow.

``build`` is the loop behind ``optimize``: analyse, lower, trace the emitted program; a cluster
whose kernel fails to build (or, for ``backend="triton"``, to lower for CUDA) is rejected and the
program re-planned without it — the per-cluster fallback. ``optimize_body`` applies the same to
the body of a ``scan``/``while``/``cond``/``shard_map`` (recursive VTC): the body is a function of its own,
its carries, consts and stacked slices physical at the boundary, and the control-flow op is
re-bound with the optimised body. A body that cannot be optimised keeps its original jaxpr.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Literal

from . import guard
from .analysis import Analysis, analyze, cost_model_for
from .compat import abstract, scan_counts, varying_axes
from .costmodel import GPU, GPUS
from .graph import Graph, Op
from .interpret import rebind
from .lower import Lowered, has_kernels, kernel_clusters, lower, triton_failures
from .primitives import CONTROL_FLOW
from .templates import KernelBuildError, Match

__all__ = ["BuildOptions", "build", "optimize_body", "per_shard_only", "MAX_BUILD_ATTEMPTS", "NO_KERNEL"]

MAX_BUILD_ATTEMPTS = 6   # re-plans after kernel build failures before giving up on the whole rewrite


NO_KERNEL = "no Pallas kernel in the plan"   # the guard's note where nothing was ever a kernel

MAX_GUARD_STEPS = 4      # re-plans with the guard's worst kernels undone before running plain jit

# jax's Pallas interpreter evaluates a kernel's body with the types of its operands; inside a
# shard_map with check_vma=True those vary over the manual axes while the kernel's own indices and
# constants do not, and jax rejects the mix when it lowers the call (jax 0.10.2 and 0.12 alike,
# for any kernel). Such a function runs as plain XLA in interpret mode; Triton lowers the kernels.
INTERPRET_VARYING = ("Pallas's interpreter (backend='interpret') cannot run kernels on values that vary "
                     "over shard_map's manual axes (check_vma=True)")


@dataclass
class BuildOptions:
    backend: str
    strict: bool
    analysis: dict[str, Any]                         # objective, cost_model, gpu
    warn: Callable[[str], None]
    error: type[Exception]                           # VTCError (raised in strict mode)
    bodies: list[str] = field(default_factory=list)  # control-flow bodies optimised or with nothing to gain (for reports)
    guard: str | None = "model"                      # guard.GUARDS: how the plan is priced against jit
    function: Callable[..., Any] | None = None       # the function being built (the guard compiles it plainly)


def build(f: Callable[..., Any], abstract_a: tuple, abstract_k: dict, flat: Sequence[Any], *,
          donate: Sequence[int], opts: BuildOptions, rejected: dict[frozenset[int], str],
          donate_names: Sequence[str] = ()) -> tuple[Analysis, Lowered, Any]:
    """``(analysis, lowered, closed_jaxpr)`` of ``f`` traced on ``flat`` (arrays, tracers or
    ShapeDtypeStructs). ``rejected`` collects the clusters whose kernels failed to build or that
    the guard undid, each named by its ops (``selection.Rejections``: ids change when a re-plan
    clusters differently); they go back into the analysis (``selection.select``) as an input,
    which re-plans without them."""
    if opts.backend == "interpret" and any(varying_axes(x) for x in flat):
        analysis = analyze(f, abstract_a, abstract_k, donate_argnums=donate, donate_argnames=donate_names,
                           rejected=rejected, **opts.analysis)
        if any(isinstance(m, Match) for m in analysis.matches.values()):   # kernels it would have had
            opts.warn(f"{INTERPRET_VARYING}; {getattr(f, '__name__', 'the function')} runs as plain XLA here "
                      "(its kernels are built for a GPU, backend='triton', or under check_vma=False)")
        return _plain(f, _noted(analysis, [f"{guard.PLAIN}: {INTERPRET_VARYING}"]), flat)
    graph = None
    undone: list[str] = []
    guard_steps = 0
    compiled: dict[str, Any] = {}   # the guard's compile of plain jit, made once
    best: tuple[float, tuple[Analysis, Lowered, Any]] | None = None   # a winning build, pruned next
    for _ in range(MAX_BUILD_ATTEMPTS + MAX_GUARD_STEPS):
        analysis = analyze(f, abstract_a, abstract_k, donate_argnums=donate, donate_argnames=donate_names,
                           rejected=rejected, graph=graph,
                           **opts.analysis)
        graph = analysis.graph
        lowered = lower(graph, analysis.clusters, analysis.matches, analysis.strategy,
                                  backend=opts.backend, rewrite=lambda op: optimize_body(op, opts))
        try:
            closed = jax.make_jaxpr(lowered.fn)(*flat)
        except KernelBuildError as e:
            if opts.strict:
                raise opts.error(f"{e}") from e.cause
            rejected[_ops(analysis, e.cluster)] = f"its kernel failed to build ({type(e.cause).__name__}: " \
                                  f"{str(e.cause).splitlines()[0] if str(e.cause) else ''})"
            continue
        if opts.backend == "triton":
            bad = triton_failures(closed)
            if bad:
                if opts.strict:
                    raise opts.error(f"kernels failed to lower for CUDA: {bad}")
                rejected.update({_ops(analysis, c): f"its kernel failed to lower for CUDA ({why})"
                                 for c, why in bad.items()})
                continue
        if best is not None and not has_kernels(closed.jaxpr):
            return best[1]   # pruning undid every kernel: the winning build stands
        if opts.guard is not None and not has_kernels(closed.jaxpr):
            # no kernel (none matched, or every one undone): what is left is VTC's re-emission of
            # jit's program with nothing gained (measured on an H200: YOLO's C3k2 block so
            # re-emitted ran 0.80-0.91x of jit)
            undone.append(f"{guard.PLAIN}: every kernel undone" if undone else f"{guard.PLAIN}: {NO_KERNEL}")
            return _plain(f, _noted(analysis, undone), flat)
        if opts.guard is None or not kernel_clusters(closed.jaxpr):
            return _noted(analysis, undone), lowered, closed
        emitted = guard.emitted_graph(closed)   # traced once: priced, and blamed if it loses
        verdict = _price(analysis, closed, emitted, dataclasses.replace(opts, function=f), compiled)
        if verdict.loses is None:
            (sv, sp), (bv, bp) = (guard.apart(verdict.seconds_vtc, verdict.seconds_plain, "µs"),
                                  guard.apart(verdict.vtc.buffers, verdict.plain.buffers, "MiB"))
            kept = f"kept: VTC's program {sv}, {bv} of buffers against jit's {sp}, {bp} (by the {verdict.by})"
            ratio = verdict.seconds_vtc / max(verdict.seconds_plain, 1e-12)
            if best is not None and ratio >= best[0]:
                return best[1]   # the pruned build is no faster than the one it came from
            result = (_noted(analysis, [*undone, kept]), lowered, closed)
            picks = _losers(analysis, closed, emitted, verdict, opts) if guard_steps < MAX_GUARD_STEPS else []
            if not picks:
                return result
            best = (ratio, result)
            guard_steps += 1
            _undo(analysis, picks, rejected, undone, f", in a program that won ({kept})",
                  f" costing more than XLA's fusions of their ops, in a program that won: {kept}")
            continue
        if best is not None:
            return best[1]   # the pruned build loses: the winning build stands
        picks = _worst(analysis, closed, emitted, verdict, opts) if guard_steps < MAX_GUARD_STEPS else []
        if picks:
            guard_steps += 1
            _undo(analysis, picks, rejected, undone, f"; VTC's program lost ({verdict.loses})",
                  f": VTC's program lost ({verdict.loses})")
            continue
        undone.append(f"{guard.PLAIN}: VTC's program still loses ({verdict.loses}), by the {verdict.by}")
        return _plain(f, _noted(analysis, undone), flat)
    raise RuntimeError(f"kernels kept failing to build after {MAX_BUILD_ATTEMPTS} attempts: {rejected}")


def per_shard_only(jaxpr: Any) -> bool:
    """Whether a built program launches its kernels only inside ``shard_map`` bodies (or none):
    run on sharded inputs, those kernels see their shards, where a kernel outside one would have
    its operands gathered by XLA's SPMD partitioner (``api.Optimized`` asks, for sharded calls).
    Calls and control-flow bodies (scan, cond, while) are looked into; shard_map bodies are not."""
    return not has_kernels(jaxpr, outside=frozenset({"shard_map"}))


class GuardedBody(Exception):
    """A control-flow body the guard keeps as plain XLA (it is priced no faster with kernels)."""


def _noted(analysis: Analysis, notes: Sequence[str]) -> Analysis:
    return dataclasses.replace(analysis, guard=tuple(notes)) if notes else analysis


def _gpu(opts: BuildOptions) -> GPU:
    return getattr(cost_model_for(opts.analysis.get("cost_model"), opts.analysis.get("objective", "latency"),
                                  opts.analysis.get("gpu")), "gpu", GPUS["h100-sxm"])


def _price(analysis: Analysis, closed: Any, emitted: Graph, opts: BuildOptions,
           cache: dict[str, Any]) -> guard.Verdict:
    """The guard's verdict on the emitted program (``opts.guard``: by the model of XLA — confirmed,
    where the model shows no clear win, by a timing on this GPU when there is one with room for it,
    else by XLA's compile for the target —, by the compile, or by a timing; see :mod:`vtc_jax.guard`). ``cache`` keeps the plain program's compile across the guard's steps."""
    gpu = _gpu(opts)
    plain = guard.price_plain(analysis.graph, analysis.donated)
    vtc = guard.price_emitted(analysis.graph, emitted, analysis.donated,
                              guard.kernel_math(analysis.graph, analysis.clusters, kernel_clusters(closed.jaxpr),
                                                analysis.strategy))
    model = guard.judge(plain, vtc, gpu)
    if opts.guard == "model" and guard.clear(model):
        return model
    if opts.guard == "model" and cache.get("no_compile"):   # say why the compile did not decide
        return dataclasses.replace(model, by=f"model (XLA's compile for the target failed: {cache['no_compile']})")
    if jax.default_backend() == "gpu" and "no_measure" not in cache and (
            opts.guard == "measure" or (opts.guard == "model" and guard.room_to_time(closed))):
        # on a GPU the evidence is a timing: XLA's compile counted EfficientViT's per-head
        # products a 5% win that ran 3.8x slower on an H200
        try:
            return guard.measured(plain, vtc, _flat_plain(opts.function, analysis), _run_closed(closed),
                                  closed, _donated_positions(analysis), gpu)
        except Exception as exc:  # noqa: BLE001 - out of memory, or a program that cannot run here
            cache["no_measure"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            if opts.guard == "measure":
                opts.warn(f"the guard could not time the programs on this GPU ({cache['no_measure']}); "
                          "it compiled them instead")
    try:
        program = closed
        if opts.backend != "triton":   # price the kernels XLA would compile, not the interpreter's loops
            lowered = lower(analysis.graph, analysis.clusters, analysis.matches, analysis.strategy,
                            backend="triton", rewrite=lambda op: optimize_body(
                                op, dataclasses.replace(opts, backend="triton", guard=None)))
            # traced in the user's own context (a shard_map in fn compares its mesh with it); the
            # kernels name their abstract GPU when the compile lowers them (compat.triton_compiler_params)
            program = jax.make_jaxpr(lowered.fn)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                                   for v in closed.jaxpr.invars])
        return guard.compiled(plain, vtc, _flat_plain(opts.function, analysis), _run_closed(program), closed,
                              _donated_positions(analysis), gpu, cache)
    except Exception as exc:  # noqa: BLE001 - XLA cannot compile for the target here (no CUDA plugin)
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if opts.guard != "model":
            opts.warn(f"the guard could not compile for the target ({why}); it priced by the model of XLA")
        cache["no_compile"] = why
        return dataclasses.replace(model, by=f"model (XLA's compile for the target failed: {why})")


def _flat_plain(f: Callable[..., Any], analysis: Analysis) -> Callable[..., tuple[Any, ...]]:
    """``f`` flat in and out: what plain ``jax.jit(f)`` runs."""
    def fn(*xs: Any) -> tuple[Any, ...]:
        a, k = jax.tree_util.tree_unflatten(analysis.graph.in_tree, xs)
        return tuple(jax.tree_util.tree_leaves(f(*a, **k)))
    return fn


def _run_closed(closed: Any) -> Callable[..., Any]:
    return lambda *xs: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs)


def _donated_positions(analysis: Analysis) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(analysis.graph.inputs) if t in analysis.donated)


def _worst(analysis: Analysis, closed: Any, emitted: Graph, verdict: guard.Verdict,
           opts: BuildOptions) -> list[tuple[int, float, str]]:
    """The kernels to undo: the worst by :func:`guard.blame`, until what they lose covers VTC's
    deficit in time (at least one; all that lose anything when the program loses on memory)."""
    ranked = guard.blame(analysis.graph, analysis.clusters,
                         guard.price_ops(analysis.graph, analysis.donated, verdict.plain), emitted,
                         verdict.vtc, kernel_clusters(closed.jaxpr), _gpu(opts))
    deficit = verdict.seconds_vtc - verdict.seconds_plain
    if verdict.vtc.buffers > verdict.plain.buffers or deficit <= 0:
        return ranked
    picks, total = [], 0.0
    for item in ranked:
        picks.append(item)
        total += item[1]
        if total >= deficit:
            break
    return picks


def _ops(analysis: Analysis, cluster_id: int) -> frozenset[int]:
    """The ops of one of ``analysis``'s clusters: how a rejection names it (``selection.Rejections``)."""
    return next(frozenset(c.ops) for c in analysis.clusters if c.id == cluster_id)


def _undo(analysis: Analysis, picks: Sequence[tuple[int, float, str]], rejected: dict[frozenset[int], str],
          undone: list[str], cluster_why: str, note_why: str) -> None:
    """Give the guard's picks back to XLA: each cluster rejected with its loss (reason starting
    ``guard.UNDONE``, then ``cluster_why``), one note for them all (then ``note_why``)."""
    for cid, loss, what in picks:
        rejected[_ops(analysis, cid)] = (f"{guard.UNDONE}: its kernel costs {loss * 1e6:,.2f} µs more than "
                         f"XLA's fusions of the same ops ({what}){cluster_why}")
    undone.append(f"undid {len(picks)} kernel(s) ({', '.join(f'#{c}' for c, _, _ in picks)}){note_why}")


def _losers(analysis: Analysis, closed: Any, emitted: Graph, verdict: guard.Verdict,
            opts: BuildOptions) -> list[tuple[int, float, str]]:
    """The kernels of a winning program that each cost more than XLA's fusions of their ops by
    more than :data:`guard.PRUNE_MIN` of jit's time: the issue's "only decisions that pay are
    kept". Why not only when the whole program loses: LoRA's attention kernel won 2.5x over XLA's
    attention on an H100 while the projection GEMM beside it ran 5x slower than cuBLAS, and the
    program as a whole, kept, came out 0.94x of jit."""
    ranked = guard.blame(analysis.graph, analysis.clusters,
                         guard.price_ops(analysis.graph, analysis.donated, verdict.plain), emitted,
                         verdict.vtc, kernel_clusters(closed.jaxpr), _gpu(opts))
    return [x for x in ranked if x[1] > guard.PRUNE_MIN * verdict.seconds_plain]


def _plain(f: Callable[..., Any], analysis: Analysis, flat: Sequence[Any]) -> tuple[Analysis, Lowered, Any]:
    """``f`` itself, flat in and out (what plain ``jax.jit(f)`` runs): the guard's last word."""
    fn = _flat_plain(f, analysis)
    return analysis, Lowered(fn, (), ()), jax.make_jaxpr(fn)(*flat)


def _optimize_closed(closed: Any, opts: BuildOptions) -> Any | None:
    """An optimised copy of a ClosedJaxpr with the same signature (None: nothing to gain). Its
    inputs keep their varying manual axes (``compat.abstract``: a ``shard_map`` body's types)."""
    sds = [abstract(a) for a in closed.in_avals]

    def body(*xs: Any) -> Any:
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs)

    nested = len(opts.bodies)
    analysis, lowered, new = build(body, tuple(sds), {}, sds, donate=(), opts=opts, rejected={})
    if analysis.guard and (analysis.guard[-1].startswith(guard.PLAIN) or not lowered.kernels):
        raise GuardedBody(analysis.guard[-1])
    if not lowered.kernels and len(opts.bodies) == nested:   # no kernel here nor in a nested body
        return None
    if [(a.shape, a.dtype) for a in new.out_avals] != [(a.shape, a.dtype) for a in closed.out_avals]:
        raise TypeError("optimised body changed its output types")
    return new


def optimize_body(op: Op, opts: BuildOptions) -> Callable[..., Sequence[Any]] | None:
    """An implementation of a control-flow op (``impl(*input values) -> output values``) with
    its body (bodies) optimised, or None to keep the op as traced."""
    if op.primitive not in CONTROL_FLOW:
        return None
    if op.primitive == "shard_map":
        return _shard_map(op, opts)
    p = dict(op.params)
    try:
        if op.primitive == "scan" and not p.get("reverse") and _cache_pairs(p):
            impl = _stacked_cache_scan(op, opts)
            opts.bodies.append(f"{op.primitive} #{op.id}")
            return impl
        # a body analysed with nothing to gain (no kernel) is a decision as well, not a fallback
        if op.primitive == "scan":
            new = _optimize_closed(p["jaxpr"], opts)
            if new is None:
                opts.bodies.append(f"{op.primitive} #{op.id}")
                return None
            p["jaxpr"] = new
        elif op.primitive == "while":
            new = _optimize_closed(p["body_jaxpr"], opts)
            if new is None:
                opts.bodies.append(f"{op.primitive} #{op.id}")
                return None
            p["body_jaxpr"] = new
        else:  # cond: every branch on its own; the outputs stay physical, so they always agree
            branches = [_optimize_closed(b, opts) for b in p["branches"]]
            if all(b is None for b in branches):
                opts.bodies.append(f"{op.primitive} #{op.id}")
                return None
            p["branches"] = tuple(b if b is not None else old for b, old in zip(branches, p["branches"]))
    except GuardedBody:   # the guard chose plain XLA for the body: a decision, not a fallback
        opts.bodies.append(f"{op.primitive} #{op.id}")
        return None
    except Exception as exc:  # noqa: BLE001 - the body stays as traced
        if opts.strict:
            raise opts.error(f"the body of {op.primitive} #{op.id} could not be optimised: {exc}") from exc
        opts.warn(f"the body of {op.primitive} #{op.id} runs as traced ({type(exc).__name__}: {exc})")
        return None
    opts.bodies.append(f"{op.primitive} #{op.id}")
    return lambda *vals: rebind(op.prim, vals, p)


def _shard_map(op: Op, opts: BuildOptions) -> Callable[..., Sequence[Any]]:
    """``shard_map`` with its body optimised per shard: re-traced through ``jax.shard_map`` with
    the equation's own mesh, specs, manual axes and ``check_vma``, the body built by VTC inside it.

    Why not optimise the body jaxpr first and re-bind the primitive with it, as for ``scan``: the
    body only traces inside the shard_map — collectives (``psum``, ``axis_index``, ...) need the
    manual axes bound, and under ``check_vma`` its values are typed by the axes they vary over
    (``compat.abstract``). ``jax.shard_map`` provides that context and re-stages the equation
    (consts, out-spec checks) through public API on every supported jax. Collectives stay opaque
    ops inside the body. A body that cannot be optimised is evaluated as traced."""
    p = op.params
    body = ClosedJaxpr(p["jaxpr"], ())
    name = f"{op.primitive} #{op.id}"

    def per_shard(*xs: Any) -> tuple[Any, ...]:
        new = None
        try:
            new = _optimize_closed(body, opts)
            opts.bodies.append(name)   # optimised, or nothing to gain: either way a decision
        except GuardedBody:   # plain XLA for the body: a decision, not a fallback
            opts.bodies.append(name)
        except Exception as exc:  # noqa: BLE001 - the body stays as traced
            if opts.strict:
                raise opts.error(f"the body of {name} could not be optimised: {exc}") from exc
            opts.warn(f"the body of {name} runs as traced ({type(exc).__name__}: {exc})")
        run = new if new is not None else body
        return tuple(jax.core.eval_jaxpr(run.jaxpr, run.consts, *xs))

    def impl(*vals: Any) -> Sequence[Any]:
        try:
            return jax.shard_map(per_shard, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                                 out_specs=tuple(p["out_specs"]), axis_names=p["newly_manual_axes"],
                                 check_vma=p["check_vma"])(*vals)
        except opts.error:
            raise
        except Exception as exc:  # noqa: BLE001 - jax would not re-stage it: the equation as traced
            if opts.strict:
                raise opts.error(f"{name} could not be re-traced: {exc}") from exc
            opts.warn(f"the body of {name} runs as traced ({type(exc).__name__}: {exc})")
            return op.bind(*vals)

    return impl


# --------------------------------------------------------------------------------------------
# Stacked caches: a per-layer cache scanned over as xs -> ys becomes a carry updated in place
# --------------------------------------------------------------------------------------------

def _cond_branch_update(eqn: Any, o: int) -> int | None:
    """The operand position ``k`` (of the branches) such that output ``o`` of ``cond`` is, in every
    branch, ``dynamic_update_slice(operand k, ...)`` and nothing else in that branch reads operand
    ``k`` (None: not that pattern). A layer kind chosen by ``lax.cond`` (Gemma-2's local/global
    alternation) updates the layer's cache slice inside the branch."""
    ks = set()
    for br in eqn.params["branches"]:
        bj = br.jaxpr
        ov = bj.outvars[o]
        e = next((x for x in bj.eqns if any(v is ov for v in x.outvars)), None)
        if e is None or e.primitive.name != "dynamic_update_slice":
            return None
        src = e.invars[0]
        if not any(src is v for v in bj.invars) or any(src is v for v in bj.outvars):
            return None
        if sum(any(v is src for v in x.invars) for x in bj.eqns) != 1 or \
                sum(v is ov for v in bj.outvars) != 1:
            return None
        ks.add(next(i for i, v in enumerate(bj.invars) if v is src))
    return ks.pop() if len(ks) == 1 else None


def _cache_pairs(p: dict[str, Any]) -> list[tuple[int, int, int, tuple[int, int] | None]]:
    """``(xs invar position, ys outvar position, eqn index, via)`` of every ``ys =
    dynamic_update_slice(xs, update, starts)`` in a scan body whose ``xs`` slice is read by nothing
    else (``via`` None), or of a ``cond`` whose every branch does that to one of its operands
    (``via = (branch operand k, cond output o)``).

    Scanned as ``xs``/``ys``, each layer's cache is sliced out of the stacked buffer and stacked
    back into a new one: the whole cache is copied every step. As a carry updated at
    ``[layer, starts]`` only the new row is written, in place (and VTC's kernels then read the
    layer's slice through a map and write the row from the projection's kernel)."""
    closed = p["jaxpr"]
    jaxpr = closed.jaxpr
    nc, ncar = scan_counts(p)  # jax 0.12: ft_in instead of num_consts/num_carry
    producer = {v: (i, e) for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    xs_vars = list(jaxpr.invars[nc + ncar:])
    out = []
    for m, ov in enumerate(jaxpr.outvars[ncar:]):
        hit = producer.get(ov)
        if hit is None:
            continue
        idx, eqn = hit
        via = None
        if eqn.primitive.name == "dynamic_update_slice":
            operand = eqn.invars[0]
        elif eqn.primitive.name == "cond":
            o = next(i for i, v in enumerate(eqn.outvars) if v is ov)
            k = _cond_branch_update(eqn, o)
            if k is None:
                continue
            operand, via = eqn.invars[1 + k], (k, o)
            if sum(v is operand for v in eqn.invars) != 1:
                continue
        else:
            continue
        if operand not in xs_vars or operand in jaxpr.outvars:
            continue
        users = [e for e in jaxpr.eqns if any(v is operand for v in e.invars)]
        if len(users) != 1 or list(jaxpr.outvars).count(ov) != 1:
            continue
        out.append((nc + ncar + xs_vars.index(operand), ncar + m, idx, via))
    return out


def _read(env: dict[Any, Any], v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def _stacked_cache_scan(op: Op, opts: BuildOptions) -> Callable[..., Sequence[Any]]:
    from jax import lax
    p = op.params
    closed = p["jaxpr"]
    jaxpr = closed.jaxpr
    (nc, ncar), length = scan_counts(p), p["length"]
    pairs = _cache_pairs(p)
    pair_in = {k for k, _, _, _ in pairs}
    pair_out = {j: n for n, (_, j, _, _) in enumerate(pairs)}
    pair_eqn = {idx: n for n, (_, _, idx, via) in enumerate(pairs) if via is None}
    cond_eqn: dict[int, list[tuple[int, int, int]]] = {}     # eqn index -> [(pair n, k, o)]
    for n, (_, _, idx, via) in enumerate(pairs):
        if via is not None:
            cond_eqn.setdefault(idx, []).append((n, *via))
    n_in = len(jaxpr.invars)
    other_xs = [i for i in range(nc + ncar, n_in) if i not in pair_in]
    other_ys = [j for j in range(ncar, len(jaxpr.outvars)) if j not in pair_out]
    npair = len(pairs)

    def body_flat(*a: Any) -> list[Any]:
        """consts, carries, stacked caches, layer index, other stacked xs -> carries, stacked
        caches, next index, other ys slices."""
        consts, carry = a[:nc], a[nc:nc + ncar]
        stacked = list(a[nc + ncar:nc + ncar + npair])
        layer = a[nc + ncar + npair]
        xs = a[nc + ncar + npair + 1:]
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars[:nc + ncar], (*consts, *carry)))
        # every other xs is read at [layer] from its stacked array: a kernel reads a layer's
        # weights through that map instead of XLA slicing them out first
        env.update(zip((jaxpr.invars[i] for i in other_xs),
                       (lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in xs)))
        whole = dict(zip((jaxpr.invars[i] for i in other_xs), xs))   # stacked xs, by body var
        for i, eqn in enumerate(jaxpr.eqns):
            if i in cond_eqn:   # the branches update the stacked caches themselves
                plist = cond_eqn[i]
                skip = {1 + k for _, k, _ in plist}
                vals = [None if j in skip else _read(env, v) for j, v in enumerate(eqn.invars)]
                # a layer's weights go into the branches whole and are read there at [layer]
                # (through a map by a kernel), not sliced out before the cond
                per_layer = {j - 1 for j, v in enumerate(eqn.invars) if j and not isinstance(v, Literal)
                             and v in whole}
                for j in per_layer:
                    vals[1 + j] = whole[eqn.invars[1 + j]]
                outs = _stacked_cond(eqn, plist, vals, [stacked[n] for n, _, _ in plist], layer, per_layer)
                for local, (n, _, o) in enumerate(plist):
                    stacked[n] = outs[o]
                    outs[o] = lax.dynamic_index_in_dim(stacked[n], layer, 0, keepdims=False)
                env.update(zip(eqn.outvars, outs))
                continue
            vals = [None if i in pair_eqn and k == 0 else _read(env, v) for k, v in enumerate(eqn.invars)]
            if i in pair_eqn:   # the layer's slice is never materialised: update the stack
                n = pair_eqn[i]
                update, starts = vals[1], [jnp.asarray(s_, jnp.int32) for s_ in vals[2:]]
                stacked[n] = lax.dynamic_update_slice(stacked[n], update[None], (layer, *starts))
                env[eqn.outvars[0]] = lax.dynamic_index_in_dim(stacked[n], layer, 0, keepdims=False)
                continue
            out = rebind(eqn.primitive, vals, eqn.params)
            env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else (out,)))
        outs = [_read(env, v) for v in jaxpr.outvars]
        return [*outs[:ncar], *stacked, layer + 1, *(outs[j] for j in other_ys)]

    def impl(*vals: Any) -> list[Any]:
        consts, init = vals[:nc], vals[nc:nc + ncar]
        stacked0 = [vals[k] for k, _, _, _ in pairs]
        xs = [vals[i] for i in other_xs]
        avals = [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in (*consts, *init, *stacked0)]
        avals.append(jax.ShapeDtypeStruct((), "int32"))
        avals += [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype) for v in xs]
        traced = jax.make_jaxpr(body_flat)(*avals)
        body = _optimize_closed(traced, opts) or traced
        ncarry = ncar + npair + 1

        def scan_body(carry: tuple, _: Any) -> tuple[tuple, tuple]:
            outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *xs)
            return tuple(outs[:ncarry]), tuple(outs[ncarry:])

        carry, ys = lax.scan(scan_body, (*init, *stacked0, jnp.int32(0)), None, length=length,
                             unroll=p.get("unroll", 1))
        final, stacked = carry[:ncar], carry[ncar:ncar + npair]
        ys_iter = iter(ys)
        out = list(final)
        for j in range(ncar, len(jaxpr.outvars)):
            out.append(stacked[pair_out[j]] if j in pair_out else next(ys_iter))
        return out

    return impl


def _stacked_cond(eqn: Any, plist: list[tuple[int, int, int]], vals: list[Any], stacked: list[Any],
                  layer: Any, per_layer: set[int] = frozenset()) -> list[Any]:
    """Re-bind a ``cond`` whose branches update layer caches (:func:`_cond_branch_update`) so
    that each branch writes its new rows into the stacked caches at ``[layer, starts]`` and
    returns the stacked caches in place of the layer's updated slice (``plist``: (pair, branch
    operand k, output o)); the layer's slice is read through ``[layer]`` where a branch reads it,
    and so are the operands in ``per_layer`` (stacked weights passed whole)."""
    from jax import lax
    ks = {k: local for local, (_, k, _) in enumerate(plist)}
    outs_o = {o: local for local, (_, _, o) in enumerate(plist)}

    def branch(br: Any) -> Callable[..., list[Any]]:
        bj = br.jaxpr
        dus = {}
        for j, e in enumerate(bj.eqns):
            if e.primitive.name == "dynamic_update_slice":
                k = next((i for i, v in enumerate(bj.invars) if v is e.invars[0]), None)
                if k in ks:
                    dus[j] = ks[k]

        def f(stk: tuple, lay: Any, *ops: Any) -> list[Any]:
            stk_l = list(stk)
            env: dict[Any, Any] = dict(zip(bj.constvars, br.consts))
            env.update(zip(bj.invars, (lax.dynamic_index_in_dim(x, lay, 0, keepdims=False) if i in per_layer
                                       else x for i, x in enumerate(ops))))
            for j, e in enumerate(bj.eqns):
                if j in dus:
                    local = dus[j]
                    update = _read(env, e.invars[1])
                    starts = [jnp.asarray(_read(env, v), jnp.int32) for v in e.invars[2:]]
                    stk_l[local] = lax.dynamic_update_slice(stk_l[local], update[None], (lay, *starts))
                    env[e.outvars[0]] = lax.dynamic_index_in_dim(stk_l[local], lay, 0, keepdims=False)
                    continue
                out = rebind(e.primitive, [_read(env, v) for v in e.invars], e.params)
                env.update(zip(e.outvars, out if e.primitive.multiple_results else (out,)))
            res = [_read(env, v) for v in bj.outvars]
            for o, local in outs_o.items():
                res[o] = stk_l[local]
            return res

        return f

    index, ops = vals[0], vals[1:]
    fns = [branch(br) for br in eqn.params["branches"]]
    return list(lax.switch(index, fns, tuple(stacked), layer, *ops))
