"""A corpus of model pieces written from scratch in styles the rest of the zoo does not cover.

Used to check that vtc_jax never makes a program slower (or wrong) compared with ``jax.jit``:
``CORPUS[name](size)`` returns an :class:`Entry` — a pure ``step`` over array pytrees, its ``args``
and the ``donate_argnums`` a user would pass. ``size="small"``: tiny random arrays (fixed keys,
deterministic) for the Pallas interpreter; ``size="paper"``: ``jax.ShapeDtypeStruct`` leaves at
the sizes the model is really run at (nothing allocated; traced / compiled only).

Styles (one or more programs each): GShard one-hot MoE dispatch and a sort/scatter (MegaBlocks-like)
MoE dispatch; a Mamba selective scan and an equinox RG-LRU (Griffin) by ``associative_scan``;
ALiBi attention (Falcon-RW MQA prefill with a fused QKV ``jnp.split``, BLOOM decode with an
interleaved fused QKV and HF's ``(B*H, D, T)`` key cache); Swin window attention (flax.linen,
relative-position bias table by a precomputed index, shifted windows); a Whisper audio conv stem;
a ConvNeXt block ported from PyTorch (NCHW<->NHWC, ``weight.T``); a U-Net up block in flax.linen
(``jax.image.resize`` nearest + skip concat + conv + GroupNorm) and the classic U-Net ``Up``
(bilinear resize, ``jnp.pad`` to the skip's odd size, concat, double conv); ESPCN pixel shuffle;
two samplers (temperature + ``lax.top_k`` + top-p, and vLLM's sort / cumsum / scatter-back with
per-request parameters), both with ``jax.random.categorical`` from a key argument; a rolling KV
cache decode (``pos % window``, ``.at[].set``, separate q/k/v matmuls from one input) and a paged
KV cache decode (vLLM block table); quantised caches (MaxText-style int8 with per-token scales, an
HF-style fp8 cache repeated for GQA); LoRA attention in flax.linen; LLaVA-style sequence packing and
a DenseNet block (``jnp.pad`` + ``jnp.concatenate``); training steps by ``value_and_grad`` (a
GPT-2 in flax.nnx, a LoRA fine-tuning step); a T5 FFN with dropout by ``jax.random.bernoulli``
and a T5 encoder self-attention with its bucketed relative-position bias.

``tests/test_corpus.py`` checks every entry against ``jax.jit``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

F32, BF16 = jnp.float32, jnp.bfloat16
SEED = 20240611


@dataclass(frozen=True)
class Entry:
    step: Callable
    args: tuple
    donate_argnums: tuple[int, ...] = ()
    style: str = ""


CORPUS: dict[str, Callable[[str], Entry]] = {}


def case(f):
    CORPUS[f.__name__] = f
    return f


class _Gen:
    """Arguments for one entry: random at "small" (numpy's generator, seeded per entry and per
    call: host arrays cost no XLA compile, where each new shape drawn by ``jax.random`` compiled a
    program of its own, about a second each on a 2-core CI machine), ShapeDtypeStructs at
    "paper"."""

    def __init__(self, size: str, salt: int = 0):
        assert size in ("small", "paper"), size
        self.paper = size == "paper"
        self._n = 0
        self._salt = salt

    def _rng(self) -> np.random.Generator:
        self._n += 1
        return np.random.default_rng((SEED, self._salt, self._n))

    @staticmethod
    def _array(x: np.ndarray, dtype) -> jax.Array:
        return jnp.asarray(np.asarray(x, np.float32).astype(dtype))

    def normal(self, *shape, dtype=F32, scale=1.0):
        if self.paper:
            return jax.ShapeDtypeStruct(shape, dtype)
        return self._array(np.float32(scale) * self._rng().standard_normal(shape, np.float32), dtype)

    def w(self, fan_in, *rest, dtype=F32):
        """A weight (fan_in, *rest) scaled by 1/sqrt(fan_in)."""
        return self.normal(fan_in, *rest, dtype=dtype, scale=fan_in ** -0.5)

    def uniform(self, *shape, lo=0.0, hi=1.0, dtype=F32):
        if self.paper:
            return jax.ShapeDtypeStruct(shape, dtype)
        return self._array(self._rng().uniform(lo, hi, shape), dtype)

    def near_one(self, *shape, dtype=F32):
        """A norm's weight: 1 + N(0, 0.1)."""
        if self.paper:
            return jax.ShapeDtypeStruct(shape, dtype)
        return self._array(1.0 + np.float32(0.1) * self._rng().standard_normal(shape, np.float32), dtype)

    def ints(self, *shape, lo=0, hi=2, dtype=jnp.int32):
        if self.paper:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jnp.asarray(self._rng().integers(lo, hi, shape).astype(dtype))

    def value(self, x, dtype=None):
        """A concrete value at small size (its ShapeDtypeStruct at paper size)."""
        x = jnp.asarray(x, dtype)
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if self.paper else x

    def key(self, seed: int, typed: bool = False):
        k = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
        return jax.ShapeDtypeStruct(k.shape, k.dtype) if self.paper else k

    def init(self, fn, *args):
        """``fn(*args)`` (a module init) — abstractly at paper size; at small size as one jitted
        program (run op by op, each of an init's primitives compiled a program of its own)."""
        return jax.eval_shape(fn, *args) if self.paper else jax.jit(fn)(*args)


def _pick(size, small, paper):
    return small if size == "small" else paper


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps) * w + b


def _rms_norm(x, w, eps=1e-6):
    xf = x.astype(F32)
    return (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype) * w


def alibi_slopes(n_heads: int) -> np.ndarray:
    """BLOOM's ``build_alibi_tensor`` slopes (non-power-of-two head counts interleave a second
    geometric series of odd powers)."""
    p = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(p) - 3)))
    slopes = [base ** (i + 1) for i in range(p)]
    if p < n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * p) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(n_heads - p)]
    return np.asarray(slopes, np.float32)


# ---- 1. mixture of experts -------------------------------------------------------------------


@case
def moe_gshard_onehot_dispatch(size):
    """GShard / Switch (T5X-style): tokens in groups, top-2 router in f32, expert capacity by a
    cumsum over (choice, token) priority, one-hot (G, S, E, C) dispatch/combine tensors, experts as
    batched einsums (SwiGLU), and the Switch load-balancing loss."""
    G, S, d, f, E = _pick(size, (2, 8, 16, 32, 4), (16, 1024, 4096, 14336, 8))
    C = int(math.ceil(2 * S / E * 1.25))
    g = _Gen(size, 1)
    params = {"router": g.w(d, E, dtype=BF16),
              "wi_0": g.normal(E, d, f, dtype=BF16, scale=d ** -0.5),
              "wi_1": g.normal(E, d, f, dtype=BF16, scale=d ** -0.5),
              "wo": g.normal(E, f, d, dtype=BF16, scale=f ** -0.5)}
    x = g.normal(G, S, d, dtype=BF16)

    def step(p, x):
        logits = jnp.einsum("gsd,de->gse", x, p["router"]).astype(F32)
        probs = jax.nn.softmax(logits, axis=-1)
        gate, idx = lax.top_k(probs, 2)                                    # (G, S, 2)
        gate = gate / jnp.sum(gate, axis=-1, keepdims=True)
        mask = jax.nn.one_hot(idx, E, dtype=jnp.int32)                     # (G, S, 2, E)
        prio = mask.transpose(0, 2, 1, 3).reshape(G, 2 * S, E)            # first choices first
        slot = ((jnp.cumsum(prio, axis=1) - 1) * prio).reshape(G, 2, S, E).transpose(0, 2, 1, 3)
        slot = jnp.sum(slot, axis=-1)                                      # (G, S, 2)
        gate = gate * (slot < C)
        combine = jnp.einsum("gsk,gske,gskc->gsec", gate, mask.astype(F32),
                             jax.nn.one_hot(slot, C, dtype=F32))
        dispatch = (combine > 0).astype(x.dtype)
        xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        h = jax.nn.silu(jnp.einsum("egcd,edf->egcf", xe, p["wi_0"])) * jnp.einsum("egcd,edf->egcf", xe, p["wi_1"])
        ye = jnp.einsum("egcf,efd->egcd", h, p["wo"])
        y = jnp.einsum("gsec,egcd->gsd", combine.astype(x.dtype), ye)
        density = jnp.mean(mask[:, :, 0].astype(F32), axis=1)
        aux = jnp.mean(density * jnp.mean(probs, axis=1)) * E * E
        return y, aux

    return Entry(step, (params, x), style="GShard/Switch MoE in T5X: top-2, capacity by cumsum, one-hot einsum dispatch")


