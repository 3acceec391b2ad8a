#!/usr/bin/env python
"""XLA's GPU priority fusion, simulated with XLA's own performance model and checked against the
pass's own dump: why a fixed duplication bound cannot say how many kernels a scan compiles to.

    JAX_PLATFORMS=cpu python benchmarks/priority_fusion.py --recurrence 2048 65536   # one program
    JAX_PLATFORMS=cpu python benchmarks/priority_fusion.py --grid                    # the table
    JAX_PLATFORMS=cpu python benchmarks/priority_fusion.py --corpus "corpus mamba_selective_scan" --vtc
    JAX_PLATFORMS=cpu python benchmarks/priority_fusion.py --write   # the grid and the corpus's two scans
                                                                      # (jit and VTC): BENCHMARKS.md

A diagnostic for whoever works on ``vtc_jax/xla.py`` (``CODE_DUPLICATION``: the model writes out
a loop fusion's value once it would be emitted more than 15 times). Each program is compiled
deviceless for an H100 with ``--xla_dump_hlo_pass_re=priority-fusion``, which makes XLA write the
HLO it fuses and every priority it computes (``priority_fusion_dump``). The simulation below is
run on that same HLO; it prints

* how close its prices are to XLA's: the first priority XLA computes for each producer (fusing it
  into all its users: the time unfused minus the time fused, each the pass's ``us_unfused`` and
  ``us_fused``) against the simulation's, the largest difference over the producers;
* the kernels after priority fusion (XLA's, counted in the HLO after the pass, and the
  simulation's), and after multi-output fusion (the compile's loop and input fusions, and the
  simulation's).

What it shows (the figures are in BENCHMARKS.md, section "XLA's priority fusion, simulated"):
XLA's priority fusion (jax 0.10.2) never refused a fusion for code size on these programs — the
dump's only ineligibility reason is "No users to fuse" — so no bound on emissions is XLA's rule.
What cuts an associative scan's tree is the performance model: a producer read by k fusions is
recomputed by each, each re-reading its operands from DRAM, against one 1 us launch saved and
its result written and read once; at 1 Ki elements a step the launch wins and the tree fuses
(9 kernels over 2,048 steps), at 64 Ki the re-reads win and each level of the up-sweep is a
kernel of its own (17). The simulation, a greedy on XLA's prices, reproduces that. XLA's rules
it needed for the corpus's scans (Mamba's and RG-LRU's), each read off the dump or XLA's verbose
log (``TF_CPP_VMODULE=gpu_performance_model_base=8,gpu_performance_model=8``):

* a concatenation along an axis that is not the outermost, whose first operand's extent along it
  is not a multiple of 32, is charged 400 flops an element
  (``GpuHloCostAnalysis::HandleConcatenate``: Mamba's (1, L, 4096, 16) levels, each with one row
  concatenated in front — 100 us of compute on the 1,024-row level, which first looked like
  uncoalesced reads);
* re-reads of a buffer under XLA's L1 (2 KiB an SM) are priced 20x faster than from DRAM
  (Mamba's readout coefficients, re-read 4,096 times);
* a reduction of 16 elements or more is fused with no other reduction and into no consumer that
  would make it a loop fusion (``CanFuse``);
* a kernel rooted at a concatenation (XLA's concatenate emitter) takes no part in multi-output
  fusion.

With these the simulation, on the HLO XLA fuses, writes out the same tensors as XLA's priority
fusion for Mamba and makes as many kernels as the compile for the four scan programs. What it
does not reproduce yet: mid widths (2 Ki - 8 Ki a step), where priorities sit within a fraction
of a microsecond of zero, come out a kernel or two off; and it runs on XLA's HLO here, not on the
model's graph (``xla.py``).

The simulation follows ``xla/service/gpu/transforms/priority_fusion.cc`` (the greedy: the
producer of the largest priority first, fused into all its users, priorities of the new fusion
and its operands recomputed — in full, where XLA updates them incrementally to the same sums;
ties to the later instruction), ``model/gpu_performance_model{,_base}.cc`` (a launch 1 us; a
kernel's reads by operand, the first from DRAM and re-reads from the L2 at 2.5x where the buffer
fits it, 20x where it fits the L1 as XLA counts it; compute at the SMs' rate, overlapped at 0.95)
and ``model/gpu_hlo_cost_analysis.cc`` (``FusionCalculateUtilizations``: the elements of each
operand a fusion reads, through slices, broadcasts and repeated uses). Multi-output fusion, after
it, merges kernels of one result shape that share an operand or read one another.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import math
import platform
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


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


# ---- XLA's side: the HLO the pass fuses, its prices, its kernels -----------------------------

_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "u8": 1, "s8": 1, "f64": 8, "s64": 8}
_KIND = {"slice": "slice", "dynamic-slice": "slice", "pad": "pad", "concatenate": "concatenate",
         "broadcast": "broadcast", "transpose": "transpose", "reduce": "reduce"}
# instructions no loop fusion takes: read by kernels as buffers
_OPAQUE = ("parameter", "custom-call", "get-tuple-element", "tuple", "constant", "convolution", "dot", "sort",
           "scatter", "gather", "while", "conditional", "all-reduce", "rng-bit-generator")


@dataclass(frozen=True)
class Program:
    """One module before priority fusion, as the simulation's nodes, with what XLA made of it."""
    nodes: tuple[Node, ...]
    inputs: dict[int, tuple[int, int]]
    outputs: frozenset[int]
    names: dict[int, str]                 # node or buffer id -> HLO instruction name
    first_priorities: dict[str, float]    # producer -> XLA's first priority for it, us
    after_priority: int                   # XLA's kernels after the pass
    after_multi_output: int               # the compile's loop and input fusions


