"""Precision parity (issue #23 item 1): every kernel dot computes at the precision of the op it
replaces, as XLA does on the GPU (:func:`vtc_jax.kernels.tiling.dot_precision`).

* f32 at jax's default precision: the kernel's ``tt.dot`` carries ``inputPrecision = tf32`` (TF32
  tensor cores, what ``jax.jit`` runs), for a matmul, a convolution, and decode and prefill
  attention programs cross-lowered for CUDA on this CPU machine.
* ``precision=HIGHEST`` on the op, or ``jax.default_matmul_precision("highest")`` around the
  lowering: IEEE f32 (Triton's default ``inputPrecision``, elided from the printed IR).
* Interpret mode is unchanged numerically (the CPU's dot is exact f32 at every level): the same
  programs equal ``jax.jit(fn)`` within 1e-5 of the reference's largest magnitude (summation order
  only), at the default precision and at ``HIGHEST``.

Shapes are small; every check is interpret mode or a CPU cross-lowering.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vtc_jax
from vtc_jax.analysis import analyze
from vtc_jax.kernels import tiling
from vtc_jax.kernels.matmul import matmul
from vtc_jax.templates import Match, Reject
from vtc_jax.testing import cross_lower, triton_ir_text

pytestmark = pytest.mark.filterwarnings("ignore::vtc_jax.VTCFallbackWarning")

RTOL = 1e-5
HI = lax.Precision.HIGHEST
B, T, H, HKV, D = 2, 24, 4, 2, 16
G = H // HKV
S = 8


def rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# --------------------------------------------------------------------------------------------
# Programs (each reads its operands through data movement, so VTC takes its contraction)
# --------------------------------------------------------------------------------------------

def mm(x, w, precision=None):
    return jnp.tanh(jnp.dot(x.T, w, precision=precision))


def conv(x, w, precision=None):
    y = lax.conv_general_dilated(jnp.transpose(x, (0, 3, 1, 2)), w, (1, 1), "SAME", precision=precision,
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return jax.nn.relu(y)


def _heads(x):            # (B, S, H, D) <-> (B, H, S, D)
    return jnp.transpose(x, (0, 2, 1, 3))


def _attend(q, k, v, mask, precision=None, pv_precision="same"):
    """GQA attention through a repeat and head transposes; ``precision`` of q·kᵀ and, unless
    ``pv_precision`` says otherwise, of p·v."""
    k, v = _heads(jnp.repeat(k, G, axis=2)), _heads(jnp.repeat(v, G, axis=2))
    s = jnp.matmul(_heads(q), jnp.swapaxes(k, -1, -2), precision=precision) * D ** -0.5
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    o = jnp.matmul(p, v, precision=precision if pv_precision == "same" else pv_precision)
    return _heads(o).reshape(q.shape[0], q.shape[1], -1)


def decode(q, kc, vc, pos, precision=None, pv_precision="same"):
    return _attend(q, kc, vc, jnp.arange(T) <= pos, precision, pv_precision)


def prefill(q, k, v, precision=None, pv_precision="same"):
    return _attend(q, k, v, jnp.tril(jnp.ones((S, S), bool)), precision, pv_precision)


PROGRAMS = {
    "matmul": (mm, lambda: (rand((32, 16)), rand((32, 48), 1)), "vtc_matmul"),
    "conv": (conv, lambda: (rand((2, 8, 8, 16)), rand((32, 16, 3, 3), 1)), "vtc_conv"),
    "decode": (decode, lambda: (rand((B, 1, H, D)), rand((B, T, HKV, D), 1), rand((B, T, HKV, D), 2),
                                jnp.int32(13)), "vtc_decode_attention"),
    "prefill": (prefill, lambda: (rand((B, S, H, D)), rand((B, S, HKV, D), 1), rand((B, S, HKV, D), 2)),
                "vtc_prefill_attention"),
}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def _optimize(fn, backend):
    return vtc_jax.optimize(fn, backend=backend, guard=None)


def kernel_dots(fn, args, kernel):
    """``inputPrecision`` of every f32 ``tt.dot`` in the Triton kernels named ``kernel*`` of
    ``optimize(fn)`` cross-lowered for CUDA: "tf32", "ieee" (Triton's default, elided when
    printed) or another of Triton's names."""
    mod = cross_lower(_optimize(fn, "triton"), *args)
    names = [k.name for k in mod.triton_kernels]
    assert any(n.startswith(kernel) for n in names), names
    found = []
    for k in mod.triton_kernels:
        if not k.name.startswith(kernel):
            continue
        for line in triton_ir_text(k.ir).splitlines():
            if "tt.dot " in line:
                assert "xf32> * tensor<" in line, line       # f32 operands (the case that matters)
                m = re.search(r"inputPrecision = (\w+)", line)
                found.append(m.group(1) if m else "ieee")
    assert found, f"no tt.dot in {kernel}"
    return found


