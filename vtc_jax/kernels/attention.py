"""Decode attention template: flash-decoding (split-K) with grouped-query heads (paper §3.1, §4.2).

One query token per sequence attends to a KV cache. The template is written against *logical*
tensors and reads them through :mod:`vio`, so the data-movement chain of the motivating example
(Split of the QKV projection, ScatterND into the cache, Slice up to ``pos``, Unsqueeze+Expand of
K/V for GQA, Reshape+Transpose for the kernel) never runs:

* ``q``: logical ``(B, Hkv, G, D)``, G query heads per KV head (G = 1 is MHA). Typically a slice
  of the fused QKV projection output reshaped — a layout, not a copy.
* ``k``, ``v``: logical ``(B, Hkv, T, D)``. Typically the ``(B, T, Hkv, D)`` KV cache through a
  transpose layout. GQA is served by loading **one** K/V block per KV head for all G query heads
  of its group (the G rows of the q tile): the repeated K/V of ``Expand`` never exists, not even
  as a broadcast layout.
* ``out``: logical ``(B, Hkv, G, D)``, a :class:`vio.VTensor` (e.g. the ``(B, Hq*D)`` input of the
  output projection through a reshape layout); default a fresh physical array.

Kernels (the paper's Listing 1 stages: load through vio / untouched compute / store through vio)::

    attn_split  grid (B, Hkv, S): program (b, h, s) owns a contiguous run of KV blocks
        q = Q.load((b, h, 0, 0), (1, 1, Gp, Dp))                      # once, stays in registers
        for j in run:                                                  # lax.fori_loop
            kb = K.load((b, h, j*bk, 0), (1, 1, bk, Dp)); vb = V.load(...)
            s = dot(q, kb.T) * sm_scale  [cap*tanh(s/cap)]  masked to lo <= t < hi   # (Gp, bk) f32
            online softmax: running max m, sum l, acc (Gp, Dv) in f32
        S == 1: OUT.store(acc / l)            (no second kernel)
        S  > 1: (m, l, acc) -> f32 scratch (B, Hkv, S, G[, Dv])
    attn_combine  grid (B, Hkv), only when S > 1: loops over the S partials, rescales them by
        exp(m_s - max m), sums, divides by the combined l, OUT.store.

Valid keys are ``lo <= t < hi`` with ``hi = min(end, T)``, ``end = pos + 1`` (or ``kv_len``, or
``T``; ``pos``/``kv_len`` one scalar for all sequences, or one per sequence: a ``(B,)`` operand
program ``b`` reads its element of, as a continuously batched server has) and, with a sliding
``window``, ``lo = end - window`` (keys ``t > pos - window``, counted from the unclamped end as
jax does for ``pos >= T``). A row with no valid key (``hi <= lo``: a position
< 0) outputs what ``empty_rows`` says (:func:`empty_rows_mode`; for a finite mask a second pass
over all T keys, which runs no step unless the row is empty). The split is decided at run time from
``[lo, hi)``: the valid KV blocks are dealt out evenly over the S programs of a head, so a short
prefix of a long cache, or a sliding window, does not leave most programs idle while one works.

Power-of-two tiles everywhere, masked by vio: ``Gp = max(16, next_pow2(G))`` rows for ``tt.dot``
(padded rows read q = 0 and are dropped before the store), ``Dp = max(16, next_pow2(D))``,
``bk`` keys per block (lanes ``t >= T`` masked). Stores use ``Gs = next_pow2(G)`` rows (the q tile
is folded from Gp to Gs rows in registers: a masked reshape-sum, since value slices do not lower
on Triton), so a G = 1 output is never addressed with a block wider than its size-1 dim.

f32 inputs use ``precision=HIGHEST`` in both dots (IEEE f32 on the GPU: the algorithm interpret mode
runs, not TF32). 16-bit inputs: scores and accumulators are f32, the probabilities are rounded to
the V dtype for the second dot (standard flash attention). f32 is a correctness configuration: the
IEEE-f32 (FMA) dots spill at D = 128 in every block/warp setting tried; bf16 is the fast path.

Launch configuration: default 8 warps, ``block_k`` 64, 3 stages for 16-bit inputs (sm_90 readings
in the test file's offline test and in the report). Why 3: Triton's pipeliner keeps
``num_stages - 1`` iterations of K/V loads ahead; at 2 stages the PTX waits ``cp.async.wait_group
0`` in the loop (the next K/V block is only requested once the current one has landed), at 3 it
waits ``wait_group 2`` (one K/V block pair in flight while the current one is consumed), at 64
registers and 72 KB of shared memory (B = 16 and 1, G = 4, D = 128, bf16; 4 stages: 104 KB). ``block_k`` is halved while the
staged K/V blocks would exceed ``SMEM_BUDGET``. A grid axis of size 1 uses the Python int 0 as its
program id, so vio sees a static in-bounds origin there.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .tiling import MIN_DOT_BLOCK, check_pow2, dot_config, next_pow2, program_id
from .vio import Plan, VTensor, output, pack_results

__all__ = ["decode_attention", "default_num_splits", "normalise", "softmax_block", "NUM_SMS"]

NUM_SMS = 132          # H100 SXM: the default split count aims to give every SM a program
MIN_DOT = MIN_DOT_BLOCK  # tt.dot wants M, N, K >= 16
MAX_SPLITS = 64
SMEM_BUDGET = 128 * 1024  # bytes of staged K/V blocks; sm_90 allows 227 KiB, sm_80 163 KiB per block
_LEN_SYM = "__vtc_attn_len"  # runtime symbol carrying pos (or kv_len) into the kernel
_NEG = -1e30           # initial running max: finite, so exp(m_prev - m_next) is never inf - inf


def default_num_splits(batch_heads: int, seq_len: int, block_k: int) -> int:
    """S such that ``batch_heads * S`` programs cover ``NUM_SMS`` SMs, with at least two KV blocks
    per split and at most ``MAX_SPLITS``; 1 when ``batch_heads`` already fills the GPU."""
    if batch_heads >= NUM_SMS:
        return 1
    want = -(-NUM_SMS // batch_heads)
    blocks = -(-seq_len // block_k)
    return int(max(1, min(want, blocks // 2, MAX_SPLITS)))


def _is_static_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _fold_rows(x: jax.Array, g: int, gs: int) -> jax.Array:
    """(Gp, ...) -> (Gs, ...): keep rows < g (g <= gs), without a value-level slice.

    Rows >= g are zeroed, the tile is viewed as (Gp/Gs, Gs, ...) and summed over the first axis:
    every kept row sits in the first slab, the other slabs are zeros (exact)."""
    gp = x.shape[0]
    if gp == gs:
        return x
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    x = jnp.where(rows < g, x, jnp.zeros_like(x))
    return x.reshape((gp // gs, gs) + x.shape[1:]).sum(axis=0)


@dataclass(frozen=True)
class _Cfg:
    B: int
    H: int
    G: int
    D: int
    Dv: int
    T: int
    Gp: int
    Gs: int
    Dp: int
    Dvp: int
    bk: int
    S: int
    scale: float
    soft_cap: float | None
    window: int | None
    hi_static: int | None     # static end of the valid keys, unclamped (None: runtime)
    hi_offset: int            # runtime end = scalar + hi_offset (pos + 1, or kv_len + 0)
    compute: np.dtype
    precision: Any
    empty_nan: bool = False   # a row with no valid key is NaN (jax's softmax of all -inf), else 0
    empty_fill: tuple | None = None  # ... or the softmax of jax's masked scores (:func:`masked_scores`)
    per_row: bool = False     # the runtime end is a (B,) operand (one position per sequence)


def softmax_block(qt: jax.Array, kb: jax.Array, vb: jax.Array, valid: jax.Array, carry: tuple, *,
                  scale: float, soft_cap: float | None, compute: Any, precision: Any,
                  transform: Any = None) -> tuple:
    """Stage 2 of both attention kernels: fold one K/V block into the running (max, sum, acc)
    of the online softmax, in f32; lanes not ``valid`` score ``-inf``; ``transform`` (the
    empty-row pass, :func:`masked_scores`) rewrites the scores of the valid lanes first."""
    m_prev, l_prev, acc_prev = carry
    sc = jnp.dot(qt, kb.T, preferred_element_type=jnp.float32, precision=precision)
    sc = sc * scale
    if soft_cap is not None:
        sc = soft_cap * jnp.tanh(sc / soft_cap)
    if transform is not None:
        sc = transform(sc)
    sc = jnp.where(valid, sc, -jnp.inf)
    m_next = jnp.maximum(m_prev, sc.max(axis=1))
    corr = jnp.exp(m_prev - m_next)
    p = jnp.exp(sc - m_next[:, None])
    l_next = l_prev * corr + p.sum(axis=1)
    pv = jnp.dot(p.astype(compute), vb, preferred_element_type=jnp.float32, precision=precision)
    return m_next, l_next, acc_prev * corr[:, None] + pv


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


def decode_attention(q: Any, k: Any, v: Any, *, kv_len: Any = None, pos: Any = None,
                     sm_scale: float | None = None, soft_cap: float | None = None,
                     window: int | None = None, out: VTensor | None = None, block_k: int = 64,
                     num_splits: int | None = None, num_warps: int = 8, num_stages: int | None = None,
                     backend: str = "interpret", empty_rows: str = "zero") -> Any:
    """Single-token (decode) attention ``softmax(mask(cap(q·kᵀ·scale)))·v`` per query head.

    q: logical (B, Hkv, G, D); k: (B, Hkv, T, D); v: (B, Hkv, T, Dv) — :class:`vio.VTensor` or
        arrays, read through their layouts (e.g. K/V straight from a (B, T, Hkv, D) cache).
    pos: runtime int32 scalar, the decode position: keys ``t <= pos`` are valid (causal); or a
        runtime ``(B,)`` vector, one position per sequence (continuous batching: program ``b``
        reads element ``b``, one scalar load).
    kv_len: instead of ``pos``: keys ``t < kv_len`` are valid (static int, runtime scalar or
        ``(B,)`` vector). Neither: all T keys. Both: error.
    sm_scale: logit scale, default ``1/sqrt(D)``.
    soft_cap: logit soft-capping ``cap * tanh(s / cap)`` after scaling (Gemma-2), before masking.
    window: sliding window: additionally keys ``t >= end - window`` only (``t > pos - window``).
    out: VTensor of logical shape (B, Hkv, G, Dv) receiving the result (written in place when its
        buffers are arrays); default a fresh physical array of q's dtype.
    block_k: keys per block, a power of two >= 16; capped at next_pow2(T), and halved while
        ``num_stages * block_k * (Dp + Dvp) * itemsize > SMEM_BUDGET`` (staged K/V blocks).
    num_splits: split-K programs per (batch, KV head); default :func:`default_num_splits`.
        1 runs a single kernel; > 1 adds the small combine kernel.
    num_warps, num_stages: Triton launch configuration of the main kernel. The default (8 warps,
        block_k 64) compiles for sm_90 without spills for bf16 Llama-3 (G=4, D=128) and MHA
        (D=128) decode; 4 warps spill there (tests/test_kernel_attention.py, offline test).
        ``num_stages`` defaults to 3 for 16-bit inputs (K/V loads pipelined one block ahead, see
        the module docstring) and 1 for f32, whose IEEE dots need the registers that a second
        pipeline stage would take (255 registers and spills at 2 stages, 88 and none at 1, sm_90,
        block_k 64).
    backend: "interpret" (CPU) or "triton".
    empty_rows: what a row with no valid key outputs (:func:`empty_rows_mode`).

    Returns like :func:`vtc_jax.kernels.matmul.matmul`: the array for a fresh/one-buffer output,
    else the tuple of ``out``'s physical buffers.
    """
    q, k, v = VTensor.of(q), VTensor.of(k), VTensor.of(v)
    _check(q, k, v, block_k=block_k, pos=pos, kv_len=kv_len, window=window)
    B, H, G, D = q.shape
    T, Dv = k.shape[2], v.shape[3]
    out = output(out, (B, H, G, Dv), q.dtype)
    hi_static, hi_offset, scalar = _valid_end(pos, kv_len, T)
    per_row = scalar is not None and jnp.ndim(scalar) == 1
    if per_row:   # one end per sequence: a (B,) int32 operand, each program reads its element
        if jnp.shape(scalar) != (B,):
            raise ValueError(f"per-sequence positions must have shape ({B},), got {jnp.shape(scalar)}")
        lens = VTensor.of(jnp.asarray(scalar, jnp.int32))
    elif scalar is not None:
        # The scalar rides along as a runtime symbol of q: vio passes symbols as (1,) int32
        # operands and hands every VRef their values (one scalar read in the kernel; a (1,)
        # physical input would be a masked vector load plus a reduction).
        if _LEN_SYM in dict(q.symbols):
            raise ValueError(f"q already carries a runtime symbol named {_LEN_SYM!r}")
        q = q.with_symbol(_LEN_SYM, jnp.asarray(scalar, jnp.int32))
    compute = np.dtype(jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), v.dtype))
    if num_stages is None:
        num_stages = 1 if compute.itemsize >= 4 else 3
    cfg = _config(q.shape, T, Dv, compute, block_k=block_k, num_stages=num_stages,
                  num_splits=num_splits, sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                  hi_static=hi_static, hi_offset=hi_offset)
    empty_nan, empty_fill = empty_rows_mode(empty_rows)
    cfg = dataclasses.replace(cfg, empty_nan=empty_nan, empty_fill=empty_fill, per_row=per_row)
    return _launch(cfg, q, k, v, out, backend=backend, num_warps=num_warps, num_stages=num_stages,
                   lens=lens if per_row else None)


def _check(q: VTensor, k: VTensor, v: VTensor, *, block_k: int, pos: Any, kv_len: Any,
           window: int | None) -> None:
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise ValueError(f"expected q (B, Hkv, G, D), k/v (B, Hkv, T, D); got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    B, H, G, D = q.shape
    T = k.shape[2]
    if tuple(k.shape) != (B, H, T, D) or tuple(v.shape[:3]) != (B, H, T):
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    check_pow2("block_k", block_k, MIN_DOT)
    if pos is not None and kv_len is not None:
        raise ValueError("give pos or kv_len, not both")
    end = pos if pos is not None else kv_len
    if end is not None and not _is_static_int(end) and jnp.ndim(end) not in (0, 1):
        raise ValueError(f"pos / kv_len must be a scalar or a (B,) vector, got shape {jnp.shape(end)}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window={window} must be >= 1")
    for v_ in (q, k, v):
        if not jnp.issubdtype(v_.dtype, jnp.floating):
            raise NotImplementedError(f"floating dtypes only, got {v_.dtype}")


def _valid_end(pos: Any, kv_len: Any, T: int) -> tuple[int | None, int, Any]:
    """Where the valid keys end: ``(hi_static, hi_offset, scalar)`` — a static end (``scalar``
    None), or ``scalar + hi_offset`` for a runtime ``pos`` (offset 1) or ``kv_len`` (offset 0).
    The end is *not* clamped to T here: a sliding window starts ``window`` keys before the
    unclamped end, as jax's ``t > pos - window`` does for ``pos >= T``."""
    if pos is not None:
        if _is_static_int(pos):
            return int(pos) + 1, 0, None
        return None, 1, pos
    if kv_len is not None:
        if _is_static_int(kv_len):
            return int(kv_len), 0, None
        return None, 0, kv_len
    return T, 0, None


