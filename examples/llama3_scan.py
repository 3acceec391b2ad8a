"""Llama-3 decode the way production JAX runs it: layers inside ``lax.scan`` (MaxText's
scan_layers), stacked parameters and KV caches ``[L, B, T, KV, D]``, and a ``fori_loop`` that
generates several tokens around it.

``step`` is one token through every layer: the stacked caches are scanned over as ``xs`` and the
updated per-layer caches come back as ``ys`` (the common formulation; XLA then copies each layer's
cache in and out of the stacked buffer). ``generate`` runs ``step`` for ``n_tokens`` positions in a
``fori_loop`` with the caches as loop carries.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import llama3_decode as L


def step(params: dict, x: jax.Array, k_caches: jax.Array, v_caches: jax.Array,
         pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token through all layers: ``(output, new K caches, new V caches)``."""
    def layer(h: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
        p, kc, vc = xs
        h, kc, vc = L.step(p, h, kc, vc, pos)
        return h, (kc, vc)

    x, (k_caches, v_caches) = lax.scan(layer, x, (params, k_caches, v_caches))
    return x, k_caches, v_caches


def generate(params: dict, x: jax.Array, k_caches: jax.Array, v_caches: jax.Array, pos: jax.Array,
             n_tokens: int = 4) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``n_tokens`` decode steps from ``pos``; each step's output is the next step's input."""
    def body(i: jax.Array, carry: tuple) -> tuple:
        h, kc, vc = carry
        return step(params, h, kc, vc, pos + i)

    return lax.fori_loop(0, n_tokens, body, (x, k_caches, v_caches))


def example_args(size: str = "small", batch: int = 1, dtype: Any = None, seed: int = 0,
                 layers: int = 2) -> tuple:
    """Stacked ``layers`` copies of ``llama3_decode.example_args`` (arrays for "small",
    ShapeDtypeStructs for "paper")."""
    params, x, kc, vc, pos = L.example_args(size, batch=batch, dtype=dtype, seed=seed)
    stack = lambda a: (jax.ShapeDtypeStruct((layers,) + tuple(a.shape), a.dtype)   # noqa: E731
                       if isinstance(a, jax.ShapeDtypeStruct) else jnp.stack([a] * layers))
    return jax.tree.map(stack, params), x, stack(kc), stack(vc), pos
