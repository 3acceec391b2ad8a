"""kernels/conv.py: ``lax.conv_general_dilated`` as an implicit GEMM over virtual tensors.

Every kernel case goes through ``check_kernel``: interpret mode against ``lax.conv_general_dilated``
*and* a CUDA cross-lowering that must contain Triton IR. Shapes are small and deliberately ragged
(3, 5, 12, 48 channels / pixels) so that every block has masked lanes.

Tolerances: interpret mode computes f32 dots exactly at every precision (on the GPU the kernel
follows the conv's precision, ``tests/test_precision.py``) and the reference is lax at HIGHEST:
only the summation order differs, rtol = atol = 1e-4. bf16
operands accumulate in f32 (bf16 products are exact in f32); the bf16 output is one rounding of that
sum, and two f32 sums may round to neighbouring bf16 values: rtol = atol = 2e-2 (one bf16 ulp is
2^-7 relative).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vtc_jax.indexmap import Layout
from vtc_jax.kernels.conv import conv
from vtc_jax.kernels.vio import VTensor
from vtc_jax.testing import check_kernel

F32 = dict(rtol=1e-4, atol=1e-4)
B16 = dict(rtol=2e-2, atol=2e-2)
HI = lax.Precision.HIGHEST
NHWC = ("NHWC", "HWIO", "NHWC")
NCHW = ("NCHW", "OIHW", "NCHW")


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def ref_conv(x, w, out_dtype=None, **kw):
    """lax conv with f32 accumulation at HIGHEST, then the result dtype (what the kernel does)."""
    out_dtype = out_dtype or jnp.promote_types(x.dtype, w.dtype)
    return lax.conv_general_dilated(x, w, precision=HI, preferred_element_type=jnp.float32,
                                    **kw).astype(out_dtype)


def operands(dn, n, hw, c, oc, k, groups=1, dtype=jnp.float32):
    """(x, w) for spatial size ``hw`` and kernel ``k`` in the layouts ``dn`` names."""
    (h, wd), (kh, kw) = hw, k
    x = (n, h, wd, c) if dn[0] == "NHWC" else (n, c, h, wd)
    w = (kh, kw, c // groups, oc) if dn[1] == "HWIO" else (oc, c // groups, kh, kw)
    return rand(x, dtype), rand(w, dtype, seed=1)


def check_conv(x, w, tol=F32, blocks=None, **kw):
    res = check_kernel(functools.partial(conv, **kw, **(blocks or {})), functools.partial(ref_conv, **kw),
                       (x, w), **tol)
    # the layout changes, the padding and the im2col matrix were never materialised
    assert res.lowered.movement_into_consumers() == []
    return res


# --------------------------------------------------------------------------------------------
# Physical operands: the conv shapes, NCHW and NHWC
# --------------------------------------------------------------------------------------------

# (spatial, C, OC, kernel, strides, padding, groups)
CASES = {
    "1x1": ((5, 5), 12, 48, (1, 1), (1, 1), "VALID", 1),
    "3x3-s1-p1": ((5, 12), 12, 16, (3, 3), (1, 1), ((1, 1), (1, 1)), 1),
    "3x3-s2-stem": ((7, 5), 3, 12, (3, 3), (2, 2), ((1, 1), (1, 1)), 1),   # C = 3: taps packed in K
    "grouped-g2": ((5, 5), 12, 48, (3, 3), (1, 1), "SAME", 2),
    "depthwise-3x3": ((5, 5), 12, 12, (3, 3), (1, 1), "SAME", 12),
    "depthwise-5x5-s2": ((12, 5), 48, 48, (5, 5), (2, 2), ((2, 2), (2, 2)), 48),
}


@pytest.mark.parametrize("dn", [NHWC, NCHW], ids=["NHWC", "NCHW"])
@pytest.mark.parametrize("case", list(CASES))
def test_conv_f32(case, dn):
    hw, c, oc, k, s, pad, g = CASES[case]
    x, w = operands(dn, 2, hw, c, oc, k, g)
    res = check_conv(x, w, window_strides=s, padding=pad, dimension_numbers=dn, feature_group_count=g)
    [kern] = res.triton_kernels
    assert kern.name == ("vtc_conv_depthwise" if c == g else "vtc_conv")


@pytest.mark.parametrize("case,dn", [("3x3-s1-p1", NHWC), ("grouped-g2", NCHW),
                                     ("depthwise-5x5-s2", NHWC)], ids=["3x3-NHWC", "g2-NCHW", "dw5-NHWC"])
def test_conv_bf16(case, dn):
    hw, c, oc, k, s, pad, g = CASES[case]
    x, w = operands(dn, 2, hw, c, oc, k, g, jnp.bfloat16)
    res = check_conv(x, w, B16, window_strides=s, padding=pad, dimension_numbers=dn, feature_group_count=g)
    assert res.output.dtype == jnp.bfloat16


def test_bf16_in_f32_out():
    x, w = operands(NHWC, 1, (5, 5), 48, 12, (3, 3), dtype=jnp.bfloat16)
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    check_kernel(functools.partial(conv, preferred_element_type=jnp.float32, **kw),
                 functools.partial(ref_conv, out_dtype=jnp.float32, **kw), (x, w), **F32)


def test_depthwise_channel_multiplier():
    """groups == C, OC = 2C: output channel oc reads input channel oc // 2 (a broadcast layout)."""
    x, w = operands(NHWC, 2, (5, 5), 12, 24, (3, 3), 12)
    check_conv(x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, feature_group_count=12)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_fori_prefetch_is_the_loop_it_replaces(n):
    """``tiling.fori_prefetch`` (the depthwise loop's register prefetch) sums the same tiles in the
    same order as the plain loop: tile t is loaded one iteration ahead, the last one re-read."""
    from vtc_jax.kernels.tiling import fori_prefetch
    tiles = jnp.arange(n * 6, dtype=jnp.float32).reshape(n, 2, 3) ** 1.5
    seen = fori_prefetch(n, lambda t: tiles[t], lambda t, x, acc: acc * 0.5 + x * (t + 1),
                         jnp.zeros((2, 3), jnp.float32))
    want = np.zeros((2, 3), np.float32)
    for t in range(n):
        want = want * 0.5 + np.asarray(tiles[t]) * (t + 1)
    np.testing.assert_allclose(np.asarray(seen), want, rtol=1e-6)


