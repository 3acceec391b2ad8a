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

``add_any`` — how autodiff sums cotangents, in every ``jax.grad`` program — is ``add`` on two
same-typed numeric arrays and is traced as one (``is_plain_add_any``); unknown, it stayed opaque and
kept the tensors around it physical. ``tile`` is traced as the broadcast + reshape ``jnp.tile`` used
to emit (``_tile_as_broadcast``), which the movement rules eliminate.

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

from .indexmap import all_of
from .interpret import interpret
from .primitives import TABLE

__all__ = ["window_scatter", "whole_update", "speculable_cond", "rewrite", "channels_last", "fold_transposes",
           "split_complex"]


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
        fits = all_of([(raw[d] >= 0) & (raw[d] <= x.shape[d] - window[d]) for d in indexed])
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


# what a cond branch may hold to be computed unconditionally (``PrimInfo.speculable``): no
# effects, no work beyond the elementwise kind (a reduction or a dot computed for nothing would
# cost), no in-place update (a cache written in one branch only must stay a cond: program.py
# updates it in place)
_SPECULABLE = frozenset(n for n, r in TABLE.items() if r.speculable)


def speculable_cond(eqn: jcore.JaxprEqn) -> bool:
    """A ``cond`` (or ``switch``) whose branches only compute elementwise values from its operands
    — Gemma's sliding window applied as ``lax.cond(pos >= window, mask, identity, scores)``. Both
    branches then run and ``select_n`` picks one by the (clamped) index: the same values, and the
    mask is one more elementwise step that the attention template fits (a cond in the middle of
    the scores is otherwise opaque and splits the attention into its parts). XLA does the same
    when it converts a small conditional into a select."""
    if eqn.primitive.name != "cond" or eqn.effects:
        return False
    if any(not hasattr(v.aval, "shape") or not isinstance(v.aval.dtype, np.dtype) for v in eqn.outvars):
        return False

    def ok(jaxpr: Any) -> bool:
        for e in jaxpr.eqns:
            if e.effects:
                return False
            inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))   # jit / closed_call bodies
            if inner is not None:
                if not ok(getattr(inner, "jaxpr", inner)):
                    return False
                continue
            if e.primitive.name not in _SPECULABLE:
                return False
        return True

    return all(ok(br.jaxpr) for br in eqn.params["branches"])


def _as_select(index: Any, *operands: Any, branches: tuple[Any, ...]) -> list[Any]:
    """Every branch computed, the result chosen per output by the index (clamped as cond does)."""
    outs = [jcore.jaxpr_as_fun(b)(*operands) for b in branches]
    n = len(branches)
    which = lax.clamp(np.int32(0), index.astype(jnp.int32), np.int32(n - 1))
    if n == 2:
        which = which != 0   # select_n takes a bool for two cases
    return [lax.select_n(which, *[o[i] for o in outs]) for i in range(len(outs[0]))]


def _tile_as_broadcast(x: Any, *, reps: tuple[int, ...]) -> Any:
    """``tile`` as the broadcast + reshape the movement rules know: ``(r0, s0, r1, s1, …)`` then
    merged pairwise (each rep is an outer dim of its merged axis, as tiling repeats whole copies)."""
    reps = (1,) * (x.ndim - len(reps)) + reps
    x = x.reshape((1,) * (len(reps) - x.ndim) + x.shape)
    inter = tuple(d for r, n in zip(reps, x.shape) for d in (r, n))
    y = lax.broadcast_in_dim(x, inter, tuple(range(1, 2 * x.ndim, 2)))
    return y.reshape(tuple(r * n for r, n in zip(reps, x.shape)))


def is_plain_add_any(eqn: jcore.JaxprEqn) -> bool:
    """``add_any`` (autodiff's sum of cotangents) of two same-typed numeric arrays: an ``add``.

    Every ``jax.grad`` program is full of them; kept opaque, each pinned its neighbours physical."""
    if eqn.primitive.name != "add_any" or len(eqn.invars) != 2:
        return False
    a, b = (v.aval for v in eqn.invars)
    # jnp: numpy's issubdtype does not count bfloat16 as a number
    ok = getattr(a, "dtype", None) is not None and jnp.issubdtype(a.dtype, jnp.number)
    return bool(ok) and a.shape == b.shape and a.dtype == b.dtype


def _traced(fn: Any, eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, list[Any]]:
    """``fn`` traced on ``eqn``'s operand types: the ``(jaxpr, consts)`` spliced in its place."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    closed = jax.make_jaxpr(fn)(*avals)
    return closed.jaxpr, list(closed.consts)


def rewrite(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, list[Any]] | None:
    """``(jaxpr, consts)`` computing ``eqn``'s output with primitives VTC handles, or None."""
    if speculable_cond(eqn):
        return _traced(functools.partial(_as_select, branches=tuple(eqn.params["branches"])), eqn)
    if whole_update(eqn):
        return _traced(lambda x, u, *starts: u, eqn)
    if eqn.primitive.name == "tile" and len(eqn.invars) == 1:
        return _traced(functools.partial(_tile_as_broadcast, reps=tuple(int(r) for r in eqn.params["reps"])), eqn)
    if is_plain_add_any(eqn):
        return _traced(lax.add, eqn)
    form = window_scatter(eqn)
    if form is None:
        return None
    window, indexed, guarded = form
    return _traced(lambda x, i, u: _as_update(x, i, u, window=window, indexed=indexed, guarded=guarded), eqn)


