"""canonical.rewrite: a one-window scatter (``cache.at[:, pos].set(row)``) traced as a guarded
dynamic_update_slice — equal to ``jax.jit`` for every position, out-of-range ones included
(``.at[].set`` drops them, ``dynamic_update_slice`` would clamp), and no scatter left in the
CUDA-lowered module."""
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import vtc_jax
from vtc_jax import canonical, graph
from vtc_jax.testing import cross_lower

T = 8
# every position a step can be called with: in range, one past each end, far out, negative
POSITIONS = (0, 3, T - 1, T, T + 5, -1, -T, -T - 1, 2**31 - 1, -2**31)


def _decode(cache, h, w, pos):
    v = (h @ w).reshape(h.shape[0], cache.shape[2], cache.shape[3])
    cache = cache.at[:, pos].set(jnp.tanh(v))
    return jnp.sum(cache, axis=1), cache


def _args(seed=0):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal((2, T, 2, 8)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((2, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 16)) * 0.25, jnp.float32)
    return cache, h, w


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_scatter_traced_as_update():
    g = graph.trace(_decode, *_args(), jnp.int32(3))
    prims = [op.primitive for op in g.ops]
    assert "scatter" not in prims and "dynamic_update_slice" in prims
    # the graph still computes exactly what the function does, out of range too
    for pos in POSITIONS:
        _close(g.evaluate(*jax.tree.leaves((_args(), jnp.int32(pos)))), jax.jit(_decode)(*_args(), jnp.int32(pos)))


@pytest.mark.parametrize("donate", [False, True])
def test_scatter_cache_matches_jit(donate):
    opt = vtc_jax.optimize(_decode, backend="interpret", donate_argnums=(0,) if donate else ())
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        for pos in POSITIONS:
            ref = jax.jit(_decode)(*_args(), jnp.int32(pos))
            out = opt(*_args(), jnp.int32(pos))   # fresh buffers: donation may consume them
            _close(out, ref)
            if pos in (T, -T - 1):                # dropped: the cache comes back unchanged
                np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(_args()[0]))


def test_scatter_cache_no_scatter_in_cuda_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the plan's program (guard=None): at this size the guard gives the whole step back to jit
        mod = cross_lower(vtc_jax.optimize(_decode, backend="triton", donate_argnums=(0,), guard=None),
                          *_args(), jnp.int32(3))
        ref = cross_lower(jax.jit(_decode, donate_argnums=(0,)), *_args(), jnp.int32(3))
    assert ref.count("stablehlo.scatter") == 1
    assert mod.count("stablehlo.scatter") == 0


@pytest.mark.parametrize("form", ["two_indices", "row", "clip", "promise", "vector_update"])
def test_scatter_forms_match_jit(form):
    """Other one-window forms: several indexed dims, a whole row, mode clip/promise_in_bounds."""
    x = jnp.arange(2 * T * 3 * 4, dtype=jnp.float32).reshape(2, T, 3, 4)
    if form == "two_indices":
        fn, u = (lambda x, u, p: x.at[:, p, 1].set(u * 2)), jnp.ones((2, 4))
    elif form == "row":
        fn, u = (lambda x, u, p: x.at[p].set(u - 1)), jnp.ones((T, 3, 4))
    elif form == "clip":
        fn, u = (lambda x, u, p: x.at[:, p].set(u + 1, mode="clip")), jnp.ones((2, 3, 4))
    elif form == "promise":
        fn, u = (lambda x, u, p: x.at[:, p].set(u + 1, mode="promise_in_bounds")), jnp.ones((2, 3, 4))
    else:   # a static slice 1:3 of the last dim: an indexed dim too (a start of 1, a window of 2)
        fn, u = (lambda x, u, p: x.at[:, p, :, 1:3].set(u + 1)), jnp.ones((2, 3, 2))
    positions = (0, 5, T - 1) if form == "promise" else POSITIONS   # promise: out of range undefined
    eqn = [e for e in jax.make_jaxpr(fn)(x, u, jnp.int32(0)).jaxpr.eqns if e.primitive.name == "scatter"][0]
    assert canonical.window_scatter(eqn) is not None, form     # every form is one window
    opt = vtc_jax.optimize(fn, backend="interpret")
    for pos in positions:
        p = jnp.int32(pos)
        if form == "row" and abs(pos) > 2 * T:
            continue   # x.at[p] with p past int32 wrapping: same rule, covered above
        _close(opt(x, u, p), jax.jit(fn)(x, u, p))


