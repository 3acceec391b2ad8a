"""Kernel test helpers: rung 1 and rung 2 of the verification ladder on a CPU-only machine.

Interpret mode alone is not enough: it ignores the Triton backend's power-of-two rule and accepts
value-level slices/pads/gathers that do not lower (PALLAS-TRITON-NOTES.md, "Pitfalls" 1). So every
kernel test both runs the kernel in interpret mode against a reference *and* cross-lowers it for
CUDA, asserting that real Triton IR comes out.

Convention: a kernel entry point takes a keyword ``backend`` in {"interpret", "triton"}.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import jax
import numpy as np

from .compat import cuda_lowering

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


class TritonKernel(tuple):
    """One Triton custom call. A 2-tuple ``(name, ir)`` — so ``for name, ir in m.triton_kernels``
    works — that also carries the launch configuration found next to the IR in the backend config.

    ``ir`` is the serialized Triton MLIR (bytecode) that XLA's Triton compiler consumes; feed it to
    ``vtc_jax.offline.compile_kernel``.
    """

    num_warps: int | None
    num_stages: int | None
    grid: tuple[int, int, int]

    def __new__(cls, name: str, ir: bytes, num_warps: int | None = None,
                num_stages: int | None = None, grid: tuple[int, int, int] = (1, 1, 1)):
        self = super().__new__(cls, (name, ir))
        self.num_warps, self.num_stages, self.grid = num_warps, num_stages, tuple(grid)
        return self

    name = property(lambda self: self[0], doc="kernel (pallas_call) name")
    ir = property(lambda self: self[1], doc="Triton IR bytes from the backend config")

    def __repr__(self) -> str:
        return (f"TritonKernel(name={self.name!r}, ir=<{len(self.ir)} bytes>, "
                f"num_warps={self.num_warps}, num_stages={self.num_stages}, grid={self.grid})")


def _walk(op) -> Iterator[Any]:
    """All operations nested in ``op`` (pre-order), including ``op`` itself."""
    op = getattr(op, "operation", op)
    yield op
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from _walk(inner)


def _int_attr(d, key: str) -> int | None:
    from jax._src.lib.mlir import ir
    return ir.IntegerAttr(d[key]).value if key in d else None


@dataclass(frozen=True)
class LoweredModule:
    """A StableHLO module lowered for CUDA, with the parsed pieces tests and accounting need.

    ``count`` walks every function in the module once: a private function called twice counts once.
    """

    text: str
    triton_kernels: tuple[TritonKernel, ...]
    op_counts: dict[str, int]
    exported: Any = field(default=None, compare=False, repr=False)  # jax.export.Exported, if any

    def count(self, op_name: str) -> int:
        """Number of ``op_name`` ops (e.g. ``"stablehlo.transpose"``) in the module."""
        return self.op_counts.get(op_name, 0)

    def movement_into_consumers(self) -> list[tuple[str, str, str]]:
        """Data-movement ops whose result reaches a Triton kernel, a dot or a function result.

        Each entry is ``(movement op, consumer, result type)``. Reshapes (bitcasts in XLA) and dtype
        conversions are looked through, so ``transpose -> reshape -> kernel`` counts. Broadcasts
        count only when they enlarge (more result elements than operand elements).
        """
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir

        module = ir.Module.parse(self.text, context=mlir.make_ir_context())
        found = []
        for op in _walk(module.operation):
            name = op.name
            if name == "stablehlo.custom_call":
                if ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_CALL_TARGET:
                    continue
                consumer = "triton kernel"
            elif name in ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"):
                consumer = name
            elif name == "func.return":
                consumer = "function result"
            else:
                continue
            for value in op.operands:
                src = _defining_movement(value)
                if src is not None:
                    found.append((src.name, consumer, str(src.results[0].type)))
        return found

    @classmethod
    def from_text(cls, text: str) -> "LoweredModule":
        """Parse module text with JAX's MLIR context (it registers the stablehlo/mhlo dialects)."""
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir

        module = ir.Module.parse(text, context=mlir.make_ir_context())
        kernels: list[TritonKernel] = []
        counts: dict[str, int] = {}
        for op in _walk(module.operation):
            counts[op.name] = counts.get(op.name, 0) + 1
            if op.name != "stablehlo.custom_call":
                continue
            if ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_CALL_TARGET:
                continue
            # Pallas puts a dictionary here: {debug, grid_x/y/z, ir, name, num_stages, num_warps}.
            cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
            kernels.append(TritonKernel(
                ir.StringAttr(cfg["name"]).value if "name" in cfg else "?",
                ir.StringAttr(cfg["ir"]).value_bytes,
                _int_attr(cfg, "num_warps"), _int_attr(cfg, "num_stages"),
                tuple(_int_attr(cfg, f"grid_{a}") or 1 for a in "xyz")))
        return cls(text, tuple(kernels), counts)


