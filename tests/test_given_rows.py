"""New cache rows handed to the step (a serving loop's K/V rows of a paged or per-sequence cache):
the decode attention kernel performs their in-place scatter itself (``lower.deferred_updates``,
``vio.Update``): its loads see the rows, its programs write them, and XLA runs no scatter.

Every result is compared with ``jax.jit`` of the same function (f32: 1e-5 relative; bf16: 2e-2),
the caches exactly; the emitted program is checked to hold no scatter, and lowered for CUDA.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax
from tests.zoo.corpus import CORPUS
from vtc_jax.testing import cross_lower

F32_TOL, BF16_TOL = 1e-5, 2e-2


def _optimize(fn, **kw):
    """The kernels themselves (the guard off: at these sizes XLA may price lower)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        return vtc_jax.optimize(fn, **{"guard": None, **kw})


def _check_equal(out, ref, tol):
    """Attention outputs within ``tol`` (relative to the largest reference value; a row with no
    valid key is NaN on both sides), caches equal."""
    o, r = np.asarray(out[0], np.float32), np.asarray(ref[0], np.float32)
    np.testing.assert_allclose(o, r, rtol=0, atol=tol * max(1.0, float(np.nanmax(np.abs(r)))), equal_nan=True)
    for a, b in zip(out[1:], ref[1:]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _check_no_scatter(fn, args, **kw):
    """The emitted program runs no scatter: the attention kernel wrote the rows."""
    text = str(jax.make_jaxpr(_optimize(fn, **kw))(*args))
    assert "scatter[" not in text and "pallas_call[" in text, text


def batching_step(q, kn, vn, ck, cv, pos):
    """Continuous batching: each sequence's new row at its own position, GQA by ``jnp.repeat``."""
    b = jnp.arange(ck.shape[0])
    return _batched_attention(q, ck.at[b, pos].set(kn), cv.at[b, pos].set(vn), pos)


def _batched_attention(q, ck, cv, pos):
    """The attention of :func:`batching_step` over caches already written, and the caches."""
    B, T, KV, D = ck.shape
    H = q.shape[2]
    k, v = jnp.repeat(ck, H // KV, axis=2), jnp.repeat(cv, H // KV, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D).astype(q.dtype)
    s = jnp.where(jnp.arange(T)[None, None, None, :] <= pos[:, None, None, None], s, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(B, 1, H * D), ck, cv


def _batching_args(pos, dtype=jnp.float32, B=3, T=256, H=4, KV=2, D=16):
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    return (jax.random.normal(ks[0], (B, 1, H, D), dtype), jax.random.normal(ks[1], (B, KV, D), dtype),
            jax.random.normal(ks[2], (B, KV, D), dtype), jax.random.normal(ks[3], (B, T, KV, D), dtype),
            jax.random.normal(ks[4], (B, T, KV, D), dtype), jnp.asarray(pos, jnp.int32))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)])
def test_continuous_batching_rows_are_written_by_the_attention_kernel(dtype, tol):
    """T = 256 makes the split kernel run two programs per head: the row at ``pos[b]`` is read from
    the given rows by whichever program holds it, and written by the programs' shares."""
    args = _batching_args([0, 100, 255], dtype)
    ref = jax.jit(batching_step)(*args)
    _check_equal(_optimize(batching_step)(*args), ref, tol)
    _check_equal(_optimize(batching_step, donate_argnums=(3, 4))(*[jnp.array(a) for a in args]), ref, tol)
    _check_equal(jax.jit(_optimize(batching_step))(*args), ref, tol)
    _check_no_scatter(batching_step, args)


def test_rows_of_a_vmapped_step_are_written_per_batch_element():
    args = _batching_args([3, 17, 200])
    qs = jnp.stack([args[0], -args[0]])
    ref = jax.vmap(jax.jit(batching_step), in_axes=(0, None, None, None, None, None))(qs, *args[1:])
    out = jax.vmap(_optimize(batching_step), in_axes=(0, None, None, None, None, None))(qs, *args[1:])
    for i in range(2):
        _check_equal([x[i] for x in out], [x[i] for x in ref], F32_TOL)


def test_rows_past_the_cache_are_dropped_and_negative_positions_wrap():
    """XLA drops a scatter row whose index is out of bounds (``pos = T``: the step then attends to
    every key), and jnp wraps a negative index before the scatter (``pos = -1``: row ``T - 1``,
    which the ``t <= -1`` mask then hides: a NaN row, as jit's); the kernel writes and reads
    exactly those rows."""
    args = _batching_args([256, -1, 40])
    ref = jax.jit(batching_step)(*args)
    _check_equal(_optimize(batching_step)(*args), ref, F32_TOL)


