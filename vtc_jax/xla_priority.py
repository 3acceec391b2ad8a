"""XLA's GPU priority fusion and multi-output fusion, simulated with XLA's own performance model.

Why: where XLA cuts a loop fusion of many indexings (an associative scan's tree) depends on its
performance model — a producer read by k fusions is recomputed by each, re-reading its operands
from DRAM, against one 1 us launch saved — so no fixed bound on emissions says how many kernels a
scan compiles to. :func:`fuse` replays ``priority_fusion.cc``'s greedy with the prices of
``gpu_performance_model{,_base}.cc`` and ``gpu_hlo_cost_analysis.cc``, then multi-output fusion.
``benchmarks/priority_fusion.py`` checks it against XLA's own dump (the rules below, each read off
that dump or XLA's verbose log); :mod:`vtc_jax.xla` uses it for the loop fusions its bound would cut.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class Device:
    """What XLA's performance model knows of the GPU (the H100 of the deviceless compile's
    ``gpu_device_info``, and the model's constants)."""
    bandwidth: float = 3.352e12      # bytes/s
    l2_bytes: int = 52_428_800
    l2_speedup: float = 2.5          # kL2CacheSpeedup: a re-read of a buffer that fits the L2
    l1_bytes_per_core: int = 2048    # DeviceDescription::l1_cache_size_per_SM's default
    l1_speedup: float = 8.0          # kL1CacheSpeedup, on top of the L2's
    launch_s: float = 1e-6           # kKernelLaunchOverhead
    clock_ghz: float = 1.98
    cores: int = 132
    fpus_per_core: int = 128
    overlap: float = 0.95            # kMemoryComputeParallelism
    threads_per_block: int = 128
    unroll: int = 4                  # a loop fusion's elements per thread
    max_operands: int = 96           # kMaxOperandsAndOutputsPerFusion


H100 = Device()
# ``GpuHloCostAnalysis``' flops an element of an element-wise op, by HLO opcode: the clock
# cycles of XLA's sm_90 op profile (``hlo_op_profiles_data.h``), 3 for one it does not list
# (``kDefaultFlopsPerElement``). ``multiply`` is 3, not the profile's 7: read off the pass's own
# dump (the f32 multiply producers' prices agree to 0.001 us with 3, and miss by 0.4 us with 7;
# ``add`` agrees with 7) — the jax 0.10.2 build's profile evidently differs from the public one.
_CYCLES_F32 = {"add": 7, "subtract": 7, "multiply": 3, "divide": 24, "exponential": 80, "log": 157,
               "log-plus-one": 221, "exponential-minus-one": 196, "rsqrt": 77, "sqrt": 77, "tanh": 179,
               "power": 487, "cosine": 326, "sine": 933, "cbrt": 400, "atan2": 428}
_CYCLES_F16 = {"add": 7, "subtract": 7, "multiply": 7, "divide": 45, "exponential": 105, "log": 182,
               "log-plus-one": 245, "exponential-minus-one": 217, "rsqrt": 94, "sqrt": 98, "tanh": 200,
               "power": 491, "cosine": 329, "sine": 333, "cbrt": 466, "atan2": 449}


def concatenate_cycles(axis: int, first: int) -> int:
    """``GpuHloCostAnalysis::HandleConcatenate``: 6 flops an element (a compare and a branch), 400
    when the concatenated axis is not the outermost and the first operand's extent along it is
    not a multiple of 32 (a warp would run both branches; XLA prices it high to keep such a
    concatenation out of compute-heavy fusions). An associative scan along a batched axis —
    Mamba's ``(1, L, 4096, 16)`` along axis 1 — concatenates one row in front of each level."""
    return 400 if axis > 0 and first % 32 else 6


def cycles(opcode: str, itemsize: int) -> int:
    """The flops XLA's cost analysis charges an element of ``opcode`` (4-byte floats: the f32
    profile; narrower: the f16 one)."""
    return (_CYCLES_F32 if itemsize >= 4 else _CYCLES_F16).get(opcode, 3)


