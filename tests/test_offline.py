"""Offline PTX/cubin compile of a tiny Triton kernel (no GPU needed)."""
import jax
import jax.numpy as jnp
import pytest

from test_testing import add_one
from vtc_jax.offline import ABORT_PROBE, SMEM_LIMIT, compile_kernel, compile_lowered, format_table
from vtc_jax.testing import cross_lower

pytestmark = pytest.mark.offline


@pytest.fixture(scope="module")
def lowered():
    return cross_lower(lambda x: add_one(x, backend="triton"),
                       jax.ShapeDtypeStruct((256,), jnp.float32))


def test_compile_kernel_reports_resources(lowered):
    [k] = lowered.triton_kernels
    r = compile_kernel(k.ir, num_warps=4, num_stages=1, name=k.name)
    assert r.ptx_ok and r.cubin_ok, r.error
    assert r.error is None and r.gpu_name == "sm_90a"
    assert r.registers > 0
    assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0
    assert 0 <= r.smem_bytes <= SMEM_LIMIT["sm_90"] and r.fits("sm_90")


def test_compile_lowered_uses_backend_config_and_isolates_failures(lowered):
    [k] = lowered.triton_kernels

    class Mixed:  # good, unparsable, a worker crash (as on LLVM ERROR), good again
        triton_kernels = (k, ("garbage", b"not triton ir"), ("abort", ABORT_PROBE), k)

    good, bad, crash, again = compile_lowered(Mixed, num_stages=2)
    assert good.cubin_ok and (good.num_warps, good.num_stages) == (4, 1)
    assert not bad.ptx_ok and "parse" in bad.error and bad.num_stages == 2
    assert not crash.ptx_ok and "worker signal SIGABRT" in crash.error
    assert again.cubin_ok and again.registers == good.registers
    table = format_table([good, bad, crash, again])
    assert "add_one" in table and "FAIL" in table


def test_compile_kernel_sm80():
    m = cross_lower(lambda x: add_one(x, backend="triton"), jax.ShapeDtypeStruct((64,), jnp.float32))
    r = compile_kernel(m.triton_kernels[0].ir, num_warps=4, num_stages=1, arch="8.0")
    assert r.cubin_ok and r.gpu_name == "sm_80", r.error
