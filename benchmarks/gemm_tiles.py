#!/usr/bin/env python
"""The matmul template's prefill-GEMM tiles against XLA's GEMM on a GPU (rung 4). Not run in CI.

    python benchmarks/gemm_tiles.py [--jsonl rows.jsonl] [--runs 10]

For the GEMM shapes of the corpus programs where a GPU measured the template losing to XLA (BERT's
f32 projections and MLP at 4,096 rows, LoRA's bf16 8,192 × 4,096 × 4,096), one
``vtc_jax.kernels.matmul.matmul`` launch per tile configuration (block M/N/K, warps, stages) is
timed back to back (``profiling.time_interleaved``) beside ``jnp.dot`` under ``jax.jit`` at jax's
default precision, and checked against it. Why: ``tiling.gemm_config`` chose 64 × 64 tiles with 4
warps for every prefill GEMM, and the H100 measured that at a tenth of XLA's rate (BENCHMARKS.md,
"Kernel by kernel"); the rows say which tiles the template should take.

On a machine without a GPU it prints "no GPU: nothing measured" and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

SHAPES = (   # (m, k, n, dtype): the corpus GEMMs the H100 timed
    (4096, 768, 3072, "float32"),    # BERT up
    (4096, 3072, 768, "float32"),    # BERT down
    (4096, 768, 768, "float32"),     # BERT q / k / v / out
    (8192, 4096, 4096, "bfloat16"),  # LoRA's projections
)
TILES = (    # (block_m, block_n, block_k, num_warps, num_stages); None: gemm_config's choice
    (64, 64, None, 4, None),
    (128, 128, 32, 4, 3),
    (128, 128, 32, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 32, 8, 3),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (256, 128, 64, 8, 3),
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jsonl", default=None)
    p.add_argument("--runs", type=int, default=10)
    ns = p.parse_args()
    import jax
    if jax.default_backend() != "gpu":
        print("no GPU: nothing measured")
        return 0
    import jax.numpy as jnp
    import numpy as np
    from vtc_jax.kernels.matmul import matmul
    from vtc_jax.profiling import time_interleaved
    dn = (((1,), (0,)), ((), ()))
    for m, k, n, dt in SHAPES:
        ka, kb = jax.random.split(jax.random.key(0))
        a = (jax.random.normal(ka, (m, k), jnp.float32) * 0.05).astype(dt)
        b = (jax.random.normal(kb, (k, n), jnp.float32) * 0.05).astype(dt)
        xla = jax.jit(jnp.dot)
        ref = np.asarray(xla(a, b), np.float32)
        flops = 2 * m * n * k
        for bm, bn, bk, warps, stages in TILES:
            row = {"m": m, "k": k, "n": n, "dtype": dt, "block_m": bm, "block_n": bn, "block_k": bk,
                   "num_warps": warps, "num_stages": stages, "device": jax.devices()[0].device_kind}
            try:
                f = jax.jit(lambda x, y, bm=bm, bn=bn, bk=bk, w=warps, s=stages: matmul(
                    x, y, dimension_numbers=dn, block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                    num_stages=s, backend="triton"))
                got = np.asarray(f(a, b), np.float32)
                row["max_rel_err"] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                t_xla, t_vtc = time_interleaved([xla, f], lambda: (a, b), ns.runs)
                row.update(xla_us=1e6 * t_xla, vtc_us=1e6 * t_vtc, vtc_tflops=flops / t_vtc / 1e12,
                           xla_tflops=flops / t_xla / 1e12)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a row
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
            if ns.jsonl:
                with open(ns.jsonl, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
