#!/usr/bin/env python
"""Per-kernel device time of the guard's corpus programs on a GPU (rung 4). Not run in CI.

    python benchmarks/kernel_times.py --only "bert,t5_relative" [--calls 10] [--jsonl rows.jsonl]

For each program: ``jax.jit``, VTC as the greedy planned it (``guard=None``) and VTC guarded, each
called ``--calls`` times under ``jax.profiler`` after warm-up calls; the GPU plane of the trace
(``jax.profiler.ProfileData``) gives every kernel's device time, summed per kernel name and divided
by the number of calls. Why: the roofline prices each Triton kernel and each XLA launch, and where
the guard's model and a GPU disagree on a program the whole-program time does not say which
launch was mispriced; this table does. Donated inputs are copied for every call before the trace
starts, so the copies are not in it.

On a machine without a GPU it prints "no GPU: nothing measured" and exits 0.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def kernel_times(fn: Callable, args: tuple, donate: tuple[int, ...], calls: int) -> dict[str, Any]:
    """{"per_call_us": total device µs per call, "kernels": [[name, launches per call, µs per call]],
    "lines": the trace lines the kernels were read from}."""
    import jax
    fresh = lambda: tuple(jax.tree.map(lambda x: x.copy(), a) if i in donate else a  # noqa: E731
                          for i, a in enumerate(args))
    for _ in range(3):
        jax.block_until_ready(fn(*fresh()))
    inputs = [jax.block_until_ready(fresh()) for _ in range(calls)]
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        outs = [fn(*a) for a in inputs]
        jax.block_until_ready(outs)
        jax.profiler.stop_trace()
        del outs
        path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.Counter()
    lines, seen = set(), set()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            seen.add(f"{plane.name} {line.name}")
            if not line.name.startswith("Stream"):
                continue   # derived lines (XLA Ops, XLA Modules) repeat the stream's kernels
            lines.add(f"{plane.name} {line.name}")
            for ev in line.events:
                total[ev.name] += ev.duration_ns / 1e3
                count[ev.name] += 1
    kernels = sorted(([n, count[n] / calls, total[n] / calls] for n in total), key=lambda r: -r[2])
    return {"per_call_us": sum(total.values()) / calls, "kernels": kernels, "lines": sorted(lines), "all_lines": sorted(seen)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", required=True, help="comma-separated substrings of corpus program names")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--pos", type=int, default=2048)
    p.add_argument("--top", type=int, default=12, help="kernels printed per program")
    p.add_argument("--jsonl", default=None)
    ns = p.parse_args()
    import gpu
    if not gpu.has_gpu():
        print(gpu.NO_GPU)
        return 0
    import jax
    import guard as corpus_bench
    import vtc_jax
    progs = corpus_bench.corpus()
    progs = {k: progs[k] for s in ns.only.split(",") for k in progs if s in k}
    for name, (step, make_args, donate) in progs.items():
        args = gpu.materialise(tuple(make_args()), ns.pos)
        row: dict[str, Any] = {"name": name, "device": jax.devices()[0].device_kind}
        for key, fn in (("jit", jax.jit(step, donate_argnums=donate)),
                        ("raw", vtc_jax.optimize(step, donate_argnums=donate, guard=None)),
                        ("vtc", vtc_jax.optimize(step, donate_argnums=donate))):
            try:
                row[key] = kernel_times(fn, args, donate, ns.calls)
            except Exception as exc:  # noqa: BLE001 - one program's failure is a row
                row[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            r = row[key]
            print(f"\n{name} [{key}]: {r['per_call_us']:.1f} µs of kernels per call, "
                  f"{sum(k[1] for k in r['kernels']):.0f} launches; lines {r['lines'] or r['all_lines']}")
            for kname, n, us in r["kernels"][:ns.top]:
                print(f"  {us:9.1f} µs  x{n:g}  {kname[:110]}")
        if ns.jsonl:
            with open(ns.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
