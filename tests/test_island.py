"""Re-clustering after elimination: pointwise clusters joined only by movement become ONE kernel.

RoPE is the case that matters (issue 11: "RoPE = 6 kernels"; issue 9: the K row written by the
RoPE kernel): ``cluster.fuse_islands`` groups the island, ``templates/island.py`` recomputes the
values a movement op inside it moves at the mapped indices. Every program here is checked against
``jax.jit`` (f32: 1e-6 relative) in Pallas interpret mode, and the structure against ``explain``
and the CUDA-lowered module.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax
from vtc_jax.testing import cross_lower

TOL = 1e-6


def _rel_err(out, ref) -> float:
    """Largest |out - ref| over the leaves, relative to max(1, max |ref|); shapes must agree."""
    errs = []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape
        errs.append(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b))))
    return max(errs)


def _close(out, ref, tol=TOL):
    err = _rel_err(out, ref)
    assert err <= tol, err


def _optimize(fn, **kw):
    """The island kernels themselves (the guard off: at these sizes XLA's fusion may price lower)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        return vtc_jax.optimize(fn, **{"guard": None, **kw})


def _rotate_half(x):
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope_step(w, x, k_cache, pos):
    """A decode step's K path: projection, RoPE (rotate-half), the rotated row into the cache."""
    b = x.shape[0]
    k = (x @ w).reshape(b, 1, 4, 16)
    ang = pos.astype(jnp.float32) * (1.0 / 10000.0 ** (jnp.arange(8, dtype=jnp.float32) / 8))
    cos = jnp.concatenate([jnp.cos(ang)] * 2)
    sin = jnp.concatenate([jnp.sin(ang)] * 2)
    k = k * cos + _rotate_half(k) * sin
    return jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, pos, 0, 0))


def _rope_args(dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(ks[0], (32, 64), dtype), jax.random.normal(ks[1], (2, 32), dtype),
            jax.random.normal(ks[2], (2, 8, 4, 16), dtype), jnp.int32(5))


def _island_clusters(report):
    """Pointwise clusters that hold movement ops (fused islands) and their template verdicts."""
    verdict = {cid: why for cid, _, why in report.templates}
    g = report.graph
    return {c.id: verdict.get(c.id) for c in report.clusters if str(c.kind) == "pointwise"
            and any(g.ops[o].primitive in ("concatenate", "slice", "pad", "transpose") for o in c.ops)}


def test_rope_island_is_one_kernel_that_writes_the_cache_row():
    args = _rope_args()
    rep = vtc_jax.explain(rope_step, donate_argnums=(2,))(*args)
    islands = _island_clusters(rep)
    assert list(islands.values()) == ["kernel"], (islands, rep.templates)
    (cid,) = islands
    ops = {rep.graph.ops[o].primitive for o in next(c for c in rep.clusters if c.id == cid).ops}
    assert {"concatenate", "neg", "mul", "add"} <= ops, ops
    # the K row goes into the cache from that kernel: the update op is eliminated, in place
    res = rep.strategy.resolution
    dus = [op.id for op in rep.graph.ops if op.primitive == "dynamic_update_slice"]
    assert dus and all(o in res.eliminated or o in res.inplace for o in dus)
    ref = jax.jit(rope_step)(*args)
    _close(_optimize(rope_step)(*args), ref)
    _close(_optimize(rope_step, donate_argnums=(2,))(*[jnp.array(a) for a in args]), ref)


def test_rope_island_lowers_for_cuda_with_no_movement_left():
    args = _rope_args(jnp.bfloat16)
    opt = cross_lower(_optimize(rope_step, backend="triton", donate_argnums=(2,)), *args)
    base = cross_lower(jax.jit(rope_step, donate_argnums=(2,)), *args)
    assert base.count("stablehlo.concatenate") >= 1 and base.count("stablehlo.dynamic_update_slice") == 1
    # the rotate-half concat and the cache update live inside Triton kernels now
    for op in ("concatenate", "dynamic_update_slice", "gather", "scatter"):
        assert opt.count(f"stablehlo.{op}") == 0, (op, opt.count(f"stablehlo.{op}"))
    assert len(opt.triton_kernels) >= 1


