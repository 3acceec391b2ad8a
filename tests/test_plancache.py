"""The persistent plan cache (``optimize(..., plan_cache=dir)``, ``vtc_jax/plancache.py``).

A second ``optimize`` object (or a second process) on the same directory answers its first call
from the cache — no analysis (``opt.last`` stays None) — with jit's numbers (f32: rtol = atol =
1e-5), fn's derivatives, the fallback messages said again, and the guard's plain-jit verdict kept.
An unreadable entry is a miss; other options are other keys.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax
from vtc_jax import plancache

ROOT = Path(__file__).resolve().parents[1]
RTOL = ATOL = 1e-5


def layer(x, w):
    """matmul -> reshape -> transpose -> tanh: one kernel writing through the transpose."""
    y = (x @ w).reshape(x.shape[0], 4, -1).transpose(1, 0, 2)
    return jnp.tanh(y) * 2.0


def scattered(x, i):
    """A scatter-add (opaque: one fallback message) next to movement."""
    return jnp.transpose(x).at[i].add(1.0) * 2.0


def _args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((8, 32)), jnp.float32),
            jnp.asarray(rng.standard_normal((32, 32)) / 6, jnp.float32))


def _files(d):
    return sorted(p.name for p in Path(d).glob("vtc-plan-*.bin"))


def test_a_second_optimize_loads_the_plan(tmp_path):
    x, w = _args()
    first = vtc_jax.optimize(layer, backend="interpret", guard=None, plan_cache=tmp_path)
    ref = jax.jit(layer)(x, w)
    np.testing.assert_allclose(first(x, w), ref, rtol=RTOL, atol=ATOL)
    assert first.last is not None and first.last[1].kernels
    assert len(_files(tmp_path)) == 1
    second = vtc_jax.optimize(layer, backend="interpret", guard=None, plan_cache=tmp_path)
    out = second(x, w)
    assert second.last is None          # answered from the cache: no analysis in this object
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    assert "call_exported" in str(jax.make_jaxpr(second)(x, w))   # the deserialised program runs
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)   # noqa: E731
    for g, r in zip(jax.grad(loss(second), argnums=(0, 1))(x, w), jax.grad(loss(layer), argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    assert len(_files(tmp_path)) == 1


def test_fallback_messages_are_said_again_from_the_cache(tmp_path):
    x = jnp.arange(12.0).reshape(3, 4)
    i = jnp.array([0, 2])
    with pytest.warns(vtc_jax.VTCFallbackWarning, match="scatter-add"):
        vtc_jax.optimize(scattered, backend="interpret", plan_cache=tmp_path)(x, i)
    again = vtc_jax.optimize(scattered, backend="interpret", plan_cache=tmp_path)
    with pytest.warns(vtc_jax.VTCFallbackWarning, match="scatter-add"):
        out = again(x, i)
    assert again.last is None
    np.testing.assert_allclose(out, jax.jit(scattered)(x, i), rtol=RTOL, atol=ATOL)


def test_other_options_other_keys_and_a_bad_entry_is_a_miss(tmp_path):
    x, w = _args()
    vtc_jax.optimize(layer, backend="interpret", guard=None, plan_cache=tmp_path)(x, w)
    vtc_jax.optimize(layer, backend="interpret", guard="model", plan_cache=tmp_path)(x, w)
    vtc_jax.optimize(layer, backend="interpret", guard=None, plan_cache=tmp_path)(x[:4], w)   # other shapes
    files = _files(tmp_path)
    assert len(files) == 3, files
    for f in files:
        (tmp_path / f).write_bytes(b"{not json\n")
    opt = vtc_jax.optimize(layer, backend="interpret", guard=None, plan_cache=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        np.testing.assert_allclose(opt(x, w), jax.jit(layer)(x, w), rtol=RTOL, atol=ATOL)
    assert opt.last is not None          # a miss: planned again, and the entry rewritten
    k = plancache.key(jax.make_jaxpr(lambda *xs: jax.tree.leaves(layer(*xs)))(x, w),
                      dict(backend="interpret", strict=False, guard=None, objective="latency", gpu=None),
                      ((), ()))
    assert plancache.load(tmp_path, k) is not None


def test_a_second_process_loads_the_plan(tmp_path):
    """The point of it: a new process's first call skips the analysis."""
    code = (
        "import sys, jax, numpy as np, vtc_jax\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from test_plancache import layer, _args\n"
        "x, w = _args()\n"
        f"opt = vtc_jax.optimize(layer, backend='interpret', guard=None, plan_cache={str(tmp_path)!r})\n"
        "np.testing.assert_allclose(opt(x, w), jax.jit(layer)(x, w), rtol=1e-5, atol=1e-5)\n"
        "print('analysed' if opt.last is not None else 'loaded')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    said = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        said.append(proc.stdout.strip().splitlines()[-1])
    assert said == ["analysed", "loaded"], said


def test_no_cache_unless_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(plancache.ENV, raising=False)
    assert vtc_jax.optimize(layer, backend="interpret").plan_cache is None
    monkeypatch.setenv(plancache.ENV, str(tmp_path))
    assert vtc_jax.optimize(layer, backend="interpret").plan_cache == str(tmp_path)
    assert vtc_jax.optimize(layer, backend="interpret", cost_model=object()).plan_cache is None   # an object no key can name
