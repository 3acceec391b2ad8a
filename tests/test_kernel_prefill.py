"""kernels/prefill_attention.py: flash attention for many query rows over virtual q/k/v/out.

Every case goes through ``check_kernel``: interpret mode against an f32 numpy reference *and*
cross-lowered for CUDA (Triton IR must come out). Shapes are small and ragged (M = 40 rows,
T = 50 keys, D = 24) so the row, key and head-dim masks of vio are all exercised.

Tolerances as for the decode kernel: f32 dots exact in interpret mode at every precision
(rtol = atol = 1e-5);
bf16 rounds the probabilities for P·V and the output once (2e-2).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vtc_jax.indexmap import Layout
from vtc_jax.kernels.prefill_attention import prefill_attention
from vtc_jax.kernels.vio import VTensor
from vtc_jax.testing import check_kernel

F32 = dict(rtol=1e-5, atol=1e-5)
B16 = dict(rtol=2e-2, atol=2e-2)
TOL = {jnp.float32: F32, jnp.bfloat16: B16}


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def ref_prefill(q, k, v, *, causal=False, q_offset=0, kv_len=None, window=None, seq_len=None,
                sm_scale=None, soft_cap=None, dtype=None, slopes=None, bias=None):
    """q (Z, M, D), k (Z, T, D), v (Z, T, Dv); row r is query position r % seq_len; ``slopes``
    (Z, M): an ALiBi bias ``slope · t`` added before the mask."""
    dtype = dtype or q.dtype
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    z, m, d = q.shape
    t = k.shape[1]
    S = seq_len or m
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    s = np.einsum("zmd,ztd->zmt", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    if slopes is not None:
        s = s + np.asarray(slopes, np.float32)[..., None] * np.arange(t, dtype=np.float32)
    if bias is not None:
        s = s + np.asarray(bias, np.float32)
    r, ts = np.arange(m)[:, None], np.arange(t)[None, :]
    end = int(q_offset) + 1 + r % S if causal else np.full((m, 1), t if kv_len is None else int(kv_len))
    valid = ts < np.minimum(end, t)
    if causal and kv_len is not None:   # a key length capping the causal ends
        valid &= ts < int(kv_len)
    if window is not None:
        valid &= ts >= end - window
    s = np.where(valid, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return jnp.asarray(np.einsum("zmt,ztd->zmd", p, v), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kw", [
    dict(causal=True),
    dict(causal=True, q_offset=10),
    dict(),
    dict(kv_len=33),
    dict(causal=True, window=7, soft_cap=5.0),
    dict(causal=True, seq_len=20),                  # two grouped heads of 20 queries in the rows
], ids=["causal", "causal_offset", "full", "kv_len", "window_cap", "gqa_rows"])
def test_physical(dtype, kw):
    z, m, t, d = 3, 40, 50, 24
    args = (rand((z, m, d), dtype), rand((z, t, d), dtype, 1), rand((z, t, d), dtype, 2))
    call = functools.partial(lambda q, k, v, backend, **kw: prefill_attention(
        q, k, v, block_q=16, block_k=16, backend=backend, **kw), **kw)
    check_kernel(call, lambda q, k, v: ref_prefill(q, k, v, **kw), args, **TOL[dtype])


@pytest.mark.parametrize("off", [0, 9])
def test_runtime_offset_over_a_transposed_cache(off):
    """Chunked prefill: S queries at runtime positions off.., K/V read straight from a
    (B, T, H, D) cache and q from a (B, S, H, D) projection: transpose layouts, no copies; the
    output written into (B, S, H*Dv) through a transpose+reshape layout."""
    b, s, h, t, d = 2, 12, 3, 40, 16

    def view(x):     # (B, L, H, D) -> logical (B*H, L, D)
        bb, ll, hh, dd = x.shape
        return VTensor(Layout.physical(0, x.shape).transpose((0, 2, 1, 3)).reshape((bb * hh, ll, dd)),
                       x.dtype, (x,))

    def call(q, kc, vc, pos, backend):
        out = VTensor(Layout.physical(0, (b, s, h * d)).reshape((b, s, h, d)).transpose((0, 2, 1, 3))
                      .reshape((b * h, s, d)), jnp.float32, (jax.ShapeDtypeStruct((b, s, h * d), jnp.float32),))
        return prefill_attention(view(q), view(kc), view(vc), causal=True, q_offset=pos, out=out,
                                 block_q=16, block_k=16, backend=backend)

    def ref(q, kc, vc, pos):
        flat = lambda x: jnp.transpose(x, (0, 2, 1, 3)).reshape(-1, x.shape[1], x.shape[3])
        o = ref_prefill(flat(q), flat(kc), flat(vc), causal=True, q_offset=int(pos))
        return jnp.transpose(o.reshape(b, h, s, d), (0, 2, 1, 3)).reshape(b, s, h * d)

    args = (rand((b, s, h, d)), rand((b, t, h, d), seed=1), rand((b, t, h, d), seed=2), jnp.int32(off))
    check_kernel(call, ref, args, **F32)


def test_runtime_kv_len_and_default_blocks():
    z, m, t, d = 2, 70, 130, 32
    args = (rand((z, m, d)), rand((z, t, d), seed=1), rand((z, t, d), seed=2), jnp.int32(77))
    call = lambda q, k, v, n, backend: prefill_attention(q, k, v, kv_len=n, backend=backend)
    check_kernel(call, lambda q, k, v, n: ref_prefill(q, k, v, kv_len=int(n)), args, **F32)


def test_runtime_offset_is_an_int32_operand():
    """A runtime q_offset / kv_len is the kernel's own (1,) int32 operand (read with one scalar
    load), not a symbol on q; a vector of them must have one entry per sequence (B dividing
    the Z programs)."""
    from vtc_jax.testing import cross_lower
    S = jax.ShapeDtypeStruct
    sds = (S((2, 40, 32), jnp.float32), S((2, 50, 32), jnp.float32), S((2, 50, 32), jnp.float32),
           S((), jnp.int32))
    for kw in ("q_offset", "kv_len"):
        f = lambda q, k, v, x, kw=kw: prefill_attention(  # noqa: E731
            q, k, v, causal=kw == "q_offset", backend="triton", **{kw: x})
        calls = [ln for ln in cross_lower(f, *sds).text.splitlines() if "__gpu$xla.gpu.triton" in ln]
        assert len(calls) == 1 and "tensor<1xi32>" in calls[0].rsplit(":", 1)[-1], kw
    q, k = rand((2, 8, 16)), rand((2, 8, 16))
    with pytest.raises(ValueError, match="q_offset must be a scalar or a"):
        prefill_attention(q, k, k, causal=True, q_offset=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="kv_len must be a scalar or a"):
        prefill_attention(q, k, k, kv_len=jnp.zeros((2, 1), jnp.int32))


def test_bad_arguments():
    q, k = rand((1, 8, 16)), rand((1, 8, 16))
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention(q, k, k, block_q=24)
    with pytest.raises(ValueError, match="divide"):
        prefill_attention(q, k, k, seq_len=3)
    with pytest.raises(ValueError, match="shape mismatch"):
        prefill_attention(q, k, rand((1, 9, 16)))


# --------------------------------------------------------------------------------------------
# The default bf16 configuration compiles to cubin for sm_90 without spills (offline)
# --------------------------------------------------------------------------------------------

OFFLINE_SHAPES = {   # name: (Z, M, T, D, seq_len, kwargs), bf16
    "llama3-8b-prefill-2k": (8, 4 * 2048, 2048, 128, 2048, dict(causal=True)),
    "gemma2-9b-prefill-1k": (8, 2 * 1024, 1024, 256, 1024, dict(causal=True, soft_cap=50.0)),
}


@pytest.mark.offline
@pytest.mark.parametrize("name", list(OFFLINE_SHAPES))
def test_default_config_compiles_sm90(name):
    from vtc_jax.offline import SMEM_LIMIT, compile_many, format_table
    from vtc_jax.testing import cross_lower

    z, m, t, d, s, kw = OFFLINE_SHAPES[name]
    f = lambda q, k, v: prefill_attention(q, k, v, seq_len=s, backend="triton", **kw)
    sds = (jax.ShapeDtypeStruct((z, m, d), jnp.bfloat16), jax.ShapeDtypeStruct((z, t, d), jnp.bfloat16),
           jax.ShapeDtypeStruct((z, t, d), jnp.bfloat16))
    kernels = cross_lower(f, *sds).triton_kernels
    results = compile_many([(k.name, k.ir, k.num_warps, k.num_stages) for k in kernels], arch="9.0")
    table = format_table(results)
    print(f"\n{name}\n{table}")
    assert len(results) == 1, table
    assert results[0].cubin_ok, table
    assert not results[0].spills, table
    assert results[0].smem_bytes <= SMEM_LIMIT["sm_90"], table


@pytest.mark.parametrize("fill", [("fill", float(jnp.finfo(jnp.float32).min)), ("bias", -1e9, 0.25)],
                         ids=["fill", "bias"])
@pytest.mark.parametrize("off", [-20, 3])
def test_finite_mask_rows_with_no_valid_key(fill, off):
    """Causal rows before key 0 (a negative offset) under a finite mask: jax's softmax of the masked
    scores (a pass over all keys, only for blocks with such a row), and IR that verifies (its loop
    bound was a select on a weak-typed Python int, which XLA's Triton rejected)."""
    z, m, t, d = 2, 40, 50, 24
    args = (rand((z, m, d)), rand((z, t, d), seed=1), rand((z, t, d), seed=2), jnp.int32(off))

    def ref(q, k, v, o):
        s = jnp.einsum("zmd,ztd->zmt", q, k, precision="highest") / math.sqrt(d)
        valid = jnp.arange(t)[None, :] <= int(o) + jnp.arange(m)[:, None]
        if fill[0] == "fill":
            s = jnp.where(valid, s, fill[1])
        else:
            s = (s / fill[2] + jnp.where(valid, 0.0, fill[1])) * fill[2]
        return jnp.einsum("zmt,ztd->zmd", jax.nn.softmax(s, -1), v, precision="highest")

    call = lambda q, k, v, o, backend: prefill_attention(   # noqa: E731
        q, k, v, causal=True, q_offset=o, empty_rows=fill, backend=backend)
    check_kernel(call, ref, args, **F32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_alibi_slopes(dtype):
    """ALiBi: a slope per query row (G = 2 heads folded into the rows, S = 40 each), causal, the
    bias ``slope · t`` added before the mask, ragged T and rows."""
    z, S, g, d = 3, 40, 2, 32
    slopes = jnp.asarray(np.repeat(-(0.5 ** np.arange(1, z * g + 1, dtype=np.float32)).reshape(z, g), S, axis=1))
    q, k, v = rand((z, g * S, d), dtype), rand((z, S, d), dtype, 1), rand((z, S, d), dtype, 2)
    call = functools.partial(lambda q, k, v, sl, **kw: prefill_attention(q, k, v, slopes=sl, **kw),
                             causal=True, seq_len=S, block_q=32, block_k=16)
    check_kernel(call, lambda q, k, v, sl: ref_prefill(q, k, v, causal=True, seq_len=S, slopes=sl),
                 (q, k, v, slopes), **TOL[dtype])


def test_additive_bias():
    """Any additive bias, (Z, M, T) read blockwise (T5's relative-position bias, say), causal."""
    z, m, d = 2, 40, 32
    q, k, v, bias = rand((z, m, d)), rand((z, m, d), seed=1), rand((z, m, d), seed=2), rand((z, m, m), seed=3)
    call = functools.partial(lambda q, k, v, bs, **kw: prefill_attention(q, k, v, bias=bs, **kw),
                             causal=True, block_q=16, block_k=16)
    check_kernel(call, lambda q, k, v, bs: ref_prefill(q, k, v, causal=True, bias=bs), (q, k, v, bias), **F32)


@pytest.mark.parametrize("causal", [False, True], ids=["lengths", "offsets"])
def test_per_sequence_bounds(causal):
    """One bound per sequence (a (B,) operand; program z reads entry z // (Z // B)): right-padded
    prompts by their lengths, or causal chunks each at its own offset. Lengths of 0 and past T
    included (a row with no valid key outputs 0 by default)."""
    b, hk, m, t, d = 3, 2, 8, 24, 16
    q, k, v = rand((b * hk, m, d)), rand((b * hk, t, d), seed=1), rand((b * hk, t, d), seed=2)
    ends = jnp.asarray([5, 0, 30] if not causal else [3, 16, 0], jnp.int32)

    def call(q, k, v, e, **kw):
        kw.update(causal=True, q_offset=e) if causal else kw.update(kv_len=e)
        return prefill_attention(q, k, v, block_q=16, block_k=16, **kw)

    def ref(q, k, v, e):
        with np.errstate(invalid="ignore"):   # a row with no valid key: NaN in numpy, 0 here
            return _ref(q, k, v, e)

    def _ref(q, k, v, e):
        per = [ref_prefill(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=causal,
                           **({"q_offset": int(e[i // hk])} if causal else {"kv_len": int(e[i // hk])}))
               for i in range(b * hk)]
        return jnp.nan_to_num(jnp.concatenate(per), nan=0.0)
    check_kernel(call, ref, (q, k, v, ends), **F32)


@pytest.mark.parametrize("when", ["nonzero", "false", "zero"])
def test_runtime_keep_mask_with_an_empty_row(when):
    """A runtime (padding) mask read blockwise through a broadcast layout of its (Z, T) values:
    keys it drops score -inf; a row with no kept key (program 1: every key padded) outputs jax's
    softmax of its masked scores, here one finite fill (the mean of V), found by ``l == 0``."""
    z, m, t, d = 3, 24, 40, 16
    q, k, v = rand((z, m, d)), rand((z, t, d), seed=1), rand((z, t, d), seed=2)
    keep = np.random.default_rng(5).random((z, t)) > 0.3
    keep[1] = False
    stored = {"nonzero": keep, "false": ~keep, "zero": np.where(keep, 0.0, -1e9).astype(np.float32)}[when]
    fill = float(jnp.finfo(jnp.float32).min)

    def call(q, k, v, kp, *, backend):
        lay = Layout.physical(0, (z, t)).reshape((z, 1, t)).broadcast((z, m, t), (0, 1, 2))
        kv = VTensor(lay, kp.dtype, (kp,))
        return prefill_attention(q, k, v, keep=kv, keep_when=when, empty_rows=("fill", fill),
                                 block_q=16, block_k=16, backend=backend)

    def ref(q, k, v, kp):
        s = np.einsum("zmd,ztd->zmt", np.asarray(q), np.asarray(k)) / math.sqrt(d)
        s = np.where(keep[:, None, :], s, fill)
        p = np.exp(s - s.max(-1, keepdims=True))
        return jnp.asarray(np.einsum("zmt,ztd->zmd", p / p.sum(-1, keepdims=True), np.asarray(v)))

    check_kernel(call, ref, (q, k, v, jnp.asarray(stored)), **F32)


def test_decode_keep_mask_refuses_a_finite_fill():
    from vtc_jax.kernels.attention import decode_attention
    q, k = rand((2, 1, 4, 16)), rand((2, 1, 32, 16), seed=1)
    with pytest.raises(ValueError, match="prefill_attention"):
        decode_attention(q, k, k, keep=jnp.ones((2, 1, 4, 32), bool), empty_rows=("fill", -1e30))


@pytest.mark.parametrize("keep", [("ne", True), ("lt", False)], ids=["ne_zero", "not_lt_zero"])
@pytest.mark.parametrize("kernel", ["prefill", "decode"])
def test_score_keep_masks_keys_by_their_own_scores(keep, kernel):
    """A mask computed from the scores (``jnp.where(s != 0, s, -inf)``, ``~(s < 0)``): zero key
    rows (an unwritten cache) score exactly 0 in any summation order; program 1's keys are all
    zero, so ``ne`` empties its rows (NaN, as jax's softmax of a row of -inf)."""
    from vtc_jax.kernels.attention import decode_attention
    z, m, t, d = 3, 4, 40, 16
    q, v = rand((z, m, d)), rand((z, t, d), seed=2)
    k = np.array(rand((z, t, d), seed=1))
    k[:, 29:] = 0
    k[1] = 0
    k = jnp.asarray(k)
    op, when = keep

    def call(q, k, v, *, backend):
        kw = dict(score_keep=keep, empty_rows="nan", block_k=16, backend=backend,
                  precision=jax.lax.Precision.HIGHEST)
        if kernel == "prefill":
            return prefill_attention(q, k, v, block_q=16, **kw)
        return decode_attention(q[:, None], k[:, None], v[:, None], **kw)[:, 0]

    def ref(q, k, v):
        s = np.einsum("zmd,ztd->zmt", np.asarray(q), np.asarray(k)) / math.sqrt(d)
        hit = {"ne": s != 0, "lt": s < 0}[op]
        s = np.where(hit == when, s, -np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(-1, keepdims=True))
            return jnp.asarray(np.einsum("zmt,ztd->zmd", p / p.sum(-1, keepdims=True), np.asarray(v)))

    check_kernel(call, ref, (q, k, v), **F32)


def test_score_keep_is_checked():
    q, k = rand((2, 4, 16)), rand((2, 32, 16), seed=1)
    with pytest.raises(ValueError, match="score_keep"):
        prefill_attention(q, k, k, score_keep=("neq", True))


@pytest.mark.parametrize("static", [False, True], ids=["per_sequence", "static"])
def test_causal_rows_capped_at_a_key_length(static):
    """``causal`` with ``kv_len``: each row's causal end capped at its sequence's length
    (``jax.nn.dot_product_attention(is_causal=True, key_value_seq_lengths=...)``: right-padded
    prompts), a (B,) operand next to the offset; lengths of 0 (rows with no valid key: 0) and past
    T included."""
    b, hk, m, t, d = 3, 2, 24, 24, 16
    q, k, v = rand((b * hk, m, d)), rand((b * hk, t, d), seed=1), rand((b * hk, t, d), seed=2)
    lens = jnp.asarray([5, 0, 30], jnp.int32)

    def call(q, k, v, n, backend):
        return prefill_attention(q, k, v, causal=True, kv_len=11 if static else n, block_q=16, block_k=16,
                                 backend=backend)

    def ref(q, k, v, n):
        with np.errstate(invalid="ignore"):
            per = [ref_prefill(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=True,
                               kv_len=11 if static else int(n[i // hk])) for i in range(b * hk)]
        return jnp.nan_to_num(jnp.concatenate(per), nan=0.0)
    check_kernel(call, ref, (q, k, v, lens), **F32)


@pytest.mark.parametrize("fill", ["-inf", "fill", "bias"])
def test_sink_causal_rows_some_empty(fill):
    """gpt-oss's attention sink (one logit per row in the softmax's denominator, no value row) over
    causal rows at a negative offset, so the first rows have no valid key: those are 0 as jax's
    (the sink takes all the probability), under a -inf mask, a finite fill and an additive bias
    scaled after it (the empty-row pass's shift applied to the sink too); the others equal jax's
    softmax over the masked scores and the sink."""
    z, m, t, d = 2, 40, 50, 24
    sink = jnp.asarray(np.random.default_rng(5).normal(size=(z, m)) * 2, jnp.float32).at[1, 7].set(-jnp.inf)
    args = (rand((z, m, d)), rand((z, t, d), seed=1), rand((z, t, d), seed=2), sink, jnp.int32(-6))
    empty = {"-inf": "nan", "fill": ("fill", float(jnp.finfo(jnp.float32).min)), "bias": ("bias", -1e9, 0.25)}[fill]

    def ref(q, k, v, sk, o):
        s = jnp.einsum("zmd,ztd->zmt", q, k, precision="highest") / math.sqrt(d)
        valid = jnp.arange(t)[None, :] <= int(o) + jnp.arange(m)[:, None]
        if fill == "bias":
            s = (s / 0.25 + jnp.where(valid, 0.0, -1e9)) * 0.25
        else:
            s = jnp.where(valid, s, -jnp.inf if fill == "-inf" else empty[1])
        full = jnp.concatenate([s, sk[..., None]], -1)
        p = jax.nn.softmax(full, -1)[..., :-1]
        return jnp.nan_to_num(jnp.einsum("zmt,ztd->zmd", p, v, precision="highest"), nan=0.0)

    def call(q, k, v, sk, o, backend):
        return jnp.nan_to_num(prefill_attention(q, k, v, causal=True, q_offset=o, sink=sk, empty_rows=empty,
                                                backend=backend), nan=0.0)
    want = ref(*args)
    assert np.all(want[0, :6] == 0) and np.any(want[0, 6:] != 0)
    check_kernel(call, ref, args, lower=fill == "fill", **F32)
