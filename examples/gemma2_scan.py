"""Gemma-2 decode with its layers in ``lax.scan`` and the local/global alternation as ``lax.cond``.

Gemma-2 alternates sliding-window (local) and global attention layers. Written the way scanned
models write it, the scan body picks the layer kind with ``lax.cond`` on the layer index: both
branches are whole layers, each optimised on its own by VTC (recursive control flow).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import gemma2_layer as G


def step(params: dict, x: jax.Array, k_caches: jax.Array, v_caches: jax.Array,
         pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token through all layers; even layers local (sliding window), odd layers global."""
    n = k_caches.shape[0]

    def layer(h: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
        p, kc, vc, i = xs
        h, kc, vc = lax.cond(i % 2 == 0, G.step_local, G.step_global, p, h, kc, vc, pos)
        return h, (kc, vc)

    x, (k_caches, v_caches) = lax.scan(layer, x, (params, k_caches, v_caches, jnp.arange(n)))
    return x, k_caches, v_caches


def example_args(size: str = "small", batch: int = 1, dtype: Any = None, seed: int = 0,
                 layers: int = 2) -> tuple:
    """Stacked ``layers`` copies of ``gemma2_layer.example_args``."""
    params, x, kc, vc, pos = G.example_args(size, batch=batch, dtype=dtype, seed=seed)
    stack = lambda a: (jax.ShapeDtypeStruct((layers,) + tuple(a.shape), a.dtype)   # noqa: E731
                       if isinstance(a, jax.ShapeDtypeStruct) else jnp.stack([a] * layers))
    return jax.tree.map(stack, params), x, stack(kc), stack(vc), pos