def one_position_step(q, kn, vn, ck, cv, pos):
    """One position for the whole batch, the rows written with ``.at[:, pos].set`` (a scatter of
    one ``(B, KV, D)`` window), a ``t <= pos`` mask."""
    B, T, KV, D = ck.shape
    H = q.shape[2]
    ck, cv = ck.at[:, pos].set(kn), cv.at[:, pos].set(vn)
    k = jnp.repeat(ck, H // KV, axis=2)
    v = jnp.repeat(cv, H // KV, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    s = jnp.where(jnp.arange(T) <= pos, s, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(B, 1, H * D), ck, cv


def test_one_window_for_the_whole_batch_is_written_by_the_attention_kernel():
    args = _batching_args(0)[:5] + (jnp.int32(130),)
    ref = jax.jit(one_position_step)(*args)
    _check_equal(_optimize(one_position_step)(*args), ref, F32_TOL)
    _check_equal(_optimize(one_position_step, donate_argnums=(3, 4))(*[jnp.array(a) for a in args]), ref, F32_TOL)
    _check_no_scatter(one_position_step, args)


def paged_step(q, k_new, v_new, k_pages, v_pages, table, lens):
    """vLLM-style paged decode (the corpus's ``paged_kv_decode``, f32): the new rows written into
    ``pages[table[b, pos // page], pos % page]``, the keys gathered through the block table."""
    B, M = table.shape
    page, KV, D = k_pages.shape[1:]
    G = q.shape[1] // KV
    pos = lens - 1
    blk = table[jnp.arange(B), pos // page]
    k_pages = k_pages.at[blk, pos % page].set(k_new)
    v_pages = v_pages.at[blk, pos % page].set(v_new)
    t = jnp.arange(M * page)
    k = k_pages[table[:, t // page], t % page]
    v = v_pages[table[:, t // page], t % page]
    s = jnp.einsum("bkgd,btkd->bkgt", q.reshape(B, KV, G, D), k) * D ** -0.5
    s = jnp.where((t[None] < lens[:, None])[:, None, None], s, -jnp.inf)
    out = jnp.einsum("bkgt,btkd->bkgd", jax.nn.softmax(s, axis=-1), v).reshape(B, -1)
    return out, k_pages, v_pages


def _paged_args(table, lens, page=8, KV=2, G=2, D=16):
    table = jnp.asarray(table, jnp.int32)
    B, _ = table.shape
    P = int(table.max()) + 2
    ks = jax.random.split(jax.random.PRNGKey(3), 5)
    return (jax.random.normal(ks[0], (B, KV * G, D)), jax.random.normal(ks[1], (B, KV, D)),
            jax.random.normal(ks[2], (B, KV, D)), jax.random.normal(ks[3], (P, page, KV, D)),
            jax.random.normal(ks[4], (P, page, KV, D)), table, jnp.asarray(lens, jnp.int32))


def test_paged_rows_are_written_through_the_block_table_by_the_attention_kernel():
    table = np.random.RandomState(0).permutation(40)[:32].reshape(2, 16)
    args = _paged_args(table, [5, 128])
    ref = jax.jit(paged_step)(*args)
    _check_equal(_optimize(paged_step)(*args), ref, F32_TOL)
    _check_equal(_optimize(paged_step, donate_argnums=(3, 4))(*[jnp.array(a) for a in args]), ref, F32_TOL)
    _check_no_scatter(paged_step, args)


def test_two_rows_for_one_page_slot_agree_with_the_cache_written():
    """Two sequences whose tables send their new rows to one page slot: jax leaves which row lands
    unspecified. Whichever the kernel writes, the attention read that row: the outputs equal
    jit's attention over the cache the kernel returned (with no update left to make)."""
    table = np.array([[4, 5, 6, 7], [0, 1, 6, 3]])        # both write page 6, slot 2 (pos 18)
    args = _paged_args(table, [19, 19])
    out = _optimize(paged_step)(*args)
    kp, vp = np.asarray(out[1]), np.asarray(out[2])
    slot = kp[6, 2]
    assert any(np.array_equal(slot, np.asarray(args[1][b])) for b in range(2)), slot
    b = next(b for b in range(2) if np.array_equal(slot, np.asarray(args[1][b])))
    np.testing.assert_array_equal(vp[6, 2], np.asarray(args[2][b]))   # K and V of one sequence

    def attend(q, k_pages, v_pages, table, lens):   # the same attention, no update
        B, M = table.shape
        page, KV, D = k_pages.shape[1:]
        t = jnp.arange(M * page)
        k, v = k_pages[table[:, t // page], t % page], v_pages[table[:, t // page], t % page]
        s = jnp.einsum("bkgd,btkd->bkgt", q.reshape(B, KV, -1, D), k) * D ** -0.5
        s = jnp.where((t[None] < lens[:, None])[:, None, None], s, -jnp.inf)
        return jnp.einsum("bkgt,btkd->bkgd", jax.nn.softmax(s, axis=-1), v).reshape(B, -1)

    ref = jax.jit(attend)(args[0], out[1], out[2], args[5], args[6])
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref), rtol=F32_TOL, atol=F32_TOL)


def test_paged_decode_at_paper_size_lowers_for_cuda_with_no_scatter():
    """The corpus's vLLM paged decode (B 16, 256 pages of 16 per sequence, 32/8 heads, bf16):
    lowered for CUDA, the two page writes live in the attention kernel (its caches aliased)."""
    e = CORPUS["paged_kv_decode"]("paper")
    base = cross_lower(jax.jit(e.step, donate_argnums=e.donate_argnums), *e.args)
    opt = cross_lower(_optimize(e.step, backend="triton", donate_argnums=e.donate_argnums), *e.args)
    assert base.count("stablehlo.scatter") == 2
    assert opt.count("stablehlo.scatter") == 0
    # the one gather left is the block table's (B,) lookup of each sequence's page, no cache's
    gathers = [l for l in opt.text.splitlines() if "stablehlo.gather" in l]
    assert len(gathers) == 1 and "-> tensor<16xi32>" in gathers[0], gathers
    assert any("decode_attention" in k.name for k in opt.triton_kernels), opt.triton_kernels


def test_a_stale_nan_in_the_slot_a_row_replaces_reaches_nothing():
    """The old contents of the slots the new rows go to never reach the result: a NaN there (a
    cache filled with NaN to catch reads of unwritten slots) is replaced, as jit's scatter does."""
    args = list(_batching_args([0, 100, 255]))
    for i in (3, 4):
        args[i] = args[i].at[jnp.arange(3), args[5]].set(jnp.nan)
    ref = jax.jit(batching_step)(*args)
    assert np.isfinite(np.asarray(ref[0])).all()
    _check_equal(_optimize(batching_step)(*args), ref, F32_TOL)


def int8_batching_step(q, kn, vn, ck, cv, k_scale, v_scale, pos):
    """An int8 cache with per-row scales, its new int8 rows handed to the step: K and V are read
    through a dequantising prologue whose scales the kernel also reads."""
    B, T, KV, D = ck.shape
    H = q.shape[2]
    b = jnp.arange(B)
    ck, cv = ck.at[b, pos].set(kn), cv.at[b, pos].set(vn)
    k = jnp.repeat(ck.astype(jnp.float32) * k_scale, H // KV, axis=2)
    v = jnp.repeat(cv.astype(jnp.float32) * v_scale, H // KV, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    s = jnp.where(jnp.arange(T)[None, None, None, :] <= pos[:, None, None, None], s, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(B, 1, H * D), ck, cv


def test_rows_of_a_cache_read_through_scales_are_written_before_the_kernel():
    """Where the kernel reads the updated cache through a prologue with operands (an int8
    cache's scales), it does not take the update: XLA's scatter runs first, and the attention
    kernel still serves the step — equal to jit either way."""
    q, kn, vn, ck, cv, pos = _batching_args([3, 64, 200])
    i8 = lambda x: jnp.clip(jnp.round(x * 40), -127, 127).astype(jnp.int8)
    ks = jax.random.uniform(jax.random.PRNGKey(1), ck.shape[:3] + (1,), minval=0.01, maxval=0.03)
    vs = jax.random.uniform(jax.random.PRNGKey(2), cv.shape[:3] + (1,), minval=0.01, maxval=0.03)
    args = (q, i8(kn), i8(vn), i8(ck), i8(cv), ks, vs, pos)
    ref = jax.jit(int8_batching_step)(*args)
    _check_equal(_optimize(int8_batching_step)(*args), ref, F32_TOL)
    text = str(jax.make_jaxpr(_optimize(int8_batching_step))(*args))
    assert "vtc_decode_attention" in text, text


def test_the_split_kernel_keeps_its_pipelined_loads_with_rows_to_write():
    """Compiled deviceless for an H100 (sm_90 PTX, ``ptxas -v``): the paged decode's split kernel
    still streams K and V with ``cp.async`` (the rows are folded into the scores and P·V, not
    patched into the loaded blocks, which left one tile in flight), without spills, and the
    program is three launches where jit's is eight."""
    from vtc_jax.offline import compile_program
    e = CORPUS["paged_kv_decode"]("paper")
    prog = compile_program(_optimize(e.step, backend="triton", donate_argnums=e.donate_argnums), *e.args,
                           donate_argnums=e.donate_argnums)
    if not prog.kernels:
        pytest.skip(f"no PTX to inspect: {prog.kernel_error}")
    split = prog.kernel("vtc_decode_attention_split")
    assert split is not None and split.spill_store_bytes == 0, split
    assert "cp.async" in split.ptx
    assert len(prog.launches) == 3, [x.name for x in prog.launches]


def _pallas_calls(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and e.primitive.name != "pallas_call":
                    yield from _pallas_calls(inner)


def test_the_kernel_that_performs_the_update_reads_its_cache_and_a_row_writer_does_not():
    """``primitives.kernel_reads_in_place``, what the model of XLA and the compile's count charge
    a kernel for a buffer it updates in place: the attention kernel that performs the page writes
    loads from both pages it updates (charged whole); the projection's reduce that writes its rows
    into a cache (the corpus's paged decode layer, rows made in the step) only stores into it."""
    from types import SimpleNamespace
    from vtc_jax.primitives import kernel_reads_in_place

    def reads(fn, args):
        """{kernel name: the sizes of the in-place operands it reads}, for kernels with any."""
        out = {}
        for e in _pallas_calls(jax.make_jaxpr(_optimize(fn))(*args).jaxpr):
            if e.params["input_output_aliases"]:
                name = e.params["name"] if "name" in e.params else e.params["name_and_src_info"].name
                got = kernel_reads_in_place(SimpleNamespace(primitive="pallas_call", params=e.params))
                out[name] = sorted(e.invars[i].aval.size for i in got)
        return out

    table = np.random.RandomState(0).permutation(40)[:32].reshape(2, 16)
    args = _paged_args(table, [5, 128])
    got = reads(paged_step, args)
    (name,) = got
    assert "decode_attention" in name and got[name] == [args[3].size, args[4].size], got
    e = CORPUS["paged_kv_decode_layer"]("small")
    got = reads(e.step, e.args)
    assert got and all(v == [] for v in got.values()), got


def clip_batching_step(q, kn, vn, ck, cv, pos):
    """Continuous batching written with ``mode="clip"``: XLA clamps an out-of-bounds position into
    the cache (a decode loop run past its end writes its last row) instead of dropping the row."""
    b = jnp.arange(ck.shape[0])
    return _batched_attention(q, ck.at[b, pos].set(kn, mode="clip"), cv.at[b, pos].set(vn, mode="clip"), pos)


def clip_raw_step(q, kn, vn, ck, cv, pos):
    """``lax.scatter`` at ``mode=CLIP`` with raw indices (a negative one clamps to 0, unwrapped)."""
    idx = jnp.stack([jnp.arange(ck.shape[0]), pos], -1)
    dn = jax.lax.ScatterDimensionNumbers((1, 2), (0, 1), (0, 1))
    ck = jax.lax.scatter(ck, idx, kn, dn, mode=jax.lax.GatherScatterMode.CLIP)
    cv = jax.lax.scatter(cv, idx, vn, dn, mode=jax.lax.GatherScatterMode.CLIP)
    return _batched_attention(q, ck, cv, pos)


def clip_computed_step(q, x, w, ck, cv, pos):
    """The rows made in the step (a projection) and written with ``mode="clip"``: the producer's
    write map clamps too."""
    B, _, KV, D = ck.shape
    kn, vn = jnp.split((x @ w).reshape(B, 2 * KV, D), 2, axis=1)
    return clip_batching_step(q, kn, vn, ck, cv, pos)


@pytest.mark.parametrize("step,pos", [(clip_batching_step, [300, -5, 10]), (clip_raw_step, [700, -3, 64]),
                                      (clip_computed_step, [300, 3, 255])])
def test_rows_written_with_mode_clip_are_clamped_into_the_cache(step, pos):
    """``scatter(mode="clip")`` clamps each index into bounds (XLA's semantics), where the default
    mode drops the row: the kernel writes and reads the clamped rows (found by a helper's probes:
    they were dropped, by the row writes of both the attention and the projection's kernel)."""
    args = _batching_args(pos)
    if step is clip_computed_step:
        ks = jax.random.split(jax.random.PRNGKey(9), 2)
        args = (args[0], jax.random.normal(ks[0], (3, 8)), jax.random.normal(ks[1], (8, 64))) + args[3:]
    ref = jax.jit(step)(*args)
    _check_equal(_optimize(step)(*args), ref, F32_TOL)
