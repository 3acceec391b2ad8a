#!/usr/bin/env python
"""Measured latency and peak memory on a GPU (verification ladder, rung 4). Not run in CI.

    python benchmarks/gpu.py [--runs 50] [--warmup 5] [--out gpu.md] [--jsonl rows.jsonl] [--deadline S]
    python benchmarks/gpu.py --corpus [--only a,b] --jsonl corpus.jsonl   # the guard's 44 programs
    python benchmarks/gpu.py --render rows.jsonl [--info "where, how"]   # the table, no GPU needed

On a machine whose default jax backend is a GPU: for each workload of ``examples/`` × batch {1, 16}
at paper size, ``vtc_jax.optimize(step)`` vs ``jax.jit(step)`` (cache arguments donated in both),
and for the Llama-3 decode-attention part alone, also versus Pallas' own GPU decode attention
(``jax.experimental.pallas.ops.gpu.decode_attention.gqa``).

* back-to-back time: seconds per call over samples of calls issued with no sync between them (at
  least 2 ms a sample, median of ``--runs`` samples; ``vtc_jax.profiling.time_interleaved``, the
  guard's own timing): what a loop sees, and the figure speed-ups are read from. Why: on the lent
  VMs one synchronisation per call carries host jitter that swamps sub-millisecond programs (the
  same program read 0.19 and 0.34 ms in two processes);
* latency: median (and 10th/90th percentile) of ``--runs`` timed calls after ``--warmup`` calls,
  each call timed alone up to ``jax.block_until_ready``; donated inputs are re-made before each call,
  outside the timed region;
* peak memory: ``device.memory_stats()["peak_bytes_in_use"]`` (when the backend reports it), with
  every measurement in its own subprocess so peaks do not mix, and ``peak - bytes after the inputs
  were allocated`` = what the program itself needed; plus XLA's ``compiled.memory_analysis()``
  temporary bytes where available;
* correctness: the VTC output against ``jax.jit``'s on the same inputs (max relative error).

``--corpus`` times ``benchmarks/guard.py``'s corpus instead (jit, VTC guarded, and VTC unguarded
where the guard changed the plan), in one process, with XLA's compiled temporary bytes and jit's
output against itself (nondeterministic programs, degenerate inputs). ``--jsonl`` appends each
row as it is measured, so a run cut short by ``--deadline`` or a time limit keeps what finished.
The driver does not open the GPU itself (each measurement has its own process and its own
peak), and hands its subprocesses the user's ``JAX_PLATFORMS`` (``benchmarks/accounting.py``
defaults it to cpu for its static work: inherited, the subprocesses found no GPU).

Inputs are random (normal × 0.05 for floats, ``--pos`` for integer scalars such as the decode
position). On a machine without a GPU it prints "no GPU: nothing measured (this script only runs on
a GPU)" and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
# benchmarks/accounting.py defaults JAX_PLATFORMS to cpu for its own static work; the measurement
# subprocesses must see the platforms the user started with.
USER_PLATFORMS = os.environ.get("JAX_PLATFORMS")
SLOWER = 1.05   # a median this much above jit's counts as slower (run-to-run spread is a few per cent)
NO_GPU = "no GPU: nothing measured (this script only runs on a GPU)"
VARIANTS = ("jit", "vtc")
ATTN_VARIANTS = ("jit", "vtc", "pallas_gqa")


def _accounting() -> Any:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import accounting
    return accounting


def has_gpu() -> bool:
    try:
        import jax
        return jax.default_backend() == "gpu"
    except Exception:  # noqa: BLE001 - no usable backend at all: no GPU either
        return False


def has_gpu_elsewhere() -> bool:
    """Whether a GPU is usable, asked of a child process: the driver does not open the GPU itself
    (a GPU in exclusive-process compute mode would refuse every measurement subprocess)."""
    code = "import jax; print(jax.default_backend())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return proc.stdout.strip().splitlines()[-1:] == ["gpu"]


# --------------------------------------------------------------------------------------------
# Inputs and programs
# --------------------------------------------------------------------------------------------

def materialise(tree: Any, pos: int, seed: int = 0) -> Any:
    """Random device arrays for a pytree of ShapeDtypeStructs (arrays pass through)."""
    import jax
    import jax.numpy as jnp
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), max(1, len(leaves)))
    out = []
    for k, x in zip(keys, leaves):
        if not isinstance(x, jax.ShapeDtypeStruct):
            out.append(x)
        elif jnp.issubdtype(x.dtype, jnp.floating):
            out.append((jax.random.normal(k, x.shape, jnp.float32) * 0.05).astype(x.dtype))
        elif jnp.issubdtype(x.dtype, jnp.integer):
            out.append(jnp.full(x.shape, pos if x.shape == () else 0, x.dtype))
        elif jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            n = max(1, int(np.prod(x.shape)))
            out.append(jax.random.split(jax.random.key(seed), n).reshape(x.shape))
        else:
            out.append(jnp.zeros(x.shape, x.dtype))
    return jax.block_until_ready(jax.tree.unflatten(treedef, out))


def workload_program(name: str, batch: int, variant: str) -> tuple[Callable, tuple, tuple[int, ...], Callable]:
    """(compiled-callable, abstract args, donated positions, reference callable) for one case."""
    import jax
    import vtc_jax
    acc = _accounting()
    mod = acc.load_example(name)
    if mod is None:
        raise FileNotFoundError(f"examples/{name}.py does not exist")
    args = tuple(mod.example_args("paper", batch=batch))
    donate = acc.donate_argnums(mod)
    ref = jax.jit(mod.step)
    if variant == "jit":
        return jax.jit(mod.step, donate_argnums=donate), args, donate, ref
    if variant == "vtc":
        return vtc_jax.optimize(mod.step, donate_argnums=donate), args, donate, ref
    raise ValueError(f"unknown variant {variant!r}")


def attention_program(batch: int, variant: str) -> tuple[Callable, tuple, tuple[int, ...], Callable]:
    """The Llama-3-8B decode attention (GQA 32/8, head dim 128, context 4096, bf16) alone:
    q (B, 1, Hq, D) and the (B, T, Hkv, D) caches -> (B, Hq·D)."""
    import jax
    import jax.numpy as jnp
    import vtc_jax
    L = _accounting().load_example("llama3_decode")
    cfg = L.SIZES["paper"]
    B, T, Hq, Hkv, D = batch, cfg.context, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    S = jax.ShapeDtypeStruct
    args = (S((B, 1, Hq, D), cfg.dtype), S((B, T, Hkv, D), cfg.dtype), S((B, T, Hkv, D), cfg.dtype),
            S((), jnp.int32))

    def attend(q: Any, kc: Any, vc: Any, pos: Any) -> Any:
        return L._attend(cfg, q, kc, vc, pos)

    ref = jax.jit(attend)
    if variant == "jit":
        return jax.jit(attend), args, (), ref
    if variant == "vtc":
        return vtc_jax.optimize(attend), args, (), ref
    if variant == "pallas_gqa":
        from jax.experimental.pallas.ops.gpu.decode_attention import gqa

        def pallas(q: Any, kc: Any, vc: Any, pos: Any) -> Any:
            # gqa(q (B, Hq, D), k/v (B, T, Hkv, D), kv_seq_len (B,)): keys t < kv_seq_len are valid.
            o = gqa(q.reshape(B, Hq, D), kc, vc, kv_seq_len=jnp.full((B,), pos + 1, jnp.int32))
            return o.reshape(B, Hq * D)

        return jax.jit(pallas), args, (), ref
    raise ValueError(f"unknown variant {variant!r}")


# --------------------------------------------------------------------------------------------
# One measurement (runs in its own subprocess)
# --------------------------------------------------------------------------------------------

def _numbers(x: Any) -> Any:
    """An output as f32 numbers to compare: a PRNG key array (a sampler returns its next key) by
    its key data, which no float conversion accepts."""
    import jax
    import jax.numpy as jnp
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return jnp.asarray(x, jnp.float32)


def _max_rel(a: Any, b: Any) -> float:
    import jax
    import jax.numpy as jnp
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = _numbers(x), _numbers(y)
        worst = max(worst, float(jnp.max(jnp.abs(x - y))) / max(float(jnp.max(jnp.abs(y))), 1e-30))
    return worst


def _timed(fn: Callable, args: tuple, donate: tuple[int, ...], runs: int, warmup: int) -> list[float]:
    """Seconds of ``runs`` calls after ``warmup`` ones, sorted; each call timed alone up to
    ``block_until_ready``, its donated inputs copied before the clock starts."""
    import jax

    def fresh() -> tuple:
        return tuple(jax.tree.map(lambda x: x.copy(), a) if i in donate else a for i, a in enumerate(args))

    for _ in range(warmup):
        jax.block_until_ready(fn(*fresh()))
    times = []
    for _ in range(runs):
        a = jax.block_until_ready(fresh())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append(time.perf_counter() - t0)
    return sorted(times)


def _back_to_back(fns: Sequence[Callable], args: tuple, donate: tuple[int, ...], out: Any, runs: int) -> list[float]:
    """Seconds per call of each of ``fns`` (on the same arguments) issued back to back, interleaved
    (``vtc_jax.profiling.time_interleaved``: one sync per sample of at least 2 ms, the programs
    alternating sample by sample): the device time a loop sees, without the jitter of one
    synchronisation per call. Programs compared are timed in one process: on a lent H100 the same
    jit program read 45 and 65 µs back to back in two processes. Donated inputs are handed on from
    call to call as a loop does (``profiling.threaded``: a decode step's updated caches are the
    next call's), as the guard times them; where no output can take a donated input's place, each
    call gets a fresh copy. As many calls per sample as half the free memory holds (``out``: one
    call's outputs)."""
    import jax
    from vtc_jax.profiling import MAX_CALLS, handed_on, threaded, time_interleaved
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    carry, on = threaded(args, donate, out), handed_on(args, donate, out)
    per_call = (sum(o.nbytes for j, o in enumerate(jax.tree.leaves(out)) if j not in on) if on else
                nbytes([a for i, a in enumerate(args) if i in donate]) + nbytes(out))
    stats = jax.devices()[0].memory_stats() or {}
    room = (stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)) // 2
    most = MAX_CALLS if per_call == 0 else max(1, min(MAX_CALLS, room // per_call))

    def fresh() -> tuple:
        return tuple(jax.tree.map(lambda x: x.copy(), a) if i in donate else a for i, a in enumerate(args))

    return time_interleaved(list(fns), fresh, runs, most, carry)


def measure(kind: str, name: str, batch: int, variant: str, *, runs: int, warmup: int, pos: int) -> dict[str, Any]:
    import jax
    dev = jax.devices()[0]
    stats = lambda: (dev.memory_stats() or {})  # noqa: E731
    if kind == "attention":
        fn, abstract, donate, ref = attention_program(batch, variant)
    else:
        fn, abstract, donate, ref = workload_program(name, batch, variant)
    args = materialise(abstract, pos)
    before = stats().get("bytes_in_use")
    res: dict[str, Any] = {"kind": kind, "name": name, "batch": batch, "variant": variant, "pos": pos,
                          "device": dev.device_kind}
    try:
        ma = fn.lower(*args).compile().memory_analysis()
        res["xla_temp_bytes"] = int(getattr(ma, "temp_size_in_bytes", 0)) if ma is not None else None
    except Exception:  # noqa: BLE001 - memory_analysis is optional
        res["xla_temp_bytes"] = None

    def fresh() -> tuple:
        if not donate:
            return args
        return tuple(jax.tree.map(lambda x: x.copy(), a) if i in donate else a for i, a in enumerate(args))

    t_compile = time.perf_counter()
    out = jax.block_until_ready(fn(*fresh()))
    res["first_call_s"] = time.perf_counter() - t_compile
    times = _timed(fn, args, donate, runs, warmup)
    res["median_ms"] = 1e3 * statistics.median(times)
    res["p10_ms"] = 1e3 * times[max(0, int(0.1 * len(times)) - 1)]
    res["p90_ms"] = 1e3 * times[min(len(times) - 1, int(0.9 * len(times)))]
    st = stats()
    res["peak_bytes_in_use"] = st.get("peak_bytes_in_use")
    res["program_peak_bytes"] = (st["peak_bytes_in_use"] - before
                                 if st.get("peak_bytes_in_use") is not None and before is not None else None)
    if getattr(fn, "last", None):
        res["guard"] = list(fn.last[0].guard)
    # back to back, after the peaks are read; a variant is timed interleaved with jit's program
    # in this process (jit_b2b_ms), and its speed-up is read from that pair
    if variant == "jit":
        res["b2b_ms"] = 1e3 * _back_to_back([fn], args, donate, out, runs)[0]
    else:
        jit_fn = (attention_program(batch, "jit") if kind == "attention" else workload_program(name, batch, "jit"))[0]
        # jit's program twice in each round: the spread of its two medians says how far this
        # machine's timing can be trusted now (a lent H200 read the same program 10% apart)
        first, res["b2b_ms"], again = (1e3 * t for t in _back_to_back([jit_fn, fn, jit_fn], args, donate, out, runs))
        res["jit_b2b_ms"] = (first + again) / 2
        res["jit_spread"] = abs(first - again) / min(first, again)
    del out
    if variant != "jit":
        try:
            res["max_rel_err_vs_jit"] = _max_rel(fn(*fresh()), ref(*fresh()))
        except Exception as exc:  # noqa: BLE001
            res["max_rel_err_vs_jit"] = f"{type(exc).__name__}: {exc}"[:200]
    return res


# --------------------------------------------------------------------------------------------
# The guard's corpus, timed (one process: compile-time memory, not allocator peaks)
# --------------------------------------------------------------------------------------------

def measure_corpus(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """``benchmarks/guard.py``'s 44 programs on this GPU: jit, VTC as the greedy planned it
    (``guard=None``) and VTC guarded (``--guard``, by default optimize's own), each timed (median of ``--runs``) and compiled
    for its temporary bytes; the VTC outputs checked against jit's. The unguarded plan is timed only
    where the guard changed it."""
    import jax
    import vtc_jax
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))
    import guard as corpus_bench
    progs = corpus_bench.corpus()
    if ns.only:   # in the order the substrings are given
        progs = {k: progs[k] for s in ns.only.split(",") for k in progs if s in k}
    results, start = [], time.monotonic()
    for name, (step, make_args, donate) in progs.items():
        if ns.deadline is not None and time.monotonic() - start > ns.deadline:
            print(f"deadline of {ns.deadline:.0f} s reached: {name} and later not measured", flush=True)
            break
        row: dict[str, Any] = {"kind": "corpus", "name": name, "guard_mode": ns.guard}
        try:
            args = materialise(tuple(make_args()), ns.pos)
            fns = {"jit": jax.jit(step, donate_argnums=donate),
                   "vtc": vtc_jax.optimize(step, donate_argnums=donate, guard=ns.guard)}
            outs = {}
            for key in ("jit", "vtc", "raw"):
                if key == "raw":
                    if all(g.startswith("kept") for g in row.get("guard", ())):
                        break        # the guard kept the plan whole: raw is vtc
                    fns["raw"] = vtc_jax.optimize(step, donate_argnums=donate, guard=None)
                fn = fns[key]
                t0 = time.perf_counter()
                fresh = tuple(jax.tree.map(lambda x: x.copy(), a) if i in donate else a for i, a in enumerate(args))
                outs[key] = jax.block_until_ready(fn(*fresh))
                first = time.perf_counter() - t0
                if key == "vtc":
                    rep = fn.last[0] if getattr(fn, "last", None) else None
                    row["guard"] = list(rep.guard) if rep is not None else []
                try:
                    ma = fn.lower(*args).compile().memory_analysis()
                    temp = int(ma.temp_size_in_bytes) if ma is not None else None
                except Exception:  # noqa: BLE001 - memory_analysis is optional
                    temp = None
                t = _timed(fn, args, donate, ns.runs, ns.warmup)
                row[key] = {"median_ms": 1e3 * statistics.median(t), "p10_ms": 1e3 * t[len(t) // 10],
                            "p90_ms": 1e3 * t[min(len(t) - 1, (9 * len(t)) // 10)], "temp_bytes": temp,
                            "first_call_s": first}
                if key == "jit":   # jit against itself: nondeterministic programs (a scatter with
                    # repeated indices) and degenerate inputs (non-finite outputs) show here
                    again = fns["jit"](*tuple(jax.tree.map(lambda x: x.copy(), a) if i in donate else a
                                              for i, a in enumerate(args)))
                    row["jit"]["jit_vs_itself"] = _max_rel(again, outs["jit"])
                    row["jit"]["finite"] = all(bool(jax.numpy.isfinite(_numbers(x)).all())
                                               for x in jax.tree.leaves(outs["jit"]))
                else:
                    row[key]["max_rel_err_vs_jit"] = _max_rel(outs[key], outs["jit"])
            # back to back, the programs interleaved in this process (what the guard compares)
            # (jit's twice: the spread of its two medians is the noise a speed-up must clear)
            timed = [k for k in ("jit", "vtc", "raw") if k in row]
            ts = _back_to_back([fns[k] for k in timed] + [fns["jit"]], args, donate, outs["jit"], ns.runs)
            for k, t in zip(timed, ts):
                row[k]["b2b_ms"] = 1e3 * t
            row["jit"]["b2b_ms"] = 1e3 * (ts[0] + ts[-1]) / 2
            row["jit"]["spread"] = abs(ts[0] - ts[-1]) / min(ts[0], ts[-1])
        except Exception as exc:  # noqa: BLE001 - one program's failure is a row, not the end
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        results.append(row)
        print(json.dumps(row), flush=True)
        if ns.jsonl:
            with open(ns.jsonl, "a") as f:
                f.write(json.dumps(row) + "\n")
    return results


def _ms(x: dict[str, Any]) -> float:
    """A row's time: back to back where measured (rows from 2026-11-26 on), else the median of
    per-call latencies (older rows)."""
    return x.get("b2b_ms", x["median_ms"])


def render_corpus(rows: list[dict[str, Any]], info: str) -> str:
    """The markdown table of :func:`measure_corpus`'s rows (``--render FILE.jsonl``). Times are
    :func:`_ms`: back to back where the rows have it."""
    MiB = 2 ** 20
    ok = [r for r in rows if "error" not in r]
    slower = lambda r, k: _ms(r[k]) > SLOWER * _ms(r["jit"])  # noqa: E731
    lose_raw = [r["name"] for r in ok if slower(r, "raw" if "raw" in r else "vtc")]
    lose = [r["name"] for r in ok if slower(r, "vtc")]
    lines = [f"{info}", "",
             f"* {len(ok)} of {len(rows)} programs measured"
             + (f" ({', '.join(r['name'] + ': ' + r['error'].splitlines()[0][:80] for r in rows if 'error' in r)})"
                if len(ok) < len(rows) else "") + ".",
             f"* Unguarded (`guard=None`), VTC is more than {100 * (SLOWER - 1):.0f}% slower than jit on "
             f"{len(lose_raw)} of {len(ok)}: {', '.join(lose_raw) or 'none'}.",
             f"* Guarded (the default), on {len(lose)} of {len(ok)}: {', '.join(lose) or 'none'}.", "",
             "| program | jit ms | VTC ms (speed-up) | VTC unguarded ms (speed-up) | XLA temp MiB, jit → VTC |"
             " max rel err vs jit (jit vs itself) | what the guard did |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | error | | | | | {r['error'].splitlines()[0][:120]} |")
            continue
        j, v = r["jit"], r["vtc"]
        raw = r.get("raw", v)
        sp = lambda x: f"{_ms(x):.3f} ({_ms(j) / _ms(x):.2f}×)"  # noqa: E731
        bold = lambda x, k: f"**{x}**" if slower(r, k) else x  # noqa: E731
        temp = lambda x: "-" if x.get("temp_bytes") is None else f"{x['temp_bytes'] / MiB:,.0f}"  # noqa: E731
        err = v.get("max_rel_err_vs_jit")
        self_err = j.get("jit_vs_itself")
        err_s = f"{err:.1e}" if isinstance(err, float) else str(err)
        if self_err is not None:
            err_s += f" ({self_err:.1e}{'' if j.get('finite', True) else ', non-finite'})"
        g = "; ".join(x.split(":")[0] for x in r.get("guard", [])) or "-"
        spread = f" (±{j['spread']:.0%})" if "spread" in j else ""   # jit against itself, same rounds
        lines.append(f"| {r['name']} | {_ms(j):.3f}{spread} | {bold(sp(v), 'vtc')} | "
                     f"{bold(sp(raw), 'raw' if 'raw' in r else 'vtc')}{'' if 'raw' in r else ' (same)'} | "
                     f"{temp(j)} → {temp(v)} | {err_s} | {g} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def _run_one(kind: str, name: str, batch: int, variant: str, ns: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", kind, name, str(batch), variant,
           "--runs", str(ns.runs), "--warmup", str(ns.warmup), "--pos", str(ns.pos)]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAX_PLATFORMS", None)
    if USER_PLATFORMS is not None:
        env["JAX_PLATFORMS"] = USER_PLATFORMS
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=ns.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
    return {"kind": kind, "name": name, "batch": batch, "variant": variant,
            "error": f"exit {proc.returncode}: {tail}"[:400]}


def _fmt(x: Any, scale: float = 1.0, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x / scale:,.{digits}f}"


def render(results: list[dict[str, Any]], ns: argparse.Namespace, device: str, where: str | None = None) -> str:
    """The examples' table. ``where``: the line saying where and how it was measured (default:
    this machine, now — the driver's own run)."""
    acc = _accounting()
    MiB = 2 ** 20
    if where is None:
        info = acc.machine_info()
        where = (f"{info['date']}, {device}; host {info['cpu']}; jax {info['jax']}, jaxlib {info['jaxlib']}, "
                 f"vtc_jax {info['vtc_jax']} (git {info['commit']}). *Back-to-back*: seconds per call over "
                 f"samples of calls issued without a sync between them (at least 2 ms each; median of {ns.runs} "
                 f"samples), what a loop sees; a VTC or Pallas row's speed-up is against jit's program timed "
                 f"beside it in the same process, the two interleaved sample by sample (jit's twice a round: "
                 f"(±x%) is the spread of its two medians, under which a speed-up is noise); *per-call*: "
                 f"median of {ns.runs} calls timed one by one up to `block_until_ready` after {ns.warmup} "
                 f"warm-up calls, host latency included.")
    lines = [where + " Peak = `memory_stats()['peak_bytes_in_use']` in a fresh process per row, *program* = "
             "peak minus the bytes in use once the inputs existed: it includes what XLA's GEMM / conv autotuner "
             "allocated while compiling on the first call, so *XLA temp* (the compiled program's own temporary "
             "buffers, `memory_analysis()`) is the figure to compare. **Measured.**", ""]
    rows = []
    key = lambda r: (r["kind"], r["name"], r["batch"], r.get("pos"))  # noqa: E731 - jit's row at the same position
    base = {key(r): r for r in results if r.get("variant") == "jit" and "error" not in r}
    for r in results:
        if "error" in r:
            rows.append([r["name"], r["batch"], r.get("pos", ""), r["variant"], "error", "", "", "", "", "", "", r["error"]])
            continue
        b = base.get(key(r))
        if r["variant"] == "jit":
            speed = ""
        elif "jit_b2b_ms" in r:   # jit timed beside it, interleaved, in the same process
            speed = f"{r['jit_b2b_ms'] / r['b2b_ms']:.2f}×"
            if "jit_spread" in r:   # jit against itself in the same rounds
                speed += f" (±{r['jit_spread']:.0%})"
        elif b is not None:       # older rows: per-call medians of separate processes
            speed = f"{b['median_ms'] / r['median_ms']:.2f}×"
        else:
            speed = ""
        rows.append([r["name"], r["batch"], r.get("pos", ""), r["variant"], _fmt(r.get("b2b_ms")), _fmt(r["median_ms"]),
                     f"{_fmt(r['p10_ms'])}–{_fmt(r['p90_ms'])}", speed,
                     _fmt(r.get("peak_bytes_in_use"), MiB, 1), _fmt(r.get("program_peak_bytes"), MiB, 1),
                     _fmt(r.get("xla_temp_bytes"), MiB, 1),
                     _fmt(r.get("max_rel_err_vs_jit"), 1, 2) if not isinstance(r.get("max_rel_err_vs_jit"), float)
                     else f"{r['max_rel_err_vs_jit']:.2e}"])
    lines.append(acc._md_table(["workload", "batch", "int inputs (pos)", "variant", "back-to-back ms",
                                "per-call median ms", "p10–p90 ms", "speed-up vs jit", "peak MiB",
                                "program peak MiB", "XLA temp MiB", "max rel err vs jit"], rows, "lrrlrrrrrrrr"))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--pos", type=int, default=2048, help="value of integer scalar inputs (decode position)")
    p.add_argument("--workloads", default=None, help="comma-separated example modules (default: all)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--no-attention", action="store_true", help="skip the decode-attention comparison")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement subprocess")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--jsonl", default=None, help="append each result here as it is measured (survives a kill)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after which no new measurement starts (the table holds what finished)")
    p.add_argument("--corpus", action="store_true", help="time the guard's 44-program corpus instead")
    p.add_argument("--only", default=None, help="with --corpus: comma-separated name substrings, measured in this order")
    p.add_argument("--guard", default="model", choices=("model", "compile", "measure"),
                   help="with --corpus: the guard of the 'vtc' variant (optimize's default: model)")
    p.add_argument("--render", default=None, metavar="JSONL",
                   help="print the markdown table of a run's --jsonl file (no GPU needed)")
    p.add_argument("--info", default="", help="with --render: the line saying where and how it was measured")
    p.add_argument("--one", nargs=4, metavar=("KIND", "NAME", "BATCH", "VARIANT"), help=argparse.SUPPRESS)
    ns = p.parse_args(argv)

    if ns.render:
        rows = [json.loads(line) for line in Path(ns.render).read_text().splitlines() if line.strip()]
        corpus = [r for r in rows if r.get("kind") == "corpus"]
        print(render_corpus(corpus, ns.info) if corpus else render(rows, ns, "", where=ns.info))
        return 0
    if ns.one:
        kind, name, batch, variant = ns.one
        if not has_gpu():
            try:
                import jax
                why = f"backend {jax.default_backend()}, {jax.devices()}"
                jax.devices("gpu")
            except Exception as exc:  # noqa: BLE001 - the reason goes into the row
                why = f"{type(exc).__name__}: {exc}"
            print(json.dumps({"kind": kind, "name": name, "batch": int(batch), "variant": variant,
                              "error": f"no GPU in the measurement process ({why})"[:400]}))
            return 0
        print(json.dumps(measure(kind, name, int(batch), variant, runs=ns.runs, warmup=ns.warmup, pos=ns.pos)))
        return 0

    if ns.corpus:
        if not has_gpu():
            print(NO_GPU)
            return 0
        measure_corpus(ns)
        return 0
    if not has_gpu_elsewhere():
        print(NO_GPU)
        return 0

    import jax
    from tqdm import tqdm
    acc = _accounting()
    names = [w.module for w in acc.WORKLOADS] if ns.workloads is None else [w for w in ns.workloads.split(",") if w]
    batches = [int(b) for b in ns.batches.split(",") if b]
    jobs = []
    for n in names:
        if acc.load_example(n) is None:
            print(f"skipped {n}: examples/{n}.py does not exist")
            continue
        for b in batches:
            jobs += [("workload", n, b, v) for v in VARIANTS]
    if not ns.no_attention and acc.load_example("llama3_decode") is not None:
        jobs += [("attention", "llama3_attention", b, v) for b in batches for v in ATTN_VARIANTS]
    results = []
    start = time.monotonic()
    for job in tqdm(jobs, desc="measurements", unit="run"):
        if ns.deadline is not None and time.monotonic() - start > ns.deadline:
            tqdm.write(f"deadline of {ns.deadline:.0f} s reached: {job} and later not measured")
            break
        results.append(_run_one(*job, ns))
        r = results[-1]
        if ns.jsonl:
            with open(ns.jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")
        tqdm.write(f"{job}: " + (r["error"] if "error" in r else f"{r['median_ms']:.3f} ms"))
    device = next((r["device"] for r in results if "device" in r), "GPU")
    text = render(results, ns, device)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
