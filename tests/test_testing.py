"""vtc_jax.testing on a tiny Pallas Triton kernel (add one to (64,) blocks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from vtc_jax.testing import TRITON_CALL_TARGET, check_kernel, cross_lower

BLOCK = 64


def add_one(x, *, backend="interpret", block=BLOCK):
    """Elementwise x + 1 over a 1-D grid of `block`-sized blocks."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // block,),
        in_specs=[spec], out_specs=spec, name="add_one",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=backend == "interpret")(x)


def add_one_value_slice(x, *, backend="interpret"):
    """Interprets fine but a value-level slice does not lower to Triton (the case rung 2 catches)."""
    def kernel(x_ref, o_ref):
        v = x_ref[...]
        o_ref[...] = jnp.concatenate([v[BLOCK // 2:], v[:BLOCK // 2]]) + 1

    spec = pl.BlockSpec((BLOCK,), lambda i: (i,))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // BLOCK,),
        in_specs=[spec], out_specs=spec,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=backend == "interpret")(x)


def test_check_kernel_passes_and_finds_triton_ir():
    x = jnp.arange(128, dtype=jnp.float32)
    res = check_kernel(add_one, lambda x: x + 1, (x,), rtol=0, atol=0)
    np.testing.assert_array_equal(res.output, np.arange(128) + 1)
    assert TRITON_CALL_TARGET in res.text
    [k] = res.triton_kernels
    name, ir = k  # unpacks as (name, ir_bytes)
    assert name == "add_one" and ir[:4] == b"ML\xefR"  # MLIR bytecode magic
    assert (k.num_warps, k.num_stages, k.grid) == (4, 1, (2, 1, 1))


def test_check_kernel_bf16_compares_in_f32():
    x = jnp.linspace(-2, 2, 128, dtype=jnp.bfloat16)
    check_kernel(add_one, lambda x: x + 1, (x,), rtol=1e-2, atol=1e-2)


def test_check_kernel_catches_wrong_values():
    x = jnp.arange(128, dtype=jnp.float32)
    with pytest.raises(AssertionError):
        check_kernel(add_one, lambda x: x + 2, (x,), rtol=1e-6, atol=0, lower=False)


def test_check_kernel_catches_shape_and_dtype():
    x = jnp.arange(128, dtype=jnp.float32)
    with pytest.raises(AssertionError, match="shape"):
        check_kernel(add_one, lambda x: (x + 1)[:64], (x,), rtol=0, atol=0, lower=False)
    with pytest.raises(AssertionError, match="dtype"):
        check_kernel(add_one, lambda x: (x + 1).astype(jnp.int32), (x,), rtol=0, atol=0,
                     lower=False)


def test_check_kernel_catches_what_only_lowering_sees():
    x = jnp.arange(128, dtype=jnp.float32)
    ref = lambda x: jnp.roll(x.reshape(2, BLOCK), -BLOCK // 2, axis=1).reshape(-1) + 1
    check_kernel(add_one_value_slice, ref, (x,), rtol=0, atol=0, lower=False)  # interprets fine
    with pytest.raises(NotImplementedError, match="Unimplemented primitive"):
        check_kernel(add_one_value_slice, ref, (x,), rtol=0, atol=0)


def test_check_kernel_catches_missing_triton_call():
    x = jnp.arange(128, dtype=jnp.float32)
    plain = lambda x, *, backend: x + 1  # no pallas_call at all
    with pytest.raises(AssertionError, match="custom call"):
        check_kernel(plain, lambda x: x + 1, (x,), rtol=0, atol=0)


def test_cross_lower_counts_ops_and_kernels():
    def f(x):
        y = add_one(x.T.reshape(-1), backend="triton")
        return add_one(y, backend="triton").reshape(16, 8).T

    m = cross_lower(f, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert m.count("stablehlo.transpose") == 2
    assert m.count("stablehlo.custom_call") == 2
    assert m.count("stablehlo.dot_general") == 0
    assert [k.name for k in m.triton_kernels] == ["add_one", "add_one"]


def test_cross_lower_accepts_arrays_and_pytrees():
    m = cross_lower(lambda d: add_one(d["x"], backend="triton"),
                    {"x": np.zeros(256, np.float32)})
    assert len(m.triton_kernels) == 1 and m.triton_kernels[0].grid == (4, 1, 1)