def test_other_scatters_untouched():
    """Scatters that are not one window (several indices, a combiner) stay scatters, still correct."""
    x = jnp.arange(T * 4, dtype=jnp.float32).reshape(T, 4)
    fns = [lambda x, i: x.at[jnp.stack([i, i + 1])].set(1.0),      # two index vectors
           lambda x, i: x.at[i].add(1.0),                            # scatter-add
           lambda x, i: x.at[i].mul(3.0)]                            # scatter-mul
    for fn in fns:
        eqn = [e for e in jax.make_jaxpr(fn)(x, jnp.int32(1)).jaxpr.eqns if "scatter" in e.primitive.name][0]
        assert canonical.window_scatter(eqn) is None
        opt = vtc_jax.optimize(fn, backend="interpret")
        for pos in (1, T - 1, T + 2, -1):
            _close(opt(x, jnp.int32(pos)), jax.jit(fn)(x, jnp.int32(pos)))


@pytest.mark.parametrize("kind", ["input", "computed"])
def test_whole_update_is_the_update(kind):
    """A dynamic_update_slice as large as its operand (a prefill filling the cache) is its update,
    whatever the starts (they clamp to 0); the update may be a graph input itself."""
    def fn(cache, u, pos):
        new = u if kind == "input" else jnp.tanh(u) * 2.0
        cache = lax.dynamic_update_slice(cache, new, (0, pos, 0))
        return cache, jnp.sum(cache)

    cache = jnp.zeros((2, T, 4), jnp.float32)
    u = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, 4)), jnp.float32)
    g = graph.trace(fn, cache, u, jnp.int32(0))
    assert "dynamic_update_slice" not in [op.primitive for op in g.ops]
    for donate in ((), (0,)):
        opt = vtc_jax.optimize(fn, backend="interpret", donate_argnums=donate)
        for pos in (0, 3, -2, T + 1):
            _close(opt(jnp.zeros_like(cache), u, jnp.int32(pos)), jax.jit(fn)(cache, u, jnp.int32(pos)))


@pytest.mark.parametrize("pos", [np.int16(5), np.int16(-20), np.uint32(7), np.uint32(2**32 - 1), np.uint8(200)])
def test_index_dtypes(pos):
    """Narrow and unsigned index dtypes: widened, never wrapped into range."""
    fn = lambda c, v, p: c.at[:, p].set(v)   # noqa: E731
    c = jnp.arange(2 * T * 3, dtype=jnp.float32).reshape(2, T, 3)
    v = -jnp.ones((2, 3), jnp.float32)
    g = graph.trace(fn, c, v, pos)
    assert "scatter" not in [op.primitive for op in g.ops]
    np.testing.assert_array_equal(np.asarray(g.evaluate(c, v, pos)[0]), np.asarray(jax.jit(fn)(c, v, pos)))


def test_int64_index_not_wrapped():
    """A 64-bit index beyond int32 is out of range, not wrapped into it (x64 mode, lax.scatter
    called directly: jnp indexing would narrow the index itself before the scatter)."""
    dn = lax.ScatterDimensionNumbers(update_window_dims=(0, 1), inserted_window_dims=(1,),
                                     scatter_dims_to_operand_dims=(1,))
    fn = lambda c, v, p: lax.scatter(c, p[None], v, dn, mode=lax.GatherScatterMode.FILL_OR_DROP)  # noqa: E731
    with jax.enable_x64(True):
        c = jnp.arange(2 * T * 3, dtype=jnp.float32).reshape(2, T, 3)
        v = -jnp.ones((2, 3), jnp.float32)
        for pos in (np.int64(3), np.int64(2**32 + 3), np.int64(-2**32 + 3)):
            g = graph.trace(fn, c, v, jnp.asarray(pos))
            assert "scatter" not in [op.primitive for op in g.ops]
            ref = jax.jit(fn)(c, v, jnp.asarray(pos))
            np.testing.assert_array_equal(np.asarray(g.evaluate(c, v, jnp.asarray(pos))[0]), np.asarray(ref))


def test_key_arrays_left_alone():
    keys = jax.random.split(jax.random.key(0), 4)
    eqns = [e for e in jax.make_jaxpr(lambda k, i: k.at[i].set(k[0]))(keys, 1).jaxpr.eqns
            if e.primitive.name == "scatter"]
    assert eqns and all(canonical.window_scatter(e) is None for e in eqns)


