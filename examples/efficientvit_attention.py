"""EfficientViT-B's attention block — lightweight multi-scale linear attention (LiteMLA) — in plain JAX.

A line-by-line port of ``LiteMLA.forward`` / ``relu_linear_att`` from the official repository
(mit-han-lab/efficientvit, ``efficientvit/models/nn/ops.py``), NCHW like the PyTorch original, so
that its data-movement ops are really in the jaxpr:

    qkv   = 1x1 conv (no bias, no norm)                           (B, 3T, H, W),   T = heads * dim
    multi-scale aggregation per scale: depthwise kxk conv (groups = 3T), then grouped 1x1 conv
          (groups = 3 * heads)
    concat [qkv, aggregated...] along channels                    (B, 3T * (1 + len(scales)), H, W)
    reshape into heads                                            (B, heads', 3 * dim, H*W)
    slice q / k / v along the 3*dim axis, ReLU kernel on q and k
    pad v with a row of ones (the normaliser trick)               (B, heads', dim + 1, H*W)
    vk  = v @ kᵀ                                                  (B, heads', dim + 1, dim)
    out = vk @ q                                                  (B, heads', dim + 1, H*W)
    out = out[:, :, :-1] / (out[:, :, -1:] + eps)
    reshape back to (B, T * (1 + len(scales)), H, W), projection 1x1 conv (BatchNorm folded into its bias)

(The two matmuls are the official code's ``v kᵀ`` then ``(v kᵀ) q``: the transpose of ``kᵀ v`` then
``q (kᵀ v)``, the same linear attention written channels-first.) The block is the context module
of an ``EfficientViTBlock``; its residual add lives outside ``LiteMLA`` and is not included.

Paper-size shapes: EfficientViT-B1's last stage (width 256, ``dim=16`` so 16 heads, scales (5,)):
input (B, 256, 64, 64) — the paper's Table "Configurations of evaluated models" gives
"Resolution: 4096", taken here as a 64x64 = 4096-token feature map at the block; f32 ("TF32" on
the GPU). qkv 256→768 channels, aggregated branch 768, concat 1536, 32 heads' of 48 rows each,
projection 512→256. ``"small"`` is 16 channels, ``dim=4``, 8x8, f32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from _common import params_and_input
from jax import lax


EPS = 1e-15   # LiteMLA's eps for the normaliser


@dataclass(frozen=True)
class Config:
    channels: int        # in_channels == out_channels in EfficientViT's stages
    dim: int             # per-head dim; heads = channels // dim
    height: int
    width: int
    dtype: Any
    scales: tuple[int, ...] = (5,)

    @property
    def heads(self) -> int:
        return self.channels // self.dim

    @property
    def total_dim(self) -> int:
        return self.heads * self.dim


SIZES = {
    "small": Config(channels=16, dim=4, height=8, width=8, dtype=jnp.float32),
    "paper": Config(channels=256, dim=16, height=64, width=64, dtype=jnp.float32),
}


def conv2d(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, groups: int = 1) -> jax.Array:
    """PyTorch-style ``nn.Conv2d`` (stride 1, 'same' padding for odd kernels), NCHW / OIHW."""
    kh, kw = w.shape[2], w.shape[3]
    y = lax.conv_general_dilated(x, w, window_strides=(1, 1), padding=((kh // 2, kh // 2), (kw // 2, kw // 2)),
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups)
    return y if b is None else y + b[None, :, None, None]


def relu_linear_att(qkv: jax.Array, dim: int, eps: float) -> jax.Array:
    b, _, h, w = qkv.shape
    qkv = jnp.reshape(qkv, (b, -1, 3 * dim, h * w))
    q, k, v = qkv[:, :, 0:dim], qkv[:, :, dim:2 * dim], qkv[:, :, 2 * dim:]
    q = jax.nn.relu(q)
    k = jax.nn.relu(k)
    trans_k = jnp.swapaxes(k, -1, -2)
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 1), (0, 0)), mode="constant", constant_values=1)
    vk = jnp.matmul(v, trans_k)
    out = jnp.matmul(vk, q)
    out = out[:, :, :-1] / (out[:, :, -1:] + eps)
    return jnp.reshape(out, (b, -1, h, w))


def step(params: dict, x: jax.Array) -> jax.Array:
    """LiteMLA on ``x`` (B, C, H, W) → (B, C, H, W)."""
    total3 = params["w_qkv"].shape[0]
    dim = params["aggreg"][0]["w_pw"].shape[1]        # grouped 1x1: in-channels per group = dim
    heads = total3 // (3 * dim)
    qkv = conv2d(x, params["w_qkv"])
    multi_scale_qkv = [qkv]
    for op in params["aggreg"]:
        y = conv2d(qkv, op["w_dw"], groups=total3)
        multi_scale_qkv.append(conv2d(y, op["w_pw"], groups=3 * heads))
    qkv = jnp.concatenate(multi_scale_qkv, axis=1)
    out = relu_linear_att(qkv, dim, EPS)
    return conv2d(out, params["w_proj"], params["b_proj"])


def example_args(size: str = "small", batch: int = 1, dtype: Any = None, seed: int = 0) -> tuple:
    """Arguments for ``step``: ``(params, x)``; ``"paper"`` as ShapeDtypeStructs, ``"small"`` random."""
    cfg = SIZES[size]
    dt = dtype or cfg.dtype
    t3 = 3 * cfg.total_dim
    shapes = {
        "w_qkv": (t3, cfg.channels, 1, 1),
        "aggreg": [{"w_dw": (t3, 1, s, s), "w_pw": (t3, cfg.dim, 1, 1)} for s in cfg.scales],
        "w_proj": (cfg.channels, cfg.total_dim * (1 + len(cfg.scales)), 1, 1),
        "b_proj": (cfg.channels,),
    }
    xs = (batch, cfg.channels, cfg.height, cfg.width)
    return params_and_input(shapes, xs, size, dt, seed, vector_scale=10 ** -0.5)

if __name__ == "__main__":
    args = example_args("small", batch=2)
    out = jax.jit(step)(*args)
    print(out.shape, float(jnp.abs(out).mean()))
