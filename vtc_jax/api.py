"""User surface: ``explain`` (analysis only) and the shared analysis pipeline.

``analyze`` runs trace → cluster → rules → VTOG → greedy once per input signature; ``explain``
wraps it into a :class:`~vtc_jax.report.Report`.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from . import costmodel, movement
from .cluster import Cluster, cluster
from .graph import Graph, trace
from .report import Modeled, MovementInfo, Report
from .strategy import (Strategy, complete_inplace, complete_views, greedy, physical_inplace,
                       producer_writes)
from .vtog import VTOG, build_vtog


@dataclass(frozen=True, eq=False)
class Analysis:
    graph: Graph
    clusters: tuple[Cluster, ...]
    vtog: VTOG
    strategy: Strategy
    seconds: float
    donated: frozenset[int] = frozenset()


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
            donate_argnums: Sequence[int] = ()) -> Analysis:
    """The analysis half of VTC for one input signature (no kernels are built here).

    ``donate_argnums`` (positions in ``args``) tell the cost model which inputs XLA may update in
    place (a donated KV cache costs only its update).
    """
    t0 = time.perf_counter()
    graph = trace(fn, *args, **kwargs)
    clusters = cluster(graph)
    from .lower import TEMPLATE_KINDS
    vtog = build_vtog(graph, clusters, kernel_kinds=TEMPLATE_KINDS)
    model = _cost_model(cost_model, objective, gpu)
    donated = donated_inputs(graph, args, kwargs, donate_argnums)
    if hasattr(model, "bind"):
        savings = model.bind(vtog, graph, clusters, donated=donated)
    else:  # a user cost model with only savings(edge, chosen, vtog, graph)
        savings = lambda e, chosen: model.savings(e, chosen, vtog, graph)
    strategy = complete_inplace(greedy(vtog, savings))
    from .lower import eliminated_ops
    gone = eliminated_ops(graph, strategy)
    strategy = complete_views(strategy, [e.op for e in vtog.edges if e.op not in gone])
    strategy = physical_inplace(strategy)
    for op in _executed_movement(graph, clusters, strategy):  # outputs left for nobody to produce
        if any(e.direction == "write" for o in op.outputs for e in strategy.points_to(o)):
            strategy = producer_writes(strategy, op.id)
    gone = eliminated_ops(graph, strategy)
    strategy = complete_views(strategy, [e.op for e in vtog.edges if e.op not in gone])
    return Analysis(graph, clusters, vtog, strategy, time.perf_counter() - t0, donated)


def _executed_movement(graph: Graph, clusters: Sequence[Cluster], strategy: Strategy) -> list[Any]:
    """Movement ops XLA still runs under ``strategy`` (a cache update made in place only writes
    its small update: not counted)."""
    from .lower import eliminated_ops
    gone = eliminated_ops(graph, strategy)
    out = []
    for c in clusters:
        if c.kind != "movement":
            continue
        for oid in c.ops:
            op = graph.ops[oid]
            if oid in gone or (op.primitive == "dynamic_update_slice" and any(
                    e.inplace for e in strategy.points_to(op.outputs[0]))):
                continue
            out.append(op)
    return out


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
        analysis = analyze(f, a, k, cost_model=cost_model, objective=objective, gpu=gpu,
                           donate_argnums=dyn_donate)
        return make_report(getattr(fn, "__name__", repr(fn)), analysis)

    return run


def make_report(name: str, a: Analysis) -> Report:
    g, v, s = a.graph, a.vtog, a.strategy
    by_op: dict[int, list[int]] = {}
    for i, e in enumerate(v.edges):
        by_op.setdefault(e.op, []).append(i)
    chosen = set(s.chosen)
    from .lower import eliminated_ops
    gone_ops = eliminated_ops(g, s)
    home = {oid: c for c in a.clusters for oid in c.ops}
    infos = []
    for op in g.ops:
        if not movement.is_movement(op, g) or all(g.tensors[t].const is not None for t in op.inputs):
            continue
        edges = tuple(by_op.get(op.id, ()))
        c = home.get(op.id)
        if c is not None and c.kind not in ("movement", "glue", "opaque"):
            gone, reason = True, f"fused into {c.kind} cluster #{c.id}: a register-level view, never in memory"
        else:
            gone = op.id in gone_ops
            reason = _reason(g, v, s, op, edges, gone)
        infos.append(MovementInfo(op.id, op.primitive,
                                  tuple(g.tensors[t].shape for t in op.inputs if g.tensors[t].const is None),
                                  g.tensors[op.outputs[0]].shape, gone, reason, edges,
                                  tuple(i for i in edges if i in chosen)))
    mb = costmodel.modeled_bytes(g, a.clusters, s, donated=a.donated)
    modeled = Modeled(**{k: int(mb[k]) for k in Modeled.__dataclass_fields__})
    opaque = tuple((g.ops[c.ops[0]].primitive, c.reason) for c in a.clusters if c.kind == "opaque")
    return Report(name, g, a.clusters, v, s, tuple(infos), modeled, a.seconds, opaque)


def _box_size(box: Sequence[tuple[int, int]]) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _reason(g: Graph, v: VTOG, s: Strategy, op: Any, edges: tuple[int, ...], gone: bool) -> str:
    chosen = [v.edges[i] for i in edges if i in set(s.chosen)]
    if gone:
        parts = sorted({f"{'t%d ⇢ t%d' % (e.src, e.dst)} ({e.direction}, Type {e.klass})" for e in chosen})
        return "virtual: " + "; ".join(parts) if parts else "virtual through composed edges"
    if not edges:
        why = movement.explain_no_edges(op, g)
        if why:
            return why
        stuck = [v.reasons[t] for t in (*op.inputs, *op.outputs) if t in v.reasons]
        return stuck[0] if stuck else "no virtual-tensor rule applies"
    for i in edges:
        for a, b in v.conflicts:
            other = b if a == i else a if b == i else None
            if other is not None and other in set(s.chosen):
                return f"edge {i} conflicts with chosen edge {other} ({v.edges[other].primitive} #{v.edges[other].op})"
    stuck = [v.reasons[t] for t in (*op.inputs, *op.outputs) if t in v.reasons]
    if stuck and not chosen:
        return stuck[0]
    return "not profitable under the cost model (no edge with positive modelled saving)" if not chosen \
        else "partially virtual: some outputs still need a physical copy"


# --------------------------------------------------------------------------------------------
# optimize
# --------------------------------------------------------------------------------------------

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
        from .lower import lower
        f, a, k = _split_static(self.fn, args, kwargs, *self._static)
        if self.profile and jax.default_backend() != "gpu":
            self._fallback("profile=True needs a GPU to time candidates; using the analytical cost model")
        try:
            abstract_a, abstract_k = jax.tree_util.tree_map(_abstract, (a, k))
            analysis = analyze(f, abstract_a, abstract_k, donate_argnums=self._donate, **self._opts)
            lowered = lower(analysis.graph, analysis.clusters, analysis.strategy, backend=self.backend)
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
        for c in analysis.clusters:
            if c.kind == "opaque":
                self._fallback(f"unsupported primitive {analysis.graph.ops[c.ops[0]].primitive} left to XLA "
                               f"({c.reason}); tensors around it stay physical")
        for why in lowered.fallbacks:
            self._fallback(f"{why}; it runs in XLA with its virtual inputs gathered")
        flat = jax.tree_util.tree_leaves((a, k))
        from .autodiff import with_original_derivatives  # derivatives: fn's own, as plain XLA
        program = with_original_derivatives(lowered.fn, f, analysis.graph.in_tree)
        return analysis.graph.unflatten_outputs(program(*flat))

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
