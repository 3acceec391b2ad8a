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

Both dots compute at ``precision``, the replaced program's (:func:`.tiling.dot_precision`, as XLA
on the GPU): f32 inputs at jax's default precision run on TF32 tensor cores, at ``HIGHEST`` as IEEE
f32 (interpret mode computes exact f32 either way). 16-bit inputs: scores and accumulators are
f32, the probabilities are rounded to the V dtype for the second dot (standard flash attention).
At ``HIGHEST`` f32 is a correctness configuration: the IEEE-f32 (FMA) dots spill at D = 128 in
every block/warp setting tried; bf16 is the fast path.

Launch configuration (:meth:`.flash.AttentionConfig.decode`, with the sm_90 readings behind
it): 8 warps, ``block_k`` 64, 3 stages on tensor cores (one K/V block pair in flight while the
current one is consumed), 1 for IEEE f32 (``HIGHEST``); ``block_k`` is halved while the staged K/V blocks would exceed
``SMEM_BUDGET``. The split count aims to give each of the GPU's ``NUM_SMS`` SMs a program
(:func:`default_num_splits`). A grid axis of size 1 uses the Python int 0 as its program id, so vio
sees a static in-bounds origin there.

Layers, as JAX's Pallas GPU ops: :func:`decode_attention` (checks the arguments, plans the
:class:`_Cfg`) -> :func:`_launch` (grids, ``Plan.build(...).call``) -> the kernel bodies
:func:`_split_body` / :func:`_combine_body`. The flash step, the empty-row pass and the launch
heuristics are :mod:`.flash`'s, shared with the prefill kernel. A runtime ``pos``/``kv_len`` is
the kernel's last input: an int32 array, ``(1,)`` or ``(B,)``, read with one scalar load
(:func:`.flash.read_end`; the Triton backend has no scalar prefetch).
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

from .flash import (AttentionConfig, Flash, KeyEnd, NEG, SMEM_BUDGET, Planned, Prologue, ProloguePlan, Rows,
                    empty_rows_mode, logical_dtypes, int32_where,
                    keep_lanes, key_end, masked_scores, normalise, read_end, softmax_block, close_end, with_sink)
from .tiling import MIN_DOT_BLOCK, NUM_SMS, check_pow2, next_pow2, program_id
from .vio import Overlay, OverlayError, Plan, Update, UpdateSpec, VTensor, land, output, pack_results

__all__ = ["decode_attention", "default_num_splits", "normalise", "softmax_block", "empty_rows_mode",
           "masked_scores", "NUM_SMS", "SMEM_BUDGET"]

MAX_SPLITS = 64


