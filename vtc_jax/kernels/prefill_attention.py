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
f32 inputs use ``precision=HIGHEST`` (IEEE f32 dots, what interpret mode computes); 16-bit inputs
keep scores/accumulators in f32 and round the probabilities to V's dtype for the P·V dot.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .attention import empty_rows_mode, masked_scores, normalise, softmax_block
from .vio import Plan, VTensor, next_pow2

__all__ = ["prefill_attention"]

MIN_DOT = 16
SMEM_BUDGET = 128 * 1024
_SYM = "__vtc_prefill_hi"    # runtime symbol: the end of the valid keys of query 0
_NEG = -1e30                 # initial running max (finite: exp(m_prev - m_next) is never nan)


def _is_static_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class _Cfg:
    Z: int
    M: int
    S: int
    T: int
    D: int
    Dv: int
    Dp: int
    Dvp: int
    bq: int
    bk: int
    causal: bool
    hi_static: int | None      # static hi_base (None: runtime symbol)
    window: int | None
    scale: float
    soft_cap: float | None
    compute: np.dtype
    precision: Any
    empty_nan: bool = False   # a row with no valid key is NaN (an all -inf softmax row), else 0
    empty_fill: tuple | None = None  # ... or jax's softmax of the masked scores (attention.masked_scores)


