"""Persistent plans: the program ``optimize`` emits, kept on disk across processes (opt-in).

Why. Every new process pays the whole pipeline at an optimised function's first call — trace,
analysis, the guard (which may compile both programs with XLA), Pallas lowering: 26× ``jax.jit``'s
first call on the small Llama-3 example on a CPU machine (``benchmarks/firstcall.py``). The result
of all that is one program, which ``jax.export`` serialises (StableHLO, the kernels inside). So,
like jax's compilation cache, a directory given by the user (``optimize(..., plan_cache=dir)`` or
``VTC_JAX_PLAN_CACHE``) keeps it: a later process traces ``fn`` (as ``jax.jit`` does), finds the
entry, deserialises it and calls it; no analysis, no guard, no kernel building. XLA still compiles
the deserialised program — pair the plan cache with jax's own compilation cache
(``jax_compilation_cache_dir``) to skip that too.

The key is what determines the emitted program: the traced jaxpr of ``fn`` at these input avals
(printed: shapes, dtypes, every primitive's params) and the bytes of its constants, the donated
inputs, ``optimize``'s options, the platform and device kind, the versions of Python, jax and
jaxlib, and a digest of vtc_jax's own source (any change to it, not only a release). (A callback or custom rule is printed by name: two different Python callables
of one name in one program are the one blind spot; derivatives are not cached — they are ``fn``'s
own, computed live, ``autodiff``.) An entry holds the serialised program, or the guard's verdict
that plain ``jax.jit`` wins, and the fallback messages the build said (said again on a hit). An
entry that cannot be read is a miss; entries are written whole (a temporary file renamed).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jaxlib
import numpy as np

from .offline import TRITON_CALL_TARGET

__all__ = ["Entry", "key", "load", "store", "ENV"]

ENV = "VTC_JAX_PLAN_CACHE"
_FORMAT = 1


@dataclass(frozen=True)
class Entry:
    """A cached plan: ``program`` (a ``jax.export.Exported``; None: plain ``jax.jit`` is the
    guard's choice) and the fallback messages its build said."""
    program: Any
    messages: tuple[str, ...]


def key(closed: Any, options: Mapping[str, Any], donated: Any) -> str:
    """The hex digest naming the plan of ``closed`` (``fn``'s jaxpr at these avals) under these
    options (:mod:`vtc_jax.plancache` docstring says what goes in and why)."""
    h = hashlib.sha256()
    for part in (f"format {_FORMAT}", str(closed.jaxpr), repr(sorted(options.items())), repr(donated),
                 platform.python_version(), jax.__version__, jaxlib.__version__, source_digest(), jax.default_backend(),
                 jax.devices()[0].device_kind):
        h.update(part.encode())
        h.update(b"\0")
    for c in closed.consts:
        arr = np.asarray(c)
        h.update(f"{arr.dtype}{arr.shape}".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of vtc_jax's own source files: a plan is vtc_jax's output, so any change to the
    package (not only a version bump) makes a new key."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _path(directory: str | os.PathLike, k: str) -> Path:
    return Path(directory) / f"vtc-plan-{k}.bin"


def load(directory: str | os.PathLike, k: str) -> Entry | None:
    """The entry under ``k``, or None (absent, unreadable, or written by another format). The
    file is a JSON header line and the serialised program's bytes (no pickle: a cache directory
    is data, never code)."""
    try:
        header, _, blob = _path(directory, k).read_bytes().partition(b"\n")
        meta = json.loads(header)
        if meta.get("format") != _FORMAT:
            return None
        program = jax.export.deserialize(bytearray(blob)) if meta["program"] else None
        return Entry(program, tuple(meta["messages"]))
    except Exception:  # noqa: BLE001 - a cache entry that cannot be read is a miss, never an error
        return None


def store(directory: str | os.PathLike, k: str, program: Any, avals: Sequence[Any], messages: Sequence[str]) -> bool:
    """Serialise ``program`` (flat inputs -> flat outputs; None: plain jit) at ``avals`` under
    ``k``, for the platform it runs on (Triton kernels' custom calls allowed). False where it
    cannot be exported or written: the plan is then simply not cached."""
    try:
        blob = b""
        if program is not None:
            exported = jax.export.export(
                jax.jit(program), disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL_TARGET)]
            )(*avals)
            blob = bytes(exported.serialize())
        header = json.dumps({"format": _FORMAT, "program": program is not None, "messages": list(messages)})
        target = _path(directory, k)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".vtc-plan-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(header.encode() + b"\n" + blob)
        os.replace(tmp, target)
        return True
    except Exception:  # noqa: BLE001 - an uncacheable plan still runs
        return False
