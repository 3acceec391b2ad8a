"""Profiling: edge savings measured on a GPU instead of modelled (the paper's Algorithm 2 profiling).

``ProfiledSavings`` turns a :class:`Profiler` (``measure(edge_set) -> seconds``) into the greedy's
``w(e)``; ``TimingProfiler`` times a program built for an edge set on the device. Nothing here runs
without a GPU.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .movement import Edge
from .vtog import VTOG, box_volume, piece_group

__all__ = ["Profiler", "ProfiledSavings", "TimingProfiler"]



class Profiler(Protocol):
    """Anything that can time the program under a set of chosen edges (seconds)."""

    def measure(self, edge_set: frozenset[int]) -> float: ...


class ProfiledSavings:
    """``w(e) = t(C) - t(C ∪ G(e))`` from a profiler (Algorithm 2, lines 8 and 19), cached by set.

    ``G(e)`` is the edge's piece group (all slabs of a concat/split together: a half-virtual
    tensor is not a runnable strategy); each piece is credited its share by volume.
    """

    def __init__(self, profiler: Profiler, vtog: VTOG | None = None) -> None:
        self.profiler, self.vtog = profiler, vtog
        self.cache: dict[frozenset[int], float] = {}
        self.calls = 0

    def time(self, edge_set: frozenset[int]) -> float:
        edge_set = frozenset(edge_set)
        if edge_set not in self.cache:
            self.calls += 1
            self.cache[edge_set] = float(self.profiler.measure(edge_set))
        return self.cache[edge_set]

    def __call__(self, edge: Edge | int, chosen: frozenset[int]) -> float:
        if isinstance(edge, int):
            i = edge
        elif self.vtog is None:
            raise TypeError("ProfiledSavings needs vtog= to map Edge objects to indices")
        else:
            i = self.vtog.index(edge)
        if self.vtog is not None:
            group = piece_group(self.vtog, i)
            vols = [box_volume(self.vtog.edges[j].box) for j in group]
            share = box_volume(self.vtog.edges[i].box) / sum(vols)
        else:
            group, share = (i,), 1.0
        chosen = frozenset(chosen)
        return share * (self.time(chosen) - self.time(chosen | set(group)))


class TimingProfiler:
    """Times ``build_fn(edge_set)(*args)`` on the GPU (median of ``repeats`` after a warm-up).

    ``build_fn`` lowers the program under the given strategy edges and returns a callable. Timing a
    CPU backend would measure nothing VTC is about (no HBM, no Triton kernels), so this refuses to
    run anywhere but on a GPU.
    """

    def __init__(self, build_fn: Callable[[frozenset[int]], Callable[..., Any]], args: Sequence[Any],
                 repeats: int = 20) -> None:
        import jax
        if jax.default_backend() != "gpu":
            raise RuntimeError(f"TimingProfiler needs a GPU (jax.default_backend() is "
                               f"{jax.default_backend()!r}); use CostModel for an analytical w(e)")
        self.build_fn, self.args, self.repeats = build_fn, tuple(args), int(repeats)

    def measure(self, edge_set: frozenset[int]) -> float:
        import jax
        fn = self.build_fn(frozenset(edge_set))
        jax.block_until_ready(fn(*self.args))          # compile + warm up
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*self.args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
