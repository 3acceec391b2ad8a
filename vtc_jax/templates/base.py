"""The types every template module shares: what a matcher returns or raises, what a builder
returns, and what a step sees of the emitted program.

Why a module of its own: the template modules (attention, contraction, pointwise, reduction,
island) need these types and :mod:`vtc_jax.templates` needs the template modules (to list them in
``TEMPLATES``); with the types here neither imports the other back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..cluster import Cluster
from ..graph import Graph
from ..primitives import Kind

__all__ = ["Run", "Step", "Decline", "KernelBuildError", "Match", "Reject", "Template"]


class Run(Protocol):
    """What a step sees of the emitted program's state (``lower._Run``)."""
    def value(self, t: int) -> Any: ...
    def vtensor(self, t: int) -> Any: ...
    def out_vtensor(self, t: int) -> Any: ...
    def written(self, t: int, out: Any, buffers: Sequence[Any]) -> None: ...
    def concat(self, ts: Sequence[int], axis: int, *, out: bool = False) -> Any: ...
    def written_concat(self, ts: Sequence[int], axis: int, buffers: Sequence[Any]) -> None: ...
    def pending_for(self, cluster: int) -> tuple[int, ...]: ...
    def flush(self, home: int) -> None: ...
    def take_update(self, home: int) -> Any: ...
    def landed(self, home: int, buffer: Any) -> None: ...
    env: dict[int, Any]


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
    # whether the kernel of a match (its detail) performs the in-place row updates of buffers it
    # reads that lowering leaves to it (``lower.deferred_updates``; the step takes them from the run)
    updates: Callable[[Any], bool] = lambda detail: False
    # whether the kernel of a match does work XLA cannot fuse into one launch even where it touches
    # no virtual tensor (a gated GEMM's epilogue over two parts of its result, a norm folded into a
    # GEMM: lowered as a kernel whatever the strategy makes virtual; the guard still prices it)
    fuses_beyond_xla: Callable[[Any], bool] = lambda detail: False
