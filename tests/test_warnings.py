"""Where vtc_jax's warnings point and what they are: the user's own line, and a notice that is not
a fallback (so ``warnings.simplefilter("error", VTCFallbackWarning)`` only trips on fallbacks)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax


def test_the_no_gpu_notice_is_not_a_fallback_and_points_at_the_caller():
    if jax.default_backend() == "gpu":
        pytest.skip("the notice is said only without a GPU")
    assert not issubclass(vtc_jax.VTCNotice, vtc_jax.VTCFallbackWarning)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)   # fallbacks as errors: no error here
        f = vtc_jax.optimize(lambda x: jnp.transpose(x) + 1.0)
    notices = [w for w in rec if issubclass(w.category, vtc_jax.VTCNotice)]
    assert len(notices) == 1 and "interpret mode" in str(notices[0].message)
    assert notices[0].filename == __file__
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(f(x), jnp.transpose(x) + 1.0)


def test_a_fallback_found_while_jax_traces_points_at_the_users_call():
    """The fallback is found inside jax.jit's trace, many frames below the call: its location is
    the line that called the optimised function."""
    def fn(x, i):
        return jnp.transpose(x).at[i].add(1.0) * 2.0   # scatter-add: opaque, its movement stays

    f = vtc_jax.optimize(fn, backend="interpret")
    x, i = jnp.arange(12.0).reshape(3, 4), jnp.array([0, 2])
    with pytest.warns(vtc_jax.VTCFallbackWarning, match="scatter-add") as rec:
        line = _lineno() + 1
        out = f(x, i)
    hits = [w for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
    assert all(w.filename == __file__ for w in hits), [(w.filename, w.lineno) for w in hits]
    assert any(w.lineno == line for w in hits)
    np.testing.assert_array_equal(out, jax.jit(fn)(x, i))


def _lineno() -> int:
    import inspect
    return inspect.currentframe().f_back.f_lineno


def test_symbolic_shapes_fall_back_with_a_reason_not_an_internal_error():
    """jax.export with shape polymorphism: vtc_jax plans for concrete shapes, so the function
    runs as plain XLA — said as such (naming the symbolic shape), not as an internal error
    ("optimisation ... failed (InconclusiveDimensionOperation ...)"); the export still equals
    jax's and the concrete-shape call is still optimised."""
    from jax import export
    f = lambda x: jnp.tanh(x.T).T * 2.0   # noqa: E731
    n = export.symbolic_shape("n")[0]
    opt = vtc_jax.optimize(f, backend="interpret")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp = export.export(jax.jit(opt))(jax.ShapeDtypeStruct((n, 8), jnp.float32))
    msgs = [str(w.message) for w in caught if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
    assert len(msgs) == 1 and "symbolic dimensions ((n, 8)" in msgs[0] and "failed" not in msgs[0], msgs
    x = jax.random.normal(jax.random.key(0), (5, 8))
    np.testing.assert_allclose(np.asarray(exp.call(x)), np.asarray(jax.jit(f)(x)), rtol=1e-6)
    with pytest.raises(vtc_jax.VTCError, match="symbolic dimensions"):
        export.export(jax.jit(vtc_jax.optimize(f, backend="interpret", strict=True)))(
            jax.ShapeDtypeStruct((n, 8), jnp.float32))


def test_a_cpu_machine_is_quiet_after_importing_vtc_jax():
    """The test extra installs jax's CUDA plugin (cross-lowering, the deviceless compile). On a
    machine without an NVIDIA driver its start-up fails at the first backend use with a 20-line
    "Jax plugin configuration error ... Unable to load cuDNN" traceback, and jax goes on with the
    CPU. With vtc_jax imported (no ``JAX_PLATFORMS`` set, as a user runs a script), that traceback
    is not printed; jax's other messages are untouched."""
    import os
    import subprocess
    import sys
    from vtc_jax.compat import nvidia_driver_present
    if nvidia_driver_present():
        pytest.skip("a machine with an NVIDIA driver: a plugin error there is real news")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import jax, vtc_jax; print(jax.devices()[0].platform)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu"
    assert "Jax plugin configuration error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_movement_the_guard_keeps_beside_a_kernel_it_undid_is_no_fallback():
    """A bilinear resize's index arithmetic (iotas: XLA's clusters in every plan) next to kernels
    the guard undoes: the movement between them stays because of the guard's choice, which
    ``optimize`` never warns about — with ``guard=None`` nothing stays there and nothing is said,
    with the default guard the same (its undo is in the guard's notes)."""
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((2, 4, 4, 16)), jnp.float32)
    skip = jnp.asarray(r.standard_normal((2, 8, 8, 8)), jnp.float32)
    wt = jnp.asarray(r.standard_normal((3, 3, 24, 8)) * 0.1, jnp.float32)

    def up_block(x, skip, wt):
        up = jax.image.resize(x, (2, 8, 8, 16), method="bilinear")
        h = jnp.concatenate([up, skip], axis=-1)
        return jax.nn.relu(jax.lax.conv_general_dilated(h, wt, (1, 1), "SAME",
                                                        dimension_numbers=("NHWC", "HWIO", "NHWC")))
    ref = jax.jit(up_block)(x, skip, wt)
    for guard in (None, "model"):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always", vtc_jax.VTCFallbackWarning)
            opt = vtc_jax.optimize(up_block, backend="interpret", guard=guard)
            out = opt(x, skip, wt)
        assert not [str(w.message) for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    assert any(n.startswith("undid") for n in opt.last[0].guard), opt.last[0].guard


def test_a_tril_mask_beside_causal_attention_is_no_fallback():
    """``jnp.tril(jnp.ones((S, S), bool))``: the iota cluster stays XLA's (an index-dependent
    kernel) and the ``jnp.ones`` feeding it is kept movement, but a fill moves no data (XLA makes
    it inside its reader) and the attention kernel reads the mask as causal: nothing to warn about
    (it used to say "the data movement next to it stays" on every causal layer)."""
    r = np.random.default_rng(1)
    q, k, v = (jnp.asarray(r.standard_normal((2, 64, 4, 32)), jnp.float32) for _ in range(3))

    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", vtc_jax.VTCFallbackWarning)
        opt = vtc_jax.optimize(attn, backend="interpret")
        out = opt(q, k, v)
    assert not [str(w.message) for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
    assert [r for _, kind, r in vtc_jax.explain(attn)(q, k, v).templates if kind == "attention"] == ["kernel"]
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(attn)(q, k, v)), rtol=1e-5, atol=1e-5)