KINDS = frozenset({"elementwise", "broadcast", "slice", "pad", "concatenate", "transpose", "reduce"})


@dataclass(frozen=True)
class Node:
    """One instruction before fusion. ``operands`` are node ids or external buffer ids (keys of
    the ``inputs`` given to :func:`fuse`); ``kind`` is one of :data:`KINDS`."""
    id: int
    kind: str
    size: int                        # elements
    nbytes: int
    operands: tuple[int, ...]
    shape: tuple[int, ...] = ()      # multi-output fusion merges kernels of one result shape
    cycles: int = 3                  # flops an element (:func:`cycles`)
    window: tuple[tuple[int, int], ...] = ()   # a slice's (start, limit) per dimension


@dataclass(frozen=True)
class Fused:
    """One kernel after fusion: the node ids it writes and the buffers it reads."""
    writes: tuple[int, ...]
    reads: frozenset[int]


class _Fusion:
    """A fusion instruction during the simulation: a DAG of copies of nodes (XLA duplicates a
    producer into each consumer) and the external operands it reads, with the utilisation,
    emission and flop figures ``GpuHloCostAnalysis::FusionCalculateUtilizations`` gives it."""

    def __init__(self, body: dict[int, tuple[Node, list[tuple[bool, int]]]], root: int, name: int,
                 sizes: Mapping[int, int], uid: int) -> None:
        self.body, self.root, self.name, self.uid = body, root, name, uid
        order: list[int] = []
        seen: set[int] = set()
        stack = [(root, False)]
        while stack:   # post-order: operands before users
            i, done = stack.pop()
            if done:
                order.append(i)
                continue
            if i in seen:
                continue
            seen.add(i)
            stack.append((i, True))
            stack.extend((r, False) for inner, r in reversed(body[i][1]) if inner and r not in seen)
        ext: dict[int, None] = {}
        for i in order:
            for inner, r in body[i][1]:
                if not inner:
                    ext.setdefault(r)
        self.ext = list(ext)
        # XLA's elementwise-use roots: a value read element-wise is read at its reader's index,
        # once per distinct non-element-wise root above it; a slice, pad or concatenation reads
        # it anew (its own root, utilisation scaled by the elements it reads)
        roots_of: dict[tuple[bool, int], set[tuple[bool, int]]] = {(True, i): set() for i in order}
        roots_of.update({(False, e): set() for e in self.ext})
        root_util: dict[tuple[bool, int], float] = {(True, root): 1.0}
        roots_of[(True, root)].add((True, root))
        util: dict[tuple[bool, int], float] = {}
        self.flops = 0.0
        for i in reversed(order):
            n = (True, i)
            node, refs = body[i]
            util[n] = sum(root_util[r] for r in roots_of[n])
            if node.kind in ("elementwise", "concatenate"):
                self.flops += util[n] * node.size * node.cycles
            elif node.kind == "reduce":   # the reducer applied to each element read
                self.flops += util[n] * sum(body[r][0].size if inner else sizes[r] for inner, r in refs) * node.cycles
            for inner, r in refs:
                o = (inner, r)
                osize = body[r][0].size if inner else sizes[r]
                if node.kind == "elementwise":
                    roots_of[o] |= roots_of[n]
                    continue
                roots_of[o].add(o)
                # a slice reads the elements it keeps, a broadcast one element per element it
                # writes (``HloCostAnalysis``' operand utilisation); the rest read their operands whole
                used = util[n] * (node.size / max(osize, 1) if node.kind in ("slice", "broadcast") else 1.0)
                used = math.ceil(used * osize - 1e-9) / osize if osize else 0.0
                root_util[o] = root_util.get(o, 0.0) + used
        self.util = {e: sum(root_util[r] for r in roots_of[(False, e)]) for e in self.ext}
        readers: dict[int, list[Node]] = {}
        for i in order:
            for inner, r in body[i][1]:
                if not inner:
                    readers.setdefault(r, []).append(body[i][0])
        # the window of an operand read through one slice only (XLA's ``FindUniqueSlice``)
        self.window = {e: rs[0].window for e, rs in readers.items() if len(rs) == 1 and rs[0].window}
        self.roots_of = {e: roots_of[(False, e)] for e in self.ext}
        self.root_util = root_util
        self.out = body[root][0]
        # ``CanFuse``: a reduction of 16 elements or more is emitted by the reduction emitter;
        # one of fewer by the elemental (loop) emitter
        def significant(i: int) -> bool:
            node, refs = body[i]
            return node.kind == "reduce" and node.size * 16 <= max(
                (body[r][0].size if inner else sizes[r]) for inner, r in refs)
        self.reduces = any(significant(i) for i in order)
        self.reduction_root = significant(root)
        # operands read element-wise from the root (XLA's FusionUsesParameterElementwiseFromRoot)
        self.elementwise = {e for e in self.ext if (True, root) in self.roots_of[e]}


