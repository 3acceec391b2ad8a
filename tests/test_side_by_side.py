"""Sibling projections of one A operand with weights of one shape but along one dim — a layer's
``h @ wq``, ``h @ wk``, ``h @ wv`` written with three weights — as one GEMM reading the weights
side by side and writing each result where it goes (``cluster.sibling_projections``,
``ContractionMatch.side``), the pre-norm folded in. XLA merges such dots into one GEMM too, and
then copies each result out of it for a kernel that reads one. Every result is compared with
``jax.jit`` (f32 at 1e-5 of the largest value, bf16 at 2e-2)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from vtc_jax.testing import cross_lower
from tests.optimized import TOL, assert_close, eqns, optimize_kernels

B, D, T, HQ, HKV, HD = 4, 64, 8, 4, 2, 16


def _rms(x, w):
    h = x.astype(jnp.float32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)).astype(x.dtype) * w


def pure_jax(x, nw, wq, wk, wv, kc, vc, pos):
    """Meta's reference style: three weights, rows reshaped to heads, the new K/V rows written
    into the caches at ``pos``."""
    h = _rms(x, nw)
    q = (h @ wq).reshape(B, 1, HQ, HD)
    k = (h @ wk).reshape(B, 1, HKV, HD)
    v = (h @ wv).reshape(B, 1, HKV, HD)
    kc = jax.lax.dynamic_update_slice(kc, k, (0, pos, 0, 0))
    vc = jax.lax.dynamic_update_slice(vc, v, (0, pos, 0, 0))
    return q, kc, vc


def einsum_heads(x, nw, wq, wk, wv, kc, vc, pos):
    """Weights shaped by heads, ``(D, H, hd)`` (flax's ``DenseGeneral``, MaxText): the weights
    differ along the heads dim, not the last."""
    h = _rms(x, nw)   # (B, 1, D)
    q = jnp.einsum("btd,dhk->bthk", h, wq)
    k = jnp.einsum("btd,dhk->bthk", h, wk)
    v = jnp.einsum("btd,dhk->bthk", h, wv)
    kc = jax.lax.dynamic_update_slice(kc, k, (0, pos, 0, 0))
    vc = jax.lax.dynamic_update_slice(vc, v, (0, pos, 0, 0))
    return q, kc, vc


def _args(style, dtype):
    ks = jax.random.split(jax.random.PRNGKey(4), 6)
    heads = style is einsum_heads
    ws = [(D ** -0.5 * jax.random.normal(k, (D, n, HD) if heads else (D, n * HD))).astype(dtype)
          for k, n in zip(ks[1:4], (HQ, HKV, HKV))]
    cache = [jax.random.normal(k, (B, T, HKV, HD), dtype) for k in ks[4:]]
    return (jax.random.normal(ks[0], (B, 1, D) if heads else (B, D), dtype), (1 + 0.1 * jax.random.normal(ks[5], (D,))).astype(dtype),
            *ws, *cache, jnp.int32(3))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("style", [pure_jax, einsum_heads])
def test_three_projections_are_one_kernel_writing_q_and_the_cache_rows(style, dtype):
    """One kernel (the norm folded in) writes q and the new K and V rows into the caches: nothing
    else makes a row sum or a product, and the results equal jit's."""
    args = _args(style, dtype)
    fn = optimize_kernels(style)
    for o, r in zip(fn(*args), jax.jit(style)(*args)):
        assert_close(o, r, TOL[dtype])
    made = [e.primitive.name for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)]
    assert made.count("pallas_call") == 1, made
    assert not {"dot_general", "reduce_sum", "dynamic_update_slice", "concatenate", "slice"} & set(made), made


def test_side_by_side_under_vmap_and_grad():
    def proj(x, wq, wk, wv):
        return x @ wq, x @ wk, x @ wv
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    args = (jax.random.normal(ks[0], (B, D)), *(0.1 * jax.random.normal(k, (D, n)) for k, n in zip(ks[1:], (64, 32, 32))))
    fn = optimize_kernels(proj)
    for o, r in zip(fn(*args), jax.jit(proj)(*args)):
        assert_close(o, r, TOL[jnp.float32])
    made = [e.primitive.name for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)]
    assert made.count("pallas_call") == 1 and "dot_general" not in made, made
    batched = tuple(jnp.stack([a, 0.5 * a]) for a in args)
    for o, r in zip(jax.vmap(fn)(*batched), jax.vmap(jax.jit(proj))(*batched)):
        assert_close(o, r, TOL[jnp.float32])

    def loss(f):
        return lambda *a: sum(jnp.sum(jnp.tanh(t) * (i + 1)) for i, t in enumerate(f(*a)))
    for g, r in zip(jax.grad(loss(fn), argnums=(0, 1, 2))(*args), jax.grad(loss(jax.jit(proj)), argnums=(0, 1, 2))(*args)):
        assert_close(g, r, 1e-4)


