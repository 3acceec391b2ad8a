"""Offline rung: compile for an H100 (sm_90) with XLA, no GPU — public jax APIs on every version."""
import re

import jax
import jax.numpy as jnp
import pytest

from test_testing import add_one
from vtc_jax.offline import (SMEM_LIMIT, compile_lowered, compile_many, compile_program,
                             format_table)
from vtc_jax.testing import cross_lower

pytestmark = pytest.mark.offline


@pytest.fixture(scope="module")
def lowered():
    return cross_lower(lambda x: add_one(x, backend="triton"),
                       jax.ShapeDtypeStruct((256,), jnp.float32))


def test_compile_lowered_reports_resources(lowered):
    [r] = compile_lowered(lowered)
    assert r.ptx_ok and r.cubin_ok, r.error
    assert r.error is None and r.gpu_name == "sm_90a" and r.name == "add_one"
    assert r.registers > 0
    assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0
    assert (r.num_warps, r.num_stages) == (4, 1)  # from the custom call's backend config
    assert 0 <= r.smem_bytes <= SMEM_LIMIT["sm_90"] and r.fits("sm_90")


def test_compile_many_takes_cross_lowered_ir_and_reports_unknown_ir(lowered):
    [k] = lowered.triton_kernels
    good, bad, again = compile_many([(k.name, k.ir, 4, 1), ("garbage", b"not triton ir", 4, 2),
                                     ("again", k.ir, 4, 1)])
    assert good.cubin_ok and (good.num_warps, good.num_stages) == (4, 1)
    assert not bad.ptx_ok and "unknown Triton IR" in bad.error
    assert again.cubin_ok and again.registers == good.registers and again.name == "again"
    table = format_table([good, bad, again])
    assert "add_one" in table and "FAIL" in table


def test_compile_program_counts_launches_bytes_and_memory():
    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    p = compile_program(lambda x: add_one(x, backend="triton") * 2, x)
    assert len(p.launches) == 2, p.thunks          # the Triton kernel and one XLA fusion
    [t] = p.triton_launches
    assert t.name == "add_one" and t.read_bytes == 1024 and t.write_bytes == 1024
    assert p.bytes == 4 * 1024
    assert p.memory["argument_size_in_bytes"] == 1024 and p.memory["output_size_in_bytes"] == 1024
    assert p.memory["total"] >= 2048
    assert {k.name for k in p.kernels} == {x.name for x in p.launches}, p.kernel_error


def test_compile_program_in_place_update_counts_the_update_only():
    cache = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    row = jax.ShapeDtypeStruct((1, 1024), jnp.float32)
    pos = jax.ShapeDtypeStruct((), jnp.int32)
    p = compile_program(lambda c, r, i: jax.lax.dynamic_update_slice(c, r * 2, (i, 0)),
                        cache, row, pos, donate_argnums=(0,), kernels=False)
    assert len(p.launches) == 1, p.thunks
    [x] = p.launches
    assert x.in_place_bytes == 64 * 1024 * 4       # the cache: updated in place, not counted
    assert x.write_bytes == 1024 * 4               # the row written
    assert p.memory["alias_size_in_bytes"] == 64 * 1024 * 4


def test_a_dynamic_slice_fusion_is_counted_once_by_the_launch_inside_it():
    """XLA runs a copy at a runtime offset beside a kernel call in a loop body as a dynamic-slice
    fusion thunk wrapping the copy; the listing prints both, the wrapper launching nothing
    (counted, it made VTC's program of a scanned sliding window one launch longer than jit's)."""
    import vtc_jax
    from tests.zoo.styles import CASES
    step, args = CASES["scan_sliding_window"]()
    p = compile_program(vtc_jax.optimize(step, backend="triton", guard=None), *args, kernels=False)
    listed = [line for line in p.thunks.splitlines() if re.match(r"\s*\d+:\s+k\w+", line)]
    if not [line for line in listed if "kDynamicSliceFusion" in line]:
        pytest.skip("this XLA runs the copy without a dynamic-slice fusion")
    named = [x.name for x in p.launches]
    assert not [n for n in named if "=" in n], named   # (a wrapper's or an async thunk's params)
    assert len(named) == len([line for line in listed if not re.match(
        r"\s*\d+:\s+k(DynamicSliceFusion|CommandBuffer|Sequential|Conditional|AsyncStart|AsyncDone)\b",
        line)]), (named, p.thunks)
    assert len(named) <= len(compile_program(jax.jit(step), *args, kernels=False).launches)


