"""Llama-3-style prefill attention (a whole prompt at once, sequence > 1), two ways.

Movement ops (``step``): q/k/v ``reshape`` into heads + ``transpose`` to (B, H, S, D); KV caches
written from position 0 by ``lax.dynamic_update_slice``; GQA by ``jnp.repeat`` on the head axis;
``k.transpose`` for the score matmul; causal mask from ``jnp.tril(jnp.ones((S, S)))`` applied by
``jnp.where`` with ``finfo.min``; heads merged back by ``transpose`` + ``reshape``.

``step_sdpa`` is the same layer using ``jax.nn.dot_product_attention(q, k, v, is_causal=True,
implementation="xla")`` on (B, S, H, D) heads (GQA handled by the library: its internal
reshape/broadcast), with the same split reshapes, cache updates and merge reshape.

Both: ``step(params, x, k_cache, v_cache) -> (out, k_cache, v_cache)``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SIZES = {
    # d_model, n_heads, n_kv_heads, head_dim, seq, context, batch, dtype
    "small": (32, 4, 2, 8, 8, 16, 2, jnp.float32),
    "paper": (4096, 32, 8, 128, 4096, 4096, 16, jnp.bfloat16),
}


def _project(params, x, k_cache):
    b, s, _ = x.shape
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    n_heads = params["wq"].shape[1] // hd
    q = (x @ params["wq"]).reshape(b, s, n_heads, hd)
    k = (x @ params["wk"]).reshape(b, s, n_kv, hd)
    v = (x @ params["wv"]).reshape(b, s, n_kv, hd)
    return q, k, v, n_heads, n_kv, hd


def _fill(k_cache, v_cache, k, v):
    return (lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, 0, 0)),
            lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, 0, 0)))


def step(params, x, k_cache, v_cache):
    b, s, d = x.shape
    q, k, v, n_heads, n_kv, hd = _project(params, x, k_cache)
    k_cache, v_cache = _fill(k_cache, v_cache, k, v)
    q = q.transpose(0, 2, 1, 3)                                         # (B, H, S, D)
    k = jnp.repeat(k, n_heads // n_kv, axis=2).transpose(0, 2, 1, 3)
    v = jnp.repeat(v, n_heads // n_kv, axis=2).transpose(0, 2, 1, 3)
    scores = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(hd)).astype(q.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    o = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, n_heads * hd)
    return x + o @ params["wo"], k_cache, v_cache


def step_sdpa(params, x, k_cache, v_cache):
    b, s, d = x.shape
    q, k, v, n_heads, n_kv, hd = _project(params, x, k_cache)
    k_cache, v_cache = _fill(k_cache, v_cache, k, v)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    o = o.reshape(b, s, n_heads * hd)
    return x + o @ params["wo"], k_cache, v_cache


def example_args(size: str = "small", seed: int = 0):
    """``(params, x, k_cache, v_cache)``; ``"paper"`` gives ShapeDtypeStructs (Llama-3-8B)."""
    dm, nh, nkv, hd, s, t, b, dt = SIZES[size]
    shapes = {"wq": (dm, nh * hd), "wk": (dm, nkv * hd), "wv": (dm, nkv * hd), "wo": (nh * hd, dm)}
    cshape = (b, t, nkv, hd)
    if size == "paper":
        sd = lambda sh: jax.ShapeDtypeStruct(sh, dt)  # noqa: E731
        return {k: sd(v) for k, v in shapes.items()}, sd((b, s, dm)), sd(cshape), sd(cshape)
    rng = np.random.default_rng(seed)
    arr = lambda sh, sc=1.0: jnp.asarray(rng.standard_normal(sh) * sc, dt)  # noqa: E731
    params = {k: arr(v, v[0] ** -0.5) for k, v in shapes.items()}
    return params, arr((b, s, dm)), arr(cshape), arr(cshape)
