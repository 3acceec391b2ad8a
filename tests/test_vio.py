"""Virtual tensor I/O through a copy kernel: every access path (strided box, gather/scatter,
several pieces, masks, runtime symbols, in-place outputs) equals the layout's numpy semantics,
in interpret mode and cross-lowered to Triton IR."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.test_indexmap import random_chain
from vtc_jax.indexmap import Layout, SymInfo, all_of, point, sym
from vtc_jax.kernels.vio import Plan, VRef, VTensor, _Binding, _flat_offsets, compiler_params, next_pow2
from vtc_jax.testing import check_kernel, cross_lower

RNG = np.random.default_rng(0)


def _copy(x: VTensor, out: VTensor, block, backend):
    plan = Plan.build([x], [out])
    grid = tuple(-(-n // b) for n, b in zip(x.shape, block))

    def body(ins, outs):
        origin = tuple(pl.program_id(k) * b for k, b in enumerate(block))
        outs[0].store(origin, block, ins[0].load(origin, block))

    return plan.call(body, grid=grid, backend=backend)[0]


def check_read_case(layout, bufs, block):
    """Copy a virtual input into a fresh physical output; reference = Layout.evaluate."""
    ref = layout.evaluate({i: np.asarray(b) for i, b in enumerate(bufs)})

    def call(*bufs, backend):
        v = VTensor(layout, bufs[0].dtype, tuple(bufs))
        return _copy(v, VTensor.fresh(layout.shape, bufs[0].dtype), block, backend)[0]

    check_kernel(call, lambda *b: ref, bufs, rtol=0, atol=0)


A = jnp.asarray(RNG.standard_normal((20, 36)), jnp.float32)
B = jnp.asarray(RNG.standard_normal((20, 12)), jnp.float32)
K = jnp.asarray(RNG.standard_normal((2, 5, 3)), jnp.float32)


@pytest.mark.parametrize("name,layout,bufs,block", [
    ("transpose", Layout.physical(0, (20, 36)).transpose((1, 0)), (A,), (8, 16)),
    ("slice", Layout.physical(0, (20, 36)).slice((3, 4), (20, 30)), (A,), (8, 16)),
    ("rev+strided (gather)", Layout.physical(0, (20, 36)).rev((1,)).slice((0, 0), (20, 36), (2, 3)), (A,), (8, 16)),
    ("concat+pad", Layout.concatenate([Layout.physical(0, (20, 36)), Layout.physical(1, (20, 12))], 1)
     .pad((1, 0), (2, 3), (0, 0), -1.0), (A, B), (8, 16)),
    ("broadcast (GQA repeat)", Layout.physical(0, (2, 5, 3)).expand_dims((2,))
     .broadcast((2, 5, 4, 3), (0, 1, 2, 3)).reshape((2, 20, 3)), (K,), (2, 8, 4)),
    ("reshape of transpose (div/mod)", Layout.physical(0, (20, 36)).transpose((1, 0)).reshape((20, 36)), (A,), (8, 16)),
])
def test_read_paths(name, layout, bufs, block):
    check_read_case(layout, bufs, block)


def test_a_whole_row_major_reshape_is_read_as_a_reshaped_buffer():
    """A buffer read through a row-major reshape of all of it (``(4, 5, 3, 12) -> (20, 36)``,
    merged dims' floordiv/mod in the map) is passed reshaped to the kernel and read through the
    identity (``vio._reshaped``), in blocks that do not line up with the merged dims; equal to
    numpy's reshape, bit for bit. A reshape of a transpose, or a buffer the kernel also writes,
    keeps its map."""
    x = A.reshape(4, 5, 3, 12)
    lay = Layout.physical(0, (4, 5, 3, 12)).reshape((20, 36))
    plan = Plan.build([VTensor(lay, x.dtype, (x,))], [VTensor.fresh((20, 36), x.dtype)])
    assert plan.inputs[0].shapes == ((20, 36),) and plan.inputs[0].layout.pieces[0].map.is_identity
    check_read_case(lay, (x,), (8, 16))
    moved = Layout.physical(0, (36, 20)).transpose((1, 0)).reshape((20, 36))
    assert Plan.build([VTensor(moved, A.dtype, (A.T,))], [VTensor.fresh((20, 36), A.dtype)]).inputs[0].shapes == ((36, 20),)
    y = VTensor(lay, x.dtype, (x,))
    assert Plan.build([y], [VTensor.physical(x)]).inputs[0].shapes == ((4, 5, 3, 12),)


def test_write_qkv_into_three_buffers_at_pos():
    """The paper's Fig. 3: one (B, 48) output lands in Q, the K cache and the V cache at ``pos``."""
    nb, t = 3, 10
    x = jnp.asarray(RNG.standard_normal((nb, 48)), jnp.float32)
    kc = jnp.asarray(RNG.standard_normal((nb, t, 2, 8)), jnp.float32)
    vc = jnp.asarray(RNG.standard_normal((nb, t, 2, 8)), jnp.float32)
    pos = jnp.int32(4)
    info = [SymInfo("pos", 0, t - 1)]
    q = Layout.physical(0, (nb, 1, 4, 4)).reshape((nb, 16))
    k = Layout.physical(1, (nb, t, 2, 8)).dynamic_slice([0, sym("pos"), 0, 0], (nb, 1, 2, 8), info).reshape((nb, 16))
    v = Layout.physical(2, (nb, t, 2, 8)).dynamic_slice([0, sym("pos"), 0, 0], (nb, 1, 2, 8), info).reshape((nb, 16))
    layout = Layout.concatenate([q, k, v], 1)

    def call(x, kc, vc, pos, *, backend):
        out = VTensor(layout, jnp.float32, (jax.ShapeDtypeStruct((nb, 1, 4, 4), jnp.float32), kc, vc),
                      (("pos", pos),))
        return _copy(VTensor.physical(x), out, (4, 16), backend)

    def ref(x, kc, vc, pos):
        kk = np.asarray(kc).copy()
        vv = np.asarray(vc).copy()
        kk[:, 4] = np.asarray(x[:, 16:32]).reshape(nb, 2, 8)
        vv[:, 4] = np.asarray(x[:, 32:]).reshape(nb, 2, 8)
        return np.asarray(x[:, :16]).reshape(nb, 1, 4, 4), kk, vv

    res = check_kernel(call, ref, (x, kc, vc, pos), rtol=0, atol=0)
    assert res.text.count("tf.aliasing_output") >= 2 or "output_operand_alias" in res.text


def test_symbol_missing_is_a_clear_error():
    lay = Layout.physical(0, (4, 8)).dynamic_slice([sym("p"), 0], (2, 8), [SymInfo("p", 0, 2)])
    with pytest.raises(ValueError, match="runtime symbols"):
        VTensor(lay, jnp.float32, (jnp.zeros((4, 8)),))


# --------------------------------------------------------------------------------------------
# VTensor views and the shared input/output helpers (no kernels)
# --------------------------------------------------------------------------------------------

def _eval(v: VTensor) -> np.ndarray:
    return v.layout.evaluate({i: np.asarray(b) for i, b in enumerate(v.buffers)},
                             {k: np.asarray(x) for k, x in v.symbols})


def test_vtensor_views_are_layouts_over_the_same_buffers():
    x = np.asarray(A)
    v = VTensor.physical(A)
    assert v.transpose((0, 1)) is v                          # identity: no new layout
    t = v.transpose((1, 0))
    assert t.shape == (36, 20) and t.buffers == v.buffers
    np.testing.assert_array_equal(_eval(t), x.T)
    np.testing.assert_array_equal(_eval(t.reshape((9, 80))), x.T.reshape(9, 80))
    np.testing.assert_array_equal(_eval(v.expand_dims((0, 2))), x[None, :, None, :])
    np.testing.assert_array_equal(_eval(v.broadcast_to((3, 20, 36))), np.broadcast_to(x, (3, 20, 36)))
    assert v.broadcast_to((20, 36)) is v
    col = VTensor.physical(B[:, :1])                         # (20, 1) -> (20, 12)
    np.testing.assert_array_equal(_eval(col.broadcast_to((20, 12))), np.broadcast_to(np.asarray(B[:, :1]), (20, 12)))
    with pytest.raises(ValueError, match="cannot broadcast"):
        v.broadcast_to((36,))
    with pytest.raises(ValueError, match="cannot broadcast"):
        v.broadcast_to((20, 35))
    w = v.with_layout(Layout.physical(0, (20, 36)).slice((2, 0), (5, 36)))
    np.testing.assert_array_equal(_eval(w), x[2:5])
    with pytest.raises(ValueError):                          # re-validated against the buffers
        v.with_layout(Layout.physical(0, (4, 4)))
    s = v.with_symbol("pos", jnp.int32(3))
    assert dict(s.symbols)["pos"] == 3 and s.layout is v.layout
    with pytest.raises(ValueError, match="already carries"):
        s.with_symbol("pos", jnp.int32(1))


def test_input_output_helpers():
    from vtc_jax.kernels.vio import broadcast_input, epilogue_input, output, outputs, pack_results
    bias = jnp.arange(6.0)
    np.testing.assert_array_equal(_eval(broadcast_input(bias, (4, 6))), np.broadcast_to(np.arange(6.0), (4, 6)))
    assert broadcast_input(jnp.float32(2), (3,)).buffers[0].shape == (1,)   # rank 0 -> (1,) buffer
    assert broadcast_input(jnp.float32(2), ()).shape == ()
    v = VTensor.physical(jnp.zeros((4, 6)))
    assert broadcast_input(VTensor.physical(bias), (4, 6)).shape == (4, 6)   # VTensors broadcast too
    assert epilogue_input(bias, (4, 6)).shape == (4, 6)
    assert epilogue_input(jnp.float32(2), (4, 6)).buffers[0].shape == ()     # rank 0 stays rank 0
    assert epilogue_input(v, (4, 6)) is v
    with pytest.raises(ValueError, match="broadcast layout"):
        epilogue_input(VTensor.physical(bias), (4, 6))                       # VTensors must match
    assert output(None, (2, 3), jnp.bfloat16).buffers[0] == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
    assert output(v, (4, 6), jnp.float32) is v
    with pytest.raises(ValueError, match="out has logical shape .*, the conv gives"):
        output(v, (4, 5), jnp.float32, "the conv gives")
    outs, lifted = outputs(None, [(), (2,)], [jnp.float32, jnp.int32])
    assert lifted == [True, False] and [o.shape for o in outs] == [(1,), (2,)]
    assert outputs(v, [(4, 6)], [jnp.float32]) == ([v], [False])
    with pytest.raises(ValueError, match="2 outs for 1 outputs"):
        outputs([v, v], [(4, 6)], [jnp.float32])
    with pytest.raises(ValueError, match="output 0 has shape"):
        outputs([v], [(4, 5)], [jnp.float32])
    a, b = jnp.ones((1,)), jnp.zeros((2, 2))
    packed = pack_results([(a,), (b,), (a, b)], [True])
    assert packed[0].shape == () and packed[1] is b and packed[2] == (a, b)


def test_tiling_helpers():
    from vtc_jax.kernels import tiling
    assert [tiling.next_pow2(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]
    tiling.check_pow2("bk", 32)
    with pytest.raises(ValueError, match="bk=24 must be a power of two >= 16"):
        tiling.check_pow2("bk", 24)
    with pytest.raises(ValueError, match="power of two >= 16"):
        tiling.check_pow2("bk", 8)
    tiling.check_pow2("b", 8, minimum=1)
    g = tiling.Group((3, 40), tiling.split_block((3, 40), 64))
    assert g.blocks == (1, 64) and g.tiles == (3, 1) and g.ntiles == 3
    assert [g.origins(t) for t in range(3)] == [(0, 0), (1, 0), (2, 0)]
    origin, n = tiling.grid_origin((5, 300), (1, 128), 7)
    assert n == 15 and origin == (2, 128)
    assert tiling.fori(1, lambda i, c: c + i + 1, 0) == 1     # one trip: no loop
    prec, acc = tiling.dot_precision(None, np.float32)       # jax's default: TF32 on the GPU
    assert prec == jax.lax.Precision.DEFAULT and acc == np.float32
    assert tiling.dot_precision(jax.lax.Precision.HIGHEST, np.float32)[0] == jax.lax.Precision.HIGHEST
    assert tiling.dot_precision(None, jnp.bfloat16) == (None, np.float32)
    assert tiling.program_id(0, 1) == 0


# --------------------------------------------------------------------------------------------
# Masked lanes of a load read `fill`, with or without the merge select
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fill", [0.0, 7.0, -0.0])
@pytest.mark.parametrize("view", ["physical", "transpose", "broadcast", "gather"])
def test_load_fill_on_masked_lanes(view, fill):
    """A (3, 5) tensor read as one (4, 8) block: lanes outside it read ``fill`` exactly (sign of
    zero included) whether the single-piece load merges with a select or relies on the masked
    load's own zeros."""
    x = jnp.asarray(RNG.standard_normal((5, 5)), jnp.float32)
    base = Layout.physical(0, (5, 5))
    layout = {"physical": base.slice((0, 0), (3, 5)),
              "transpose": base.transpose((1, 0)).slice((0, 0), (3, 5)),
              "broadcast": base.slice((0, 0), (1, 5)).broadcast((3, 5), (0, 1)),
              "gather": base.rev((0,)).slice((0, 0), (3, 5))}[view]
    expect = np.full((4, 8), fill, np.float32)
    expect[:3, :5] = layout.evaluate({0: np.asarray(x)})

    def call(x, *, backend):
        plan = Plan.build([VTensor(layout, x.dtype, (x,))], [VTensor.fresh((4, 8), x.dtype)])

        def body(ins, outs):
            outs[0].store((0, 0), (4, 8), ins[0].load((0, 0), (4, 8), fill=fill))

        return plan.call(body, grid=(1,), backend=backend)[0][0]

    res = check_kernel(call, lambda x: expect, (x,), rtol=0, atol=0)
    out = np.asarray(res.output)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(expect))


# --------------------------------------------------------------------------------------------
# Buffers of 2^31 elements or more: no wrapping 32-bit offsets
# --------------------------------------------------------------------------------------------

from vtc_jax.kernels import vio as _vio  # noqa: E402
from vtc_jax.testing import triton_ir_text  # noqa: E402


@pytest.mark.parametrize("name,layout", [
    ("rev+strided (gather)", Layout.physical(0, (20, 36)).rev((1,)).slice((0, 0), (20, 36), (2, 3))),
    ("reshape of transpose (div/mod)", Layout.physical(0, (20, 36)).transpose((1, 0)).reshape((20, 36))),
])
def test_wide_buffer_path_reads_and_writes(monkeypatch, name, layout):
    """Path 3 (per-dim index arrays, the buffer unflattened), forced on a small buffer: the same
    values as the flat gather/scatter, reading and writing (masked-off scatter lanes dropped)."""
    monkeypatch.setattr(_vio, "_WIDE_ELEMENTS", 0)
    check_read_case(layout, (A,), (8, 16))
    inv = np.zeros((20, 36), np.float32)
    vals = np.asarray(RNG.standard_normal(layout.shape), np.float32)

    def call(vals, buf, *, backend):
        out = VTensor(layout, jnp.float32, (buf,))
        return _copy(VTensor.physical(vals), out, (8, 16), backend)[0]

    expect = inv.copy()
    # every logical element goes to its physical home; untouched elements keep the buffer's zeros
    idx = layout.evaluate({0: np.arange(720, dtype=np.int64).reshape(20, 36)})
    expect.reshape(-1)[np.asarray(idx).reshape(-1)] = vals.reshape(-1)
    check_kernel(call, lambda v, b: expect, (jnp.asarray(vals), jnp.asarray(inv)), rtol=0, atol=0)


def _addptrs(ir_text, arg):
    """The ``tt.addptr`` lines that offset kernel argument ``arg`` (e.g. ``%arg0``)."""
    import re
    lines = ir_text.splitlines()
    splats = {m.group(1) for ln in lines
              if (m := re.match(r"\s*(%\w+) = tt.splat " + arg + r" ", ln))}
    return [ln for ln in lines if (m := re.match(r"\s*%\w+ = tt.addptr (%\w+),", ln))
            and m.group(1) in splats]


def _ir(fn, *sds):
    return [triton_ir_text(k.ir) for k in cross_lower(fn, *sds).triton_kernels]


def test_cache_of_2_pow_32_elements_lowers_with_i64_offsets():
    """A bf16 KV cache of 2^32 elements (8 GiB, abstract: nothing allocated) written at runtime
    ``pos`` through a strided box and read through a gather (reshape of a transpose): the lowered
    Triton IR computes pointer offsets in i64 and no offset tensor in i32."""
    big = (128, 32768, 8, 128)                       # 2^32 elements
    cache = jax.ShapeDtypeStruct(big, jnp.bfloat16)
    row = jax.ShapeDtypeStruct((128, 1024), jnp.bfloat16)
    info = [SymInfo("pos", 0, big[1] - 1)]

    def write(x, kc, pos, *, backend="triton"):
        lay = Layout.physical(0, big).dynamic_slice([0, sym("pos"), 0, 0], (128, 1, 8, 128), info) \
            .reshape((128, 1024))
        return _copy(VTensor.physical(x), VTensor(lay, jnp.bfloat16, (kc,), (("pos", pos),)),
                     (16, 64), backend)

    [w] = _ir(write, row, cache, jax.ShapeDtypeStruct((), jnp.int32))
    # operands: x, the cache (aliased input), pos; output: the cache
    assert _addptrs(w, "%arg3") and all("xi64>" in ln for ln in _addptrs(w, "%arg3")), w
    assert _addptrs(w, "%arg0") and all("xi32>" in ln for ln in _addptrs(w, "%arg0"))  # x: i32

    def read(kc, *, backend="triton"):
        lay = Layout.physical(0, big).transpose((0, 2, 1, 3)).reshape((128 * 8, 32768 * 128))
        out = VTensor.fresh((16, 64), jnp.bfloat16)
        plan = Plan.build([VTensor(lay, jnp.bfloat16, (kc,))], [out])

        def body(ins, outs):
            outs[0].store((0, 0), (16, 64), ins[0].load((pl.program_id(0) * 16, 0), (16, 64)))

        return plan.call(body, grid=(1,), backend=backend)[0]

    [r] = _ir(read, cache)
    loads = _addptrs(r, "%arg0")
    assert loads and all("xi64>" in ln for ln in loads), r
    assert "arith.divsi" in r or "arith.divui" in r        # it is the gather path (div/mod)
    # the batch stride 8 * 32768 * 128 = 2^25 multiplies in i64 (the flat i32 gather did it in
    # i32 before the cast: b * 2^25 wraps from b = 64 on)
    assert "33554432 : i64" in r and "33554432 : i32" not in r


def test_one_byte_buffer_that_pallas_would_address_in_i32_is_refused():
    """int8 with more than 2^31 elements (and at most 2^32 bytes): the Pallas lowering keeps i32
    element offsets, and the last ones (2^31 and up) wrap."""
    with pytest.raises(NotImplementedError, match="32-bit offsets"):
        Plan.build([VTensor.physical(jax.ShapeDtypeStruct((2, 2 ** 30 + 64), jnp.int8))],
                   [VTensor.fresh((2, 16), jnp.int8)])


@pytest.mark.parametrize("shape,dtype,stride", [((64, 16384, 8, 256), jnp.bfloat16, 2 ** 25),
                                                ((2, 2 ** 30), jnp.int8, None)], ids=["bf16-cache", "int8"])
def test_buffer_of_2_pow_31_elements_is_addressed_in_i32(shape, dtype, stride):
    """Exactly 2^31 elements (a bf16 KV cache at batch 64, 16,384 tokens, 8 KV heads of 256: 4 GiB,
    abstract) is at most 2^32 bytes, so Pallas addresses it with i32 element offsets — and the last
    element's, 2^31 - 1, fits: the plan builds (it was refused before, and Gemma-2's attention at
    that size fell back to XLA), and the block at the buffer's very end is read through i32
    offsets (the cache's per-dim indices by the gather path, its batch stride 2^25 multiplying in
    i32: the last element's offset is ``63 * 2^25 + 2^25 - 1 = 2^31 - 1``)."""
    big = jax.ShapeDtypeStruct(shape, dtype)
    n = math.prod(shape)
    rows = n // 16

    def read(kc, *, backend="triton"):
        lay = Layout.physical(0, shape).reshape((rows, 16))
        out = VTensor.fresh((16, 16), dtype)
        plan = Plan.build([VTensor(lay, dtype, (kc,))], [out])

        def body(ins, outs):   # the buffer's last 16 rows: elements 2^31 - 256 ... 2^31 - 1
            outs[0].store((0, 0), (16, 16), ins[0].load((rows - 16, 0), (16, 16)))

        return plan.call(body, grid=(1,), backend=backend)[0]

    [r] = _ir(read, big)
    loads = _addptrs(r, "%arg0")
    assert loads and all("xi32>" in ln for ln in loads), r
    assert "i64" not in "".join(loads)
    if stride:
        assert f"{stride} : i32" in r and f"{stride} : i64" not in r


# --------------------------------------------------------------------------------------------
# Contiguous merges read/written as windows, not gathers (blocks within one merged row)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(2, 16), (4, 32), (2, 64)], ids=["inside", "one-row", "two-rows"])
def test_merged_dims_concat_write_as_window(block):
    """The decode QKV output (B, H*D + 2*D) onto Q (B, 1, H, D) and K/V caches at ``pos``: a block
    of at most D columns, at an origin that is a multiple of it (tiling.InBounds), is a ``pl.ds``
    window of the 4-D buffers — no per-lane ``//``/``%`` in the Triton IR (only scalar ones). A
    block spanning two rows (64 > D = 32) takes path 3 (per-dim indices) and is still exact."""
    from vtc_jax.kernels.tiling import InBounds

    nb, t, h, d = 4, 6, 2, 32           # (h + 2) * d = 128 columns: every block fits exactly
    x = jnp.asarray(RNG.standard_normal((nb, (h + 2) * d)), jnp.float32)
    kc = jnp.asarray(RNG.standard_normal((nb, t, 1, d)), jnp.float32)
    vc = jnp.asarray(RNG.standard_normal((nb, t, 1, d)), jnp.float32)
    info = [SymInfo("pos", 0, t - 1)]
    q = Layout.physical(0, (nb, 1, h, d)).reshape((nb, h * d))
    kv = [Layout.physical(i, (nb, t, 1, d)).offset(1, sym("pos"), 1, info).reshape((nb, d)) for i in (1, 2)]
    layout = Layout.concatenate([q, *kv], 1)

    def call(x, kc, vc, pos, *, backend):
        out = VTensor(layout, jnp.float32, (jax.ShapeDtypeStruct((nb, 1, h, d), jnp.float32), kc, vc),
                      (("pos", pos),))
        plan = Plan.build([VTensor.physical(x)], [out])

        def body(ins, outs):
            org = (pl.program_id(0) * block[0], InBounds(pl.program_id(1) * block[1]))
            outs[0].store(org, block, ins[0].load(org, block))

        return plan.call(body, grid=(nb // block[0], (h + 2) * d // block[1]), backend=backend)[0]

    def ref(x, kc, vc, pos):
        kk, vv = np.asarray(kc).copy(), np.asarray(vc).copy()
        kk[:, 2, 0] = np.asarray(x[:, h * d:(h + 1) * d])
        vv[:, 2, 0] = np.asarray(x[:, (h + 1) * d:])
        return np.asarray(x[:, :h * d]).reshape(nb, 1, h, d), kk, vv

    res = check_kernel(call, ref, (x, kc, vc, jnp.int32(2)), rtol=0, atol=0)
    [k] = res.triton_kernels
    text = triton_ir_text(k.ir)
    lane_divs = [ln for ln in text.splitlines()
                 if re.search(r"arith\.(div|rem)[su]i", ln) and "tensor<" in ln]
    assert (lane_divs == []) == (block[1] <= d), lane_divs


# --------------------------------------------------------------------------------------------
# In-kernel offsets and masks are the algebra's own (random layouts)
# --------------------------------------------------------------------------------------------

def _offsets_kernel(layout: Layout, names, block, backend: str):
    """A kernel writing, for every block of ``layout``, each piece's flat offsets (vio's path 2)
    and its lane mask as vio computes them: ``f(*symbols) -> [offsets, mask] per piece`` over the
    grid-padded shape."""
    grid = tuple(-(-n // b) for n, b in zip(layout.shape, block))
    padded = tuple(g * b for g, b in zip(grid, block))
    binding = _Binding(layout, np.dtype(np.float32), (), (), (), ())   # _env/_piece_mask read the layout only

    def kernel(*refs):
        sym_refs, outs = refs[:len(names) + 1], refs[len(names) + 1:]
        r = VRef(binding, (), {k: ref[0] for k, ref in zip(names, sym_refs[1:])})   # [0]: a dummy
        env, inb = r._env(tuple(pl.program_id(k) * b for k, b in enumerate(block)), block)
        for i, p in enumerate(layout.pieces):
            outs[2 * i][...] = _flat_offsets(p, env, p.map.target, block)
            m = r._piece_mask(p, env, inb, block)
            outs[2 * i + 1][...] = jnp.broadcast_to(True if m is None else m, block).astype(jnp.int32)

    spec = pl.BlockSpec(block, lambda *g: g)
    return pl.pallas_call(
        kernel, grid=grid, out_shape=[jax.ShapeDtypeStruct(padded, jnp.int32)] * (2 * len(layout.pieces)),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (len(names) + 1),
        out_specs=[spec] * (2 * len(layout.pieces)), compiler_params=compiler_params(),
        interpret=backend == "interpret")


@settings(max_examples=30, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_kernel_offsets_equal_the_reference(data):
    """vio's in-kernel flat offsets (int32 lanes, truncating division) and piece masks (bounds
    and piece conditions) equal the numpy reference's ``IndexMap.flat_offsets`` / ``Piece.holds``
    on every in-bounds lane of random layouts; the kernel cross-lowers to verified Triton IR."""
    c = random_chain(data)
    lay = c.layout
    if not lay.shape:
        return
    block = tuple(min(next_pow2(n), 4) for n in lay.shape)
    names = sorted(c.symbols)
    args = [jnp.int32(0).reshape(1)] + [jnp.asarray(c.symbols[k], jnp.int32).reshape(1) for k in names]
    got = jax.jit(_offsets_kernel(lay, names, block, "interpret"))(*args)
    padded = got[0].shape
    idx = list(np.indices(padded, dtype=np.int64))
    at = point(idx, c.symbols)
    inb = np.broadcast_to(all_of(i < n for i, n in zip(idx, lay.shape)), padded)
    for i, p in enumerate(lay.pieces):
        msg = " -> ".join(c.steps) + f"\npiece {i}: {p.map}"
        want_off = np.broadcast_to(p.map.flat_offsets(at), padded)
        np.testing.assert_array_equal(np.asarray(got[2 * i])[inb], want_off[inb], err_msg=msg)
        held = p.holds(at)
        want_mask = inb & np.broadcast_to(True if held is None else held, padded)
        np.testing.assert_array_equal(np.asarray(got[2 * i + 1]).astype(bool), want_mask, err_msg=msg)
    cross_lower(_offsets_kernel(lay, names, block, "triton"), *args)


# --------------------------------------------------------------------------------------------
# Indirect layouts: Load atoms read an index table inside the kernel
# --------------------------------------------------------------------------------------------

def _paged_layout(pages, page, b, m, d):
    """``(B, T, D) -> pages[tbl[b, t floordiv page], t mod page, d]`` (wrap and clamp as jnp/XLA)."""
    from vtc_jax.indexmap import Dim, Expr, IndexMap, Load, dim
    bounds = {Dim(0): (0, b - 1), Dim(1): (0, m * page - 1), Dim(2): (0, d - 1)}
    read = Load("tbl", (dim(0), dim(1).floordiv(page, bounds)), 0, pages - 1, pages)
    m_ = IndexMap((b, m * page, d), (Expr.of(read), dim(1).mod(page, bounds), dim(2)), (pages, page, d),
                  syms=(SymInfo("tbl", 0, 0, shape=(b, m)),))
    return Layout.physical(0, (pages, page, d)).compose(m_)


@pytest.mark.parametrize("block", [(1, 8, 16), (2, 4, 8)])
def test_indirect_layout_reads_pages_through_the_table_in_kernel(block):
    """A paged cache read by a kernel through its block table: interpret mode equals the
    reference evaluation (negative entries wrapped, out-of-range ones clamped), and the Triton
    lowering reads the table once per block row (a load of ``block[1]`` table entries, not one
    per element) and verifies."""
    pages, page, b, m, d = 13, 4, 3, 4, 16
    lay = _paged_layout(pages, page, b, m, d)
    buf = jnp.asarray(RNG.standard_normal((pages, page, d)), jnp.float32)
    table = np.array([[3, 0, 7, 5], [1, -2, 4, 60], [8, 9, -100, 11]], np.int32)
    ref = lay.evaluate({0: np.asarray(buf)}, {"tbl": table})

    def call(buf, tbl, *, backend):
        v = VTensor(lay, jnp.float32, (buf,), (("tbl", tbl),))
        return _copy(v, VTensor.fresh(lay.shape, jnp.float32), block, backend)[0]

    chk = check_kernel(call, lambda *a: ref, (buf, jnp.asarray(table)), rtol=0, atol=0)
    (k,) = chk.triton_kernels
    text = triton_ir_text(k.ir)
    loads = re.findall(r"tt\.load [^:]*: tensor<([0-9x]+)x!tt\.ptr<i32>>", text)
    assert loads and all(np.prod([int(n) for n in s.split("x")]) <= block[0] * block[1] for s in loads), loads


def test_indirect_layout_table_must_be_supplied():
    lay = _paged_layout(13, 4, 3, 4, 16)
    with pytest.raises(ValueError, match="tbl"):
        VTensor(lay, jnp.float32, (jnp.zeros((13, 4, 16)),))