def prefill_attention(q: Any, k: Any, v: Any, *, causal: bool = False, q_offset: Any = 0,
                      kv_len: Any = None, window: int | None = None, seq_len: int | None = None,
                      sm_scale: float | None = None, soft_cap: float | None = None,
                      out: VTensor | None = None, block_q: int = 64, block_k: int = 64,
                      num_warps: int | None = None, num_stages: int | None = None,
                      backend: str = "interpret", empty_rows: str = "zero") -> Any:
    """Flash attention ``softmax(mask(cap(q·kᵀ·scale)))·v`` for many query rows.

    q: logical (Z, M, D); k: (Z, T, D); v: (Z, T, Dv) — VTensors or arrays.
    seq_len: the query sequence length S; row r is query position ``r % S`` (default M: rows are
        the sequence; M = G·S folds G grouped query heads into the rows).
    causal: keys ``t <= q_offset + (r % S)`` are valid. ``q_offset``: static int or runtime scalar.
    kv_len: non-causal only: keys ``t < kv_len`` valid (static int or runtime scalar; default T).
    window: sliding window: also keys ``t > q_offset + (r % S) - window`` only (causal), or
        ``t >= kv_len - window`` (before clamping the end to T).
    sm_scale: default 1/sqrt(D). soft_cap: ``cap*tanh(s/cap)`` after scaling, before masking.
    out: VTensor (Z, M, Dv) written in place when its buffers are arrays; default fresh, q's dtype.
    block_q, block_k: powers of two >= 16 (capped at the padded M / T).
    num_warps: default 4, 8 for head dims > 128 (sm_90, bf16, block 64x64: 234 registers and no
        spills at D = 128 with 4 warps; D = 256 spills with 4 warps, none with 8 —
        tests/test_kernel_prefill.py, offline test). num_stages: 2 for 16-bit inputs, 1 for f32.
        f32 is a correctness configuration (IEEE-f32 dots spill at D = 128 in every setting tried).

    Returns the array for a fresh/one-buffer output, else the tuple of ``out``'s buffers.
    """
    q, k, v = VTensor.of(q), VTensor.of(k), VTensor.of(v)
    if len(q.shape) != 3 or len(k.shape) != 3 or len(v.shape) != 3:
        raise ValueError(f"expected q (Z, M, D), k (Z, T, D), v (Z, T, Dv); got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    Z, M, D = q.shape
    T, Dv = k.shape[1], v.shape[2]
    if tuple(k.shape) != (Z, T, D) or tuple(v.shape[:2]) != (Z, T):
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    for b in (block_q, block_k):
        if b < MIN_DOT or b & (b - 1):
            raise ValueError(f"block sizes must be powers of two >= {MIN_DOT}, got {b}")
    S = M if seq_len is None else int(seq_len)
    if S < 1 or M % S:
        raise ValueError(f"seq_len={S} must divide the {M} query rows")
    if causal and kv_len is not None:
        raise ValueError("give causal (with q_offset) or kv_len, not both")
    if window is not None and int(window) < 1:
        raise ValueError(f"window={window} must be >= 1")
    for x in (q, k, v):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise NotImplementedError(f"floating dtypes only, got {x.dtype}")
    if out is None:
        out = VTensor.fresh((Z, M, Dv), q.dtype)
    elif tuple(out.shape) != (Z, M, Dv):
        raise ValueError(f"out has logical shape {out.shape}, expected {(Z, M, Dv)}")

    # hi_base: the end of query row 0's valid keys (row r adds r % S when causal).
    scalar: Any = None
    hi_static: int | None = T
    if causal:
        if _is_static_int(q_offset):
            hi_static = int(q_offset) + 1
        else:
            hi_static, scalar = None, jnp.asarray(q_offset, jnp.int32) + 1
    elif kv_len is not None:
        if _is_static_int(kv_len):
            hi_static = int(kv_len)          # clamped to T in the kernel, after the window
        else:
            hi_static, scalar = None, jnp.asarray(kv_len, jnp.int32)
    if scalar is not None:
        if _SYM in dict(q.symbols):
            raise ValueError(f"q already carries a runtime symbol named {_SYM!r}")
        q = dataclasses.replace(q, symbols=q.symbols + ((_SYM, scalar),))

    compute = np.dtype(jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), v.dtype))
    if num_stages is None:
        num_stages = 1 if compute.itemsize >= 4 else 2
    Dp, Dvp = max(MIN_DOT, next_pow2(D)), max(MIN_DOT, next_pow2(Dv))
    if num_warps is None:
        num_warps = 8 if max(Dp, Dvp) > 128 else 4
    bq = min(block_q, max(MIN_DOT, next_pow2(M)))
    bk = min(block_k, max(MIN_DOT, next_pow2(T)))
    while bk > MIN_DOT and max(num_stages, 1) * bk * (Dp + Dvp) * compute.itemsize > SMEM_BUDGET:
        bk //= 2
    cfg = _Cfg(Z=Z, M=M, S=S, T=T, D=D, Dv=Dv, Dp=Dp, Dvp=Dvp, bq=bq, bk=bk, causal=bool(causal),
               hi_static=hi_static, window=None if window is None else int(window),
               scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
               soft_cap=None if soft_cap is None else float(soft_cap), compute=compute,
               precision=lax.Precision.HIGHEST if compute == np.float32 else None,
               empty_nan=empty_rows_mode(empty_rows)[0], empty_fill=empty_rows_mode(empty_rows)[1])
    plan = Plan.build([q, k, v], [out])
    nq = -(-M // bq)
    (res,) = plan.call(lambda ins, outs: _body(cfg, ins, outs), grid=(Z, nq), backend=backend,
                       num_warps=num_warps, num_stages=num_stages, name="vtc_prefill_attention")
    return res[0] if len(res) == 1 else res


def _pid(axis: int, size: int) -> Any:
    return 0 if size == 1 else pl.program_id(axis)


def _body(c: _Cfg, ins: list[Any], outs: list[Any]) -> None:
    q_ref, k_ref, v_ref = ins
    (o_ref,) = outs
    z, i = _pid(0, c.Z), _pid(1, -(-c.M // c.bq))
    r0 = i * c.bq

    # The valid keys [lo, hi) of every row of this block, as (bq, 1) int32 columns.
    base: Any = q_ref.syms[_SYM] if c.hi_static is None else c.hi_static
    rows = lax.broadcasted_iota(jnp.int32, (c.bq, 1), 0) + r0
    hi = jnp.zeros((c.bq, 1), jnp.int32) + base
    if c.causal:
        hi = hi + (rows % c.S if c.S != c.M else rows)
    lo = jnp.maximum(hi - c.window, 0) if c.window is not None else None   # from the unclamped end
    hi = jnp.minimum(hi, c.T)
    live = rows < c.M          # padded rows past M: do not let them widen the key range
    # Blocks meeting any row's range: [min lo // bk, cdiv(max hi, bk)).
    j1 = (jnp.max(jnp.where(live, hi, 0)) + c.bk - 1) // c.bk
    j0 = jnp.min(jnp.where(live, lo, c.T)) // c.bk if lo is not None else 0

    qt = q_ref.load((z, r0, 0), (1, c.bq, c.Dp)).reshape(c.bq, c.Dp).astype(c.compute)
    lanes = lax.broadcasted_iota(jnp.int32, (1, c.bk), 1)

    def step(j: Any, carry: Any, empty_pass: bool = False) -> Any:
        m_prev, l_prev, acc_prev = carry
        t0 = j * c.bk
        kb = k_ref.load((z, t0, 0), (1, c.bk, c.Dp)).reshape(c.bk, c.Dp).astype(c.compute)
        vb = v_ref.load((z, t0, 0), (1, c.bk, c.Dvp)).reshape(c.bk, c.Dvp).astype(c.compute)
        t = lanes + t0
        if empty_pass:      # every key of the cache, at jax's masked value
            return softmax_block(qt, kb, vb, t < c.T, (m_prev, l_prev, acc_prev), scale=c.scale,
                                 soft_cap=c.soft_cap, compute=c.compute, precision=c.precision,
                                 transform=masked_scores(c.empty_fill))
        valid = t < hi
        if lo is not None:
            valid = valid & (t >= lo)
        return softmax_block(qt, kb, vb, valid, (m_prev, l_prev, acc_prev), scale=c.scale,
                             soft_cap=c.soft_cap, compute=c.compute, precision=c.precision)

    init = (jnp.full((c.bq,), _NEG, jnp.float32), jnp.zeros((c.bq,), jnp.float32),
            jnp.zeros((c.bq, c.Dvp), jnp.float32))
    _, l, acc = lax.fori_loop(j0, j1, step, init)
    if c.empty_fill is not None:
        # rows with no valid key under a finite mask: jax's softmax of the masked scores over all
        # T keys (a second pass, only when this block has such a row; no reduce_or in Triton)
        empty = (hi <= lo if lo is not None else hi <= 0)[:, 0] & live[:, 0]
        nblk = -(-c.T // c.bk)
        # int32 bounds on both sides: a weak-typed Python int in the select lowers to IR that
        # MLIR's verifier rejects (testing.verify_triton_ir)
        n_e = jnp.where(jnp.max(empty.astype(jnp.int32)) > 0, jnp.int32(nblk), jnp.int32(0))
        _, l_e, acc_e = lax.fori_loop(jnp.int32(0), n_e, functools.partial(step, empty_pass=True), init)
        l = jnp.where(empty, l_e, l)
        acc = jnp.where(empty[:, None], acc_e, acc)
    o = normalise(acc, l, c.empty_nan).astype(o_ref.binding.dtype)
    o_ref.store((z, r0, 0), (1, c.bq, c.Dvp), o.reshape(1, c.bq, c.Dvp))