def qk_rope_step(w, x, k_cache, pos):
    """A GQA decode step's q and k rotations (4 query heads, 2 KV heads), both cut out of one
    projection; k's row goes into the cache."""
    b = x.shape[0]
    qk = x @ w
    q, k = qk[:, :64].reshape(b, 1, 4, 16), qk[:, 64:].reshape(b, 1, 2, 16)
    ang = pos.astype(jnp.float32) * (1.0 / 10000.0 ** (jnp.arange(8, dtype=jnp.float32) / 8))
    cos, sin = jnp.concatenate([jnp.cos(ang)] * 2), jnp.concatenate([jnp.sin(ang)] * 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, pos, 0, 0))


def _qk_rope_args(dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    return (jax.random.normal(ks[0], (32, 96), dtype), jax.random.normal(ks[1], (3, 32), dtype),
            jax.random.normal(ks[2], (3, 8, 2, 16), dtype), jnp.int32(6))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, TOL), (jnp.bfloat16, 2e-2)])
def test_sibling_rotations_are_one_kernel_over_the_union_of_their_shapes(dtype, tol):
    """q's and k's rotations, islands cut out of one projection with no path between them
    (``cluster.sibling_islands``), are one kernel over ``(B, 1, 4, 16)``, the union of their
    shapes; k's lanes beyond its 2 heads read nothing and are never stored, and its row goes into
    the cache from that kernel (XLA's one loop fusion for both; a launch each before)."""
    args = _qk_rope_args(dtype)
    ref = jax.jit(qk_rope_step)(*args)
    rep = _check_one_kernel_for_q_and_k(qk_rope_step, args)
    dus = [op.id for op in rep.graph.ops if op.primitive == "dynamic_update_slice"]
    assert dus and all(o in rep.strategy.resolution.eliminated for o in dus)
    _close(_optimize(qk_rope_step)(*args), ref, tol)
    _close(_optimize(qk_rope_step, donate_argnums=(2,))(*[jnp.array(a) for a in args]), ref, tol)
    _close(jax.vmap(_optimize(qk_rope_step), in_axes=(None, 0, None, None))(
        args[0], jnp.stack([args[1], -args[1]]), args[2], args[3])[1][0], ref[1], tol)
    _check_lowers_with_one_rotation_kernel(qk_rope_step, args)


def _check_one_kernel_for_q_and_k(step, args):
    """``explain(step)``: one island kernel, writing q's ``(3, 1, 4, 16)`` and k's ``(3, 1, 2, 16)``."""
    rep = vtc_jax.explain(step, donate_argnums=(2,))(*args)
    islands = _island_clusters(rep)
    assert list(islands.values()) == ["kernel"], (islands, rep.templates)
    (cid,) = islands
    outs = next(c for c in rep.clusters if c.id == cid).outputs
    assert sorted(rep.graph.tensors[t].shape for t in outs) == [(3, 1, 2, 16), (3, 1, 4, 16)]
    return rep


def _check_lowers_with_one_rotation_kernel(step, args):
    """Lowered for CUDA: no concatenation or cache update left to XLA, one pointwise kernel."""
    lowered = cross_lower(_optimize(step, backend="triton", donate_argnums=(2,)), *args)
    assert lowered.count("stablehlo.dynamic_update_slice") == 0 and lowered.count("stablehlo.concatenate") == 0
    assert sum("pointwise" in k for k in lowered.triton_kernels) == 1, lowered.triton_kernels


def hf_rope_step(w, x, k_cache, pos):
    """Hugging Face's rotary embedding: ``emb = cat(freqs, freqs)``, ``cos = emb.cos()`` computed in
    the step and applied to q and k cut out of one projection; k's row goes into the cache."""
    b = x.shape[0]
    qk = x @ w
    q, k = qk[:, :64].reshape(b, 1, 4, 16), qk[:, 64:].reshape(b, 1, 2, 16)
    freqs = pos.astype(jnp.float32) * (1.0 / 10000.0 ** (jnp.arange(0, 16, 2, dtype=jnp.float32) / 16))
    emb = jnp.concatenate([freqs, freqs])
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, pos, 0, 0))


