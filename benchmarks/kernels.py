#!/usr/bin/env python
"""Offline compile of the kernel templates (verification ladder, rung 2b): registers, spills, smem.

    JAX_PLATFORMS=cpu python benchmarks/kernels.py            # rewrites benchmarks/kernels.md

Each kernel template in its default configuration (block sizes, warps, stages chosen by the
template) at paper-relevant shapes is cross-lowered for CUDA with ``backend="triton"``, and the
module is compiled deviceless for sm_90 by XLA (its own Triton to PTX; ``ptxas -v`` on that PTX;
``vtc_jax.offline.compile_lowered``); no GPU is needed. A second table does the same
for the kernels ``vtc_jax.optimize(step, backend="triton")`` emits for each workload of
``examples/`` at paper size.

The template cases come from ``vtc_jax.kernels.catalog.examples()`` (also what ``vtc-jax kernels``
compiles).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_TRACEBACK_FILTERING", "off")  # so a lowering failure names the frame that raised

import argparse
import math
import functools
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "JAX_PLATFORMS=cpu python benchmarks/kernels.py"
GPU = "sm_90"


from vtc_jax.kernels.catalog import examples  # noqa: E402  (the template cases)


# --------------------------------------------------------------------------------------------
# Compile and tabulate
# --------------------------------------------------------------------------------------------

def _status(r: Any) -> str:
    from vtc_jax.offline import SMEM_LIMIT
    if r.error or not r.cubin_ok:
        return "FAIL: " + ((r.error or "").strip().splitlines() or [""])[0][:120]
    if not r.fits(GPU):
        return f"shared memory > {SMEM_LIMIT[GPU]} B"
    return "spills" if r.spills else "ok"


def compile_cases(cases: Sequence[tuple[str, Callable[[], Any]]], desc: str) -> list[dict[str, Any]]:
    """``cases``: (label, thunk returning a LoweredModule). One row per Triton kernel (or per failure)."""
    from tqdm import tqdm
    from vtc_jax.offline import compile_lowered
    rows = []
    for label, make in tqdm(cases, desc=desc, unit="case"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lowered = make()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append({"case": label, "kernel": "-",
                         "status": f"lowering failed: {_accounting().describe_error(exc)}"})
            continue
        if not lowered.triton_kernels:
            rows.append({"case": label, "kernel": "-", "status": "no Triton kernel in the lowered module"})
            continue
        for k, r in zip(lowered.triton_kernels, compile_lowered(lowered)):
            rows.append({"case": label, "kernel": r.name, "grid": "×".join(map(str, k.grid)),
                         **in_flight(r, k.grid),
                         "warps": r.num_warps, "stages": r.num_stages, "regs": r.registers,
                         "spill": f"{r.spill_store_bytes or 0}/{r.spill_load_bytes or 0}" if r.cubin_ok else "-",
                         "smem": r.smem_bytes, "target": r.gpu_name, "status": _status(r)})
    return rows


def in_flight(r: Any, grid: Sequence[int]) -> dict[str, Any]:
    """Tiles in flight from the PTX (``offline.main_loop``): per CTA (its longest loop: a
    ``cp.async`` pipeline waiting with groups pending keeps >= 2, plain loads 1, a loop-free
    kernel its one block), CTAs one SM holds at once (``GPU.resident_ctas`` from ptxas's
    registers, the warps and the shared memory, capped by the grid's CTAs per SM), and their
    product: the tiles each SM keeps in flight, what Little's law needs to cover DRAM latency."""
    from vtc_jax.costmodel import GPUS
    from vtc_jax.offline import main_loop
    if not r.ptx or not r.registers:
        return {}
    loop = main_loop(r.ptx, r.name)
    gpu = GPUS["h100-sxm"]
    ctas = math.prod(int(g) for g in grid)
    per_sm = min(gpu.resident_ctas(int(r.registers), 32 * int(r.num_warps or 4), int(r.smem_bytes or 0)),
                 -(-ctas // gpu.sms))
    waves = ctas / (gpu.sms * gpu.resident_ctas(int(r.registers), 32 * int(r.num_warps or 4),
                                                int(r.smem_bytes or 0)))
    return {"loop": loop.describe(), "tiles_cta": loop.tiles_per_cta, "ctas_sm": per_sm,
            "tiles_sm": loop.tiles_per_cta * per_sm, "waves": f"{waves:.2f}"}


def template_cases(only: str | None = None) -> list[tuple[str, Callable[[], Any]]]:
    from vtc_jax.testing import cross_lower
    return [(name, functools.partial(lambda c, a: cross_lower(functools.partial(c, backend="triton"), *a), call, args))
            for name, call, args in examples() if only is None or only in name]


def workload_cases(workloads: Sequence[str], batches: Sequence[int]) -> list[tuple[str, Callable[[], Any]]]:
    import vtc_jax
    from vtc_jax.testing import cross_lower
    acc = _accounting()
    out = []
    for w in workloads:
        mod = acc.load_example(w)
        if mod is None:
            print(f"skipped {w}: examples/{w}.py does not exist yet")
            continue
        for b in batches:
            def make(mod: Any = mod, b: int = b) -> Any:
                f = vtc_jax.optimize(mod.step, backend="triton", donate_argnums=acc.donate_argnums(mod))
                return cross_lower(f, *mod.example_args("paper", batch=b))
            out.append((f"{w} b{b}", make))
    return out


def _accounting() -> Any:
    here = Path(__file__).resolve().parent
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    import accounting
    return accounting


def markdown(rows: list[dict[str, Any]]) -> str:
    acc = _accounting()
    cols = ["case", "kernel", "grid", "warps", "stages", "regs", "spill", "smem", "loop", "tiles_cta",
            "ctas_sm", "tiles_sm", "waves", "status"]
    head = ["case", "kernel", "grid", "warps", "stages", "registers", "spill st/ld B", "smem B",
            "main loop (PTX)", "tiles / CTA", "CTAs / SM", "tiles / SM", "waves", "status"]
    return acc._md_table(head, [[("-" if r.get(c) is None else r.get(c)) for c in cols] for r in rows],
                         "llrrrrrrlrrrrl")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "kernels.md"))
    p.add_argument("--only", default=None, help="template cases whose name contains this")
    p.add_argument("--workloads", default=None,
                   help="comma-separated example modules for the second table ('' to skip; default all)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--check", action="store_true", help="exit 1 if any kernel fails, spills or exceeds smem")
    ns = p.parse_args(argv)
    acc = _accounting()
    t0 = time.perf_counter()
    info = acc.machine_info()
    templ = compile_cases(template_cases(ns.only), "templates")
    names = [w.module for w in acc.WORKLOADS] if ns.workloads is None else [w for w in ns.workloads.split(",") if w]
    work = compile_cases(workload_cases(names, [int(b) for b in ns.batches.split(",") if b]), "workloads") \
        if names else []
    elapsed = time.perf_counter() - t0

    def summary(rows: list[dict[str, Any]]) -> str:
        n = len(rows)
        ok = sum(r["status"] == "ok" for r in rows)
        bad = [r for r in rows if r["status"] != "ok"]
        return f"{ok} of {n} kernels compile for {GPU} without spills within the shared-memory limit" + (
            f"; not ok: {', '.join(sorted({r['case'] + ('' if r['kernel'] == '-' else ' ' + r['kernel']) for r in bad}))}."
            if bad else ".")

    def in_flight_summary(rows: list[dict[str, Any]]) -> str:
        from vtc_jax.costmodel import GPUS
        sms = GPUS["h100-sxm"].sms
        measured = [r for r in rows if "tiles_sm" in r]
        ok = [r for r in measured if r["tiles_sm"] >= 2]
        small = [r for r in measured if r["tiles_sm"] < 2
                 and math.prod(int(x) for x in r["grid"].split("×")) < sms]
        other = [r for r in measured if r not in ok and r not in small]
        looped = sorted({f"{r['case']} {r['kernel']}" for r in small if not r["loop"].startswith("no loop")})
        text = (f"Tiles in flight: {len(ok)} of {len(measured)} kernels keep >= 2 per SM; the other "
                f"{len(small)} launch fewer CTAs than the {sms} SMs (a batch-1 vector, a decode "
                "split's combine or reduce, a 28×28 map): their output has fewer tiles than the GPU "
                "has SMs. Those without a loop issue all their loads at once (one DRAM round trip); "
                f"{len(looped)} have a loop and pay it once per iteration"
                + (f" ({'; '.join(looped)}) — more, smaller CTAs (split K) would hide it; not done"
                   if looped else ""))
        if other:
            text += "; not covered by that: " + ", ".join(f"{r['case']} {r['kernel']}" for r in other)
        one = sorted({f"{r['case']} {r['kernel']} ({r['loop']})" for r in measured
                      if r["tiles_cta"] < 2 and not r["loop"].startswith("no loop")})
        if one:
            text += (f". Loops that wait for a load in the iteration that issues it ({len(one)}): "
                     + "; ".join(one))
        return text + "."

    text = "\n".join([
        "# Offline compile of the Triton kernels (sm_90)", "",
        "Regenerate with one command:", "", "```sh", COMMAND, "```", "",
        f"Generated {info['date']} in {elapsed / 60:.1f} min on {info['cpu']} ({info['cores']} cores, {info['ram']}); "
        f"Python {info['python']}, jax {info['jax']}, jaxlib {info['jaxlib']}, vtc_jax {info['vtc_jax']} "
        f"(git {info['commit']}). No GPU: each case is cross-lowered for CUDA (`backend=\"triton\"`) and every Triton "
        "kernel compiled to PTX by XLA's bundled Triton, then to a cubin by `ptxas` "
        "(`vtc_jax.offline.compile_lowered`, compute capability 9.0). Registers and spills from `ptxas -v`; "
        "smem = Triton's dynamic shared memory + static; the limit checked is the sm_90 opt-in maximum per block "
        "(232,448 B). Warps/stages are what the template put in the launch configuration. "
        "Tiles in flight (`in_flight` in this script): *main loop* is the kernel's longest PTX loop — "
        "`cp.async.wait_group N` (Triton's pipeline; N >= 1 keeps >= 2 tiles in flight per CTA), plain "
        "`ld.global`s — *prefetched* when nothing but a `mov` reads them before the back branch (carried into "
        "the next iteration, `tiling.fori_prefetch`), else consumed in the iteration that issues them — or no "
        "loop (the CTA loads its one block at once: 1). *Tiles / CTA* is 2 only when the loop waits for none "
        "of its loads in the iteration that issues them (a pipeline with groups pending, prefetched loads, or "
        "both); one plain load consumed in its own iteration makes it 1, whatever else is staged; *CTAs / SM* is how many of its CTAs an SM holds at once (registers, warps, shared "
        "memory; capped by grid / 132 SMs); *tiles / SM* their product — what covers DRAM latency (Little's "
        "law); *waves* = grid / (132 × CTAs an SM holds). This says the kernels build and fit and how they "
        "keep memory busy, nothing measured about their speed.", "",
        "## Kernel templates, default configurations", "",
        summary(templ), "", in_flight_summary(templ), "", markdown(templ), "",
        "## Kernels `vtc_jax.optimize(step, backend=\"triton\")` emits for each workload (paper size)", "",
        (summary(work) if work else "skipped") + "", "",
        in_flight_summary(work) if work else "", "",
        markdown(work) if work else "", "",
    ])
    Path(ns.out).write_text(text)
    print(text)
    print(f"wrote {ns.out} in {elapsed:.0f} s")
    bad = [r for r in templ + work if r["status"] != "ok"]
    return 1 if (ns.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