def _read_s(net: float, total: float, d: Device) -> float:
    """``ReadTimeWithDRAMHeuristic`` (coalesced reads): the first read from DRAM, the rest from
    the L2 if the buffer fits it, and from the L1 as well (8x more) if it fits the SMs' L1 as XLA
    counts it (``l1_cache_size_per_SM``: 2 KiB an SM for a GPU it has no figure for — Mamba's
    (1, 2048, 16) readout coefficients, re-read 4,096 times by the readout's reduction)."""
    first = min(net, total)
    rest_bw = d.bandwidth * (d.l2_speedup if net < d.l2_bytes else 1.0)
    if net < d.l1_bytes_per_core * d.cores:
        rest_bw *= d.l1_speedup
    return first / d.bandwidth + (total - first) / rest_bw


def _combine(compute: float, memory: float, d: Device) -> float:
    return compute + memory - d.overlap * min(compute, memory)


def _compute_s(flops: float, elements: int, d: Device) -> float:
    blocks = max(1, math.ceil(elements / (d.threads_per_block * d.unroll)))
    rate = d.clock_ghz * 1e9 * 2 * min(d.threads_per_block, d.fpus_per_core) * min(blocks, d.cores)
    return flops / rate


def _run_s(f: _Fusion, nbytes: Mapping[int, int], d: Device) -> float:
    """``EstimateRunTimeForInstruction``."""
    reads = sum(_read_s(min(nbytes[e], nbytes[e] * f.util[e]), nbytes[e] * f.util[e], d) for e in f.ext)
    return _combine(_compute_s(f.flops, f.out.size, d), reads + f.out.nbytes / d.bandwidth, d)


def _fused_s(p: _Fusion, c: _Fusion, nbytes: Mapping[int, int], d: Device) -> float:
    """``EstimateRunTimeForFusion``: producer ``p`` inside consumer ``c`` (``p`` recomputed as
    often as ``c`` reads it; operands both read counted once where both read them at one index)."""
    u = c.util[p.name]
    reads = 0.0
    for e in dict.fromkeys(p.ext + c.ext):
        if e == p.name:
            continue
        total = nbytes[e] * (p.util.get(e, 0.0) * u + c.util.get(e, 0.0))
        if e in p.elementwise and e in c.util:
            total -= nbytes[e] * sum(c.root_util[r] for r in c.roots_of[e] & c.roots_of[p.name])
        reads += _read_s(min(nbytes[e], total), total, d)
    return _combine(_compute_s(p.flops * u + c.flops, c.out.size, d), reads + c.out.nbytes / d.bandwidth, d)


