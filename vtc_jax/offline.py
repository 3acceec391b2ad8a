"""Rung 2b of the verification ladder: compile for an H100 (sm_90) with XLA, no GPU, no driver.

Cross-lowering proves that Triton IR exists; it does not catch register pressure, spills or a
shared-memory footprint over the device limit (only checked at kernel load time), and it says
nothing about what XLA makes of the rest of the program. So the program is compiled *deviceless*
with public jax APIs only: ``jax.experimental.topologies.get_topology_desc`` with an H100 target
config (``H100_TARGET_CONFIG``) gives a compile-only CUDA device; ``jax.jit(f).lower(...)
.compile()`` then runs XLA's whole GPU pipeline (fusion, layout, scheduling, buffer assignment) and
compiles every Triton custom call with XLA's own bundled Triton, on jax 0.10.2 … 0.12.x alike.

What comes back (:class:`CompiledProgram`):

* the optimised HLO and XLA's thunk sequence (``--xla_dump_to``): one line per kernel launch, with
  grid and dynamic shared memory;
* ``compiled.memory_analysis()``: arguments, outputs, temporaries, aliased bytes;
* the PTX XLA emits: XLA is pointed (``xla_gpu_cuda_data_dir``) at a ``ptxas`` wrapper that keeps a
  copy of each PTX file it hands to the real ``ptxas`` (from the ``nvidia-cuda-nvcc-cu12`` wheel);
  ``ptxas -v`` on that PTX gives registers, spill bytes and static shared memory per kernel
  (:class:`KernelResources`).

The compile runs in this process (XLA failures are Python exceptions here, not aborts).
``compile_lowered``/``compile_many`` keep the per-Triton-kernel interface of the kernel tests: the
kernels come from ``vtc_jax.testing.cross_lower`` modules, which are compiled whole as above.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping, Sequence

from .compat import CPU_LOWERING_CORES, cuda_lowering
from .primitives import kernel_reads_in_place
from .testing import LoweredModule, exported_for_ir

# Shared memory per block (opt-in maximum), bytes. Only checked by the driver at load time.
SMEM_LIMIT: dict[str, int] = {"sm_90": 232448, "sm_80": 166912, "sm_86": 101376, "sm_89": 101376}

DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3

# GpuTargetConfig (text proto) of an H100 SXM 80GB: XLA's deviceless GPU compile reads the device
# from here. Figures from NVIDIA's published H100 SXM specifications (132 SMs, 228 KiB shared memory
# per SM of which 227 KiB per block opt-in, 50 MiB L2, 3.35 TB/s HBM3, 1.98 GHz boost).
H100_TARGET_CONFIG = """\
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: %d
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85520809984
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
""" % CPU_LOWERING_CORES


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
    # The PTX file this entry was assembled from (XLA may put several entries in one file): what
    # the kernel tests grep for pipelining (``cp.async.wait_group N``) and index widths.
    ptx: str | None = field(default=None, repr=False, compare=False)

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


# ---------------------------------------------------------------- ptxas

_TARGET_RE = re.compile(r"(?m)^\s*\.target\s+(sm_\w+)")
_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_FIELD_RE = {k: re.compile(p) for k, p in {
    "registers": r"Used (\d+) registers", "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads", "static_smem": r"(\d+) bytes smem"}.items()}


@dataclass(frozen=True)
class MainLoop:
    """What a kernel's PTX says about how it keeps loads in flight (``main_loop``).

    ``loop``: the kernel has a loop (a backward branch); ``waits``: the ``cp.async.wait_group N``
    operands inside its longest loop (Triton's software pipeline: N groups stay in flight while
    the oldest is consumed); ``loads``: plain ``ld.global`` instructions in that loop;
    ``prefetched``: those of them whose values nothing but a ``mov`` reads before the loop's
    back branch — values carried into the next iteration (``tiling.fori_prefetch``), so the
    iteration does not wait for them. Any other plain load is consumed in the iteration that
    issues it: that loop waits one DRAM round trip per iteration, whatever else it pipelines."""
    loop: bool
    waits: tuple[int, ...] = ()
    loads: int = 0
    prefetched: int = 0

    @property
    def tiles_per_cta(self) -> int:
        """Tiles in flight per CTA, a lower bound: 2 for a loop none of whose loads it waits for
        in the iteration that issues them (a ``cp.async`` pipeline waiting with at least one group
        pending, plain loads prefetched for the next iteration, or both); 1 for a loop that
        consumes a plain load in its own iteration, or for a kernel without a loop (its one
        block)."""
        if not self.loop or self.loads > self.prefetched:
            return 1
        if self.waits:
            return 2 if min(self.waits) >= 1 else 1
        return 2 if self.prefetched else 1

    def describe(self) -> str:
        if not self.loop:
            return "no loop (one block)"
        plain = f"{self.loads} ld.global" + (f" ({self.prefetched} prefetched)" if self.prefetched else "")
        if self.waits:
            return f"cp.async.wait_group {min(self.waits)}" + (f" + {plain}" if self.loads else "")
        return f"{plain}, no cp.async"


_LABEL = re.compile(r"^\s*(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")


def main_loop(ptx: str, entry: str | None = None) -> MainLoop:
    """The longest loop of ``entry``'s body in ``ptx`` (the whole text if ``entry`` is None or not
    found): a label and a later branch back to it."""
    body = ptx
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\b", ptx) if entry else None
    if m is not None:
        body = ptx[m.start():]
        nxt = body.find(".entry", 6)
        body = body if nxt < 0 else body[:nxt]
    lines = body.splitlines()
    labels: dict[str, int] = {}
    best: tuple[int, int] | None = None
    for i, line in enumerate(lines):
        lm = _LABEL.match(line)
        if lm:
            labels[lm.group(1)] = i
        bm = _BRANCH.search(line)
        if bm and bm.group(1) in labels:
            a = labels[bm.group(1)]
            if best is None or i - a > best[1] - best[0]:
                best = (a, i)
    if best is None:
        return MainLoop(False)
    seg = lines[best[0]:best[1] + 1]
    waits = tuple(int(x) for x in re.findall(r"cp\.async\.wait_group\s+(\d+)", "\n".join(seg)))
    loads = [i for i, line in enumerate(seg) if _LD_GLOBAL.search(line)]
    return MainLoop(True, waits, len(loads), sum(_carried(seg, i) for i in loads))


_LD_GLOBAL = re.compile(r"\bld\.global[\w.]*\s+\{?([^\[]*?)\}?\s*,\s*\[")
_MOV = re.compile(r"^\s*mov\.\w+\s+(%\w+|\{[^}]*\})\s*,\s*(%\w+)\s*;")


def _carried(seg: Sequence[str], i: int) -> bool:
    """Whether the registers loaded by the ``ld.global`` at ``seg[i]`` are read by nothing but
    ``mov`` up to the back branch: copies into the loop's carried registers, or the unpacking of a
    32-bit word into its two 16-bit halves (a renaming of the halves, which ptxas keeps in the
    word's register), whose results are followed the same way."""
    regs = set(re.findall(r"%\w+", _LD_GLOBAL.search(seg[i]).group(1)))
    for line in seg[i + 1:]:
        code = line.split("//")[0]
        used = {r for r in regs if re.search(re.escape(r) + r"\b", code)}
        if not used:
            continue
        m = _MOV.match(code)
        if m is None or m.group(2) not in regs:
            return False
        regs |= set(re.findall(r"%\w+", m.group(1)))
    return True


def _tail(text: str, lines: int = 8) -> str:
    keep = [ln for ln in text.splitlines() if "cudart_stub" not in ln and "absl::" not in ln]
    return "\n".join(keep[-lines:]).strip()


def ptxas_entries(ptx_file: Path) -> tuple[str, dict[str, dict[str, Any]], str | None]:
    """Assemble one PTX file for its own ``.target`` with ``ptxas -v``: (target, per-entry fields
    {registers, spill_store_bytes, spill_load_bytes, static_smem}, error or None)."""
    m = _TARGET_RE.search(ptx_file.read_text(errors="replace"))
    target = m.group(1) if m else "sm_90a"
    proc = subprocess.run([ptxas_path(), "-v", f"--gpu-name={target}", str(ptx_file), "-o",
                           str(ptx_file.with_suffix(".cubin"))],
                          capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return target, {}, f"ptxas exit {proc.returncode}: {_tail(log)}"
    entries: dict[str, dict[str, Any]] = {}
    parts = _ENTRY_RE.split(log)  # [preamble, name1, text1, name2, text2, ...]
    for name, text in zip(parts[1::2], parts[2::2]):
        fields = {k: sum(int(x) for x in r.findall(text)) for k, r in _FIELD_RE.items()}
        entries[name] = fields
    return target, entries, None


# ---------------------------------------------------------------- deviceless compile for an H100

_PTXAS_WRAPPER = """#!/bin/sh
# Written by vtc_jax.offline: keep a copy of the PTX that XLA hands to ptxas, then run the real one.
if [ -f "$1" ]; then cp "$1" "$(mktemp "{capture}/ptx-XXXXXXXX")" 2>/dev/null; fi
exec "{real}" "$@"
"""

_H100S: dict[int, tuple[Any, ...]] = {}


def h100_devices(n: int = 1) -> tuple[Any, ...]:
    """Compile-only CUDA devices for ``n`` H100s on one host (``jax.experimental.topologies``,
    topology ``1x1xn``; no GPU needed): a mesh over them compiles sharded programs as for a node."""
    if n not in _H100S:
        from jax.experimental import topologies
        _H100S[n] = tuple(topologies.get_topology_desc("h100", "cuda", target_config=H100_TARGET_CONFIG,
                                                       topology=f"1x1x{n}").devices)
    return _H100S[n]


def h100_device() -> Any:
    """A compile-only CUDA device for an H100 (``jax.experimental.topologies``; no GPU needed)."""
    return h100_devices(1)[0]


# thunks that launch nothing themselves (a dynamic-slice fusion wraps the copy or GEMM it runs at
# offsets it reads; an async start/done pair (jax 0.12's XLA) runs the thunks between them on
# another stream: the listing prints each inner thunk on its own line, counted there)
_NON_LAUNCH_THUNKS = frozenset({"kCommandBuffer", "kSequential", "kConditional", "kWaitForStreams",
                                "kWaitForStream", "kHostSendDone", "kHostRecvDone", "kDynamicSliceFusion",
                                "kAsyncStart", "kAsyncDone"})
_THUNK_RE = re.compile(r"^\s*\d+:\s+(k\w+)\s*(?:\[[^\]]*\])?\s*(.*)$")
_KERNEL_RE = re.compile(r"(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: (\d+)")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_LEAF_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
# thunk kinds that print no instruction name -> custom-call targets they run
_LIBRARY_THUNKS = {"kConvolution": ("__cudnn$conv",),
                   "kGemm": ("__cublas$gemm", "__cublas$lt"),
                   "kCublasLtMatmul": ("__cublas$lt",)}


def _leaf_sizes(shape: str) -> list[int]:
    out = []
    for dt, dims in _LEAF_RE.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * _DTYPE_BYTES.get(dt, 1))
    return out


def _balanced(text: str, i: int) -> int:
    """Index just past the bracket group opening at ``text[i]``."""
    depth = 0
    pairs = {"(": ")", "{": "}", "[": "]"}
    close = pairs[text[i]]
    for j in range(i, len(text)):
        if text[j] == text[i]:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


@dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    args: str = ""                  # raw text inside the parentheses (a parameter's index)


_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        k = _balanced(rest, 0)
        shape, rest = rest[:k], rest[k:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    k = _balanced(rest, op.end() - 1)
    # "%pallas_call.14#1" is XLA's short form of get-tuple-element(%pallas_call.14), index=1: kept
    # whole so that a launch reading one result of a multi-output call is charged that result only
    operands = tuple(re.findall(r"%([\w.\-]+(?:#\d+)?)", rest[op.end():k - 1]))
    return _Instr(m.group(1), shape, op.group(1), operands, rest[k:], rest[op.end():k - 1])


def _computations(hlo: str) -> dict[str, list[_Instr]]:
    comps: dict[str, list[_Instr]] = {}
    cur = None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            cur = "ENTRY" if head.group(1) else head.group(2)
            comps[cur] = []
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            ins = _parse_instr(line)
            if ins:
                comps[cur].append(ins)
    return comps


@dataclass(frozen=True)
class Launch:
    """One kernel launch of the compiled program (a line of XLA's thunk sequence).

    Bytes are buffer bytes from the optimised HLO: every distinct buffer the launch reads
    (``read_bytes``) or writes (``write_bytes``). A buffer updated in place (an operand aliased to a
    result) is counted in ``in_place_bytes`` instead: HLO does not show how much of it the kernel
    touches; for XLA's in-place dynamic-update-slice/scatter fusions the update written is in
    ``write_bytes``."""
    name: str
    kind: str
    triton: bool = False            # a Triton custom call (a Pallas kernel)
    grid: tuple[int, ...] = ()
    threads: tuple[int, ...] = ()
    shared_memory: int = 0          # dynamic shared memory from the thunk, bytes
    hlo: str | None = None          # the HLO instruction it launches
    read_bytes: int = 0
    write_bytes: int = 0
    in_place_bytes: int = 0
    num_warps: int | None = None
    num_stages: int | None = None

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.write_bytes


@dataclass(frozen=True)
class CompiledProgram:
    """A program compiled by XLA for an H100 without a GPU (see the module docstring)."""
    hlo: str
    thunks: str
    launches: tuple[Launch, ...]
    memory: dict[str, int]           # CompiledMemoryStats fields, plus "total"
    kernels: tuple[KernelResources, ...] = ()
    kernel_error: str | None = None  # why ``kernels`` is empty or partial
    jax_version: str = ""

    @property
    def triton_launches(self) -> tuple[Launch, ...]:
        return tuple(x for x in self.launches if x.triton)

    @property
    def bytes(self) -> int:
        return sum(x.bytes for x in self.launches)

    @property
    def in_place_bytes(self) -> int:
        return sum(x.in_place_bytes for x in self.launches)

    def kernel(self, name: str) -> KernelResources | None:
        return next((k for k in self.kernels if k.name == name), None)


def _memory(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
    mem = {k: int(getattr(stats, k, 0) or 0) for k in keys}
    mem["total"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"]
                    + mem["temp_size_in_bytes"] - mem["alias_size_in_bytes"])
    return mem


def _dedup(ins: _Instr) -> str:
    """The kernel an instruction runs: XLA's ``deduplicated_name`` where it shares one."""
    m = re.search(r'deduplicated_name="([^"]+)"', ins.attrs)
    return m.group(1) if m else ins.name


def _launches(hlo: str, thunks: str, reads_in_place: Mapping[str, frozenset[int]] | None = None
              ) -> tuple[Launch, ...]:
    comps = _computations(hlo)
    entry = comps.get("ENTRY", [])
    by_name = {i.name: i for i in entry}

    def value(name: str, index: int | None = None) -> tuple[str, int | None]:
        name, hash_, k = name.partition("#")
        index = int(k) if hash_ else index
        ins = by_name.get(name)
        while ins is not None and ins.opcode in ("bitcast", "get-tuple-element", "copy-done"):
            if ins.opcode == "get-tuple-element":
                m = re.search(r"index=(\d+)", ins.attrs)
                index = int(m.group(1)) if m else 0
            nxt, hash_, k = ins.operands[0].partition("#")
            index = int(k) if hash_ else index
            ins = by_name.get(nxt)
            name = ins.name if ins else name
        return name, index

    def size(v: tuple[str, int | None]) -> int:
        ins = by_name.get(v[0])
        if ins is None:
            return 0
        leaves = _leaf_sizes(ins.shape)
        if v[1] is None:
            return sum(leaves)
        return leaves[v[1]] if v[1] < len(leaves) else 0

    def in_place(ins: _Instr) -> dict[int, tuple[int, int]]:
        """{result leaf index: (operand index, bytes written)} for results aliased to operands."""
        out: dict[int, tuple[int, int]] = {}
        m = re.search(r"output_to_operand_aliasing=\{(.*?)\}\s*(?:,\s*\w+=|$)", ins.attrs)
        if m:
            for res, opnd in re.findall(r"\{(\d*)\}:\s*\((\d+)", m.group(1)):
                out[int(res or 0)] = (int(opnd), 0)
        if ins.opcode == "fusion":
            calls = re.search(r"calls=%?([\w.\-]+)", ins.attrs)
            body = comps.get(calls.group(1), []) if calls else []
            root = body[-1] if body else None
            if root is not None and root.opcode in ("dynamic-update-slice", "scatter"):
                first = next((i for i in body if i.name == root.operands[0]), None)
                if first is not None and first.opcode == "parameter" and first.args.isdigit():
                    k = int(first.args)
                    upd_name = root.operands[1 if root.opcode == "dynamic-update-slice" else 2]
                    upd = next((i for i in body if i.name == upd_name), None)
                    written = sum(_leaf_sizes(upd.shape)) if upd else 0
                    out[0] = (k, written)
        return out

    def gathered(ins: _Instr) -> dict[int, int]:
        """{operand index: bytes read} for operands a launch reads only as a gather's table: the
        rows the gathers take, not the table (an embedding lookup reads 140 of 32,064 rows)."""
        if ins.opcode == "gather":
            return {0: sum(_leaf_sizes(ins.shape))}
        calls = re.search(r"calls=%?([\w.\-]+)", ins.attrs) if ins.opcode == "fusion" else None
        body = comps.get(calls.group(1), []) if calls else []
        out: dict[int, int] = {}
        for p in body:
            if p.opcode != "parameter" or not p.args.isdigit():
                continue
            names, rows, only = {p.name}, 0, True
            for u in body:   # in order: a bitcast's users come after it
                hits = [j for j, o in enumerate(u.operands) if o in names]
                if not hits:
                    continue
                if u.opcode == "bitcast":
                    names.add(u.name)
                elif u.opcode == "gather" and hits == [0]:
                    rows += sum(_leaf_sizes(u.shape))
                else:
                    only = False
                    break
            if only and rows:
                out[int(p.args)] = rows
        return out

    def stats(ins: _Instr, reads: frozenset[int] = frozenset()) -> tuple[int, int, int]:
        alias = in_place(ins)
        aliased_operands = {opnd for opnd, _ in alias.values()} - reads
        sparse = gathered(ins)
        seen, read = set(), 0
        for j, o in enumerate(ins.operands):
            if j in aliased_operands:
                continue
            v = value(o)
            if v not in seen:
                seen.add(v)
                read += min(size(v), sparse[j]) if j in sparse else size(v)
        leaves = _leaf_sizes(ins.shape)
        write = sum(b for i, b in enumerate(leaves) if i not in alias)
        write += sum(w for _, w in alias.values())
        inplace = sum(leaves[i] for i in alias if i < len(leaves))
        return read, write, inplace

    skip = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all",
            "partition-id", "replica-id", "opt-barrier"}
    candidates = [i for i in entry if i.opcode not in skip]
    # thunk names are the instruction names sanitised for PTX ("gemm_fusion_dot.10" -> "..._10")
    by_thunk_name = {re.sub(r"[^\w]", "_", i.name): i for i in candidates}
    used: set[str] = set()
    triton_calls = [i for i in candidates if i.opcode == "custom-call"
                    and TRITON_CALL_TARGET in i.attrs]
    # XLA's sort emitter runs one sort fusion as several launches, named after the sort inside
    # (``sort_1_1``, ``sort_1_1__1``, ...): each sorts the fusion's result buffers in place
    sort_of = {}
    for i in candidates:
        calls = re.search(r"calls=%?([\w.\-]+)", i.attrs) if i.opcode == "fusion" else None
        body = comps.get(calls.group(1), []) if calls else []
        if body and body[-1].opcode == "sort":
            sort_of[re.sub(r"[^\w]", "_", body[-1].name)] = i
        elif i.opcode == "sort":   # an unstable sort XLA leaves unfused
            sort_of[re.sub(r"[^\w]", "_", i.name)] = i
    twins: dict[str, list[_Instr]] = {}
    for i in candidates:
        twins.setdefault(_dedup(i), []).append(i)
    lines = [(m.group(1), m.group(2)) for m in map(_THUNK_RE.match, thunks.splitlines())
             if m and m.group(1) not in _NON_LAUNCH_THUNKS]
    names = [(_KERNEL_RE.search(rest).group(1) if _KERNEL_RE.search(rest) else (rest.split() or [kind])[0])
             for kind, rest in lines]

    readers: dict[str, int] = {}
    for i in entry:
        for o in i.operands:
            readers[value(o)[0]] = readers.get(value(o)[0], 0) + 1

    def kept_operands(sort: _Instr) -> list[tuple[str, int | None]]:
        """A sort's operands still needed elsewhere (a parameter, a value with other readers):
        XLA copies each into the buffers the sort then works on in place."""
        opnds = [value(o) for o in sort.operands]
        return [v for v in opnds if by_name.get(v[0]) is not None and (
            by_name[v[0]].opcode == "parameter" or readers.get(v[0], 0) > 1)]

    def copies_for_a_sort(j: int) -> bool:
        """Launch line ``j`` is one of the unnamed copies a sort makes of its operands: the last
        of the unnamed copies right before the sort's launches (the ones before them are HLO
        copies scheduled there)."""
        end = j
        while end < len(lines) and lines[end][0] == "kCopy" and names[end] == "kCopy":
            end += 1
        sort = sort_of.get(re.sub(r"__\d+$", "", names[end])) if end < len(lines) else None
        return sort is not None and end - j <= len(kept_operands(sort))

    launches = []
    for j, (kind, rest) in enumerate(lines):
        km = _KERNEL_RE.search(rest)
        name = names[j]
        sort = sort_of.get(re.sub(r"__\d+$", "", name))
        if sort is not None:
            used.add(sort.name)
            res = sum(_leaf_sizes(sort.shape))
            launches.append(Launch(name=name, kind=kind, grid=tuple(int(x) for x in km.group(2).split(",")),
                                   threads=tuple(int(x) for x in km.group(3).split(",")), hlo=sort.name,
                                   read_bytes=res, write_bytes=res) if km else
                            Launch(name=name, kind=kind, hlo=sort.name, read_bytes=res, write_bytes=res))
            continue
        ins = by_name.get(name) or by_thunk_name.get(name)
        if ins is not None and ins.name in used:
            # XLA compiles identical fusions once (``deduplicated_name``) and names every launch of
            # that kernel after the first: the next unclaimed fusion of the same kernel
            same = twins.get(_dedup(ins), ())
            if len(same) < 2:   # deduplicated without the attribute: a fusion of the same kind and shape
                same = [i for i in candidates if i.shape == ins.shape
                        and re.sub(r"\.\d+$", "", i.name) == re.sub(r"\.\d+$", "", ins.name)]
            ins = next((i for i in same if i.name not in used), None)
        if ins is None and kind in _LIBRARY_THUNKS:
            # a cuDNN / cuBLAS thunk prints no instruction name: the thunk sequence follows the
            # scheduled ENTRY order, so it is the next unclaimed library custom call (left unmatched,
            # a jit conv was charged 0 bytes and VTC's Pallas conv its full traffic)
            ins = next((i for i in candidates if i.name not in used and i.opcode == "custom-call"
                        and any(t in i.attrs for t in _LIBRARY_THUNKS[kind])), None)
        if ins is None and kind == "kCopy" and name == "kCopy" and not copies_for_a_sort(j):
            # a device copy of an HLO ``copy`` prints no instruction name: the thunks follow the
            # scheduled ENTRY order, so it is the next unclaimed copy (a sort's copies: below)
            ins = next((i for i in candidates if i.name not in used and i.opcode == "copy"), None)
        if ins is None and re.fullmatch(r"topk(__\d+)?", name):   # XLA's top-k kernel (k <= 16)
            ins = next((i for i in candidates if i.name not in used and i.opcode == "custom-call"
                        and "__gpu$TopK" in i.attrs), None)
        triton = False
        if ins is None:
            ins = next((i for i in triton_calls if i.name not in used
                        and re.search(r'name = "' + re.escape(name.split("__")[0]) + '"', i.attrs)),
                       None)
            triton = ins is not None
        elif ins.opcode == "custom-call" and TRITON_CALL_TARGET in ins.attrs:
            triton = True
        fields: dict[str, Any] = {"name": name, "kind": kind, "triton": triton}
        if km:
            fields.update(grid=tuple(int(x) for x in km.group(2).split(",")),
                          threads=tuple(int(x) for x in km.group(3).split(",")),
                          shared_memory=int(km.group(4)))
        if ins is not None:
            used.add(ins.name)
            r, w, ip = stats(ins, (reads_in_place or {}).get(name.split("__")[0], frozenset()) if triton
                             else frozenset())
            fields.update(hlo=ins.name, read_bytes=r, write_bytes=w, in_place_bytes=ip)
            for key in ("num_warps", "num_stages"):
                mm = re.search(key + r" = (\d+)", ins.attrs)
                if mm and triton:
                    fields[key] = int(mm.group(1))
        launches.append(Launch(**fields))
    # unnamed device copies right before a sort's launches: each copies one operand still needed
    # elsewhere into the buffers the sort then works on in place; read and write it
    j = 0
    while j < len(launches):
        run = j
        while run < len(launches) and launches[run].kind == "kCopy" and launches[run].hlo is None:
            run += 1
        nxt = launches[run] if run < len(launches) else None
        if run > j and nxt is not None and nxt.hlo is not None and re.sub(r"__\d+$", "", nxt.name) in sort_of:
            opnds = [value(o) for o in by_name[nxt.hlo].operands]
            kept = kept_operands(by_name[nxt.hlo])
            sizes = [size(v) for v in kept] if len(kept) == run - j else \
                [sum(size(v) for v in opnds) // (run - j)] * (run - j)
            for k, b in zip(range(j, run), sizes):
                launches[k] = replace(launches[k], read_bytes=b, write_bytes=b)
        j = run + 1
    # a conditional runs one branch per call: keep the heaviest branch's launches (an upper bound)
    tags = _branches(thunks)
    if any(tags) and len(tags) == len(launches):
        weight: dict[tuple[int, str], int] = {}
        for x, tag in zip(launches, tags):
            if tag is not None:
                weight[tag] = weight.get(tag, 0) + x.bytes + 1
        keep = {max((t for t in weight if t[0] == c), key=lambda t: weight[t]) for c, _ in weight}
        launches = [x for x, tag in zip(launches, tags) if tag is None or tag in keep]
    return tuple(launches)


def _branches(thunks: str) -> list[tuple[int, str] | None]:
    """Per launch line of XLA's thunk sequence, the (conditional, branch) it runs in, or None."""
    out: list[tuple[int, str] | None] = []
    conds, branch = 0, None      # branch: (conditional, name, header indent)
    for line in thunks.splitlines():
        indent = len(line) - len(line.lstrip())
        if branch is not None and line.strip() and indent <= branch[2]:
            branch = None
        m = _THUNK_RE.match(line)
        if m and m.group(1) == "kConditional":
            conds += 1
        hm = re.match(r"^\s*(\w*branch\w*):\s*$", line)
        if hm:
            branch = (conds, hm.group(1), indent)
        elif m and m.group(1) not in _NON_LAUNCH_THUNKS:
            out.append(branch[:2] if branch else None)
    return out


def _sds(x: Any, sharding: Any) -> Any:
    import jax
    import numpy as np
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sharding)


def compile_program(fn: Callable, *args: Any, kernels: bool = True, donate_argnums: Any = (),
                    placed: bool = False, **kwargs: Any) -> CompiledProgram:
    """Compile ``fn`` (a function, a ``jax.jit`` object or a ``vtc_jax.optimize`` object) for an
    H100 with XLA, deviceless; ``args``/``kwargs`` are arrays or ``ShapeDtypeStruct`` pytrees.
    On a machine with a GPU, for that GPU (the deviceless topology is for machines without one).

    A plain function is wrapped in ``jax.jit(fn, donate_argnums=donate_argnums)``. With ``kernels``
    the PTX XLA emits is assembled by ``ptxas -v`` for per-kernel resources. ``placed``: the
    arguments are ShapeDtypeStructs already carrying their shardings (e.g. a mesh over
    :func:`h100_devices`), kept as they are, and the program is lowered with no context manager, as
    a user lowers it; the counts are then those of one device's program."""
    import jax

    local = jax.default_backend() == "gpu"
    if not placed:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0] if local else h100_device())
        args = jax.tree.map(lambda x: _sds(x, sharding), args)
        kwargs = jax.tree.map(lambda x: _sds(x, sharding), kwargs)
    target = fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums)
    with tempfile.TemporaryDirectory(prefix="vtc-xla-") as tmp:
        d = Path(tmp)
        dump, capture, cuda = d / "dump", d / "ptx", d / "cuda"
        capture.mkdir()
        options: dict[str, Any] = {"xla_dump_to": str(dump)}
        kernel_error = None
        if kernels:
            try:
                real = ptxas_path()
            except FileNotFoundError as e:
                kernel_error, kernels = str(e), False
        if kernels:
            (cuda / "bin").mkdir(parents=True)
            wrapper = cuda / "bin" / "ptxas"
            wrapper.write_text(_PTXAS_WRAPPER.format(capture=capture, real=real))
            wrapper.chmod(0o755)
            nvvm = Path(real).parent.parent / "nvvm"
            if nvvm.is_dir():
                (cuda / "nvvm").symlink_to(nvvm)
            options.update(xla_gpu_cuda_data_dir=str(cuda), xla_gpu_enable_libnvptxcompiler=False)
        # placed arguments: lowered exactly as a user lowers a sharded program (no vtc_jax context;
        # vtc_jax's kernels name their abstract GPU themselves, compat.triton_compiler_params)
        with (contextlib.nullcontext() if local or placed else cuda_lowering()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            # a donation no output can take: jax says so at the user's own call, not at each price
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = target.lower(*args, **kwargs).compile(compiler_options=options)
        hlo_files = sorted(dump.glob("*after_optimizations.txt"))
        if not hlo_files:
            raise RuntimeError(f"XLA wrote no optimised HLO to {dump}")
        hlo_file = hlo_files[-1]
        prefix = hlo_file.name.split(".sm_")[0]
        thunk_files = (sorted(dump.glob(prefix + "*thunk_sequence_after_thunk_passes.txt"))
                       or sorted(dump.glob(prefix + "*thunk_sequence.txt")))
        hlo = hlo_file.read_text()
        thunks = thunk_files[-1].read_text() if thunk_files else ""
        launches = _launches(hlo, thunks, _pallas_reads_in_place(target, args, kwargs))
        res: list[KernelResources] = []
        if kernels:
            res, kernel_error = _kernel_resources(
                sorted(capture.iterdir(), key=lambda f: f.stat().st_mtime_ns), launches)
        return CompiledProgram(hlo, thunks, launches, _memory(compiled), tuple(res), kernel_error,
                               jax.__version__)


def _pallas_reads_in_place(target: Any, args: Any, kwargs: Any) -> dict[str, frozenset[int]]:
    """Per Pallas kernel name, the operands it updates in place and reads whole
    (:func:`primitives.kernel_reads_in_place`, from the traced program: the optimised HLO shows
    only the aliasing, not what the kernel loads). Empty where the program cannot be traced here."""
    import jax
    try:
        closed = jax.make_jaxpr(target)(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the launches then count aliased operands as untouched
        return {}
    out: dict[str, frozenset[int]] = {}

    def walk(jaxpr: Any) -> None:
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                info = e.params.get("name_and_src_info")
                name = getattr(info, "name", None) or e.params.get("name")
                reads = kernel_reads_in_place(SimpleNamespace(primitive="pallas_call", params=e.params))
                if name and reads:
                    out[str(name)] = out.get(str(name), frozenset()) | reads
                continue
            for p in e.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return out


def _kernel_resources(ptx_files: Sequence[Path], launches: Sequence[Launch]
                      ) -> tuple[list[KernelResources], str | None]:
    """ptxas -v over every PTX file XLA produced; the last compile of an entry name wins (XLA may
    compile a fusion more than once). Shared memory = the launch's dynamic + ptxas's static."""
    if not ptx_files:
        return [], ("XLA handed no PTX to ptxas (was the PTX compiled in-process? this jaxlib may "
                    "ignore xla_gpu_enable_libnvptxcompiler)")
    entries: dict[str, tuple[str, dict[str, Any], str]] = {}
    errors = []
    for f in ptx_files:
        target, found, err = ptxas_entries(f)
        if err:
            errors.append(err)
        for name, fields in found.items():
            entries[name] = (target, fields, f.read_text(errors="replace"))
    by_name = {x.name: x for x in launches}
    out = []
    for name, (target, f, ptx) in entries.items():
        launch = by_name.get(name)
        dyn = launch.shared_memory if launch else 0
        out.append(KernelResources(
            name=name, registers=f["registers"], spill_store_bytes=f["spill_store_bytes"],
            spill_load_bytes=f["spill_load_bytes"], smem_bytes=dyn + f["static_smem"],
            ptx_ok=True, cubin_ok=True, num_warps=launch.num_warps if launch else None,
            num_stages=launch.num_stages if launch else None, gpu_name=target, ptx=ptx))
    return out, ("; ".join(errors) or None)


# ---------------------------------------------------------------- per Triton kernel (kernel tests)

def _compile_exported(exported: Any) -> CompiledProgram:
    """``exported.call`` wants the exported function's own argument pytree (a params dict, say),
    not the flat ``in_avals``."""
    import jax
    args, kwargs = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    return compile_program(exported.call, *args, **kwargs)


def compile_lowered(lowered_module: Any, *, num_warps: int | None = None,
                    num_stages: int | None = None, arch: str = "9.0") -> list[KernelResources]:
    """Resources of every Triton kernel of a ``vtc_jax.testing.LoweredModule`` (in module order),
    from compiling the module deviceless for sm_90 (``compile_program``).

    ``num_warps``/``num_stages`` are what Pallas recorded in each custom call (the arguments are
    kept for compatibility and ignored); only ``arch="9.0"`` is supported."""
    exported = getattr(lowered_module, "exported", None)
    kernels = list(getattr(lowered_module, "triton_kernels", ()))
    if exported is None:
        return [KernelResources(name=k[0], error="not a vtc_jax.testing.cross_lower module")
                for k in kernels]
    return _match(kernels, _compile_or_error(exported, arch))


def compile_many(kernels: Sequence[tuple[str, bytes, int, int]], *, arch: str = "9.0"
                 ) -> list[KernelResources]:
    """Resources for ``(name, ir_bytes, num_warps, num_stages)`` tuples whose IR came from
    ``vtc_jax.testing.cross_lower`` (each module is compiled once, deviceless, for sm_90)."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    out: list[KernelResources | None] = [None] * len(kernels)
    for i, (name, ir, _, _) in enumerate(kernels):
        owner = exported_for_ir(ir)
        if owner is None:
            out[i] = KernelResources(name=name, error=(
                "unknown Triton IR: compile_many takes IR from vtc_jax.testing.cross_lower modules"))
            continue
        groups.setdefault(id(owner[0]), (owner[0], []))[1].append(i)
    for exported, idxs in groups.values():
        program = _compile_or_error(exported, arch)
        module_kernels = LoweredModule.from_text(exported.mlir_module()).triton_kernels
        matched = _match(list(module_kernels), program)
        for i in idxs:
            k_index = exported_for_ir(kernels[i][1])[1]
            r = matched[k_index]
            out[i] = KernelResources(**{**r.__dict__, "name": kernels[i][0]})
    return [r for r in out if r is not None]


def _compile_or_error(exported: Any, arch: str) -> CompiledProgram | str:
    if arch not in ("9.0", "9.0a", "sm_90", "sm_90a"):
        return f"only sm_90 is supported by the deviceless compile (asked for {arch})"
    try:
        return _compile_exported(exported)
    except Exception as e:  # noqa: BLE001 - reported per kernel
        return f"XLA: {type(e).__name__}: {_tail(str(e))}"


def _match(kernels: list[Any], program: CompiledProgram | str) -> list[KernelResources]:
    """Pair the module's Triton kernels (module order) with the compiled Triton launches: by
    Pallas name, XLA's ``name__N`` duplicates in launch order."""
    if isinstance(program, str):
        return [KernelResources(name=k[0], error=program) for k in kernels]
    pool = list(program.triton_launches)
    out = []
    for k in kernels:
        name = k[0]
        launch = next((x for x in pool if x.name == name or x.name.split("__")[0] == name
                       or re.sub(r"__\d+$", "", x.name) == name), None)
        if launch is None:
            out.append(KernelResources(name=name, error=(
                f"no compiled Triton launch named {name!r}; launches: "
                + ", ".join(x.name for x in program.triton_launches))))
            continue
        pool.remove(launch)
        r = program.kernel(launch.name)
        if r is None:
            out.append(KernelResources(name=name, num_warps=launch.num_warps,
                                       num_stages=launch.num_stages,
                                       error=program.kernel_error or "no PTX for this kernel"))
            continue
        out.append(KernelResources(**{**r.__dict__, "name": name,
                                      "num_warps": launch.num_warps or getattr(k, "num_warps", None),
                                      "num_stages": launch.num_stages or getattr(k, "num_stages", None)}))
    return out

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