def _entry(text: str) -> list[str]:
    return text[text.index("\nENTRY"):].splitlines()[1:]


def read_program(dump: Path) -> Program:
    """The module XLA fused (``*before_priority-fusion.txt``), its priorities
    (``*priority_fusion_dump.txt``) and its kernels (after the pass, and compiled)."""
    before = next(dump.glob("*before_priority-fusion.txt")).read_text()
    ids: dict[str, int] = {}
    alias: dict[str, str] = {}
    scalars: set[str] = set()
    nodes: list[Node] = []
    inputs: dict[int, tuple[int, int]] = {}
    outputs: set[int] = set()
    shapes: dict[str, tuple[int, ...]] = {}

    def tid(name: str) -> int:
        return ids.setdefault(alias.get(name, name), len(ids))
    for line in _entry(before):
        m = re.match(r"\s*(ROOT )?%([\w.\-]+) = (\(.*?\)|\w+\[[\d,]*\]\S*) ([\w\-]+)\((.*?)\)(.*)", line)
        if not m:
            continue
        root, name, shape, opcode, args, rest = m.groups()
        ms = re.match(r"(\w+)\[([\d,]*)\]", shape)
        dims = tuple(int(d) for d in ms.group(2).split(",") if d) if ms and not shape.startswith("(") else ()
        size = math.prod(dims) if ms and not shape.startswith("(") else 0
        nbytes = size * _ITEMSIZE.get(ms.group(1), 4) if ms else 0
        operands = [a for a in re.findall(r"%([\w.\-]+)", args) if a not in scalars]
        shapes[name] = dims
        if opcode == "constant" and size <= 1:
            scalars.add(name)
            continue
        if opcode == "bitcast":
            alias[name] = alias.get(operands[0], operands[0])
        elif opcode in _OPAQUE or opcode == "fusion" and "kCustom" in rest:
            inputs[tid(name)] = (size, nbytes)
            outputs.update(tid(o) for o in operands if alias.get(o, o) in ids)   # read by a kernel as a buffer
        else:
            kind = _KIND.get(opcode, "elementwise")
            window = tuple((int(a), int(b)) for a, b in re.findall(r"\[(\d+):(\d+)(?::\d+)?\]", rest)) \
                if opcode == "slice" else ()
            per = (cycles(opcode, nbytes // max(size, 1)) if kind == "elementwise" else
                   cycles("add", nbytes // max(size, 1)) if kind == "reduce" else 3)
            if kind == "concatenate":
                axis = int(re.search(r"dimensions=\{(\d+)\}", rest).group(1))
                per = concatenate_cycles(axis, shapes[operands[0]][axis])
            nodes.append(Node(tid(name), kind, size, nbytes, tuple(tid(o) for o in operands), dims, per, window))
        if root:
            outputs.add(tid(name))
    node_ids = {n.id for n in nodes}
    first: dict[str, float] = {}
    steps = re.findall(r"fusion_steps \{\n(.*?)\n\}\n", next(dump.glob("*priority_fusion_dump.txt")).read_text(), re.S)
    for step in steps:
        if step.strip().startswith("fusion {"):
            break
        if step.strip().startswith("update_priority"):
            producer = re.search(r'producer_name: "([^"]+)"', step).group(1)
            fused = float(re.search(r"us_fused: ([-\d.e+]+)", step).group(1))
            unfused = float(re.search(r"us_unfused: ([-\d.e+]+)", step).group(1))
            first.setdefault(producer, unfused - fused)
    after = _entry(next(dump.glob("*after_priority-fusion*.txt")).read_text())
    kernels = sum(1 for line in after if re.search(r"= \S+ (fusion|[a-z\-]+)\(", line) and " fusion(" in line
                  and "kCustom" not in line)
    compiled = "\n".join(_entry(next(dump.glob("*gpu_after_optimizations.txt")).read_text()))
    return Program(tuple(nodes), inputs, frozenset(outputs & node_ids), {v: k for k, v in ids.items()}, first,
                   kernels, len(re.findall(r"kind=k(?:Loop|Input)", compiled)))


def simulated_priorities(program: Program) -> dict[str, float]:
    """The simulation's first priority for each producer XLA priced (us)."""
    nbytes = {e: b for e, (_, b) in program.inputs.items()}
    sizes = {e: n for e, (n, _) in program.inputs.items()}
    for n in program.nodes:
        nbytes[n.id], sizes[n.id] = n.nbytes, n.size
    insts = {n.id: _Fusion({0: (n, [(False, x) for x in n.operands])}, 0, n.id, sizes, k)
             for k, n in enumerate(program.nodes)}
    users: dict[int, list[int]] = {}
    for f in insts.values():
        for e in f.ext:
            users.setdefault(e, []).append(f.name)
    out = {}
    for i, f in insts.items():
        name, cs = program.names[i], users.get(i, [])
        if name not in program.first_priorities or not cs:
            continue
        unfused = H100.launch_s * (len(cs) + 1) + _run_s(f, nbytes, H100) + sum(_run_s(insts[c], nbytes, H100) for c in cs)
        fused = H100.launch_s * len(cs) + sum(_fused_s(f, insts[c], nbytes, H100) for c in cs)
        out[name] = (unfused - fused) * 1e6
    return out


def simulated_kernels(program: Program) -> tuple[int, int]:
    """The simulation's kernels after priority fusion and after multi-output fusion."""
    kernels = fuse(program.nodes, program.inputs, program.outputs)
    return sum(len(k.writes) for k in kernels), len(kernels)


def compile_with_dump(fn: Callable, args: Sequence[Any], where: Path) -> Path:
    """Compile ``fn`` (a function, wrapped in ``jax.jit``, or anything with ``lower``: a
    ``vtc_jax.optimize`` object) deviceless for an H100, XLA dumping its priority fusion to ``where``."""
    import warnings

    import jax

    from vtc_jax.offline import cuda_lowering, h100_device
    sharding = jax.sharding.SingleDeviceSharding(h100_device())
    sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    target = fn if hasattr(fn, "lower") else jax.jit(fn)
    with cuda_lowering(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        target.lower(*sds).compile(compiler_options={
            "xla_dump_to": str(where), "xla_dump_hlo_pass_re": "priority-fusion"})
    return where


def linear_recurrence(a: Any, b: Any) -> Any:
    """h_t = a_t h_{t-1} + b_t by ``lax.associative_scan`` (Mamba's and RG-LRU's scan)."""
    import jax
    return jax.lax.associative_scan(lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1]), (a, b), axis=0)[1]


def recurrence_args(steps: int, width: int) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp
    return (jax.ShapeDtypeStruct((steps, width), jnp.float32),) * 2


@dataclass(frozen=True)
class Row:
    """One program: the simulation's prices and kernels against XLA's."""
    name: str
    priced: int
    worst: float           # the largest difference of a first priority, us
    worst_at: str
    xla_after_priority: int
    after_priority: int
    compiled: int
    simulated: int

    def __str__(self) -> str:
        return (f"| {self.name} | {self.priced} | {self.worst:.3f} ({self.worst_at}) | {self.xla_after_priority} / "
                f"{self.after_priority} | {self.compiled} / {self.simulated} |")


def report(name: str, dump: Path) -> Row:
    """The simulation on the program XLA dumped to ``dump``, against XLA."""
    program = read_program(dump)
    mine = simulated_priorities(program)
    worst = max(((abs(mine[k] - v), k) for k, v in program.first_priorities.items() if k in mine), default=(0.0, ""))
    after_priority, after_multi = simulated_kernels(program)
    return Row(name, len(mine), worst[0], worst[1], program.after_priority, after_priority,
               program.after_multi_output, after_multi)


HEADER = ("| program | producers priced | largest priority difference, us (producer) | kernels after priority "
          "fusion: XLA / simulated | loop and input fusions compiled / simulated |\n| --- | ---: | --- | ---: | ---: |")
GRID = [(512, 256), (512, 65536), (2048, 1024), (2048, 2048), (2048, 4096), (2048, 8192), (2048, 65536),
        (8192, 4096), (8192, 65536)]


BEGIN, END = "<!-- priority_fusion:begin -->", "<!-- priority_fusion:end -->"
SCANS = ["corpus mamba_selective_scan", "corpus rglru_equinox"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recurrence", nargs=2, type=int, action="append", metavar=("STEPS", "WIDTH"), default=[])
    p.add_argument("--grid", action="store_true", help="the linear recurrence at the widths of the table")
    p.add_argument("--corpus", action="append", default=[], help="a program of benchmarks/guard.py's corpus")
    p.add_argument("--vtc", action="store_true", help="with --corpus: VTC's unguarded program too")
    p.add_argument("--write", action="store_true", help="the grid and the corpus's scans, into BENCHMARKS.md")
    a = p.parse_args()
    print(HEADER)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vtc-priority-") as tmp:
        recurrences = (GRID if a.grid or a.write else []) + [tuple(x) for x in a.recurrence]
        for steps, width in recurrences:
            where = compile_with_dump(linear_recurrence, recurrence_args(steps, width), Path(tmp) / f"r{steps}_{width}")
            rows.append(report(f"linear recurrence, {steps:,} steps x {width:,}", where))
            print(str(rows[-1]), flush=True)
        for name in a.corpus + (SCANS if a.write else []):
            import guard as corpus_guard

            import vtc_jax
            step, make_args, donate = corpus_guard.corpus()[name]
            programs = [(name, step)]
            if a.vtc or a.write:   # VTC's program: its kernels, and the scan left to XLA
                programs.append((f"{name}, VTC unguarded",
                                 vtc_jax.optimize(step, backend="triton", guard=None, donate_argnums=donate)))
            for label, fn in programs:
                where = compile_with_dump(fn, make_args(), Path(tmp) / re.sub(r"\W", "_", label))
                rows.append(report(label, where))
                print(str(rows[-1]), flush=True)
    if a.write:
        import jax
        from blocks import write_block
        grid, scans = rows[:len(recurrences)], rows[len(recurrences):]
        write_block("\n".join([
            BEGIN, "## XLA's priority fusion, simulated (compiled, deviceless H100)", "",
            f"`JAX_PLATFORMS=cpu python benchmarks/priority_fusion.py --write`. Python {platform.python_version()}, "
            f"jax {jax.__version__}, on {platform.machine()} ({os.cpu_count()} cores), no GPU.", "",
            "Why the model of XLA (`vtc_jax/xla.py`) is off on Mamba's scan (the guard's only program outside "
            "±1 launch), read off XLA's own priority-fusion dump: each program compiled with "
            "`--xla_dump_hlo_pass_re=priority-fusion`, and XLA's priority fusion simulated on the HLO the pass "
            "fused, with XLA's performance model (the script's docstring has the sources). The pass refused no "
            "fusion for code size (its only ineligibility reason: \"No users to fuse\"): no bound on emissions "
            "is XLA's rule, the prices are. On the linear recurrence the simulation's first price for each "
            f"producer agrees with XLA's to {max(r.worst for r in grid):.3f} µs, and its kernels are the "
            f"compile's within one on {sum(abs(r.simulated - r.compiled) <= 1 for r in grid)} of {len(grid)} "
            f"widths ({', '.join(f'{r.compiled}/{r.simulated}' for r in grid)}, compiled/simulated). On the "
            "corpus's scans, plain jit and VTC's program: loop and input fusions compiled/simulated "
            f"{', '.join(f'{r.compiled}/{r.simulated}' for r in scans)} ({'; '.join(r.name for r in scans)}). "
            f"Mamba's largest first-price difference ({scans[0].worst:.0f} µs, {scans[0].worst_at}) is on a "
            "producer a GEMM reads through a bitcast (XLA prices the bitcast as a user; neither fuses it). The "
            "simulation runs on XLA's HLO here; it is not the model's rule yet.", "",
            HEADER, *map(str, rows), END]), BEGIN, END, after="<!-- guard:end -->")
    elif not rows:
        p.print_help()


if __name__ == "__main__":
    main()