def default_num_splits(batch_heads: int, seq_len: int, block_k: int) -> int:
    """S such that ``batch_heads * S`` programs cover the GPU's ``NUM_SMS`` SMs (one program per
    SM), with at least two KV blocks per split and at most ``MAX_SPLITS``; 1 when ``batch_heads``
    already fills the GPU."""
    if batch_heads >= NUM_SMS:
        return 1
    want = -(-NUM_SMS // batch_heads)
    blocks = -(-seq_len // block_k)
    return int(max(1, min(want, blocks // 2, MAX_SPLITS)))


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
class _Cfg(Planned):
    """The decode kernels' static configuration (see the module docstring)."""
    B: int
    H: int
    G: int
    D: int
    Dv: int
    Gs: int                   # rows of the stores: next_pow2(G)
    Dp: int
    Dvp: int
    S: int                    # split-K programs per (batch, KV head)
    window: int | None
    end: KeyEnd               # the end of the valid keys (static, or the end operand)
    launch: AttentionConfig
    flash: Flash
    alibi: bool = False       # a (B, Hkv, G) slopes operand after q, k, v: ALiBi bias slope · t
    bias: bool = False        # a (B, Hkv, G, T) bias operand next: added to the scores
    bias_scale: float = 1.0   # times this (a bias added before a scaling of the scores)
    keep: str | None = None   # a (B, Hkv, G, T) runtime mask operand next: which values keep a key
    sink: bool = False        # a (B, Hkv, G) sink-logit operand next (:func:`.flash.with_sink`)
    pro: ProloguePlan = ProloguePlan()   # q's, K's, V's prologues: their operands are the last inputs
    # pending row updates the split kernel performs (their rows after every other input, their
    # destinations after the outputs): per update its spec, and (operand 1 = K / 2 = V, update,
    # piece) for each piece of K or V that reads an updated buffer
    updates: tuple[UpdateSpec, ...] = ()
    over: tuple[tuple[int, int, int], ...] = ()

    @property
    def Gp(self) -> int:
        return self.launch.block_q


def decode_attention(q: Any, k: Any, v: Any, *, kv_len: Any = None, pos: Any = None,
                     sm_scale: float | None = None, soft_cap: float | None = None,
                     window: int | None = None, out: VTensor | None = None, block_k: int = 64,
                     num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, backend: str = "interpret",
                     empty_rows: Any = "zero", precision: Any = None, slopes: Any = None,
                     bias: Any = None, bias_scale: float = 1.0, keep: Any = None,
                     keep_when: str = "nonzero", score_keep: Any = None, inclusive: bool = False,
                     sink: Any = None, score_dtype: Any = None, q_prologue: Prologue | None = None,
                     k_prologue: Prologue | None = None, v_prologue: Prologue | None = None,
                     updates: tuple[Update, ...] = ()) -> Any:
    """Single-token (decode) attention ``softmax(mask(cap(q·kᵀ·scale) + slope·t))·v`` per query head.

    q: logical (B, Hkv, G, D); k: (B, Hkv, T, D); v: (B, Hkv, T, Dv) — :class:`vio.VTensor` or
        arrays, read through their layouts (e.g. K/V straight from a (B, T, Hkv, D) cache).
    pos: runtime int32 scalar, the decode position: keys ``t <= pos`` are valid (causal); or a
        runtime ``(B,)`` vector, one position per sequence (continuous batching: program ``b``
        reads element ``b``, one scalar load).
    kv_len: instead of ``pos``: keys ``t < kv_len`` are valid (static int, runtime scalar or
        ``(B,)`` vector). Neither: all T keys. Both: error. A runtime ``pos``/``kv_len`` is an
        int32 operand of the kernel (:func:`.flash.key_end`). ``inclusive``: a runtime ``pos`` /
        ``kv_len`` is the last valid key, its end saturating at int32's max (``t <= pos`` for every
        int32 ``pos``, as jax compares); else ``pos + 1`` wraps as jax's int32 add does.
    sm_scale: logit scale, default ``1/sqrt(D)``.
    soft_cap: logit soft-capping ``cap * tanh(s / cap)`` after scaling (Gemma-2), before masking.
    window: sliding window: additionally keys ``t >= end - window`` only (``t > pos - window``).
    out: VTensor of logical shape (B, Hkv, G, Dv) receiving the result (written in place when its
        buffers are arrays); default a fresh physical array of q's dtype.
    block_k: keys per block, a power of two >= 16; capped at next_pow2(T), and halved while
        ``num_stages * block_k * (Dp + Dvp) * itemsize > SMEM_BUDGET`` (staged K/V blocks).
    num_splits: split-K programs per (batch, KV head); default :func:`default_num_splits`.
        1 runs a single kernel; > 1 adds the small combine kernel.
    num_warps, num_stages: Triton launch configuration of the main kernel; default
        :meth:`.flash.AttentionConfig.decode` (8 warps; 3 stages on tensor cores, 1 for IEEE f32).
    backend: "interpret" (CPU) or "triton".
    empty_rows: what a row with no valid key outputs (:func:`empty_rows_mode`).
    precision: of both dots, with ``lax.dot_general``'s meaning (None:
        ``jax_default_matmul_precision``, else ``DEFAULT``: TF32 for f32 on the GPU; ``HIGHEST``:
        IEEE f32), resolved by :func:`.tiling.dot_precision`.
    slopes: ALiBi (BLOOM, Falcon): f32 (B, Hkv, G), one slope per query head; ``slope · t`` is
        added to the scaled (capped) scores of key ``t`` before the mask. None: no bias.
    bias: any additive bias, logical (B, Hkv, G, T) (a VTensor: a relative-position table's
        gather, a learned bias, broadcast layouts for the axes it does not vary along), added to
        the scaled (capped) scores before the mask, blockwise, times ``bias_scale`` (a bias added
        before a scaling: ``(s + b) / c``). None: no bias.
    keep: a runtime mask (a padding mask), logical (B, Hkv, G, T), read blockwise: key ``t`` is
        valid only where it keeps it (``keep_when`` as :func:`.flash.keep_lanes`). A row it leaves
        with no valid key outputs 0 or NaN (``empty_rows`` "zero" / "nan"): the split programs
        cannot tell such a row from their partials, so jax's masked softmax of it (a finite fill)
        is :func:`.prefill_attention.prefill_attention`'s. None: no such mask.
    score_keep: a mask computed from the scores themselves, ``(op, when)``: key ``t`` is valid only
        where ``(score op 0) == when`` on the scaled, capped score (``jnp.where(s != 0, s, -inf)``,
        an unwritten zero cache row: ``("ne", True)``; :func:`.flash.score_lanes`). Rows it empties
        as for ``keep``. None: no such mask.
    sink: an attention sink (gpt-oss): logical (B, Hkv, G), one logit per query head that joins
        the softmax's denominator and no value row (:func:`.flash.with_sink`), in the units of the
        masked, biased scores; folded in by split 0 (with a finite mask, shifted as the empty-row
        pass shifts its scores). None: no sink.
    score_dtype: the type of the program's scores (its first dot's result): f16 scores are
        rounded to f16 after the dot and the scaling, so a score past 65504 is inf as the
        program's is (:func:`.flash.narrow_range`). None: f32 scores.
    q_prologue, k_prologue, v_prologue: a :class:`.flash.Prologue` applied to every block loaded of
        q, K or V (an int8 or fp8 cache dequantised, a bf16 cache widened to f32): the kernel
        computes in the dtypes they return. None: the blocks as loaded.
    updates: :class:`vio.Update` s of buffers K or V read (new cache rows handed to the step): the
        kernel attends to K and V as updated — the rows' scores and their share of P·V computed
        from the rows, the loaded blocks left as loaded (:class:`.flash.Rows`) — and its split
        programs write the rows into those buffers, in place. Each update's buffer is read by K
        and/or V alone (not by q, a bias, a mask or a prologue's operand; K or V with a prologue
        that reads operands reads none), through a map whose row depends on the key alone.

    Returns like :func:`vtc_jax.kernels.matmul.matmul`: the array for a fresh/one-buffer output,
    else the tuple of ``out``'s physical buffers; with ``updates``, ``(that, updated buffers)``.
    """
    q, k, v = VTensor.of(q), VTensor.of(k), VTensor.of(v)
    pro = (q_prologue, k_prologue, v_prologue)
    dtypes = logical_dtypes((q, k, v), pro)
    _check(q, k, v, block_k=block_k, pos=pos, kv_len=kv_len, window=window, dtypes=dtypes)
    B, H, G, _ = q.shape
    if slopes is not None:
        slopes = VTensor.of(slopes)
        if tuple(slopes.shape) != (B, H, G) or slopes.dtype != np.float32:
            raise ValueError(f"slopes must be f32 of shape {(B, H, G)}, got {slopes.dtype} {slopes.shape}")
    out = output(out, (B, H, G, v.shape[3]), dtypes[0])
    end, end_operand = key_end(pos, kv_len, k.shape[2], inclusive)
    if end.per_row and end_operand.shape != (B,):
        raise ValueError(f"per-sequence positions must have shape ({B},), got {end_operand.shape}")
    cfg = _config(q, k, v, end, dtypes=dtypes, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                  num_splits=num_splits, sm_scale=sm_scale, soft_cap=soft_cap, window=window,
                  empty_rows=empty_rows, precision=precision, score_keep=score_keep,
                  score_dtype=score_dtype)
    if bias is not None:
        bias = VTensor.of(bias)
        if tuple(bias.shape) != (B, H, G, k.shape[2]):
            raise ValueError(f"bias must have shape {(B, H, G, k.shape[2])}, got {bias.shape}")
    if keep is not None:
        keep = VTensor.of(keep)
        if tuple(keep.shape) != (B, H, G, k.shape[2]):
            raise ValueError(f"keep must have shape {(B, H, G, k.shape[2])}, got {keep.shape}")
        if keep_when not in ("nonzero", "zero", "false"):
            raise ValueError(f"keep_when must be 'nonzero', 'zero' or 'false', got {keep_when!r}")
    if (keep is not None or score_keep is not None) and cfg.flash.empty_fill is not None:
        raise ValueError("decode_attention with a runtime keep mask or a score mask outputs 0 or NaN for a "
                         "row it empties (empty_rows 'zero' or 'nan'); use prefill_attention for jax's "
                         "softmax of its masked scores")
    if sink is not None:
        sink = VTensor.of(sink)
        if tuple(sink.shape) != (B, H, G) or not jnp.issubdtype(sink.dtype, jnp.floating):
            raise ValueError(f"sink must be floating of shape {(B, H, G)}, got {sink.dtype} {sink.shape}")
    extra = [VTensor.of(o) for o in ProloguePlan.operands(*pro)]
    over = tuple((i, n, piece) for n, u in enumerate(updates) for i, x in ((1, k), (2, v))
                 for piece in u.pieces_reading(x))
    for n, u in enumerate(updates):
        others = [x for x in (q, slopes, bias, keep, sink, out, *extra) if x is not None]
        if any(b is u.buffer for x in others for b in x.buffers):
            raise OverlayError(f"update {n}'s buffer is read by an operand other than K and V")
    for i, n, piece in over:
        updates[n].check_overlay((k, v)[i - 1], piece, (2,), (3,))
        if pro[i] is not None and pro[i].operands:
            raise OverlayError("an update of a cache read through a prologue with operands")
    if len({i for i, _, _ in over}) < len(over) or len({n for _, n, _ in over}) < len(updates):
        raise OverlayError("K or V reads more than one updated buffer, or an update is read by neither")
    cfg = dataclasses.replace(cfg, alibi=slopes is not None, bias=bias is not None, bias_scale=float(bias_scale),
                              keep=None if keep is None else keep_when, sink=sink is not None,
                              pro=ProloguePlan.of(*pro), updates=tuple(u.spec for u in updates), over=over)
    res = _launch(cfg, q, k, v, out, end_operand, backend=backend, slopes=slopes, bias=bias, keep=keep,
                  sink=sink, extra=extra, updates=tuple(updates))
    return res


def _check(q: VTensor, k: VTensor, v: VTensor, *, block_k: int, pos: Any, kv_len: Any,
           window: int | None, dtypes: tuple[np.dtype, ...]) -> None:
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise ValueError(f"expected q (B, Hkv, G, D), k/v (B, Hkv, T, D); got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    B, H, G, D = q.shape
    T = k.shape[2]
    if tuple(k.shape) != (B, H, T, D) or tuple(v.shape[:3]) != (B, H, T):
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    check_pow2("block_k", block_k, MIN_DOT_BLOCK)
    if pos is not None and kv_len is not None:
        raise ValueError("give pos or kv_len, not both")
    end = pos if pos is not None else kv_len
    if end is not None and not isinstance(end, (int, np.integer)) and jnp.ndim(end) not in (0, 1):
        raise ValueError(f"pos / kv_len must be a scalar or a (B,) vector, got shape {jnp.shape(end)}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window={window} must be >= 1")
    for dt in dtypes:
        if not jnp.issubdtype(dt, jnp.floating):
            raise NotImplementedError(f"floating dtypes only, got {dt}")


def _config(q: VTensor, k: VTensor, v: VTensor, end: KeyEnd, *, dtypes: tuple[np.dtype, ...], block_k: int,
            num_warps: int | None, num_stages: int | None, num_splits: int | None,
            sm_scale: float | None, soft_cap: float | None, window: int | None,
            empty_rows: Any, precision: Any, score_keep: Any = None, score_dtype: Any = None) -> _Cfg:
    """Tiles, launch and split count (see the module docstring)."""
    B, H, G, D = q.shape
    T, Dv = k.shape[2], v.shape[3]
    compute = np.dtype(jnp.promote_types(jnp.promote_types(dtypes[0], dtypes[1]), dtypes[2]))
    Dp, Dvp = max(MIN_DOT_BLOCK, next_pow2(D)), max(MIN_DOT_BLOCK, next_pow2(Dv))
    launch = AttentionConfig.decode(G, T, Dp, Dvp, compute, block_k=block_k, num_warps=num_warps,
                                    num_stages=num_stages, precision=precision)
    bk = launch.block_k
    S = default_num_splits(B * H, T, bk) if num_splits is None else int(num_splits)
    S = max(1, min(S, -(-T // bk)))  # never more splits than KV blocks
    return _Cfg(B=B, H=H, G=G, D=D, Dv=Dv, Gs=next_pow2(G), Dp=Dp, Dvp=Dvp, S=S,
                window=None if window is None else int(window), end=end, launch=launch,
                flash=Flash.of(T, bk, D, compute, sm_scale=sm_scale, soft_cap=soft_cap,
                               empty_rows=empty_rows, precision=precision, score_keep=score_keep,
                               score_dtype=score_dtype))


def _launch(c: _Cfg, q: VTensor, k: VTensor, v: VTensor, out: VTensor, end: Any, *,
            backend: str, slopes: Any = None, bias: Any = None, keep: Any = None, sink: Any = None,
            extra: list[VTensor] | None = None, updates: tuple[Update, ...] = ()) -> Any:
    """Grid and launch: one kernel when S == 1; else the split kernel into f32 partials, then the
    combine kernel. ``end``: the runtime end operand, or None (a static end); ``extra``: the
    prologues' operands; ``updates``: performed by the (split) kernel, its last inputs and outputs."""
    ins = [q, k, v] + ([slopes] if c.alibi else []) + ([bias] if c.bias else []) + ([keep] if c.keep else []) \
        + ([sink] if c.sink else []) + ([end] if end is not None else []) + (extra or []) \
        + [u.flat_rows() for u in updates]
    dests = [u.dest for u in updates]
    over = frozenset(id(u.buffer) for u in updates)
    warps, stages = c.launch.num_warps, c.launch.num_stages

    def packed(res: Any, bufs: list[tuple[Any, ...]]) -> Any:
        return res if not updates else (res, tuple(b[0] for b in bufs[len(bufs) - len(updates):]))

    if c.S == 1:
        plan = Plan.build(ins, [out] + dests, over=over)
        bufs = plan.call(functools.partial(_split_body, c), grid=(c.B, c.H, 1), backend=backend,
                         num_warps=warps, num_stages=stages, name="vtc_decode_attention")
        return packed(pack_results(bufs[:1])[0], bufs)
    parts = [VTensor.fresh((c.B, c.H, c.S, c.G), jnp.float32),
             VTensor.fresh((c.B, c.H, c.S, c.G), jnp.float32),
             VTensor.fresh((c.B, c.H, c.S, c.G, c.Dv), jnp.float32)]
    plan = Plan.build(ins, parts + dests, over=over)
    split = plan.call(functools.partial(_split_body, c), grid=(c.B, c.H, c.S),
                      backend=backend, num_warps=warps, num_stages=stages,
                      name="vtc_decode_attention_split")
    (m,), (l,), (acc,) = split[:3]
    plan2 = Plan.build([m, l, acc], [out])
    bufs = plan2.call(functools.partial(_combine_body, c), grid=(c.B, c.H), backend=backend,
                      num_warps=4, num_stages=1, name="vtc_decode_attention_combine")
    return packed(pack_results(bufs)[0], split)


# --------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------

def _split_body(c: _Cfg, ins: list[Any], outs: list[Any]) -> None:
    b, h, s = program_id(0, c.B), program_id(1, c.H), program_id(2, c.S)

    # The valid keys [lo, hi): scalars (traced or static); a window counts back from the
    # unclamped end (jax's ``t > pos - window`` for any pos).
    n_fixed = 3 + c.alibi + c.bias + bool(c.keep) + c.sink
    end = close_end(c.end, read_end(c.end, ins[n_fixed] if c.end.static is None else None, b))
    n_up = len(c.updates)
    rows, dests = ins[len(ins) - n_up:], outs[len(outs) - n_up:]
    ins, outs = ins[:len(ins) - n_up], outs[:len(outs) - n_up]
    load_q, load_k, load_v = c.pro.loaders(ins[:3], ins[n_fixed + (c.end.static is None):])
    seen = {i: Overlay(ins[i], piece, rows[n], dests[n], c.updates[n]) for i, n, piece in c.over}

    def new_rows(t0: Any) -> tuple[Rows | None, Rows | None]:
        # which new row lands on each key of this block, for K and for V
        out = []
        for i in (1, 2):
            if i not in seen:
                out.append(None)
                continue
            blk = (1, 1, c.bk, (c.Dp, c.Dvp)[i - 1])
            hits = seen[i].hits((b, h, t0, 0), blk, (2,), tables[i])

            def at_lanes(i: int = i, blk: tuple = blk, hits: Any = hits) -> jax.Array:
                x = seen[i].at_lanes(hits, (b, h, t0, 0), blk, (2,))
                fn = c.pro.fns[i]
                return (x if fn is None else fn(x)).reshape(c.bk, blk[3]).astype(c.flash.compute)
            out.append(Rows(hits.reshape(1, c.bk), at_lanes))
        return out[0], out[1]

    if c.end.static is None:
        hi: Any = jnp.minimum(end, c.T)
        lo: Any = jnp.maximum(end - c.window, 0) if c.window is not None else 0
    else:
        hi = min(end, c.T)
        lo = max(end - c.window, 0) if c.window is not None else 0

    # This program's run of KV blocks: the blocks meeting [lo, hi) dealt out evenly over S.
    first = lo // c.bk
    last = (hi + c.bk - 1) // c.bk
    if c.S == 1:
        j0, j1 = first, last
    else:
        per = (last - first + c.S - 1) // c.S
        j0 = first + s * per
        j1 = jnp.minimum(j0 + per, last)

    # The updates' rows, written home first, each program its share (nothing is live yet; the
    # reads below see the rows whether or not another program has written them).
    for n, spec in enumerate(c.updates):
        land(rows[n], dests[n], spec, (b * c.H + h) * c.S + s, c.B * c.H * c.S)

    # Stage 1 (once): the q tile of this KV head's G query heads, padded to Gp rows.
    qt = load_q((b, h, 0, 0), (1, 1, c.Gp, c.Dp)).reshape(c.Gp, c.Dp).astype(c.flash.compute)

    def load_kv(t0: Any) -> tuple[Any, ...]:
        # one K and one V block, shared by all G query heads of the group; with pending updates,
        # also the rows landing in them (V's stale lanes not loaded)
        rk, rv = new_rows(t0) if seen else (None, None)
        kb = load_k((b, h, t0, 0), (1, 1, c.bk, c.Dp)).reshape(c.bk, c.Dp).astype(c.flash.compute)
        vb = load_v((b, h, t0, 0), (1, 1, c.bk, c.Dvp),
                    lanes=None if rv is None else (rv.hits < 0).reshape(1, 1, c.bk, 1))
        vb = vb.reshape(c.bk, c.Dvp).astype(c.flash.compute)
        return (kb, vb) if not seen else (kb, vb, rk, rv)

    # The rows' ALiBi slopes and bias blocks (padded rows and keys past T read 0).
    slope = ins[3].load((b, h, 0), (1, 1, c.Gp)).reshape(c.Gp) if c.alibi else None
    bias_ref = ins[3 + c.alibi] if c.bias else None

    def load_bias(t0: Any) -> jax.Array:
        blk = bias_ref.load((b, h, 0, t0), (1, 1, c.Gp, c.bk)).reshape(c.Gp, c.bk).astype(jnp.float32)
        return blk if c.bias_scale == 1.0 else blk * c.bias_scale

    keep_ref = ins[3 + c.alibi + c.bias] if c.keep else None

    def load_keep(t0: Any) -> jax.Array:
        return keep_lanes(keep_ref.load((b, h, 0, t0), (1, 1, c.Gp, c.bk)).reshape(c.Gp, c.bk), c.keep)

    # Stage 2: scores and the online softmax, in f32 (where the new rows land: read once).
    tables = {i: ov.table() for i, ov in seen.items()}
    m, l, acc = c.flash.loop(qt, load_kv, j0, j1, c.flash.init(c.Gp, c.Dvp), hi=hi,
                             lo=lo if c.window is not None else None, slope=slope,
                             load_bias=load_bias if c.bias else None, load_keep=load_keep if c.keep else None)
    if c.flash.empty_fill is not None:
        # No valid key (hi <= lo: pos < 0, say) under a finite mask: jax's softmax of the masked
        # scores over all T keys, the T blocks dealt out over the S programs like the valid ones.
        # The main loop ran no step then, so its result is still ``init``; otherwise this runs none.
        nblk = -(-c.T // c.bk)
        per_u = -(-nblk // c.S)
        u0 = 0 if c.S == 1 else s * per_u
        u1 = int32_where(hi <= lo, jnp.minimum(u0 + per_u, nblk), u0)
        m, l, acc = c.flash.empty_pass(qt, load_kv, u0, u1, (m, l, acc))
    if c.sink:
        # the sink logit, once per row: in split 0's partial (the combine rescales it with the
        # rest), shifted as the empty-row pass shifted the scores when that pass ran
        sk = ins[n_fixed - 1].load((b, h, 0), (1, 1, c.Gp)).reshape(c.Gp).astype(jnp.float32)
        if c.flash.empty_fill is not None:
            sk = sk - jnp.where(hi <= lo, jnp.float32(c.flash.empty_shift), jnp.float32(0.0))
        if c.S > 1:
            sk = jnp.where(s == 0, sk, -jnp.inf)
        m, l, acc = with_sink((m, l, acc), sk)

    # Stage 3.
    if c.S == 1:
        (o_ref,) = outs
        o = c.flash.normalise(acc, l)
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
        m = m_ref.load((b, h, s, 0), (1, 1, 1, c.Gs), fill=NEG).reshape(c.Gs)
        l = l_ref.load((b, h, s, 0), (1, 1, 1, c.Gs)).reshape(c.Gs)
        a = a_ref.load((b, h, s, 0, 0), (1, 1, 1, c.Gs, c.Dvp)).reshape(c.Gs, c.Dvp)
        m_next = jnp.maximum(m_run, m)
        c_run, c_new = jnp.exp(m_run - m_next), jnp.exp(m - m_next)
        return (m_next, l_run * c_run + l * c_new,
                acc_run * c_run[:, None] + a * c_new[:, None])

    _, l, acc = lax.fori_loop(0, c.S, step, c.flash.init(c.Gs, c.Dvp))
    o = c.flash.normalise(acc, l).astype(o_ref.binding.dtype)
    o_ref.store((b, h, 0, 0), (1, 1, c.Gs, c.Dvp), o.reshape(1, 1, c.Gs, c.Dvp))
