"""A Llama-3 decoder layer in decode (one new token per sequence), in plain JAX.

Written the way a model author writes it — fused QKV projection, split, reshape, KV-cache update
at a runtime position, grouped-query heads repeated with broadcast+reshape, transposes into the
attention layout — so that every data-movement op of the paper's Fig. 2 is really in the jaxpr.

``step`` is the whole layer; ``attention_block`` is the paper's motivating subgraph (frames 1–3:
QKV projection → movement → decode attention). ``example_args(size, batch)`` gives arguments:
``"small"`` (tiny f32 arrays, for equivalence tests on CPU) or ``"paper"`` (Llama-3-8B dimensions,
context 4096, bf16, as ShapeDtypeStructs so nothing is allocated).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Config:
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    context: int
    dtype: Any
    eps: float = 1e-5
    rope_theta: float = 500000.0


SIZES = {
    "small": Config(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, context=32, dtype=jnp.float32),
    "paper": Config(d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336, context=4096,
                    dtype=jnp.bfloat16),
}


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding at one position; ``x`` is (B, 1, H, D)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = pos.astype(jnp.float32) * inv
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)])
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)])
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., d // 2:], xf[..., : d // 2]], axis=-1)
    return (xf * cos + rot * sin).astype(x.dtype)


def _attend(cfg: Config, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array) -> jax.Array:
    """GQA decode attention over the whole cache, keys after ``pos`` masked out."""
    b, t = k_cache.shape[0], k_cache.shape[1]
    g = cfg.n_heads // cfg.n_kv_heads
    # GQA: repeat each KV head for its group of query heads (Unsqueeze + Expand + Reshape).
    k = jnp.broadcast_to(k_cache[:, :, :, None, :], (b, t, cfg.n_kv_heads, g, cfg.head_dim))
    k = k.reshape(b, t, cfg.n_heads, cfg.head_dim)
    v = jnp.broadcast_to(v_cache[:, :, :, None, :], (b, t, cfg.n_kv_heads, g, cfg.head_dim))
    v = v.reshape(b, t, cfg.n_heads, cfg.head_dim)
    q = jnp.transpose(q, (0, 2, 1, 3))            # (B, H, 1, D)
    k = jnp.transpose(k, (0, 2, 3, 1))            # (B, H, D, T)
    v = jnp.transpose(v, (0, 2, 1, 3))            # (B, H, T, D)
    s = jnp.matmul(q, k, preferred_element_type=jnp.float32) * (cfg.head_dim ** -0.5)
    s = jnp.where(jnp.arange(t) <= pos, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.matmul(p, v, preferred_element_type=jnp.float32).astype(q.dtype)  # (B, H, 1, D)
    return jnp.transpose(o, (0, 2, 1, 3)).reshape(b, cfg.n_heads * cfg.head_dim)


def _qkv(cfg: Config, params: dict, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    b = h.shape[0]
    qkv = jnp.dot(h, params["w_qkv"], preferred_element_type=jnp.float32).astype(h.dtype)
    nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    q, k, v = jnp.split(qkv, [nq, nq + nk], axis=-1)
    return (q.reshape(b, 1, cfg.n_heads, cfg.head_dim), k.reshape(b, 1, cfg.n_kv_heads, cfg.head_dim),
            v.reshape(b, 1, cfg.n_kv_heads, cfg.head_dim))


def _update(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (0, pos, 0, 0))


def attention_block(h: jax.Array, w_qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The paper's Fig. 2 subgraph: QKV projection → split/reshape/cache update/GQA/transposes → attention."""
    cfg = _config_of(h, w_qkv, k_cache)
    q, k, v = _qkv(cfg, {"w_qkv": w_qkv}, h)
    k_cache, v_cache = _update(k_cache, k, pos), _update(v_cache, v, pos)
    return _attend(cfg, q, k_cache, v_cache, pos), k_cache, v_cache


def step(params: dict, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
         pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer for one new token per sequence: returns (output, new K cache, new V cache)."""
    cfg = _config_of(x, params["w_qkv"], k_cache)
    h = rms_norm(x, params["attn_norm"], cfg.eps)
    q, k, v = _qkv(cfg, params, h)
    q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    k_cache, v_cache = _update(k_cache, k, pos), _update(v_cache, v, pos)
    attn = _attend(cfg, q, k_cache, v_cache, pos)
    x = x + jnp.dot(attn, params["w_o"], preferred_element_type=jnp.float32).astype(x.dtype)
    h = rms_norm(x, params["mlp_norm"], cfg.eps)
    gate_up = jnp.dot(h, params["w_gate_up"], preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(x.dtype)
    x = x + jnp.dot(act, params["w_down"], preferred_element_type=jnp.float32).astype(x.dtype)
    return x, k_cache, v_cache


def _config_of(x: jax.Array, w_qkv: jax.Array, k_cache: jax.Array) -> Config:
    """Recover the configuration from shapes, so ``step`` takes only arrays (jit-friendly)."""
    d_model = x.shape[-1]
    _, t, n_kv, hd = k_cache.shape
    n_heads = (w_qkv.shape[1] - 2 * n_kv * hd) // hd
    return Config(d_model, n_heads, n_kv, hd, 0, t, x.dtype)


def example_args(size: str = "small", batch: int = 1, dtype: Any = None, seed: int = 0) -> tuple:
    """Arguments for ``step``: ``(params, x, k_cache, v_cache, pos)``.

    ``"paper"`` returns ShapeDtypeStructs (Llama-3-8B, context 4096, bf16): for analysis and
    lowering only. ``"small"`` returns random arrays; ``pos`` is a traced-friendly int32 scalar.
    """
    cfg = SIZES[size]
    dt = dtype or cfg.dtype
    nqkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    shapes = {
        "attn_norm": (cfg.d_model,), "w_qkv": (cfg.d_model, nqkv), "w_o": (cfg.n_heads * cfg.head_dim, cfg.d_model),
        "mlp_norm": (cfg.d_model,), "w_gate_up": (cfg.d_model, 2 * cfg.ffn), "w_down": (cfg.ffn, cfg.d_model),
    }
    cache = (batch, cfg.context, cfg.n_kv_heads, cfg.head_dim)
    if size == "paper":
        sds = lambda s, d=dt: jax.ShapeDtypeStruct(s, d)
        params = {k: sds(s) for k, s in shapes.items()}
        return params, sds((batch, cfg.d_model)), sds(cache), sds(cache), sds((), jnp.int32)
    rng = np.random.default_rng(seed)
    arr = lambda s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dt)
    params = {k: arr(s, 1.0 if "norm" in k else s[0] ** -0.5) for k, s in shapes.items()}
    pos = jnp.int32(cfg.context // 2 + 1)
    return params, arr((batch, cfg.d_model)), arr(cache), arr(cache), pos


def attention_block_args(size: str = "small", batch: int = 1, dtype: Any = None) -> tuple:
    """Arguments for ``attention_block``: ``(h, w_qkv, k_cache, v_cache, pos)``."""
    params, x, kc, vc, pos = example_args(size, batch, dtype)
    return x, params["w_qkv"], kc, vc, pos


if __name__ == "__main__":
    args = example_args("small", batch=2)
    out, kc, vc = jax.jit(step)(*args)
    print(out.shape, kc.shape, float(jnp.abs(out).mean()))
