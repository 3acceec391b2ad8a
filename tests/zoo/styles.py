"""Snippets in the styles of other codebases that the zoo's models do not cover.

Each ``CASES[name]()`` returns ``(step, args)``, small and random: flax.linen's
``MultiHeadDotProductAttention`` in decode mode (its cache collection), flax.nnx's
``MultiHeadAttention`` with a causal mask, equinox's ``MultiheadAttention`` vmapped per sample,
``jax.nn.dot_product_attention`` with GQA (bf16, causal), T5-style relative-position bias by
``jnp.take``, a top-k MoE router with ``take_along_axis``, ViT patchify (reshape/transpose) with a
class token and LayerNorm by ``rsqrt``, a flax.linen conv + BatchNorm block in NHWC, ``roll`` /
``flip`` / reflect ``pad`` / ``tile``, a ``scan`` over ``dynamic_slice`` windows, rotate-half RoPE
with ``.at[:, pos].set`` caches and a ``finfo.min`` mask, continuous-batching decode (a position per
sequence), PRNG keys made inside, ``value_and_grad``
through transposes, ``cond`` + ``while_loop``, integer and boolean outputs; and attention as
Mistral's rolling-buffer cache, an int8 KV cache dequantised by per-token scales, DeepSeek's MLA
(absorbed, two score terms), Whisper's cross-attention, multi-query attention, attention dropout
in training, ``vmap`` over heads, a ``scan`` of decode steps, and gpt-oss's attention sinks
(decode with a sliding window; its reference ``sdpa`` vmapped over a batch).
``tests/test_styles.py`` checks each against ``jax.jit``.
"""
import math

import jax
import jax.numpy as jnp
from jax import lax

key = jax.random.PRNGKey(0)


def _rng():
    """``rnd(*shape, dtype=f32)``: a normal array, each call of one case its own key (a case's
    values do not depend on which cases ran before it)."""
    n = iter(range(1, 1 << 30))
    return lambda *shape, dtype=jnp.float32: jax.random.normal(jax.random.fold_in(key, next(n)), shape, dtype)


CASES: dict = {}


def case(f):
    CASES[f.__name__] = f
    return f



@case
def flax_linen_mha_decode():
    rnd = _rng()
    import flax.linen as nn
    m = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, decode=True)
    x = rnd(2, 8, 32)
    v = m.init(key, x, x)
    params, cache = v["params"], v["cache"]
    tok = rnd(2, 1, 32)
    def step(params, cache, tok):
        y, upd = m.apply({"params": params, "cache": cache}, tok, tok, mutable=["cache"])
        return y, upd["cache"]
    return step, (params, cache, tok)


@case
def flax_nnx_mha():
    rnd = _rng()
    from flax import nnx
    m = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=False, rngs=nnx.Rngs(0))
    gd, st = nnx.split(m)
    x = rnd(2, 8, 32)
    def step(st, x):
        mm = nnx.merge(gd, st)
        return mm(x, mask=nnx.make_causal_mask(jnp.ones((2, 8))))
    return step, (st, x)


@case
def equinox_mha_vmapped():
    rnd = _rng()
    import equinox as eqx
    m = eqx.nn.MultiheadAttention(num_heads=4, query_size=32, key=key)
    x = rnd(3, 8, 32)
    params, static = eqx.partition(m, eqx.is_array)
    def step(params, x):
        mm = eqx.combine(params, static)
        return jax.vmap(lambda s: mm(s, s, s))(x)
    return step, (params, x)


@case
def sdpa_gqa_causal_bf16():
    rnd = _rng()
    q = rnd(2, 8, 8, 16, dtype=jnp.bfloat16); k = rnd(2, 8, 2, 16, dtype=jnp.bfloat16); v = rnd(2, 8, 2, 16, dtype=jnp.bfloat16)
    def step(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return step, (q, k, v)


@case
def t5_relative_bias():
    rnd = _rng()
    q = rnd(2, 4, 8, 16); k = rnd(2, 4, 8, 16); v = rnd(2, 4, 8, 16); table = rnd(32, 4)
    def step(q, k, v, table):
        pos = jnp.arange(8)[None, :] - jnp.arange(8)[:, None]
        bucket = jnp.clip(pos + 16, 0, 31)
        bias = jnp.take(table, bucket, axis=0).transpose(2, 0, 1)  # (H, q, k)
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) + bias[None]
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
    return step, (q, k, v, table)


