"""kernels/pointwise.py: the virtual-I/O matrix, ragged shapes, dtypes.

Every case goes through ``check_kernel``: interpret mode against a jnp reference AND a CUDA
cross-lowering that must contain Triton IR. Layouts are static, so each kernel call builds its
VTensors from the array arguments it receives.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vtc_jax.indexmap import Layout, SymInfo, sym
from vtc_jax.kernels.pointwise import choose_block, f32_math, pointwise
from vtc_jax.kernels.vio import VTensor
from vtc_jax.testing import check_kernel

TOL = {jnp.float32: dict(rtol=1e-6, atol=1e-6), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [jnp.float32, jnp.bfloat16]
M, N = 48, 100          # non-power-of-two on both axes
T = 80                  # cache length for the dynamic_update_slice cases


def rnd(i, shape, dtype):
    return jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype)


def fn(a, b):           # stage 2: untouched elementwise compute
    return a * b + jnp.tanh(a)


def phys(shape):
    return Layout.physical(0, shape)


def vt(layout, *bufs, symbols=()):
    return VTensor(layout, bufs[0].dtype, tuple(bufs), symbols)


def pos_slice(rows, cols, total):
    """Rows [pos, pos+rows) of a (total, cols) buffer: the dynamic_update_slice / KV-cache window."""
    return Layout.physical(0, (total, cols)).dynamic_slice(
        [sym("pos"), 0], (rows, cols), syms=[SymInfo("pos", 0, total - rows)])


# --------------------------------------------------------------------------------------------
# Read side: the first operand of fn is virtual, the second physical; output fresh.
# Each case: (args maker, VTensor builder, reference of the logical (M, N) operand).
# --------------------------------------------------------------------------------------------

READ = {
    "physical": (lambda d: (rnd(1, (M, N), d),),
                 lambda x: x,
                 lambda x: x),
    "transposed": (lambda d: (rnd(1, (N, M), d),),
                   lambda xt: vt(phys((N, M)).transpose((1, 0)), xt),
                   lambda xt: xt.T),
    "slice": (lambda d: (rnd(1, (M + 5, N + 7), d),),
              lambda big: vt(phys(big.shape).slice((2, 3), (2 + M, 3 + N)), big),
              lambda big: big[2:2 + M, 3:3 + N]),
    "split_piece": (lambda d: (rnd(1, (M, 2 * N), d),),   # second output of split(x, 2, axis=1)
                    lambda xs: vt(phys(xs.shape).slice((0, N), (M, 2 * N)), xs),
                    lambda xs: xs[:, N:]),
    "strided_slice": (lambda d: (rnd(1, (2 * M, N), d),),  # x[::2]: non-unit stride, gather path
                      lambda big: vt(phys(big.shape).slice((0, 0), (2 * M, N), (2, 1)), big),
                      lambda big: big[::2]),
    "reshape": (lambda d: (rnd(1, (M * N,), d),),
                lambda flat: vt(phys((M * N,)).reshape((M, N)), flat),
                lambda flat: flat.reshape(M, N)),
    "broadcast_bias": (lambda d: (rnd(1, (N,), d),),
                       lambda bias: vt(phys((N,)).broadcast((M, N), (1,)), bias),
                       lambda bias: jnp.broadcast_to(bias, (M, N))),
    # concat pieces: piece boundaries on block boundaries with READ_BLOCK (the pl.ds path for
    # every piece); test_read_concat_default_blocks straddles them (vio's gather path)
    "concat_pieces": (lambda d: (rnd(1, (M, 32), d), rnd(2, (M, N - 32), d)),
                      lambda a, b: vt(Layout.concatenate([Layout.physical(0, a.shape),
                                                          Layout.physical(1, b.shape)], 1), a, b),
                      lambda a, b: jnp.concatenate([a, b], 1)),
    "concat_axis0": (lambda d: (rnd(1, (16, N), d), rnd(2, (M - 16, N), d)),
                     lambda a, b: vt(Layout.concatenate([Layout.physical(0, a.shape),
                                                         Layout.physical(1, b.shape)], 0), a, b),
                     lambda a, b: jnp.concatenate([a, b], 0)),
    "pad": (lambda d: (rnd(1, (M, N - 4), d),),
            lambda x: vt(phys(x.shape).pad((0, 1), (0, 3), (0, 0), 0.0), x),
            lambda x: jnp.pad(x, ((0, 0), (1, 3)))),
    "dynamic_slice_at_pos": (lambda d: (rnd(1, (T, N), d), jnp.int32(13)),
                             lambda c, pos: vt(pos_slice(M, N, T), c, symbols=(("pos", pos),)),
                             lambda c, pos: lax.dynamic_slice(c, (pos, 0), (M, N))),
}


READ_BLOCK = {"concat_pieces": (16, 32), "concat_axis0": (16, 128)}


def check_read(case, dtype, block=None):
    make, build, logical = READ[case]
    args = make(dtype) + (rnd(9, (M, N), dtype),)

    def kernel(*args, backend):
        *xs, y = args
        return pointwise(fn, [build(*xs), y], block=block, backend=backend)

    def ref(*args):
        *xs, y = args
        return fn(logical(*xs), y)

    return check_kernel(kernel, ref, args, **TOL[dtype], name=f"pointwise read {case}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(READ))
def test_read_side(case, dtype):
    check_read(case, dtype, READ_BLOCK.get(case))


def test_read_concat_default_blocks():
    """Default blocks (16, 128) straddle the piece boundary at column 32: a piece starting after
    the block origin (negative window start) goes through vio's gather path."""
    check_read("concat_pieces", jnp.float32, None)


