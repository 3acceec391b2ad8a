"""Where the supported jax versions (0.10.2 … 0.12.x) differ, in one place. Public jax APIs only,
but for the two hooks named below (Pallas's lowering rules; whether a trace is under way).

* **Lowering for CUDA on a machine without a GPU.** jax ≤ 0.10 let Pallas's Triton lowering assume
  compute capability 9.0 there; jax ≥ 0.11 raises "No supported GPU devices found, please specify
  an abstract GPU device using AbstractDevice": its Triton lowering rule
  (``jax/_src/pallas/triton/pallas_call_registration.py``, ``gpu_info.get_gpu_info``) asks
  ``jax.sharding.get_abstract_mesh().abstract_device``, else the default device, which GPU it
  lowers for — when the *program* is lowered (``jax.export``, ``.lower``), outside vtc_jax's code,
  in whatever mesh the user has entered. So vtc_jax's kernels carry
  :func:`triton_compiler_params`: a subclass of ``plgpu.CompilerParams`` whose lowering rule (Pallas
  picks the GPU lowering rule by the compiler params' class,
  ``jax._src.pallas.core.register_lowering_rule``: the one private hook used here) runs Pallas's
  own inside :func:`abstract_gpu_mesh` — the context's abstract mesh, its axis names, sizes and
  types unchanged, with an H100 (sm_90) as its abstract device — where no GPU is named or
  attached. ``backend="triton"`` then exports for CUDA with no context manager, inside the user's
  ``jax.set_mesh`` / ``use_mesh`` / ``use_abstract_mesh`` and with a ``shard_map`` in the program:
  the user's mesh is named a device only while a kernel lowers, and nothing is entered while jax
  *traces* (a ``shard_map`` compares its mesh with the context's there). ``cuda_lowering()``, the
  context users entered before, still works and serves Pallas kernels of one's own (tests',
  ``offline.compile_program``): it enters the same :func:`abstract_gpu_mesh` (with no context
  mesh, an empty one named an H100, which a traced ``shard_map`` does not compare against); on
  older jax, on a GPU machine or inside a mesh that already names a GPU it does nothing.
* **The Pallas Triton backend is deprecated upstream** (jax ≥ 0.11 warns with a DeprecationWarning
  on every GPU lowering of a ``pallas_call``; jax 0.12.0.1 still lowers it unchanged). vtc_jax's
  GPU kernels lower through it, so importing vtc_jax filters exactly that message and
  ``triton_backend_notice()`` says it once per process in vtc_jax's words
  (:class:`TritonBackendDeprecation`). Interpret mode never warns.
* **Where a warning points.** vtc_jax warns from deep inside jax's tracing (a fallback is found
  while ``jax.jit`` traces the user's function); :func:`warn` gives each warning the user's own
  line as its location — the first frame outside vtc_jax, jax and the standard library — which
  ``warnings.warn``'s ``skip_file_prefixes`` does only from Python 3.12 on.
* **Varying manual axes** (``jax.shard_map`` with ``check_vma=True``, the default). Inside a
  ``shard_map`` body every value's type says which mesh axes it varies over
  (``jax.typeof(x).mat.varying``, a ``jax.sharding.ManualAxisType``) and every primitive requires
  its operands' to match. ``abstract(x)`` keeps that type in the ``ShapeDtypeStruct`` VTC traces
  with (traced without it, a body's ``pvary`` of a replicated weight is missing and the re-bound
  ``dot_general`` fails); ``manual_axis_type(axes)`` is the type a kernel output gets (a Pallas
  output's ``ShapeDtypeStruct`` must carry one under ``check_vma``); ``vary(x, axes)`` is
  ``jax.lax.pcast(x, axes, to="varying")`` (``jax.lax.pvary`` is gone from jax >= 0.10). Outside a
  ``shard_map``, and on a jax without these types, they are no-ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import sysconfig
import warnings
from typing import Any, Iterator

import jax
from jax.experimental.pallas import triton as plgpu
from jax.extend.core import primitives as _primitives

try:  # the one private hook (see the module docstring): Pallas's GPU lowering rules by params class
    from jax._src.pallas import core as _pallas_core
except ImportError:  # pragma: no cover - a jax that moved it: kernels lower as plain Triton params
    _pallas_core = None

try:  # the second private hook: whether any trace is under way (jax.jit's own dispatch asks it)
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover - a jax that moved it: every call takes the full check
    _trace_state_clean = None


def outside_traces() -> bool:
    """Whether no jax transformation is tracing now (False where this jax cannot say): then a
    call's arguments are concrete values, never tracers. 0.15 µs, where reading every argument's
    sharding cost ``optimize`` about 4 µs a call with 13 arguments (``api._on_one_device``)."""
    return _trace_state_clean is not None and _trace_state_clean()


JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])

# The GPU lowered for when none is attached: what jax <= 0.10 assumed (compute capability 9.0).
CPU_LOWERING_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
CPU_LOWERING_CORES = 132
"""The H100 SXM's SM count: the one figure for the abstract device, XLA's deviceless target
(``offline.H100_TARGET_CONFIG``) and the kernels' grid heuristics (``kernels.tiling.NUM_SMS``)."""

