"""User surface: ``optimize`` (a drop-in ``jax.jit`` that runs the VTC pipeline) and ``explain``
(the analysis only, as a :class:`~vtc_jax.report.Report`).

Nothing here decides anything about the program: the analysis is :mod:`vtc_jax.analysis`, the
build with its per-cluster fallback :mod:`vtc_jax.program`, the messages :mod:`vtc_jax.report`.
This module follows ``jax.jit``'s conventions for arguments (static and donated, by number or
name, pytrees, keywords, methods) and turns fallbacks into warnings, or errors in strict mode.
"""
from __future__ import annotations

import functools
import inspect
import operator
import os
import types
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .analysis import analyze, cost_model_for, positions
from .autodiff import with_original_derivatives
from .compat import abstract, outside_traces, warn, weak_typed
from .guard import GUARDS, PLAIN, UNDONE
from .program import NO_KERNEL, BuildOptions, build, per_shard_only
from .report import Report, build_report, fallback_messages
from . import plancache
from .spmd import Refused, per_shard


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
            donate_argnames: str | Sequence[str] = (), guard: str | None = None) -> Any:
    """``explain(fn)(*args, **kwargs) -> Report``: what VTC would do to ``fn``, without running it.

    Arguments may be arrays or ``jax.ShapeDtypeStruct`` (paper-size models analyse without
    allocating). Usable as ``explain(fn)`` or ``explain(objective="memory")(fn)``. With ``guard``
    ("model", "compile"), the program is also built (kernels traced, not run) and priced against
    plain jit as ``optimize`` does: the report lists what the guard undid and why
    (``Optimized.explain`` passes the guard ``optimize`` was given).
    """
    if fn is None:
        return functools.partial(explain, static_argnums=static_argnums, static_argnames=static_argnames,
                                 donate_argnums=donate_argnums, objective=objective, gpu=gpu,
                                 cost_model=cost_model, donate_argnames=donate_argnames, guard=guard)
    _check_guard(guard)
    if not callable(fn):
        raise TypeError(f"explain requires a callable, got {fn!r} of type {type(fn).__name__}")
    nums, names = resolve_argnums(fn, static_argnums, static_argnames)
    dnums, dnames = resolve_argnums(fn, donate_argnums, donate_argnames)

    def stub(*args: Any, **kwargs: Any) -> None:   # jax.jit's checks of the arguments, nothing traced
        return None
    sig = _signature(fn)
    if sig is not None:
        stub.__signature__ = sig  # type: ignore[attr-defined]
    checked = jax.jit(stub, static_argnums=nums, static_argnames=names, donate_argnums=dnums,
                      donate_argnames=dnames)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Report:
        checked.trace(*args, **kwargs)   # bad static / donated arguments: jax.jit's own error
        f, a, k = _split_static(fn, args, kwargs, nums, names)
        dyn_nums, dyn_names = _dynamic_donation(args, kwargs, nums, names, dnums, dnames)
        try:
            if guard is None:
                analysis = analyze(f, a, k, cost_model=cost_model, objective=objective, gpu=gpu,
                                   donate_argnums=dyn_nums, donate_argnames=dyn_names)
            else:   # built and guarded as optimize would (Triton kernels on a GPU: a timing guard times them)
                abstract_a, abstract_k = jax.tree_util.tree_map(_abstract, (a, k))
                backend = "triton" if jax.default_backend() == "gpu" else "interpret"
                opts = BuildOptions(backend, False, dict(objective=objective, cost_model=cost_model, gpu=gpu),
                                    lambda msg: None, VTCError, guard=guard)
                analysis, _, _ = build(f, abstract_a, abstract_k, jax.tree_util.tree_leaves((abstract_a, abstract_k)),
                                       donate=dyn_nums, donate_names=dyn_names, opts=opts, rejected={})
            return build_report(getattr(fn, "__name__", repr(fn)), analysis)
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


# --------------------------------------------------------------------------------------------
# optimize
# --------------------------------------------------------------------------------------------

def _check_guard(guard: Any) -> None:
    if guard not in GUARDS:
        raise ValueError(f"guard must be one of {GUARDS}, got {guard!r}")