@case
def moe_topk_router():
    rnd = _rng()
    x = rnd(16, 32); wr = rnd(32, 4); we = rnd(4, 32, 32)
    def step(x, wr, we):
        logits = x @ wr
        w, idx = lax.top_k(logits, 2)
        w = jax.nn.softmax(w, axis=-1)
        ye = jnp.einsum("td,edf->tef", x, we)
        sel = jnp.take_along_axis(ye, idx[:, :, None], axis=1)
        return jnp.sum(sel * w[:, :, None], axis=1)
    return step, (x, wr, we)


@case
def vit_patchify():
    rnd = _rng()
    img = rnd(2, 3, 16, 16); w = rnd(3 * 4 * 4, 32); cls = rnd(1, 1, 32); pos = rnd(1, 17, 32)
    def step(img, w, cls, pos):
        b, c, h, ww = img.shape
        p = img.reshape(b, c, h // 4, 4, ww // 4, 4).transpose(0, 2, 4, 1, 3, 5).reshape(b, 16, c * 16)
        t = p @ w
        t = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, 32)), t], axis=1) + pos
        mu = t.mean(-1, keepdims=True); var = ((t - mu) ** 2).mean(-1, keepdims=True)
        return (t - mu) * lax.rsqrt(var + 1e-6)
    return step, (img, w, cls, pos)


@case
def linen_conv_bn_nhwc():
    rnd = _rng()
    import flax.linen as nn
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Conv(16, (3, 3))(x)
            y = nn.BatchNorm(use_running_average=True)(y)
            y = nn.relu(y)
            y = nn.Conv(16, (1, 1), feature_group_count=1)(y)
            return jnp.concatenate([x, y], axis=-1)[..., ::2]
    m = Block(); x = rnd(2, 8, 8, 16)
    v = m.init(key, x)
    return (lambda v, x: m.apply(v, x)), (v, x)


@case
def roll_flip_pad_tile():
    rnd = _rng()
    x = rnd(2, 8, 16)
    def step(x):
        y = jnp.roll(x, 3, axis=1) * 2.0
        y = jnp.flip(y, axis=2) + 1.0
        y = jnp.pad(y, ((0, 0), (1, 1), (2, 2)), mode="reflect")
        z = jnp.tile(y, (1, 2, 1))
        return jnp.tanh(z)[:, ::3, 1:-1]
    return step, (x,)


@case
def scan_sliding_window():
    rnd = _rng()
    x = rnd(4, 32); w = rnd(8, 8)
    def step(x, w):
        def body(c, i):
            win = lax.dynamic_slice(x, (0, i), (4, 8))
            return c + jnp.tanh(win @ w).sum(), win[:, ::2]
        return lax.scan(body, 0.0, jnp.arange(0, 24, 4))
    return step, (x, w)


@case
def rotate_half_rope_kvcache_at_set():
    rnd = _rng()
    B, H, T, D = 2, 4, 16, 8
    q = rnd(B, 1, H, D); kn = rnd(B, 1, H, D); ck = rnd(B, T, H, D); cv = rnd(B, T, H, D); vn = rnd(B, 1, H, D)
    pos = jnp.int32(5)
    def rot(x, p):
        half = x.shape[-1] // 2
        f = 1.0 / (10000 ** (jnp.arange(half) / half))
        a = p * f
        c, s = jnp.cos(a), jnp.sin(a)
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    def step(q, kn, vn, ck, cv, pos):
        q = rot(q, pos); kn = rot(kn, pos)
        ck = ck.at[:, pos].set(kn[:, 0]); cv = cv.at[:, pos].set(vn[:, 0])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, ck) * (D ** -0.5)
        s = jnp.where(jnp.arange(T)[None, None, None] <= pos, s, jnp.finfo(s.dtype).min)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), cv)
        return o.reshape(B, 1, H * D), ck, cv
    return step, (q, kn, vn, ck, cv, pos)


