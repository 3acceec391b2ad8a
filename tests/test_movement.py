"""VTOG rules per primitive: edge count, endpoints, direction, class, and that every map is right.

"Right" means: for an edge ``src ⇢ dst``, ``Layout.physical(dst).compose(edge.map)`` restricted to
``edge.box`` and evaluated on dst's actual value equals src's actual value inside the box (for the
in-place dynamic_update_slice edge, dst's buffer holds the updated value).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from vtc_jax.graph import trace
from vtc_jax.indexmap import Layout, Piece, box_conds, point
from vtc_jax.movement import Edge, explain_no_edges, rules, static_value
from vtc_jax.primitives import is_movement_op

F32 = jnp.float32
ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _values(g, *args):
    """Every tensor's value: re-bind each op (like Graph.evaluate, keeping intermediates)."""
    env = {t.id: t.const for t in g.tensors if t.const is not None}
    env.update(zip(g.inputs, jax.tree_util.tree_leaves((args, {}))))
    for op in g.ops:
        out = op.prim.bind(*(env[t] for t in op.inputs), **op.params)
        env.update(zip(op.outputs, out if op.prim.multiple_results else (out,)))
    return {k: np.asarray(v) for k, v in env.items()}


def check_edge(e: Edge, g, vals) -> None:
    """The edge's map, evaluated on dst's value, reproduces src inside the box."""
    op = g.ops[e.op]
    assert e.primitive == op.primitive
    assert e.direction == ("read" if e.src in op.outputs else "write")
    assert {e.src, e.dst} <= set(op.inputs) | set(op.outputs)
    src, dst = vals[e.src], vals[e.dst]
    assert e.map.domain == src.shape and e.map.target == dst.shape
    assert len(e.box) == src.ndim and e.klass in ("I", "II") and e.note
    if e.inplace:  # out lives in operand's buffer, which holds out's value after the update
        assert e.map.is_identity and op.primitive in ("dynamic_update_slice", "scatter")
        dst = src
    # a symbol is its source tensor's value after lax's wrap and clamp (SymInfo.normalise)
    # an index table is its source tensor's value as it is (each read wraps and clamps)
    symbols = {s.name: vals[s.source] if s.is_table else int(s.normalise(vals[s.source]))
               for s in e.map.syms}
    lay = Layout.physical(e.dst, dst.shape).compose(e.map).restrict_box(e.box)
    got = lay.evaluate({e.dst: dst}, symbols)
    box = tuple(slice(lo, hi) for lo, hi in e.box)
    # a write that the map's conditions drop (a scatter's out-of-bounds row) lands nowhere
    idx = list(np.indices(src.shape)) if src.shape else []
    lands = e.map.valid(point(idx, symbols)) if e.direction == "write" else None
    lands = np.ones(src.shape, bool) if lands is None else np.broadcast_to(lands, src.shape)
    np.testing.assert_array_equal(np.where(lands, got, 0)[box], np.where(lands, src, 0)[box],
                                  err_msg=f"{op.primitive}: {e}")


def run(fn, *args, primitive=None):
    """Trace, check every edge of every op, return (graph, edges of the ops of `primitive`)."""
    g = trace(fn, *args)
    vals = _values(g, *args)
    edges = []
    for op in g.ops:
        es = rules(op, g)
        assert is_movement_op(op, g) or not es
        assert (explain_no_edges(op, g) is None) == bool(es)
        for e in es:
            check_edge(e, g, vals)
        if op.primitive == primitive:
            edges += es
    return g, edges


def roles(g, edges):
    """Edges as (src role, dst role, direction, klass, inplace); roles are x<k> / y<k> of the op."""
    def role(op, t):
        return f"x{op.inputs.index(t)}" if t in op.inputs else f"y{op.outputs.index(t)}"
    return [(role(g.ops[e.op], e.src), role(g.ops[e.op], e.dst), e.direction, e.klass, e.inplace) for e in edges]


R, W = "read", "write"


def arr(*shape, dtype=F32):
    return jnp.arange(np.prod(shape), dtype=dtype).reshape(shape) + 1


