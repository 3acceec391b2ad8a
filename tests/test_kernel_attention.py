"""kernels/attention.py: flash-decoding with GQA over virtual q/k/v (paper §3.1, §4.2).

Every case goes through ``check_kernel``: interpret mode against an f32 numpy reference *and*
cross-lowered for CUDA (Triton IR must come out). Shapes are small and deliberately ragged
(T = 100, D = 48 / 96, G = 3) so every mask is exercised.

Reference: ``softmax(mask(cap(q·kᵀ·scale)))·v`` in f32 numpy, cast to the output dtype.
Tolerances: interpret mode computes both f32 dots exactly at every precision (on the GPU they
follow the ``precision`` argument, ``tests/test_precision.py``: TF32 at jax's default, IEEE at
``HIGHEST``); only the summation order and the online-softmax rescaling differ: rtol = atol = 1e-5.
bf16 inputs: scores and accumulators are f32, but the probabilities are rounded to bf16 for the
P·V dot (flash attention) and the output is one bf16 rounding (2^-8 relative): rtol = atol = 2e-2.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vtc_jax.indexmap import Layout, SymInfo, sym
from vtc_jax.kernels.attention import decode_attention, default_num_splits
from vtc_jax.kernels.matmul import matmul
from vtc_jax.kernels.vio import VTensor
from vtc_jax.testing import TRITON_CALL_TARGET, check_kernel

F32 = dict(rtol=1e-5, atol=1e-5)
B16 = dict(rtol=2e-2, atol=2e-2)
TOL = {jnp.float32: F32, jnp.bfloat16: B16}


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def ref_attention(q, k, v, *, hi=None, window=None, sm_scale=None, soft_cap=None, dtype=None, slopes=None,
                  bias=None):
    """q (B, H, G, D), k (B, H, T, D), v (B, H, T, Dv); keys t < hi (and t >= hi - window) valid;
    ``slopes`` (B, H, G): an ALiBi bias ``slope · t`` added before the mask."""
    dtype = dtype or q.dtype
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    t = k.shape[2]
    hi = t if hi is None else min(int(hi), t)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = np.einsum("bhgd,bhtd->bhgt", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    if slopes is not None:
        s = s + np.asarray(slopes, np.float32)[..., None] * np.arange(t, dtype=np.float32)
    if bias is not None:
        s = s + np.asarray(bias, np.float32)
    ts = np.arange(t)
    valid = ts < hi
    if window is not None:
        valid &= ts >= hi - window
    s = np.where(valid, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return jnp.asarray(np.einsum("bhgt,bhtd->bhgd", p, v), dtype)


def cache_view(cache):
    """Logical (B, Hkv, T, D) read straight from a (B, T, Hkv, D) cache: a transpose layout."""
    return VTensor(Layout.physical(0, cache.shape).transpose((0, 2, 1, 3)), cache.dtype, (cache,))


def from_cache(c):
    return jnp.swapaxes(c, 1, 2)


# --------------------------------------------------------------------------------------------
# Physical operands: GQA / MHA, ragged shapes, both dtypes, split and unsplit
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("b,h,g,d,t,splits", [
    (2, 2, 4, 64, 128, None),   # GQA G=4, default split count
    (1, 3, 1, 96, 100, 1),      # MHA, non-pow2 D and T, one kernel (no combine)
    (2, 2, 3, 48, 100, 3),      # G=3, D=48, T=100, split-K + combine
])
def test_physical(dtype, b, h, g, d, t, splits):
    args = (rand((b, h, g, d), dtype), rand((b, h, t, d), dtype, 1), rand((b, h, t, d), dtype, 2),
            jnp.int32(t - 7))
    call = functools.partial(lambda q, k, v, pos, **kw: decode_attention(q, k, v, pos=pos, **kw),
                             num_splits=splits, block_k=32)
    res = check_kernel(call, lambda q, k, v, pos: ref_attention(q, k, v, hi=int(pos) + 1), args,
                       **TOL[dtype])
    assert len(res.triton_kernels) == (1 if splits == 1 else 2)
    if splits:
        assert res.triton_kernels[0].grid == (b, h, splits)


def test_no_mask_static_kv_len_with_window_and_runtime_kv_len():
    q, k, v = rand((1, 2, 2, 32)), rand((1, 2, 70, 32), seed=1), rand((1, 2, 70, 32), seed=2)
    check_kernel(decode_attention, lambda q, k, v: ref_attention(q, k, v), (q, k, v), **F32)
    check_kernel(functools.partial(decode_attention, kv_len=33, window=20, num_splits=2),
                 lambda q, k, v: ref_attention(q, k, v, hi=33, window=20), (q, k, v), **F32)
    check_kernel(lambda q, k, v, n, **kw: decode_attention(q, k, v, kv_len=n, num_splits=3, **kw),
                 lambda q, k, v, n: ref_attention(q, k, v, hi=int(n)), (q, k, v, jnp.int32(41)),
                 **F32)


@pytest.mark.parametrize("pos", [0, 5, 99])
def test_empty_splits_short_prefix(pos):
    """Only the first KV block(s) are valid but 4 splits: splits with no block must not disturb
    the combine (m = -1e30, l = 0), and pos = 0 (one key) is exact."""
    q, k, v = rand((1, 1, 3, 48)), rand((1, 1, 100, 48), seed=1), rand((1, 1, 100, 48), seed=2)
    check_kernel(lambda q, k, v, p, **kw: decode_attention(q, k, v, pos=p, num_splits=4,
                                                           block_k=16, **kw),
                 lambda q, k, v, p: ref_attention(q, k, v, hi=int(p) + 1),
                 (q, k, v, jnp.int32(pos)), **F32)


# --------------------------------------------------------------------------------------------
# Gemma-2 features: logit soft-cap and sliding window
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_soft_cap_and_sliding_window(dtype):
    b, hkv, g, d, t, win, cap = 1, 2, 2, 96, 100, 37, 5.0
    args = (rand((b, hkv, g, d), dtype) * 4, rand((b, t, hkv, d), dtype, 1),
            rand((b, t, hkv, d), dtype, 2), jnp.int32(88))

    def call(q, kc, vc, pos, *, backend):
        return decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, soft_cap=cap,
                                window=win, sm_scale=0.2, block_k=16, num_splits=3,
                                backend=backend)

    def ref(q, kc, vc, pos):
        return ref_attention(q, from_cache(kc), from_cache(vc), hi=int(pos) + 1, window=win,
                             sm_scale=0.2, soft_cap=cap)

    check_kernel(call, ref, args, **TOL[dtype])


# --------------------------------------------------------------------------------------------
# Virtual operands: the KV cache through a transpose, the cache updated at pos, q from the fused
# QKV buffer, the output into the o-projection input, and the whole §3.1 chain
# --------------------------------------------------------------------------------------------

def _walk(op):
    op = getattr(op, "operation", op)
    yield op
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield from _walk(inner)


def module_facts(text):
    """(operand shapes of each Triton custom call, [(op name, result elements)] of all ops)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    module = ir.Module.parse(text, context=mlir.make_ir_context())
    kernels, sizes = [], []
    for op in _walk(module.operation):
        shapes = []
        for r in op.results:
            try:
                shapes.append(int(np.prod(ir.RankedTensorType(r.type).shape)))
            except ValueError:  # not a ranked tensor (tokens, tuples)
                pass
        sizes.append((op.name, max(shapes, default=0)))
        if op.name == "stablehlo.custom_call" and \
                ir.StringAttr(op.attributes["call_target_name"]).value == TRITON_CALL_TARGET:
            kernels.append([tuple(ir.RankedTensorType(o.type).shape) for o in op.operands])
    return kernels, sizes