@case
def moe_sort_scatter_dispatch(size):
    """Mixtral experts with a MegaBlocks-like dispatch: top-2 per token, the (token, choice) pairs
    argsorted by expert, rank within the expert from the per-expert offsets, scattered into a
    fixed-capacity (E, C, d) buffer (overflow dropped), SwiGLU experts as batched einsums,
    gathered back and summed into the tokens by a weighted scatter-add."""
    B, S, d, f, E, K = _pick(size, (2, 6, 16, 32, 4, 2), (8, 512, 4096, 14336, 8, 2))
    T = B * S
    C = int(math.ceil(T * K / E * _pick(size, 0.75, 1.25)))   # small: some tokens overflow
    g = _Gen(size, 2)
    params = {"gate": g.w(d, E, dtype=BF16),
              "w1": g.normal(E, d, f, dtype=BF16, scale=d ** -0.5),
              "w3": g.normal(E, d, f, dtype=BF16, scale=d ** -0.5),
              "w2": g.normal(E, f, d, dtype=BF16, scale=f ** -0.5)}
    x = g.normal(B, S, d, dtype=BF16)

    def step(p, x):
        t = x.reshape(T, d)
        logits = (t @ p["gate"]).astype(F32)
        w, e = lax.top_k(logits, K)
        w = jax.nn.softmax(w, axis=-1).astype(x.dtype)
        flat_e = e.reshape(-1)
        flat_tok = jnp.repeat(jnp.arange(T), K)
        order = jnp.argsort(flat_e, stable=True)
        se, stok = flat_e[order], flat_tok[order]
        counts = jnp.sum(jax.nn.one_hot(flat_e, E, dtype=jnp.int32), axis=0)
        starts = jnp.cumsum(counts) - counts
        rank = jnp.arange(T * K) - starts[se]
        buf = jnp.zeros((E, C, d), x.dtype).at[se, rank].set(t[stok], mode="drop")
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf, p["w1"])) * jnp.einsum("ecd,edf->ecf", buf, p["w3"])
        out = jnp.einsum("ecf,efd->ecd", h, p["w2"])
        back = out.at[se, rank].get(mode="fill", fill_value=0)             # (T*K, d)
        y = jnp.zeros((T, d), x.dtype).at[stok].add(back * w.reshape(-1)[order][:, None])
        return y.reshape(B, S, d)

    return Entry(step, (params, x), style="Mixtral experts, MegaBlocks-like argsort + scatter into capacity buffers")


# ---- 2. state-space models -------------------------------------------------------------------


@case
def mamba_selective_scan(size):
    """A Mamba-1 mixer as JAX ports write it: in_proj split into x / z, causal depthwise conv1d by
    left ``jnp.pad`` + ``conv_general_dilated(feature_group_count=D)``, x_proj split into
    (dt, B, C), softplus dt, discretised A/B (B, L, D, N), the selective scan by
    ``lax.associative_scan``, C readout, D skip, SiLU gate, out_proj."""
    B, L, dm, Di, N, R, Kc = _pick(size, (2, 8, 8, 16, 4, 2, 4), (1, 2048, 2048, 4096, 16, 128, 4))
    g = _Gen(size, 3)
    p = {"in_proj": g.w(dm, 2 * Di), "conv_w": g.normal(Kc, 1, Di, scale=0.5), "conv_b": g.normal(Di, scale=0.1),
         "x_proj": g.w(Di, R + 2 * N), "dt_proj": g.w(R, Di), "dt_bias": g.normal(Di, scale=0.5),
         "A_log": g.uniform(Di, N, lo=0.0, hi=2.5), "D": g.normal(Di), "out_proj": g.w(Di, dm)}
    x = g.normal(B, L, dm)

    def step(p, x):
        xz = x @ p["in_proj"]
        xi, z = jnp.split(xz, 2, axis=-1)
        xp = jnp.pad(xi, ((0, 0), (Kc - 1, 0), (0, 0)))
        xc = lax.conv_general_dilated(xp, p["conv_w"], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"),
                                      feature_group_count=Di) + p["conv_b"]
        xc = jax.nn.silu(xc)
        dt, Bm, Cm = jnp.split(xc @ p["x_proj"], [R, R + N], axis=-1)
        dt = jax.nn.softplus(dt @ p["dt_proj"] + p["dt_bias"])            # (B, L, Di)
        A = -jnp.exp(p["A_log"])                                           # (Di, N)
        dA = jnp.exp(dt[..., None] * A)                                    # (B, L, Di, N)
        dBx = dt[..., None] * Bm[:, :, None, :] * xc[..., None]

        def combine(a, b):
            return a[0] * b[0], b[0] * a[1] + b[1]

        _, h = lax.associative_scan(combine, (dA, dBx), axis=1)
        y = jnp.einsum("bldn,bln->bld", h, Cm) + p["D"] * xc
        y = y * jax.nn.silu(z)
        return y @ p["out_proj"]

    return Entry(step, (p, x), style="Mamba-1 mixer (mamba.py / JAX ports): selective scan by lax.associative_scan")


@case
def rglru_equinox(size):
    """Griffin / RecurrentGemma's recurrent block as an equinox Module applied per sample by
    ``jax.vmap``: GELU branch, linear -> causal depthwise ``eqx.nn.Conv1d`` (C, L layout, so two
    transposes) -> RG-LRU (sigmoid gates, ``a = exp(-8 * r * softplus(Λ))``, sqrt(1 - a²)
    normalisation, ``lax.associative_scan`` over time) -> gated product -> output linear."""
    import equinox as eqx

    B, L, D = _pick(size, (2, 8, 16), (2, 2048, 2560))

    def binop(a, b):
        return a[0] * b[0], b[0] * a[1] + b[1]

    class RGLRU(eqx.Module):
        input_gate: eqx.nn.Linear
        a_gate: eqx.nn.Linear
        a_param: jax.Array

        def __init__(self, d, *, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.input_gate = eqx.nn.Linear(d, d, key=k1)
            self.a_gate = eqx.nn.Linear(d, d, key=k2)
            self.a_param = jax.random.uniform(k3, (d,), minval=0.5, maxval=2.0)

        def __call__(self, x):                      # (L, D)
            gx = jax.nn.sigmoid(jax.vmap(self.input_gate)(x))
            ga = jax.nn.sigmoid(jax.vmap(self.a_gate)(x))
            log_a = -8.0 * ga * jax.nn.softplus(self.a_param)
            a = jnp.exp(log_a)
            norm = jnp.sqrt(1.0 - jnp.exp(2.0 * log_a))
            _, h = lax.associative_scan(binop, (a, x * gx * norm), axis=0)
            return h

    class RecurrentBlock(eqx.Module):
        linear_y: eqx.nn.Linear
        linear_x: eqx.nn.Linear
        conv: eqx.nn.Conv1d
        lru: RGLRU
        linear_out: eqx.nn.Linear

        def __init__(self, d, *, key):
            k = jax.random.split(key, 5)
            self.linear_y = eqx.nn.Linear(d, d, key=k[0])
            self.linear_x = eqx.nn.Linear(d, d, key=k[1])
            self.conv = eqx.nn.Conv1d(d, d, 4, padding=((3, 0),), groups=d, key=k[2])
            self.lru = RGLRU(d, key=k[3])
            self.linear_out = eqx.nn.Linear(d, d, key=k[4])

        def __call__(self, x):                      # (L, D)
            y = jax.nn.gelu(jax.vmap(self.linear_y)(x))
            h = jax.vmap(self.linear_x)(x)
            h = self.conv(h.T).T
            h = self.lru(h)
            return jax.vmap(self.linear_out)(h * y)

    make = lambda: RecurrentBlock(D, key=jax.random.PRNGKey(3))
    g = _Gen(size, 4)
    model = eqx.filter_eval_shape(make) if g.paper else make()
    x = g.normal(B, L, D)

    def step(model, x):
        return jax.vmap(model)(x)

    return Entry(step, (model, x), style="Griffin/RecurrentGemma RG-LRU block in equinox, vmapped per sample")


# ---- 3. ALiBi --------------------------------------------------------------------------------


@case
def falcon_alibi_mqa_prefill(size):
    """Falcon-RW-style prefill: one fused ``query_key_value`` weight, ``jnp.split`` into H query
    heads and a single K/V head (multi-query), ALiBi bias ``slope_h * key_pos`` (BLOOM's slopes for
    a non-power-of-two head count), causal mask by ``finfo.min``, f32 softmax, dense out."""
    B, S, H, D = _pick(size, (2, 8, 6, 8), (2, 2048, 71, 64))
    d = H * D
    g = _Gen(size, 5)
    p = {"query_key_value": g.w(d, (H + 2) * D, dtype=BF16), "dense": g.w(d, d, dtype=BF16)}
    x = g.normal(B, S, d, dtype=BF16)
    slopes = alibi_slopes(H)

    def step(p, x):
        fused = x @ p["query_key_value"]
        q, k, v = jnp.split(fused, [H * D, (H + 1) * D], axis=-1)
        q = q.reshape(B, S, H, D)
        s = jnp.einsum("bqhd,bkd->bhqk", q, k).astype(F32) / math.sqrt(D)
        s = s + jnp.asarray(slopes)[:, None, None] * jnp.arange(S, dtype=F32)[None, None, :]
        causal = jnp.tril(jnp.ones((S, S), bool))
        s = jnp.where(causal[None, None], s, jnp.finfo(F32).min)
        probs = jax.nn.softmax(s, axis=-1).astype(x.dtype)
        o = jnp.einsum("bhqk,bkd->bqhd", probs, v).reshape(B, S, d)
        return o @ p["dense"]

    return Entry(step, (p, x), style="Falcon-RW MQA prefill with ALiBi (HF modeling_falcon), fused QKV split")


@case
def bloom_alibi_decode(size):
    """BLOOM decode as HF writes it: fused QKV reshaped (B, 1, H, 3, D) and indexed (interleaved
    per head), key cache laid out (B*H, D, T) and value cache (B*H, T, D) updated by
    ``dynamic_update_slice``, ``baddbmm``-style ``alibi + q @ k / sqrt(D)``, mask by ``finfo.min``,
    f32 softmax, merge heads, dense with bias."""
    B, T, H, D = _pick(size, (2, 16, 4, 8), (16, 2048, 32, 128))
    d = H * D
    g = _Gen(size, 6)
    p = {"qkv": g.w(d, 3 * d, dtype=BF16), "qkv_b": g.normal(3 * d, dtype=BF16, scale=0.02),
         "dense": g.w(d, d, dtype=BF16), "dense_b": g.normal(d, dtype=BF16, scale=0.02)}
    x = g.normal(B, 1, d, dtype=BF16)
    kc, vc = g.normal(B * H, D, T, dtype=BF16), g.normal(B * H, T, D, dtype=BF16)
    pos = g.value(9, jnp.int32)
    slopes = alibi_slopes(H)

    def step(p, x, k_cache, v_cache, pos):
        fused = (x @ p["qkv"] + p["qkv_b"]).reshape(B, 1, H, 3, D)
        q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
        k_cache = lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 3, 1).reshape(B * H, D, 1), (0, 0, pos))
        v_cache = lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).reshape(B * H, 1, D), (0, pos, 0))
        qh = q.transpose(0, 2, 1, 3).reshape(B * H, 1, D)
        alibi = jnp.tile(jnp.asarray(slopes)[:, None] * jnp.arange(T, dtype=F32)[None], (B, 1))[:, None, :]
        s = alibi + (qh @ k_cache).astype(F32) * (1.0 / math.sqrt(D))
        s = jnp.where(jnp.arange(T)[None, None, :] <= pos, s, jnp.finfo(F32).min)
        probs = jax.nn.softmax(s, axis=-1).astype(BF16)
        ctx = (probs @ v_cache).reshape(B, H, 1, D).transpose(0, 2, 1, 3).reshape(B, 1, d)
        return ctx @ p["dense"] + p["dense_b"], k_cache, v_cache

    return Entry(step, (p, x, kc, vc, pos), donate_argnums=(2, 3),
                 style="BLOOM decode (HF modeling_bloom): interleaved fused QKV, (B*H, D, T) key cache, ALiBi")