# --------------------------------------------------------------------------------------------
# Write side: physical inputs, the output is virtual.
# --------------------------------------------------------------------------------------------

def _qkv_layout(n):
    """(M, 3n) output onto Q (fresh), K cache rows [pos, pos+M) and V cache rows [pos, pos+M)."""
    return Layout.concatenate([Layout.physical(0, (M, n)),
                               Layout.physical(1, (T, n)).dynamic_slice(
                                   [sym("pos"), 0], (M, n), syms=[SymInfo("pos", 0, T - M)]),
                               Layout.physical(2, (T, n)).dynamic_slice(
                                   [sym("pos"), 0], (M, n), syms=[SymInfo("pos", 0, T - M)])], 1)


def test_write_layouts_are_what_they_claim():
    assert len(_qkv_layout(20).pieces) == 3
    assert len(pos_slice(M, N, T).pieces[0].map.syms) == 1


WRITE_N = 96   # qkv: three 32-wide pieces; concat: 32 | 64
N1 = 32
# Explicit blocks keep every piece boundary on a block boundary; the default blocks (16, 128)
# straddle them: see test_write_default_blocks.
WRITE_BLOCK = {"concat_two_buffers": (16, 32), "qkv_three_tensors": (16, 32)}


def _write_case(case, x, y, extra, backend, block=None):
    d = x.dtype
    kw = dict(block=block, backend=backend)
    if case == "fresh":
        return pointwise(fn, [x, y], **kw)
    if case == "transposed":
        out = vt(phys((x.shape[1], x.shape[0])).transpose((1, 0)),
                 jax.ShapeDtypeStruct((x.shape[1], x.shape[0]), d))
        return pointwise(fn, [x, y], outs=out, **kw)
    if case == "concat_two_buffers":
        out = vt(Layout.concatenate([Layout.physical(0, (M, N1)),
                                     Layout.physical(1, (M, WRITE_N - N1))], 1),
                 jax.ShapeDtypeStruct((M, N1), d), jax.ShapeDtypeStruct((M, WRITE_N - N1), d))
        return pointwise(fn, [x, y], outs=out, **kw)
    if case == "dus_at_pos":
        cache, pos = extra
        out = vt(pos_slice(M, WRITE_N, T), cache, symbols=(("pos", pos),))
        return pointwise(fn, [x, y], outs=out, **kw)
    if case == "qkv_three_tensors":
        kc, vc, pos = extra
        n = WRITE_N // 3
        out = vt(_qkv_layout(n), jax.ShapeDtypeStruct((M, n), d), kc, vc, symbols=(("pos", pos),))
        return pointwise(fn, [x, y], outs=out, **kw)
    raise AssertionError(case)


