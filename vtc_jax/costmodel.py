"""Edge savings ``w(e)`` for the greedy (paper §5.2), modelled analytically or measured by profiling.

The analytical model
====================

The program is modelled as a sequence of memory-bound kernels, one per cluster (the graph "after
operator fusion" the paper starts from). Under a strategy ``C`` (a set of chosen VTOG edges)::

    T(C) = Σ_clusters  bytes_eff(cluster, C) / HBM_bandwidth  +  launches(cluster, C) · launch_overhead
                       +  library_loss(cluster, C)

and the saving of an edge is its discrete derivative ``w(e) = T(C) - T(C ∪ {e})``, evaluated only on
the clusters whose cost can change (the edge's movement op and the producers/consumers of the
tensors whose layout changes), so one evaluation costs a few map compositions, not a graph walk.

* **Movement ops.** A movement op reads and writes ``B(op) = Σ out bytes + min(Σ data-input bytes,
  Σ out bytes)`` (a slice reads only what it keeps, a broadcast reads its small input once). Each
  chosen edge of the op absorbs ``b(e) = src bytes in e.box + min(same, dst bytes)``; the op costs
  what is left, ``max(0, B - Σ b)``, plus one launch while anything is left. The launch saving
  therefore lands on the pick that completes the op (the last slab of a concat written in place).
  Exceptions: a *bitcast* (reshape / squeeze / expand_dims / size-1 broadcast / same-dtype
  convert) is free in XLA while both sides are physical, but becomes a real copy (``2·bytes`` + a
  launch) once one side is virtual through another op; ``dynamic_update_slice`` costs ``2·update``
  plus ``2·operand`` only when XLA must copy the operand (a graph input that is not donated, a
  graph output, or read again later) — its in-place edge absorbs exactly that copy.
* **Kernels.** A compute cluster reads its inputs and writes its outputs once; a virtual input
  that repeats elements (a broadcast, a repeat-gather) costs only the physical bytes behind it
  (the repeats hit L2/L1). Accesses through a non-contiguous map pay a sector penalty: with
  ``run`` the contiguous run in bytes (``IndexMap.contiguity``, or the tile run — up to 64
  elements — along any unit-stride virtual dim, since Triton coalesces a block along whichever
  axis is unit-stride), the traffic is multiplied by ``ceil(run / 32) · 32 / run``: a 4-byte run
  moves a whole 32-byte sector (8×), a 48-byte run two sectors (1.33×), full contiguity 1×. This
  is what makes Type II edges (paper §4.3) cost something and Type I free.
* **Library loss.** A matmul / conv cluster that touches a virtual tensor becomes a Pallas kernel
  instead of a cuBLAS / cuDNN call: ``flops / rate(template, its math) - flops / rate(XLA, its
  math)`` (:meth:`GPU.flop_rate`, :data:`ENGINE_EFFICIENCY`: what each engine was measured to
  achieve on an H100 — our conv kernels reach a tenth of cuDNN), charged once per cluster (on the first edge that makes it touch a virtual tensor). A decode
  GEMM (``m ≤ 64``) is bandwidth-bound, so its loss is the larger of that and
  :func:`decode_gemm_loss` (the template's bandwidth from its loads in flight vs XLA's at HBM
  bandwidth): the greedy keeps XLA's GEMM unless the template's launch streams as fast.
* **Memory objective.** ``w(e)`` is the bytes of ``e.src`` covered by ``e.box`` (its buffer is no
  longer needed).

Pieces (slabs of a concat/split that must be chosen together, :func:`vtog.piece_group`) are
evaluated as a group and each piece is credited its share by volume.

**Bitcast lookahead.** Judged one edge at a time, ``c ⇢ d`` (the reshaped K slice into the KV
cache) breaks the free reshape ``b -> c`` and looks like a loss, while ``b ⇢ c`` saves nothing
until ``c`` moved: the chain would never start. So an edge's estimate also makes its undecided
bitcast neighbours follow it (``T(C) - T(C ∪ {e} ∪ followers)``), and the bound model tells the
greedy to take those followers in the same pick (``companions``) and which estimates to redo
after a pick (``refresh``). With ``CostModel.bind`` passed to the greedy, its ``total_saving`` is
exactly ``T(∅) - T(C)``.

``accounting.modeled_bytes`` uses the same per-cluster accounting (:func:`cluster_cost`) to report total HBM bytes and a liveness-based
peak, for plain XLA (``baseline``) and under a strategy (``optimized``). All of this is a model:
it knows nothing about caches beyond the repeat rule, overlap of kernels, or compute-bound kernels
other than the library loss. On a GPU, ``profiling.TimingProfiler`` + ``ProfiledSavings`` measure
``w(e)`` instead (Algorithm 2's profiling lines).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .cluster import cluster
from .indexmap import Dim, FloorDiv, Layout, Mod
from .kernels import tiling
from .movement import Edge
from .primitives import Kind, data_inputs
from .vtog import VTOG, box_volume, piece_group
from .xla import LIBRARY_KINDS, Facts, math_class, op_flops

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph import Graph, Op
    from .strategy import Strategy

__all__ = ["GPU", "GPUS", "ENGINE_EFFICIENCY", "ENGINE_OF_KIND", "cluster_math", "kernel_flops", "CostModel", "BoundCostModel", "Context", "Cost", "cluster_cost", "strategy_oracles",
           "access_penalty", "piece_penalty", "block_dims", "kernel_waste", "KERNEL_BLOCK", "decode_gemm_loss"]

INF = float("inf")
ENGINE_OF_KIND = {Kind.MATMUL: "matmul", Kind.CONV: "conv", Kind.ATTENTION: "attention"}   # template of a cluster kind
TILE = 64                                               # block extent a kernel coalesces along


@dataclass(frozen=True)
class GPU:
    """Published figures of one GPU (dense tensor-core bf16, CUDA-core fp32).

    ``launch_overhead`` is not a published figure: it is the typical gap one extra kernel adds to a
    stream of short kernels (launch + tail), about 2 µs on recent GPUs.
    """
    name: str
    hbm_bandwidth: float       # bytes / s
    launch_overhead: float     # s
    peak_flops_bf16: float     # flop / s, dense
    peak_flops_f32: float      # flop / s, non-tensor-core
    sms: int = tiling.NUM_SMS      # streaming multiprocessors (only decode GEMMs use it)
    hbm_latency: float = 0.8e-6    # s, a load's round trip under load: Little's law for bandwidth
    # per-SM limits on resident CTAs (Hopper, CUDA occupancy calculator): registers, shared memory
    # (228 KB, 1 KB of it reserved per CTA), threads, CTAs
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    threads_per_sm: int = 2048
    ctas_per_sm: int = 32

    def resident_ctas(self, registers: int, threads: int, smem: int) -> int:
        """CTAs of one kernel an SM holds at once (registers allocated per warp in units of 256)."""
        warps = -(-threads // 32)
        regs = warps * -(-max(1, registers) * 32 // 256) * 256
        by_smem = self.smem_per_sm // (smem + 1024)
        return max(1, min(self.regs_per_sm // regs, by_smem, self.threads_per_sm // threads, self.ctas_per_sm))

    def peak_flops(self, dtype: Any) -> float:
        return self.peak_flops_f32 if np.dtype(dtype).itemsize >= 4 else self.peak_flops_bf16

    def class_peak(self, math: str) -> float:
        """Dense peak of one of :data:`xla.MATH_CLASSES` (TF32 tensor cores: half the bf16 peak)."""
        return {"bf16": self.peak_flops_bf16, "tf32": self.peak_flops_bf16 / 2}.get(math, self.peak_flops_f32)

    def flop_rate(self, engine: str, math: str) -> float:
        """Flops per second that ``engine`` ("xla", or a Pallas template: "matmul", "conv",
        "attention") achieves in ``math`` (:data:`ENGINE_EFFICIENCY` × the class's peak)."""
        eff = ENGINE_EFFICIENCY.get((engine, math), ENGINE_EFFICIENCY.get((engine, "bf16"), 0.05))
        return eff * self.class_peak(math or "ieee")


# Fraction of the math class's dense peak each engine achieves on the GEMMs and convolutions of
# this project's programs. Measured where a figure is given, on an H100 SXM (BENCHMARKS.md,
# "Measured on an H100"; rows in benchmarks/measured/): "kernel by kernel" is one kernel's flops
# over its own device time in the program's trace (`benchmarks/kernel_times.py`); otherwise
# whole-program flops over the program's time (`benchmarks/gpu.py --corpus`) — a lower bound on the
# engine, the side to err on: the guard then prefers XLA. Assumed where none is given.
ENGINE_EFFICIENCY: Mapping[tuple[str, str], float] = {
    ("xla", "bf16"): 0.70,        # measured: GShard MoE expert einsums, 692 TFLOP/s
    ("xla", "tf32"): 0.60,        # measured ≥ 0.31 (f32 U-Net convs via cuDNN: 154 TFLOP/s whole program)
    ("xla", "ieee"): 0.80,        # assumed (cuBLAS SGEMM)
    ("matmul", "bf16"): 0.30,     # measured kernel by kernel (2026-11-27, benchmarks/kernel_times.py and
    #                               gemm_tiles.py): 0.16 inside LoRA's program with the old 64 x 64 tiles
    #                               (0.28 alone), 0.64 alone with tiling.prefill_tiles' 128 x 256; not yet
    #                               measured inside a program with them (decode GEMMs: decode_gemm_loss).
    #                               LoRA's in-program kernel read its A operand (the attention output
    #                               through a reshape) with scalar loads, since passed reshaped
    #                               (vio._reshaped): its PTX is now cp.async alone, and on an H200
    #                               (2026-11-27) that kernel read 0.34 inside the program (8192 x 4096
    #                               x 4096 in 814 us; cuBLAS 335 us). On an H100 (evening, 2149f23):
    #                               0.35 there (799 us; cuBLAS 343 us) and 0.27 in T5's output
    #                               projection (4096 x 1024 x 1024 in 31.8 us; XLA's 17.9 us). 0.30
    ("matmul", "tf32"): 0.085,    # measured kernel by kernel: BERT's f32 projections and MLP, 42-43 TFLOP/s
    #                               inside the program (0.12 alone); EfficientViT's per-head products
    #                               reached 0.03: their tiles are mostly padding (kernel_flops counts them)
    ("matmul", "ieee"): 0.15,     # measured: Mamba's projections with IEEE dots, 10 TFLOP/s
    ("conv", "bf16"): 0.014,      # measured: the zoo's bf16 C3k2, 14 TFLOP/s against cuDNN's 82
    ("conv", "tf32"): 0.017,      # measured: ESPCN 8.6, U-Net 16–46 TFLOP/s (cuDNN: 33–154)
    ("conv", "ieee"): 0.05,       # measured: ConvNeXt 3.4, ESPCN 4.2 TFLOP/s (IEEE f32 FMAs; depthwise always)
    ("attention", "bf16"): 0.30,  # measured ≥ 0.37: LoRA's causal prefill (full S² counted), 365 TFLOP/s
    #                               on an H100 (be43eae), 514 on an H200 (2026-11-27, 534 us); kept low
    ("attention", "tf32"): 0.08,  # measured kernel by kernel: BERT's and T5's f32 prefill, 40 and 46 TFLOP/s
    ("attention", "ieee"): 0.15,
}


GPUS: Mapping[str, GPU] = {
    # NVIDIA A100 datasheet (80GB PCIe): 1,935 GB/s HBM2e, 312 TFLOPS bf16, 19.5 TFLOPS fp32, 108 SMs
    "a100-80gb-pcie": GPU("A100 80GB PCIe", 1.935e12, 2.0e-6, 312e12, 19.5e12, sms=108),
    # NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOPS bf16 dense, 67 TFLOPS fp32
    "h100-sxm": GPU("H100 SXM", 3.35e12, 2.0e-6, 989.4e12, 66.9e12),
    # H100 NVL: 3.9 TB/s HBM3, 835 TFLOPS bf16 dense (1,671 sparse), 60 TFLOPS fp32
    "h100-nvl": GPU("H100 NVL", 3.9e12, 2.0e-6, 835.5e12, 60e12),
    # H200 (SXM): 4.8 TB/s HBM3e, 989 TFLOPS bf16 dense, 67 TFLOPS fp32
    "h200": GPU("H200 SXM", 4.8e12, 2.0e-6, 989.4e12, 66.9e12),
}


# --------------------------------------------------------------------------------------------
# Access penalty of a layout (the Type II cost)
# --------------------------------------------------------------------------------------------

def _map_run_bytes(m: Any, itemsize: int, tiled: frozenset[int] | None = None) -> tuple[bool, int]:
    """(fully contiguous?, best contiguous run in bytes) of one piece map, read in blocks that
    span the virtual dims ``tiled`` (None: any dim, as XLA's copies tile through shared memory;
    a kernel's: :func:`block_dims`).

    Besides the innermost run of the paper's contiguity, any virtual dim that maps to consecutive
    physical elements (coefficient 1, not inside a floordiv/mod) gives a run as long as the tile a
    kernel loads along it: Triton's coalescing pass orders threads along whichever axis of a block
    is unit-stride, so a transposed or head-repeated block still reads whole sectors. A range
    condition on the dim (a pad's mask, a concat piece's bounds) only masks lanes at the run's
    ends; it used to count as breaking the run, which priced EfficientViT's padded V, read through
    the concat of NHWC conv outputs in 64-byte runs, as 4-byte reads (8× the traffic) and left
    XLA to materialise V and Kᵀ (the compile: 3,410 against 2,514 MiB at batch 16).
    """
    c = m.contiguity(itemsize)
    if c.full:
        return True, c.run_bytes
    run = c.run_bytes
    flat = m.flat_expr()
    blocked: set[int] = set()
    for a, _ in flat.terms:
        if isinstance(a, (FloorDiv, Mod)):
            blocked |= a.expr.dims()
    for cond in m.conds:   # a range check masks the run's ends; only a floordiv/mod breaks it
        for a, _ in cond.expr.terms:
            if isinstance(a, (FloorDiv, Mod)):
                blocked |= a.expr.dims()
    for i, n in enumerate(m.domain):
        if n > 1 and i not in blocked and flat.coeff(Dim(i)) == 1 and (tiled is None or i in tiled):
            run = max(run, min(n, TILE) * itemsize)
    return False, run


def piece_penalty(p: Any, itemsize: int, sector: int = 32,
                  tiled: frozenset[int] | None = None) -> tuple[int, float]:
    """(volume, traffic multiplier) of one piece, its map looked at inside its own box, read in
    blocks spanning the dims ``tiled`` (:func:`_map_run_bytes`)."""
    box = p.box()
    m = p.map
    if box is not None and any(b != (0, n) for b, n in zip(box, m.domain)):
        m = m.restrict(box)
    vol = max(1, math.prod(m.domain))
    full, run = _map_run_bytes(m, itemsize, tiled)
    return vol, 1.0 if full else (math.ceil(max(run, 1) / sector) * sector) / max(run, 1)


def access_penalty(layout: Layout | None, itemsize: int, sector: int = 32,
                   piece_fn: Callable[[Any, int], tuple[int, float]] | None = None,
                   tiled: frozenset[int] | None = None) -> float:
    """Traffic multiplier of reading/writing a tensor through ``layout`` (1.0 when physical), in
    blocks spanning the dims ``tiled`` (None: any; a kernel's: :func:`block_dims`).

    Volume-weighted over the pieces; each piece's map is looked at inside its own box (a slab of a
    concat is contiguous in its target even if the full map is not).
    """
    if layout is None:
        return 1.0
    tot, acc = 0, 0.0
    for p in layout.pieces:
        vol, pen = piece_fn(p, itemsize) if piece_fn is not None else piece_penalty(p, itemsize, sector, tiled)
        tot += vol
        acc += vol * pen
    return acc / tot if tot else 1.0


# Elements a kernel's block spans along a tensor's trailing dims: the pointwise template's block
# budget (``kernels.tiling.choose_block``); the matmul, attention and reduction templates tile two
# dims, whatever their sizes
KERNEL_BLOCK = 2048


def block_dims(graph: "Graph", c: "Cluster", t: int) -> frozenset[int]:
    """The dims of tensor ``t`` along which the kernel of cluster ``c`` loads (or stores) blocks
    longer than one element: only along these can Triton's coalescing pass order its threads on a
    unit-stride run (:func:`_map_run_bytes`). A GEMM's or an attention's dot operand or result:
    every dim but the dot's batch dims (each batch element, each head, is a grid program). Any
    other tensor: the trailing dims, filled from the last outwards up to :data:`KERNEL_BLOCK`
    elements and at least the last two longer than one (the attention kernels' (queries, keys)
    blocks, the reduction's (rows, columns)); the leading dims are grid axes of block 1.

    Why: T5's relative-position bias is read by the attention kernel as (head, query, key) from the
    (query, key, head) buffer its embedding lookup wrote. Its unit-stride dim, the head, is a grid
    axis of the kernel, so every load gathers 4-byte elements 64 bytes apart: the H100 ran that
    kernel at 46 TFLOP/s, 187 µs where XLA's softmax and GEMMs took about 120
    (benchmarks/measured/h100-2026-11-27-kernels.jsonl). Counting any unit-stride dim as coalesced
    priced that read as contiguous."""
    shape = graph.tensors[t].shape
    dot = next((graph.ops[o] for o in c.ops if graph.ops[o].primitive == "dot_general"
                and (t in graph.ops[o].inputs or t in graph.ops[o].outputs)), None)
    if c.kind in (Kind.MATMUL, Kind.ATTENTION) and dot is not None:
        (_, _), (lb, rb) = dot.params["dimension_numbers"]
        batch = (set(lb) if t == dot.inputs[0] else set(rb) if t in dot.inputs else set(range(len(lb))))
        return frozenset(range(len(shape))) - batch
    dims, vol, long = set(), 1, 0
    for i in reversed(range(len(shape))):
        if shape[i] > 1 and long >= 2 and vol * shape[i] > KERNEL_BLOCK:
            break
        dims.add(i)
        vol *= shape[i]
        long += shape[i] > 1
    return frozenset(dims)


def kernel_waste(graph: "Graph", c: "Cluster", layout_of: Callable[[int], Layout | None]) -> int:
    """Bytes of memory sectors cluster ``c``'s kernel moves beyond the elements it uses: each piece
    of a tensor it reads or writes through a virtual layout (``layout_of``: None when physical)
    costs the bytes it touches in its target (an element repeated by a broadcast once, as
    ``Context.read_bytes`` counts them) times its :func:`piece_penalty` in the kernel's blocks
    (:func:`block_dims`) less one. The guard prices a kernel call by its buffers' bytes (what
    XLA's compile counts); this is the traffic the buffers do not show."""
    waste = 0.0
    for t in dict.fromkeys((*c.inputs, *c.outputs)):
        lay = layout_of(t)
        if lay is None:
            continue
        itemsize = np.dtype(graph.tensors[t].dtype).itemsize
        tiled = block_dims(graph, c, t)
        for p in lay.pieces:
            vol, pen = piece_penalty(p, itemsize, tiled=tiled)
            waste += (pen - 1.0) * min(vol, graph.tensors[p.target].size) * itemsize
    return int(waste)


# --------------------------------------------------------------------------------------------
# Static per-graph facts
# --------------------------------------------------------------------------------------------

DECODE_MAX_M = 64   # a GEMM with at most this many rows streams its weights: bandwidth-bound


def _gemm_shape(graph: "Graph", c: "Cluster") -> tuple[int, int, int, int, int, int] | None:
    """``(batch, m, n, k, lhs itemsize, rhs itemsize)`` of a matmul cluster's dot (None if none,
    or if the dot is empty: a zero-size GEMM has no launch to price)."""
    op = next((graph.ops[o] for o in c.ops if graph.ops[o].primitive == "dot_general"), None)
    if op is None:
        return None
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = graph.tensors[op.inputs[0]], graph.tensors[op.inputs[1]]
    batch = math.prod(lhs.shape[d] for d in lb)
    k = math.prod(lhs.shape[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs.shape) if d not in lc and d not in lb)
    n = math.prod(s for d, s in enumerate(rhs.shape) if d not in rc and d not in rb)
    if 0 in (batch, m, n, k):
        return None
    return batch, m, n, k, lhs.dtype.itemsize, rhs.dtype.itemsize


def template_gemm_inflight(batch: int, m: int, n: int, k: int, a_itemsize: int, b_itemsize: int,
                           sms: int) -> tuple[int, int]:
    """``(CTAs, operand bytes each CTA keeps in flight)`` of the matmul template's launch.

    Read from the kernels' own launch description (``tiling.gemm_config``: split-K, deeper
    pipelines for decode shapes), so the model and the kernel cannot disagree.
    """
    cfg = tiling.gemm_config(m, n, k, batch=batch, a_itemsize=a_itemsize, b_itemsize=b_itemsize, sms=sms)
    return cfg.ctas, cfg.tiles_in_flight * cfg.tile_bytes


def decode_gemm_loss(gpu: GPU, batch: int, m: int, n: int, k: int, a_itemsize: int, b_itemsize: int) -> float:
    """Seconds the matmul template loses against XLA's GEMM on a decode-shaped GEMM (``m ≤ 64``).

    Why not flops: such a GEMM does almost no math — it streams its weights once, so its time is
    ``bytes / achieved bandwidth``, and the flop-based loss (``(1 - eff) · flops / peak``) calls an
    M = 16 projection's loss 0.1 µs where the kernel is tens of µs slower. XLA's GEMM for these
    shapes (split-K Triton gemm fusions / cuBLAS GEMV) is taken to run at HBM bandwidth, and no
    faster than one HBM latency. The template reaches only what its loads in flight allow
    (Little's law): ``min(CTAs, SMs) · bytes in flight per CTA / HBM latency``. Llama-3-8B's QKV
    projection at M = 16 without split-K: 96 CTAs × 8 KB in flight ≈ 0.8 MB, a third of the
    ~2.7 MB that 3.35 TB/s × 0.8 µs needs. A GEMM small enough to be in flight at once takes one
    latency either way (no loss). Batched GEMMs (per-head products: EfficientViT's linear
    attention) are not weight-streaming projections and give the template one program per batch
    element: no loss beyond the flop term.
    """
    if m > DECODE_MAX_M or batch > 1:
        return 0.0
    nbytes = batch * (m * k * a_itemsize + k * n * b_itemsize)
    ctas, per_cta = template_gemm_inflight(batch, m, n, k, a_itemsize, b_itemsize, gpu.sms)
    stream = nbytes / gpu.hbm_bandwidth
    xla = max(stream, gpu.hbm_latency)                 # everything in flight a GPU can keep
    inflight = min(nbytes, min(ctas, gpu.sms) * per_cta)
    template = max(stream, nbytes * gpu.hbm_latency / max(inflight, 1))
    return max(0.0, template - xla)


def kernel_flops(graph: "Graph", c: "Cluster") -> int:
    """The flops the matmul template's kernel issues for a cluster: its dot's, padded to whole
    tiles (``tiling.gemm_config``'s blocks; a tensor-core tile computes all of its rows and columns
    whatever the GEMM uses). Measured on an H100: EfficientViT's per-head products (512 GEMMs of
    17×16 over K = 4,096) fill a fraction of their tiles and ran at 15 TFLOP/s, where Mamba's
    2048×160 and 2048×4096 projections on the same template kept up with XLA. An unbatched
    decode-shaped GEMM (``m ≤ DECODE_MAX_M``) streams its weights: bandwidth-bound, priced by
    :func:`decode_gemm_loss`, its flops unpadded. Other kinds: the ops' own flops."""
    flops = sum(op_flops(graph.ops[o], graph) for o in c.ops)
    g = _gemm_shape(graph, c) if c.kind == Kind.MATMUL else None
    if g is None or not flops:
        return flops
    batch, m, n, k, ai, bi = g
    if batch == 1 and m <= DECODE_MAX_M:
        return flops
    cfg = tiling.gemm_config(m, n, k, batch=batch, a_itemsize=ai, b_itemsize=bi)
    used = (m * n) / (cfg.m_tiles * cfg.block_m * cfg.n_tiles * cfg.block_n)
    return int(flops / max(used, 1e-6))


def cluster_math(graph: "Graph", c: "Cluster") -> tuple[str, str]:
    """(XLA's math class, the Pallas kernel's) for a GEMM / conv cluster. Both follow the op's
    precision (``kernels.tiling.dot_precision``: f32 at jax's default on TF32 tensor cores), except
    a depthwise convolution's kernel, which has no dot (exact f32 FMAs on the CUDA cores)."""
    op = next((graph.ops[o] for o in c.ops if op_flops(graph.ops[o], graph)), graph.ops[c.ops[0]])
    dtype = graph.tensors[op.inputs[0]].dtype if op.inputs else np.float32
    xla = math_class(dtype, op.params.get("precision"))
    depthwise = op.primitive == "conv_general_dilated" and op.params.get("feature_group_count", 1) > 1
    return xla, ("ieee" if depthwise and xla != "bf16" else xla)


class Context(Facts):
    """XLA's facts about (graph, clusters) plus what the model needs of the VTOG, computed once."""

    def __init__(self, graph: "Graph", clusters: Sequence["Cluster"], vtog: VTOG | None,
                 donated: Iterable[int] = ()) -> None:
        super().__init__(graph, clusters, donated)
        self.vtog = vtog
        self.flops = {k: sum(op_flops(graph.ops[o], graph) for o in c.ops)
                      for k, c in enumerate(self.clusters) if c.kind in LIBRARY_KINDS}
        self.math = {k: cluster_math(graph, c) for k, c in enumerate(self.clusters) if k in self.flops}
        self.gemm = {k: g for k, c in enumerate(self.clusters) if c.kind == Kind.MATMUL
                     for g in [_gemm_shape(graph, c)] if g is not None}
        self.edge_bytes: list[int] = []
        self.by_op: dict[int, list[int]] = {}
        if vtog is not None:
            for i, e in enumerate(vtog.edges):
                self.edge_bytes.append(self._edge_bytes(e))
                self.by_op.setdefault(e.op, []).append(i)
        self._pen: dict[tuple[int, frozenset[int] | None], tuple] = {}
        self._blocks: dict[tuple[int, int], frozenset[int]] = {}

    def _edge_bytes(self, e: Edge) -> int:
        if e.inplace and not self.dus_copy.get(e.op, True):
            return 0
        vol = box_volume(e.box)
        dst_elems = self.graph.tensors[e.dst].size
        return vol * self.itemsize[e.src] + min(vol, dst_elems) * self.itemsize[e.dst]

    def penalty(self, t: int, layout: Layout | None, k: int | None = None) -> float:
        """Traffic multiplier of ``t`` read or written through ``layout`` by cluster ``k``'s kernel
        (its :func:`block_dims`), or by XLA's copy (``k`` None)."""
        if layout is None:
            return 1.0
        tiled = self.block_dims(k, t) if k is not None else None
        return access_penalty(layout, self.itemsize[t], piece_fn=lambda p, i: self._piece(p, i, tiled))

    def block_dims(self, k: int, t: int) -> frozenset[int]:
        """Cached :func:`block_dims` of tensor ``t`` in cluster ``k``'s kernel."""
        hit = self._blocks.get((k, t))
        if hit is None:
            hit = self._blocks[(k, t)] = block_dims(self.graph, self.clusters[k], t)
        return hit

    def _piece(self, p: Any, itemsize: int, tiled: frozenset[int] | None = None) -> tuple[int, float]:
        """Cached :func:`piece_penalty` (pieces are reused across evaluations by identity)."""
        key = (id(p), tiled)
        hit = self._pen.get(key)
        if hit is None or hit[0] is not p or hit[1] != itemsize:
            hit = (p, itemsize, piece_penalty(p, itemsize, tiled=tiled))
            self._pen[key] = hit
        return hit[2]

    def read_bytes(self, t: int, layout: Layout | None) -> int:
        """Bytes a kernel reads for tensor ``t``: repeated elements are read once."""
        if layout is None:
            return self.nbytes[t]
        total = 0
        for p in layout.pieces:
            vol = self._piece(p, self.itemsize[t])[0]     # the piece's box volume (cached)
            total += min(vol, self.graph.tensors[p.target].size) * self.itemsize[t]
        return min(total, self.nbytes[t])


@dataclass
class Cost:
    raw: float = 0.0        # bytes, as counted by modeled_bytes
    eff: float = 0.0        # bytes including sector waste
    launches: int = 0
    extra: float = 0.0      # seconds (library loss)


def cluster_cost(ctx: Context, k: int, layout: Callable[[int], Layout | None],
                  chosen_of_op: Callable[[int], Sequence[int]], lib_loss: Callable[[int], float]) -> Cost:
    """Cost of cluster ``k`` given a layout oracle (None = physical) and the chosen edges."""
    c = ctx.clusters[k]
    g = ctx.graph
    if c.kind == Kind.MOVEMENT:
        cost = Cost()
        for oid in c.ops:
            op = g.ops[oid]
            mine = chosen_of_op(oid)
            data = (*data_inputs(op), *op.outputs)
            if oid not in ctx.base:      # a movement op outside the model (should not happen)
                continue
            if ctx.bitcast[oid]:
                if mine or all(layout(t) is None for t in data):
                    continue
                rem = 2 * ctx.nbytes[op.outputs[0]]
            else:
                rem = ctx.base[oid] - sum(ctx.edge_bytes[i] for i in mine)
            if rem <= 0:
                continue
            srcs = {ctx.vtog.edges[i].src for i in mine} if mine else set()
            wts = [(ctx.nbytes[t], ctx.penalty(t, layout(t))) for t in data if t not in srcs]
            tw = sum(w for w, _ in wts)
            pen = sum(w * p for w, p in wts) / tw if tw else 1.0
            cost.raw += rem
            cost.eff += rem * pen
            cost.launches += 1
        return cost
    raw = eff = 0.0
    touched = False
    for t in c.inputs:
        lay = layout(t)
        touched |= lay is not None
        b = ctx.read_bytes(t, lay)
        raw += b
        eff += b * ctx.penalty(t, lay, k)
    for t in c.outputs:
        lay = layout(t)
        touched |= lay is not None
        raw += ctx.nbytes[t]
        eff += ctx.nbytes[t] * ctx.penalty(t, lay, k)
    extra = lib_loss(k) if touched and c.kind in LIBRARY_KINDS else 0.0
    return Cost(raw, eff, 1, extra)


# --------------------------------------------------------------------------------------------
# Chosen-set state (incremental layouts)
# --------------------------------------------------------------------------------------------

class _State:
    """Layouts under a chosen edge set ``C``, extended incrementally as the greedy grows ``C``."""

    def __init__(self, ctx: Context) -> None:
        self.ctx, self.vtog = ctx, ctx.vtog
        self.C: frozenset[int] = frozenset()
        self.by_src: dict[int, list[int]] = {}
        self.by_op: dict[int, list[int]] = {}
        self.rev: dict[int, set[int]] = {}
        self.memo: dict[int, Layout] = {}
        self.piece_cache: dict[int, tuple[Layout, tuple]] = {}
        self.phys: dict[int, Layout] = {}

    def sync(self, C: frozenset[int]) -> None:
        if C is self.C or C == self.C:
            return
        if not self.C <= C:
            self.__init__(self.ctx)  # type: ignore[misc]
        new = C - self.C
        for i in new:
            e = self.vtog.edges[i]
            self.by_src.setdefault(e.src, []).append(i)
            self.by_op.setdefault(e.op, []).append(i)
            self.rev.setdefault(e.dst, set()).add(e.src)
        for s in self.in_tree({self.vtog.edges[i].src for i in new}):
            self.memo.pop(s, None)
        self.C = C

    def in_tree(self, roots: Iterable[int]) -> set[int]:
        """``roots`` and every tensor whose chosen edges lead to one of them."""
        seen = set(roots)
        stack = list(seen)
        while stack:
            for s in self.rev.get(stack.pop(), ()):
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return seen

    def layout(self, t: int) -> Layout | None:
        if t not in self.by_src:
            return None
        got = self.memo.get(t)
        if got is None:
            got = self.compose(t, self.by_src[t], self._full)
            self.memo[t] = got
        return got

    def _full(self, t: int) -> Layout:
        lay = self.layout(t)
        if lay is not None:
            return lay
        got = self.phys.get(t)     # one object per physical tensor: keeps piece_cache hits
        if got is None:
            got = self.phys[t] = Layout.physical(t, self.vtog.shapes[t])
        return got

    def compose(self, t: int, idxs: Sequence[int], full: Callable[[int], Layout]) -> Layout:
        """``t``'s layout through edges ``idxs`` given its targets' layouts (``full``).

        Each edge's piece list is cached against the identity of the target layout it was built
        from: the greedy re-evaluates the same edges over an unchanged target many times.
        """
        shape = tuple(self.vtog.shapes[t])
        parts: list = []
        for i in idxs:
            e = self.vtog.edges[i]
            base = full(e.dst)
            hit = self.piece_cache.get(i)
            if hit is None or hit[0] is not base:
                hit = (base, Layout.part(base, e.map, e.box))
                self.piece_cache[i] = hit
            parts.append(hit[1])
        return Layout.union(shape, parts)


# --------------------------------------------------------------------------------------------
# The cost model
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostModel:
    """Analytical ``w(e)`` (see the module docstring). ``objective``: "latency" (s) or "memory" (B)."""
    gpu: GPU = GPUS["h100-sxm"]
    objective: str = "latency"
    xla_fusion: bool = True   # leave to XLA the pointwise clusters it fuses better (xla_fuses)
    decode_loss: bool = True  # charge decode GEMMs decode_gemm_loss (off: the template streams as fast)
    math_loss: bool = True    # charge a template's math at its measured rate (off: as fast as XLA's library)

    def __post_init__(self) -> None:
        if self.objective not in ("latency", "memory"):
            raise ValueError(f"objective must be 'latency' or 'memory', not {self.objective!r}")

    def bind(self, vtog: VTOG, graph: "Graph", clusters: Sequence["Cluster"] | None = None,
             donated: Iterable[int] = ()) -> "BoundCostModel":
        """A ``savings(edge, chosen)`` callable for :func:`strategy.greedy`, holding the state it
        caches (layouts under the chosen set) for that one (vtog, graph, clusters).

        Prefer passing the bound object itself to ``greedy`` (not a lambda around ``savings``):
        its ``companions`` and ``refresh`` methods keep the greedy's total exact.
        ``donated`` are graph inputs whose buffers the caller donates (a KV cache updated in place).
        """
        return BoundCostModel(self, Context(graph, cluster(graph) if clusters is None else clusters, vtog,
                                           donated))

    def savings(self, edge: Edge, chosen: frozenset[int], vtog: VTOG, graph: "Graph",
                clusters: Sequence["Cluster"] | None = None) -> float:
        """Seconds (latency) or bytes (memory) saved by adding ``edge`` to ``chosen`` (binds afresh on
        every call: for one-off questions; the greedy takes :meth:`bind`'s object)."""
        return self.bind(vtog, graph, clusters)(edge, chosen)

    def seconds(self, cost: Cost) -> float:
        return cost.eff / self.gpu.hbm_bandwidth + cost.launches * self.gpu.launch_overhead + cost.extra

    def _lib_loss(self, ctx: Context) -> Callable[[int], float]:
        gpu = self.gpu

        def lib(k: int) -> float:
            flops = ctx.flops.get(k, 0)
            xla, kernel = ctx.math.get(k, ("ieee", "ieee"))
            engine = ENGINE_OF_KIND.get(ctx.clusters[k].kind, "matmul")
            issued = kernel_flops(ctx.graph, ctx.clusters[k]) if flops else 0
            compute = (max(0.0, issued / gpu.flop_rate(engine, kernel) - flops / gpu.flop_rate("xla", xla))
                       if self.math_loss else 0.0)
            g = ctx.gemm.get(k)
            return compute if g is None or not self.decode_loss else max(compute, decode_gemm_loss(self.gpu, *g))
        return lib


class BoundCostModel:
    """``CostModel`` bound to one (vtog, graph, clusters): the callable greedy consumes."""

    def __init__(self, model: CostModel, ctx: Context) -> None:
        self.model, self.ctx, self.vtog = model, ctx, ctx.vtog
        self.state = _State(ctx)
        self.lib = model._lib_loss(ctx)

    def time(self, strategy: "Strategy") -> float:
        """Modelled seconds of the whole program under ``strategy`` (latency objective; bytes
        under the memory objective are not a time, so there it is 0 and every strategy ties).

        Why: ``strategy.plan``'s completion passes add edges the greedy never priced (a producer
        writing every output of a split, a view next to a kernel); one of them can turn a library
        GEMM into a Pallas kernel (a decode projection written straight into the KV cache), which
        the greedy itself would have refused. ``plan`` keeps such an addition only if this does
        not go up."""
        return self.time_of(strategy, range(len(self.ctx.clusters)))

    def time_of(self, strategy: "Strategy", clusters: Iterable[int]) -> float:
        """:meth:`time` over some clusters only (positions): comparing two strategies on the
        clusters next to the edges they differ in is the same comparison, at a fraction of the cost."""
        if self.model.objective != "latency":
            return 0.0
        lay, by_op = strategy_oracles(strategy)
        return sum(self.model.seconds(cluster_cost(self.ctx, k, lay, by_op, self.lib)) for k in clusters)

    def prefers_library(self, k: int) -> bool:
        """Cluster position ``k`` is a GEMM whose Pallas kernel is modelled slower than XLA's
        (:func:`decode_gemm_loss`), or a convolution whose kernel's math is (the library loss:
        EfficientViT's 1x1 projection, made a Pallas conv by a free reshape of its input and
        ~2 ms slower than cuDNN); ``strategy.plan``'s view pass leaves its operands physical."""
        if self.ctx.clusters[k].kind == Kind.CONV:
            return self.model.objective == "latency" and self.lib(k) > 0
        g = self.ctx.gemm.get(k)
        return (self.model.objective == "latency" and self.model.decode_loss and g is not None
                and decode_gemm_loss(self.model.gpu, *g) > 0)

    def near(self, edges: Iterable[int]) -> list[int]:
        """Cluster positions whose cost an edge set can change: its movement ops' clusters and the
        producers and consumers of its tensors."""
        ks: set[int] = set()
        for i in edges:
            e = self.vtog.edges[i]
            if e.op in self.ctx.pos:
                ks.add(self.ctx.pos[e.op])
            for t in (e.src, e.dst):
                if t in self.ctx.producer:
                    ks.add(self.ctx.producer[t])
                ks.update(self.ctx.users.get(t, ()))
        return sorted(ks)

    def __call__(self, edge: Edge | int, chosen: frozenset[int]) -> float:
        i = edge if isinstance(edge, int) else self.vtog.index(edge)
        group = piece_group(self.vtog, i)
        vols = [box_volume(self.vtog.edges[j].box) for j in group]
        share = box_volume(self.vtog.edges[i].box) / sum(vols)
        if self.model.objective == "memory":
            e = self.vtog.edges[i]
            return float(box_volume(e.box) * self.ctx.itemsize[e.src])
        return share * self._group_delta(group, frozenset(chosen))

    def companions(self, picked: Sequence[int], chosen: frozenset[int]) -> tuple[int, ...]:
        """The lookahead edges the estimate of ``picked`` (chosen on top of ``chosen``) assumed.

        :func:`strategy.greedy` takes them in the same pick, so the recorded saving is exactly
        the model's ``T(C) - T(C ∪ picked ∪ companions)`` instead of counting the bitcast twice.
        """
        if self.model.objective != "latency" or not picked:
            return ()
        self.state.sync(frozenset(chosen))
        srcs = {self.vtog.edges[i].src for i in picked}
        reach = set().union(*(self._reach(self.vtog.edges[i].dst) for i in picked))
        return tuple(self._followers(srcs, reach))

    def refresh(self, new_edges: Sequence[int], chosen: frozenset[int]) -> set[int]:
        """Edges whose estimate the greedy must redo after ``new_edges`` joined ``chosen``.

        An edge's estimate includes its bitcast followers (lookahead), so it depends on what lives
        in the tensors of its bitcast-connected neighbourhood: after a pick, the undecided tensors
        the new virtual tensors live in, and their undecided bitcast neighbours, get their
        out-edges re-estimated.
        """
        st, vt, g = self.state, self.vtog, self.ctx.graph
        st.sync(frozenset(chosen))
        roots: set[int] = set()
        for i in new_edges:
            roots |= {t for t in self._reach(vt.edges[i].dst) if t not in st.by_src}
        seen, stack = set(roots), list(roots)
        while stack:
            t = stack.pop()
            near = [*g.consumers(t)] + ([g.producer(t)] if g.producer(t) is not None else [])
            for op in near:
                if self.ctx.bitcast.get(op.id):
                    for o in (*op.inputs, *op.outputs):
                        if o not in seen and o not in st.by_src and o not in vt.physical:
                            seen.add(o)
                            stack.append(o)
        return {i for t in seen for i in vt.out_edges(t)}

    def _followers(self, srcs: set[int], reach: set[int]) -> list[int]:
        """Bitcast edges that would follow the new virtual tensors for free (one-step lookahead).

        Making ``c`` virtual breaks the bitcast ``b -> c`` (XLA's free reshape becomes a real copy
        while ``b`` stays physical), and the bitcast's own edge ``b ⇢ c`` saves nothing until then:
        judged one edge at a time, the chain ``b ⇢ c ⇢ d`` would never start. So the hypothetical
        state also makes each undecided bitcast neighbour ``b`` virtual through its edge into the
        new tensor; after the pick, ``b ⇢ c`` is re-estimated (it now removes a real copy) and taken.
        """
        st, vt, ctx, g = self.state, self.vtog, self.ctx, self.ctx.graph
        out: list[int] = []
        frontier = list(srcs)
        while frontier:
            t = frontier.pop()
            near = [*g.consumers(t)] + ([g.producer(t)] if g.producer(t) is not None else [])
            for op in near:
                if not ctx.bitcast.get(op.id):
                    continue
                for j in ctx.by_op.get(op.id, ()):
                    e = vt.edges[j]
                    o = e.src
                    if (e.dst == t and o not in st.by_src and o not in srcs and o not in reach
                            and o not in vt.physical):
                        out.append(j)
                        srcs.add(o)
                        frontier.append(o)
        return out

    def _group_delta(self, group: Sequence[int], chosen: frozenset[int]) -> float:
        st = self.state
        st.sync(chosen)
        vt, ctx = self.vtog, self.ctx
        src = vt.edges[group[0]].src
        if src in st.by_src:      # already virtual: nothing more to gain
            return -INF
        if any(src in self._reach(vt.edges[j].dst) for j in group):
            return -INF           # would close a cycle
        hyp_edges: dict[int, list[int]] = {src: list(group)}
        srcs = {src}
        reach = set().union(*(self._reach(vt.edges[j].dst) for j in group))
        for j in self._followers(srcs, reach):
            hyp_edges.setdefault(vt.edges[j].src, []).append(j)
        tree = st.in_tree(srcs)
        hyp: dict[int, Layout] = {}

        def full(t: int) -> Layout:
            if t in hyp:
                return hyp[t]
            if t in hyp_edges:
                lay = st.compose(t, hyp_edges[t], full)
            elif t in tree:
                lay = st.compose(t, st.by_src[t], full)
            else:
                return st._full(t)
            hyp[t] = lay
            return lay

        try:
            for t in tree:
                full(t)
        except Exception:  # noqa: BLE001 - a map that does not compose cannot be chosen
            return -INF

        def lay_after(t: int) -> Layout | None:
            return hyp[t] if t in hyp else st.layout(t)

        extra: dict[int, list[int]] = {}
        for idxs in hyp_edges.values():
            for j in idxs:
                extra.setdefault(vt.edges[j].op, []).append(j)

        def chosen_after(oid: int) -> Sequence[int]:
            return [*st.by_op.get(oid, ()), *extra.get(oid, ())]

        def chosen_before(oid: int) -> Sequence[int]:
            return st.by_op.get(oid, ())

        affected: set[int] = {ctx.pos[o] for o in extra if o in ctx.pos}
        for t in tree:
            if t in ctx.producer:
                affected.add(ctx.producer[t])
            affected.update(ctx.users.get(t, ()))
        sec = self.model.seconds
        before = sum(sec(cluster_cost(ctx, k, st.layout, chosen_before, self.lib)) for k in affected)
        after = sum(sec(cluster_cost(ctx, k, lay_after, chosen_after, self.lib)) for k in affected)
        return before - after

    def _reach(self, t: int) -> set[int]:
        """``t`` and every tensor its chosen edges lead to."""
        st = self.state
        seen, stack = {t}, [t]
        while stack:
            for i in st.by_src.get(stack.pop(), ()):
                d = self.vtog.edges[i].dst
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return seen


def strategy_oracles(strategy: "Strategy") -> tuple[Callable[[int], Layout | None], Callable[[int], Sequence[int]]]:
    by_op: dict[int, list[int]] = {}
    for i in strategy.chosen:
        by_op.setdefault(strategy.vtog.edges[i].op, []).append(i)
    return ((lambda t: strategy.layout(t) if strategy.is_virtual(t) else None),
            (lambda oid: by_op.get(oid, ())))
