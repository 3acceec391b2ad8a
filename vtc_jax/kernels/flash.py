"""What the decode and prefill attention templates share: launch heuristics, the valid-key bound,
the flash step and the empty-row pass.

* :class:`AttentionConfig`: query block, key block, warps and pipeline stages of an attention
  kernel, with the two heuristics (:meth:`AttentionConfig.decode`, :meth:`AttentionConfig.prefill`)
  and the shared-memory fit of the key block, each with the measurement behind it.
* :class:`KeyEnd` / :func:`key_end`: where the valid keys end — a static int, or a runtime int32
  operand (one scalar, or one per sequence) plus a static offset — and :func:`read_end`, the
  kernel's read of that operand. Pallas' Triton backend has no scalar prefetch: a runtime scalar
  reaches the kernel as a small int32 array (``(1,)``, or ``(B,)`` per sequence) passed as an
  ordinary operand and read with one scalar load.
* :class:`Prologue`: an element-wise function of each block a kernel loads of q, K or V (a
  dequantised or upcast cache), with the operands it reads beside the block.
* :class:`Flash`: the static parameters of the online softmax (scale, soft-cap, dot precision,
  what a row with no valid key outputs) and its two loops: :meth:`Flash.loop`, the flash step over
  a run of K/V blocks, and :meth:`Flash.empty_pass`, the pass over every key at jax's masked value
  for rows with none valid. The kernels differ only in how a program finds its rows, its run of
  blocks and its K/V blocks (a ``load_kv(t0)`` closure over its vio refs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .tiling import MIN_DOT_BLOCK, dot_precision, next_pow2, pipeline_stages
from .vio import VRef

__all__ = ["AttentionConfig", "Flash", "KeyEnd", "Planned", "Prologue", "ProloguePlan", "logical_dtypes", "SMEM_BUDGET", "NEG", "key_end", "read_end", "keep_lanes",
           "score_lanes", "narrow_range", "softmax_block", "empty_rows_mode", "close_end", "masked_scores", "normalise", "int32_where",
           "with_sink", "Rows"]

SMEM_BUDGET = 128 * 1024  # bytes of staged K/V blocks; sm_90 allows 227 KiB, sm_80 163 KiB per block
NEG = -1e30               # initial running max: finite, so exp(m_prev - m_next) is never inf - inf

# key origin t0 -> (K block, V block), or (K block, V block, K's Rows, V's Rows) (either None)
LoadKV = Callable[[Any], tuple[Any, ...]]


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionConfig:
    """Tiles and Triton launch parameters of one attention kernel.

    ``block_q``: query rows per program (decode: the q tile's padded G rows); ``block_k``: keys per
    K/V block; ``num_warps``, ``num_stages``: Triton's launch configuration (``num_stages - 1`` K/V
    blocks are in flight while one is consumed). Readings are ptxas on sm_90 (the kernel tests'
    offline tests, ``benchmarks/kernels.md``).
    """
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int

    @classmethod
    def decode(cls, G: int, T: int, Dp: int, Dvp: int, compute: np.dtype, *, block_k: int = 64,
               num_warps: int | None = None, num_stages: int | None = None,
               precision: Any = None) -> "AttentionConfig":
        """The decode kernel's launch.

        * ``block_q = max(16, next_pow2(G))``: the G query heads of a KV head are the rows of one
          ``tt.dot`` tile (M >= 16).
        * 8 warps: compiles without spills for bf16 Llama-3 (G = 4, D = 128) and MHA (D = 128);
          4 warps spill there.
        * 3 stages on tensor cores, 1 for IEEE f32 (:func:`.tiling.pipeline_stages`): at 2 the PTX
          waits ``cp.async.wait_group 0`` in the loop (the next K/V block is only requested once
          the current one has landed), at 3 ``wait_group 2`` (one K/V block pair in flight while
          the current one is consumed), at 64 registers and 72 KB of shared memory for bf16 (B = 16
          and 1, G = 4, D = 128; 4 stages: 104 KB) and 80 registers for f32 at TF32. IEEE dots
          (``HIGHEST``) need the registers a second stage would take (255 registers and spills at
          2 and 3 stages, 94 and none at 1).
        * ``block_k`` 64, fitted by :meth:`fit_block_k`.
        """
        stages = pipeline_stages(precision, compute) if num_stages is None else num_stages
        return cls(block_q=max(MIN_DOT_BLOCK, next_pow2(G)),
                   block_k=cls.fit_block_k(block_k, T, Dp, Dvp, compute, stages),
                   num_warps=8 if num_warps is None else num_warps, num_stages=stages)

    @classmethod
    def prefill(cls, M: int, T: int, Dp: int, Dvp: int, compute: np.dtype, *, block_q: int = 64,
                block_k: int = 64, num_warps: int | None = None,
                num_stages: int | None = None, precision: Any = None) -> "AttentionConfig":
        """The prefill kernel's launch.

        * ``block_q`` 64 query rows (capped at the padded M), ``block_k`` 64 (:meth:`fit_block_k`).
        * 4 warps, 8 for head dims > 128: bf16, blocks 64x64: 234 registers and no spills at
          D = 128 with 4 warps; D = 256 spills with 4 warps, none with 8.
        * 3 stages on tensor cores, 1 for IEEE f32 (:func:`.tiling.pipeline_stages`): at 2 the loop
          waits ``cp.async.wait_group 0`` (the QKᵀ wgmma of one K block runs with no load in
          flight), at 3 ``wait_group 2``: the next K/V blocks load while this one's dots run. bf16
          D = 128: 201 registers, 112 KB of shared memory (198 and 80 KB at 2 stages); f32 at TF32
          D = 128: 244 registers, no spills (2 stages spilled 136 B). IEEE-f32 dots (``HIGHEST``)
          spill at D = 128 in every staged setting tried.
        """
        stages = pipeline_stages(precision, compute) if num_stages is None else num_stages
        warps = (8 if max(Dp, Dvp) > 128 else 4) if num_warps is None else num_warps
        return cls(block_q=min(block_q, max(MIN_DOT_BLOCK, next_pow2(M))),
                   block_k=cls.fit_block_k(block_k, T, Dp, Dvp, compute, stages),
                   num_warps=warps, num_stages=stages)

    @staticmethod
    def fit_block_k(block_k: int, T: int, Dp: int, Dvp: int, compute: np.dtype, num_stages: int) -> int:
        """``block_k`` capped at ``max(16, next_pow2(T))`` and halved while Triton's staged K and V
        blocks (``num_stages`` deep) exceed :data:`SMEM_BUDGET`, so the kernel also *loads* on the
        device (f32 with D = 256, say): shared memory is only checked at load time."""
        bk = min(block_k, max(MIN_DOT_BLOCK, next_pow2(T)))
        while bk > MIN_DOT_BLOCK and max(num_stages, 1) * bk * (Dp + Dvp) * compute.itemsize > SMEM_BUDGET:
            bk //= 2
        return bk


# --------------------------------------------------------------------------------------------
# The end of the valid keys: static, or a runtime operand
# --------------------------------------------------------------------------------------------

def _is_static_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class KeyEnd:
    """Where the valid keys end, *unclamped* (a sliding window starts ``window`` keys before it, as
    jax's ``t > pos - window`` does for ``pos >= T``): ``static``, or (``static`` None) the kernel's
    int32 end operand plus ``offset`` — ``pos + 1`` or ``kv_len + 0`` — one value for every
    sequence, or one per sequence (``per_row``: a ``(B,)`` operand, program ``b`` reads element b)."""
    static: int | None
    offset: int = 0
    per_row: bool = False
    inclusive: bool = False   # the operand (+ offset, + the row when causal) is the last valid key:
                              # one more, saturating at int32's max (:func:`close_end`)


def key_end(pos: Any, kv_len: Any, T: int, inclusive: bool = False) -> tuple[KeyEnd, jax.Array | None]:
    """The valid keys' end for a ``pos`` (keys ``t <= pos``) or a ``kv_len`` (keys ``t < kv_len``),
    each a static int or a runtime scalar / ``(B,)`` vector; neither: all T keys. Returns the
    :class:`KeyEnd` and, for a runtime one, the int32 operand ``(1,)`` or ``(B,)`` the kernel reads
    with :func:`read_end`. A runtime end is int32 arithmetic, wrapping as jax's does: ``pos + 1``
    (``t < pos + 1``), unless ``inclusive``: then the operand is the last valid key (``t <= pos``,
    ``t <= kv_len``) and the end one past it saturates — every key valid at ``pos = 2**31 - 1``,
    as jax's ``t <= pos`` is."""
    for x, offset in ((pos, 1), (kv_len, 0)):
        if x is None:
            continue
        if _is_static_int(x):
            return KeyEnd(int(x) + offset + (inclusive and offset == 0)), None
        per_row = jnp.ndim(x) == 1
        return (KeyEnd(None, 0 if inclusive else offset, per_row, inclusive),
                jnp.asarray(x, jnp.int32).reshape(-1))
    return KeyEnd(T), None


INT32_MAX = 2 ** 31 - 1


def close_end(end: KeyEnd, hi: Any) -> Any:
    """Inside a kernel, after :func:`read_end` (and the query row, when causal): the end of the
    valid keys — one past the last valid key, saturating at int32's max, for an inclusive end."""
    if not end.inclusive or end.static is not None:
        return hi
    return jnp.where(hi == INT32_MAX, hi, hi + 1)


def read_end(end: KeyEnd, operand: VRef | None, row: Any = 0) -> Any:
    """Inside a kernel: the unclamped end of the valid keys, a Python int or an int32 scalar —
    element ``row`` of the end operand (one scalar load of the physical int32 array, as JAX's Pallas
    GPU ops read their lengths) plus the static offset."""
    if end.static is not None:
        return end.static
    (ref,) = operand.refs
    return ref[row if end.per_row else 0] + end.offset


# --------------------------------------------------------------------------------------------
# The flash step and the empty-row pass
# --------------------------------------------------------------------------------------------

_COMPARE = {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
            "gt": jnp.greater, "ge": jnp.greater_equal}


def narrow_range(dtype: Any) -> np.dtype | None:
    """``dtype`` where a value of it overflows before an f32 does (f16: past 65504), else None
    (f32; bf16 has f32's exponent range). The attention kernels keep scores in f32 and round them
    to such a type where the program's are of it (:attr:`Flash.rounded`)."""
    if dtype is None:
        return None
    dt = np.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating) or float(jnp.finfo(dt).max) >= float(jnp.finfo(jnp.float32).max):
        return None
    return dt


