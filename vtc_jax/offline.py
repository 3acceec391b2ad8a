"""Rung 2b of the verification ladder: compile Triton IR to PTX and cubin with no GPU and no driver.

Cross-lowering proves that Triton IR exists; it does not catch register pressure, spills or a
shared-memory footprint over the device limit (that is only checked at kernel load time). XLA's
bundled Triton compiler (registered by the CUDA plugin even under ``JAX_PLATFORMS=cpu``) turns the IR
into PTX, and ``ptxas`` from the ``nvidia-cuda-nvcc-cu12`` wheel assembles it and reports resources.

Some Triton failures abort the process (``LLVM ERROR``, exit 134), so the Triton step runs in a worker
subprocess. One worker compiles a batch sequentially (start-up costs ~1 s, a kernel ~0.05 s); when it
dies, the kernel it was on is marked failed and a fresh worker continues with the rest.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

# Shared memory per block (opt-in maximum), bytes. Only checked by the driver at load time.
SMEM_LIMIT: dict[str, int] = {"sm_90": 232448, "sm_80": 166912, "sm_86": 101376, "sm_89": 101376}

DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
ABORT_PROBE = b"__vtc_offline_abort__"  # IR that makes the worker abort: tests crash recovery
_WORKER_TIMEOUT_S = 120.0  # per kernel in a batch, plus one start-up allowance


@dataclass(frozen=True)
class KernelResources:
    """Per-kernel result. ``smem_bytes`` = Triton's dynamic shared memory + ptxas static smem."""

    name: str
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    smem_bytes: int | None = None
    ptx_ok: bool = False
    cubin_ok: bool = False
    error: str | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    gpu_name: str | None = None  # ptxas target, e.g. "sm_90a"

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes)

    def fits(self, gpu: str | None = None) -> bool:
        """Compiled, and shared memory within the per-block limit of ``gpu`` (default: the target)."""
        gpu = gpu or (self.gpu_name or "sm_90").rstrip("a")
        return self.cubin_ok and self.smem_bytes is not None and self.smem_bytes <= SMEM_LIMIT[gpu]


def ptxas_path() -> str:
    """ptxas from the nvidia-cuda-nvcc-cu12 wheel (``nvidia/cuda_nvcc/bin/ptxas``, a namespace
    package), else ``$VTC_PTXAS`` or PATH."""
    if os.environ.get("VTC_PTXAS"):
        return os.environ["VTC_PTXAS"]
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(base) / "bin" / "ptxas"
        if cand.is_file():
            return str(cand)
    found = shutil.which("ptxas")
    if found:
        return found
    raise FileNotFoundError("ptxas not found: pip install nvidia-cuda-nvcc-cu12 (or set VTC_PTXAS)")


# ---------------------------------------------------------------- worker (runs in a subprocess)

