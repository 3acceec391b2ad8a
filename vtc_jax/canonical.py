"""Canonical forms applied while tracing: equations rewritten into primitives VTC already handles.

Why: ``cache.at[:, pos].set(row)`` — how JAX users write a KV-cache update — is a ``scatter`` with
one index vector, i.e. one window written at a runtime position, exactly what
``dynamic_update_slice`` does, which the rest of the pipeline eliminates (the producer writes the
row straight into the cache buffer, in place). A scatter offers no VTOG edge (``movement.RULES``:
data-dependent indices), so left alone it stays an XLA scatter, and the cache write is a kernel of
its own. The two differ only out of bounds: ``.at[].set`` (mode ``FILL_OR_DROP``, negative indices
already normalised in the jaxpr) drops an update whose window does not fit, while
``dynamic_update_slice`` clamps the start and writes. The rewrite keeps the scatter's meaning
exactly::

    start = clamp(idx, 0, dim - window)             # where dynamic_update_slice writes anyway
    fits  = all(0 <= idx <= dim - window)           # a scalar: the scatter writes at all
    out   = dynamic_update_slice(x, where(fits, upd, dynamic_slice(x, start, window)), start)

so an out-of-bounds index writes back what the window already holds (nothing changes), in-bounds
it is the plain update. The guard reads one window of ``x`` (the size of the update) before the
write, which the in-place legality check (vtog) accepts: nothing reads the old buffer after it.
Mode ``CLIP`` is ``dynamic_update_slice`` itself (both clamp the window into bounds), without the
guard; ``PROMISE_IN_BOUNDS`` leaves out-of-bounds behaviour undefined, so the guarded form is one
valid implementation of it.

A ``dynamic_update_slice`` whose update is the whole operand (a prefill writing a prompt as long as
the cache) is its update: the starts clamp to 0. Spliced in as the update itself, the producer of
the update writes the new cache directly instead of XLA copying it into the old buffer.

Only a plain ``scatter`` (a set: ``update_jaxpr`` None, no combiner) with a single index vector
(indices of shape ``(k,)``), no batching dims and the update covering the window in order is
rewritten; everything else is traced unchanged. The rewrite is a function of the equation alone
(a pure function of its params and avals), traced with ``jax.make_jaxpr`` and spliced in like a
``jit`` body by :mod:`graph`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["window_scatter", "whole_update", "rewrite"]


def window_scatter(eqn: jcore.JaxprEqn) -> tuple[tuple[int, ...], tuple[int, ...], bool] | None:
    """``(window shape, operand dims indexed in index-vector order, guarded)`` when ``eqn`` is a
    scatter that writes one window at runtime indices (a dynamic_update_slice in disguise), else
    None. ``guarded`` is False only for mode CLIP (already dynamic_update_slice's clamping)."""
    if eqn.primitive.name != "scatter" or len(eqn.invars) != 3 or len(eqn.outvars) != 1:
        return None
    p = eqn.params
    if p.get("update_jaxpr") is not None or p.get("update_consts"):
        return None
    dn = p.get("dimension_numbers")
    x, idx, upd = (v.aval for v in eqn.invars)
    if dn is None or any(not hasattr(a, "shape") for a in (x, idx, upd)):
        return None
    if tuple(getattr(dn, "operand_batching_dims", ())) or tuple(getattr(dn, "scatter_indices_batching_dims", ())):
        return None
    indexed = tuple(int(d) for d in dn.scatter_dims_to_operand_dims)
    inserted = tuple(int(d) for d in dn.inserted_window_dims)
    rank = len(x.shape)
    if (len(idx.shape) != 1 or idx.shape[0] != len(indexed) or not indexed
            or not np.issubdtype(np.dtype(idx.dtype), np.integer)
            or tuple(dn.update_window_dims) != tuple(range(len(upd.shape)))
            or len(upd.shape) + len(inserted) != rank or len(set(indexed)) != len(indexed)
            or not set(inserted) <= set(indexed) or upd.dtype != x.dtype
            or not isinstance(x.dtype, np.dtype)):   # extended dtypes (PRNG keys): left alone
        return None
    rest = iter(upd.shape)
    window = tuple(1 if d in inserted else int(next(rest)) for d in range(rank))
    if any(w > n for w, n in zip(window, x.shape)):
        return None
    mode = str(p.get("mode"))
    if "CLIP" in mode:
        guarded = False
    elif "FILL_OR_DROP" in mode or "PROMISE_IN_BOUNDS" in mode:
        guarded = True
    else:
        return None
    return window, indexed, guarded


def _as_update(x: Any, idx: Any, upd: Any, *, window: tuple[int, ...], indexed: tuple[int, ...],
               guarded: bool) -> Any:
    """The scatter's value as a (guarded) dynamic_update_slice; see the module docstring."""
    it = np.dtype(idx.dtype)
    if it.itemsize < 4:   # widen (never narrow: a 64-bit index cast to int32 could wrap in range)
        idx, it = idx.astype(jnp.int32), np.dtype(np.int32)
    raw = {d: idx[k] for k, d in enumerate(indexed)}
    # clamp in the index's own dtype, then int32 (the clamped start always fits)
    start = [lax.clamp(it.type(0), raw[d], it.type(n - w)).astype(jnp.int32) if d in raw else np.int32(0)
             for d, (n, w) in enumerate(zip(x.shape, window))]
    new = upd.reshape(window)
    if guarded:
        fits = functools.reduce(jnp.logical_and, [(raw[d] >= 0) & (raw[d] <= x.shape[d] - window[d])
                                                  for d in indexed])
        new = lax.select_n(fits, lax.dynamic_slice(x, start, window), new)   # scalar predicate
    return lax.dynamic_update_slice(x, new, start)


def whole_update(eqn: jcore.JaxprEqn) -> bool:
    """A ``dynamic_update_slice`` whose update is as large as its operand: every start clamps to
    0, so the result *is* the update (XLA's algebraic simplifier folds it the same way)."""
    if eqn.primitive.name != "dynamic_update_slice" or len(eqn.invars) < 2:
        return False
    x, u = eqn.invars[0].aval, eqn.invars[1].aval
    return (hasattr(x, "shape") and hasattr(u, "shape") and tuple(x.shape) == tuple(u.shape)
            and x.dtype == u.dtype)


def rewrite(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, list[Any]] | None:
    """``(jaxpr, consts)`` computing ``eqn``'s output with primitives VTC handles, or None."""
    if whole_update(eqn):
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        closed = jax.make_jaxpr(lambda x, u, *starts: u)(*avals)
        return closed.jaxpr, list(closed.consts)
    form = window_scatter(eqn)
    if form is None:
        return None
    window, indexed, guarded = form
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    closed = jax.make_jaxpr(lambda x, i, u: _as_update(x, i, u, window=window, indexed=indexed,
                                                       guarded=guarded))(*avals)
    return closed.jaxpr, list(closed.consts)


def fold_transposes(eqn: jcore.JaxprEqn, inner: jcore.JaxprEqn | None) -> tuple[jcore.Jaxpr, list[Any]] | None:
    """``transpose(transpose(x, p1), p2)`` as the one ``transpose(x, p1∘p2)`` (a jaxpr taking ``x``,
    the identity when the composition is), or None when ``eqn`` is not a transpose of a transpose.

    Why: ``jax.nn.dot_product_attention`` (GQA) transposes its output twice; as two ops the greedy
    can take the first one's read edge and leave the second to XLA, while one transpose is a
    single edge the attention kernel writes through. XLA's algebraic simplifier folds the same
    pair. The inner transpose stays if anything else reads it (dead-code elimination drops it
    otherwise)."""
    if eqn.primitive.name != "transpose" or inner is None or inner.primitive.name != "transpose":
        return None
    p1, p2 = tuple(inner.params["permutation"]), tuple(eqn.params["permutation"])
    perm = tuple(int(p1[j]) for j in p2)
    x = inner.invars[0].aval
    if perm == tuple(range(len(perm))):
        closed = jax.make_jaxpr(lambda a: a)(jax.ShapeDtypeStruct(x.shape, x.dtype))
    else:
        closed = jax.make_jaxpr(lambda a: lax.transpose(a, perm))(jax.ShapeDtypeStruct(x.shape, x.dtype))
    return closed.jaxpr, list(closed.consts)