@pytest.mark.parametrize("lhs_d,rhs_d,pad", [((1, 1), (2, 2), "SAME"), ((2, 2), (1, 1), ((1, 2), (2, 1)))],
                         ids=["rhs-dilation", "lhs-dilation"])
def test_dilation(lhs_d, rhs_d, pad):
    """Dilations are index maps too: rhs dilation scales the tap index, lhs dilation (transposed
    conv) is the pad's interior."""
    x, w = operands(NCHW, 2, (7, 5), 12, 16, (3, 3))
    check_conv(x, w, window_strides=(1, 1), padding=pad, lhs_dilation=lhs_d, rhs_dilation=rhs_d,
          dimension_numbers=NCHW)


def test_conv1d():
    x, w = rand((2, 12, 5)), rand((3, 5, 16), seed=1)
    check_conv(x, w, window_strides=(2,), padding=((1, 1),), dimension_numbers=("NWC", "WIO", "NWC"))


def test_unusual_dimension_numbers():
    """Any dim order works the same way: lhs NWCH, rhs HOIW, out CHWN."""
    x, w = rand((2, 5, 12, 6)), rand((3, 16, 12, 3), seed=1)
    check_conv(x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=("NWCH", "HOIW", "CHWN"))


def test_small_blocks_several_tiles():
    """block 16 everywhere: M, OC and K loops have several (ragged) tiles; program id -> origins."""
    x, w = operands(NHWC, 2, (5, 5), 48, 40, (3, 3))
    check_conv(x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC,
          blocks=dict(block_m=16, block_n=16, block_k=16))


