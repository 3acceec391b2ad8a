"""PRNG keys through vtc_jax.optimize / explain (issue #8): key-typed tensors (``key<fry>``, ...)
stay ordinary XLA, the rest of the function is still optimised, and nothing falls back."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax


def _noisy_matmul(x, w):
    """A module that defaults its key (key=None -> PRNGKey(0)), plus jax.random.key in the body."""
    k = jax.random.PRNGKey(0)
    n = jax.random.normal(k, x.shape)
    k2 = jax.random.split(jax.random.key(1))[0]
    m = jax.random.uniform(jax.random.fold_in(k2, 3), w.shape)
    return jnp.transpose((x + 0.1 * n) @ (w * m))


def _keyed(key, x, w):
    a, b = jax.random.split(key)
    keep = jax.random.bernoulli(a, 0.75, x.shape)            # dropout
    h = jnp.where(keep, x / 0.75, 0.0) @ w
    return jnp.transpose(h).reshape(4, -1), b


def _args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
            jnp.asarray(rng.standard_normal((16, 8)), jnp.float32))


def _same_keys(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


@pytest.fixture(autouse=True)
def _no_fallback_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        yield


def test_key_made_inside_equals_jit_strict():
    x, w = _args()
    f = vtc_jax.optimize(_noisy_matmul, backend="interpret", strict=True)
    np.testing.assert_allclose(f(x, w), jax.jit(_noisy_matmul)(x, w), rtol=1e-5, atol=1e-6)
    analysis, lowered = f.last
    assert any(op.primitive == "random_bits" for op in analysis.graph.ops)  # really traced, not fallen back
    assert not lowered.fallbacks


def test_explain_reports_with_keys():
    x, w = _args()
    report = vtc_jax.explain(_noisy_matmul)(x, w)
    assert isinstance(report, vtc_jax.Report)
    assert "transpose" in str(report)
    assert any(c.kind == "glue" and "PRNG" in c.reason for c in report.clusters)
    report.to_json(), report.to_dot()
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)  # analysis only, abstract key
    report = vtc_jax.explain(_keyed)(key, jax.ShapeDtypeStruct((8, 16), jnp.float32),
                                     jax.ShapeDtypeStruct((16, 8), jnp.float32))
    assert "transpose" in str(report) and "key<fry>" in report.to_json()


@pytest.mark.parametrize("make_key", [lambda: jax.random.key(3), lambda: jax.random.key(3, impl="rbg"),
                                      lambda: jax.random.PRNGKey(3)], ids=["key", "rbg", "raw"])
def test_key_passed_as_argument(make_key):
    x, w = _args()
    key = make_key()
    f = vtc_jax.optimize(_keyed, backend="interpret", strict=True)
    (out, nxt), (ref, ref_nxt) = f(key, x, w), jax.jit(_keyed)(key, x, w)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    if jax.dtypes.issubdtype(ref_nxt.dtype, jax.dtypes.extended):
        _same_keys(nxt, ref_nxt)
    else:
        np.testing.assert_array_equal(nxt, ref_nxt)
    assert isinstance(f.explain(key, x, w), vtc_jax.Report)


def test_closed_over_key_and_key_outputs():
    x, w = _args()
    outer = jax.random.key(7)

    def fn(x, w):
        ks = jax.random.split(outer, 4)
        idx = jax.random.randint(ks[2], (8,), 0, 8)
        return jnp.transpose(x[idx] @ w), ks[1:3]

    f = vtc_jax.optimize(fn, backend="interpret", strict=True)
    (out, ks), (ref, ref_ks) = f(x, w), jax.jit(fn)(x, w)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    _same_keys(ks, ref_ks)