def fuse(nodes: Sequence[Node], inputs: Mapping[int, tuple[int, int]], outputs: Iterable[int],
         device: Device = H100) -> list[Fused]:
    """The kernels XLA makes of ``nodes`` (in program order; ``inputs``: external buffer id ->
    (elements, bytes); ``outputs``: node ids read outside, never fused into a reader): priority
    fusion, then multi-output fusion."""
    nbytes = {e: b for e, (_, b) in inputs.items()}
    sizes = {e: n for e, (n, _) in inputs.items()}
    for n in nodes:
        nbytes[n.id], sizes[n.id] = n.nbytes, n.size
    pinned = set(outputs)
    uid = iter(range(1 << 62))
    insts = {n.id: _Fusion({0: (n, [(False, x) for x in n.operands])}, 0, n.id, sizes, next(uid)) for n in nodes}
    order = {n.id: k for k, n in enumerate(nodes)}
    users: dict[int, list[int]] = {}

    def index_users() -> None:
        users.clear()
        for f in insts.values():
            for e in f.ext:
                users.setdefault(e, []).append(f.name)
    index_users()
    cost: dict[int, float] = {}

    def run(f: _Fusion) -> float:
        if f.uid not in cost:
            cost[f.uid] = _run_s(f, nbytes, device)
        return cost[f.uid]

    def priority(name: int) -> float | None:
        cs = users.get(name, [])
        if name in pinned or not cs:
            return None
        p = insts[name]
        if any(len(set(p.ext) | set(insts[c].ext)) > device.max_operands for c in cs):
            return None
        # ``CanFuse``: never both a reduction; never a reduction into a consumer that would make it
        # a loop fusion (an element-wise epilogue XLA allows is not simulated)
        if p.reduces and any(insts[c].reduces or not insts[c].reduction_root for c in cs):
            return None
        unfused = device.launch_s * (len(cs) + 1) + run(p) + sum(run(insts[c]) for c in cs)
        fused = device.launch_s * len(cs) + sum(_fused_s(p, insts[c], nbytes, device) for c in cs)
        return unfused - fused

    queue: dict[int, float] = {}

    def requeue(names: Iterable[int]) -> None:
        for n in names:
            queue.pop(n, None)
            pr = priority(n)
            if pr is not None and pr >= 0:
                queue[n] = pr
    requeue(list(insts))
    while queue:
        name = max(queue, key=lambda n: (queue[n], insts[n].uid))   # ties: the later instruction
        del queue[name]
        p = insts.pop(name)
        changed = []
        for cn in users[name]:
            c = insts[cn]
            body = dict(c.body)
            base = max(body) + 1
            remap = {i: base + k for k, i in enumerate(p.body)}
            for i, (node, refs) in p.body.items():
                body[remap[i]] = (node, [(True, remap[r]) if inner else (False, r) for inner, r in refs])
            for i, (node, refs) in c.body.items():
                body[i] = (node, [(True, remap[p.root]) if (not inner and r == name) else (inner, r)
                                  for inner, r in refs])
            insts[cn] = _Fusion(body, c.root, cn, sizes, next(uid))
            changed.append(cn)
        index_users()
        requeue({*changed, *(e for cn in changed for e in insts[cn].ext if e in insts)})
    return multi_output(insts, order, sizes, nbytes)


def multi_output(insts: Mapping[int, _Fusion], order: Mapping[int, int], sizes: Mapping[int, int],
                 nbytes: Mapping[int, int]) -> list[Fused]:
    """XLA's multi-output fusion: kernels writing one shape of result that share an operand, or
    where one reads the other, become one kernel — unless a kernel outside them lies between."""
    reads = {n: set(f.ext) for n, f in insts.items()}
    below: dict[int, set[int]] = {}

    def reach(n: int) -> set[int]:   # the kernels ``n`` depends on
        if n not in below:
            below[n] = set()
            for e in reads[n]:
                if e in insts:
                    below[n] |= {e} | reach(e)
        return below[n]
    def shares(a: int, b: int, e: int) -> bool:
        """Siblings ``a`` and ``b`` share operand ``e`` profitably: not a scalar, and not two
        disjoint slices of a buffer of 1 KiB or more (``ParameterSlicesAreNonOverlapping``:
        strides ignored)."""
        if sizes.get(e, 2) <= 1:
            return False
        wa, wb = insts[a].window.get(e), insts[b].window.get(e)
        return not (wa and wb and nbytes.get(e, 0) >= 1024
                    and any(sa >= lb or sb >= la for (sa, la), (sb, lb) in zip(wa, wb)))
    groups: list[list[int]] = []
    for n in sorted(insts, key=lambda n: order[n]):
        # a kernel whose root is a concatenation runs XLA's concatenate emitter (an input fusion):
        # it takes no part in multi-output fusion (``IsProducerMultiOutputFusible``: loop fusions)
        if insts[n].out.kind == "concatenate":
            groups.append([n])
            continue
        for grp in groups:
            if insts[grp[0]].out.kind == "concatenate":
                continue
            if insts[grp[0]].out.shape != insts[n].out.shape or insts[grp[0]].out.nbytes != insts[n].out.nbytes:
                continue
            if not any(m in reads[n] or n in reads[m] or any(shares(n, m, e) for e in reads[n] & reads[m])
                       for m in grp):
                continue
            members = set(grp)
            # a kernel outside the group between a member and ``n`` would make a cycle
            if any(x not in members and (x in reach(n) and reach(x) & members or n in reach(x) and x in
                                         set().union(*(reach(m) for m in grp)))
                   for x in insts):
                continue
            grp.append(n)
            break
        else:
            groups.append([n])
    return [Fused(tuple(grp), frozenset(set().union(*(reads[m] for m in grp)) - set(grp))) for grp in groups]




