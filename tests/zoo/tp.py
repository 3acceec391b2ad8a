"""Tensor- and data-parallel decode layers, written the ways users shard a model (issue #22).

One decode step of a Llama-3 layer (``style="llama"``: RMSNorm, SwiGLU) or a Gemma-2-style one
(``style="gemma"``: ``(1 + w)`` RMSNorm before *and* after attention and MLP, tanh soft-capped
scores, a sliding-window causal mask, GeGLU), in three programs on a mesh of 4 host devices:

* ``megatron_gspmd`` — Megatron tensor parallelism left to GSPMD: the user device_puts the
  weights with ``NamedSharding``s over a ``model`` axis (Q/K/V, gate and up projections split by
  columns, output and down projections by rows), the caches split by KV head, and pins the heads
  with ``with_sharding_constraint``; the partitioner inserts the all-reduces.
* ``shard_map_psum`` — the same layer under ``jax.shard_map`` over ``model``: each shard sees its
  own heads and FFN columns (the code reads the local head count off the weights' shapes) and
  calls ``lax.psum`` after each row-parallel matmul itself. ``check_vma`` is jax's flag (named so
  on jax 0.10.2 and 0.12 alike: ``jax.shard_map(..., check_vma=)``).
* ``dp_cache`` — data parallel: weights replicated, batch and KV caches split over a ``data`` axis;
  the caches are donated (``DONATE``).

Movement ops: Q/K/V ``reshape`` into heads, rotate-half RoPE (``jnp.split`` + ``concatenate``),
both caches updated at ``pos`` by ``lax.dynamic_update_slice``, GQA as a ``(B, KV, G, D)`` reshape
read by ``einsum``s (no repeat), the head merge ``reshape``, and (GSPMD) sharding constraints.

``make(name, style, **kw)`` gives ``step(params, x, k_cache, v_cache, pos) -> (x, k_cache,
v_cache)``; ``example_args(name, size, style)`` gives its arguments placed with the program's
shardings (``"paper"``: ShapeDtypeStructs carrying them, Llama-3-8B / Gemma-2-9B shapes).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

DEVICES = 4
EPS = 1e-6
THETA = 500000.0
SOFTCAP = 50.0          # Gemma-2's attention logit soft-cap
PROGRAMS = ("megatron_gspmd", "shard_map_psum", "dp_cache")
STYLES = ("llama", "gemma")
DONATE = {"dp_cache": (2, 3)}   # the caches


class Cfg(NamedTuple):
    d_model: int
    n_heads: int
    n_kv: int
    head_dim: int
    ffn: int
    context: int
    batch: int
    dtype: object


SIZES = {
    "small": {s: Cfg(64, 8, 4, 8, 128, 16, 4, jnp.float32) for s in STYLES},
    "paper": {"llama": Cfg(4096, 32, 8, 128, 14336, 4096, 16, jnp.bfloat16),
              "gemma": Cfg(3584, 16, 8, 256, 14336, 4096, 16, jnp.bfloat16)},
}


def mesh(axis: str, devices=None, explicit=False) -> jax.sharding.Mesh:
    """A 1-D mesh over ``devices`` (default: the first 4; made on call: importing needs only one
    device). benchmarks/tp.py passes compile-only H100s (``offline.h100_devices``). ``explicit``:
    its axis typed Explicit (sharding in types, what ``jax.make_mesh`` makes by default)."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(np.array(devices if devices is not None else jax.devices()[:DEVICES]), (axis,),
                             axis_types=(kind,))


# ---- the layer, shared by the three programs -------------------------------------------------

def rms_norm(x, w, gemma):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)
    return (y * (1.0 + w if gemma else w)).astype(x.dtype)