def assert_no_repeated_kv(text, cache_shape, hq):
    """The kernels take the (B, T, Hkv, D) caches themselves; nothing in the module is as large
    as a K/V repeated to Hq heads, and no transpose/concat/broadcast touches cache-sized data."""
    kernels, sizes = module_facts(text)
    b, t, hkv, d = cache_shape
    cache_elems, repeated = b * t * hkv * d, b * t * hq * d
    assert any(ops.count(tuple(cache_shape)) >= 2 for ops in kernels), kernels  # K and V caches
    assert max(n for _, n in sizes) < repeated, [s for s in sizes if s[1] >= repeated]
    moved = [(name, n) for name, n in sizes if n >= cache_elems and name in (
        "stablehlo.transpose", "stablehlo.concatenate", "stablehlo.broadcast_in_dim",
        "stablehlo.gather", "stablehlo.copy")]
    assert not moved, moved


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gqa_reads_the_cache_through_a_transpose(dtype):
    """K/V straight from (B, T, Hkv, D) caches, G = 4 query heads per KV head: no transpose, no
    repeat — one K/V block per KV head serves its 4 query heads."""
    b, hkv, g, d, t = 2, 2, 4, 64, 100
    args = (rand((b, hkv, g, d), dtype), rand((b, t, hkv, d), dtype, 1),
            rand((b, t, hkv, d), dtype, 2), jnp.int32(60))

    def call(q, kc, vc, pos, *, backend):
        return decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, num_splits=2,
                                block_k=16, backend=backend)

    res = check_kernel(call, lambda q, kc, vc, pos: ref_attention(
        q, from_cache(kc), from_cache(vc), hi=int(pos) + 1), args, **TOL[dtype])
    assert res.lowered.count("stablehlo.transpose") == 0
    assert_no_repeated_kv(res.text, (b, t, hkv, d), hkv * g)


