"""User surface: ``explain`` (analysis only) and the shared analysis pipeline.

``analyze`` runs trace → cluster → rules → VTOG → greedy once per input signature; ``explain``
wraps it into a :class:`~vtc_jax.report.Report`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax

from . import costmodel
from .cluster import Cluster, cluster, fuse_islands
from .primitives import is_movement_op
from .graph import Graph, trace, trace_with
from .report import Report, build_report
from .strategy import Strategy, plan
from .templates import Match, Reject, match_all
from .vtog import VTOG, build_vtog


@dataclass(frozen=True, eq=False)
class Analysis:
    """Everything the analysis decided for one input signature (what lower and report read)."""
    graph: Graph
    clusters: tuple[Cluster, ...]
    matches: dict[int, Match | Reject]
    vtog: VTOG
    strategy: Strategy
    seconds: float
    donated: frozenset[int] = frozenset()
    declined: tuple[tuple[int, str], ...] = ()   # (first dot op, why) of attention regions no template took
    xla_fused: frozenset[int] = frozenset()      # clusters left to XLA by choice (costmodel.xla_fuses), not a fallback


def _cost_model(cost_model: Any, objective: str, gpu: str | None) -> Any:
    if cost_model is not None:
        return cost_model
    if objective not in ("latency", "memory"):
        raise ValueError(f"objective must be 'latency' or 'memory', got {objective!r}")
    kw = {"objective": objective}
    if gpu is not None:
        if gpu not in costmodel.GPUS:
            raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(costmodel.GPUS)}")
        kw["gpu"] = costmodel.GPUS[gpu]
    return costmodel.CostModel(**kw)


def analyze(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *,
            cost_model: Any = None, objective: str = "latency", gpu: str | None = None,
            donate_argnums: Sequence[int] = (), rejected: Mapping[int, str] | None = None,
            graph: Graph | None = None) -> Analysis:
    """The analysis half of VTC for one input signature (no kernels are built here):
    trace → cluster → match templates → VTOG → strategy (``strategy.plan``).

    ``donate_argnums`` (positions in ``args``) tell the cost model which inputs XLA may update in
    place (a donated KV cache costs only its update). ``rejected`` forces clusters (by id) to XLA
    with the given reason: a kernel that failed to build on an earlier attempt. ``graph`` re-uses
    an earlier trace of the same signature.
    """
    t0 = time.perf_counter()
    if graph is None:   # traced here: XLA's convs next to kernels take another trace, channels-last
        layout: frozenset[int] = frozenset()
        for _ in range(4):   # each pass can put another conv next to a kernel; a few suffice
            g = trace_with(fn, args, kwargs, channels_last=layout)
            a = analyze(fn, args, kwargs, cost_model=cost_model, objective=objective, gpu=gpu,
                        donate_argnums=donate_argnums, rejected=rejected, graph=g)
            more = xla_layout_convs(a)
            if not more:
                break
            layout |= more
        return dataclasses.replace(a, seconds=time.perf_counter() - t0)
    clusters = cluster(graph)
    matches = match_all(graph, clusters, rejected)
    declined = tuple((c.ops[0], matches[c.id].reason) for c in clusters
                     if c.kind == "attention" and isinstance(matches.get(c.id), Reject))
    if declined:   # an attention region no template takes is clustered as its parts instead
        clusters = cluster(graph, not_attention=frozenset(o for o, _ in declined))
        matches = match_all(graph, clusters, rejected)
    model = _cost_model(cost_model, objective, gpu)
    fused: dict[int, str] = {}
    if getattr(model, "xla_fusion", False):   # pointwise work XLA fuses better stays XLA's
        islands = costmodel.pointwise_islands(graph, clusters, matches)
        left: dict[int, str] = {}
        if islands:   # ... unless it becomes one kernel: re-cluster each island as one
            regrouped, left = fuse_islands(graph, clusters, islands)
            if regrouped is not clusters:
                m2 = match_all(graph, regrouped, rejected)
                # an island its template cannot plan stays its parts, left to XLA's fusion
                bad = {frozenset(c.ops): m2[c.id].reason for c in regrouped
                       if isinstance(m2.get(c.id), Reject) and c.kind == "pointwise"
                       and any(is_movement_op(graph.ops[o], graph) for o in c.ops)}
                if bad:
                    ops_of = {c.id: set(c.ops) for c in clusters}
                    keep, why = [], {}
                    for isl in islands:
                        ops = set().union(*(ops_of[k] for k in isl))
                        reason = next((r for b, r in bad.items() if ops <= b), None)
                        if reason is None:
                            keep.append(isl)
                        else:
                            why[min(ops)] = f"its kernel cannot be planned ({reason})"
                    regrouped, left = fuse_islands(graph, clusters, keep) if keep else (clusters, {})
                    left = {**left, **why}
                    m2 = match_all(graph, regrouped, rejected) if regrouped is not clusters else matches
                clusters, matches = regrouped, m2
        kinds = {c.id: c.kind for c in clusters}
        fused = costmodel.xla_fuses(graph, clusters, matches, left)
        matches = {**matches, **{k: Reject(k, kinds[k], why) for k, why in fused.items()}}
    vtog = build_vtog(graph, clusters, matches=matches)
    donated = donated_inputs(graph, args, kwargs, donate_argnums)
    if hasattr(model, "bind"):
        savings = model.bind(vtog, graph, clusters, donated=donated)
    else:  # a user cost model with only savings(edge, chosen, vtog, graph)
        savings = lambda e, chosen: model.savings(e, chosen, vtog, graph)
    strategy = plan(vtog, graph, clusters, savings)
    return Analysis(graph, clusters, matches, vtog, strategy, time.perf_counter() - t0, donated, declined,
                    frozenset(fused))


def xla_layout_convs(a: Analysis) -> frozenset[int]:
    """``conv_index`` of the NCHW-style convolutions XLA runs next to a Pallas kernel: one whose
    output a kernel reads (directly or through a virtual tensor) or whose input a kernel writes.

    XLA gives such a conv's buffers cuDNN's NHWC layout and copies them into the row-major layout
    the kernel takes; traced again with these convs channels-last (``canonical.channels_last``),
    the copy is a transpose the strategy can make virtual. Convs VTC runs, or XLA runs among XLA
    fusions only, are left as written."""
    res = a.strategy.resolution
    if res is None:
        return frozenset()
    kernel_ops: set[int] = set()
    for c in a.clusters:
        if (c.kind != "movement" and isinstance(a.matches.get(c.id), Match)
                and any(t in res.layouts for t in (*c.inputs, *c.outputs))):
            kernel_ops.update(c.ops)
    read_by_kernel: set[int] = set()   # physical tensors a kernel reads, through views or not
    for op in kernel_ops:
        for t in a.graph.ops[op].inputs:
            lay = res.layouts.get(t)
            read_by_kernel.update((p.target for p in lay.pieces) if lay is not None else (t,))
    out: set[int] = set()
    for c in a.clusters:
        if any(t in res.layouts for t in (*c.inputs, *c.outputs)):
            continue   # VTC's kernel (or a view): its layout is VTC's own
        for o in c.ops:
            op = a.graph.ops[o]
            dn = op.params.get("dimension_numbers")
            if (op.primitive != "conv_general_dilated" or op.conv_index is None
                    or getattr(dn, "lhs_spec", (0, 1))[1] == len(a.graph.tensors[op.inputs[0]].shape) - 1
                    and getattr(dn, "out_spec", (0, 1))[1] == len(a.graph.tensors[op.outputs[0]].shape) - 1):
                continue   # already channels-last
            src = a.graph.producer(op.inputs[0])
            if (any(t in read_by_kernel for t in op.outputs)
                    or (src is not None and src.id in kernel_ops)):
                out.add(op.conv_index)
    return frozenset(out)


def donated_inputs(graph: Graph, args: Sequence[Any], kwargs: dict[str, Any],
                   donate_argnums: Sequence[int]) -> frozenset[int]:
    """Graph input tensor ids of the leaves of the donated positional arguments."""
    if not donate_argnums:
        return frozenset()
    counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    starts = [sum(counts[:i]) for i in range(len(args))]
    nums = {i % len(args) for i in donate_argnums} if args else set()
    return frozenset(graph.inputs[starts[i] + j] for i in nums for j in range(counts[i]))


def _split_static(fn: Callable[..., Any], args: tuple, kwargs: dict, static_argnums: Sequence[int],
                  static_argnames: Sequence[str]) -> tuple[Callable[..., Any], tuple, dict]:
    """Close over static arguments the way jax.jit treats them: as compile-time Python values."""
    nums = {i % len(args) if args else i for i in static_argnums}
    static_pos = {i: args[i] for i in nums if i < len(args)}
    static_kw = {k: kwargs[k] for k in static_argnames if k in kwargs}
    if not static_pos and not static_kw:
        return fn, args, kwargs
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    dyn_kw = {k: v for k, v in kwargs.items() if k not in static_kw}

    def closed(*dargs: Any, **dkw: Any) -> Any:
        it = iter(dargs)
        full = [static_pos[i] if i in static_pos else next(it) for i in range(len(args))]
        return fn(*full, **dkw, **static_kw)

    return closed, dyn_args, dyn_kw


def explain(fn: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
            objective: str = "latency", gpu: str | None = None, cost_model: Any = None) -> Any:
    """``explain(fn)(*args, **kwargs) -> Report``: what VTC would do to ``fn``, without running it.

    Arguments may be arrays or ``jax.ShapeDtypeStruct`` (paper-size models analyse without
    allocating). Usable as ``explain(fn)`` or ``explain(objective="memory")(fn)``.
    """
    if fn is None:
        return functools.partial(explain, static_argnums=static_argnums, static_argnames=static_argnames,
                                 donate_argnums=donate_argnums, objective=objective, gpu=gpu,
                                 cost_model=cost_model)
    if not callable(fn):
        raise TypeError(f"explain requires a callable, got {fn!r} of type {type(fn).__name__}")
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Report:
        f, a, k = _split_static(fn, args, kwargs, nums, names)
        static = set(nums)
        dyn_pos = [i for i in range(len(args)) if i not in static]
        dyn_donate = tuple(dyn_pos.index(i) for i in donate if i in dyn_pos)
        try:
            analysis = analyze(f, a, k, cost_model=cost_model, objective=objective, gpu=gpu,
                               donate_argnums=dyn_donate)
            return make_report(getattr(fn, "__name__", repr(fn)), analysis)
        except VTCError:
            raise
        except Exception as exc:
            try:  # the function itself at fault: jax's own error, unchanged
                jax.eval_shape(functools.partial(f, **k), *a)
            except Exception:
                raise
            raise VTCError(f"vtc_jax could not analyse {getattr(fn, '__name__', 'fn')} "
                           f"({type(exc).__name__}: {exc})") from exc

    return run


def make_report(name: str, a: Analysis) -> Report:
    """The :class:`Report` of an analysis (kept here for callers of the old name)."""
    return build_report(name, a)


# --------------------------------------------------------------------------------------------
# optimize
# --------------------------------------------------------------------------------------------

def fallback_messages(a: Analysis, always: frozenset[int] = frozenset(),
                      bodies: Sequence[str] = ()) -> list[str]:
    """One line per reason VTC left part of the program to XLA where it mattered: opaque
    primitives, and compute clusters next to data movement that no template took (grouped by
    reason, so 32 identical layers give one line)."""
    g = a.graph
    msgs: list[str] = []
    for c in a.clusters:
        if c.kind == "opaque" and f"{g.ops[c.ops[0]].primitive} #{c.ops[0]}" not in bodies:
            msgs.append(f"unsupported primitive {g.ops[c.ops[0]].primitive} left to XLA "
                        f"({c.reason}); tensors around it stay physical")
    res = a.strategy.resolution
    kept = [a.graph.ops[o] for o in (res.executed if res is not None else ())]
    kept_tensors = {t for op in kept for t in (*op.inputs, *op.outputs)}
    by_reason: dict[tuple[str, str], list[Cluster]] = {}
    for c in a.clusters:   # a rejection matters where data movement next to the cluster still runs
        verdict = a.matches.get(c.id)
        if c.id in a.xla_fused:   # XLA's by choice: not a fallback
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


class VTCFallbackWarning(UserWarning):
    """Part (or all) of a function runs as plain XLA instead of through VTC's kernels."""


