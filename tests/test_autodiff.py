"""Autodiff through vtc_jax.optimize (issue #8): the forward pass runs VTC's kernels, derivatives are
the original function's (vtc_jax/autodiff.py); every result equals jax.jit(fn)'s."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax

RTOL, ATOL = 1e-5, 1e-6


def fn(x, w):
    """matmul + split + transpose + reshape + concat, the movement VTC removes."""
    h = x @ w                                   # (8,16) @ (16,16)
    a, b = jnp.split(h, 2, axis=1)              # (8,8) each
    t = jnp.transpose(a).reshape(8, 8)
    return jnp.tanh(jnp.concatenate([t, b * 2.0], axis=1))


def _args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
            jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32))


def _loss(g):
    return lambda x, w: jnp.sum(g(x, w) ** 2)


def check_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
        if a.dtype == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.fixture(autouse=True)
def _no_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        yield


@pytest.fixture(scope="module")
def opt():
    return vtc_jax.optimize(fn, backend="interpret", guard=None, strict=True)


TRANSFORMS = {
    "grad": lambda g, x, w: jax.grad(_loss(g), argnums=(0, 1))(x, w),
    "value_and_grad": lambda g, x, w: jax.value_and_grad(_loss(g))(x, w),
    "vjp": lambda g, x, w: (lambda out, back: (out, back(jnp.cos(out))))(*jax.vjp(g, x, w)),
    "jvp": lambda g, x, w: jax.jvp(g, (x, w), (jnp.sin(x), w)),
    "linearize": lambda g, x, w: jax.linearize(lambda x: g(x, w), x)[1](jnp.cos(x)),
    "jit_of_grad": lambda g, x, w: jax.jit(jax.grad(_loss(g)))(x, w),
    "hvp": lambda g, x, w: jax.jvp(jax.grad(_loss(g)), (x, w), (jnp.sin(x), w))[1],
    "vmap": lambda g, x, w: jax.vmap(g, in_axes=(0, None))(jnp.stack([x, -2 * x]), w),
    "grad_of_vmap": lambda g, x, w: jax.grad(
        lambda xs: jnp.sum(jax.vmap(g, in_axes=(0, None))(xs, w) ** 2))(jnp.stack([x, -2 * x])),
    "vmap_of_grad": lambda g, x, w: jax.vmap(jax.grad(_loss(g)), in_axes=(0, None))(jnp.stack([x, -2 * x]), w),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_equals_jit(opt, name):
    x, w = _args()
    check_same(TRANSFORMS[name](opt, x, w), TRANSFORMS[name](jax.jit(fn), x, w))
    _, lowered = opt.last
    assert lowered.kernels and not lowered.fallbacks  # the forward really went through VTC


def test_forward_of_grad_runs_the_kernels_backward_is_xla(opt):
    x, w = _args()
    jaxpr = str(jax.make_jaxpr(jax.grad(_loss(opt), argnums=(0, 1)))(x, w))
    assert "pallas_call" in jaxpr
    # the backward pass is the original's VJP: a transposed dot_general, no kernel transposed
    assert jaxpr.count("pallas_call") == str(jax.make_jaxpr(opt)(x, w)).count("pallas_call")


def test_optimize_of_vmapped_fn():
    x, w = _args()
    vf = jax.vmap(fn, in_axes=(0, None))
    xs = jnp.stack([x, 3 * x])
    f = vtc_jax.optimize(vf, backend="interpret", guard=None, strict=True)
    check_same(f(xs, w), jax.jit(vf)(xs, w))
    check_same(jax.grad(_loss(f), argnums=(0, 1))(xs, w), jax.grad(_loss(jax.jit(vf)), argnums=(0, 1))(xs, w))


def test_jit_conventions_under_autodiff():
    """static_argnums/argnames, kwargs, pytrees, integer and bool inputs (float0), int outputs,
    a PRNG key argument; .lower/.trace/.eval_shape unchanged."""
    def g(scale, params, x, n, *, mask, mode, key):
        h = x @ params["w"] + params["b"]
        a, b = jnp.split(h, 2, axis=1)
        t = jnp.transpose(a).reshape(8, 8) + 0.01 * jax.random.normal(key, (8, 8))
        y = jnp.where(mask, jnp.concatenate([t, b * n], axis=1) * scale, 0.0)
        return {"y": jnp.tanh(y) if mode == "tanh" else y, "count": jnp.sum(mask.astype(jnp.int32)), "n": n * 2}

    x, w = _args()
    params = {"w": w, "b": jnp.linspace(-1, 1, 16)}
    n, mask, key = jnp.int32(3), x > 0, jax.random.key(1)
    kw = dict(static_argnums=0, static_argnames="mode")
    f, ref = vtc_jax.optimize(g, backend="interpret", guard=None, strict=True, **kw), jax.jit(g, **kw)

    def loss(h):
        return lambda p, x, n: jnp.sum(h(0.5, p, x, n, mask=mask, mode="tanh", key=key)["y"] ** 2)

    grads = lambda h: jax.value_and_grad(loss(h), argnums=(0, 1, 2), allow_int=True)(params, x, n)
    check_same(grads(f), grads(ref))
    assert grads(f)[1][2].dtype == jax.dtypes.float0
    tangents = lambda h: jax.jvp(lambda p, x: h(2.0, p, x, n, mask=mask, mode="id", key=key), (params, x), (params, x))
    check_same(tangents(f), tangents(ref))
    full = (1.0, params, x, n)
    kwargs = dict(mask=mask, mode="tanh", key=key)
    assert "func.func" in f.lower(*full, **kwargs).as_text()
    assert f.trace(*full, **kwargs).jaxpr is not None
    assert f.eval_shape(*full, **kwargs) == ref.eval_shape(*full, **kwargs)


def test_grad_with_donated_forward_and_whole_fallback(monkeypatch):
    """Donation keeps working for the plain call; if the rewrite fails, grad is jax's own."""
    x, w = _args()
    f = vtc_jax.optimize(fn, backend="interpret", guard=None, donate_argnums=0)
    check_same(f(jnp.array(x), w), jax.jit(fn)(x, w))
    import vtc_jax.program as program   # the build loop's lowering step

    def boom(*a, **k):
        raise RuntimeError("synthetic lowering failure")

    monkeypatch.setattr(program, "lower", boom)
    g = vtc_jax.optimize(fn, backend="interpret", guard=None)
    with pytest.warns(vtc_jax.VTCFallbackWarning, match="synthetic"):
        got = jax.grad(_loss(g), argnums=(0, 1))(x, w)
    check_same(got, jax.grad(_loss(jax.jit(fn)), argnums=(0, 1))(x, w))


def test_custom_vjp_inside_fn_keeps_its_rule():
    @jax.custom_vjp
    def clip_grad(v):
        return v

    clip_grad.defvjp(lambda v: (v, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))

    def h(x, w):
        return jnp.transpose(clip_grad(x @ w) * 3.0)

    x, w = _args()
    f = vtc_jax.optimize(h, backend="interpret", guard=None, strict=True)
    grads = lambda g: jax.grad(_loss(g), argnums=(0, 1))(x, w)
    check_same(grads(f), grads(jax.jit(h)))