def test_transpose_of_transpose_is_one_transpose():
    """Consecutive transposes fold into one (the identity vanishes); an inner transpose another op
    reads stays; values equal jax.jit."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 4, 5)), jnp.float32)
    cases = [
        (lambda a: jnp.tanh(a.transpose(3, 0, 2, 1).transpose(1, 2, 3, 0)), 1),
        (lambda a: jnp.tanh(a.transpose(1, 0, 2, 3).transpose(1, 0, 2, 3)), 0),      # identity
        (lambda a: jnp.tanh(a.transpose(0, 2, 1, 3).transpose(0, 1, 3, 2).transpose(3, 2, 1, 0)), 1),
        (lambda a: (lambda t: (jnp.tanh(t.transpose(0, 1, 3, 2)), t * 2))(a.transpose(0, 2, 1, 3)), 2),
    ]
    for fn, n in cases:
        g = graph.trace(fn, x)
        assert [op.primitive for op in g.ops].count("transpose") == n
        _close(g.evaluate(x), jax.jit(fn)(x))
        _close(vtc_jax.optimize(fn, backend="interpret")(x), jax.jit(fn)(x))


# ---- a cond whose branches are elementwise: both computed, one selected ---------------------

def _windowed_scores(q, k, v, pos, window):
    """Decode attention with a sliding window applied under lax.cond (Gemma's style)."""
    t = k.shape[1]
    idx = jnp.arange(t)
    s = jnp.einsum("bkgh,btkh->bkgt", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    s = jnp.where((idx <= pos)[None, None, None, :], s, -jnp.inf)
    s = lax.cond(pos >= window, lambda s: jnp.where((idx > pos - window)[None, None, None, :], s, -jnp.inf),
                 lambda s: s, s)
    return jnp.einsum("bkgt,btkh->bkgh", jax.nn.softmax(s, axis=-1), v)


def test_elementwise_cond_traced_as_select_and_fits_the_attention_window():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 2, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, T, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, T, 2, 8)), jnp.float32)
    g = graph.trace(_windowed_scores, q, k, v, jnp.int32(5), 3)
    assert not [op for op in g.ops if op.primitive == "cond"]
    rep = vtc_jax.explain(_windowed_scores, static_argnums=4)(q, k, v, jnp.int32(5), 3)
    assert [w for _, kind, w in rep.templates if kind == "attention"] == ["kernel"], rep.templates
    ref = jax.jit(_windowed_scores, static_argnums=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        f = vtc_jax.optimize(_windowed_scores, static_argnums=4)
        for pos in (0, 1, 2, 3, 5, T - 1):   # both sides of the cond's predicate
            _close(f(q, k, v, jnp.int32(pos), 3), ref(q, k, v, jnp.int32(pos), 3))


def test_switch_with_three_elementwise_branches_matches_jit():
    def fn(x, i):
        return lax.switch(i, [jnp.sin, jnp.cos, lambda v: v * 2.0], x) + 1.0
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    assert not [op for op in graph.trace(fn, x, jnp.int32(1)).ops if op.primitive == "cond"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        f = vtc_jax.optimize(fn)
        for i in (-3, 0, 1, 2, 7):   # switch clamps its index
            _close(f(x, jnp.int32(i)), jax.jit(fn)(x, jnp.int32(i)))


def test_cond_with_work_or_an_update_stays_a_cond():
    def heavy(x, w, p):
        return lax.cond(p, lambda a: a @ w, lambda a: a, x)

    def update(c, r, p):
        return lax.cond(p > 0, lambda c: lax.dynamic_update_slice(c, r, (p, 0)), lambda c: c, c)
    x, w = jnp.ones((4, 4)), jnp.eye(4)
    for fn, args in ((heavy, (x, w, True)), (update, (x, jnp.ones((1, 4)), jnp.int32(2)))):
        assert [op for op in graph.trace(fn, *args).ops if op.primitive == "cond"], fn.__name__


# ---- complex arithmetic as pairs of real tensors ----------------------------------------------

def _complex_rope(x, pos):
    """Llama's complex RoPE: adjacent pairs as complex numbers times exp(i·θ)."""
    d = x.shape[-1]
    theta = pos.astype(jnp.float32) / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rot = jnp.exp(1j * theta).astype(jnp.complex64)
    xp = x.reshape(*x.shape[:-1], d // 2, 2)
    z = lax.complex(xp[..., 0], xp[..., 1]) * rot
    return jnp.stack([z.real, z.imag], axis=-1).reshape(x.shape)


def test_complex_rope_traced_without_complex_and_equal():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 1, 4, 16)), jnp.float32)
    g = graph.trace(_complex_rope, x, jnp.int32(7))
    cplx = [op.primitive for op in g.ops
            if any(np.issubdtype(np.dtype(g.tensors[t].dtype), np.complexfloating) for t in (*op.inputs, *op.outputs))]
    # only the constant 1j is taken apart (its real/imag parts); no complex arithmetic is left
    assert set(cplx) <= {"real", "imag"}, cplx
    for pos in (0, 7, 300):
        np.testing.assert_allclose(np.asarray(g.evaluate(x, jnp.int32(pos))[0]),
                                   np.asarray(jax.jit(_complex_rope)(x, jnp.int32(pos))), rtol=1e-5, atol=1e-5)
    rep = vtc_jax.explain(_complex_rope)(x, jnp.int32(7))
    assert all(why == "kernel" or "iota" in why for _, kind, why in rep.templates if kind == "pointwise"), rep.templates


