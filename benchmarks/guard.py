#!/usr/bin/env python
"""Never slower than jax.jit: the model of XLA against XLA's own compile, and the guard, on a corpus.

    JAX_PLATFORMS=cpu python benchmarks/guard.py            # rewrites the "guard" block of BENCHMARKS.md
    JAX_PLATFORMS=cpu python benchmarks/guard.py --only gemma   # some programs, printed, nothing written
    JAX_PLATFORMS=cpu python benchmarks/guard.py --dry          # all, printed, nothing written

The corpus: the examples at batch 1 and 16 (``examples/``), the zoo (``tests/zoo``: pure-JAX Llama,
flax Gemma, prefill, vision) and the corpus of styles unlike the zoo's (``tests/zoo/corpus.py``:
MoE dispatch, selective/associative scans, ALiBi and relative-position biases, conv stems, ConvNeXt
and U-Net blocks with resize and pads, pixel shuffle, samplers with sort/top-k, rolling and paged
caches, LoRA, sliced sibling matmuls, packed sequences, random bits, training steps), each at its
paper size, caches donated as users donate them.

Per program, compiled *deviceless* for an H100 (``vtc_jax.offline.compile_program``, nothing run):

* **jit** — ``jax.jit(step)``;
* **VTC unguarded** — ``vtc_jax.optimize(step, backend="triton", guard=None)``: the plan as the
  greedy makes it;
* **VTC** — ``vtc_jax.optimize(step, backend="triton")``: the default guard (``guard="model"``).

And the model of XLA (``vtc_jax.xla.xla_program``) of plain jit (the traced function) and of the
unguarded VTC program (its emitted jaxpr, each kernel a kernel call), against the compile: launches
and bytes, with the error. The roofline time is ``launches × 2 µs + bytes / 3.35 TB/s`` (H100 SXM,
``costmodel.GPUS["h100-sxm"]``), from the compile's counts.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402

import vtc_jax  # noqa: E402
from vtc_jax import guard as G  # noqa: E402
from vtc_jax.costmodel import GPUS  # noqa: E402
from vtc_jax.offline import compile_program  # noqa: E402
from vtc_jax.lower import kernel_clusters  # noqa: E402
from vtc_jax.program import BuildOptions, build  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu python benchmarks/guard.py"
BEGIN, END = "<!-- guard:begin -->", "<!-- guard:end -->"
MiB = 2 ** 20
GPU = GPUS["h100-sxm"]


def corpus() -> dict[str, tuple[Callable, Callable[[], tuple], tuple[int, ...]]]:
    """name -> (step, paper-size args, donated argnums)."""
    from accounting import WORKLOADS, donate_argnums, load_example
    from tests.zoo.corpus import CORPUS
    from zoo import models
    out: dict[str, tuple[Callable, Callable[[], tuple], tuple[int, ...]]] = {}
    for w in dict.fromkeys(w.module for w in WORKLOADS):
        mod = load_example(w)
        for b in (1, 16):
            out[f"{w} b{b}"] = (mod.step, lambda mod=mod, b=b: tuple(mod.example_args("paper", batch=b)),
                                donate_argnums(mod))
    for name, (step, args, donate) in models().items():
        out[f"zoo {name}"] = (step, lambda args=args: tuple(args("paper")), tuple(donate))
    for name, make in CORPUS.items():
        out[f"corpus {name}"] = (lambda *a, make=make: make("paper").step(*a),
                                 lambda make=make: tuple(make("paper").args), tuple(make("paper").donate_argnums))
    return out


@contextlib.contextmanager
def _quiet():
    from zoo import _no_cpu_sharding
    with warnings.catch_warnings(), _no_cpu_sharding():
        warnings.simplefilter("ignore")
        yield


def seconds(launches: int, nbytes: int, compute: float = 0.0) -> float:
    return launches * GPU.launch_overhead + nbytes / GPU.hbm_bandwidth + compute


def built(step: Callable, args: tuple, donate: tuple[int, ...], how: str | None) -> tuple[Any, Any]:
    """VTC's analysis of ``step`` on ``args`` (``guard=how``) and the jaxpr it emits."""
    opts = BuildOptions("triton", False, {}, lambda m: None, RuntimeError, guard=how, function=step)
    a, _, closed = build(step, tuple(args), {}, jax.tree.leaves(args), donate=donate, opts=opts, rejected={})
    return a, closed


