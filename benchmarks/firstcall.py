"""The first call in a new process: jax.jit, vtc_jax, and vtc_jax with its plan cache.

``python benchmarks/firstcall.py`` (about 2 min). Each example (small size, batch 1, its caches
donated as the examples do) is called once in fresh Python processes, and the first call is timed
from after the imports and the inputs to the result being ready:

* ``jax.jit(step)``;
* ``vtc_jax.optimize(step)`` with no plan cache (trace, analysis, guard, kernels, XLA's compile);
* ``vtc_jax.optimize(step, plan_cache=dir)`` in a second process (the first wrote the plan):
  trace, load, XLA's compile of the loaded program;
* both again with jax's persistent compilation cache on (second process each: XLA's compile
  loaded too).

Measured on this machine's CPU in interpret mode (the kernels are Pallas's interpreter loops, which
XLA compiles slower than the plain program): a CPU figure of start-up cost, not a GPU result.
Median of ``--repeat`` runs. Writes the ``firstcall`` block of BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from blocks import write_block

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- firstcall:begin -->", "<!-- firstcall:end -->"
EXAMPLES = ("llama3_decode", "gemma2_layer", "efficientvit_attention", "yolo11_c3k2", "shufflenet_unit")

CHILD = r"""
import json, os, sys, time, warnings
sys.path[:0] = [{root!r}, {examples!r}, {bench!r}]
import jax
if {xla_cache!r}:
    jax.config.update("jax_compilation_cache_dir", {xla_cache!r})
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
warnings.simplefilter("ignore")
import vtc_jax
from accounting import donate_argnums
mod = __import__({example!r})
args = mod.example_args("small")
donate = donate_argnums(mod)
if {mode!r} == "jit":
    fn = jax.jit(mod.step, donate_argnums=donate)
else:
    fn = vtc_jax.optimize(mod.step, donate_argnums=donate, plan_cache={plans!r} or None)
t = time.perf_counter()
jax.block_until_ready(fn(*args))
print(json.dumps({{"seconds": time.perf_counter() - t}}))
"""


def run(example: str, mode: str, plans: str = "", xla_cache: str = "") -> float:
    code = CHILD.format(root=str(ROOT), examples=str(ROOT / "examples"), bench=str(ROOT / "benchmarks"),
                        example=example, mode=mode, plans=plans, xla_cache=xla_cache)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env.pop("VTC_JAX_PLAN_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def measure(example: str, repeat: int) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as d:
            plans, jcache, vcache = (str(Path(d) / n) for n in ("plans", "xla-jit", "xla-vtc"))
            rows = {"jit": run(example, "jit"), "vtc": run(example, "vtc")}
            run(example, "vtc", plans=plans)                                  # writes the plan
            rows["vtc, plan cache"] = run(example, "vtc", plans=plans)
            run(example, "jit", xla_cache=jcache)
            rows["jit, XLA cache"] = run(example, "jit", xla_cache=jcache)
            run(example, "vtc", plans=plans, xla_cache=vcache)
            rows["vtc, plan + XLA caches"] = run(example, "vtc", plans=plans, xla_cache=vcache)
        for k, v in rows.items():
            out.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in out.items()}


def render(rows: dict[str, dict[str, float]], info: str) -> str:
    cols = ("jit", "vtc", "vtc, plan cache", "jit, XLA cache", "vtc, plan + XLA caches")
    lines = [BEGIN, "## The first call in a new process (CPU, interpret mode)", "",
             "`python benchmarks/firstcall.py`. " + info, "",
             "Seconds from the inputs to the first result, each in a fresh process (small sizes, batch 1). "
             "`plan cache`: `optimize(..., plan_cache=dir)` in the process after the one that wrote the plan "
             "(`vtc_jax/plancache.py`); `XLA cache`: jax's `jax_compilation_cache_dir`, second process. On "
             "this CPU the kernels are Pallas's interpreter loops, which XLA compiles slower than the plain "
             "program: what remains of VTC's first call with the plan cache is mostly that compile (gone with "
             "the XLA cache too). A start-up cost on the CPU, not a GPU result.", "",
             "| example | " + " | ".join(cols) + " | plan cache ÷ jit | both caches ÷ jit |",
             "| --- | " + " | ".join("---:" for _ in cols) + " | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[c]:.2f}" for c in cols)
                     + f" | {r['vtc, plan cache'] / r['jit']:.1f}× | {r['vtc, plan + XLA caches'] / r['jit']:.1f}× |")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", default=",".join(EXAMPLES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dry", action="store_true", help="print the block, write nothing")
    ns = p.parse_args()
    started = time.time()
    rows = {}
    for ex in ns.examples.split(","):
        rows[ex] = measure(ex, ns.repeat)
        print(ex, {k: round(v, 2) for k, v in rows[ex].items()}, flush=True)
    import jax
    info = (f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC in "
            f"{(time.time() - started) / 60:.1f} min on {platform.machine()}, {os.cpu_count()} cores, no GPU; "
            f"Python {platform.python_version()}, jax {jax.__version__}; median of {ns.repeat}.")
    block = render(rows, info)
    print(block)
    if ns.dry:
        return
    write_block(block, BEGIN, END)


if __name__ == "__main__":
    main()
