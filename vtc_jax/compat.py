"""Where the supported jax versions (0.10.2 … 0.12.x) differ, in one place. Public jax APIs only.

* **Lowering for CUDA on a machine without a GPU.** jax ≤ 0.10 let Pallas's Triton lowering assume
  compute capability 9.0 there; jax ≥ 0.11 raises "No supported GPU devices found, please specify
  an abstract GPU device using AbstractDevice". ``cuda_lowering()`` is the context to lower (or
  compile deviceless) in: on jax ≥ 0.11 with no GPU attached it enters
  ``jax.sharding.use_abstract_mesh`` with a one-device mesh whose ``AbstractDevice`` is an H100
  (sm_90); on older jax, on a GPU machine, or inside a mesh that already names a device it does
  nothing.
* **The Pallas Triton backend is deprecated upstream** (jax ≥ 0.11 warns with a DeprecationWarning
  on every GPU lowering of a ``pallas_call``; jax 0.12.0.1 still lowers it unchanged). vtc_jax's
  GPU kernels lower through it, so importing vtc_jax filters exactly that message and
  ``triton_backend_notice()`` says it once per process in vtc_jax's words
  (:class:`TritonBackendDeprecation`). Interpret mode never warns.
* **Where a warning points.** vtc_jax warns from deep inside jax's tracing (a fallback is found
  while ``jax.jit`` traces the user's function); :func:`warn` gives each warning the user's own
  line as its location — the first frame outside vtc_jax, jax and the standard library — which
  ``warnings.warn``'s ``skip_file_prefixes`` does only from Python 3.12 on.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import sysconfig
import warnings
from typing import Any, Iterator

import jax

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])

# The GPU lowered for when none is attached: what jax <= 0.10 assumed (compute capability 9.0).
CPU_LOWERING_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
CPU_LOWERING_CORES = 132
"""The H100 SXM's SM count: the one figure for the abstract device, XLA's deviceless target
(``offline.H100_TARGET_CONFIG``) and the kernels' grid heuristics (``kernels.tiling.NUM_SMS``)."""

_JAX_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


class TritonBackendDeprecation(UserWarning):
    """jax deprecates the Pallas Triton backend that vtc_jax's GPU kernels lower through."""


def needs_abstract_gpu() -> bool:
    """True on jax >= 0.11, where Pallas needs an abstract GPU device to lower for CUDA without one."""
    return JAX_VERSION >= (0, 11)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def _current_abstract_device() -> object | None:
    try:
        return jax.sharding.get_abstract_mesh().abstract_device
    except AttributeError:  # jax without abstract devices: nothing to look at
        return None


def abstract_h100_mesh() -> "jax.sharding.AbstractMesh":
    """A one-device abstract mesh whose device is an H100 (jax >= 0.11 only)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    return AbstractMesh((1,), ("_vtc_cuda",), axis_types=(AxisType.Auto,),
                        abstract_device=AbstractDevice(CPU_LOWERING_DEVICE_KIND,
                                                       CPU_LOWERING_CORES, "cuda"))


@contextlib.contextmanager
def cuda_lowering() -> Iterator[None]:
    """Context for lowering (``jax.export``, ``.lower(lowering_platforms=("cuda",))``, a deviceless
    compile) for CUDA on any machine; see the module docstring. Says the deprecation notice once."""
    triton_backend_notice()
    if not needs_abstract_gpu() or _current_abstract_device() is not None or _has_gpu():
        yield
        return
    with jax.sharding.use_abstract_mesh(abstract_h100_mesh()):
        yield


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


def scan_counts(params: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's params.

    jax <= 0.10 has ``num_consts``/``num_carry``; jax 0.12 replaced them (and ``linear``) with
    ``ft_in``, a FlatTree packing (consts, carry, xs)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))
