"""kernels/reduction.py: the virtual-I/O matrix, ragged shapes, long rows, dtypes.

Every case goes through ``check_kernel``: interpret mode against a jnp reference (computed in f32,
cast to the output dtype) AND a CUDA cross-lowering that must contain Triton IR.
"""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

from vtc_jax.indexmap import Layout, SymInfo, sym
from vtc_jax.kernels import reduction as R
from vtc_jax.kernels.reduction import Stat, choose_row_blocks, row_reduce
from vtc_jax.kernels.vio import VTensor
from vtc_jax.testing import check_kernel

TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [jnp.float32, jnp.bfloat16]
DT_IDS = ["f32", "bf16"]
M, N = 48, 100
T = 80


def rnd(i, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype)


def f32(x):
    return x.astype(jnp.float32)


def phys(shape):
    return Layout.physical(0, shape)


def vt(layout, *bufs, symbols=()):
    return VTensor(layout, bufs[0].dtype, tuple(bufs), symbols)


def pos_slice(rows, cols, total):
    return Layout.physical(0, (total, cols)).dynamic_slice(
        [sym("pos"), 0], (rows, cols), syms=[SymInfo("pos", 0, total - rows)])


# ---- references: f32 math, result in the input dtype -------------------------------------

def softmax_ref(x, axis=-1):
    return jax.nn.softmax(f32(x), axis=axis).astype(x.dtype)


def sum_ref(x, axis=-1, keepdims=False):
    return jnp.sum(f32(x), axis=axis, keepdims=keepdims).astype(x.dtype)


def max_ref(x, axis=-1, keepdims=False):
    return jnp.max(x, axis=axis, keepdims=keepdims)


def mean_ref(x, axis=-1, keepdims=False):
    return jnp.mean(f32(x), axis=axis, keepdims=keepdims).astype(x.dtype)


def rms_ref(x, w, eps=1e-6):
    x32 = f32(x)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * f32(w)).astype(x.dtype)


def ln_ref(x, w, b, eps=1e-5):
    x32 = f32(x)
    m = x32.mean(-1, keepdims=True)
    v = ((x32 - m) ** 2).mean(-1, keepdims=True)
    return ((x32 - m) * lax.rsqrt(v + eps) * f32(w) + f32(b)).astype(x.dtype)


OPS = {  # name: (kernel(x, **kw), reference(x))
    "softmax": (R.softmax, softmax_ref),
    "sum": (R.reduce_sum, sum_ref),
}


# --------------------------------------------------------------------------------------------
# Read side: the reduced input is virtual; output fresh.
# --------------------------------------------------------------------------------------------

