"""Kernel templates: *matched* once right after clustering, *built* at lowering from the match.

Why match before the strategy: a virtual tensor is only worth anything if the kernel that reads
or writes it exists. Every non-movement cluster gets one verdict here — a :class:`Match` (the
template will serve it, with whatever the template read off the cluster) or a :class:`Reject`
(the reason). The VTOG pins every tensor of a rejected cluster physical, so the greedy never
makes a tensor virtual for a kernel that will not be built, and XLA never has to gather one.

A template is a :class:`Template`: ``match(graph, cluster) -> detail`` (raise :class:`Decline`
to refuse) and ``build(graph, cluster, detail, backend) -> Step``. ``library`` says whether XLA
would hand such a cluster to a vendor library (cuBLAS/cuDNN): the cost model charges a template
kernel the difference. Adding a template: a kernel in ``kernels/``, its adapter module here, and
one line in :data:`TEMPLATES`.

What no template can take is decided from dtypes up front (:func:`dtype_problem`): complex
numbers, PRNG keys and other extended dtypes, float8 and sub-byte integers have no
Triton lowering in Pallas, so such clusters stay XLA from the analysis on (and ``explain`` says so).
One use of float8 lowers: a kernel loading an fp8 input and widening it at once (an fp8 KV cache
cast to bf16 for attention: ``tt.fp_to_fp``, compiled by ptxas for sm_90, e4m3fn and e5m2).

Kernel modules are imported lazily (inside ``build``): analysis never pays for Pallas.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from ..cluster import Cluster
from ..graph import Graph
from ..primitives import Kind
from . import attention, contraction, pointwise, reduction
from .base import Decline, KernelBuildError, Match, Reject, Run, Step, Template

__all__ = ["Match", "Reject", "Decline", "Template", "TEMPLATES", "Run", "Step", "match_all",
           "dtype_problem", "empty_problem", "KernelBuildError"]


TEMPLATES: Mapping[Kind, Template] = {t.kind: t for t in (
    contraction.MATMUL, contraction.CONV, pointwise.TEMPLATE, attention.TEMPLATE, reduction.TEMPLATE)}
# cluster kinds that are not computations: nothing to match
_NOT_COMPUTE = frozenset({Kind.MOVEMENT, Kind.GLUE, Kind.OPAQUE})

_NO_TRITON = ("float8", "float4", "int4", "uint4", "int2", "uint2")


def dtype_problem(graph: Graph, c: Cluster) -> str | None:
    """Why no template can take ``c`` because of a dtype it touches (None: dtypes are fine)."""
    seen: set[int] = set(_widened_fp8_inputs(graph, c))
    for oid in c.ops:
        op = graph.ops[oid]
        for t in (*op.inputs, *op.outputs):
            if t in seen:
                continue
            seen.add(t)
            dt = graph.tensors[t].dtype
            try:
                d = np.dtype(dt)
            except TypeError:
                return f"t{t} has dtype {dt} (an extended dtype such as a PRNG key): no kernel type"
            if jnp.issubdtype(d, jnp.complexfloating):
                return f"t{t} is {d.name}: complex numbers have no Triton type"
            if any(d.name.startswith(p) for p in _NO_TRITON) or not (
                    d == np.bool_ or jnp.issubdtype(d, jnp.floating) or jnp.issubdtype(d, jnp.integer)):
                return f"t{t} is {d.name}: no Pallas Triton lowering for this dtype"
    return None


def _widened_fp8_inputs(graph: Graph, c: Cluster) -> set[int]:
    """The cluster's float8 inputs that it only widens (each reader inside a cast to a float type
    of two bytes or more): what a kernel loads as fp8 and converts in registers."""
    own = set(c.ops)
    out = set()
    for t in c.inputs:
        if not str(graph.tensors[t].dtype).startswith("float8"):   # (extended dtypes are no numpy dtype)
            continue
        readers = [op for op in graph.consumers(t) if op.id in own]
        if readers and all(op.primitive == "convert_element_type" and jnp.issubdtype(
                d := np.dtype(graph.tensors[op.outputs[0]].dtype), jnp.floating) and d.itemsize >= 2 for op in readers):
            out.add(t)
    return out


def empty_problem(graph: Graph, c: Cluster) -> str | None:
    """Why ``c`` is no kernel's business: it touches a tensor with no elements (None: none does).
    Such a cluster computes nothing (or only a fill); a Pallas grid of zero programs and block
    sizes derived from a zero extent are not worth special cases, so XLA runs it (read by
    ``selection.select``, which leaves it to XLA by choice: no fallback warning)."""
    for oid in c.ops:
        op = graph.ops[oid]
        for t in (*op.inputs, *op.outputs):
            if graph.tensors[t].size == 0:
                return f"t{t} has no elements (shape {graph.tensors[t].shape}): nothing for a kernel to do"
    return None


def match_all(graph: Graph, clusters: Sequence[Cluster],
              forced: Mapping[int, str] | None = None) -> dict[int, Match | Reject]:
    """One verdict per compute cluster (movement, glue and opaque clusters get none).

    ``forced`` rejects clusters by id with the given reason (a kernel that failed to build on an
    earlier attempt). A matcher that raises anything but :class:`Decline` rejects the cluster with
    the error as the reason: analysis never fails because of one template.
    """
    forced = forced or {}
    out: dict[int, Match | Reject] = {}
    for c in clusters:
        kind = Kind(c.kind)
        if kind in _NOT_COMPUTE:
            continue
        if c.id in forced:
            out[c.id] = Reject(c.id, kind, forced[c.id])
            continue
        t = TEMPLATES.get(kind)
        why = f"no {kind.value} kernel template" if t is None else dtype_problem(graph, c)
        if why is None:
            try:
                out[c.id] = Match(c.id, kind, t.match(graph, c))
                continue
            except Decline as d:
                why = str(d)
            except Exception as exc:  # noqa: BLE001 - a matcher bug must not fail the analysis
                why = f"template matcher failed ({type(exc).__name__}: {exc})"
        out[c.id] = Reject(c.id, kind, why)
    return out
