#!/usr/bin/env python
"""Where the model of XLA and XLA's compile part: one corpus program's launches side by side.

    JAX_PLATFORMS=cpu python benchmarks/xla_diff.py "corpus mamba_selective_scan"        # plain jit
    JAX_PLATFORMS=cpu python benchmarks/xla_diff.py "corpus mamba_selective_scan" --vtc  # VTC's program
    JAX_PLATFORMS=cpu python benchmarks/xla_diff.py --list                               # the names

A diagnostic for whoever works on ``vtc_jax/xla.py``: ``benchmarks/guard.py`` says *that* a
program's model is off; this says *where*. The model's launch groups (``xla.Fusion``: what each
writes, ``Fusion.made``) and the compile's launches (``offline.Launch``, their results read off the
optimised HLO) are keyed by what they write — element type and element count, so that a bitcast
of the same buffer matches — and only the keys whose counts differ are printed, each with the
groups and launches behind it (launches, bytes read and written). Compiled deviceless for an H100;
nothing runs.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import math
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

import vtc_jax  # noqa: E402
from vtc_jax import guard as G  # noqa: E402
from vtc_jax.lower import kernel_clusters  # noqa: E402
from vtc_jax.offline import compile_program  # noqa: E402

import guard as corpus_guard  # noqa: E402

MiB = 2 ** 20
HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "uint32": "u32",
             "int8": "s8", "bool": "pred", "int64": "s64"}


def written(hlo: str) -> dict[str, list[tuple[str, int]]]:
    """Instruction name -> (element type, element count) of each result, from HLO text."""
    out: dict[str, list[tuple[str, int]]] = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) (?:fusion|custom-call|[a-z\-]+)\(", line)
        if m and m.group(1) not in out:
            out[m.group(1)] = [(t, math.prod(int(d) for d in dims.split(",") if d))
                               for t, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", m.group(2))]
    return out


def sides(name: str, vtc: bool) -> tuple[Any, Any, Any]:
    """(the modelled graph, its ``Price``, the compiled program) of one corpus program."""
    step, make_args, donate = corpus_guard.corpus()[name]
    args = make_args()
    with corpus_guard._quiet():
        a, closed = corpus_guard.built(step, args, donate, None)
        if vtc:
            graph = G.emitted_graph(closed)
            price = G.price_emitted(a.graph, graph, a.donated,
                                    G.kernel_math(a.graph, a.clusters, kernel_clusters(closed.jaxpr), a.strategy))
            fn = vtc_jax.optimize(step, backend="triton", guard=None, donate_argnums=donate)
        else:
            graph, price = a.graph, G.price_plain(a.graph, a.donated)
            fn = jax.jit(step, donate_argnums=donate)
        return graph, price, compile_program(fn, *args, kernels=False)


def made_keys(graph: Any, f: Any) -> list[tuple[str, int]]:
    """(element type, element count) of each tensor a model group writes."""
    return [(HLO_TYPES.get(str(graph.tensors[t].dtype), str(graph.tensors[t].dtype)),
             math.prod(graph.tensors[t].shape)) for t in f.made]


def largest(keys: list[tuple[str, Any]]) -> tuple[str, Any]:
    """The key of the most elements (a launch's or a group's bytes are charged to it)."""
    return max(keys, key=lambda k: (isinstance(k[1], int) and k[1], str(k)))


def diff(graph: Any, price: Any, compiled: Any) -> list[str]:
    """The keys (element type, element count written) whose model and compile counts differ."""
    model: dict[Any, list[str]] = collections.defaultdict(list)
    for f in price.fusions:
        keys = made_keys(graph, f) or ([("?", f.what)] if f.launches else [])
        for k in keys:
            model[k].append(f"{f.what} x{f.launches} {f.bytes / MiB:.1f}")
    results = written(compiled.hlo)
    comp: dict[Any, list[str]] = collections.defaultdict(list)
    for launch in compiled.launches:
        for k in results.get(launch.hlo or "", [])[:4] or [("?", launch.name)]:
            comp[k].append(f"{launch.name} r{launch.read_bytes / MiB:.1f} w{launch.write_bytes / MiB:.1f}")
    lines = [f"model: {price.launches} launches, {price.bytes / MiB:,.1f} MiB; "
             f"compile: {len(compiled.launches)} launches, {compiled.bytes / MiB:,.1f} MiB"]
    for k in sorted(set(model) | set(comp), key=str):
        if len(model[k]) != len(comp[k]):
            lines.append(f"{k[0]}[{k[1]}]: model {len(model[k])}, compile {len(comp[k])}\n"
                         f"    model:   {'; '.join(model[k]) or '-'}\n    compile: {'; '.join(comp[k]) or '-'}")
    return lines


def byte_diff(graph: Any, price: Any, compiled: Any, top: int = 12) -> list[str]:
    """The keys whose bytes differ most: each model group's bytes charged to the largest tensor
    it writes, each launch's (read + written) to its largest result."""
    model: dict[Any, float] = collections.defaultdict(float)
    for f in price.fusions:
        model[largest(made_keys(graph, f) or [("?", f.what)])] += f.bytes
    results = written(compiled.hlo)
    comp: dict[Any, float] = collections.defaultdict(float)
    for launch in compiled.launches:
        comp[largest(results.get(launch.hlo or "", []) or [("?", launch.name)])] += \
            launch.read_bytes + launch.write_bytes
    rows = sorted(set(model) | set(comp), key=lambda k: -abs(model[k] - comp[k]))[:top]
    return [f"{k[0]}[{k[1]}]: model {model[k] / MiB:,.1f} MiB, compile {comp[k] / MiB:,.1f} MiB "
            f"({(model[k] - comp[k]) / MiB:+,.1f})" for k in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", nargs="?", help="a corpus program (see --list)")
    p.add_argument("--vtc", action="store_true", help="VTC's unguarded program instead of plain jit")
    p.add_argument("--list", action="store_true", help="print the corpus's names")
    p.add_argument("--bytes", action="store_true", help="the keys whose bytes differ most, instead of launches")
    a = p.parse_args()
    if a.list or not a.name:
        print("\n".join(corpus_guard.corpus()))
        return
    print("\n".join((byte_diff if a.bytes else diff)(*sides(a.name, a.vtc))))


if __name__ == "__main__":
    main()
