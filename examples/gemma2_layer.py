"""A Gemma-2 decoder layer in decode (one new token per sequence), in plain JAX.

Written the way a model author writes it (following Hugging Face's ``Gemma2DecoderLayer``, with a
fused QKV projection as in the Llama example) so that the data-movement ops are really in the
jaxpr: split and reshape of the fused projection, KV-cache update with ``dynamic_update_slice`` at
the runtime position ``pos``, grouped-query heads repeated with broadcast+reshape, transposes into
the attention layout.

Gemma-2 specifics: RMSNorm scales by ``1 + w`` (computed in f32); four norms per layer (pre- and
post-attention, pre- and post-feed-forward); queries scaled by ``query_pre_attn_scalar ** -0.5``;
attention logits soft-capped as ``cap * tanh(s / cap)`` (cap 50); layers alternate between local
sliding-window attention and global attention; the MLP is GeGLU with tanh-approximate GELU
(``gelu_pytorch_tanh``; exact erf GELU would not lower to Triton).

``step`` is the local (sliding-window) layer, ``step_global`` the global one; ``layer(..., local=)``
takes the choice as a static keyword. ``example_args(size, batch)`` gives ``(params, x, k_cache,
v_cache, pos)``: ``"small"`` (tiny f32 arrays for CPU equivalence tests; window 8 < context 32 so
the window mask really cuts) or ``"paper"`` (Gemma-2-9B, context 4096, bf16, as ShapeDtypeStructs).

Paper-size shapes come from Gemma-2-9B's ``config.json``: hidden_size 3584, num_attention_heads 16,
num_key_value_heads 8, head_dim 256 (so the query width 16*256 = 4096 differs from d_model),
intermediate_size 14336, query_pre_attn_scalar 256, sliding_window 4096, attn_logit_softcapping
50.0, rms_norm_eps 1e-6, rope_theta 10000; the context length 4096 and bf16 are the paper's Table
"Configurations of evaluated models". With context 4096 and window 4096 the window mask is
all-true at paper size but still in the graph, as in the real model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import llama3_decode  # the fused QKV projection, RoPE and cache update are Llama's, unchanged
from llama3_decode import _update, rope


@dataclass(frozen=True)
class Config:
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    context: int
    dtype: Any
    window: int = 4096                  # sliding_window
    query_pre_attn_scalar: float = 256.0
    softcap: float = 50.0               # attn_logit_softcapping
    eps: float = 1e-6
    rope_theta: float = 10000.0


SIZES = {
    "small": Config(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, context=32, dtype=jnp.float32,
                    window=8, query_pre_attn_scalar=16.0),
    "paper": Config(d_model=3584, n_heads=16, n_kv_heads=8, head_dim=256, ffn=14336, context=4096,
                    dtype=jnp.bfloat16),
}


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: normalise in f32, scale by ``1 + w``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def _qkv(cfg: Config, w_qkv: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return llama3_decode._qkv(cfg, {"w_qkv": w_qkv}, h)


def _attend(cfg: Config, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array,
            local: bool) -> jax.Array:
    """GQA decode attention with logit soft-capping; causal mask, plus the sliding window if ``local``."""
    b, t = k_cache.shape[0], k_cache.shape[1]
    g = cfg.n_heads // cfg.n_kv_heads
    k = jnp.broadcast_to(k_cache[:, :, :, None, :], (b, t, cfg.n_kv_heads, g, cfg.head_dim))
    k = k.reshape(b, t, cfg.n_heads, cfg.head_dim)
    v = jnp.broadcast_to(v_cache[:, :, :, None, :], (b, t, cfg.n_kv_heads, g, cfg.head_dim))
    v = v.reshape(b, t, cfg.n_heads, cfg.head_dim)
    q = jnp.transpose(q, (0, 2, 1, 3))            # (B, H, 1, D)
    k = jnp.transpose(k, (0, 2, 3, 1))            # (B, H, D, T)
    v = jnp.transpose(v, (0, 2, 1, 3))            # (B, H, T, D)
    s = jnp.matmul(q, k, preferred_element_type=jnp.float32) * (cfg.query_pre_attn_scalar ** -0.5)
    s = cfg.softcap * jnp.tanh(s / cfg.softcap)
    idx = jnp.arange(t)
    mask = idx <= pos
    if local:
        mask = mask & (idx > pos - cfg.window)
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.matmul(p, v, preferred_element_type=jnp.float32).astype(q.dtype)  # (B, H, 1, D)
    return jnp.transpose(o, (0, 2, 1, 3)).reshape(b, cfg.n_heads * cfg.head_dim)


def layer(params: dict, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array, pos: jax.Array, *,
          local: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One Gemma-2 decoder layer for one new token per sequence: (output, new K cache, new V cache).

    ``local`` (static) picks sliding-window attention (even layers of Gemma-2) or global attention.
    """
    cfg = _config_of(x, params["w_qkv"], params["w_down"], k_cache)
    h = rms_norm(x, params["input_norm"], cfg.eps)
    q, k, v = _qkv(cfg, params["w_qkv"], h)
    q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
    k_cache, v_cache = _update(k_cache, k, pos), _update(v_cache, v, pos)
    attn = _attend(cfg, q, k_cache, v_cache, pos, local)
    attn = jnp.dot(attn, params["w_o"], preferred_element_type=jnp.float32).astype(x.dtype)
    x = x + rms_norm(attn, params["post_attn_norm"], cfg.eps)
    h = rms_norm(x, params["pre_ffn_norm"], cfg.eps)
    gate_up = jnp.dot(h, params["w_gate_up"], preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    act = (jax.nn.gelu(gate, approximate=True) * up).astype(x.dtype)
    mlp = jnp.dot(act, params["w_down"], preferred_element_type=jnp.float32).astype(x.dtype)
    x = x + rms_norm(mlp, params["post_ffn_norm"], cfg.eps)
    return x, k_cache, v_cache


def step_local(params: dict, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
               pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The local (sliding-window) Gemma-2 layer."""
    return layer(params, x, k_cache, v_cache, pos, local=True)


def step_global(params: dict, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The global-attention Gemma-2 layer."""
    return layer(params, x, k_cache, v_cache, pos, local=False)


def step(params: dict, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
         pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The workload: the local sliding-window layer (same as ``step_local``)."""
    return layer(params, x, k_cache, v_cache, pos, local=True)


def _config_of(x: jax.Array, w_qkv: jax.Array, w_down: jax.Array, k_cache: jax.Array) -> Config:
    """Recover the configuration from shapes, so the step functions take only arrays (jit-friendly).

    The constants no shape carries (window, query scalar, soft-cap) come from the ``SIZES`` entry of
    the same width and head size, or Gemma-2-9B's values otherwise.
    """
    d_model = x.shape[-1]
    _, t, n_kv, hd = k_cache.shape
    n_heads = (w_qkv.shape[1] - 2 * n_kv * hd) // hd
    shape = dict(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, ffn=w_down.shape[0],
                 context=t, dtype=x.dtype)
    for cfg in SIZES.values():
        if cfg.d_model == d_model and cfg.head_dim == hd:
            return dataclasses.replace(cfg, **shape)
    return Config(**shape)


_PARAM_SHAPES = {
    "input_norm": lambda c: (c.d_model,),
    "w_qkv": lambda c: (c.d_model, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim),
    "w_o": lambda c: (c.n_heads * c.head_dim, c.d_model),
    "post_attn_norm": lambda c: (c.d_model,),
    "pre_ffn_norm": lambda c: (c.d_model,),
    "w_gate_up": lambda c: (c.d_model, 2 * c.ffn),
    "w_down": lambda c: (c.ffn, c.d_model),
    "post_ffn_norm": lambda c: (c.d_model,),
}


def example_args(size: str = "small", batch: int = 1, dtype: Any = None, seed: int = 0) -> tuple:
    """Arguments for ``step`` / ``step_global``: ``(params, x, k_cache, v_cache, pos)``.

    ``"paper"`` returns ShapeDtypeStructs (Gemma-2-9B, context 4096, bf16): for analysis and
    lowering only. ``"small"`` returns random arrays; ``pos`` is an int32 scalar past the window.
    """
    cfg = SIZES[size]
    dt = dtype or cfg.dtype
    shapes = {k: f(cfg) for k, f in _PARAM_SHAPES.items()}
    cache = (batch, cfg.context, cfg.n_kv_heads, cfg.head_dim)
    if size == "paper":
        sds = lambda s, d=dt: jax.ShapeDtypeStruct(s, d)
        params = {k: sds(s) for k, s in shapes.items()}
        return params, sds((batch, cfg.d_model)), sds(cache), sds(cache), sds((), jnp.int32)
    rng = np.random.default_rng(seed)
    arr = lambda s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dt)
    # Norm weights are offsets from 1 (Gemma stores w with the scale 1 + w).
    params = {k: arr(s, 0.1 if "norm" in k else s[0] ** -0.5) for k, s in shapes.items()}
    pos = jnp.int32(cfg.context // 2 + 1)
    return params, arr((batch, cfg.d_model)), arr(cache), arr(cache), pos


if __name__ == "__main__":
    args = example_args("small", batch=2)
    for fn in (step_local, step_global):
        out, kc, vc = jax.jit(fn)(*args)
        print(fn.__name__, out.shape, kc.shape, float(jnp.abs(out).mean()))