class VTCNotice(UserWarning):
    """Information, not a fallback (no GPU here: the kernels run in the Pallas interpreter). Not a
    :class:`VTCFallbackWarning`, so turning fallbacks into errors does not trip on it."""


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
    """An argument as the analysis traces it: shape, dtype, weak type and, inside ``shard_map``,
    the axes it varies over (``compat.abstract``)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return abstract(x)
    return x


class Optimized:
    """What ``optimize`` returns: called like ``jax.jit(fn)``; ``.lower``, ``.trace``, ``.explain``.

    The analysis runs when jax traces the function, so it runs once per input signature (jax.jit's
    own cache), inside another ``jax.jit`` too, and under ``jax.export``.
    """

    def __init__(self, fn: Callable[..., Any], *, static_argnums: Sequence[int], static_argnames: Sequence[str],
                 donate_argnums: Sequence[int], backend: str, objective: str, cost_model: Any,
                 strict: bool, gpu: str | None, donate_argnames: Sequence[str] = (),
                 guard: str | None = "model", plan_cache: str | os.PathLike | None = None) -> None:
        self.fn = fn
        self._static = resolve_argnums(fn, static_argnums or None, static_argnames or None)
        self._donate = resolve_argnums(fn, donate_argnums or None, donate_argnames or None)
        self._opts = dict(objective=objective, cost_model=cost_model, gpu=gpu)
        self.backend = _resolve_backend(backend)
        self.strict = strict
        self.guard = guard
        # opt-in persistent plans (plancache); a custom cost model is an object no key can name
        self.plan_cache = (plan_cache if plan_cache is not None else os.environ.get(plancache.ENV)) \
            if cost_model is None else None
        self._said: set[str] = set()
        self.last: Any = None   # (Analysis, Lowered) of the latest trace, for inspection
        self._rejected: dict[frozenset[int], str] = {}   # clusters (by ops) whose kernel failed to build (latest trace)
        if backend == "auto" and self.backend == "interpret":
            self._warn("no GPU: Pallas kernels run in interpret mode (correct, slow); "
                       "use backend='triton' to lower them for CUDA", VTCNotice)
        if guard == "measure" and jax.default_backend() != "gpu":
            self._warn("guard='measure' needs a GPU to time on; the guard compiles both programs for the "
                       "target with XLA instead (guard='compile')", VTCNotice)
        # name, doc and ``__wrapped__`` as jax.jit gives them; not ``fn.__dict__``, which would
        # overwrite this object's own attributes (equinox's ``filter_jit`` keeps its name in ``.fn``)
        functools.update_wrapper(self, fn, updated=())

        def impl(*args: Any, **kwargs: Any) -> Any:
            return self._impl(*args, **kwargs)

        sig = _signature(fn)   # jax.jit validates names and numbers against fn's own signature
        if sig is not None:
            impl.__signature__ = sig  # type: ignore[attr-defined]
        impl.__name__ = getattr(fn, "__name__", "fn")
        impl.__qualname__ = getattr(fn, "__qualname__", impl.__name__)
        self._jitted = jax.jit(impl, static_argnums=self._static[0], static_argnames=self._static[1],
                               donate_argnums=self._donate[0], donate_argnames=self._donate[1])
        # sharded inputs: jax.jit's own program (see _sharded_over); made on first need
        self._plain_jit: Any = None
        self._routes: dict[Any, Any] = {}       # sharded call signature -> the jitted function it runs
        self._one_device: bool | None = None    # whether this process sees one device (first call)

    def _warn(self, msg: str, category: type[Warning] | None = None) -> None:
        """Say ``msg`` once, located at the user's call (``compat.warn``)."""
        if msg not in self._said:
            self._said.add(msg)
            warn(f"vtc_jax: {msg}", category or VTCFallbackWarning)

    def _fallback(self, msg: str, exc: BaseException | None = None) -> None:
        if self.strict:
            raise VTCError(msg) from exc
        self._warn(msg)

    def _impl(self, *args: Any, **kwargs: Any) -> Any:
        f, a, k = _split_static(self.fn, args, kwargs, *self._static)
        donate = _dynamic_donation(args, kwargs, *self._static, *self._donate)
        flat = jax.tree_util.tree_leaves((a, k))
        symbolic = _symbolic_shape(flat)
        if symbolic is not None:   # jax.export shape polymorphism: nothing to plan tiles for
            self._fallback(f"{getattr(self.fn, '__name__', 'fn')} is traced with symbolic dimensions "
                           f"({symbolic}, jax.export's shape polymorphism): vtc_jax plans kernels and "
                           "index maps for concrete shapes; running it as plain XLA")
            return f(*a, **k)
        key, hit = self._cached(f, a, k, flat, donate) if self.plan_cache else (None, None)
        if hit is not None:
            return hit()
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
        emitted = (lambda *xs: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs))  # noqa: E731
        if analysis.guard and analysis.guard[-1].startswith(PLAIN):   # the guard's last word: jax.jit's own program
            # where nothing was ever a kernel, why is still worth a warning (as without the guard)
            messages = fallback_messages(analysis, self._failed(analysis), self._build.bodies) \
                if analysis.guard[-1].endswith(NO_KERNEL) else []
            for msg in messages:
                self._fallback(msg)
            self._keep(key, None, flat, messages)
            return f(*a, **k)
        messages = [*fallback_messages(analysis, self._failed(analysis), self._build.bodies), *lowered.fallbacks]
        for msg in messages:
            self._fallback(msg)
        self._keep(key, emitted, flat, messages)
        # derivatives: fn's own, as plain XLA
        program = with_original_derivatives(emitted, f, analysis.graph.in_tree)
        return analysis.graph.unflatten_outputs(_weak_as(program(*flat), analysis.graph.weak_outputs))

    def _cached(self, f: Callable[..., Any], a: tuple, k: dict, flat: list,
                donate: tuple[tuple[int, ...], tuple[str, ...]]) -> tuple[str, Callable[[], Any] | None]:
        """With a plan cache: ``(key, the call answered from it)``, the call None on a miss (the
        key is then the one :meth:`_keep` writes under). Keyed by ``fn``'s jaxpr at these avals
        (``plancache.key``)."""
        in_tree = jax.tree_util.tree_structure((a, k))
        closed, out_tree = _flat_jaxpr(f, in_tree, flat)
        options = dict(backend=self.backend, strict=self.strict, guard=self.guard,
                       objective=self._opts["objective"], gpu=self._opts["gpu"])
        key = plancache.key(closed, options, donate)
        entry = plancache.load(self.plan_cache, key)
        if entry is None:
            return key, None
        self.last = None   # no analysis in this process: explain() gives it
        for msg in entry.messages:
            self._fallback(msg)
        if entry.program is None:   # the guard chose plain jax.jit when the plan was made
            return key, lambda: f(*a, **k)
        program = with_original_derivatives(entry.program.call, f, in_tree)
        weak = [bool(getattr(v.aval, "weak_type", False)) for v in closed.jaxpr.outvars]
        return key, lambda: jax.tree_util.tree_unflatten(out_tree, _weak_as(program(*flat), weak))

    def _failed(self, analysis: Any) -> frozenset[int]:
        """The ids, in ``analysis``, of the clusters whose kernels failed to build (not the ones
        the guard undid)."""
        failed = {ops for ops, why in self._rejected.items() if not why.startswith(UNDONE)}
        return frozenset(c.id for c in analysis.clusters if frozenset(c.ops) in failed)

    def _keep(self, key: str | None, emitted: Callable[..., Any] | None, flat: list, messages: Sequence[str]) -> None:
        """Write the plan just made to the plan cache under ``key`` (None: no cache)."""
        if key is not None:
            plancache.store(self.plan_cache, key, emitted, [_abstract(x) for x in flat], messages)

    def _plan_and_build(self, f: Callable[..., Any], a: tuple, k: dict, flat: list,
                        donate: tuple[tuple[int, ...], tuple[str, ...]]) -> tuple[Any, Any, Any]:
        """Analyse, lower and trace the emitted program (``program.build``: per-cluster fallback,
        control-flow bodies optimised recursively)."""
        abstract_a, abstract_k = jax.tree_util.tree_map(_abstract, (a, k))
        self._rejected = {}
        self._build = BuildOptions(self.backend, self.strict, self._opts, self._fallback, VTCError, guard=self.guard)
        return build(f, abstract_a, abstract_k, flat, donate=donate[0], donate_names=donate[1], opts=self._build,
                     rejected=self._rejected)

    def _for(self, args: tuple, kwargs: dict) -> Any:
        """The jitted function to run on these arguments. Inputs on one device (or replicated):
        VTC's. Inputs sharded over several devices (:func:`_sharded_over`, also ShapeDtypeStructs
        placed on a deviceless topology): the program rewritten to run per shard
        (:meth:`_rewritten`); where the rewrite is refused, VTC's own where its kernels all sit in
        ``shard_map`` bodies; else ``jax.jit(fn)`` itself with the reason (a kernel outside a
        shard_map would have its operands gathered by XLA's partitioner). Decided once per call
        signature."""
        if _on_one_device(jax.tree_util.tree_leaves((args, kwargs))):
            return self._jitted   # the common call, kept as cheap as jax.jit's own dispatch
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        n = _sharded_over(leaves)
        if not n:
            return self._jitted
        key = _call_key(tree, leaves)
        route = self._routes.get(key) if key is not None else None
        if route is None:
            route = self._route(args, kwargs, n)
            if key is not None:
                self._routes[key] = route
        return route

    def _route(self, args: tuple, kwargs: dict, n: int) -> Any:
        rewritten = self._rewritten(args, kwargs)
        if not isinstance(rewritten, str):
            return rewritten
        # VTC's own program is per shard where its only kernels sit in shard_map bodies
        if per_shard_only(self._jitted.trace(*args, **kwargs).jaxpr.jaxpr):
            return self._jitted
        self._warn(f"{getattr(self.fn, '__name__', 'fn')} is given inputs sharded over {n} devices and cannot "
                   f"run per shard ({rewritten}): vtc_jax's kernels do not partition with jax's SPMD partitioner "
                   "(XLA would gather their operands onto every device), so it runs as plain jax.jit, "
                   "shardings kept", VTCNotice)
        if self._plain_jit is None:
            self._plain_jit = jax.jit(self.fn, static_argnums=self._static[0], static_argnames=self._static[1],
                                      donate_argnums=self._donate[0], donate_argnames=self._donate[1])
        return self._plain_jit

    def _rewritten(self, args: tuple, kwargs: dict) -> Any:
        """``fn`` on sharded inputs, rewritten to run per shard (``spmd.per_shard``: one shard_map
        over the inputs' mesh, the partitioner's all-reduces inserted) and optimised as such: its
        kernels then sit in the shard_map body and see their shards. The jitted program, or the
        reason it cannot be (a string). Derivatives stay ``fn``'s own (``autodiff``), partitioned
        by XLA as under ``jax.jit``."""
        f, a, k = _split_static(self.fn, args, kwargs, *self._static)
        flat, in_tree = jax.tree_util.tree_flatten((a, k))
        shardings = [_sharding_of(x) for x in flat]
        closed, out_tree = _flat_jaxpr(f, in_tree, flat)   # fn's own errors are jax.jit's
        try:
            plan = per_shard(closed, shardings)
        except Refused as why:
            return str(why)
        except Exception as exc:  # noqa: BLE001 - never an internal error to the user: plain jit, said why
            return f"the per-shard rewrite failed: {type(exc).__name__}: {exc}"
        static = self._static

        @functools.wraps(self.fn)
        def program(*args: Any, **kwargs: Any) -> Any:
            f, a, k = _split_static(self.fn, args, kwargs, *static)
            xs, tree = jax.tree_util.tree_flatten((a, k))
            run = with_original_derivatives(plan, f, tree)
            return jax.tree_util.tree_unflatten(out_tree, run(*xs))

        inner = Optimized(program, static_argnums=self._static[0], static_argnames=self._static[1],
                          donate_argnums=self._donate[0], donate_argnames=self._donate[1], backend=self.backend,
                          strict=self.strict, guard=self.guard, plan_cache="", **self._opts)
        inner._said = self._said   # one voice: a notice said by either is said once
        return inner._jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._one_device is None:
            self._one_device = _one_device_only()
        if self._one_device and outside_traces():   # concrete values on the only device: nothing
            return self._jitted(*args, **kwargs)     # is sharded, and dispatch costs what jax.jit's does
        return self._for(args, kwargs)(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """A method decorated with ``optimize`` binds ``self`` as its first argument, as a
        ``jax.jit``-decorated one does (``@partial(optimize, static_argnums=0)`` on a method)."""
        return self if obj is None else types.MethodType(self, obj)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._for(args, kwargs).lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._for(args, kwargs).trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forget every traced signature, as ``jax.jit``'s ``clear_cache`` does: the next call
        traces ``fn`` and plans again (the persistent ``plan_cache`` directory is kept)."""
        self._jitted.clear_cache()
        if self._plain_jit is not None:
            self._plain_jit.clear_cache()
        self._routes.clear()
        self.last = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "Optimized":
        """The function itself, as for ``jax.jit``'s: what it holds (plans, the latest analysis)
        describes ``fn`` and is not copied (an object holding ``optimize(step)`` deep-copies)."""
        return self

    def explain(self, *args: Any, **kwargs: Any) -> Report:
        return explain(self.fn, static_argnums=self._static[0], static_argnames=self._static[1],
                       donate_argnums=self._donate[0], donate_argnames=self._donate[1], guard=self.guard,
                       **self._opts)(*args, **kwargs)


def _weak_as(outs: Sequence[Any], weak: Sequence[bool]) -> list[Any]:
    """The emitted program's flat results with ``fn``'s weak types back (``compat.weak_typed``):
    jax.jit returns a result of Python scalars weakly typed, and the promotion that reads it
    later (``bf16_array * lr``) must not change; a kernel's or a re-bound op's result is strong."""
    return [weak_typed(o) if i < len(weak) and weak[i] else o for i, o in enumerate(outs)]


def _flat_jaxpr(f: Callable[..., Any], in_tree: Any, flat: Sequence[Any]) -> tuple[Any, Any]:
    """``f``'s jaxpr over the flat leaves of ``(args, kwargs)`` (at their avals, untyped), and the
    tree of its outputs: what the plan cache keys and the per-shard rewrite reads."""
    trees: list[Any] = []

    def flat_f(*xs: Any) -> list[Any]:
        ar, kw = jax.tree_util.tree_unflatten(in_tree, xs)
        out, tree = jax.tree_util.tree_flatten(f(*ar, **kw))
        trees.append(tree)
        return out

    closed = jax.make_jaxpr(flat_f)(*map(_abstract, flat))
    return closed, trees[0]


def _one_device_only() -> bool:
    """Whether this process (all hosts) sees one device on its default backend and on the CPU:
    then no concrete array can be sharded. Asked at the first call, not at decoration (as
    ``jax.jit``, ``optimize`` starts no backend when a module is imported)."""
    try:
        return jax.device_count() == 1 and jax.device_count("cpu") == 1
    except RuntimeError:   # no CPU backend: the default one alone
        return jax.device_count() == 1


def _on_one_device(leaves: Sequence[Any]) -> bool:
    """Whether every array among ``leaves`` is a concrete array on a single device (then nothing is
    sharded, and :func:`_sharded_over` need not look). Why a separate test: it runs on every call
    of a multi-device process, where a loop of small programs is bound by the host's dispatch, and
    :func:`_sharded_over`'s reading of each sharding cost about 4 µs a call with 13 arguments
    (this project's CPU; 2.5 µs this way). Tracers and ShapeDtypeStructs take the full test."""
    single = jax.sharding.SingleDeviceSharding
    for x in leaves:
        sharding = getattr(x, "sharding", None)   # a tracer has none (AttributeError)
        if type(sharding) is single:
            continue
        if sharding is None and not isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
            continue   # a number, a numpy array, None: never sharded
        return False
    return True


def _sharded_over(leaves: Sequence[Any]) -> int:
    """The most devices an input (an array or a ShapeDtypeStruct with a sharding) is split over;
    0 where none is (single-device or replicated everywhere). Why it matters: a Pallas call is a
    custom call XLA's partitioner cannot look into, so it gathers the call's operands onto every
    device (8 host devices: jit's output sharded ``P(None, 'x')`` with no collective, VTC's
    replicated with three all-reduces)."""
    most = 0
    for leaf in leaves:
        sharding = _sharding_of(leaf)
        if sharding is None or getattr(sharding, "is_fully_replicated", True):
            continue
        mesh = getattr(sharding, "mesh", None)
        n = len(getattr(sharding, "device_set", ())) if mesh is None else int(np.prod(mesh.axis_sizes))
        most = max(most, n)
    return most if most > 1 else 0


def _sharding_of(x: Any) -> Any:
    """An input's sharding: an array's or ShapeDtypeStruct's own; inside the user's own
    ``jax.jit`` (a tracer), the sharding its type carries where the mesh has Explicit axes
    (sharding in types, ``jax.make_mesh``'s default); else None (Auto axes: the partitioner decides
    later, nothing to read while tracing)."""
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        explicit = any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))
        return sharding if explicit and any(e is not None for e in sharding.spec) else None
    return getattr(x, "sharding", None)


