"""Tiling helpers shared by the kernel templates: power-of-two blocks, grids, loops, f32 math.

Everything here is static planning or scalar index arithmetic; nothing touches memory (that is
:mod:`vio`'s job). A template combines them as the Pallas GPU ops do: a kernel body taking its
static configuration, a launch building the grid, and a thin public wrapper.

* Blocks: :func:`next_pow2`, :func:`check_pow2`, :func:`choose_block` (pointwise / elementwise
  tiles), :func:`choose_blocks` (the (bm, bn, bk) of a dot), :func:`split_block` (one group's block
  split over several dims), :class:`Group` (a group of dims tiled together and the per-dim origins
  of a tile index).
* Grids and loops: :func:`cdiv`, :func:`program_id` (the Python int 0 on a size-1 grid axis, so
  vio sees a static origin), :func:`grid_origin` (a 1-D grid over blocks), :func:`fori` (a loop
  that is just the body when it runs once).
* Dots: :func:`dot_precision` (precision and accumulator dtype of the in-kernel ``tt.dot``, from
  the precision of the op the kernel replaces: TF32 tensor cores for f32 at jax's default, IEEE at
  ``HIGHEST``, as XLA on the GPU), :func:`resolve_precision`, :func:`precision_unsupported`,
  :func:`more_precise`;
  :func:`gemm_config` / :class:`GemmConfig`: the launch shape of the matmul template (blocks,
  pipeline depth, split-K) and what it implies — grid, waves, tiles in flight, bytes per CTA. A
  pure function of sizes and dtypes, so the cost model can read the same numbers the kernel uses.
* 16-bit math: :func:`f32_math` and :data:`F32_MATH_PRIMITIVES` (per-op f32 for the primitives
  Triton cannot run on bf16/f16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from ..compat import CPU_LOWERING_CORES
from ..interpret import interpret
from ..primitives import CALL_LIKE, TABLE

__all__ = ["MIN_DOT_BLOCK", "NUM_SMS", "DECODE_MAX_M", "GemmConfig", "gemm_config", "prefill_tiles", "next_pow2", "cdiv",
           "check_pow2", "choose_block", "choose_blocks",
           "split_block", "Group", "InBounds", "program_id", "grid_origin", "fori", "fori_prefetch", "dot_precision",
           "resolve_precision", "precision_unsupported", "more_precise", "TRITON_DOT_ALGORITHMS", "f32_math",
           "F32_MATH_PRIMITIVES", "ieee_f32", "pipeline_stages"]

MIN_DOT_BLOCK = 16  # tt.dot needs M, N, K >= 16 (and K >= 16 for 16-bit types in the front end)
NUM_SMS = CPU_LOWERING_CORES
"""Streaming multiprocessors of the target GPU, an H100 SXM (132 SMs; the PCIe card has 114). The
one definition every template sizes its grid against (decode attention's split count, the matmul's
split-K waves) and the cost model's ``GPU.sms`` default: no GPU is queried, the kernels are planned
for this card."""
_TARGET = 2048      # elements per elementwise block (fits 4 warps comfortably for a few live values)
_MAX_1D = 1024      # elementwise block of a rank-1 tensor


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------

def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(n: int, d: int) -> int:
    return -(-int(n) // int(d))


def check_pow2(name: str, v: int, minimum: int = MIN_DOT_BLOCK) -> None:
    """Raise ``ValueError`` unless ``v`` is a power of two ``>= minimum``."""
    if v < minimum or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two >= {minimum}")


def choose_block(shape: Sequence[int], itemsize: int = 4, target: int = _TARGET) -> tuple[int, ...]:
    """Power-of-two block for ``shape``, filled from the innermost dim outwards up to ~``target``
    elements: the last dim at most 128 (4-byte) / 256 (2-byte) wide, outer dims get what is left
    of the budget (1 once it is spent: those dims are collapsed into the grid)."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return ()
    if len(shape) == 1:
        return (min(next_pow2(shape[0]), _MAX_1D),)
    last = min(next_pow2(shape[-1]), 256 if itemsize <= 2 else 128)
    out, budget = [last], max(1, target // last)
    for n in reversed(shape[:-1]):
        b = min(next_pow2(n), budget)
        out.append(b)
        budget = max(1, budget // b)
    return tuple(reversed(out))


def choose_blocks(m: int, n: int, k: int, *, block_m: int = 64, block_n: int = 64,
                  block_k: int = 32) -> tuple[int, int, int]:
    """The effective (bm, bn, bk) for logical sizes M, N, K: ``max(16, next_pow2(size))`` capped
    at the requested block (the M = 1..16 decode case gets bm = 16)."""
    return tuple(min(cap, max(MIN_DOT_BLOCK, next_pow2(s)))  # type: ignore[return-value]
                 for s, cap in ((m, block_m), (n, block_n), (k, block_k)))


def split_block(sizes: Sequence[int], cap: int, minimum: int = MIN_DOT_BLOCK) -> tuple[int, ...]:
    """Blocks (powers of two) for a group: the total is ``min(cap, max(minimum, padded size))``,
    handed out from the innermost dim; any surplus (group smaller than ``minimum``) is masked lanes
    on the innermost dim."""
    if not sizes:
        return ()
    total = min(int(cap), max(minimum, math.prod(next_pow2(s) for s in sizes)))
    blocks = [1] * len(sizes)
    rem = total
    for i in reversed(range(len(sizes))):
        b = min(next_pow2(sizes[i]), rem)
        blocks[i] = b
        rem //= b
    # Surplus lanes go on the innermost dim that has more than one element: a block wider than
    # 1 on a size-1 dim is a dim with no physical home, which stores cannot serve strided.
    big = [i for i, s in enumerate(sizes) if s > 1]
    blocks[big[-1] if big else -1] *= rem
    return tuple(blocks)


@dataclass(frozen=True)
class InBounds:
    """A block origin the template proves in range: ``origin + block <= size`` along its dim.

    vio emits a bounds mask for every traced origin it cannot bound; a tile index ``t < tiles``
    times a block that divides the size needs none. Fewer masks mean unpredicated, vectorised
    loads (``cp.async`` without a zero-fill predicate) and fewer ``setp``/``selp`` in the PTX.
    Only vio unwraps it (``value``); templates never do arithmetic on it."""
    value: Any


@dataclass(frozen=True)
class Group:
    """A group of logical dims tiled together (a dot's B, M, N or K): sizes, blocks, tiles per dim."""
    sizes: tuple[int, ...]
    blocks: tuple[int, ...]

    @property
    def tiles(self) -> tuple[int, ...]:
        return tuple(-(-s // b) for s, b in zip(self.sizes, self.blocks))

    @property
    def ntiles(self) -> int:
        return math.prod(self.tiles)

    @property
    def block(self) -> int:
        return math.prod(self.blocks)

    def origins(self, t: Any, mark: bool = False) -> tuple[Any, ...]:
        """Per-dim origins of tile ``t`` (traced int32 or Python int), innermost dim fastest.

        ``mark``: the caller guarantees ``0 <= t < ntiles``; traced origins along dims whose block
        divides the size come back as :class:`InBounds` (for vio only: no bounds mask)."""
        out: list[Any] = [0] * len(self.sizes)
        stride = 1
        for i in reversed(range(len(self.sizes))):
            n, b = self.tiles[i], self.blocks[i]
            if n > 1:
                # lax.div/rem on int32 (operands are non-negative): jnp's floor-mod expands into
                # selects whose constants the Triton lowering mistypes (i1 vs i32).
                q = t if stride == 1 else _div(t, stride)
                if stride * n < self.ntiles:
                    q = _rem(q, n)
                out[i] = q * b
                if mark and self.sizes[i] % b == 0 and not isinstance(t, int):
                    out[i] = InBounds(out[i])
            stride *= n
        return tuple(out)


def _div(x: Any, c: int) -> Any:
    return x // c if isinstance(x, int) else lax.div(x, jnp.int32(c))


def _rem(x: Any, c: int) -> Any:
    return x % c if isinstance(x, int) else lax.rem(x, jnp.int32(c))


# --------------------------------------------------------------------------------------------
# Grids and loops
# --------------------------------------------------------------------------------------------

def program_id(axis: int, size: int) -> Any:
    """The program id along a grid axis, as the Python int 0 when the axis has one program: vio
    then knows the block origin statically and emits no bounds mask along that dim."""
    return 0 if size == 1 else pl.program_id(axis)


def grid_origin(shape: Sequence[int], block: Sequence[int], pid: Any) -> tuple[tuple[Any, ...], int]:
    """(origin of program ``pid``'s block, grid size) for a 1-D grid over blocks, last dim fastest.

    Dims covered by a single block get the static origin ``0`` (vio then skips their masks when
    the block also fits exactly). Returns the grid size as the second element.
    """
    counts = [max(1, -(-int(n) // int(b))) for n, b in zip(shape, block)]
    origin: list[Any] = []
    stride = 1
    for n, b in reversed(list(zip(counts, block))):
        if n == 1:
            origin.append(0)
        else:
            q = pid if stride == 1 else pid // stride
            origin.append((q % n) * b if stride * n < math.prod(counts) else q * b)
        stride *= n
    return tuple(reversed(origin)), math.prod(counts)


def fori(n: int, step: Callable[[Any, Any], Any], init: Any) -> Any:
    """``lax.fori_loop(0, n, step, init)``, or just ``step(0, init)`` when it runs once."""
    return step(0, init) if n == 1 else lax.fori_loop(0, n, step, init)


def fori_prefetch(n: int, load: Callable[[Any], Any], step: Callable[[Any, Any, Any], Any], init: Any) -> Any:
    """``acc = step(t, load(t), acc)`` for ``t < n``, with ``load(t + 1)`` issued before
    ``step(t, ...)``: the loaded tile rides in the loop carry, so two tiles are in flight per CTA
    (register prefetch).

    Why: Triton's software pipeliner stages only loads that feed a ``tt.dot`` (a loop without one,
    such as the depthwise convolution's, would need a loop-level ``num_stages``, which Pallas does
    not set), and only loads of at least 4 contiguous bytes (``cp.async``'s smallest copy). A loop
    whose loads are neither waits a DRAM round trip per iteration; prefetching into registers
    overlaps that trip with the current iteration's arithmetic, as CUTLASS's pre-``cp.async``
    mainloops did. The last iteration re-reads tile ``n - 1`` (no branch in the loop; an L2 hit).
    ``load(t)`` returns any pytree; ``n == 1`` is one plain step.
    """
    if n == 1:
        return step(0, load(0), init)

    def body(t: Any, carry: Any) -> Any:
        acc, cur = carry
        nxt = load(jnp.minimum(t + 1, n - 1))
        return step(t, cur, acc), nxt

    return lax.fori_loop(0, n, body, (init, load(0)))[0]


# --------------------------------------------------------------------------------------------
# Dots
# --------------------------------------------------------------------------------------------

TRITON_DOT_ALGORITHMS = frozenset({
    lax.DotAlgorithmPreset.F16_F16_F16, lax.DotAlgorithmPreset.F16_F16_F32,
    lax.DotAlgorithmPreset.BF16_BF16_BF16, lax.DotAlgorithmPreset.BF16_BF16_F32,
    lax.DotAlgorithmPreset.BF16_BF16_F32_X3, lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    lax.DotAlgorithmPreset.BF16_BF16_F32_X9, lax.DotAlgorithmPreset.TF32_TF32_F32,
    lax.DotAlgorithmPreset.TF32_TF32_F32_X3, lax.DotAlgorithmPreset.F32_F32_F32})
"""The ``lax.DotAlgorithmPreset`` values Pallas' Triton lowering of ``dot_general`` runs (jax 0.10.2
… 0.12, ``_dot_general_lowering``); FP8, F64 and custom ``lax.DotAlgorithm`` values it refuses, so
an op asking for one stays in XLA (:func:`precision_unsupported`)."""


def resolve_precision(precision: Any) -> Any:
    """What an op's ``precision`` param computes at on the GPU: a ``lax.Precision`` level or a
    ``lax.DotAlgorithmPreset`` (or a custom ``lax.DotAlgorithm``, passed through).

    ``precision`` is any value a ``dot_general`` / ``conv_general_dilated`` param or ``lax.dot``
    takes: None, a level, a pair of levels, a preset, or their names. None resolves against
    ``jax_default_matmul_precision`` *now*: a kernel is planned while its program is lowered, so this
    is the setting the lowering runs under — what ``lax.canonicalize_precision`` does when jax
    traces a dot, and the reason an op whose param is None (traced with no setting) still follows a
    ``jax.default_matmul_precision(...)`` context around the lowering. Unset, it is ``DEFAULT``.
    Strings map as jax maps them (``"tensorfloat32"`` is ``HIGH``, ``"float32"`` ``HIGHEST``,
    ``"bfloat16"`` ``DEFAULT``, other names are presets). A pair resolves to its more precise level:
    XLA's GPU backend allows TF32 only when neither operand asks for ``HIGHEST``, while Triton's
    lowering would take TF32 as soon as one does. The preset ``DEFAULT`` is "no algorithm": the
    level ``DEFAULT``.
    """
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
        if precision is None:
            return lax.Precision.DEFAULT
    if isinstance(precision, str):
        try:
            return lax.Precision(precision)
        except ValueError:
            return resolve_precision(lax.DotAlgorithmPreset[precision])
    if isinstance(precision, lax.DotAlgorithm):   # a NamedTuple: not a pair of levels
        return precision
    if isinstance(precision, (tuple, list)):
        return max((resolve_precision(p) for p in precision), key=lambda p: p.value)
    if precision == lax.DotAlgorithmPreset.DEFAULT:
        return lax.Precision.DEFAULT
    return precision


def precision_unsupported(precision: Any) -> str | None:
    """Why an in-kernel dot cannot compute at ``precision`` (an op's param, as
    :func:`resolve_precision` takes it), or None when it can: a template declines such an op."""
    p = resolve_precision(precision)
    if isinstance(p, lax.Precision) or p in TRITON_DOT_ALGORITHMS:
        return None
    return f"dot algorithm {p} (Pallas' Triton dot runs levels and the presets of TRITON_DOT_ALGORITHMS)"


def dtype_unsupported(dtype: Any) -> str | None:
    """Why an in-kernel dot cannot take operands of ``dtype`` as XLA computes them, or None: float64
    (x64 mode) — the kernels accumulate in f32 (attention's flash state) or lower no f64 MMA for
    sm_90, where XLA runs the f64 dot exactly; a template declines such a cluster."""
    if np.dtype(dtype) == np.float64:
        return "float64 operands: the kernels' dots and accumulators are f32 at most (XLA computes f64 exactly)"
    return None


def native_precision(precision: Any, dtype: Any) -> Any:
    """``precision`` with a preset that only restates what a dot of ``dtype`` operands does anyway
    — ``BF16_BF16_F32`` on bf16, ``F16_F16_F32`` on f16: the operands' own type on tensor cores,
    f32 accumulation — replaced by the level ``DEFAULT``. ``jax.nn.dot_product_attention`` puts
    ``BF16_BF16_F32`` on its q·kᵀ and nothing on its p·v: the two dots compute alike."""
    native = {np.dtype(jnp.bfloat16): lax.DotAlgorithmPreset.BF16_BF16_F32,
              np.dtype(jnp.float16): lax.DotAlgorithmPreset.F16_F16_F32}.get(np.dtype(dtype))
    return lax.Precision.DEFAULT if native is not None and precision == native else precision


def more_precise(a: Any, b: Any) -> Any:
    """One precision for a kernel whose dots replace two ops (attention's q·kᵀ and p·v): the ops'
    own, unresolved, when the params are equal (so a None still follows the setting the kernel is
    built under); else the resolved one when they resolve alike, else the more precise level
    (never less exact than either op asked for). Two different presets, or a preset and a level,
    have no order: ValueError."""
    if a == b:
        return a
    ra, rb = resolve_precision(a), resolve_precision(b)
    if ra == rb:
        return ra
    if isinstance(ra, lax.Precision) and isinstance(rb, lax.Precision):
        return max(ra, rb, key=lambda p: p.value)
    raise ValueError(f"the dots compute at {ra} and {rb}: no one precision for both")


def dot_precision(precision: Any, compute_dtype: Any) -> tuple[Any, np.dtype]:
    """(precision, accumulator dtype) of an in-kernel dot over ``compute_dtype`` operands that
    replaces an op with ``precision`` (its ``dot_general`` / ``conv_general_dilated`` param, None
    when the caller has none): the one rule every kernel's ``tt.dot`` follows, so a kernel computes
    as XLA computes the op it replaces on the GPU.

    f32 operands: the level :func:`resolve_precision` gives, which Pallas' Triton lowering maps as
    XLA's GPU backend does — ``DEFAULT`` and ``HIGH`` to TF32 tensor cores (``inputPrecision =
    tf32``; XLA also runs ``HIGH`` as TF32 on NVIDIA GPUs), ``HIGHEST`` to IEEE f32 FMAs. So an f32
    program at jax's default precision gets the tensor cores ``jax.jit`` gets, and ``HIGHEST`` (on
    the op, or ``jax.default_matmul_precision("highest")``) stays exact. 16-bit operands: None — the
    tensor cores at the operands' own type, whatever the level (a level only affects f32, in XLA
    too). A ``lax.DotAlgorithmPreset`` is passed to the dot as is, for any operand type (the
    lowering casts the operands to the preset's input type). Interpret mode on the CPU computes
    every level as exact f32 (XLA's CPU dot ignores the level), so its numbers do not change.

    The accumulator is f32 for 16/32-bit floats: the dot's result dtype, which the kernels also
    sum their K tiles in (a preset's own accumulation type applies within one tile's ``tt.dot``).
    Raises NotImplementedError for what :func:`precision_unsupported` names.
    """
    compute_dtype = np.dtype(compute_dtype)
    acc = np.dtype(jnp.float32) if compute_dtype.itemsize <= 4 else compute_dtype
    why = precision_unsupported(precision)
    if why:
        raise NotImplementedError(why)
    p = resolve_precision(precision)
    if isinstance(p, lax.DotAlgorithmPreset):
        return p, acc
    return (p if compute_dtype == np.float32 else None), acc


def ieee_f32(precision: Any, compute_dtype: Any) -> bool:
    """Whether an in-kernel dot over ``compute_dtype`` operands at ``precision`` (an op's param, as
    :func:`dot_precision` takes it) runs as IEEE f32 FMAs rather than on tensor cores."""
    p, _ = dot_precision(precision, compute_dtype)
    return np.dtype(compute_dtype) == np.float32 and p in (lax.Precision.HIGHEST,
                                                             lax.DotAlgorithmPreset.F32_F32_F32)


def pipeline_stages(precision: Any, compute_dtype: Any) -> int:
    """Triton's ``num_stages`` for a conv or attention kernel whose main loop feeds ``tt.dot`` ops at
    ``precision`` over ``compute_dtype`` operands: 3 on tensor cores, 1 for IEEE f32.

    Why 3: Triton's pipeliner gives a loop ``num_stages - 1`` loads in flight; at 2 the PTX waits
    ``cp.async.wait_group 0`` at the loop head (the next tile is only asked for once the current
    one has landed: one tile in flight), at 3 ``wait_group`` 1-2 (two). ptxas on sm_90 (jax
    0.12's Triton; ``benchmarks/kernels.md``): TF32 convolutions take no more registers at 3 stages
    than at 1 (56/95/84 against 52/110/92 for YOLO's 3x3, its batch-16 1x1 and EfficientViT's 1x1);
    the f32 prefill kernel at D = 128 spills 136 B at 2 stages and none at 3 (244 registers); the
    f32 decode kernel takes 80 registers at 3 stages (120 at 1).

    Why 1 for IEEE f32 (``HIGHEST``): its dots are FMAs in registers, and the registers a staged
    tile takes spill — the decode kernel at 255 registers with 132-168 B spilled at 2 and 3
    stages, a batch-16 1x1 convolution 24 B at 3 — while a loop that computes at the FMA rate is
    not waiting on its loads.
    """
    return 1 if ieee_f32(precision, compute_dtype) else 3


def interpreter_dtype(compute_dtype: Any, backend: str) -> np.dtype:
    """The dtype a GEMM kernel casts its dot operands to: ``compute_dtype``, but f32 for 16-bit
    floats on the CPU interpreter. Why: XLA's CPU ``DotThunk`` has no BF16 × BF16 → F32 (nor F16)
    for some block shapes and fails at run time, after ``optimize`` returned (a bf16 ``a.T @ b``
    of 16×8 operands). Exact: the product of two 16-bit floats is exact in f32 and the kernels
    accumulate in f32, so only the summation order can differ, as between two tilings."""
    compute_dtype = np.dtype(compute_dtype)
    if backend == "interpret" and jnp.issubdtype(compute_dtype, jnp.floating) and compute_dtype.itemsize == 2:
        return np.dtype(jnp.float32)
    return compute_dtype


# --------------------------------------------------------------------------------------------
# The matmul template's launch shape (read by the kernel and by the cost model)
# --------------------------------------------------------------------------------------------

DECODE_MAX_M = 64          # M (flattened lhs free size) up to this is "decode-shaped"
_DECODE_WAVES = 2          # split-K until the grid fills this many waves of SMs ...
_DECODE_B_TILE = 16384     # ... streaming weight tiles of about this many bytes (bk x bn)
_DECODE_STAGES = 4         # pipeline depth of the decode path (3 tiles in flight per CTA)
_DECODE_SMEM = 128 * 1024  # cap on the staged A + B tiles of the decode path (sm_90: 227 KiB)
_PIECES_SMEM = 200 * 1024  # ... of operands read from several buffers, each piece staged apart

# Prefill tiles by operand width: (block_m, block_n, block_k, num_warps), 3 stages. Measured on an
# H100 (benchmarks/gemm_tiles.py, rows in benchmarks/measured/h100-2026-11-27-gemm-tiles.jsonl;
# XLA's GEMM timed beside each): bf16 8192 x 4096 x 4096 ran at 636 TFLOP/s with 128 x 256 x 64 and
# 8 warps against 277 with the old 64 x 64 x 32 and 4 warps (XLA: 659-691). f32 keeps the small
# tiles: 256 x 128 x 64 ran BERT's 4096-row GEMMs on TF32 at 93 / 74 / 67 TFLOP/s against 58 / 60 /
# 52 alone (XLA: 104-197), but inside the program it took 224 KiB of shared memory, 255 registers
# and spilled behind a GELU epilogue, and one of Swin's batched products asked for 672 KiB (XLA's
# deviceless compile); 128 x 256 x 64 f32 asks for 256 KiB and fails.
_PREFILL_TILES = {2: (128, 256, 64, 8)}
_SMALL_TILES = (64, 64, 4)         # block_m, block_n, num_warps of every other GEMM


@dataclass(frozen=True)
class GemmConfig:
    """One matmul launch: blocks, pipeline depth and split-K, and what they imply on the GPU.

    Sizes are the flattened groups (``batch`` = product of batch dims, ``m``/``n``/``k`` = lhs free,
    rhs free, contracting). The derived figures are a model, not a measurement (no GPU here):

    * ``grid``: programs of the main kernel, ``(batch * split_k, m_tiles, n_tiles)``; with
      ``split_k > 1`` each program sums ``k_tiles_per_split`` K tiles into an f32 workspace and a
      second kernel (``reduce_grid``, one program per output tile) adds the partials in a fixed
      order, applies the epilogue once and does the (virtual) stores.
    * ``waves``: ``ctas / sms`` (one CTA per SM assumed; a wave under 1 leaves SMs idle).
    * ``tiles_in_flight``: K tiles whose loads are outstanding while one is consumed — Triton's
      software pipeliner keeps ``num_stages - 1`` iterations ahead (``cp.async.wait_group`` then
      waits for the oldest only); never more than the loop has iterations.
    * ``bytes_per_cta``: operand bytes one main-kernel program streams (padded tiles: an M = 1
      decode row still loads a 16-row A block, masked lanes are not fetched but are counted here
      as A is tiny next to B).
    * ``smem_bytes``: the pipelined operand buffers, ``(num_stages - 1) * (A tile + B tile)``:
      Triton's pipeliner allocates ``num_stages - 1`` buffers (measured: 61,440 B for
      16x4096x6144 bf16 = 3 x 20,480). An upper bound: a folded M = 1 A tile is smaller
      (53,248 B measured); benchmarks/kernels.md has the ptxas figures.
    * ``workspace_bytes``: f32 partial sums written by the main kernel and read by the reduce
      kernel (0 without split-K): the price of filling the GPU, ``2 * split_k * batch * m * n * 4``.
    """
    batch: int
    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    a_itemsize: int = 2
    b_itemsize: int = 2
    sms: int = NUM_SMS
    b_parts: int = 1          # B tiles per K step (a gated GEMM's gate and up parts)

    @property
    def m_tiles(self) -> int:
        return cdiv(self.m, self.block_m)

    @property
    def n_tiles(self) -> int:
        return cdiv(self.n, self.block_n)

    @property
    def k_tiles(self) -> int:
        return cdiv(self.k, self.block_k)

    @property
    def k_tiles_per_split(self) -> int:
        return cdiv(self.k_tiles, self.split_k)

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.batch * self.split_k, self.m_tiles, self.n_tiles

    @property
    def reduce_grid(self) -> tuple[int, int, int] | None:
        return (self.batch, self.m_tiles, self.n_tiles) if self.split_k > 1 else None

    @property
    def ctas(self) -> int:
        return math.prod(self.grid)

    @property
    def waves(self) -> float:
        return self.ctas / self.sms

    @property
    def tiles_in_flight(self) -> int:
        return max(1, min(self.num_stages - 1, self.k_tiles_per_split))

    @property
    def tile_bytes(self) -> int:
        """Bytes of one K step's A and B tiles."""
        return self.block_k * (self.block_m * self.a_itemsize + self.block_n * self.b_itemsize * self.b_parts)

    @property
    def bytes_per_cta(self) -> int:
        return self.k_tiles_per_split * self.tile_bytes

    @property
    def smem_bytes(self) -> int:
        return max(1, self.num_stages - 1) * self.tile_bytes

    @property
    def workspace_bytes(self) -> int:
        return 0 if self.split_k == 1 else 2 * self.split_k * self.batch * self.m * self.n * 4 * self.b_parts


def prefill_tiles(m: int, n: int, *, batch: int = 1, itemsize: int = 2,
                  sms: int = NUM_SMS) -> tuple[int, int, int, int] | None:
    """The big prefill tile ``(block_m, block_n, block_k, num_warps)`` for an ``m x n`` product of
    operands ``itemsize`` bytes wide, or None where it does not fit: f32 operands, a decode shape, a group
    smaller than the tile (the tile would be mostly padding: per-head attention products), or a
    grid of fewer than half a wave of big tiles (on the H100 a 0.73-wave grid of big tiles, BERT's
    4096 x 768 f32 outputs as 96 tiles of 256 x 128, still ran 1.3x faster than 768 small ones)."""
    tile = _PREFILL_TILES.get(itemsize)
    if tile is None or m <= DECODE_MAX_M or m < tile[0] or n < tile[1]:
        return None
    return tile if batch * cdiv(m, tile[0]) * cdiv(n, tile[1]) >= sms // 2 else None


def gemm_config(m: int, n: int, k: int, *, batch: int = 1, a_itemsize: int = 2, b_itemsize: int = 2,
                block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, split_k: int | None = None,
                sms: int = NUM_SMS, b_parts: int = 1, pieces: tuple[int, int] = (1, 1)) -> GemmConfig:
    """The launch the matmul template uses for these sizes (``None`` = the template's choice).

    Why three regimes: a 16-bit prefill GEMM with enough big tiles takes :func:`prefill_tiles`
    (measured on an H100: 2.3x the bf16 rate of the small tiles). Otherwise: a prefill-sized GEMM (``m > DECODE_MAX_M``) has enough output tiles to fill
    the GPU and is compute-heavy, so it keeps ``bk = 32``, with 3 stages (two stages made the K
    loop wait for the tile it had just issued, ``cp.async.wait_group 0``: one tile in flight;
    three keep two, and ptxas gives the f32 kernel fewer registers, 109 against 222). A decode GEMM (``m`` up to
    64 rows) reads each weight once and does almost no math: it is bound by how many weight bytes
    are in flight. With one 64-wide N tile per program, Llama-3-8B's QKV (N = 6144) gives 96
    programs and w_o 64 — under one wave of 132 SMs, each waiting on one 4 KB tile at a time. So
    the decode path (i) widens ``bk`` so a weight tile is ~16 KB, (ii) pipelines 4 stages (3 tiles
    in flight per CTA), and (iii) splits K in powers of two until the grid fills
    ``2 * sms`` programs, as long as each split keeps at least ``num_stages`` K tiles (a shorter
    loop cannot fill the pipeline). Gate/up (N = 28672: 448 programs) needs no split. Batched
    GEMMs (``batch > 1``) never split.

    ``b_parts``: the B tiles each program loads per K step (a gated GEMM computes ``x @ W_gate``
    and ``x @ W_up`` side by side for its epilogue, ``silu(g) * u``): the staged weight bytes are
    budgeted over all of them — a decode tile of ~16 KB across the parts, the shared-memory cap on
    their sum — and the prefill tiles, sized for one B tile, are not taken. ``n`` is one part's.

    ``pieces``: how many buffers the A and the B operand are read from (a virtual operand's
    pieces: weights side by side, a concatenation). Each piece is loaded under its own mask and
    staged in its own shared-memory buffers, so the pipeline is budgeted for all of them (capped
    at :data:`_PIECES_SMEM`: the side-by-side q/k/v weights of a decode layer, three pieces, keep
    their 16 KB tiles) and the prefill tiles are not taken (three B pieces of 128 x 256 x 64 over
    3 stages asked ptxas for 448 KB).
    """
    decode = m <= DECODE_MAX_M
    big = (prefill_tiles(m, n, batch=batch, itemsize=max(a_itemsize, b_itemsize), sms=sms)
           if block_m is None and block_n is None and block_k is None and num_warps is None
           and b_parts == 1 and pieces == (1, 1) else None)
    if big is not None:
        block_m, block_n, block_k, num_warps = big
    block_m = _SMALL_TILES[0] if block_m is None else block_m
    block_n = _SMALL_TILES[1] if block_n is None else block_n
    num_warps = _SMALL_TILES[2] if num_warps is None else num_warps
    bm, bn, _ = choose_blocks(m, n, k, block_m=block_m, block_n=block_n, block_k=256)
    auto_k = block_k is None
    if auto_k:
        block_k = 32
        if decode:
            per = _DECODE_B_TILE // (bn * b_itemsize * b_parts)   # (a power of two: three parts give 42)
            block_k = min(256, max(32, 1 << max(0, per.bit_length() - 1)))
    check_pow2("block_k", block_k)
    bk = min(block_k, max(MIN_DOT_BLOCK, next_pow2(k)))
    if num_stages is None:
        num_stages = _DECODE_STAGES if decode else 3
    # A wide K tile is for a narrow N: with M up to 64 rows and f32 the staged A tiles dominate;
    # halve the automatic bk until the pipeline fits the budget (EfficientViT's f32 attention
    # matmuls asked for 288 KB at bk 256).
    cap = _DECODE_SMEM if pieces == (1, 1) else _PIECES_SMEM
    while auto_k and bk > 32 and max(1, num_stages - 1) * bk * (
            bm * a_itemsize * pieces[0] + bn * b_itemsize * b_parts * pieces[1]) > cap:
        bk //= 2
    k_tiles = cdiv(k, bk)
    base = batch * cdiv(m, bm) * cdiv(n, bn) * b_parts   # (a program streaming two parts counts twice)
    if split_k is None:
        split_k = 1
        # only unbatched (weight-streaming) projections split: a batched product (per-head
        # attention matmuls) is not a weight stream, and a split costs a second launch (the
        # reduce) that the cost model does not price for it
        if decode and batch == 1:
            while base * split_k < _DECODE_WAVES * sms and k_tiles // (2 * split_k) >= num_stages:
                split_k *= 2
    split_k = normalize_split(k_tiles, split_k)
    return GemmConfig(batch, m, n, k, bm, bn, bk, split_k, num_warps, num_stages, a_itemsize,
                      b_itemsize, sms, b_parts)


def normalize_split(k_tiles: int, split_k: int) -> int:
    """The split actually launched: no empty splits (``cdiv(k_tiles, cdiv(k_tiles, split_k))``)."""
    if split_k < 1:
        raise ValueError(f"split_k={split_k} must be >= 1")
    return cdiv(k_tiles, cdiv(k_tiles, min(split_k, k_tiles)))


# --------------------------------------------------------------------------------------------
# 16-bit math
# --------------------------------------------------------------------------------------------

# Primitives computed in f32 (inputs upcast, result rounded back) when they see 16-bit floats:
# the primitive table's ``f32_math`` rows.
F32_MATH_PRIMITIVES = frozenset(n for n, r in TABLE.items() if r.f32_math)
_LOW = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


# erfc by the Chebyshev fit of Numerical Recipes (Press et al., 2nd ed., §6.2, ``erfcc``):
# t = 1 / (1 + |x|/2), erfc(|x|) = t·exp(-x² + P(t)) with |relative error| < 1.2e-7 for every x.
_ERFC_T = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
           1.48851587, -0.82215223, 0.17087277)
_TWO_OVER_SQRT_PI = 1.1283791670955126


def erfc_f32(x: Any) -> Any:
    """erfc in f32 from exp and arithmetic (:data:`_ERFC_T`), for kernels: Pallas' Triton lowering
    has no erf / erfc, and exact GELU (``jax.nn.gelu(approximate=False)``, PyTorch's default) is
    ``x/2 · erfc(-x/√2)``."""
    x = jnp.asarray(x, jnp.float32)
    z = jnp.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = jnp.float32(_ERFC_T[-1])
    for c in reversed(_ERFC_T[:-1]):
        poly = poly * t + c
    r = t * jnp.exp(-z * z + poly)
    return jnp.where(x >= 0, r, 2.0 - r)


def erf_f32(x: Any) -> Any:
    """erf in f32: its Taylor series to x¹³ where |x| < 1/2 (relative error < 1e-7 there, where
    ``1 - erfc`` would cancel), ``±(1 - erfc(|x|))`` beyond."""
    x = jnp.asarray(x, jnp.float32)
    x2 = x * x
    series = jnp.float32(0.0)
    for n in range(6, -1, -1):   # Σ (-1)^n x^(2n+1) / (n! (2n+1))
        series = series * x2 + (-1.0) ** n / (math.factorial(n) * (2 * n + 1))
    small = _TWO_OVER_SQRT_PI * x * series
    big = jnp.sign(x) * (1.0 - erfc_f32(jnp.abs(x)))
    return jnp.where(jnp.abs(x) < 0.5, small, big)


def round_f32(x: Any, rounding_method: Any = lax.RoundingMethod.AWAY_FROM_ZERO) -> Any:
    """``lax.round`` in f32 from floor and compares (Pallas' Triton lowering has no ``round``;
    ``jnp.round`` is to nearest even, int8 quantisation's): the fraction ``|x| - floor(|x|)`` is
    exact, so the ties are decided exactly — ``floor(|x| + 0.5)`` would round 0.49999997 up —,
    ``|x| >= 2^23`` (every such f32 an integer), inf and NaN are their own rounding, and the sign
    is kept (``round(-0.3) = -0.0``)."""
    x = jnp.asarray(x, jnp.float32)
    a = jnp.abs(x)
    r = jnp.floor(a)
    d = a - r
    if int(rounding_method) == int(lax.RoundingMethod.TO_NEAREST_EVEN):
        half = r * 0.5
        up = (d > 0.5) | ((d == 0.5) & (half != jnp.floor(half)))
    else:
        up = d >= 0.5
    res = jnp.copysign(r + jnp.where(up, 1.0, 0.0), x)
    return jnp.where(a < 2.0 ** 23, res, x)


# primitives Pallas' Triton lowering lacks, computed in kernels from ones it has (f32; 16-bit
# operands upcast and rounded back): ``fn(x, params)``, the equation's params
IN_KERNEL_MATH: dict[str, Callable[[Any, Mapping[str, Any]], Any]] = {
    "erf": lambda x, p: erf_f32(x), "erfc": lambda x, p: erfc_f32(x),
    "round": lambda x, p: round_f32(x, p.get("rounding_method", lax.RoundingMethod.AWAY_FROM_ZERO))}


def f32_math(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` evaluated primitive by primitive, with :data:`F32_MATH_PRIMITIVES` on bf16/f16
    operands computed in f32 and rounded back, and :data:`IN_KERNEL_MATH` primitives computed
    from ones Triton lowers (call-like primitives — jit, custom_jvp/vjp — are inlined). Everything
    else is re-bound unchanged."""
    def wrapped(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _eval_f32_math(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)
    return wrapped


def _f32_rule(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """One equation of :func:`f32_math`: call bodies inlined, :data:`F32_MATH_PRIMITIVES` on
    16-bit operands computed in f32 and rounded back, anything else re-bound (None)."""
    inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                  if isinstance(eqn.params.get(k), jcore.ClosedJaxpr)), None)
    if inner is not None and eqn.primitive.name in CALL_LIKE:
        return _eval_f32_math(inner.jaxpr, inner.consts, invals)
    if eqn.primitive.name in IN_KERNEL_MATH:
        [v] = eqn.outvars
        return [IN_KERNEL_MATH[eqn.primitive.name](invals[0], eqn.params).astype(v.aval.dtype)]
    if eqn.primitive.name in F32_MATH_PRIMITIVES and any(
            np.dtype(v.aval.dtype) in _LOW for v in eqn.invars if hasattr(v.aval, "dtype")):
        up = [jnp.asarray(x).astype(jnp.float32) if np.dtype(v.aval.dtype) in _LOW else x
              for v, x in zip(eqn.invars, invals)]
        outs = eqn.primitive.bind(*up, **eqn.params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        return [o.astype(v.aval.dtype) if np.dtype(v.aval.dtype) in _LOW else o
                for o, v in zip(outs, eqn.outvars)]
    return None


def _eval_f32_math(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    return interpret(jaxpr, consts, args, _f32_rule)