def test_complex_ops_without_a_pair_rule_keep_complex_values():
    def fn(a, b):
        z = lax.complex(a, b)
        w = z / (z + 2.0) + jnp.conj(z) * jnp.exp(z)     # division: no pair rule, runs whole
        return jnp.abs(w), w                               # a complex output stays complex
    a = jnp.linspace(-1.0, 1.0, 8)
    b = jnp.linspace(0.5, 2.0, 8)
    g = graph.trace(fn, a, b)
    assert "div" in {op.primitive for op in g.ops}
    out, ref = g.evaluate(a, b), jax.jit(fn)(a, b)
    for o, r in zip(out, ref):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        _close(vtc_jax.optimize(fn)(a, b), jax.jit(fn)(a, b))


# ---- convolutions XLA runs next to kernels, written channels-last ------------------------------

CONV_FORMS = [
    # (input shape, filter shape, dimension numbers, groups)
    ((2, 6, 9, 7), (4, 6, 3, 3), ("NCHW", "OIHW", "NCHW"), 1),
    ((2, 6, 9, 7), (3, 3, 6, 4), ("NCHW", "HWIO", "NHWC"), 1),
    ((2, 9, 7, 6), (3, 3, 3, 4), ("NHWC", "HWIO", "NCHW"), 2),
    ((2, 6, 11), (6, 1, 5), ("NCH", "OIH", "NCH"), 6),            # 1-D depthwise
    ((6, 2, 5, 4), (4, 6, 1, 3), ("CNHW", "OIHW", "HNWC"), 1),    # batch not first
]