_JAX_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


class TritonBackendDeprecation(UserWarning):
    """jax deprecates the Pallas Triton backend that vtc_jax's GPU kernels lower through."""


# XLA's GPU compile of a decode attention whose value cache is repeated for GQA (broadcast over
# the group axis) and contracted along its non-contiguous axis: jax 0.10.2's XLA writes that cache
# out transposed (and widened to the dot's result type) before ``p @ v``; jax 0.12's does so only
# where the dot keeps the cache's 16-bit type (a bf16 ``p @ v``: the zoo's pure-JAX Llama) and reads it
# where it is for a widening one (``preferred_element_type=f32``: the examples) (``xla.py``
# charges the copy only where it is made).
XLA_TRANSPOSES_REPEATED_VALUES = JAX_VERSION < (0, 11)

# XLA's Triton GEMM fusion, read off the deviceless H100 compiles: jax 0.10.2's copies a right
# operand whose free axes lie on both sides of its contracted ones (``bd,edf->bef``) and fuses
# no epilogue that reads another GEMM's result (LoRA's ``x @ W + (x @ A) @ B * s``); jax 0.12's
# reads that operand where it is and fuses such an epilogue into one of the GEMMs.
XLA_RELAYS_SPLIT_FREE_RHS = JAX_VERSION < (0, 11)
XLA_EPILOGUE_READS_OTHER_GEMMS = JAX_VERSION >= (0, 11)

# A norm XLA runs as a reduction fusion and a loop fusion applying it (no Triton fusion: its
# per-row values escape to a training step's backward), read off the deviceless H100 compiles of
# an RMSNorm's gradient: jax 0.10.2's XLA computes the ``rsqrt`` of the statistic inside each
# reader; jax 0.12's writes it by a loop fusion of its own (``loop_rsqrt_fusion``).
XLA_WRITES_ESCAPING_ROW_SCALE = JAX_VERSION >= (0, 11)

# XLA's stable-sort expander makes a stable sort's ties break by position with one more int32
# operand (an iota): jax 0.10.2's XLA adds it even where the sort already carries an iota
# (``argsort``); jax 0.12's uses that one.
XLA_STABLE_SORT_ADDS_IOTA_TO_AN_IOTA = JAX_VERSION < (0, 11)