def test_cache_updated_at_pos_then_read():
    """The new K/V row is written into the caches at pos (XLA dynamic_update_slice, in place under
    donation); the kernel reads the updated caches through the transpose layout and must see it."""
    b, hkv, g, d, t = 2, 2, 2, 32, 40

    def update(kc, vc, kn, vn, pos):
        z = jnp.int32(0)
        return (lax.dynamic_update_slice(kc, kn[:, None], (z, pos, z, z)),
                lax.dynamic_update_slice(vc, vn[:, None], (z, pos, z, z)))

    def call(q, kc, vc, kn, vn, pos, *, backend):
        kc, vc = update(kc, vc, kn, vn, pos)
        o = decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, num_splits=2,
                             block_k=16, backend=backend)
        return o, kc, vc

    def ref(q, kc, vc, kn, vn, pos):
        kc, vc = update(kc, vc, kn, vn, pos)
        return ref_attention(q, from_cache(kc), from_cache(vc), hi=int(pos) + 1), kc, vc

    args = (rand((b, hkv, g, d)), rand((b, t, hkv, d), seed=1), rand((b, t, hkv, d), seed=2),
            rand((b, hkv, d), seed=3) * 3, rand((b, hkv, d), seed=4) * 3, jnp.int32(17))
    out = check_kernel(call, ref, args, **F32).output
    # The new row matters: attention over the stale cache differs.
    stale = ref_attention(args[0], from_cache(args[1]), from_cache(args[2]), hi=18)
    assert not np.allclose(np.asarray(out[0]), np.asarray(stale), atol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_q_from_fused_qkv_and_output_into_oproj_buffer(dtype):
    """q is a slice of the fused (B, (Hq + 2 Hkv) * D) QKV projection output, reshaped to
    (B, Hkv, G, D) (slice + reshape layout); the result lands in a fresh (B, Hq * D) buffer —
    the o-projection's input — through a reshape layout."""
    b, hkv, g, d, t = 2, 2, 3, 48, 50
    hq = hkv * g
    qkv_w = (hq + 2 * hkv) * d
    args = (rand((b, qkv_w), dtype), rand((b, t, hkv, d), dtype, 1),
            rand((b, t, hkv, d), dtype, 2), jnp.int32(31))

    def call(qkv, kc, vc, pos, *, backend):
        q = VTensor(Layout.physical(0, (b, qkv_w)).slice((0, 0), (b, hq * d))
                    .reshape((b, hkv, g, d)), qkv.dtype, (qkv,))
        out = VTensor(Layout.physical(0, (b, hq * d)).reshape((b, hkv, g, d)), qkv.dtype,
                      (jax.ShapeDtypeStruct((b, hq * d), qkv.dtype),))
        return decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, out=out,
                                num_splits=2, block_k=16, backend=backend)

    def ref(qkv, kc, vc, pos):
        q = qkv[:, :hq * d].reshape(b, hkv, g, d)
        o = ref_attention(q, from_cache(kc), from_cache(vc), hi=int(pos) + 1)
        return o.reshape(b, hq * d)

    res = check_kernel(call, ref, args, **TOL[dtype])
    # Only reshapes (bitcasts in XLA: vio passes gather-path buffers flattened) remain.
    assert set(res.lowered.op_counts) <= {"builtin.module", "func.func", "func.return",
                                          "stablehlo.custom_call", "stablehlo.reshape"}, \
        res.lowered.op_counts