def test_a_gather_is_charged_the_rows_it_takes_not_its_table():
    """An embedding lookup reads the rows its ids pick: a launch reading a table only through
    gathers is charged the gathered rows (LLaVA's 32,064-row embedding was charged whole, 250 MiB
    for 3 MiB of rows), here fused with a scale and unfused alike."""
    table = jax.ShapeDtypeStruct((32064, 1024), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((4, 35), jnp.int32)
    rows = 4 * 35 * 1024 * 2
    for fn in (lambda t, i: jnp.take(t, i, axis=0) * 2, lambda t, i: t[i]):
        p = compile_program(jax.jit(fn), table, ids, kernels=False)
        reads = [x.read_bytes for x in p.launches]
        assert max(reads) < 2 * rows, p.launches   # the rows and the ids, not the 64 MiB table
        assert sum(x.write_bytes for x in p.launches) >= rows


def test_compile_lowered_takes_a_module_with_pytree_arguments():
    """A cross-lowered function of a dict (a workload's params) compiles: the exported call is
    invoked with its own argument pytree, not the flat avals (benchmarks/kernels.py workloads)."""
    x = jax.ShapeDtypeStruct((256,), jnp.float32)
    mod = cross_lower(lambda p, y: add_one(p["w"], backend="triton") + y, {"w": x}, x)
    [r] = compile_lowered(mod)
    assert r.cubin_ok, r.error


def test_launch_reading_one_result_of_a_multi_output_call_is_charged_that_result():
    """XLA prints ``get-tuple-element(%call), index=k`` as the operand ``%call#k``: a fusion reading
    the small result of a Pallas call that also returns a whole KV cache must be charged the small
    result, not the tuple (the compiled tables overstated VTC's bytes by the cache size)."""
    from vtc_jax.offline import _launches
    hlo = """ENTRY %main (p0: f32[1024], p1: f32[64,1024]) -> (f32[16], f32[64,1024]) {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[64,1024]{1,0} parameter(1)
  %call = (f32[16]{0}, f32[64,1024]{1,0}) custom-call(%p0, %p1), custom_call_target="__gpu$xla.gpu.triton"
  %bitcast.1 = f32[64,1024]{1,0} bitcast(%call#1)
  %loop_fusion = f32[16]{0} fusion(%call#0), kind=kLoop, calls=%fused
  ROOT %tuple = (f32[16]{0}, f32[64,1024]{1,0}) tuple(%loop_fusion, %bitcast.1)
}
"""
    thunks = ("001: kCustomKernel [source | sink] loop_fusion grid: [1, 1, 1] threads: [128, 1, 1]"
              "  shared_memory: 0 bytes\n")
    [x] = _launches(hlo, thunks)
    assert x.name == "loop_fusion" and x.read_bytes == 16 * 4 and x.write_bytes == 16 * 4


def test_cudnn_convolution_thunks_are_charged_their_operands():
    """A kConvolution thunk prints no instruction name; it is the next cuDNN custom call in the
    scheduled ENTRY. Unmatched, every jit conv counted 0 bytes (shufflenet's jit looked cheaper
    than VTC's Pallas convs that were counted)."""
    x = jax.ShapeDtypeStruct((2, 8, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 8, 3, 3), jnp.float32)
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
    p = compile_program(conv, x, w, kernels=False)
    convs = [l for l in p.launches if l.kind == "kConvolution"]
    assert convs, p.thunks
    assert sum(c.read_bytes for c in convs) >= 8 * 8 * 9 * 4          # at least the filter
    assert sum(c.write_bytes for c in convs) >= 2 * 8 * 16 * 16 * 4   # the output


def test_main_loop_reads_how_a_kernel_keeps_tiles_in_flight(lowered):
    """``offline.main_loop`` on real PTX: a pointwise kernel has no loop (one block); a bf16 GEMM
    pipelined by Triton waits with groups pending (>= 2 tiles per CTA); a bf16 NCHW 3x3 conv, whose
    odd-column 2-byte runs ``cp.async`` cannot copy, consumes its plain loads in the iteration
    that issues them (1 tile per CTA); a depthwise conv (no dot for the pipeliner to stage)
    carries every load into the next iteration (``tiling.fori_prefetch``: 2)."""
    from vtc_jax.kernels.conv import conv
    from vtc_jax.kernels.matmul import matmul
    from vtc_jax.offline import main_loop
    [r] = compile_lowered(lowered)
    assert not main_loop(r.ptx, r.name).loop and main_loop(r.ptx, r.name).tiles_per_cta == 1
    bf = jnp.bfloat16
    mm = cross_lower(lambda a, b: matmul(a, b, dimension_numbers=(((1,), (0,)), ((), ())), backend="triton"),
                     jax.ShapeDtypeStruct((16, 2048), bf), jax.ShapeDtypeStruct((2048, 256), bf))
    main = [x for x in compile_lowered(mm) if x.name.startswith("vtc_matmul")][0]
    loop = main_loop(main.ptx, main.name)
    assert loop.loop and loop.waits and min(loop.waits) >= 1 and loop.tiles_per_cta == 2, loop

    def conv_loop(x, w, groups=1):
        cv = cross_lower(lambda x, w: conv(x, w, window_strides=(1, 1), padding="SAME", feature_group_count=groups,
                                           dimension_numbers=("NCHW", "OIHW", "NCHW"), backend="triton"),
                         jax.ShapeDtypeStruct(x, bf), jax.ShapeDtypeStruct(w, bf))
        [c] = compile_lowered(cv)
        return main_loop(c.ptx, c.name)

    loop = conv_loop((1, 64, 16, 16), (32, 64, 3, 3))
    assert loop.loop and not loop.waits and loop.loads > loop.prefetched and loop.tiles_per_cta == 1, loop
    assert "ld.global" in loop.describe()
    loop = conv_loop((1, 64, 16, 16), (64, 1, 3, 3), groups=64)
    assert loop.loop and not loop.waits and loop.loads == loop.prefetched > 0 and loop.tiles_per_cta == 2, loop
    assert "prefetched" in loop.describe()


def test_the_big_prefill_tile_compiles_without_spills_and_keeps_tiles_in_flight():
    """``tiling.prefill_tiles``' 128 x 256 x 64 bf16 tile with 8 warps (measured on an H100 at 636
    TFLOP/s): ptxas for sm_90 assembles it without spills, within the shared memory of a block,
    with the main loop pipelined (>= 2 tiles in flight) — LoRA's projection, 8192 x 4096 x 4096."""
    from vtc_jax.kernels.matmul import matmul
    from vtc_jax.offline import main_loop
    bf = jnp.bfloat16
    mm = cross_lower(lambda a, b: matmul(a, b, dimension_numbers=(((1,), (0,)), ((), ())), backend="triton"),
                     jax.ShapeDtypeStruct((8192, 4096), bf), jax.ShapeDtypeStruct((4096, 4096), bf))
    [k] = [x for x in compile_lowered(mm) if x.name.startswith("vtc_matmul")]
    assert k.cubin_ok and k.fits("sm_90") and not k.spills, k
    assert (k.num_warps, k.num_stages) == (8, 3), k
    loop = main_loop(k.ptx, k.name)
    assert loop.loop and loop.waits and min(loop.waits) >= 1 and loop.tiles_per_cta == 2, loop


def test_a_gemm_operand_read_through_a_reshape_is_loaded_like_a_plain_one():
    """T5's and LoRA's output projections read the attention output ``(B, S, H, D)`` as
    ``(B·S, H·D)``: through the map, the K loop's blocks gathered it with 32 scalar 2-byte
    ``ld.global`` per thread and step. ``vio`` passes a buffer read through a whole row-major
    reshape reshaped (a bitcast), and the main loop takes that operand with ``cp.async`` like the
    other: no ``ld.global`` left in it."""
    from vtc_jax.kernels.matmul import matmul
    from vtc_jax.kernels.vio import VTensor
    from vtc_jax.offline import main_loop
    bf = jnp.bfloat16

    def proj(o, w):
        a = VTensor.physical(o).reshape((8 * 512, 16 * 64))
        return matmul(a, w, dimension_numbers=(((1,), (0,)), ((), ())), backend="triton")

    mm = cross_lower(proj, jax.ShapeDtypeStruct((8, 512, 16, 64), bf), jax.ShapeDtypeStruct((1024, 1024), bf))
    [k] = [x for x in compile_lowered(mm) if x.name.startswith("vtc_matmul")]
    loop = main_loop(k.ptx, k.name)
    assert k.cubin_ok and not k.spills, k
    assert loop.loop and loop.waits and loop.loads == 0, loop


def test_every_launch_of_a_deduplicated_kernel_is_charged():
    """XLA compiles identical fusions once and names each launch of that kernel after the first
    fusion: every launch is still matched to its own fusion and charged its buffers (two GEMMs of
    the same shape: one was 0 bytes)."""
    a, w = jnp.ones((16, 1024), jnp.bfloat16), jnp.ones((1024, 4096), jnp.bfloat16)
    p = compile_program(jax.jit(lambda a, b, w1, w2: (jnp.tanh(a @ w1), jnp.tanh(b @ w2))), a, a, w, w,
                        kernels=False)
    assert all(x.hlo is not None for x in p.launches), p.launches
    assert len({x.hlo for x in p.launches}) == len(p.launches)
    gemms = [x for x in p.launches if "gemm" in x.name or "dot" in x.name]
    assert len(gemms) == 2 and gemms[0].bytes == gemms[1].bytes >= w.nbytes


def test_device_copies_are_charged_what_they_copy():
    """An HLO copy runs as a device copy whose thunk prints no instruction name: it is charged
    reading and writing the buffer (it was 0 bytes)."""
    x = jnp.ones((256, 1024))
    p = compile_program(jax.jit(lambda x: (x, x.at[3].set(0.0))), x, kernels=False)
    copies = [c for c in p.launches if c.kind == "kCopy"]
    assert copies and all(c.read_bytes == c.write_bytes == x.nbytes for c in copies), p.launches


def test_a_conditional_counts_the_branch_it_runs():
    """A conditional runs one branch per call: its launches are the heavier branch's, not both
    (and the conditional itself launches no kernel). Branches with GEMMs, so that XLA keeps the
    conditional (cheap ones become a select)."""
    x = jnp.ones((1024, 1024))

    def f(x, p):
        return jax.lax.cond(p > 0, lambda x: x @ x, lambda x: jnp.tanh(jnp.sin(x) @ x) @ x, x)
    p = compile_program(jax.jit(f), x, jnp.int32(1), kernels=False)
    assert "kConditional" in p.thunks
    assert all(c.kind != "kConditional" for c in p.launches)
    assert sum("gemm" in c.name for c in p.launches) == 2, p.launches   # the heavier branch's two


def test_a_guarded_cache_write_in_a_kernel_copies_no_cache():
    """``cache.at[:, pos].set(row)`` becomes a guarded write (it reads the window it writes); the
    kernel writing it in place must take the donated cache once, as the aliased operand: passed
    also as a read operand, XLA copied the whole cache before the kernel and again for the output
    (two 128 MiB copies per layer at paper size)."""
    import vtc_jax
    from tests.zoo import llama_pure
    step, args = llama_pure.make_step("where_ninf"), llama_pure.example_args("small")
    fn = vtc_jax.optimize(step, backend="triton", donate_argnums=(2,), guard=None)
    p = compile_program(fn, *args, kernels=False)
    cache = args[2].k.nbytes
    assert p.triton_launches
    assert not [x for x in p.launches if x.kind == "kCopy" and x.bytes >= cache], p.launches


def test_a_sorts_copy_and_an_hlo_copy_are_told_apart():
    """A sort of a parameter (XLA copies it into the sort's buffers: an unnamed device copy) beside
    an HLO ``copy`` of another parameter (updated in place, not donated): each copy is charged what
    it copies, the sort's not claiming the HLO copy."""
    x, y = jnp.ones((16, 8192)), jnp.ones((512, 1024))
    p = compile_program(jax.jit(lambda x, y: (jnp.sort(x, axis=-1), y.at[3].set(0.0))), x, y, kernels=False)
    copies = [c for c in p.launches if c.kind == "kCopy"]
    assert sorted(c.read_bytes for c in copies) == sorted([x.nbytes, y.nbytes]), p.launches