def _worker(jobdir: str) -> None:
    """Compile every job in ``jobdir/jobs.json`` from index ``start`` on; append one JSON line per
    job to ``results.jsonl`` *before* moving on, so the parent knows where a crash happened."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    d = Path(jobdir)
    spec = json.loads((d / "jobs.json").read_text())
    import jax
    jax.devices()  # plugin discovery registers the CUDA Triton compilation handler
    from jax._src.lib import triton as jt  # private: pinned by jax<0.11 in pyproject
    with open(d / "results.jsonl", "a") as out:
        out.write('{"ready": true}\n')
        out.flush()
        for job in spec["jobs"][spec["start"]:]:
            res: dict[str, Any] = {"i": job["i"]}
            try:
                if not jt.has_compilation_handler("cuda"):
                    raise RuntimeError("no CUDA Triton compilation handler: pip install "
                                       "jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2")
                ir_bytes = (d / f"{job['i']}.ir").read_bytes()
                if ir_bytes == ABORT_PROBE:
                    os.abort()
                r = jt.compile("cuda", ir_bytes, job["arch"],
                               num_warps=job["num_warps"], num_ctas=1,
                               num_stages=job["num_stages"])
                (d / f"{job['i']}.ptx").write_text(r.asm)
                res["smem_bytes"] = int(r.smem_bytes)
            except Exception as e:  # noqa: BLE001 — reported per kernel
                res["error"] = f"triton: {type(e).__name__}: {e}"
            out.write(json.dumps(res) + "\n")
            out.flush()


_WORKER_BOOT = ("import importlib.util as u, sys; s = u.spec_from_file_location('_vtc_offline', "
                "sys.argv[1]); m = sys.modules['_vtc_offline'] = u.module_from_spec(s); "
                "s.loader.exec_module(m); "
                "m._worker(sys.argv[2])")


def _triton_batch(jobs: list[dict[str, Any]], d: Path) -> dict[int, dict[str, Any]]:
    """Run the worker over ``jobs`` (restarting after crashes); results keyed by job index."""
    results: dict[int, dict[str, Any]] = {}
    start = 0
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    while start < len(jobs):
        (d / "jobs.json").write_text(json.dumps({"jobs": jobs, "start": start}))
        (d / "results.jsonl").unlink(missing_ok=True)
        err = ""
        try:
            proc = subprocess.run(
                [sys.executable, "-P", "-c", _WORKER_BOOT, __file__, str(d)], env=env,
                capture_output=True, text=True,
                timeout=_WORKER_TIMEOUT_S * (len(jobs) - start + 1))
            rc = proc.returncode
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            err = f"worker {how}: {_tail(proc.stderr)}".rstrip(": ")
        except subprocess.TimeoutExpired as e:
            err = f"worker timed out after {e.timeout:.0f} s"
        path = d / "results.jsonl"
        lines = [json.loads(ln) for ln in (path.read_text().splitlines() if path.exists() else [])
                 if ln.strip()]
        if not any(r.get("ready") for r in lines):  # died before compiling anything: give up
            for j in jobs[start:]:
                results[j["i"]] = {"i": j["i"], "error": f"{err} (worker start-up)"}
            break
        results.update((r["i"], r) for r in lines if "i" in r)
        done = sum(1 for j in jobs[start:] if j["i"] in results)
        if start + done < len(jobs):  # the worker died on jobs[start + done]
            results[jobs[start + done]["i"]] = {"i": jobs[start + done]["i"], "error": err}
            done += 1
        start += done
    return results


def _tail(text: str, lines: int = 8) -> str:
    keep = [ln for ln in text.splitlines() if "cudart_stub" not in ln and "absl::" not in ln]
    return "\n".join(keep[-lines:]).strip()


# ---------------------------------------------------------------- ptxas

_RE = {k: re.compile(p) for k, p in {
    "registers": r"Used (\d+) registers", "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads", "smem": r"(\d+) bytes smem",
    "target": r"(?m)^\s*\.target\s+(sm_\w+)"}.items()}


def _ptxas(ptx_file: Path) -> dict[str, Any]:
    """Assemble PTX for its own ``.target`` and parse ``ptxas -v``. Max registers over entries,
    summed spills and static smem."""
    ptx = ptx_file.read_text()
    m = _RE["target"].search(ptx)
    target = m.group(1) if m else "sm_90a"
    proc = subprocess.run([ptxas_path(), "-v", f"--gpu-name={target}", str(ptx_file), "-o",
                           str(ptx_file.with_suffix(".cubin"))],
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    out: dict[str, Any] = {"gpu_name": target, "cubin_ok": proc.returncode == 0}
    if proc.returncode != 0:
        out["error"] = f"ptxas exit {proc.returncode}: {_tail(log)}"
        return out
    regs = [int(x) for x in _RE["registers"].findall(log)]
    out["registers"] = max(regs) if regs else None
    for key in ("spill_store_bytes", "spill_load_bytes"):
        out[key] = sum(int(x) for x in _RE[key].findall(log))
    out["static_smem"] = sum(int(x) for x in _RE["smem"].findall(log))
    return out


# ---------------------------------------------------------------- public API

def compile_many(kernels: Sequence[tuple[str, bytes, int, int]], *, arch: str = "9.0"
                 ) -> list[KernelResources]:
    """Compile ``(name, ir_bytes, num_warps, num_stages)`` tuples; one result per kernel, in order.
    ``arch`` is the compute capability Triton targets ("9.0" gives sm_90a, "8.0" sm_80)."""
    with tempfile.TemporaryDirectory(prefix="vtc-offline-") as tmp:
        d = Path(tmp)
        jobs = []
        for i, (_, ir_bytes, nw, ns) in enumerate(kernels):
            (d / f"{i}.ir").write_bytes(ir_bytes)
            jobs.append({"i": i, "arch": arch, "num_warps": int(nw), "num_stages": int(ns)})
        triton = _triton_batch(jobs, d)
        out = []
        for job, (name, _, nw, ns) in zip(jobs, kernels):
            t = triton.get(job["i"], {"error": "no result"})
            common = dict(name=name, num_warps=int(nw), num_stages=int(ns))
            if "error" in t:
                out.append(KernelResources(error=t["error"], **common))
                continue
            p = _ptxas(d / f"{job['i']}.ptx")
            out.append(KernelResources(
                registers=p.get("registers"), spill_store_bytes=p.get("spill_store_bytes"),
                spill_load_bytes=p.get("spill_load_bytes"),
                smem_bytes=t["smem_bytes"] + p.get("static_smem", 0), ptx_ok=True,
                cubin_ok=p["cubin_ok"], error=p.get("error"), gpu_name=p["gpu_name"], **common))
        return out


def compile_kernel(ir_bytes: bytes, *, num_warps: int, num_stages: int, arch: str = "9.0",
                   name: str = "kernel") -> KernelResources:
    """Compile one kernel's Triton IR (bytecode or text) to PTX and cubin; see module docstring."""
    return compile_many([(name, ir_bytes, num_warps, num_stages)], arch=arch)[0]


