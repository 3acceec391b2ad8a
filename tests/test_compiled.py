"""Rung 3 without private APIs: XLA's deviceless compile for an H100 of whole programs.

The CUDA plugin registers without a GPU under ``JAX_PLATFORMS=cpu``; XLA then compiles for the
described H100 (``vtc_jax.compiled``), Triton kernels included.
"""
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="deviceless CUDA compile needs jax-cuda12-plugin")

import vtc_jax  # noqa: E402
from vtc_jax.compiled import compile_for_h100, stats  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def test_llama_layer_compiles_for_h100_with_its_triton_kernels():
    import llama3_decode as L
    args = L.example_args("small", batch=2)
    jit = stats(compile_for_h100(L.step, args, (2, 3)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        vtc = stats(compile_for_h100(vtc_jax.optimize(L.step, backend="triton", donate_argnums=(2, 3)), args, (2, 3)))
    assert jit.triton == 0 and vtc.triton >= 5          # every Pallas kernel compiled by XLA's Triton
    assert jit.launches and vtc.launches and not vtc.loops
    # the donated caches alias their outputs in both programs
    assert jit.aliased > 0 and vtc.aliased == jit.aliased
    assert 0 < vtc.buffers and 0 < jit.buffers
    assert all(x.bytes >= 0 for x in (*jit.launches, *vtc.launches))


def test_scan_body_launches_are_found_inside_the_loop():
    import llama3_scan as LS
    args = LS.example_args("small", batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        s = stats(compile_for_h100(vtc_jax.optimize(LS.step, backend="triton", donate_argnums=(2, 3)), args, (2, 3)))
    assert s.loops and sum(x.kind == "triton" and x.in_loop for x in s.launches) >= 5