# --------------------------------------------------------------------------------------------
# Virtual input: split piece, channel shuffle, concat
# --------------------------------------------------------------------------------------------

def test_input_is_channel_slice_of_bigger_buffer():
    """x = channels [12, 24) of a (2, 36, 5, 5) NCHW buffer (a split piece): read in place."""
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NCHW)

    def call(big, w, *, backend):
        lay = Layout.physical(0, big.shape).slice((0, 12, 0, 0), (2, 24, 5, 5))
        return conv(VTensor(lay, big.dtype, (big,)), w, backend=backend, **kw)

    big, w = rand((2, 36, 5, 5)), rand((16, 12, 3, 3), seed=1)
    res = check_kernel(call, lambda big, w: ref_conv(big[:, 12:24], w, **kw), (big, w), **F32)
    assert res.lowered.movement_into_consumers() == []


@pytest.mark.parametrize("dn", [NCHW, NHWC], ids=["NCHW", "NHWC"])
def test_input_is_channel_shuffle_depthwise(dn):
    """ShuffleNet: x = shuffle(y, 2) = reshape -> transpose -> reshape of a physical y, feeding a
    depthwise 3x3 conv. The shuffle is the layout; no transpose is materialised."""
    n, c, h, wd, gs = 2, 12, 5, 5, 2
    cax = 1 if dn == NCHW else 3

    def shuffle_shape(shape):
        return shape[:cax] + (gs, c // gs) + shape[cax + 1:]

    perm = list(range(5))
    perm[cax], perm[cax + 1] = perm[cax + 1], perm[cax]
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=dn, feature_group_count=c)

    def call(y, w, *, backend):
        lay = (Layout.physical(0, y.shape).reshape(shuffle_shape(y.shape)).transpose(perm)
               .reshape(y.shape))
        return conv(VTensor(lay, y.dtype, (y,)), w, backend=backend, **kw)

    def ref(y, w):
        x = y.reshape(shuffle_shape(y.shape)).transpose(perm).reshape(y.shape)
        return ref_conv(x, w, **kw)

    y = rand((n, c, h, wd) if dn == NCHW else (n, h, wd, c))
    w = rand((c, 1, 3, 3) if dn == NCHW else (3, 3, 1, c), seed=1)
    res = check_kernel(call, ref, (y, w), **F32)
    assert res.lowered.count("stablehlo.transpose") == 0
    assert res.lowered.movement_into_consumers() == []


def test_input_is_concat_of_two_buffers():
    """C3K2-style: x = concat([a (.., 12), b (.., 20)], channels) read piecewise (a K block of 32
    channels straddles both buffers)."""
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)

    def call(a, b, w, *, backend):
        lay = Layout.concatenate([Layout.physical(0, a.shape), Layout.physical(1, b.shape)], 3)
        return conv(VTensor(lay, a.dtype, (a, b)), w, backend=backend, **kw)

    a, b, w = rand((2, 5, 5, 12)), rand((2, 5, 5, 20), seed=2), rand((3, 3, 32, 16), seed=1)
    res = check_kernel(call, lambda a, b, w: ref_conv(jnp.concatenate([a, b], 3), w, **kw),
                       (a, b, w), **F32)
    assert res.lowered.count("stablehlo.concatenate") == 0
    assert res.lowered.movement_into_consumers() == []


# --------------------------------------------------------------------------------------------
# Virtual output: slabs of concat buffers
# --------------------------------------------------------------------------------------------