def measure(step: Callable, args: tuple, donate: tuple[int, ...]) -> dict[str, Any]:
    """Compile jit, VTC unguarded and VTC guarded; model jit and unguarded VTC."""
    row: dict[str, Any] = {}
    with _quiet():
        for key, fn in (("jit", jax.jit(step, donate_argnums=donate)),
                        ("raw", vtc_jax.optimize(step, backend="triton", donate_argnums=donate, guard=None)),
                        ("vtc", vtc_jax.optimize(step, backend="triton", donate_argnums=donate))):
            t0 = time.perf_counter()
            c = compile_program(fn, *args, kernels=False)
            row[key] = dict(launches=len(c.launches), bytes=c.bytes, buffers=c.memory["total"],
                            triton=len(c.triton_launches), seconds=time.perf_counter() - t0)
            if key == "vtc":
                rep = fn.last[0] if fn.last else None
                row["guard"] = list(rep.guard) if rep is not None else []
        t0 = time.perf_counter()
        priced = {}
        for key, how in (("raw", None), ("vtc", "model")):
            a, closed = built(step, args, donate, how)
            priced[key] = G.price_emitted(a.graph, G.emitted_graph(closed), a.donated,
                                          G.kernel_math(a.graph, a.clusters, kernel_clusters(closed.jaxpr), a.strategy))
            if key == "raw":
                plain = G.price_plain(a.graph, a.donated)
                row["model_seconds"] = time.perf_counter() - t0
    raw = priced["raw"]
    row["model_jit"] = dict(launches=plain.launches, bytes=plain.bytes, buffers=plain.buffers)
    row["model_raw"] = dict(launches=raw.launches, bytes=raw.bytes, buffers=raw.buffers)
    # the math beyond the bytes (modelled: flops at each engine's achieved rate), added to the
    # compiled counts' roofline of the same program
    row["jit"]["compute"] = plain.compute_seconds(GPU)
    row["raw"]["compute"] = raw.compute_seconds(GPU)
    row["vtc"]["compute"] = priced["vtc"].compute_seconds(GPU)
    return row


def _err(m: float, c: float) -> str:
    return f"{(m - c) / c * 100:+.0f}%" if c else ("0" if not m else "n/a")


