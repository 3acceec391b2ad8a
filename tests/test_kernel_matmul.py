"""kernels/matmul.py: the dot_general template over the virtual-tensor I/O matrix.

Every case goes through ``check_kernel``: it runs in interpret mode against a ``lax`` reference *and*
cross-lowers for CUDA, asserting Triton IR comes out (interpret mode alone accepts things that do
not lower). Shapes are small and deliberately not multiples of the blocks (masks).

Tolerances: interpret mode computes f32 dots exactly at every precision (on the GPU the kernel
follows the op's precision, ``tests/test_precision.py``: TF32 at jax's default, IEEE at ``HIGHEST``)
and the reference is lax at ``HIGHEST``, so only the summation order differs: rtol = atol = 1e-5. bf16/f16
operands accumulate in f32 (products of 16-bit floats are exact in f32); a 16-bit *output* is one
rounding of that f32 sum, and the two f32 sums may round to neighbouring 16-bit values: rtol = atol
= 2e-2 (2^-7 relative is one bf16 ulp). A 16-bit-in, f32-out case keeps 1e-5.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vtc_jax.indexmap import Layout, SymInfo, sym
from vtc_jax.kernels.matmul import choose_blocks, matmul
from vtc_jax.kernels.tiling import split_block as _split_block
from vtc_jax.kernels.vio import VTensor
from vtc_jax.testing import check_kernel

MM = (((1,), (0,)), ((), ()))  # (M, K) @ (K, N)
F32 = dict(rtol=1e-5, atol=1e-5)
B16 = dict(rtol=2e-2, atol=2e-2)
HI = lax.Precision.HIGHEST


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def ref_dot(a, b, dn=MM, out_dtype=None):
    """dot_general with f32 accumulation, then the result dtype (what the kernel computes)."""
    out_dtype = out_dtype or jnp.promote_types(a.dtype, b.dtype)
    return lax.dot_general(a, b, dn, precision=HI, preferred_element_type=jnp.float32).astype(out_dtype)


# --------------------------------------------------------------------------------------------
# Block choice (no kernels)
# --------------------------------------------------------------------------------------------

def test_choose_blocks_decode_and_caps():
    assert choose_blocks(1, 4096, 4096) == (16, 64, 32)      # decode: bm = 16, not 64
    assert choose_blocks(5, 3, 1) == (16, 16, 16)            # tt.dot minimum 16 per dim
    assert choose_blocks(48, 100, 96) == (64, 64, 32)
    assert choose_blocks(1000, 1000, 1000, block_m=128, block_k=64) == (128, 64, 64)
    assert _split_block((2, 3), 16) == (2, 8)                # innermost first, surplus inside
    assert _split_block((2, 1), 16) == (16, 1)               # never widen a size-1 dim
    assert _split_block((4, 12), 32) == (2, 16)
    assert _split_block((100,), 64) == (64,)


def test_prefill_tiles_by_dtype_and_size():
    """``tiling.prefill_tiles`` (measured on an H100, benchmarks/gemm_tiles.py): a 16-bit prefill
    GEMM with half a wave of whole 128 x 256 tiles takes them with 8 warps; f32, decode shapes,
    groups smaller than a tile and small grids keep the 64 x 64 tiles and 4 warps."""
    from vtc_jax.kernels.tiling import gemm_config, prefill_tiles
    assert prefill_tiles(8192, 4096) == (128, 256, 64, 8)
    assert prefill_tiles(8192, 4096, itemsize=4) is None            # f32: spilled in programs
    assert prefill_tiles(64, 4096) is None                          # decode-shaped
    assert prefill_tiles(4096, 160) is None                         # N under one tile
    assert prefill_tiles(512, 512) is None                          # 8 tiles: under half a wave
    assert prefill_tiles(512, 512, batch=16) == (128, 256, 64, 8)   # batched: 128 tiles
    big = gemm_config(8192, 4096, 4096)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps, big.num_stages) == (128, 256, 64, 8, 3)
    small = gemm_config(8192, 4096, 4096, a_itemsize=4, b_itemsize=4)
    assert (small.block_m, small.block_n, small.block_k, small.num_warps) == (64, 64, 32, 4)
    capped = gemm_config(8192, 4096, 4096, block_m=64)              # a caller's cap: no big tile
    assert (capped.block_m, capped.block_n, capped.num_warps) == (64, 64, 4)


def test_prefill_tiles_compute_the_product():
    """The big tiles in the kernel (interpret mode): a bf16 2048 x 64 x 2048 product (128 tiles
    of 128 x 256) equals ``dot_general`` with f32 accumulation."""
    a, b = rand((2048, 64), jnp.bfloat16), rand((64, 2048), jnp.bfloat16, seed=1)
    out = jax.jit(lambda x, y: matmul(x, y, dimension_numbers=MM))(a, b)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_dot(a, b), np.float32), **B16)


# --------------------------------------------------------------------------------------------
# Physical operands: shapes and dtypes
# --------------------------------------------------------------------------------------------

SHAPES = [(100, 48, 96), (3, 100, 48), (48, 3, 100), (96, 1, 3), (16, 96, 48)]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_physical_f32(m, k, n):
    check_kernel(functools.partial(matmul, dimension_numbers=MM), ref_dot,
                 (rand((m, k)), rand((k, n), seed=1)), **F32)


@pytest.mark.parametrize("m,k,n", [(1, 48, 96), (100, 3, 1)])
def test_physical_size1_output_dim(m, k, n):
    """M = 1 (decode, one sequence) / N = 1: a 16-wide block over a size-1 dim of a 2-D output;
    vio folds the padding lanes before the strided store."""
    check_kernel(functools.partial(matmul, dimension_numbers=MM), ref_dot,
                 (rand((m, k)), rand((k, n), seed=1)), **F32)


def test_exact_single_block():
    """(16, 32) @ (32, 64): one tile, static origins, no ragged edge: loads need no mask."""
    check_kernel(functools.partial(matmul, dimension_numbers=MM), ref_dot,
                 (rand((16, 32)), rand((32, 64), seed=1)), **F32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_physical_16bit(dtype):
    a, b = rand((100, 48), dtype), rand((48, 96), dtype, seed=1)
    res = check_kernel(functools.partial(matmul, dimension_numbers=MM), ref_dot, (a, b), **B16)
    assert res.output.dtype == dtype


def test_bf16_in_f32_out():
    a, b = rand((3, 96), jnp.bfloat16), rand((96, 100), jnp.bfloat16, seed=1)
    check_kernel(functools.partial(matmul, dimension_numbers=MM, preferred_element_type=jnp.float32),
                 lambda a, b: ref_dot(a, b, out_dtype=jnp.float32), (a, b), **F32)


def test_mixed_dtypes_promote():
    a, b = rand((48, 32), jnp.bfloat16), rand((32, 40), jnp.float32, seed=1)
    check_kernel(functools.partial(matmul, dimension_numbers=MM), ref_dot, (a, b), **F32)


def test_decode_grid_uses_block_m_16():
    """M = 5 (decode batch): one 16-row tile, grid over N only, tiny K loop."""
    a, b = rand((5, 64)), rand((64, 200), seed=1)
    res = check_kernel(functools.partial(matmul, dimension_numbers=MM), ref_dot, (a, b), **F32)
    [k] = res.triton_kernels
    # grid = (batch, tiles(M), tiles(N)) = (1, 1, 4); the Pallas Triton lowering flattens it
    assert np.prod(k.grid) == 4


# --------------------------------------------------------------------------------------------
# Read side: transposed, slice, concat, broadcast
# --------------------------------------------------------------------------------------------

def test_transposed_operands():
    """a is the transpose of a physical (K, M) buffer, b of an (N, K) one (torch Linear weight)."""
    def call(at, bt, *, backend):
        a = VTensor(Layout.physical(0, at.shape).transpose((1, 0)), at.dtype, (at,))
        b = VTensor(Layout.physical(0, bt.shape).transpose((1, 0)), bt.dtype, (bt,))
        return matmul(a, b, dimension_numbers=MM, backend=backend)

    at, bt = rand((48, 100)), rand((96, 48), seed=1)
    res = check_kernel(call, lambda at, bt: ref_dot(at.T, bt.T), (at, bt), **F32)
    assert res.lowered.count("stablehlo.transpose") == 0  # the transposes were never materialised


def test_dimension_numbers_transposed_rhs():
    """Same thing through dimension_numbers instead of layouts: contract lhs 1 with rhs 1."""
    dn = (((1,), (1,)), ((), ()))
    a, b = rand((40, 48), jnp.bfloat16), rand((100, 48), jnp.bfloat16, seed=1)
    check_kernel(functools.partial(matmul, dimension_numbers=dn),
                 lambda a, b: ref_dot(a, b, dn), (a, b), **B16)


def test_slice_piece_operand():
    """a is a column slice [K, 2K) of a wider (M, 3K) buffer (a split piece)."""
    m, k, n = 20, 24, 40

    def call(wide, b, *, backend):
        a = VTensor(Layout.physical(0, wide.shape).slice((0, k), (m, 2 * k)), wide.dtype, (wide,))
        return matmul(a, b, dimension_numbers=MM, backend=backend)

    wide, b = rand((m, 3 * k)), rand((k, n), seed=1)
    check_kernel(call, lambda wide, b: ref_dot(wide[:, k:2 * k], b), (wide, b), **F32)


@pytest.mark.parametrize("k1,k2", [(32, 20), (20, 28)], ids=["aligned", "straddle"])
def test_concat_pieces_read_along_k(k1, k2):
    """a = concat([a1 (M, k1), a2 (M, k2)], axis=1): with k1 = 32 every K block lies in one piece
    (strided pl.ds path), with k1 = 20 a K block straddles the buffers (vio's gather path)."""
    def call(a1, a2, b, *, backend):
        lay = Layout.concatenate([Layout.physical(0, a1.shape), Layout.physical(1, a2.shape)], 1)
        a = VTensor(lay, a1.dtype, (a1, a2))
        return matmul(a, b, dimension_numbers=MM, backend=backend)

    a1, a2, b = rand((30, k1)), rand((30, k2), seed=1), rand((k1 + k2, 50), seed=2)
    res = check_kernel(call, lambda a1, a2, b: ref_dot(jnp.concatenate([a1, a2], 1), b),
                       (a1, a2, b), **F32)
    assert res.lowered.count("stablehlo.concatenate") == 0


def test_broadcast_bias_epilogue():
    """Bias from a (N,) vector: once as a plain array (broadcast by numpy rules), once as an
    explicit broadcast-layout VTensor; plus a scale and a tanh-GELU, bf16 result."""
    m, k, n = 33, 40, 72

    def call(a, b, bias, *, backend):
        vbias = VTensor(Layout.physical(0, bias.shape).broadcast((m, n), (1,)), bias.dtype, (bias,))
        return matmul(a, b, dimension_numbers=MM, backend=backend,
                      epilogue=lambda acc, b1, b2: jax.nn.gelu(0.5 * acc + b1 + 2 * b2, approximate=True),
                      epilogue_args=(bias, vbias), preferred_element_type=jnp.bfloat16)

    def ref(a, b, bias):
        acc = ref_dot(a, b, out_dtype=jnp.float32)
        return jax.nn.gelu(0.5 * acc + 3 * bias, approximate=True).astype(jnp.bfloat16)

    check_kernel(call, ref, (rand((m, k)), rand((k, n), seed=1), rand((n,), seed=2)), **B16)


def test_epilogue_residual_from_transposed_layout():
    """A residual epilogue argument of the output's logical shape read through a transpose."""
    m, k, n = 40, 24, 36

    def call(a, b, rt, *, backend):
        res = VTensor(Layout.physical(0, rt.shape).transpose((1, 0)), rt.dtype, (rt,))
        return matmul(a, b, dimension_numbers=MM, backend=backend,
                      epilogue=lambda acc, r: acc + r, epilogue_args=(res,))

    check_kernel(call, lambda a, b, rt: ref_dot(a, b) + rt.T,
                 (rand((m, k)), rand((k, n), seed=1), rand((n, m), seed=2)), **F32)


# --------------------------------------------------------------------------------------------
# Write side: concat pieces, transposed write, dynamic_update_slice at pos, QKV
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n1,n2,bn", [(32, 40, 32), (40, 56, 64)], ids=["aligned", "straddle"])
def test_concat_pieces_write(n1, n2, bn):
    """out (M, n1 + n2) = concat of two fresh buffers (M, n1), (M, n2); with n1 = 40, bn = 64
    tile 0 straddles both (two masked stores), with n1 = bn = 32 each tile hits one piece."""
    m, k = 50, 32

    def call(a, b, *, backend):
        lay = Layout.concatenate([Layout.physical(0, (m, n1)), Layout.physical(1, (m, n2))], 1)
        out = VTensor(lay, jnp.float32, (jax.ShapeDtypeStruct((m, n1), jnp.float32),
                                         jax.ShapeDtypeStruct((m, n2), jnp.float32)))
        return matmul(a, b, dimension_numbers=MM, out=out, block_n=bn, backend=backend)

    def ref(a, b):
        y = ref_dot(a, b)
        return (y[:, :n1], y[:, n1:])

    check_kernel(call, ref, (rand((m, k)), rand((k, n1 + n2), seed=1)), **F32)


def test_transposed_write():
    """The result is stored transposed into a fresh (N, M) buffer."""
    m, k, n = 20, 32, 48

    def call(a, b, *, backend):
        out = VTensor(Layout.physical(0, (n, m)).transpose((1, 0)), jnp.float32,
                      (jax.ShapeDtypeStruct((n, m), jnp.float32),))
        return matmul(a, b, dimension_numbers=MM, out=out, backend=backend)

    check_kernel(call, lambda a, b: ref_dot(a, b).T, (rand((m, k)), rand((k, n), seed=1)), **F32)


def test_dynamic_update_slice_write_at_pos():
    """out (3, 96) is written into rows [pos, pos + 3) of a (64, 96) cache (aliased, in place)."""
    t, m, k, n = 64, 3, 40, 96

    def call(a, b, cache, pos, *, backend):
        lay = Layout.physical(0, cache.shape).offset(0, sym("pos"), m, [SymInfo("pos", 0, t - m)])
        out = VTensor(lay, cache.dtype, (cache,), (("pos", pos),))
        return matmul(a, b, dimension_numbers=MM, out=out, backend=backend)

    def ref(a, b, cache, pos):
        return lax.dynamic_update_slice(cache, ref_dot(a, b), (pos, 0))

    args = (rand((m, k)), rand((k, n), seed=1), rand((t, n), seed=2), jnp.int32(17))
    res = check_kernel(call, ref, args, **F32)
    # the cache (operand 2 of the custom call) is aliased to the kernel's output: written in place
    assert "output_operand_alias<output_tuple_indices = [], operand_index = 2" in res.text


def _qkv_problem(s, d, **kw):
    """x (B, S, D) @ W (D, 64) -> one (B, S, 64) output onto Q (B, S, 2, 16) fresh and the K and V
    caches (B, T, 1, 16) at runtime ``pos``: ``(call, ref, args)`` for check_kernel; ``kw`` goes
    to ``matmul`` (block_n, split_k)."""
    bsz, t, hq, hkv, dh = 2, 8, 2, 1, 16
    qw, kw_ = hq * dh, hkv * dh
    dn = (((2,), (0,)), ((), ()))
    syms = [SymInfo("pos", 0, t - s)]

    def call(x, w, kc, vc, pos, *, backend):
        q = Layout.physical(0, (bsz, s, hq, dh)).reshape((bsz, s, qw))
        kv = [Layout.physical(i, (bsz, t, hkv, dh)).offset(1, sym("pos"), s, syms).reshape((bsz, s, kw_))
              for i in (1, 2)]
        out = VTensor(Layout.concatenate([q, *kv], 2), x.dtype,
                      (jax.ShapeDtypeStruct((bsz, s, hq, dh), x.dtype), kc, vc), (("pos", pos),))
        return matmul(x, w, dimension_numbers=dn, out=out, backend=backend, **kw)

    def ref(x, w, kc, vc, pos):
        y = ref_dot(x, w, dn)
        q = y[..., :qw].reshape(bsz, s, hq, dh)
        k = y[..., qw:qw + kw_].reshape(bsz, s, hkv, dh)
        v = y[..., qw + kw_:].reshape(bsz, s, hkv, dh)
        z = jnp.int32(0)
        return (q, lax.dynamic_update_slice(kc, k, (z, pos, z, z)),
                lax.dynamic_update_slice(vc, v, (z, pos, z, z)))

    args = (rand((bsz, s, d)), rand((d, qw + 2 * kw_), seed=1), rand((bsz, t, hkv, dh), seed=2),
            rand((bsz, t, hkv, dh), seed=3), jnp.int32(t - s - 1))
    return call, ref, args


@pytest.mark.parametrize("s,bn", [(1, 16), (3, 16), (1, 64)],
                         ids=["decode", "prefill", "decode-straddle"])
def test_qkv_one_output_three_buffers(s, bn):
    """The QKV projection's one output written onto Q fresh and the K and V caches at runtime
    ``pos`` (decode S = 1, prefill chunk S = 3). With bn = 16 = head_dim each tile lies in one
    piece; with bn = 64 one tile spans Q, K and V."""
    res = check_kernel(*_qkv_problem(s, 32, block_n=bn), **F32)
    assert res.triton_kernels, res


# --------------------------------------------------------------------------------------------
# dot_general generality: batch dims, several free / contracting dims, degenerate groups
# --------------------------------------------------------------------------------------------

def test_batch_dims():
    dn = (((2,), (1,)), ((0,), (0,)))
    a, b = rand((3, 20, 24), jnp.bfloat16), rand((3, 24, 40), jnp.bfloat16, seed=1)
    check_kernel(functools.partial(matmul, dimension_numbers=dn),
                 lambda a, b: ref_dot(a, b, dn), (a, b), **B16)


def test_attention_scores_two_batch_dims():
    """'bqhd,bkhd->bhqk': batch (b, h) in the middle of the operands, rhs contracted on its last
    dim (in-register transpose), non-power-of-two q, k."""
    dn = (((3,), (3,)), ((0, 2), (0, 2)))
    q, k = rand((2, 5, 3, 16)), rand((2, 48, 3, 16), seed=1)
    check_kernel(functools.partial(matmul, dimension_numbers=dn),
                 lambda q, k: ref_dot(q, k, dn), (q, k), **F32)


@pytest.mark.parametrize("b,s,bm", [(2, 3, 64), (3, 20, 16)])
def test_several_free_dims(b, s, bm):
    """(B, S, D) @ (D, N): the M group (B, S) is tiled as a whole — (2, 3) as one 16-row block
    (2 x 8); (3, 20) with bm = 16 as blocks (1, 16), tiles (3, 2): program id -> (//, %)."""
    dn = (((2,), (0,)), ((), ()))
    check_kernel(functools.partial(matmul, dimension_numbers=dn, block_m=bm),
                 lambda x, w: ref_dot(x, w, dn), (rand((b, s, 40)), rand((40, 24), seed=1)), **F32)


@pytest.mark.parametrize("h,d", [(4, 12), (3, 40)])
def test_several_contracting_dims(h, d):
    """'shd,hdn->sn' (attention output projection): the K group (h, d) is one loop — (4, 12) in
    blocks (2, 16), 2 steps; (3, 40) in blocks (1, 32), tiles (3, 2): loop index -> (//, %)."""
    dn = (((1, 2), (0, 1)), ((), ()))
    check_kernel(functools.partial(matmul, dimension_numbers=dn, block_k=32),
                 lambda a, b: ref_dot(a, b, dn), (rand((5, h, d)), rand((h, d, 24), seed=1)), **F32)


def test_contracting_before_free_in_lhs():
    """lhs (K, M) contracted on dim 0 via dimension_numbers: in-register .T of the a block."""
    dn = (((0,), (0,)), ((), ()))
    check_kernel(functools.partial(matmul, dimension_numbers=dn),
                 lambda a, b: ref_dot(a, b, dn), (rand((48, 100)), rand((48, 20), seed=1)), **F32)


def test_outer_product_no_contraction():
    dn = (((), ()), ((), ()))
    check_kernel(functools.partial(matmul, dimension_numbers=dn),
                 lambda a, b: ref_dot(a, b, dn), (rand((20,)), rand((30,), seed=1)), **F32)


def test_matrix_vector_and_vector_matrix():
    """No rhs (lhs) free dim: a size-1 N (M) dim is added through the layouts."""
    dn = (((1,), (0,)), ((), ()))
    check_kernel(functools.partial(matmul, dimension_numbers=dn),
                 lambda a, b: ref_dot(a, b, dn), (rand((20, 48)), rand((48,), seed=1)), **F32)
    dn = (((0,), (0,)), ((), ()))
    check_kernel(functools.partial(matmul, dimension_numbers=dn),
                 lambda a, b: ref_dot(a, b, dn), (rand((48,)), rand((48, 30), seed=1)), **F32)


def test_bad_blocks_rejected():
    with pytest.raises(ValueError, match="power of two"):
        matmul(rand((4, 4)), rand((4, 4)), dimension_numbers=MM, block_m=48)
    with pytest.raises(ValueError, match="mismatch"):
        matmul(rand((4, 5)), rand((4, 4)), dimension_numbers=MM)


# --------------------------------------------------------------------------------------------
# Rung 2b: the default configuration compiles to cubin for sm_90 within budget
# --------------------------------------------------------------------------------------------

@pytest.mark.offline
def test_default_config_compiles_sm90_no_spills():
    from vtc_jax.offline import SMEM_LIMIT, compile_lowered, format_table, main_loop
    from vtc_jax.testing import cross_lower

    mods = []
    for dt in (jnp.float32, jnp.bfloat16):
        # K = 512: 16 K tiles, a loop whatever the pipeliner peels (at K = 96, three tiles, jax
        # 0.10's Triton unrolled it whole)
        sds = (jax.ShapeDtypeStruct((100, 512), dt), jax.ShapeDtypeStruct((512, 200), dt))
        mods.append(cross_lower(functools.partial(matmul, dimension_numbers=MM, backend="triton"),
                                *sds))
    results = [r for m in mods for r in compile_lowered(m, arch="9.0")]
    table = format_table(results)
    assert len(results) == 2, table
    for r in results:
        assert r.cubin_ok, table
        assert (r.num_warps, r.num_stages) == (4, 3), table
        assert not r.spills, table
        loop = main_loop(r.ptx, r.name)   # 3 stages: the K loop waits with tiles still in flight
        assert loop.loop and loop.tiles_per_cta >= 2, (loop, table)
        assert r.smem_bytes <= SMEM_LIMIT["sm_90"], table


# --------------------------------------------------------------------------------------------
# Decode shape: split-K into an f32 workspace + a reduce kernel that applies epilogue and stores
# --------------------------------------------------------------------------------------------

from vtc_jax.kernels.tiling import DECODE_MAX_M, NUM_SMS, gemm_config  # noqa: E402


@pytest.mark.parametrize("m,n,splits", [(1, 6144, 4), (16, 6144, 4), (1, 4096, 8), (16, 4096, 8),
                                        (1, 28672, 1), (16, 28672, 1)])
def test_gemm_config_llama3_8b_decode_fills_two_waves(m, n, splits):
    """Llama-3-8B decode GEMMs (K = 4096, bf16): QKV, w_o and gate_up reach >= 2 waves of 132 SMs,
    >= 2 weight tiles in flight per CTA, operand buffers well inside sm_90's 232,448 B."""
    c = gemm_config(m, n, 4096)
    assert (c.block_m, c.block_n, c.block_k, c.num_stages) == (16, 64, 128, 4)
    assert c.split_k == splits and c.ctas >= 2 * NUM_SMS and c.waves >= 2
    assert c.tiles_in_flight >= 2 and c.k_tiles_per_split >= c.num_stages
    assert c.smem_bytes <= 232448 and c.smem_bytes == 3 * 128 * (16 + 64) * 2
    assert c.grid == (splits, 1, n // 64)
    assert c.reduce_grid == (None if splits == 1 else (1, 1, n // 64))
    assert c.bytes_per_cta == c.k_tiles_per_split * 128 * (16 + 64) * 2
    assert c.workspace_bytes == (0 if splits == 1 else 2 * splits * m * n * 4)


def test_gemm_config_prefill_and_explicit_split():
    c = gemm_config(512, 512, 512)
    assert (c.block_k, c.num_stages, c.split_k, c.grid) == (32, 3, 1, (1, 8, 8))
    assert DECODE_MAX_M == 64 and gemm_config(65, 64, 4096).split_k == 1
    assert gemm_config(1, 64, 4096, split_k=3).split_k == 3          # 32 K tiles: 11 + 11 + 10
    assert gemm_config(1, 64, 4096, split_k=64).split_k == 32        # never an empty split
    assert gemm_config(1, 64, 4096, split_k=6).split_k == 6          # cdiv(32, 6) = 6 -> 6 splits
    assert gemm_config(1, 64, 640, split_k=6).k_tiles == 5           # bk 128: 5 tiles
    assert gemm_config(1, 64, 640, split_k=4).split_k == 3           # kps 2 -> 3 non-empty splits
    assert gemm_config(1, 4096, 4096, a_itemsize=4, b_itemsize=4).block_k == 64   # f32: 16 KB tile
    # 64 f32 rows with a narrow N: the automatic bk is halved until 3 staged buffers fit 128 KB
    c = gemm_config(64, 16, 4096, a_itemsize=4, b_itemsize=4)
    assert c.smem_bytes <= 128 * 1024 and c.block_k == 128, c
    assert gemm_config(64, 16, 4096, a_itemsize=4, b_itemsize=4, block_k=256).block_k == 256


def _names(res):
    return [k.name for k in res.triton_kernels]


@pytest.mark.parametrize("m,k,n,split", [(1, 2048, 256, None), (5, 1000, 200, 3), (16, 640, 96, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_k_physical(m, k, n, split, dtype):
    """Split-K (auto for 1x2048x256: 4 N tiles -> 2 (bf16, bk 128) or 4 (f32, bk 64) splits of 8
    K tiles; forced uneven splits otherwise, the last split reading masked zeros past K): equal to
    the reference. Operands are uniform in [0, 1): a K = 2048 sum of signed normals cancels to
    values whose f32 rounding differs by more than 1e-5 relative between any two summation orders,
    split or not; positive terms keep the check at 1e-5 honest."""
    a = jnp.asarray(np.random.default_rng(0).random((m, k)), dtype)
    b = jnp.asarray(np.random.default_rng(1).random((k, n)), dtype)
    res = check_kernel(functools.partial(matmul, dimension_numbers=MM, split_k=split), ref_dot,
                       (a, b), **(F32 if dtype == jnp.float32 else B16))
    assert _names(res) == ["vtc_matmul_splitk", "vtc_matmul_reduce"]
    main, red = res.triton_kernels
    assert (main.num_stages, red.num_stages) == (4, 1)


def test_split_k_epilogue_applied_once_after_the_sum():
    """bias + relu + residual: wrong if applied per split (relu of partial sums, bias S times)."""
    m, k, n = 3, 512, 80
    dt = jnp.bfloat16

    def call(a, b, bias, res_, *, backend):
        return matmul(a, b, dimension_numbers=MM, split_k=4, epilogue=lambda acc, bi, r: jnp.maximum(
            acc + bi.astype(jnp.float32), 0.0) + r.astype(jnp.float32), epilogue_args=(bias, res_),
            backend=backend)

    def ref(a, b, bias, res_):
        y = lax.dot_general(a, b, MM, precision=HI, preferred_element_type=jnp.float32)
        return (jnp.maximum(y + bias.astype(jnp.float32), 0.0) + res_.astype(jnp.float32)).astype(dt)

    args = (rand((m, k), dt), rand((k, n), dt, seed=1), rand((n,), dt, seed=2), rand((m, n), dt, seed=3))
    res = check_kernel(call, ref, args, **B16)
    assert _names(res) == ["vtc_matmul_splitk", "vtc_matmul_reduce"]


@pytest.mark.parametrize("s", [1, 3])
def test_split_k_qkv_virtual_writes_at_pos(s):
    """The decode QKV projection with split-K: the reduce kernel alone writes Q and the K/V caches
    at runtime ``pos`` (in place: the caches are aliased to the reduce kernel's outputs)."""
    res = check_kernel(*_qkv_problem(s, 512, block_n=16, split_k=4), **F32)
    assert _names(res) == ["vtc_matmul_splitk", "vtc_matmul_reduce"]
    # only the reduce kernel aliases buffers: the two caches (its operands 1 and 2)
    assert res.text.count("output_operand_alias<") == 2, res.text.count("output_operand_alias<")


def test_split_k_batch_dims():
    """Batch tiles and splits share grid axis 0 (b * S + s)."""
    dn = (((2,), (1,)), ((0,), (0,)))
    a, b = rand((3, 4, 300)), rand((3, 300, 40), seed=1)
    res = check_kernel(functools.partial(matmul, dimension_numbers=dn, split_k=3),
                       lambda a, b: ref_dot(a, b, dn), (a, b), **F32)
    assert np.prod(res.triton_kernels[0].grid) == 3 * 3


@pytest.mark.offline
def test_decode_split_k_compiles_sm90_pipelined_no_spills():
    """Llama-3-8B QKV / w_o / gate_up decode GEMMs (bf16, M = 1 and 16) compiled offline for sm_90:
    the main loop keeps >= 2 K tiles in flight (``cp.async.wait_group N``, N >= 1), no spills,
    shared memory within the limit; the grids are the modelled ones."""
    import re

    from vtc_jax.offline import SMEM_LIMIT, compile_lowered, format_table
    from vtc_jax.testing import cross_lower

    for m, n in [(1, 6144), (16, 6144), (1, 4096), (16, 4096), (16, 28672)]:
        sds = (jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, n), jnp.bfloat16))
        mod = cross_lower(functools.partial(matmul, dimension_numbers=MM, backend="triton"), *sds)
        cfg = gemm_config(m, n, 4096)
        results = compile_lowered(mod, arch="9.0")
        table = format_table(results)
        assert [k.name for k in mod.triton_kernels] == (
            ["vtc_matmul_splitk", "vtc_matmul_reduce"] if cfg.split_k > 1 else ["vtc_matmul"]), table
        assert np.prod(mod.triton_kernels[0].grid) == cfg.ctas >= 2 * NUM_SMS
        for r in results:
            assert r.cubin_ok and not r.spills and r.smem_bytes <= SMEM_LIMIT["sm_90"], table
        main = results[0]
        assert main.num_stages == 4, table
        waits = [int(x) for x in re.findall(r"cp\.async\.wait_group\s+(\d+)", main.ptx)]
        assert max(waits) >= 1, waits


def test_in_bounds_tiles_load_without_masks():
    """Tile origins the template proves in range (tiling.InBounds: block divides the size, tile
    index < tiles) get no bounds mask: at 16x4096x6144 every load of the split-K kernel is
    unmasked (Triton IR ``tt.load %ptr`` with no mask/other operands) and the kernel has no
    ``arith.select``; at M = 1 the weight tile load is still unmasked (the one-row activation
    and the workspace row keep their M masks)."""
    import re

    from vtc_jax.testing import cross_lower, triton_ir_text

    def loads(m):
        sds = (jax.ShapeDtypeStruct((m, 4096), jnp.bfloat16),
               jax.ShapeDtypeStruct((4096, 6144), jnp.bfloat16))
        mod = cross_lower(functools.partial(matmul, dimension_numbers=MM, backend="triton"), *sds)
        text = triton_ir_text(mod.triton_kernels[0].ir)
        return text, [ln for ln in text.splitlines() if "tt.load" in ln]

    text, lds = loads(16)
    assert lds and all(re.search(r"tt\.load %\w+ :", ln) for ln in lds), lds
    assert "arith.select" not in text
    _, lds = loads(1)
    weights = [ln for ln in lds if "tensor<128x64x!tt.ptr<bf16>>" in ln]
    assert weights and all(re.search(r"tt\.load %\w+ :", ln) for ln in weights), lds


@pytest.mark.parametrize("split_k", [None, 3])
def test_prologue_on_both_operands(split_k):
    """``prologue=(fa, fb)``: a ReLU on the lhs tiles and a scaled tanh on the transposed rhs
    tiles, applied after the load (ragged M/N/K edges: 0 maps to 0 on both sides), with and
    without split-K; interpret and Triton IR."""
    m, k, n = 5 if split_k else 33, 100, 40

    def call(a, bt, *, backend):
        b = VTensor(Layout.physical(0, bt.shape).transpose((1, 0)), bt.dtype, (bt,))
        return matmul(a, b, dimension_numbers=MM, backend=backend, split_k=split_k,
                      prologue=(jax.nn.relu, lambda y: jnp.tanh(y) * 2.0))

    def ref(a, bt):
        return ref_dot(jax.nn.relu(a), jnp.tanh(bt.T) * 2.0)

    check_kernel(call, ref, (rand((m, k)), rand((n, k), seed=1)), **F32)


def test_prologue_that_moves_zero_on_one_side():
    """``a + 1`` maps 0 to 1: allowed on one operand, since the other's masked K lanes are 0 and
    the products of the padding vanish (ragged K = 100)."""
    m, k, n = 20, 100, 24
    call = lambda a, b, *, backend: matmul(a, b, dimension_numbers=MM, backend=backend,
                                           prologue=(lambda x: x + 1.0, None))
    check_kernel(call, lambda a, b: ref_dot(a + 1.0, b), (rand((m, k)), rand((k, n), seed=1)), **F32)


@pytest.mark.parametrize("split_k", [None, 4])
def test_prologue_that_widens_the_dtype(split_k):
    """``prologue_dtypes``: bf16 tiles cast to f32 in registers (``v.astype(f32) @ k`` on bf16
    values) — the dot computes in f32, as ``lax.dot_general`` on the cast operands does, and the
    kernel loads 2-byte tiles; ragged edges, with and without split-K; interpret and Triton IR."""
    m, k, n = 5 if split_k else 33, 100, 40
    f32 = lambda t: t.astype(jnp.float32)   # noqa: E731
    call = lambda a, b, *, backend: matmul(a, b, dimension_numbers=MM, backend=backend, split_k=split_k,
                                           prologue=(f32, None), prologue_dtypes=(jnp.float32, None))
    a, b = rand((m, k)).astype(jnp.bfloat16), rand((k, n), seed=1)
    out = check_kernel(call, lambda a, b: ref_dot(a.astype(jnp.float32), b), (a, b), **F32).output
    assert out.dtype == jnp.float32
