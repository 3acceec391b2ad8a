"""Snippets in other codebases' styles (``tests/zoo/styles.py``) against ``jax.jit``.

Each case: ``vtc_jax.optimize(step, backend="interpret")`` equals ``jax.jit(step)`` (same pytree,
shapes and dtypes; max |diff| <= 1e-5 x max |ref| for f32, 2e-2 for bf16; integer and boolean
outputs exactly), the fallback warnings are exactly the expected ones (what vtc_jax leaves to XLA
in that case, and why), attention reaches the kernel named in ``ATTENTION`` (and no other case
has one), and the optimised program cross-lowers for CUDA (every Pallas kernel
through Triton's lowering).
"""
import warnings

import jax
import numpy as np
import pytest

import vtc_jax
from vtc_jax.program import NO_KERNEL
from vtc_jax.templates import Match
from tests.test_zoo import check_close
from tests.zoo.styles import CASES

# case -> substrings of the fallback warnings it must give (one per warning); absent: none. (The
# causal masks XLA builds from iotas, ``tril(ones)``, ``triu`` of ``-inf``, keep only the fill of
# their ``jnp.ones``/``jnp.full`` beside them, which moves no data: no warning, report.py.)
FALLBACKS = {
    "moe_topk_router": ("'top_k'",),
    "int_and_bool_outputs": ("'cumsum'",),
}

# case -> the attention kernel its attention must run in (the template reached from that style)
ATTENTION = {
    "flax_linen_mha_decode": "decode",
    "flax_nnx_mha": "prefill",
    "equinox_mha_vmapped": "decode",      # 8 query rows, no mask: one decode tile per head
    "sdpa_gqa_causal_bf16": "prefill",
    "rotate_half_rope_kvcache_at_set": "decode",
    "continuous_batching_decode": "decode",
    "rolling_buffer_mistral": "decode",
    "int8_kv_cache_dequant": "decode",
    "whisper_cross_attention": "decode",
    "mqa_single_kv_head": "decode",
    "vmap_over_heads_attention": "prefill",
    "t5_relative_bias": "decode",           # the table's gather read blockwise as a bias operand
    "mla_absorbed": "decode",               # the rope scores a bias operand, scaled with the rest
    "gpt_oss_sinks_decode": "decode",       # the sink logit an operand, folded in once per row
    "gpt_oss_sinks_prefill_vmapped": "prefill",
}


def _exact(out, ref):
    """Integer and boolean leaves exactly; float leaves by check_close's tolerances."""
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        if not np.issubdtype(np.asarray(b).dtype, np.inexact) and np.asarray(b).dtype.name != "bfloat16":
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check_close(out, ref)


def _case(name):
    try:
        return CASES[name]()
    except ImportError as e:   # flax / equinox: in the test extra, absent on a bare GPU machine
        pytest.skip(f"{name} needs {e.name}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_style_matches_jit(name):
    step, args = _case(name)
    ref = jax.jit(step)(*args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", vtc_jax.VTCFallbackWarning)
        opt = vtc_jax.optimize(step, backend="interpret")
        out = opt(*args)
    kernels = [m.detail.kernel for m in opt.last[0].matches.values() if isinstance(m, Match) and m.kind == "attention"]
    assert kernels == ([ATTENTION[name]] if name in ATTENTION else []), kernels
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    _exact(out, ref)
    got = [str(w.message) for w in caught if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
    # where the guard runs the whole function as plain jit, nothing is left to XLA beside a kernel:
    # no fallback to warn about (the guard's decision is in explain, never a warning) — unless no
    # kernel was ever planned: then why is still said, as without the guard
    note = opt.last[0].guard[-1] if opt.last[0].guard else ""
    plain = note.startswith("plain jax.jit") and not note.endswith(NO_KERNEL)
    want = () if plain else FALLBACKS.get(name, ())
    assert len(got) == len(want) and all(any(s in g for g in got) for s in want), got


@pytest.mark.parametrize("name", sorted(CASES))
def test_style_cross_lowers_for_cuda(name):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="cross-lowering for CUDA needs jax-cuda12-plugin")
    from vtc_jax.testing import cross_lower
    step, args = _case(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        module = cross_lower(vtc_jax.optimize(step, backend="triton", guard=None), *args)
    if name != "int_and_bool_outputs":   # argmax, a reshape and a cumsum: nothing for a kernel
        assert module.triton_kernels, "no Pallas kernel in the CUDA module"