CASES = {
    # name: (fn, args, primitive, expected roles)
    "transpose_last_two": (lambda x: x.transpose(0, 2, 1), (arr(4, 6, 8),), "transpose",
                           [("y0", "x0", R, "II", False), ("x0", "y0", W, "II", False)]),
    "transpose_keeps_innermost_32B": (lambda x: x.transpose(1, 0, 2), (arr(4, 6, 8),), "transpose",
                                      [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "transpose_keeps_innermost_16B": (lambda x: x.transpose(1, 0, 2), (arr(4, 6, 8, dtype=jnp.bfloat16),),
                                      "transpose", [("y0", "x0", R, "II", False), ("x0", "y0", W, "II", False)]),
    "reshape": (lambda x: x.reshape(6, 4), (arr(4, 6),), "reshape",
                [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "reshape_dimensions": (lambda x: lax.reshape(x, (6, 4), dimensions=(1, 0)), (arr(4, 6),), "reshape",
                           [("y0", "x0", R, "II", False), ("x0", "y0", W, "II", False)]),
    # read: runs of 8 inside the merged dim are invisible to per-dim contiguity (paper Def. 3): II;
    # write: the innermost dim of 8 f32 (32 B) stays innermost: I
    "reshape_dimensions_3d": (lambda x: lax.reshape(x, (3, 16), dimensions=(1, 0, 2)), (arr(2, 3, 8),), "reshape",
                              [("y0", "x0", R, "II", False), ("x0", "y0", W, "I", False)]),
    "squeeze": (lambda x: jnp.squeeze(x, 1), (arr(4, 1, 6),), "squeeze",
                [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "expand_dims": (lambda x: lax.expand_dims(x, (1,)), (arr(4, 6),), "broadcast_in_dim",
                    [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "broadcast": (lambda x: jnp.broadcast_to(x, (4, 6)), (arr(1, 6),), "broadcast_in_dim",
                  [("y0", "x0", R, "II", False)]),
    "broadcast_rank_up": (lambda x: lax.broadcast_in_dim(x, (3, 4, 6), (1, 2)), (arr(4, 6),), "broadcast_in_dim",
                          [("y0", "x0", R, "II", False)]),
    "slice_axis0": (lambda x: x[1:3], (arr(4, 6),), "slice", [("y0", "x0", R, "I", False)]),
    "slice_axis1": (lambda x: x[:, 1:4], (arr(4, 6),), "slice", [("y0", "x0", R, "II", False)]),
    "slice_strided": (lambda x: x[::2], (arr(4, 6),), "slice", [("y0", "x0", R, "II", False)]),
    "slice_row_of_1xN": (lambda x: x[:, 2:5], (arr(1, 6),), "slice", [("y0", "x0", R, "I", False)]),
    "dynamic_slice_rows": (lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 6)), (arr(4, 6), 3), "dynamic_slice",
                           [("y0", "x0", R, "I", False)]),
    "dynamic_slice_window": (lambda x, i: lax.dynamic_slice(x, (1, i), (2, 3)), (arr(4, 6), -2), "dynamic_slice",
                             [("y0", "x0", R, "II", False)]),
    "dynamic_update_slice": (lambda c, u, p: lax.dynamic_update_slice(c, u, (0, p, 0, 0)),
                             (arr(1, 8, 2, 4), -arr(1, 1, 2, 4), 5), "dynamic_update_slice",
                             [("y0", "x0", R, "I", True), ("x1", "y0", W, "I", False)]),
    "dynamic_update_slice_cols": (lambda c, u, p: lax.dynamic_update_slice(c, u, (0, p)),
                                  (arr(4, 8), -arr(4, 2), 100), "dynamic_update_slice",
                                  [("y0", "x0", R, "I", True), ("x1", "y0", W, "II", False)]),
    "concatenate_axis0": (lambda a, b: jnp.concatenate([a, b], 0), (arr(2, 6), -arr(3, 6)), "concatenate",
                          [("y0", "x0", R, "I", False), ("y0", "x1", R, "I", False),
                           ("x0", "y0", W, "I", False), ("x1", "y0", W, "I", False)]),
    "concatenate_axis1": (lambda a, b: jnp.concatenate([a, b], 1), (arr(4, 2), -arr(4, 3)), "concatenate",
                          [("y0", "x0", R, "II", False), ("y0", "x1", R, "II", False),
                           ("x0", "y0", W, "II", False), ("x1", "y0", W, "II", False)]),
    "concatenate_same_operand_twice": (lambda a: jnp.concatenate([a, a], 0), (arr(2, 6),), "concatenate",
                                       [("y0", "x0", R, "I", False), ("y0", "x0", R, "I", False),
                                        ("x0", "y0", W, "I", False), ("x0", "y0", W, "I", False)]),
    "split_1xN": (lambda x: jnp.split(x, [4, 6], axis=1), (arr(1, 8),), "split",
                  [("x0", "y0", W, "I", False), ("x0", "y1", W, "I", False), ("x0", "y2", W, "I", False),
                   ("y0", "x0", R, "I", False), ("y1", "x0", R, "I", False), ("y2", "x0", R, "I", False)]),
    "split_axis1": (lambda x: jnp.split(x, [2], axis=1), (arr(4, 8),), "split",
                    [("x0", "y0", W, "II", False), ("x0", "y1", W, "II", False),
                     ("y0", "x0", R, "II", False), ("y1", "x0", R, "II", False)]),
    "stack": (lambda a, b: jnp.stack([a, b]), (arr(4, 6), -arr(4, 6)), "stack",
              [("y0", "x0", R, "I", False), ("y0", "x1", R, "I", False),
               ("x0", "y0", W, "I", False), ("x1", "y0", W, "I", False)]),
    "stack_axis1": (lambda a, b: jnp.stack([a, b], 1), (arr(4, 6), -arr(4, 6)), "stack",
                    [("y0", "x0", R, "II", False), ("y0", "x1", R, "II", False),
                     ("x0", "y0", W, "II", False), ("x1", "y0", W, "II", False)]),
    "unstack": (lambda x: jnp.unstack(x), (arr(2, 4, 6),), "unstack",
                [("x0", "y0", W, "I", False), ("x0", "y1", W, "I", False),
                 ("y0", "x0", R, "I", False), ("y1", "x0", R, "I", False)]),
    "rev_rows": (lambda x: x[::-1], (arr(4, 8),), "rev", [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "rev_last": (lambda x: x[:, ::-1], (arr(4, 8),), "rev", [("y0", "x0", R, "II", False), ("x0", "y0", W, "II", False)]),
    "pad": (lambda x: jnp.pad(x, ((1, 2), (0, 1)), constant_values=-1.0), (arr(4, 6),), "pad",
            [("y0", "x0", R, "II", False)]),
    "pad_negative_interior": (lambda x: lax.pad(x, np.float32(7), ((-1, 2, 1), (1, -2, 0))), (arr(4, 6),), "pad",
                              [("y0", "x0", R, "II", False)]),
    "copy": (lambda x: jnp.copy(x), (arr(4, 6),), "copy", [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "convert_same_dtype": (lambda x, i: lax.convert_element_type(i, jnp.int32) + x, (jnp.arange(3, dtype=jnp.int32), 2),
                           "convert_element_type", [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "device_put": (lambda x: jax.device_put(x) * 2, (arr(4, 6),), "device_put",
                   [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "sharding_constraint": (lambda x: lax.with_sharding_constraint(x, ONE_DEVICE) * 2, (arr(4, 6),),
                            "sharding_constraint", [("y0", "x0", R, "I", False), ("x0", "y0", W, "I", False)]),
    "take_rows": (lambda x: jnp.take(x, jnp.arange(1, 3), axis=0), (arr(4, 6),), "gather",
                  [("y0", "x0", R, "I", False)]),
    "take_cols": (lambda x: jnp.take(x, jnp.arange(1, 4), axis=1), (arr(4, 6),), "gather",
                  [("y0", "x0", R, "II", False)]),
    "take_strided_reversed": (lambda x: x[:, np.array([5, 3, 1])], (arr(4, 6),), "gather",
                              [("y0", "x0", R, "II", False)]),
    "take_2d_indices": (lambda x: x[np.array([[3, 2], [1, 0]])], (arr(4, 6),), "gather",
                        [("y0", "x0", R, "II", False)]),
    "take_repeat": (lambda x: jnp.take(x, np.array([0, 0, 1, 1, 2, 2, 3]), axis=0), (arr(4, 6),), "gather",
                    [("y0", "x0", R, "II", False)]),
    "take_scalar": (lambda x: jnp.take(x, 2, axis=1), (arr(4, 6),), "gather", [("y0", "x0", R, "II", False)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule(name):
    fn, args, prim, want = CASES[name]
    g, edges = run(fn, *args, primitive=prim)
    if prim is not None:
        assert prim in [op.primitive for op in g.ops], [op.primitive for op in g.ops]
    assert roles(g, edges) == want


def test_dynamic_slice_symbol_and_static_start():
    g, edges = run(lambda x, i: lax.dynamic_slice(x, (i, 2), (2, 3)), arr(4, 6), 1, primitive="dynamic_slice")
    (e,) = edges
    op = g.ops[e.op]
    (s,) = e.map.syms
    # lax's wrap of a negative start (select_n(i < 0, i, i + 4)) is folded into the symbol: its
    # source is the raw index, the program input, which kernels then take as it is
    assert s.source == g.inputs[1] and (s.lo, s.hi, s.wrap) == (0, 2, 4) and s.name == f"s{g.inputs[1]}w4"
    assert str(e.map) == f"(d0, d1) -> (d0 + {s.name}, d1 + 2)"
    assert [int(s.normalise(np.int32(i))) for i in (-5, -4, -1, 0, 1, 2, 3, 9)] == [0, 0, 2, 0, 1, 2, 2, 2]
    g, edges = run(lambda x: lax.dynamic_slice(x, (7, 2), (2, 3)), arr(4, 6), primitive="dynamic_slice")
    assert not edges[0].map.syms and str(edges[0].map) == "(d0, d1) -> (d0 + 2, d1 + 2)"  # clamped like lax


def test_dynamic_update_slice_symbol_range():
    g, edges = run(lambda c, u, p: lax.dynamic_update_slice(c, u, (0, p, 0, 0)),
                   arr(1, 8, 2, 4), -arr(1, 1, 2, 4), 3, primitive="dynamic_update_slice")
    upd = edges[1]
    assert [(s.lo, s.hi) for s in upd.map.syms] == [(0, 7)]
    assert upd.map.contiguity(4).full and "in place" in edges[0].note


def test_pad_with_runtime_fill_has_no_edge():
    g = trace(lambda x, v: lax.pad(x, v, ((1, 0, 0), (0, 0, 0))), arr(4, 6), np.float32(3))
    (op,) = g.ops
    assert rules(op, g) == () and is_movement_op(op, g)  # still data movement, just not removable
    assert "runtime" in explain_no_edges(op, g)


@pytest.mark.parametrize("fn, args, why", [
    (lambda x, i: jnp.take(x, i, axis=0), (arr(4, 6), jnp.array([0, 2])), "fills out-of-bounds rows"),
    (lambda x: x[np.array([0, 3, 1])], (arr(4, 6),), "not a strided run"),
    (lambda x: x.at[np.array([0, 2])].set(0.0), (arr(4, 6),), "constant indices"),
    (lambda x, f: x[(f * 2).astype(jnp.int32)], (arr(4, 6), jnp.array([0.0, 1.0])), "integer index arithmetic"),
    (lambda x, i: x[jnp.argmax(x[:2] * i[:, None], axis=0)], (arr(4, 6), jnp.array([1, 2])),
     "integer index arithmetic"),
])
def test_opaque_gather_scatter(fn, args, why):
    g = trace(fn, *args)
    ops = [op for op in g.ops if op.primitive in ("gather", "scatter")]
    op = ops[-1]   # the outermost (``x[j[i]]``: the inner ``j[i]`` reads j through table i)
    assert rules(op, g) == () and is_movement_op(op, g)
    assert why in explain_no_edges(op, g)


@pytest.mark.parametrize("fn, args, expect", [
    (lambda x, i: x[i * 2], (arr(4, 6), jnp.array([0, 1])), "(d0, d1) -> (T[d0, 0], d1)"),
    (lambda x, i, j: x[i, j], (arr(4, 6), jnp.array([0, -1]), jnp.array([2, 9])),
     "(d0) -> (T[d0, 0], T[d0, 1])"),
    (lambda x, i, j: x[j[i]], (arr(4, 6), jnp.array([0, 1]), jnp.array([2, 3, 1])), "(d0, d1) -> (T[d0, 0], d1)"),
    (lambda x, i: x[i + 1], (arr(4, 6), jnp.array([0, 5])), "(d0, d1) -> (T[d0, 0], d1)"),
])
def test_gathers_at_computed_indices_read_the_index_array(fn, args, expect):
    """Indices computed from input tables by more than views (arithmetic, two tables, a table read
    through another) are read from the index array XLA computes, as they are (clamped as XLA
    clamps a gather's starts); ``check_edge`` evaluates the map on that array."""
    g, edges = run(fn, *args, primitive="gather")
    last = max(e.op for e in edges)      # the outermost gather (``x[j[i]]``: j[i] reads input table i)
    main = [e for e in edges if "indirect" in e.note and e.op == last]
    assert len(main) == 1 and main[0].direction == R, edges
    (info,) = main[0].map.syms
    assert info.is_table and g.producer(info.source) is not None   # computed in the program
    assert str(main[0].map) == expect.replace("T", info.name)


@pytest.mark.parametrize("lens", [[5, 16, 11], [0, 1, 99]], ids=["in range", "wrapped, dropped"])
def test_paged_page_writes_through_two_tables(lens):
    """vLLM's page write ``pages.at[block_table[b, (len[b] - 1) // page], (len[b] - 1) % page]``:
    both coordinates computed from two tables (a nested read and integer arithmetic), read from
    the index array; a row whose page index lands out of bounds is dropped, as XLA drops it."""
    def f(pages, rows, tbl, lens):
        pos = lens - 1
        return pages.at[tbl[jnp.arange(3), pos // 4], pos % 4].set(rows)

    tbl = jnp.array([[3, 0, 7, 5], [1, 2, 4, 6], [8, 9, 10, 40]], jnp.int32)
    g, edges = run(f, arr(13, 4, 2), -arr(3, 2), tbl, jnp.array(lens, jnp.int32), primitive="scatter")
    assert [(e.direction, e.inplace) for e in edges] == [(R, True), (W, False)]
    m = edges[1].map
    assert m.syms[0].is_table and m.conds, str(m)


def test_a_scatter_may_send_two_rows_to_one_place():
    """``x.at[i].set(r)`` with a repeated index: jax leaves which update lands unspecified
    (``unique_indices=False``), so the write edge is offered as for distinct rows."""
    g, edges = run(lambda x, i, r: x.at[i].set(r), arr(4, 6), jnp.array([0, 2]), arr(2, 6), primitive="scatter")
    assert [(e.direction, e.inplace) for e in edges] == [(R, True), (W, False)]


@pytest.mark.parametrize("table", [[[3, 0, 7, 5], [1, 2, 4, 6], [8, 9, 10, 11]],      # a permutation
                                   [[-1, 0, 40, 5], [1, -13, 4, -90], [8, 9, 12, 11]]])  # wrapped, clamped
def test_indirect_gather_reads_a_paged_cache_through_its_block_table(table):
    """vLLM's ``pages[block_table[:, t // page], t % page]``: the output reads the pages through a
    table read (negative entries wrapped as jnp normalises them, out-of-range ones clamped as
    XLA's gather clamps); ``check_edge`` evaluates the map on the table and compares values."""
    def f(pages, tbl):
        t = jnp.arange(16)
        return pages[tbl[:, t // 4], t % 4]

    g, edges = run(f, arr(13, 4, 2), jnp.array(table, jnp.int32), primitive="gather")
    main = [e for e in edges if "indirect" in e.note]
    assert len(main) == 1 and main[0].direction == R and main[0].klass == "II"
    assert str(main[0].map) == "(d0, d1, d2) -> (t1[d0, (d1) floordiv 4], (d1) mod 4, d2)"
    assert main[0].map.syms[0].is_table and main[0].map.syms[0].shape == (3, 4)


@pytest.mark.parametrize("pos", [[0, 7, 15, 3], [-1, 20, -17, 15]], ids=["in range", "wrapped, dropped"])
def test_indirect_scatter_writes_one_row_per_sequence(pos):
    """Continuous batching's ``cache.at[arange(B), pos].set(row)``: out lives in the cache's buffer
    (in place) and each row is written through ``pos[b]`` — wrapped when negative, dropped when out
    of bounds (XLA skips it), which the map's condition says; ``check_edge`` compares the rows
    that land."""
    def f(c, r, p):
        return c.at[jnp.arange(4), p].set(r)

    g, edges = run(f, arr(4, 16, 2), arr(4, 2) * -1, jnp.array(pos, jnp.int32), primitive="scatter")
    assert [(e.direction, e.inplace) for e in edges] == [(R, True), (W, False)]
    assert str(edges[1].map) == "(d0, d1) -> (d0, t2[d0], d1) if 0 <= t2[d0] < 16 else None"


def test_indirect_gather_embedding_lookup():
    """``emb[tokens]``: each output row reads the row its token names."""
    g, edges = run(lambda emb, tok: emb[tok], arr(10, 4), jnp.array([[1, 9, -2], [0, 3, 3]], jnp.int32),
                   primitive="gather")
    (e,) = edges
    assert str(e.map) == "(d0, d1, d2) -> (t1[d0, d1], d2)"


def test_repeat_with_array_repeats_folds_to_a_repeat_gather():
    g, edges = run(lambda x: jnp.repeat(x, np.array([2, 2, 2, 2]), axis=0, total_repeat_length=8), arr(4, 6),
                   primitive="gather")
    (e,) = edges
    assert str(e.map) == "(d0, d1) -> ((d0) floordiv 2, d1)" and e.klass == "II"


def test_non_movement_ops():
    g = trace(lambda x: (x + 1).astype(jnp.bfloat16), arr(4, 6))
    for op in g.ops:
        assert not is_movement_op(op, g) and explain_no_edges(op, g)
    assert "not a data-movement" in explain_no_edges(g.ops[0], g)
    assert "dtype" in explain_no_edges(g.ops[-1], g)


def test_static_value_folds_index_arithmetic():
    g = trace(lambda x: jnp.take(x, jnp.arange(1, 4), axis=1), arr(4, 6))
    (op,) = [op for op in g.ops if op.primitive == "gather"]
    np.testing.assert_array_equal(static_value(op.inputs[1], g).reshape(-1), [1, 2, 3])
    assert static_value(g.inputs[0], g) is None


# --------------------------------------------------------------------------------------------
# The Fig-2 decode chain: fused QKV -> split -> reshape -> KV-cache update at pos -> GQA repeat
# --------------------------------------------------------------------------------------------

H, KV, D, T = 4, 2, 8, 16


def decode(x, wqkv, kcache, vcache, pos):
    qkv = x @ wqkv                                                  # (1, (H + 2KV) D)
    q, k, v = jnp.split(qkv, [H * D, (H + KV) * D], axis=-1)
    q = q.reshape(1, H, D)
    k = k.reshape(1, 1, KV, D)
    v = v.reshape(1, 1, KV, D)
    kcache = lax.dynamic_update_slice(kcache, k, (0, pos, 0, 0))    # cache (1, T, KV, D)
    vcache = lax.dynamic_update_slice(vcache, v, (0, pos, 0, 0))
    kk = jnp.repeat(kcache, H // KV, axis=2).transpose(0, 2, 1, 3)  # (1, H, T, D)
    vv = jnp.repeat(vcache, H // KV, axis=2).transpose(0, 2, 1, 3)
    s = jnp.einsum("bhd,bhtd->bht", q, kk)
    return jnp.einsum("bht,bhtd->bhd", jax.nn.softmax(s, -1), vv), kcache, vcache


def test_fig2_decode_chain():
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((1, 32)).astype(np.float32),
            rng.standard_normal((32, (H + 2 * KV) * D)).astype(np.float32),
            rng.standard_normal((1, T, KV, D)).astype(np.float32),
            rng.standard_normal((1, T, KV, D)).astype(np.float32), 5)
    g, _ = run(decode, *args)  # checks every edge's map on the real values
    by_prim = {}
    for op in g.ops:
        by_prim.setdefault(op.primitive, []).extend(rules(op, g))
    # split of a (1, N) row: every piece is contiguous, both directions Type I (3 + 3 edges)
    split = by_prim["split"]
    assert len(split) == 6 and all(e.klass == "I" for e in split)
    # reshapes to heads and the GQA merge (KV, G) -> H: clean, Type I both ways
    assert len(by_prim["reshape"]) == 2 * 5 and all(e.klass == "I" for e in by_prim["reshape"])
    # cache updates: out ⇢ cache in place (I); the new k/v ⇢ out at s{pos} (full contiguity: I)
    dus = by_prim["dynamic_update_slice"]
    assert [(e.direction, e.klass, e.inplace) for e in dus] == [(R, "I", True), (W, "I", False)] * 2
    assert all(len(e.map.syms) == 1 for e in dus if not e.inplace)
    # GQA repeat: a broadcast read edge (II); the head transpose keeps D innermost (32 B runs: I)
    bcast = [e for e in by_prim["broadcast_in_dim"] if g.tensors[e.src].shape == (1, T, KV, H // KV, D)]
    assert len(bcast) == 2 and all((e.direction, e.klass) == (R, "II") for e in bcast)
    trans = [e for e in by_prim["transpose"] if (1, T, H, D) in (g.tensors[e.src].shape, g.tensors[e.dst].shape)]
    assert len(trans) == 4 and all(e.klass == "I" for e in trans)


def test_fig2_composed_gqa_map():
    """Composing the read edges of repeat+transpose gives the grouped-query map onto the cache."""
    rng = np.random.default_rng(1)
    args = (rng.standard_normal((1, 32)).astype(np.float32),
            rng.standard_normal((32, (H + 2 * KV) * D)).astype(np.float32),
            rng.standard_normal((1, T, KV, D)).astype(np.float32),
            rng.standard_normal((1, T, KV, D)).astype(np.float32), 3)
    g = trace(decode, *args)
    vals = _values(g, *args)
    # walk back from the head transpose's output through read edges until the updated cache
    op = next(op for op in g.ops if op.primitive == "transpose" and g.tensors[op.inputs[0]].shape == (1, T, H, D))
    t, m = op.outputs[0], None
    while (prod := g.producer(t)) is not None and prod.primitive != "dynamic_update_slice":
        (e,) = [e for e in rules(prod, g) if e.direction == R and e.src == t]
        m = e.map if m is None else e.map.compose(m)
        t = e.dst
    assert m.domain == (1, H, T, D) and g.tensors[t].shape == (1, T, KV, D)
    assert str(m) == "(d0, d1, d2, d3) -> (0, d2, (d1) floordiv 2, d3)"
    got = Layout.physical(t, g.tensors[t].shape).compose(m).evaluate({t: vals[t]})
    np.testing.assert_array_equal(got, vals[op.outputs[0]])


def test_fig2_qkv_written_through_pieces():
    """Paper Fig. 2: following write edges split -> reshape -> update-slice -> in place makes the
    projection output a 3-piece virtual tensor over Q, the K cache at pos and the V cache at pos."""
    pos = 6
    rng = np.random.default_rng(2)
    args = (rng.standard_normal((1, 32)).astype(np.float32),
            rng.standard_normal((32, (H + 2 * KV) * D)).astype(np.float32),
            rng.standard_normal((1, T, KV, D)).astype(np.float32),
            rng.standard_normal((1, T, KV, D)).astype(np.float32), pos)
    g = trace(decode, *args)
    vals = _values(g, *args)
    split = next(op for op in g.ops if op.primitive == "split")
    qkv = split.inputs[0]
    pieces, buffers, symbols = [], {}, {}
    for e in (e for e in rules(split, g) if e.src == qkv):
        m, t = e.map, e.dst
        while True:  # through the reshape and the cache update, then into the cache in place
            nxt = [f for op in g.consumers(t) if op.primitive in ("reshape", "dynamic_update_slice")
                   for f in rules(op, g) if f.src == t and f.direction == W]
            prod = g.producer(t)
            nxt += [f for f in rules(prod, g) if f.inplace and f.src == t] if prod is not None else []
            if not nxt:
                break
            (f,) = nxt
            m, t = f.map.compose(m), f.dst
        pieces.append(Piece(t, m, box_conds(e.box, g.tensors[qkv].shape)))
        symbols.update({s.name: int(s.normalise(vals[s.source])) for s in m.syms})
        # a cache is the graph input, holding the updated value once written in place
        buffers[t] = vals[g.consumers(t)[0].outputs[0]] if g.tensors[t].shape == (1, T, KV, D) else vals[t]
    lay = Layout(g.tensors[qkv].shape, tuple(pieces))
    q, kc, vc = (p.target for p in lay.pieces)
    assert g.tensors[q].shape == (1, H, D) and {kc, vc} == {g.inputs[2], g.inputs[3]}
    (s,) = lay.pieces[1].map.syms
    assert str(lay.pieces[1].map) == f"(d0, d1) -> (0, {s.name}, (d1) floordiv 8 - 4, (d1) mod 8)"
    assert lay.pieces[1].map.restrict(lay.pieces[1].box()).contiguity(4).full  # one 64 B run at pos
    np.testing.assert_array_equal(lay.evaluate(buffers, symbols), vals[qkv])


# ---- adding a movement primitive: a TABLE row (primitives.py) and a rule (movement.py), nothing else

def test_sharding_constraint_composes_with_its_neighbours():
    """transpose -> one-device sharding_constraint -> reshape: the read edges composed from the
    output back to ``x``, evaluated on x's numpy value, equal jax.lax's result (exactly)."""
    def f(x):
        return lax.with_sharding_constraint(x.T, ONE_DEVICE).reshape(-1)

    x = np.arange(24, dtype=np.float32).reshape(4, 6) * 0.5 - 3.0
    g = trace(f, x)
    assert [op.primitive for op in g.ops] == ["transpose", "sharding_constraint", "reshape"]
    t, m = g.outputs[0], None
    while (op := g.producer(t)) is not None:
        (e,) = [e for e in rules(op, g) if e.src == t and e.direction == R]
        m, t = e.map if m is None else e.map.compose(m), e.dst
    assert t == g.inputs[0]
    got = Layout.physical(t, x.shape).compose(m).evaluate({t: x}, {})
    np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x)))


def test_sharding_constraint_across_devices_offers_no_edge():
    import dataclasses
    from types import SimpleNamespace
    g = trace(lambda x: lax.with_sharding_constraint(x, ONE_DEVICE), arr(4, 6))
    (op,) = g.ops
    two = dataclasses.replace(op, params={**op.params, "sharding": SimpleNamespace(device_set={0, 1})})
    assert rules(two, g) == () and is_movement_op(two, g) and "resharding" in explain_no_edges(two, g)


def test_sharding_constraint_is_eliminated_and_optimize_equals_jit():
    """End to end: the constraint between a matmul and its consumer is eliminated (one of its two
    Type I edges taken), and the result equals jax.jit's (f32, Pallas interpret mode, rtol 1e-5)."""
    import vtc_jax

    def f(x, w):
        h = lax.with_sharding_constraint(jnp.transpose(x @ w), ONE_DEVICE)
        return jnp.tanh(h) * 2.0

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32)), F32)
    w = jnp.asarray(rng.standard_normal((32, 24)), F32)
    opt = vtc_jax.optimize(f, backend="interpret")
    np.testing.assert_allclose(np.asarray(opt(x, w)), np.asarray(jax.jit(f)(x, w)), rtol=1e-5, atol=1e-6)
    a, _ = opt.last
    (sc,) = [op.id for op in a.graph.ops if op.primitive == "sharding_constraint"]
    assert sc in a.strategy.resolution.eliminated