def check_close(out, ref, rtol=RTOL):
    """Max abs difference within ``rtol`` of the reference's largest magnitude."""
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape
        assert np.max(np.abs(a - b)) <= rtol * max(np.max(np.abs(b)), 1.0), np.max(np.abs(a - b))


def with_precision(fn, **kw):
    def f(*args):
        return fn(*args, **kw)
    f.__name__ = fn.__name__
    return f


# --------------------------------------------------------------------------------------------
# The CUDA lowering: TF32 at the default, IEEE at HIGHEST
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PROGRAMS)
def test_default_precision_f32_runs_on_tf32_tensor_cores(name):
    fn, args, kernel = PROGRAMS[name]
    assert set(kernel_dots(fn, args(), kernel)) == {"tf32"}


@pytest.mark.parametrize("name", PROGRAMS)
def test_highest_on_the_op_is_ieee(name):
    fn, args, kernel = PROGRAMS[name]
    assert set(kernel_dots(with_precision(fn, precision=HI), args(), kernel)) == {"ieee"}


@pytest.mark.parametrize("name", PROGRAMS)
def test_highest_default_matmul_precision_context_is_ieee(name):
    fn, args, kernel = PROGRAMS[name]
    with jax.default_matmul_precision("highest"):
        assert set(kernel_dots(fn, args(), kernel)) == {"ieee"}


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_attention_dots_of_different_precision_both_take_the_more_precise(name):
    fn, args, kernel = PROGRAMS[name]
    assert set(kernel_dots(with_precision(fn, precision=None, pv_precision=HI), args(), kernel)) == {"ieee"}
    assert set(kernel_dots(with_precision(fn, precision=HI, pv_precision=lax.Precision.HIGH), args(),
                           kernel)) == {"ieee"}


def test_kernel_precision_none_follows_the_setting_at_lowering():
    """The kernel entry point's ``precision=None`` resolves when the kernel is built: the same
    call is TF32 without a setting and IEEE under ``default_matmul_precision("float32")``."""
    def f(a, b):
        return matmul(a, b, dimension_numbers=(((1,), (0,)), ((), ())), backend="triton")

    a, b = rand((32, 32)), rand((32, 32), 1)

    def precisions():
        return {re.search(r"inputPrecision = (\w+)", ln).group(1) if "inputPrecision" in ln else "ieee"
                for k in cross_lower(f, a, b).triton_kernels
                for ln in triton_ir_text(k.ir).splitlines() if "tt.dot " in ln}

    assert precisions() == {"tf32"}
    with jax.default_matmul_precision("float32"):
        assert precisions() == {"ieee"}
    with jax.default_matmul_precision("tensorfloat32"):
        assert precisions() == {"tf32"}


# --------------------------------------------------------------------------------------------
# Interpret mode: numerically what it was (exact f32 dots on the CPU at every level)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", [None, HI], ids=["default", "highest"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_interpret_mode_equals_jit(name, precision):
    fn, args, _ = PROGRAMS[name]
    fn = with_precision(fn, precision=precision)
    args = args()
    opt = _optimize(fn, "interpret")
    check_close(opt(*args), jax.jit(fn)(*args))
    assert opt.last[1].kernels, "no kernel ran"


# --------------------------------------------------------------------------------------------
# The one rule: tiling.dot_precision / resolve_precision
# --------------------------------------------------------------------------------------------

def test_resolve_precision_maps_as_jax_does():
    P, A = lax.Precision, lax.DotAlgorithmPreset
    r = tiling.resolve_precision
    assert r(None) == P.DEFAULT
    assert r(P.HIGH) == P.HIGH and r((P.HIGH, P.HIGH)) == P.HIGH
    assert r((P.DEFAULT, P.HIGHEST)) == P.HIGHEST          # XLA: TF32 only when neither asks HIGHEST
    assert r(A.DEFAULT) == P.DEFAULT and r(A.TF32_TF32_F32) == A.TF32_TF32_F32
    for s, want in (("default", P.DEFAULT), ("bfloat16", P.DEFAULT), ("high", P.HIGH),
                    ("tensorfloat32", P.HIGH), ("float32", P.HIGHEST), ("highest", P.HIGHEST),
                    ("BF16_BF16_F32", A.BF16_BF16_F32)):
        assert r(s) == want, s
        with jax.default_matmul_precision(s):
            assert r(None) == want, s
            assert r(P.DEFAULT) == P.DEFAULT      # an explicit level is not overridden


