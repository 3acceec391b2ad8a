"""A decode GEMM's split-K partials summed by the island kernel that reads its result
(``cluster.reduce_islands``, ``ContractionMatch.island``, ``island.summed``): a layer's QKV
projection, its split into q, k and v, the rotary embedding of q and k and the new K/V rows
written into the caches — the split-K kernel and one island kernel, no reduce kernel and no
projection written and read back. Every result is compared with ``jax.jit`` (f32 at 1e-5 of the
largest value, bf16 at 2e-2)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vtc_jax.kernels.matmul import splits
from vtc_jax.testing import cross_lower
from tests.optimized import TOL, assert_close, eqns, optimize_kernels

# a decode step's sizes that split K (kernels.matmul.splits(B, N, D) == 2) at interpret-mode cost
B, D, T, HQ, HKV, HD = 4, 1024, 8, 4, 2, 64
N = (HQ + 2 * HKV) * HD


def _rms(x, w):
    h = x.astype(jnp.float32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)).astype(x.dtype) * w


def _rotate_half(x, pos):
    """Hugging Face's rotation: ``x * cos + rotate_half(x) * sin`` at position ``pos``."""
    inv = 1.0 / (10000.0 ** (jnp.arange(0, HD, 2, dtype=jnp.float32) / HD))
    f = pos.astype(jnp.float32) * inv
    cos, sin = jnp.cos(jnp.concatenate([f, f])), jnp.sin(jnp.concatenate([f, f]))
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    rot = jnp.concatenate([-x2, x1], -1)
    return (x.astype(jnp.float32) * cos + rot.astype(jnp.float32) * sin).astype(x.dtype)


def merged_qkv(x, nw, w_qkv, kc, vc, pos):
    """A pre-norm, one merged projection split into q, k and v, q and k rotated, the new rows
    written into the caches at ``pos`` (the shipped Llama-3 example's layer)."""
    qkv = _rms(x, nw) @ w_qkv
    q, k, v = jnp.split(qkv, [HQ * HD, (HQ + HKV) * HD], axis=-1)
    q = _rotate_half(q.reshape(B, 1, HQ, HD), pos)
    k = _rotate_half(k.reshape(B, 1, HKV, HD), pos)
    kc = jax.lax.dynamic_update_slice(kc, k, (0, pos, 0, 0))
    vc = jax.lax.dynamic_update_slice(vc, v.reshape(B, 1, HKV, HD), (0, pos, 0, 0))
    return q, kc, vc


def unnormed(x, nw, w_qkv, kc, vc, pos):
    """The same without the pre-norm (a GEMM with no folded statistic, ``nw`` unread), slices for
    the split and ``.at[].set`` for the cache rows."""
    qkv = x @ w_qkv
    q, k, v = qkv[:, :HQ * HD], qkv[:, HQ * HD:(HQ + HKV) * HD], qkv[:, (HQ + HKV) * HD:]
    q = _rotate_half(q.reshape(B, 1, HQ, HD), pos)
    k = _rotate_half(k.reshape(B, 1, HKV, HD), pos)
    kc = kc.at[:, pos].set(k[:, 0])
    vc = vc.at[:, pos].set(v.reshape(B, HKV, HD))
    return q, kc, vc


def three_weights(x, nw, wq, wk, wv, kc, vc, pos):
    """Meta's reference style: three weights (one GEMM over them side by side,
    ``cluster.sibling_projections``), the rows written with ``dynamic_update_slice``."""
    h = _rms(x, nw)
    q = _rotate_half((h @ wq).reshape(B, 1, HQ, HD), pos)
    k = _rotate_half((h @ wk).reshape(B, 1, HKV, HD), pos)
    kc = jax.lax.dynamic_update_slice(kc, k, (0, pos, 0, 0))
    vc = jax.lax.dynamic_update_slice(vc, (h @ wv).reshape(B, 1, HKV, HD), (0, pos, 0, 0))
    return q, kc, vc


def _three(dtype):
    x, nw, w, kc, vc, pos = _args(dtype)
    return x, nw, w[:, :HQ * HD], w[:, HQ * HD:(HQ + HKV) * HD], w[:, (HQ + HKV) * HD:], kc, vc, pos


