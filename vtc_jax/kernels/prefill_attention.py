"""Prefill attention template: flash attention (online softmax) over virtual q/k/v/out.

Many query rows per (batch·head) attend to a key/value sequence. Like the decode template
(:mod:`.attention`) the kernel is written against *logical* tensors and reads/writes them through
:mod:`vio`, so the head transposes of the prefill (``(B, S, H, D) -> (B, H, S, D)`` and back) and
a K/V cache the keys are read from stay layouts, never copies.

* ``q``: logical ``(Z, M, D)``: ``Z`` = batch·KV-heads, ``M`` query rows per ``Z``. Rows are
  ``(groups..., S)`` flattened: a GQA group's query heads share one K/V block (row ``r`` is query
  position ``r % S``), so the repeated K/V of a ``jnp.repeat`` never exists.
* ``k``, ``v``: logical ``(Z, T, D)`` / ``(Z, T, Dv)``.
* ``out``: logical ``(Z, M, Dv)``, a :class:`vio.VTensor` (default a fresh physical array).

Kernel (one program per (Z, q-block), the paper's three stages)::

    grid (Z, cdiv(M, bq)):
        q = Q.load((z, i*bq, 0), (1, bq, Dp))                 # once
        rows' valid keys [lo(r), hi(r)):   e = hi_base + (r % S if causal else 0), hi = min(T, e)
                                           lo = max(0, e - window) with a sliding window
        for j in [min lo // bk, cdiv(max hi, bk)):            # blocks past the diagonal skipped
            kb = K.load((z, j*bk, 0)); vb = V.load(...)
            s = q·kbᵀ·scale [cap·tanh(s/cap)], masked to lo <= t < hi      # (bq, bk) f32
            online softmax: running max m, sum l, acc (bq, Dv) in f32
        OUT.store((z, i*bq, 0), acc / l)

Masking: causal with a query offset (``q_offset``: query ``i`` sits at position ``q_offset + i``,
keys ``t <= q_offset + i`` are valid; ``q_offset`` static or a runtime int32 scalar, e.g. the
cache position of a chunked prefill), or a key-length bound ``kv_len`` (non-causal, static or
runtime), optionally a sliding ``window`` (keys ``t > hi - 1 - window``). A row with no valid key
outputs what ``empty_rows`` says (:func:`.attention.empty_rows_mode`: 0, NaN, or jax's softmax of
the masked scores by a second pass over all keys, run only by a block that has such a row).

Power-of-two tiles: ``bq``, ``bk`` >= 16 (``tt.dot``), ``Dp = max(16, next_pow2(D))``; vio masks
the ragged edges (rows ``>= M`` read 0 and are not stored, keys ``>= T`` are masked by ``hi``).
Both dots compute at ``precision``, the replaced program's (:func:`.tiling.dot_precision`, as XLA
on the GPU: f32 at jax's default on TF32 tensor cores, at ``HIGHEST`` IEEE f32; interpret mode
computes exact f32 either way); 16-bit inputs keep scores/accumulators in f32 and round the
probabilities to V's dtype for the P·V dot.

Layers, as :mod:`.attention` and JAX's Pallas GPU ops: :func:`prefill_attention` (checks the
arguments, plans the :class:`_Cfg`) -> :func:`_launch` (grid, ``Plan.build(...).call``) ->
:func:`_body`. Launch heuristics (:meth:`.flash.AttentionConfig.prefill`), the flash step and the
empty-row pass are :mod:`.flash`'s, shared with the decode kernel. A runtime ``q_offset`` /
``kv_len`` is the kernel's last input, a ``(1,)`` int32 array read with one scalar load
(:func:`.flash.read_end`).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .flash import (AttentionConfig, Flash, KeyEnd, Planned, Prologue, ProloguePlan, close_end, int32_where,
                    keep_lanes, key_end, logical_dtypes, read_end, with_sink)
from .tiling import MIN_DOT_BLOCK, cdiv, check_pow2, next_pow2, program_id
from .vio import Plan, VTensor, output, pack_results

__all__ = ["prefill_attention"]


@dataclass(frozen=True)
class _Cfg(Planned):
    """The prefill kernel's static configuration (see the module docstring)."""
    Z: int
    M: int
    S: int                     # query sequence length: row r is query position r % S
    D: int
    Dv: int
    Dp: int
    Dvp: int
    causal: bool
    window: int | None
    end: KeyEnd                # the end of query row 0's valid keys (row r adds r % S when causal)
    launch: AttentionConfig
    flash: Flash
    alibi: bool = False        # a (Z, M) slopes operand after q, k, v: ALiBi bias slope · t
    bias: bool = False         # a (Z, M, T) bias operand next: added to the scores
    bias_scale: float = 1.0    # times this (a bias added before a scaling of the scores)
    keep: str | None = None    # a (Z, M, T) runtime mask operand next: which values keep a key
    cap: KeyEnd | None = None  # causal rows' ends also capped at this (``kv_len`` with ``causal``)
    sink: bool = False         # a (Z, M) sink-logit operand after keep (:func:`.flash.with_sink`)
    pro: ProloguePlan = ProloguePlan()   # q's, K's, V's prologues: their operands are the last inputs

    @property
    def bq(self) -> int:
        return self.launch.block_q