def test_dot_precision_per_dtype():
    P, A = lax.Precision, lax.DotAlgorithmPreset
    f32, bf16, acc = np.float32, jnp.bfloat16, np.dtype(np.float32)
    assert tiling.dot_precision(None, f32) == (P.DEFAULT, acc)        # TF32 on the GPU
    assert tiling.dot_precision(P.HIGH, f32) == (P.HIGH, acc)         # TF32 too (as XLA)
    assert tiling.dot_precision(HI, f32) == (HI, acc)                 # IEEE
    assert tiling.dot_precision(HI, bf16) == (None, acc)              # 16-bit: tensor cores, unchanged
    assert tiling.dot_precision(A.BF16_BF16_F32_X3, f32) == (A.BF16_BF16_F32_X3, acc)
    with jax.default_matmul_precision("highest"):
        assert tiling.dot_precision(None, f32) == (HI, acc)


def test_algorithms_triton_lacks_are_declined():
    A = lax.DotAlgorithmPreset
    assert tiling.precision_unsupported(A.ANY_F8_ANY_F8_F32)
    assert tiling.precision_unsupported(A.F64_F64_F64)
    assert tiling.precision_unsupported(None) is None
    assert tiling.precision_unsupported(A.TF32_TF32_F32_X3) is None
    custom = lax.DotAlgorithm(jnp.float32, jnp.float32, jnp.float32)
    assert tiling.resolve_precision(custom) is custom and tiling.precision_unsupported(custom)
    with pytest.raises(NotImplementedError):
        tiling.dot_precision(A.F64_F64_F64, np.float32)
    with pytest.raises(ValueError):
        tiling.more_precise(A.BF16_BF16_F32, A.TF32_TF32_F32)
    assert tiling.more_precise(None, None) is None                      # resolved when built
    assert tiling.more_precise(None, HI) == HI

    args = PROGRAMS["matmul"][1]()
    a = analyze(with_precision(mm, precision=A.ANY_F8_ANY_F8_F32), args, {})
    assert not any(isinstance(m, Match) and m.kind == "matmul" for m in a.matches.values())
    assert any(isinstance(m, Reject) and "dot algorithm" in m.reason for m in a.matches.values()), \
        [m for m in a.matches.values()]


def test_sdpa_preset_on_bf16_is_the_default():
    """``jax.nn.dot_product_attention`` on bf16 puts ``BF16_BF16_F32`` on q·kᵀ and nothing on p·v:
    both compute as a bf16 dot with f32 accumulation, so the attention template takes it (one
    precision for both dots) instead of declining two precisions it cannot order."""
    from vtc_jax.kernels.tiling import more_precise, native_precision
    preset = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    assert native_precision(preset, jnp.bfloat16) == jax.lax.Precision.DEFAULT
    assert native_precision(preset, jnp.float32) == preset          # on f32 operands it is a real choice
    assert native_precision(jax.lax.DotAlgorithmPreset.F16_F16_F32, jnp.float16) == jax.lax.Precision.DEFAULT
    assert more_precise(native_precision(preset, jnp.bfloat16), None) in (None, jax.lax.Precision.DEFAULT)


@pytest.mark.parametrize("form", ["a.T @ b", "lax.dot(a.T, b, preferred_element_type=f32)"])
def test_bf16_transposed_dot_runs_on_the_cpu_interpreter(form):
    """A bf16 ``a.T @ b`` of 16×8 operands (issue #25): XLA's CPU DotThunk has no
    BF16 × BF16 → F32 for these blocks and failed at the first call, after ``optimize`` returned.
    On the interpreter the GEMM kernels widen 16-bit operands to f32 (``tiling.interpreter_dtype``:
    exact products, f32 accumulation as before); lowered for CUDA they stay bf16 (tensor cores)."""
    from vtc_jax.kernels.tiling import interpreter_dtype
    fn = (lambda a, b: a.T @ b) if form.startswith("a.T") else \
        (lambda a, b: jax.lax.dot(a.T, b, preferred_element_type=jnp.float32))
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((16, 8)), jnp.bfloat16) for _ in range(2))
    opt = vtc_jax.optimize(fn, backend="interpret", guard=None)   # the GEMM kernel, whatever it wins
    out, ref = opt(a, b), jax.jit(fn)(a, b)
    assert out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)
    assert any("matmul" in k for k in opt.last[1].kernels), opt.last[1].kernels
    assert interpreter_dtype(jnp.bfloat16, "triton") == jnp.bfloat16
    assert interpreter_dtype(jnp.bfloat16, "interpret") == jnp.float32
