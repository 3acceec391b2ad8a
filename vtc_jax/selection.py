"""Selection: which ops form a kernel, and which clusters become kernels — decided once, here.

One function, :func:`select`, runs the front of the pipeline for one traced graph and returns every
compute cluster with its verdict (:class:`~vtc_jax.templates.Match`, or
:class:`~vtc_jax.templates.Reject` with the reason). In order:

1. **cluster** (``cluster.cluster``): primitives grouped into kernel-shaped clusters;
2. **match** (``templates.match_all``): one verdict per compute cluster; clusters the caller
   ``rejected`` (a kernel that failed to build or to lower on an earlier attempt, or that the guard
   undid) get their reason. A rejection names the cluster by its ops (:data:`Rejections`), at every
   step below: re-clustering renumbers clusters, so an id from an earlier attempt may name another
   cluster (BERT's guard undid a pointwise island by id and the re-plan rejected one of its ops
   alone, leaving the rest a kernel, and brought back the kernels undone the step before);
3. **declined attention re-clustered**: an attention region no template takes is clustered again
   as its parts (matmuls, softmax reduction, pointwise), which other templates may take;
4. **islands**: pointwise clusters XLA would run as one loop fusion (``xla.pointwise_islands``) are
   merged into one cluster (``cluster.fuse_islands``) when one kernel can serve them; an island its
   template cannot plan stays its parts; an island making an attention's query (its rotary
   embedding, ``cluster.query_prologue_islands``) joins the attention cluster, whose kernel
   recomputes it on the query blocks it loads, unless the attention template then declines;
   island kernels cut out of one tensor with no path between them (a decode step's q and k
   rotations, ``cluster.sibling_islands``) become one kernel over the union of their shapes;
   a matmul kernel whose result a pointwise kernel reads only through the parts a split cuts out
   of it (a gated MLP's ``silu(gate) * up``, ``cluster.gated_epilogues``) takes it as its epilogue,
   the weight's halves dotted side by side (or two weights: ``silu(h @ w1) * (h @ w3)``); matmul
   kernels that are bare dots of one A operand (``h @ wq``, ``h @ wk``, ``h @ wv``,
   ``cluster.sibling_projections``) become one kernel reading the weights side by side and writing
   each result where it goes; and one whose A operand a row-norm kernel computes
   (a pre-norm's ``rms_norm(x) @ W``, ``cluster.norm_prologues``) folds the norm into its K loop,
   after each matmul kernel has taken the element-wise kernel reading only its result and rows of
   its size (a residual sum, ``cluster.residual_epilogues``) as its epilogue; last, a one-dot
   matmul kernel whose result's parts an island kernel reads (a decode layer's QKV projection
   and its rotations, ``cluster.reduce_islands``) takes the island, whose kernel sums the GEMM's
   split-K partials where it reads them (no reduce kernel);
5. **XLA verdicts** (``xla.xla_fuses``): pointwise work XLA fuses better is rejected with the
   reason, recorded in ``xla_fused`` (XLA's by choice, not a fallback); so is a cluster touching a
   tensor with no elements (``templates.empty_problem``: nothing for a kernel to do).

This module is the only caller of ``match_all`` and ``fuse_islands``. Later stages read the
verdicts (the VTOG pins every tensor of a rejected cluster physical; lowering builds kernels for
matches; the report prints the reasons) and never re-decide them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from .cluster import (Cluster, cluster, fuse_islands, gated_epilogues, norm_prologues, query_prologue_islands,
                      reduce_islands, residual_epilogues, sibling_islands, sibling_projections)
from .graph import Graph
from .primitives import Kind, is_movement_op
from .templates import Match, Reject, empty_problem, match_all
from .xla import pointwise_islands, xla_fuses

__all__ = ["Rejections", "Selection", "select"]

# Clusters forced to XLA, each named by its ops (the op ids of one traced graph), with the reason.
Rejections = Mapping[frozenset[int], str]


@dataclass(frozen=True)
class Selection:
    """The clusters of one graph and the verdict on each compute cluster.

    ``verdicts``: cluster id → Match | Reject (movement, glue and opaque clusters have none).
    ``declined``: (first dot op, why) of attention regions no template took, clustered as parts.
    ``xla_fused``: ids of clusters left to XLA by choice (XLA fuses them better), not fallbacks.
    """
    clusters: tuple[Cluster, ...]
    verdicts: Mapping[int, Match | Reject]
    declined: tuple[tuple[int, str], ...] = ()
    xla_fused: frozenset[int] = frozenset()


def select(graph: Graph, rejected: Rejections | None = None, *, xla_fusion: bool = True) -> Selection:
    """Cluster ``graph`` and give each compute cluster its verdict (see the module docstring).

    ``rejected``: clusters (by their ops) forced to XLA with the given reason — build or lowering
    failures of an earlier attempt on the same graph, and the guard's undone kernels, fed back by
    ``program.build``. A cluster is forced where its ops are exactly a rejected set. ``xla_fusion=False``
    keeps every matched pointwise cluster a kernel (the cost model's switch, for ablations).
    """
    rejected = rejected or {}
    clusters = cluster(graph)
    verdicts = match_all(graph, clusters, _forced(clusters, rejected))
    declined = tuple((c.ops[0], verdicts[c.id].reason) for c in clusters
                     if c.kind == Kind.ATTENTION and isinstance(verdicts.get(c.id), Reject)
                     and frozenset(c.ops) not in rejected)   # (undone, not declined: kept whole)
    if declined:
        clusters = cluster(graph, not_attention=frozenset(o for o, _ in declined))
        verdicts = match_all(graph, clusters, _forced(clusters, rejected))
    fused: dict[int, str] = {}
    if xla_fusion:
        clusters, verdicts, not_fused = _fuse_islands(graph, clusters, verdicts, rejected)
        clusters, verdicts = _fuse_query_prologues(graph, clusters, verdicts, rejected)
        clusters, verdicts = _fuse_siblings(graph, clusters, verdicts, rejected)
        clusters, verdicts = _fuse_gated(graph, clusters, verdicts, rejected)
        clusters, verdicts = _fuse_residuals(graph, clusters, verdicts, rejected)
        clusters, verdicts = _fuse_projections(graph, clusters, verdicts, rejected)
        clusters, verdicts = _fuse_norms(graph, clusters, verdicts, rejected)
        clusters, verdicts = _fuse_reduce_islands(graph, clusters, verdicts, rejected)
        fused = xla_fuses(graph, clusters, verdicts, not_fused)
    fused.update({c.id: why for c in clusters if isinstance(verdicts.get(c.id), Match)
                  for why in [empty_problem(graph, c)] if why is not None})
    kinds = {c.id: c.kind for c in clusters}
    verdicts = {**verdicts, **{k: Reject(k, Kind(kinds[k]), why) for k, why in fused.items()}}
    return Selection(clusters, verdicts, declined, frozenset(fused))


def _forced(clusters: tuple[Cluster, ...], rejected: Rejections) -> dict[int, str]:
    """``match_all``'s ``forced``: the ids, in this clustering, of the clusters ``rejected`` names."""
    return {c.id: why for c in clusters if (why := rejected.get(frozenset(c.ops))) is not None}


def _fuse_query_prologues(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                          rejected: Rejections
                          ) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Each attention kernel takes the island making its query (``cluster.query_prologue_islands``:
    a rotary embedding), where both are kernels and the attention template takes the merged
    cluster; a pair it declines stays two kernels."""
    queries = {c.id: m.detail.q for c in clusters if c.kind == Kind.ATTENTION
               and isinstance(m := verdicts.get(c.id), Match)}
    kernels = frozenset(k for k, v in verdicts.items() if isinstance(v, Match))
    return _fuse_groups(graph, clusters, verdicts, rejected, query_prologue_islands(graph, clusters, queries, kernels))


def _fuse_siblings(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                   rejected: Rejections) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Island kernels cut out of one tensor with no path between them (``cluster.sibling_islands``:
    a decode step's q and k rotations) as one kernel over the union of their shapes, where the
    pointwise template takes the merged cluster; a group it declines stays its kernels."""
    kernels = frozenset(k for k, v in verdicts.items() if isinstance(v, Match))
    return _fuse_groups(graph, clusters, verdicts, rejected, sibling_islands(graph, clusters, kernels), union=True)


def _fuse_gated(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                rejected: Rejections) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Each matmul kernel whose result one pointwise kernel reads only through its parts
    (``cluster.gated_epilogues``: ``silu(gate) * up`` of a merged gate/up projection) as one
    matmul cluster, where the matmul template takes it; a pair it declines stays two kernels."""
    kernels = frozenset(k for k, v in verdicts.items() if isinstance(v, Match))
    return _fuse_groups(graph, clusters, verdicts, rejected, gated_epilogues(graph, clusters, kernels))


def _fuse_residuals(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                    rejected: Rejections) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Each matmul kernel with the element-wise kernel reading only its result (and residual rows,
    ``cluster.residual_epilogues``) as one matmul cluster, where the matmul template takes it."""
    kernels = frozenset(k for k, v in verdicts.items() if isinstance(v, Match))
    return _fuse_groups(graph, clusters, verdicts, rejected, residual_epilogues(graph, clusters, kernels))


def _fuse_projections(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                      rejected: Rejections) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Matmul kernels that are bare dots of one A operand (``cluster.sibling_projections``: a
    layer's q, k and v projections with three weights) as one matmul cluster with a result each,
    where the matmul template takes it (the weights read side by side); a group it declines
    stays its kernels."""
    kernels = frozenset(k for k, v in verdicts.items() if isinstance(v, Match))
    return _fuse_groups(graph, clusters, verdicts, rejected, sibling_projections(graph, clusters, kernels),
                        union=True)


def _fuse_norms(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                rejected: Rejections) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Each matmul kernel whose A operand one row-norm kernel computes (``cluster.norm_prologues``,
    with the norm weight's cast) as one matmul cluster folding the norm, where the matmul template
    takes it; a group it declines stays its kernels."""
    kernels = frozenset(k for k, v in verdicts.items() if isinstance(v, Match))
    return _fuse_groups(graph, clusters, verdicts, rejected, norm_prologues(graph, clusters, kernels),
                        union=True)   # (sibling projections side by side write results of several shapes)


def _fuse_reduce_islands(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                         rejected: Rejections) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Each one-dot matmul kernel with the island kernel reading its result's parts
    (``cluster.reduce_islands``: a decode layer's QKV projection and its rotations, the v part's
    view into its cache row) as one matmul cluster, where the matmul template takes it (the GEMM
    splits K: the island's kernel sums the partials); a group it declines stays its kernels."""
    kernels = frozenset(k for k, v in verdicts.items() if isinstance(v, Match))
    return _fuse_groups(graph, clusters, verdicts, rejected, reduce_islands(graph, clusters, kernels),
                        union=True)


def _fuse_groups(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                 rejected: Rejections, groups: list[set[int]], *, union: bool = False
                 ) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject]]:
    """Each group of kernels merged into one cluster (``cluster.fuse_islands``) and matched again
    (:func:`_rematched`); a group whose merged cluster its template declines is put back as it was
    (one the caller rejected stays merged, rejected)."""
    while groups:
        regrouped, _ = fuse_islands(graph, clusters, groups, union=union)
        if regrouped is clusters:
            break
        merged = _rematched(graph, clusters, verdicts, regrouped, rejected)
        ops_of = {c.id: set(c.ops) for c in clusters}
        declined = [set(c.ops) for c in regrouped
                    if isinstance(merged.get(c.id), Reject) and frozenset(c.ops) not in rejected]
        keep = [p for p in groups if not any(set().union(*(ops_of[k] for k in p)) <= d for d in declined)]
        if len(keep) == len(groups):
            return regrouped, merged
        groups = keep
    return clusters, verdicts


def _rematched(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
               regrouped: tuple[Cluster, ...], rejected: Rejections) -> dict[int, Match | Reject]:
    """``match_all`` of ``regrouped``, matching only the clusters regrouping changed: one whose
    ops are those of an earlier cluster keeps that cluster's verdict under its new id (matching
    an attention cluster again means probing its masks again); ``rejected`` ones get their reason."""
    before = {frozenset(c.ops): verdicts[c.id] for c in clusters if c.id in verdicts}
    fresh = [c for c in regrouped if frozenset(c.ops) not in before or frozenset(c.ops) in rejected]
    out = match_all(graph, fresh, _forced(regrouped, rejected))
    for c in regrouped:
        if c.id not in out and (v := before.get(frozenset(c.ops))) is not None:
            out[c.id] = dataclasses.replace(v, cluster=c.id)
    return out


def _fuse_islands(graph: Graph, clusters: tuple[Cluster, ...], verdicts: dict[int, Match | Reject],
                  rejected: Rejections
                  ) -> tuple[tuple[Cluster, ...], dict[int, Match | Reject], dict[int, str]]:
    """Each pointwise island (``xla.pointwise_islands``) re-clustered as one cluster, where its
    template can plan it: ``(clusters, verdicts, why not fused)``, the last keyed by the island's
    smallest op id (``xla.xla_fuses`` then leaves the island's parts to XLA with that reason).
    Results of several shapes take one grid over their union (``union=True``: Hugging Face's
    rotation, cos and sin of ``cat(freqs, freqs)`` computed once for q and k)."""
    islands = pointwise_islands(graph, clusters, verdicts)
    if not islands:
        return clusters, verdicts, {}
    regrouped, left = fuse_islands(graph, clusters, islands, union=True)
    if regrouped is clusters:
        return clusters, verdicts, left
    regrouped_verdicts = match_all(graph, regrouped, _forced(regrouped, rejected))
    # an island its template cannot plan stays its parts, left to XLA's fusion (one the caller
    # rejected stays whole: rejected as it was undone)
    bad = {frozenset(c.ops): regrouped_verdicts[c.id].reason for c in regrouped
           if isinstance(regrouped_verdicts.get(c.id), Reject) and c.kind == Kind.POINTWISE
           and frozenset(c.ops) not in rejected and any(is_movement_op(graph.ops[o], graph) for o in c.ops)}
    if not bad:
        return regrouped, regrouped_verdicts, left
    ops_of = {c.id: set(c.ops) for c in clusters}
    keep, why = [], {}
    for isl in islands:
        ops = set().union(*(ops_of[k] for k in isl))
        reason = next((r for b, r in bad.items() if ops <= b), None)
        if reason is None:
            keep.append(isl)
        else:
            why[min(ops)] = f"its kernel cannot be planned ({reason})"
    if not keep:
        return clusters, verdicts, why
    regrouped, left = fuse_islands(graph, clusters, keep, union=True)
    if regrouped is clusters:
        return clusters, verdicts, {**left, **why}
    return regrouped, match_all(graph, regrouped, _forced(regrouped, rejected)), {**left, **why}