def _call_key(tree: Any, leaves: Sequence[Any]) -> Any:
    """A hashable signature of a call (tree, shapes, dtypes, shardings, other leaves' values), or
    None where a leaf cannot be hashed."""
    key = [tree]
    for x in leaves:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            key.append((tuple(x.shape), str(x.dtype), _sharding_of(x)))
        else:
            key.append((type(x), x))
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


def _symbolic_shape(flat: Sequence[Any]) -> str | None:
    """The first argument shape with a symbolic dimension, as text (None when all are constant)."""
    def constant(d: Any) -> bool:
        try:
            operator.index(d)   # ints, numpy ints; a jax.export dimension expression has no index
            return True
        except TypeError:
            return False

    for x in flat:
        shape = getattr(x, "shape", ())
        if not all(constant(d) for d in shape):
            return "(" + ", ".join(str(d) for d in shape) + ")"
    return None


def optimize(fn: Callable[..., Any] | None = None, *, static_argnums: int | Sequence[int] = (),
             static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
             backend: str = "auto", objective: str = "latency", cost_model: Any = None,
             strict: bool = False, gpu: str | None = None,
             donate_argnames: str | Sequence[str] = (), guard: str | None = "model",
             plan_cache: str | os.PathLike | None = None) -> Any:
    """Compile ``fn`` with VTC: like ``jax.jit(fn)``, with data movement turned into index maps.

    Use as ``@optimize`` or ``@optimize(donate_argnums=2, ...)``. Static and donated arguments
    follow ``jax.jit``: by number or by name, the other read off ``fn``'s signature. ``backend``: "auto" (Triton on a
    GPU, the Pallas interpreter elsewhere), "triton" (lower for CUDA even on a CPU machine, e.g. to
    export) or "interpret". ``strict=True`` raises where VTC would fall back to plain XLA.

    ``guard`` decides whether the plan is kept (never slower than ``jax.jit``): the emitted program
    is priced against plain jit — ``"model"`` (default) by the model of XLA (``xla.xla_program``:
    milliseconds per trace) where it shows a clear win, else by timing both on this GPU (when its
    free memory holds three times the inputs) or by XLA's compile for the target, ``"compile"`` by compiling both with XLA for the target (deviceless
    for an H100 without a GPU: seconds per trace), ``"measure"`` by timing both on the GPU (the
    compile where there is none), ``None`` not at all. Kernels that lose are undone cluster by
    cluster; if the program still loses, it runs as plain ``jax.jit(fn)``. ``explain()`` says what
    the guard did. A guard's undo is a choice, not a fallback: no warning.

    ``plan_cache``: a directory (default: the ``VTC_JAX_PLAN_CACHE`` environment variable; None:
    off) keeping each emitted program across processes (:mod:`vtc_jax.plancache`): a later
    process's first call traces ``fn``, loads the plan and skips the analysis, the guard and the
    kernel builds. Pair it with jax's ``jax_compilation_cache_dir`` to skip XLA's compile too.
    """
    opts = dict(static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                backend=backend, objective=objective, cost_model=cost_model, strict=strict,
                gpu=gpu, donate_argnames=donate_argnames, guard=guard, plan_cache=plan_cache)
    if fn is None:
        return functools.partial(optimize, **opts)
    if isinstance(fn, staticmethod):   # (callable since Python 3.10; jax.jit's own error)
        raise TypeError("staticmethod arguments are not supported")
    if not callable(fn):
        raise TypeError(f"optimize requires a callable, got {fn!r} of type {type(fn).__name__}")
    # (None: jax.jit's default for each of the four, as wrappers forward it)
    as_tuple = lambda x, t: () if x is None else (x,) if isinstance(x, t) else tuple(x)
    _resolve_backend(backend)
    _check_guard(guard)
    cost_model_for(cost_model, objective, gpu)
    return Optimized(fn, static_argnums=as_tuple(static_argnums, int), static_argnames=as_tuple(static_argnames, str),
                     donate_argnums=as_tuple(donate_argnums, int), donate_argnames=as_tuple(donate_argnames, str),
                     backend=backend, objective=objective,
                     cost_model=cost_model, strict=strict, gpu=gpu, guard=guard, plan_cache=plan_cache)