# XLA's dot merger joins sibling dots (one operand shared) only where one of them reads and writes
# at most this many bytes, read off the H100 compile of two bf16 projections of one activation
# (K = N = 1024): jax 0.10.2's XLA merges at 64 MiB a dot and not at 65; jax 0.12's at 126 and
# not at 127.
# A repeated (broadcast, GQA) GEMM operand: jax 0.10.2's XLA writes it out (``wrapped_broadcast``)
# before the GEMM; jax 0.12's Triton GEMM reads it through the broadcast (read off the H100
# compile of a GQA prefill).
XLA_WRITES_REPEATED_GEMM_OPERANDS = JAX_VERSION < (0, 11)
# A GEMM operand cut out of a buffer's rows (Falcon's q, k and v split from one QKV result):
# jax 0.10.2's XLA copies it first (``loop_slice_fusion``), jax 0.12's reads it in place.
XLA_COPIES_PART_OF_ROWS = JAX_VERSION < (0, 11)
# Attention scores whose rank a reshape changes before the softmax (query heads grouped by
# reshaping the scores), soft-capped and masked: jax 0.10.2's XLA does that work in a loop fusion
# of its own before its Triton softmax; jax 0.12's inside the softmax's fusion.
XLA_MASKS_REGROUPED_SCORES_APART = JAX_VERSION < (0, 11)
# A returned cache updated in place and read by a GEMM in another layout (``relayout``): written
# by a scatter (``cache.at[:, slot].set(row)``), jax 0.12's XLA copies it once more than written by
# a dynamic_update_slice (4 cache-size launches against 3; a rolling window cache). On jax 0.10.2
# the two read 3 and 2-3 (read off the H100 compile of one cache, K read by a GQA einsum).
XLA_COPIES_SCATTERED_CACHE_AGAIN = JAX_VERSION >= (0, 11)
# Sibling projections with biases merged into one GEMM (BERT's q, k and v), each part transposed
# for the attention's GEMMs: jax 0.10.2's XLA adds the bias in the transpose's fusion; jax 0.12's
# in the GEMM reading the part, from the bias broadcast to the operand's shape by a launch of its
# own (``wrapped_broadcast``; read off the H100 compile of ``(x @ wq + bq)`` heads).
XLA_BROADCASTS_BIAS_OF_MERGED_GEMMS = JAX_VERSION >= (0, 11)
# A GEMM result transposed with its batch axes still next to each other but reordered (``(H, B,
# T, D)`` of a ``(B, H, T, D)`` product): jax 0.12's GEMM writes it itself, jax 0.10.2's copies it.
XLA_GEMM_REORDERS_BATCHES = JAX_VERSION >= (0, 11)

# XLA's dot merger, read off the deviceless H100 compiles of ``x @ a, x @ b, x @ c`` (bf16, M x K
# by K x N over M 64-32,768, K 1,024-8,192, N 1,024-4,096): jax 0.10.2's joins a dot to those
# merged so far where either reads and writes at most the bound (a 4096 x 16384 projection joins
# LoRA's rank-16 products of the same ``x``; a second such projection does not); jax 0.12's joins
# two (a dot, or those merged so far) where each one's result and other operand together are at
# most the bound (LoRA's q and k at 2,048 tokens, 48 MiB each, one GEMM; v, past 64 with them,
# one of its own; K = N = 1,024 at 31,744 rows still one GEMM).
XLA_DOT_MERGER_MAX_BYTES = 64 << 20
XLA_DOT_MERGER_JOINS_ONE_WITHIN = JAX_VERSION < (0, 11)


def needs_abstract_gpu() -> bool:
    """True on jax >= 0.11, where Pallas needs an abstract GPU device to lower for CUDA without one."""
    return JAX_VERSION >= (0, 11)


def _local_gpu() -> Any:
    try:
        return next((d for d in jax.devices() if d.platform == "gpu"), None)
    except RuntimeError:
        return None


def _has_gpu() -> bool:
    return _local_gpu() is not None


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _abstract_gpu() -> "jax.sharding.AbstractDevice":
    """The device to lower for: the local GPU where there is one, else an H100."""
    gpu = _local_gpu()
    if gpu is not None:
        return jax.sharding.AbstractDevice(gpu.device_kind, getattr(gpu, "core_count", None), "gpu")
    return jax.sharding.AbstractDevice(CPU_LOWERING_DEVICE_KIND, CPU_LOWERING_CORES, "cuda")


def abstract_gpu_mesh() -> "jax.sharding.AbstractMesh | None":
    """The context's abstract mesh with a GPU as its abstract device: the same axis names, sizes
    and types (a mesh the user entered is kept, only its device named), an empty mesh where the
    context has none. None where Pallas finds a GPU already (jax < 0.11 needs none; a GPU attached
    and no other device named; a context mesh whose device is a GPU)."""
    if not needs_abstract_gpu():
        return None
    mesh = jax.sharding.get_abstract_mesh()
    device = mesh.abstract_device
    if device is not None and device.platform in _GPU_PLATFORMS:
        return None
    if device is None and _has_gpu():
        return None
    return jax.sharding.AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names),
                                     axis_types=tuple(mesh.axis_types), abstract_device=_abstract_gpu())