def channels_last(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, list[Any]] | None:
    """``transpose(conv_NHWC(transpose(x)))`` for a convolution whose input or output is not
    channels-last (``NCHW``), as ``(jaxpr, consts)``; None when it already is.

    Why: XLA runs a GPU convolution in cuDNN's channels-last layout whatever the program says: it
    assigns an NCHW conv's buffers the NHWC layout and transposes wherever a consumer needs the
    logical row-major one. Its own fusions read the NHWC buffer through the layout; a Pallas
    kernel cannot (its operands are row-major), so every conv output a kernel reads costs a
    whole-tensor layout copy no VTC decision saw (EfficientViT's ``wrapped_transpose``s). With
    the layout change written out as movement ops the strategy treats it like any other: the
    kernel reads the NHWC buffer through the transpose's index map, and a conv feeding a conv
    folds its pair of transposes away (``fold_transposes``). Only convs XLA runs next to kernels
    are rewritten (``api.analyze``'s second pass): around a conv VTC runs itself the transposes
    would only split it from its epilogue. The filter keeps its layout (XLA picks one for it)."""
    if eqn.primitive.name != "conv_general_dilated":
        return None
    dn = eqn.params.get("dimension_numbers")
    lhs, out = tuple(getattr(dn, "lhs_spec", ()) or ()), tuple(getattr(dn, "out_spec", ()) or ())
    rank = len(lhs)
    if rank < 3 or len(out) != rank or not all(hasattr(v.aval, "shape") for v in eqn.invars):
        return None
    cl = (0, rank - 1, *range(1, rank - 1))     # ConvDimensionNumbers of (N, spatial.., C)
    if lhs == cl and out == cl:
        return None
    in_perm = tuple(int(d) for d in (lhs[0], *lhs[2:], lhs[1]))   # (N, spatial.., C) of the input
    out_perm = [0] * rank                                          # the user's output of (N, .., C)
    out_perm[out[0]], out_perm[out[1]] = 0, rank - 1
    for i, d in enumerate(out[2:]):
        out_perm[d] = 1 + i
    params = {**eqn.params, "dimension_numbers": lax.ConvDimensionNumbers(
        lhs_spec=cl, rhs_spec=tuple(int(d) for d in dn.rhs_spec), out_spec=cl)}

    def conv(x: Any, w: Any) -> Any:
        return lax.transpose(eqn.primitive.bind(lax.transpose(x, in_perm), w, **params), tuple(out_perm))

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    closed = jax.make_jaxpr(conv)(*avals)
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


# ---- complex arithmetic as pairs of real tensors -------------------------------------------------

_COMPONENT = {np.dtype(np.complex64): np.dtype(np.float32), np.dtype(np.complex128): np.dtype(np.float64)}
# movement and rounding: the same op on both components (``PrimInfo.componentwise``)
_PAIRWISE = frozenset(n for n, r in TABLE.items() if r.componentwise)
# calls whose body may be evaluated on pairs in their place (``PrimInfo.plain_call``)
_PLAIN_CALLS = frozenset(n for n, r in TABLE.items() if r.plain_call)


class _Pair:
    """A complex value held as its real and imaginary parts (two real tensors)."""
    __slots__ = ("re", "im")

    def __init__(self, re: Any, im: Any) -> None:
        self.re, self.im = re, im


def _is_complex(dtype: Any) -> bool:
    try:
        return np.dtype(dtype) in _COMPONENT
    except TypeError:
        return False


def _has_complex(jaxpr: Any) -> bool:
    for e in jaxpr.eqns:
        if any(_is_complex(getattr(v.aval, "dtype", None)) for v in (*e.invars, *e.outvars)):
            return True
        inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        if inner is not None and _has_complex(getattr(inner, "jaxpr", inner)):
            return True
    return False


def _pair(x: Any) -> _Pair:
    if isinstance(x, _Pair):
        return x
    if _is_complex(jnp.result_type(x)):
        return _Pair(lax.real(jnp.asarray(x)), lax.imag(jnp.asarray(x)))
    return _Pair(x, jnp.zeros_like(x))


def _whole(x: Any) -> Any:
    return lax.complex(x.re, x.im) if isinstance(x, _Pair) else x