class VTCError(RuntimeError):
    """Raised in strict mode where VTC would otherwise fall back to plain XLA."""


def _resolve_backend(backend: str) -> str:
    if backend not in ("auto", "triton", "interpret"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'interpret', got {backend!r}")
    if backend != "auto":
        return backend
    return "triton" if jax.default_backend() == "gpu" else "interpret"


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(getattr(x, "aval", x), "weak_type", False))
    return x


class Optimized:
    """What ``optimize`` returns: called like ``jax.jit(fn)``; ``.lower``, ``.trace``, ``.explain``.

    The analysis runs when jax traces the function, so it runs once per input signature (jax.jit's
    own cache), inside another ``jax.jit`` too, and under ``jax.export``.
    """

    def __init__(self, fn: Callable[..., Any], *, static_argnums: Sequence[int], static_argnames: Sequence[str],
                 donate_argnums: Sequence[int], backend: str, objective: str, cost_model: Any,
                 profile: bool, strict: bool, gpu: str | None) -> None:
        self.fn = fn
        self._static = (tuple(static_argnums), tuple(static_argnames))
        self._donate = tuple(donate_argnums)
        self._opts = dict(objective=objective, cost_model=cost_model, gpu=gpu)
        self.backend = _resolve_backend(backend)
        self.strict = strict
        self.profile = profile
        self._said: set[str] = set()
        self.last: Any = None   # (Analysis, Lowered) of the latest trace, for inspection
        self._rejected: dict[int, str] = {}   # clusters whose kernel failed to build (latest trace)
        if backend == "auto" and self.backend == "interpret":
            self._warn("no GPU: Pallas kernels run in interpret mode (correct, slow); "
                       "use backend='triton' to lower them for CUDA")
        functools.update_wrapper(self, fn)
        self._jitted = jax.jit(self._impl, static_argnums=static_argnums, static_argnames=static_argnames,
                               donate_argnums=donate_argnums)

    def _warn(self, msg: str) -> None:
        if msg not in self._said:
            self._said.add(msg)
            import warnings
            warnings.warn(f"vtc_jax: {msg}", VTCFallbackWarning, stacklevel=3)

    def _fallback(self, msg: str, exc: BaseException | None = None) -> None:
        if self.strict:
            raise VTCError(msg) from exc
        self._warn(msg)

    def _impl(self, *args: Any, **kwargs: Any) -> Any:
        f, a, k = _split_static(self.fn, args, kwargs, *self._static)
        if self.profile and jax.default_backend() != "gpu":
            self._fallback("profile=True needs a GPU to time candidates; using the analytical cost model")
        flat = jax.tree_util.tree_leaves((a, k))
        try:
            analysis, lowered, closed = self._plan_and_build(f, a, k, flat)
        except VTCError:
            raise
        except Exception as exc:  # the whole rewrite failed: plain jax.jit behaviour
            try:  # unless the function itself is at fault: then jax.jit's own error, unchanged
                jax.eval_shape(functools.partial(f, **k), *a)
            except Exception:
                raise
            self._fallback(f"optimisation of {getattr(self.fn, '__name__', 'fn')} failed "
                           f"({type(exc).__name__}: {exc}); running it as plain XLA", exc)
            return f(*a, **k)
        self.last = (analysis, lowered)
        for msg in fallback_messages(analysis, frozenset(self._rejected), self._build.bodies):
            self._fallback(msg)
        for why in lowered.fallbacks:
            self._fallback(why)
        from .autodiff import with_original_derivatives  # derivatives: fn's own, as plain XLA
        program = with_original_derivatives(lambda *xs: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs),
                                            f, analysis.graph.in_tree)
        return analysis.graph.unflatten_outputs(program(*flat))

    def _plan_and_build(self, f: Callable[..., Any], a: tuple, k: dict, flat: list) -> tuple[Any, Any, Any]:
        """Analyse, lower and trace the emitted program (``program.build``: per-cluster fallback,
        control-flow bodies optimised recursively)."""
        from .program import BuildOptions, build
        abstract_a, abstract_k = jax.tree_util.tree_map(_abstract, (a, k))
        self._rejected = {}
        self._build = BuildOptions(self.backend, self.strict, self._opts, self._fallback, VTCError)
        return build(f, abstract_a, abstract_k, flat, donate=self._donate, opts=self._build,
                     rejected=self._rejected)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.eval_shape(*args, **kwargs)

    def explain(self, *args: Any, **kwargs: Any) -> Report:
        return explain(self.fn, static_argnums=self._static[0], static_argnames=self._static[1],
                       donate_argnums=self._donate, **self._opts)(*args, **kwargs)


