"""Profiling: edge savings measured on a GPU instead of modelled (the paper's Algorithm 2 profiling).

``ProfiledSavings`` turns a :class:`Profiler` (``measure(edge_set) -> seconds``) into the greedy's
``w(e)``; ``TimingProfiler`` times a program built for an edge set on the device. The timing itself
(:func:`time_interleaved`, on inputs from :func:`device_inputs`) is also the guard's
(``guard.measured``). Timing means something only on a GPU.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from .movement import Edge
from .primitives import TABLE
from .vtog import VTOG, box_volume, piece_group

__all__ = ["Profiler", "ProfiledSavings", "TimingProfiler", "time_interleaved", "calls_per_sample", "device_inputs",
           "last_positions", "carried", "threaded", "handed_on", "SAMPLE_SECONDS", "MAX_CALLS"]


# A sample is this long at least (calls issued back to back, one sync at its end): shorter ones
# are host jitter. Measured on a lent H100 (a VM), timed per synced call: YOLO's C3k2 block at
# batch 1 under jit read 0.187 ms in one process and 0.336 ms in another, and 806 µs in the guard's
# own 20 calls; programs whose HLO was jit's own (every kernel undone) read 12% to 2x slower than jit.
SAMPLE_SECONDS = 2e-3
# ... and at most this many calls (each call's donated inputs are copied before the sample).
MAX_CALLS = 32
# Calls before timing starts, also by time: an idle GPU's clocks ramp up over tens of milliseconds.
WARM_SECONDS = 0.05


def calls_per_sample(seconds_per_call: float, max_calls: int = MAX_CALLS) -> int:
    """How many back-to-back calls make one sample: enough for ``SAMPLE_SECONDS``, at most
    ``max_calls`` (the caller's memory bound on copies of donated inputs), at least one."""
    if seconds_per_call <= 0:
        return max(1, max_calls)
    return max(1, min(max_calls, -int(-SAMPLE_SECONDS // seconds_per_call)))


def carried(ins: Sequence[Any], donate: Sequence[int], outs: Sequence[Any]) -> dict[int, int] | None:
    """Each donated input (by its index in ``ins``) paired with the output (index in ``outs``) that
    takes its place in the next call of a loop: the first output not yet taken with its shape and
    dtype, which is also the output XLA aliases a donated buffer with. ``None`` where a donated
    input has no such output (a loop then needs a fresh copy of it per call). ``ins`` and ``outs``
    are flat, anything with ``shape`` and ``dtype``."""
    taken: dict[int, int] = {}
    for i in sorted(set(donate)):
        j = next((j for j, o in enumerate(outs) if j not in taken.values()
                  and tuple(o.shape) == tuple(ins[i].shape) and o.dtype == ins[i].dtype), None)
        if j is None:
            return None
        taken[i] = j
    return taken


def _donated_leaves(args: Sequence[Any], donate: Sequence[int], out: Any
                    ) -> tuple[list[tuple[int, Any, int, int]], dict[int, int]] | None:
    """The donated arguments' leaves (position, tree, first leaf, leaf count for each) and
    :func:`carried`'s pairing of those leaves with ``out``'s; None where nothing is donated or a
    leaf has no output to take its place."""
    in_leaves, where = [], []
    for i in sorted(set(donate)):
        leaves, tree = jax.tree_util.tree_flatten(args[i])
        where.append((i, tree, len(in_leaves), len(leaves)))
        in_leaves.extend(leaves)
    pairs = carried(in_leaves, range(len(in_leaves)), jax.tree_util.tree_leaves(out)) if in_leaves else None
    return None if pairs is None else (where, pairs)


def handed_on(args: Sequence[Any], donate: Sequence[int], out: Any) -> frozenset[int]:
    """The output leaves :func:`threaded` hands to the next call (none where it hands nothing):
    the outputs a sample of back-to-back calls does not hold one of per call."""
    found = _donated_leaves(args, donate, out)
    return frozenset(found[1].values()) if found else frozenset()


def threaded(args: Sequence[Any], donate: Sequence[int], out: Any
             ) -> Callable[[Sequence[Any], Any], tuple[Any, ...]] | None:
    """How a loop feeds one call's outputs to the next (:func:`time_interleaved`'s ``carry``): each
    donated argument (a position in ``args``, an array or a pytree of them) replaced by the outputs
    :func:`carried` pairs with its leaves; ``out`` is one call's output, or its avals, as a pytree.
    ``None`` where nothing is donated or a donated leaf has no output to take its place.

    Why: a decode step donates its caches and a serving loop passes the updated caches to the next
    step. Timed with a fresh copy of the caches per call instead, a sample of back-to-back calls
    holds a copy per call, and BLOOM's 512 MiB of caches fit one call per sample in the guard's
    memory bound: one synchronised call, whose time favoured VTC's program 1.46x where back to back
    it ran 0.75x of jit's (a lent H200, ``benchmarks/measured/h200-2026-11-28-corpus.jsonl``)."""
    found = _donated_leaves(args, donate, out)
    if found is None:
        return None
    where, pairs = found

    def carry(a: Sequence[Any], o: Any) -> tuple[Any, ...]:
        leaves, nxt = jax.tree_util.tree_leaves(o), list(a)
        for i, tree, start, n in where:
            nxt[i] = jax.tree_util.tree_unflatten(tree, [leaves[pairs[start + k]] for k in range(n)])
        return tuple(nxt)
    return carry


def time_interleaved(fns: Sequence[Callable[..., Any]], make_args: Callable[[], Sequence[Any]],
                     repeats: int = 20, max_calls: int = MAX_CALLS,
                     carry: Callable[[Sequence[Any], Any], Sequence[Any]] | None = None) -> list[float]:
    """The median seconds per call of each of ``fns``, as a loop that calls it sees them.

    Warm-up: calls of each until ``WARM_SECONDS`` have passed (compile, autotuning, module load,
    clocks). Then ``repeats`` rounds; in each, every function in turn runs one sample: ``n`` calls
    issued back to back and one ``block_until_ready`` at the end, over ``n`` (the same ``n`` for
    all, :func:`calls_per_sample` of the fastest). The host's dispatch overlaps the device's work,
    as in a serving or training loop, so a sub-millisecond program is timed by its device time and
    not by the jitter of one synchronisation; the interleaving puts a clock or thermal drift on
    all of them alike, and the order turns by one each round (no function always follows
    another). ``make_args()`` gives a call its arguments before the sample's clock starts. With
    ``carry`` (:func:`threaded`) a sample's calls are a loop: ``make_args()`` once, then each call
    is given ``carry(args, outputs)`` of the one before (a decode step its updated caches), so a
    sample holds one set of donated inputs however many calls it makes. Without it, each call of a
    sample gets its own ``make_args()`` (fresh copies where a call donates, and so consumes, its
    inputs). ``max_calls`` bounds the calls of a sample: the memory the caller lets a sample hold
    (the copies and the outputs of calls in flight)."""
    def loop(fn: Callable[..., Any], n: int) -> Any:
        a, o = make_args(), None
        for _ in range(n):
            o = fn(*a)
            a = carry(a, o)
        return o

    single = []
    for fn in fns:
        jax.block_until_ready(fn(*make_args()))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*make_args()))
        single.append(time.perf_counter() - t0)
    for fn, t in zip(fns, single):
        if carry is not None:
            jax.block_until_ready(loop(fn, min(int(WARM_SECONDS / max(t, 1e-6)), 200)))
            continue
        for _ in range(min(int(WARM_SECONDS / max(t, 1e-6)), 200)):
            jax.block_until_ready(fn(*make_args()))
    n = calls_per_sample(min(single), max_calls)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        # each round starts at the next function: every one is timed at every place in a round
        # (on a lent H200 the plain-jit fallback, always timed second, read 0.92x of the same
        # executable timed first and third, with jit's own two medians 0% apart)
        turn = [(i + r) % len(fns) for i in range(len(fns))]
        for fn, t in ((fns[i], times[i]) for i in turn):
            if carry is not None:
                a = jax.block_until_ready(make_args())
                t0 = time.perf_counter()
                for _ in range(n):
                    o = fn(*a)
                    a = carry(a, o)
                jax.block_until_ready(o)
                t.append((time.perf_counter() - t0) / n)
                del o, a
                continue
            sets = [make_args() for _ in range(n)]
            jax.block_until_ready(sets)
            t0 = time.perf_counter()
            outs = [fn(*a) for a in sets]
            jax.block_until_ready(outs)
            t.append((time.perf_counter() - t0) / n)
            del outs, sets
    return [statistics.median(t) for t in times]


def device_inputs(avals: Sequence[Any], seed: int = 0, ints: Mapping[int, int] | None = None) -> list[Any]:
    """Arrays of the given shapes and dtypes on the default device: floats normal × 0.05, input
    ``i`` of ``ints`` that value (:func:`last_positions`), every other input zero. Made eagerly even
    inside a trace (the guard times while the user's function is being traced, and a traced value
    cannot be fed to a compiled program)."""
    ints = ints or {}
    with jax.ensure_compile_time_eval():
        keys = jax.random.split(jax.random.key(seed), max(len(avals), 1))
        return jax.block_until_ready([
            (0.05 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
            if jnp.issubdtype(a.dtype, jnp.floating) else jnp.full(a.shape, ints.get(i, 0), a.dtype)
            for i, (k, a) in enumerate(zip(keys, avals))])


# Ops that hand an integer scalar on unchanged in value (a cast, the scalar broadcast to an array
# to be compared elementwise, a reshape of it), and ops that hand an iota's values on likewise.
_SAME_VALUE = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims"})
_COMPARES = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})


def last_positions(jaxpr: Any) -> dict[int, int]:
    """For each integer input that indexes an axis: the largest value every such use of it accepts
    (the last position of a cache it is written at, the last key of a mask it is compared with; for
    an array, such as per-sequence lengths, one value for all its elements). Timed there, an
    attention that reads keys up to the position reads them all.

    Why: the guard times both programs on inputs of its own, and a decode position of 0 timed
    VTC's decode attention at its cheapest (one key block) against jit's, which reads the whole
    cache at every position. On a lent H100 the guard timed BLOOM's ALiBi decode 1.66× ahead at
    position 0; it ran 0.91× of jit at the last position
    (``benchmarks/measured/h100-2026-11-27-evening-corpus.jsonl``). The uses read: a
    ``dynamic_slice`` / ``dynamic_update_slice`` start on an axis (at most the axis less the
    slice), and a comparison with an ``iota`` (at most the iota's last value), each through casts,
    broadcasts, reshapes and ``+``/``-`` of a literal, and into the bodies of plain calls (nested
    ``jit``), past jax's wrap of negative indices. An input no such use bounds (token ids, a block table) is not in the result: the
    caller keeps it 0, an index every axis accepts."""
    bounds: dict[int, int] = {}

    def bound(i: int, hi: int) -> None:
        bounds[i] = max(0, min(bounds.get(i, hi), hi))

    def visit(jx: Any, origin: dict[Any, tuple[int, int]], iotas: dict[Any, int]) -> None:
        negative: set[Any] = set()
        def src(v: Any) -> tuple[int, int] | None:
            return None if isinstance(v, jcore.Literal) else origin.get(v)

        for e in jx.eqns:
            name, ins = e.primitive.name, [src(v) for v in e.invars]
            if name == "iota":
                iotas[e.outvars[0]] = e.params["shape"][e.params["dimension"]] - 1
            elif name in _SAME_VALUE and not isinstance(e.invars[0], jcore.Literal) and e.invars[0] in iotas:
                iotas[e.outvars[0]] = iotas[e.invars[0]]
            if not any(ins):
                continue
            if name in _SAME_VALUE and ins[0]:
                origin[e.outvars[0]] = ins[0]
            elif name == "lt" and ins[0] and isinstance(e.invars[1], jcore.Literal) and e.invars[1].val == 0:
                negative.add(e.outvars[0])   # jax's wrap of a negative index: `select_n(i < 0, i, i + n)`
            elif name == "select_n" and e.invars[0] in negative and ins[1]:
                origin[e.outvars[0]] = ins[1]
            elif name in ("add", "sub") and sum(map(bool, ins)) == 1:
                k = 0 if ins[0] else 1
                lit = e.invars[1 - k]
                if isinstance(lit, jcore.Literal) and np.ndim(lit.val) == 0 and (name == "add" or k == 0):
                    c = int(lit.val) if name == "add" else -int(lit.val)
                    origin[e.outvars[0]] = (ins[k][0], ins[k][1] + c)   # the input's value + c
            elif name == "dynamic_update_slice":
                shape, upd = e.invars[0].aval.shape, e.invars[1].aval.shape
                for a, o in enumerate(ins[2:]):
                    if o:
                        bound(o[0], shape[a] - upd[a] - o[1])
            elif name == "dynamic_slice":
                shape, sizes = e.invars[0].aval.shape, e.params["slice_sizes"]
                for a, o in enumerate(ins[1:]):
                    if o:
                        bound(o[0], shape[a] - sizes[a] - o[1])
            elif name in _COMPARES:
                for o, other in ((ins[0], e.invars[1]), (ins[1], e.invars[0])):
                    if o and not isinstance(other, jcore.Literal) and other in iotas:
                        bound(o[0], iotas[other] - o[1])
            elif TABLE.get(name) and TABLE[name].plain_call:
                inner = next((e.params[k] for k in TABLE[name].call_body if k in e.params), None)
                inner = getattr(inner, "jaxpr", inner)
                if inner is not None and len(inner.invars) == len(ins):
                    visit(inner, {v: o for v, o in zip(inner.invars, ins) if o}, {})

    top = getattr(jaxpr, "jaxpr", jaxpr)
    ints = {v: (i, 0) for i, v in enumerate(top.invars) if jnp.issubdtype(v.aval.dtype, jnp.integer)}
    visit(top, ints, {})
    return bounds


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
        if jax.default_backend() != "gpu":
            raise RuntimeError(f"TimingProfiler needs a GPU (jax.default_backend() is "
                               f"{jax.default_backend()!r}); use CostModel for an analytical w(e)")
        self.build_fn, self.args, self.repeats = build_fn, tuple(args), int(repeats)

    def measure(self, edge_set: frozenset[int]) -> float:
        return time_interleaved([self.build_fn(frozenset(edge_set))], lambda: self.args, self.repeats)[0]
