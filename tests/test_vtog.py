"""The VTOG (paper §5.1): the paper's Fig. 5 / Fig. 6 graphs built from Edge objects with real
index maps, Fig. 7's three strategies as points-to graphs, and Algorithm 1 on traced graphs."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vtc_jax.indexmap import IndexMap, Layout, SymInfo, sym
from vtc_jax.movement import Edge
from vtc_jax.strategy import StrategyError, from_edges
from vtc_jax.vtog import boxes_overlap, build_vtog, build_vtog_from_edges, piece_group

# Fig. 5 tensors: a = QKV-like output, split into q and b; b reshaped to c; c written into the
# K cache at `pos` by ScatterND (dynamic_update_slice), giving d.
A, Q, B, C, K, D = range(6)
SPLIT, RESHAPE, DUS = 0, 1, 2
SHAPES = {A: (1, 12), Q: (1, 8), B: (1, 4), C: (1, 1, 2, 2), K: (1, 8, 2, 2), D: (1, 8, 2, 2)}
POS = SymInfo("pos", 0, 7)


def edge(src, dst, op, prim, m, box=None, klass="I", inplace=False):
    direction = "read" if (op, src) in {(SPLIT, Q), (SPLIT, B), (RESHAPE, C), (DUS, D)} else "write"
    box = tuple((0, n) for n in SHAPES[src]) if box is None else tuple(box)
    return Edge(src, dst, op, prim, direction, box, m, klass, inplace)


def fig5_edges():
    pieces = Layout.concatenate([Layout.physical(Q, SHAPES[Q]), Layout.physical(B, SHAPES[B])], 1).pieces
    return {
        "a->q": edge(A, Q, SPLIT, "split", pieces[0].map, pieces[0].box()),
        "a->b": edge(A, B, SPLIT, "split", pieces[1].map, pieces[1].box()),
        "q->a": edge(Q, A, SPLIT, "split", IndexMap.identity(SHAPES[A]).offset(1, 0, 8)),
        "b->a": edge(B, A, SPLIT, "split", IndexMap.identity(SHAPES[A]).offset(1, 8, 4)),
        "b->c": edge(B, C, RESHAPE, "reshape", IndexMap.identity(SHAPES[C]).reshape(SHAPES[B])),
        "c->b": edge(C, B, RESHAPE, "reshape", IndexMap.identity(SHAPES[B]).reshape(SHAPES[C])),
        "d->K": edge(D, K, DUS, "dynamic_update_slice", IndexMap.identity(SHAPES[K]), inplace=True),
        "c->d": edge(C, D, DUS, "dynamic_update_slice",
                     IndexMap.identity(SHAPES[D]).dynamic_slice([0, sym("pos"), 0, 0], SHAPES[C], (POS,)),
                     klass="II"),
    }


def fig5_vtog():
    es = fig5_edges()
    v = build_vtog_from_edges(range(6), es.values(), physical={K}, reasons={K: "graph input"}, shapes=SHAPES)
    return v, {name: v.index(e) for name, e in es.items()}


def test_fig5_vtog_edges():
    v, ix = fig5_vtog()
    pairs = {(e.src, e.dst) for e in v.edges}
    # Split: edges between a and b; Reshape: between b and c; ScatterND: c, d and the K cache.
    assert {(A, B), (B, A)} <= pairs
    assert {(B, C), (C, B)} <= pairs
    assert {(C, D), (D, K)} <= pairs
    assert v.out_edges(K) == () and K in v.physical and v.reasons[K] == "graph input"
    assert set(v.out_edges(A)) == {ix["a->q"], ix["a->b"]}
    assert set(v.in_edges(K)) == {ix["d->K"]}
    # a's two split pieces are disjoint: compatible; c's two options overlap: conflict
    assert not v.in_conflict(ix["a->q"], ix["a->b"])
    assert v.in_conflict(ix["c->b"], ix["c->d"])
    assert piece_group(v, ix["a->b"]) == tuple(sorted((ix["a->q"], ix["a->b"])))
    assert piece_group(v, ix["c->d"]) == (ix["c->d"],)


def test_physical_sources_are_dropped():
    es = fig5_edges()
    v = build_vtog_from_edges(range(6), es.values(), physical={K, D}, shapes=SHAPES)
    assert v.out_edges(D) == ()
    assert any(e.src == D for e, _ in v.dropped)
    assert any((e.src, e.dst) == (C, D) for e in v.edges)   # edges *into* a physical tensor stay


def test_fig6_conflicts():
    """c = concat(a, b) and d = transpose(c): c ⇢ a (1) and c ⇢ b (2) are disjoint pieces, c ⇢ d (3)
    covers all of c, so 1&3 and 2&3 conflict (an element would get two homes), 1&2 do not."""
    a, b, c, d = range(4)
    pieces = Layout.concatenate([Layout.physical(a, (4, 3)), Layout.physical(b, (4, 5))], 1).pieces
    e1 = Edge(c, a, 0, "concatenate", "read", pieces[0].box(), pieces[0].map, "II")
    e2 = Edge(c, b, 0, "concatenate", "read", pieces[1].box(), pieces[1].map, "II")
    e3 = Edge(c, d, 1, "transpose", "write", ((0, 4), (0, 8)), IndexMap.identity((4, 8)).transpose((1, 0)), "II")
    e4 = Edge(a, c, 0, "concatenate", "write", ((0, 4), (0, 3)), IndexMap.identity((4, 8)).offset(1, 0, 3), "II")
    v = build_vtog_from_edges(range(4), [e1, e2, e3, e4], shapes={d: (8, 4)})
    i1, i2, i3 = v.index(e1), v.index(e2), v.index(e3)
    assert v.in_conflict(i1, i3) and v.in_conflict(i2, i3)
    assert not v.in_conflict(i1, i2)
    assert v.conflicts == {tuple(sorted((i1, i3))), tuple(sorted((i2, i3)))}
    assert all(i < j for i, j in v.conflicts)
    assert v.conflicting(i3) == {i1, i2}
    # a read edge (1) and a write edge (3) out of c: same overlap rule
    assert (e1.direction, e3.direction) == ("read", "write")
    # strategies: 1&2 together are a valid points-to graph; 1&3 is not
    from_edges(v, [i1, i2]).validate()
    with pytest.raises(StrategyError, match="conflicting"):
        from_edges(v, [i1, i3]).validate()


def test_boxes_overlap():
    assert boxes_overlap(((0, 2), (0, 4)), ((1, 3), (3, 5)))
    assert not boxes_overlap(((0, 2), (0, 4)), ((0, 2), (4, 8)))
    assert boxes_overlap((), ())


# --------------------------------------------------------------------------------------------
# Fig. 7: three points-to graphs of Fig. 5
# --------------------------------------------------------------------------------------------

def _buffers(rng):
    return {t: rng.standard_normal(SHAPES[t]).astype(np.float32) for t in (A, Q, B, C, K, D)}


def test_fig7_strategy1_everything_in_the_k_cache():
    v, ix = fig5_vtog()
    s = from_edges(v, [ix[n] for n in ("a->q", "a->b", "b->c", "c->d", "d->K")])
    s.validate()
    assert s.virtual == {A, B, C, D}
    for t in (B, C, D):
        assert s.layout(t).targets == (K,)
    assert set(s.layout(A).targets) == {Q, K}
    assert [e.dst for e in s.points_to(B)] == [C]
    bufs, pos = _buffers(np.random.default_rng(0)), 3
    a = s.layout(A).evaluate(bufs, {"pos": pos})
    np.testing.assert_array_equal(a[:, :8], bufs[Q])
    np.testing.assert_array_equal(a[0, 8:], bufs[K][0, pos].reshape(4))
    np.testing.assert_array_equal(s.layout(C).evaluate(bufs, {"pos": pos}), bufs[K][:, pos:pos + 1])
    np.testing.assert_array_equal(s.layout(D).evaluate(bufs, {"pos": pos}), bufs[K])


def test_fig7_strategy2_b_and_k_cache_physical():
    v, ix = fig5_vtog()
    s = from_edges(v, [ix[n] for n in ("a->q", "a->b", "c->b", "d->K")])
    s.validate()
    assert not s.is_virtual(B) and not s.is_virtual(K)
    assert s.layout(C).targets == (B,) and s.layout(D).targets == (K,)
    assert set(s.layout(A).targets) == {Q, B}
    bufs = _buffers(np.random.default_rng(1))
    np.testing.assert_array_equal(s.layout(C).evaluate(bufs), bufs[B].reshape(SHAPES[C]))
    np.testing.assert_array_equal(s.layout(A).evaluate(bufs), np.concatenate([bufs[Q], bufs[B]], 1))


def test_fig7_strategy3_all_physical():
    v, _ = fig5_vtog()
    s = from_edges(v, [])
    s.validate()
    for t in range(6):
        assert not s.is_virtual(t)
        assert s.layout(t) == Layout.physical(t, SHAPES[t])


@pytest.mark.parametrize("names, match", [
    (("a->b",), "cover"),                       # half of a is virtual: not a strategy
    (("b->c", "c->b"), "cycle"),
    (("c->b", "c->d"), "conflicting"),
])
def test_invalid_points_to_graphs(names, match):
    v, ix = fig5_vtog()
    with pytest.raises(StrategyError, match=match):
        from_edges(v, [ix[n] for n in names]).validate()


def test_pinned_tensor_cannot_be_virtual():
    es = fig5_edges()
    v = build_vtog_from_edges(range(6), es.values(), physical={K}, shapes=SHAPES)
    # smuggle an edge out of K past build_vtog_from_edges
    bad = Edge(K, D, DUS, "dynamic_update_slice", "write", tuple((0, n) for n in SHAPES[K]),
               IndexMap.identity(SHAPES[K]), "I")
    v2 = dataclasses.replace(build_vtog_from_edges(range(6), [*v.edges, bad], shapes=SHAPES),
                             physical=frozenset({K}))
    with pytest.raises(StrategyError, match="pinned"):
        from_edges(v2, [v2.index(bad)]).validate()


# --------------------------------------------------------------------------------------------
# Algorithm 1 on traced graphs
# --------------------------------------------------------------------------------------------

def _fig5_fn(x, w, cache, pos):
    qkv = x @ w                                        # a
    q, b = jnp.split(qkv, [8], axis=1)
    c = b.reshape(1, 1, 2, 2)
    d = jax.lax.dynamic_update_slice(cache, c, (0, pos, 0, 0))
    return (q * 2.0).sum() + d.sum()


def _trace(fn, *args):
    from vtc_jax.cluster import cluster
    from vtc_jax.graph import trace
    g = trace(fn, *args)
    cl = cluster(g)
    return g, cl, build_vtog(g, cl)


def _by_prim(g, name):
    return next(op for op in g.ops if op.primitive == name)


def test_build_vtog_fig5_traced():
    g, cl, v = _trace(_fig5_fn, jnp.ones((1, 4)), jnp.ones((4, 12)), jnp.zeros((1, 8, 2, 2)), 3)
    split, reshape, dus = (_by_prim(g, p) for p in ("split", "reshape", "dynamic_update_slice"))
    a, (q, b), c, d = split.inputs[0], split.outputs, reshape.outputs[0], dus.outputs[0]
    cache = g.inputs[2]
    pairs = {(e.src, e.dst) for e in v.edges}
    assert {(a, b), (b, a), (b, c), (c, b), (c, d), (d, cache)} <= pairs
    for t in g.inputs:
        assert t in v.physical and v.out_edges(t) == ()
    assert v.reasons[cache] == "graph input"
    assert all(v.reasons[t] == "graph output" for t in g.outputs)
    assert v.shapes[a] == (1, 12)


def test_inplace_edge_dropped_when_operand_read_later():
    def fn(x, y):
        t = x * 2.0
        u = jax.lax.dynamic_update_slice(t, y, (1, 0))
        return u.sum() * t.sum()    # t's old contents are needed after the update

    g, _, v = _trace(fn, jnp.ones((4, 4)), jnp.ones((1, 4)))
    dus = _by_prim(g, "dynamic_update_slice")
    assert not any(e.inplace for e in v.edges)
    assert any(e.inplace and e.op == dus.id and "old contents" in why for e, why in v.dropped)


def test_inplace_edge_kept_when_legal():
    def fn(x, y):
        t = x * 2.0
        u = jax.lax.dynamic_update_slice(t, y, (1, 0))
        return u.sum()

    _, _, v = _trace(fn, jnp.ones((4, 4)), jnp.ones((1, 4)))
    assert any(e.inplace for e in v.edges)


def test_opaque_cluster_pins_tensors():
    def fn(x):
        y = (x * x).T   # binary: stays before the transpose (graph._sink_elementwise)
        # a reduction in a branch: not speculated into a select (canonical.speculable_cond)
        z = jax.lax.cond(y.sum() > 0, lambda a: a + a.sum(), lambda a: a - 1.0, y)
        return z.T * 2.0

    g, cl, v = _trace(fn, jnp.ones((4, 8)))
    cond = _by_prim(g, "cond")
    y = _by_prim(g, "transpose").outputs[0]
    assert y in cond.inputs
    assert y in v.physical and "opaque" in v.reasons[y]
    assert v.out_edges(y) == ()
    assert any(e.dst == y for e in v.edges)     # ...but the transpose's input may live in it