def score_lanes(sc: jax.Array, keep: tuple[str, bool]) -> jax.Array:
    """The lanes a mask computed from the scores keeps: ``keep = (op, when)`` keeps key ``t``
    where ``(score op 0) == when`` (``jnp.where(s != 0, s, -inf)``: ``("ne", True)``). The
    program compares its scores at some stage; the kernel compares its own, the same scores up to
    positive scalings applied after the comparison (the matcher refuses anything else), which
    keep the sign, so against 0 the lanes are the program's. ``when=False`` negates (``~(s < 0)``
    keeps a NaN score, as the program's ``not`` does)."""
    op, when = keep
    hit = _COMPARE[op](sc, 0.0)
    return hit if when else jnp.logical_not(hit)


def softmax_block(qt: jax.Array, kb: jax.Array, vb: jax.Array, valid: jax.Array, carry: tuple, *,
                  scale: float, soft_cap: float | None, compute: Any, precision: Any,
                  transform: Any = None, slope: Any = None, keys: Any = None, bias: Any = None,
                  score_keep: tuple[str, bool] | None = None, rounded: Any = None,
                  rows_k: "Rows | None" = None, rows_v: "Rows | None" = None) -> tuple:
    """Stage 2 of both attention kernels: fold one K/V block into the running (max, sum, acc)
    of the online softmax, in f32; lanes not ``valid`` score ``-inf``; ``transform`` (the
    empty-row pass, :func:`masked_scores`) rewrites the scores of the valid lanes first.
    ``slope`` (rows,) with ``keys`` (1, block) int32: an ALiBi bias ``slope · key position``
    added to the scaled scores (f32, as jax adds ``slopes[:, None] * arange(T)``); ``bias``
    (rows, block): any other additive bias's block, added the same way. ``score_keep``: a mask
    computed from the scaled, capped scores themselves (:func:`score_lanes`). ``rounded``: the
    program's scores are of this narrower-ranged type (f16): the dot and the scaling are rounded to
    it, so a score past its range is ``inf`` as in the program (:attr:`Flash.rounded`).
    ``rows_k`` / ``rows_v``: new rows that replace some keys of ``kb`` / values of ``vb`` (a
    cache update the kernel performs, :class:`Rows`; ``vb``'s stale lanes loaded as 0): the
    lanes they land on score the rows, and P·V adds the rows' share."""
    m_prev, l_prev, acc_prev = carry
    sc = jnp.dot(qt, kb.T, preferred_element_type=jnp.float32, precision=precision)
    if rows_k is not None:
        sc = rows_k.when(lambda s: jnp.where(rows_k.hits >= 0, jnp.dot(
            qt, rows_k.at_lanes().T, preferred_element_type=jnp.float32, precision=precision), s), sc)
    if rounded is not None:
        sc = sc.astype(rounded).astype(jnp.float32)
    sc = sc * scale
    if rounded is not None and scale != 1.0:
        sc = sc.astype(rounded).astype(jnp.float32)
    if soft_cap is not None:
        sc = soft_cap * jnp.tanh(sc / soft_cap)
    if score_keep is not None:
        valid = valid & score_lanes(sc, score_keep)
    if slope is not None:
        sc = sc + slope[:, None] * keys.astype(jnp.float32)
    if bias is not None:
        sc = sc + bias.astype(jnp.float32)
    if transform is not None:
        sc = transform(sc)
    sc = jnp.where(valid, sc, -jnp.inf)
    m_next = jnp.maximum(m_prev, sc.max(axis=1))
    corr = jnp.exp(m_prev - m_next)
    p = jnp.exp(sc - m_next[:, None])
    l_next = l_prev * corr + p.sum(axis=1)
    pc = p.astype(compute)
    pv = jnp.dot(pc, vb, preferred_element_type=jnp.float32, precision=precision)
    if rows_v is not None:
        pv = rows_v.when(lambda a: a + jnp.dot(pc, rows_v.at_lanes(), preferred_element_type=jnp.float32,
                                               precision=precision), pv)
    return m_next, l_next, acc_prev * corr[:, None] + pv


