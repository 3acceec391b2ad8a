"""The corpus (``tests/zoo/corpus.py``) against ``jax.jit``.

``test_corpus_matches_jit``: at "small" size, ``vtc_jax.optimize(step, backend="interpret",
donate_argnums=...)`` on fresh copies of the arguments equals ``jax.jit(step)`` — same pytree,
shapes and dtypes, float leaves by ``check_close`` (1e-5 x max |ref| for f32, 2e-2 for bf16),
integer / boolean leaves (and PRNG keys) exactly. ``VTCFallbackWarning``s are recorded (attached to
the test's output), never failures. ``test_corpus_paper_traces``: at "paper" size every entry
traces (``jax.eval_shape``) and ``vtc_jax.explain`` analyses it without raising.

An entry that fails today is an ``xfail(strict=True)`` with the exact error, listed in ``XFAIL``.
"""
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax
from tests.test_zoo import check_close
from tests.zoo.corpus import CORPUS

# name -> the exact error of an entry whose small-size equivalence fails today.
XFAIL: dict = {}
# name -> the exact error of an entry whose paper-size analysis fails today.
XFAIL_PAPER: dict = {}
# paper-size analyses slower than ~20 s (mamba_selective_scan took 21 s until the island planner
# got its budget, templates/island.MAX_VALUES: about 3 s now)
SLOW_PAPER: set = set()


def _is_key(x):
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _unkey(tree):
    return jax.tree.map(lambda v: jax.random.key_data(v) if _is_key(v) else v, tree)


def _copy(tree):
    def one(v):
        if _is_key(v):
            return jax.random.wrap_key_data(jnp.array(jax.random.key_data(v), copy=True),
                                            impl=jax.random.key_impl(v))
        return jnp.array(v, copy=True) if isinstance(v, jax.Array) else v
    return jax.tree.map(one, tree)


def _exact(out, ref, low_precision=False):
    """Integer, boolean (and key) leaves exactly; float leaves by check_close's tolerances — or,
    for a program computing in bf16/f16 (``low_precision``), every float leaf at bf16's 2e-2 of
    its largest magnitude: an f32 gradient of a bf16 model carries the bf16 rounding of the
    activations it came from (a kernel rounding one intermediate differently moves it by ~1%)."""
    out, ref = _unkey(out), _unkey(ref)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        if not jnp.issubdtype(b.dtype, jnp.inexact):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        elif low_precision:
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.max(np.abs(a - b), initial=0.0) <= 2e-2 * max(np.max(np.abs(b), initial=0.0), 1e-30)
    if not low_precision:
        check_close(out, ref)


def _low_precision(args):
    return any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4
               for x in jax.tree.leaves(args) if hasattr(x, "dtype") and not _is_key(x))


def _params(table, slow=frozenset()):
    out = []
    for name in sorted(CORPUS):
        marks = [pytest.mark.xfail(strict=True, reason=table[name])] if name in table else []
        if name in slow:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params(XFAIL))
def test_corpus_matches_jit(name, record_property):
    e = CORPUS[name]("small")
    ref = jax.jit(e.step)(*_copy(e.args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", vtc_jax.VTCFallbackWarning)
        opt = vtc_jax.optimize(e.step, backend="interpret", donate_argnums=e.donate_argnums)
        out = opt(*_copy(e.args))
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    _exact(out, ref, _low_precision(e.args))
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
    record_property("fallbacks", fallbacks)


@pytest.mark.parametrize("name", _params(XFAIL_PAPER, SLOW_PAPER))
def test_corpus_paper_traces(name, record_property):
    e = CORPUS[name]("paper")
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(e.args)), "paper args allocate"
    jax.eval_shape(e.step, *e.args)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        report = vtc_jax.explain(e.step, donate_argnums=e.donate_argnums)(*e.args)
    assert report is not None
    record_property("explain_s", round(time.perf_counter() - t, 2))
    record_property("eliminated", f"{len(report.eliminated)}/{len(report.movement)}")