@dataclass(frozen=True)
class Problem:
    """One simulation's input with its ids renumbered by first appearance (nodes in order, then
    their operands): equal for islands equal up to the ids of their tensors — a model's layers —
    so a caller can price each distinct island once (:func:`canonical`)."""
    nodes: tuple[Node, ...]
    inputs: tuple[tuple[int, tuple[int, int]], ...]
    outputs: frozenset[int]

    def fuse(self, device: Device = H100) -> list[Fused]:
        return fuse(self.nodes, dict(self.inputs), self.outputs, device)


def canonical(nodes: Sequence[Node], inputs: Mapping[int, tuple[int, int]], outputs: Iterable[int]
              ) -> tuple[Problem, dict[int, int]]:
    """``(problem, back)``: the :class:`Problem` of ``nodes`` and the map from its ids to the
    caller's (the kernels of ``problem.fuse()`` are the caller's through ``back``)."""
    new: dict[int, int] = {}
    for n in nodes:
        new.setdefault(n.id, len(new))
    for n in nodes:
        for x in n.operands:
            new.setdefault(x, len(new))
    problem = Problem(tuple(Node(new[n.id], n.kind, n.size, n.nbytes, tuple(new[x] for x in n.operands), n.shape,
                                 n.cycles, n.window) for n in nodes),
                      tuple(sorted((new[e], v) for e, v in inputs.items() if e in new)),
                      frozenset(new[t] for t in outputs if t in new))
    return problem, {v: k for k, v in new.items()}


def first_gains(nodes: Sequence[Node], inputs: Mapping[int, tuple[int, int]], d: Device = H100
                ) -> dict[int, float]:
    """Each producer's first priority (seconds): the time unfused minus the time fused into all its
    users, before any fusion — what XLA's dump records as ``us_unfused - us_fused``."""
    nbytes = {e: b for e, (_, b) in inputs.items()}
    sizes = {e: n for e, (n, _) in inputs.items()}
    for n in nodes:
        nbytes[n.id], sizes[n.id] = n.nbytes, n.size
    insts = {n.id: _Fusion({0: (n, [(False, x) for x in n.operands])}, 0, n.id, sizes, k)
             for k, n in enumerate(nodes)}
    users: dict[int, list[int]] = {}
    for f in insts.values():
        for e in f.ext:
            users.setdefault(e, []).append(f.name)
    out = {}
    for i, f in insts.items():
        cs = users.get(i, [])
        if not cs:
            continue
        unfused = d.launch_s * (len(cs) + 1) + _run_s(f, nbytes, d) + sum(_run_s(insts[c], nbytes, d) for c in cs)
        fused = d.launch_s * len(cs) + sum(_fused_s(f, insts[c], nbytes, d) for c in cs)
        out[i] = unfused - fused
    return out