def compile_lowered(lowered_module: Any, *, num_warps: int | None = None,
                    num_stages: int | None = None, arch: str = "9.0") -> list[KernelResources]:
    """Compile every Triton kernel of a ``vtc_jax.testing.LoweredModule``.

    ``num_warps``/``num_stages`` come from each custom call's backend config (Pallas records the
    ``CompilerParams`` there); the arguments are used only where it has none.
    """
    ks = []
    for k in lowered_module.triton_kernels:
        nw = getattr(k, "num_warps", None) or num_warps or DEFAULT_NUM_WARPS
        ns = getattr(k, "num_stages", None) or num_stages or DEFAULT_NUM_STAGES
        ks.append((k[0], k[1], nw, ns))
    return compile_many(ks, arch=arch) if ks else []


def format_table(results: Iterable[KernelResources], gpu: str = "sm_90") -> str:
    """A plain-text table: one row per kernel, verdict against ``gpu``'s shared-memory limit."""
    rows = [("kernel", "warps", "stages", "regs", "spill st/ld B", "smem B", "status")]
    for r in results:
        if r.error or not r.cubin_ok:
            status = "FAIL " + (r.error or "").splitlines()[0][:60] if r.error else "FAIL"
        elif not r.fits(gpu):
            status = f"SMEM > {SMEM_LIMIT[gpu]}"
        else:
            status = "spills" if r.spills else "ok"
        rows.append((r.name, str(r.num_warps or "-"), str(r.num_stages or "-"),
                     str(r.registers if r.registers is not None else "-"),
                     f"{r.spill_store_bytes or 0}/{r.spill_load_bytes or 0}" if r.cubin_ok else "-",
                     str(r.smem_bytes if r.smem_bytes is not None else "-"), status))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)
