"""The paper's five workloads (``examples/``): VTC computes what ``jax.jit`` computes, and every
paper-size model analyses quickly with its data-movement ops really in the traced graph.

Equivalence runs the Pallas kernels in interpret mode at the examples' "small" sizes (tiny, f32);
the paper-size checks only trace and analyse (``explain`` on ShapeDtypeStructs, nothing allocated).
"""
import importlib
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

EXAMPLES = ("llama3_decode", "gemma2_layer", "efficientvit_attention", "yolo11_c3k2", "shufflenet_unit")
RTOL = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2}

# The movement primitives each model is written to contain (a model author's reshape/split/concat...).
MOVEMENT = {
    "llama3_decode": {"split", "reshape", "dynamic_update_slice", "broadcast_in_dim", "transpose", "concatenate"},
    "gemma2_layer": {"split", "reshape", "dynamic_update_slice", "broadcast_in_dim", "transpose", "concatenate"},
    "efficientvit_attention": {"concatenate", "reshape", "split", "transpose", "pad"},   # q/k/v slices: one split
    "yolo11_c3k2": {"split", "concatenate"},
    "shufflenet_unit": {"split", "concatenate", "reshape", "transpose"},
}

def _module(name):
    return importlib.import_module(name)


def _cases(batches):
    return [pytest.param(name, b, id=f"{name}-b{b}") for name in EXAMPLES for b in batches]


def _max_rel(out, ref):
    errs = []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(b))
        errs.append(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return max(errs)


def _check_equal(fn, args):
    ref = jax.jit(fn)(*args)
    out = vtc_jax.optimize(fn, backend="interpret")(*args)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    tol = max(RTOL[jnp.dtype(leaf.dtype)] for leaf in jax.tree.leaves(ref))
    err = _max_rel(out, ref)
    assert err <= tol, f"max relative error {err:.3g} > {tol}"


@pytest.mark.filterwarnings("ignore::vtc_jax.VTCFallbackWarning")
@pytest.mark.parametrize("name,batch", _cases((1, 2)))
def test_small_equals_jit(name, batch):
    mod = _module(name)
    _check_equal(mod.step, mod.example_args("small", batch=batch))


@pytest.mark.filterwarnings("ignore::vtc_jax.VTCFallbackWarning")
def test_gemma_global_layer_equals_jit():
    """``step`` is Gemma-2's local (sliding-window) layer; the global layer drops the window mask."""
    mod = _module("gemma2_layer")
    _check_equal(mod.step_global, mod.example_args("small", batch=2))


def test_small_examples_are_small_f32():
    for name in EXAMPLES:
        for leaf in jax.tree.leaves(_module(name).example_args("small", batch=2)):
            assert leaf.dtype in (jnp.float32, jnp.int32) and leaf.size <= 1 << 16, (name, leaf.shape)


@pytest.mark.parametrize("name,batch", [pytest.param(n, b, id=f"{n}-b{b}") for n in EXAMPLES for b in (1, 16)])
def test_paper_size_explain(name, batch):
    mod = _module(name)
    args = mod.example_args("paper", batch=batch)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(args))
    t0 = time.process_time()  # CPU time: wall time on a shared box measures the neighbours
    report = vtc_jax.explain(mod.step)(*args)
    seconds = time.process_time() - t0
    assert len(report.movement) >= 1
    assert MOVEMENT[name] <= {m.primitive for m in report.movement}
    assert seconds < 10, f"explain took {seconds:.1f} s"


def test_gemma2_cache_of_2_pow_31_elements_keeps_its_attention_kernel():
    """Gemma-2's decode layer serving batch 64 at 16,384 tokens: each bf16 cache (64, 16384, 8, 256)
    has exactly 2^31 elements (4 GiB). Pallas addresses it with i32 element offsets, which reach
    2^31 - 1: the attention kernel builds (it was refused as "wrapping 32-bit offsets", and the
    whole layer fell back to jit where the kernel reads the keys up to ``pos`` instead of XLA's
    copies of the caches). Traced and its kernels built on ShapeDtypeStructs: nothing allocated."""
    mod = _module("gemma2_layer")
    args = list(mod.example_args("paper", batch=64))
    for i in (2, 3):
        s = args[i]
        args[i] = jax.ShapeDtypeStruct((64, 16384) + tuple(s.shape[2:]), s.dtype)
        assert np.prod(args[i].shape) == 2 ** 31
    report = vtc_jax.explain(mod.step, donate_argnums=(2, 3), guard="model")(*args)
    reasons = [r for _, kind, r in report.templates if kind == "attention"]
    assert reasons == ["kernel"], reasons
    assert not any("32-bit" in r for _, _, r in report.templates)