def abstract_h100_mesh() -> "jax.sharding.AbstractMesh":
    """A one-device abstract mesh whose device is an H100 (jax >= 0.11 only). Kept for callers of
    earlier versions; vtc_jax itself uses :func:`abstract_gpu_mesh` (the context's own axes)."""
    return jax.sharding.AbstractMesh((1,), ("_vtc_cuda",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=jax.sharding.AbstractDevice(
                                         CPU_LOWERING_DEVICE_KIND, CPU_LOWERING_CORES, "cuda"))


@contextlib.contextmanager
def cuda_lowering() -> Iterator[None]:
    """Context for lowering (``jax.export``, ``.lower(lowering_platforms=("cuda",))``, a deviceless
    compile) Pallas kernels of one's own for CUDA on any machine; vtc_jax's kernels need none (see
    the module docstring). Says the deprecation notice once."""
    triton_backend_notice()
    mesh = abstract_gpu_mesh()
    if mesh is None:
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh):
        yield


@dataclasses.dataclass(frozen=True)
class _TritonParams(plgpu.CompilerParams):
    """``plgpu.CompilerParams`` whose CUDA lowering names an abstract GPU where none is given."""


def _lower_triton(ctx: Any, *args: Any, **params: Any) -> Any:
    """Pallas's own Triton lowering rule, inside :func:`abstract_gpu_mesh` when lowering for CUDA
    (the user's context mesh with a GPU device; nothing entered where Pallas finds one)."""
    triton_backend_notice()
    rule = _pallas_core.get_lowering_rule(plgpu.CompilerParams, "gpu")
    if rule is None:
        raise RuntimeError("jax's Pallas Triton lowering is not registered (is jax's CUDA plugin installed?)")
    platforms = tuple(getattr(ctx, "platforms", None) or ctx.module_context.platforms)
    mesh = abstract_gpu_mesh() if platforms == ("cuda",) else None
    if mesh is None:
        return rule(ctx, *args, **params)
    with jax.sharding.use_abstract_mesh(mesh):
        return rule(ctx, *args, **params)


_HOOKED = _pallas_core is not None and needs_abstract_gpu()
if _HOOKED:
    _pallas_core.register_lowering_rule(_TritonParams, _lower_triton, "gpu")


def triton_compiler_params(num_warps: int, num_stages: int) -> Any:
    """Compiler params for a vtc_jax Triton kernel. On jax >= 0.11 they lower for CUDA without a GPU
    and without a context manager (see the module docstring); elsewhere plain ``plgpu.CompilerParams``
    (older jax finds a GPU to lower for without being told)."""
    cls = _TritonParams if _HOOKED else plgpu.CompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