def test_one_island_with_results_of_two_shapes_is_one_kernel():
    """Hugging Face's rotation computes cos and sin of ``cat(freqs, freqs)`` once for q and k: q's
    and k's rotations and the tables are one island (``xla.pointwise_islands``) whose results have
    two shapes. It is one kernel over their union (``fuse_islands(..., union=True)``); it was left
    to XLA ("its results have different shapes")."""
    args = _qk_rope_args()
    ref = jax.jit(hf_rope_step)(*args)
    _check_one_kernel_for_q_and_k(hf_rope_step, args)
    _close(_optimize(hf_rope_step, donate_argnums=(2,))(*[jnp.array(a) for a in args]), ref)
    _check_lowers_with_one_rotation_kernel(hf_rope_step, args)


def pad_transpose_step(x, y, buf, pos):
    """An island joined by a pad (with its own value), a slice, a transpose and a size-1 operand."""
    a = jnp.tanh(x)                                              # (3, 6, 8)
    b = jnp.pad(a, ((0, 0), (2, 1), (0, 0)), constant_values=0.5)[:, 1:7]   # border rows 0.5
    c = jnp.transpose(jnp.exp(x), (0, 1, 2)) * 0.25
    out = (b * y + c).astype(buf.dtype)                          # y: (3, 1, 8), broadcast in-op
    return jax.lax.dynamic_update_slice(buf, out[None], (pos, 0, 0, 0))


def test_island_with_pad_slice_and_broadcast_operand_equals_jit():
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    args = (jax.random.normal(ks[0], (3, 6, 8)), jax.random.normal(ks[1], (3, 1, 8)),
            jnp.zeros((4, 3, 6, 8)), jnp.int32(2))
    ref = jax.jit(pad_transpose_step)(*args)
    _close(_optimize(pad_transpose_step)(*args), ref)
    _close(_optimize(pad_transpose_step, donate_argnums=(2,))(*[jnp.array(a) for a in args]), ref)
    # the pad's border rows really carry the pad value through the kernel
    x = np.asarray(args[0]); y = np.asarray(args[1])
    got = np.asarray(_optimize(pad_transpose_step)(*args))[2]
    np.testing.assert_allclose(got[:, 0], 0.5 * y[:, 0] + 0.25 * np.exp(x[:, 0]), rtol=1e-5)