_MOVEMENT_HLO = frozenset({
    "stablehlo.transpose", "stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.concatenate",
    "stablehlo.dynamic_update_slice", "stablehlo.pad", "stablehlo.reverse", "stablehlo.gather",
    "stablehlo.scatter", "stablehlo.broadcast_in_dim", "stablehlo.copy",
})


def _elements(t: Any) -> int:
    from jax._src.lib.mlir import ir
    shaped = ir.RankedTensorType(t)
    return int(np.prod(shaped.shape)) if shaped.rank else 1


def _defining_movement(value: Any) -> Any:
    """The movement op behind ``value`` (through reshapes/converts), or None."""
    from jax._src.lib.mlir import ir
    for _ in range(64):
        owner = value.owner
        if not isinstance(owner, ir.Operation) and not hasattr(owner, "name"):
            return None  # a block argument
        op = getattr(owner, "operation", owner)
        if op.name in ("stablehlo.reshape", "stablehlo.convert", "stablehlo.bitcast_convert"):
            value = op.operands[0]
            continue
        if op.name not in _MOVEMENT_HLO:
            return None
        if op.name == "stablehlo.broadcast_in_dim" and \
                _elements(op.results[0].type) <= _elements(op.operands[0].type):
            return None
        return op
    return None


def _sds(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


def cross_lower(fn: Callable, *args: Any) -> LoweredModule:
    """Lower ``jax.jit(fn)`` for CUDA on this CPU machine (``jax.export``, platforms=["cuda"]).

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees. The Triton custom call is not on
    export's stable list, so that safety check is disabled: we only inspect the module. Every
    Triton kernel's IR is verified (:func:`verify_triton_ir`; :class:`TritonIRError` otherwise).
    Needs jax-cuda12-plugin installed (the Pallas Triton lowering lives behind it). On jax >= 0.11
    without a GPU the lowering runs inside ``compat.cuda_lowering()`` (the context's mesh with an
    abstract H100): for kernels of one's own; vtc_jax's name their abstract GPU themselves.
    """
    with cuda_lowering():
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL_TARGET)],
        )(*jax.tree.map(_sds, args))
    module = replace(LoweredModule.from_text(exported.mlir_module()), exported=exported)
    for k in module.triton_kernels:
        verify_triton_ir(k.ir, k.name)
    for i, k in enumerate(module.triton_kernels):
        _IR_OWNERS[k.ir] = (exported, i)
    while len(_IR_OWNERS) > 4096:
        _IR_OWNERS.pop(next(iter(_IR_OWNERS)))
    return module


# Triton IR bytes -> (the Exported module holding it, kernel index): lets vtc_jax.offline compile a
# kernel given only its IR, by compiling the module it came from.
_IR_OWNERS: dict[bytes, tuple[Any, int]] = {}


def exported_for_ir(ir: bytes) -> tuple[Any, int] | None:
    """The ``jax.export.Exported`` (and kernel index) that ``cross_lower`` found ``ir`` in."""
    return _IR_OWNERS.get(bytes(ir))


@dataclass(frozen=True)
class KernelCheck:
    """What ``check_kernel`` saw: the interpret-mode output and the CUDA lowering (if requested)."""

    output: Any
    lowered: LoweredModule | None

    @property
    def text(self) -> str:
        return self.lowered.text if self.lowered else ""

    @property
    def triton_kernels(self) -> tuple[TritonKernel, ...]:
        return self.lowered.triton_kernels if self.lowered else ()


