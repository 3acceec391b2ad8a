"""Rung 3 on whole programs with control flow: XLA's deviceless compile for an H100 of a scanned
decode step (``vtc_jax.offline.compile_program``) holds the Pallas kernels inside the loop, and
no copy of the stacked cache."""
import math
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="deviceless CUDA compile needs jax-cuda12-plugin")

import vtc_jax  # noqa: E402
from vtc_jax.offline import compile_program  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def test_scanned_llama_compiles_with_kernels_in_the_loop_and_no_cache_copy():
    import llama3_scan as LS
    args = LS.example_args("small", batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        prog = compile_program(vtc_jax.optimize(LS.step, backend="triton", donate_argnums=(2, 3)), *args,
                               kernels=False, donate_argnums=(2, 3))
    # the loop body's kernels are in the HLO (compile_program's launch list does not walk while
    # bodies' thunks yet: counted from the optimised HLO instead)
    assert prog.hlo.count('custom_call_target="__gpu$xla.gpu.triton"') >= 5
    assert "while(" in prog.hlo
    cache_bytes = args[2].size * args[2].dtype.itemsize
    copies = [x for x in prog.launches if x.kind.lower().startswith("copy") and x.bytes >= cache_bytes]
    assert copies == [], copies


@pytest.mark.parametrize("name", ["rotate_half_rope_kvcache_at_set", "mqa_single_kv_head", "int8_kv_cache_dequant",
                                  "continuous_batching_decode"])
def test_finite_mask_and_per_sequence_decode_compile_for_sm90(name):
    """Rung 3 for attention in other codebases' styles (``tests/zoo/styles.py``): the decode kernels
    behind ``finfo.min`` / ``-1e30`` masks (with their empty-row pass) and per-sequence positions
    compile in XLA's deviceless H100 compile — every Triton kernel to a cubin, no spills. The
    empty-row pass once emitted IR XLA's Triton rejected ("Failed to parse Triton module")."""
    from tests.zoo.styles import CASES
    step, args = CASES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        opt = vtc_jax.optimize(step, backend="triton", guard=None)
        prog = compile_program(opt, *args)
    assert any(x.name.startswith("vtc_decode_attention") for x in prog.triton_launches), \
        [x.name for x in prog.triton_launches]
    if prog.kernel_error is None:   # ptxas found: every kernel assembled, none spills
        attn = [k for k in prog.kernels if k.name.startswith("vtc_decode_attention")]
        assert attn and all(k.cubin_ok and not k.spill_store_bytes for k in attn), attn


def test_efficientvit_layout_copies_only_at_the_block_edges():
    """EfficientViT's LiteMLA at paper size, batch 1, compiled deviceless for an H100 with the
    default guard: XLA runs its convolutions channels-last (cuDNN), and a Pallas kernel's operands
    are row-major, so every NCHW conv beside a kernel used to cost a whole-tensor layout copy. With
    the convs that read what a kernel reads (the depthwise conv on the qkv conv's output) or what a
    kernel writes through a reshape (the projection) traced channels-last, and the projection's
    conv kept cuDNN's (a free reshape no longer makes it a Pallas conv ~25x slower), only the
    block's own NCHW input and output are transposed — as jit does — and VTC moves fewer bytes in
    fewer launches than jit (compiled: 9 launches and 166 MiB against 12 and 216 MiB)."""
    import jax
    import efficientvit_attention as eff
    args = tuple(eff.example_args("paper", batch=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = vtc_jax.optimize(eff.step, backend="triton")
        vtc = compile_program(opt, *args, kernels=False)
        jit = compile_program(jax.jit(eff.step), *args, kernels=False)
    block = math.prod(args[-1].shape) * args[-1].dtype.itemsize      # the (1, 256, 64, 64) input / output
    copies = [x for x in vtc.launches if "transpose" in x.name]
    assert len(copies) == 2 and all(x.bytes == 2 * block for x in copies), [(x.name, x.bytes) for x in copies]
    assert vtc.triton_launches and not any(x.name.startswith("vtc_conv") for x in vtc.triton_launches)
    assert len(vtc.launches) < len(jit.launches) and vtc.bytes < 0.8 * jit.bytes
    # the plan itself, before the guard, keeps cuDNN's projection (``CostModel.prefers_library``):
    # the heads' free reshape of a kernel's result no longer makes it a Pallas conv
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = compile_program(vtc_jax.optimize(eff.step, backend="triton", guard=None), *args, kernels=False)
    assert not any(x.name.startswith("vtc_conv") for x in raw.triton_launches), [x.name for x in raw.triton_launches]