def prefill_attention(q: Any, k: Any, v: Any, *, causal: bool = False, q_offset: Any = 0,
                      kv_len: Any = None, window: int | None = None, seq_len: int | None = None,
                      sm_scale: float | None = None, soft_cap: float | None = None,
                      out: VTensor | None = None, block_q: int = 64, block_k: int = 64,
                      num_warps: int | None = None, num_stages: int | None = None,
                      backend: str = "interpret", empty_rows: Any = "zero",
                      precision: Any = None, slopes: Any = None, bias: Any = None,
                      bias_scale: float = 1.0, keep: Any = None, keep_when: str = "nonzero",
                      score_keep: Any = None, inclusive: bool = False, sink: Any = None,
                      score_dtype: Any = None, q_prologue: Prologue | None = None,
                      k_prologue: Prologue | None = None, v_prologue: Prologue | None = None) -> Any:
    """Flash attention ``softmax(mask(cap(q·kᵀ·scale) + slope·t))·v`` for many query rows.

    q: logical (Z, M, D); k: (Z, T, D); v: (Z, T, Dv) — VTensors or arrays.
    seq_len: the query sequence length S; row r is query position ``r % S`` (default M: rows are
        the sequence; M = G·S folds G grouped query heads into the rows).
    causal: keys ``t <= q_offset + (r % S)`` are valid. ``q_offset``: static int or runtime scalar,
        or a runtime ``(B,)`` vector, one offset per sequence (chunked prefill of a batch at its
        own positions): the Z programs' rows are B sequences of ``Z // B`` heads each, program
        ``z`` reads element ``z // (Z // B)``.
    kv_len: keys ``t < kv_len`` valid (static int, runtime scalar, or a ``(B,)`` vector of
        per-sequence lengths: right-padded prompts; default T); with ``causal`` a cap on each
        row's causal end (``jax.nn.dot_product_attention(is_causal=True,
        key_value_seq_lengths=...)``). A runtime ``q_offset``/``kv_len`` is an int32 operand of
        the kernel (:func:`.flash.key_end`). ``inclusive``: a runtime ``q_offset`` (``t <= q_offset +
        i``) or ``kv_len`` (then ``t <= kv_len``) is the last valid key, the end saturating at
        int32's max as jax's comparison does; else ``+ 1`` wraps as jax's int32 add does.
    window: sliding window: also keys ``t > q_offset + (r % S) - window`` only (causal), or
        ``t >= kv_len - window`` (before clamping the end to T).
    sm_scale: default 1/sqrt(D). soft_cap: ``cap*tanh(s/cap)`` after scaling, before masking.
    out: VTensor (Z, M, Dv) written in place when its buffers are arrays; default fresh, q's dtype.
    block_q, block_k: powers of two >= 16 (capped at the padded M / T).
    num_warps, num_stages: default :meth:`.flash.AttentionConfig.prefill` (4 warps, 8 for head
        dims > 128; 3 stages on tensor cores, 1 for IEEE f32).
    empty_rows: what a row with no valid key outputs (:func:`.flash.empty_rows_mode`).
    precision: of both dots, with ``lax.dot_general``'s meaning (None:
        ``jax_default_matmul_precision``, else ``DEFAULT``: TF32 for f32 on the GPU; ``HIGHEST``:
        IEEE f32), resolved by :func:`.tiling.dot_precision`.
    slopes: ALiBi: f32 (Z, M), one slope per query row; ``slope · t`` is added to the scaled
        (capped) scores of key ``t`` before the mask. None: no bias.
    bias: any additive bias, logical (Z, M, T) (a VTensor read through its layout), added to the
        scaled (capped) scores before the mask, blockwise, times ``bias_scale``. None: no bias.
    keep: a runtime mask (a padding mask), logical (Z, M, T), read blockwise through its layout:
        key ``t`` of row ``r`` is valid only where ``keep`` is nonzero (``keep_when="nonzero"``:
        a boolean pred), zero (``"zero"``: an additive mask of 0 and large negatives) or zero
        (``"false"``: the pred of ``where(~m, neg, s)``). A row it leaves with no valid key outputs
        what ``empty_rows`` says. None: no such mask.
    score_keep: a mask computed from the scores themselves, ``(op, when)``: key ``t`` is valid only
        where ``(score op 0) == when`` on the scaled, capped score (:func:`.flash.score_lanes`).
        Rows it empties as for ``keep``. None: no such mask.
    sink: an attention sink (gpt-oss): logical (Z, M), one logit per query row that joins the
        softmax's denominator and no value row (:func:`.flash.with_sink`), in the units of the
        masked, biased scores (with a finite mask, shifted as the empty-row pass shifts its
        scores for the rows that pass computes). None: no sink.
    score_dtype: the type of the program's scores, as :func:`.attention.decode_attention`'s.
    q_prologue, k_prologue, v_prologue: :class:`.flash.Prologue` of the blocks loaded of q, K, V,
        as :func:`.attention.decode_attention`'s.

    Returns the array for a fresh/one-buffer output, else the tuple of ``out``'s buffers.
    """
    q, k, v = VTensor.of(q), VTensor.of(k), VTensor.of(v)
    pro = (q_prologue, k_prologue, v_prologue)
    dtypes = logical_dtypes((q, k, v), pro)
    _check(q, k, v, block_q=block_q, block_k=block_k, seq_len=seq_len, causal=causal,
           q_offset=q_offset, kv_len=kv_len, window=window, dtypes=dtypes)
    Z, M, _ = q.shape
    if slopes is not None:
        slopes = VTensor.of(slopes)
        if tuple(slopes.shape) != (Z, M) or slopes.dtype != np.float32:
            raise ValueError(f"slopes must be f32 of shape {(Z, M)}, got {slopes.dtype} {slopes.shape}")
    out = output(out, (Z, M, v.shape[2]), dtypes[0])
    end, end_operand = key_end(q_offset if causal else None, None if causal else kv_len, k.shape[1], inclusive)
    cap, cap_operand = key_end(None, kv_len, k.shape[1]) if causal and kv_len is not None else (None, None)
    cfg = _config(q, k, v, end, dtypes=dtypes, causal=causal, window=window, seq_len=seq_len, sm_scale=sm_scale,
                  soft_cap=soft_cap, block_q=block_q, block_k=block_k, num_warps=num_warps,
                  num_stages=num_stages, empty_rows=empty_rows, precision=precision, score_keep=score_keep,
                  score_dtype=score_dtype)
    if bias is not None:
        bias = VTensor.of(bias)
        if tuple(bias.shape) != (Z, M, k.shape[1]):
            raise ValueError(f"bias must have shape {(Z, M, k.shape[1])}, got {bias.shape}")
    if keep is not None:
        keep = VTensor.of(keep)
        if tuple(keep.shape) != (Z, M, k.shape[1]):
            raise ValueError(f"keep must have shape {(Z, M, k.shape[1])}, got {keep.shape}")
        if keep_when not in ("nonzero", "zero", "false"):
            raise ValueError(f"keep_when must be 'nonzero', 'zero' or 'false', got {keep_when!r}")
    if sink is not None:
        sink = VTensor.of(sink)
        if tuple(sink.shape) != (Z, M) or not jnp.issubdtype(sink.dtype, jnp.floating):
            raise ValueError(f"sink must be floating of shape {(Z, M)}, got {sink.dtype} {sink.shape}")
    cfg = dataclasses.replace(cfg, alibi=slopes is not None, bias=bias is not None, bias_scale=float(bias_scale),
                              keep=None if keep is None else keep_when, cap=cap, sink=sink is not None,
                              pro=ProloguePlan.of(*pro))
    return _launch(cfg, q, k, v, out, end_operand, backend=backend, slopes=slopes, bias=bias, keep=keep,
                   cap=cap_operand, sink=sink, extra=[VTensor.of(o) for o in ProloguePlan.operands(*pro)])


