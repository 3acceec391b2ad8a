"""Gemma-2 decode layer as a ``flax.linen`` Module, bf16 throughout.

Movement ops: q projection by ``nn.DenseGeneral`` to (B, H, D); k/v from one stacked
``[2, KV, d, D]`` einsum, split by indexing ``kv[0]``/``kv[1]``; RoPE by half-split
(slices + negate + ``concatenate``); KV caches updated by ``lax.dynamic_update_slice`` at a runtime
position; GQA by ``reshape`` of q into (KV, G) groups + grouped einsums against the caches (no
repeat); query pre-scaling ``q * head_dim**-0.5`` before the dot; logit soft-cap
``tanh(s / 50) * 50``; causal + sliding-window mask by ``jnp.where`` (Gemma's -2.38e38 constant);
output merge ``reshape`` + ``DenseGeneral`` over two axes; tanh-GELU gate from a stacked
``[2, d, f]`` weight split by indexing; pre/post RMS norms around attention and MLP.

The sliding window is ``T // 2`` of the cache length ``T``, so that it masks at both sizes.
``step_cond`` applies it under ``lax.cond(pos >= window, ...)`` instead (control flow: the cond's
body is optimised on its own, the scores stay physical at its boundary).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax import lax

SIZES = {
    # d_model, n_heads, n_kv_heads, head_dim, ffn, context, batch
    "small": (32, 4, 2, 8, 64, 16, 2),
    "paper": (3584, 16, 8, 256, 14336, 4096, 16),
}
DTYPE = jnp.bfloat16
SOFT_CAP = 50.0
K_MASK = -2.3819763e38
EPS = 1e-6


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.normal(0.1), (x.shape[-1],), DTYPE)
        xf = x.astype(jnp.float32)
        y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
        return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


def rope(x, pos, base=10000.0):
    """x: (B, H, D) at one position; half-split rotation."""
    d = x.shape[-1]
    frac = 2 * jnp.arange(d // 2, dtype=jnp.float32) / d
    ang = pos.astype(jnp.float32) / (base ** frac)
    sin, cos = jnp.sin(ang), jnp.cos(ang)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class GemmaBlock(nn.Module):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    window_style: str = "where"   # "where" | "cond"
    heads: str = "groups"         # "groups": scores per (KV, G) group | "reshape": merged to H for the softmax

    @nn.compact
    def __call__(self, x, k_cache, v_cache, pos):
        b, d = x.shape
        t = k_cache.shape[1]
        kvh, hd = self.num_kv_heads, self.head_dim
        g = self.num_heads // kvh
        init = nn.initializers.normal(d ** -0.5)

        h = RMSNorm(name="pre_attention_norm")(x)
        q = nn.DenseGeneral((self.num_heads, hd), use_bias=False, dtype=DTYPE, param_dtype=DTYPE,
                            kernel_init=init, name="q_proj")(h)                  # (B, H, D)
        w_kv = self.param("kv_einsum", init, (2, kvh, d, hd), DTYPE)
        kv = jnp.einsum("bd,ckdh->cbkh", h, w_kv)                                 # (2, B, KV, D)
        k, v = kv[0], kv[1]
        q, k = rope(q, pos), rope(k, pos)
        q = q * jnp.asarray(hd ** -0.5, DTYPE)                                   # query pre-scaling

        k_cache = lax.dynamic_update_slice(k_cache, k[:, None], (0, pos, 0, 0))
        v_cache = lax.dynamic_update_slice(v_cache, v[:, None], (0, pos, 0, 0))

        qg = q.reshape(b, kvh, g, hd)                                            # GQA groups
        logits = jnp.einsum("bkgh,btkh->bkgt", qg, k_cache).astype(jnp.float32)
        if self.heads == "reshape":   # (B, KV, G, T) -> (B, H, T): mask and softmax per head
            logits = logits.reshape(b, self.num_heads, t)
        logits = jnp.tanh(logits / SOFT_CAP) * SOFT_CAP
        window = t // 2
        idx = jnp.arange(t)
        if self.window_style == "where":
            allowed = (idx <= pos) & (idx > pos - window)
            logits = jnp.where(allowed.reshape((1,) * (logits.ndim - 1) + (t,)), logits, K_MASK)
        else:   # "cond": the window is applied only once pos has passed it, under lax.cond
            logits = jnp.where((idx <= pos)[None, None, None, :], logits, K_MASK)
            logits = lax.cond(pos >= window,
                              lambda s: jnp.where((idx > pos - window)[None, None, None, :], s, K_MASK),
                              lambda s: s, logits)
        probs = jax.nn.softmax(logits, axis=-1).astype(DTYPE).reshape(b, kvh, g, t)
        enc = jnp.einsum("bkgt,btkh->bkgh", probs, v_cache).reshape(b, self.num_heads, hd)
        attn = nn.DenseGeneral(d, axis=(-2, -1), use_bias=False, dtype=DTYPE, param_dtype=DTYPE,
                               kernel_init=nn.initializers.normal((self.num_heads * hd) ** -0.5),
                               name="o_proj")(enc)
        x = x + RMSNorm(name="post_attention_norm")(attn)

        h = RMSNorm(name="pre_ffw_norm")(x)
        w_gate = self.param("gating_einsum", init, (2, d, self.ffn), DTYPE)
        gate = jnp.einsum("bd,cdf->cbf", h, w_gate)
        act = jax.nn.gelu(gate[0], approximate=True) * gate[1]
        w_down = self.param("linear", nn.initializers.normal(self.ffn ** -0.5), (self.ffn, d), DTYPE)
        mlp = jnp.einsum("bf,fd->bd", act, w_down)
        x = x + RMSNorm(name="post_ffw_norm")(mlp)
        return x, k_cache, v_cache


def _block_of(params, k_cache, window_style: str = "where", heads: str = "groups") -> GemmaBlock:
    _, n_heads, hd = params["q_proj"]["kernel"].shape
    n_kv = k_cache.shape[2]
    ffn = params["gating_einsum"].shape[-1]
    return GemmaBlock(n_heads, n_kv, hd, ffn, window_style, heads)


def step(params, x, k_cache, v_cache, pos):
    """One Gemma-2 layer for one new token per sequence: ``(x, k_cache, v_cache)``."""
    return _block_of(params, k_cache).apply({"params": params}, x, k_cache, v_cache, pos)


def step_cond(params, x, k_cache, v_cache, pos):
    """The same layer with the sliding window applied under ``lax.cond`` (once ``pos`` passed it)."""
    return _block_of(params, k_cache, "cond").apply({"params": params}, x, k_cache, v_cache, pos)


def step_heads(params, x, k_cache, v_cache, pos):
    """The same layer with the grouped scores reshaped to one row per query head for the soft-cap,
    mask and softmax (``(B, KV, G, T) -> (B, H, T)``) and back for ``p @ v``, as flax ports that
    apply a per-head mask write it."""
    return _block_of(params, k_cache, heads="reshape").apply({"params": params}, x, k_cache, v_cache, pos)


def example_args(size: str = "small", seed: int = 0):
    """``(params, x, k_cache, v_cache, pos)``; ``"paper"`` gives ShapeDtypeStructs (Gemma-2-9B)."""
    dm, nh, nkv, hd, f, t, b = SIZES[size]
    block = GemmaBlock(nh, nkv, hd, f)
    cache = jax.ShapeDtypeStruct((b, t, nkv, hd), DTYPE)
    xs = jax.ShapeDtypeStruct((b, dm), DTYPE)
    pos_s = jax.ShapeDtypeStruct((), jnp.int32)
    if size == "paper":
        params = jax.eval_shape(block.init, jax.random.PRNGKey(seed), xs, cache, cache, pos_s)["params"]
        return params, xs, cache, cache, pos_s
    rng = np.random.default_rng(seed)
    arr = lambda s: jnp.asarray(rng.standard_normal(s.shape), DTYPE)  # noqa: E731
    params = block.init(jax.random.PRNGKey(seed), arr(xs), arr(cache), arr(cache), jnp.int32(0))["params"]
    return params, arr(xs), arr(cache), arr(cache), jnp.int32(t // 2 + 3)
