"""``python -m vtc_jax demo``: VTC on a Llama-3 decoder layer, end to end, on any machine.

1. Analyse the paper-size layer (Llama-3-8B, batch 16, context 4096, bf16; ShapeDtypeStructs, no
   allocation) and print the report: which data-movement ops vanish and why, modelled bytes.
2. Optimise the small-size layer and check it against ``jax.jit`` (Pallas interpret mode on CPU).
3. Lower the paper-size optimised layer for CUDA (Triton) and count what is left, when the CUDA
   plugin is installed (the ``test`` extra); otherwise say so.
"""
from __future__ import annotations

import importlib.util
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from .testing import cross_lower


def _example() -> Any:
    """The Llama-3 example ships in ``examples/``; load it from the source tree or the package."""
    here = Path(__file__).resolve().parent
    for path in (here.parent / "examples" / "llama3_decode.py", here / "_examples" / "llama3_decode.py"):
        if path.exists():
            spec = importlib.util.spec_from_file_location("llama3_decode", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules["llama3_decode"] = mod
            spec.loader.exec_module(mod)
            return mod
    raise FileNotFoundError("examples/llama3_decode.py not found next to the package")


def run(batch: int = 16) -> int:
    import vtc_jax

    L = _example()
    print(f"== 1. Analysis: Llama-3-8B decoder layer, batch {batch}, context 4096, bf16 (paper size) ==")
    report = vtc_jax.explain(L.step)(*L.example_args("paper", batch=batch))
    print(report)
    print("  (the figures above are the analytical model; its plain-XLA baseline is an upper bound "
          "that XLA's own H100 compile contradicts: see BENCHMARKS.md, python benchmarks/compiled.py)")

    # guard=None: at this toy size the default guard prices no win and runs plain jax.jit, which
    # would check nothing of the kernels
    print("\n== 2. Equivalence at small size (Pallas interpret mode on CPU, every kernel kept: guard=None) ==")
    ok = True
    for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)):
        args = L.example_args("small", batch=2, dtype=dtype)
        ref = jax.jit(L.step)(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
            f = vtc_jax.optimize(L.step, backend="interpret", guard=None)
            t0 = time.perf_counter()
            out = f(*args)
            secs = time.perf_counter() - t0
        errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                      / max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30))
                for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))]
        good = max(errs) <= tol
        ok &= good
        _, lowered = f.last
        print(f"  {jnp.dtype(dtype).name}: max relative error {max(errs):.2e} (tolerance {tol:g}) "
              f"{'OK' if good else 'FAIL'}; {len(lowered.kernels)} Pallas kernels, "
              f"{len(lowered.skipped)} movement ops not executed; first call {secs:.1f} s (CPU, not a GPU figure)")

    print("\n== 3. Cross-lowering the paper-size layer for CUDA (Triton kernels) ==")
    try:
        f = vtc_jax.optimize(L.step, backend="triton", donate_argnums=(2, 3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
            mod = cross_lower(f, *L.example_args("paper", batch=batch))
            base = cross_lower(jax.jit(L.step, donate_argnums=(2, 3)), *L.example_args("paper", batch=batch))
        names = ("stablehlo.transpose", "stablehlo.concatenate", "stablehlo.dynamic_update_slice",
                 "stablehlo.slice", "stablehlo.broadcast_in_dim", "stablehlo.pad", "stablehlo.gather")
        print("  op counts in the CUDA-lowered module (plain jax.jit -> vtc_jax.optimize):")
        for n in names:
            print(f"    {n:36s} {base.count(n):4d} -> {mod.count(n):4d}")
        print(f"    Triton kernels                       {len(base.triton_kernels):4d} -> {len(mod.triton_kernels):4d}")
    except Exception as exc:  # no CUDA plugin: the demo still stands on steps 1-2
        print(f"  skipped: {type(exc).__name__}: {exc} (install the 'test' extra for the CUDA plugin)")
    return 0 if ok else 1