def _args(dtype, rows=B):
    ks = jax.random.split(jax.random.PRNGKey(11), 5)
    return (jax.random.normal(ks[0], (rows, D), dtype), (1 + 0.1 * jax.random.normal(ks[1], (D,))).astype(dtype),
            (D ** -0.5 * jax.random.normal(ks[2], (D, N))).astype(dtype),
            jax.random.normal(ks[3], (rows, T, HKV, HD), dtype), jax.random.normal(ks[4], (rows, T, HKV, HD), dtype),
            jnp.int32(5))


def _calls(fn, args):
    return [e for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == "pallas_call"]


def test_the_sizes_split_k():
    """(what the tests below are about: a GEMM that splits K)"""
    assert splits(B, N, D) == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layer", [merged_qkv, unnormed])
def test_projection_rotations_and_cache_rows_are_two_kernels(layer, dtype):
    """The split-K kernel and the island kernel summing its partials: two kernels write q and the
    cache rows (three with a reduce kernel), nothing else is computed; equal to jit's."""
    args = _args(dtype)
    fn = optimize_kernels(layer)
    for o, r in zip(fn(*args), jax.jit(layer)(*args)):
        assert_close(o, r, TOL[dtype])
    made = [e.primitive.name for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)]
    assert made.count("pallas_call") == 2, made
    assert not {"dot_general", "reduce_sum", "dynamic_update_slice", "concatenate", "slice"} & set(made), made
    shapes = [[tuple(v.aval.shape) for v in e.outvars] for e in _calls(fn, args)]
    assert shapes[0][0][1:] == (B, N) and shapes[0][0][0] >= 2, shapes   # the partials: summed by the second kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_three_weights_side_by_side_feed_the_island(dtype):
    """q, k and v of three weights: one split-K GEMM over them side by side, the island kernel
    summing each dot's columns of the partials; equal to jit's."""
    args = _three(dtype)
    fn = optimize_kernels(three_weights)
    for o, r in zip(fn(*args), jax.jit(three_weights)(*args)):
        assert_close(o, r, TOL[dtype])
    made = [e.primitive.name for e in eqns(jax.make_jaxpr(fn)(*args).jaxpr)]
    assert made.count("pallas_call") == 2 and "dot_general" not in made, made


def test_a_guarded_cache_write_reads_its_row_in_place():
    """``.at[pos].set`` in the island (the scatter's guarded form reads the cache row it
    overwrites): the island's grid is the union of q's and the rows' shapes, and the cache is read
    where it is written, at the same lane, masked to the rows' extent — passed once, aliased, not
    read from a copy (``vio.Plan.build``'s same-place test); two kernels, equal to jit's."""
    def guarded(x, nw, wq, wk, wv, kc, vc, pos):
        h = _rms(x, nw)
        q = _rotate_half((h @ wq).reshape(B, 1, HQ, HD), pos)
        k = _rotate_half((h @ wk).reshape(B, 1, HKV, HD), pos)
        return q, kc.at[:, pos].set(k[:, 0]), vc.at[:, pos].set((h @ wv).reshape(B, HKV, HD))
    args = _three(jnp.bfloat16)
    fn = optimize_kernels(guarded)
    for o, r in zip(fn(*args), jax.jit(guarded)(*args)):
        assert_close(o, r, TOL[jnp.bfloat16])
    calls = _calls(fn, args)
    assert [e.params["name"] for e in calls] == ["vtc_matmul_splitk", "pointwise"], calls
    island = calls[1]
    caches = [i for i, v in enumerate(island.invars) if v.aval.size == B * T * HKV * HD and v.aval.dtype == jnp.bfloat16]
    aliased = dict(island.params["input_output_aliases"])
    assert len(caches) == 2 and all(i in aliased for i in caches), (caches, aliased)   # each passed once