def test_output_into_slab_of_existing_concat_buffer():
    """The conv writes channels [16, 32) of an existing (2, 48, 5, 5) NCHW buffer, in place."""
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NCHW)

    def call(x, w, buf, *, backend):
        out = VTensor(Layout.physical(0, buf.shape).slice((0, 16, 0, 0), (2, 32, 5, 5)), buf.dtype, (buf,))
        return conv(x, w, out=out, backend=backend, **kw)

    def ref(x, w, buf):
        return buf.at[:, 16:32].set(ref_conv(x, w, **kw))

    x, w = operands(NCHW, 2, (5, 5), 12, 16, (3, 3))
    res = check_kernel(call, ref, (x, w, rand((2, 48, 5, 5), seed=3)), **F32)
    assert "output_operand_alias<output_tuple_indices = [], operand_index = 2" in res.text
    assert res.lowered.movement_into_consumers() == []


def test_two_convs_fill_a_fresh_concat_buffer():
    """Two convs (a 1x1 and a depthwise 3x3, NHWC) write the two channel slabs of one fresh buffer:
    the first allocates it, the second updates it in place. No concatenate is left."""
    c1, c2 = 12, 20
    kw1 = dict(window_strides=(1, 1), padding="VALID", dimension_numbers=NHWC)
    kw2 = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, feature_group_count=c2)
    shape = (2, 5, 5, c1 + c2)

    def slab(buf, lo, hi):
        lay = Layout.physical(0, shape).slice((0, 0, 0, lo), (2, 5, 5, hi))
        return VTensor(lay, jnp.float32, (buf,))

    def call(x1, w1, x2, w2, *, backend):
        buf = conv(x1, w1, out=slab(jax.ShapeDtypeStruct(shape, jnp.float32), 0, c1), backend=backend, **kw1)
        return conv(x2, w2, out=slab(buf, c1, c1 + c2), backend=backend, **kw2)

    def ref(x1, w1, x2, w2):
        return jnp.concatenate([ref_conv(x1, w1, **kw1), ref_conv(x2, w2, **kw2)], 3)

    args = (rand((2, 5, 5, 48)), rand((1, 1, 48, c1), seed=1), rand((2, 5, 5, c2), seed=2),
            rand((3, 3, 1, c2), seed=3))
    res = check_kernel(call, ref, args, **F32)
    assert len(res.triton_kernels) == 2
    assert res.lowered.count("stablehlo.concatenate") == 0
    assert res.lowered.movement_into_consumers() == []


# --------------------------------------------------------------------------------------------
# Epilogue
# --------------------------------------------------------------------------------------------

def silu(v):
    return v * jax.nn.sigmoid(v)


@pytest.mark.parametrize("dn", [NHWC, NCHW], ids=["NHWC", "NCHW"])
def test_epilogue_bias_silu(dn):
    """Conv + per-channel bias + SiLU (the YOLO Conv block), bias broadcast by numpy rules:
    (OC,) against NHWC, (OC, 1, 1) against NCHW."""
    kw = dict(window_strides=(2, 2), padding=((1, 1), (1, 1)), dimension_numbers=dn)
    oc = 48
    x, w = operands(dn, 2, (7, 5), 12, oc, (3, 3))
    bias = rand((oc,) if dn == NHWC else (oc, 1, 1), seed=2)
    check_kernel(lambda x, w, b, *, backend: conv(x, w, epilogue=lambda acc, bb: silu(acc + bb),
                                                  epilogue_args=(b,), backend=backend, **kw),
                 lambda x, w, b: silu(ref_conv(x, w, **kw) + b), (x, w, bias), **F32)


def test_epilogue_depthwise_bias_relu_bf16():
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NCHW, feature_group_count=48)
    x, w = operands(NCHW, 2, (5, 5), 48, 48, (3, 3), 48, jnp.bfloat16)
    bias = rand((48, 1, 1), jnp.bfloat16, seed=2)

    def ref(x, w, b):
        acc = ref_conv(x, w, out_dtype=jnp.float32, **kw)
        return jax.nn.relu(acc + b.astype(jnp.float32)).astype(jnp.bfloat16)

    check_kernel(lambda x, w, b, *, backend: conv(x, w, epilogue=lambda acc, bb: jax.nn.relu(acc + bb),
                                                  epilogue_args=(b,), backend=backend, **kw),
                 ref, (x, w, bias), **B16)


