"""A pre-norm folded into the projection reading it (``cluster.norm_prologues``,
``ContractionMatch.fold``, ``kernels.matmul.Fold``): the kernel dots the norm with its row factor
taken as 1, sums ``x²`` over the K tiles it loads anyway and scales the accumulator rows; and a
residual sum taken into the projection's epilogue (``cluster.residual_epilogues``). Results are
compared with ``jax.jit`` (f32 at 1e-5 of the largest value, bf16 at 2e-2: the norm's rounding to
bf16 happens before the row factor, not after) or with numpy."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax
from vtc_jax.kernels.matmul import Fold, matmul
from vtc_jax.kernels.vio import VTensor
from tests.optimized import TOL, assert_close, eqns, optimize_kernels


def _outside_kernels(fn, args):
    """Primitive names of the emitted program's equations outside Pallas kernels."""
    return [e.primitive.name for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)]


def _folded(outside):
    """The norm and its projection are one kernel: no sum, no dot, one kernel outside kernels."""
    return "reduce_sum" not in outside and "dot_general" not in outside and outside.count("pallas_call") == 1


# --- norms as codebases write them -------------------------------------------------------------

def llama_norm(x, w, eps=1e-5):
    """Meta's Llama: upcast, mean of squares, rsqrt, weight, back to the input dtype."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)).astype(x.dtype)


def gemma_norm(x, w, eps=1e-6):
    """Gemma: ``x * rsqrt(mean(x²) + eps) * (1 + w)``, squares by ``jnp.square``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def t5_norm(x, w, eps=1e-6):
    """T5 / HF: variance by ``x ** 2``, the weight applied after the cast back."""
    var = jnp.mean(x.astype(jnp.float32) ** 2, axis=-1, keepdims=True)
    return w * (x.astype(jnp.float32) / jnp.sqrt(var + eps)).astype(x.dtype)


def _proj(norm):
    def f(x, w, W):
        return jnp.einsum("...d,dn->...n", norm(x, w), W)
    f.__name__ = f"{norm.__name__}_proj"
    return f


def _args(dtype, lead=(4,), d=64, n=96):
    ks = jax.random.split(jax.random.PRNGKey(11), 3)
    return (2.0 * jax.random.normal(ks[0], (*lead, d), dtype), (1 + 0.2 * jax.random.normal(ks[1], (d,))).astype(dtype),
            (0.2 * jax.random.normal(ks[2], (d, n))).astype(dtype))


@pytest.mark.parametrize("norm", [llama_norm, gemma_norm])
@pytest.mark.parametrize("lead", [(4,), (2, 3)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_pre_norm_is_folded_into_its_projection(norm, lead, dtype):
    """The norm's sum runs inside the projection's kernel: no reduction, no normalised tensor
    outside it; the result equals jit's."""
    f = _proj(norm)
    args = _args(dtype, lead)
    fn = optimize_kernels(f)
    assert_close(fn(*args), jax.jit(f)(*args), TOL[dtype])
    outside = _outside_kernels(fn, args)
    assert _folded(outside), outside


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_norm_dividing_by_its_statistic_is_folded(dtype):
    """``x / sqrt(var + eps)`` (rows divided by the factor, the weight applied after the cast
    back): the kernel scales by the factor's reciprocal; equal to jit's."""
    f = _proj(t5_norm)
    args = _args(dtype)
    assert_close(optimize_kernels(f)(*args), jax.jit(f)(*args), TOL[dtype])
    assert _folded(_outside_kernels(optimize_kernels(f), args))


def test_a_statistic_that_is_not_a_row_factor_stays_apart_and_right():
    """``x - rsqrt(ms)`` brings the statistic in by a difference: it does not commute with the dot,
    so no fold; the result equals jit's."""
    def shifted(x, w, W):
        xf = x.astype(jnp.float32)
        return ((xf - jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)) * w) @ W
    args = _args(jnp.float32)
    assert_close(optimize_kernels(shifted)(*args), jax.jit(shifted)(*args), TOL[jnp.float32])
    assert not _folded(_outside_kernels(optimize_kernels(shifted), args))


def test_layer_norm_and_a_norm_read_twice_are_not_folded():
    """A LayerNorm (two statistics) and a norm whose result is also returned stay apart; both
    results equal jit's."""
    def layer_norm_proj(x, w, W):
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, -1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(xf - mu), -1, keepdims=True) + 1e-5)
        return (y * w).astype(x.dtype) @ W

    def norm_returned(x, w, W):
        h = llama_norm(x, w)
        return h @ W, h
    args = _args(jnp.float32)
    for f in (layer_norm_proj, norm_returned):
        out, ref = optimize_kernels(f)(*args), jax.jit(f)(*args)
        for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            assert_close(o, r, TOL[jnp.float32])
        assert not _folded(_outside_kernels(optimize_kernels(f), args)), f.__name__


