"""User surface: ``explain`` (analysis only) and the shared analysis pipeline.

``analyze`` runs trace → cluster → rules → VTOG → greedy once per input signature; ``explain``
wraps it into a :class:`~vtc_jax.report.Report`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import types
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
            graph: Graph | None = None, donate_argnames: Sequence[str] = ()) -> Analysis:
    """The analysis half of VTC for one input signature (no kernels are built here):
    trace → cluster → match templates → VTOG → strategy (``strategy.plan``).

    ``donate_argnums`` (positions in ``args``) and ``donate_argnames`` (keys of ``kwargs``) tell
    the cost model which inputs XLA may update in place (a donated KV cache costs only its
    update). ``rejected`` forces clusters (by id) to XLA with the given reason: a kernel that
    failed to build on an earlier attempt. ``graph`` re-uses an earlier trace of the same
    signature.
    """
    t0 = time.perf_counter()
    if graph is None:   # traced here: XLA's convs next to kernels take another trace, channels-last
        layout: frozenset[int] = frozenset()
        for _ in range(4):   # each pass can put another conv next to a kernel; a few suffice
            g = trace_with(fn, args, kwargs, channels_last=layout)
            a = analyze(fn, args, kwargs, cost_model=cost_model, objective=objective, gpu=gpu,
                        donate_argnums=donate_argnums, rejected=rejected, graph=g,
                        donate_argnames=donate_argnames)
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
    donated = donated_inputs(graph, args, kwargs, donate_argnums, donate_argnames)
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


def positions(argnums: Sequence[int], n: int) -> set[int]:
    """The argument positions ``argnums`` name in a call with ``n`` positional arguments, as
    jax.jit reads them (``FlatTree.flatten_static_argnums``): a negative number counts from the
    end, one past the end names nothing (that argument was passed by keyword, or left to its
    default)."""
    return {i % n if i < 0 else i for i in argnums if n and i < n}


def donated_inputs(graph: Graph, args: Sequence[Any], kwargs: dict[str, Any],
                   donate_argnums: Sequence[int], donate_argnames: Sequence[str] = ()) -> frozenset[int]:
    """Graph input tensor ids of the leaves of the donated arguments: positions in ``args`` and
    keys of ``kwargs`` (the graph's inputs are the leaves of ``(args, kwargs)``, keys sorted)."""
    if not donate_argnums and not donate_argnames:
        return frozenset()
    leaves = [len(jax.tree_util.tree_leaves(a)) for a in args]
    keys = sorted(kwargs)
    leaves += [len(jax.tree_util.tree_leaves(kwargs[k])) for k in keys]
    starts = [sum(leaves[:i]) for i in range(len(leaves))]
    slots = positions(donate_argnums, len(args))
    slots |= {len(args) + keys.index(k) for k in donate_argnames if k in kwargs}
    return frozenset(graph.inputs[starts[i] + j] for i in slots for j in range(leaves[i]))


def _split_static(fn: Callable[..., Any], args: tuple, kwargs: dict, static_argnums: Sequence[int],
                  static_argnames: Sequence[str]) -> tuple[Callable[..., Any], tuple, dict]:
    """Close over static arguments the way jax.jit treats them: as compile-time Python values."""
    nums = positions(static_argnums, len(args))
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


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):   # some builtins have none: jax.jit then infers nothing either
        return None