@pytest.mark.parametrize("xs,ws,dn,groups", CONV_FORMS)
def test_channels_last_conv_equals_the_conv(xs, ws, dn, groups):
    """``trace_with(channels_last=...)`` writes the conv as transpose → (N, spatial.., C) conv →
    transpose back, for any dimension numbers and groups: the traced graph evaluates to lax's
    conv (f32, 1e-5), and its conv is channels-last. A conv that already is stays untouched."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
    w = jnp.asarray(rng.standard_normal(ws), jnp.float32)
    nsp = len(xs) - 2
    fn = lambda x, w: jnp.tanh(lax.conv_general_dilated(x, w, (1,) * nsp, "SAME", dimension_numbers=dn,
                                                       feature_group_count=groups))
    g = graph.trace_with(fn, (x, w), {}, channels_last=frozenset({0}))
    convs = [op for op in g.ops if op.primitive == "conv_general_dilated"]
    assert len(convs) == 1 and convs[0].conv_index == 0
    cl = (0, len(xs) - 1, *range(1, len(xs) - 1))
    d = convs[0].params["dimension_numbers"]
    assert tuple(d.lhs_spec) == cl and tuple(d.out_spec) == cl
    _close(g.evaluate(x, w), jax.jit(fn)(x, w))
    # already channels-last: nothing to rewrite
    nhwc = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    g2 = graph.trace_with(nhwc, (jnp.zeros((1, 5, 5, 2)), jnp.zeros((3, 3, 2, 4))), {}, channels_last=frozenset({0}))
    assert [op.primitive for op in g2.ops] == ["conv_general_dilated"]


def test_convs_xla_runs_next_to_kernels_are_traced_channels_last():
    """EfficientViT's LiteMLA: the qkv and grouped 1×1 convs feed the attention matmuls through a
    concat and a reshape. ``api.xla_layout_convs`` names them after the first analysis (XLA runs
    them, a kernel reads their outputs); the second trace writes them channels-last, and the
    transposes back to NCHW are read through by the kernels (eliminated), so XLA has no layout
    copy to make for a Pallas operand. The depthwise conv between them reads what a kernel reads
    (the qkv conv's output: channels-last, its pair of transposes folds away, no 192 MiB copy at
    paper size) and the projection reads what a kernel writes (through the heads' reshape): both
    channels-last too. Values equal jax.jit (f32, 1e-5)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import efficientvit_attention as eff
    from vtc_jax.analysis import analyze, xla_layout_convs

    args = tuple(eff.example_args("small", batch=2))
    first = analyze(eff.step, args, {}, graph=graph.trace(eff.step, *args))
    picked = xla_layout_convs(first)
    assert picked == {0, 1, 2, 3}
    a = analyze(eff.step, args, {})
    res = a.strategy.resolution
    for op in a.graph.ops:
        if op.primitive == "conv_general_dilated":
            assert tuple(op.params["dimension_numbers"].out_spec) == (0, 3, 1, 2)
        if op.primitive == "conv_general_dilated" and op.conv_index in (0, 2):
            backs = [c for c in a.graph.consumers(op.outputs[0]) if c.primitive == "transpose"]
            assert backs and all(b.id in res.eliminated for b in backs)
    assert not xla_layout_convs(a)   # a fixed point: nothing left to rewrite
    assert sum(op.primitive == "transpose" and op.id not in res.eliminated for op in a.graph.ops) <= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _close(vtc_jax.optimize(eff.step)(*args), jax.jit(eff.step)(*args))


# ---- autodiff's add_any and jnp.tile: primitives other codebases emit -------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grad_add_any_is_an_add_and_no_fallback(dtype):
    """A ``jax.grad`` program sums cotangents with ``add_any``: traced as ``add`` (no opaque op, no
    fallback warning; bf16 too, which numpy does not count as a number), and the gradients equal
    jax.jit's."""
    rng = np.random.default_rng(5)
    x, w1, w2 = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((8, 16), (16, 32), (32, 16)))

    def loss(w1, w2, x):
        h = jax.nn.gelu((x @ w1).reshape(8, 4, 8).transpose(1, 0, 2)).transpose(1, 0, 2).reshape(8, 32)
        return jnp.mean((h @ w2 - x) ** 2) + jnp.sum(h * h)   # h read twice: its cotangents add_any

    step = jax.value_and_grad(loss, argnums=(0, 1))
    assert "add_any" in str(jax.make_jaxpr(step)(w1, w2, x))
    g = graph.trace(step, w1, w2, x)
    assert not any(op.primitive == "add_any" or op.opaque_reason for op in g.ops)
    with warnings.catch_warnings():
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        got = vtc_jax.optimize(step, backend="interpret")(w1, w2, x)
    want = jax.jit(step)(w1, w2, x)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("shape,reps", [((2, 3, 4), (1, 2, 1)), ((3, 4), (2, 2)), ((4,), (2, 3, 1)),
                                        ((2, 3), (3,)), ((2, 1, 3), (1, 4, 2))])
def test_tile_is_a_broadcast_and_eliminated(shape, reps):
    """``jnp.tile`` (a ``tile`` primitive in jax ≥ 0.10) is traced as broadcast + reshape, which the
    movement rules make virtual: no movement op left running, values exactly jax.jit's."""
    x = jnp.asarray(np.random.default_rng(6).standard_normal(shape), jnp.float32)
    fn = lambda a: jnp.tanh(jnp.tile(a * 2.0, reps)) + 1.0   # noqa: E731
    g = graph.trace(fn, x)
    assert "tile" not in [op.primitive for op in g.ops]
    rep = vtc_jax.explain(fn)(x)
    assert all(m.eliminated for m in rep.movement), rep
    np.testing.assert_array_equal(np.asarray(vtc_jax.optimize(fn, backend="interpret")(x)),
                                  np.asarray(jax.jit(fn)(x)))
