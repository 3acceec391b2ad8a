"""Per-launch roofline of the compiled programs: what each launch of jax.jit's and VTC's program
costs on an H100 by a bandwidth/latency model, and the end-to-end modelled ratio.

    JAX_PLATFORMS=cpu python benchmarks/roofline.py      # reads benchmarks/compiled.json

Input: ``benchmarks/compiled.json`` (``benchmarks/compiled.py``: every launch of XLA's deviceless
H100 compile, its HBM bytes, shared memory and grid). Nothing is run; no GPU figure is claimed.

The model (why these terms: a decode step moves far more bytes than it computes, and its launches
are small): per launch

    achieved BW = HBM BW                                   XLA's fusions / library calls (tuned)
                = min(HBM BW, min(CTAs, SMs · resident) · in flight / latency)   a Pallas kernel
    modelled    = max(bytes / achieved BW, latency)        one HBM round trip at the least
    end to end  = Σ modelled + launches · launch overhead

A Pallas kernel's bytes in flight per CTA are its pipelined shared-memory buffers (the staged
K/V or weight tiles XLA reports as the launch's shared memory), at least ``PLAIN_INFLIGHT`` (the
vectorised loads of one block a kernel without staged buffers keeps outstanding; a few KB of
shared memory are reduction scratch, not loads). ``resident`` is how many of its CTAs one SM
holds at once (``GPU.resident_ctas`` from the kernel's registers and warps in ptxas's report and
its shared memory: the occupancy calculator's limits); each keeps its own bytes in flight, so a
grid of many small CTAs covers the latency that one CTA per SM would not. The bound column says which term wins:
``latency`` (the launch is smaller than one round trip), ``bandwidth``, or ``in flight`` (Little's
law: too few CTAs or too few bytes per CTA to cover the latency). Flops are not counted: the
conv/prefill-GEMM workloads (YOLO, EfficientViT) are partly compute-bound, so their figures are a
memory-side lower bound. Constants from ``vtc_jax.costmodel.GPUS["h100-sxm"]``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vtc_jax.costmodel import GPUS  # noqa: E402

GPU = GPUS["h100-sxm"]
PLAIN_INFLIGHT = 16 * 1024     # bytes per CTA: 128 threads x 16 B x 8 loads outstanding
BEGIN, END = "<!-- roofline:begin -->", "<!-- roofline:end -->"


def launch_model(launch: list, kernel: list | None = None) -> dict:
    """Modelled time of one compiled launch (``compiled.json`` per_launch row; ``kernel``: its
    ``kernels`` row, ``[name, registers, spills.., smem, num_warps, num_stages]``, for occupancy)."""
    name, kind, triton, rd, wr, _in_place, smem = launch[:7]
    grid = launch[7] if len(launch) > 7 else []
    nbytes = rd + wr
    bw, bound = GPU.hbm_bandwidth, "bandwidth"
    if triton:
        ctas = math.prod(grid) if grid else GPU.sms
        resident = 1
        if kernel is not None and kernel[1]:
            resident = GPU.resident_ctas(int(kernel[1]), 32 * int(kernel[5] or 4), int(smem))
        inflight = min(ctas, GPU.sms * resident) * max(smem, PLAIN_INFLIGHT)
        little = inflight / GPU.hbm_latency
        if little < bw:
            bw, bound = little, "in flight"
    t = nbytes / bw
    if t < GPU.hbm_latency:
        t, bound = GPU.hbm_latency, "latency"
    return {"name": name, "triton": bool(triton), "bytes": nbytes, "ideal_us": nbytes / GPU.hbm_bandwidth * 1e6,
            "modelled_us": t * 1e6, "bound": bound}


def program_model(per_launch: list, kernels: list = ()) -> dict:
    by_name = {k[0]: k for k in kernels}
    rows = [launch_model(x, by_name.get(x[0])) for x in per_launch]
    total = sum(r["modelled_us"] for r in rows) + len(rows) * GPU.launch_overhead * 1e6
    return {"rows": rows, "total_us": total, "ideal_us": sum(r["ideal_us"] for r in rows)}


def render(data: dict, detail: tuple[str, int] = ("llama3_decode", 16)) -> str:
    out = [BEGIN, "## Roofline of the compiled programs (modelled, H100 SXM)", "",
           "`JAX_PLATFORMS=cpu python benchmarks/roofline.py` (from `benchmarks/compiled.json`). A model, "
           "not a measurement: every launch of XLA's compile is charged `max(bytes / achieved bandwidth, "
           f"latency)` plus {GPU.launch_overhead * 1e6:.1f} µs of launch overhead; XLA's launches reach "
           f"{GPU.hbm_bandwidth / 1e12:.2f} TB/s, a Pallas kernel what its CTAs keep in flight allows "
           f"(Little's law over the CTAs resident at once, {GPU.hbm_latency * 1e6:.1f} µs latency, "
           f"{GPU.sms} SMs). Flops are not counted "
           "(YOLO and EfficientViT are partly compute-bound: a lower bound there). See the module "
           "docstring for why.", "",
           "| workload | batch | launches jit / VTC | ideal µs jit / VTC | modelled µs jit / VTC | modelled speed-up |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["rows"]:
        j, v = (program_model(r[s]["per_launch"], r[s].get("kernels", ())) for s in ("jit", "vtc"))
        out.append(f"| {r['workload']} | {r['batch']} | {len(j['rows'])} / {len(v['rows'])} | "
                   f"{j['ideal_us']:,.1f} / {v['ideal_us']:,.1f} | {j['total_us']:,.1f} / {v['total_us']:,.1f} | "
                   f"{j['total_us'] / v['total_us']:.2f}× |")
    for r in data["rows"]:
        if (r["workload"], r["batch"]) != detail:
            continue
        for side in ("jit", "vtc"):
            m = program_model(r[side]["per_launch"], r[side].get("kernels", ()))
            out += ["", f"Per launch, {detail[0]} batch {detail[1]}, {side}:", "",
                    "| launch | Pallas | MiB | ideal µs | modelled µs | bound |", "| --- | --- | ---: | ---: | ---: | --- |"]
            out += [f"| `{x['name']}` | {'yes' if x['triton'] else ''} | {x['bytes'] / 2**20:,.1f} | "
                    f"{x['ideal_us']:,.1f} | {x['modelled_us']:,.1f} | {x['bound']} |" for x in m["rows"]]
    out.append(END)
    return "\n".join(out)


def write(block: str, path: Path) -> None:
    text = path.read_text()
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        marker = "## Per-kernel resources"
        text = text.replace(marker, block + "\n\n" + marker, 1) if marker in text else text + "\n" + block + "\n"
    path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "compiled.json"))
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--print", action="store_true", help="print instead of writing --out")
    a = ap.parse_args()
    block = render(json.loads(Path(a.json).read_text()))
    if a.print:
        print(block)
    else:
        write(block, Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