def test_llama_decode_chain_qkv_projection_to_attention():
    """The paper's §3.1 example end to end, no movement op anywhere: x @ Wqkv writes Q into a
    fresh buffer and K/V into the caches at ``pos`` (one matmul, three buffers); attention reads
    q from Q, K/V from the caches (transpose layouts, GQA G = 4) and writes (B, Hq * D) for the
    o-projection."""
    b, dm, hkv, g, d, t = 2, 32, 2, 4, 16, 24
    hq = hkv * g
    qw, kw = hq * d, hkv * d
    info = [SymInfo("pos", 0, t - 1)]

    def call(x, w, kc, vc, pos, *, backend):
        lq = Layout.physical(0, (b, hq, d)).reshape((b, qw))
        lkv = [Layout.physical(i, (b, t, hkv, d)).dynamic_slice([0, sym("pos"), 0, 0],
                                                                 (b, 1, hkv, d), info)
               .reshape((b, kw)) for i in (1, 2)]
        qkv = VTensor(Layout.concatenate([lq, *lkv], 1), x.dtype,
                      (jax.ShapeDtypeStruct((b, hq, d), x.dtype), kc, vc), (("pos", pos),))
        qbuf, kc, vc = matmul(x, w, dimension_numbers=(((1,), (0,)), ((), ())), out=qkv,
                              backend=backend)
        q = VTensor(Layout.physical(0, (b, hq, d)).reshape((b, hkv, g, d)), x.dtype, (qbuf,))
        out = VTensor(Layout.physical(0, (b, qw)).reshape((b, hkv, g, d)), x.dtype,
                      (jax.ShapeDtypeStruct((b, qw), x.dtype),))
        o = decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, out=out, num_splits=2,
                             block_k=16, backend=backend)
        return o, kc, vc

    def ref(x, w, kc, vc, pos):
        y = np.asarray(lax.dot(x, w, precision=lax.Precision.HIGHEST))
        q = y[:, :qw].reshape(b, hkv, g, d)
        kc, vc = np.array(kc), np.array(vc)
        kc[:, int(pos)] = y[:, qw:qw + kw].reshape(b, hkv, d)
        vc[:, int(pos)] = y[:, qw + kw:].reshape(b, hkv, d)
        o = ref_attention(q, from_cache(kc), from_cache(vc), hi=int(pos) + 1)
        return o.reshape(b, qw), jnp.asarray(kc), jnp.asarray(vc)

    args = (rand((b, dm)), rand((dm, qw + 2 * kw), seed=1) * 0.3, rand((b, t, hkv, d), seed=2),
            rand((b, t, hkv, d), seed=3), jnp.int32(13))
    res = check_kernel(call, ref, args, **F32)
    assert len(res.triton_kernels) == 3  # projection, attention split, combine
    for name in ("stablehlo.transpose", "stablehlo.concatenate", "stablehlo.slice",
                 "stablehlo.dynamic_slice", "stablehlo.dynamic_update_slice", "stablehlo.scatter",
                 "stablehlo.gather", "stablehlo.broadcast_in_dim"):
        assert res.lowered.count(name) == 0, name
    assert_no_repeated_kv(res.text, (b, t, hkv, d), hq)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

def test_default_num_splits():
    assert default_num_splits(8, 4096, 64) == 17      # Llama-3-8B decode, B = 1: 136 programs
    assert default_num_splits(128, 4096, 64) == 2     # B = 16
    assert default_num_splits(256, 4096, 64) == 1     # already fills 132 SMs
    assert default_num_splits(8, 100, 64) == 1        # two blocks: no split
    assert default_num_splits(1, 1 << 20, 64) == 64   # capped


def test_sm_count_is_the_kernels_one_constant():
    """The split count, the matmul's split-K waves and the cost model all size against
    ``tiling.NUM_SMS`` (an H100 SXM's 132 SMs)."""
    from vtc_jax.kernels import attention, tiling
    assert tiling.NUM_SMS == 132 and attention.NUM_SMS is tiling.NUM_SMS
    assert tiling.gemm_config(16, 4096, 4096).sms == tiling.NUM_SMS
    assert default_num_splits(tiling.NUM_SMS, 4096, 64) == 1


def test_launch_heuristics():
    """AttentionConfig.decode / .prefill: the defaults the offline tests compile without spills."""
    from vtc_jax.kernels.flash import SMEM_BUDGET, AttentionConfig
    bf16, f32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
    assert AttentionConfig.decode(4, 4096, 128, 128, bf16) == AttentionConfig(16, 64, 8, 3)
    assert AttentionConfig.decode(4, 4096, 128, 128, f32) == AttentionConfig(16, 32, 8, 3)   # TF32, smem
    assert AttentionConfig.decode(4, 4096, 128, 128, f32, precision="highest") == AttentionConfig(16, 64, 8, 1)
    assert AttentionConfig.decode(32, 40, 64, 64, bf16) == AttentionConfig(32, 64, 8, 3)
    assert AttentionConfig.decode(1, 20, 16, 16, bf16).block_k == 32     # capped at next_pow2(T)
    assert AttentionConfig.prefill(8192, 2048, 128, 128, bf16) == AttentionConfig(64, 64, 4, 3)
    assert AttentionConfig.prefill(2048, 1024, 256, 256, bf16) == AttentionConfig(64, 32, 8, 3)   # smem
    assert AttentionConfig.prefill(20, 2048, 128, 128, f32) == AttentionConfig(32, 32, 4, 3)     # TF32, smem
    assert AttentionConfig.prefill(20, 2048, 128, 128, f32, precision="highest") == AttentionConfig(32, 64, 4, 1)
    # staged K/V blocks over the shared-memory budget: the key block is halved
    bk = AttentionConfig.fit_block_k(64, 4096, 256, 256, f32, 2)
    assert bk == 32 and 2 * bk * 512 * 4 <= SMEM_BUDGET