def test_epilogue_residual_from_other_layout():
    """A residual of the output's logical shape (NHWC) stored NCHW: read through a transpose."""
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC, feature_group_count=2)
    x, w = operands(NHWC, 2, (5, 5), 12, 12, (3, 3), 2)

    def call(x, w, r_nchw, *, backend):
        r = VTensor(Layout.physical(0, r_nchw.shape).transpose((0, 2, 3, 1)), r_nchw.dtype, (r_nchw,))
        return conv(x, w, epilogue=lambda acc, rr: acc + rr, epilogue_args=(r,), backend=backend, **kw)

    res = check_kernel(call, lambda x, w, r: ref_conv(x, w, **kw) + r.transpose(0, 2, 3, 1),
                       (x, w, rand((2, 12, 5, 5), seed=2)), **F32)
    assert res.lowered.count("stablehlo.transpose") == 0


# --------------------------------------------------------------------------------------------
# Argument checks (no kernels)
# --------------------------------------------------------------------------------------------

def test_bad_arguments_rejected():
    x, w = operands(NHWC, 1, (5, 5), 12, 16, (3, 3))
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=NHWC)
    with pytest.raises(ValueError, match="power of two"):
        conv(x, w, block_m=48, **kw)
    with pytest.raises(NotImplementedError, match="batch_group_count"):
        conv(x, w, batch_group_count=2, **kw)
    with pytest.raises(ValueError, match="logical shape"):
        conv(x, w, out=VTensor.fresh((1, 5, 5, 17), jnp.float32), **kw)
    with pytest.raises(ValueError):  # lax's own check: 12 input channels, 5 groups
        conv(x, w, feature_group_count=5, **kw)


# --------------------------------------------------------------------------------------------
# Rung 2b: the default configuration compiles to cubin for sm_90 within budget
# --------------------------------------------------------------------------------------------

@pytest.mark.offline
def test_default_config_compiles_sm90_no_spills():
    from vtc_jax.offline import SMEM_LIMIT, compile_many, format_table, main_loop
    from vtc_jax.testing import cross_lower

    sds = jax.ShapeDtypeStruct
    kernels = []
    for dt in (jnp.float32, jnp.bfloat16):
        for name, xs, ws, kw in [
            ("3x3", (2, 32, 32, 64), (3, 3, 64, 64), dict(padding="SAME", dimension_numbers=NHWC)),
            ("1x1-nchw", (2, 64, 32, 32), (64, 64, 1, 1), dict(padding="VALID", dimension_numbers=NCHW)),
            ("dw3x3", (2, 32, 32, 64), (3, 3, 1, 64),
             dict(padding="SAME", dimension_numbers=NHWC, feature_group_count=64)),
        ]:
            mod = cross_lower(functools.partial(conv, window_strides=(1, 1), backend="triton", **kw),
                              sds(xs, dt), sds(ws, dt))
            [k] = mod.triton_kernels
            kernels.append((f"{name}-{jnp.dtype(dt).name}", k.ir, k.num_warps, k.num_stages))
    results = compile_many(kernels, arch="9.0")
    table = format_table(results)
    print(table)
    assert len(results) == 6, table
    for r in results:
        assert r.cubin_ok, table
        stages = 1 if r.name.startswith("dw") else 3  # tiling.pipeline_stages (f32 at TF32); no dot: 1
        assert (r.num_warps, r.num_stages) == (4, stages), table
        # two tiles in flight per CTA: cp.async stages (dot path), registers (depthwise prefetch);
        # or no loop left (jax 0.10.2's LLVM unrolls the 1x1's two K tiles: all loads at once)
        loop = main_loop(r.ptx, r.name)
        print(r.name, loop.describe())
        assert not loop.loop or loop.tiles_per_cta == 2, (r.name, loop)
        assert not r.spills, table
        assert r.smem_bytes <= SMEM_LIMIT["sm_90"], table
