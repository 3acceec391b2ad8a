"""Two chained ShuffleNet-v2 units (stride 1), in plain JAX (NCHW, f32).

A port of torchvision's ``InvertedResidual`` with ``stride=1`` (``torchvision/models/shufflenetv2.py``)
with BatchNorm folded into the conv biases, as inference exporters do:

    x1, x2 = split(x, 2, axis=1)                       torch ``x.chunk(2, dim=1)``
    b      = ReLU(conv1x1(x2)) → depthwise conv3x3 (no activation) → ReLU(conv1x1(.))
    out    = concat([x1, b], axis=1)
    out    = channel_shuffle(out, 2): reshape (B, 2, C/2, H, W) → transpose (0, 2, 1, 3, 4) → reshape (B, C, H, W)

``step`` runs two units back to back, so the first unit's shuffle feeds the second unit's split —
the reshape→transpose→reshape→split chain is the data movement a compiler meets between units.

Paper-size shapes: the paper's Table "Configurations of evaluated models" evaluates ShuffleNet at
resolution 224. In ShuffleNet-v2 1.0x (``stages_out_channels = [24, 116, 232, 464, 1024]``) the
first stage runs at 224/8 = 28x28 with 116 channels (conv1 stride 2, max-pool stride 2, the
stage's first unit stride 2), so its stride-1 units see (B, 116, 28, 28) and each branch works on
58 channels. ``"small"`` is 16 channels (branch 8), 8x8, f32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _common import params_and_input
from jax import lax


@dataclass(frozen=True)
class Config:
    channels: int
    height: int
    width: int
    dtype: Any
    units: int = 2


SIZES = {
    "small": Config(channels=16, height=8, width=8, dtype=jnp.float32),
    "paper": Config(channels=116, height=28, width=28, dtype=jnp.float32),
}


def conv2d(x: jax.Array, w: jax.Array, b: jax.Array, *, groups: int = 1) -> jax.Array:
    """``nn.Conv2d`` (stride 1, 'same' padding) with a folded BatchNorm bias, NCHW / OIHW."""
    kh, kw = w.shape[2], w.shape[3]
    y = lax.conv_general_dilated(x, w, window_strides=(1, 1), padding=((kh // 2, kh // 2), (kw // 2, kw // 2)),
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups)
    return y + b[None, :, None, None]


def channel_shuffle(x: jax.Array, groups: int) -> jax.Array:
    b, c, h, w = x.shape
    x = jnp.reshape(x, (b, groups, c // groups, h, w))
    x = jnp.transpose(x, (0, 2, 1, 3, 4))
    return jnp.reshape(x, (b, c, h, w))


def unit(p: dict, x: jax.Array) -> jax.Array:
    """One stride-1 ShuffleNet-v2 unit."""
    x1, x2 = jnp.split(x, 2, axis=1)
    y = jax.nn.relu(conv2d(x2, p["w1"], p["b1"]))
    y = conv2d(y, p["w_dw"], p["b_dw"], groups=y.shape[1])
    y = jax.nn.relu(conv2d(y, p["w2"], p["b2"]))
    return channel_shuffle(jnp.concatenate([x1, y], axis=1), 2)


def step(params: list, x: jax.Array) -> jax.Array:
    """The chained units on ``x`` (B, C, H, W) → (B, C, H, W)."""
    for p in params:
        x = unit(p, x)
    return x


def example_args(size: str = "small", batch: int = 1, dtype: Any = None, seed: int = 0) -> tuple:
    """Arguments for ``step``: ``(params, x)``; ``"paper"`` as ShapeDtypeStructs, ``"small"`` random."""
    cfg = SIZES[size]
    dt = dtype or cfg.dtype
    c = cfg.channels // 2
    shapes = [{"w1": (c, c, 1, 1), "b1": (c,), "w_dw": (c, 1, 3, 3), "b_dw": (c,), "w2": (c, c, 1, 1), "b2": (c,)}
              for _ in range(cfg.units)]
    xs = (batch, cfg.channels, cfg.height, cfg.width)
    return params_and_input(shapes, xs, size, dt, seed)

if __name__ == "__main__":
    args = example_args("small", batch=2)
    out = jax.jit(step)(*args)
    print(out.shape, float(jnp.abs(out).mean()))
