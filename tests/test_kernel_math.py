"""erf / erfc / round inside kernels (Pallas' Triton lowering has none): ``kernels.tiling.erf_f32`` /
``erfc_f32`` against jax's own, and exact GELU (``jax.nn.gelu(approximate=False)``, PyTorch's
default ``x/2·erfc(-x/√2)``) in a matmul epilogue and a pointwise kernel: equal to ``jax.jit``
in interpret mode, lowered for CUDA with the epilogue inside the Triton kernel (no fallback).

Tolerances: against float64 truth, ours and jax's own f32 erf / erfc reach the same errors
(erfc's far tail ~4e-6 relative, set by the f32 ``exp(-x²)``); programs through kernels are
compared with jax.jit at 1e-5 (f32) and 2e-2 (bf16) relative to the output's scale."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy import special

import vtc_jax
from vtc_jax.kernels.tiling import erf_f32, erfc_f32, round_f32
from vtc_jax.templates import Match
from vtc_jax.testing import cross_lower


X = np.concatenate([np.linspace(-10, 10, 4001), np.geomspace(1e-8, 1, 200), -np.geomspace(1e-8, 1, 200),
                    [0.0, 0.4999, 0.5, 0.5001, 1.0, -1.0, 9.1, -9.1]]).astype(np.float32)


def _rel_err(fn, ref):
    truth = np.array([ref(float(x)) for x in X])
    ok = np.abs(truth) > 1e-36            # below f32's range both underflow
    got = np.asarray(jax.jit(fn)(X), np.float64)
    return float(np.max(np.abs(got - truth)[ok] / np.abs(truth)[ok]))


@pytest.mark.parametrize("name", ["erf", "erfc"])
def test_in_kernel_erf_is_as_accurate_as_jaxs(name):
    """Against the float64 truth (``math.erf``/``math.erfc``): ours within 5e-6 relative, and
    never more than 10% worse than jax's own f32 erf / erfc (both reach ~4e-6 in erfc's far tail,
    where the f32 ``exp(-x²)`` rounds: 3.9e-6 at x ≈ 8)."""
    import math
    ours = _rel_err({"erf": erf_f32, "erfc": erfc_f32}[name], getattr(math, name))
    jaxs = _rel_err(getattr(special, name), getattr(math, name))
    assert ours < 5e-6 and ours <= 1.1 * jaxs + 1e-7, (ours, jaxs)


def gelu_mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1, approximate=False) @ w2


def gelu_pointwise(x):   # erf form, as hand-written code does
    return 0.5 * x.T * (1.0 + jax.lax.erf(x.T / np.sqrt(2.0)))


def _args(dtype):
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (32, 64), jnp.float32).astype(dtype),
            (jax.random.normal(k[1], (64, 128), jnp.float32) / 8).astype(dtype),
            (jax.random.normal(k[2], (128, 64), jnp.float32) / 11).astype(dtype))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_exact_gelu_runs_in_kernels_and_matches_jit(dtype, tol):
    args = _args(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)   # no cluster may fall back
        for fn, a in ((gelu_mlp, args), (gelu_pointwise, args[:1])):
            opt = vtc_jax.optimize(fn, backend="interpret", guard=None)
            got = np.asarray(opt(*a), np.float32)
            want = np.asarray(jax.jit(fn)(*a), np.float32)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
            _, lowered = opt.last
            assert lowered.kernels, "the erf/erfc cluster went to XLA"


def test_exact_gelu_lowers_for_cuda():
    """The GELU epilogue and the transposed erf pointwise kernel cross-lower for CUDA: no
    'Unimplemented primitive ... erfc' (before: the clusters fell back at build time while
    explain() listed them as kernels)."""
    args = _args(jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        for fn, a in ((gelu_mlp, args), (gelu_pointwise, args[:1])):
            opt = vtc_jax.optimize(fn, backend="triton", guard=None)
            mod = cross_lower(opt, *a)
            assert mod.triton_kernels, fn.__name__
            analysis, _ = opt.last
            erf_ops = [op for op in analysis.graph.ops if op.primitive in ("erf", "erfc")]
            in_kernels = {o for c in analysis.clusters if isinstance(analysis.matches.get(c.id), Match)
                          for o in c.ops}
            assert erf_ops and all(op.id in in_kernels for op in erf_ops), fn.__name__


# ---- round (jnp.round: to nearest even; lax.round's default: away from zero) ---------------------

ROUND_X = np.concatenate([
    np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 4194304.5, -4194304.5,
              2.0 ** 23 - 0.5, 2.0 ** 23 + 2, 1e30, -1e30, np.inf, -np.inf, np.nan, -0.3, 0.0, -0.0,
              3.7, -3.7], np.float32),
    (np.random.default_rng(0).standard_normal(20000) * 10.0 ** np.random.default_rng(1).uniform(-3, 8, 20000)
     ).astype(np.float32)])


@pytest.mark.parametrize("method", [jax.lax.RoundingMethod.AWAY_FROM_ZERO, jax.lax.RoundingMethod.TO_NEAREST_EVEN],
                         ids=["away", "even"])
def test_in_kernel_round_is_jaxs_bit_for_bit(method):
    """Ties either way, 0.49999997 (where ``floor(x + 0.5)`` rounds up), past 2^23, inf, NaN and
    the sign of zero: ``round_f32`` equals ``lax.round`` bit for bit."""
    got = np.asarray(jax.jit(lambda x: round_f32(x, method))(ROUND_X))
    want = np.asarray(jax.lax.round(ROUND_X, method))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def quantise_int8(x, scale):
    """int8 quantisation of a transposed activation (``jnp.round`` to nearest even, then clip)."""
    return jnp.clip(jnp.round(x.T / scale), -128, 127).astype(jnp.int8)


def test_round_runs_in_kernels_and_lowers_for_cuda():
    """``jnp.round`` (int8 quantisation) in a pointwise kernel: equal to jax.jit, and the program
    cross-lowers for CUDA with it inside the Triton kernel (before: 'Unimplemented primitive in
    Pallas Triton lowering: round', and the whole function fell back)."""
    x = jax.random.normal(jax.random.key(3), (48, 100), jnp.float32) * 40
    x = x.at[0, :4].set(jnp.array([0.5, 1.5, -2.5, 0.49999997]) * 0.25)   # ties after / 0.25
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        got = vtc_jax.optimize(quantise_int8, backend="interpret", guard=None)(x, 0.25)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(quantise_int8)(x, 0.25)))
        opt = vtc_jax.optimize(quantise_int8, backend="triton", guard=None)
        assert cross_lower(opt, x, 0.25).triton_kernels
        analysis, _ = opt.last
        in_kernels = {o for c in analysis.clusters if isinstance(analysis.matches.get(c.id), Match) for o in c.ops}
        assert any(op.primitive == "round" and op.id in in_kernels for op in analysis.graph.ops)


@pytest.mark.parametrize("prim", ["lgamma", "digamma", "reduce_precision"])
def test_primitives_triton_cannot_lower_stay_xla_naming_why(prim):
    """lgamma, digamma and reduce_precision have no Pallas Triton rule: their cluster is XLA's,
    declined with that reason, and the program lowers for CUDA (the rest of it keeps kernels)."""
    op = {"lgamma": jax.lax.lgamma, "digamma": jax.lax.digamma,
          "reduce_precision": lambda v: jax.lax.reduce_precision(v, 5, 10)}[prim]
    fn = lambda x: op(jnp.abs(x.T) + 1.0)   # noqa: E731
    x = jax.random.normal(jax.random.key(4), (32, 64), jnp.float32)
    report = vtc_jax.explain(fn)(x)
    assert any(f"{prim} inside the cluster: Pallas' Triton lowering has no rule" in r for _, _, r in report.templates)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        cross_lower(vtc_jax.optimize(fn, backend="triton", guard=None), x)
        np.testing.assert_allclose(vtc_jax.optimize(fn, backend="interpret")(x), jax.jit(fn)(x), rtol=1e-6)