def _check(q: VTensor, k: VTensor, v: VTensor, *, block_q: int, block_k: int,
           seq_len: int | None, causal: bool, q_offset: Any, kv_len: Any,
           window: int | None, dtypes: tuple[np.dtype, ...]) -> None:
    if len(q.shape) != 3 or len(k.shape) != 3 or len(v.shape) != 3:
        raise ValueError(f"expected q (Z, M, D), k (Z, T, D), v (Z, T, Dv); got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    Z, M, D = q.shape
    T = k.shape[1]
    if tuple(k.shape) != (Z, T, D) or tuple(v.shape[:2]) != (Z, T):
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    check_pow2("block_q", block_q, MIN_DOT_BLOCK)
    check_pow2("block_k", block_k, MIN_DOT_BLOCK)
    S = M if seq_len is None else int(seq_len)
    if S < 1 or M % S:
        raise ValueError(f"seq_len={S} must divide the {M} query rows")
    for name, end in (("q_offset", q_offset if causal else None), ("kv_len", kv_len)):
        if end is not None and not isinstance(end, (int, np.integer)) and (
                jnp.ndim(end) > 1 or jnp.ndim(end) == 1 and (jnp.shape(end)[0] < 1 or Z % jnp.shape(end)[0])):
            raise ValueError(f"{name} must be a scalar or a (B,) vector with B dividing the {Z} programs, "
                             f"got shape {jnp.shape(end)}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window={window} must be >= 1")
    for dt in dtypes:
        if not jnp.issubdtype(dt, jnp.floating):
            raise NotImplementedError(f"floating dtypes only, got {dt}")


def _config(q: VTensor, k: VTensor, v: VTensor, end: KeyEnd, *, dtypes: tuple[np.dtype, ...], causal: bool,
            window: int | None, seq_len: int | None, sm_scale: float | None,
            soft_cap: float | None, block_q: int, block_k: int, num_warps: int | None,
            num_stages: int | None, empty_rows: Any, precision: Any, score_keep: Any = None,
            score_dtype: Any = None) -> _Cfg:
    """Tiles and launch (:meth:`.flash.AttentionConfig.prefill`) and the flash parameters."""
    Z, M, D = q.shape
    T, Dv = k.shape[1], v.shape[2]
    compute = np.dtype(jnp.promote_types(jnp.promote_types(dtypes[0], dtypes[1]), dtypes[2]))
    Dp, Dvp = max(MIN_DOT_BLOCK, next_pow2(D)), max(MIN_DOT_BLOCK, next_pow2(Dv))
    launch = AttentionConfig.prefill(M, T, Dp, Dvp, compute, block_q=block_q, block_k=block_k,
                                     num_warps=num_warps, num_stages=num_stages, precision=precision)
    return _Cfg(Z=Z, M=M, S=M if seq_len is None else int(seq_len), D=D, Dv=Dv, Dp=Dp, Dvp=Dvp,
                causal=bool(causal), window=None if window is None else int(window), end=end,
                launch=launch, flash=Flash.of(T, launch.block_k, D, compute, sm_scale=sm_scale,
                                              soft_cap=soft_cap, empty_rows=empty_rows,
                                              precision=precision, score_keep=score_keep,
                                              score_dtype=score_dtype))


def _launch(c: _Cfg, q: VTensor, k: VTensor, v: VTensor, out: VTensor, end: Any, *,
            backend: str, slopes: Any = None, bias: Any = None, keep: Any = None, cap: Any = None,
            sink: Any = None, extra: list[VTensor] | None = None) -> Any:
    """Grid ``(Z, cdiv(M, bq))`` and launch. ``end``, ``cap``: the runtime end / cap operands, or None;
    ``extra``: the prologues' operands."""
    plan = Plan.build([q, k, v] + ([slopes] if c.alibi else []) + ([bias] if c.bias else [])
                      + ([keep] if c.keep else []) + ([sink] if c.sink else []) + ([end] if end is not None else [])
                      + ([cap] if cap is not None else []) + (extra or []), [out])
    bufs = plan.call(functools.partial(_body, c), grid=(c.Z, cdiv(c.M, c.bq)), backend=backend,
                     num_warps=c.launch.num_warps, num_stages=c.launch.num_stages,
                     name="vtc_prefill_attention")
    return pack_results(bufs)[0]


def _body(c: _Cfg, ins: list[Any], outs: list[Any]) -> None:
    (o_ref,) = outs
    z, i = program_id(0, c.Z), program_id(1, cdiv(c.M, c.bq))
    r0 = i * c.bq

    # The valid keys [lo, hi) of every row of this block, as (bq, 1) int32 columns.
    n_fixed = 3 + c.alibi + c.bias + bool(c.keep) + c.sink
    end_ref = ins[n_fixed] if c.end.static is None else None
    cap_ref = ins[n_fixed + (end_ref is not None)] if c.cap is not None and c.cap.static is None else None
    load_q, load_k, load_v = c.pro.loaders(ins[:3], ins[n_fixed + (end_ref is not None) + (cap_ref is not None):])

    def end_of(end: KeyEnd, ref: Any) -> Any:   # a (B,) operand: program z reads its sequence's entry
        return read_end(end, ref, z // (c.Z // ref.shape[0]) if end.per_row else 0)
    base = end_of(c.end, end_ref)
    rows = lax.broadcasted_iota(jnp.int32, (c.bq, 1), 0) + r0
    hi = jnp.zeros((c.bq, 1), jnp.int32) + base
    if c.causal:
        hi = hi + (rows % c.S if c.S != c.M else rows)
    hi = close_end(c.end, hi)
    lo = jnp.maximum(hi - c.window, 0) if c.window is not None else None   # from the unclamped end
    if c.cap is not None:   # a key length beside the causal bound: keys t < cap too
        hi = jnp.minimum(hi, end_of(c.cap, cap_ref))
    hi = jnp.minimum(hi, c.T)
    live = rows < c.M          # padded rows past M: do not let them widen the key range
    # Blocks meeting any row's range: [min lo // bk, cdiv(max hi, bk)).
    j1 = (jnp.max(jnp.where(live, hi, 0)) + c.bk - 1) // c.bk
    j0 = jnp.min(jnp.where(live, lo, c.T)) // c.bk if lo is not None else 0

    qt = load_q((z, r0, 0), (1, c.bq, c.Dp)).reshape(c.bq, c.Dp).astype(c.flash.compute)

    def load_kv(t0: Any) -> tuple[jax.Array, jax.Array]:
        kb = load_k((z, t0, 0), (1, c.bk, c.Dp)).reshape(c.bk, c.Dp).astype(c.flash.compute)
        vb = load_v((z, t0, 0), (1, c.bk, c.Dvp)).reshape(c.bk, c.Dvp).astype(c.flash.compute)
        return kb, vb

    slope = ins[3].load((z, r0), (1, c.bq)).reshape(c.bq) if c.alibi else None   # padded rows: 0
    bias_ref = ins[3 + c.alibi] if c.bias else None

    def load_bias(t0: Any) -> jax.Array:
        blk = bias_ref.load((z, r0, t0), (1, c.bq, c.bk)).reshape(c.bq, c.bk).astype(jnp.float32)
        return blk if c.bias_scale == 1.0 else blk * c.bias_scale

    keep_ref = ins[3 + c.alibi + c.bias] if c.keep else None

    def load_keep(t0: Any) -> jax.Array:
        return keep_lanes(keep_ref.load((z, r0, t0), (1, c.bq, c.bk)).reshape(c.bq, c.bk), c.keep)

    # the rows' sink logits (padded rows read 0), folded in once after the keys
    sk = ins[n_fixed - 1].load((z, r0), (1, c.bq)).reshape(c.bq).astype(jnp.float32) if c.sink else None
    init = c.flash.init(c.bq, c.Dvp)
    m, l, acc = c.flash.loop(qt, load_kv, j0, j1, init, hi=hi, lo=lo, slope=slope,
                             load_bias=load_bias if c.bias else None, load_keep=load_keep if c.keep else None)
    l_keys = l
    if sk is not None:
        _, l, acc = with_sink((m, l, acc), sk)
    if c.flash.empty_fill is not None:
        # rows with no valid key under a finite mask: jax's softmax of the masked scores over all
        # T keys (a second pass, only when this block has such a row); under a runtime mask, a
        # row none of whose keys it kept summed nothing (``l == 0``: a valid key adds exp(0) = 1)
        empty = (hi <= lo if lo is not None else hi <= 0)[:, 0] & live[:, 0]
        if c.keep or c.flash.score_keep is not None:
            empty = empty | ((l_keys == 0) & live[:, 0])
        n_e = int32_where(jnp.max(empty.astype(jnp.int32)) > 0, cdiv(c.T, c.bk), 0)
        m_e, l_e, acc_e = c.flash.empty_pass(qt, load_kv, jnp.int32(0), n_e, init)
        if sk is not None:   # the sink against the masked scores as the pass shifted them
            _, l_e, acc_e = with_sink((m_e, l_e, acc_e), sk - c.flash.empty_shift)
        l = jnp.where(empty, l_e, l)
        acc = jnp.where(empty[:, None], acc_e, acc)
    o = c.flash.normalise(acc, l).astype(o_ref.binding.dtype)
    o_ref.store((z, r0, 0), (1, c.bq, c.Dvp), o.reshape(1, c.bq, c.Dvp))
