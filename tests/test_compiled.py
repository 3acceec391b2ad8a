"""Rung 3 on whole programs with control flow: XLA's deviceless compile for an H100 of a scanned
decode step (``vtc_jax.offline.compile_program``) holds the Pallas kernels inside the loop, and
no copy of the stacked cache."""
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="deviceless CUDA compile needs jax-cuda12-plugin")

import vtc_jax  # noqa: E402
from vtc_jax.offline import compile_program  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def test_scanned_llama_compiles_with_kernels_in_the_loop_and_no_cache_copy():
    import llama3_scan as LS
    args = LS.example_args("small", batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        prog = compile_program(vtc_jax.optimize(LS.step, backend="triton", donate_argnums=(2, 3)), *args,
                               kernels=False, donate_argnums=(2, 3))
    # the loop body's kernels are in the HLO (compile_program's launch list does not walk while
    # bodies' thunks yet: counted from the optimised HLO instead)
    assert prog.hlo.count('custom_call_target="__gpu$xla.gpu.triton"') >= 5
    assert "while(" in prog.hlo
    cache_bytes = args[2].size * args[2].dtype.itemsize
    copies = [x for x in prog.launches if x.kind.lower().startswith("copy") and x.bytes >= cache_bytes]
    assert copies == [], copies
