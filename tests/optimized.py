"""What the kernel-capability tests share: the kernels themselves (the guard off), compared with
``jax.jit`` at a tolerance relative to the largest reference value, and the emitted program's
equations."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterator

import jax.numpy as jnp
import numpy as np

import vtc_jax

# f32 at 1e-5 of the largest value; bf16 at 2e-2 (its own rounding, and a folded norm's)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def optimize_kernels(fn: Callable, **kw: Any) -> Any:
    """``vtc_jax.optimize(fn, guard=None, ...)``: the kernels themselves (at test sizes XLA may price
    lower, and the guard would keep plain jit), fallback warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        return vtc_jax.optimize(fn, **{"guard": None, **kw})


def assert_close(out: Any, ref: Any, tol: float) -> None:
    """Within ``tol`` of the largest reference value (at least 1)."""
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(o, r, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(r)))))


def eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the calls in it, not those inside Pallas kernels."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name == "pallas_call":
            continue
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from eqns(inner)
