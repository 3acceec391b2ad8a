"""Tensor- and data-parallel decode layers compiled for a node of H100s, deviceless: jit and VTC.

``JAX_PLATFORMS=cpu python benchmarks/tp.py`` (about 2 min; jax 0.11+ for the 8-device
topology's shard_map lowering as run here). The zoo's sharded Llama-3-8B and Gemma-2-9B decode
layers (``tests/zoo/tp.py``, paper size, batch 16, a 4096-token cache, bf16) — Megatron-style
GSPMD, ``shard_map`` with explicit ``psum``, and data parallel with donated sharded caches — on
a mesh of 2, 4 and 8 compile-only H100s (``offline.h100_devices``, topology ``1x1xN``). Each is
compiled by XLA twice: ``jax.jit(step)`` and ``vtc_jax.optimize(step, backend="triton")`` (the
sharded programs run per shard: ``spmd.per_shard``). Counts are one device's program: launches,
bytes moved (the project's definition, ``offline``), XLA's temporary buffers, and the
collectives (all-reduce, all-gather, ...). Time is the roofline of those counts, launches × 2 µs
+ bytes / 3.35 TB/s — modelled from the compile, not measured, and without the collectives'
own time (equal counts on both sides). Writes the ``tp`` block of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import jax  # noqa: E402

import vtc_jax  # noqa: E402
from vtc_jax import offline  # noqa: E402
from tests.zoo import tp  # noqa: E402
from blocks import write_block  # noqa: E402

BEGIN, END = "<!-- tp:begin -->", "<!-- tp:end -->"
MiB = 2 ** 20
LAUNCH_S, BANDWIDTH = 2e-6, 3.35e12
NOTE = ("Reading it: the tensor-parallel layers get kernels at N = 2 and 4; at N = 8 (one KV head per device) "
        "the shard_map layers' kernels lose to XLA's fusions and the guard, compiling the shard_map body as each "
        "device runs it, keeps XLA's program (0 Triton launches): shard_map_psum is then jit's program. The GSPMD "
        "layers are the per-shard rewrite of it, which moves about a third fewer bytes than GSPMD's own program "
        "(Gemma's 1.37× at N = 8 comes from the rewrite alone; Llama's keeps 8 Triton launches there, 18 launches "
        "against 22). The data-parallel layers keep their kernels at every N. `tests/test_tp.py` checks these "
        "compiles on both CI legs (N = 4 and 8).")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _collectives(hlo: str) -> dict[str, int]:
    return {k: hlo.count(f" {k}(") + hlo.count(f" {k}-start(") for k in COLLECTIVES}


def _row(program: Any) -> dict[str, Any]:
    return {"launches": len(program.launches), "triton": len(program.triton_launches), "bytes": program.bytes,
            "temp": program.memory.get("temp_size_in_bytes", 0), "collectives": _collectives(program.hlo),
            "time_us": (len(program.launches) * LAUNCH_S + program.bytes / BANDWIDTH) * 1e6}


def measure(name: str, style: str, n: int) -> dict[str, Any]:
    devices = offline.h100_devices(n)
    step = tp.make(name, style, devices=devices)
    args = tp.example_args(name, "paper", style, devices=devices)
    donate = tp.DONATE.get(name, ())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jit = offline.compile_program(step, *args, donate_argnums=donate, placed=True, kernels=False)
        opt = vtc_jax.optimize(step, backend="triton", donate_argnums=donate)
        vtc = offline.compile_program(opt, *args, placed=True, kernels=False)
    return {"jit": _row(jit), "vtc": _row(vtc)}


def _coll(c: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in c.items() if v) or "none"


def render(rows: dict[tuple[str, str, int], dict[str, Any]], info: str) -> str:
    lines = [BEGIN, "## Sharded decode layers on a node of H100s (compiled, deviceless)", "",
             "`JAX_PLATFORMS=cpu python benchmarks/tp.py`. " + info, "",
             "The zoo's tensor- and data-parallel decode layers (`tests/zoo/tp.py`) at paper size (Llama-3-8B, "
             "Gemma-2-9B; batch 16, 4096-token caches, bf16) on a mesh of N compile-only H100s. Per device: "
             "launches (Triton kernels among them), bytes moved, XLA's temporary buffers, collectives; time is "
             "the roofline of those counts (launches × 2 µs + bytes / 3.35 TB/s, collectives not timed) — "
             "modelled from the compile, not measured. VTC's sharded programs run per shard "
             "(`spmd.per_shard`; shard_map_psum is per shard as written).", "",
             "| program | style | N | launches jit → VTC (Triton) | MiB moved jit → VTC | temp MiB jit → VTC "
             "| collectives jit / VTC | time jit → VTC, µs | speed-up |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for (name, style, n), r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {style} | {n} | {r['error']} | | | | | |")
            continue
        j, v = r["jit"], r["vtc"]
        coll = _coll(j["collectives"]) if j["collectives"] == v["collectives"] else \
            f"{_coll(j['collectives'])} / {_coll(v['collectives'])}"
        lines.append(f"| {name} | {style} | {n} | {j['launches']} → {v['launches']} ({v['triton']}) | "
                     f"{j['bytes'] / MiB:,.1f} → {v['bytes'] / MiB:,.1f} | {j['temp'] / MiB:,.1f} → "
                     f"{v['temp'] / MiB:,.1f} | {coll} | {j['time_us']:,.1f} → {v['time_us']:,.1f} | "
                     f"{j['time_us'] / v['time_us']:.2f}× |")
    lines += ["", NOTE, END]
    return "\n".join(lines)


def _info(started: float) -> str:
    import jaxlib
    return (f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC in "
            f"{(time.time() - started) / 60:.1f} min on {platform.machine()}, {os.cpu_count()} cores, no GPU; "
            f"Python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
            "target: H100 SXM (sm_90), deviceless.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="2,4,8")
    p.add_argument("--dry", action="store_true", help="print the block, write nothing")
    ns = p.parse_args()
    started = time.time()
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for name in tp.PROGRAMS:
        for style in tp.STYLES:
            for n in map(int, ns.devices.split(",")):
                t0 = time.perf_counter()
                try:
                    rows[(name, style, n)] = measure(name, style, n)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    rows[(name, style, n)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
                print(f"{name} {style} N={n}: {rows[(name, style, n)]} ({time.perf_counter() - t0:.1f} s)",
                      flush=True)
    block = render(rows, _info(started))
    print(block)
    if ns.dry:
        return
    write_block(block, BEGIN, END)


if __name__ == "__main__":
    main()