def _write_ref(case, x, y, extra):
    r = fn(x, y)
    if case == "fresh":
        return r
    if case == "transposed":
        return r.T
    if case == "concat_two_buffers":
        return (r[:, :N1], r[:, N1:])
    if case == "dus_at_pos":
        cache, pos = extra
        return lax.dynamic_update_slice(cache, r, (pos, 0))
    if case == "qkv_three_tensors":
        kc, vc, pos = extra
        n = WRITE_N // 3
        return (r[:, :n], lax.dynamic_update_slice(kc, r[:, n:2 * n], (pos, 0)),
                lax.dynamic_update_slice(vc, r[:, 2 * n:], (pos, 0)))
    raise AssertionError(case)


WRITE = ["fresh", "transposed", "concat_two_buffers", "dus_at_pos", "qkv_three_tensors"]


def check_write(case, dtype, block=None):
    x, y = rnd(1, (M, WRITE_N), dtype), rnd(2, (M, WRITE_N), dtype)
    pos = jnp.int32(21)
    extra = {"dus_at_pos": (rnd(3, (T, WRITE_N), dtype), pos),
             "qkv_three_tensors": (rnd(4, (T, WRITE_N // 3), dtype),
                                   rnd(5, (T, WRITE_N // 3), dtype), pos)}.get(case, ())
    return check_kernel(lambda x, y, extra, backend: _write_case(case, x, y, extra, backend, block),
                   lambda x, y, extra: _write_ref(case, x, y, extra),
                   (x, y, extra), **TOL[dtype], name=f"pointwise write {case}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", WRITE)
def test_write_side(case, dtype):
    res = check_write(case, dtype, WRITE_BLOCK.get(case))
    if case in ("dus_at_pos", "qkv_three_tensors"):
        # the caches are outputs aliased onto inputs: written in place, not rebuilt
        assert "output_operand_aliases" in res.text


@pytest.mark.parametrize("case", ["concat_two_buffers", "qkv_three_tensors"])
def test_write_default_blocks(case):
    """Default blocks straddle the piece boundaries: pieces after the first are scattered."""
    check_write(case, jnp.float32, None)


# ---- vio cases these tests found (extent-1 pieces, pad value on exact-fit blocks) ----------

@pytest.mark.parametrize("axis", [0, 1])
def test_write_concat_of_extent1_pieces(axis):
    shape = (2, 1) if axis == 0 else (1, 2)
    x = rnd(1, shape, jnp.float32)
    two = Layout.concatenate([Layout.physical(0, (1, 1)), Layout.physical(1, (1, 1))], axis)
    S = jax.ShapeDtypeStruct

    def kernel(x, backend):
        out = vt(two, S((1, 1), x.dtype), S((1, 1), x.dtype))
        return pointwise(jnp.tanh, [x], outs=out, backend=backend)

    check_kernel(kernel, lambda x: tuple(jnp.split(jnp.tanh(x), 2, axis)), (x,), **TOL[jnp.float32])


def test_read_pad_nonzero_value_exact_block():
    x = rnd(1, (16, 124), jnp.float32)

    def kernel(x, backend):
        return pointwise(jnp.tanh, [vt(phys(x.shape).pad((0, 0), (0, 4), (0, 0), 2.0), x)],
                         backend=backend)

    check_kernel(kernel, lambda x: jnp.tanh(jnp.pad(x, ((0, 0), (0, 4)), constant_values=2.0)), (x,),
                 **TOL[jnp.float32])


# --------------------------------------------------------------------------------------------
# Shapes, broadcasting of plain arrays, scalars, several outputs
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (3,), (100,), (3000,), (1, 1), (1, 100), (3, 48), (96, 3),
                                   (100, 300), (2, 3, 100), (3, 5, 1, 7), (5, 3, 48, 130)], ids=str)
def test_shapes_f32(shape):
    x, y = rnd(1, shape, jnp.float32), rnd(2, shape, jnp.float32)
    check_kernel(lambda x, y, backend: pointwise(fn, [x, y], backend=backend), fn, (x, y),
          **TOL[jnp.float32])


@pytest.mark.parametrize("shape", [(3,), (48, 96), (2, 3, 100)], ids=str)
def test_shapes_bf16(shape):
    x, y = rnd(1, shape, jnp.bfloat16), rnd(2, shape, jnp.bfloat16)
    check_kernel(lambda x, y, backend: pointwise(fn, [x, y], backend=backend), fn, (x, y),
                 **TOL[jnp.bfloat16])


def test_rank0():
    x, y = jnp.float32(1.5), jnp.float32(-2.0)
    check_kernel(lambda x, y, backend: pointwise(fn, [x, y], backend=backend), fn, (x, y),
                 **TOL[jnp.float32])


@pytest.mark.parametrize("bshape", [(N,), (M, 1), (1, N), (), (1,)], ids=str)
def test_plain_array_broadcasting(bshape):
    x, b = rnd(1, (M, N), jnp.float32), rnd(2, bshape, jnp.float32)
    check_kernel(lambda x, b, backend: pointwise(fn, [x, b], backend=backend), fn, (x, b),
                 **TOL[jnp.float32])


def test_both_operands_broadcast_and_python_scalar():
    col, row = rnd(1, (M, 1), jnp.float32), rnd(2, (N,), jnp.float32)
    f = lambda a, s, b: a * s - b
    check_kernel(lambda c, r, backend: pointwise(f, [c, 3.0, r], backend=backend),
                 lambda c, r: f(c, 3.0, r), (col, row), **TOL[jnp.float32])


def test_several_outputs_and_out_dtypes():
    x, y = rnd(1, (M, N), jnp.bfloat16), rnd(2, (M, N), jnp.bfloat16)
    f = lambda a, b: (a + b, (a * b).astype(jnp.float32), a > b)
    check_kernel(lambda x, y, backend: pointwise(f, [x, y], backend=backend), f, (x, y),
                 **TOL[jnp.bfloat16])
    g = lambda a, b: (a + b, a - b)
    check_kernel(lambda x, y, backend: pointwise(g, [x, y], out_dtypes=jnp.float32, backend=backend),
                 lambda x, y: tuple(v.astype(jnp.float32) for v in g(x, y)), (x, y),
                 **TOL[jnp.bfloat16])


def test_virtual_in_virtual_out_together():
    """Transposed bf16 input + bias VTensor, output into a KV-cache-like buffer at pos."""
    xt, bias, cache = rnd(1, (N, M), jnp.bfloat16), rnd(2, (N,), jnp.bfloat16), rnd(3, (T, N), jnp.bfloat16)
    pos = jnp.int32(5)

    def kernel(xt, bias, cache, pos, backend):
        x = vt(phys((N, M)).transpose((1, 0)), xt)
        b = vt(phys((N,)).broadcast((M, N), (1,)), bias)
        out = vt(pos_slice(M, N, T), cache, symbols=(("pos", pos),))
        return pointwise(fn, [x, b], outs=out, backend=backend)

    check_kernel(kernel, lambda xt, b, c, p: lax.dynamic_update_slice(c, fn(xt.T, b), (p, 0)),
                 (xt, bias, cache, pos), **TOL[jnp.bfloat16])


def test_bf16_math_that_triton_cannot_do_in_bf16():
    """silu (logistic), tanh soft-capping, division, gelu-tanh in bf16: without f32_math the
    division does not lower and tanh/log1p fail Triton's LLVM step (see the offline test)."""
    x, y = rnd(1, (M, N), jnp.bfloat16), rnd(2, (M, N), jnp.bfloat16)
    f = lambda a, b: (jax.nn.silu(a) * b, 30.0 * jnp.tanh(a / 30.0), jax.nn.gelu(b), jnp.log1p(a * a))
    check_kernel(lambda x, y, backend: pointwise(f, [x, y], backend=backend), f, (x, y),
          **TOL[jnp.bfloat16])
    with pytest.raises(Exception, match="unsupported types"):
        check_kernel(lambda x, y, backend: pointwise(lambda a, b: a / b, [x, y], upcast_math=False,
                                              backend=backend), lambda a, b: a / b, (x, y),
              **TOL[jnp.bfloat16])


def test_f32_math_rounds_per_op():
    x = rnd(1, (8,), jnp.bfloat16)
    g = f32_math(lambda a: jax.jit(lambda u: jnp.tanh(u) / 3)(a) + 1)
    jaxpr = str(jax.make_jaxpr(g)(x))
    assert "tanh" in jaxpr and "f32" in jaxpr and "jit[" not in jaxpr
    np.testing.assert_array_equal(np.asarray(g(x), np.float32),
                                  np.asarray(jnp.tanh(x) / 3 + 1, np.float32))
    y = rnd(1, (8,), jnp.float32)
    assert "convert_element_type" not in str(jax.make_jaxpr(g)(y))


def test_explicit_block_and_choose_block():
    assert choose_block((M, N)) == (16, 128)
    assert choose_block((M, 300), itemsize=2) == (8, 256)
    assert choose_block((2, 3, 100)) == (2, 4, 128)
    assert choose_block((64, 2, 100)) == (8, 2, 128)
    assert choose_block((100, 3, 5, 1000)) == (1, 2, 8, 128)
    assert choose_block((100000,)) == (1024,)
    x, y = rnd(1, (M, N), jnp.float32), rnd(2, (M, N), jnp.float32)
    res = check_kernel(lambda x, y, backend: pointwise(fn, [x, y], block=(8, 32), backend=backend),
                       fn, (x, y), **TOL[jnp.float32])
    [k] = res.triton_kernels
    assert k.grid == (6 * 4, 1, 1)
    with pytest.raises(ValueError, match="powers of two"):
        pointwise(fn, [x, y], block=(8, 48))


def test_rejects_non_elementwise_fn_and_broadcasts_scalar_results():
    x = rnd(1, (M, N), jnp.float32)
    with pytest.raises(ValueError, match="elementwise"):
        pointwise(lambda a: a.sum(0), [x])
    f = lambda a: (a + 1, jnp.float32(2.5))       # a constant output (re-bound cluster ops)
    check_kernel(lambda x, backend: pointwise(f, [x], backend=backend),
                 lambda x: (x + 1, jnp.full(x.shape, 2.5, jnp.float32)), (x,), **TOL[jnp.float32])


# --------------------------------------------------------------------------------------------
# Rung 2b: the default configurations compile to cubin for sm_90 without spills
# --------------------------------------------------------------------------------------------

@pytest.mark.offline
def test_default_configs_compile_for_sm90():
    from vtc_jax.offline import SMEM_LIMIT, compile_lowered, format_table
    from vtc_jax.testing import cross_lower

    S = jax.ShapeDtypeStruct
    cases = [
        (lambda x, y: pointwise(fn, [x, y], backend="triton"),
         (S((1000, 1000), jnp.float32), S((1000, 1000), jnp.float32))),
        (lambda x, y: pointwise(fn, [x, y], backend="triton"),
         (S((4, 1000, 1000), jnp.bfloat16), S((1000,), jnp.bfloat16))),
        (lambda x, y: pointwise(fn, [vt(phys((512, 1024)).transpose((1, 0)), x), y], backend="triton"),
         (S((512, 1024), jnp.bfloat16), S((1024, 512), jnp.bfloat16))),
        (lambda x, y: pointwise(lambda a, b: (jax.nn.silu(a) * b, 30.0 * jnp.tanh(a / 30.0)), [x, y],
                                backend="triton"),
         (S((4096, 1024), jnp.bfloat16), S((4096, 1024), jnp.bfloat16))),
        (lambda x, y, c, p: _write_case("qkv_three_tensors", x, y, (c, c, p), "triton"),
         (S((M, WRITE_N), jnp.bfloat16), S((M, WRITE_N), jnp.bfloat16),
          S((T, WRITE_N // 3), jnp.bfloat16), S((), jnp.int32))),
    ]
    results = []
    for f, sds in cases:
        results += compile_lowered(cross_lower(f, *sds))
    table = format_table(results)
    for r in results:
        assert r.cubin_ok, table
        assert not r.spills, table
        assert r.smem_bytes <= SMEM_LIMIT["sm_90"], table


def test_index_args_give_the_block_indices():
    """``index_args=True``: ``fn`` also receives the output indices of its block (int32, one array
    per dim), ragged edges included — an iota computed in registers (the island template's
    ``Index`` step); interpret and Triton IR."""
    shape = (5, 3, 70)

    def call(x, *, backend):
        return pointwise(lambda v, i, j, k: v * 2.0 + (i * 1000 + j * 100 + k).astype(v.dtype), [x],
                         backend=backend, index_args=True)

    def ref(x):
        i, j, k = np.indices(shape)
        return x * 2.0 + jnp.asarray(i * 1000 + j * 100 + k, jnp.float32)

    check_kernel(call, ref, (jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32),),
                 rtol=1e-6, atol=1e-6)