def _as_numpy(x: Any) -> np.ndarray:
    a = np.asarray(x)
    # Compare floating types (bf16/f16 included) in f32: assert_allclose does not handle bf16.
    return a.astype(np.float32) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a


def check_kernel(kernel_call: Callable, ref_fn: Callable, args: tuple, *, rtol: float,
                 atol: float, lower: bool = True, name: str | None = None,
                 check_dtype: bool = True) -> KernelCheck:
    """Check a kernel entry point ``kernel_call(*args, backend=...)`` against ``ref_fn(*args)``.

    (a) ``backend="interpret"`` under ``jax.jit``: shapes (and dtypes) must match the reference and
        values agree within ``rtol``/``atol`` (floats compared in f32); outputs may be pytrees.
    (b) if ``lower``: ``backend="triton"`` cross-lowered for CUDA must contain at least one
        ``__gpu$xla.gpu.triton`` custom call — the check interpret mode cannot do — whose Triton
        IR MLIR's verifier accepts (``cross_lower`` verifies every kernel).
    ``name`` only labels failure messages. Static configuration belongs in a ``functools.partial``.
    """
    label = name or getattr(kernel_call, "__name__", repr(kernel_call))
    out = jax.jit(functools.partial(kernel_call, backend="interpret"))(*args)
    ref = ref_fn(*args)
    out_leaves, out_tree = jax.tree.flatten(out)
    ref_leaves, ref_tree = jax.tree.flatten(ref)
    assert out_tree == ref_tree, f"{label}: output structure {out_tree} != reference {ref_tree}"
    for i, (o, r) in enumerate(zip(out_leaves, ref_leaves)):
        where = f"{label} output {i}"
        assert np.shape(o) == np.shape(r), f"{where}: shape {np.shape(o)} != {np.shape(r)}"
        if check_dtype:
            od, rd = jax.numpy.result_type(o), jax.numpy.result_type(r)
            assert od == rd, f"{where}: dtype {od} != {rd}"
        np.testing.assert_allclose(_as_numpy(o), _as_numpy(r), rtol=rtol, atol=atol,
                                   err_msg=where)
    lowered = None
    if lower:
        lowered = cross_lower(functools.partial(kernel_call, backend="triton"), *args)
        assert lowered.triton_kernels, (
            f"{label}: the CUDA lowering has no {TRITON_CALL_TARGET} custom call — did the "
            "pallas_call get compiler_params=plgpu.CompilerParams(...)?")
    return KernelCheck(out, lowered)


class TritonIRError(ValueError):
    """A kernel's Triton IR that MLIR's verifier rejects: XLA's Triton would refuse to compile it."""


def verify_triton_ir(ir: bytes, name: str = "kernel") -> None:
    """Parse a kernel's Triton IR (bytecode) with jaxlib's Triton dialect, which runs MLIR's
    verifier: the check XLA's Triton makes before compiling. Pallas can emit IR it does not
    verify itself (an ``arith.select`` between a weak-typed Python int and an i32, typed i1), so
    without this a kernel cross-lowers here and fails only when compiled for the GPU."""
    try:
        triton_ir_text(ir)
    except Exception as exc:  # noqa: BLE001 - MLIR raises a plain error with the diagnostics
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "error" in ln and ln != lines[0]), lines[0] if lines else "")
        raise TritonIRError(f"Triton IR of {name} does not verify: {why}") from exc


def triton_ir_text(ir: bytes) -> str:
    """The Triton MLIR of a custom call (``TritonKernel.ir``, bytecode) as text, for tests that
    count ops (selects, compares) or check index widths (``xi64``). Uses jaxlib's bundled Triton
    dialect (private API, present on jax 0.10.2 ... 0.12)."""
    from jax._src.lib import triton
    from jax._src.lib.mlir import ir as mlir_ir
    ctx = mlir_ir.Context()
    triton.dialect.register_dialect(ctx)
    with ctx:
        return str(mlir_ir.Module.parse(bytes(ir)))
