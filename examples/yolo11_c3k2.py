"""YOLOv11n's C3k2 block, in plain JAX (NCHW, f32).

A port of Ultralytics' ``C3k2`` (``ultralytics/nn/modules/block.py``; ``C2f.forward`` with
``Bottleneck`` children since ``c3k=False``) with every ``Conv`` = conv + BatchNorm + SiLU and the
BatchNorm folded into the conv bias, as inference exporters do:

    y      = SiLU(cv1(x))                        1x1 conv, c1 → 2c                 (Y in the paper's Fig.)
    a, b   = split(y, 2, axis=1)                 torch ``.chunk(2, 1)``
    for each of the n bottlenecks:               (on the last chunk, shortcut=True)
        h  = SiLU(conv3x3(b_last)), c → c/2
        c_ = b_last + SiLU(conv3x3(h)), c/2 → c
    out    = SiLU(cv2(concat([a, b, c_...], axis=1)))   1x1 conv, (2 + n)c → c2

Paper-size shapes: the paper's Table "Configurations of evaluated models" evaluates YOLOv11n at
resolution 640. In ``yolo11.yaml`` the first C3k2 (layer 2, ``[-1, 2, C3k2, [256, False, 0.25]]``)
sits at the P2/4 level: 640/4 = 160x160. With the "n" scale (depth 0.50, width 0.25) its input is
layer 1's 32 channels, c2 = 256*0.25 = 64, e = 0.25 so c = 16 hidden channels per chunk, and
n = round(2*0.5) = 1 bottleneck (hidden 8 channels, e=0.5). So x is (B, 32, 160, 160), the split
halves a, b are (B, 16, 160, 160) (the paper's "16x160x160" contiguous chunks at batch 16), the
concat is (B, 48, 160, 160) and the output (B, 64, 160, 160). ``"small"`` is 8 → 16 channels
(c = 4, bottleneck hidden 2), 8x8, f32.
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
    c1: int              # input channels
    c2: int              # output channels
    height: int
    width: int
    dtype: Any
    n: int = 1           # bottlenecks
    e: float = 0.25      # hidden ratio: c = int(c2 * e)

    @property
    def c(self) -> int:
        return int(self.c2 * self.e)


SIZES = {
    "small": Config(c1=8, c2=16, height=8, width=8, dtype=jnp.float32),
    "paper": Config(c1=32, c2=64, height=160, width=160, dtype=jnp.float32),
}


def conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """Ultralytics ``Conv`` at inference: conv (stride 1, 'same' padding) with folded BN bias, then SiLU."""
    kh, kw = w.shape[2], w.shape[3]
    y = lax.conv_general_dilated(x, w, window_strides=(1, 1), padding=((kh // 2, kh // 2), (kw // 2, kw // 2)),
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return jax.nn.silu(y + b[None, :, None, None])


def bottleneck(p: dict, x: jax.Array) -> jax.Array:
    """``Bottleneck(c, c, shortcut=True, k=(3, 3), e=0.5)``."""
    return x + conv(conv(x, p["w1"], p["b1"]), p["w2"], p["b2"])


def step(params: dict, x: jax.Array) -> jax.Array:
    """C3k2 on ``x`` (B, c1, H, W) → (B, c2, H, W)."""
    y = list(jnp.split(conv(x, params["w_cv1"], params["b_cv1"]), 2, axis=1))
    y.extend(bottleneck(p, y[-1]) for p in params["m"])
    return conv(jnp.concatenate(y, axis=1), params["w_cv2"], params["b_cv2"])


def example_args(size: str = "small", batch: int = 1, dtype: Any = None, seed: int = 0) -> tuple:
    """Arguments for ``step``: ``(params, x)``; ``"paper"`` as ShapeDtypeStructs, ``"small"`` random."""
    cfg = SIZES[size]
    dt = dtype or cfg.dtype
    c, h = cfg.c, cfg.c // 2
    shapes = {
        "w_cv1": (2 * c, cfg.c1, 1, 1), "b_cv1": (2 * c,),
        "m": [{"w1": (h, c, 3, 3), "b1": (h,), "w2": (c, h, 3, 3), "b2": (c,)} for _ in range(cfg.n)],
        "w_cv2": (cfg.c2, (2 + cfg.n) * c, 1, 1), "b_cv2": (cfg.c2,),
    }
    xs = (batch, cfg.c1, cfg.height, cfg.width)
    return params_and_input(shapes, xs, size, dt, seed)

if __name__ == "__main__":
    args = example_args("small", batch=2)
    out = jax.jit(step)(*args)
    print(out.shape, float(jnp.abs(out).mean()))