@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_sequence"])
def test_runtime_position_is_an_int32_operand(per_row):
    """A runtime pos reaches the kernel as an operand of its own, a (1,) or (B,) int32 array (no
    scalar prefetch on Triton; no runtime symbol riding on q), alongside q's own symbols."""
    from vtc_jax.testing import cross_lower
    b, h, g, d, t = 3, 2, 2, 32, 64
    S = jax.ShapeDtypeStruct
    f = lambda q, kc, vc, p: decode_attention(q, cache_view(kc), cache_view(vc), pos=p,  # noqa: E731
                                              num_splits=1, backend="triton")
    text = cross_lower(f, S((b, h, g, d), jnp.float32), S((b, t, h, d), jnp.float32),
                       S((b, t, h, d), jnp.float32), S((b,) if per_row else (), jnp.int32)).text
    kernels, _ = module_facts(text)
    assert len(kernels) == 1 and kernels[0][-1] == ((b,) if per_row else (1,)), kernels
    # the kernel's bound and a runtime symbol of q's layout are separate operands
    q = VTensor(Layout.physical(0, (b, h, g, d)), jnp.float32, (rand((b, h, g, d)),), (("__vtc_attn_len", 7),))
    kc, vc = rand((b, t, h, d), seed=1), rand((b, t, h, d), seed=2)
    pos = jnp.asarray([5, 20, 63], jnp.int32) if per_row else jnp.int32(20)
    got = decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, block_k=16)
    want = [ref_attention(q.buffers[0][i:i + 1], from_cache(kc)[i:i + 1], from_cache(vc)[i:i + 1],
                          hi=int(pos[i] if per_row else pos) + 1) for i in range(b)]
    np.testing.assert_allclose(got, jnp.concatenate(want), rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    q, k = rand((1, 1, 1, 16)), rand((1, 1, 8, 16))
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k, k, block_k=48)
    with pytest.raises(ValueError, match="pos or kv_len"):
        decode_attention(q, k, k, pos=1, kv_len=2)
    with pytest.raises(ValueError, match="shape mismatch"):
        decode_attention(q, k, rand((1, 2, 8, 16)))
    with pytest.raises(ValueError, match="logical shape"):
        decode_attention(q, k, k, out=VTensor.fresh((1, 1, 2, 16), jnp.float32))


# --------------------------------------------------------------------------------------------
# Rung 2b: the default bf16 configuration compiles to cubin for sm_90 within budget
# --------------------------------------------------------------------------------------------

OFFLINE_SHAPES = {  # name: (B, Hkv, G, D, extra kwargs); T = 4096, bf16, K/V from the caches
    "llama3-8b": (1, 8, 4, 128, {}),
    "llama3-8b-b16": (16, 8, 4, 128, {}),
    "mha": (1, 32, 1, 128, {}),
    "gemma2-9b": (1, 8, 2, 256, dict(soft_cap=50.0, window=4096)),
    "llama3-8b-b16-f32": (16, 8, 4, 128, dict(_dtype=jnp.float32)),
}


@pytest.fixture(scope="module")
def compiled_defaults():
    """Every shape's kernels compiled for sm_90 in one offline batch (one worker start-up)."""
    from vtc_jax.offline import compile_many
    from vtc_jax.testing import cross_lower

    t = 4096
    jobs, owner = [], []
    for name, (b, hkv, g, d, extra) in OFFLINE_SHAPES.items():
        extra = dict(extra)
        dt = extra.pop("_dtype", jnp.bfloat16)
        def f(q, kc, vc, pos, extra=extra):
            return decode_attention(q, cache_view(kc), cache_view(vc), pos=pos,
                                    backend="triton", **extra)

        sds = (jax.ShapeDtypeStruct((b, hkv, g, d), dt), jax.ShapeDtypeStruct((b, t, hkv, d), dt),
               jax.ShapeDtypeStruct((b, t, hkv, d), dt), jax.ShapeDtypeStruct((), jnp.int32))
        for k in cross_lower(f, *sds).triton_kernels:
            jobs.append((k.name, k.ir, k.num_warps, k.num_stages))
            owner.append(name)
    results = compile_many(jobs, arch="9.0")
    return {name: [r for r, o in zip(results, owner) if o == name] for name in OFFLINE_SHAPES}


@pytest.mark.offline
@pytest.mark.parametrize("name", list(OFFLINE_SHAPES))
def test_default_config_compiles_sm90_no_spills(compiled_defaults, name):
    from vtc_jax.offline import SMEM_LIMIT, format_table

    results = compiled_defaults[name]
    table = format_table(results)
    print(f"\n{name}\n{table}")
    assert len(results) == 2, table  # split + combine (default num_splits > 1 here)
    for r in results:
        assert r.cubin_ok, table
        assert not r.spills, table
        assert r.smem_bytes <= SMEM_LIMIT["sm_90"], table
    stages = 3    # tiling.pipeline_stages: 3 on tensor cores (bf16, and f32 at TF32, jax's default)
    assert (results[0].num_warps, results[0].num_stages) == (8, stages), table
    if stages > 1:   # K/V loads pipelined: the loop waits for all but the newest cp.async groups
        import re
        waits = [int(x) for x in re.findall(r"cp\.async\.wait_group\s+(\d+)", results[0].ptx or "")]
        assert waits and max(waits) >= 1, waits


