#!/usr/bin/env python
"""Decode by cache position: Llama-3-8B and Gemma-2-9B decode layers over a sweep of positions,
batches and context lengths (modelled from XLA's deviceless H100 compile).

    JAX_PLATFORMS=cpu python benchmarks/positions.py          # rewrites the "positions" block
    JAX_PLATFORMS=cpu python benchmarks/positions.py --dry    # prints it

Why: every decode figure elsewhere is at the last cache position, where the attention reads the
whole cache on both sides. A server decodes at every position: VTC's decode attention reads the
keys up to ``pos`` (its blocks past the valid range are never loaded), XLA's fusions read the
whole cache at every position. The compiled program does not depend on ``pos``; its cost does.

Per (model, context T, batch B): ``jax.jit(step)`` and ``vtc_jax.optimize(step)`` (the default
guard), caches donated, compiled deviceless for an H100 (``offline.compile_program``). At each
position the modelled time is the compile's launches × launch overhead + bytes / HBM bandwidth
(``costmodel.GPUS["h100-sxm"]``), with the bytes of VTC's attention launches (the Triton calls
named ``*decode_attention*``) that are the K/V caches scaled to the key blocks up to ``pos``
(Gemma-2's local window: from ``pos - window``); jit's launches unchanged. The *roofline* is the
least any program moves: every weight once, K and V up to ``pos`` (the window), the new rows
and the activations, at HBM bandwidth, no launch cost; *% of roofline* is roofline / modelled.
Modelled, not measured: ``benchmarks/gpu.py`` measures the attention alone on a GPU.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import math
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import vtc_jax  # noqa: E402
from vtc_jax.costmodel import GPUS  # noqa: E402
from vtc_jax.offline import compile_program  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu python benchmarks/positions.py"
BEGIN, END = "<!-- positions:begin -->", "<!-- positions:end -->"
GPU = GPUS["h100-sxm"]
MODELS = ("llama3_decode", "gemma2_layer")
CONTEXTS = (4096, 16384)
BATCHES = (1, 16, 64)
BLOCK_K = 64   # the decode kernel's key block (kernels.flash.AttentionConfig.decode)


def _args(mod: Any, batch: int, context: int) -> tuple:
    """The example's paper-size arguments with the caches' context set to ``context``."""
    args = list(mod.example_args("paper", batch=batch))
    for i in (2, 3):
        s = args[i]
        args[i] = jax.ShapeDtypeStruct((s.shape[0], context) + tuple(s.shape[2:]), s.dtype)
    return tuple(args)


def _nbytes(x: Any) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _keys_read(pos: int, context: int, window: int | None) -> int:
    """Keys VTC's decode attention loads at ``pos``: whole key blocks over [lo, pos]."""
    lo = max(0, pos + 1 - window) if window else 0
    return min(context, math.ceil((pos + 1) / BLOCK_K) * BLOCK_K) - (lo // BLOCK_K) * BLOCK_K


def measure(name: str, batch: int, context: int) -> dict[str, Any]:
    from accounting import donate_argnums, load_example
    mod = load_example(name)
    args, donate = _args(mod, batch, context), donate_argnums(mod)
    window = getattr(mod.SIZES["paper"], "window", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jit = compile_program(jax.jit(mod.step, donate_argnums=donate), *args, kernels=False)
        fn = vtc_jax.optimize(mod.step, backend="triton", donate_argnums=donate)
        vtc = compile_program(fn, *args, kernels=False)
    cache = _nbytes(args[2]) + _nbytes(args[3])
    weights = sum(_nbytes(x) for x in jax.tree.leaves(args[0]))
    attn = [x for x in vtc.launches if x.triton and "decode_attention" in x.name]
    row: dict[str, Any] = dict(model=name, T=context, B=batch, window=window, positions={},
                               launches=(len(jit.launches), len(vtc.launches)))
    for pos in (context // 8, context // 2, context - 1):
        f = _keys_read(pos, context, window) / context
        vtc_bytes = vtc.bytes - sum(min(x.read_bytes, cache) for x in attn) * (1 - f)
        t_jit = len(jit.launches) * GPU.launch_overhead + jit.bytes / GPU.hbm_bandwidth
        t_vtc = len(vtc.launches) * GPU.launch_overhead + vtc_bytes / GPU.hbm_bandwidth
        ideal = (weights + cache * f + 4 * _nbytes(args[1])) / GPU.hbm_bandwidth
        row["positions"][pos] = dict(jit=t_jit, vtc=t_vtc, roof=ideal)
    return row


def render(rows: list[dict[str, Any]], info: str) -> str:
    out = [BEGIN, "## Decode by cache position (modelled from the compile, deviceless H100)", "",
           f"`{COMMAND}`. {info}", "",
           "Llama-3-8B and Gemma-2-9B decode layers (the examples, bf16, caches donated) at context T and "
           "batch B, each compiled once by XLA for an H100 (`jax.jit` and `vtc_jax.optimize` with its default "
           "guard); at each position the time is the compile's launches × 2 µs + bytes / 3.35 TB/s, VTC's "
           "decode-attention launches charged the K/V blocks up to the position (Gemma-2's sliding window: "
           "from `pos - 4096`), jit's fusions the whole cache, as they read it. *Roofline*: every weight, K/V "
           "up to the position (the window) and the activations once at HBM bandwidth, no launch cost; "
           "*% roof* = roofline / modelled time. Modelled, not measured (the measured attention-alone sweep "
           "is in the H200 section).", "",
           "| model | T | B | launches jit → VTC | pos T/8: jit → VTC µs (×) | pos T/2 | pos T−1 | mean × | "
           "VTC % roof (T/8, T/2, T−1) | jit % roof |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ps = list(r["positions"].values())
        cells = [f"{p['jit'] * 1e6:,.0f} → {p['vtc'] * 1e6:,.0f} ({p['jit'] / p['vtc']:.2f}×)" for p in ps]
        mean = sum(p["jit"] / p["vtc"] for p in ps) / len(ps)
        roof = ", ".join(f"{p['roof'] / p['vtc'] * 100:.0f}%" for p in ps)
        jroof = ", ".join(f"{p['roof'] / p['jit'] * 100:.0f}%" for p in ps)
        out.append(f"| {r['model']} | {r['T']:,} | {r['B']} | {r['launches'][0]} → {r['launches'][1]} | "
                   + " | ".join(cells) + f" | {mean:.2f}× | {roof} | {jroof} |")
    out.append(END)
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="print the block, write nothing")
    ns = p.parse_args()
    t0 = time.perf_counter()
    rows = []
    for name in MODELS:
        for T in CONTEXTS:
            for B in BATCHES:
                t1 = time.perf_counter()
                rows.append(measure(name, B, T))
                print(f"{name} T={T} B={B}: {time.perf_counter() - t1:.0f} s", file=sys.stderr, flush=True)
    info = (f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in "
            f"{(time.perf_counter() - t0) / 60:.1f} min on {platform.machine()} ({os.cpu_count()} cores), no GPU; "
            f"Python {platform.python_version()}, jax {jax.__version__}; target: H100 SXM (sm_90), deviceless.")
    text = render(rows, info)
    if ns.dry:
        print(text)
        return
    from blocks import write_block
    write_block(text, BEGIN, END, after="<!-- tp:end -->")


if __name__ == "__main__":
    main()