_said = False


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_INTERNAL_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep, _package_dir(jax),
                   os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep, "<frozen ")


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` located at the user's call: the first frame (outward from the caller)
    whose file is not vtc_jax's, jax's or the standard library's (see the module docstring)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_FILES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def triton_backend_notice() -> None:
    """Say once per process, in vtc_jax's words, that jax deprecates the Pallas Triton backend (only
    on jax versions that deprecate it). Call where vtc_jax builds or lowers a Triton kernel."""
    global _said
    if _said or JAX_VERSION < (0, 11):
        return
    _said = True
    warn(
        f"vtc_jax: jax {jax.__version__} deprecates the Pallas Triton backend that vtc_jax's GPU "
        "kernels lower through (upstream points to Mosaic GPU or jax-triton). On this jax they "
        "still lower, compile and run unchanged; vtc_jax hides jax's per-kernel "
        "DeprecationWarning and says it only here.", TritonBackendDeprecation)


def quiet_jax_triton_deprecation() -> None:
    """Filter jax's own per-lowering Pallas Triton DeprecationWarning (its exact message only)."""
    if JAX_VERSION >= (0, 11):
        warnings.filterwarnings("ignore", message=_JAX_TRITON_DEPRECATION,
                                category=DeprecationWarning)


quiet_jax_triton_deprecation()


def nvidia_driver_present() -> bool:
    """Whether this machine has an NVIDIA driver (its kernel module, or its user-space library)."""
    import ctypes.util
    return os.path.exists("/proc/driver/nvidia/version") or ctypes.util.find_library("cuda") is not None


class _NoDriverPluginError:
    """A filter on jax's ``jax._src.xla_bridge`` logger dropping the record of its CUDA plugin
    failing to start — a 20-line "Jax plugin configuration error ... Unable to load cuDNN"
    traceback at the first backend use — on a machine with no NVIDIA driver, where it can only
    fail and jax goes on with the CPU. The test extra installs the plugin for cross-lowering and
    the deviceless compile; a CPU machine following the README should stay quiet (issue #25)."""

    @staticmethod
    def filter(record: Any) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("Jax plugin configuration error") and "cuda" in str(record.args).lower())


def quiet_cuda_plugin_without_driver() -> None:
    """Install :class:`_NoDriverPluginError` where there is no NVIDIA driver (a no-op elsewhere:
    on a GPU machine a plugin error is real news). jax 0.10.2's jaxlib also prints absl lines
    ("Could not find cuda drivers") from C++ when ``import jax`` loads the plugin's libraries,
    before vtc_jax is imported: no Python code can silence those."""
    if not nvidia_driver_present():
        import logging
        logging.getLogger("jax._src.xla_bridge").addFilter(_NoDriverPluginError())


quiet_cuda_plugin_without_driver()


_MANUAL_AXIS_TYPE = getattr(jax.sharding, "ManualAxisType", None)
_EMPTY_MAT = _MANUAL_AXIS_TYPE() if _MANUAL_AXIS_TYPE is not None else None


def _mat(x: Any) -> Any:
    """The ``ManualAxisType`` of an array, tracer, aval or ``ShapeDtypeStruct`` (None: none known)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return getattr(x, "manual_axis_type", None)
    return getattr(getattr(x, "aval", x), "mat", None)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over inside a ``shard_map`` (empty outside one)."""
    mat = _mat(x)
    return frozenset(mat.varying) if mat is not None else frozenset()


def abstract(x: Any) -> Any:
    """``jax.ShapeDtypeStruct`` of an array, tracer or aval: shape, dtype, weak type and, inside a
    ``shard_map``, its varying manual axes (the module docstring says why)."""
    aval = getattr(x, "aval", x)
    mat = _mat(x)
    # a varying type needs the (manual, abstract) mesh it varies over: the aval's sharding
    extra = {"manual_axis_type": mat, "sharding": aval.sharding} if mat is not None and mat != _EMPTY_MAT else {}
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(aval, "weak_type", False), **extra)


def weak_typed(x: Any) -> Any:
    """``x`` as a weakly typed value of its own dtype (what ``jax.jit`` returns for a result of
    Python scalars): ``convert_element_type`` with ``weak_type=True``, the one primitive that sets
    it (``jax.extend``). A kernel's or a re-bound op's result is strongly typed."""
    if getattr(getattr(x, "aval", None), "weak_type", True):
        return x
    return _primitives.convert_element_type_p.bind(x, new_dtype=x.dtype, weak_type=True, sharding=None)


def manual_axis_type(axes: frozenset) -> dict[str, Any]:
    """``ShapeDtypeStruct`` keywords for a value varying over ``axes`` (``{}`` on a jax without
    manual axis types). Given even for no axes: under ``check_vma`` Pallas requires one."""
    return {} if _MANUAL_AXIS_TYPE is None else {"manual_axis_type": _MANUAL_AXIS_TYPE(varying=frozenset(axes))}


def vary(x: Any, axes: frozenset) -> Any:
    """``x`` typed as varying over ``axes`` too (the axes it already varies over are left)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def scan_counts(params: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's params.

    jax <= 0.10 has ``num_consts``/``num_carry``; jax 0.12 replaced them (and ``linear``) with
    ``ft_in``, a FlatTree packing (consts, carry, xs)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))
