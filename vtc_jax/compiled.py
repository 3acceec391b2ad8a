"""Ground truth from XLA's own compile for an H100, with no GPU attached (deviceless AOT).

XLA compiles for a GPU it is only *described*: ``jax.experimental.topologies.get_topology_desc``
with a CUDA target config (the GPU's published properties, in XLA's ``GpuTargetConfig`` text
format) gives devices that ``jax.jit(...).lower(...).compile()`` targets; XLA then runs its whole
GPU pipeline — fusion, strength reduction of small dots, in-place updates, buffer assignment —
and compiles every Pallas Triton kernel with its own Triton, for sm_90. What comes back is what a
user's H100 would run, minus autotuning choices.

``compile_for_h100(fn, args, donate_argnums)`` returns the compiled executable;
``stats(compiled)`` reads it: every launch of the entry computation (and of while bodies) with the
bytes of the buffers it binds, the Triton kernels, and XLA's buffer assignment
(``memory_analysis()``: arguments + outputs + temporaries − aliased). Needs the CUDA PJRT plugin
(``jax-cuda12-plugin``) installed; no driver or GPU. Bytes are *bound* bytes (every operand and
result buffer of a launch, once): a launch that reads a window of a buffer touches less, an
in-place update (a dynamic-update-slice fusion, an aliased kernel output) is counted as its
update only.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

__all__ = ["H100_TARGET_CONFIG", "h100_sharding", "compile_for_h100", "stats", "Launch", "CompiledStats"]

# XLA's GpuTargetConfig (text proto) for an H100 SXM 80 GB: 132 SMs, 3.35 TB/s, 50 MiB L2, sm_90.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
runtime_version: {
  major: 12
  minor: 8
  patch: 0
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 7
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
# opcodes that are no kernel launch on a GPU (aliases, tuples, loop plumbing, constants)
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
                   "call", "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done"})


@functools.lru_cache(maxsize=1)
def _h100_devices() -> tuple[Any, ...]:
    from jax.experimental.topologies import get_topology_desc
    topo = get_topology_desc("vtc_h100", "cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
    return tuple(topo.devices)


def h100_sharding() -> jax.sharding.Sharding:
    devices = _h100_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_for_h100(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int] = ()) -> Any:
    """``jax.jit(fn, donate_argnums)`` compiled for a described H100 (``args``: arrays or SDS)."""
    sh = h100_sharding()
    sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tuple(args))
    return jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*sds).compile()


@dataclass(frozen=True)
class Launch:
    name: str
    kind: str          # "fusion", "triton", "custom-call" (cuBLAS, ...), or the opcode
    bytes: int         # bound bytes (in-place buffers: the update only)
    in_loop: bool = False


@dataclass(frozen=True)
class CompiledStats:
    launches: tuple[Launch, ...]
    arguments: int
    outputs: int
    temporaries: int
    aliased: int

    @property
    def buffers(self) -> int:
        """XLA's buffer assignment: arguments + outputs + temporaries − aliased (bytes)."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    @property
    def bytes(self) -> int:
        return sum(x.bytes for x in self.launches)

    @property
    def triton(self) -> int:
        return sum(x.kind == "triton" for x in self.launches)

    @property
    def loops(self) -> bool:
        return any(x.in_loop for x in self.launches)


def _shape_bytes(shape: str) -> int:
    total = 0
    for dt, dims in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dt, 4)
    return total


def _split_shape(rest: str) -> tuple[str, str]:
    """``'(a, b) op(...)'`` or ``'f32[2]{0} op(...)'`` -> (shape, remainder)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    sp = rest.index(" ")
    return rest[:sp], rest[sp + 1:]


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _computations(text: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """computation name -> [(name, shape, opcode, rest)] (first entry of the ENTRY one is '__entry__')."""
    comps: dict[str, list[tuple[str, str, str, str]]] = {}
    cur: list | None = None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(", line)
        if head and line.rstrip().endswith("{"):
            cur = comps.setdefault("__entry__" if head.group(1) else head.group(2), [])
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if cur is None or not m:
            continue
        try:
            shape, rest = _split_shape(m.group(2))
        except ValueError:
            continue
        op = rest.split("(", 1)[0].strip()
        cur.append((m.group(1), shape, op, rest))
    return comps


def _operands(rest: str) -> list[str]:
    inner = rest.split("(", 1)[1]
    depth, out, tok = 1, [], ""
    for ch in inner:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                break
        if ch == "," and depth == 1:
            out.append(tok)
            tok = ""
        else:
            tok += ch
    out.append(tok)
    return [t.strip().split(" ")[-1].lstrip("%") for t in out if t.strip()]


def stats(compiled: Any) -> CompiledStats:
    """Launches, bound bytes and buffer assignment of a compiled executable (see module docstring)."""
    text = compiled.as_text()
    comps = _computations(text)
    roots = {name: instrs[-1][2] for name, instrs in comps.items() if instrs}

    def walk(comp: str, in_loop: bool) -> list[Launch]:
        out: list[Launch] = []
        shapes = {n: s for n, s, _, _ in comps.get(comp, [])}
        for name, shape, op, rest in comps.get(comp, []):
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest)
                if body:
                    out += walk(body.group(1), True)
                continue
            if op == "conditional":
                for br in re.findall(r"%([\w.\-]+)", rest.split("branch_computations=")[-1].split("}")[0]):
                    out += walk(br, in_loop)
                continue
            if op in _FREE:
                continue
            ops = _operands(rest)
            op_bytes = [_shape_bytes(shapes.get(o, "")) for o in ops]
            res = _shape_bytes(shape)
            kind = op
            if op == "custom-call":
                kind = "triton" if "__gpu$xla.gpu.triton" in rest else "custom-call"
                aliased = re.findall(r"\{(\d*)\}:\s*\((\d+)", rest.split("output_to_operand_aliasing=")[-1]) \
                    if "output_to_operand_aliasing" in rest else []
                for _, k in aliased:       # an in-place buffer: its update is what the kernel writes
                    res -= op_bytes[int(k)]
                    op_bytes[int(k)] = 0
            elif op == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", rest)
                if called and roots.get(called.group(1)) == "dynamic-update-slice" and op_bytes \
                        and op_bytes[0] == res:
                    res, op_bytes[0] = 0, 0     # in place: only the update is read and written
                    res = sum(op_bytes)
            out.append(Launch(name, kind, max(0, res) + sum(op_bytes), in_loop))
        return out

    ma = compiled.memory_analysis()
    return CompiledStats(tuple(walk("__entry__", False)), int(ma.argument_size_in_bytes),
                         int(ma.output_size_in_bytes), int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes))