def test_batchnorm_in_train_mode_warns_of_no_movement_that_moves_nothing():
    """Train-mode BatchNorm between convolutions (a ResNet block, the running averages updated): its
    reductions stay XLA's (a statistic output depends on more than the statistics), and the only
    movement beside them is ``[C] -> [1, 1, 1, C]``, a bitcast in XLA. Nothing stays that moves
    data, so nothing is said (it used to warn on every training step), with or without the guard."""
    r = np.random.default_rng(2)
    x = jnp.asarray(r.standard_normal((2, 8, 8, 16)), jnp.float32)
    k1 = jnp.asarray(r.standard_normal((1, 1, 16, 8)) * 0.3, jnp.float32)
    k2 = jnp.asarray(r.standard_normal((1, 1, 8, 16)) * 0.3, jnp.float32)
    st = {n: jnp.asarray(r.uniform(0.5, 1.5, c), jnp.float32) for n, c in (("m1", 8), ("v1", 8), ("m2", 16), ("v2", 16))}

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def bn(x, m_run, v_run):
        m, v = x.mean((0, 1, 2)), x.var((0, 1, 2))
        y = (x - m.reshape(1, 1, 1, -1)) * jax.lax.rsqrt(v.reshape(1, 1, 1, -1) + 1e-5)
        return y, 0.9 * m_run + 0.1 * m, 0.9 * v_run + 0.1 * v

    def block(x, k1, k2, st):
        y, m1, v1 = bn(conv(x, k1), st["m1"], st["v1"])
        y, m2, v2 = bn(conv(jax.nn.relu(y), k2), st["m2"], st["v2"])
        return jax.nn.relu(y + x), dict(m1=m1, v1=v1, m2=m2, v2=v2)
    ref = jax.jit(block)(x, k1, k2, st)
    for guard in (None, "model"):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always", vtc_jax.VTCFallbackWarning)
            out = vtc_jax.optimize(block, backend="interpret", guard=guard)(x, k1, k2, st)
        assert not [str(w.message) for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_a_donation_no_output_can_take_is_said_once_as_jit_says_it():
    """jax warns "Some donated buffers were not usable" once per call of ``jax.jit``; the guard's
    deviceless compiles of both programs (pricing) said it twice more on the first call."""
    def f(w, x):
        return jnp.tanh(x.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3) @ w)
    w = jnp.ones((8, 16))
    x = jnp.ones((2, 32, 8))
    counts = []
    for make in (lambda: jax.jit(f, donate_argnums=(1,)), lambda: vtc_jax.optimize(f, donate_argnums=(1,))):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            out = make()(w, jnp.array(x, copy=True))
        counts.append(sum("donated buffers were not usable" in str(r.message) for r in rec))
        np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(f)(w, x)), rtol=1e-6)
    assert counts == [1, 1], counts