def test_a_biased_projection_or_another_operand_stays_apart():
    """Qwen's biased q projection (an epilogue of its own) and a dot of another operand are not
    merged; the rest are; equal to jit's."""
    def qwen(x, y, wq, bq, wk, wv, wy):
        return x @ wq + bq, x @ wk, x @ wv, y @ wy
    ks = jax.random.split(jax.random.PRNGKey(6), 7)
    args = (jax.random.normal(ks[0], (B, D)), jax.random.normal(ks[1], (B, D)), 0.1 * jax.random.normal(ks[2], (D, 64)),
            jax.random.normal(ks[3], (64,)), 0.1 * jax.random.normal(ks[4], (D, 32)),
            0.1 * jax.random.normal(ks[5], (D, 32)), 0.1 * jax.random.normal(ks[6], (D, 32)))
    fn = optimize_kernels(qwen)
    for o, r in zip(fn(*args), jax.jit(qwen)(*args)):
        assert_close(o, r, TOL[jnp.float32])
    calls = [[tuple(v.aval.shape) for v in e.outvars] for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)
             if e.primitive.name == "pallas_call"]
    # k and v: one kernel of two results (a buffer a block straddles may be passed flattened)
    assert [c for c in calls if len(c) == 2 and sum(math.prod(x) for x in c) == 2 * B * 32], calls
    assert not [c for c in calls if (B, 64) in c and len(c) > 1], calls   # the biased q apart


def test_side_by_side_kernel_lowers_for_cuda():
    """Cross-lowered for CUDA: one Triton matmul kernel (split-K and its reduce at decode shape
    would be two) reading the three weights and writing q and the cache rows."""
    args = _args(pure_jax, jnp.bfloat16)
    mod = cross_lower(optimize_kernels(pure_jax, backend="triton"), *args)
    names = [k.name for k in mod.triton_kernels]
    assert names and all(n.startswith("vtc_matmul") for n in names), names


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_biases_and_casts_ride_side_by_side(dtype):
    """Qwen's q/k/v with a bias each, accumulated in f32 and cast back: one kernel, the biases read
    side by side in its epilogue; equal to jit's."""
    def qwen(x, wq, bq, wk, bk, wv, bv):
        f = lambda w, b: (jnp.dot(x, w, preferred_element_type=jnp.float32) + b).astype(x.dtype)  # noqa: E731
        return f(wq, bq), f(wk, bk), f(wv, bv)
    ks = jax.random.split(jax.random.PRNGKey(7), 7)
    args = [jax.random.normal(ks[0], (B, D), dtype)]
    for i, n in enumerate((64, 32, 32)):
        args += [(0.1 * jax.random.normal(ks[1 + 2 * i], (D, n))).astype(dtype), jax.random.normal(ks[2 + 2 * i], (n,))]
    fn = optimize_kernels(qwen)
    for o, r in zip(fn(*args), jax.jit(qwen)(*args)):
        assert_close(o, r, TOL[dtype])
    made = [e.primitive.name for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)]
    assert made.count("pallas_call") == 1 and not {"dot_general", "add"} & set(made), made


def test_flax_dense_projections_with_biases():
    """flax linen's ``nn.Dense`` q, k, v layers (a bias each, the default), as a model writes them."""
    import flax.linen as nn

    class QKV(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64, name="q")(x), nn.Dense(32, name="k")(x), nn.Dense(32, name="v")(x)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, D))
    params = QKV().init(jax.random.PRNGKey(2), x)
    fn = optimize_kernels(QKV().apply)
    for o, r in zip(fn(params, x), jax.jit(QKV().apply)(params, x)):
        assert_close(o, r, TOL[jnp.float32])
    made = [e.primitive.name for e in eqns(jax.make_jaxpr(fn)(params, x).jaxpr)]
    assert made.count("pallas_call") == 1 and "dot_general" not in made, made
