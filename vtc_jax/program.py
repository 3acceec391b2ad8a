"""Building the optimised program for one input signature, and for the bodies of control flow.

``build`` is the loop behind ``optimize``: analyse, lower, trace the emitted program; a cluster
whose kernel fails to build (or, for ``backend="triton"``, to lower for CUDA) is rejected and the
program re-planned without it — the per-cluster fallback. ``optimize_body`` applies the same to
the body of a ``scan``/``while``/``cond`` (recursive VTC): the body is a function of its own,
its carries, consts and stacked slices physical at the boundary, and the control-flow op is
re-bound with the optimised body. A body that cannot be optimised keeps its original jaxpr.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

from .graph import CONTROL_FLOW_PRIMITIVES, Op

__all__ = ["BuildOptions", "build", "optimize_body", "MAX_BUILD_ATTEMPTS"]

MAX_BUILD_ATTEMPTS = 6   # re-plans after kernel build failures before giving up on the whole rewrite


@dataclass
class BuildOptions:
    backend: str
    strict: bool
    analysis: dict[str, Any]                         # objective, cost_model, gpu
    warn: Callable[[str], None]
    error: type[Exception]                           # VTCError (raised in strict mode)
    bodies: list[str] = field(default_factory=list)  # control-flow bodies optimised (for reports)


def build(f: Callable[..., Any], abstract_a: tuple, abstract_k: dict, flat: Sequence[Any], *,
          donate: Sequence[int], opts: BuildOptions, rejected: dict[int, str]) -> tuple[Any, Any, Any]:
    """``(analysis, lowered, closed_jaxpr)`` of ``f`` traced on ``flat`` (arrays, tracers or
    ShapeDtypeStructs). ``rejected`` collects the clusters whose kernels failed to build."""
    from . import lower as lower_mod
    from .api import analyze
    from .templates import KernelBuildError
    graph = None
    for _ in range(MAX_BUILD_ATTEMPTS):
        analysis = analyze(f, abstract_a, abstract_k, donate_argnums=donate, rejected=rejected, graph=graph,
                           **opts.analysis)
        graph = analysis.graph
        lowered = lower_mod.lower(graph, analysis.clusters, analysis.matches, analysis.strategy,
                                  backend=opts.backend, rewrite=lambda op: optimize_body(op, opts))
        try:
            closed = jax.make_jaxpr(lowered.fn)(*flat)
        except KernelBuildError as e:
            if opts.strict:
                raise opts.error(f"{e}") from e.cause
            rejected[e.cluster] = f"its kernel failed to build ({type(e.cause).__name__}: " \
                                  f"{str(e.cause).splitlines()[0] if str(e.cause) else ''})"
            continue
        if opts.backend == "triton":
            bad = lower_mod.triton_failures(closed)
            if bad:
                if opts.strict:
                    raise opts.error(f"kernels failed to lower for CUDA: {bad}")
                rejected.update({c: f"its kernel failed to lower for CUDA ({why})" for c, why in bad.items()})
                continue
        return analysis, lowered, closed
    raise RuntimeError(f"kernels kept failing to build after {MAX_BUILD_ATTEMPTS} attempts: {rejected}")


def _optimize_closed(closed: Any, opts: BuildOptions) -> Any | None:
    """An optimised copy of a ClosedJaxpr with the same signature (None: nothing to gain)."""
    avals = closed.in_avals
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals]

    def fn(*xs: Any) -> Any:
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *xs)

    _, lowered, new = build(fn, tuple(sds), {}, sds, donate=(), opts=opts, rejected={})
    if not lowered.kernels:
        return None
    if [(a.shape, a.dtype) for a in new.out_avals] != [(a.shape, a.dtype) for a in closed.out_avals]:
        raise TypeError("optimised body changed its output types")
    return new


def optimize_body(op: Op, opts: BuildOptions) -> dict[str, Any] | None:
    """New params for a control-flow op with its body (bodies) optimised, or None to keep it."""
    if op.primitive not in CONTROL_FLOW_PRIMITIVES:
        return None
    p = dict(op.params)
    try:
        if op.primitive == "scan":
            new = _optimize_closed(p["jaxpr"], opts)
            if new is None:
                return None
            p["jaxpr"] = new
        elif op.primitive == "while":
            new = _optimize_closed(p["body_jaxpr"], opts)
            if new is None:
                return None
            p["body_jaxpr"] = new
        else:  # cond: every branch on its own; the outputs stay physical, so they always agree
            branches = [_optimize_closed(b, opts) for b in p["branches"]]
            if all(b is None for b in branches):
                return None
            p["branches"] = tuple(b if b is not None else old for b, old in zip(branches, p["branches"]))
    except Exception as exc:  # noqa: BLE001 - the body stays as traced
        if opts.strict:
            raise opts.error(f"the body of {op.primitive} #{op.id} could not be optimised: {exc}") from exc
        opts.warn(f"the body of {op.primitive} #{op.id} runs as traced ({type(exc).__name__}: {exc})")
        return None
    opts.bodies.append(f"{op.primitive} #{op.id}")
    return p