# ---- 4. relative-position bias ---------------------------------------------------------------


def _window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.reshape(B, H // ws, ws, W // ws, ws, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, C)


def _window_reverse(w, ws, B, H, W):
    C = w.shape[-1]
    x = w.reshape(B, H // ws, W // ws, ws, ws, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def _relative_position_index(ws):
    coords = np.stack(np.meshgrid(np.arange(ws), np.arange(ws), indexing="ij")).reshape(2, -1)
    rel = (coords[:, :, None] - coords[:, None, :]).transpose(1, 2, 0)
    rel[:, :, 0] += ws - 1
    rel[:, :, 1] += ws - 1
    rel[:, :, 0] *= 2 * ws - 1
    return rel.sum(-1)


def _shift_mask(H, W, ws, s):
    img = np.zeros((1, H, W, 1), np.float32)
    cnt = 0
    for hs in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
        for wsl in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
            img[:, hs, wsl, :] = cnt
            cnt += 1
    mw = img.reshape(1, H // ws, ws, W // ws, ws, 1).transpose(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws)
    m = mw[:, None, :] - mw[:, :, None]
    return np.where(m != 0, -100.0, 0.0).astype(np.float32)


@case
def swin_window_attention_linen(size):
    """Two Swin Transformer blocks (regular + shifted windows) in flax.linen, as the official
    code's JAX ports write them: LayerNorm, ``jnp.roll`` cyclic shift, window partition by
    reshape/transpose, fused qkv Dense + ``(B_, N, 3, h, d).transpose(2, 0, 3, 1, 4)``, a
    relative-position bias table param indexed by a precomputed numpy index, the shifted-window
    mask, window reverse, roll back, residual, MLP."""
    import flax.linen as nn

    B, Hs, C, heads, ws, shift = _pick(size, (1, 8, 8, 2, 4, 2), (16, 56, 96, 3, 7, 3))
    N = ws * ws
    rel_index = _relative_position_index(ws)
    mask = _shift_mask(Hs, Hs, ws, shift)

    class WindowAttention(nn.Module):
        dim: int
        num_heads: int

        @nn.compact
        def __call__(self, x, mask):
            B_, n, c = x.shape
            hd = c // self.num_heads
            table = self.param("relative_position_bias_table", nn.initializers.truncated_normal(0.02),
                               ((2 * ws - 1) ** 2, self.num_heads))
            qkv = nn.Dense(3 * c, name="qkv")(x).reshape(B_, n, 3, self.num_heads, hd).transpose(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            attn = (q * hd ** -0.5) @ k.swapaxes(-2, -1)
            bias = table[rel_index.reshape(-1)].reshape(n, n, -1).transpose(2, 0, 1)
            attn = attn + bias[None]
            if mask is not None:
                nw = mask.shape[0]
                attn = attn.reshape(B_ // nw, nw, self.num_heads, n, n) + jnp.asarray(mask)[None, :, None]
                attn = attn.reshape(-1, self.num_heads, n, n)
            attn = jax.nn.softmax(attn, axis=-1)
            x = (attn @ v).transpose(0, 2, 1, 3).reshape(B_, n, c)
            return nn.Dense(c, name="proj")(x)

    class SwinBlock(nn.Module):
        dim: int
        num_heads: int
        shift: int

        @nn.compact
        def __call__(self, x):                      # (B, H*W, C)
            b, L, c = x.shape
            shortcut = x
            x = nn.LayerNorm(epsilon=1e-5, name="norm1")(x).reshape(b, Hs, Hs, c)
            if self.shift:
                x = jnp.roll(x, (-self.shift, -self.shift), axis=(1, 2))
            w = WindowAttention(self.dim, self.num_heads, name="attn")(
                _window_partition(x, ws), mask if self.shift else None)
            x = _window_reverse(w, ws, b, Hs, Hs)
            if self.shift:
                x = jnp.roll(x, (self.shift, self.shift), axis=(1, 2))
            x = shortcut + x.reshape(b, L, c)
            h = nn.LayerNorm(epsilon=1e-5, name="norm2")(x)
            h = nn.Dense(4 * c, name="fc1")(h)
            h = nn.Dense(c, name="fc2")(nn.gelu(h, approximate=False))
            return x + h

    class Stage(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = SwinBlock(C, heads, 0, name="block0")(x)
            return SwinBlock(C, heads, shift, name="block1")(x)

    m = Stage()
    g = _Gen(size, 7)
    x = g.normal(B, Hs * Hs, C)
    variables = g.init(m.init, jax.random.PRNGKey(7), x)
    return Entry(lambda v, x: m.apply(v, x), (variables, x),
                 style="Swin-T stage 1 (window + shifted-window blocks) in flax.linen, relative position bias table")


# ---- 5. audio stem ---------------------------------------------------------------------------


@case
def whisper_audio_stem(size):
    """Whisper's AudioEncoder stem: conv1d(80 -> D, k3) + GELU, conv1d(D -> D, k3, stride 2) +
    GELU on a log-mel (B, 80, T) in PyTorch's NCW layout, ``permute`` to (B, T/2, D), sinusoidal
    positional embedding computed inside, the first block's LayerNorm."""
    B, T, D = _pick(size, (2, 16, 32), (16, 3000, 1280))
    g = _Gen(size, 8)
    p = {"conv1_w": g.normal(D, 80, 3, scale=(80 * 3) ** -0.5), "conv1_b": g.normal(D, scale=0.1),
         "conv2_w": g.normal(D, D, 3, scale=(D * 3) ** -0.5), "conv2_b": g.normal(D, scale=0.1),
         "ln_w": g.near_one(D), "ln_b": g.normal(D, scale=0.1)}
    mel = g.normal(B, 80, T)

    def sinusoids(length, channels, max_timescale=10000):
        inc = np.log(max_timescale) / (channels // 2 - 1)
        inv = jnp.exp(-inc * jnp.arange(channels // 2, dtype=F32))
        t = jnp.arange(length, dtype=F32)[:, None] * inv[None, :]
        return jnp.concatenate([jnp.sin(t), jnp.cos(t)], axis=1)

    def conv1d(x, w, b, stride):
        y = lax.conv_general_dilated(x, w, (stride,), [(1, 1)], dimension_numbers=("NCH", "OIH", "NCH"))
        return y + b[None, :, None]

    def step(p, mel):
        x = jax.nn.gelu(conv1d(mel, p["conv1_w"], p["conv1_b"], 1), approximate=False)
        x = jax.nn.gelu(conv1d(x, p["conv2_w"], p["conv2_b"], 2), approximate=False)
        x = x.transpose(0, 2, 1)
        x = x + sinusoids(x.shape[1], D)
        return x, _layer_norm(x, p["ln_w"], p["ln_b"])

    return Entry(step, (p, mel), style="OpenAI Whisper AudioEncoder stem (conv1d x2, GELU, permute, sinusoids)")


# ---- 6. ConvNeXt ---------------------------------------------------------------------------


@case
def convnext_block_torch_port(size):
    """A ConvNeXt block ported line by line from PyTorch: depthwise 7x7 conv in NCHW/OIHW,
    ``permute(0, 2, 3, 1)``, LayerNorm(eps=1e-6) channels-last, ``x @ pwconv1.weight.T`` (torch
    Linear layout), exact GELU, pwconv2, layer scale gamma, ``permute(0, 3, 1, 2)``, residual."""
    B, C, Hs = _pick(size, (2, 8, 8), (32, 96, 56))
    g = _Gen(size, 9)
    p = {"dwconv": {"weight": g.normal(C, 1, 7, 7, scale=1 / 7), "bias": g.normal(C, scale=0.1)},
         "norm": {"weight": g.normal(C, scale=0.2), "bias": g.normal(C, scale=0.1)},
         "pwconv1": {"weight": g.normal(4 * C, C, scale=C ** -0.5), "bias": g.normal(4 * C, scale=0.1)},
         "pwconv2": {"weight": g.normal(C, 4 * C, scale=(4 * C) ** -0.5), "bias": g.normal(C, scale=0.1)},
         "gamma": g.normal(C, scale=0.5)}
    x = g.normal(B, C, Hs, Hs)

    def step(p, x):
        inp = x
        x = lax.conv_general_dilated(x, p["dwconv"]["weight"], (1, 1), [(3, 3), (3, 3)],
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=C)
        x = x + p["dwconv"]["bias"][None, :, None, None]
        x = x.transpose(0, 2, 3, 1)
        x = _layer_norm(x, p["norm"]["weight"], p["norm"]["bias"], 1e-6)
        x = x @ p["pwconv1"]["weight"].T + p["pwconv1"]["bias"]
        x = jax.nn.gelu(x, approximate=False)
        x = x @ p["pwconv2"]["weight"].T + p["pwconv2"]["bias"]
        x = p["gamma"] * x
        x = x.transpose(0, 3, 1, 2)
        return inp + x

    return Entry(step, (p, x), style="ConvNeXt-T block, PyTorch port (NCHW<->NHWC permutes, torch Linear weights)")


# ---- 7. U-Net up blocks -----------------------------------------------------------------------


@case
def unet_up_block_linen(size):
    """A Stable-Diffusion-like decoder up step in flax.linen (NHWC): ``jax.image.resize`` nearest
    x2 + conv, ``jnp.concatenate`` with the encoder skip, a ResNet block (GroupNorm, SiLU, 3x3
    convs, 1x1 shortcut conv)."""
    import flax.linen as nn

    B, Hs, Cin, Cs, Cout, groups = _pick(size, (2, 4, 16, 8, 8, 4), (2, 32, 640, 320, 320, 32))

    class ResnetBlock(nn.Module):
        out: int

        @nn.compact
        def __call__(self, x):
            h = nn.silu(nn.GroupNorm(num_groups=groups, epsilon=1e-5)(x))
            h = nn.Conv(self.out, (3, 3), padding=((1, 1), (1, 1)))(h)
            h = nn.silu(nn.GroupNorm(num_groups=groups, epsilon=1e-5)(h))
            h = nn.Conv(self.out, (3, 3), padding=((1, 1), (1, 1)))(h)
            return nn.Conv(self.out, (1, 1), name="conv_shortcut")(x) + h

    class UpBlock(nn.Module):
        @nn.compact
        def __call__(self, x, skip):
            b, h, w, c = x.shape
            x = jax.image.resize(x, (b, 2 * h, 2 * w, c), method="nearest")
            x = nn.Conv(c, (3, 3), padding=((1, 1), (1, 1)), name="upsample_conv")(x)
            x = jnp.concatenate([x, skip], axis=-1)
            return ResnetBlock(Cout)(x)

    m = UpBlock()
    g = _Gen(size, 10)
    x, skip = g.normal(B, Hs, Hs, Cin), g.normal(B, 2 * Hs, 2 * Hs, Cs)
    variables = g.init(m.init, jax.random.PRNGKey(10), x, skip)
    return Entry(lambda v, x, skip: m.apply(v, x, skip), (variables, x, skip),
                 style="Stable-Diffusion-like UNet up block in flax.linen (resize nearest, skip concat, GroupNorm)")


@case
def unet_up_bilinear_pad(size):
    """The classic U-Net ``Up`` (milesial/Pytorch-UNet, bilinear=True) ported to JAX in NCHW:
    ``jax.image.resize`` bilinear x2, ``jnp.pad`` to the skip's (odd) size, ``concatenate([x2,
    x1], axis=1)``, DoubleConv (3x3 conv without bias, eval BatchNorm, ReLU) x2. Paper size: the
    Carvana images at scale 0.5 (479x320), up2 (59x40 -> 119x80)."""
    B, Cx, hx, wx, Cs, hs, ws_, mid, out = _pick(size, (2, 8, 3, 4, 8, 7, 8, 8, 4),
                                                (4, 256, 59, 40, 256, 119, 80, 256, 128))
    g = _Gen(size, 11)

    def bn(c):
        return {"scale": g.uniform(c, lo=0.5, hi=1.5), "shift": g.normal(c, scale=0.1)}

    p = {"w1": g.normal(mid, Cx + Cs, 3, 3, scale=(9 * (Cx + Cs)) ** -0.5), "bn1": bn(mid),
         "w2": g.normal(out, mid, 3, 3, scale=(9 * mid) ** -0.5), "bn2": bn(out)}
    x1, x2 = g.normal(B, Cx, hx, wx), g.normal(B, Cs, hs, ws_)

    def conv_bn_relu(x, w, bnp):
        y = lax.conv_general_dilated(x, w, (1, 1), [(1, 1), (1, 1)], dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return jax.nn.relu(y * bnp["scale"][None, :, None, None] + bnp["shift"][None, :, None, None])

    def step(p, x1, x2):
        b, c, h, w = x1.shape
        x1 = jax.image.resize(x1, (b, c, 2 * h, 2 * w), method="bilinear")
        dy, dx = x2.shape[2] - x1.shape[2], x2.shape[3] - x1.shape[3]
        x1 = jnp.pad(x1, ((0, 0), (0, 0), (dy // 2, dy - dy // 2), (dx // 2, dx - dx // 2)))
        x = jnp.concatenate([x2, x1], axis=1)
        x = conv_bn_relu(x, p["w1"], p["bn1"])
        return conv_bn_relu(x, p["w2"], p["bn2"])

    return Entry(step, (p, x1, x2), style="milesial Pytorch-UNet Up block port: bilinear resize, F.pad to skip, cat")


# ---- 8. pixel shuffle ------------------------------------------------------------------------


@case
def espcn_pixel_shuffle(size):
    """ESPCN super-resolution in NCHW: conv5x5 -> tanh -> conv3x3 -> tanh -> conv3x3 to
    C*r^2 channels, PyTorch's ``pixel_shuffle`` by reshape (B, C, r, r, H, W) -> transpose
    (0, 1, 4, 2, 5, 3) -> reshape (B, C, H*r, W*r), clip to [0, 1]."""
    B, Cimg, Hs, r, c1, c2 = _pick(size, (2, 3, 8, 2, 8, 4), (16, 3, 224, 3, 64, 32))
    g = _Gen(size, 12)
    p = {"w1": g.normal(c1, Cimg, 5, 5, scale=(25 * Cimg) ** -0.5), "b1": g.normal(c1, scale=0.1),
         "w2": g.normal(c2, c1, 3, 3, scale=(9 * c1) ** -0.5), "b2": g.normal(c2, scale=0.1),
         "w3": g.normal(Cimg * r * r, c2, 3, 3, scale=(9 * c2) ** -0.5), "b3": g.normal(Cimg * r * r, scale=0.1)}
    x = g.uniform(B, Cimg, Hs, Hs)

    def conv(x, w, b, pad):
        y = lax.conv_general_dilated(x, w, (1, 1), [(pad, pad), (pad, pad)], dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y + b[None, :, None, None]

    def step(p, x):
        h = jnp.tanh(conv(x, p["w1"], p["b1"], 2))
        h = jnp.tanh(conv(h, p["w2"], p["b2"], 1))
        h = conv(h, p["w3"], p["b3"], 1)
        b, crr, hh, ww = h.shape
        c = crr // (r * r)
        h = h.reshape(b, c, r, r, hh, ww).transpose(0, 1, 4, 2, 5, 3).reshape(b, c, hh * r, ww * r)
        return jnp.clip(h * 0.5 + 0.5, 0.0, 1.0)

    return Entry(step, (p, x), style="ESPCN super-resolution with PyTorch pixel_shuffle port")


# ---- 9. samplers -----------------------------------------------------------------------------


@case
def sampler_lm_head_topk_topp(size):
    """GPT-2 / HF generate style: last hidden state through the LM head (bf16), logits to f32 /
    temperature, ``lax.top_k`` (k=50), top-p over the top-k (softmax, cumsum, shifted mask),
    ``jax.random.categorical`` with a typed key split inside, token id gathered back."""
    B, d, V, K = _pick(size, (3, 32, 128, 8), (16, 4096, 128256, 50))
    g = _Gen(size, 13)
    h = g.normal(B, d, dtype=BF16)
    lm_head = g.w(d, V, dtype=BF16)
    key = g.key(13, typed=True)

    def step(h, lm_head, key, temperature=0.7, top_p=0.9):
        logits = (h @ lm_head).astype(F32) / temperature
        vals, idx = lax.top_k(logits, K)
        probs = jax.nn.softmax(vals, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        vals = jnp.where(cum - probs > top_p, -jnp.inf, vals)
        key, sub = jax.random.split(key)
        choice = jax.random.categorical(sub, vals, axis=-1)
        tok = jnp.take_along_axis(idx, choice[:, None], axis=1)[:, 0]
        return tok, key

    return Entry(step, (h, lm_head, key), style="HF/GPT-2 sampling: lm head, temperature, lax.top_k + top-p, categorical")


@case
def sampler_vllm_sort_topk_topp(size):
    """vLLM's ``_apply_top_k_top_p`` with per-request parameters: logits / temperature[b], a full
    ascending sort (``argsort`` + ``take_along_axis``), the k-th largest gathered at ``V - k[b]``,
    top-p by softmax + cumsum on the sorted row, the sorted row scattered back to vocabulary order
    (``.at[rows, idx].set``), a categorical draw from a PRNG key argument, and the sampled
    logprobs."""
    B, V = _pick(size, (4, 64), (16, 128256))
    g = _Gen(size, 14)
    logits = g.normal(B, V, scale=3.0)
    temperature = g.value([0.7, 1.0, 0.5, 1.3] * (B // 4), F32)
    top_k = g.value(([5, 60, 1, 20] if not g.paper else [50, 1000, 1, 200]) * (B // 4), jnp.int32)
    top_p = g.value([0.9, 0.5, 1.0, 0.95] * (B // 4), F32)
    key = g.key(14)

    def step(logits, temperature, top_k, top_p, key):
        logits = logits / temperature[:, None]
        idx = jnp.argsort(logits, axis=-1)
        srt = jnp.take_along_axis(logits, idx, axis=-1)
        kth = jnp.take_along_axis(srt, (V - top_k)[:, None], axis=-1)
        srt = jnp.where(srt < kth, -jnp.inf, srt)
        probs = jax.nn.softmax(srt, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        drop = (cum <= 1.0 - top_p[:, None]).at[:, -1].set(False)
        srt = jnp.where(drop, -jnp.inf, srt)
        rows = jnp.arange(B)[:, None]
        logits = jnp.zeros_like(srt).at[rows, idx].set(srt)
        tok = jax.random.categorical(key, logits, axis=-1)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        return tok, jnp.take_along_axis(logprobs, tok[:, None], axis=-1)[:, 0]

    return Entry(step, (logits, temperature, top_k, top_p, key), style="vLLM sampler: sort, top-k/top-p, scatter back, categorical")


# ---- 10. KV caches ---------------------------------------------------------------------------


def _rope_half(x, pos, theta=10000.0):
    """Rotate-half RoPE at a scalar position (x: (..., D))."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (jnp.arange(half, dtype=F32) / half)
    ang = pos.astype(F32) * inv
    c, s = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@case
def rolling_kv_decode(size):
    """Mistral's sliding-window decode with a rolling cache: separate q/k/v matmuls from the same
    normed input, rotate-half RoPE, cache rows written at ``pos % W`` by ``.at[:, slot].set``, the
    absolute position held by each slot recomputed for the mask, GQA by reshaping q into (KV, G)
    groups, f32 softmax, output projection."""
    B, W, H, KV, D = _pick(size, (2, 8, 4, 2, 8), (16, 4096, 32, 8, 128))
    d, G = H * D, H // KV
    g = _Gen(size, 15)
    p = {"norm": g.near_one(d, dtype=BF16),
         "wq": g.w(d, H * D, dtype=BF16), "wk": g.w(d, KV * D, dtype=BF16), "wv": g.w(d, KV * D, dtype=BF16),
         "wo": g.w(H * D, d, dtype=BF16)}
    x = g.normal(B, d, dtype=BF16)
    ck, cv = g.normal(B, W, KV, D, dtype=BF16), g.normal(B, W, KV, D, dtype=BF16)
    pos = g.value(_pick(size, 11, 6000), jnp.int32)

    def step(p, x, cache_k, cache_v, pos):
        h = _rms_norm(x, p["norm"], 1e-5)
        q = (h @ p["wq"]).reshape(B, H, D)
        k = (h @ p["wk"]).reshape(B, KV, D)
        v = (h @ p["wv"]).reshape(B, KV, D)
        q, k = _rope_half(q, pos), _rope_half(k, pos)
        slot = pos % W
        cache_k = cache_k.at[:, slot].set(k)
        cache_v = cache_v.at[:, slot].set(v)
        slot_pos = pos - (pos - jnp.arange(W)) % W
        valid = slot_pos >= 0
        s = jnp.einsum("bkgd,btkd->bkgt", q.reshape(B, KV, G, D), cache_k).astype(F32) / math.sqrt(D)
        s = jnp.where(valid[None, None, None], s, -jnp.inf)
        probs = jax.nn.softmax(s, axis=-1).astype(x.dtype)
        o = jnp.einsum("bkgt,btkd->bkgd", probs, cache_v).reshape(B, H * D)
        return x + o @ p["wo"], cache_k, cache_v

    return Entry(step, (p, x, ck, cv, pos), donate_argnums=(2, 3),
                 style="Mistral-7B sliding-window decode, rolling cache by pos % W and .at[].set")


@case
def int8_kv_cache_decode(size):
    """A MaxText-style decode layer over an int8 KV cache: q/k/v projections (bf16), rotate-half
    RoPE, the new K/V rows quantised per token and head (``max|x| / 127`` scales in bf16, round,
    clip, int8) and written with ``lax.dynamic_update_slice`` into the int8 caches and their scale
    caches, the caches dequantised for attention (``cache.astype(bf16) * scale``), GQA by grouping
    the query heads in the einsum, keys ``t <= pos``, f32 softmax, output projection."""
    B, T, H, KV, D = _pick(size, (2, 16, 4, 2, 8), (16, 4096, 32, 8, 128))
    d, G = H * D, H // KV
    g = _Gen(size, 31)
    p = {"wq": g.w(d, H * D, dtype=BF16), "wk": g.w(d, KV * D, dtype=BF16), "wv": g.w(d, KV * D, dtype=BF16),
         "wo": g.w(H * D, d, dtype=BF16)}
    x = g.normal(B, d, dtype=BF16)
    ck, cv = g.ints(B, T, KV, D, lo=-127, hi=128, dtype=jnp.int8), g.ints(B, T, KV, D, lo=-127, hi=128, dtype=jnp.int8)
    sk, sv = g.uniform(B, T, KV, 1, lo=0.005, hi=0.02, dtype=BF16), g.uniform(B, T, KV, 1, lo=0.005, hi=0.02, dtype=BF16)
    pos = g.value(_pick(size, 9, 3000), jnp.int32)

    def quantise(r):
        scale = (jnp.max(jnp.abs(r.astype(F32)), -1, keepdims=True) / 127.0).astype(BF16)
        q8 = jnp.clip(jnp.round(r.astype(F32) / jnp.maximum(scale.astype(F32), 1e-8)), -127, 127)
        return q8.astype(jnp.int8), scale

    def step(p, x, cache_k, cache_v, scale_k, scale_v, pos):
        q = _rope_half((x @ p["wq"]).reshape(B, H, D), pos)
        k = _rope_half((x @ p["wk"]).reshape(B, 1, KV, D), pos)
        v = (x @ p["wv"]).reshape(B, 1, KV, D)
        (k8, ks), (v8, vs) = quantise(k), quantise(v)
        cache_k = lax.dynamic_update_slice(cache_k, k8, (0, pos, 0, 0))
        cache_v = lax.dynamic_update_slice(cache_v, v8, (0, pos, 0, 0))
        scale_k = lax.dynamic_update_slice(scale_k, ks, (0, pos, 0, 0))
        scale_v = lax.dynamic_update_slice(scale_v, vs, (0, pos, 0, 0))
        kd, vd = cache_k.astype(BF16) * scale_k, cache_v.astype(BF16) * scale_v
        s = jnp.einsum("bkgd,btkd->bkgt", q.reshape(B, KV, G, D), kd).astype(F32) / math.sqrt(D)
        s = jnp.where(jnp.arange(T) <= pos, s, -jnp.inf)
        probs = jax.nn.softmax(s, axis=-1).astype(BF16)
        o = jnp.einsum("bkgt,btkd->bkgd", probs, vd).reshape(B, H * D)
        return x + o @ p["wo"], cache_k, cache_v, scale_k, scale_v

    return Entry(step, (p, x, ck, cv, sk, sv, pos), donate_argnums=(2, 3, 4, 5),
                 style="MaxText-style int8 KV cache: per-token scales, dynamic_update_slice, dequantised attention")


@case
def fp8_kv_repeat_decode(size):
    """An HF-style decode attention over an fp8 (e4m3) KV cache: the new rows cast to fp8 and
    written by ``.at[:, pos].set``, the caches cast back to bf16 and repeated for the query heads
    (``repeat_kv``: ``jnp.repeat(k, G, axis=2)``), scores ``(B, H, 1, T)`` with an additive causal
    mask of ``finfo.min``, f32 softmax."""
    B, T, H, KV, D = _pick(size, (2, 16, 4, 2, 8), (16, 4096, 32, 8, 128))
    G = H // KV
    g = _Gen(size, 32)
    q = g.normal(B, 1, H, D, dtype=BF16)
    kn, vn = g.normal(B, KV, D, dtype=BF16), g.normal(B, KV, D, dtype=BF16)
    ck, cv = g.normal(B, T, KV, D, dtype=jnp.float8_e4m3fn), g.normal(B, T, KV, D, dtype=jnp.float8_e4m3fn)
    pos = g.value(_pick(size, 12, 3500), jnp.int32)

    def step(q, k_new, v_new, cache_k, cache_v, pos):
        cache_k = cache_k.at[:, pos].set(k_new.astype(cache_k.dtype))
        cache_v = cache_v.at[:, pos].set(v_new.astype(cache_v.dtype))
        k = jnp.repeat(cache_k.astype(BF16), G, axis=2).transpose(0, 2, 1, 3)
        v = jnp.repeat(cache_v.astype(BF16), G, axis=2).transpose(0, 2, 1, 3)
        s = jnp.matmul(q.transpose(0, 2, 1, 3), k.transpose(0, 1, 3, 2)) / math.sqrt(D)
        mask = jnp.where(jnp.arange(T) <= pos, 0.0, jnp.finfo(BF16).min).astype(BF16)
        probs = jax.nn.softmax((s + mask).astype(F32), axis=-1).astype(BF16)
        o = jnp.matmul(probs, v).transpose(0, 2, 1, 3).reshape(B, 1, H * D)
        return o, cache_k, cache_v

    return Entry(step, (q, kn, vn, ck, cv, pos), donate_argnums=(3, 4),
                 style="HF-style fp8 KV cache: repeat_kv of the widened cache, additive causal mask")


@case
def paged_kv_decode(size):
    """vLLM-style paged attention decode written in JAX: the new K/V row written into
    ``pages[block_table[b, pos // page], pos % page]`` by ``.at[].set``, the keys of every sequence
    gathered through its block table (``k_pages[block_table[:, t // page], t % page]``), GQA
    scores, a per-sequence length mask, f32 softmax."""
    B, page, M, H, KV, D = _pick(size, (3, 4, 4, 4, 2, 8), (16, 16, 256, 32, 8, 128))
    P = B * M + 1
    G = H // KV
    g = _Gen(size, 16)
    q = g.normal(B, H, D, dtype=BF16)
    kn, vn = g.normal(B, KV, D, dtype=BF16), g.normal(B, KV, D, dtype=BF16)
    kp, vp = g.normal(P, page, KV, D, dtype=BF16), g.normal(P, page, KV, D, dtype=BF16)
    if g.paper:
        table, lens = jax.ShapeDtypeStruct((B, M), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
    else:
        table = jax.random.permutation(jax.random.PRNGKey(16), P)[: B * M].reshape(B, M).astype(jnp.int32)
        lens = jnp.array([5, 16, 11], jnp.int32)

    def step(q, k_new, v_new, k_pages, v_pages, block_table, seq_lens):
        pos = seq_lens - 1
        b = jnp.arange(B)
        blk = block_table[b, pos // page]
        off = pos % page
        k_pages = k_pages.at[blk, off].set(k_new)
        v_pages = v_pages.at[blk, off].set(v_new)
        t = jnp.arange(M * page)
        k = k_pages[block_table[:, t // page], t % page]                    # (B, T, KV, D)
        v = v_pages[block_table[:, t // page], t % page]
        s = jnp.einsum("bkgd,btkd->bkgt", q.reshape(B, KV, G, D), k).astype(F32) * D ** -0.5
        s = jnp.where((t[None] < seq_lens[:, None])[:, None, None], s, -jnp.inf)
        probs = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        out = jnp.einsum("bkgt,btkd->bkgd", probs, v).reshape(B, H * D)
        return out, k_pages, v_pages

    return Entry(step, (q, kn, vn, kp, vp, table, lens), donate_argnums=(3, 4),
                 style="vLLM paged KV cache decode: block-table gathers and page writes")


@case
def paged_kv_decode_layer(size):
    """The paged decode step with its rows made in the step, as a model's attention layer runs it
    over vLLM's block tables: q/k/v projections of the hidden state (bf16), RoPE-free; the new
    rows written at ``pages[block_table[b, (len[b] - 1) // page], (len[b] - 1) % page]`` (two
    tables and integer arithmetic: a nested read), the keys gathered through the block table, GQA
    scores with a per-sequence length mask, f32 softmax, the output projection."""
    B, page, M, H, KV, D, DM = _pick(size, (3, 4, 4, 4, 2, 8, 32), (16, 16, 256, 32, 8, 128, 4096))
    P = B * M + 1
    G = H // KV
    g = _Gen(size, 17)
    x = g.normal(B, DM, dtype=BF16)
    wq, wk, wv = g.w(DM, H * D, dtype=BF16), g.w(DM, KV * D, dtype=BF16), g.w(DM, KV * D, dtype=BF16)
    wo = g.w(H * D, DM, dtype=BF16)
    kp, vp = g.normal(P, page, KV, D, dtype=BF16), g.normal(P, page, KV, D, dtype=BF16)
    if g.paper:
        table, lens = jax.ShapeDtypeStruct((B, M), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
    else:
        table = jax.random.permutation(jax.random.PRNGKey(17), P)[: B * M].reshape(B, M).astype(jnp.int32)
        lens = jnp.array([5, 16, 11], jnp.int32)

    def step(x, wq, wk, wv, wo, k_pages, v_pages, block_table, seq_lens, q_precision=None):
        q = jnp.matmul(x, wq, precision=q_precision).reshape(B, KV, G, D)
        k_new, v_new = (x @ wk).reshape(B, KV, D), (x @ wv).reshape(B, KV, D)
        pos = seq_lens - 1
        blk = block_table[jnp.arange(B), pos // page]
        k_pages = k_pages.at[blk, pos % page].set(k_new)
        v_pages = v_pages.at[blk, pos % page].set(v_new)
        t = jnp.arange(M * page)
        k = k_pages[block_table[:, t // page], t % page]                    # (B, T, KV, D)
        v = v_pages[block_table[:, t // page], t % page]
        s = jnp.einsum("bkgd,btkd->bkgt", q, k).astype(F32) * D ** -0.5
        s = jnp.where((t[None] < seq_lens[:, None])[:, None, None], s, -jnp.inf)
        probs = jax.nn.softmax(s, axis=-1).astype(x.dtype)
        out = jnp.einsum("bkgt,btkd->bkgd", probs, v).reshape(B, H * D)
        return out @ wo, k_pages, v_pages

    return Entry(step, (x, wq, wk, wv, wo, kp, vp, table, lens), donate_argnums=(5, 6),
                 style="vLLM paged decode layer: rows projected in the step, written through two tables")


@case
def t5_relative_attention_linen(size):
    """A T5 encoder self-attention sublayer in flax.linen as HF's FlaxT5Attention computes it: T5's
    RMS LayerNorm, q/k/v/o ``nn.Dense`` without bias, no 1/sqrt(d) scaling, the relative-position
    bias from a learned ``(num_buckets, H)`` ``nn.Embed`` looked up by log-spaced bidirectional
    buckets of ``key - query`` (computed with jnp from iotas), added to the scores; f32 softmax,
    residual; bf16."""
    import flax.linen as nn

    B, S, H, D, nb, maxd = _pick(size, (2, 12, 4, 8, 8, 16), (8, 512, 16, 64, 32, 128))
    d = H * D

    def bucket(rel):
        n = -rel
        half = nb // 2
        ret = (n < 0).astype(jnp.int32) * half
        n = jnp.abs(n)
        exact = half // 2
        large = exact + (jnp.log(n.astype(F32) / exact + jnp.finfo(F32).eps) / math.log(maxd / exact)
                         * (half - exact)).astype(jnp.int32)
        return ret + jnp.where(n < exact, n, jnp.minimum(large, half - 1))

    class SelfAttention(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, s, _ = x.shape
            h = x.astype(F32)
            h = (h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)).astype(BF16)
            h = h * self.param("ln", nn.initializers.ones, (d,), BF16)
            dense = lambda name: nn.Dense(d, use_bias=False, dtype=BF16, param_dtype=BF16, name=name)  # noqa: E731
            q, k, v = (dense(n)(h).reshape(b, s, H, D) for n in ("q", "k", "v"))
            rel = jnp.arange(s)[None, :] - jnp.arange(s)[:, None]                       # key - query
            emb = nn.Embed(nb, H, dtype=F32, param_dtype=F32, name="relative_attention_bias")
            bias = jnp.transpose(emb(bucket(rel)), (2, 0, 1))[None]                      # (1, H, S, S)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) + bias
            probs = jax.nn.softmax(scores, axis=-1).astype(BF16)
            o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
            return x + dense("o")(o)

    m = SelfAttention()
    g = _Gen(size, 23)
    x = g.normal(B, S, d, dtype=BF16)
    variables = g.init(m.init, jax.random.PRNGKey(23), x)
    return Entry(lambda v, x: m.apply(v, x), (variables, x),
                 style="T5 encoder self-attention (HF FlaxT5): bucketed relative-position bias from an nn.Embed")


@case
def bert_padding_mask_linen(size):
    """A BERT encoder layer in flax.linen as HF's FlaxBertSelfAttention computes it, on a right-padded
    batch: an int 0/1 ``attention_mask`` expanded to ``(B, 1, 1, S)``, turned into an additive bias
    by ``lax.select(mask > 0, 0, finfo.min)``, ``nn.dot_product_attention_weights`` with that bias,
    q/k/v/o ``nn.Dense`` with biases, post-LN residuals and a GELU MLP; f32. One sequence of the
    small batch is all padding (HF outputs jax's softmax of ``s + finfo.min`` for it)."""
    import flax.linen as nn

    B, S, H, D = _pick(size, (3, 16, 4, 8), (8, 512, 12, 64))
    d = H * D

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, attention_mask):
            b, s, _ = x.shape
            q, k, v = (nn.Dense(d, name=n)(x).reshape(b, s, H, D) for n in ("query", "key", "value"))
            mask = jnp.expand_dims(attention_mask, axis=(-3, -2))
            bias = lax.select(mask > 0, jnp.full(mask.shape, 0.0, F32), jnp.full(mask.shape, jnp.finfo(F32).min, F32))
            w = nn.dot_product_attention_weights(q, k, bias=bias, dtype=F32)
            o = jnp.einsum("...hqk,...khd->...qhd", w, v).reshape(b, s, d)
            x = nn.LayerNorm(epsilon=1e-12, name="attn_ln")(x + nn.Dense(d, name="out")(o))
            h = nn.Dense(d, name="down")(nn.gelu(nn.Dense(4 * d, name="up")(x), approximate=False))
            return nn.LayerNorm(epsilon=1e-12, name="out_ln")(x + h)

    m = Layer()
    g = _Gen(size, 24)
    x = g.normal(B, S, d)
    if g.paper:
        am = jax.ShapeDtypeStruct((B, S), jnp.int32)
    else:
        am = (jnp.arange(S)[None, :] < jnp.array([S, 5, 0])[:, None]).astype(jnp.int32)
    variables = g.init(m.init, jax.random.PRNGKey(24), x, am)
    return Entry(lambda v, x, am: m.apply(v, x, am), (variables, x, am),
                 style="HF FlaxBert encoder layer: an int padding mask as an additive finfo.min bias")


# ---- 11. LoRA --------------------------------------------------------------------------------


@case
def lora_attention_linen(size):
    """A causal self-attention layer with LoRA adapters on q_proj / v_proj (peft's defaults) in
    flax.linen: ``x @ W + (x @ A) @ B * alpha / r`` as a LoRADense module, k/o as plain
    ``nn.Dense``, heads by reshape, ``nn.make_causal_mask`` + ``nn.dot_product_attention``, bf16."""
    import flax.linen as nn

    B, S, H, D, r = _pick(size, (2, 8, 4, 8, 4), (4, 2048, 32, 128, 16))
    d = H * D

    class LoRADense(nn.Module):
        features: int
        rank: int
        alpha: float = 32.0

        @nn.compact
        def __call__(self, x):
            kin = x.shape[-1]
            w = self.param("kernel", nn.initializers.lecun_normal(), (kin, self.features), BF16)
            a = self.param("lora_A", nn.initializers.normal(kin ** -0.5), (kin, self.rank), BF16)
            b = self.param("lora_B", nn.initializers.normal(0.02), (self.rank, self.features), BF16)
            return x @ w + ((x @ a) @ b) * (self.alpha / self.rank)

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, s, _ = x.shape
            q = LoRADense(d, r, name="q_proj")(x).reshape(b, s, H, D)
            k = nn.Dense(d, use_bias=False, dtype=BF16, param_dtype=BF16, name="k_proj")(x).reshape(b, s, H, D)
            v = LoRADense(d, r, name="v_proj")(x).reshape(b, s, H, D)
            mask = nn.make_causal_mask(jnp.ones((b, s), jnp.int32))
            o = nn.dot_product_attention(q, k, v, mask=mask, dtype=BF16)
            return nn.Dense(d, use_bias=False, dtype=BF16, param_dtype=BF16, name="o_proj")(o.reshape(b, s, d))

    m = Attention()
    g = _Gen(size, 17)
    x = g.normal(B, S, d, dtype=BF16)
    variables = g.init(m.init, jax.random.PRNGKey(17), x)
    return Entry(lambda v, x: m.apply(v, x), (variables, x), style="peft-style LoRA on q/v projections in flax.linen")


# ---- 12/13. padded concatenations ----------------------------------------------------------


@case
def llava_sequence_packing(size):
    """LLaVA-1.5 input merging: the vision tower's patch features through the 2-layer GELU
    projector, text embeddings by ``jnp.take`` of the (pad-containing) prompt ids before and after
    the image, ``jnp.concatenate`` [prefix, image, suffix], ``jnp.pad`` of the sequence to a
    multiple of 64 with an attention mask padded alongside, HF-style position ids by cumsum."""
    B, P, N, Q, dv, d, V = _pick(size, (2, 3, 4, 5, 8, 16, 50), (4, 35, 576, 60, 1024, 4096, 32064))
    mult = _pick(size, 8, 64)
    g = _Gen(size, 18)
    p = {"embed": g.normal(V, d, dtype=BF16, scale=0.02),
         "mm0_w": g.w(dv, d, dtype=BF16), "mm0_b": g.normal(d, dtype=BF16, scale=0.02),
         "mm2_w": g.w(d, d, dtype=BF16), "mm2_b": g.normal(d, dtype=BF16, scale=0.02)}
    pre, post = g.ints(B, P, lo=0, hi=V), g.ints(B, Q, lo=0, hi=V)
    feats = g.normal(B, N, dv, dtype=BF16)
    PAD = 0

    def step(p, pre_ids, post_ids, image_features):
        img = jax.nn.gelu(image_features @ p["mm0_w"] + p["mm0_b"]) @ p["mm2_w"] + p["mm2_b"]
        pre = jnp.take(p["embed"], pre_ids, axis=0)
        post = p["embed"][post_ids]
        seq = jnp.concatenate([pre, img, post], axis=1)
        mask = jnp.concatenate([pre_ids != PAD, jnp.ones((B, N), bool), post_ids != PAD], axis=1)
        L = seq.shape[1]
        Lp = -(-L // mult) * mult
        seq = jnp.pad(seq, ((0, 0), (0, Lp - L), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, Lp - L)))
        positions = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, 1)
        seq = jnp.where(mask[..., None], seq, 0)
        return seq, mask, positions

    return Entry(step, (p, pre, post, feats), style="LLaVA-1.5 merge of image tokens into the prompt, padded to a multiple")


@case
def densenet_block_pad_concat(size):
    """A DenseNet-121 dense block (4 layers) in NHWC: each layer reads ``jnp.concatenate`` of all
    previous feature maps, eval BatchNorm (scale/shift) + ReLU, 1x1 conv to 4*growth, BN + ReLU,
    explicit ``jnp.pad`` then a VALID 3x3 conv to ``growth``, appended to the list."""
    B, Hs, C0, gr, n = _pick(size, (2, 6, 8, 4, 3), (16, 56, 64, 32, 4))
    g = _Gen(size, 19)
    layers = []
    for i in range(n):
        c = C0 + i * gr
        layers.append({"bn1_s": g.uniform(c, lo=0.5, hi=1.5), "bn1_b": g.normal(c, scale=0.1),
                       "w1": g.normal(1, 1, c, 4 * gr, scale=c ** -0.5),
                       "bn2_s": g.uniform(4 * gr, lo=0.5, hi=1.5), "bn2_b": g.normal(4 * gr, scale=0.1),
                       "w2": g.normal(3, 3, 4 * gr, gr, scale=(36 * gr) ** -0.5)})
    x = g.normal(B, Hs, Hs, C0)
    dn = ("NHWC", "HWIO", "NHWC")

    def step(layers, x):
        feats = [x]
        for lp in layers:
            h = jnp.concatenate(feats, axis=-1)
            h = jax.nn.relu(h * lp["bn1_s"] + lp["bn1_b"])
            h = lax.conv_general_dilated(h, lp["w1"], (1, 1), "VALID", dimension_numbers=dn)
            h = jax.nn.relu(h * lp["bn2_s"] + lp["bn2_b"])
            h = jnp.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0)))
            h = lax.conv_general_dilated(h, lp["w2"], (1, 1), "VALID", dimension_numbers=dn)
            feats.append(h)
        return jnp.concatenate(feats, axis=-1)

    return Entry(step, (layers, x), style="DenseNet-121 dense block (NHWC): explicit pad + VALID conv, growing concat")


# ---- 14. training steps ---------------------------------------------------------------------


@case
def gpt2_train_step_nnx(size):
    """nanoGPT in flax.nnx, one training step: token + position ``nnx.Embed``, pre-LN blocks with a
    fused ``c_attn`` Linear split by ``jnp.split`` into q/k/v, heads by reshape/transpose, a tril
    causal mask with -inf, tanh-GELU MLP, tied LM head by ``wte.attend``, cross-entropy by
    ``log_softmax`` + ``take_along_axis``; ``nnx.value_and_grad`` returns (loss, grads)."""
    from flax import nnx

    B, S, d, H, V, nl = _pick(size, (2, 8, 32, 4, 64, 2), (8, 1024, 768, 12, 50304, 2))

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln_1 = nnx.LayerNorm(d, rngs=rngs)
            self.c_attn = nnx.Linear(d, 3 * d, rngs=rngs)
            self.c_proj = nnx.Linear(d, d, rngs=rngs)
            self.ln_2 = nnx.LayerNorm(d, rngs=rngs)
            self.c_fc = nnx.Linear(d, 4 * d, rngs=rngs)
            self.mlp_proj = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            b, t, c = x.shape
            q, k, v = jnp.split(self.c_attn(self.ln_1(x)), 3, axis=-1)
            q, k, v = (z.reshape(b, t, H, c // H).transpose(0, 2, 1, 3) for z in (q, k, v))
            att = (q @ k.swapaxes(-2, -1)) * (1.0 / math.sqrt(c // H))
            att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
            y = jax.nn.softmax(att, axis=-1) @ v
            x = x + self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, c))
            return x + self.mlp_proj(nnx.gelu(self.c_fc(self.ln_2(x)), approximate=True))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            self.wte = nnx.Embed(V, d, rngs=rngs)
            self.wpe = nnx.Embed(S, d, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(nl)])
            self.ln_f = nnx.LayerNorm(d, rngs=rngs)

        def __call__(self, idx):
            x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.wte.attend(self.ln_f(x))

    make = lambda: GPT(nnx.Rngs(19))
    g = _Gen(size, 20)
    graphdef, state = nnx.split(nnx.eval_shape(make) if g.paper else make())
    idx, tgt = g.ints(B, S, lo=0, hi=V), g.ints(B, S, lo=0, hi=V)

    def loss_fn(model, idx, tgt):
        logp = jax.nn.log_softmax(model(idx), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))

    def step(state, idx, tgt):
        model = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, idx, tgt)
        return loss, grads

    return Entry(step, (state, idx, tgt), style="nanoGPT (GPT-2 small) training step in flax.nnx, value_and_grad")


@case
def lora_finetune_train_step(size):
    """A LoRA fine-tuning step in pure JAX (frozen bf16 weights, f32 adapters cast to bf16 in the
    forward): RMSNorm, q/k/v/o each ``x @ W + (x @ A) @ B * scale``, causal attention with a
    ``finfo.min`` mask, residual, final norm, LM head, f32 cross-entropy with an ignore-index mask;
    ``jax.value_and_grad`` with respect to the adapters only."""
    B, S, H, D, r, V = _pick(size, (2, 8, 4, 8, 4, 64), (2, 1024, 32, 128, 16, 32000))
    d = H * D
    scale = 32.0 / r
    g = _Gen(size, 21)
    frozen = {"norm": g.near_one(d, dtype=BF16),
              "final_norm": g.near_one(d, dtype=BF16),
              **{n: g.w(d, d, dtype=BF16) for n in ("wq", "wk", "wv", "wo")},
              "lm_head": g.w(d, V, dtype=BF16)}
    lora = {n: {"A": g.normal(d, r, scale=d ** -0.5), "B": g.normal(r, d, scale=0.05)} for n in ("wq", "wk", "wv", "wo")}
    x = g.normal(B, S, d, dtype=BF16)
    labels = g.ints(B, S, lo=-1, hi=V)           # -1: ignored

    def proj(frozen, lora, name, h):
        a, b = lora[name]["A"].astype(BF16), lora[name]["B"].astype(BF16)
        return h @ frozen[name] + ((h @ a) @ b) * scale

    def loss_fn(lora, frozen, x, labels):
        h = _rms_norm(x, frozen["norm"])
        q = proj(frozen, lora, "wq", h).reshape(B, S, H, D)
        k = proj(frozen, lora, "wk", h).reshape(B, S, H, D)
        v = proj(frozen, lora, "wv", h).reshape(B, S, H, D)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(F32) / math.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, jnp.finfo(F32).min)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(BF16), v).reshape(B, S, d)
        h = x + proj(frozen, lora, "wo", o)
        logits = (_rms_norm(h, frozen["final_norm"]) @ frozen["lm_head"]).astype(F32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        valid = labels >= 0
        nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)

    def step(lora, frozen, x, labels):
        return jax.value_and_grad(loss_fn)(lora, frozen, x, labels)

    return Entry(step, (lora, frozen, x, labels), style="LoRA fine-tuning step (pure JAX, frozen bf16 base), value_and_grad")


# ---- random bits inside ----------------------------------------------------------------------


@case
def t5_ffn_dropout(size):
    """A T5 v1.1 feed-forward sublayer in training mode: T5's RMS LayerNorm, gated-GELU
    (wi_0, wi_1), dropout by ``jax.random.bernoulli`` on the hidden and on the output with keys
    split from a key argument, residual; bf16."""
    B, S, d, f = _pick(size, (2, 8, 16, 32), (16, 512, 1024, 2816))
    rate = 0.1
    g = _Gen(size, 22)
    p = {"ln": g.near_one(d, dtype=BF16),
         "wi_0": g.w(d, f, dtype=BF16), "wi_1": g.w(d, f, dtype=BF16), "wo": g.w(f, d, dtype=BF16)}
    x = g.normal(B, S, d, dtype=BF16)
    key = g.key(22)

    def step(p, x, key):
        k1, k2 = jax.random.split(key)
        h = _rms_norm(x, p["ln"])
        h = jax.nn.gelu(h @ p["wi_0"], approximate=True) * (h @ p["wi_1"])
        keep = jax.random.bernoulli(k1, 1.0 - rate, h.shape)
        h = jnp.where(keep, h / (1.0 - rate), 0).astype(x.dtype)
        y = h @ p["wo"]
        keep2 = jax.random.bernoulli(k2, 1.0 - rate, y.shape)
        return x + jnp.where(keep2, y / (1.0 - rate), 0).astype(x.dtype)

    return Entry(step, (p, x, key), style="T5 v1.1 gated-GELU FFN with train-mode dropout (bernoulli from a key arg)")