def continuous_batching_step(B, T, H, KV, D):
    """One decode step of serving with continuous batching over (B, T, KV, D) caches: each sequence
    at its own position (a (B,) vector), K/V rows scattered per sequence, GQA by jnp.repeat, scores
    / sqrt(d), a -inf mask per sequence."""
    def step(q, kn, vn, ck, cv, pos):
        b = jnp.arange(B)
        ck, cv = ck.at[b, pos].set(kn[:, 0]), cv.at[b, pos].set(vn[:, 0])
        k, v = jnp.repeat(ck, H // KV, axis=2), jnp.repeat(cv, H // KV, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D).astype(q.dtype)
        s = jnp.where(jnp.arange(T)[None, None, None, :] <= pos[:, None, None, None], s, -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return o.reshape(B, 1, H * D), ck, cv
    return step


@case
def continuous_batching_decode():
    """Serving with continuous batching (:func:`continuous_batching_step`), small."""
    rnd = _rng()
    B, T, H, KV, D = 4, 32, 8, 2, 16
    q, kn, vn = rnd(B, 1, H, D), rnd(B, 1, KV, D), rnd(B, 1, KV, D)
    ck, cv = rnd(B, T, KV, D), rnd(B, T, KV, D)
    pos = jnp.array([0, 7, 31, 12], jnp.int32)
    return continuous_batching_step(B, T, H, KV, D), (q, kn, vn, ck, cv, pos)


@case
def prng_dropout_inside():
    rnd = _rng()
    x = rnd(4, 32); w = rnd(32, 32)
    def step(x, w, seed):
        k = jax.random.PRNGKey(seed)
        k1, k2 = jax.random.split(k)
        y = (x @ w).T.reshape(8, 16)
        keep = jax.random.bernoulli(k1, 0.9, y.shape)
        n = jax.random.normal(k2, (8, 16))
        return jnp.where(keep, y / 0.9, 0.0) + 0.01 * n
    return step, (x, w, 3)


@case
def grad_through_transpose_mlp():
    rnd = _rng()
    x = rnd(8, 16); w1 = rnd(16, 32); w2 = rnd(32, 16)
    def loss(w1, w2, x):
        h = jax.nn.gelu((x @ w1).reshape(8, 4, 8).transpose(1, 0, 2)).transpose(1, 0, 2).reshape(8, 32)
        return jnp.mean((h @ w2 - x) ** 2)
    def step(w1, w2, x):
        return jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x)
    return step, (w1, w2, x)


@case
def cond_switch_and_while():
    rnd = _rng()
    x = rnd(4, 16)
    def step(x, flag):
        y = lax.cond(flag > 0, lambda a: jnp.transpose(a) @ a, lambda a: a.T @ (2 * a), x)
        def body(c):
            i, v = c
            return i + 1, jnp.roll(v, 1, axis=0) * 0.5
        return lax.while_loop(lambda c: c[0] < 3, body, (0, y))[1]
    return step, (x, 1)


@case
def int_and_bool_outputs():
    rnd = _rng()
    x = rnd(4, 8)
    def step(x):
        a = jnp.argmax(x.T, axis=0)
        m = (x.reshape(8, 4) > 0)
        return a, m, jnp.cumsum(x, axis=1)[:, ::-1]
    return step, (x,)


# ---- attention in more codebases' styles -----------------------------------------------------


@case
def gpt_oss_sinks_decode():
    """gpt-oss's attention block ported to jax, one decode step: the QKV projection split, RoPE
    (rotate-half) at ``pos``, the cache rows written by ``dynamic_update_slice``, the queries
    grouped as (kv head, q_mult), a sliding window (its local layers), the learned per-head sink
    logit concatenated to the f32 scores and its probability sliced off before ``p·v``; bf16."""
    rnd = _rng()
    B, T, H, KV, D, W, DM = 2, 32, 8, 2, 16, 8, 32
    G, bf = H // KV, jnp.bfloat16
    x, wqkv = rnd(B, DM, dtype=bf), (rnd(DM, (H + 2 * KV) * D) * DM ** -0.5).astype(bf)
    sinks, ck, cv = rnd(H, dtype=bf), rnd(B, T, KV, D, dtype=bf), rnd(B, T, KV, D, dtype=bf)

    def rope(x, pos):
        half = D // 2
        a = pos.astype(jnp.float32) / (150000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
        c, s = jnp.cos(a).astype(x.dtype), jnp.sin(a).astype(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def step(x, wqkv, sinks, ck, cv, pos):
        q, k, v = jnp.split(x @ wqkv, [H * D, (H + KV) * D], axis=-1)
        q, k, v = rope(q.reshape(B, KV, G, D), pos), rope(k.reshape(B, 1, KV, D), pos), v.reshape(B, 1, KV, D)
        ck, cv = lax.dynamic_update_slice(ck, k, (0, pos, 0, 0)), lax.dynamic_update_slice(cv, v, (0, pos, 0, 0))
        s = jnp.einsum("bkgd,btkd->bkgt", q, ck).astype(jnp.float32) * D ** -0.5
        t = jnp.arange(T)
        s = jnp.where((t <= pos) & (t > pos - W), s, -jnp.inf)
        sk = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, KV, G, 1), (B, KV, G, 1))
        w = jax.nn.softmax(jnp.concatenate([s, sk], axis=-1), axis=-1)[..., :-1]
        o = jnp.einsum("bkgt,btkd->bkgd", w.astype(cv.dtype), cv)
        return o.reshape(B, H * D), ck, cv
    return step, (x, wqkv, sinks, ck, cv, jnp.int32(19))


@case
def gpt_oss_sinks_prefill_vmapped():
    """gpt-oss's reference ``sdpa`` (one sequence: queries ``(n, kv_heads, q_mult, d)``, keys
    expanded over ``q_mult``, an additive ``triu(-inf)`` causal mask plus a ``tril(-inf)`` sliding
    window, the sinks reshaped to ``(kv_heads, q_mult, 1, 1)`` and expanded over the tokens,
    ``softmax(cat([QK, S]))[..., :-1]``), ported line by line and ``jax.vmap``-ed over a batch."""
    rnd = _rng()
    B, n, KV, G, D, W = 2, 12, 2, 2, 16, 4
    Q, K, V, S = rnd(B, n, KV, G, D), rnd(B, n, KV, D), rnd(B, n, KV, D), rnd(KV * G)

    def sdpa(Q, K, V, S):
        K = jnp.broadcast_to(K[:, :, None, :], (n, KV, G, D))
        V = jnp.broadcast_to(V[:, :, None, :], (n, KV, G, D))
        S = jnp.broadcast_to(S.reshape(KV, G, 1, 1), (KV, G, n, 1))
        mask = jnp.triu(jnp.full((n, n), -jnp.inf), k=1)
        mask = mask + jnp.tril(jnp.full((n, n), -jnp.inf), k=-W)
        QK = jnp.einsum("qhmd,khmd->hmqk", Q, K) * (1.0 / math.sqrt(D)) + mask[None, None, :, :]
        Wt = jax.nn.softmax(jnp.concatenate([QK, S], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("hmqk,khmd->qhmd", Wt, V).reshape(n, -1)

    def step(Q, K, V, S):
        return jax.vmap(sdpa, in_axes=(0, 0, 0, None))(Q, K, V, S)
    return step, (Q, K, V, S)


@case
def rolling_buffer_mistral():
    rnd = _rng(); B, W, H, KV, D = 2, 16, 4, 2, 8
    q, kn, vn = rnd(B, 1, H, D), rnd(B, 1, KV, D), rnd(B, 1, KV, D); ck, cv = rnd(B, W, KV, D), rnd(B, W, KV, D)
    def step(q, kn, vn, ck, cv, pos):
        slot = pos % W
        ck = lax.dynamic_update_slice(ck, kn, (0, slot, 0, 0)); cv = lax.dynamic_update_slice(cv, vn, (0, slot, 0, 0))
        k = jnp.repeat(ck, H // KV, 2); v = jnp.repeat(cv, H // KV, 2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        valid = jnp.arange(W) <= pos   # before the buffer wraps
        s = jnp.where(valid[None, None, None], s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v), ck, cv
    return step, (q, kn, vn, ck, cv, jnp.int32(20))


@case
def int8_kv_cache_dequant():
    rnd = _rng(); B, T, H, KV, D = 2, 32, 8, 2, 16
    q = rnd(B, 1, H, D, dtype=jnp.bfloat16)
    ck = (rnd(B, T, KV, D) * 40).astype(jnp.int8); cv = (rnd(B, T, KV, D) * 40).astype(jnp.int8)
    sk, sv = jnp.abs(rnd(B, T, KV)) * 0.02, jnp.abs(rnd(B, T, KV)) * 0.02
    def step(q, ck, cv, sk, sv, pos):
        k = (ck.astype(jnp.bfloat16) * sk[..., None].astype(jnp.bfloat16))
        v = (cv.astype(jnp.bfloat16) * sv[..., None].astype(jnp.bfloat16))
        qg = q.reshape(B, 1, KV, H // KV, D)
        s = jnp.einsum("bqkgd,btkd->bkgqt", qg, k).astype(jnp.float32) * D ** -0.5
        s = jnp.where(jnp.arange(T) <= pos, s, jnp.finfo(jnp.float32).min)
        p = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
        return jnp.einsum("bkgqt,btkd->bqkgd", p, v).reshape(B, 1, H * D)
    return step, (q, ck, cv, sk, sv, jnp.int32(17))


@case
def mla_absorbed():
    rnd = _rng(); B, T, H, R, Dr, D = 2, 16, 4, 32, 8, 16
    qn, qr = rnd(B, H, D), rnd(B, H, Dr); ckv, kr = rnd(B, T, R), rnd(B, T, Dr); wuk, wuv = rnd(H, D, R), rnd(H, R, D)
    def step(qn, qr, ckv, kr, wuk, wuv, pos):
        qa = jnp.einsum("bhd,hdr->bhr", qn, wuk)
        s = (jnp.einsum("bhr,btr->bht", qa, ckv) + jnp.einsum("bhd,btd->bht", qr, kr)) / math.sqrt(D + Dr)
        s = jnp.where(jnp.arange(T)[None, None] <= pos, s, -jnp.inf)
        o = jnp.einsum("bht,btr->bhr", jax.nn.softmax(s, -1), ckv)
        return jnp.einsum("bhr,hrd->bhd", o, wuv).reshape(B, H * D)
    return step, (qn, qr, ckv, kr, wuk, wuv, jnp.int32(9))


@case
def whisper_cross_attention():
    rnd = _rng(); B, S, T, H, D = 2, 1, 30, 4, 16
    x, enc = rnd(B, S, H * D), rnd(B, T, H * D); wq, wk, wv = rnd(H * D, H * D), rnd(H * D, H * D), rnd(H * D, H * D)
    def step(x, enc, wq, wk, wv):
        q = (x @ wq).reshape(B, S, H, D).transpose(0, 2, 1, 3) * D ** -0.25
        k = (enc @ wk).reshape(B, T, H, D).transpose(0, 2, 3, 1) * D ** -0.25
        v = (enc @ wv).reshape(B, T, H, D).transpose(0, 2, 1, 3)
        w = jax.nn.softmax((q @ k).astype(jnp.float32), axis=-1).astype(q.dtype)
        return (w @ v).transpose(0, 2, 1, 3).reshape(B, S, H * D)
    return step, (x, enc, wq, wk, wv)


@case
def mqa_single_kv_head():
    rnd = _rng(); B, T, H, D = 3, 24, 6, 16
    q, ck, cv = rnd(B, H, D), rnd(B, T, D), rnd(B, T, D)
    def step(q, ck, cv, pos):
        s = jnp.einsum("bhd,btd->bht", q, ck) * lax.rsqrt(jnp.float32(D))
        s = jnp.where((jnp.arange(T) < pos + 1)[None, None], s, -1e30)
        return jnp.einsum("bht,btd->bhd", jax.nn.softmax(s, -1), cv)
    return step, (q, ck, cv, jnp.int32(11))


@case
def attn_dropout_training():
    rnd = _rng(); B, S, H, D = 2, 8, 4, 16
    q, k, v = rnd(B, S, H, D), rnd(B, S, H, D), rnd(B, S, H, D)
    def step(q, k, v, key):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, -1)
        keep = jax.random.bernoulli(key, 0.9, p.shape)
        p = jnp.where(keep, p / 0.9, 0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return step, (q, k, v, jax.random.PRNGKey(3))


@case
def vmap_over_heads_attention():
    rnd = _rng(); S, H, D = 8, 4, 16
    q, k, v = rnd(H, S, D), rnd(H, S, D), rnd(H, S, D)
    def one(q, k, v):
        s = q @ k.T / math.sqrt(D)
        s = jnp.where(jnp.arange(S)[:, None] >= jnp.arange(S)[None], s, jnp.finfo(s.dtype).min)
        return jax.nn.softmax(s) @ v
    def step(q, k, v):
        return jax.vmap(one)(q, k, v).transpose(1, 0, 2).reshape(S, H * D)
    return step, (q, k, v)


@case
def scan_decode_loop_kvcache():
    rnd = _rng(); B, T, H, D = 2, 16, 2, 8
    q0, ck, cv, w = rnd(B, H, D), rnd(B, T, H, D), rnd(B, T, H, D), rnd(H * D, 3 * H * D) * 0.3
    def step(q0, ck, cv, w):
        def body(c, p):
            x, ck, cv = c
            qkv = (x.reshape(B, H * D) @ w).reshape(B, 3, H, D)
            ck = lax.dynamic_update_slice(ck, qkv[:, 1][:, None], (0, p, 0, 0))
            cv = lax.dynamic_update_slice(cv, qkv[:, 2][:, None], (0, p, 0, 0))
            s = jnp.einsum("bhd,bthd->bht", qkv[:, 0], ck) / math.sqrt(D)
            s = jnp.where(jnp.arange(T) <= p, s, -jnp.inf)
            o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1), cv)
            return (jnp.tanh(o), ck, cv), o.sum()
        return lax.scan(body, (q0, ck, cv), jnp.arange(4, 8))
    return step, (q0, ck, cv, w)