def _config(q_shape: tuple[int, ...], T: int, Dv: int, compute: np.dtype, *, block_k: int,
            num_stages: int, num_splits: int | None, sm_scale: float | None,
            soft_cap: float | None, window: int | None, hi_static: int | None,
            hi_offset: int) -> _Cfg:
    """Tiles, key block and split count (see the module docstring)."""
    B, H, G, D = q_shape
    Dp, Dvp = max(MIN_DOT, next_pow2(D)), max(MIN_DOT, next_pow2(Dv))
    bk = min(block_k, max(MIN_DOT, next_pow2(T)))
    # Shared memory: Triton stages the K and V blocks (num_stages deep). Halve the block until
    # that fits SMEM_BUDGET, so the kernel also *loads* on the device (f32 with D = 256, say).
    while bk > MIN_DOT and max(num_stages, 1) * bk * (Dp + Dvp) * compute.itemsize > SMEM_BUDGET:
        bk //= 2
    S = default_num_splits(B * H, T, bk) if num_splits is None else int(num_splits)
    S = max(1, min(S, -(-T // bk)))  # never more splits than KV blocks
    return _Cfg(B=B, H=H, G=G, D=D, Dv=Dv, T=T, Gp=max(MIN_DOT, next_pow2(G)), Gs=next_pow2(G),
                Dp=Dp, Dvp=Dvp, bk=bk, S=S,
                scale=float(1.0 / math.sqrt(D) if sm_scale is None else sm_scale),
                soft_cap=None if soft_cap is None else float(soft_cap),
                window=None if window is None else int(window), hi_static=hi_static,
                hi_offset=hi_offset, compute=compute, precision=dot_config(compute)[0])


def _launch(c: _Cfg, q: VTensor, k: VTensor, v: VTensor, out: VTensor, *, backend: str,
            num_warps: int, num_stages: int, lens: VTensor | None = None) -> Any:
    """One kernel when S == 1; else the split kernel into f32 partials, then the combine kernel."""
    ins = [q, k, v] + ([lens] if lens is not None else [])
    if c.S == 1:
        plan = Plan.build(ins, [out])
        bufs = plan.call(functools.partial(_split_body, c), grid=(c.B, c.H, 1), backend=backend,
                         num_warps=num_warps, num_stages=num_stages, name="vtc_decode_attention")
        return pack_results(bufs)[0]
    parts = [VTensor.fresh((c.B, c.H, c.S, c.G), jnp.float32),
             VTensor.fresh((c.B, c.H, c.S, c.G), jnp.float32),
             VTensor.fresh((c.B, c.H, c.S, c.G, c.Dv), jnp.float32)]
    plan = Plan.build(ins, parts)
    (m,), (l,), (acc,) = plan.call(functools.partial(_split_body, c), grid=(c.B, c.H, c.S),
                                   backend=backend, num_warps=num_warps, num_stages=num_stages,
                                   name="vtc_decode_attention_split")
    plan2 = Plan.build([m, l, acc], [out])
    bufs = plan2.call(functools.partial(_combine_body, c), grid=(c.B, c.H), backend=backend,
                      num_warps=4, num_stages=1, name="vtc_decode_attention_combine")
    return pack_results(bufs)[0]


# --------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------

def _split_body(c: _Cfg, ins: list[Any], outs: list[Any]) -> None:
    q_ref, k_ref, v_ref = ins[:3]
    b, h, s = program_id(0, c.B), program_id(1, c.H), program_id(2, c.S)

    # The valid keys [lo, hi): scalars (traced or static); a window counts back from the
    # unclamped end (jax's ``t > pos - window`` for any pos).
    if c.hi_static is None:
        # this sequence's position: a (1,)-block load of the (B,) operand, reduced to a scalar
        x = ins[3].load((b,), (1,)).max() if c.per_row else q_ref.syms[_LEN_SYM]
        end: Any = x + c.hi_offset
        hi: Any = jnp.minimum(end, c.T)
        lo: Any = jnp.maximum(end - c.window, 0) if c.window is not None else 0
    else:
        hi = min(c.hi_static, c.T)
        lo = max(c.hi_static - c.window, 0) if c.window is not None else 0

    # This program's run of KV blocks: the blocks meeting [lo, hi) dealt out evenly over S.
    first = lo // c.bk
    last = (hi + c.bk - 1) // c.bk
    if c.S == 1:
        j0, j1 = first, last
    else:
        per = (last - first + c.S - 1) // c.S
        j0 = first + s * per
        j1 = jnp.minimum(j0 + per, last)

    # Stage 1 (once): the q tile of this KV head's G query heads, padded to Gp rows.
    qt = q_ref.load((b, h, 0, 0), (1, 1, c.Gp, c.Dp)).reshape(c.Gp, c.Dp).astype(c.compute)
    lanes = lax.broadcasted_iota(jnp.int32, (1, c.bk), 1)

    def step(j: Any, carry: Any, empty_pass: bool = False) -> Any:
        m_prev, l_prev, acc_prev = carry
        t0 = j * c.bk
        # Stage 1: one K and one V block, shared by all G query heads of the group.
        kb = k_ref.load((b, h, t0, 0), (1, 1, c.bk, c.Dp)).reshape(c.bk, c.Dp).astype(c.compute)
        vb = v_ref.load((b, h, t0, 0), (1, 1, c.bk, c.Dvp)).reshape(c.bk, c.Dvp).astype(c.compute)
        # Stage 2: scores and the online softmax, in f32.
        t = lanes + t0
        if empty_pass:      # every key of the cache, at jax's masked value
            return softmax_block(qt, kb, vb, t < c.T, (m_prev, l_prev, acc_prev), scale=c.scale,
                                 soft_cap=c.soft_cap, compute=c.compute, precision=c.precision,
                                 transform=masked_scores(c.empty_fill))
        valid = t < hi
        if c.window is not None:
            valid = valid & (t >= lo)
        return softmax_block(qt, kb, vb, valid, (m_prev, l_prev, acc_prev), scale=c.scale,
                             soft_cap=c.soft_cap, compute=c.compute, precision=c.precision)

    init = (jnp.full((c.Gp,), _NEG, jnp.float32), jnp.zeros((c.Gp,), jnp.float32),
            jnp.zeros((c.Gp, c.Dvp), jnp.float32))
    m, l, acc = lax.fori_loop(j0, j1, step, init)
    if c.empty_fill is not None:
        # No valid key (hi <= lo: pos < 0, say) under a finite mask: jax's softmax of the masked
        # scores over all T keys, the T blocks dealt out over the S programs like the valid ones.
        # The main loop ran no step then, so its result is still ``init``; otherwise this runs none.
        nblk = -(-c.T // c.bk)
        per_u = -(-nblk // c.S)
        u0 = 0 if c.S == 1 else s * per_u
        # both branches int32 arrays: a weak-typed Python-int branch lowers to an ``arith.select``
        # with an i1 operand that XLA's Triton rejects (ptxas never sees the kernel)
        u1 = jnp.where(hi <= lo, jnp.asarray(jnp.minimum(u0 + per_u, nblk), jnp.int32),
                       jnp.asarray(u0, jnp.int32))
        m, l, acc = lax.fori_loop(u0, u1, functools.partial(step, empty_pass=True), (m, l, acc))

    # Stage 3.
    if c.S == 1:
        (o_ref,) = outs
        o = normalise(acc, l, c.empty_nan)
        o = _fold_rows(o, c.G, c.Gs).astype(o_ref.binding.dtype)
        o_ref.store((b, h, 0, 0), (1, 1, c.Gs, c.Dvp), o.reshape(1, 1, c.Gs, c.Dvp))
        return
    m_ref, l_ref, a_ref = outs
    m_ref.store((b, h, s, 0), (1, 1, 1, c.Gs), _fold_rows(m, c.G, c.Gs).reshape(1, 1, 1, c.Gs))
    l_ref.store((b, h, s, 0), (1, 1, 1, c.Gs), _fold_rows(l, c.G, c.Gs).reshape(1, 1, 1, c.Gs))
    a_ref.store((b, h, s, 0, 0), (1, 1, 1, c.Gs, c.Dvp),
                _fold_rows(acc, c.G, c.Gs).reshape(1, 1, 1, c.Gs, c.Dvp))


def _combine_body(c: _Cfg, ins: list[Any], outs: list[Any]) -> None:
    m_ref, l_ref, a_ref = ins
    (o_ref,) = outs
    b, h = program_id(0, c.B), program_id(1, c.H)

    def step(s: Any, carry: Any) -> Any:
        m_run, l_run, acc_run = carry
        m = m_ref.load((b, h, s, 0), (1, 1, 1, c.Gs), fill=_NEG).reshape(c.Gs)
        l = l_ref.load((b, h, s, 0), (1, 1, 1, c.Gs)).reshape(c.Gs)
        a = a_ref.load((b, h, s, 0, 0), (1, 1, 1, c.Gs, c.Dvp)).reshape(c.Gs, c.Dvp)
        m_next = jnp.maximum(m_run, m)
        c_run, c_new = jnp.exp(m_run - m_next), jnp.exp(m - m_next)
        return (m_next, l_run * c_run + l * c_new,
                acc_run * c_run[:, None] + a * c_new[:, None])

    init = (jnp.full((c.Gs,), _NEG, jnp.float32), jnp.zeros((c.Gs,), jnp.float32),
            jnp.zeros((c.Gs, c.Dvp), jnp.float32))
    _, l, acc = lax.fori_loop(0, c.S, step, init)
    o = normalise(acc, l, c.empty_nan).astype(o_ref.binding.dtype)
    o_ref.store((b, h, 0, 0), (1, 1, c.Gs, c.Dvp), o.reshape(1, 1, c.Gs, c.Dvp))
