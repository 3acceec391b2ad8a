"""What XLA does with the program VTC leaves it: the one model of XLA's behaviour.

Every stage that has to predict XLA reads it here, not from a model of its own:

* **facts** (:class:`Facts`): bytes per tensor, producer and reader clusters, which movement ops
  XLA runs as free bitcasts, which ``dynamic_update_slice`` it runs in place and which it must
  copy first (a graph input not donated, a graph output, an operand read again later);
* **fusion** (:func:`pointwise_islands`, :func:`xla_fuses`): element-wise work XLA fuses with the
  movement between it into one loop fusion, casts it folds into a neighbour — read by
  ``selection`` to leave such clusters to XLA;
* **plain jit** (:func:`xla_plain`): launches and bytes of ``jax.jit(fn)`` as XLA's GPU pipeline
  fuses it (library calls and their layouts included) — the baseline ``accounting`` reports and
  BENCHMARKS.md checks against XLA's own compile (``benchmarks/compiled.py``).

Why one module: these rules used to live in the cost model and in the accounting, with different
cast lists, so the two predicted different programs for the same jit. One list (:data:`CAST_ONLY`)
and one set of facts now serve both. Everything here is a model read off XLA's compiled programs;
``tests/test_costmodel.py`` holds it against the examples' deviceless H100 compile.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax import lax

from .cluster import Cluster, cluster
from .compat import (XLA_BROADCASTS_BIAS_OF_MERGED_GEMMS, XLA_COPIES_PART_OF_ROWS, XLA_COPIES_SCATTERED_CACHE_AGAIN,
                     XLA_DOT_MERGER_JOINS_ONE_WITHIN, XLA_DOT_MERGER_MAX_BYTES, XLA_EPILOGUE_READS_OTHER_GEMMS,
                     XLA_GEMM_REORDERS_BATCHES, XLA_MASKS_REGROUPED_SCORES_APART, XLA_RELAYS_SPLIT_FREE_RHS, XLA_STABLE_SORT_ADDS_IOTA_TO_AN_IOTA,
                     XLA_TRANSPOSES_REPEATED_VALUES, XLA_WRITES_ESCAPING_ROW_SCALE, XLA_WRITES_REPEATED_GEMM_OPERANDS)
from .graph import Graph, Speculated, is_extended
from .kernels.tiling import resolve_precision
from .primitives import (KERNEL_CALLS, TABLE, Kind, Role, data_inputs, inplace_operand, is_expensive, is_fill,
                         is_view, kernel_aliases, kernel_reads_in_place)
from .templates import TEMPLATES, Match
from .xla_priority import Fused, Problem, canonical, concatenate_cycles
from .xla_priority import Node as PriorityNode
from .xla_priority import cycles as priority_cycles

__all__ = ["xla_clusters", "Facts", "LIBRARY_KINDS", "CAST_ONLY", "MATH_CLASSES", "Fusion", "Price", "op_flops", "math_class",
           "pointwise_islands", "xla_fuses", "xla_plain", "xla_program"]

LIBRARY_KINDS = frozenset(k for k, t in TEMPLATES.items() if t.library)   # XLA calls cuBLAS / cuDNN
# A normalisation (statistics over a row applied back to it: RMSNorm, LayerNorm, softmax) of at
# least two rows of at most this many elements is one launch: XLA's Triton normalization fusion.
# One row is a reduction fusion per statistic plus a loop fusion applying them; longer rows a
# reduction plus the loop fusion (see the norm rule in xla_program). Read off the deviceless H100
# compile, jax 0.10.2 and 0.12 alike (RMSNorm and LayerNorm, rows 1 / 2 / 16 / 512 of 512 ...
# 16,384: one launch from 2 rows on; one row 2 and 3 launches).
TRITON_NORM_MAX_ROW = 16384
# A norm whose statistics are reduced side by side from the rows (flax's LayerNorm: the mean and
# the mean of squares, E[x²] − E[x]²) is no Triton fusion: one reduction fusion writing both, a
# loop fusion computing each row's scale, a loop fusion applying it — three launches for rows
# longer than this; up to it the scale is computed in the applying fusion (two). Read off the
# deviceless H100 compile of 50,176 rows of 64-768.
XLA_NORM_ROW_FUSED_MAX = 64
# A softmax over rows read through a reshape of a flat (1-D) buffer — a Pallas kernel's result,
# a flat argument — whose length is not a power of two and at most this is two Triton fusions,
# not one: the first writes ``x - max(x)``, the second the rest. Read off the deviceless H100
# compile of ``softmax(flat.reshape(n, r))``: r of 12-320 two launches; 336-3,000 and powers of
# two one.
XLA_FLAT_NORM_SPLIT_MAX_ROW = 320
# XLA's priority fusion repeats an expensive producer (``exp``, a division, ``cos``) inside the
# fusions reading it only while the work repeated costs less than writing the producer out and
# reading it back: with ``E`` elements computed by its readers from ``N`` of its own, of ``b``
# bytes each, it is written out (a loop fusion of its own) when
#     (E - N) * sum(1 / XLA_REPEATED_EXPENSIVE_MAX[op] for each expensive op of the chain)
#         > 1 + 2 * N * b / XLA_LAUNCH_BYTES
# (:func:`repeats_too_much`): the per-op bound is the repeated elements that cost one launch (XLA's
# ``kKernelLaunchOverhead``, 1 us), ``XLA_LAUNCH_BYTES`` the bytes the H100's DRAM moves in that
# time. Read off the deviceless H100 compile (both jax versions): a per-row ``f(s)`` broadcast into
# ``sum(d * f(s)[:, None] * e)`` over rows of 1,024 gives the bounds (rows of 256-4,096 move them by
# about one Mi); ``exp(x)[:, None, :] * z`` over ``x`` of 256 Ki, 1 Mi and 4 Mi elements is written
# out from a reuse of 97-112, 57-64 and 41-48 (the formula: 106, 57, 46); a decode RoPE table at
# ``pos`` read by q and k at batch 1 (5 Ki elements) is recomputed in them, at batch 16 (80 Ki) a
# loop fusion of its own. The small bounds depend on the fusion around them: ``cos`` is 48-64 Ki
# in a reduction, 62-64 Ki in RoPE's concatenation, 96-128 Ki reading a buffer; ``sin`` in RoPE
# 64-96 Ki (the flax Gemma-2 layer at batch 16 recomputes it over 96 Ki where ``cos`` is written
# out: a launch the model counts over); ``tanh`` 64-96 Ki in a reduction, past 128 Ki reading a
# buffer. Each bound is its RoPE or reduction reading; an expensive op not listed (``sin``,
# ``pow``, ``erf``) is taken as ``cos``.
XLA_REPEATED_EXPENSIVE_MAX = {"div": 13 << 20, "integer_pow": 13 << 20, "exp": 16 << 20, "rsqrt": 17 << 20,
                              "sqrt": 17 << 20, "log": 3 << 20, "logistic": 6 << 20, "tanh": 80 << 10}
XLA_REPEATED_EXPENSIVE_DEFAULT = 64 << 10
XLA_LAUNCH_BYTES = 3_350_000
# The model writes out a value of a loop fusion once the fusion would emit it more than this many
# times (each distinct indexing of a value — a slice, a pad, a concatenation reading it — emits it
# again): an associative scan's tree of strided slices is a fusion every level or two instead of
# one. A proxy, not XLA's rule: XLA's priority fusion (jax 0.10.2) refuses no fusion for code size
# on these trees; it fuses producers greedily by the time its GPU performance model says each
# fusion saves (a launch 1 us against the operands every reader re-reads), so the tree is cut
# more the wider each step. So the bound only says *that* an island is a tree XLA cuts: where,
# and into how many kernels, is XLA's priority fusion replayed (``simulated``, with
# :mod:`xla_priority`: Mamba's 65,536-wide scan 33 launches modelled against 32 compiled, where the
# bound gave 27; ``benchmarks/priority_fusion.py`` checks the simulation against XLA's dump).
CODE_DUPLICATION = 15
# jaxpr primitives whose HLO opcode is named otherwise (the flops of ``xla_priority.cycles`` are by opcode)
HLO_OPCODE = {"mul": "multiply", "sub": "subtract", "div": "divide", "exp": "exponential", "log1p": "log-plus-one",
              "expm1": "exponential-minus-one", "pow": "power", "cos": "cosine", "sin": "sine"}
# A column reduction (the minor axis kept: a bias's or a LayerNorm scale's gradient, BatchNorm's
# training statistics) over more than this many rows is split by XLA's tree reduction rewriter: a
# fusion reducing blocks of rows into partial sums (about sqrt(rows) of them), and one reducing
# those, which takes no epilogue (a mean's division is a loop fusion of its own). Read off the
# deviceless H100 compile, jax 0.10.2 and 0.12 alike: (R, 768) sums are one launch up to R = 4,096
# and two from 4,097; (8,192, C) two for C from 8 to 3,072 (C = 1 is a row).
XLA_COLUMN_TREE_MIN_ROWS = 4096
# a GEMM with at least this many rows takes an element-wise consumer as its epilogue (:func:`_epilogue_gemm`)
GEMM_EPILOGUE_MIN_ROWS = 512
# a PRNG counter vector (:func:`_prng_launches`) read more than this many times per element is a
# loop fusion of its own: between the compiles' 1,024 (a (512, 1024) mask: fused) and 2,048 (two
# such masks sharing it: written out)
PRNG_COUNTER_REUSE = 1024
# what a launch of scalar-sized work (a key schedule, a counter vector) moves, for its bytes
SMALL_LAUNCH_BYTES = 64
_NEVER_IN_A_LOOP = frozenset({Kind.MATMUL, Kind.CONV, Kind.ATTENTION})   # launches no loop fusion absorbs


class Facts:
    """What XLA makes of (graph, clusters, donated inputs), computed once: tensor bytes, producer
    and reader cluster positions, free bitcasts, in-place updates and the copies XLA adds first.

    ``base[op]`` is a movement op's HBM traffic run on its own: ``dynamic_update_slice`` writes its
    update in place (``2 * update``) plus ``2 * operand`` where XLA must copy the operand; any other
    op writes its outputs and reads at most as much (a slice reads what it keeps)."""

    def __init__(self, graph: Graph, clusters: Sequence[Cluster], donated: Iterable[int] = ()) -> None:
        self.graph, self.clusters = graph, tuple(clusters)
        self.donated = donated = frozenset(donated)
        self.nbytes = [int(t.size) * t.dtype.itemsize for t in graph.tensors]
        self.itemsize = [t.dtype.itemsize for t in graph.tensors]
        self.pos = {oid: k for k, c in enumerate(self.clusters) for oid in c.ops}
        self.producer: dict[int, int] = {}
        self.users: dict[int, list[int]] = {}
        for k, c in enumerate(self.clusters):
            for t in c.outputs:
                self.producer[t] = k
            for t in c.inputs:
                self.users.setdefault(t, []).append(k)
        outs = set(graph.outputs)
        ins = set(graph.inputs) | {t.id for t in graph.tensors if t.const is not None}
        self.bitcast: dict[int, bool] = {}
        self.dus_copy: dict[int, bool] = {}
        self.base: dict[int, int] = {}
        for c in self.clusters:
            if c.kind != Kind.MOVEMENT:
                continue
            for oid in c.ops:
                op = graph.ops[oid]
                self.bitcast[oid] = is_view(op, graph)
                k_inplace = inplace_operand(op.primitive)
                if k_inplace is not None:
                    operand = op.inputs[k_inplace]
                    later = any(self.pos.get(u.id, u.id) > self.pos.get(oid, oid)
                                for u in graph.consumers(operand) if u.id != oid)
                    if operand in donated:   # XLA updates a donated input buffer in place
                        self.dus_copy[oid] = later or operand in outs
                    else:
                        self.dus_copy[oid] = operand in ins or operand in outs or later
                    self.base[oid] = 2 * self.update_bytes(op) + (
                        2 * self.nbytes[operand] if self.dus_copy[oid] else 0)
                else:
                    w = sum(self.nbytes[t] for t in op.outputs)
                    r = sum(self.nbytes[t] for t in data_inputs(op))
                    self.base[oid] = w + min(r, w)


    def update_bytes(self, op: Any) -> int:
        """What an in-place update writes: its data operands other than the updated buffer (a
        DUS's update, a scatter's updates)."""
        k = inplace_operand(op.primitive)
        return sum(self.nbytes[t] for j, t in enumerate(op.inputs) if j != k and t in data_inputs(op))


# Primitives a pointwise cluster may consist of and still be "only a cast": XLA fuses such a cluster
# into whatever fusion produces or consumes its tensors, so a kernel of its own is a pure loss.
# (the table's free-view rows: a cast, a broadcast, a reshape, a squeeze, a copy)
CAST_ONLY = frozenset(n for n, r in TABLE.items() if r.view)


def pointwise_islands(graph: Graph, clusters: Sequence[Cluster],
                      matches: Mapping[int, Any]) -> list[list[int]]:
    """Groups (two or more) of matched pointwise clusters joined to each other only through
    movement clusters: RoPE's convert/mul, neg and mul/add joined by slices and a concat; or
    feeding one concat/stack (a complex RoPE's real and imaginary parts); or of one shape, each
    output only the update of a dynamic_update_slice (a decode step's K and V cache rows). XLA
    runs each group as one loop fusion; ``cluster.fuse_islands`` makes each one kernel."""
    cl_of_tensor: dict[int, Cluster] = {}
    for c in clusters:
        for t in c.outputs:
            cl_of_tensor[t] = c
    ops = {op.id: op for op in graph.ops}
    kernels = {c.id: c for c in clusters
               if c.kind == Kind.POINTWISE and isinstance(matches.get(c.id), Match)}
    parent = {k: k for k in kernels}

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def upstream_kernels(t: int, seen: set[int]) -> set[int]:
        """Pointwise kernels reachable from tensor ``t`` upwards through movement clusters only."""
        c = cl_of_tensor.get(t)
        if c is None or c.id in seen:
            return set()
        seen.add(c.id)
        if c.id in kernels:
            return {c.id}
        if c.kind != Kind.MOVEMENT:
            return set()
        found: set[int] = set()
        for o in c.ops:
            for x in data_inputs(ops[o]):
                found |= upstream_kernels(x, seen)
        return found

    for k, c in kernels.items():
        for t in c.inputs:
            p = cl_of_tensor.get(t)
            if p is None or p.kind != Kind.MOVEMENT:
                continue   # a direct pointwise→pointwise edge would have been one cluster
            for q in upstream_kernels(t, set()):
                parent[find(q)] = find(k)
    for c in clusters:   # siblings joined by a concat/stack (a complex RoPE's real and imag parts)
        if c.kind != Kind.MOVEMENT or len(c.inputs) < 2:
            continue
        found = set()
        for o in c.ops:
            for x in data_inputs(ops[o]):
                found |= upstream_kernels(x, set())
        found = sorted(found)
        for q in found[1:]:
            parent[find(q)] = find(found[0])
    # one step's cache rows: kernels whose every output is the update of a dynamic_update_slice
    # (through movement only) and of one shape — a decode step's K row (RoPE) and V row — write
    # their rows from one launch, as XLA's horizontal fusion would (fuse_islands refuses a group
    # whose contraction closes a cycle)
    # (only writers independent of each other: layer i's rows and layer j's are joined through
    # the attention between them, and one launch cannot hold both)
    rows: dict[tuple[int, ...], list[list[int]]] = {}
    upstream: dict[int, set[int]] = {}
    for k, c in kernels.items():
        if not c.outputs or not all(_feeds_update(graph, cl_of_tensor, t) for t in c.outputs):
            continue
        shapes = {tuple(graph.tensors[t].shape) for t in c.outputs}
        if len(shapes) != 1:
            continue
        upstream[k] = _ancestors(graph, c.ops)
        for group in (groups := rows.setdefault(shapes.pop(), [])):
            if all(not (set(kernels[q].ops) & upstream[k]) and not (set(c.ops) & upstream[q]) for q in group):
                group.append(k)
                break
        else:
            groups.append([k])
    for group in (g for gs in rows.values() for g in gs):
        for q in group[1:]:
            parent[find(q)] = find(group[0])
    islands: dict[int, list[int]] = {}
    for k in kernels:
        islands.setdefault(find(k), []).append(k)
    return [sorted(m) for m in islands.values() if len(m) > 1]


def _ancestors(graph: Graph, ops: Sequence[int]) -> set[int]:
    """Ids of the ops upstream of ``ops`` (not ``ops`` themselves, unless on a path between them)."""
    seen: set[int] = set()
    stack = [t for o in ops for t in graph.ops[o].inputs]
    while stack:
        p = graph.producer(stack.pop())
        if p is not None and p.id not in seen:
            seen.add(p.id)
            stack.extend(p.inputs)
    return seen


def _feeds_update(graph: Graph, cl_of_tensor: Mapping[int, Cluster], t: int, depth: int = 0) -> bool:
    """Is every use of ``t`` the update of a dynamic_update_slice, directly or through movement
    clusters only (a cast to the cache's dtype, a reshape to the window)?"""
    users = graph.consumers(t)
    if not users or t in graph.outputs or depth > 8:
        return False
    for u in users:
        if u.primitive == "dynamic_update_slice":
            if len(u.inputs) < 2 or u.inputs[1] != t or u.inputs[0] == t:
                return False
            continue
        c = cl_of_tensor.get(u.outputs[0]) if u.outputs else None
        if c is None or c.kind != Kind.MOVEMENT or not all(
                _feeds_update(graph, cl_of_tensor, y, depth + 1) for y in u.outputs):
            return False
    return True


def xla_fuses(graph: Graph, clusters: Sequence[Cluster], matches: Mapping[int, Any],
              not_fused: Mapping[int, str] | None = None) -> dict[int, str]:
    """Pointwise clusters better left to XLA than made Pallas kernels: ``{cluster id: why}``.

    Why: every Pallas kernel is an opaque custom call that XLA fuses nothing into, while XLA itself
    fuses element-wise ops *together with* the slices, concats, broadcasts, reshapes and transposes
    between them (a loop fusion reads its operands through the movement ops' index maps — what VTC
    does for compute kernels). So for element-wise work the virtual tensors VTC would introduce buy
    nothing XLA does not already get, and the lowering's one-kernel-per-cluster costs launches
    (found in XLA's H100 compile, BENCHMARKS.md: RoPE became six Pallas kernels where XLA emits one
    concatenate fusion, and a lone bf16→f32 cast of a norm weight became a kernel XLA folds into
    the norm's reduction fusion). Two rules, both structural (no size threshold, so small test
    programs and paper-size ones are planned alike):

    * **pointwise islands** — matched pointwise clusters connected to each other only through
      movement clusters (RoPE: convert/mul, neg and mul/add joined by slices and a concat) that
      ``cluster.fuse_islands`` could not make one cluster (``not_fused``: why, keyed by the
      island's smallest op id): VTC would launch one kernel per cluster, XLA one loop fusion for
      the island. All of them go to XLA. A lone pointwise cluster (an island of one) keeps its kernel: one launch either way, and
      its virtual reads can still save a copy XLA would make.
    * **lone casts** — a pointwise cluster made only of casts/broadcasts/reshapes: XLA fuses it
      into its producer's or consumer's fusion (zero launches); a kernel costs one.
    * **parameter transforms** — a pointwise cluster reading only vectors passed in (and
      constants): Gemma's ``1 + w`` norm scale; XLA recomputes it inside the norm's fusion.

    Clusters the templates already rejected are not listed (they go to XLA anyway).
    """
    ops = {op.id: op for op in graph.ops}
    kernels = {c.id: c for c in clusters
               if c.kind == Kind.POINTWISE and isinstance(matches.get(c.id), Match)}
    out: dict[int, str] = {}
    for members in pointwise_islands(graph, clusters, matches):
        why = (not_fused or {}).get(min(o for k in members for o in kernels[k].ops))
        for k in members:
            out[k] = (f"XLA fuses it with {len(members) - 1} more pointwise cluster(s) "
                      f"({', '.join(f'#{m}' for m in sorted(members) if m != k)}) and the movement "
                      "between them into one loop fusion; Pallas would launch one kernel each"
                      + (f" (not one cluster here: {why})" if why else ""))
    inputs = set(graph.inputs)
    for k, c in kernels.items():
        if k in out:
            continue
        if all(ops[o].primitive in CAST_ONLY for o in c.ops):
            out[k] = "only casts/broadcasts: XLA fuses it into a neighbouring fusion (no launch of its own)"
        elif all((t in inputs and len(graph.tensors[t].shape) <= 1) or graph.tensors[t].const is not None
                 for t in c.inputs):
            out[k] = ("a per-channel parameter transform (1 + w, a cast of a weight vector): XLA folds it "
                      "into the fusion that reads it (no launch of its own)")
    return out


# --------------------------------------------------------------------------------------------
# Math: the flops of a dot / convolution and the units that run them
# --------------------------------------------------------------------------------------------

# How a GPU runs a dot's multiply-adds: 16-bit tensor cores ("bf16", f16 too), f32 operands on
# TF32 tensor cores ("tf32": XLA's default for f32 on Ampere and later), or IEEE f32 FMAs on the
# CUDA cores ("ieee": ``Precision.HIGHEST``). Throughput differs by up to 15x between them.
MATH_CLASSES = ("bf16", "tf32", "ieee")


def op_flops(op: Any, graph: Graph) -> int:
    """Multiply-adds × 2 of a ``dot_general`` or ``conv_general_dilated`` (0 for anything else)."""
    out = graph.tensors[op.outputs[0]]
    if op.primitive == "dot_general":
        (lc, _), _ = op.params["dimension_numbers"]
        lhs = graph.tensors[op.inputs[0]].shape
        return 2 * out.size * math.prod(lhs[d] for d in lc)
    if op.primitive == "conv_general_dilated":
        rhs = graph.tensors[op.inputs[1]].shape
        dn = op.params.get("dimension_numbers")
        o = dn.rhs_spec[0] if dn is not None and hasattr(dn, "rhs_spec") else 0
        return 2 * out.size * math.prod(rhs) // max(1, rhs[o])
    return 0


def math_class(dtype: Any, precision: Any) -> str:
    """The :data:`MATH_CLASSES` entry a dot of ``dtype`` operands runs in at ``precision`` (an op's
    param, resolved as XLA and the kernels resolve it: :func:`kernels.tiling.resolve_precision`):
    16-bit types on tensor cores; f32 on TF32 tensor cores unless it resolves to ``HIGHEST`` or an
    f32 algorithm."""
    if np.dtype(dtype).itemsize < 4:
        return "bf16"
    p = resolve_precision(precision)
    if p == lax.Precision.HIGHEST or "F32_F32_F32" in str(p):
        return "ieee"
    return "tf32"


def _op_math(op: Any, graph: Graph) -> str:
    return math_class(graph.tensors[op.inputs[0]].dtype, op.params.get("precision"))


@dataclass(frozen=True)
class Fusion:
    """One launch group of the modelled program: the clusters (positions) XLA runs together, and
    the math it does (``flops`` on ``engine`` — "xla" for XLA's GEMMs / cuDNN, a template name
    for a Pallas kernel — in ``math``, one of :data:`MATH_CLASSES`)."""
    clusters: tuple[int, ...]
    what: str            # "loop", "gemm", "conv", "reduction", "kernel", "copy", "update", "layout", ...
    launches: int
    bytes: int
    flops: int = 0
    engine: str = "xla"
    math: str = ""
    # sector traffic beyond ``bytes``: a kernel's tensors read or written through strided virtual
    # maps (``costmodel.kernel_waste``). Not a buffer byte (the compile's count has none of it),
    # but time at HBM bandwidth all the same
    waste: int = 0
    # the tensors of the modelled graph this group writes out (what a reader of the listing needs
    # to match it against the compile's fusions)
    made: tuple[int, ...] = ()

    def memory_seconds(self, gpu: Any) -> float:
        return (self.bytes + self.waste) / gpu.hbm_bandwidth


@dataclass(frozen=True)
class Price:
    """What XLA makes of a program, modelled: launches, HBM bytes (the compile's buffer-level
    definition: every buffer a launch reads plus every buffer it writes, a buffer updated in place
    charged only what is written) and buffer memory (arguments + outputs + the peak of the
    temporaries live at once − donated inputs aliased to outputs), with the launch groups."""
    launches: int
    bytes: int
    buffers: int
    fusions: tuple[Fusion, ...] = ()

    def compute_seconds(self, gpu: Any) -> float:
        """What math adds to the memory time: each launch group runs for the longer of its bytes at
        HBM bandwidth and its flops at what its engine achieves (``gpu.flop_rate``); the excess
        over the bytes is the math's share."""
        return sum(max(0.0, f.flops / gpu.flop_rate(f.engine, f.math) - f.memory_seconds(gpu))
                   for f in self.fusions if f.flops)

    def waste_seconds(self, gpu: Any) -> float:
        """The sector traffic of the kernels' strided reads and writes (:attr:`Fusion.waste`)."""
        return sum(f.waste for f in self.fusions) / gpu.hbm_bandwidth

    def seconds(self, gpu: Any) -> float:
        """The roofline time the guard compares: bytes at HBM bandwidth, a fixed cost per launch,
        the sectors the kernels' strided accesses waste, and the time the compute-bound launch
        groups take beyond their memory time."""
        return (self.bytes / gpu.hbm_bandwidth + self.launches * gpu.launch_overhead
                + self.waste_seconds(gpu) + self.compute_seconds(gpu))


# XLA's GPU sort emitter (read off the deviceless H100 compile, jax 0.10.2 and 0.12): one block
# sorts a tile of up to 4096 elements (all operands) in its 48 KiB of shared memory, halved until
# they fit; each merge stage beyond the tile is one launch per comparison distance the tile cannot
# hold, plus one for those it can. A stable sort gets one more int32 operand (an iota: XLA's
# stable-sort expander).
SORTS = ("sort", "top_k")
SORT_TILE_ELEMENTS = 4096
SORT_TILE_BYTES = 48 * 1024
# ``lax.top_k`` with k <= 16 on rows of >= 1024 runs XLA's one-launch top-k kernel; otherwise a sort
TOPK_KERNEL_MAX_K, TOPK_KERNEL_MIN_ROW = 16, 1024


# XLA's dot merger joins sibling dots only within compat.XLA_DOT_MERGER_MAX_BYTES (what it bounds
# per jax version: there; a prefill's Q/K/V at 16 x 4096 tokens stay three GEMMs, a decode
# step's are one)
DOT_MERGER_MAX_BYTES = XLA_DOT_MERGER_MAX_BYTES
# The merged GEMM's fusion concatenates its weights in its operand where each is a multiple of
# this many columns wide (Llama's 4,096 + 1,024 + 1,024: one launch); a narrower one (LoRA's
# rank-16 A matrices) makes the concatenation a launch of its own (``wrapped_concatenate``; read
# off the deviceless H100 compiles of both)
XLA_CONCAT_IN_GEMM_MULTIPLE = 64

# ``jnp.cumsum`` and its kin on the GPU: XLA rewrites a scan along a long axis into a tree of
# reduce-windows (its ``ReduceWindowRewriter``), more launches the longer the axis. The launches
# by the scanned length, read off the H100 compile of a 16-row f32 cumsum: up to 128 one, up to
# 2,049 two, 8,192 three, 65,536 four, 262,144 five, longer (1M) six.
CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
CUMULATIVE_LAUNCHES = ((128, 1), (2049, 2), (8192, 3), (65536, 4), (262144, 5))


def cumulative_launches(n: int) -> int:
    """Launches of XLA's scan of length ``n`` (:data:`CUMULATIVE_LAUNCHES`; 6 beyond them)."""
    return next((k for bound, k in CUMULATIVE_LAUNCHES if n <= bound), 6)


def sort_launches(n: int, element_bytes: int) -> int:
    """Launches XLA's bitonic sort takes to sort rows of ``n`` elements of ``element_bytes`` (all
    operands together). Why this shape: rows padded to ``2^k``; a tile of ``2^t`` sorts in shared
    memory in one launch; each of the ``m = k - t`` stages beyond it needs one launch per distance
    ``>= 2^t`` plus one in-tile launch, so ``1 + sum_{s=1..m} (s + 1) = (m + 1)(m + 2) / 2``.
    On a GPU with CUB, XLA may rewrite a one-key sort to CUB's radix sort instead (the deviceless
    compile has no CUB data): both sides of the guard keep the same sorts, so this cancels there."""
    k = max(0, (max(1, n) - 1).bit_length())
    tile = SORT_TILE_ELEMENTS
    while tile > 1 and tile * element_bytes > SORT_TILE_BYTES:
        tile //= 2
    m = max(0, k - (tile.bit_length() - 1))
    return (m + 1) * (m + 2) // 2


def xla_plain(graph: Graph, clusters: Sequence[Cluster], donated: Iterable[int] = ()) -> dict[str, int]:
    """Launches and HBM bytes of plain ``jax.jit`` (:func:`xla_program`), as ``Report.modeled`` keys."""
    p = xla_program(graph, clusters, donated)
    return {"kernels_xla": p.launches, "bytes_xla": p.bytes}


def xla_clusters(graph: Graph) -> tuple[Cluster, ...]:
    """The groups the model of XLA starts from: :func:`cluster.cluster` without sibling
    statistics — XLA's fusions of sibling reductions are this module's own rule, and a norm's
    statistics and its normalisation are launches apart in XLA however VTC's kernel joins them."""
    return cluster(graph, siblings=False)


def xla_program(graph: Graph, clusters: Sequence[Cluster], donated: Iterable[int] = (),
                kernel_math: Sequence[tuple[int, str, str, int]] = ()) -> Price:
    """Launches, HBM bytes and buffers of a program as XLA's GPU pipeline fuses it (a model): plain
    ``jax.jit(fn)`` on ``fn``'s graph, and the program VTC emits on *its* graph, where each Pallas
    kernel is a kernel call (``Role.KERNEL``) — one model prices both sides of the guard.

    Why a model of the compile and not the unfused bound: ``bytes_baseline``/``kernels_baseline``
    charge every movement op and every cluster a kernel — an upper bound that XLA's H100 compile
    beats by 2–6× (BENCHMARKS.md). The rules, each read off XLA's compiled programs
    (``benchmarks/compiled.json``, ``benchmarks/guard.py``):

    * **movement fuses into its consumer**: a transpose / slice / concat / broadcast / reshape /
      pad costs no launch; the fusion reading it reads its source (a broadcast: its small input,
      a slice: what it keeps). It costs a launch and a write only where it is a program output
      (one launch for all the outputs filled with one constant in one shape and dtype:
      :func:`_fill_key`), or a GEMM contracts a concatenation's axis (:func:`_concatenation`).
    * **a kernel call fuses with nothing**: XLA cannot look inside a custom call, so movement
      feeding one is materialised (a bitcast excepted): fused into the producing loop fusion as
      one more output, or a copy of its own (reading every buffer behind it whole, as the
      compile counts: a slice charged the buffer it is cut from; element-wise work only a
      copied concatenation reads computed inside it; a copy that reads a kernel's result after
      it); scalar index arithmetic feeding kernels is one
      small loop fusion; a cast or prologue never folds into it. The kernel reads every buffer
      it is given, whole — an operand it updates in place only where it also loads from it
      (``primitives.kernel_reads_in_place``: the decode attention performing its cache's update)
      — and writes every output, except those aliased to an operand (``input_output_aliases``:
      in place).
    * **dynamic_update_slice is in place**: one launch writing the update (plus a copy of the
      operand where XLA must keep it: not donated, or read later).
    * **element-wise work fuses**: pointwise clusters joined directly or through movement are one
      loop fusion, unless a GEMM, convolution, attention or kernel call runs between them (the
      residual adds before and after an FFN: the fusion would depend on itself); a lone cast, and pointwise work feeding only a reduction or an update, fold
      into that consumer (input fusion / DUS fusion) — no launch of their own; so does index
      arithmetic read only as a gather's indices (jnp's negative-index
      normalisation of a block table) read once, inside the gather's fusion. A value the fusion
      computes and reads back through movement (a slice of it) costs no bytes; a value it would
      emit more than CODE_DUPLICATION times, or an expensive one its readers would repeat at a
      cost above a launch and its write and read (:func:`repeats_too_much`), is written out and
      read back, a launch more (:func:`duplicated`).
    * **GEMM / conv / reduction**: one launch each (gemm fusion, cuDNN call, input fusion), and
      one more per GEMM operand computed by an elementwise prologue (XLA's loop fusion). A GEMM
      of GEMM_EPILOGUE_MIN_ROWS rows or more (no batch axes, no split K) takes an element-wise
      epilogue that reads the product once — its cluster's own, or a consumer's (the residual
      add after a projection) whose result no GEMM reads; any other epilogue (a decode GEMM's
      bias, SiLU's ``x * sigmoid(x)``) is a loop fusion of its own, unless an element-wise
      fusion reading the result computes it, reading the product as the GEMM writes it (in the
      narrowest type along its casts). A dot with a vector side is strength-reduced to a
      reduction fusion (:func:`_strength_reduced`). A GEMM with a narrow side is split along K
      (:data:`XLA_SPLIT_K`): f32 partials, then a reduce of its own unless the one fusion
      reading the sum takes it in (a loop fusion, its epilogue's, a router's Triton softmax). cuDNN
      fuses a conv's bias + ReLU only: any other epilogue is one more loop fusion when another
      conv, a GEMM or a kernel call reads the result directly (or through bitcasts) or it is
      returned channels-last; it
      runs NHWC, so each channels-first program input a conv reads (and each output one writes)
      is transposed once (a kernel's result too), and each filter that is not OHWI up to unit
      axes (OIHW larger than 1×1 and not depthwise; flax's HWIO, any); movement in front of a
      conv (a split half, a concat, behind bitcasts too) is materialised, by a copy computing the
      element-wise work only such copies read, and a loop fusion's result a conv reads
      transposed is written in the conv's layout.
    * **PRNG**: the key schedule and the threefry counters are tiny launches of their own
      (:func:`_prng_launches`); the random bits fuse into their readers.
    * **attention left to XLA**: one fusion per reduction (the M=1 dots become reductions) and one
      element-wise fusion between each pair, ``2 n - 1``, each reading and writing the scores;
      keys-minor scores (:func:`_keys_minor`) take one Triton softmax between the two dots.
    * **norms and losses**: rows a reduction cluster makes from its statistics with cheap
      element-wise work are recomputed by their readers (:func:`_rows_recomputed`); statistics
      over rows past TRITON_NORM_MAX_ROW are trees of two launches; a full reduction's epilogue
      and a scatter's filled buffer are launches of their own — no fill where the scatter-add
      into zeros is added to a value, which XLA scatters into in place (:func:`_added_into`); a
      reduction XLA emits element by element (:func:`_elemental_reduction`) that only a scatter
      reads runs inside the scatter's fusion; a gather of single elements a reduction reads is
      a loop fusion of its own (:func:`_element_gather`), its index arithmetic inside it. A norm's backward whose row sums
      meet the forward's statistics (written by other fusions) is no Triton fusion: per depth of
      row sums a reduction fusion (joining a statistic's fusion that reduces the same rows or
      reads a common operand no GEMM makes; riding in the loop fusion writing its rows) and a
      loop fusion for the per-row scalars when they read more than one value, then the fusion
      applying them (:func:`_mixed_levels`); a cheap product reading no more than it writes is
      duplicated into its readers; a value returned twice is copied once.
    * **sibling GEMMs**: dots of one activation by weights are one GEMM (XLA's dot merger,
      :func:`joined`'s rule per jax version), split along K as the merged GEMM is.
    * **buffers**: arguments and outputs (a donated input aliased to an output counted once) plus
      the peak of the materialised intermediates, each live from its group to its last reader.
    * **math**: each group carries the flops of its dots and convolutions, on XLA's engines in
      the class its precision gives (:func:`math_class`); a kernel call carries what
      ``kernel_math`` says of it (``(flops, template, class, waste)`` per kernel call, in program
      order: the caller knows what each kernel replaced; ``waste``: the sector bytes its strided
      virtual accesses move beyond its buffers). :meth:`Price.seconds` turns them into time.
    """
    ctx = Facts(graph, clusters, donated)
    _data = data_inputs
    g, cl = graph, ctx.clusters
    outs = set(g.outputs)
    call = [bool(c.ops) and all(g.ops[o].primitive in KERNEL_CALLS for o in c.ops) for c in cl]
    # a dot XLA strength-reduces is a reduction fusion, taking its producers in like any other
    dot_reduces = {k for k, c in enumerate(cl) if c.kind == Kind.MATMUL and not call[k] and any(
        g.ops[o].primitive == "dot_general" for o in c.ops) and all(
        _strength_reduced(g, g.ops[o]) for o in c.ops if g.ops[o].primitive == "dot_general")}
    # a dot contracting nothing (an outer product over batch axes: MoE's gates times the one-hot
    # dispatch, ``einsum("bsk,bske->bske")``) is a multiply of broadcasts to XLA's algebraic
    # simplifier, element-wise work fused like any other (into the router's ``fusion_37``)
    products = {k for k, c in enumerate(cl) if c.kind == Kind.MATMUL and not call[k] and (dots := [
        g.ops[o] for o in c.ops if g.ops[o].primitive == "dot_general"]) and all(
        not any(d.params["dimension_numbers"][0]) for d in dots)}
    kind = [Kind.POINTWISE if k in products else Kind.REDUCTION if k in dot_reduces else Kind(c.kind)
            for k, c in enumerate(cl)]
    parent = list(range(len(cl)))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def is_dus(k: int) -> bool:
        return kind[k] == Kind.MOVEMENT and any(inplace_operand(g.ops[o].primitive) is not None for o in cl[k].ops)

    def scatters(k: int) -> bool:
        """Cluster ``k`` is an opaque scatter (``.at[].add``: its combiner traced opaque), which
        XLA's scatter fusion runs computing its updates inside."""
        return kind[k] == Kind.OPAQUE and all(g.ops[o].primitive.startswith("scatter") for o in cl[k].ops)

    def fused_movement(k: int) -> bool:
        return kind[k] in (Kind.MOVEMENT, Kind.GLUE) and not is_dus(k)

    def producers_through_movement(t: int, seen: set[int]) -> set[int]:
        k = ctx.producer.get(t)
        if k is None or k in seen:
            return set()
        seen.add(k)
        if not fused_movement(k):
            return {k}
        return set().union(*[producers_through_movement(x, seen) for o in cl[k].ops for x in _data(g.ops[o])] or [set()])

    def consumers_through_movement(t: int, seen: set[int]) -> set[int]:
        found: set[int] = set()
        for k in ctx.users.get(t, ()):
            if k in seen:
                continue
            seen.add(k)
            if fused_movement(k):
                for o in cl[k].outputs:
                    found |= consumers_through_movement(o, seen)
            else:
                found.add(k)
        return found

    def returned(t: int) -> bool:
        """``t`` is a program output, or reaches one through movement XLA fuses (a weight
        gradient written transposed)."""
        return t in outs or any(fused_movement(k) and any(returned(o) for o in cl[k].outputs)
                                for k in ctx.users.get(t, ()))

    def readers_through_views(t: int, pads: bool = False) -> set[int]:
        """Clusters reading ``t`` directly or through bitcasts (a copy, a reshape), and with
        ``pads`` through zero pads (a convolution's reader folds them into its window)."""
        found: set[int] = set()
        for k in ctx.users.get(t, ()):
            if bitcasts_only(k) or pads and kind[k] == Kind.MOVEMENT and all(
                    ctx.bitcast.get(o) or _zero_pad(g, g.ops[o]) for o in cl[k].ops):
                found |= {u for x in cl[k].outputs for u in readers_through_views(x, pads)}
            else:
                found.add(k)
        return found

    def bitcasts_only(k: int) -> bool:
        return kind[k] == Kind.MOVEMENT and all(ctx.bitcast.get(o) for o in cl[k].ops)

    def bitcast_source(t: int) -> int | None:
        """The tensor ``t`` is a bitcast view of, one cluster back (None: not a view)."""
        k = ctx.producer.get(t)
        srcs = [x for o in cl[k].ops for x in _data(g.ops[o])] if k is not None and bitcasts_only(k) else []
        return srcs[0] if len(srcs) == 1 else None

    def behind_bitcasts(t: int) -> int:
        """The tensor ``t`` is a bitcast view of (through bitcast clusters), or ``t``."""
        while (x := bitcast_source(t)) is not None:
            t = x
        return t

    # movement and glue that a kernel call reads (directly, or through bitcasts of it: a reshape
    # vio passes a kernel in place of a reshape map, ESPCN's pixel shuffle): XLA materialises them
    feeds_call: set[int] = set()
    for k, c in enumerate(cl):
        if call[k]:
            for t in c.inputs:
                p = ctx.producer.get(t)
                if p is not None and fused_movement(p):
                    feeds_call.add(p)
                while (x := bitcast_source(t)) is not None:   # behind a view: movement, not scalar glue
                    t, p = x, ctx.producer.get(x)
                    if p is not None and kind[p] == Kind.MOVEMENT and not is_dus(p):
                        feeds_call.add(p)

    inputs = set(g.inputs)

    materialised: set[int] = set()   # movement a kernel call reads that XLA writes out (below)

    def buffer_of(t: int) -> int:
        """The buffer ``t`` lives in: through bitcasts XLA leaves as views, its source's."""
        k = ctx.producer.get(t)
        while k is not None and bitcasts_only(k) and find(k) == k and k not in materialised:
            srcs = [x for o in cl[k].ops for x in _data(g.ops[o])]
            if len(srcs) != 1:
                break
            t = srcs[0]
            k = ctx.producer.get(t)
        return t

    succ = [{u for t in c.outputs for u in ctx.users.get(t, ())} for c in cl]
    reach_memo: dict[int, int] = {}

    def reach(k: int) -> int:
        """Clusters reading what ``k`` computes, directly or through others, as a bit set (the
        program is a DAG; bit sets keep the unions of an unrolled model's many layers linear)."""
        stack = [k]
        while stack:                      # post-order: a cluster's set after all its readers'
            u = stack[-1]
            todo = [w for w in succ[u] if w not in reach_memo]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            if u not in reach_memo:
                bits = 0
                for w in succ[u]:
                    bits |= (1 << w) | reach_memo[w]
                reach_memo[u] = bits
        return reach_memo[k]

    launch_bits = sum(1 << m for m in range(len(cl)) if call[m] or kind[m] in _NEVER_IN_A_LOOP)

    def joins_around_a_launch(a: int, b: int) -> bool:
        """Would one fusion of groups ``a`` and ``b`` contain a path through a GEMM, convolution,
        attention or kernel call outside both (a residual add before the FFN and the one after
        it: the FFN's GEMMs run between them)? XLA never fuses across such a path: the fusion
        would depend on itself. (Element-wise work between them may join the same fusion.)"""
        ga = [m for m in range(len(cl)) if find(m) == a]
        gb = [m for m in range(len(cl)) if find(m) == b]
        bits_a = sum(1 << m for m in ga)
        bits_b = sum(1 << m for m in gb)
        for x, bits_x, bits_y in ((ga, bits_a, bits_b), (gb, bits_b, bits_a)):
            between = 0
            for m in x:
                between |= reach(m)
            between &= launch_bits & ~bits_x & ~bits_y
            while between:
                m = between.bit_length() - 1
                between &= ~(1 << m)
                if reach(m) & bits_y:
                    return True
        return False

    for k, c in enumerate(cl):   # pointwise islands: one loop fusion
        if kind[k] != Kind.POINTWISE:
            continue
        for t in c.inputs:
            for p in producers_through_movement(t, set()):
                if kind[p] == Kind.POINTWISE and find(p) != find(k) and not joins_around_a_launch(find(p), find(k)):
                    parent[find(p)] = find(k)
    islands: dict[int, list[int]] = {}
    for k in range(len(cl)):
        if kind[k] == Kind.POINTWISE:
            islands.setdefault(find(k), []).append(k)
    def gather_index(t: int) -> bool:
        """``t`` is read once, as the indices of a gather a GEMM reads (directly or through a
        chain of movement): XLA computes it inside the fusion that writes the gathered operand
        out (:func:`_gathered`). Index arithmetic read by several ops, or by a gather XLA fuses
        into a loop fusion, stays a launch of its own (read off the compiles of the MoE,
        sequence-packing and U-Net resize programs)."""
        users = g.consumers(t)
        if t in outs or len(users) != 1:
            return False
        op = users[0]
        if op.primitive == "gather":   # (or a kernel call: Swin's bias table for VTC's attention;
            # or a convolution; through more gathers: U-Net's nearest upsampling, both axes)
            return t not in _data(op) and (_gemm_reads(g, op.outputs[0]) or _conv_reads(g, op.outputs[0])
                                           or called_through_gathers(op.outputs[0]))
        if (is_view(op, g) or op.primitive in _FUSED_VIEWS or op.primitive == "concatenate") and len(op.outputs) == 1:
            return gather_index(op.outputs[0])
        return False

    def element_index(t: int, island: set[int]) -> bool:
        """``t`` is read only as the indices of scatters of single elements (updates one element
        an index) and of gathers of single elements that reductions read (:func:`_element_gather`:
        a loop fusion of their own), directly or through views, or by the ``island`` of ops making
        the indices. (Read by gathers XLA fuses into their readers it is a launch of its own: the
        MoE dispatch's permuted ids, ``flat_e[order]``.)"""
        if t in outs:
            return False
        users = [op for op in g.consumers(t) if op.id not in island]
        for op in users:
            if is_view(op, g) or op.primitive in _FUSED_VIEWS:
                if not all(element_index(y, island) for y in op.outputs):
                    return False
            elif op.primitive == "gather":   # (a loop fusion of its own: read by reductions)
                if t in _data(op) or not _element_gather(op) or not all(
                        kind[u] == Kind.REDUCTION for u in readers_through_views(op.outputs[0])):
                    return False
            elif op.primitive.startswith("scatter"):
                if op.inputs[1] != t or t in _data(op) or g.tensors[op.inputs[2]].size > g.tensors[t].size:
                    return False
            else:
                return False
        return True

    def called_through_gathers(y: int) -> bool:
        """A kernel call reads ``y``, through views and gathers of it (as their table)."""
        for u in readers_through_views(y):
            if call[u]:
                return True
            ops = [g.ops[o] for o in cl[u].ops]
            if kind[u] == Kind.MOVEMENT and ops and all(op.primitive == "gather" for op in ops) and any(
                    y in _data(op) or buffer_of(x) == y for op in ops for x in _data(op)) and any(
                    called_through_gathers(z) for z in cl[u].outputs):
                return True
        return False

    def materialised_behind(k: int) -> int | None:
        """The materialised copy that fused movement ``k``'s result is written out by (a gather
        another gather reads, inside the copy of the second), else None."""
        seen, todo = set(), [k]
        while todo:
            u = todo.pop()
            if u in materialised:
                return u
            if u in seen or kind[u] != Kind.MOVEMENT:
                continue
            seen.add(u)
            todo.extend(w for t in cl[u].outputs for w in ctx.users.get(t, ()))
        return None

    table_memo: dict[int, bool] = {}

    def from_scalars(t: int) -> bool:
        """``t`` is computed from iotas, literals and scalars alone (a position table: RoPE's
        frequencies and angles at ``pos``; a mask ``iota <= pos``)."""
        if t not in table_memo:
            info, op = g.tensors[t], g.producer(t)
            table_memo[t] = info.size <= 1 or info.const is not None or op is not None and (
                op.primitive == "iota" or op.primitive in _TABLE_STEPS and all(from_scalars(x) for x in _data(op)))
        return table_memo[t]

    literal_memo: dict[int, bool] = {}

    def literal(t: int) -> bool:
        """``t`` is computed from literal constants alone (no iota, no argument)."""
        if t not in literal_memo:
            info, op = g.tensors[t], g.producer(t)
            literal_memo[t] = info.const is not None or op is not None and op.primitive != "iota" and (
                op.primitive in _TABLE_STEPS and all(literal(x) for x in op.inputs))
        return literal_memo[t]

    def table_of(members: Sequence[int]) -> list[int]:
        """The ops of an island that compute a table from scalars (outputs larger than a scalar)."""
        return [o for m in members for o in cl[m].ops
                if all(from_scalars(t) and g.tensors[t].size > 1 for t in g.ops[o].outputs)]

    def island_users(members: Sequence[int]) -> set[int]:
        users = set().union(*[consumers_through_movement(t, set()) for m in members for t in cl[m].outputs]
                            or [set()])
        return {find(u) for u in users if find(u) != find(members[0])}

    def norm_of_stat(u: int, users: set[int]) -> bool:
        """``u`` is a norm applying a statistic among ``users`` (flax's LayerNorm: the mean of
        squares reduced beside it)."""
        return kind[u] == Kind.REDUCTION and any(
            k in users and _statistic(g, cl[k]) for t in cl[u].inputs for k in producers_through_movement(t, set()))

    def writing_pays(members: Sequence[int], users: set[int], launch: int) -> bool:
        """Whether writing island ``members`` once and each of its ``users`` reading it back costs
        XLA's priority fusion less than repeating the island in every reader, each reading the
        island's operands again (a gathered row charged its table: the gather repeated): ``k``
        readers, ``k · read > read + (1 + k) · wrote + launch``, ``launch`` the bytes' worth of a
        launch when the write is a fusion of its own (``XLA_LAUNCH_BYTES``), 0 when it is one more
        output of a fusion that runs anyway (:func:`written_into_stat`)."""
        own = {t for m in members for t in cl[m].outputs}

        def operand(t: int) -> int:
            p = g.producer(t)
            return ctx.nbytes[p.inputs[0]] if p is not None and p.primitive == "gather" else ctx.nbytes[t]
        read = sum(operand(t) for t in {t for m in members for t in cl[m].inputs} - own)
        wrote = sum(ctx.nbytes[t] for t in own)
        return len(users) * read > read + (1 + len(users)) * wrote + launch

    def written_into_stat(members: Sequence[int], users: set[int]) -> bool:
        """Whether XLA writes island ``members`` as one more output of the statistic among its
        ``users`` (GpuMultiOutputFusion: GPT-2's residual add in a training step,
        ``input_add_reduce_fusion`` writing the sum and the LayerNorm's statistics). Only where
        the island is not duplicated into every reader instead: a reader that cannot take it in
        (a GEMM, a kernel call, a scatter), or duplication reading its operands more than writing
        and reading it back would (each reader's operands vs one write and one read per reader:
        four readers of an add of two rows are written, Swin's three are duplicated) — and only
        where no other reader leads to the statistic (the fusion would depend on itself)."""
        stat = min(u for u in users if _statistic(g, cl[u]))
        if any(reach(w) >> stat & 1 for w in users if w != stat):
            return False
        if any(call[w] or kind[w] not in (Kind.POINTWISE, Kind.REDUCTION) for w in users):
            return True
        return writing_pays(members, users, 0)

    def cheap_for_readers(members: Sequence[int], users: set[int]) -> bool:
        """Island ``members`` is cheap element-wise work (no expensive op) and its ``users`` are
        loop and reduction fusions: what XLA's priority fusion may repeat in each reader."""
        return not any(call[w] or kind[w] not in (Kind.POINTWISE, Kind.REDUCTION) for w in users) and all(
            (row := TABLE.get(g.ops[o].primitive)) is not None and row.role == Role.ELEMENTWISE
            and not is_expensive(g.ops[o]) for m in members for o in cl[m].ops)

    def duplicated(members: Sequence[int], users: set[int]) -> bool:
        """Whether XLA's priority fusion duplicates island ``members`` into each of its ``users``:
        cheap element-wise work that reads no more bytes than it writes, read by loop and
        reduction fusions only."""
        if not cheap_for_readers(members, users):
            return False
        own = {t for m in members for t in cl[m].outputs}
        wrote = sum(ctx.nbytes[t] for t in own)
        size = min(g.tensors[t].size for t in own)   # (per-row operands read beside: negligible)
        return sum(ctx.nbytes[t] for t in {t for m in members for t in cl[m].inputs} - own
                   if g.tensors[t].size >= size) <= wrote

    def repeated_in_readers(members: Sequence[int], users: set[int]) -> bool:
        """Whether XLA's priority fusion repeats island ``members`` — cheap element-wise work —
        in each of its ``users`` (loop and reduction fusions): each reader reading the island's
        operands costs less than a launch (``XLA_LAUNCH_BYTES``) writing it and every reader
        reading it back; as for :func:`written_into_stat`, up to three readers always. Not one
        reading a split-K GEMM's result: the partial sums are reduced inside it (jit's residual
        add after the output projection, ``loop_add_fusion_1``, written)."""
        if not cheap_for_readers(members, users):
            return False
        own = {t for m in members for t in cl[m].outputs}
        if any(kind[p] == Kind.MATMUL and not call[p] and any(
                g.ops[o].primitive == "dot_general" and _xla_split_k(g, g.ops[o]) > 1 for o in cl[p].ops)
               for m in members for t in cl[m].inputs if t not in own for p in producers_through_movement(t, set())):
            return False
        return not writing_pays(members, users, XLA_LAUNCH_BYTES)

    recomputed: set[int] = set()   # tables XLA computes inside each reader: no launch, no bytes
    index_of_copy: list[tuple[int, int]] = []   # (index island, the gather cluster it feeds)
    for members in islands.values():   # folded into the consumer: lone casts, prologues of reductions/updates
        table = table_of(members)
        if (table and len(table) == sum(len(cl[m].ops) for m in members)
                and not any(t in outs for m in members for t in cl[m].outputs)):
            # all of it a table made from scalars: XLA computes it inside each fusion reading it
            # (a mask ``iota <= pos`` in the attention's select), unless it is expensive and read
            # by several (IsExpensive: not duplicated; a loop fusion of its own)
            # (indices of a gather excepted: T5's relative-position buckets are a loop fusion
            # the gather then reads)
            users = island_users(members)
            expensive = any(is_expensive(g.ops[o]) for o in table)
            indices = any(_indexes_a_gather(g, t) for m in members for t in cl[m].outputs)
            if all(literal(t) for m in members for t in cl[m].outputs):
                # made from literal arrays alone (Swin's relative-position index wrapped with
                # ``where(i < 0, i + n, i)``): XLA's constant folding computes it at compile time
                recomputed.add(find(members[0]))
                continue
            if users and not indices and not any(call[u] for u in users) and (len(users) == 1 or not expensive):
                # its own group at no cost (not merged into a reader: guard.blame shares a
                # group's cost among the clusters in it, and the table would take the reader's)
                recomputed.add(find(members[0]))
                continue
        if any(t in outs for m in members for t in cl[m].outputs):
            continue
        island = {o for m in members for o in cl[m].ops}
        if all(element_index(t, island) for m in members for t in cl[m].outputs):
            # index arithmetic only gathers and scatters of single elements read (a target
            # token's index wrapped, read by ``take_along_axis`` and by its gradient's scatter):
            # computed inside each of them, no launch (the compile's GPT-2 loss: none)
            recomputed.add(find(members[0]))
            continue
        if all(gather_index(t) for m in members for t in cl[m].outputs):
            users = sorted({find(u) for m in members for t in cl[m].outputs
                            for u in consumers_through_movement(t, set())} - {find(members[0])})
            if users and not any(call[u] for u in users):   # index arithmetic: inside its reader
                parent[find(members[0])] = users[0]
                continue
            gathers = {ctx.producer[y] for m in members for t in cl[m].outputs for y in _gather_of(g, t)}
            if len(gathers) == 1:   # a gather a kernel call reads: inside the copy writing it
                index_of_copy.append((members[0], next(iter(gathers))))
                continue
        reached = set().union(*[consumers_through_movement(t, set()) for m in members for t in cl[m].outputs]
                              or [set()])
        users = {find(u) for u in reached if find(u) != find(members[0])}
        readers = reached - set(members)
        island_ops = {o for m in members for o in cl[m].ops}
        if readers and all(_loop_epilogue(g, cl[u]) for u in readers) and all(
                _epilogue_reads(g, t, [cl[u] for u in readers], island_ops) for m in members for t in cl[m].outputs):
            # a per-channel vector only a convolution's epilogue reads (an eval BatchNorm's
            # ``rsqrt(var + eps) * gamma``), where the epilogue is a loop fusion: computed inside it
            recomputed.add(find(members[0]))
            continue
        cast = all(g.ops[o].primitive in CAST_ONLY for m in members for o in cl[m].ops)
        made = all(g.ops[o].primitive in ("iota", *CAST_ONLY) for m in members for o in cl[m].ops)
        sorting = all(any(g.ops[o].primitive in SORTS for o in cl[u].ops) for u in users)
        if len(users) == 1 and not any(call[u] for u in users) and (
                cast and not sorting or all(kind[u] == Kind.REDUCTION or is_dus(u) or scatters(u) for u in users)
                or made and sorting):   # (a sort fuses only an iota: made inside its first launch)
            parent[find(members[0])] = find(next(iter(users)))
        elif (cast or any(_statistic(g, cl[u]) for u in users)) and duplicated(members, users):
            # a cheap product reading no more than it writes (``dy * rstd`` in a LayerNorm's
            # backward, read by its row sum and by the fusion applying the gradient; a bf16 row's
            # f32 cast read by an RMSNorm's forward and backward): XLA duplicates it into every
            # reader (``input_reduce_fusion_2`` and ``loop_add_fusion_1`` each read ``dy``),
            # nothing written
            recomputed.add(find(members[0]))
        elif len(users) > 1 and not any(_statistic(g, cl[u]) for u in users) and repeated_in_readers(members, users):
            # a cheap element-wise island read by several loop and reduction fusions, recomputed
            # in each where that costs less than a launch writing it and each reader reading it
            # back (the residual add ``x + attn`` of VTC's decode layer, read by the RMSNorm and
            # by the final add: ``input_reduce_fusion`` and ``loop_add_fusion`` both read ``x``
            # and the kernel's result)
            recomputed.add(find(members[0]))
        elif not cast and any(_statistic(g, cl[u]) for u in users) and (all(
                call[u] or _statistic(g, cl[u]) or kind[u] == Kind.MATMUL or norm_of_stat(u, users)
                for u in users) or written_into_stat(members, users)):
            # read by a statistic (a reduction writing only reduced values: a LayerNorm's mean and
            # variance for VTC's norm kernel) and otherwise by kernel calls, GEMMs or the norm
            # applying that statistic (flax's LayerNorm in BERT), or written out anyway
            # (:func:`written_into_stat`): one multi-output fusion computing it, writing it and
            # reducing it (``input_add_reduce_fusion``)
            stat = next(u for u in sorted(users) if _statistic(g, cl[u]))
            parent[find(members[0])] = find(stat)
        elif len(users) > 1 and all(kind[u] == Kind.REDUCTION and not call[u] for u in users) and any(
                _column_tree(g, g.ops[o]) for u in users for o in cl[u].ops) and len(island_ops) <= 2 and all(
                TABLE[g.ops[o].primitive].role == Role.ELEMENTWISE and not is_expensive(g.ops[o])
                for o in island_ops):
            # a cheap product (``dy * gamma`` in a LayerNorm's backward) read by reductions only,
            # one of them a column tree: XLA computes it inside each of them
            recomputed.add(find(members[0]))
    # movement a kernel call reads: one more output of the loop fusion that produces its source
    # (XLA's multi-output fusion), or a copy of its own
    for k in sorted(feeds_call):
        if kind[k] == Kind.GLUE or bitcasts_only(k):
            continue
        srcs = {p for o in cl[k].ops for x in _data(g.ops[o]) for p in producers_through_movement(x, set())}
        host = [p for p in srcs if kind[p] in (Kind.POINTWISE, Kind.REDUCTION) and not call[p]
                and find(p) not in recomputed]   # (folded away: no fusion to ride in)
        if len(srcs) == 1 and host:
            parent[find(k)] = find(host[0])
        else:
            materialised.add(k)
    # a copy reading another copy's result (Swin's q, k, v split out of one GEMM's result and
    # one of them transposed): one fusion writing both (``input_slice_transpose_fusion``)
    for k in sorted(materialised):
        behind = {ctx.producer.get(buffer_of(x)) for x in cl[k].inputs}
        if len(behind & materialised) == 1 and behind <= materialised | {None}:
            # (a copy reading a kernel call's result too waits for the call: YOLO's concat of a
            # split half with the kernels' outputs is a launch of its own after them)
            parent[find(k)] = find(next(iter(behind & materialised)))
    # a reduction XLA emits element by element (:func:`_elemental_reduction`) that only a
    # scatter reads, as its updates: inside the scatter's fusion, which reads the rows unreduced
    # (GPT-2's position-embedding gradient, ``input_scatter_fusion`` reading ``f32[8,1024,768]``)
    for k, c in enumerate(cl):
        if kind[k] != Kind.REDUCTION or call[k] or find(k) != k or any(t in outs for t in c.outputs):
            continue
        readers = {u for t in c.outputs for u in readers_through_views(t)}
        if len(readers) == 1 and scatters(u := next(iter(readers))) and all(
                _elemental_reduction(g, g.ops[o]) for o in c.ops if g.ops[o].primitive.startswith("reduce_")) and all(
                behind_bitcasts(g.ops[o].inputs[2]) in c.outputs and behind_bitcasts(g.ops[o].inputs[0]) not in c.outputs
                for o in cl[u].ops):
            parent[k] = find(u)
    for k, gk in index_of_copy:
        if (into := materialised_behind(gk)) is not None:
            parent[find(k)] = find(into)
    # element-wise work only a materialised concatenation reads: computed inside the
    # concatenation's fusion (YOLO's C3k2: the last bottleneck's SiLU and residual add, in its
    # ``input_concatenate_fusion``)
    into_copy: set[int] = set()
    for k in sorted(materialised):
        if not any(g.ops[o].primitive == "concatenate" for o in cl[k].ops):
            continue
        for x in {x for o in cl[k].ops for x in _data(g.ops[o])}:
            p = ctx.producer.get(x)
            if (p is not None and p != k and kind[p] == Kind.POINTWISE and not call[p] and find(p) == p
                    and find(p) not in recomputed and not any(t in outs for t in cl[p].outputs)
                    and all(set(ctx.users.get(t, ())) == {k} for t in cl[p].outputs)):
                into_copy.add(p)
                parent[p] = find(k)
    # scalar index arithmetic a kernel reads: a loop fusion per distinct computation (XLA's CSE
    # merges the same clamp of ``pos`` made for several kernels); broadcasts and reshapes of a
    # scalar are bitcasts of it (no launch)
    glue_launch: dict[tuple, int] = {}
    for k in sorted(feeds_call):
        if kind[k] != Kind.GLUE:
            continue
        sig = tuple((g.ops[o].primitive, tuple(x for x in g.ops[o].inputs if x in inputs or ctx.producer.get(x) is None))
                    for o in cl[k].ops if not is_view(g.ops[o], g) and g.ops[o].primitive not in CAST_ONLY)
        if not sig:
            continue
        # (or the same values, computed twice from computed operands: the block-table rows a
        # paged layer's K and V kernels each read, one ``input_concatenate_fusion``)
        same = ("values", tuple(g.same_value(t) for t in cl[k].outputs))
        if sig in glue_launch or same in glue_launch:
            parent[find(k)] = find(glue_launch.get(sig, glue_launch.get(same)))
        else:
            glue_launch[sig] = glue_launch[same] = k
    glue_launches = {find(k) for k in glue_launch.values()}
    # sibling GEMMs: dots reading one activation with weights passed in (Q, K and V projections)
    # are one GEMM (XLA's dot merger); a kernel call reading one of the results then reads a
    # slice XLA must copy out of the merged buffer
    siblings: dict[tuple, list[int]] = {}
    for k, c in enumerate(cl):
        dots = [g.ops[o] for o in c.ops if g.ops[o].primitive == "dot_general"]
        if kind[k] != Kind.MATMUL or len(dots) != 1 or any(
                g.ops[o].primitive not in ("dot_general", *CAST_ONLY) and not _bias_epilogue(g, g.ops[o], inputs)
                and not _activation_epilogue(g, g.ops[o], set(c.ops)) for o in c.ops):
            continue
        d = dots[0]
        w = d.inputs[1]
        while (p := g.producer(w)) is not None and p.primitive in CAST_ONLY:
            w = p.inputs[0]   # (a weight cast on its way in: LoRA's f32 adapters in bf16)
        if w not in inputs:
            continue
        key = (buffer_of(d.inputs[0]), str(d.params.get("dimension_numbers")), len(g.tensors[d.inputs[1]].shape),
               str(g.tensors[d.inputs[1]].dtype))
        siblings.setdefault(key, []).append(k)
    merged: set[int] = set()
    merged_bytes: dict[int, int] = {}   # member -> its merged GEMM's whole output buffer
    merged_whole: dict[int, int] = {}   # (the same, for every merged member)
    merged_width: dict[int, int] = {}   # member -> its merged GEMM's N

    def dot_bytes(k: int) -> int:
        d = next(g.ops[o] for o in cl[k].ops if g.ops[o].primitive == "dot_general")
        return sum(ctx.nbytes[t] for t in (*d.inputs[:2], *d.outputs))

    def joined(members: list[int]) -> list[list[int]]:
        """The groups of sibling dots XLA's dot merger joins into one GEMM each (in program order).
        On jax 0.10.2 one: each next dot while it or the dot merged so far is within the bound (the
        first projection joins the small products, the second not). On jax 0.12 the narrow ones
        (widths no multiple of XLA_CONCAT_IN_GEMM_MULTIPLE) apart from the others, each next dot
        joining those merged so far while both are within the bound (``result_and_other``):
        LoRA's rank-16 products of ``x`` one GEMM (``gemm_fusion_dot.66``) beside its
        projections; a decode step's q, k and v (4096, 1024, 1024 wide) one; at a LoRA training
        step's 2,048 tokens q and k one (48 MiB each), v one of its own; a 4096 x 16384
        projection, past the bound alone, joins nothing."""
        if not XLA_DOT_MERGER_JOINS_ONE_WITHIN:
            groups: list[list[int]] = []
            for narrow in (True, False):
                group: list[int] = []
                size = 0
                for k in (k for k in members if (width(k) % XLA_CONCAT_IN_GEMM_MULTIPLE != 0) == narrow):
                    own = result_and_other(k)
                    if group and size <= DOT_MERGER_MAX_BYTES and own <= DOT_MERGER_MAX_BYTES:
                        group.append(k)
                        size += own
                    else:
                        groups += [group] if group else []
                        group, size = [k], own
                groups += [group] if group else []
            return groups
        out = members[:1]
        for k in members[1:]:
            if merged_bytes_of(out) <= DOT_MERGER_MAX_BYTES or dot_bytes(k) <= DOT_MERGER_MAX_BYTES:
                out.append(k)
        return [out]

    def result_and_other(k: int) -> int:
        """What jax 0.12's dot merger bounds: the dot's result and its other (not shared) operand."""
        d = next(g.ops[o] for o in cl[k].ops if g.ops[o].primitive == "dot_general")
        return ctx.nbytes[d.outputs[0]] + ctx.nbytes[d.inputs[1]]

    def merged_bytes_of(ks: list[int]) -> int:
        """What one GEMM merging dots ``ks`` reads and writes (their shared operand once)."""
        return dot_bytes(ks[0]) + sum(dot_bytes(m) - ctx.nbytes[shared_operand(m)] for m in ks[1:])

    def width(k: int) -> int:
        """Cluster ``k``'s dot's N: what it adds to a merged GEMM's result."""
        return math.prod(_free_sizes(g, next(g.ops[o] for o in cl[k].ops if g.ops[o].primitive == "dot_general"))[1:])

    def shared_operand(k: int) -> int:
        return next(g.ops[o] for o in cl[k].ops if g.ops[o].primitive == "dot_general").inputs[0]

    concatenated: list[list[int]] = []   # merged groups whose weights a launch concatenates
    sliced_out: set[int] = set()   # merged members whose result a copy cuts out of the merged buffer
    for members in (group for sib in siblings.values() for group in joined(sib)):
        if len(members) > 1:
            merged.update(members)
            widths = [width(k) for k in members]
            if any(w % XLA_CONCAT_IN_GEMM_MULTIPLE for w in widths):
                concatenated.append(members)
            whole = sum(ctx.nbytes[t] for k in members for t in cl[k].outputs)
            merged_whole.update((k, whole) for k in members)
            merged_width.update((k, sum(widths)) for k in members)
            # a narrow part other GEMMs read (LoRA's ``x @ A``, read by ``@ B`` and by B's
            # gradient) is copied out of the merged buffer once (``wrapped_slice``); one GEMM
            # reading it takes the slice into its operand (LoRA's inference layer on jax 0.12)
            sliced_out.update(k for k, w in zip(members, widths) if w % XLA_CONCAT_IN_GEMM_MULTIPLE and len({
                u for t in cl[k].outputs for u in consumers_through_movement(t, set())
                if kind[u] == Kind.MATMUL and not call[u]}) > 1)
            if not any(call[u] for k in members for t in cl[k].outputs
                       for u in consumers_through_movement(t, set())):   # (else slices are copied out)
                merged_bytes.update((k, whole) for k in members if k not in sliced_out)
            for k in members[1:]:
                parent[find(k)] = find(members[0])
    # an element-wise consumer of a large GEMM is its epilogue (XLA's Triton GEMM fusion takes
    # it: the residual add after an output projection at prefill and training sizes), when it
    # and the GEMM's own epilogue read the product once
    for k in range(len(cl)):
        if kind[k] != Kind.MATMUL or call[k] or k in merged or find(k) != k or len(cl[k].outputs) != 1:
            continue
        dot = _epilogue_gemm(g, cl[k].ops)
        (t,) = cl[k].outputs
        if dot is None or t in outs or not _read_once(g, dot.outputs[0], set(cl[k].ops)):
            continue
        users = {find(u) for u in readers_through_views(t)}
        u = next(iter(users)) if len(users) == 1 else None
        island_ops = {o for m in islands[u] for o in cl[m].ops} if u in islands else set()
        if u not in islands or not _read_once(g, t, island_ops) or not _epilogue_ops_ok(g, island_ops, t):
            continue
        moved = any(fused_movement(r) and not bitcasts_only(r) for m in islands[u] for x in cl[m].outputs
                    for r in ctx.users.get(x, ()))
        gemm_read = any(kind[r] in (Kind.MATMUL, Kind.ATTENTION) for m in islands[u] for x in cl[m].outputs
                        for r in readers_through_views(x))
        # (an epilogue reading another GEMM's result is a loop fusion too: LoRA's
        # ``x @ W + (x @ A) @ B * s``, the compile's ``wrapped_add``; on jax 0.12 only where that
        # result is a part of a merged GEMM's: LoRA's q and k, ``loop_add_fusion``)
        other_gemm = any(
            p != k and (kind[p] in _NEVER_IN_A_LOOP or call[p]) and (not XLA_EPILOGUE_READS_OTHER_GEMMS or p in merged)
            for m in islands[u] for x in cl[m].inputs for p in producers_through_movement(x, set()))
        if not moved and not gemm_read and not other_gemm:   # (a result a GEMM reads, or
            parent[u] = find(k)    # transposed for its reader, is a loop fusion's: LoRA's q, relaid for the scores)

    # a convolution's result plus another tensor of its shape, and nothing else (the shortcut of
    # a ResNet block added to its last convolution): cuDNN's side input, the add inside
    # ``cudnn-conv-bias-activation``, where the convolution's own epilogue is at most its bias
    # (read off the U-Net up block's compile: the shortcut conv reads the residual, no loop fusion)
    for k in range(len(cl)):
        if kind[k] != Kind.CONV or call[k] or find(k) != k or len(cl[k].outputs) != 1 or (
                _conv_epilogue(g, cl[k]) - {"add"}):
            continue
        (t,) = cl[k].outputs
        users = {find(u) for u in readers_through_views(t)}
        u = next(iter(users)) if len(users) == 1 else None
        if t in outs or u not in islands:
            continue
        ops = [g.ops[o] for m in islands[u] for o in cl[m].ops]
        if len(ops) == 1 and ops[0].primitive == "add" and len(ctx.users.get(t, ())) == 1 and all(
                g.tensors[x].size == g.tensors[t].size and g.tensors[x].dtype == g.tensors[t].dtype
                for x in ops[0].inputs) and len(set(ops[0].inputs)) == 2:
            parent[u] = find(k)
    # cuDNN's own epilogue applied through bitcasts: a conv with none, whose result only a
    # bias add (and ReLU) reads through unit-axis reshapes (flax's ``nnx.Conv`` under ``vmap``
    # adds the bias to a reshaped result), is one ``cudnn-conv-bias-activation`` in the compile,
    # as if the cluster had taken them (:func:`_cudnn_epilogue` on the island's ops)
    for k in range(len(cl)):
        if kind[k] != Kind.CONV or call[k] or find(k) != k or len(cl[k].outputs) != 1 or _conv_epilogue(g, cl[k]):
            continue
        (t,) = cl[k].outputs
        users = {find(u) for u in readers_through_views(t)}
        u = next(iter(users)) if len(users) == 1 else None
        if t in outs or u not in islands or len(ctx.users.get(t, ())) != 1:
            continue
        if _cudnn_epilogue(g, cl[k], {g.ops[o].primitive for m in islands[u] for o in cl[m].ops} - CAST_ONLY):
            parent[u] = find(k)

    def _generated(t: int) -> bool:
        """``t`` is an iota (through casts and broadcasts): XLA makes it inside its reader."""
        k = ctx.producer.get(t)
        return k is not None and all(g.ops[o].primitive in ("iota", *CAST_ONLY) or is_view(g.ops[o], g)
                                     for o in cl[k].ops)

    def merged_member(t: int) -> int | None:
        """The merged sibling GEMM whose part of the result ``t`` is (a view of), else None."""
        while (k := ctx.producer.get(t)) is not None and fused_movement(k) and k not in materialised:
            xs = _data(g.producer(t))
            if not xs:   # (made from nothing: an iota, a literal's broadcast)
                return None
            t = xs[0]
        return k if k in merged else None

    def from_merged(t: int) -> bool:
        """``t`` is (a view of) one sibling's part of a merged GEMM's result: one buffer for all
        the siblings, in the layout the merged GEMM writes (BERT's q, k and v, each transposed
        out of it for the attention's GEMMs, the bias added on the way on jax 0.10.2)."""
        return merged_member(t) is not None

    def called_through_bitcasts(t: int) -> bool:
        """``t`` is read by a kernel call, directly or through bitcasts."""
        return any(call[u] or bitcasts_only(u) and any(called_through_bitcasts(y) for y in cl[u].outputs)
                   for u in ctx.users.get(t, ()))

    numerators: dict[int, list[int]] = {}   # (filled below: values readers recompute, and from what)
    norm_rows: set[int] = set()   # (those of them a norm makes from its statistics)
    as_written: dict[int, int] = {}   # (filled below: what a GEMM writes, where not its result)

    def read_bytes(t: int, seen: set[int], inside: frozenset[int] = frozenset(),
                   whole: set[int] | None = None, strided: bool = False) -> int:
        """Bytes a fusion reads for ``t``: through fused movement, what its sources hold; nothing
        for what the fusion's own clusters ``inside`` compute (a slice of a value made in it).
        ``whole``: the buffers counted so far, each once — a slice on the way is charged the
        buffer it is cut from (the compile's buffer-level count of a copy's operands)."""
        k = ctx.producer.get(t)
        if k in inside:
            return 0
        if t in numerators:   # recomputed from the scores
            return sum(read_bytes(x, seen, inside, whole, strided) for x in numerators[t])
        if k in merged_bytes:   # a slice of a merged GEMM's output: the fusion reads its buffer
            return merged_bytes[k]   # (the compile's buffer-level count; q/k/v transposes of BERT, T5)
        # (a split's part no kernel call reads is not written out by the split's copy: read in
        # place where ``whole`` counts buffers — ShuffleNet's untouched half)
        if k is None or not fused_movement(k) or k in seen or find(k) != k and k in feeds_call or (
                k in materialised and not (whole is not None and g.producer(t).primitive == "split"
                                           and not called_through_bitcasts(t))):
            if whole is not None:
                if t in whole:
                    return 0
                whole.add(t)
            return as_written.get(t, ctx.nbytes[t])
        seen.add(k)
        xs = [x for o in cl[k].ops for x in _data(g.ops[o])]
        src = sum(read_bytes(x, seen, inside, whole, strided) for x in xs)
        if kind[k] == Kind.GLUE:
            return 0
        if whole is not None:   # (the buffers behind a slice, however little of them the copy writes)
            return src
        # (``strided``: a part cut from a transposed view, strided across the whole buffer
        # behind it, is charged that buffer where a loop fusion or a GEMM operand's copy reads
        # it — Swin's q, k and v split out of the heads-major view of one QKV result, each
        # ``loop_slice_fusion`` reading all of it)
        if any(ctx.producer.get(x) in merged_bytes for x in xs) or strided and strided_cut(k):
            return src
        if any(x in numerators for x in xs) or all(ctx.bitcast.get(o) for o in cl[k].ops):
            return src   # (gathered from rows it recomputes: the compile charges the rows whole —
            # GPT-2's picked log-probs —, also through a view after the gather: ``[..., 0]``)
        return min(ctx.nbytes[t], src)

    def transposed_copies(dots: Sequence[Any]) -> tuple[int, int]:
        """(launches, bytes) of the operands XLA copies transposed before decode's vector dots
        (:func:`_transposed_operands`): jax <= 0.10 always; jax 0.12 where the dot keeps the
        cache's 16-bit type (a widening or 32-bit ``p @ v`` is read where it is: see compat).
        The copy holds the repeat's source (the cache's heads, not the query heads), widened to
        the dot's type: it is written, and the reduction reads it instead of the cache (an int8
        or fp8 cache: read narrow by the copy, the dot reads the wide copy)."""
        n = nbytes = 0
        for d in dots:
            for x, wide in _transposed_operands(g, d):
                if not XLA_TRANSPOSES_REPEATED_VALUES and (wide != g.tensors[x].dtype.itemsize or wide > 2):
                    continue
                if XLA_TRANSPOSES_REPEATED_VALUES and _repeats(g, x) * _batch_rows(g, d, x) <= XLA_READS_REPEATED_VALUES_MAX:
                    continue
                src = read_bytes(x, set())
                base, elems = x, g.tensors[x].size
                while (p := g.producer(base)) is not None and (p.primitive in _FUSED_VIEWS or p.primitive in CAST_ONLY):
                    base = data_inputs(p)[0]
                    elems = min(elems, g.tensors[base].size)
                copy = elems * wide
                n, nbytes = n + 1, nbytes + src + copy + (copy - src)
        return n, nbytes

    strided_memo: dict[int, bool] = {}

    def strided_cut(k: int) -> bool:
        """Fused movement ``k``, or movement behind it, cuts a part (``slice``, ``split``) out of
        a transposed view of a buffer (a transpose XLA does not do as a bitcast, behind the cut
        through fused movement). Each (cluster, behind a cut) visited once."""
        if k not in strided_memo:
            todo, seen, found = [(k, False)], set(), False
            while todo and not found:
                p, below_cut = todo.pop()
                if (p, below_cut) in seen:
                    continue
                seen.add((p, below_cut))
                ops = [g.ops[o] for o in cl[p].ops]
                if below_cut and any(op.primitive == "transpose" and not ctx.bitcast.get(op.id) for op in ops):
                    found = True
                    break
                cut = below_cut or any(op.primitive in ("slice", "split") for op in ops)
                for x in (x for op in ops for x in _data(op)):
                    q = ctx.producer.get(x)
                    if q is not None and fused_movement(q) and q not in materialised:
                        todo.append((q, cut))
                    elif cut and q is not None and kind[q] == Kind.CONV and any(
                            _channels_first(g.ops[o], "out_spec") for o in cl[q].ops
                            if g.ops[o].primitive == "conv_general_dilated"):
                        # (an NCHW conv's result lies NHWC in cuDNN's buffer: a channel part of it
                        # is strided across all of it — EfficientViT's q, k and v)
                        found = True
            strided_memo[k] = found
        return strided_memo[k]

    def source_bytes(t: int, own: set[int]) -> int:
        """Bytes a fusion recomputing ``t`` from the fusion's own ops ``own`` (casts and
        element-wise math XLA fuses in) reads: its sources outside them (a norm's bf16 rows, not
        their f32 cast)."""
        op = g.producer(t)
        if op is None or op.id not in own or op.primitive.startswith("reduce_"):
            return read_bytes(t, set())
        return min(ctx.nbytes[t], sum(source_bytes(x, own) for x in _data(op)))

    def read_src_is_input(t: int) -> bool:
        """``t`` is (a movement op's view of) a program input with more than one dimension."""
        if t in inputs:
            return len(g.tensors[t].shape) >= 3
        k = ctx.producer.get(t)
        return k is not None and fused_movement(k) and kind[k] == Kind.MOVEMENT and any(
            read_src_is_input(x) for o in cl[k].ops for x in _data(g.ops[o]))

    def moved_behind(t: int) -> bool:
        """``t`` is fused movement that is no bitcast (a slice, a concatenation), through bitcasts."""
        k = ctx.producer.get(t)
        while k is not None and bitcasts_only(k) and len(srcs := [x for o in cl[k].ops for x in _data(g.ops[o])]) == 1:
            k = ctx.producer.get(srcs[0])
        return k is not None and fused_movement(k) and not bitcasts_only(k)

    def _sources_behind(t: int) -> set[int]:
        """The tensors fused movement in front of ``t`` reads (program inputs, computed values)."""
        k = ctx.producer.get(t)
        if t in inputs or k is None or not fused_movement(k):
            return {t}
        return set().union(*[_sources_behind(x) for o in cl[k].ops for x in _data(g.ops[o])] or [set()])

    def _inputs_behind(t: int) -> set[int]:
        """The program inputs fused movement in front of ``t`` reads."""
        return _sources_behind(t) & inputs

    def _transposed_sources(t: int) -> set[int]:
        """The computed values fused movement in front of ``t`` reads through a transpose that
        moves axes (the transposes' results), op by op."""
        k, op = ctx.producer.get(t), g.producer(t)
        if t in inputs or k is None or op is None or not fused_movement(k):
            return set()
        out: set[int] = set()
        for x in _data(op):
            p = ctx.producer.get(x)
            if (op.primitive == "transpose" and not ctx.bitcast.get(op.id) and p is not None
                    and not fused_movement(p)):
                out.update(op.outputs)
            else:
                out |= _transposed_sources(x)
        return out

    fusions: list[Fusion] = []
    # a softmax's numerator ``exp(x - max)`` that a division by its sum reads outside its
    # reduction: XLA's Triton softmax fusions recompute it from the scores wherever it is read
    # (the statistics fusion writes only the statistics; LoRA's training scores): value -> the
    # scores it is recomputed from
    for k, c in enumerate(cl):
        prims = {g.ops[o].primitive for o in c.ops}
        if kind[k] != Kind.REDUCTION or call[k]:
            continue
        sums = {g.ops[o].outputs[0] for o in c.ops if g.ops[o].primitive == "reduce_sum"}
        for o in c.ops if {"reduce_max", "exp", "reduce_sum"} <= prims else ():
            e = g.ops[o].outputs[0]
            if g.ops[o].primitive != "exp" or e not in c.outputs or e in outs:
                continue
            if any(u.primitive == "div" and any(_sources_behind(x) & sums for x in u.inputs if x != e)
                   for u in g.consumers(e)):
                numerators[e] = [x for x in c.inputs if g.tensors[x].size == g.tensors[e].size]
        # rows a norm makes from its statistics with cheap element-wise work (``x - mean``,
        # ``(x - mean) * rstd`` kept for a training step's backward; a log-softmax's
        # ``x - max - log(sum)`` read by ``take_along_axis``): recomputed by each XLA fusion
        # reading them from the rows and the statistics, never written (read off GPT-2's
        # training step: the forward LayerNorm writes its output alone)
        for e in c.outputs:
            if e in outs or e in numerators or not any(g.ops[o].primitive.startswith("reduce_") for o in c.ops):
                continue
            readers = consumers_through_movement(e, set())
            if not readers or any(call[u] or kind[u] in _NEVER_IN_A_LOOP or u in materialised or u in feeds_call
                                  for u in readers):
                continue
            if (rows := _rows_recomputed(g, e, set(c.ops))) is not None:
                numerators[e] = sorted(rows)
                norm_rows.add(e)

    # a reduction XLA emits element by element (:func:`_elemental_reduction`) that only a
    # scatter reads, as its updates, where its cluster computes more (a LayerNorm's backward
    # making the rows it sums): the scatter's fusion reduces the rows itself, so the reduction
    # is no launch and its result is never written (GPT-2's position-embedding gradient, the
    # batch sum of the input gradient: ``input_scatter_fusion_1`` reading ``f32[8,1024,768]``)
    into_scatter: set[int] = set()   # those reductions (and reshapes on the way), by op
    for k, c in enumerate(cl):
        if kind[k] != Kind.REDUCTION or call[k] or len(c.outputs) < 2:
            continue
        for e in c.outputs:
            readers = readers_through_views(e)
            if e in outs or e in numerators or len(readers) != 1 or not scatters(u := next(iter(readers))) or any(
                    behind_bitcasts(g.ops[o].inputs[2]) != e or behind_bitcasts(g.ops[o].inputs[0]) == e
                    for o in cl[u].ops):
                continue
            chain, x = [], e   # back through reshapes and reductions to the rows
            while (op := g.producer(x)) is not None and op.id in c.ops and (
                    op.primitive == "reshape" or _elemental_reduction(g, op)):
                chain.append(op.id)
                x = _data(op)[0]
            if any(g.ops[o].primitive.startswith("reduce_") for o in chain) and x in c.outputs:
                numerators[e] = [x]
                into_scatter.update(chain)

    def stat_apart(k: int) -> bool:
        """Reduction cluster ``k`` writes only statistics once the rows its readers recompute
        are set aside (``norm_rows``: VTC's LayerNorm between kernels, ``x - mean`` kept for
        the backward; a softmax's numerator is no such row: its backward is a Triton fusion)."""
        reds = [g.ops[o] for o in cl[k].ops if g.ops[o].primitive.startswith("reduce_")]
        return bool(reds) and all(_reduces_minor(g, r) for r in reds) and all(
            t in norm_rows or g.tensors[t].size <= max(g.tensors[r.outputs[0]].size for r in reds)
            for t in cl[k].outputs)

    def epilogue_apart(m: int) -> str | None:
        """How XLA runs GEMM cluster ``m``'s element-wise epilogue when its GEMM does not take it
        (below GEMM_EPILOGUE_MIN_ROWS rows, a select, or one reading the product twice): "loop",
        a loop fusion of its own — where a library call, a kernel or a sort reads the result, it
        is returned, or it is expensive and read by a fusion reading each element many times
        (XLA duplicates no expensive producer into a consumer that reuses its elements: Mamba's
        softplus); "reader", computed by the fusions reading it; "taken", inside the GEMM
        fusion; "casts", none but casts (the GEMM's output type); None: not one GEMM."""
        if kind[m] != Kind.MATMUL or call[m] or len(cl[m].outputs) != 1:
            return None
        dots = [o for o in cl[m].ops if g.ops[o].primitive == "dot_general"]
        if len(dots) != 1:
            return None
        after = {o for o in cl[m].ops if o > dots[0] and g.ops[o].primitive not in CAST_ONLY}
        dot = _epilogue_gemm(g, cl[m].ops)
        if not after:
            return "casts"
        if dot is not None and _read_once(g, dot.outputs[0], after) and _epilogue_ops_ok(g, after, dot.outputs[0]):
            return "taken"
        (t,) = cl[m].outputs
        readers = readers_through_views(t) - {m}
        costly = any(is_expensive(g.ops[o]) for o in after)
        if t in outs or costly and _reread(g, t) or any(kind[u] in _NEVER_IN_A_LOOP or call[u] or any(
                g.ops[o].primitive in SORTS for o in cl[u].ops) for u in readers):
            return "loop"
        return "reader"

    # what a GEMM writes where its result is only cast, or its epilogue is computed by the
    # fusions reading it: the product in the narrowest type along its casts (a bf16 product
    # widened to f32 is written bf16 and widened by its readers: the LM head's logits, LoRA's
    # masked training scores); where the GEMM takes its epilogue, the value before the casts it
    # ends in (an RMSNorm's weight applied to a bf16 gradient on its way to the f32 backward,
    # ``gemm_fusion_dot_general_3``)
    for m in range(len(cl)):
        how = epilogue_apart(m)
        if how not in ("taken", "casts", "reader"):
            continue   # (an epilogue a loop fusion of its own takes writes the result)
        (t,) = cl[m].outputs
        if how == "taken":   # back from the result through the casts it ends in
            def step(x: int) -> int | None:
                p = g.producer(x)
                return p.inputs[0] if p is not None and p.primitive in CAST_ONLY and p.id in cl[m].ops else None
            x = t
        else:                # forward from the product through the casts it takes
            def step(x: int) -> int | None:
                us = g.consumers(x)
                return us[0].outputs[0] if len(us) == 1 and us[0].primitive in CAST_ONLY and us[0].id in cl[m].ops else None
            x = next(g.ops[o] for o in cl[m].ops if g.ops[o].primitive == "dot_general").outputs[0]
        narrowest = ctx.nbytes[x]
        while (x := step(x)) is not None:
            narrowest = min(narrowest, ctx.nbytes[x])
        if narrowest < ctx.nbytes[t]:
            as_written[t] = narrowest

    # a scatter into zeros added to a fusion's result (:func:`_added_into`): XLA scatters into that
    # result in place, so no launch writes the zeros, none reads the scatter's result for the add
    folded_adds: dict[int, int] = {}   # the add -> the addend scattered into
    for k in range(len(cl)):
        for o in cl[k].ops if scatters(k) else ():
            if (a := _added_into(g, g.ops[o])) is not None:
                folded_adds[a.id] = next(x for x in a.inputs if x != g.ops[o].outputs[0])
    folded = {x for a in folded_adds for x in g.ops[a].inputs if x not in folded_adds.values()}
    as_written.update(dict.fromkeys(folded, 0))
    written: dict[int, int] = {}     # materialised tensor -> group position that writes it

    call_ops = [op.id for op in g.ops if op.primitive in KERNEL_CALLS]
    call_math = dict(zip(call_ops, kernel_math)) if len(kernel_math) == len(call_ops) else {}

    def add(members: Sequence[int], what: str, n: int, nbytes: int, made: Iterable[int] = ()) -> None:
        # copies and layout transposes charged to a GEMM / conv cluster do none of its math
        ops = [g.ops[o] for m in members for o in cl[m].ops] if what not in ("copy", "layout") else []
        flops, engine, cls, waste = 0, "xla", "", 0
        for op in ops:
            if op.id in call_math:
                f, engine, cls, w = call_math[op.id]
                flops += f
                waste += w
            elif (f := op_flops(op, g)):
                flops += f
                cls = cls or _op_math(op, g)
        made = tuple(made)
        fusions.append(Fusion(tuple(members), what, int(n), int(nbytes), int(flops), engine, cls, int(waste), made))
        for t in made:
            written[t] = len(fusions) - 1

    relaid: set[int] = set()   # GEMM operands already copied into GEMM layout (XLA's CSE: once)
    filled: set[tuple[Any, ...]] = set()   # constants returned filled (:func:`_fill_key`)

    def split_of(k: int) -> int:
        """How many parts XLA splits cluster ``k``'s GEMM along K (1: not split)."""
        return max((_xla_split_k(g, g.ops[o], merged_width.get(k, 0)) for o in cl[k].ops
                    if g.ops[o].primitive == "dot_general"), default=1)

    def elementwise_sources(t: int) -> list[int]:
        """The tensors element-wise work making ``t`` reads, through that work and the views
        XLA fuses (a dequantised cache: the int8 cache and its broadcast scales), in op order."""
        op = g.producer(t)
        row = TABLE.get(op.primitive) if op is not None else None
        if op is None or not (row is not None and row.role == Role.ELEMENTWISE or op.primitive in _FUSED_VIEWS):
            return [t]
        return list(dict.fromkeys(y for x in _data(op) for y in elementwise_sources(x)))

    def relayout(x: int) -> tuple[int, int]:
        """Launches and bytes of a GEMM operand's copy into GEMM layout (made once for all its
        readers: read the source, write the copy), plus what the GEMM reads beyond the source."""
        src, full = read_bytes(x, set()), ctx.nbytes[x]
        if x in relaid:
            return 0, full - src
        relaid.add(x)
        sibling = merged_member(x)
        if XLA_BROADCASTS_BIAS_OF_MERGED_GEMMS and sibling is not None and any(
                g.ops[o].primitive == "add" for o in cl[sibling].ops):
            # jax 0.12: the bias of a merged sibling is added by the GEMM reading its part, from
            # a broadcast written out in that operand's layout (``wrapped_broadcast``)
            return 2, 4 * full   # the transpose (reading the merged buffer, the GEMM's read of
            # it charged the part only) and the broadcast written and read
        # (a part of rows: the copy reads the whole buffer it is cut from)
        whole = ctx.nbytes[_slice_source(g, x)] if _minor_slice(g, x) is not None else src
        k = ctx.producer.get(x)
        if k is not None and is_dus(k) and x in outs:
            # a cache updated in place, returned, and read by a GEMM in another layout: XLA's
            # layout assignment gives the update the GEMM's layout — the cache is transposed
            # in, copied for the in-place update, and the result transposed back for the output
            # (read off the H100 compile of flax's Gemma-2 decode: G = 2 heads per KV head make
            # the scores a GEMM, four cache-size copies per cache). Written by a scatter (a
            # rolling cache's ``.at[:, slot].set``), the update and the transpose back each read
            # the cache once more, and jax 0.12's XLA copies it once more
            scattered = g.origin(x) == "scatter"
            n = 3 + (XLA_COPIES_SCATTERED_CACHE_AGAIN and scattered)
            return n, (n + scattered) * 2 * full
        made = producers_through_movement(x, set())
        if len(made) == 1 and all(kind[p] == Kind.MATMUL and not call[p] and split_of(p) > 1 for p in made):
            return 0, full - src   # a part of a split-K GEMM's sum: the fusion reducing the partials
            # writes it for this GEMM (Mamba's ``dt`` out of x_proj: ``loop_reduce_fusion``)
        if len(made) == 1 and all(kind[p] == Kind.POINTWISE and not call[p] and find(p) not in recomputed
                                  and all(kind[u] in _NEVER_IN_A_LOOP and not call[u]
                                          for t in cl[p].outputs for u in consumers_through_movement(t, set()))
                                  for p in made):
            return 0, full - src   # computed only for GEMMs (Swin's scaled q): the loop fusion
            # computing it writes it in the GEMM's layout (``loop_slice_fusion``)
        main = _made_elementwise_from(g, x)
        updated = [t for t in elementwise_sources(x) if t in outs and (p := ctx.producer.get(t)) is not None
                   and is_dus(p)] if main is not None else []
        n = 1
        nbytes = whole + full + (full - src)
        for t in updated:
            # a cache updated in place and returned, made into the GEMM's operand element-wise in
            # another layout (MaxText's int8 cache dequantised for the attention's GEMMs): XLA fuses
            # the update into the fusion writing the operand, which writes the whole cache beside
            # it (its in-place update's launch folded in) and needs the cache copied once more
            # (transposed in for it, or copied out into the output's buffer: ``wrapped_transpose``,
            # ``kCopy``); a smaller buffer the work broadcasts (a per-token scale cache) keeps its
            # in-place update and is transposed for the fusion (``input_transpose_fusion``)
            n, nbytes = (n, nbytes + 3 * ctx.nbytes[t]) if t == main else (n + 1, nbytes + 2 * ctx.nbytes[t])
        return n, nbytes

    def sort_price(op: Any) -> tuple[int, int]:
        """Launches and bytes of a ``sort`` / ``top_k`` (:func:`sort_launches`): every launch reads
        and writes the buffers being sorted (in place); an operand still needed elsewhere is copied
        into them first (a ``kCopy`` each; an ``iota`` operand is made inside the first launch). A
        ``top_k`` result is a slice of the sorted buffers: a reader's fusion reads the whole
        buffer, a program output is one more launch."""
        x = op.inputs[0]
        if op.primitive == "top_k":
            axis = op.params.get("axis", len(g.tensors[x].shape) - 1)
            row = g.tensors[x].shape[axis]
            if op.params["k"] <= TOPK_KERNEL_MAX_K and row >= TOPK_KERNEL_MIN_ROW:
                return 1, ctx.nbytes[x] + sum(ctx.nbytes[t] for t in op.outputs)
            sorted_bytes = [ctx.nbytes[x], g.tensors[x].size * 4]   # values and int32 indices
            operands = [x]
        else:
            axis = op.params["dimension"]
            row = g.tensors[x].shape[axis]
            operands = [y for y in op.inputs if not _generated(y)]
            tiebreak = op.params.get("is_stable") and (
                len(operands) == len(op.inputs) or XLA_STABLE_SORT_ADDS_IOTA_TO_AN_IOTA)
            sorted_bytes = [ctx.nbytes[t] for t in op.outputs] + [g.tensors[x].size * 4] * bool(tiebreak)
        width = sum(b // max(1, g.tensors[x].size) for b in sorted_bytes)
        n = sort_launches(row, width)
        nbytes = n * 2 * sum(sorted_bytes)
        kept = [y for y in operands if (y in inputs and y not in ctx.donated) or y in outs
                or len(set(ctx.users.get(y, ()))) > 1]
        n, nbytes = n + len(kept), nbytes + 2 * sum(ctx.nbytes[y] for y in kept)
        if op.primitive == "top_k":
            for t, full in zip(op.outputs, sorted_bytes):
                readers = {find(u) for u in consumers_through_movement(t, set())}
                nbytes += len(readers) * (full - ctx.nbytes[t])
                if t in outs:
                    n, nbytes = n + 1, nbytes + full + ctx.nbytes[t]
        return n, nbytes

    def chain_cost(t: int, within: set[int]) -> float:
        """What recomputing ``t`` per element costs (:func:`repeat_cost`): the expensive ops of
        ``within`` it is computed by, but those XLA folds to constants (on literals alone: one on
        an iota is computed, Whisper's sinusoid frequencies ``exp(-c * iota)`` in a loop fusion of
        their own)."""
        def up(x: int) -> Iterable[int]:
            p = g.producer(x)
            return [y for y in _data(p) if not literal(y)] if p is not None and p.id in within else ()
        return sum(repeat_cost(g.producer(x)) for x in _walk([t], up) if not literal(x)
                   and g.producer(x) is not None and g.producer(x).id in within)

    # an expensive table (``pow``, ``cos``) made inside two fusions, from the same scalars (two
    # RoPE calls each computing the frequencies at ``pos``), or made in one and read by another:
    # XLA's CSE makes it once, and where its readers would repeat it at a cost above writing it
    # out (:func:`repeats_too_much`) each value read is a loop fusion of its own (the cos and the
    # sin table, read off the H100 compiles of the pure-JAX Llama and the examples' Llama-3 at
    # batch 16 — which XLA sometimes merges into one, the rolling-cache decode; at batch 1 a
    # decode step's readers are small and the tables are recomputed inside them; RoPE'd q and k
    # that are both program outputs keep the two fusions even at batch 1, which this does not
    # model)
    # table value -> (its chain's cost per element, clusters computing something from it)
    holders: dict[int, tuple[float, set[int]]] = {}
    for members in islands.values():
        table = set(table_of(members))
        if not any(is_expensive(g.ops[o]) for o in table):
            continue
        for o in table:
            for t in g.ops[o].outputs:
                readers: set[int] = set()
                for u in g.consumers(t):
                    k = ctx.pos.get(u.id)
                    if u.id in table or k is None:
                        continue
                    if fused_movement(k):   # through a broadcast or reshape: who reads that
                        readers |= {r for x in cl[k].outputs for r in consumers_through_movement(x, set())}
                    else:
                        readers.add(k)
                if readers:
                    v = g.same_value(t)
                    cost, known = holders.get(v, (0.0, set()))
                    holders[v] = (max(cost, chain_cost(t, set(table))), known | readers)

    def reused(v: int) -> bool:
        """Computed in more than one fusion, whose readers would repeat it at a cost above writing
        it out (:func:`repeats_too_much`)."""
        readers = holders[v][1]

        def reads(k: int) -> int:
            """How many values reader ``k`` computes from the table: its output, or for a gather
            or scatter, its indices (each read once: a target token's index, read by the loss's
            ``take_along_axis`` and by its gradient's scatter, is recomputed in both)."""
            moves = [g.ops[o] for o in cl[k].ops if g.ops[o].primitive == "gather"
                     or g.ops[o].primitive.startswith("scatter")]
            if moves:
                return max(g.tensors[op.inputs[1]].size for op in moves)
            return max((g.tensors[x].size for x in cl[k].outputs), default=0)
        elements = sum(reads(k) for k in readers)
        info = g.tensors[v]
        return len({find(k) for k in readers}) > 1 and repeats_too_much(
            holders[v][0], elements, info.size, np.dtype(info.dtype).itemsize)

    shared = {v for v in holders if reused(v)}

    def in_loop(head: int, op_id: int) -> bool:
        """Op ``op_id`` is emitted in the loop fusion of launch group ``head``: one of its
        clusters' ops, or movement XLA fuses into it."""
        k = ctx.pos.get(op_id)
        return k is not None and (find(k) == head or fused_movement(k) and k not in materialised
                                  and kind[k] == Kind.MOVEMENT)

    def duplicated(members: Sequence[int], roots: Iterable[int]) -> tuple[list[int], list[int]]:
        """Ops of a loop fusion XLA writes out instead of recomputing, and those of them cut by
        CODE_DUPLICATION (where XLA's priority fusion is replayed instead: :func:`simulated`), walking
        the fusion from its ``roots`` (the tensors it writes) to its operands as XLA's indexing
        evaluation does: an operand of the op's own shape (or transposed) is indexed as the op
        is; any other read (slice, pad, concatenation, reshape) indexes it anew, once per
        emission of the reader; emissions are counted per fusion (the written tensor or cut
        each belongs to), as XLA checks each consumer fusion a producer would join. A broadcast
        is always fused (its operand is what may be cut); an expensive value a reader repeats at
        a cost above writing it out is written out (:func:`repeats_too_much`: Mamba's
        ``-exp(A_log)``, a loop fusion of its own in front of the scan)."""
        head = find(members[0])

        def cost(o: int) -> float:
            """What repeating ``o`` per element costs: :func:`chain_cost` over the ops of its size
            feeding it in the fusion (element-wise, views)."""
            size = g.tensors[g.ops[o].outputs[0]].size
            return chain_cost(g.ops[o].outputs[0], {q for q in seen if g.tensors[g.ops[q].outputs[0]].size == size})

        indexers: dict[int, set[int]] = {}
        for t in roots:
            p = g.producer(t)
            if p is not None:
                indexers.setdefault(p.id, set()).add(-1 - t)   # the fusion's output: emitted once
        # emissions per fusion: indexer -> {the root of a fusion it is emitted in: times}. XLA
        # counts a producer's emissions in each fusion it would join (its consumers' fusions are
        # made first), not over all of them: Mamba's ``exp(dt * A)``, read by the scan's first
        # level and by the readout's reduction, is fused into both
        count: dict[int, dict[int, int]] = {-1 - t: {-1 - t: 1} for t in roots}
        cuts: list[int] = []
        bounded: list[int] = []
        order: list[int] = []
        stack, seen = [o for o in indexers], set(indexers)
        while stack:
            o = stack.pop()
            order.append(o)
            for x in _data(g.ops[o]):
                p = g.producer(x)
                if p is not None and p.id not in seen and in_loop(head, p.id):
                    seen.add(p.id)
                    stack.append(p.id)
        repeated: dict[int, int] = {}   # expensive value -> elements its readers compute from it
        for o in sorted(order, reverse=True):   # op ids are in program order: consumers first
            op = g.ops[o]
            per: dict[int, int] = {}
            for i in indexers.get(o, ()):
                for r, k in count[i].items():
                    per[r] = per.get(r, 0) + k
            bound = max(per.values(), default=0) > CODE_DUPLICATION and op.primitive != "broadcast_in_dim"
            if (bound or o in repeated and repeats_too_much(cost(o), repeated[o], g.tensors[op.outputs[0]].size,
                                                            np.dtype(g.tensors[op.outputs[0]].dtype).itemsize)
                    ) and not any(g.same_value(t) in shared for t in op.outputs):   # (shared
                cuts.append(o)                                                       # tables: their own rule)
                if bound:
                    bounded.append(o)
                root = -1 - op.outputs[0]
                per, indexers[o] = {root: 1}, {root}
                count[root] = dict(per)
            count[o] = per
            shape = g.tensors[op.outputs[0]].shape
            for x in _data(op):
                p = g.producer(x)
                if p is None or p.id not in seen:
                    continue
                if g.tensors[op.outputs[0]].size > g.tensors[x].size:   # (a reader repeating it)
                    v = p
                    while is_view(v, g) and (q := g.producer(_data(v)[0])) is not None and q.id in seen:
                        v = q   # the value itself, not a view of it
                    repeated[v.id] = repeated.get(v.id, 0) + g.tensors[op.outputs[0]].size
                if tuple(g.tensors[x].shape) == tuple(shape) or op.primitive == "transpose":
                    indexers.setdefault(p.id, set()).update(indexers.get(o, ()))
                else:
                    indexers.setdefault(p.id, set()).add(o)
        return cuts, bounded

    def summed_parts(m: int) -> list[int] | None:
        """The parts a split-K GEMM's sum is cut into when slices and splits are all that read it
        (None otherwise): each is summed apart from the partials (XLA's ``loop_slice_fusion``)."""
        parts = [y for t in cl[m].outputs for op in g.consumers(t) for y in op.outputs
                 if op.primitive in ("split", "slice")]
        if parts and all(op.primitive in ("split", "slice") for t in cl[m].outputs for op in g.consumers(t)) \
                and not any(t in outs for t in cl[m].outputs):
            return parts
        return None

    simulations: dict[Problem, list[Fused]] = {}   # each distinct island's kernels, simulated once

    def simulated(members: Sequence[int], roots: Iterable[int], written: Sequence[int]
                  ) -> tuple[list[int], int, int] | None:
        """XLA's priority and multi-output fusion of a loop fusion's ops, simulated with its
        performance model (:mod:`xla_priority`), for a fusion CODE_DUPLICATION would cut (an
        associative scan's tree: where XLA writes out levels depends on how wide each step is,
        which no bound on emissions captures). ``written``: ops written out for reasons of their
        own (an expensive value, :func:`repeats_too_much`), kept written. ``(ops written out
        beyond the roots, launches beyond one, bytes beyond reading each operand once and writing
        the roots)``; None where an op is not one the simulation prices (a gather, a cumulative op)."""
        head = find(members[0])
        roots = list(roots)
        alias: dict[int, int] = {}

        def inside(o: int) -> bool:
            """Op ``o`` is one of the group's, and not a part of a split-K GEMM's sum (a reduce
            fusion of its own writes that, priced with the GEMM: a buffer here)."""
            op = g.ops[o]
            k = ctx.producer.get(op.inputs[0]) if op.primitive in ("split", "slice") and op.inputs else None
            return in_loop(head, o) and not (k is not None and kind[k] == Kind.MATMUL and split_of(k) > 1
                                              and summed_parts(k) is not None)
        found, stack = set(), [p.id for t in roots if (p := g.producer(t)) is not None and inside(p.id)]
        while stack:
            o = stack.pop()
            if o in found:
                continue
            found.add(o)
            stack.extend(p.id for x in _data(g.ops[o]) if (p := g.producer(x)) is not None and inside(p.id))
        read = {x for o in found for x in _data(g.ops[o])} | set(roots)
        nodes: list[PriorityNode] = []
        inputs: dict[int, tuple[int, int]] = {}
        common: dict[tuple, int] = {}
        for o in sorted(found):
            op = g.ops[o]
            # XLA's simplifier drops what has no elements: an operand of a concatenation (the one
            # row an associative scan's last level puts in front of nothing), ops computing it
            xs = [alias.get(x, x) for x in _data(op) if g.tensors[x].size]
            if not any(g.tensors[t].size for t in op.outputs):
                continue
            if is_view(op, g) or op.primitive == "concatenate" and len(xs) == 1:
                alias[op.outputs[0]] = xs[0]
                continue
            row = TABLE.get(op.primitive)
            what = ("elementwise" if row is not None and row.role in (Role.ELEMENTWISE, Role.GENERATOR) else
                    "broadcast" if op.primitive == "broadcast_in_dim" else
                    "transpose" if op.primitive in ("transpose", "rev") else
                    "slice" if op.primitive in ("split", "dynamic_slice") else   # (each part of a split)
                    # a reduction in the loop (Mamba's readout contracting 16 states, computed by
                    # XLA as a reduce fusion with the scan's last level inside it)
                    "reduce" if row is not None and row.role in (Role.REDUCTION, Role.CONTRACTION) else
                    op.primitive if op.primitive in ("slice", "pad", "concatenate") else None)
            if what is None or len(op.outputs) != 1 and op.primitive != "split":
                return None
            for x in xs:
                if (q := g.producer(x)) is None or q.id not in found:
                    inputs[x] = (g.tensors[x].size, ctx.nbytes[x])
            out_t = op.outputs[0]
            if what == "elementwise":   # an operand of fewer elements is broadcast (XLA's broadcast op)
                full = []
                for x in xs:
                    if g.tensors[x].size < g.tensors[out_t].size:
                        bid = -1 - len(nodes)
                        nodes.append(PriorityNode(bid, "broadcast", g.tensors[out_t].size, ctx.nbytes[out_t], (x,),
                                                  tuple(g.tensors[out_t].shape), 3))
                        full.append(bid)
                    else:
                        full.append(x)
                xs = full
            per = priority_cycles(HLO_OPCODE.get(op.primitive, op.primitive), np.dtype(g.tensors[out_t].dtype).itemsize) \
                if what == "elementwise" else priority_cycles("add", 4) if what == "reduce" else \
                concatenate_cycles(int(op.params["dimension"]), g.tensors[xs[0]].shape[int(op.params["dimension"])]) \
                if what == "concatenate" else 3
            for t, window in zip(op.outputs, windows(g, op)):
                # XLA's CSE: one instruction for equal ones (the scan's slices of one level, cut
                # the same way for the odd and the even steps)
                key = (op.primitive if op.primitive != "split" else "slice", tuple(xs), window,
                       tuple(g.tensors[t].shape), repr(sorted(op.params.items())) if not window else "")
                if key in common:
                    alias[t] = common[key]
                elif t in read:   # (a split's part the group does not read: not its to write)
                    common[key] = t
                    nodes.append(PriorityNode(t, what, g.tensors[t].size, ctx.nbytes[t], tuple(xs),
                                              tuple(g.tensors[t].shape), per, window))
        ids = {n.id for n in nodes}
        pinned = {alias.get(t, t) for t in roots} | {g.ops[o].outputs[0] for o in written}
        problem, back = canonical(nodes, inputs, pinned & ids)
        if problem not in simulations:   # (a model's layers: one simulation for all)
            simulations[problem] = problem.fuse()
        kernels = [Fused(tuple(back[t] for t in k.writes), frozenset(back[x] for x in k.reads))
                   for k in simulations[problem]]
        writes = {t for k in kernels for t in k.writes if t >= 0}
        total = sum(ctx.nbytes[x] for k in kernels for x in k.reads) + sum(ctx.nbytes[t] for t in writes)
        once = sum(ctx.nbytes[x] for x in inputs) + sum(ctx.nbytes[t] for t in roots)
        cut = sorted({g.producer(t).id for t in writes - {alias.get(t, t) for t in roots}})
        return cut, len(kernels) - 1, total - once

    def cut_rereads(members: Sequence[int], cuts: Sequence[int], roots: Iterable[int]) -> int:
        """Bytes the fusions a loop fusion is cut into (:func:`duplicated`) read of its operands
        beyond reading each once: each fusion recomputes what its own ops reach, not through
        another cut, reading the operands behind it again (RG-LRU's scan: the gates, computed
        from two GEMMs' results, recomputed and those results read by each level's fusion)."""
        if not cuts:
            return 0
        head = find(members[0])

        def operands(starts: Iterable[int]) -> set[int]:
            found, stack, seen = set(), list(starts), set()
            while stack:
                o = stack.pop()
                for x in _data(g.ops[o]):
                    p = g.producer(x)
                    if p is None or not in_loop(head, p.id):
                        found.add(x)
                    elif p.id not in seen and p.id not in cut_set:
                        seen.add(p.id)
                        stack.append(p.id)
            return found

        cut_set = set(cuts)
        starts = [p.id for t in roots if (p := g.producer(t)) is not None]
        first = operands(starts)
        everything = first.union(*(operands([o]) for o in cuts))
        return sum(ctx.nbytes[x] for o in cuts for x in operands([o])) - sum(
            ctx.nbytes[x] for x in everything - first)

    groups: dict[int, list[int]] = {}
    for k in range(len(cl)):
        groups.setdefault(find(k), []).append(k)
    # the buffers each loop fusion reads and writes: a column tree's partial sums over what one of
    # them reads or writes ride in it as one more output (XLA's multi-output fusion,
    # ``input_add_reduce_fusion``); partial sums of the same rows as another tree's share its
    # fusion (a LayerNorm's scale and bias gradients: one fusion writing both partials)
    loop_buffers = [({buffer_of(t) for m in ms for t in cl[m].inputs} | {t for m in ms for t in cl[m].outputs},
                     {g.tensors[t].size for m in ms for t in cl[m].outputs})
                    for r, ms in groups.items() if r not in recomputed and r not in glue_launches
                    and all(kind[m] == Kind.POINTWISE and m not in materialised for m in ms)]
    tree_partials: list[tuple[int, set[int]]] = []   # (rows reduced, buffers read) of each partial fusion
    applied_in_loop: set[int] = set()   # norms XLA applies in a loop fusion, not a Triton one
    summed_apart: set[int] = set()   # split-K GEMMs whose sum a reduce fusion of its own writes
    epilogue_written: set[int] = set()   # GEMMs whose result an epilogue's loop fusion writes

    def rows_behind(t: int, own: set[int]) -> frozenset[int]:
        """The buffers whose elements ``t`` is computed from, one for one, by element-wise work
        among ``own`` (a reduction's operand ``x * x``: ``x``'s buffer). Each value visited once
        (a backward pass's element-wise work is a DAG with many paths to one value)."""
        found, seen, todo = set(), set(), [t]
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            op = g.producer(x)
            row = TABLE.get(op.primitive) if op is not None else None
            if op is None or op.id not in own or row is None or row.role != Role.ELEMENTWISE:
                found.add(buffer_of(x))
                continue
            todo.extend(y for y in _data(op) if g.tensors[y].size == g.tensors[x].size)
        return frozenset(found)

    def reductions(k: int) -> list[Any]:
        return [g.ops[o] for o in cl[k].ops if g.ops[o].primitive.startswith("reduce_")]

    # reductions that write only reduced values, by (the rows they reduce, their result's shape)
    reduced_only: dict[tuple[frozenset[int], tuple[int, ...]], set[int]] = {}
    for k in range(len(cl)):
        if kind[k] == Kind.REDUCTION and not call[k] and (rs := reductions(k)) and all(
                g.tensors[t].size <= max(g.tensors[r.outputs[0]].size for r in rs) for t in cl[k].outputs):
            for r in rs:
                key = (rows_behind(_data(r)[0], set(cl[k].ops)), g.tensors[r.outputs[0]].shape)
                reduced_only.setdefault(key, set()).add(k)

    def reduced_beside(m: int, r: Any) -> bool:
        """Another fusion reduces the same rows to the same shape, writing only what it reduces
        (flax's GroupNorm: the mean and the mean of squares over several axes): XLA's sibling
        multi-output fusion reduces both in one launch reading the rows once, and ``r`` rides in
        it (the U-Net up block's ``input_reduce_fusion``, read off the compiles of both sides)."""
        key = (rows_behind(_data(r)[0], set(cl[m].ops)), g.tensors[r.outputs[0]].shape)
        return any(find(k) != find(m) for k in reduced_only.get(key, ()))

    def recomputed_from(t: int) -> set[int]:
        """What a fusion reading ``t`` reads where XLA recomputes ``t`` inside it (a norm's rows
        from the rows and statistics, a product duplicated into its readers): its sources."""
        if t in numerators:
            return {y for x in numerators[t] for y in recomputed_from(x)}
        k = ctx.producer.get(t)
        if k is not None and kind[k] == Kind.POINTWISE and find(k) in recomputed:
            return {y for x in cl[k].inputs for y in recomputed_from(x)}
        return {t}

    def riding_loop(t: int, m: int) -> bool:
        """``t`` is written by a loop fusion of its own, not cluster ``m``'s (a residual add)."""
        k = ctx.producer.get(t)
        return k is not None and kind[k] == Kind.POINTWISE and not call[k] and find(k) != find(m) \
            and find(k) not in recomputed and find(k) not in glue_launches

    def read_through(t: int) -> set[int]:
        """The buffers a fusion reading ``t`` reads: through work it recomputes, that work's."""
        k = ctx.producer.get(t)
        if k is not None and find(k) in recomputed:
            return {b for x in cl[k].inputs for b in read_through(x)}
        return {buffer_of(t)}

    for members in groups.values():
        head = members[0]
        scratch: set[int] = set()   # what the group's launches write for each other (buffers, not made)
        if find(head) in recomputed:
            add(members, "recomputed", 0, 0)
            continue
        if find(head) in glue_launches:
            ops = [g.ops[o] for m in members for o in cl[m].ops]
            bits = sum(op.primitive == "random_bits" for op in ops)   # random bits a kernel reads:
            # a loop fusion writing each, besides the key schedule and counters
            values = bits or _glue_roots(g, {o for m in members for o in cl[m].ops},
                                         [t for m in members for t in cl[m].outputs])
            add(members, "loop", values + _prng_launches(g, ops),
                sum(ctx.nbytes[t] for m in members for t in cl[m].outputs))
            continue
        if kind[head] == Kind.POINTWISE and not call[head] and all(
                g.same_value(t) in shared for m in members for t in cl[m].outputs):
            # tables a kernel call reads (a rolling cache's RoPE cos and sin at ``pos``, cast to
            # bf16 for the q and for the k kernel): written once per value, by the shared
            # tables' fusions below (``loop_convert_fusion`` x2, not four)
            add(members, "recomputed", 0, 0)
            continue
        if len(members) == 1 and call[head]:
            nbytes, made = 0, []
            for o in cl[head].ops:
                op = g.ops[o]
                alias = kernel_aliases(op)
                aliased = set(alias.values()) - kernel_reads_in_place(op)   # (one it reads, it reads whole)
                seen: set[int] = set()
                for j, x in enumerate(op.inputs):
                    b = buffer_of(x)
                    if j not in aliased and b not in seen:
                        seen.add(b)
                        nbytes += ctx.nbytes[x]
                for j, y in enumerate(op.outputs):
                    if j not in alias:
                        nbytes += ctx.nbytes[y]
                        made.append(y)
            add(members, "kernel", len(cl[head].ops), nbytes, made)
            continue
        if any(m in materialised for m in members) and all(
                m in materialised or kind[m] == Kind.POINTWISE for m in members):
            pairs = [(t, x) for m in members if m in materialised
                     for o in cl[m].ops for t, x in zip(g.ops[o].outputs, _data(g.ops[o])[:1])]
            srcs = [x for m in members if m in materialised for o in cl[m].ops for x in _data(g.ops[o])]
            counted: set[int] = set()   # (every part of a concatenation, each buffer once)
            inside = frozenset(m for m in members if m in into_copy)
            srcs += [x for m in inside for x in cl[m].inputs]   # (what the work computed in it reads)
            nbytes = sum(ctx.nbytes[t] for t, _ in pairs) + sum(
                read_bytes(x, set(), inside, whole=counted) for x in dict.fromkeys(buffer_of(x) for x in srcs))
            add(members, "copy", 1, nbytes, [t for m in members if m in materialised for t in cl[m].outputs])
            continue
        if len(members) == 1 and fused_movement(head):
            if kind[head] == Kind.GLUE and (prng := _prng_launches(g, [g.ops[o] for o in cl[head].ops])):
                add(members, "prng", prng, prng * 2 * SMALL_LAUNCH_BYTES)
            elif kind[head] == Kind.GLUE and any(t in outs for t in cl[head].outputs) and any(
                    not is_view(g.ops[o], g) and g.ops[o].primitive not in CAST_ONLY for o in cl[head].ops):
                # scalar arithmetic returned (a loss's ``sum / count`` after a kernel's sum): no
                # reader to fuse into, a loop fusion of its own writes it (``loop_divide_fusion``)
                add(members, "loop", 1, sum(ctx.nbytes[t] for t in cl[head].outputs)
                    + sum(ctx.nbytes[x] for x in dict.fromkeys(cl[head].inputs)), cl[head].outputs)
            if kind[head] == Kind.MOVEMENT:
                for o in cl[head].ops:
                    op = g.ops[o]
                    if not any(t in outs for t in op.outputs):
                        continue
                    chain = [op]   # back through movement XLA fuses into this copy: a
                    # transpose then a reshape returned is the transpose written out
                    while ((k := ctx.producer.get(_data(chain[-1])[0])) is not None and kind[k] == Kind.MOVEMENT
                           and k not in materialised and fused_movement(k)):
                        chain.append(g.producer(_data(chain[-1])[0]))
                    if not all(ctx.bitcast.get(q.id) or _gemm_writes_transposed(g, q) for q in chain):
                        # one constant filled in one shape and dtype is one launch however many
                        # outputs take it (XLA's CSE and a multi-output loop fusion: the zero
                        # gradients of unused or frozen weights of one shape, ``loop_broadcast_fusion``)
                        key = _fill_key(g, op) if len(chain) == 1 else None
                        add(members, "copy", int(key is None or key not in filled), sum(ctx.nbytes[t] for t in op.outputs)
                            + sum(read_bytes(x, set()) for x in _data(chain[-1])), op.outputs)
                        if key is not None:
                            filled.add(key)
            continue
        if len(members) == 1 and is_dus(head):
            add(members, "update", 1, sum(ctx.base.get(o, 0) for o in cl[head].ops), cl[head].outputs)
            continue
        sorts = [g.ops[o] for m in members for o in cl[m].ops if g.ops[o].primitive in SORTS]
        if sorts:
            n = nbytes = 0
            for op in sorts:
                n_, b_ = sort_price(op)
                n, nbytes = n + n_, nbytes + b_
            add(members, "sort", n, nbytes, [t for op in sorts for t in op.outputs])
            continue
        inside = {t for m in members for t in cl[m].outputs}
        ins = {t for m in members for t in cl[m].inputs if t not in inside}
        own = frozenset(members)

        def leaves(t: int, seen: set[int]) -> bool:
            """``t`` is read outside the group: a program output, or read by another group (through
            fused movement: a slice of it read back inside the group is not)."""
            if t in outs:
                return True
            for u in ctx.users.get(t, ()):
                if u in own or u in seen:
                    continue
                seen.add(u)
                if not fused_movement(u) or u in materialised or u in feeds_call or find(u) != u:
                    return True
                if any(leaves(x, seen) for x in cl[u].outputs):
                    return True
            return False

        out = {t for m in members for t in cl[m].outputs if leaves(t, set()) and t not in numerators}
        nbytes = 0
        n = 1
        for m in members:
            if kind[m] != Kind.CONV:
                continue
            direct = [u for t in cl[m].outputs for u in readers_through_views(t, pads=True)
                      if kind[u] in _NEVER_IN_A_LOOP or call[u]]   # (a GEMM reading it too: Mamba's conv1d)
            returned = any(t in outs for t in cl[m].outputs) and not any(
                _channels_first(g.ops[o], "out_spec") for o in cl[m].ops if g.ops[o].primitive == "conv_general_dilated")
            if _loop_epilogue(g, cl[m]) and (direct or returned):
                n += 1   # cuDNN fuses bias + ReLU only (an eval BatchNorm's per-channel scale
                # is a multiply it does not take); another epilogue is a loop fusion of its
                # own where a convolution, a GEMM or a kernel call reads the result, or it is
                # returned (else it fuses into the fusions reading it: the
                # layout transpose of a channels-first result too), reading cuDNN's output and
                # writing the result
                nbytes += 2 * sum(ctx.nbytes[t] for t in cl[m].outputs)
                if any(call[u] for u in direct) and _epilogue_rereads(g, cl[m]) and any(
                        _channels_first(g.ops[o], "out_spec") for o in cl[m].ops
                        if g.ops[o].primitive == "conv_general_dilated"):
                    # a kernel call reads the result channels-first (row-major NCHW) and the
                    # epilogue reads a value twice (SiLU's ``x * sigmoid(x)``): XLA's layout
                    # assignment gives that value NCHW, so cuDNN's NHWC result is transposed by
                    # a launch of its own and the epilogue reads it in both layouts (YOLO's C3k2
                    # under VTC: ``wrapped_transpose.1``, then an ``input_transpose_fusion``
                    # reading it and cuDNN's buffer; ConvNeXt's depthwise bias, read once, is
                    # transposed inside its one loop fusion)
                    n += 1
                    nbytes += 3 * sum(ctx.nbytes[t] for t in cl[m].outputs)
        for m in members:   # an epilogue XLA's GEMM does not take, in a loop fusion of its own
            if epilogue_apart(m) == "loop":
                (t,) = cl[m].outputs   # (reading the product, or the merged GEMM's whole result
                n, nbytes = n + 1, nbytes + merged_whole.get(m, ctx.nbytes[t]) + ctx.nbytes[t]
                epilogue_written.add(m)   # its part is in: no slice copied out besides)
        for m in members:   # a split-K GEMM: its reduce is a loop fusion of its own unless
            if kind[m] != Kind.MATMUL:   # the one fusion reading the sum takes it in
                continue
            split = split_of(m)
            if split > 1:
                users = {u for t in cl[m].outputs for u in consumers_through_movement(t, set())
                         if find(u) != find(m)}
                # a norm (XLA's Triton normalization fusion) or another GEMM reading the sum
                # cannot take the reduce in; a loop fusion or a kernel call's operand fusion does
                # (a copy XLA makes of the sum for the call, a merged GEMM's part copied out of
                # its buffer among them: a call reading the sum itself, or through bitcasts,
                # reads the buffer a reduce fusion of its own writes — LoRA's
                # ``dy @ B.T`` read by the Pallas kernel of ``A``'s gradient, ``loop_reduce_fusion``),
                # and so does a Triton softmax reading nothing else of its size (a router's
                # logits: the GEMM, then the softmax summing the partials; a residual add in
                # front of a norm keeps the reduce a fusion of its own); a sum returned and read
                # by nothing (a weight's gradient) is reduced by a fusion of its own, or by the
                # loop fusion of its epilogue (BLOOM's output bias)
                size = {g.tensors[t].size for t in cl[m].outputs}
                dots = [o for o in cl[m].ops if g.ops[o].primitive == "dot_general"]
                epilogue = any(o > dots[0] and g.ops[o].primitive not in CAST_ONLY for o in cl[m].ops)
                # (a merged GEMM's parts copied out of its buffer: each copy sums the partials)
                returned_alone = not users and not epilogue and m not in merged and any(
                    returned(t) for t in cl[m].outputs)

                def takes_no_reduce(u: int) -> bool:
                    softmax_alone = kind[u] == Kind.REDUCTION and len(users) == 1 and all(
                        x in cl[m].outputs for x in cl[u].inputs if g.tensors[x].size in size)
                    return kind[u] in (Kind.REDUCTION, Kind.MATMUL) and not call[u] and not softmax_alone

                partials = split * sum(g.tensors[t].size * 4 for t in cl[m].outputs)
                parts = summed_parts(m)
                if parts is not None:
                    # the sum cut into parts read apart (Mamba's ``dt, B, C`` out of x_proj): each
                    # part a fusion that cannot take the reduce in reads is reduced by a fusion of
                    # its own, reading all the partials (``loop_slice_fusion``, one per part)
                    for y in parts:
                        if any(takes_no_reduce(find(u)) for u in consumers_through_movement(y, set())):
                            n, nbytes = n + 1, nbytes + partials + ctx.nbytes[y]
                elif returned_alone or any(takes_no_reduce(u) for u in users) or m not in merged and any(
                        called_through_bitcasts(t) for t in cl[m].outputs):
                    n += 1
                    nbytes += 2 * partials
                    summed_apart.add(m)
        prologue_loop = False   # (a loop fusion writing a GEMM operand: reads like one, below)
        for m in members:   # a matmul prologue (cluster._grow_prologue) is XLA's loop fusion
            if kind[m] != Kind.MATMUL:   # of its own: it writes the operand the GEMM then reads
                continue
            dots = [o for o in cl[m].ops if g.ops[o].primitive == "dot_general"]
            made_in = {t for o in cl[m].ops if o not in dots for t in g.ops[o].outputs}
            for o in dots:   # (both operands made by prologues: one multi-output loop fusion,
                prologued = [x for x in g.ops[o].inputs[:2] if x in made_in]   # linear attention's
                if prologued:                                                  # ``input_transpose_fusion``)
                    n += 1
                    nbytes += 2 * sum(ctx.nbytes[_before_widening(g, x, made_in)] for x in prologued)
                    prologue_loop = True
            for x in (x for o in dots for x in _gemm_relayouts(g, g.ops[o], from_merged) if x not in made_in):
                n_, b_ = relayout(x)
                n, nbytes = n + n_, nbytes + b_
        for m in members:   # a norm (TRITON_NORM_MAX_ROW): one Triton fusion, or a reduction
            if kind[m] != Kind.REDUCTION:   # fusion per statistic and a loop fusion applying them,
                continue                    # each reading the rows again
            reds = [g.ops[o] for o in cl[m].ops if g.ops[o].primitive.startswith("reduce_")
                    and o not in into_scatter   # (inside a scatter's fusion, above)
                    and not _column_tree(g, g.ops[o])   # (column trees: below; a reduction over
                    and g.tensors[_data(g.ops[o])[0]].size > g.tensors[g.ops[o].outputs[0]].size]
            # unit axes alone is a bitcast to XLA, no statistic: ``jax.grad`` of a log-softmax's
            # ``keepdims`` sum; counted one, GPT-2's loss was three launches over)
            if not reds:
                continue
            row = max(g.tensors[x].size // max(1, g.tensors[r.outputs[0]].size) for r in reds for x in _data(r))
            rows = min(g.tensors[r.outputs[0]].size for r in reds)
            minor = all(_reduces_minor(g, r) for r in reds)
            if not any(g.tensors[t].size > g.tensors[reds[-1].outputs[0]].size and not (
                    t in norm_rows and row > TRITON_NORM_MAX_ROW) for t in cl[m].outputs):
                # (statistics alone, or with rows over long rows that every reader recomputes from
                # them: a log-softmax over a 50,304-word vocabulary read by ``take_along_axis``)
                for t in _expensive_per_row(g, {o for c in members for o in cl[c].ops}, reds):
                    n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[t]   # (see below)
                if minor and row > TRITON_NORM_MAX_ROW:   # statistics alone over long rows: each
                    # a tree too (a partial and a finishing launch: the sum of a loss's gradient
                    # over a 32,000- or 50,304-word vocabulary), the rows read once per statistic
                    n += 2 * len(reds) - 1
                    nbytes += (len(reds) - 1) * sum(ctx.nbytes[x] for x in _data(reds[-1]))
                continue
            if rows >= 2 and row <= TRITON_NORM_MAX_ROW and minor:
                x = _data(reds[0])[0]
                if row & (row - 1) and row <= XLA_FLAT_NORM_SPLIT_MAX_ROW and len(g.tensors[buffer_of(x)].shape) == 1:
                    # rows of a flat buffer (a kernel's result) that a Triton tile cannot cover:
                    # two Triton fusions, the first writing ``x - max`` (Swin's masked softmax
                    # between VTC's kernels)
                    n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[x]
                stat = [t for t in cl[m].inputs if g.tensors[t].size == rows and any(
                    kind[k] == Kind.REDUCTION and (_statistic(g, cl[k]) or stat_apart(k))
                    for k in producers_through_movement(t, set()))]
                if stat and row > XLA_NORM_ROW_FUSED_MAX and _per_row_inputs(g, set(cl[m].ops), reds) > 1:
                    # a statistic reduced beside it (flax's mean of squares, E[x²] − E[x]²): no
                    # Triton fusion; its reductions join that statistic's fusion, a loop fusion
                    # computes the row's scale from them, and another applies it (read off the
                    # compile: three launches; an RMSNorm's scale, from one sum, is computed by
                    # the fusion applying it: LoRA's ``loop_convert_fusion.2``)
                    n, nbytes = n + 1, nbytes + 3 * sum(ctx.nbytes[t] for t in stat)
                    applied_in_loop.add(m)
                stat_clusters = {c for t in stat for k in producers_through_movement(t, set()) for c in groups[find(k)]}
                stat_ops = {o for c in stat_clusters for o in cl[c].ops}
                stat_reds = [g.ops[o] for o in stat_ops if g.ops[o].primitive.startswith("reduce_")]
                rows_read = {rows_behind(_data(r)[0], set(cl[c].ops)) for c in stat_clusters for r in reductions(c)}
                inputs_read = {x for r in stat_reds for x in _inputs_read(g, _data(r)[0], stat_ops)}
                group_ops = {o for c in members for o in cl[c].ops}
                for i, level in enumerate(_mixed_levels(g, set(cl[m].ops), reds)):
                    if i == 0 and stat and all(
                            rows_behind(_data(r)[0], set(cl[m].ops)) in rows_read
                            or _inputs_read(g, _data(r)[0], group_ops) & inputs_read for r in level):
                        continue   # (joined the statistic's fusion, above: XLA's sibling
                        # multi-output fusion merges reductions of the same rows, or reading a
                        # common operand no GEMM makes — a LayerNorm's scale —, never through a
                        # GEMM's result alone: a residual LayerNorm's two row sums of its
                        # gradient stay apart)
                    # a depth of row sums no Triton fusion takes (a norm's backward): a reduction
                    # fusion reading the rows (siblings reading the same rows in one), and a loop
                    # fusion computing the per-row scalars past XLA_NORM_ROW_FUSED_MAX
                    sources = {frozenset(rows_behind(_data(r)[0], set(cl[m].ops))) for r in level}
                    n += (row > XLA_NORM_ROW_FUSED_MAX and not (i == 0 and stat)
                          and _per_row_inputs(g, set(cl[m].ops), level) > 1)
                    # (beside a statistic, the loop fusion computing the scale computes them too;
                    # per-row work reading one value, an RMSNorm's ``rsqrt(sum / n + eps)``, is
                    # computed by the fusion applying it)
                    for rows_ in sources:
                        if i == 0 and all(riding_loop(b, m) for b in rows_):
                            continue   # (reducing rows a loop fusion writes: one more output of
                            # it, XLA's producer-consumer multi-output fusion — LoRA's residual
                            # add and its final RMSNorm's sum, ``input_add_reduce_fusion``)
                        n += 1
                        nbytes += sum(read_bytes(x, set()) for x in {x for b in rows_ for x in recomputed_from(b)})
                    applied_in_loop.add(m)
                renormed = any(kind[k] == Kind.REDUCTION for r in reds for b in rows_behind(_data(r)[0], set(cl[m].ops))
                               for k in producers_through_movement(b, set()))
                # a norm applied in the cluster whose per-row values other fusions read too (a
                # training step's backward reading an RMSNorm's ``rsqrt`` and its derivative):
                # XLA's Triton fusion writes the normalised rows alone, so there is none (LoRA's
                # final RMSNorm on both jax versions: ``input_add_reduce_fusion`` and
                # ``loop_convert_fusion_2``; a softmax's statistics, applied by another cluster,
                # are its statistics fusion already)
                own_ops = set(cl[m].ops)
                escaped = any(g.tensors[t].size > rows and _made_from(g, t, own_ops, {reds[-1].id})
                              for t in cl[m].outputs) and any(
                    g.tensors[t].size == rows and any(kind[u] in (Kind.POINTWISE, Kind.REDUCTION) and not call[u]
                                                      and find(u) != find(m) for u in ctx.users.get(t, ()))
                    for t in cl[m].outputs)   # (a cache update writing an int8 cache's scale: no reader)
                if not stat and not renormed and m not in applied_in_loop and (
                        escaped or not _diamond(g, group_ops, reds)):
                    # no diamond, no Triton fusion: a reduction fusion reading the rows (reductions
                    # of the same rows in one), the cluster's launch applying its result, and a
                    # loop fusion for each expensive per-row value made elsewhere (a Triton fusion
                    # takes those in). (Rows a norm or softmax writes XLA recomputes here, with
                    # their diamond: jit's attention backward, ``fusion_83`` of LoRA's step.)
                    for rows_ in {frozenset(rows_behind(_data(r)[0], set(cl[m].ops))) for r in reds}:
                        if all(riding_loop(b, m) for b in rows_):
                            continue
                        n += 1
                        nbytes += sum(read_bytes(x, set()) for x in {x for b in rows_ for x in recomputed_from(b)})
                    for t in _expensive_per_row(g, group_ops, reds):
                        n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[t]
                    for t in cl[m].outputs if escaped and XLA_WRITES_ESCAPING_ROW_SCALE else ():
                        if g.tensors[t].size == rows and is_expensive(g.producer(t)):   # (the rsqrt)
                            n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[t]
                    applied_in_loop.add(m)
                continue
            # one row: a reduction fusion per statistic; rows longer than the Triton fusion takes,
            # reduced along their minor axes: each statistic a tree (XLA's tree reduction
            # rewriter: a fusion reading the rows into partial results, one reducing those; a
            # softmax over a 128,256-word vocabulary); over several axes: one reduction fusion
            # (flax's GroupNorm over 40,960-wide groups, U-Net: the compile's count)
            # (a statistic over a major axis, ``jax.image.resize``'s weight columns normalised
            # by their sum: XLA's Triton fusion reduces minor axes only, a reduction fusion too)
            if not minor and all(reduced_beside(m, r) for r in reds):
                continue
            if row > TRITON_NORM_MAX_ROW:
                extra = 2 * len(reds) if minor else 1
            else:
                extra = len(reds)
            n += extra
            own_ops = {o for m2 in members for o in cl[m2].ops}
            nbytes += min(extra, len(reds)) * sum(source_bytes(x, own_ops) for x in _data(reds[-1]))
        for m in members:   # reductions over axes a kept axis separates: a small loop fusion
            if kind[m] != Kind.REDUCTION:   # finishes each (:func:`_finished_apart`)
                continue
            for r in reductions(m):
                if partials := _finished_apart(g, r):
                    n, nbytes = n + 1, nbytes + 2 * 4 * partials
        for m in members:   # column trees (XLA_COLUMN_TREE_MIN_ROWS): the finishing reduce a
            if kind[m] != Kind.REDUCTION:   # launch of its own, and any epilogue of it another
                continue
            trees = [g.ops[o] for o in cl[m].ops if _column_tree(g, g.ops[o])]
            for op in trees:
                (r,) = op.outputs
                partial = _column_tree(g, op) * ctx.nbytes[r] * 4 // max(1, g.tensors[r].dtype.itemsize)
                n, nbytes = n + 1, nbytes + 2 * partial
                if any(not is_view(u, g) and u.primitive not in CAST_ONLY and u.id in cl[m].ops
                       for u in g.consumers(r)):
                    n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[r]
            if not trees:
                continue
            row_reds = [o for o in cl[m].ops if g.ops[o].primitive.startswith("reduce_") and not _column_tree(g, g.ops[o])
                        and g.tensors[_data(g.ops[o])[0]].size > g.tensors[g.ops[o].outputs[0]].size]
            size = g.tensors[_data(trees[0])[0]].size
            read = {b for t in cl[m].inputs if g.tensors[t].size == size for b in read_through(t)}
            sibling = next((r for s_, r in tree_partials if s_ == size and r & read), None)
            # beside row statistics (a LayerNorm's backward) applied by a loop fusion, the partial
            # sums ride in it (GPT-2's, ``input_add_reduce_fusion``); beside a Triton norm they are
            # a fusion of their own (or a sibling's), and what they sum, where it is made from the
            # statistics (the normalised rows), is written by a Triton fusion of its own
            if row_reds and m not in applied_in_loop:
                if sibling is None:
                    n += 1
                    nbytes += sum(ctx.nbytes[x] for op in trees for x in _data(op))
                for x in {x for op in trees for x in _data(op)}:
                    if _made_from(g, x, set(cl[m].ops), set(row_reds)):   # (reading the rows,
                        # writing the value; the partial sums read it beside its other factor)
                        n, nbytes = n + 1, nbytes + 3 * ctx.nbytes[x]
            elif not row_reds and len(members) == 1 and all(g.tensors[t].size < size for t in cl[m].outputs):
                common = set()
                if sibling is not None:
                    common = sibling & read
                elif any(read <= bufs and size in sizes for bufs, sizes in loop_buffers):
                    common = read
                if common:
                    n -= 1
                    nbytes -= sum(ctx.nbytes[t] for t in common)
            tree_partials.append((size, read))
        for o in (o for m in members for o in cl[m].ops if g.ops[o].primitive in CUMULATIVE):
            op = g.ops[o]   # a long scan: the levels of the reduce-window tree, each a launch
            extra = cumulative_launches(g.tensors[op.inputs[0]].shape[op.params["axis"]]) - 1
            (t,) = op.outputs   # reading or writing about the scanned tensor once; the last level's
            readers = readers_through_views(t)   # add fuses into a loop fusion reading the result
            if extra and t not in outs and readers and not any(   # (LLaVA's positions by cumsum)
                    kind[u] in _NEVER_IN_A_LOOP or call[u] for u in readers):
                extra -= 1
            n += extra
            nbytes += extra * ctx.nbytes[t]
        if any(kind[m] == Kind.ATTENTION for m in members):
            red = [o for m in members for o in cl[m].ops
                   if g.ops[o].primitive == "dot_general" or g.ops[o].primitive.startswith("reduce_")]
            dots = [g.ops[o] for o in red if g.ops[o].primitive == "dot_general"]
            if any(_vector_dot(g, d) for d in dots) and _keys_minor(g, dots[0]) and len(dots) > 1:
                # decode over a key cache stored keys-minor (BLOOM's (B·H, D, T)): the scores come
                # out keys-minor and the softmax is one Triton fusion between the two reductions
                made_in = {t for m in members for o in cl[m].ops for t in g.ops[o].outputs}
                probs = next((x for x in dots[-1].inputs[:2] if x in made_in), dots[-1].inputs[0])
                n = len(dots) + 1
                nbytes += 2 * ctx.nbytes[dots[0].outputs[0]] + 2 * ctx.nbytes[probs]
                n, nbytes = (a + b for a, b in zip((n, nbytes), transposed_copies(dots)))
            elif any(_vector_dot(g, d) for d in dots):   # decode: every step its own reduction
                n = max(1, 2 * len(red) - 1)
                # the scores written by the first, and each element-wise fusion between two
                # reductions reading and writing them (the mask, ``exp``, the probabilities'
                # layout), each later reduction reading them (the compile's 10 x the scores for
                # a masked softmax between the two dots)
                scores = ctx.nbytes[g.ops[red[0]].outputs[0]] if len(red) > 1 else 0
                nbytes += scores * (1 + 3 * (len(red) - 1)) + 2 * sum(
                    ctx.nbytes[g.ops[o].outputs[0]] for o in red[1:-1])
                n, nbytes = (a + b for a, b in zip((n, nbytes), transposed_copies(dots)))
            else:   # prefill: GEMMs with the softmax between them one fusion (XLA's Triton softmax)
                made_in = {t for m in members for o in cl[m].ops for t in g.ops[o].outputs}
                scores = dots[0].outputs[0]
                # the scores and the probabilities are buffers of their own between the launches
                # (jit's temporaries: 1,536 MiB for a 2 x 32-head causal prefill of 2,048 tokens,
                # f32 scores and bf16 probabilities, where the model counted none)
                scratch |= {scores} | {next((x for x in d.inputs[:2] if x in made_in), d.inputs[0]) for d in dots[1:]}
                n = len(dots) + (len(red) > len(dots))
                nbytes += 2 * sum(ctx.nbytes[d.outputs[0]] for d in dots[:-1])
                nbytes += 2 * sum(ctx.nbytes[next((x for x in d.inputs[:2] if x in made_in), d.inputs[0])]
                                  for d in dots[1:])   # the probabilities: either operand
                order = _scores_transposed(g, [o for m in members for o in cl[m].ops], scores)
                regroup = _scores_regrouped(g, [o for m in members for o in cl[m].ops], scores)
                if regroup is not None and XLA_MASKS_REGROUPED_SCORES_APART:   # heads regrouped by a reshape of the scores (a flax Gemma
                    # grouping its query heads): the work on the scores before the softmax is a
                    # loop fusion of its own, writing them f32 for the Triton softmax
                    n, nbytes = n + 1, nbytes + ctx.nbytes[scores] + g.tensors[regroup].size * 4
                if order == "statistics":   # each statistic a reduction fusion reading the scores
                    reds = len(red) - len(dots)
                    n += reds
                    nbytes += reds * ctx.nbytes[scores]
                elif order == "layout" and len(dots) > 1:   # the probabilities transposed
                    (pc, _), _ = dots[1].params["dimension_numbers"]
                    probs = next((x for x in dots[1].inputs[:2] if x in made_in), dots[1].inputs[0])
                    keys = math.prod(g.tensors[dots[1].inputs[0]].shape[a] for a in pc)
                    if keys > XLA_PROBS_TRANSPOSE_MAX_KEYS:
                        n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[probs]
                for d in dots:   # operands a GEMM cannot read where they are: a repeated (GQA)
                    for x in _gemm_relayouts(g, d, from_merged):   # one, heads not next to the batch: copied
                        (_, (lb, rb)) = d.params["dimension_numbers"]
                        moved = (_repeat_transposed(g, x, lb if x == d.inputs[0] else rb)
                                 if x not in relaid else None)
                        if _repeated(g, x) and not XLA_WRITES_REPEATED_GEMM_OPERANDS:
                            relaid.add(x)   # the GEMM reads it through the broadcast
                        else:
                            n_, b_ = relayout(x)
                            n, nbytes = n + n_, nbytes + b_
                        if moved is not None:   # a repeat whose heads move too: one more launch
                            n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[moved]
                # a gathered bias (Swin's relative-position table at its index): the Triton
                # softmax fusion cannot contain the gather, which is a launch of its own
                # (``wrapped_gather``) writing what the softmax then reads
                for op in {_source_gather(g, t) for t in ins} - {None}:
                    if _gemm_reads(g, op.outputs[0]) or not np.issubdtype(g.tensors[op.outputs[0]].dtype, np.floating):
                        continue   # a gathered GEMM operand (relaid above), or indices
                    n, nbytes = n + 1, nbytes + 2 * sum(ctx.nbytes[y] for y in op.outputs)
        # a scatter into a buffer of one value (``jax.grad`` of a gather: a zero buffer scattered
        # into): a loop fusion writes the buffer, the scatter updates it in place, writing the
        # rows its updates hold (``loop_broadcast_fusion``, ``input_scatter_fusion``)
        for o in (o for m in members if kind[m] == Kind.OPAQUE for o in cl[m].ops):
            op = g.ops[o]
            fill = g.producer(op.inputs[0]) if op.primitive.startswith("scatter") else None
            if fill is not None and is_fill(fill, g):
                n, nbytes = n + (op.outputs[0] not in folded), nbytes + ctx.update_bytes(op)
                x = next((folded_adds[u.id] for u in g.consumers(op.outputs[0]) if u.id in folded_adds), None)
                if x is not None and g.producer(x) is None and x not in ctx.donated:   # an input: copied
                    n, nbytes = n + 1, nbytes + 2 * ctx.nbytes[x]
        group_ops = {o for m in members for o in cl[m].ops}
        # a gather of single elements (a target token's log-probability, ``take_along_axis``)
        # read by a reduction: XLA fuses no such gather into a reduction fusion (a gather of rows
        # it does); a loop fusion of its own writes the elements, with the element-wise work
        # between them and the reduction (``loop_select_fusion``), which the reduction reads —
        # riding in another reduction reading the same indices' source where there is one (XLA's
        # sibling multi-output fusion: LoRA's ``input_reduce_select_fusion``, with the count of
        # valid labels)
        if any(op.primitive.startswith("reduce_") and g.tensors[_data(op)[0]].size > g.tensors[op.outputs[0]].size
               for op in (g.ops[o] for m in members if kind[m] == Kind.REDUCTION for o in cl[m].ops)):
            for t in ins:
                op = g.producer(behind_bitcasts(t))
                if op is None or op.id in group_ops or not _element_gather(op):
                    continue
                behind = _walk([op.inputs[1]], lambda x: _data(p) if (p := g.producer(x)) is not None and (
                    p.id in group_ops or is_view(p, g) or p.primitive in _FUSED_VIEWS
                    or find(ctx.pos[p.id]) in recomputed) else ())   # (through the indices' arithmetic)
                sibling = any(find(u) != find(head) and any(kind[c] == Kind.REDUCTION for c in groups[find(u)])
                              for x in behind for u in [*ctx.users.get(x, ()), ctx.producer.get(x, find(head))])
                n, nbytes = n + (not sibling), nbytes + 2 * ctx.nbytes[t]
        # the add a scatter was folded into is gone: work after it in the group is a loop fusion
        # of its own, after the scatter, reading the scattered buffer (the work before it writing
        # the buffer); a group that was the add alone is no launch
        for a in (g.ops[o] for o in group_ops if o in folded_adds):
            todo, after = [a.outputs[0]], set()   # (the group's ops reading the add's result)
            while todo:
                for u in g.consumers(todo.pop()):
                    if u.id in group_ops and u.id not in after:
                        after.add(u.id)
                        todo.extend(u.outputs)
            before = {o for o in group_ops - after - {a.id}
                      if not is_view(g.ops[o], g) and g.ops[o].primitive not in CAST_ONLY}
            if before and after:
                x = folded_adds[a.id]
                n, nbytes = n + 1, nbytes + ctx.nbytes[x] + ctx.nbytes[a.outputs[0]]
            elif not before and not any(not is_view(g.ops[o], g) and g.ops[o].primitive not in CAST_ONLY
                                        for o in after):
                n = 0
        # a full reduction's element-wise epilogue (a loss's mean, its negation): a small loop
        # fusion of its own (a statistic of one row applied back to the row is a norm: below)
        for m in members:
            if kind[m] != Kind.REDUCTION or any(g.tensors[t].size > 1 for t in cl[m].outputs):
                continue
            if any(g.ops[o].primitive.startswith("reduce_") and g.tensors[g.ops[o].outputs[0]].size == 1
                   and g.tensors[_data(g.ops[o])[0]].size > 1 and any(
                       u.id in cl[m].ops and not is_view(u, g) and u.primitive not in CAST_ONLY
                       for u in g.consumers(g.ops[o].outputs[0])) for o in cl[m].ops):
                n += 1
        if any(is_dus(m) for m in members):   # the update fused into the in-place DUS fusion:
            for m in members:                    # it writes the update (and the copy, if any)
                for o in cl[m].ops if is_dus(m) else ():
                    op = g.ops[o]
                    ins.discard(op.inputs[0])
                    nbytes += ctx.update_bytes(op) + (ctx.base.get(o, 0) - 2 * ctx.update_bytes(op))
            out = {t for t in out if not any(is_dus(m) and t in cl[m].outputs for m in members)}
        what = next((str(kind[m]) for m in members if kind[m] not in (Kind.POINTWISE, Kind.MOVEMENT, Kind.GLUE)),
                    "loop")
        made = set(out)
        if all(kind[m] == Kind.POINTWISE or m in dot_reduces for m in members):   # past the duplication bound:
            cuts, bounded = duplicated(members, out)
            sim = simulated(members, out, [o for o in cuts if o not in bounded]) if bounded else None
            if sim is not None:   # XLA's own greedy decides where a tree of indexings is cut
                cuts, more, extra = sim
                n, nbytes = n + more, nbytes + extra
                made.update(g.ops[o].outputs[0] for o in cuts)
                cuts = []
            for o in cuts:                                    # written out, read back by each reader
                t = g.ops[o].outputs[0]
                reads = [min(ctx.nbytes[t], sum(ctx.nbytes[y] for y in u.outputs)) for u in g.consumers(t)]
                n, nbytes = n + 1, nbytes + ctx.nbytes[t] + sum(reads)
                made.add(t)
            nbytes += cut_rereads(members, cuts, out)
        # each buffer once, however many views of it the group reads (a GroupNorm's rows, read
        # as the concatenation and as its reshape to groups: one operand of the loop fusion; two
        # parts of one merged GEMM's result read by one launch: T5's ``gelu(x @ wi_0) * (x @ wi_1)``)
        read: dict[tuple[int, int], int] = {}
        looped = all(kind[m] == Kind.POINTWISE for m in members)
        for t in {x for t in ins for x in recomputed_from(t)}:
            part = merged_member(t)
            b = (1, find(part)) if part is not None and part in merged_bytes and n == 1 else (0, buffer_of(t))
            read[b] = max(read.get(b, 0), read_bytes(t, set(), own, strided=looped or prologue_loop or t in relaid))
        nbytes += sum(read.values()) + sum(as_written.get(t, ctx.nbytes[t]) for t in out)
        add(members, what, n, nbytes if n else 0, made)
        for t in scratch - made:
            written.setdefault(t, len(fusions) - 1)
    for members in concatenated:   # weights of widths the GEMM fusion cannot concatenate in its
        # operand (LoRA's rank-16 A matrices): ``wrapped_concatenate``, reading and writing them
        weights = [next(g.ops[o] for o in cl[k].ops if g.ops[o].primitive == "dot_general").inputs[1]
                   for k in members]
        add((), "copy", 1, 2 * sum(ctx.nbytes[w] for w in weights))
    for k in sorted(merged):   # a merged GEMM's result read by a kernel call or returned: a slice
        for t in cl[k].outputs:   # copied out (the compile's ``wrapped_slice`` reads the whole buffer),
            if k in summed_apart or k in epilogue_written:   # unless the fusion summing a split
                continue   # GEMM's part writes it (jax 0.12's rank-16 ``x @ A``: ``loop_slice_fusion``,
                # one per part) or the loop fusion of its epilogue does (T5's GELU in VTC's FFN)
            if t in outs or k in sliced_out or any(call[u] for u in consumers_through_movement(t, set())):
                add((k,), "copy", 1, merged_whole[k] + ctx.nbytes[t], (t,))
    convs = [k for k in range(len(cl)) if kind[k] == Kind.CONV]
    if convs:   # cuDNN runs NHWC: each NCHW program input a conv reads, and each output a conv
        # produces, is transposed once (one launch reading and writing it); a conv whose operand
        # or result is channels-last already (flax's NHWC) needs none
        convs_ops = [g.ops[o] for k in convs for o in cl[k].ops if g.ops[o].primitive == "conv_general_dilated"]
        lhs = [op.inputs[0] for op in convs_ops]
        srcs = {x for op in convs_ops if _channels_first(op, "lhs_spec") and read_src_is_input(op.inputs[0])
                for x in _inputs_behind(op.inputs[0])}
        cf = {k for k in convs if any(g.ops[o].primitive == "conv_general_dilated" and _channels_first(g.ops[o], "out_spec")
                                      for o in cl[k].ops)}
        made = {t for t in outs if len(g.tensors[t].shape) >= 3
                and any(p in cf for p in producers_through_movement(t, set()))}
        # (each reads the input whole and writes what the convolutions read of it: half of it
        # where they read a channel slice)
        kept = {x: min(ctx.nbytes[x], sum(ctx.nbytes[op.inputs[0]] for op in convs_ops
                                          if x in _inputs_behind(op.inputs[0]))) for x in srcs}
        # a kernel call's row-major result a channels-first conv reads through bitcasts is
        # transposed for cuDNN the same way (RG-LRU's depthwise ``Conv1d`` under VTC, reading
        # the linear's kernel: ``input_transpose_fusion``)
        srcs |= {x for op in convs_ops if _channels_first(op, "lhs_spec")
                 for x in [behind_bitcasts(op.inputs[0])] if (k := ctx.producer.get(x)) is not None and call[k]}
        if srcs | made:
            add((), "layout", len(srcs) + len(made),
                sum(ctx.nbytes[t] + kept.get(t, ctx.nbytes[t]) for t in srcs | made))
        # a conv reads a buffer: movement (a split half, a concat) in front of it is materialised
        # by one fusion, unless it only reshapes or reads a program input (the layout transpose
        # above does it)
        fed, whole = set(), {}
        fed_at: dict[int, int] = {}   # conv op -> the copy it reads (behind bitcasts)
        for op in convs_ops:
            # (back through bitcasts to the movement they view: ShuffleNet's split half of a
            # channels-last input, reshaped twice on its way to the conv, ``wrapped_slice``)
            t = behind_bitcasts(op.inputs[0])
            t = t if ctx.producer.get(t) is not None else op.inputs[0]
            p = ctx.producer.get(t)
            if p is None or kind[p] != Kind.MOVEMENT or is_dus(p) or t in fed or p in materialised:
                continue
            # (NCHW: a concatenation of a program input and a computed tensor — U-Net's skip and
            # its upsampled input — is written channels-last by a fusion of its own)
            mixed = _channels_first(op, "lhs_spec") and any(g.ops[o].primitive == "concatenate" for o in cl[p].ops) \
                and any(ctx.producer.get(x) is not None and not fused_movement(ctx.producer[x]) for x in _sources_behind(t))
            folded = any(_zero_pad(g, g.ops[o]) for o in cl[p].ops) and all(
                ctx.bitcast.get(o) or _zero_pad(g, g.ops[o]) for o in cl[p].ops) and not any(
                moved_behind(x) for o in cl[p].ops for x in _data(g.ops[o]))
            # (a part of a channels-last program input, ShuffleNet's half of ``x``, is copied
            # out: ``wrapped_slice``; other movement of a program input is done by the layout
            # transpose above or read through)
            sliced = not _channels_first(op, "lhs_spec") and any(
                g.ops[o].primitive in ("slice", "split") for o in cl[p].ops)
            behind_input = bool(_inputs_behind(t))
            # (channels-last: a concatenation with a computed part is written out, no layout
            # transpose doing it: the U-Net up block's upsampled input and its skip)
            joined = not _channels_first(op, "lhs_spec") and any(
                g.ops[o].primitive == "concatenate" for o in cl[p].ops) and not _sources_behind(t) <= inputs
            # (a gather cannot be read through: written out, its indices computed inside)
            gathered = _source_gather(g, t) is not None
            behind = behind_input and not mixed and not sliced and not joined and not gathered
            if all(ctx.bitcast.get(o) for o in cl[p].ops) or folded or behind:
                continue   # (a zero pad of a computed buffer is folded into the convolution's own
                # padding; one of a split half is written by the copy of the half: Mamba's)
            fed.add(t)
            fed_at[op.id] = t
            if sliced and behind_input:   # the copy reads the whole input (``wrapped_slice``)
                whole[t] = sum(ctx.nbytes[x] for o in cl[p].ops for x in _data(g.ops[o]))
            if mixed:   # a computed source transposed on its way in: transposed by a launch of
                # its own (the upsampled half, a GEMM result along H moved back to NCHW)
                moved = _transposed_sources(t)
                if moved:
                    add((), "layout", len(moved), sum(2 * ctx.nbytes[x] for x in moved), moved)

        def relaid(t: int) -> list[int]:
            """``t`` and the tensors it is a relayout of: back through bitcasts and transposes
            (one source each), whose layout XLA lets the producer choose."""
            chain = [t]
            while (k := ctx.producer.get(chain[-1])) is not None and kind[k] == Kind.MOVEMENT and all(
                    ctx.bitcast.get(o) or g.ops[o].primitive == "transpose" for o in cl[k].ops):
                srcs = [x for o in cl[k].ops for x in _data(g.ops[o])]
                if len(srcs) != 1:
                    break
                chain.append(srcs[0])
            return chain

        def to_fed(y: int, copies: set[int]) -> bool:
            """``y`` is one of the copies convolutions read, what one relays out, or a bitcast
            view of those."""
            while y not in copies:
                if (x := bitcast_source(y)) is None:
                    return False
                y = x
            return True

        dropped: set[int] = set()

        def absorbed_into_copies() -> dict[int, set[int]]:
            """The results of loop fusions read only through the copies convolutions read (by the
            convolutions, or by loop fusions reading a copy), each mapped to the buffers its fusion
            reads. Those fusions' launches are dropped from ``fusions`` and ``written``, their
            clusters added to ``dropped``."""
            found: dict[int, set[int]] = {}
            copies = {x for t in fed for x in relaid(t)}
            for i, f in enumerate(fusions):
                if f.what != "loop" or f.launches != 1 or not f.made or any(
                        call[m] or kind[m] != Kind.POINTWISE for m in f.clusters) or any(x in outs for x in f.made):
                    continue
                own, stack, seen, ok = set(f.clusters), list(f.made), set(), True
                while stack and ok:
                    y = stack.pop()
                    for k in ctx.users.get(y, ()):
                        if k in own or (k, y) in seen:
                            continue
                        seen.add((k, y))
                        if fused_movement(k) and k not in materialised:
                            stack.extend(cl[k].outputs)
                        elif call[k] or kind[k] not in (Kind.CONV, Kind.POINTWISE, Kind.REDUCTION) or not to_fed(y, copies):
                            ok = False
                if not ok:
                    continue
                reads = {b for m in f.clusters for x in cl[m].inputs if ctx.producer.get(x) not in own
                         for b in _sources_behind(x)} - set(f.made)
                found.update((x, reads) for x in f.made)
                dropped.update(f.clusters)
                for x in f.made:
                    written.pop(x, None)
                fusions[i] = dataclasses.replace(f, launches=0, bytes=0, made=())
            return found

        def copy_reads(t: int, absorbed: Mapping[int, set[int]]) -> int:
            """Bytes the copy ``t`` reads: the buffers behind it, those of the element-wise work
            it computes inside in place of that work's results."""
            if t in whole:
                return whole[t]
            srcs = _sources_behind(t)
            if not srcs & absorbed.keys():
                return read_bytes(t, set())
            return sum(ctx.nbytes[b] for b in set().union(*(absorbed.get(x, {x}) for x in srcs)))

        # a copy that only relays out a loop fusion's result read by no kernel call and not
        # returned is no copy: XLA's layout assignment has that fusion write it in the conv's
        # layout (the zoo's C3k2 under VTC: the residual sum, ``loop_add_fusion``, written NHWC
        # for the next conv and read so by the concatenation)
        for t in list(fed):
            x = relaid(t)[-1]
            i = written.get(x)
            if x != t and x not in outs and i is not None and fusions[i].what == "loop" and fusions[i].launches and not any(
                    call[u] for u in readers_through_views(x)):
                fed.discard(t)
        # element-wise work read only through these copies is computed inside each of them (XLA
        # fuses a producer into every consumer fusion, a copy too): no launch of its own, and each
        # copy reads that work's operands (the zoo's C3k2: the first conv's SiLU recomputed by the
        # copy of the half the next conv reads, ``loop_slice_fusion``, and by the concatenation's
        # copy, ``input_concatenate_fusion``, which takes the last bottleneck's SiLU and residual in)
        absorbed = absorbed_into_copies()
        # a copy whose value a reduction or loop fusion reads too is one more output of that
        # fusion (XLA's multi-output fusion: the U-Net up block's GroupNorm statistics and the
        # concatenation its shortcut convolution reads, one ``input_concatenate_reduce_fusion``)
        riding = {t for t in fed if t not in whole and not _sources_behind(t) & absorbed.keys() and any(
            kind[u] in (Kind.REDUCTION, Kind.POINTWISE) and not call[u] and u not in dropped
            for u in readers_through_views(t))}
        # the convolution reads the copy, where its fusion was priced through the movement to its
        # source: more where the copy is larger than what it reads (a nearest-neighbour upsample's
        # gathers, 5 MiB read and 20 written, read by the U-Net up block's conv: it reads 20)
        for t in fed:   # (charged to the conv's own launch group: its memory time, beside its math)
            grown = ctx.nbytes[t] - read_bytes(t, set())
            i = next((i for i, f in enumerate(fusions) if f.what == "conv" and any(
                fed_at.get(o) == t for m in f.clusters for o in cl[m].ops)), None)
            if grown > 0 and i is not None:
                fusions[i] = dataclasses.replace(fusions[i], bytes=fusions[i].bytes + grown)
        if riding:
            add((), "copy", 0, sum(ctx.nbytes[t] for t in riding), riding)
        fed -= riding
        if fed:
            add((), "copy", len(fed), sum(copy_reads(t, absorbed) + ctx.nbytes[t] for t in fed), fed)
        # cuDNN wants filters OHWI: any other layout (OIHW, a 1-D conv's OIW, HWIO) is transposed
        # once, unless only unit axes move (OIHW 1x1 and depthwise filters; HWIO ones move O)
        for k in convs:
            for o in cl[k].ops:
                op = g.ops[o]
                if op.primitive != "conv_general_dilated" or op.inputs[1] not in inputs:
                    continue
                shape = g.tensors[op.inputs[1]].shape
                spec = op.params["dimension_numbers"].rhs_spec   # (out, in, spatial...)
                ohwi = [a for a in (spec[0], *spec[2:], spec[1]) if shape[a] != 1]
                if ohwi != sorted(ohwi):   # not a bitcast of OHWI (OIHW 1x1 and depthwise are)
                    add((k,), "layout", 1, 2 * ctx.nbytes[op.inputs[1]])
    for v in sorted(shared):   # a loop fusion per shared value (XLA's loop_cosine_fusion, loop_sine_fusion)
        add((), "table", 1, 2 * ctx.nbytes[v], (v,))
    # a scatter XLA writes as an in-place dynamic-update-slice checks its index vector in bounds
    # first: a reduction fusion per distinct index (``input_reduce_fusion``, shared by a rolling
    # cache's K and V rows written at one slot), where the trace wrote a dynamic_update_slice
    # (an index of literals is folded: ``mask.at[:, -1].set(False)`` checks nothing)
    checks = {tuple(g.same_value(t) if g.tensors[t].const is None else repr(g.tensors[t].const)
                    for t in op.inputs[2:]) for op in g.ops
              if op.primitive == "dynamic_update_slice" and g.origin(op.outputs[0]) == "scatter"
              and not all(_static(g, t) for t in op.inputs[2:])}
    if checks:
        add((), "bounds", len(checks), 0)
    # a value the program returns more than once (``jax.grad`` of ``f(x + r)`` by ``x`` and by
    # ``r``): every output buffer is distinct, each repeat a ``kCopy`` of the first
    repeats = [t for i, t in enumerate(g.outputs) if t in g.outputs[:i] and t not in inputs]
    if repeats:
        add((), "copy", len(repeats), sum(2 * ctx.nbytes[t] for t in repeats))
    for c in g.speculated:   # a cond the trace made a select: XLA keeps most of them a conditional
        if xla_keeps_conditional(c):
            n, nbytes = conditional_price(g, c)
            add((), "conditional", n, nbytes, c.outputs)
    return Price(sum(f.launches for f in fusions), sum(f.bytes for f in fusions),
                 _buffers(ctx, fusions, written), tuple(fusions))


def _fill_key(g: Graph, op: Any) -> tuple[Any, ...] | None:
    """What makes two returned fills one value to XLA: the shape, the dtype and the constant
    (a literal's value, else the scalar's own value); None where ``op`` is no fill."""
    if not is_fill(op, g):
        return None
    x = op.inputs[0]
    const = g.tensors[x].const
    literal = const is not None and not is_extended(g.tensors[x].dtype)   # (a key's value: numpy holds none)
    value = ("literal", np.asarray(const).item()) if literal else ("value", g.same_value(x))
    out = g.tensors[op.outputs[0]]
    return tuple(out.shape), str(out.dtype), value


def _element_gather(op: Any) -> bool:
    """``op`` gathers single elements: every slice one element (``take_along_axis``, a table
    looked up per element), not rows."""
    return op.primitive == "gather" and math.prod(op.params["slice_sizes"]) == 1


def _added_into(g: Graph, op: Any) -> Any:
    """The ``add`` that XLA's algebraic simplifier folds the scatter ``op`` into, else None:
    ``x + scatter_add(zeros, i, u)`` is ``scatter_add(x, i, u)``, the scatter updating ``x``'s
    buffer in place — no zero buffer, no add (``x``'s other readers scheduled first; a program
    input is copied first: ``kCopy``). GPT-2's tied embedding: the LM head's weight gradient, a
    GEMM, then the lookup's gradient scattered into its result (``gemm_fusion_dot.1``,
    ``input_scatter_fusion``)."""
    if op.primitive not in ("scatter-add", "scatter_add"):
        return None
    fill = g.producer(op.inputs[0])
    key = _fill_key(g, fill) if fill is not None else None
    users = g.consumers(op.outputs[0])
    if key is None or key[2] != ("literal", 0) or len(users) != 1 or users[0].primitive not in ("add", "add_any"):
        return None
    add = users[0]
    others = [x for x in add.inputs if x != op.outputs[0]]
    if len(others) != 1:
        return None
    x, y = g.tensors[others[0]], g.tensors[op.outputs[0]]
    if (x.shape, x.dtype) != (y.shape, y.dtype):
        return None
    return add


def _bias_epilogue(g: Graph, op: Any, inputs: Any) -> bool:
    """``op`` adds a program input broadcast along rows (a bias: flax's ``y + bias.reshape(1, 1,
    -1)``), or is a view or broadcast of one on its way there."""
    def of_input(x: int) -> bool:
        while x not in inputs and (p := g.producer(x)) is not None and (
                p.primitive in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims") or p.primitive in CAST_ONLY):
            x = p.inputs[0]
        return x in inputs
    if op.primitive in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
        return of_input(op.inputs[0])
    return op.primitive == "add" and any(of_input(x) for x in op.inputs)


def _activation_epilogue(g: Graph, op: Any, ops: set[int]) -> bool:
    """``op`` is element-wise work on the product alone (an activation: T5's GELU of ``x @ wi_0``
    in VTC's program), its other operands scalars: XLA's dot merger, which runs before fusion,
    joins the dot all the same."""
    row = TABLE.get(op.primitive)
    return row is not None and row.role == Role.ELEMENTWISE and all(
        g.tensors[x].size == 1 or ((p := g.producer(x)) is not None and p.id in ops) for x in data_inputs(op))


def _static(g: Graph, t: int, depth: int = 0) -> bool:
    """``t`` is computed from literals alone (XLA folds it to a constant)."""
    if g.tensors[t].const is not None:
        return True
    op = g.producer(t)
    return op is not None and depth < 16 and bool(op.inputs) and all(_static(g, x, depth + 1) for x in op.inputs)


# What XLA's ConditionalSimplifier does not count expensive in a branch (its
# ``instruction_is_expensive``: elementwise ops, broadcast, concatenate, dynamic-slice, reduce,
# reshape, pad, slice): a two-branch conditional of only these, neither branch empty, becomes a
# select; an iota, a transpose, a dot, or a branch returning its operand keeps it a conditional.
_CHEAP_IN_A_SELECT = frozenset(
    {n for n, r in TABLE.items() if r.role == Role.ELEMENTWISE}
    | {"broadcast_in_dim", "concatenate", "dynamic_slice", "reshape", "squeeze", "expand_dims", "pad",
       "slice", "copy", "copy_p"} | {n for n in TABLE if n.startswith("reduce_")})


def xla_keeps_conditional(c: Speculated) -> bool:
    """Whether XLA runs a ``cond`` the trace computed as a select (``graph.Speculated``) as a
    conditional. Read off the H100 compile (jax 0.10.2 and 0.12): ``cond(p, s*2, s-1)`` is one
    loop fusion; ``cond(p, s*2, identity)`` and Gemma's window mask (an iota in the branch) are a
    conditional (ConditionalSimplifier: "an empty branch is faster to execute than select")."""
    return c.branches != 2 or c.empty_branch or not c.primitives <= _CHEAP_IN_A_SELECT


def conditional_price(g: Graph, c: Speculated) -> tuple[int, int]:
    """Launches and bytes a kept conditional adds to the program priced as its select: a fusion
    computing the branch index, the branch that runs (one loop fusion; the heavier is charged, as
    ``offline`` counts the compile), and a launch writing each array operand that an elementwise
    op, a movement op or a generator made (in the select they fused into their readers); the
    readers of the results then read them where the select's fusion read the operand's sources.
    The branch's own reads and writes are not charged, as the compile's count has no buffers for a
    branch computation (its operands are its parameter tuple): under-charging jit errs towards
    giving the program back to jit. Read off flax Gemma-2's ``lax.cond`` window: the masked
    scores and the key iota written, the compare, the branch, the softmax reading the result:
    4 launches and 8 MiB more than the ``where`` form, as compiled."""
    n, nbytes = 1 + bool(c.primitives), 0
    for x in c.operands[1:]:
        t = g.tensors[x]
        op = g.producer(x)
        row = TABLE.get(op.primitive) if op is not None else None
        if (t.size > 1 and isinstance(t.dtype, np.dtype) and row is not None
                and row.role in (Role.ELEMENTWISE, Role.GENERATOR, Role.MOVEMENT)):
            n += 1
            nbytes += t.size * t.dtype.itemsize
    if nbytes:
        nbytes += sum(g.tensors[y].size * g.tensors[y].dtype.itemsize for y in c.outputs
                      if isinstance(g.tensors[y].dtype, np.dtype))
    return n, nbytes


# what a table made from scalars passes through (xla_program's from_scalars): element-wise math
# and the views and rearrangements that shape it (a scalar broadcast, RoPE's doubled angles)
_TABLE_STEPS = frozenset(n for n, r in TABLE.items() if r.role in (Role.ELEMENTWISE, Role.GENERATOR)) | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "concatenate", "slice", "transpose", "rev"}

# movement XLA fuses into the fusion reading its result (followed back to the buffer read)
_FUSED_VIEWS = ("transpose", "broadcast_in_dim", "squeeze", "expand_dims", "reshape", "slice", "split",
                "dynamic_slice", "pad", "rev")


# the most keys XLA's second attention GEMM contracts reading probabilities laid out in the
# score GEMM's order (``_scores_transposed``'s "layout"); more, and they are transposed first
XLA_PROBS_TRANSPOSE_MAX_KEYS = 1024


def _conv_epilogue(g: Graph, c: Cluster) -> set[str]:
    """The primitives a convolution cluster applies to the convolution's result (casts aside)."""
    return {g.ops[o].primitive for o in c.ops} - {"conv_general_dilated"} - CAST_ONLY


def _before_widening(g: Graph, x: int, made: set[int]) -> int:
    """The value a GEMM prologue's loop fusion writes for operand ``x``: ``x``, or what a final
    widening cast reads where element-wise work made it (``made``) — XLA's Triton GEMM fusion
    takes the cast into its operand and reads the narrow value (the zoo's linear attention: the
    ReLU'd bf16 q and k written, cast to f32 inside ``gemm_fusion_dot``; its padded v, cut by
    movement, is written f32)."""
    op = g.producer(x)
    if op is None or op.primitive != "convert_element_type" or op.inputs[0] not in made:
        return x
    src = op.inputs[0]
    narrow = np.dtype(g.tensors[src].dtype).itemsize < np.dtype(g.tensors[x].dtype).itemsize
    return src if narrow and not is_view(g.producer(src), g) else x


def _epilogue_rereads(g: Graph, c: Cluster) -> bool:
    """Whether a convolution cluster's epilogue reads one of its values in two ops (SiLU's
    ``x * sigmoid(x)``), not along one chain (a bias add, ReLU)."""
    own = set(c.ops)
    made = {t for o in own for t in g.ops[o].outputs}
    return any(sum(1 for u in g.consumers(t) if u.id in own) > 1 for t in made)


def _loop_epilogue(g: Graph, c: Cluster) -> bool:
    """Whether a convolution cluster's epilogue is XLA's loop fusion, not cuDNN's: cuDNN fuses
    bias + ReLU only (an eval BatchNorm's per-channel scale is a multiply it does not take), and
    adds alone (a bias, a residual) on an ungrouped conv: the U-Net up block's 3x3 and 1x1 convs,
    read by GroupNorm kernels, are one ``kConvolution`` each in the compile; a depthwise conv's bias
    alone is a loop fusion (flax's NHWC block)."""
    if c.kind != Kind.CONV:
        return False
    epi = _conv_epilogue(g, c)
    return bool(epi) and not _cudnn_epilogue(g, c, epi)


def _cudnn_epilogue(g: Graph, c: Cluster, epi: set[str]) -> bool:
    """Whether cuDNN takes the element-wise primitives ``epi`` (casts aside) as convolution
    cluster ``c``'s epilogue: bias + ReLU, or adds alone on an ungrouped conv
    (:func:`_loop_epilogue`)."""
    ungrouped = all(g.ops[o].params.get("feature_group_count", 1) == 1 for o in c.ops
                    if g.ops[o].primitive == "conv_general_dilated")
    return epi == {"add", "max"} or epi == {"add"} and ungrouped


def _epilogue_reads(g: Graph, t: int, convs: Sequence[Cluster], own: set[int]) -> bool:
    """Whether every reader of ``t`` (through broadcasts, reshapes and other views) outside the
    ops ``own`` is an epilogue op of one of the convolution clusters ``convs``: not a
    convolution's operand."""
    for op in g.consumers(t):
        if op.id in own:
            continue
        if any(op.id in c.ops for c in convs):
            if op.primitive == "conv_general_dilated":
                return False
        elif op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY:
            if not all(_epilogue_reads(g, y, convs, own) for y in op.outputs):
                return False
        else:
            return False
    return True


def _gemm_writes_transposed(g: Graph, op: Any) -> bool:
    """Whether a transpose of a GEMM's result is a layout XLA's GEMM writes itself, with no copy:
    its batch axes kept in order and next to each other (one stride between batches), each
    operand's free axes in their order, anywhere around them — ``C`` written transposed (a
    weight gradient ``(x.T @ dy).T``), the free axes in front of the batches (``(T, B, H, D)``).
    Batches split (``(B, T, H, D)`` of a ``(B, H, T, D)`` product) are a copy; reordered
    (``(H, B, T, D)``) a copy on jax 0.10.2 only (``compat.XLA_GEMM_REORDERS_BATCHES``).
    Read off the deviceless H100 compile of ``(p @ v).transpose(perm)`` over all the kinds of
    ``perm`` and of 2-D and 3-D weight gradients."""
    if op.primitive != "transpose":
        return False
    d = g.producer(data_inputs(op)[0])
    if d is None or d.primitive != "dot_general":
        return False
    (lc, _), (lb, _) = d.params["dimension_numbers"]
    nb = len(lb)
    nl = len(g.tensors[d.inputs[0]].shape) - nb - len(lc)
    perm = list(op.params["permutation"])
    where = [perm.index(a) for a in range(len(perm))]
    batch, lhs, rhs = where[:nb], where[nb:nb + nl], where[nb + nl:]
    together = sorted(batch) == list(range(min(batch), min(batch) + nb)) if batch else True
    in_order = XLA_GEMM_REORDERS_BATCHES or batch == sorted(batch)
    return together and in_order and lhs == sorted(lhs) and rhs == sorted(rhs)


def _zero_pad(g: Graph, op: Any) -> bool:
    """A ``pad`` by a literal zero with no interior padding: XLA folds it into a convolution's
    window padding."""
    if op.primitive != "pad":
        return False
    t = op.inputs[1]
    while g.tensors[t].const is None and (p := g.producer(t)) is not None and p.primitive in CAST_ONLY:
        t = data_inputs(p)[0]   # jnp.pad's value: a cast of the literal 0
    value = g.tensors[t].const
    return (value is not None and np.all(np.asarray(value) == 0)
            and all(i == 0 for (_, _, i) in op.params["padding_config"]))


def _statistic(g: Graph, c: Cluster) -> bool:
    """A reduction cluster that writes reduced values only (no normalised rows), each over the
    rows' minor axes (a column sum, a training step's bias gradient, is not: XLA reduces it in
    a tree of its own)."""
    if c.kind != Kind.REDUCTION:
        return False
    reds = [g.ops[o] for o in c.ops if g.ops[o].primitive.startswith("reduce_")]
    return bool(reds) and all(_reduces_minor(g, r) for r in reds) and all(g.tensors[t].size <= max(g.tensors[r.outputs[0]].size for r in reds)
                              for t in c.outputs)


def _walk(starts: Iterable[int], expand: Callable[[int], Iterable[int]]) -> Iterator[int]:
    """Each tensor reachable from ``starts`` through ``expand`` once, ``expand`` asked of a tensor
    after it is yielded (a backward pass's element-wise work is a DAG with many paths to one value:
    visiting each once keeps the walks of the norm rules linear)."""
    todo, seen = list(starts), set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        yield x
        todo.extend(expand(x))


def _mixed_levels(g: Graph, ops: set[int], reds: Sequence[Any]) -> list[list[Any]]:
    """The row reductions among ``reds`` whose per-row results meet, before they are broadcast
    back over the rows, a per-row value made outside ``ops`` (another fusion's statistics),
    grouped by depth (a reduction of rows made from another's result is one deeper). A norm's
    backward that combines its row sums with the forward's statistics, written by the forward's
    fusions, is no Triton normalization fusion: XLA runs each depth as a reduction fusion, a loop
    fusion computing the per-row scalars and, at the end, one applying them (a residual LayerNorm
    block's gradient: ``input_reduce_fusion_1``, ``loop_multiply_fusion_1``, ``loop_add_fusion``;
    GPT-2's and LoRA's training steps; both jax versions). A LayerNorm's backward that recomputes
    its statistics from the rows is one Triton fusion however its per-row values combine
    (``test_xla_column_sums_over_many_rows_are_a_tree``)."""
    def made_outside(x: int) -> bool:
        return (p := g.producer(x)) is None or p.id not in ops

    def from_outside(t: int, size: int) -> bool:
        """A per-row value made, through per-row work among ``ops``, from one made outside them."""
        def up(x: int) -> Iterable[int]:
            return () if made_outside(x) else [y for y in data_inputs(g.producer(x)) if g.tensors[y].size == size]
        return g.tensors[t].size == size and any(made_outside(x) for x in _walk([t], up))

    def mixes(r: Any) -> bool:
        size = g.tensors[r.outputs[0]].size

        def per_row(x: int) -> list[Any]:   # the per-row work among ``ops`` reading ``x``
            return [u for u in g.consumers(x)
                    if u.id in ops and len(u.outputs) == 1 and g.tensors[u.outputs[0]].size == size]

        def meets_outside(u: Any) -> bool:
            row = TABLE.get(u.primitive)
            operands = {y for y in data_inputs(u) if g.tensors[y].size > 1}
            return row is not None and row.role == Role.ELEMENTWISE and len(operands) > 1 and any(
                from_outside(y, size) for y in operands)
        return any(meets_outside(u) for x in _walk([r.outputs[0]], lambda x: [u.outputs[0] for u in per_row(x)])
                   for u in per_row(x))

    depth: dict[int, int] = {}
    for r in reds:   # (in program order: a reduction's sources come before it)
        depth[r.id] = max((depth[q.id] + 1 for q in reds if q.id in depth
                           and _made_from(g, data_inputs(r)[0], ops, {q.id})), default=0)
    levels: dict[int, list[Any]] = {}
    for r in reds:
        if mixes(r):
            levels.setdefault(depth[r.id], []).append(r)
    return [levels[d] for d in sorted(levels)]


def _diamond(g: Graph, ops: set[int], reds: Sequence[Any]) -> bool:
    """Whether one of the row reductions ``reds`` is a normalization diamond, where XLA's Triton
    normalization fusion starts: the rows it reduces and the rows the work after its broadcast
    combines it with are the same value, each traced back through element-wise work whose other
    operands are broadcasts, views or casts (``e / sum(e)``, ``x - max(x)``, ``dy * g - sum(dy *
    g)``). A reduction of a product of two row tensors applied to one of them (a softmax's
    backward ``p * (dp - sum(p * dp))``) has none: a reduction fusion and a loop fusion applying
    its result, each reading the rows (read off the deviceless H100 compile of
    ``(d - sum(d * e)) * e``, rows of 256-4,096, both jax versions); beside a diamond such a
    reduction rides in the Triton fusion (a LayerNorm's backward)."""
    stats = {o for o in ops if g.ops[o].primitive.startswith("reduce_")}

    def small(x: int, full: int, written: bool = False) -> bool:
        """A per-row (per-column, scalar) value or its broadcast; ``written``: not one an
        expensive op makes from values from outside ``ops`` (XLA writes it out first)."""
        while (p := g.producer(x)) is not None and (is_view(p, g) or p.primitive == "broadcast_in_dim"):
            x = p.inputs[0]
        return g.tensors[x].size < full and not (
            written and p is not None and p.id in ops and is_expensive(p) and not _made_from(g, x, ops, stats))

    def root(x: int, full: int) -> int:
        while (p := g.producer(x)) is not None and p.id in ops and (
                is_view(p, g) or (row := TABLE.get(p.primitive)) is not None and row.role == Role.ELEMENTWISE):
            rows = {y for y in data_inputs(p) if not small(y, full, written=True)}
            if len(rows) != 1:
                break
            (x,) = rows
        return x

    order = sorted(ops)
    for r in reds:
        x = data_inputs(r)[0]
        full = g.tensors[x].size
        start = root(x, full)
        derived = set(r.outputs)
        for o in (o for o in order if o > r.id):
            op = g.ops[o]
            if not set(op.inputs) & derived:
                continue
            out = op.outputs[0]
            if small(out, full) or op.primitive == "broadcast_in_dim":
                derived.update(op.outputs)
            elif any(root(y, full) == start for y in data_inputs(op) if y not in derived and not small(y, full)):
                return True
    return False


def repeat_cost(op: Any) -> float:
    """What XLA's priority fusion charges for computing ``op`` once more per element, in
    launches: ``1 / XLA_REPEATED_EXPENSIVE_MAX[op]`` for an expensive op, nothing for a cheap one."""
    if not is_expensive(op):
        return 0.0
    return 1.0 / XLA_REPEATED_EXPENSIVE_MAX.get(op.primitive, XLA_REPEATED_EXPENSIVE_DEFAULT)


def repeats_too_much(cost: float, elements: int, size: int, itemsize: int) -> bool:
    """Whether XLA writes out a producer of ``size`` elements (``itemsize`` bytes each) whose
    readers compute ``elements`` from it, recomputing it at ``cost`` per element
    (:func:`repeat_cost`): the repeated work against one launch more and the producer written and
    read back (``XLA_REPEATED_EXPENSIVE_MAX``'s comment has the readings)."""
    return cost > 0 and (elements - size) * cost > 1 + 2 * size * itemsize / XLA_LAUNCH_BYTES


def _expensive_per_row(g: Graph, ops: set[int], reds: Sequence[Any]) -> list[int]:
    """Per-row values ``ops`` compute with an expensive op (a division, ``rsqrt``, ``exp``) from
    values made outside them, not from their own reductions, and read broadcast over the rows:
    XLA duplicates no expensive producer into a consumer reusing its elements, so each is a loop
    fusion of its own (``1 / (s * s)`` of a softmax's sums in its backward: ``loop_divide_fusion``;
    read off the compile of ``sum(d * f(s)[:, None] * e)`` for ``f`` of ``1 / s``, ``s ** -2``,
    ``rsqrt``, ``exp``, ``log``: two launches where ``s * s`` is one), once the reader would
    repeat it at a cost above writing it out (:func:`repeats_too_much`)."""
    own = {r.id for r in reds}
    found = []
    for o in sorted(ops):
        op = g.ops[o]
        if not is_expensive(op) or _made_from(g, op.outputs[0], ops, own):
            continue
        size = g.tensors[op.outputs[0]].size

        def readers(x: int) -> Iterable[int]:   # through views of the value itself
            return [u.outputs[0] for u in g.consumers(x) if len(u.outputs) == 1
                    and g.tensors[u.outputs[0]].size == size and (is_view(u, g) or u.primitive == "broadcast_in_dim")]
        cost, itemsize = repeat_cost(op), np.dtype(g.tensors[op.outputs[0]].dtype).itemsize
        if any(u.id in ops and repeats_too_much(cost, g.tensors[u.outputs[0]].size, size, itemsize)
               for x in _walk([op.outputs[0]], readers) for u in g.consumers(x)):
            found.append(op.outputs[0])
    return found


def _inputs_read(g: Graph, t: int, ops: set[int]) -> set[int]:
    """The program inputs (more than a scalar) that computing ``t`` reads through ``ops``, views,
    and products no operand of which is as large as the product (a per-row scale times a
    LayerNorm's weight: XLA recomputes them wherever they are read)."""
    def up(x: int) -> Iterable[int]:
        if (p := g.producer(x)) is None:
            return ()
        xs = data_inputs(p)
        through = p.id in ops or is_view(p, g) or p.primitive == "broadcast_in_dim" or (
            not p.primitive.startswith("reduce_") and xs and all(g.tensors[y].size < g.tensors[x].size for y in xs))
        return xs if through else ()
    return {x for x in _walk([t], up)
            if g.producer(x) is None and g.tensors[x].size > 1 and g.tensors[x].const is None}


def _per_row_inputs(g: Graph, ops: set[int], level: Sequence[Any]) -> int:
    """How many per-row values the per-row work after reductions ``level`` reads: their results
    and the per-row values it combines them with (other reductions', the cluster's inputs)."""
    size = g.tensors[level[0].outputs[0]].size

    def source(x: int) -> bool:   # made outside ``ops``, or a reduction's result
        p = g.producer(x)
        return p is None or p.id not in ops or (
            p.primitive.startswith("reduce_") and g.tensors[data_inputs(p)[0]].size > size)

    def around(x: int) -> list[int]:   # the per-row values it is made from and those made from it
        up = [] if source(x) else [y for y in data_inputs(g.producer(x)) if g.tensors[y].size == size]
        return up + [u.outputs[0] for u in g.consumers(x)
                     if u.id in ops and len(u.outputs) == 1 and g.tensors[u.outputs[0]].size == size]
    return sum(source(x) for x in _walk([r.outputs[0] for r in level], around))


def _rows_recomputed(g: Graph, t: int, ops: set[int]) -> set[int] | None:
    """The rows (full-size tensors from outside ``ops``) from which cheap element-wise work in
    ``ops`` computes ``t`` with per-row values a reduction in ``ops`` made (``x - mean``,
    ``(x - mean) * rstd``: what a norm's readers recompute), else None."""
    size = g.tensors[t].size
    rows: set[int] = set()
    stats = False

    def inside(x: int) -> bool:   # a full-size value ``ops`` compute
        return (p := g.producer(x)) is not None and p.id in ops and g.tensors[x].size >= size
    for x in _walk([t], lambda x: data_inputs(g.producer(x)) if inside(x) else ()):
        p = g.producer(x)
        if p is None or p.id not in ops:
            if g.tensors[x].size >= size:
                rows.add(x)
        elif g.tensors[x].size < size:   # a per-row value: read by the reader (small)
            stats = stats or _made_from(g, x, ops, {o for o in ops if g.ops[o].primitive.startswith("reduce_")})
        elif p.primitive.startswith("reduce_") or (row := TABLE.get(p.primitive)) is None or is_expensive(p) or not (
                row.role == Role.ELEMENTWISE or is_view(p, g) or p.primitive in _FUSED_VIEWS):
            return None
    return rows if stats and rows else None


def _gather_of(g: Graph, t: int) -> list[int]:
    """The outputs of the gathers ``t`` indexes, through views and concatenations."""
    out: list[int] = []
    for op in g.consumers(t):
        if op.primitive == "gather" and t not in data_inputs(op):
            out.extend(op.outputs)
        elif (is_view(op, g) or op.primitive in _FUSED_VIEWS or op.primitive == "concatenate") and len(op.outputs) == 1:
            out.extend(_gather_of(g, op.outputs[0]))
    return out


def _column_tree(g: Graph, op: Any) -> int:
    """The rows of partial sums XLA's tree reduction rewriter writes for a column reduction
    ``op`` (the minor axis of the buffer it reads kept, more than
    :data:`XLA_COLUMN_TREE_MIN_ROWS` rows reduced); 0 where the reduction is one fusion (a row,
    a short column, a full reduction to a scalar)."""
    if not op.primitive.startswith("reduce_") or _reduces_minor(g, op):
        return 0
    x = data_inputs(op)[0]
    shape = g.tensors[x].shape
    axes = set(op.params["axes"])
    rows = math.prod(shape[a] for a in axes)
    minor = _minor_axis(g, x)   # (in the buffer read: a transposed GEMM result summed over its
    # contiguous axis is a row)
    if minor is None or minor in axes or rows <= XLA_COLUMN_TREE_MIN_ROWS:
        return 0
    return 2 ** int(math.log2(math.isqrt(rows)))


def _made_from(g: Graph, t: int, ops: set[int], sources: set[int]) -> bool:
    """Whether ``t`` is computed, by ops among ``ops``, from the result of one of ``sources``."""
    stack, seen = [t], set()
    while stack:
        p = g.producer(stack.pop())
        if p is None or p.id not in ops or p.id in seen:
            continue
        if p.id in sources:
            return True
        seen.add(p.id)
        stack.extend(data_inputs(p))
    return False


def _reduces_minor(g: Graph, op: Any) -> bool:
    """Whether a reduction's axes are the minor axes of the tensor it reads (the rows XLA's
    Triton normalization fusion takes), unit axes aside. Logical order: XLA's layout assignment
    makes a transpose in front of a norm free (ConvNeXt's channels-last LayerNorm of a cuDNN
    result, written NHWC already), which the buffers' row-major order cannot see."""
    x = data_inputs(op)[0]
    shape = g.tensors[x].shape
    axes = {a for a in op.params["axes"] if shape[a] != 1}
    live = [a for a in range(len(shape)) if shape[a] != 1]
    return set(live[len(live) - len(axes):]) == axes if axes else True


def _elemental_reduction(g: Graph, op: Any) -> bool:
    """XLA emits the reduction element by element, as a loop op (``IsReductionFromOrToContiguous
    Dimensions`` false: not a reduction hero), so it fuses into its consumer like element-wise
    work. Its axes (unit axes aside) one run: a row reduction (the run minor) over fewer than a
    warp's 32 elements that do not divide 32, or a column reduction (kept axes minor to the run)
    over few rows — under 32; under 64 with fewer than 32 kept minor elements, under 128 with
    fewer than 8, under 256 with fewer than 3 (``IsUnnestedReductionFasterThanElemental``). The
    position embedding's gradient, a batch of 8 summed over ``(8, 1024, 768)``: inside the
    scatter's ``input_scatter_fusion``."""
    if not op.primitive.startswith("reduce_") or op.primitive == "reduce_precision":
        return False
    shape = g.tensors[data_inputs(op)[0]].shape
    live = [a for a in range(len(shape)) if shape[a] != 1]
    axes = [a for a in live if a in op.params["axes"]]
    if not axes:   # over unit axes alone: a bitcast
        return True
    if _finished_apart(g, op):
        return False
    reduced = math.prod(shape[a] for a in axes)
    minor = math.prod(shape[a] for a in live[live.index(axes[-1]) + 1:])
    if minor == 1:   # a row reduction
        return reduced < 32 and 32 % reduced != 0
    return reduced < 32 or (reduced < 64 and minor < 32) or (reduced < 128 and minor < 8) or (
        reduced < 256 and minor < 3)


def _finished_apart(g: Graph, op: Any) -> int:
    """The partial results (elements) of a reduction XLA runs in two launches, else 0: its axes
    (unit axes aside) in more than one run, a kept axis between them (flax's channels-last
    GroupNorm over H, W and the channels of a group, the groups kept: ``(B, H, W, G, C/G)``
    reduced over 1, 2 and 4). The first launch reduces the major run, writing partials of the
    result's size times the minor run's; a small loop fusion finishes them (the U-Net up block's
    ``loop_multiply_fusion`` reducing ``f32[2,32,30]`` to the groups' means, on both jax
    versions)."""
    x = data_inputs(op)[0]
    shape = g.tensors[x].shape
    axes = sorted(a for a in op.params["axes"] if shape[a] != 1)
    live = [a for a in range(len(shape)) if shape[a] != 1]
    runs = [[axes[0]]] if axes else []
    for a in axes[1:]:
        if live.index(a) == live.index(runs[-1][-1]) + 1:
            runs[-1].append(a)
        else:
            runs.append([a])
    if len(runs) < 2:
        return 0
    return g.tensors[op.outputs[0]].size * math.prod(shape[a] for r in runs[1:] for a in r)


def _scores_regrouped(g: Graph, ops: Sequence[int], scores: int) -> int | None:
    """The scores (as they reach the softmax) where reshapes among ``ops`` change their rank
    between the score GEMM and the first reduction — query heads grouped by reshaping the scores,
    ``(B, T, KV, G, S) -> (B, T, H, S)`` — and element-wise work (a soft-cap, a mask) is done on
    them: XLA's Triton softmax starts after that work, which is a loop fusion of its own (read
    off the H100 compile of the zoo's flax Gemma-2 decode, heads by reshape). None otherwise."""
    own = set(ops)
    t, work = scores, False
    while True:
        users = [u for u in g.consumers(t) if u.id in own]
        if len(users) != 1 or users[0].primitive.startswith("reduce_"):
            break
        work = work or not is_view(users[0], g) and users[0].primitive not in CAST_ONLY
        t = users[0].outputs[0]
    # (reshaped and back — Swin's mask added per window — is no regrouping: one Triton softmax)
    return t if work and len(g.tensors[t].shape) != len(g.tensors[scores].shape) else None


def _scores_transposed(g: Graph, ops: Sequence[int], scores: int) -> str | None:
    """How XLA runs the softmax between an attention fusion's two GEMMs (among ``ops``) when the
    score GEMM's result ``scores`` reaches the probabilities through a transpose that moves axes
    (not a bitcast). XLA's GEMM writes its free axes in operand order and its Triton softmax
    fusion takes no transpose. Read off the deviceless H100 compiles (bf16, B 2-16, T and S
    1,024-4,096, 8-71 heads, D 64-128):

    * ``"statistics"``: the free axes reordered behind batch axes that stay major, before the
      first reduction (an MQA einsum ``bqhd,bkd->bhqk``, a GQA ``btkgh,bskh->bkgts``): no Triton
      softmax; a reduction fusion per statistic, each reading the scores, and a transpose fusion
      writing the probabilities (Falcon's prefill);
    * ``"layout"``: an axis moved in front of the batch axes, or the transpose after a reduction
      (``jax.nn.dot_product_attention``'s GQA group): XLA assigns the GEMM's result a layout in
      which the softmax is a Triton fusion, and the probabilities are transposed for the second
      GEMM in a launch of their own once it contracts more than ``XLA_PROBS_TRANSPOSE_MAX_KEYS``
      keys (at 1,024 it reads them where they are; at 1,536 and more it does not);
    * None: no such transpose (``bhqd,bkd->bhqk``, ``bqhd,bkd->bqhk``: one Triton softmax)."""
    first = next((o for o in sorted(ops) if g.ops[o].primitive.startswith("reduce_")), None)
    reach = {scores}
    for o in sorted(ops):
        op = g.ops[o]
        if not reach & set(op.inputs):
            continue
        if (op.primitive == "transpose" and not is_view(op, g)
                and g.tensors[op.inputs[0]].size == g.tensors[scores].size):
            (_, (lb, _)) = g.producer(scores).params["dimension_numbers"]
            shape = g.tensors[op.inputs[0]].shape   # the GEMM's result order: batch axes first
            batch = [a for a in range(len(lb)) if shape[a] != 1]
            major = [a for a in op.params["permutation"] if shape[a] != 1][:len(batch)] == batch
            return "statistics" if major and (first is None or o < first) else "layout"
        reach.update(op.outputs)
    return None


def _repeated(g: Graph, t: int) -> bool:
    """Whether the movement XLA fuses into ``t``'s reader (transposes, broadcasts, squeezes,
    reshapes, slices, casts) repeats its buffer's elements: a broadcast that adds elements (a
    GQA group axis, ``jnp.repeat``)."""
    return _repeats(g, t) > 1


def _repeats(g: Graph, t: int) -> int:
    """How many times the movement XLA fuses into ``t``'s reader repeats its buffer's elements
    (the broadcasts that add elements: a GQA group of ``G`` query heads per KV head, ``G``)."""
    op, times = g.producer(t), 1
    while op is not None and (op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY):
        src = data_inputs(op)[0]
        if op.primitive == "broadcast_in_dim" and g.tensors[op.outputs[0]].size > g.tensors[src].size:
            times *= g.tensors[op.outputs[0]].size // max(1, g.tensors[src].size)
        op = g.producer(src)
    return times


def _repeat_transposed(g: Graph, t: int, batch: Sequence[int]) -> int | None:
    """For a repeated (GQA) GEMM operand ``t`` (:func:`_repeated`) with batch axes ``batch``: the
    tensor XLA transposes in a launch of its own beside the broadcast's, where the heads must also
    move next to the batch — the broadcast's source where the transpose comes first (an explicit
    one, or the GEMM's layout: ``jnp.repeat``'d K and V of ``(B, S, H, D)``), the broadcast
    result where an explicit one comes after. Read off the H100 compiles of GQA prefills: K is a
    transpose then a ``wrapped_broadcast``, V sometimes a broadcast then a
    ``loop_transpose_fusion``. None: nothing to move, or no repeat."""
    op, transposed, after, source = g.producer(t), None, True, None
    while op is not None and (op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY):
        src = data_inputs(op)[0]
        if op.primitive == "transpose" and transposed is None:
            transposed = op.outputs[0] if after else src
        if op.primitive == "broadcast_in_dim" and g.tensors[op.outputs[0]].size > g.tensors[src].size:
            if transposed is not None:
                return t            # transposed after the broadcast: the repeated tensor
            after, source = False, src
        op = g.producer(src)
    if source is None:
        return None
    if transposed is not None:
        return transposed
    shape = g.tensors[t].shape
    lead = tuple(a for a in range(len(shape)) if shape[a] != 1)[:len([a for a in batch if shape[a] != 1])]
    return None if lead == tuple(a for a in batch if shape[a] != 1) else source


def _minor_axis(g: Graph, t: int) -> int | None:
    """The axis of ``t`` contiguous in the buffer a fusion reading ``t`` reads (its last axis when
    materialised), None where a reshape regroups a permuted buffer."""
    order = _physical_order(g, t)
    return None if order is None else next((a for a in reversed(order) if g.tensors[t].shape[a] != 1),
                                           order[-1] if order else None)


def _transposed_operands(g: Graph, op: Any) -> list[tuple[int, int]]:
    """``[(operand, itemsize of its copy)]`` XLA (jax <= 0.10) transposes before a batched vector
    dot: an operand repeated by a broadcast (a GQA group axis) and not contracted along its
    contiguous axis, written out whole, contracted axis last, in the dot's result type (the
    decode attention's ``p @ v``: an ``input_transpose_fusion`` writing the bf16 value cache as
    f32 with ``preferred_element_type=f32``; unrepeated, or ``q @ k``, the cache is read in place)."""
    if op.primitive != "dot_general" or not _vector_dot(g, op):
        return []
    (lc, rc), _ = op.params["dimension_numbers"]
    out = []
    for x, c, f in zip(op.inputs[:2], (tuple(lc), tuple(rc)), _free_sizes(g, op)):
        m = _minor_axis(g, x)
        if f > 1 and _repeated(g, x) and len(c) == 1 and m is not None and m != c[0]:
            out.append((x, g.tensors[op.outputs[0]].dtype.itemsize))
    return out


def _batch_rows(g: Graph, op: Any, x: int) -> int:
    """The batch of dot ``op``'s operand ``x`` beyond its heads: the product of its batch axes
    but the last (``(B, H, T, D)``'s B)."""
    (_, _), (lb, rb) = op.params["dimension_numbers"]
    batch = tuple(lb) if x == op.inputs[0] else tuple(rb)
    return math.prod(g.tensors[x].shape[a] for a in batch[:-1])


def _physical_order(g: Graph, t: int) -> tuple[int, ...] | None:
    """The axes of ``t`` from major to minor as they lie in the buffer a fusion reading ``t``
    reads: row-major for a materialised tensor, carried through the movement XLA fuses into its
    reader (transposes, squeezes, broadcasts adding unit axes, row-major reshapes, slices, casts).
    A broadcast that repeats elements is written out before a GEMM reads it (row-major); None
    where a reshape regroups a permuted source."""
    op = g.producer(t)
    nd = len(g.tensors[t].shape)
    if op is None or not (op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY):
        return tuple(range(nd))
    src = data_inputs(op)[0]
    if op.primitive == "broadcast_in_dim" and g.tensors[t].size > g.tensors[src].size:
        return tuple(range(nd))
    order = _physical_order(g, src)
    if order is None:
        return None
    if op.primitive == "transpose":
        perm = list(op.params["permutation"])
        return tuple(perm.index(a) for a in order)
    if op.primitive == "broadcast_in_dim":   # unit axes only: they go anywhere; put them first
        bd = tuple(op.params["broadcast_dimensions"])
        return tuple(a for a in range(nd) if a not in bd) + tuple(bd[a] for a in order)
    if op.primitive == "squeeze":
        dims = tuple(op.params["dimensions"])
        return tuple(a - sum(d < a for d in dims) for a in order if a not in dims)
    if op.primitive == "reshape":
        unit = [a for a in order if g.tensors[src].shape[a] != 1]
        return tuple(range(nd)) if unit == sorted(unit) else None
    return order if len(g.tensors[src].shape) == nd else None


def _minor_slice(g: Graph, t: int) -> tuple[int, ...] | None:
    """Where ``t`` is a part of its buffer's rows — a ``slice`` or ``split`` of one inner axis of
    a materialised result (the axes after it whole), reached through row-major reshapes and casts
    (no transpose) — the axes of ``t`` that part spans (its trailing non-unit axes); None
    otherwise. jax 0.10.2's XLA copies such a GEMM operand first, reading the whole buffer
    (``loop_slice_fusion``, ``compat.XLA_COPIES_PART_OF_ROWS``; read off the H100 compile of Falcon's MQA prefill and of a part of
    one QKV result as either operand. Falcon's K, a right operand contracted over exactly the part
    kept, was read in place there and copied beside a parameter: the model copies it always)."""
    shape = g.tensors[t].shape
    x, op = t, g.producer(t)
    while op is not None and (op.primitive in ("reshape", "squeeze", "expand_dims") or op.primitive in CAST_ONLY):
        x = data_inputs(op)[0]
        op = g.producer(x)
    if op is None or op.primitive not in ("slice", "split"):
        return None
    src = g.tensors[data_inputs(op)[0]].shape
    kept = list(g.tensors[x].shape)   # (a split's part, or a slice: the axes it keeps)
    if op.primitive == "slice" and any(s is not None and s != 1 for s in op.params.get("strides") or ()):
        return None
    cut = [a for a in range(len(src)) if kept[a] != src[a]]
    outer = [a for a in range(len(src)) if src[a] != 1][:1]
    if len(cut) != 1 or cut == outer:
        return None   # (a cut of the outermost axis is a contiguous part: no stride to cross)
    row, axes = math.prod(kept[cut[0]:]), []
    for a in reversed(range(len(shape))):
        if row <= 1:
            break
        if shape[a] == 1:
            continue
        if row % shape[a]:
            return None
        row //= shape[a]
        axes.append(a)
    return tuple(sorted(axes)) if row == 1 else None


def _slice_source(g: Graph, t: int) -> int:
    """The buffer a part of rows (:func:`_minor_slice`) is cut from."""
    op = g.producer(t)
    while op.primitive not in ("slice", "split"):
        op = g.producer(data_inputs(op)[0])
    return data_inputs(op)[0]


def _gathered(g: Graph, t: int) -> bool:
    """Whether ``t`` is (a view of) the result of a gather at runtime indices (a paged cache's
    pages gathered through its block table): XLA's GEMM fusions cannot read through a gather, so
    it is written out first, by a fusion of its own (read off the H100 compile of a vLLM-style
    paged decode: an ``input_transpose_fusion`` per gathered cache in front of its GEMM)."""
    op = _source_gather(g, t)
    return op is not None and _runtime(g, op.inputs[1])


def _glue_roots(g: Graph, ops: set[int], outputs: Sequence[int]) -> int:
    """How many loop fusions XLA makes of scalar glue ``ops`` writing ``outputs`` for kernel
    calls: one per distinct value computed (seen through views and casts), less those another
    one is computed from — XLA fuses a producer into its consumers and merges no independent
    siblings; work both need is repeated in each. Read off the compile of the pure-JAX Llama's
    VTC program: its cache row start ``clamp(where(pos < 0, pos + T, pos))`` and its mask bound
    ``0 <= pos & pos <= T`` from one ``pos``, a ``loop_clamp_fusion`` and a ``loop_and_fusion``."""
    def value(t: int) -> int | None:   # the op computing t, through views and casts
        p = g.producer(t)
        while p is not None and p.id in ops and (is_view(p, g) or p.primitive in CAST_ONLY):
            p = g.producer(data_inputs(p)[0]) if data_inputs(p) else None
        return p.id if p is not None and p.id in ops else None

    roots = {v for t in outputs if (v := value(t)) is not None}

    def up(o: int) -> Iterable[int]:
        return [p.id for x in data_inputs(g.ops[o]) if (p := g.producer(x)) is not None and p.id in ops]
    below = {q for r in roots for q in _walk(up(r), up)}
    return max(1, len({g.same_value(g.ops[r].outputs[0]) for r in roots - below}))


def _prng_launches(g: Graph, ops: Sequence[Any]) -> int:
    """Launches of XLA's threefry key schedule and counters around the random bits it fuses into
    their readers (read off the H100 compiles of dropout and samplers): a ``random_split`` or
    ``random_fold_in`` is a launch hashing the key; the counters of ``random_bits`` of shape
    ``S`` are a sum over the axes of ``iota(S[i]) * stride[i]`` in 64 bits, and each such vector
    (the same one computed for several calls once) is a loop fusion of its own where its
    readers repeat each element more than ``PRNG_COUNTER_REUSE`` times (T5's dropout masks of
    ``(16, 512, 2816)``: the 16- and the 512-vector; a ``(512, 1024)`` mask: none). The key
    schedule's ``xor`` XLA sometimes writes out too is not modelled."""
    n = 0
    reads: dict[tuple[int, int], int] = {}
    for op in ops:
        if op.primitive in ("random_split", "random_fold_in"):
            n += 1
        elif op.primitive == "random_bits":
            shape, stride = tuple(op.params["shape"]), 1
            for i in reversed(range(len(shape))):
                if i < len(shape) - 1 and shape[i] > 1:
                    reads[(shape[i], stride)] = reads.get((shape[i], stride), 0) + math.prod(shape)
                stride *= shape[i]
    return n + sum(r > PRNG_COUNTER_REUSE * size for (size, _), r in reads.items())


def _epilogue_gemm(g: Graph, ops: Sequence[int]) -> Any:
    """The ``dot_general`` among ``ops`` if XLA runs it as a Triton GEMM that takes an
    element-wise epilogue: no batch axes, no split K, at least GEMM_EPILOGUE_MIN_ROWS rows (read
    off the deviceless H100 compile: a residual add is fused at 512 rows and more, not at 256)."""
    dots = [g.ops[o] for o in ops if g.ops[o].primitive == "dot_general"]
    if len(dots) != 1:
        return None
    op = dots[0]
    (lc, _), (lb, _) = op.params["dimension_numbers"]
    a = g.tensors[op.inputs[0]].shape
    rows = math.prod(n for i, n in enumerate(a) if i not in lc)
    if lb or _xla_split_k(g, op) > 1 or rows < GEMM_EPILOGUE_MIN_ROWS:
        return None
    return op


_NO_TRITON_EPILOGUE = frozenset({"select_n", "lt", "le", "gt", "ge", "eq", "ne"})


def _epilogue_ops_ok(g: Graph, ops: set[int], product: int) -> bool:
    """Whether XLA's Triton GEMM fusion takes ``ops`` (element-wise, reading ``product``) as its
    epilogue: no compare or select (a dropout mask, ``where(m, y, 0)``), and every other input of
    the GEMM's own type (a side input cast on its way in, an f32 uniform scaling a bf16 product,
    is not taken). Read off the deviceless H100 compile of ``x @ w`` with such epilogues: ``y + r``
    and ``y * r`` fused, ``where(r < .9, y, 0)`` and ``y * u.astype(bf16)`` a loop fusion each
    (T5's dropout after its FFN's output projection)."""
    made = {y for o in ops for y in g.ops[o].outputs} | {product}
    for o in ops:
        op = g.ops[o]
        if op.primitive in _NO_TRITON_EPILOGUE:
            return False
        if op.primitive == "convert_element_type" and op.inputs[0] not in made:
            return False
    return True


def _read_once(g: Graph, t: int, ops: set[int]) -> bool:
    """``t`` and every value computed from it by ``ops`` is read by at most one op: an epilogue
    XLA's Triton GEMM fusion takes (``x @ w + r``, ``relu``, ``exp(x @ w + b)``); one reading it
    twice (SiLU's ``x * sigmoid(x)``, a tanh GELU) it leaves to a loop fusion."""
    frontier = [t]
    while frontier:
        readers = g.consumers(frontier.pop())
        if len(readers) > 1:
            return False
        frontier.extend(y for op in readers if op.id in ops for y in op.outputs)
    return True


def _channels_first(op: Any, spec: str) -> bool:
    """A convolution's operand (``lhs_spec``) or result (``out_spec``) has its feature axis
    before the spatial ones (NCHW): cuDNN's NHWC needs it transposed."""
    dims = getattr(op.params["dimension_numbers"], spec)
    return dims[1] != len(dims) - 1


def _indexes_a_gather(g: Graph, t: int) -> bool:
    """``t`` (through views XLA fuses) is the indices operand of a ``gather``."""
    for op in g.consumers(t):
        if op.primitive == "gather" and op.inputs[1] == t:
            return True
        if (op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY) and any(
                _indexes_a_gather(g, y) for y in op.outputs):
            return True
    return False


def _source_gather(g: Graph, t: int) -> Any:
    """The ``gather`` op ``t`` is a view of (through movement XLA fuses), or None."""
    op = g.producer(t)
    while op is not None and (op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY):
        op = g.producer(data_inputs(op)[0])
    return op if op is not None and op.primitive == "gather" else None


def _gemm_reads(g: Graph, t: int) -> bool:
    """Whether a GEMM (a ``dot_general``) reads ``t``, directly or through views XLA fuses."""
    for op in g.consumers(t):
        if op.primitive == "dot_general":
            return True
        if (op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY) and any(_gemm_reads(g, y) for y in op.outputs):
            return True
    return False


def _conv_reads(g: Graph, t: int) -> bool:
    """Whether a convolution reads ``t`` as its input, directly or through views and gathers
    (``jax.image.resize``'s nearest upsampling in front of a conv)."""
    for op in g.consumers(t):
        if op.primitive == "conv_general_dilated" and op.inputs[0] == t:
            return True
        if (op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY or op.primitive == "gather"
                and t in data_inputs(op)) and any(_conv_reads(g, y) for y in op.outputs):
            return True
    return False


def _runtime(g: Graph, t: int) -> bool:
    """Whether ``t``'s value depends on a program input (else XLA folds it to a constant)."""
    p = g.producer(t)
    if p is None:
        return t in g.inputs
    ops = _ancestors(g, [p.id]) | {p.id}
    return any(x in g.inputs for o in ops for x in g.ops[o].inputs)


def _epilogue_of(g: Graph, op: Any) -> Any:
    """The ``dot_general`` whose result ``op`` computes element-wise from (a bias add, an
    activation: one operand of the result's shape, the rest broadcast), else None."""
    while op is not None and op.primitive != "dot_general":
        row = TABLE.get(op.primitive)
        if row is None or row.role is not Role.ELEMENTWISE:
            return None
        shape = g.tensors[op.outputs[0]].shape
        full = [x for x in data_inputs(op) if g.tensors[x].shape == shape]
        if len(full) != 1:
            return None
        op = g.producer(full[0])
    return op


def _fixed_layout(g: Graph, t: int) -> bool:
    """Whether the buffer behind ``t`` (through movement) has a layout its producer cannot choose:
    a program input, a GEMM's or convolution's result, a kernel call's, or a buffer updated in
    place. Any other producer (a loop fusion, a gather) XLA lets write the layout its reader
    wants (the paged KV cache's gathered keys come out of the gather already transposed; BERT's
    per-head q, k and v come out of their GEMMs with the bias added already in the attention's
    layout). A GEMM's result with its epilogue (a bias add) split into several (Swin's one QKV
    projection cut into q, k and v) has one layout for all its readers: fixed."""
    op, split = g.producer(t), False
    while op is not None:
        if op.primitive in _FUSED_VIEWS or op.primitive in CAST_ONLY:
            split = split or op.primitive == "split"
            op = g.producer(data_inputs(op)[0])
            continue
        gemm = _epilogue_of(g, op) if split else None
        if gemm is not None:
            op = gemm
        break
    return op is None or op.primitive in ("dot_general", "conv_general_dilated", *KERNEL_CALLS) \
        or inplace_operand(op.primitive) is not None


def _made_elementwise_from(g: Graph, t: int) -> int | None:
    """The buffer element-wise work making ``t`` reads element for element, where ``t`` is such
    work's result: through casts and element-wise ops, each one's operand of its result's shape
    (not a broadcast scale or bias), to the first tensor no such op makes — a dequantised cache's
    int8 buffer behind ``cache.astype(bf16) * scale``. None where ``t`` is no element-wise result
    (a cast alone is :func:`_fixed_layout`'s)."""
    op, computed = g.producer(t), False
    while op is not None and (row := TABLE.get(op.primitive)) is not None and row.role == Role.ELEMENTWISE:
        full = [x for x in data_inputs(op) if g.tensors[x].shape == g.tensors[t].shape]
        if not full:
            return None
        computed = computed or op.primitive not in CAST_ONLY
        t, op = full[0], g.producer(full[0])
    return t if computed else None


def _concatenation(g: Graph, t: int, contracted: Sequence[int]) -> bool:
    """``t``, a GEMM operand contracted on axes ``contracted``, is a concatenation along one of them
    (directly, or through casts): XLA's GEMM fusion takes no concatenation of the contracted axis
    into its operand, a loop fusion writes it first (``input_concatenate_fusion``: GPT-2's q, k and
    v gradients, each moved back from heads, concatenated for the fused QKV weight's input
    gradient; read off the deviceless H100 compile of that backward pass, one per layer). Along a
    free axis the GEMM reads the parts where they are (rows concatenated: one launch)."""
    op = g.producer(t)
    while op is not None and op.primitive in CAST_ONLY:
        op = g.producer(data_inputs(op)[0])
    return op is not None and op.primitive == "concatenate" and op.params["dimension"] in contracted


def _gemm_relayouts(g: Graph, op: Any, fixed: Any = None) -> list[int]:
    """The operands of a GEMM (a ``dot_general`` XLA runs as a GEMM, not a reduction) that XLA
    writes out in another layout first: its GEMMs want the batch axes major, in order, and any
    order of the rest that a view can give (a stacked weight ``(2, d, f)`` contracted on ``d``
    is read where it is), so a batched operand whose batch axes are not major, or any operand a
    reshape regroups out of a permuted buffer, is copied (read off the H100 compile of
    prefill attention: heads moved next to the batch by a transpose of ``(B, S, H, D)`` are an
    ``input_transpose_fusion`` in front of the score GEMM, and the merged-heads output a
    ``loop_transpose_fusion`` in front of the output projection); a repeated (broadcast) operand
    is written out too (``wrapped_broadcast``), a gathered one (:func:`_gathered`), and a
    concatenation along a contracted axis (:func:`_concatenation`)."""
    if op.primitive != "dot_general" or _vector_dot(g, op):
        return []
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    out = []
    for x, c, b in zip(op.inputs[:2], (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))):
        shape = g.tensors[x].shape
        if _repeated(g, x) or _gathered(g, x) or _concatenation(g, x, c):
            out.append(x)
            continue
        # element-wise work on a buffer whose layout is fixed (an int8 cache dequantised by
        # ``astype(bf16) * scale``, in the attention's cluster): the GEMM fusion computes it on
        # its operand's loads where that buffer's layout suits the GEMM, else a loop fusion
        # writes it in the GEMM's layout (read off the H100 compile of MaxText's int8 cache)
        src = x if _fixed_layout(g, x) or fixed is not None and fixed(x) else _made_elementwise_from(g, x)
        if src is None or src != x and not _fixed_layout(g, src):
            continue
        if XLA_COPIES_PART_OF_ROWS and _minor_slice(g, x) is not None:   # a part of a buffer's
            out.append(x)   # rows (Falcon's q, k and v cut out of the fused QKV GEMM's result)
            continue
        order = _physical_order(g, src)
        if order is None:
            out.append(x)
            continue
        nb = tuple(a for a in b if shape[a] != 1)
        rest = tuple(a for a in order if shape[a] != 1)
        major, rest = rest[:len(nb)], rest[len(nb):]
        if major != nb:   # unit axes lie anywhere
            out.append(x)
            continue
        # behind the batch, the right operand's free axes and its contracted ones each one run
        # of the buffer: free axes on both sides of a contracted one are no GEMM dimension
        # (``jax.image.resize`` contracting H of NCHW, ``bd,edf->bef``: the compile's
        # ``wrapped_transpose`` in front of the GEMM). The left operand's outer free axes lead
        # the result, and XLA runs them as a batch (``btd,edf->ebtf``: one GEMM, no copy)
        runs = sum(1 for i, a in enumerate(rest) if i == 0 or (a in c) != (rest[i - 1] in c))
        if XLA_RELAYS_SPLIT_FREE_RHS and runs > 2 and x == op.inputs[1] and x != op.inputs[0]:
            out.append(x)
    return out


def _free_sizes(g: Graph, op: Any) -> list[int]:
    """The element counts of a ``dot_general``'s two operands' free (neither batch nor
    contracted) axes: M and N."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    shapes = [g.tensors[x].shape for x in op.inputs[:2]]
    return [math.prod(s[d] for d in range(len(s)) if d not in (tuple(c) + tuple(b)))
            for s, c, b in zip(shapes, (lc, rc), (lb, rb))]


# How many K splits XLA's GEMM fusion gives a GEMM with no batch axes, read off the deviceless H100
# compile of ``a @ b`` (jax 0.10.2 and 0.12 alike; bf16 and f32 alike; symmetric in M and N):
# keyed by (the smaller free side s, the larger B) at powers of two and at model widths that are
# not (s = 96, 192, 384, 768, 1,536: GPT-2's 768 x 2,304 weight gradient is split in two at
# K = 8,192, where 1,024 x 2,048, the nearest powers of two side by side, gives no split), one
# entry per K bucket of SPLIT_K_K. A split GEMM writes ``split`` f32 partials and a reduce sums them.
# Off the grid a GEMM takes the entry nearest on a log scale in both sides together: XLA counts
# output tiles, so such a size (14,336 columns, say) can land a step either way.
SPLIT_K_K = (256, 512, 1024, 2048, 4096, 8192, 16384)
# The same for a GEMM of one row, ``(1, K) @ (K, N)`` (a decode step at batch 1), keyed by N (the
# power of two nearest on a log scale), one entry per K bucket of SPLIT_K_K — the largest not
# above K: 3,584 is 2,048's (Gemma-2's ``(1, 3584) @ (3584, 8192)`` unsplit; by 3,584 or 4,096
# columns XLA splits it, which this misses), 14,336 8,192's (Llama-3's down projection split 8;
# Gemma-2's is split 16, the same two launches). Read off
# the deviceless H100 compile of the grid N 256-32,768 x K 256-16,384, bf16, jax 0.10.2 and 0.12
# alike. Below about 13.5 M weight elements XLA runs the dot as reductions, unsplit here (1):
# one launch, or two where the rows are long (a column tree) or the product is written first.
XLA_SPLIT_K_ONE_ROW: Mapping[int, tuple[int, ...]] = {
    256: (1,) * 7, 512: (1,) * 7, 1024: (1, 1, 1, 1, 1, 1, 32), 2048: (1, 1, 1, 1, 1, 16, 16),
    4096: (1, 1, 1, 1, 8, 8, 16), 8192: (1, 1, 1, 1, 4, 8, 8), 16384: (1, 1, 1, 1, 1, 4, 4),
    32768: (1, 1, 1, 1, 1, 1, 2)}
XLA_SPLIT_K: Mapping[tuple[int, int], tuple[int, ...]] = {
    (2, 256): (1, 1, 1, 16, 32, 32, 64), (2, 512): (1, 1, 1, 16, 16, 32, 32),
    (2, 1024): (1, 1, 1, 8, 16, 16, 32), (2, 2048): (1, 1, 1, 8, 8, 16, 16),
    (2, 4096): (1, 1, 1, 4, 8, 8, 16), (2, 8192): (1, 1, 1, 1, 4, 8, 8),
    (2, 16384): (1, 1, 1, 1, 1, 4, 8), (2, 32768): (1, 1, 1, 1, 1, 4, 4),
    (4, 256): (1, 1, 16, 16, 32, 32, 64), (4, 512): (1, 1, 8, 16, 16, 32, 32),
    (4, 1024): (1, 1, 8, 8, 16, 16, 32), (4, 2048): (1, 1, 4, 8, 8, 16, 16),
    (4, 4096): (1, 1, 1, 4, 8, 8, 16), (4, 8192): (1, 1, 1, 1, 4, 8, 8),
    (4, 16384): (1, 1, 1, 1, 4, 4, 8), (4, 32768): (1, 1, 1, 1, 1, 4, 4),
    (8, 256): (1, 8, 16, 16, 32, 32, 64), (8, 512): (1, 8, 8, 16, 16, 32, 32),
    (8, 1024): (1, 4, 8, 8, 16, 16, 32), (8, 2048): (1, 1, 4, 8, 8, 16, 16),
    (8, 4096): (1, 1, 1, 4, 8, 8, 16), (8, 8192): (1, 1, 1, 4, 4, 8, 8),
    (8, 16384): (1, 1, 1, 1, 4, 4, 8), (8, 32768): (1, 1, 1, 1, 1, 4, 4),
    (16, 256): (8, 8, 16, 16, 32, 32, 64), (16, 512): (4, 8, 8, 16, 16, 32, 32),
    (16, 1024): (1, 4, 8, 8, 16, 16, 32), (16, 2048): (1, 1, 4, 8, 8, 16, 16),
    (16, 4096): (1, 1, 4, 4, 8, 8, 16), (16, 8192): (1, 1, 1, 4, 4, 8, 8),
    (16, 16384): (1, 1, 1, 1, 4, 4, 8), (16, 32768): (1, 1, 1, 1, 1, 4, 4),
    (32, 256): (8, 8, 16, 16, 32, 32, 64), (32, 512): (4, 8, 8, 16, 16, 32, 32),
    (32, 1024): (1, 4, 8, 8, 16, 16, 32), (32, 2048): (1, 4, 4, 8, 8, 16, 16),
    (32, 4096): (1, 1, 4, 4, 8, 8, 16), (32, 8192): (1, 1, 1, 4, 4, 8, 8),
    (32, 16384): (1, 1, 1, 1, 4, 4, 4), (32, 32768): (1, 1, 1, 1, 1, 2, 2),
    (64, 256): (8, 8, 16, 16, 32, 32, 64), (64, 512): (4, 8, 8, 16, 16, 32, 32),
    (64, 1024): (4, 4, 8, 8, 16, 16, 32), (64, 2048): (1, 4, 4, 8, 8, 16, 16),
    (64, 4096): (1, 1, 4, 4, 8, 8, 8), (64, 8192): (1, 1, 1, 4, 4, 4, 4),
    (64, 16384): (1, 1, 1, 1, 2, 2, 2), (64, 32768): (1,) * 7,
    (128, 256): (8, 8, 16, 16, 32, 32, 64), (128, 512): (4, 8, 8, 16, 16, 32, 32),
    (128, 1024): (4, 4, 8, 8, 16, 16, 16), (128, 2048): (1, 4, 4, 8, 8, 8, 8),
    (128, 4096): (1, 1, 4, 4, 4, 4, 4), (128, 8192): (1, 1, 1, 2, 2, 2, 2),
    (128, 16384): (1,) * 7, (128, 32768): (1,) * 7,
    (256, 256): (4, 8, 8, 16, 16, 32, 32), (256, 512): (4, 4, 8, 8, 16, 16, 16),
    (256, 1024): (1, 4, 4, 8, 8, 8, 8), (256, 2048): (1, 1, 4, 4, 4, 4, 4),
    (256, 4096): (1, 1, 1, 2, 2, 2, 2), (256, 8192): (1,) * 7,
    (512, 512): (1, 4, 4, 8, 8, 8, 8), (512, 1024): (1, 1, 4, 4, 4, 4, 4),
    (512, 2048): (1, 1, 1, 2, 2, 2, 2), (512, 4096): (1,) * 7,
    (1024, 1024): (1, 1, 1, 2, 2, 2, 2), (1024, 2048): (1,) * 7,
    (96, 768): (4, 4, 8, 8, 16, 16, 32), (96, 1536): (1, 4, 4, 8, 8, 16, 16),
    (96, 2304): (1, 2, 4, 4, 8, 8, 8), (96, 3072): (1, 1, 4, 4, 8, 8, 8),
    (96, 5120): (1, 1, 2, 4, 4, 4, 4), (96, 6144): (1, 1, 1, 4, 4, 4, 4),
    (96, 12288): (1, 1, 1, 1, 2, 2, 2), (96, 32768): (1,) * 7,
    (192, 768): (2, 4, 4, 8, 8, 16, 16), (192, 1536): (1, 2, 4, 4, 8, 8, 8),
    (192, 2304): (1, 1, 4, 4, 4, 4, 4), (192, 3072): (1, 1, 2, 4, 4, 4, 4),
    (192, 5120): (1, 1, 1, 2, 2, 2, 2), (192, 6144): (1, 1, 1, 1, 2, 2, 2),
    (192, 12288): (1,) * 7, (192, 32768): (1,) * 7,
    (384, 768): (1, 2, 4, 4, 8, 8, 8), (384, 1536): (1, 1, 2, 4, 4, 4, 4),
    (384, 2304): (1, 1, 1, 2, 2, 4, 4), (384, 3072): (1, 1, 1, 2, 2, 2, 2),
    (384, 5120): (1, 1, 1, 1, 1, 1, 2), (384, 6144): (1,) * 7,
    (384, 12288): (1,) * 7, (384, 32768): (1,) * 7,
    (768, 768): (1, 1, 2, 4, 4, 4, 4), (768, 1536): (1, 1, 1, 2, 2, 2, 2),
    (768, 2304): (1, 1, 1, 1, 1, 2, 2), (768, 3072): (1,) * 7,
    (768, 5120): (1,) * 7, (768, 6144): (1,) * 7,
    (768, 12288): (1,) * 7, (768, 32768): (1,) * 7,
    (1536, 1536): (1,) * 7, (1536, 2304): (1,) * 7,
    (1536, 3072): (1,) * 7, (1536, 5120): (1,) * 7,
    (1536, 6144): (1,) * 7, (1536, 12288): (1,) * 7,
    (1536, 32768): (1,) * 7,
}


def _bucket(x: int, keys: Sequence[int]) -> int:
    """The one of ``keys`` nearest ``x`` on a log scale (28,672 columns are 32,768's, 14,336 are
    16,384's: XLA counts output tiles, so a size behaves as the power of two it is nearest)."""
    return min(keys, key=lambda k: abs(math.log2(k) - math.log2(max(x, 1))))


def windows(g: Graph, op: Any) -> list[tuple[tuple[int, int], ...]]:
    """Each output's ``(start, limit)`` per axis of ``op``'s operand, where ``op`` is a static
    slice or a split (XLA's slices: multi-output fusion tells disjoint parts of one buffer apart by
    them); ``()`` for any other op's outputs."""
    if op.primitive == "slice" and all(s in (None, 1) for s in op.params.get("strides") or ()):
        return [tuple(zip(map(int, op.params["start_indices"]), map(int, op.params["limit_indices"])))]
    if op.primitive == "split":
        shape, axis, start, out = g.tensors[op.inputs[0]].shape, int(op.params["axis"]), 0, []
        for size in op.params["sizes"]:
            out.append(tuple((start, start + int(size)) if a == axis else (0, n) for a, n in enumerate(shape)))
            start += int(size)
        return out
    return [()] * len(op.outputs)


def _xla_split_k(g: Graph, op: Any, width: int = 0) -> int:
    """How many K splits XLA's GEMM fusion gives ``op`` (1: none): :data:`XLA_SPLIT_K`, one row
    :data:`XLA_SPLIT_K_ONE_ROW`. Batched dots are not split here: the whole programs read off the
    compile do not show them split. ``width``: the merged GEMM's N where
    the dot merger joined ``op`` with siblings (LoRA's rank-16 ``x @ A`` inside the QKV GEMM is
    not split)."""
    dn = op.params.get("dimension_numbers")
    if dn is None:
        return 1
    (lc, rc), (lb, rb) = dn
    a, b = g.tensors[op.inputs[0]].shape, g.tensors[op.inputs[1]].shape
    if lb or rb:
        return 1
    k = math.prod(a[i] for i in lc)
    m = math.prod(n for i, n in enumerate(a) if i not in lc)
    n = width or math.prod(x for i, x in enumerate(b) if i not in rc)
    small, large = sorted((m, n))
    if m == 1 and not width and k >= SPLIT_K_K[0]:   # one row (a decode step at batch 1)
        row = XLA_SPLIT_K_ONE_ROW[_bucket(n, tuple(XLA_SPLIT_K_ONE_ROW))]
        return row[max(i for i, b in enumerate(SPLIT_K_K) if b <= k)]
    if small < 2 or k < 192:   # a GEMV; a contraction shorter than the table's
        return 1
    key = min(XLA_SPLIT_K, key=lambda e: abs(math.log2(e[0] / small)) + abs(math.log2(e[1] / large)))
    return XLA_SPLIT_K[key][SPLIT_K_K.index(_bucket(k, SPLIT_K_K))]


def _keys_minor(g: Graph, op: Any) -> bool:
    """A decode ``q @ k`` whose key operand has a free axis minor (keys stored after the head
    dim, BLOOM's ``(B·H, D, T)``, or minor once the head dim is reduced away, ``(B, H, T, D)``):
    XLA's reduction writes the scores keys-minor, so the softmax
    over them is a Triton normalization fusion (one launch), where a ``(B, T, H, D)`` cache
    gives scores that a reduction fusion per statistic reads (read off the deviceless H100
    compile: BLOOM's ALiBi decode, Llama-3's)."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    for x, c, b in zip(op.inputs[:2], (lc, rc), (lb, rb)):
        shape = g.tensors[x].shape
        free = [d for d in range(len(shape)) if d not in tuple(c) + tuple(b)]
        if math.prod(shape[d] for d in free) <= 1:
            continue   # q's side
        axis = max(free, key=lambda d: shape[d])   # the keys
        contracted = list(c)
        while (p := g.producer(x)) is not None and p.primitive == "transpose":   # where it is stored
            perm = p.params["permutation"]
            axis, contracted, x = perm[axis], [perm[d] for d in contracted], p.inputs[0]
        if p is not None and p.primitive in _FUSED_VIEWS:
            return False   # regrouped on the way (a GQA repeat): not read off the compile
        # minor once the contracted head dim is reduced away: (B·H, D, T) and (B, H, T, D)
        # alike, not (B, T, H, D)
        stored = g.tensors[x].shape
        kept = [d for d in range(len(stored)) if d not in contracted and stored[d] != 1]
        return bool(kept) and axis == kept[-1]
    return False


def _vector_dot(g: Graph, op: Any) -> bool:
    """A batched dot with a free side of one element (decode attention's ``q @ k``, ``p @ v``):
    XLA runs it as a reduction, not a GEMM."""
    (_, _), (lb, _) = op.params["dimension_numbers"]
    return bool(lb) and min(_free_sizes(g, op)) == 1


def _reread(g: Graph, t: int) -> bool:
    """Some op reading ``t`` (through views of it) reads each element more than once: its
    result is larger (``dt[..., None] * A``: each element of ``dt`` read N times)."""
    stack, seen = [t], set()
    while stack:
        x = stack.pop()
        for op in g.consumers(x):
            if op.id in seen:
                continue
            seen.add(op.id)
            if g.tensors[op.outputs[0]].size > g.tensors[t].size:
                return True
            if is_view(op, g):
                stack.extend(op.outputs)
    return False


# XLA's DotStrengthReduction rewrites a dot with a vector side (no free axes once size-1 axes are
# dropped) into a multiply and a reduce when ``(M + N) * K`` is below this
# (``IsMatrixMultiplicationTooSmallForRewriting``): Mamba's ``einsum("bldn,bln->bld")`` read off
# its compile as an ``input_reduce_fusion`` computing the scan's last level inside it
XLA_DOT_TO_REDUCE_MAX = 10_000_000
# jax 0.10.2's XLA reads a repeated value cache in place inside the decode ``p @ v`` reduction
# (the transpose fused into it) while the group size G (query heads per KV head) times the
# batch is at most this, and copies it transposed (f32) otherwise: read off the deviceless H100
# compiles of the Llama-3 decode layer — batch 1, G = 2 no copy (heads / KV heads / head dim
# 16/8/128, 16/8/256, 8/4/128, 32/16/64, 64/32/128; contexts 4,096 to 65,536); G = 3, 4, 8 at
# batch 1 and G = 2 at batch 2 to 16 a ``loop_transpose_fusion`` / ``input_transpose_fusion``
XLA_READS_REPEATED_VALUES_MAX = 2


def _strength_reduced(g: Graph, op: Any) -> bool:
    """A batched ``dot_general`` XLA runs as a multiply and a reduce (a reduction fusion taking
    its operands' producers in), not a GEMM: one side a vector and the dot small
    (:data:`XLA_DOT_TO_REDUCE_MAX`)."""
    (lc, _), (lb, _) = op.params["dimension_numbers"]
    m, n = _free_sizes(g, op)
    k = math.prod(g.tensors[op.inputs[0]].shape[d] for d in lc)
    return bool(lb) and min(m, n) == 1 and (m + n) * k < XLA_DOT_TO_REDUCE_MAX


def _buffers(ctx: Facts, fusions: Sequence[Fusion], written: Mapping[int, int]) -> int:
    """Arguments + outputs + the peak of the intermediates XLA materialises (each from the launch
    group that writes it to the last group that reads it, groups in program order) − donated
    inputs whose buffer an output takes over (XLA's buffer assignment, modelled)."""
    g = ctx.graph
    args = {t: ctx.nbytes[t] for t in g.inputs}
    results = {t: ctx.nbytes[t] for t in g.outputs if t not in args}
    def donated_source(t: int, depth: int = 0) -> bool:
        """``t`` is a donated input's buffer: through bitcasts, in-place updates and kernel calls
        that write into an operand (``input_output_aliases``)."""
        if t in ctx.donated:
            return True
        op = g.producer(t)
        if op is None or depth > 64:
            return False
        if ctx.bitcast.get(op.id) or (op.id in ctx.dus_copy and not ctx.dus_copy[op.id]):
            return donated_source(op.inputs[0], depth + 1)
        alias = kernel_aliases(op)
        j = op.outputs.index(t)
        return j in alias and donated_source(op.inputs[alias[j]], depth + 1)

    for t in list(results):
        if donated_source(t):
            results.pop(t)
    order = {id(f): min(f.clusters, default=len(ctx.clusters)) for f in fusions}
    group_of_cluster = {k: i for i, f in enumerate(fusions) for k in f.clusters}
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for t, i in written.items():
        if t in args or t in g.outputs:
            continue
        first = order[id(fusions[i])]
        last = max((order[id(fusions[group_of_cluster[u]])] for u in ctx.users.get(t, ())
                    if u in group_of_cluster), default=first)
        start[t], end[t] = first, max(first, last)
    peak = live = 0
    for pos in sorted({*start.values(), *end.values()}):
        live += sum(ctx.nbytes[t] for t, s in start.items() if s == pos)
        peak = max(peak, live)
        live -= sum(ctx.nbytes[t] for t, e in end.items() if e == pos)
    return int(sum(args.values()) + sum(results.values()) + peak)