def test_flax_rmsnorm_into_a_dense_layer():
    """flax linen's ``nn.RMSNorm`` feeding ``nn.Dense``, as a model writes them: folded, equal to jit."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(96, use_bias=False)(nn.RMSNorm()(x))
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 64))
    params = Block().init(jax.random.PRNGKey(1), x)
    f = Block().apply
    assert_close(optimize_kernels(f)(params, x), jax.jit(f)(params, x), TOL[jnp.float32])
    assert _folded(_outside_kernels(optimize_kernels(f), (params, x)))


def test_a_folded_norm_under_vmap_and_grad():
    f = _proj(llama_norm)
    args = _args(jnp.float32)
    fn = optimize_kernels(f)
    batched = tuple(jnp.stack([a, 0.5 * a]) for a in args)
    assert_close(jax.vmap(fn)(*batched), jax.vmap(jax.jit(f))(*batched), TOL[jnp.float32])
    g = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2))(*args)
    r = jax.grad(lambda *a: jnp.sum(jax.jit(f)(*a) ** 2), argnums=(0, 1, 2))(*args)
    for a, b in zip(g, r):
        assert_close(a, b, 1e-4)


@pytest.mark.parametrize("split_k", [None, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_sums_the_statistic_over_its_k_tiles(split_k, dtype):
    """``kernels.matmul`` with a :class:`Fold`, with and without split-K (each split's partial
    statistic summed in the reduce), and as a gated GEMM's A operand: equals numpy's norm · W."""
    B, D, N = 8, 256, 96
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    x = jax.random.normal(ks[0], (B, D), dtype)
    w = (1 + 0.1 * jax.random.normal(ks[1], (D,))).astype(dtype)
    W = (0.1 * jax.random.normal(ks[2], (D, 2 * N))).astype(dtype)
    fold = Fold(prologue=lambda xt, wt: (xt.astype(jnp.float32) * wt.astype(jnp.float32)).astype(dtype),
                statistic=lambda xt, wt: jnp.square(xt.astype(jnp.float32)),
                scale=lambda s: jax.lax.rsqrt(s / D + 1e-6), inputs=(VTensor.physical(w).broadcast_to((B, D)),))
    wv = VTensor.physical(W)
    gate, up = (wv.with_layout(wv.layout.slice((0, i * N), (D, (i + 1) * N))) for i in range(2))
    out = matmul(x, gate, rhs_parts=[up], epilogue=lambda g, u: g * u, fold=fold, split_k=split_k, block_k=32,
                 dimension_numbers=(((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                 prologue_dtypes=(dtype, None))
    xf = np.asarray(x, np.float64)
    h = (xf / np.sqrt(np.mean(xf ** 2, -1, keepdims=True) + 1e-6) * np.asarray(w, np.float64))
    p = h @ np.asarray(W, np.float64)
    assert_close(out, p[:, :N] * p[:, N:], TOL[dtype])


def test_a_fold_needs_rows_of_the_operand_shape():
    fold = Fold(prologue=lambda x, w: x * w, statistic=lambda x, w: x * x, scale=lambda s: s,
                inputs=(jnp.ones((8,)),))
    with pytest.raises(ValueError, match="operand's shape"):
        matmul(jnp.ones((4, 16)), jnp.ones((16, 8)), fold=fold, dimension_numbers=(((1,), (0,)), ((), ())))


def test_a_residual_sum_is_read_in_the_projections_epilogue():
    """``x + (a @ W_o)``: the sum is the projection kernel's epilogue (its split-K reduce's for a
    decode shape), no add outside a kernel; equal to jit."""
    from examples import llama3_decode as L
    args = L.example_args("small", batch=2)
    fn = optimize_kernels(L.step, donate_argnums=(2, 3))
    ref = jax.jit(L.step)(*args)
    for o, r in zip(fn(*args), ref):
        assert_close(o, r, TOL[jnp.float32])
    outside = _outside_kernels(optimize_kernels(L.step), args)
    assert "reduce_sum" not in outside and "logistic" not in outside, outside


def test_llama3_decode_layer_compiles_to_nine_launches():
    """Llama-3-8B's decode layer at batch 16, compiled deviceless for an H100: both norms folded into
    their projections, SiLU·up the gate/up GEMM's epilogue, the residual the output projection's
    reduce epilogue, the rotary embedding and the cache-row writes in the kernel summing the QKV
    GEMM's split-K partials (no reduce kernel) — 9 launches (jit: 21); the two folding kernels keep
    ``cp.async``, and they and the island kernel do not spill."""
    from examples import llama3_decode as L
    from vtc_jax.offline import compile_program
    args = L.example_args("paper", batch=16)
    prog = compile_program(optimize_kernels(L.step, backend="triton", donate_argnums=(2, 3)), *args, donate_argnums=(2, 3))
    assert len(prog.launches) == 9, [x.name for x in prog.launches]
    assert "vtc_matmul_reduce" in [x.name for x in prog.launches]   # (w_o's: its residual epilogue)
    assert len([x for x in prog.launches if x.name.startswith("vtc_matmul_reduce")]) == 1
    if not prog.kernels:
        pytest.skip(f"no PTX to inspect: {prog.kernel_error}")
    for name in ("vtc_matmul", "vtc_matmul_splitk"):
        k = prog.kernel(name)
        assert k is not None and k.spill_store_bytes == 0 and "cp.async" in k.ptx, k
    k = prog.kernel("pointwise")
    assert k is not None and k.spill_store_bytes == 0, k


# --- found by probing as users write models (each failed before its fix) -----------------------

def _no_fallback(fn, args):
    """Run with fallbacks as errors: the kernel builds."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        return vtc_jax.optimize(fn, guard=None)(*args)