def test_the_sum_matches_the_reduce_kernel_bit_for_bit():
    """Summed where it is read, in split order in f32 and rounded once, the projection is the one
    the reduce kernel wrote: the rotated rows equal those of the program planned with the island
    apart (the ``rejected`` path of the selection keeps the merged cluster out)."""
    from vtc_jax import cluster as C
    args = _args(jnp.bfloat16)
    merged = optimize_kernels(merged_qkv)(*args)
    real = C.reduce_islands
    try:
        C.reduce_islands = lambda *a: []
        import vtc_jax.selection as S
        S.reduce_islands = C.reduce_islands
        apart_fn = optimize_kernels(merged_qkv)
        apart = apart_fn(*args)
        assert len(_calls(apart_fn, args)) == 3   # split-K, reduce, island
    finally:
        C.reduce_islands = real
        S.reduce_islands = real
    for o, r in zip(merged, apart):
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))


def test_prefill_rows_do_not_split_and_stay_apart():
    """At 128 rows the GEMM takes one kernel (no split to sum): the island stays its own kernel;
    equal to jit's."""
    def prefill(x, nw, w_qkv):
        qkv = _rms(x, nw) @ w_qkv
        q, k, _ = jnp.split(qkv, [HQ * HD, (HQ + HKV) * HD], axis=-1)
        return _rotate_half(q.reshape(128, 1, HQ, HD), jnp.int32(5)), _rotate_half(k.reshape(128, 1, HKV, HD), jnp.int32(5))
    assert splits(128, N, D) == 1
    args = _args(jnp.float32, rows=128)[:3]
    fn = optimize_kernels(prefill)
    for o, r in zip(fn(*args), jax.jit(prefill)(*args)):
        assert_close(o, r, TOL[jnp.float32])
    assert all(e.outvars[0].aval.shape[0] != 2 for e in _calls(fn, args))   # no partials


def test_under_vmap_and_grad():
    """vmap over a batch of layers' inputs and grad through the step (its backward left to the
    autodiff rules): equal to jit's."""
    args = _args(jnp.float32)
    fn = optimize_kernels(merged_qkv)
    batched = tuple(jnp.stack([a, 0.5 * a]) if i < 3 else a for i, a in enumerate(args))
    axes = (0, 0, 0, None, None, None)
    for o, r in zip(jax.vmap(fn, in_axes=axes)(*batched), jax.vmap(jax.jit(merged_qkv), in_axes=axes)(*batched)):
        assert_close(o, r, TOL[jnp.float32])

    def loss(f):
        return lambda x, w: sum(jnp.sum(jnp.tanh(t) * (i + 1)) for i, t in enumerate(f(x, args[1], w, *args[3:])))
    for g, r in zip(jax.grad(loss(fn), argnums=(0, 1))(args[0], args[2]),
                    jax.grad(loss(jax.jit(merged_qkv)), argnums=(0, 1))(args[0], args[2])):
        assert_close(g, r, 1e-4)


def test_island_epilogue_lowers_for_cuda():
    """Cross-lowered for CUDA: the split-K matmul kernel and the island kernel reading its
    partials, both Triton."""
    args = _args(jnp.bfloat16)
    mod = cross_lower(optimize_kernels(merged_qkv, backend="triton"), *args)
    names = [k.name for k in mod.triton_kernels]
    assert len(names) == 2 and names[0].startswith("vtc_matmul_splitk") and names[1].startswith("pointwise"), names


def test_the_jit_model_does_not_read_the_merged_clusters():
    """``Report.modeled``'s plain-jit figures come from the model of XLA on plain jit's groups
    (``xla.xla_clusters``), whatever VTC's selection merged — the projection, its rotations and
    views in one cluster here — as the guard's ``price_plain`` prices jit."""
    from vtc_jax.accounting import modeled_bytes
    from vtc_jax.analysis import analyze
    from vtc_jax.xla import xla_clusters, xla_program
    args = _args(jnp.bfloat16)
    a = analyze(merged_qkv, args, {})
    merged = [c for c in a.clusters if c.kind == "matmul" and len(c.outputs) > 1]
    assert merged, [(c.kind, len(c.ops)) for c in a.clusters]   # (what this is about)
    m = modeled_bytes(a.graph, a.clusters, a.strategy)
    plain = xla_program(a.graph, xla_clusters(a.graph))
    assert (m["kernels_xla"], m["bytes_xla"]) == (plain.launches, plain.bytes)