def resolve_argnums(fn: Callable[..., Any], nums: int | Sequence[int] | None,
                    names: str | Sequence[str] | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``jax.jit``'s rule for ``*_argnums`` / ``*_argnames``: given only one of the two, the other
    is read off ``fn``'s signature (its positional-or-keyword parameters), so an argument marked
    static or donated by name is so when passed by position too, and the reverse."""
    nums_t = () if nums is None else (nums,) if isinstance(nums, int) else tuple(nums)
    names_t = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    sig = _signature(fn)
    if sig is None or (nums_t and names_t) or not (nums_t or names_t):
        return nums_t, names_t
    params = [(i, k) for i, (k, p) in enumerate(sig.parameters.items())
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if nums_t:
        return nums_t, tuple(k for i, k in params if i in nums_t)
    return tuple(i for i, k in params if k in names_t), names_t


def _dynamic_donation(args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str],
                      donate_argnums: Sequence[int], donate_argnames: Sequence[str]) -> tuple[tuple[int, ...],
                                                                                             tuple[str, ...]]:
    """The donated arguments as positions in the *dynamic* args and keys of the dynamic kwargs
    (what ``_split_static`` leaves: static arguments removed, later positions shifted down)."""
    n = len(args)
    static = positions(static_argnums, n)
    dyn_pos = [i for i in range(n) if i not in static]
    donated = positions(donate_argnums, n)
    nums = tuple(dyn_pos.index(i) for i in sorted(donated) if i in dyn_pos)
    names = tuple(k for k in donate_argnames if k in kwargs and k not in static_argnames)
    return nums, names


def explain(fn: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
            objective: str = "latency", gpu: str | None = None, cost_model: Any = None,
            donate_argnames: str | Sequence[str] = ()) -> Any:
    """``explain(fn)(*args, **kwargs) -> Report``: what VTC would do to ``fn``, without running it.

    Arguments may be arrays or ``jax.ShapeDtypeStruct`` (paper-size models analyse without
    allocating). Usable as ``explain(fn)`` or ``explain(objective="memory")(fn)``.
    """
    if fn is None:
        return functools.partial(explain, static_argnums=static_argnums, static_argnames=static_argnames,
                                 donate_argnums=donate_argnums, objective=objective, gpu=gpu,
                                 cost_model=cost_model, donate_argnames=donate_argnames)
    if not callable(fn):
        raise TypeError(f"explain requires a callable, got {fn!r} of type {type(fn).__name__}")
    nums, names = resolve_argnums(fn, static_argnums, static_argnames)
    dnums, dnames = resolve_argnums(fn, donate_argnums, donate_argnames)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Report:
        f, a, k = _split_static(fn, args, kwargs, nums, names)
        dyn_nums, dyn_names = _dynamic_donation(args, kwargs, nums, names, dnums, dnames)
        try:
            analysis = analyze(f, a, k, cost_model=cost_model, objective=objective, gpu=gpu,
                               donate_argnums=dyn_nums, donate_argnames=dyn_names)
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
                 profile: bool, strict: bool, gpu: str | None, donate_argnames: Sequence[str] = ()) -> None:
        self.fn = fn
        self._static = resolve_argnums(fn, static_argnums or None, static_argnames or None)
        self._donate = resolve_argnums(fn, donate_argnums or None, donate_argnames or None)
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

        def impl(*args: Any, **kwargs: Any) -> Any:
            return self._impl(*args, **kwargs)

        sig = _signature(fn)   # jax.jit validates names and numbers against fn's own signature
        if sig is not None:
            impl.__signature__ = sig  # type: ignore[attr-defined]
        impl.__name__ = getattr(fn, "__name__", "fn")
        impl.__qualname__ = getattr(fn, "__qualname__", impl.__name__)
        self._jitted = jax.jit(impl, static_argnums=self._static[0], static_argnames=self._static[1],
                               donate_argnums=self._donate[0], donate_argnames=self._donate[1])

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
        donate = _dynamic_donation(args, kwargs, *self._static, *self._donate)
        if self.profile and jax.default_backend() != "gpu":
            self._fallback("profile=True needs a GPU to time candidates; using the analytical cost model")
        flat = jax.tree_util.tree_leaves((a, k))
        try:
            analysis, lowered, closed = self._plan_and_build(f, a, k, flat, donate)
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

    def _plan_and_build(self, f: Callable[..., Any], a: tuple, k: dict, flat: list,
                        donate: tuple[tuple[int, ...], tuple[str, ...]]) -> tuple[Any, Any, Any]:
        """Analyse, lower and trace the emitted program (``program.build``: per-cluster fallback,
        control-flow bodies optimised recursively)."""
        from .program import BuildOptions, build
        abstract_a, abstract_k = jax.tree_util.tree_map(_abstract, (a, k))
        self._rejected = {}
        self._build = BuildOptions(self.backend, self.strict, self._opts, self._fallback, VTCError)
        return build(f, abstract_a, abstract_k, flat, donate=donate[0], donate_names=donate[1], opts=self._build,
                     rejected=self._rejected)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """A method decorated with ``optimize`` binds ``self`` as its first argument, as a
        ``jax.jit``-decorated one does (``@partial(optimize, static_argnums=0)`` on a method)."""
        return self if obj is None else types.MethodType(self, obj)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.eval_shape(*args, **kwargs)

    def explain(self, *args: Any, **kwargs: Any) -> Report:
        return explain(self.fn, static_argnums=self._static[0], static_argnames=self._static[1],
                       donate_argnums=self._donate[0], donate_argnames=self._donate[1],
                       **self._opts)(*args, **kwargs)


def optimize(fn: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = (),
             static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
             backend: str = "auto", objective: str = "latency", cost_model: Any = None,
             profile: bool = False, strict: bool = False, gpu: str | None = None,
             donate_argnames: str | Sequence[str] = ()) -> Any:
    """Compile ``fn`` with VTC: like ``jax.jit(fn)``, with data movement turned into index maps.

    Use as ``@optimize`` or ``@optimize(donate_argnums=2, ...)``. Static and donated arguments
    follow ``jax.jit``: by number or by name, the other read off ``fn``'s signature. ``backend``: "auto" (Triton on a
    GPU, the Pallas interpreter elsewhere), "triton" (lower for CUDA even on a CPU machine, e.g. to
    export) or "interpret". ``strict=True`` raises where VTC would fall back to plain XLA.
    """
    opts = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                backend=backend, objective=objective, cost_model=cost_model, profile=profile, strict=strict,
                gpu=gpu, donate_argnames=donate_argnames)
    if fn is None:
        return functools.partial(optimize, **opts)
    if not callable(fn):
        raise TypeError(f"optimize requires a callable, got {fn!r} of type {type(fn).__name__}")
    as_tuple = lambda x, t: (x,) if isinstance(x, t) else tuple(x)
    _resolve_backend(backend)
    _cost_model(cost_model, objective, gpu)
    return Optimized(fn, static_argnums=as_tuple(static_argnums, int), static_argnames=as_tuple(static_argnames, str),
                     donate_argnums=as_tuple(donate_argnums, int), donate_argnames=as_tuple(donate_argnames, str),
                     backend=backend, objective=objective,
                     cost_model=cost_model, profile=profile, strict=strict, gpu=gpu)