def _rms(x, w=1.0, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


@pytest.mark.parametrize("case", ["square", "int8", "f16", "f16_after_f32"])
def test_what_the_factor_cannot_pass_is_not_folded(case):
    """The factor must reach the dot once and unrounded in range: ``h * h`` carries it twice, a cast
    to int8 truncates before it, f16 overflows on rows the factor would have normalised (jit's row
    finite, the fold's inf). Each equals jit's."""
    ks = jax.random.split(jax.random.PRNGKey(4), 2)
    x, W = 3 * jax.random.normal(ks[0], (8, 64)), 0.1 * jax.random.normal(ks[1], (64, 32))
    if case == "square":
        def f(x, W):
            h = _rms(x)
            return (h * h) @ W
    elif case == "int8":
        def f(x, W):
            return (_rms(x) * 20).astype(jnp.int8).astype(jnp.float32) @ W
    elif case == "f16":
        x, W = x.astype(jnp.float16).at[:, 0].set(20000.0), W.astype(jnp.float16)

        def f(x, W):
            xf = x.astype(jnp.float32)
            return (_rms(xf) * 4.0).astype(x.dtype) @ W
    else:
        x = x.at[:, 0].set(1e5)

        def f(x, W):
            return _rms(x).astype(jnp.float16) @ W.astype(jnp.float16)
    out, ref = optimize_kernels(f)(x, W), jax.jit(f)(x, W)
    assert np.isfinite(np.asarray(out, np.float32)).all() == np.isfinite(np.asarray(ref, np.float32)).all()
    assert_close(out, ref, TOL[jnp.bfloat16] if case.startswith("f16") else TOL[jnp.float32])


def test_an_epilogue_reading_the_norms_input_and_a_nnx_style_statistic():
    """``x + rms(x) @ W`` (the residual is the norm's input, read by the epilogue), and flax nnx's
    statistic reshaped to ``(..., 1)`` instead of keepdims, on (B, T, D) rows: folded, built,
    equal to jit's."""
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    x, w, W = jax.random.normal(ks[0], (2, 8, 64)), 1 + 0.1 * jax.random.normal(ks[1], (64,)), \
        0.1 * jax.random.normal(ks[2], (64, 64))

    def residual(x, w, W):
        return x + _rms(x, w) @ W

    def nnx_style(x, w, W):
        ms = jnp.mean(jnp.square(x), -1)
        return (x * jax.lax.rsqrt(ms.reshape(ms.shape + (1,)) + 1e-6) * w) @ W
    for f in (residual, nnx_style):
        assert_close(_no_fallback(f, (x, w, W)), jax.jit(f)(x, w, W), TOL[jnp.float32])
        assert _folded(_outside_kernels(optimize_kernels(f), (x, w, W))), f.__name__