# --------------------------------------------------------------------------------------------
# One position per sequence (continuous batching): a (B,) pos / kv_len operand
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("splits,window,use_kv_len", [(1, None, False), (3, None, False), (2, 24, False),
                                                      (3, None, True)])
def test_per_sequence_positions(dtype, splits, window, use_kv_len):
    """Each sequence its own end: positions 0, mid, T - 1 and past T, through a cache layout, in
    both the one-kernel and the split + combine forms, with a sliding window; equal to the numpy
    reference row by row."""
    b, h, g, d, t = 4, 2, 3, 48, 100
    # past the end only without a window (ref_attention counts a window from the clamped end)
    pos = jnp.asarray([0, 37, t - 1, t + 5 if window is None else 60], jnp.int32)
    q = rand((b, h, g, d), dtype)
    kc, vc = rand((b, t, h, d), dtype, 1), rand((b, t, h, d), dtype, 2)

    def call(q, kc, vc, pos, backend):
        kw = dict(kv_len=pos + 1) if use_kv_len else dict(pos=pos)
        return decode_attention(q, cache_view(kc), cache_view(vc), num_splits=splits, block_k=32,
                                window=window, backend=backend, **kw)

    def ref(q, kc, vc, pos):
        rows = [ref_attention(q[i:i + 1], from_cache(kc)[i:i + 1], from_cache(vc)[i:i + 1],
                              hi=int(pos[i]) + 1, window=window) for i in range(b)]
        return jnp.concatenate(rows, axis=0)

    res = check_kernel(call, ref, (q, kc, vc, pos), **TOL[dtype])
    assert len(res.triton_kernels) == (1 if splits == 1 else 2)


def test_per_sequence_positions_must_match_the_batch():
    q, k = rand((2, 1, 1, 16)), rand((2, 1, 32, 16))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        decode_attention(q, k, k, pos=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="scalar or a"):
        decode_attention(q, k, k, pos=jnp.zeros((2, 1), jnp.int32))


# --------------------------------------------------------------------------------------------
# Rows with no valid key under a finite mask: the empty-row pass lowers to IR that verifies
# --------------------------------------------------------------------------------------------

def _ref_masked(q, k, v, hi, fill):
    """jax's numbers for a finite mask: ``where(valid, s, fill)`` or an additive bias applied before
    a scaling (``(s / f + where(valid, 0, b)) * f``), softmax over every key (f32)."""
    s = jnp.einsum("bhgd,bhtd->bhgt", q.astype(jnp.float32), k.astype(jnp.float32)) / math.sqrt(q.shape[-1])
    valid = jnp.arange(k.shape[2]) < hi
    if fill[0] == "fill":
        s = jnp.where(valid, s, fill[1])
    else:
        _, b, f = fill
        s = (s / f + jnp.where(valid, 0.0, b)) * f
    return jnp.einsum("bhgt,bhtd->bhgd", jax.nn.softmax(s, -1), v.astype(jnp.float32)).astype(q.dtype)


