"""Llama-3 decode layer in minimal pure-JAX style (the way a reference port looks).

Movement ops: complex RoPE (reshape to (..., D/2, 2), ``lax.complex`` of two strided slices,
``.real``/``.imag`` + ``jnp.stack`` + reshape back), q/k/v ``reshape`` into heads, KV cache as a
``NamedTuple(k, v)`` updated by ``lax.dynamic_update_slice`` (k) and ``.at[:, pos].set`` (v,
a scatter), GQA by ``jnp.repeat`` (broadcast + reshape), head ``transpose``s for the score and
value einsums, output transpose + ``reshape`` merge, ``with_sharding_constraint`` calls
(identity on one device), and a position mask by ``jnp.where`` (-inf / finfo.min) or an additive
-1e30 bias. Scores are scaled by ``/ jnp.sqrt(head_dim)``.

``make_step(mask, rope)`` builds a ``step(params, x, cache, pos) -> (out, cache)`` for one mask
variant; ``step`` is the ``"where_ninf"`` one. ``"scores_nonzero"`` masks on the scores themselves
(``where(scores != 0, scores, -inf)``): a zero-initialised cache's unwritten rows score exactly 0
(its arguments: :func:`zero_tail_args`). ``rope="real"`` rotates the pairs with real cos/sin
instead of complex numbers (the control: the complex clusters have no Triton type and run in XLA).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SIZES = {
    # d_model, n_heads, n_kv_heads, head_dim, ffn, context, batch, dtype
    "small": (32, 4, 2, 8, 64, 16, 2, jnp.float32),
    "paper": (4096, 32, 8, 128, 14336, 4096, 16, jnp.bfloat16),
}
ROPE_THETA = 500000.0
EPS = 1e-5
MASKS = ("where_ninf", "where_finfo", "additive_1e30", "scores_nonzero")


class KVCache(NamedTuple):
    k: jax.Array   # (B, T, KV, D)
    v: jax.Array   # (B, T, KV, D)


def _sharding_ok() -> bool:
    try:
        s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        jax.jit(lambda a: lax.with_sharding_constraint(a, s))(jnp.ones((2, 2)))
        return True
    except Exception:   # skip the constraint where this backend rejects it
        return False


_SHARD = _sharding_ok()


def constrain(x):
    if not _SHARD:
        return x
    return lax.with_sharding_constraint(x, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def rms_norm(x, w):
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x.astype(jnp.float32) * lax.rsqrt(var + EPS)).astype(x.dtype) * w


def apply_rope(x, pos):
    """x: (B, S, H, D); rotate pairs (2i, 2i+1) as complex numbers."""
    d = x.shape[-1]
    freqs = 1.0 / (ROPE_THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = pos.astype(jnp.float32) * freqs                     # (D/2,)
    rot = jnp.exp(1j * angles).astype(jnp.complex64)
    xp = x.astype(jnp.float32).reshape(*x.shape[:-1], d // 2, 2)
    xc = lax.complex(xp[..., 0], xp[..., 1]) * rot
    out = jnp.stack([xc.real, xc.imag], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def apply_rope_real(x, pos):
    """The same rotation of adjacent pairs (2i, 2i+1) with real cos/sin: the control for the
    complex path (same movement ops around it, no complex dtype)."""
    d = x.shape[-1]
    freqs = 1.0 / (ROPE_THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = pos.astype(jnp.float32) * freqs                     # (D/2,)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xp = x.astype(jnp.float32).reshape(*x.shape[:-1], d // 2, 2)
    a, b = xp[..., 0], xp[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


ROPES = {"complex": apply_rope, "real": apply_rope_real}


def make_step(mask: str = "where_ninf", rope: str = "complex"):
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    rope_fn = ROPES[rope]

    def step(params, x, cache: KVCache, pos):
        b, d_model = x.shape
        _, t, n_kv, hd = cache.k.shape
        n_heads = params["wq"].shape[1] // hd
        h = rms_norm(x, params["attn_norm"])
        q = (h @ params["wq"]).reshape(b, 1, n_heads, hd)
        k = (h @ params["wk"]).reshape(b, 1, n_kv, hd)
        v = (h @ params["wv"]).reshape(b, 1, n_kv, hd)
        q, k = rope_fn(q, pos), rope_fn(k, pos)
        q = constrain(q)
        new_k = lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, pos, 0, 0))
        new_v = cache.v.at[:, pos].set(v[:, 0].astype(cache.v.dtype))
        cache = KVCache(new_k, new_v)
        keys = jnp.repeat(cache.k, n_heads // n_kv, axis=2)        # (B, T, H, D)
        values = jnp.repeat(cache.v, n_heads // n_kv, axis=2)
        q = q.transpose(0, 2, 1, 3)                                # (B, H, 1, D)
        keys = keys.transpose(0, 2, 1, 3)                          # (B, H, T, D)
        values = values.transpose(0, 2, 1, 3)
        scores = jnp.matmul(q, keys.transpose(0, 1, 3, 2)) / jnp.sqrt(hd).astype(q.dtype)
        scores = scores.astype(jnp.float32)
        valid = jnp.arange(t)[None, None, None, :] <= pos
        if mask == "where_ninf":
            scores = jnp.where(valid, scores, -jnp.inf)
        elif mask == "where_finfo":
            scores = jnp.where(valid, scores, jnp.finfo(scores.dtype).min)
        elif mask == "scores_nonzero":
            # ports that start from a zero cache mask what was never written by its zero score
            scores = jnp.where(scores != 0, scores, -jnp.inf)
        else:
            scores = scores + jnp.where(valid, 0.0, -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        o = jnp.matmul(probs, values)                              # (B, H, 1, D)
        o = o.transpose(0, 2, 1, 3).reshape(b, n_heads * hd)
        x = x + constrain(o @ params["wo"])
        h = rms_norm(x, params["ffn_norm"])
        ffn = (jax.nn.silu(h @ params["w1"]) * (h @ params["w3"])) @ params["w2"]
        return x + ffn, cache

    step.__name__ = f"llama_pure_{mask}" + ("" if rope == "complex" else f"_{rope}rope")
    return step


step = make_step("where_ninf")


def example_args(size: str = "small", seed: int = 0):
    """``(params, x, cache, pos)``; ``"paper"`` gives ShapeDtypeStructs (Llama-3-8B, bf16)."""
    dm, nh, nkv, hd, f, t, b, dt = SIZES[size]
    shapes = {"attn_norm": (dm,), "wq": (dm, nh * hd), "wk": (dm, nkv * hd), "wv": (dm, nkv * hd),
              "wo": (nh * hd, dm), "ffn_norm": (dm,), "w1": (dm, f), "w3": (dm, f), "w2": (f, dm)}
    cshape = (b, t, nkv, hd)
    if size == "paper":
        s = lambda sh, d=dt: jax.ShapeDtypeStruct(sh, d)  # noqa: E731
        return ({k: s(v) for k, v in shapes.items()}, s((b, dm)), KVCache(s(cshape), s(cshape)),
                s((), jnp.int32))
    rng = np.random.default_rng(seed)
    arr = lambda sh, sc=1.0: jnp.asarray(rng.standard_normal(sh) * sc, dt)  # noqa: E731
    params = {k: arr(v, 1.0 if "norm" in k else v[0] ** -0.5) for k, v in shapes.items()}
    return params, arr((b, dm)), KVCache(arr(cshape), arr(cshape)), jnp.int32(t // 2 + 1)


def zero_tail_args(size: str = "small", seed: int = 0):
    """:func:`example_args` with the cache zero from ``pos`` on (a zero-initialised cache written up
    to the previous token), the state ``"scores_nonzero"`` relies on."""
    params, x, cache, pos = example_args(size, seed)
    if size == "paper":
        return params, x, cache, pos
    keep = (jnp.arange(cache.k.shape[1]) < pos)[None, :, None, None]
    return params, x, KVCache(jnp.where(keep, cache.k, 0), jnp.where(keep, cache.v, 0)), pos