def render(rows: dict[str, dict[str, Any]], info: str) -> str:
    t = lambda r: seconds(r["launches"], r["bytes"], r.get("compute", 0.0))  # noqa: E731
    lost_raw = [n for n, r in rows.items() if "error" not in r and (t(r["raw"]) > t(r["jit"]) or
                                                                   r["raw"]["buffers"] > r["jit"]["buffers"])]
    lost = [n for n, r in rows.items() if "error" not in r and (t(r["vtc"]) > t(r["jit"]) or
                                                               r["vtc"]["buffers"] > r["jit"]["buffers"])]
    ok = [r for r in rows.values() if "error" not in r]
    lerr = lambda side, key: [r[f"model_{side}"]["launches"] - r[key]["launches"] for r in ok]  # noqa: E731
    berr = lambda side, key: [abs(r[f"model_{side}"]["bytes"] - r[key]["bytes"]) / max(1, r[key]["bytes"])  # noqa: E731
                              for r in ok]
    out = [BEGIN, "## Never slower than jax.jit: the guard on a corpus (compiled, deviceless H100)", "",
           f"`{COMMAND}`. {info}", "",
           f"{len(rows)} programs at paper size: the examples at batch 1 and 16, the zoo, and the corpus of "
           "styles unlike the zoo's (`tests/zoo/corpus.py`). Each compiled by XLA for an H100 without a GPU "
           "three times: `jax.jit`, VTC with `guard=None` (the greedy's plan) and VTC with the default "
           "`guard=\"model\"`. Time is the roofline of the compile's counts, launches × 2 µs + bytes / 3.35 TB/s, "
           "plus the modelled time of the compute-bound launch groups beyond their bytes (flops at the rate each "
           "engine was measured to achieve, `costmodel.ENGINE_EFFICIENCY`) — modelled from compiled counts, "
           "not measured (the measured table is the section \"Measured on an H100\"); buffers are XLA's buffer "
           "assignment.", "",
           f"* Unguarded, VTC loses to jit (time or buffers) on {len(lost_raw)} of {len(ok)}: "
           + (", ".join(lost_raw) or "none") + ".",
           f"* With the default guard it loses on {len(lost)} of {len(ok)}: " + (", ".join(lost) or "none") + ".",
           "* The model of XLA against the compile (launch error = model − compile; bytes error = |model − "
           "compile| / compile): jit side, launches within ±1 on "
           f"{sum(abs(x) <= 1 for x in lerr('jit', 'jit'))} of {len(ok)}, bytes within 10% on "
           f"{sum(x <= 0.10 for x in berr('jit', 'jit'))}; VTC side, launches within ±1 on "
           f"{sum(abs(x) <= 1 for x in lerr('raw', 'raw'))}, bytes within 10% on "
           f"{sum(x <= 0.10 for x in berr('raw', 'raw'))}.", "",
           "| program | time jit → VTC unguarded → VTC, µs | buffers jit → VTC, MiB | launches jit: model / compile |"
           " launches VTC: model / compile | bytes jit, MiB: model / compile (err) | bytes VTC, MiB: model / "
           "compile (err) | what the guard did |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, r in rows.items():
        if "error" in r:
            out.append(f"| {name} | error: {r['error']} | | | | | | |")
            continue
        j, raw, v, mj, mr = r["jit"], r["raw"], r["vtc"], r["model_jit"], r["model_raw"]
        mark = lambda x: f"**{x}**"  # noqa: E731
        tv = f"{t(v) * 1e6:,.1f}"
        tv = mark(tv) if t(v) > t(j) else tv
        bv = f"{v['buffers'] / MiB:,.1f}"
        bv = mark(bv) if v["buffers"] > j["buffers"] else bv
        g = "; ".join(x.split(":")[0] for x in r.get("guard", [])) or "-"
        out.append(f"| {name} | {t(j) * 1e6:,.1f} → {t(raw) * 1e6:,.1f} → {tv} | {j['buffers'] / MiB:,.1f} → {bv} | "
                   f"{mj['launches']} / {j['launches']} | {mr['launches']} / {raw['launches']} | "
                   f"{mj['bytes'] / MiB:,.1f} / {j['bytes'] / MiB:,.1f} ({_err(mj['bytes'], j['bytes'])}) | "
                   f"{mr['bytes'] / MiB:,.1f} / {raw['bytes'] / MiB:,.1f} ({_err(mr['bytes'], raw['bytes'])}) | {g} |")
    out.append(END)
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="substring of program names; prints, writes nothing")
    p.add_argument("--dry", action="store_true", help="print the block, write nothing")
    ns = p.parse_args()
    rows: dict[str, dict[str, Any]] = {}
    for name, (step, args, donate) in corpus().items():
        if ns.only and ns.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            rows[name] = measure(step, args(), donate)
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
        print(f"{name}: {time.perf_counter() - t0:.0f} s", rows[name].get("error", ""), file=sys.stderr, flush=True)
    info = (f"Python {platform.python_version()}, jax {jax.__version__}, on {platform.machine()} "
            f"({os.cpu_count()} cores), no GPU.")
    text = render(rows, info)
    if ns.only or ns.dry:
        print(text)
        return
    bench = ROOT / "BENCHMARKS.md"
    old = bench.read_text()
    if BEGIN in old:
        head, _, rest = old.partition(BEGIN)
        _, _, tail = rest.partition(END)
        bench.write_text(head + text + tail)
    else:
        bench.write_text(old.rstrip() + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
