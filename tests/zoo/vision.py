"""Three vision blocks written with the libraries vision users reach for, applied per sample by
``jax.vmap`` inside ``step(model, x)`` (the model is the first argument: flax.nnx and equinox
modules are pytrees of arrays), each with a PRNG key made inside ``step`` for an eval-mode dropout.

* ``shufflenet`` — a ShuffleNet-v2 stride-1 unit in ``flax.nnx`` (NHWC per sample): ``jnp.split``
  of the channels, 1x1 conv → depthwise 3x3 conv (``feature_group_count``) → 1x1 conv on one half,
  ``jnp.concatenate`` with the other, channel shuffle by ``reshape`` (H, W, 2, C/2) → ``transpose``
  → ``reshape``; ``nnx.Dropout(deterministic=True)`` with ``nnx.Rngs(jax.random.PRNGKey(0))``.
* ``shufflenet_state`` — the same unit (plus eval-mode ``nnx.BatchNorm``s, whole batch at once) as
  ``nnx.split`` hands it over: ``step(state, x)`` merges it inside, and ``state`` carries the
  Dropout's ``nnx.Rngs`` stream (a typed PRNG key and a counter) next to the params.
* ``c3k2`` — a YOLOv11 C3k2-like block in ``equinox`` (CHW per sample): 1x1 conv to 2c,
  ``jnp.split`` in two, a chain of two Bottlenecks (3x3 conv, 3x3 conv, residual) on the last
  piece, each output appended, ``jnp.concatenate`` of all pieces, 1x1 conv; SiLU; an
  ``eqx.nn.Dropout(inference=True)`` with ``jax.random.PRNGKey(0)``.
* ``linattn`` — an EfficientViT LiteMLA-style ReLU linear-attention block in ``equinox``: 1x1 qkv
  conv, multi-scale aggregation (depthwise 5x5 + grouped 1x1), ``jnp.concatenate`` of scales,
  ``reshape`` to (heads, 3*dim, H*W), q/k/v by slicing, ``jnp.pad`` of v with a row of ones,
  ``k.T``, two matmuls, ``out[:-1] / out[-1:]`` slicing, ``reshape`` back to (C, H, W), 1x1
  projection, residual; an unused default key ``jax.random.key(0)`` split for a dropout.

``MODELS[name] = (step, example_args)``; the module-level ``step``/``example_args`` are the
ShuffleNet unit's. ``"paper"`` sizes are batch 16, bf16: ShuffleNet-v2 1.0x stage 2 at 224
(116 channels, 28x28), a YOLO11 C3k2 at 640 (128 channels, 80x80), EfficientViT-B1 stage 3
(128 channels, 28x28, head dim 16).
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

PAPER_BATCH = 16


# ---- ShuffleNet-v2 unit (flax.nnx) ----------------------------------------------------------

class ShuffleUnit(nnx.Module):
    def __init__(self, channels: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = channels // 2
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.pw1 = nnx.Conv(c, c, (1, 1), **kw)
        self.dw = nnx.Conv(c, c, (3, 3), padding="SAME", feature_group_count=c, **kw)
        self.pw2 = nnx.Conv(c, c, (1, 1), **kw)
        self.drop = nnx.Dropout(0.1, deterministic=True)

    def __call__(self, x, *, rngs: nnx.Rngs):          # x: (H, W, C), one sample
        x1, x2 = jnp.split(x, 2, axis=-1)
        b = nnx.relu(self.pw1(x2))
        b = self.dw(b)
        b = nnx.relu(self.pw2(b))
        b = self.drop(b, rngs=rngs)
        out = jnp.concatenate([x1, b], axis=-1)
        h, w, ch = out.shape
        out = out.reshape(h, w, 2, ch // 2).transpose(0, 1, 3, 2).reshape(h, w, ch)  # channel shuffle
        return out


def step_shufflenet(model: ShuffleUnit, x):
    rngs = nnx.Rngs(dropout=jax.random.PRNGKey(0))      # eval mode: never drawn from
    return jax.vmap(lambda xi: model(xi, rngs=rngs))(x)


def args_shufflenet(size: str = "small", seed: int = 0):
    c, hw, b, dt = {"small": (8, 6, 2, jnp.float32), "paper": (116, 28, PAPER_BATCH, jnp.bfloat16)}[size]
    if size == "paper":
        model = nnx.eval_shape(lambda: ShuffleUnit(c, dtype=dt, rngs=nnx.Rngs(seed)))
        return model, jax.ShapeDtypeStruct((b, hw, hw, c), dt)
    model = ShuffleUnit(c, dtype=dt, rngs=nnx.Rngs(seed))
    return model, jax.random.normal(jax.random.PRNGKey(seed + 1), (b, hw, hw, c), dt)


class ShuffleUnitKeyed(nnx.Module):
    """The unit as ``nnx.split`` hands it to a jitted step: eval-mode BatchNorms after each conv and
    a Dropout holding its own ``nnx.Rngs`` stream, so the *state* argument carries a typed PRNG key
    and a counter next to the params and statistics (extended-dtype graph inputs)."""

    def __init__(self, channels: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = channels // 2
        kw = dict(dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.pw1 = nnx.Conv(c, c, (1, 1), use_bias=False, **kw)
        self.bn1 = nnx.BatchNorm(c, use_running_average=True, **kw)
        self.dw = nnx.Conv(c, c, (3, 3), padding="SAME", feature_group_count=c, use_bias=False, **kw)
        self.bn2 = nnx.BatchNorm(c, use_running_average=True, **kw)
        self.pw2 = nnx.Conv(c, c, (1, 1), use_bias=False, **kw)
        self.bn3 = nnx.BatchNorm(c, use_running_average=True, **kw)
        self.drop = nnx.Dropout(0.1, deterministic=True, rngs=rngs)

    def __call__(self, x):                              # x: (B, H, W, C), the whole batch
        x1, x2 = jnp.split(x, 2, axis=-1)
        y = nnx.relu(self.bn1(self.pw1(x2)))
        y = self.bn2(self.dw(y))
        y = nnx.relu(self.bn3(self.pw2(y)))
        out = jnp.concatenate([x1, y], axis=-1)
        b, h, w, ch = out.shape
        out = jnp.swapaxes(out.reshape(b, h, w, 2, ch // 2), 3, 4).reshape(b, h, w, ch)
        return self.drop(out)


_KEYED_GRAPHDEFS: dict = {}   # (channels, dtype) -> nnx GraphDef (static structure, not an argument)


def step_shufflenet_state(state, x):
    """``nnx.merge`` of the split state inside the step (how nnx models enter ``jax.jit``)."""
    key = (x.shape[-1], jnp.dtype(x.dtype))
    if key not in _KEYED_GRAPHDEFS:
        args_shufflenet_state("small" if x.shape[-1] != 116 else "paper")
    return nnx.merge(_KEYED_GRAPHDEFS[key], state)(x)


def args_shufflenet_state(size: str = "small", seed: int = 0):
    c, hw, b, dt = {"small": (8, 6, 2, jnp.float32), "paper": (116, 28, PAPER_BATCH, jnp.bfloat16)}[size]

    def make():
        m = ShuffleUnitKeyed(c, dtype=dt, rngs=nnx.Rngs(seed))
        if size == "small":   # non-trivial eval-mode statistics
            k = jax.random.split(jax.random.PRNGKey(seed + 2), 4)
            for i, bn in enumerate((m.bn1, m.bn2, m.bn3)):
                bn.mean[...] = (0.1 * jax.random.normal(k[i], bn.mean[...].shape)).astype(dt)
                bn.var[...] = (1.0 + jax.random.uniform(k[3], bn.var[...].shape)).astype(dt)
        return m

    graphdef, state = nnx.split(make() if size == "small" else nnx.eval_shape(make))
    _KEYED_GRAPHDEFS[(c, jnp.dtype(dt))] = graphdef
    if size == "paper":
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state), \
            jax.ShapeDtypeStruct((b, hw, hw, c), dt)
    return state, jax.random.normal(jax.random.PRNGKey(seed + 1), (b, hw, hw, c), dt)


# ---- YOLOv11 C3k2-like block (equinox) ------------------------------------------------------

class ConvBNAct(eqx.Module):
    """Conv2d with the BatchNorm folded into its bias (inference export), then SiLU."""
    conv: eqx.nn.Conv2d

    def __init__(self, cin, cout, k, *, key, groups=1, dtype=jnp.float32):
        self.conv = eqx.nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, dtype=dtype, key=key)

    def __call__(self, x):
        return jax.nn.silu(self.conv(x))


class Bottleneck(eqx.Module):
    cv1: ConvBNAct
    cv2: ConvBNAct

    def __init__(self, c, *, key, dtype=jnp.float32):
        k1, k2 = jax.random.split(key)
        self.cv1 = ConvBNAct(c, c, 3, key=k1, dtype=dtype)
        self.cv2 = ConvBNAct(c, c, 3, key=k2, dtype=dtype)

    def __call__(self, x):
        return x + self.cv2(self.cv1(x))


class C3k2(eqx.Module):
    cv1: ConvBNAct
    cv2: ConvBNAct
    m: list

    def __init__(self, c1, c2, n=2, *, key, dtype=jnp.float32):
        c = c2 // 2
        keys = jax.random.split(key, n + 2)
        self.cv1 = ConvBNAct(c1, 2 * c, 1, key=keys[0], dtype=dtype)
        self.cv2 = ConvBNAct((2 + n) * c, c2, 1, key=keys[1], dtype=dtype)
        self.m = [Bottleneck(c, key=k, dtype=dtype) for k in keys[2:]]

    def __call__(self, x, *, key):                     # x: (C, H, W), one sample
        y = list(jnp.split(self.cv1(x), 2, axis=0))
        for blk in self.m:
            y.append(blk(y[-1]))
        out = self.cv2(jnp.concatenate(y, axis=0))
        return eqx.nn.Dropout(0.1, inference=True)(out, key=key)


def step_c3k2(model: C3k2, x):
    key = jax.random.PRNGKey(0)
    return jax.vmap(lambda xi: model(xi, key=key))(x)


def args_c3k2(size: str = "small", seed: int = 0):
    c, hw, b, dt = {"small": (8, 6, 2, jnp.float32), "paper": (128, 80, PAPER_BATCH, jnp.bfloat16)}[size]
    make = lambda: C3k2(c, c, key=jax.random.PRNGKey(seed), dtype=dt)  # noqa: E731
    if size == "paper":
        return eqx.filter_eval_shape(make), jax.ShapeDtypeStruct((b, c, hw, hw), dt)
    return make(), jax.random.normal(jax.random.PRNGKey(seed + 1), (b, c, hw, hw), dt)


# ---- EfficientViT LiteMLA-style linear attention (equinox) ---------------------------------

class LiteMLA(eqx.Module):
    qkv: eqx.nn.Conv2d
    agg_dw: eqx.nn.Conv2d
    agg_pw: eqx.nn.Conv2d
    proj: eqx.nn.Conv2d
    dim: int = eqx.field(static=True)

    def __init__(self, channels, dim, *, key, dtype=jnp.float32):
        heads = channels // dim
        total = heads * dim
        k = jax.random.split(key, 4)
        self.dim = dim
        self.qkv = eqx.nn.Conv2d(channels, 3 * total, 1, use_bias=False, dtype=dtype, key=k[0])
        self.agg_dw = eqx.nn.Conv2d(3 * total, 3 * total, 5, padding=2, groups=3 * total, use_bias=False,
                                    dtype=dtype, key=k[1])
        self.agg_pw = eqx.nn.Conv2d(3 * total, 3 * total, 1, groups=3 * heads, use_bias=False, dtype=dtype,
                                    key=k[2])
        self.proj = eqx.nn.Conv2d(2 * total, channels, 1, dtype=dtype, key=k[3])

    def __call__(self, x, *, key):                     # x: (C, H, W), one sample
        qkv = self.qkv(x)
        qkv = jnp.concatenate([qkv, self.agg_pw(self.agg_dw(qkv))], axis=0)
        _, h, w = qkv.shape
        d = self.dim
        qkv = qkv.reshape(-1, 3 * d, h * w)            # (heads', 3*dim, HW)
        q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
        q, k = jax.nn.relu(q), jax.nn.relu(k)
        v = jnp.pad(v, ((0, 0), (0, 1), (0, 0)), constant_values=1.0)
        vk = v.astype(jnp.float32) @ jnp.swapaxes(k, -1, -2).astype(jnp.float32)   # (heads', dim+1, dim)
        out = vk @ q.astype(jnp.float32)                                           # (heads', dim+1, HW)
        out = out[:, :-1] / (out[:, -1:] + 1e-15)
        out = out.astype(x.dtype).reshape(-1, h, w)
        _, drop_key = jax.random.split(key)
        out = eqx.nn.Dropout(0.0, inference=True)(self.proj(out), key=drop_key)
        return x + out


def step_linattn(model: LiteMLA, x):
    key = jax.random.key(0)
    return jax.vmap(lambda xi: model(xi, key=key))(x)


def args_linattn(size: str = "small", seed: int = 0):
    c, dim, hw, b, dt = {"small": (8, 4, 4, 2, jnp.float32),
                         "paper": (128, 16, 28, PAPER_BATCH, jnp.bfloat16)}[size]
    make = lambda: LiteMLA(c, dim, key=jax.random.PRNGKey(seed), dtype=dt)  # noqa: E731
    if size == "paper":
        return eqx.filter_eval_shape(make), jax.ShapeDtypeStruct((b, c, hw, hw), dt)
    return make(), jax.random.normal(jax.random.PRNGKey(seed + 1), (b, c, hw, hw), dt)


MODELS = {
    "shufflenet": (step_shufflenet, args_shufflenet),
    "shufflenet_state": (step_shufflenet_state, args_shufflenet_state),
    "c3k2": (step_c3k2, args_c3k2),
    "linattn": (step_linattn, args_linattn),
}
step, example_args = step_shufflenet, args_shufflenet
