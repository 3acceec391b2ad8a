"""Argument builders shared by the examples: paper size as ShapeDtypeStructs, small size random."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def params_and_input(shapes: Any, x_shape: tuple[int, ...], size: str, dtype: Any, seed: int,
                     vector_scale: float = 0.1) -> tuple[Any, Any]:
    """``(params, x)`` for a pytree of parameter shapes: ShapeDtypeStructs at ``"paper"`` size
    (nothing allocated), else fan-in-scaled normal weights (``vector_scale`` for 1-D ones)."""
    is_shape = lambda s: isinstance(s, tuple)  # noqa: E731
    if size == "paper":
        sds = lambda s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
        return jax.tree.map(sds, shapes, is_leaf=is_shape), sds(x_shape)
    rng = np.random.default_rng(seed)

    def arr(s: tuple[int, ...]) -> jax.Array:
        scale = int(np.prod(s[1:])) ** -0.5 if len(s) > 1 else vector_scale
        return jnp.asarray(rng.standard_normal(s) * scale, dtype)

    return jax.tree.map(arr, shapes, is_leaf=is_shape), jnp.asarray(rng.standard_normal(x_shape), dtype)