def rope(x, pos):
    """Rotate-half RoPE (HF style) on (B, H, D) at one position."""
    d = x.shape[-1]
    angles = pos.astype(jnp.float32) * THETA ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def layer(p, x, k_cache, v_cache, pos, *, style, heads=lambda t: t, reduce=lambda t: t):
    """One decode step. ``heads`` pins a (B, H, D) tensor's sharding (GSPMD), ``reduce`` sums the
    row-parallel partial products (shard_map); both are identities where the program needs none.
    Head counts come from the shapes, so the same code runs on global or local shards."""
    gemma = style == "gemma"
    b, t, head_dim = x.shape[0], k_cache.shape[1], k_cache.shape[-1]
    h = rms_norm(x, p["attn_norm"], gemma)
    q = heads((h @ p["wq"]).reshape(b, -1, head_dim))
    k = heads((h @ p["wk"]).reshape(b, -1, head_dim))
    v = heads((h @ p["wv"]).reshape(b, -1, head_dim))
    q, k = rope(q, pos), rope(k, pos)
    k_cache = lax.dynamic_update_slice(k_cache, k[:, None].astype(k_cache.dtype), (0, pos, 0, 0))
    v_cache = lax.dynamic_update_slice(v_cache, v[:, None].astype(v_cache.dtype), (0, pos, 0, 0))
    n_kv = k.shape[1]
    q = q.reshape(b, n_kv, -1, head_dim)                           # (B, KV, G, D): GQA groups
    s = jnp.einsum("bkgd,btkd->bkgt", q, k_cache).astype(jnp.float32) * head_dim ** -0.5
    idx = jnp.arange(t)
    mask = idx <= pos
    if gemma:
        s = jnp.tanh(s / SOFTCAP) * SOFTCAP
        mask = mask & (idx > pos - t // 2)                         # sliding window of context/2
    s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
    probs = jax.nn.softmax(s, axis=-1).astype(v_cache.dtype)
    o = jnp.einsum("bkgt,btkd->bkgd", probs, v_cache).reshape(b, -1)
    o = reduce(o @ p["wo"])
    x = x + (rms_norm(o, p["post_attn_norm"], True) if gemma else o)
    h = rms_norm(x, p["ffn_norm"], gemma)
    act = (lambda u: jax.nn.gelu(u, approximate=True)) if gemma else jax.nn.silu
    f = reduce((act(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"])
    x = x + (rms_norm(f, p["post_ffn_norm"], True) if gemma else f)
    return x, k_cache, v_cache


# ---- shardings --------------------------------------------------------------------------------

COLUMN, ROW = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")


def specs(name, style):
    """PartitionSpecs of ``(params, x, k_cache, v_cache, pos)`` for a program."""
    norms = ("attn_norm", "ffn_norm") + (("post_attn_norm", "post_ffn_norm") if style == "gemma" else ())
    if name == "dp_cache":
        params = {k: P() for k in COLUMN + ROW + norms}
        return params, P("data", None), P("data"), P("data"), P()
    params = {**{k: P(None, "model") for k in COLUMN}, **{k: P("model", None) for k in ROW},
              **{k: P() for k in norms}}
    cache = P(None, None, "model", None)                           # (B, T, KV, D) split by KV head
    return params, P(), cache, cache, P()


def make(name, style="llama", check_vma=True, devices=None):
    """``step`` for program ``name`` (``check_vma``: shard_map_psum only) on a mesh over ``devices``."""
    if name == "megatron_gspmd":
        m = mesh("model", devices)
        heads = lambda t: lax.with_sharding_constraint(t, NamedSharding(m, P(None, "model", None)))  # noqa: E731

        def step(params, x, k_cache, v_cache, pos):
            return layer(params, x, k_cache, v_cache, pos, style=style, heads=heads)
    elif name == "shard_map_psum":
        m = mesh("model", devices)
        in_specs = specs(name, style)

        def local(params, x, k_cache, v_cache, pos):
            return layer(params, x, k_cache, v_cache, pos, style=style,
                         reduce=lambda t: lax.psum(t, "model"))

        def step(params, x, k_cache, v_cache, pos):
            return jax.shard_map(local, mesh=m, in_specs=in_specs, out_specs=(P(), in_specs[2], in_specs[3]),
                                 check_vma=check_vma)(params, x, k_cache, v_cache, pos)
    elif name == "dp_cache":
        def step(params, x, k_cache, v_cache, pos):
            return layer(params, x, k_cache, v_cache, pos, style=style)
    else:
        raise ValueError(f"program must be one of {PROGRAMS}, got {name!r}")
    step.__name__ = f"{name}_{style}"
    return step


def example_args(name="megatron_gspmd", size="small", style="llama", seed=0, place=True, devices=None,
                 explicit=False):
    """``(params, x, k_cache, v_cache, pos)`` with the program's shardings (``place=False``: on
    one device, for a shard_map to split itself)."""
    c = SIZES[size][style]
    shapes = {"attn_norm": (c.d_model,), "ffn_norm": (c.d_model,),
              "wq": (c.d_model, c.n_heads * c.head_dim), "wk": (c.d_model, c.n_kv * c.head_dim),
              "wv": (c.d_model, c.n_kv * c.head_dim), "wo": (c.n_heads * c.head_dim, c.d_model),
              "w1": (c.d_model, c.ffn), "w3": (c.d_model, c.ffn), "w2": (c.ffn, c.d_model)}
    if style == "gemma":
        shapes.update(post_attn_norm=(c.d_model,), post_ffn_norm=(c.d_model,))
    cshape = (c.batch, c.context, c.n_kv, c.head_dim)
    m = mesh("data" if name == "dp_cache" else "model", devices, explicit)
    shard = jax.tree.map(lambda s: NamedSharding(m, s), specs(name, style),
                         is_leaf=lambda s: isinstance(s, P))
    if size == "paper":
        sds = lambda sh, sg, dt=c.dtype: jax.ShapeDtypeStruct(sh, dt, sharding=sg)  # noqa: E731
        return ({k: sds(v, shard[0][k]) for k, v in shapes.items()}, sds((c.batch, c.d_model), shard[1]),
                sds(cshape, shard[2]), sds(cshape, shard[3]), sds((), shard[4], jnp.int32))
    rng = np.random.default_rng(seed)
    arr = lambda sh, sc=1.0: jnp.asarray(rng.standard_normal(sh) * sc, c.dtype)  # noqa: E731
    unit = 0.0 if style == "gemma" else 1.0                         # Gemma's norms scale by 1 + w
    params = {k: arr(v, 0.1) + unit if "norm" in k else arr(v, v[0] ** -0.5) for k, v in shapes.items()}
    args = (params, arr((c.batch, c.d_model)), arr(cshape), arr(cshape), jnp.int32(c.context // 2 + 1))
    return jax.device_put(args, shard) if place else args