def _complex_rule(eqn: Any, ins: list[Any]) -> list[Any] | None:
    """The eqn on complex values as pairs, or None (then it runs on whole complex values)."""
    name = eqn.primitive.name
    out_dt = eqn.outvars[0].aval.dtype if eqn.outvars else None
    if name == "complex":
        return [_Pair(*ins)]
    if name in ("real", "imag"):
        z = _pair(ins[0])
        return [z.re if name == "real" else z.im]
    if name in _PAIRWISE:
        z, rest = _pair(ins[0]), ins[1:]
        return [_Pair(eqn.primitive.bind(z.re, *rest, **eqn.params), eqn.primitive.bind(z.im, *rest, **eqn.params))]
    if name == "select_n":
        cases = [_pair(c) for c in ins[1:]]
        return [_Pair(lax.select_n(ins[0], *[c.re for c in cases]), lax.select_n(ins[0], *[c.im for c in cases]))]
    if name == "concatenate":
        zs = [_pair(z) for z in ins]
        d = eqn.params["dimension"]
        return [_Pair(lax.concatenate([z.re for z in zs], d), lax.concatenate([z.im for z in zs], d))]
    if name == "convert_element_type":
        new = np.dtype(eqn.params["new_dtype"])
        if not _is_complex(new):
            return None            # complex -> real: jax's own semantics (drops the imaginary part)
        z, comp = _pair(ins[0]), _COMPONENT[new]
        return [_Pair(lax.convert_element_type(z.re, comp), lax.convert_element_type(z.im, comp))]
    if not _is_complex(out_dt):
        return None
    if name == "neg":
        z = _pair(ins[0])
        return [_Pair(-z.re, -z.im)]
    if name == "conj":
        z = _pair(ins[0])
        return [_Pair(z.re, -z.im)]
    if name in ("add", "sub"):
        a, b = _pair(ins[0]), _pair(ins[1])
        f = lax.add if name == "add" else lax.sub
        return [_Pair(f(a.re, b.re), f(a.im, b.im))]
    if name == "mul":
        a, b = _pair(ins[0]), _pair(ins[1])
        return [_Pair(a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re)]
    if name == "exp":
        z = _pair(ins[0])
        e = lax.exp(z.re)
        return [_Pair(e * lax.cos(z.im), e * lax.sin(z.im))]
    return None


def _pairs_rule(e: Any, ins: list[Any]) -> list[Any] | None:
    """One equation of :func:`split_complex`: call bodies holding complex values are evaluated
    on pairs too, complex ops by :func:`_complex_rule`, anything else on whole values."""
    inner = e.params.get("jaxpr", e.params.get("call_jaxpr")) if e.primitive.name in _PLAIN_CALLS else None
    outs = None
    if inner is not None and _has_complex(getattr(inner, "jaxpr", inner)):
        outs = interpret(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), ins, _pairs_rule)
    elif any(isinstance(x, _Pair) for x in ins) or any(_is_complex(v.aval.dtype) for v in e.outvars
                                                       if hasattr(v.aval, "dtype")):
        outs = _complex_rule(e, ins)
    if outs is None and any(isinstance(x, _Pair) for x in ins):
        body = _call_body(e)
        if body is not None:   # custom_jvp / custom_vjp / remat on pairs: their body, as graph inlines it
            return interpret(getattr(body, "jaxpr", body), getattr(body, "consts", ()), ins, _pairs_rule)
        res = e.primitive.bind(*[_whole(x) for x in ins], **e.params)
        outs = list(res) if e.primitive.multiple_results else [res]
    return outs


def _call_body(e: Any) -> Any:
    """The body of a call-like equation (its row's ``call_body`` params, in order) whose inputs and
    outputs are the equation's, else None (re-binding ``custom_jvp_call`` from its params alone
    raises: its ``subfuns`` are not among them)."""
    row = TABLE.get(e.primitive.name)
    for name in row.call_body if row is not None else ():
        body = e.params.get(name)
        jaxpr = getattr(body, "jaxpr", body)
        if isinstance(jaxpr, jcore.Jaxpr) and len(jaxpr.invars) == len(e.invars) and len(jaxpr.outvars) == len(e.outvars):
            return body
    return None


def split_complex(closed: Any) -> Any | None:
    """``closed`` with its complex arithmetic done on pairs of real tensors (None: nothing complex).

    Why: complex numbers have no Triton type, so a complex RoPE (``lax.complex(x[..., 0], x[..., 1])
    * exp(1j·θ)`` then ``.real``/``.imag``: how minimal Llama ports write it) would keep every
    cluster it touches in XLA, with the movement around it. As pairs, the same rotation is real
    multiplies and adds joined by slices and a stack — a pointwise island VTC fuses into one
    kernel (``cluster.fuse_islands``) that also writes the rotated K row into its cache. Complex
    ``add``/``sub``/``neg``/``conj``/``mul``/``exp``, casts, movement and selects are split (the
    textbook formulas XLA expands them to); anything else — a complex dot, division, reduction,
    a complex input or output — gets its whole complex value back (``lax.complex``) and runs as
    written."""
    if not _has_complex(closed.jaxpr):
        return None
    avals = [v.aval for v in closed.jaxpr.invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    def run(*args: Any) -> Any:
        return [_whole(x) for x in interpret(closed.jaxpr, closed.consts, args, _pairs_rule)]

    return jax.make_jaxpr(run)(*specs)