READ = {
    "physical": (lambda d: (rnd(1, (M, N), d),), lambda x: x, lambda x: x),
    "transposed": (lambda d: (rnd(1, (N, M), d),),          # the row is a physical column
                   lambda xt: vt(phys((N, M)).transpose((1, 0)), xt), lambda xt: xt.T),
    "slice": (lambda d: (rnd(1, (M + 5, N + 7), d),),
              lambda big: vt(phys(big.shape).slice((2, 3), (2 + M, 3 + N)), big),
              lambda big: big[2:2 + M, 3:3 + N]),
    "split_piece": (lambda d: (rnd(1, (M, 2 * N), d),),
                    lambda xs: vt(phys(xs.shape).slice((0, N), (M, 2 * N)), xs),
                    lambda xs: xs[:, N:]),
    "strided_slice": (lambda d: (rnd(1, (M, 2 * N), d),),  # x[:, ::2]: gather path
                      lambda big: vt(phys(big.shape).slice((0, 0), (M, 2 * N), (1, 2)), big),
                      lambda big: big[:, ::2]),
    "reshape": (lambda d: (rnd(1, (M * N,), d),),
                lambda flat: vt(phys((M * N,)).reshape((M, N)), flat),
                lambda flat: flat.reshape(M, N)),
    "broadcast_rows": (lambda d: (rnd(1, (N,), d),),       # the same row M times
                       lambda v: vt(phys((N,)).broadcast((M, N), (1,)), v),
                       lambda v: jnp.broadcast_to(v, (M, N))),
    "broadcast_along_row": (lambda d: (rnd(1, (M, 1), d),),  # a constant row
                            lambda v: vt(phys((M, 1)).broadcast((M, N), (0, 1)), v),
                            lambda v: jnp.broadcast_to(v, (M, N))),
    "concat_rows": (lambda d: (rnd(1, (16, N), d), rnd(2, (M - 16, N), d)),  # 16 = row block
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


def check_read(op, case, dtype, **kw):
    make, build, logical = READ[case]
    kernel_op, ref_op = OPS[op]
    args = make(dtype)
    return check_kernel(lambda *a, backend: kernel_op(build(*a), backend=backend, **kw),
                   lambda *a: ref_op(logical(*a)), args, **TOL[dtype], name=f"{op} read {case}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", list(READ))
def test_read_side_softmax(case, dtype):
    check_read("softmax", case, dtype)


@pytest.mark.parametrize("case", ["transposed", "strided_slice", "broadcast_along_row", "pad",
                                  "concat_rows", "dynamic_slice_at_pos"])
def test_read_side_sum(case):
    """The reduced-output path over the input layouts (the load code is shared with softmax)."""
    check_read("sum", case, jnp.float32)


READ_CONCAT_COLS = (lambda d: (rnd(1, (M, 32), d), rnd(2, (M, N - 32), d)),
                    lambda a, b: vt(Layout.concatenate([Layout.physical(0, a.shape),
                                                        Layout.physical(1, b.shape)], 1), a, b),
                    lambda a, b: jnp.concatenate([a, b], 1))
READ["concat_cols"] = READ_CONCAT_COLS   # the reduced row runs across two buffers


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op", list(OPS))
def test_read_concat_along_reduced_axis(op, dtype):
    """Row = [a | b]: column blocks of 32 (the looped path) keep blocks inside one piece."""
    check_read(op, "concat_cols", dtype, block_cols=32)


@pytest.mark.parametrize("op", list(OPS))
def test_read_concat_along_reduced_axis_whole_row(op):
    """A whole-row block straddles the piece boundary (vio's gather path for the second piece)."""
    check_read(op, "concat_cols", jnp.float32)


# --------------------------------------------------------------------------------------------
# Write side: physical input, the output is virtual.
# --------------------------------------------------------------------------------------------

WN = 96   # row length for the write cases: qkv = three 32-wide pieces


def _qkv_layout(n):
    return Layout.concatenate([Layout.physical(0, (M, n)),
                               Layout.physical(1, (T, n)).dynamic_slice(
                                   [sym("pos"), 0], (M, n), syms=[SymInfo("pos", 0, T - M)]),
                               Layout.physical(2, (T, n)).dynamic_slice(
                                   [sym("pos"), 0], (M, n), syms=[SymInfo("pos", 0, T - M)])], 1)


def _full_write(case, d, extra):
    """Output VTensor of logical shape (M, WN) for softmax / norms, and the reference packer."""
    if case == "fresh":
        return None, lambda r: r
    if case == "transposed":
        return (vt(phys((WN, M)).transpose((1, 0)), jax.ShapeDtypeStruct((WN, M), d)),
                lambda r: r.T)
    if case == "concat_two_buffers":
        return (vt(Layout.concatenate([Layout.physical(0, (M, 32)), Layout.physical(1, (M, WN - 32))], 1),
                   jax.ShapeDtypeStruct((M, 32), d), jax.ShapeDtypeStruct((M, WN - 32), d)),
                lambda r: (r[:, :32], r[:, 32:]))
    if case == "dus_at_pos":
        cache, pos = extra
        return (vt(pos_slice(M, WN, T), cache, symbols=(("pos", pos),)),
                lambda r: lax.dynamic_update_slice(cache, r, (pos, 0)))
    if case == "qkv_three_tensors":
        kc, vc, pos = extra
        n = WN // 3
        return (vt(_qkv_layout(n), jax.ShapeDtypeStruct((M, n), d), kc, vc, symbols=(("pos", pos),)),
                lambda r: (r[:, :n], lax.dynamic_update_slice(kc, r[:, n:2 * n], (pos, 0)),
                           lax.dynamic_update_slice(vc, r[:, 2 * n:], (pos, 0))))
    raise AssertionError(case)


def _extra(case, d):
    pos = jnp.int32(21)
    return {"dus_at_pos": (rnd(3, (T, WN), d), pos),
            "qkv_three_tensors": (rnd(4, (T, WN // 3), d), rnd(5, (T, WN // 3), d), pos)}.get(case, ())


FULL_WRITE = ["fresh", "transposed", "concat_two_buffers", "dus_at_pos", "qkv_three_tensors"]
# multi-piece outputs along the row: column blocks of 32 keep pieces block-aligned (looped path,
# pl.ds for every piece); test_write_whole_row_straddles_pieces covers the whole-row default
FULL_WRITE_KW = {"concat_two_buffers": dict(block_cols=32), "qkv_three_tensors": dict(block_cols=32)}


def check_full_write(case, dtype, op, **kw):
    x = rnd(1, (M, WN), dtype)
    w, b = rnd(7, (WN,), dtype), rnd(8, (WN,), dtype)
    extra = _extra(case, dtype)

    def kernel(x, w, b, extra, backend):
        out, _ = _full_write(case, x.dtype, extra)
        if op == "softmax":
            return R.softmax(x, out=out, backend=backend, **kw)
        return R.layer_norm(x, w, b, out=out, backend=backend, **kw)

    def ref(x, w, b, extra):
        r = softmax_ref(x) if op == "softmax" else ln_ref(x, w, b)
        return _full_write(case, x.dtype, extra)[1](r)

    return check_kernel(kernel, ref, (x, w, b, extra), **TOL[dtype], name=f"{op} write {case}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", FULL_WRITE)
def test_write_side_softmax(case, dtype):
    res = check_full_write(case, dtype, "softmax", **FULL_WRITE_KW.get(case, {}))
    if case in ("dus_at_pos", "qkv_three_tensors"):
        assert "output_operand_aliases" in res.text   # caches written in place


@pytest.mark.parametrize("case", ["dus_at_pos", "qkv_three_tensors"])
def test_write_side_layer_norm_bf16(case):
    check_full_write(case, jnp.bfloat16, "layer_norm", **FULL_WRITE_KW.get(case, {}))


@pytest.mark.parametrize("case", ["concat_two_buffers", "qkv_three_tensors"])
def test_write_whole_row_straddles_pieces(case):
    """Default whole-row blocks straddle the output pieces (scatter for the later pieces)."""
    check_full_write(case, jnp.float32, "softmax")


RED_WRITE = ["fresh", "concat_two_buffers", "dus_at_pos", "three_tensors"]


def _red_write(case, d, extra):
    """Output VTensor of logical shape (M,) for reduce_sum, and the reference packer."""
    if case == "fresh":
        return None, lambda r: r
    if case == "concat_two_buffers":   # rows 16 | 32: the row block is 16
        return (vt(Layout.concatenate([Layout.physical(0, (16,)), Layout.physical(1, (M - 16,))], 0),
                   jax.ShapeDtypeStruct((16,), d), jax.ShapeDtypeStruct((M - 16,), d)),
                lambda r: (r[:16], r[16:]))
    if case == "dus_at_pos":
        vec, pos = extra
        lay = Layout.physical(0, (T,)).dynamic_slice([sym("pos")], (M,), syms=[SymInfo("pos", 0, T - M)])
        return (vt(lay, vec, symbols=(("pos", pos),)),
                lambda r: lax.dynamic_update_slice(vec, r, (pos,)))
    if case == "three_tensors":        # rows 16 | 16 at pos | 16 at pos
        a, b, pos = extra
        dyn = lambda t: Layout.physical(t, (T,)).dynamic_slice([sym("pos")], (16,),
                                                               syms=[SymInfo("pos", 0, T - 16)])
        lay = Layout.concatenate([Layout.physical(0, (16,)), dyn(1), dyn(2)], 0)
        return (vt(lay, jax.ShapeDtypeStruct((16,), d), a, b, symbols=(("pos", pos),)),
                lambda r: (r[:16], lax.dynamic_update_slice(a, r[16:32], (pos,)),
                           lax.dynamic_update_slice(b, r[32:], (pos,))))
    raise AssertionError(case)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", RED_WRITE)
def test_write_side_reduced_output(case, dtype):
    x = rnd(1, (M, N), dtype)
    pos = jnp.int32(9)
    extra = {"dus_at_pos": (rnd(3, (T,), dtype), pos),
             "three_tensors": (rnd(4, (T,), dtype), rnd(5, (T,), dtype), pos)}.get(case, ())

    def kernel(x, extra, backend):
        return R.reduce_sum(x, out=_red_write(case, x.dtype, extra)[0], backend=backend)

    assert choose_row_blocks(M, N)[0] == 16
    check_kernel(kernel, lambda x, extra: _red_write(case, x.dtype, extra)[1](sum_ref(x)), (x, extra),
          **TOL[dtype], name=f"reduce_sum write {case}")


# --------------------------------------------------------------------------------------------
# Every wrapper, both dtypes; axes, keepdims, ranks; ragged shapes; long rows
# --------------------------------------------------------------------------------------------

WRAPPERS = {
    "reduce_sum": (lambda x, **kw: R.reduce_sum(x, **kw), sum_ref),
    "reduce_max": (lambda x, **kw: R.reduce_max(x, **kw), max_ref),
    "mean": (lambda x, **kw: R.mean(x, **kw), mean_ref),
    "softmax": (lambda x, **kw: R.softmax(x, **kw), softmax_ref),
    "rms_norm": (lambda x, **kw: R.rms_norm(x, rnd(7, x.shape[-1:], x.dtype), 1e-6, **kw),
                 lambda x: rms_ref(x, rnd(7, x.shape[-1:], x.dtype))),
    "layer_norm": (lambda x, **kw: R.layer_norm(x, rnd(7, x.shape[-1:], x.dtype),
                                                rnd(8, x.shape[-1:], x.dtype), 1e-5, **kw),
                   lambda x: ln_ref(x, rnd(7, x.shape[-1:], x.dtype), rnd(8, x.shape[-1:], x.dtype))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("op", list(WRAPPERS))
def test_wrappers(op, dtype):
    k, ref = WRAPPERS[op]
    check_kernel(lambda x, backend: k(x, backend=backend), ref, (rnd(1, (M, N), dtype),), **TOL[dtype])


@pytest.mark.parametrize("shape,op", [((1, 1), "reduce_sum"), ((3, 1), "softmax"), ((1, 3), "layer_norm"),
                                      ((3, 48), "softmax"), ((96, 100), "layer_norm"),
                                      ((100, 96), "reduce_sum"), ((1, 100), "softmax"),
                                      ((3,), "layer_norm"), ((100,), "softmax")], ids=str)
def test_ragged_shapes(shape, op):
    k, ref = WRAPPERS[op]
    check_kernel(lambda x, backend: k(x, backend=backend), ref, (rnd(1, shape),), **TOL[jnp.float32],
          name=f"{op} {shape}")


@pytest.mark.parametrize("op,axis,keepdims", [("reduce_sum", 0, False), ("reduce_max", 1, True),
                                              ("mean", 2, False), ("mean", 0, True)])
def test_axes_rank3(op, axis, keepdims):
    k = {"reduce_sum": R.reduce_sum, "reduce_max": R.reduce_max, "mean": R.mean}[op]
    ref = {"reduce_sum": sum_ref, "reduce_max": max_ref, "mean": mean_ref}[op]
    check_kernel(lambda x, backend: k(x, axis, keepdims=keepdims, backend=backend),
          lambda x: ref(x, axis, keepdims), (rnd(1, (3, 48, 5)),), **TOL[jnp.float32])


def test_softmax_rank3_axis1_and_clean_flatten():
    check_kernel(lambda x, backend: R.softmax(x, axis=1, backend=backend), lambda x: softmax_ref(x, 1),
          (rnd(1, (3, 5, 100)),), **TOL[jnp.float32])
    # (1, 48, 100) flattens cleanly to (48, 100) rows: one grid dim, 3 programs of 16 rows
    res = check_kernel(lambda x, backend: R.softmax(x, backend=backend), softmax_ref,
                (rnd(1, (1, M, N)),), **TOL[jnp.float32])
    assert res.triton_kernels[0].grid == (3, 1, 1)


def test_rank1_reduction_to_scalar():
    check_kernel(lambda x, backend: R.reduce_sum(x, backend=backend), sum_ref, (rnd(1, (100,)),),
          **TOL[jnp.float32])
    check_kernel(lambda x, backend: R.reduce_max(x, keepdims=True, backend=backend),
          lambda x: max_ref(x, keepdims=True), (rnd(1, (100,)),), **TOL[jnp.float32])


@pytest.mark.parametrize("op,dtype", [("softmax", jnp.float32), ("softmax", jnp.bfloat16),
                                      ("layer_norm", jnp.float32), ("layer_norm", jnp.bfloat16),
                                      ("rms_norm", jnp.bfloat16), ("reduce_sum", jnp.float32),
                                      ("reduce_max", jnp.bfloat16)], ids=str)
def test_looped_long_rows_small(op, dtype):
    """max_row_block=32 forces the column loop (4 blocks of 32 for a 100-long row, ragged tail)."""
    k, ref = WRAPPERS[op]
    check_kernel(lambda x, backend: k(x, max_row_block=32, backend=backend), ref,
                (rnd(1, (5, N), dtype),), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_long_rows(dtype):
    """Rows longer than 8192: the column loop with its default 2048-wide blocks."""
    x = rnd(1, (3, 10000), dtype)
    check_kernel(lambda x, backend: R.softmax(x, backend=backend), softmax_ref, (x,), **TOL[dtype])
    check_kernel(lambda x, backend: R.reduce_sum(x, backend=backend), sum_ref, (x,),
          rtol=TOL[dtype]["rtol"], atol=1e-4 if dtype == jnp.float32 else 0.5)


def test_whole_row_8192_single_block():
    assert choose_row_blocks(2, 8192) == (1, 8192, False)
    assert choose_row_blocks(2, 8193)[2]
    x = rnd(1, (2, 8192), jnp.bfloat16)
    res = check_kernel(lambda x, backend: R.layer_norm(x, x[0], x[1], backend=backend),
                lambda x: ln_ref(x, x[0], x[1]), (x,), **TOL[jnp.bfloat16])
    assert res.triton_kernels[0].num_warps == 16


def test_params_as_vtensors_and_broadcast_bias():
    """layer_norm whose weight is a slice of a packed parameter buffer and bias a broadcast VTensor."""
    x = rnd(1, (M, N))
    packed = rnd(2, (2 * N + 7,))
    bias = rnd(3, (N,))

    def kernel(x, packed, bias, backend):
        w = vt(phys(packed.shape).slice((7,), (7 + N,)), packed)
        b = vt(phys((N,)).broadcast((M, N), (1,)), bias)   # already at the logical shape
        return R.layer_norm(x, w, b, backend=backend)

    check_kernel(kernel, lambda x, p, b: ln_ref(x, p[7:7 + N], b), (x, packed, bias), **TOL[jnp.float32])


def test_engine_epilogue_and_reduced_outputs_together():
    """row_reduce with both kinds of output: log-softmax and logsumexp, online in one kernel."""
    x = rnd(1, (M, N))
    passes = [Stat(lambda v: v, "max"), Stat(lambda v, m: jnp.exp(v - m), "sum")]
    epi = lambda v, m, s: v - m - jnp.log(s)
    red = lambda m, s: m + jnp.log(s)

    def ref(x):
        lse = jax.nn.logsumexp(x, -1)
        return x - lse[:, None], lse

    check_kernel(lambda x, backend: row_reduce([x], passes, epi, reduced=red, backend=backend), ref, (x,),
          **TOL[jnp.float32])
    check_kernel(lambda x, backend: row_reduce([x], passes, epi, reduced=red, max_row_block=16,
                                        backend=backend), ref, (x,), **TOL[jnp.float32])


def test_engine_min_and_validation():
    x = rnd(1, (M, N))
    check_kernel(lambda x, backend: R.reduce_min(x, backend=backend), lambda x: x.min(-1), (x,),
          **TOL[jnp.float32])
    with pytest.raises(ValueError, match="combine"):
        Stat(lambda v: v, "prod")
    with pytest.raises(ValueError, match="epilogue"):
        row_reduce([x], [Stat(lambda v: v)])


# --------------------------------------------------------------------------------------------
# Rung 2b: the default configurations compile to cubin for sm_90 without spills
# --------------------------------------------------------------------------------------------

@pytest.mark.offline
def test_default_configs_compile_for_sm90():
    from vtc_jax.offline import SMEM_LIMIT, compile_lowered, format_table
    from vtc_jax.testing import cross_lower

    S = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    ln = lambda x, w, b: R.layer_norm(x, w, b, backend="triton")   # noqa: E731
    cases = [  # short rows sharing a program; whole 8192 row in registers (16 warps); looped
        (lambda x: R.softmax(x, backend="triton"), (S((4096, 100), bf16),)),
        (lambda x: R.softmax(x, backend="triton"), (S((16, 8192), bf16),)),
        (lambda x: R.softmax(x, backend="triton"), (S((4, 32768), bf16),)),
        (ln, (S((16, 8192), jnp.float32), S((8192,), jnp.float32), S((8192,), jnp.float32))),
        (ln, (S((4, 32768), bf16), S((32768,), bf16), S((32768,), bf16))),
        (lambda x, w: R.rms_norm(x, w, backend="triton"), (S((32, 4096), bf16), S((4096,), bf16))),
        (lambda x: R.reduce_sum(x, 0, backend="triton"), (S((4096, 512), jnp.float32),)),
    ]
    results = []
    for f, sds in cases:
        results += compile_lowered(cross_lower(f, *sds))
    table = format_table(results)
    for r in results:
        assert r.cubin_ok, table
        assert not r.spills, table
        assert r.smem_bytes <= SMEM_LIMIT["sm_90"], table