def optimize(fn: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = (),
             static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
             backend: str = "auto", objective: str = "latency", cost_model: Any = None,
             profile: bool = False, strict: bool = False, gpu: str | None = None) -> Any:
    """Compile ``fn`` with VTC: like ``jax.jit(fn)``, with data movement turned into index maps.

    Use as ``@optimize`` or ``@optimize(donate_argnums=2, ...)``. ``backend``: "auto" (Triton on a
    GPU, the Pallas interpreter elsewhere), "triton" (lower for CUDA even on a CPU machine, e.g. to
    export) or "interpret". ``strict=True`` raises where VTC would fall back to plain XLA.
    """
    opts = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                backend=backend, objective=objective, cost_model=cost_model, profile=profile, strict=strict,
                gpu=gpu)
    if fn is None:
        return functools.partial(optimize, **opts)
    if not callable(fn):
        raise TypeError(f"optimize requires a callable, got {fn!r} of type {type(fn).__name__}")
    as_tuple = lambda x, t: (x,) if isinstance(x, t) else tuple(x)
    _resolve_backend(backend)
    _cost_model(cost_model, objective, gpu)
    return Optimized(fn, static_argnums=as_tuple(static_argnums, int), static_argnames=as_tuple(static_argnames, str),
                     donate_argnums=as_tuple(donate_argnums, int), backend=backend, objective=objective,
                     cost_model=cost_model, profile=profile, strict=strict, gpu=gpu)
