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

Kernel modules are imported lazily (inside ``build``): analysis never pays for Pallas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax.numpy as jnp
import numpy as np

from ..cluster import Cluster
from ..graph import Graph
from ..primitives import Kind

__all__ = ["Match", "Reject", "Decline", "Template", "TEMPLATES", "Run", "Step", "match_all",
           "dtype_problem", "KernelBuildError"]


class Run(Protocol):
    """What a step sees of the emitted program's state (``lower._Run``)."""
    def value(self, t: int) -> Any: ...
    def vtensor(self, t: int) -> Any: ...
    def out_vtensor(self, t: int) -> Any: ...
    def written(self, t: int, out: Any, buffers: Sequence[Any]) -> None: ...


Step = Callable[[Run], None]


class Decline(Exception):
    """Raised by a matcher: the template does not serve this cluster (the message says why)."""


class KernelBuildError(Exception):
    """A template's kernel could not be built, traced or lowered for one cluster."""

    def __init__(self, cluster: int, kind: str, primitives: Sequence[str], cause: BaseException) -> None:
        self.cluster, self.kind, self.primitives, self.cause = cluster, kind, tuple(primitives), cause
        super().__init__(f"{kind} cluster #{cluster} ({', '.join(self.primitives[:6])}"
                         f"{', ...' if len(self.primitives) > 6 else ''}): "
                         f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")


@dataclass(frozen=True)
class Match:
    cluster: int
    kind: Kind
    detail: Any = None


@dataclass(frozen=True)
class Reject:
    cluster: int
    kind: Kind
    reason: str


@dataclass(frozen=True)
class Template:
    kind: Kind
    library: bool
    match: Callable[[Graph, Cluster], Any]
    build: Callable[[Graph, Cluster, Any, str], Step]


def _templates() -> dict[Kind, Template]:
    from . import attention, contraction, pointwise, reduction
    return {t.kind: t for t in (contraction.MATMUL, contraction.CONV, pointwise.TEMPLATE,
                                attention.TEMPLATE, reduction.TEMPLATE)}


TEMPLATES: Mapping[Kind, Template] = _templates()
# cluster kinds that are not computations: nothing to match
_NOT_COMPUTE = frozenset({Kind.MOVEMENT, Kind.GLUE, Kind.OPAQUE})

_NO_TRITON = ("float8", "float4", "int4", "uint4", "int2", "uint2")


def dtype_problem(graph: Graph, c: Cluster) -> str | None:
    """Why no template can take ``c`` because of a dtype it touches (None: dtypes are fine)."""
    seen: set[int] = set()
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