@pytest.mark.parametrize("fill", [("fill", float(jnp.finfo(jnp.float32).min)), ("bias", -1e9, 0.25)],
                         ids=["fill", "bias"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pos", [-1, 9])
def test_finite_mask_rows(fill, splits, pos):
    """A position < 0 leaves every key masked: the kernels add a pass over all keys at jax's masked
    value (the mean of V for a constant fill). Its loop bounds once lowered to an ``arith.select``
    MLIR's verifier rejects (a weak-typed Python int), which XLA's Triton refused on the GPU; the
    cross-lowering now verifies every kernel's IR (``testing.verify_triton_ir``)."""
    args = (rand((2, 2, 3, 16)), rand((2, 2, 40, 16), seed=1), rand((2, 2, 40, 16), seed=2), jnp.int32(pos))
    call = lambda q, k, v, p, backend: decode_attention(   # noqa: E731
        q, k, v, pos=p, num_splits=splits, block_k=16, empty_rows=fill, backend=backend)
    check_kernel(call, lambda q, k, v, p: _ref_masked(q, k, v, int(p) + 1, fill), args, **F32)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_alibi_slopes(dtype, splits):
    """ALiBi (BLOOM, Falcon): one slope per query head, ``slope · t`` added to the scaled scores
    before the mask; GQA rows (G = 3) each with its own slope, split-K and one kernel."""
    b, h, g, d, t = 2, 2, 3, 32, 100
    slopes = jnp.asarray(-(2.0 ** -np.arange(1, b * h * g + 1, dtype=np.float32) % 0.9).reshape(b, h, g))
    args = (rand((b, h, g, d), dtype), rand((b, h, t, d), dtype, 1), rand((b, h, t, d), dtype, 2),
            jnp.int32(61), slopes)
    call = functools.partial(lambda q, k, v, pos, sl, **kw: decode_attention(q, k, v, pos=pos, slopes=sl, **kw),
                             num_splits=splits, block_k=32)
    check_kernel(call, lambda q, k, v, pos, sl: ref_attention(q, k, v, hi=int(pos) + 1, slopes=sl), args,
                 **TOL[dtype])
    with pytest.raises(ValueError, match="slopes must be f32"):
        decode_attention(*args[:3], pos=args[3], slopes=slopes[:, :, :2])


@pytest.mark.parametrize("splits", [1, 2])
def test_additive_bias_read_through_a_broadcast_layout(splits):
    """Any additive bias (a relative-position table's gather, a learned bias): read blockwise as a
    (B, Hkv, G, T) VTensor, here a per-head (H, T) table broadcast over the batch (no copy)."""
    b, h, g, d, t = 2, 2, 3, 32, 70
    table = rand((h * g, t), seed=5)
    view = VTensor(Layout.physical(0, (h * g, t)).reshape((h, g, t)).broadcast((b, h, g, t), (1, 2, 3)),
                   table.dtype, (table,))
    args = (rand((b, h, g, d)), rand((b, h, t, d), seed=1), rand((b, h, t, d), seed=2), jnp.int32(50), table)
    call = functools.partial(
        lambda q, k, v, pos, tb, **kw: decode_attention(q, k, v, pos=pos, bias=VTensor(view.layout, tb.dtype, (tb,)), **kw),
        num_splits=splits, block_k=32)
    ref_bias = np.broadcast_to(np.asarray(table).reshape(1, h, g, t), (b, h, g, t))
    check_kernel(call, lambda q, k, v, pos, tb: ref_attention(q, k, v, hi=int(pos) + 1, bias=ref_bias), args, **F32)


# --------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss): one more logit per query head in the softmax's denominator
# --------------------------------------------------------------------------------------------

def _sink_softmax_ref(s, sink, v):
    """jax's own spelling: the sink logit concatenated to the (masked) scores, the softmax over
    T + 1, its probability dropped before ``p·v`` (f32, HIGHEST)."""
    full = jnp.concatenate([s, jnp.broadcast_to(sink[..., None], s.shape[:-1] + (1,))], -1)
    p = jax.nn.softmax(full, -1)[..., :-1]
    return jnp.einsum("bhgt,bhtd->bhgd", p, v, precision="highest")


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("pos,fill", [(37, "-inf"), (-4, "-inf"), (-4, "fill"), (37, "fill")],
                         ids=["valid", "empty_nan", "empty_fill", "fill"])
def test_decode_sink(splits, pos, fill):
    """The sink joins the denominator once — in split 0's partial, rescaled by the combine with the
    rest — so every row equals jax's softmax over the scores and the sink. A row with no valid key
    (pos < 0) is 0, as jax's (the sink takes all the probability), under a -inf mask and under a
    finite fill (the empty-row pass's scores are shifted by the fill: the sink is shifted alike);
    one head's sink is -inf (no sink: jax's NaN row under -inf), one is large."""
    b, h, g, t, d = 2, 2, 3, 100, 32
    sink = jnp.asarray(np.array([[0.5, -1.0, 3.0], [-np.inf, 40.0, 0.0]], np.float32))
    sink = jnp.broadcast_to(sink, (b, h, g))
    args = (rand((b, h, g, d)), rand((b, h, t, d), seed=1), rand((b, h, t, d), seed=2), sink, jnp.int32(pos))
    empty = "nan" if fill == "-inf" else ("fill", float(jnp.finfo(jnp.float32).min))

    def call(q, k, v, sk, p, backend):
        return decode_attention(q, k, v, pos=p, sink=sk, num_splits=splits, empty_rows=empty, backend=backend,
                                precision=lax.Precision.HIGHEST)

    def ref(q, k, v, sk, p):
        s = jnp.einsum("bhgd,bhtd->bhgt", q, k, precision="highest") / math.sqrt(d)
        s = jnp.where(jnp.arange(t) <= p, s, -jnp.inf if fill == "-inf" else jnp.finfo(jnp.float32).min)
        return _sink_softmax_ref(s, sk, v)

    out, want = jax.jit(functools.partial(call, backend="interpret"))(*args), ref(*args)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))   # the -inf sink's empty row only
    assert np.isnan(want).any() == (pos < 0 and fill == "-inf")
    np.testing.assert_allclose(np.nan_to_num(out, nan=0.0), np.nan_to_num(want, nan=0.0), **F32)
    if pos == 37 and splits == 3:
        check_kernel(call, ref, args, **F32)   # and cross-lowered for CUDA