def shuffle_step(x, w, buf, pos):
    """Channel shuffle between two pointwise clusters (reshape → transpose → reshape)."""
    h = jnp.maximum(x @ w, 0.0)                         # (4, 8): the matmul's epilogue
    s = jnp.sin(h) + 1.0
    n, c = s.shape
    s = s.reshape(n, 2, c // 2).transpose(0, 2, 1).reshape(n, c)
    return jax.lax.dynamic_update_slice(buf, (s * 3.0)[None], (pos, 0, 0))


def test_shuffle_island_equals_jit_under_vmap_and_nested_jit():
    ks = jax.random.split(jax.random.PRNGKey(2), 2)
    args = (jax.random.normal(ks[0], (4, 16)), jax.random.normal(ks[1], (16, 8)), jnp.zeros((3, 4, 8)),
            jnp.int32(1))
    # the unary `sin + 1` is moved below the shuffle's views (graph._sink_elementwise), so one
    # pointwise kernel reads the matmul's output through them: nothing is left for XLA to move
    rep = vtc_jax.explain(shuffle_step)(*args)
    assert [w for _, k, w in rep.templates if k == "pointwise"] == ["kernel"], rep.templates
    assert rep.strategy.resolution.executed == ()
    ref = jax.jit(shuffle_step)(*args)
    f = _optimize(shuffle_step)
    assert _rel_err(f(*args), ref) <= TOL
    assert _rel_err(jax.jit(lambda *a: f(*a))(*args), ref) <= TOL
    xs = jnp.stack([args[0], args[0] * 2.0])
    assert _rel_err(jax.vmap(f, in_axes=(0, None, None, None))(xs, *args[1:]),
                    jax.vmap(shuffle_step, in_axes=(0, None, None, None))(xs, *args[1:])) <= TOL


def escaping_step(x, buf, pos):
    """The slice between the two clusters is also returned: results of two shapes."""
    a = jnp.exp(x)
    half = a[:, :4]
    b = jnp.concatenate([half, half], axis=1) * 2.0
    return jax.lax.dynamic_update_slice(buf, b[None], (pos, 0, 0)), half


def escaping_rank_step(x, buf, pos):
    """As :func:`escaping_step`, the island's other result flattened: results of two ranks."""
    a = jnp.exp(x)
    half = a[:, :4]
    b = jnp.concatenate([half, half], axis=1).reshape(-1) * 2.0
    return jax.lax.dynamic_update_slice(buf, b[None], (pos, 0)), half


def test_island_with_a_returned_part_is_one_kernel_over_both_shapes():
    """The returned slice ``(2, 4)`` and the concatenation ``(2, 8)`` written into ``buf``: one
    kernel over their union, the slice stored within its own extent."""
    args = (jax.random.normal(jax.random.PRNGKey(3), (2, 8)), jnp.zeros((3, 2, 8)), jnp.int32(1))
    rep = vtc_jax.explain(escaping_step)(*args)
    assert list(_island_clusters(rep).values()) == ["kernel"], rep.templates
    _close(_optimize(escaping_step)(*args), jax.jit(escaping_step)(*args))


def test_island_that_cannot_be_one_kernel_stays_xla_and_right():
    """Results of two ranks have no one grid (``indexmap.union_shape``): the island stays XLA's."""
    args = (jax.random.normal(jax.random.PRNGKey(3), (2, 8)), jnp.zeros((3, 16)), jnp.int32(1))
    rep = vtc_jax.explain(escaping_rank_step)(*args)
    assert not _island_clusters(rep)
    _close(_optimize(escaping_rank_step)(*args), jax.jit(escaping_rank_step)(*args))


def test_fuse_islands_explains_what_it_leaves():
    from vtc_jax import xla
    from vtc_jax.cluster import cluster, fuse_islands
    from vtc_jax.graph import trace
    from vtc_jax.templates import match_all
    args = (jax.random.normal(jax.random.PRNGKey(3), (2, 8)), jnp.zeros((3, 2, 8)), jnp.int32(1))
    g = trace(escaping_step, *args)
    cl = cluster(g)
    islands = xla.pointwise_islands(g, cl, match_all(g, cl))
    assert islands
    new, left = fuse_islands(g, cl, islands)
    assert new == cl and "different shapes" in next(iter(left.values()))
    ga = trace(rope_step, *_rope_args())
    ca = cluster(ga)
    new, left = fuse_islands(ga, ca, xla.pointwise_islands(ga, ca, match_all(ga, ca)))
    assert len(new) < len(ca) and not left
    assert sorted(o for c in new for o in c.ops) == sorted(o for c in ca for o in c.ops)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, TOL), (jnp.bfloat16, 2e-2)])
def test_rope_island_dtypes(dtype, tol):
    args = _rope_args(dtype)
    f = _optimize(rope_step, donate_argnums=(2,))
    out = f(*[jnp.array(a) for a in args])
    assert out.dtype == dtype
    assert _rel_err(out, jax.jit(rope_step)(*args)) <= tol
    _, lowered = f.last
    assert any(k.startswith("pointwise") and "concatenate" in k for k in lowered.kernels), lowered.kernels


def test_position_tables_are_recomputed_in_the_kernel():
    """cos/sin(pos·θ_j) tables read by the RoPE kernel are recomputed in it from ``pos`` and the
    index (``island._table_ops``, ``island.Index``): XLA would otherwise launch a fusion for each
    table (it does not constant-fold an iota a custom call reads)."""
    from vtc_jax.analysis import analyze
    from vtc_jax.templates import Match, island
    args = _rope_args()
    a = analyze(rope_step, args, {}, donate_argnums=(2,))
    plans = [m.detail.island for m in a.matches.values()
             if isinstance(m, Match) and getattr(m.detail, "island", None) is not None]
    assert len(plans) == 1
    p = plans[0]
    loaded = {a.graph.tensors[s.tensor].shape for s in p.inputs if isinstance(s, island.Load)}
    assert (16,) not in loaded and (8,) not in loaded, loaded          # no table is loaded
    assert p.uses_index and any(isinstance(s, island.Apply) and a.graph.ops[s.op].primitive == "cos"
                                for s in p.steps)
    for pos in (0, 5, 7):
        args = (*args[:3], jnp.int32(pos))
        _close(_optimize(rope_step, donate_argnums=(2,))(*[jnp.array(x) for x in args]),
               jax.jit(rope_step)(*args))