@dataclass(frozen=True, eq=False)
class Rows:
    """New rows that replace some lanes of a K or V block (a cache update the kernel performs,
    :class:`.vio.Overlay`): ``hits`` ``(1, block)`` int32, the row landing on each key lane or -1;
    ``at_lanes()`` a block of the rows' elements at the lanes they land on (0 elsewhere), in the
    kernel's compute dtype, read only in a block some row lands in.

    Why this shape (deviceless sm_90 PTX of the paged decode's split kernel): a K/V load that
    flows straight into its dot is an asynchronous copy Triton's pipeliner keeps in flight; a
    block rewritten in registers, or a loop nested in the main loop, left one tile in flight (no
    ``cp.async``). So the blocks stay as loaded (V's stale lanes left out of its load: 0, whatever
    the old row held), the lanes rows land on take the rows' scores (one more dot of q, in that
    block only), and P·V adds the rows' share (one more dot), both exact as the block's own (an inf
    in a row reaches its lane alone). The split kernel holds 154 registers where it held 80 (no
    spills; one CTA of 8 warps per SM where three fitted: its 256 programs then run in two rounds,
    each streaming half the keys, with the three cp.async stages in flight — not yet timed on a
    GPU); moving per-row values to lanes by one-hot dots or selects held 201 to 255."""
    hits: jax.Array
    at_lanes: Callable[[], jax.Array]

    def when(self, f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        """``f(x)`` in a block some row lands in, else ``x``."""
        return lax.cond(jnp.max(self.hits) >= 0, f, lambda y: y, x)


def empty_rows_mode(empty_rows: Any) -> tuple[bool, tuple | None]:
    """``(empty_nan, empty_fill)`` for the kernels' ``empty_rows`` argument: what a query row with
    no valid key outputs (a position < 0, say), to equal what jax computes for the program's mask:

    * ``"zero"``: 0 (only for programs where no such row can happen);
    * ``"nan"``: NaN — the softmax of a row of ``-inf`` (every mask fills ``-inf``);
    * ``("fill", v)``: the masked lanes hold ``v`` (``jnp.where(m, s, finfo.min)``): the softmax of
      equal values, the mean of V over all T keys;
    * ``("bias", b, f)``: the masked lanes hold ``(s / f + b) * f`` (an additive bias ``b`` applied
      before a scaling by ``f``: ``(s + where(m, 0, -1e9)) / sqrt(d)``), computed as jax does.
    """
    if empty_rows in ("zero", "nan"):
        return empty_rows == "nan", None
    if isinstance(empty_rows, tuple) and ((len(empty_rows) == 2 and empty_rows[0] == "fill") or
                                          (len(empty_rows) == 3 and empty_rows[0] == "bias")):
        return False, (empty_rows[0], *map(float, empty_rows[1:]))
    raise ValueError(f"empty_rows must be 'zero', 'nan', ('fill', v) or ('bias', b, f); got {empty_rows!r}")


def masked_scores(fill: tuple) -> Any:
    """The score transform of a row with no valid key: every lane holds jax's masked value,
    shifted by a constant (the softmax is shift-invariant, and the kernels' running max starts at
    -1e30, above ``finfo.min``): equal values become 0; a bias lane ``fl(s / f + b) * f`` less
    ``b * f``, a subtraction Sterbenz's lemma makes exact, so the rounding of ``s + b`` that jax's
    row depends on is kept."""
    if fill[0] == "fill":
        return jnp.zeros_like
    _, b, f = fill
    # the shift is written as a function of ``sc`` (``sc * 0``, not folded for floats) so that no
    # simplifier rewrites ``(x + c) - c`` to ``x`` (XLA's does, in interpret mode)
    return lambda sc: (sc / f + b) * f - ((sc * 0.0) / f + b) * f


def normalise(acc: jax.Array, l: jax.Array, empty_nan: bool) -> jax.Array:
    """``acc / l`` per row; a row with no valid key (``l == 0``) is 0, or NaN where the program's
    mask is ``-inf`` (``jax.nn.softmax`` of an all ``-inf`` row is NaN)."""
    o = acc / jnp.where(l > 0, l, 1.0)[:, None]
    return jnp.where((l > 0)[:, None], o, jnp.nan) if empty_nan else o


def with_sink(carry: tuple, sink: jax.Array) -> tuple:
    """The running (max, sum, acc) of some rows with one more logit per row, ``sink`` ((rows,)
    f32), whose value row is 0: gpt-oss's attention sink (a learned logit per head concatenated to
    the scores, its probability dropped before ``p·v``), folded in once after the keys. A sink of
    ``-inf`` changes nothing (a row with no valid key then outputs what ``empty_rows`` says, as
    jax's softmax of that row does); a finite one makes such a row 0, as in jax; NaN gives NaN."""
    m, l, acc = carry
    m_next = jnp.maximum(m, sink)
    corr = jnp.exp(m - m_next)
    return m_next, l * corr + jnp.exp(sink - m_next), acc * corr[:, None]


def keep_lanes(block: jax.Array, when: str) -> jax.Array:
    """The lanes of a runtime mask's block that keep their key: where it is nonzero (a boolean
    pred, ``when="nonzero"``), zero (``"false"``: the pred of ``where(~m, neg, s)``; ``"zero"``:
    an additive mask of 0 and large negatives). Booleans are compared as int32 (Triton's i1
    compares are not what every lowering accepts)."""
    x = block.astype(jnp.int32) if block.dtype == jnp.bool_ else block
    if when == "zero":
        return x == 0
    return (x != 0) if when == "nonzero" else (x == 0)


def int32_where(cond: Any, a: Any, b: Any) -> jax.Array:
    """``where(cond, a, b)`` with both branches int32 arrays: a weak-typed Python int branch lowers
    to an ``arith.select`` with an i1 operand that MLIR's verifier (and XLA's Triton) rejects."""
    return jnp.where(cond, jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


@dataclass(frozen=True)
class Flash:
    """Static parameters of the online softmax shared by the attention kernels: ``T`` keys in
    blocks of ``block_k``; scores ``cap * tanh(q·kᵀ·scale / cap)`` with both dots at ``precision``
    over ``compute`` operands (:func:`tiling.dot_precision` of the replaced dots' precision: f32 at
    jax's default on TF32 tensor cores, at ``HIGHEST`` IEEE f32; 16-bit inputs keep scores and
    accumulators in f32 and round the probabilities to V's dtype for the P·V dot); a row
    with no valid key outputs 0, NaN (``empty_nan``) or jax's softmax of its masked scores
    (``empty_fill``, :func:`empty_rows_mode`); ``score_keep``: a mask computed from the scores
    (:func:`score_lanes`), applied in the main loop (the empty-row pass reads every key)."""
    T: int
    block_k: int
    scale: float
    soft_cap: float | None
    compute: np.dtype
    precision: Any
    empty_nan: bool = False
    empty_fill: tuple | None = None
    score_keep: tuple[str, bool] | None = None
    # the program's scores are f16 (a dot of f16 operands without an f32 result type): the kernel
    # rounds its f32 scores to f16 after the dot and the scaling, so one past f16's range (65504)
    # is inf, and its row NaN, as jax.jit computes it; None for f32 and bf16 scores (f32's range)
    rounded: np.dtype | None = None

    @classmethod
    def of(cls, T: int, block_k: int, D: int, compute: np.dtype, *, sm_scale: float | None,
           soft_cap: float | None, empty_rows: Any, precision: Any = None,
           score_keep: Any = None, score_dtype: Any = None) -> "Flash":
        """``sm_scale`` defaults to ``1/sqrt(D)``; ``empty_rows`` as :func:`empty_rows_mode`;
        ``precision``: the replaced dots' (lax's meaning, resolved by :func:`tiling.dot_precision`);
        ``score_keep``: ``(op, when)`` as :func:`score_lanes`, or None; ``score_dtype``: the
        program's score type (None: f32), rounded to where its range is narrower than f32's."""
        empty_nan, empty_fill = empty_rows_mode(empty_rows)
        if score_keep is not None:
            op, when = score_keep
            if op not in _COMPARE or not isinstance(when, (bool, np.bool_)):
                raise ValueError(f"score_keep must be (op, bool) with op one of {sorted(_COMPARE)}, "
                                 f"got {score_keep!r}")
            score_keep = (str(op), bool(when))
        return cls(T=T, block_k=block_k, scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
                   soft_cap=None if soft_cap is None else float(soft_cap), compute=compute,
                   precision=dot_precision(precision, compute)[0], empty_nan=empty_nan, empty_fill=empty_fill,
                   score_keep=score_keep, rounded=narrow_range(score_dtype))

    def init(self, rows: int, dvp: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The running (max, sum, acc) of ``rows`` query rows before any key."""
        return (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, dvp), jnp.float32))

    def loop(self, qt: jax.Array, load_kv: LoadKV, j0: Any, j1: Any, carry: tuple, *, hi: Any,
             lo: Any = None, slope: Any = None, load_bias: Any = None, load_keep: Any = None) -> tuple:
        """The flash step over K/V blocks ``[j0, j1)``: keys ``lo <= t < hi`` valid (``hi``/``lo``
        scalars or per-row ``(rows, 1)`` columns; ``lo`` None: no lower bound); ``slope``: the
        rows' ALiBi slopes (:func:`softmax_block`), or None; ``load_bias``: key origin ->
        the rows' bias block, or None; ``load_keep``: key origin -> the rows' ``(rows, block)``
        boolean block of keys a runtime mask keeps (a padding mask), or None. ``load_kv`` may also
        return the :class:`Rows` replacing keys and values of its blocks."""
        def valid(t: jax.Array) -> jax.Array:
            v = t < hi
            return v if lo is None else v & (t >= lo)
        return lax.fori_loop(j0, j1, self._step(qt, load_kv, valid, None, slope, load_bias, load_keep), carry)

    def empty_pass(self, qt: jax.Array, load_kv: LoadKV, u0: Any, u1: Any, carry: tuple) -> tuple:
        """Blocks ``[u0, u1)`` of every key ``t < T`` at jax's masked value (:func:`masked_scores`):
        the softmax of a row with no valid key under a finite mask. The caller makes the loop
        empty unless its block has such a row (no ``reduce_or`` in Triton: a select on the bound)."""
        return lax.fori_loop(u0, u1, self._step(qt, load_kv, lambda t: t < self.T,
                                                masked_scores(self.empty_fill)), carry)

    def _step(self, qt: jax.Array, load_kv: LoadKV, valid: Callable[[jax.Array], jax.Array],
              transform: Any, slope: Any = None, load_bias: Any = None,
              load_keep: Any = None) -> Callable[[Any, tuple], tuple]:
        lanes = lax.broadcasted_iota(jnp.int32, (1, self.block_k), 1)

        def step(j: Any, carry: tuple) -> tuple:
            t0 = j * self.block_k
            kb, vb, *rows = load_kv(t0)   # stage 1: one K and one V block (and the bias/keep blocks)
            ok = valid(lanes + t0)
            if load_keep is not None:
                ok = ok & load_keep(t0)
            rk, rv = rows or (None, None)
            return softmax_block(qt, kb, vb, ok, carry, scale=self.scale,
                                 soft_cap=self.soft_cap, compute=self.compute,
                                 precision=self.precision, transform=transform, slope=slope,
                                 keys=lanes + t0, bias=None if load_bias is None else load_bias(t0),
                                 score_keep=self.score_keep if transform is None else None,
                                 rounded=self.rounded, rows_k=rk, rows_v=rv)
        return step

    def normalise(self, acc: jax.Array, l: jax.Array) -> jax.Array:
        return normalise(acc, l, self.empty_nan)

    @property
    def empty_shift(self) -> float:
        """What :meth:`empty_pass` subtracts from every lane's masked value (:func:`masked_scores`:
        the fill, or ``fl(b · f)``): a sink logit folded into that pass's result is shifted alike."""
        if self.empty_fill is None:
            return 0.0
        if self.empty_fill[0] == "fill":
            return float(self.empty_fill[1])
        _, b, f = self.empty_fill
        return float(np.float32(b) * np.float32(f))


@dataclass(frozen=True)
class Prologue:
    """An element-wise function a kernel applies to every block it loads of q, K or V: ``fn(block,
    *operand_blocks)``, each of ``operands`` (VTensors or arrays of the operand's logical shape) read
    at the same origin through its own layout — a per-key-row scale is a broadcast layout, one
    value per row loaded.

    Why: serving code keeps its caches narrow and widens them for attention (``cache.astype(jnp.
    float32)``, an int8 cache ``cache.astype(jnp.bfloat16) * scale``, fp8); applied as the blocks
    are loaded, the kernel reads the narrow cache and its scales, where a program that widens first
    writes the wide cache out and reads it back. ``fn`` must map zeros to zero: lanes past the
    operand's edges (padded keys, head dims, query rows) load 0, and the dots read them."""
    fn: Callable[..., Any]
    operands: tuple[Any, ...] = ()

    def dtype(self, x: Any) -> np.dtype:
        """The dtype ``fn`` returns for blocks of ``x`` (and of the operands)."""
        args = [jax.ShapeDtypeStruct((1,) * len(x.shape), x.dtype)] + [
            jax.ShapeDtypeStruct((1,) * len(x.shape), o.dtype) for o in self.operands]
        return np.dtype(jax.eval_shape(self.fn, *args).dtype)


@dataclass(frozen=True)
class ProloguePlan:
    """A kernel plan's static view of the :class:`Prologue` of q, K and V: each one's function
    (None: none) and operand count. The operands are the kernel's last inputs, q's first."""
    fns: tuple[Callable[..., Any] | None, ...] = (None, None, None)
    counts: tuple[int, ...] = (0, 0, 0)

    @staticmethod
    def of(*prologues: "Prologue | None") -> "ProloguePlan":
        return ProloguePlan(tuple(None if p is None else p.fn for p in prologues),
                            tuple(0 if p is None else len(p.operands) for p in prologues))

    @staticmethod
    def operands(*prologues: "Prologue | None") -> list[Any]:
        return [o for p in prologues if p is not None for o in p.operands]

    def loaders(self, qkv: Sequence[Any], extra: Sequence[Any]) -> tuple[Callable[..., jax.Array], ...]:
        """``load(origin, block)`` for q, K and V: their refs ``qkv`` read and passed through their
        functions with the operands' refs ``extra`` (q's first, as :meth:`operands` orders them)."""
        out, extra = [], list(extra)
        for ref, fn, n in zip(qkv, self.fns, self.counts):
            out.append(_loader(ref, fn, extra[:n]))
            extra = extra[n:]
        return tuple(out)


def logical_dtypes(xs: tuple[Any, ...], pro: tuple[Prologue | None, ...]) -> tuple[np.dtype, ...]:
    """q's, K's and V's dtypes as the kernel computes with them: what their prologues return (each
    operand of a prologue checked to have the shape of what it reads beside)."""
    for name, x, p in zip("qkv", xs, pro):
        for o in () if p is None else p.operands:
            if tuple(o.shape) != tuple(x.shape):
                raise ValueError(f"{name}_prologue operands must have {name}'s shape {x.shape}, got {o.shape}")
    return tuple(x.dtype if p is None else p.dtype(x) for x, p in zip(xs, pro))


def _loader(ref: Any, fn: Callable[..., Any] | None, ops: Sequence[Any]) -> Callable[..., jax.Array]:
    def load(origin: Sequence[Any], block: Sequence[int], lanes: Any = None) -> jax.Array:
        x = ref.load(origin, block) if lanes is None else ref.load(origin, block, lanes=lanes)
        return x if fn is None else fn(x, *(o.load(origin, block) for o in ops))
    return load


class Planned:
    """What a kernel's plan (``_Cfg``) reads off its launch and flash step: the key length and the
    K/V block. A mixin for the decode and the prefill plans, which hold ``launch`` and ``flash``."""
    launch: AttentionConfig
    flash: Flash

    @property
    def T(self) -> int:
        return self.flash.T

    @property
    def bk(self) -> int:
        return self.launch.block_k