# --------------------------------------------------------------------------------------------
# Prologues: caches stored narrow (int8 with scales, fp8, bf16 attended in f32)
# --------------------------------------------------------------------------------------------

def _dequant(x, s):
    return x.astype(jnp.bfloat16) * s


def _narrow_case(kind, b=2, h=2, g=4, t=200, d=64):
    """(q, stored K, stored V, K prologue, V prologue, widened K, widened V)."""
    from vtc_jax.kernels.flash import Prologue
    r = np.random.default_rng(7)
    q = jnp.asarray(r.standard_normal((b, h, g, d)), jnp.bfloat16)
    if kind == "int8":
        kc, vc = (jnp.asarray(r.integers(-127, 128, (b, h, t, d)), jnp.int8) for _ in range(2))
        ks, vs = (jnp.asarray(r.uniform(0.005, 0.05, (b, h, t, 1)), jnp.bfloat16) for _ in range(2))
        kp, vp = (Prologue(_dequant, (jnp.broadcast_to(s, (b, h, t, d)),)) for s in (ks, vs))
        return q, kc, vc, kp, vp, _dequant(kc, ks), _dequant(vc, vs)
    kc, vc = (jnp.asarray(r.standard_normal((b, h, t, d)), jnp.float8_e4m3fn) for _ in range(2))
    widen = lambda x: x.astype(jnp.bfloat16)   # noqa: E731
    return q, kc, vc, Prologue(widen), Prologue(widen), widen(kc), widen(vc)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("splits", [1, 3])
def test_prologue_widens_the_blocks_it_loads(kind, splits):
    """A dequantising prologue gives exactly the kernel's result on the dequantised cache (the same
    bf16 values reach the dots), decode and prefill; its dtype is what the kernel computes in."""
    from vtc_jax.kernels.prefill_attention import prefill_attention
    q, kc, vc, kp, vp, k, v = _narrow_case(kind)
    ref = decode_attention(q, k, v, pos=150, num_splits=splits)
    out = decode_attention(q, kc, vc, pos=150, num_splits=splits, k_prologue=kp, v_prologue=vp)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    z = lambda x: x.reshape((-1,) + x.shape[2:])   # noqa: E731   (B·H, ., D)
    from vtc_jax.kernels.flash import Prologue
    zp = lambda p: Prologue(p.fn, tuple(z(o) for o in p.operands))   # noqa: E731
    ref = prefill_attention(z(q), z(k), z(v), kv_len=150)
    out = prefill_attention(z(q), z(kc), z(vc), kv_len=150, k_prologue=zp(kp), v_prologue=zp(vp))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_prologue_operands_must_have_the_operands_shape():
    from vtc_jax.kernels.flash import Prologue
    q, kc, vc, kp, vp, k, v = _narrow_case("int8")
    with pytest.raises(ValueError, match="k_prologue operands must have k's shape"):
        decode_attention(q, kc, vc, k_prologue=Prologue(_dequant, (kp.operands[0][..., :1],)), v_prologue=vp)


@pytest.mark.offline
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_prologue_compiles_sm90_no_spills(kind):
    """Loading int8 blocks with their scales, or fp8 blocks (``tt.fp_to_fp``), and widening them
    in registers compiles for sm_90 at Llama-3's batch 16 x 4k, without spills."""
    from vtc_jax.kernels.flash import Prologue
    from vtc_jax.offline import compile_many, format_table
    from vtc_jax.testing import cross_lower
    b, hkv, g, d, t = 16, 8, 4, 128, 4096
    S = jax.ShapeDtypeStruct
    dt = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn

    def f(q, kc, vc, pos, ks, vs):
        if kind == "int8":
            kp, vp = (Prologue(_dequant, (jnp.broadcast_to(s, kc.shape),)) for s in (ks, vs))
        else:
            kp = vp = Prologue(lambda x: x.astype(jnp.bfloat16))
        return decode_attention(q, kc, vc, pos=pos, backend="triton", k_prologue=kp, v_prologue=vp)
    sds = (S((b, hkv, g, d), jnp.bfloat16), S((b, hkv, t, d), dt), S((b, hkv, t, d), dt), S((), jnp.int32),
           S((b, hkv, t, 1), jnp.bfloat16), S((b, hkv, t, 1), jnp.bfloat16))
    kernels = cross_lower(f, *sds).triton_kernels
    results = compile_many([(k.name, k.ir, k.num_warps, k.num_stages) for k in kernels], arch="9.0")
    table = format_table(results)
    assert len(results) == 2, table
    for r in results:
        assert r.cubin_ok and not r.spills, table