def runtime_window_step(x, buf, pos):
    """Two pointwise clusters joined by a dynamic_slice at a runtime start: the island's plan
    declines it (a runtime offset), so it stays its parts, left to XLA's one loop fusion."""
    a = jnp.exp(x)
    b = jax.lax.dynamic_slice(a, (pos, 0), (2, 8)) * 2.0
    return jax.lax.dynamic_update_slice(buf, b[None], (pos, 0, 0))


def test_island_the_plan_declines_is_left_to_xla_without_a_warning():
    from vtc_jax.analysis import analyze
    args = (jax.random.normal(jax.random.PRNGKey(5), (6, 8)), jnp.zeros((5, 2, 8)), jnp.int32(3))
    a = analyze(runtime_window_step, args, {})
    assert not [c for c in a.clusters if str(c.kind) == "pointwise"
                and any(a.graph.ops[o].primitive == "dynamic_slice" for o in c.ops)]
    assert a.xla_fused, "the two pointwise clusters are XLA's loop fusion"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = vtc_jax.optimize(runtime_window_step, backend="interpret")(*args)
    assert not [w for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)
                and "runs in XLA" in str(w.message)], [str(w.message) for w in rec]
    _close(out, jax.jit(runtime_window_step)(*args))


# ---- property: random movement between two elementwise stages, one kernel, jit's numbers -------

from hypothesis import HealthCheck, given, settings   # noqa: E402
from hypothesis import strategies as st               # noqa: E402

_MOVES = ("rotate", "pad_slice", "transpose_back", "reshape_back", "flip_halves")


def _move(kind: str, y):
    """A shape-preserving movement between the stages (each a different read-edge map)."""
    h = y.shape[-1] // 2
    if kind == "rotate":          # rotate-half: two slices and a concat of a computed piece
        return jnp.concatenate([-y[..., h:], y[..., :h]], axis=-1)
    if kind == "pad_slice":       # a pad with its own value, sliced back to the shape
        return jnp.pad(y, ((0, 0), (1, 0), (0, 0)), constant_values=0.75)[:, :-1]
    if kind == "transpose_back":  # a transpose and its inverse around a negation
        return -jnp.transpose(jnp.transpose(y, (0, 2, 1)) * 1.5, (0, 2, 1))
    if kind == "reshape_back":
        return jnp.reshape(jnp.reshape(y, (y.shape[0], -1)) + 0.5, y.shape)
    return jnp.concatenate([y[..., h:], y[..., :h]], axis=-1)   # flip_halves (pure movement)


@settings(max_examples=10, deadline=None, derandomize=True, print_blob=False,
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(_MOVES), min_size=1, max_size=3), st.integers(0, 4))
def test_random_islands_equal_jit(moves, pos):
    def step(x, buf, p):
        y = jnp.tanh(x) * 2.0
        for k in moves:
            y = _move(k, y) * 0.5 + 0.25
        return jax.lax.dynamic_update_slice(buf, (y * y)[None], (p, 0, 0, 0))
    x = jax.random.normal(jax.random.PRNGKey(len(moves) + pos), (2, 3, 8))
    args = (x, jnp.zeros((5, 2, 3, 8)), jnp.int32(pos))
    # every pointwise cluster is a kernel (the island fused, or the movement moved out of the
    # way: graph._sink_elementwise) and XLA executes no movement op
    rep = vtc_jax.explain(step, donate_argnums=(1,))(*args)
    assert all(why == "kernel" for _, kind, why in rep.templates if kind == "pointwise"), rep.templates
    assert rep.strategy.resolution.executed == (), (moves, rep.strategy.resolution.executed)
    _close(_optimize(step, donate_argnums=(1,))(*[jnp.array(a) for a in args]), jax.jit(step)(*args))


def test_an_island_that_would_recompute_too_much_is_declined(monkeypatch):
    """An island asking for more values than ``island.MAX_VALUES`` (an associative scan's slice/pad
    tree at 2,048 steps asked for ~10,000: 20 s of analysis) is declined with the reason, and the
    program still equals jax.jit. Shown on RoPE with the budget lowered to a few values."""
    from vtc_jax.templates import Reject, island
    monkeypatch.setattr(island, "MAX_VALUES", 4)
    args = _rope_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = vtc_jax.explain(rope_step)(*args)
    why = [w for _, _, w in rep.templates if f"more than {island.MAX_VALUES} values" in w]
    assert why, rep.templates
    _close(_optimize(rope_step)(*args), jax.jit(rope_step)(*args))
