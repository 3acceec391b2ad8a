"""The analysis of one input signature: trace → select → rules → VTOG → strategy.

``analyze`` is what ``optimize`` (through ``program.build``) and ``explain`` run once per input
signature; no kernel is built here. Its result, :class:`Analysis`, is what lowering and the report
read. Stages, each with one owner: the trace (``graph``), the selection of kernels with a verdict
each (``selection.select``), the VTOG (``vtog``), the strategy (``strategy.plan``, priced by the
cost model). The channels-last re-trace (XLA runs NCHW convolutions next to a Pallas kernel in
NHWC: traced again, the layout copy becomes a transpose the strategy can remove) loops here.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax

from . import costmodel
from .cluster import Cluster
from .graph import Graph, trace_with
from .primitives import Kind, is_view
from .selection import Rejections, Selection, select
from .strategy import Strategy, plan
from .templates import Match, Reject
from .vtog import VTOG, build_vtog

__all__ = ["Analysis", "analyze", "cost_model_for", "donated_inputs", "positions", "xla_layout_convs"]

MAX_LAYOUT_PASSES = 4   # channels-last re-traces: each can put another conv next to a kernel; a few suffice


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
    xla_fused: frozenset[int] = frozenset()      # clusters left to XLA by choice (xla.xla_fuses), not a fallback
    guard: tuple[str, ...] = ()                  # what the guard decided (program.build): kept, undid, plain jit


def cost_model_for(cost_model: Any, objective: str, gpu: str | None) -> Any:
    """The cost model ``optimize``/``explain`` were given, or the analytical one for ``objective``
    and ``gpu`` (validated here: a bad value is the caller's error, raised before any tracing)."""
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
            donate_argnums: Sequence[int] = (), rejected: Rejections | None = None,
            graph: Graph | None = None, donate_argnames: Sequence[str] = ()) -> Analysis:
    """The analysis half of VTC for one input signature (no kernels are built here):
    trace → select (clusters with verdicts) → VTOG → strategy (``strategy.plan``).

    ``donate_argnums`` (positions in ``args``) and ``donate_argnames`` (keys of ``kwargs``) tell
    the cost model which inputs XLA may update in place (a donated KV cache costs only its
    update). ``rejected`` forces clusters (named by their ops, ``selection.Rejections``) to XLA
    with the given reason: a kernel that failed to build on an earlier attempt, or that the guard
    undid. ``graph`` re-uses an earlier trace of the same
    signature (and skips the channels-last re-trace).
    """
    t0 = time.perf_counter()
    model = cost_model_for(cost_model, objective, gpu)
    donate = dict(donate_argnums=donate_argnums, donate_argnames=donate_argnames)
    if graph is not None:
        return _analyze_graph(graph, args, kwargs, model, rejected, t0, **donate)
    layout: frozenset[int] = frozenset()
    written = None   # the first trace: the program as written
    for _ in range(MAX_LAYOUT_PASSES):
        g = trace_with(fn, args, kwargs, channels_last=layout)
        written = written or g
        a = _analyze_graph(g if not layout else dataclasses.replace(g, as_written=written), args, kwargs,
                           model, rejected, t0, **donate)
        more = xla_layout_convs(a)
        if not more:
            break
        layout |= more
    return dataclasses.replace(a, seconds=time.perf_counter() - t0)


def _analyze_graph(graph: Graph, args: Sequence[Any], kwargs: dict[str, Any], model: Any,
                   rejected: Rejections | None, t0: float, *, donate_argnums: Sequence[int],
                   donate_argnames: Sequence[str]) -> Analysis:
    """One pass of :func:`analyze` over a traced graph."""
    sel: Selection = select(graph, rejected, xla_fusion=getattr(model, "xla_fusion", False))
    vtog = build_vtog(graph, sel.clusters, matches=sel.verdicts)
    donated = donated_inputs(graph, args, kwargs, donate_argnums, donate_argnames)
    if hasattr(model, "bind"):
        savings = model.bind(vtog, graph, sel.clusters, donated=donated)
    else:  # a user cost model with only savings(edge, chosen, vtog, graph)
        savings = lambda e, chosen: model.savings(e, chosen, vtog, graph)  # noqa: E731
    strategy = plan(vtog, graph, sel.clusters, savings)
    return Analysis(graph, sel.clusters, dict(sel.verdicts), vtog, strategy, time.perf_counter() - t0, donated,
                    sel.declined, sel.xla_fused)


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
        if (c.kind != Kind.MOVEMENT and isinstance(a.matches.get(c.id), Match)
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
            while src is not None and src.id not in kernel_ops and is_view(src, a.graph):
                src = a.graph.producer(src.inputs[0])   # (a kernel's result reshaped: EfficientViT's heads)
            if (any(t in read_by_kernel for t in op.outputs) or op.inputs[0] in read_by_kernel
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


