"""vtc_jax.graph: tracing into a flat, inlined, faithful Graph."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vtc_jax.graph import Graph, trace


def _rand(key: int, *shape: int, dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, dtype)


def _check_faithful(fn, *args, **kwargs) -> Graph:
    """Graph.evaluate (eager and under jit) reproduces jax.jit(fn), pytree structure included."""
    g = trace(fn, *args, **kwargs)
    flat = jax.tree_util.tree_leaves((args, kwargs))
    want = jax.jit(fn)(*args, **kwargs)
    for got in (g.evaluate(*flat), jax.jit(g.evaluate)(*flat)):
        got_tree = g.unflatten_outputs(got)
        assert jax.tree_util.tree_structure(got_tree) == jax.tree_util.tree_structure(want)
        for a, b in zip(jax.tree_util.tree_leaves(got_tree), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    _check_well_formed(g)
    return g


def _check_well_formed(g: Graph) -> None:
    assert [t.id for t in g.tensors] == list(range(len(g.tensors)))
    assert [op.id for op in g.ops] == list(range(len(g.ops)))
    defined = set(g.inputs) | {t.id for t in g.tensors if t.const is not None}
    for op in g.ops:  # topological: every input defined before use, each tensor written once
        assert set(op.inputs) <= defined, op
        assert not set(op.outputs) & defined
        defined |= set(op.outputs)
        for t in op.outputs:
            assert g.producer(t) is op
        for t in op.inputs:
            assert op in g.consumers(t)
    assert set(g.outputs) <= defined


def test_pytrees_and_kwargs():
    def fn(params, x, *, scale, extra):
        h = jnp.tanh(x @ params["w"] + params["b"]) * scale
        return {"h": h, "pair": (h.sum(), extra[0] - extra[1].T)}

    params = {"w": _rand(0, 8, 4), "b": _rand(1, 4)}
    g = _check_faithful(fn, params, _rand(2, 3, 8), scale=_rand(3), extra=(_rand(4, 2, 5), _rand(5, 5, 2)))
    assert g.in_tree == jax.tree_util.tree_structure(((params, 0), {"scale": 0, "extra": (0, 0)}))
    assert len(g.inputs) == 6


def test_nested_jit_is_inlined():
    @jax.jit
    def inner(x):
        return jnp.sin(x) * 2.0

    @jax.jit
    def middle(x, y):
        return inner(x) + jax.jit(jnp.cos)(y)

    g = _check_faithful(lambda x, y: middle(x, y) * inner(y), _rand(0, 4, 4), _rand(1, 4, 4))
    prims = [op.primitive for op in g.ops]
    assert "jit" not in prims and "pjit" not in prims
    assert prims.count("sin") == 2 and prims.count("cos") == 1


def test_custom_jvp_is_inlined():
    g = _check_faithful(lambda x: jax.nn.softmax(jax.nn.relu(x) * jax.nn.gelu(x), axis=-1), _rand(0, 3, 7))
    prims = {op.primitive for op in g.ops}
    assert not prims & {"custom_jvp_call", "jit", "pjit"}
    assert {"max", "exp", "reduce_sum", "reduce_max"} <= prims


def test_custom_vjp_keeps_primal():
    @jax.custom_vjp
    def clip_grad(x):
        return jnp.sin(x)

    clip_grad.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (jnp.clip(g, -1, 1),))
    g = _check_faithful(lambda x: clip_grad(x) + 1.0, _rand(0, 5))
    assert [op.primitive for op in g.ops] == ["sin", "add"]


def test_remat_is_inlined():
    fn = jax.checkpoint(lambda x, w: jnp.tanh(x @ w) @ w.T)
    g = _check_faithful(fn, _rand(0, 4, 6), _rand(1, 6, 6))
    assert [op.primitive for op in g.ops] == ["dot_general", "tanh", "transpose", "dot_general"]


def test_scan_kept_opaque():
    def fn(xs):
        carry, ys = jax.lax.scan(lambda c, x: (c + x, c * x), jnp.zeros(xs.shape[1:]), xs)
        return carry, ys

    g = _check_faithful(fn, _rand(0, 5, 3))
    (scan,) = [op for op in g.ops if op.primitive == "scan"]
    assert scan.opaque_reason == "control flow (scan) kept opaque"
    assert all(op.opaque_reason is None for op in g.ops if op is not scan)


def test_consts_and_literals():
    table_np = np.arange(6.0, dtype=np.float32)
    table_jax = jnp.arange(6.0) * 3

    def fn(x):
        return x * 2.0 + table_np + table_jax, x, x, 7.0

    g = _check_faithful(fn, _rand(0, 6))
    consts = [t for t in g.tensors if t.const is not None]
    assert any(np.array_equal(t.const, table_np) for t in consts)
    assert any(np.array_equal(t.const, np.asarray(table_jax)) for t in consts)
    assert any(t.shape == () and t.const == 2.0 and t.dtype == np.float32 for t in consts)
    assert g.outputs[1] == g.outputs[2] == g.inputs[0]  # outputs may repeat and may be inputs
    assert g.producer(g.outputs[3]) is None and g.tensors[g.outputs[3]].const == 7.0


def test_dead_code_removed_effects_kept():
    def fn(x):
        unused = jnp.sin(x) @ x.T  # noqa: F841  (dead)
        jax.debug.callback(lambda v: None, x)  # effectful, no outputs used: must stay
        return jnp.exp(x)

    g = trace(fn, _rand(0, 3, 3))
    prims = [op.primitive for op in g.ops]
    assert "sin" not in prims and "dot_general" not in prims and "transpose" not in prims
    assert "exp" in prims and "debug_callback" in prims
    # dead tensors are gone too
    assert all(g.producer(t.id) is not None or t.id in g.inputs or t.const is not None for t in g.tensors)


def test_int64_params_normalised():
    def fn(x):
        a = jax.lax.slice(x, (np.int64(1),), (np.int64(5),))
        b = jax.lax.broadcast_in_dim(a, (np.int64(2), np.int64(4)), (np.int64(1),))
        return b, jnp.pad(x, ((np.int64(1), np.int64(2)),))

    g = _check_faithful(fn, _rand(0, 6))

    def ints_only(v):
        if isinstance(v, tuple):
            return all(ints_only(i) for i in v)
        return not isinstance(v, np.integer)

    by_prim = {op.primitive: op.params for op in g.ops}
    assert by_prim["slice"]["start_indices"] == (1,) and type(by_prim["slice"]["start_indices"][0]) is int
    assert type(by_prim["broadcast_in_dim"]["shape"][0]) is int
    assert by_prim["pad"]["padding_config"] == ((1, 2, 0),)
    assert all(ints_only(v) for op in g.ops for v in op.params.values())


def test_shape_dtype_struct_paper_size_without_allocating():
    shape = (16, 4096, 8, 128)
    sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16)

    def fn(k, w):
        return jnp.swapaxes(k, 1, 2).reshape(16, 8, 4096 * 128 // 128, 128) @ w

    before = {id(a) for a in jax.live_arrays()}
    g = trace(fn, sds, w)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert all(a.size < 1 << 20 for a in new)
    assert g.tensors[g.inputs[0]].shape == shape and g.tensors[g.inputs[0]].dtype == jnp.bfloat16
    assert [op.primitive for op in g.ops] == ["transpose", "dot_general"]  # reshape is an identity here
    assert g.tensors[g.outputs[0]].shape == (16, 8, 4096, 128)


def test_not_callable_raises_type_error():
    with pytest.raises(TypeError, match="not callable"):
        trace(3, jnp.ones(2))


def test_bad_args_propagate_jax_error():
    with pytest.raises(TypeError):
        trace(lambda a, b: a @ b, jnp.ones((2, 3)), jnp.ones((4, 5)))


def test_prng_keys_are_ordinary_tensors():
    """Extended dtypes (key<fry>, key<rbg>) are representable; the random ops re-bind unchanged."""
    from vtc_jax.graph import is_extended

    closed_key = jax.random.key(5)

    def fn(key, x):
        a, b = jax.random.split(key)
        inner = jax.random.fold_in(jax.random.PRNGKey(0), 3)           # raw uint32 key data
        rbg = jax.random.split(jax.random.key(1, impl="rbg"))[1]
        n = jax.random.normal(a, x.shape) + jax.random.uniform(inner, x.shape)
        n = n + jax.random.normal(rbg, x.shape) + jax.random.normal(closed_key, x.shape)
        return (x + n) @ x.T, b, jax.random.key_data(b)

    key, x = jax.random.key(11), _rand(0, 4, 6)
    g = trace(fn, key, x)
    _check_well_formed(g)
    assert is_extended(g.tensors[g.inputs[0]].dtype) and not is_extended(g.tensors[g.inputs[1]].dtype)
    keyed = [t for t in g.tensors if is_extended(t.dtype)]
    assert {str(t.dtype) for t in keyed} == {"key<fry>", "key<rbg>"}
    assert any(t.const is not None for t in keyed)  # the closed-over key: a jax array, not numpy
    prims = {op.primitive for op in g.ops}
    assert {"random_seed", "random_split", "random_fold_in", "random_bits", "random_wrap"} <= prims
    want = jax.jit(fn)(key, x)
    for got in (g.evaluate(key, x), jax.jit(g.evaluate)(key, x)):
        out, b, data = g.unflatten_outputs(got)
        # f32: the same sums of six products, fused differently by jit (one element read 3e-6
        # apart on this project's machine); the keys and bits below are exact
        np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-6)
        assert b.dtype == want[1].dtype
        np.testing.assert_array_equal(jax.random.key_data(b), jax.random.key_data(want[1]))
        np.testing.assert_array_equal(data, want[2])
    sds = trace(fn, jax.ShapeDtypeStruct((), key.dtype), jax.ShapeDtypeStruct((4, 6), jnp.float32))
    assert sds.tensors[sds.inputs[0]].dtype == key.dtype


# ---- casts moved across views (graph._sink_elementwise / _hoist_narrowing_casts) ---------------

from hypothesis import given, settings, strategies as st  # noqa: E402

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_VIEWS = ("transpose", "reshape", "expand", "squeeze", "relu")


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(_VIEWS + ("cast",)), st.sampled_from(_DTYPES)),
                      min_size=1, max_size=6))
def test_casts_across_views_keep_values_and_dtypes(steps):
    """Random chains of views, casts (narrowing and widening) and a unary op after a matmul, as
    traced (casts sunk or hoisted across views): the traced graph gives jax.jit's values bit for
    bit, in the same output dtype — a cast commutes with a view exactly — and a narrowing cast of
    the matmul's result (through views only) never ends up after a view: it is the dot's epilogue
    (``graph._hoist_narrowing_casts``; after an elementwise op it stays where it is)."""
    def fn(a, b):
        y = a @ b                                   # (4, 6)
        for kind, dt in steps:
            if kind == "transpose":
                y = jnp.swapaxes(y, 0, 1) if y.ndim >= 2 else y
            elif kind == "reshape":
                y = y.reshape(-1) if y.ndim != 1 else y.reshape(2, -1)
            elif kind == "expand":
                y = y[None]
            elif kind == "squeeze":
                y = y[0] if y.shape[0] == 1 else y
            elif kind == "relu":
                y = jax.nn.relu(y)
            else:
                y = y.astype(dt)
        return y

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)
    g = trace(fn, a, b)
    ref = jax.jit(fn)(a, b)
    (out,) = g.evaluate(a, b)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    views = {"transpose", "reshape", "squeeze"}
    for op in g.ops:
        if op.primitive in views:
            user = g.consumers(op.outputs[0])
            src_op = g.producer(op.inputs[0])
            while src_op is not None and (src_op.primitive in views or (
                    src_op.primitive == "broadcast_in_dim"   # adding size-1 dims: a view too
                    and g.tensors[src_op.inputs[0]].size == g.tensors[src_op.outputs[0]].size)):
                src_op = g.producer(src_op.inputs[0])
            if len(user) == 1 and user[0].primitive == "convert_element_type" and \
                    src_op is not None and src_op.primitive == "dot_general":
                src, dst = g.tensors[op.inputs[0]].dtype, g.tensors[user[0].outputs[0]].dtype
                assert np.dtype(dst).itemsize >= np.dtype(src).itemsize, (op.primitive, src, dst)


@pytest.mark.parametrize("widen", ["int8_scaled", "f32", "scale_only"])
def test_widening_chains_move_past_a_repeat_into_the_dot(widen):
    """``jnp.repeat(cache.astype(bf16) * scale, G, axis=2)`` on its way into a dot is traced with the
    repeat's views on the int8 cache and on the scale, the cast and the product after them, next
    to the dot (``graph._sink_into_dot_operands``: the attention kernel's prologue); the values are
    jit's bit for bit. A chain that widens nothing (``k * scale`` in the cache's own dtype) stays."""
    r = np.random.default_rng(0)
    b, t, hk, g, d = 2, 6, 2, 3, 4
    q = jnp.asarray(r.standard_normal((b, hk * g, d)), jnp.float32 if widen == "f32" else jnp.bfloat16)
    c = jnp.asarray(r.integers(-100, 100, (b, t, hk, d)), jnp.int8 if widen == "int8_scaled" else jnp.bfloat16)
    s = jnp.asarray(r.uniform(0.01, 0.1, (b, t, hk, 1)), jnp.bfloat16)

    def fn(q, c, s):
        k = {"int8_scaled": lambda: c.astype(jnp.bfloat16) * s, "f32": lambda: c.astype(jnp.float32),
             "scale_only": lambda: c * s}[widen]()
        return jnp.einsum("bhd,bthd->bht", q, jnp.repeat(k, g, axis=2))

    gr = trace(fn, q, c, s)
    (out,) = gr.evaluate(q, c, s)
    ref = jax.jit(fn)(q, c, s)
    assert out.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    dot = next(op for op in gr.ops if op.primitive == "dot_general")
    k_op = gr.producer(dot.inputs[1])
    if widen == "scale_only":
        assert k_op.primitive == "reshape", k_op.primitive   # the repeat's view stays last
    else:
        assert k_op.primitive in ("mul", "convert_element_type"), k_op.primitive
        views = [gr.producer(x) for x in k_op.inputs if gr.producer(x) is not None]
        assert views and all(p.primitive in ("reshape", "convert_element_type") for p in views), views
