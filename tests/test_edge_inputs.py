"""Edge inputs a user meets, each against ``jax.jit``: float64 and int64 under x64 (in a subprocess:
the flag is process-wide), a complex convolution through ``jax.nn.relu`` (a ``custom_jvp`` on
complex values), ``jax.hessian``'s one-piece split, an optimised function called inside another,
and ``explain``'s checks of static and donated arguments (jax.jit's own errors)."""
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fallbacks(fn, *args, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", vtc_jax.VTCFallbackWarning)
        out = vtc_jax.optimize(fn, backend="interpret", **kw)(*args)
    return out, [str(w.message) for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]


def test_x64_float64_attention_and_int64_positions_equal_jit():
    """Under x64: a float64 attention and a float64 convolution stay XLA's (the kernels accumulate
    in f32 at most: declined, named), a float64 matmul chain equals jit; an int64 position past
    int32's range saturates into the kernels' bound instead of wrapping (jax compares in int64)."""
    script = textwrap.dedent("""
        import warnings, numpy as np, jax, jax.numpy as jnp, vtc_jax
        from vtc_jax.templates import Match
        assert jax.config.jax_enable_x64
        def attn(q, cache, pos):
            T, D = cache.shape[1], cache.shape[3]
            s = jnp.einsum("bhd,bthd->bht", q, cache) * (D ** -0.5)
            s = jnp.where(jnp.arange(T) <= pos, s, -jnp.inf)
            return jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, axis=-1), cache)
        def conv(x, w):
            return jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                            dimension_numbers=("NHWC", "HWIO", "NHWC")))
        r = np.random.default_rng(0)
        q, c = jnp.asarray(r.standard_normal((2, 4, 16))), jnp.asarray(r.standard_normal((2, 32, 4, 16)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = vtc_jax.optimize(attn, backend="interpret", guard=None)
            d = float(jnp.max(jnp.abs(opt(q, c, 5) - jax.jit(attn)(q, c, 5))))
            assert d < 1e-12, d
            assert not [m for m in opt.last[0].matches.values() if isinstance(m, Match) and m.kind == "attention"]
            rep = vtc_jax.explain(attn)(q, c, 5)
            assert any("float64" in why for _, kind, why in rep.templates if kind == "attention"), rep.templates
            x, w = jnp.asarray(r.standard_normal((2, 8, 8, 4))), jnp.asarray(r.standard_normal((3, 3, 4, 8)))
            assert float(jnp.max(jnp.abs(vtc_jax.optimize(conv, backend="interpret", guard=None)(x, w)
                                         - jax.jit(conv)(x, w)))) == 0.0
            q32, c32 = q.astype(jnp.float32), c.astype(jnp.float32)
            for pos in (2 ** 32 + 3, -2 ** 32 + 5, 2 ** 31, 7):
                p = jnp.int64(pos)
                a = np.asarray(vtc_jax.optimize(attn, backend="interpret", guard=None)(q32, c32, p))
                b = np.asarray(jax.jit(attn)(q32, c32, p))
                assert np.array_equal(np.isnan(a), np.isnan(b)), pos
                assert np.nanmax(np.abs(a - b)) < 1e-5 if not np.isnan(b).all() else True, pos
        print("ok")
    """)
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_complex_convolution_through_relu_equals_jit():
    """``jax.nn.relu`` is a ``custom_jvp``: on complex values split into pairs its body is evaluated
    on the pairs (re-binding the call from its params alone raised ``KeyError: 'subfuns'``)."""
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((2, 8, 8, 4))).astype(jnp.complex64)
    w = jnp.asarray(r.standard_normal((3, 3, 4, 8))).astype(jnp.complex64)

    def conv(x, w):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y)
    out, msgs = _fallbacks(conv, x, w, guard=None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(conv)(x, w)), rtol=1e-5, atol=1e-4)
    assert not [m for m in msgs if "failed" in m or "Error" in m], msgs


def test_one_piece_split_and_hessian_are_planned():
    """``lax.split`` into one piece (``jax.hessian`` and ``jax.jacrev`` emit it) written home through
    a reshape: the rewrite completes (no "optimisation failed"), equal to jit."""
    def f(x):
        y = jnp.cumsum(x, axis=0).transpose(1, 2, 0)
        (z,) = jax.lax.split(y, (8,), axis=2)
        return z.reshape(2, 4, 2, 4)
    x = jnp.arange(64.0).reshape(8, 2, 4)
    out, msgs = _fallbacks(f, x, guard=None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(f)(x)), rtol=1e-6)
    assert not [m for m in msgs if "failed" in m], msgs

    def mlp(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
    p = {"w1": jnp.asarray(r := np.random.default_rng(1).standard_normal((4, 6)), jnp.float32) * 0.5,
         "w2": jnp.asarray(np.random.default_rng(2).standard_normal((6, 3)), jnp.float32) * 0.5}
    xs = jnp.asarray(np.random.default_rng(3).standard_normal((5, 4)), jnp.float32)
    h = jax.hessian(mlp, argnums=1)
    out, msgs = _fallbacks(h, p, xs, guard=None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(h)(p, xs)), rtol=1e-5, atol=1e-6)
    assert not [m for m in msgs if "failed" in m], msgs
    del r


