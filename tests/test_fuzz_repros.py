"""Minimal reproductions of the failures the widened fuzzer found (tests/FUZZ_REPROS.md, same numbers).

Each test states the contract the library breaks: ``optimize(fn)`` equals ``jax.jit(fn)``, and a
kernel that is only plain pointwise/matmul work should not fall back to XLA because its build fails.
All of them failed on the library they were found on and pass since the fixes of the "never
wrong" issue; they stay as regression tests.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import vtc_jax


def _optimize(fn, *args, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = vtc_jax.optimize(fn, backend="interpret", **kw)(*args)
    return out, [str(w.message) for w in caught if issubclass(w.category, vtc_jax.VTCFallbackWarning)]


def test_repro1_fully_masked_decode_attention_row_is_nan():
    """#1 (donated_cache): pos < 0 masks every key; jax.jit's softmax row is NaN, optimize's zeros."""
    def fn(pos, q, cache):
        s = jnp.einsum('hd,htd->ht', q, cache)
        s = jnp.where(jnp.arange(2) <= pos, s, -jnp.inf)
        return jnp.einsum('ht,htd->hd', jax.nn.softmax(s, axis=-1), cache)

    rng = np.random.default_rng(0)
    args = (np.int32(-1), rng.standard_normal((1, 2)).astype(np.float32),
            rng.standard_normal((1, 2, 2)).astype(np.float32))
    out, _ = _optimize(fn, *args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(fn)(*args)))   # NaN == NaN here


def test_repro2_prng_key_inside_function_optimises():
    """#2 (prng): a key made inside the function makes the whole rewrite fail (plain XLA + warning)."""
    def fn(x, w):
        mask = jax.random.bernoulli(jax.random.key(0), 0.8, (4, 3))
        return jnp.where(mask, jnp.tanh(x @ w) / 0.8, 0.0)

    x, w = np.ones((4, 5), np.float32), np.ones((5, 3), np.float32)
    out, msgs = _optimize(fn, x, w)
    np.testing.assert_allclose(out, jax.jit(fn)(x, w), rtol=1e-5)
    assert not [m for m in msgs if "optimisation of fn failed" in m], msgs


def test_repro3_closed_over_numpy_constant_operand_builds():
    """#3 (np_consts, donated_cache): a closed-over numpy array broadcast into a pointwise/matmul
    epilogue: the kernel fails to build ("tN is read before any kernel wrote it")."""
    c = np.linspace(-1, 1, 2, dtype=np.float32)

    def fn(x):
        return jnp.tanh(x) * c

    x = np.ones((2, 2), np.float32)
    out, msgs = _optimize(fn, x)
    np.testing.assert_allclose(out, jax.jit(fn)(x), rtol=1e-5)
    assert not [m for m in msgs if "failed to build" in m], msgs


def test_repro3b_closed_over_numpy_weight_through_transpose_builds():
    """#3 (np_consts): the same with a constant matmul weight read through a transpose."""
    w = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)

    def fn(x):
        return x @ jnp.transpose(w.T)

    x = np.ones((2, 3), np.float32)
    out, msgs = _optimize(fn, x)
    np.testing.assert_allclose(out, jax.jit(fn)(x), rtol=1e-5)
    assert not [m for m in msgs if "failed to build" in m], msgs


def test_repro4_pointwise_reads_dynamic_row_of_concat():
    """#4 (concat_row): a pointwise kernel reading a dynamic row of a concatenation fails to build
    ("cannot reshape array of shape () (size 1) into shape [1, 4]"): the cluster falls back."""
    def fn(pos, a, b):
        c = jnp.concatenate([jnp.tanh(a), b])
        return jnp.exp(lax.dynamic_slice(c, (pos, 0), (1, 4)))

    rng = np.random.default_rng(0)
    args = (np.int32(1), rng.standard_normal((1, 4)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32))
    out, msgs = _optimize(fn, *args)
    np.testing.assert_allclose(out, jax.jit(fn)(*args), rtol=1e-5)
    assert not [m for m in msgs if "failed to build" in m], msgs


def test_repro5_bf16_concat_of_pieces_scaled_by_converted_scalar():
    """#5 (donated_cache, bf16 caches): two slices of a (1, n) bf16 row, each multiplied by an f32
    value converted to bf16, concatenated: the first piece comes back NaN."""
    def fn(k, a):
        c = a.astype(jnp.bfloat16)
        return jnp.concatenate([k[:, :2] * c, k[:, 2:] * c], axis=-1)

    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((1, 4)), jnp.bfloat16)
    a = rng.standard_normal((1, 1)).astype(np.float32)
    out, _ = _optimize(fn, k, a)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jax.jit(fn)(k, a), np.float32))


def test_repro6_dus_of_a_dus_overwritten_by_its_reverse_optimises():
    """#6 (existing chains family, test_two_chains_meet): the lowering calls a method that does
    not exist (``_Run._store_window``, vtc_jax/lower.py): the whole rewrite falls back."""
    def fn(pos, x, u):
        v = lax.dynamic_update_slice_in_dim(x, jnp.tanh(u), pos, 0)
        return lax.dynamic_update_slice(v, jnp.flip(v, 0), (0,)) + 1.0

    args = (np.int32(1), np.array([0.5, -1.0], np.float32), np.array([2.0], np.float32))
    out, msgs = _optimize(fn, *args)
    np.testing.assert_allclose(out, jax.jit(fn)(*args), rtol=1e-5)
    assert not [m for m in msgs if "failed" in m], msgs


def test_repro7_statically_decided_piece_condition_builds():
    """#7 (pad_slice_pad, slow run: 5 of 2,106 programs): a pad -> strided slice -> pad chain whose
    piece condition folds to a Python bool; the lane mask code called ``.shape`` on it and the
    pointwise kernel failed to build (a fallback with "'bool' object has no attribute 'shape'")."""
    def fn(pos, a0, a1):
        v1 = lax.pad(jnp.tanh(a0), jnp.array(0.0, a0.dtype), ((0, 2, 0),))
        v3 = lax.pad(v1[2:3:2], jnp.array(0.0, a0.dtype), ((0, 0, 1),))
        return jnp.tanh(v3)

    args = (np.int32(2), np.array([0.5, -1.0], np.float32), np.array([1.0], np.float32))
    out, msgs = _optimize(fn, *args)
    np.testing.assert_allclose(out, jax.jit(fn)(*args), rtol=1e-6)
    assert not [m for m in msgs if "failed to build" in m], msgs