def test_an_optimised_function_inside_another_is_no_fallback():
    """The inner function's Pallas kernel is a compiled kernel the outer one runs as it is: not an
    "unsupported primitive" fallback."""
    inner = vtc_jax.optimize(lambda x, w: jnp.tanh((x @ w).reshape(4, 2, 8).transpose(1, 0, 2)),
                             backend="interpret", guard=None)

    def outer(x, w):
        return inner(x, w).reshape(8, 8) @ w[:8]
    x, w = jnp.ones((4, 16)) * 0.1, jnp.ones((16, 16)) * 0.2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner(x, w)
    out, msgs = _fallbacks(outer, x, w, guard=None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(outer)(x, w)), rtol=1e-5)
    assert not [m for m in msgs if "pallas_call" in m], msgs


@pytest.mark.parametrize("kw", [dict(static_argnums=1), dict(static_argnames="nope"), dict(donate_argnums=9)],
                         ids=["unhashable_static", "unknown_name", "donate_out_of_range"])
def test_explain_checks_static_and_donated_arguments_as_jit(kw):
    def f(x, w):
        return (x @ w).T
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    with pytest.raises(ValueError) as want:
        jax.jit(f, **kw)(x, w)
    with pytest.raises(ValueError) as got:
        vtc_jax.explain(f, **kw)(x, w)
    assert str(got.value).split(".")[0] == str(want.value).split(".")[0], (got.value, want.value)


def test_a_callable_with_attributes_of_its_own_is_optimised_as_jit_runs_it():
    """A callable object whose attributes share names with the optimised function's (equinox's
    ``filter_jit`` keeps a string in ``.fn``): ``optimize`` copies its name and doc, not its
    attributes (it called the string and failed)."""
    eqx = pytest.importorskip("equinox")

    class Wrapped:
        def __init__(self, f):
            self.fn, self.backend, self.last, self._f = "a name for a repr", "cuda", "x", f

        def __call__(self, x, w):
            return self._f(x, w)

    def f(x, w):
        return jnp.tanh(x @ w).T.reshape(-1) * 2.0

    x, w = jnp.arange(12.0).reshape(3, 4) / 10, jnp.ones((4, 5)) / 4
    ref = jax.jit(f)(x, w)
    for g in (Wrapped(f), eqx.filter_jit(f)):
        out = vtc_jax.optimize(g, backend="interpret", guard=None)(x, w)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_jit_conventions_a_wrapper_relies_on():
    """What code written for ``jax.jit`` passes or calls: ``None`` for the argnums and argnames
    (jax.jit's defaults, forwarded by wrappers; optimize iterated None), ``clear_cache()``, a
    deep copy of an object holding the function after its first call (it could not pickle its
    analysis), and jax.jit's error for a staticmethod (optimize took it and then failed on the
    instance)."""
    import copy

    def f(x, w):
        return jnp.tanh(x @ w).T.reshape(-1) * 2.0

    x, w = jnp.arange(12.0).reshape(3, 4) / 10, jnp.ones((4, 5)) / 4
    ref = jax.jit(f, static_argnums=None, donate_argnums=None)(x, w)
    g = vtc_jax.optimize(f, static_argnums=None, static_argnames=None, donate_argnums=None,
                         donate_argnames=None, backend="interpret", guard=None)
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(ref), rtol=1e-6, atol=1e-6)

    class Trainer:
        def __init__(self):
            self.step = g

    t = copy.deepcopy(Trainer())
    np.testing.assert_allclose(np.asarray(t.step(x, w)), np.asarray(ref), rtol=1e-6, atol=1e-6)
    g.clear_cache()
    assert g.last is None
    np.testing.assert_allclose(np.asarray(g(x, w)), np.asarray(ref), rtol=1e-6, atol=1e-6)
    assert g.last is not None   # traced and planned again
    with pytest.raises(TypeError, match="staticmethod arguments are not supported"):
        jax.jit(staticmethod(f))
    with pytest.raises(TypeError, match="staticmethod arguments are not supported"):
        vtc_jax.optimize(staticmethod(f))
