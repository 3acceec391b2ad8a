"""vtc_jax.optimize end to end: same numbers as jax.jit, jax.jit's conventions, honest fallbacks.

Equivalence runs the Pallas kernels in interpret mode (small shapes); the paper-size checks only
trace and lower for CUDA (no execution).
"""
import sys
import functools
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax
from vtc_jax.compat import cuda_lowering
from vtc_jax.testing import cross_lower

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama3_decode as L  # noqa: E402

F32_RTOL, BF16_RTOL = 1e-4, 2e-2


def _max_rel(out, ref):
    errs = []
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape
        errs.append(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
    return max(errs)


@pytest.mark.parametrize("dtype,tol,batch", [(jnp.float32, F32_RTOL, 2), (jnp.bfloat16, BF16_RTOL, 2),
                                             (jnp.float32, F32_RTOL, 1)])
def test_llama_layer_equals_jit(dtype, tol, batch):
    args = L.example_args("small", batch=batch, dtype=dtype)
    ref = jax.jit(L.step)(*args)
    f = vtc_jax.optimize(L.step, backend="interpret", guard=None)
    out = f(*args)
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    assert _max_rel(out, ref) <= tol
    _, lowered = f.last
    kinds = {k.split()[0] for k in lowered.kernels}
    assert {"matmul", "attention"} <= kinds, lowered.kernels
    # RoPE (three pointwise clusters joined by slices and a concat) is re-clustered as ONE
    # pointwise cluster holding its slices and concat (cluster.fuse_islands); q's and k's, cut out
    # of one QKV result, are one kernel over the union of their shapes (cluster.sibling_islands),
    # which writes k's row straight into the cache
    a, _ = f.last
    rope = {c.id for c in a.clusters if c.kind == "pointwise"
            and any(a.graph.ops[o].primitive == "neg" for o in c.ops)}
    assert len(rope) == 1 and not rope & a.xla_fused, (rope, a.xla_fused)
    (r,) = rope
    assert len({a.graph.tensors[t].shape for t in next(c for c in a.clusters if c.id == r).outputs}) == 2
    assert all({a.graph.ops[o].primitive for o in next(c for c in a.clusters if c.id == r).ops}
               >= {"concatenate", "neg", "mul", "add"} for r in rope)
    assert all(any(k.startswith("pointwise cluster #%d " % c) for k in lowered.kernels) for c in rope)
    dus = [op.id for op in a.graph.ops if op.primitive == "dynamic_update_slice"]
    assert dus and all(o in a.strategy.resolution.eliminated for o in dus)
    assert not lowered.fallbacks
    assert len(lowered.skipped) >= 10  # movement ops nobody executes


@pytest.mark.parametrize("batch", [1, 16])
def test_paper_size_lowering_leaves_no_movement(batch):
    """Fig. 2 at Llama-3-8B size: no cache-sized movement reaches a kernel, a dot or a result (the
    GQA repeat and K/V transposes are gone); the caches alias."""
    args = L.example_args("paper", batch=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        f = vtc_jax.optimize(L.step, backend="triton", donate_argnums=(2, 3))
        opt = cross_lower(f, *args)
        with cuda_lowering():  # jax >= 0.11 on a CPU machine: an abstract H100 to lower for
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    base = cross_lower(jax.jit(L.step, donate_argnums=(2, 3)), *args)
    assert base.movement_into_consumers(), "the baseline should have movement feeding dots/results"
    # Nothing cache-sized moves: the GQA repeat (broadcast) and the K/V transposes the baseline
    # feeds its attention dots are gone — the attention kernel reads the caches through the index
    # maps — and both cache rows are written in place by kernels (K by the fused RoPE kernel,
    # cluster.fuse_islands; V by the QKV projection's split-K reduction): no dynamic_update_slice
    # is left. What still reaches a dot or a result is the attention output's transpose of a
    # size-1 axis (a bitcast).
    cache = "tensor<%dx4096x8x128xbf16>" % batch
    moved = opt.movement_into_consumers()
    assert not [m for m in moved if m[2] == cache], moved
    assert opt.count("stablehlo.dynamic_update_slice") == 0
    assert all(m[0] != "stablehlo.broadcast_in_dim" for m in moved), moved
    assert all(m[2] in (cache, "tensor<%dx1x32x128xbf16>" % batch) for m in moved), moved
    big = lambda ms: [m for m in ms if m[0] in ("stablehlo.broadcast_in_dim", "stablehlo.transpose")
                      and "x4096x" in m[2]]
    assert big(base.movement_into_consumers()) and not big(moved)
    for op in ("dynamic_slice", "pad", "reverse", "gather", "scatter"):
        assert opt.count(f"stablehlo.{op}") == 0, op
    assert len(opt.triton_kernels) >= 2   # decode attention: split + combine
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text  # K and V caches


def test_jit_conventions_pytrees_kwargs_static_and_nesting():
    def fn(tree, *, scale, mode):
        a, b = tree["a"], tree["b"]
        y = jnp.dot(a, b.T) * scale
        return {"y": jnp.transpose(y) if mode == "t" else y, "n": jnp.sum(a)}

    tree = {"a": jnp.arange(48.0).reshape(6, 8) / 48, "b": jnp.ones((5, 8))}
    f = vtc_jax.optimize(fn, static_argnames="mode", backend="interpret")
    for mode in ("t", "n"):
        out = f(tree, scale=2.0, mode=mode)
        ref = jax.jit(fn, static_argnames="mode")(tree, scale=2.0, mode=mode)
        assert jax.tree.structure(out) == jax.tree.structure(ref)
        assert _max_rel(out, ref) <= 1e-6
    inner = jax.jit(lambda t: f(t, scale=1.0, mode="t")["y"] + 1)(tree)
    np.testing.assert_allclose(inner, jax.jit(fn, static_argnames="mode")(tree, scale=1.0, mode="t")["y"] + 1,
                               rtol=1e-6)
    assert "func.func" in f.lower(tree, scale=1.0, mode="t").as_text()
    assert f.trace(tree, scale=1.0, mode="n").jaxpr is not None
    exp = jax.export.export(jax.jit(lambda t: f(t, scale=1.0, mode="t")))(tree)
    np.testing.assert_allclose(exp.call(tree)["y"], out_t := f(tree, scale=1.0, mode="t")["y"], rtol=1e-6)
    assert isinstance(f.explain(tree, scale=1.0, mode="t"), vtc_jax.Report)


def _scaled_with_a_schedule(x, step, base_lr):
    """A kernel beside a result of Python scalars (a learning-rate schedule): jax.jit returns the
    schedule weakly typed."""
    return jnp.tanh(x.T) * 2.0, base_lr * jnp.minimum(1.0, step / 100.0), step * 3


@pytest.mark.parametrize("guard", [None, "model"], ids=["unguarded", "guarded"])
def test_weak_types_of_results_as_jax_jit(guard, tmp_path):
    """Results computed from Python scalars keep jax's weak type, as jax.jit returns them: the
    promotion that reads them later is jit's (``bf16 * lr`` stays bf16), directly, inside an
    outer jit and from the plan cache. They came back strongly typed (``bf16 * lr`` was f32)."""
    x = jnp.arange(12.0).reshape(3, 4)
    ref = jax.jit(_scaled_with_a_schedule)(x, 10, 1e-3)
    half = jnp.ones((2,), jnp.bfloat16)
    for cache in (None, tmp_path):
        f = vtc_jax.optimize(_scaled_with_a_schedule, backend="interpret", guard=guard, plan_cache=cache)
        for _ in range(2 if cache else 1):   # with a cache: made, then answered from it
            out = f(x, 10, 1e-3)
            assert [o.aval.weak_type for o in out] == [r.aval.weak_type for r in ref] == [False, True, True]
            assert (half * out[1]).dtype == jnp.bfloat16 and (half * out[2]).dtype == jnp.bfloat16
            assert _max_rel(out, ref) <= 1e-6
    nested = jax.jit(lambda x: half * vtc_jax.optimize(_scaled_with_a_schedule, backend="interpret",
                                                       guard=guard)(x, 10, 1e-3)[1])(x)
    assert nested.dtype == jnp.bfloat16


def _cache_step(n, x, cache, pos):
    y = jnp.tanh(x.T) * n
    cache = jax.lax.dynamic_update_slice(cache, y[None], (pos, 0, 0))
    return cache.sum(0), cache


def test_static_and_donated_arguments_by_number_or_name_as_jax_jit():
    """jax.jit's rule: static/donated arguments given by number or by name, the other read off the
    signature. A static argument passed the other way round is still static (a Python ``if`` on it
    traces), a donated one is donated (its buffer aliased, the analysis told which graph input it
    is, with static arguments before it shifting the positions), and bad numbers or names raise
    jax.jit's own errors."""
    x = jnp.arange(32.0).reshape(4, 8) / 32
    cache = jnp.zeros((5, 8, 4))
    ref = jax.jit(_cache_step, static_argnums=0)(2, x, cache, 1)
    calls = [  # (optimize's keywords, how the call passes n, cache and pos)
        (dict(static_argnums=0, donate_argnums=2), lambda f, c: f(2, x, c, 1)),
        (dict(static_argnames="n", donate_argnames="cache"), lambda f, c: f(2, x, c, 1)),
        (dict(static_argnums=0, donate_argnames="cache"), lambda f, c: f(2, x, cache=c, pos=1)),
        (dict(static_argnames="n", donate_argnums=2), lambda f, c: f(x=x, n=2, cache=c, pos=1)),
    ]
    for kw, call in calls:
        f = vtc_jax.optimize(_cache_step, backend="interpret", **kw)
        out = call(f, jnp.array(cache))
        assert _max_rel(out, ref) <= 1e-6, kw
        g = f.last[0].graph
        cache_input = [t for t in g.inputs if g.tensors[t].shape == cache.shape]
        assert f.last[0].donated == frozenset(cache_input), (kw, f.last[0].donated, g.inputs)
        text = call(f.lower, cache).as_text()
        assert "tf.aliasing_output = 1" in text, kw
    branchy = lambda x, mode: x * 2 if mode > 1 else x   # noqa: E731 - a Python if on a static arg
    for kw in (dict(static_argnames="mode"), dict(static_argnums=1)):
        f = vtc_jax.optimize(branchy, backend="interpret", **kw)
        np.testing.assert_array_equal(f(x, 3), jax.jit(branchy, **kw)(x, 3))
        np.testing.assert_array_equal(f(x, mode=3), jax.jit(branchy, **kw)(x, mode=3))
    for kw in (dict(static_argnames="nope"), dict(donate_argnames="nope"), dict(donate_argnums=9),
               dict(static_argnames="cache", donate_argnames="cache")):
        with pytest.raises(ValueError) as want:
            jax.jit(_cache_step, **kw)(2, x, cache, 1)
        with pytest.raises(ValueError, match=re.escape(str(want.value)[:60])):
            vtc_jax.optimize(_cache_step, backend="interpret", **kw)(2, x, cache, 1)
    rep = vtc_jax.explain(_cache_step, static_argnums=0, donate_argnames="cache")(2, x, cache, 1)
    assert isinstance(rep, vtc_jax.Report)


def test_method_binds_self_as_jax_jit():
    """``@partial(optimize, static_argnums=0)`` on a method binds ``self`` (a static, hashable
    object), as ``jax.jit`` does; a non-static ``self`` that is not an array gets jax.jit's error."""
    class Layer:
        def __init__(self, k):
            self.k = k

        def __hash__(self):
            return hash(self.k)

        def __eq__(self, other):
            return isinstance(other, Layer) and other.k == self.k

        @functools.partial(vtc_jax.optimize, static_argnums=0, backend="interpret")
        def f(self, x):
            return (x.T * self.k).sum(0)

        @functools.partial(jax.jit, static_argnums=0)
        def g(self, x):
            return (x.T * self.k).sum(0)

        @functools.partial(vtc_jax.optimize, backend="interpret")
        def h(self, x):
            return x.T

    x = jnp.arange(12.0).reshape(3, 4)
    for k in (2.0, 3.0):
        layer = Layer(k)
        np.testing.assert_array_equal(layer.f(x), layer.g(x))
        np.testing.assert_array_equal(Layer.f(layer, x), layer.g(x))
    with pytest.raises(TypeError, match="as an abstract array"):
        Layer(1.0).h(x)


def test_a_call_on_one_device_dispatches_as_cheaply_as_jax_jit(monkeypatch):
    """On a process with one device, a call outside any trace goes straight to the jitted program,
    as ``jax.jit``'s dispatch does: reading every argument's sharding (to route sharded inputs)
    cost about 4 µs a call with 13 arguments, paid wherever a loop of small programs is bound by
    the host (a lent H200's plain-jit fallback read 0.92x of ``jax.jit`` back to back). Inside a
    trace (arguments are tracers that may carry Explicit shardings) the full routing still runs."""
    from vtc_jax import api
    assert jax.device_count() == 1   # the suite's own process (tests/test_tp.py: 8 in a subprocess)

    def step(params, x):
        return jnp.tanh(x @ params["w"]) + params["b"]

    params = {"w": jnp.full((8, 8), 0.1), "b": jnp.ones(8)}
    x = jnp.ones((4, 8))
    opt = vtc_jax.optimize(step)
    routed = []
    full = api.Optimized._for
    monkeypatch.setattr(api.Optimized, "_for", lambda self, a, k: routed.append(1) or full(self, a, k))
    np.testing.assert_allclose(opt(params, x), jax.jit(step)(params, x), rtol=1e-6)
    assert routed == []
    np.testing.assert_allclose(jax.jit(opt)(params, x), jax.jit(step)(params, x), rtol=1e-6)
    assert routed == [1]
    # the leaf test used where several devices exist: concrete single-device values pass,
    # tracers and ShapeDtypeStructs take the full test
    assert api._on_one_device([x, np.ones(3), 2.0, None])
    assert not api._on_one_device([x, jax.ShapeDtypeStruct((2,), jnp.float32)])
    seen = []
    jax.jit(lambda v: seen.append(api._on_one_device([x, v])) or v)(x)
    assert seen == [False]


def test_decorator_forms_and_bad_input():
    @vtc_jax.optimize
    def g(x):
        return jnp.transpose(x) * 2

    @vtc_jax.optimize(backend="interpret")
    def h(x):
        return jnp.transpose(x) * 2

    x = jnp.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        np.testing.assert_array_equal(g(x), h(x))
    with pytest.raises(TypeError, match="callable"):
        vtc_jax.optimize(3)
    with pytest.raises(ValueError, match="backend"):
        vtc_jax.optimize(h, backend="cuda")
    with pytest.raises(TypeError):  # wrong arity: the same kind of error jax.jit gives
        h(x, x)


def _sort_between_matmuls(x, w1, w2):
    y = jnp.dot(x, w1)
    y = jnp.sort(y, axis=-1)
    return jnp.transpose(jnp.dot(y, w2))


def test_fallback_warns_once_naming_the_primitive_and_strict_raises():
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.standard_normal((4, 8)), jnp.float32), jnp.asarray(rng.standard_normal((8, 8)), jnp.float32),
            jnp.asarray(rng.standard_normal((8, 4)), jnp.float32))
    # guard=None: the plan as the greedy made it (a 4 x 8 program's kernels win nothing the guard
    # would keep, and a function the guard runs as plain jit has no fallback to warn about)
    f = vtc_jax.optimize(_sort_between_matmuls, backend="interpret", guard=None)
    with pytest.warns(vtc_jax.VTCFallbackWarning, match="sort") as rec:
        out = f(*args)
    assert sum("sort" in str(w.message) for w in rec) == 1
    np.testing.assert_allclose(out, jax.jit(_sort_between_matmuls)(*args), rtol=1e-5)
    strict = vtc_jax.optimize(_sort_between_matmuls, backend="interpret", strict=True, guard=None)
    with pytest.raises(vtc_jax.VTCError, match="sort"):
        strict(*args)


def test_whole_rewrite_failure_falls_back_to_jit(monkeypatch):
    import vtc_jax.program as program   # the build loop's lowering step

    def boom(*a, **k):
        raise RuntimeError("synthetic lowering failure")

    monkeypatch.setattr(program, "lower", boom)
    f = vtc_jax.optimize(lambda x: jnp.transpose(x) + 1, backend="interpret")
    x = jnp.arange(6.0).reshape(2, 3)
    with pytest.warns(vtc_jax.VTCFallbackWarning, match="synthetic lowering failure"):
        np.testing.assert_array_equal(f(x), jnp.transpose(x) + 1)


def test_inplace_hazard_is_detected_and_the_answer_stays_right():
    """The old cache is read after the update: the in-place edge must go, with a reason."""
    def step(cache, new, pos):
        updated = jax.lax.dynamic_update_slice(cache, new, (pos, 0))
        old_sum = jnp.sum(cache * 2.0, axis=0)           # reads the *old* contents afterwards
        return jnp.dot(jnp.transpose(updated), updated) + old_sum

    rng = np.random.default_rng(1)
    cache = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((1, 8)), jnp.float32)
    pos = jnp.int32(5)
    report = vtc_jax.explain(step)(cache, new, pos)
    dropped = [why for e, why in report.vtog.dropped if e.inplace]
    assert dropped and "old contents" in dropped[0]
    assert not any(report.vtog.edges[i].inplace for i in report.strategy.chosen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        out = vtc_jax.optimize(step, backend="interpret")(cache, new, pos)
    np.testing.assert_allclose(out, jax.jit(step)(cache, new, pos), rtol=1e-5)


def test_donated_cache_is_updated_in_place():
    args = L.example_args("small", batch=1)
    ref = jax.jit(L.step)(*args)
    f = vtc_jax.optimize(L.step, backend="interpret", donate_argnums=(2, 3))
    params, x, kc, vc, pos = args
    out = f(params, x, jnp.array(kc), jnp.array(vc), pos)
    assert _max_rel(out, ref) <= F32_RTOL
    text = f.lower(*args).as_text()
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text


def _fused_qkv_decode(p, x, k_cache, v_cache, pos):
    """A BLOOM-style step (HF ``modeling_bloom``): one fused QKV GEMM + bias, its (B, 1, H, 3, D)
    view split per head, the K row transposed into a (B*H, D, T) cache and the V row into a
    (B*H, T, D) cache by ``dynamic_update_slice`` at a traced ``pos``."""
    B, H, D = x.shape[0], 2, x.shape[-1] // 2
    fused = (x @ p["qkv"] + p["b"]).reshape(B, 1, H, 3, D)
    q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 3, 1).reshape(B * H, D, 1), (0, 0, pos))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3).reshape(B * H, 1, D), (0, pos, 0))
    return q * 2.0, k_cache, v_cache


def _fused_qkv_args(pos):
    rng = np.random.default_rng(3)
    B, H, D, T = 2, 2, 16, 12
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return ({"qkv": f(H * D, 3 * H * D), "b": f(3 * H * D)}, f(B, 1, H * D), f(B * H, D, T), f(B * H, T, D),
            jnp.int32(pos))


@pytest.mark.parametrize("pos", [0, 5, 11, 40, -1, -5, -40])
def test_fused_qkv_rows_are_written_into_the_caches_by_the_gemm(pos):
    """The GEMM's reduce writes the K and V rows into the caches (strategy.update_by_producer): no
    dynamic_update_slice is left, the caches are updated in place, and the values equal jit's at
    any ``pos`` — negative ones wrap and out-of-range ones clamp as lax does, in the kernel
    (``indexmap.normalise_start``: the raw ``pos`` is the kernel's symbol, no XLA launch for it)."""
    args = _fused_qkv_args(pos)
    ref = jax.jit(_fused_qkv_decode)(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        f = vtc_jax.optimize(_fused_qkv_decode, backend="interpret", guard=None, donate_argnums=(2, 3))
        report = f.explain(*args)
        text = f.lower(*args).as_text()
        out = f(*jax.tree.map(jnp.array, args))
        mod = cross_lower(vtc_jax.optimize(_fused_qkv_decode, backend="triton", guard=None,
                                           donate_argnums=(2, 3)), *args)
    assert _max_rel(out, ref) <= F32_RTOL
    rows = [r for r in str(report).splitlines() if "dynamic_update_slice" in r and r.strip().startswith("#")]
    assert len(rows) == 2 and all("eliminated" in r and "(write" in r for r in rows), rows
    assert "tf.aliasing_output = 1" in text and "tf.aliasing_output = 2" in text
    assert not [m for m in mod.movement_into_consumers() if m[0] == "stablehlo.dynamic_update_slice"]
    assert [k.name for k in mod.triton_kernels if k.name.startswith("vtc_matmul")]
    # pos reaches the kernels raw: no scalar select/clamp for XLA to launch before them
    glue = [l for l in mod.text.splitlines() if re.search(r"stablehlo\.(select|clamp|minimum|maximum|compare)", l)]
    assert not glue, glue


def test_user_errors_are_not_swallowed():
    f = vtc_jax.optimize(lambda x, y: jnp.dot(x, y), backend="interpret")
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have the same shape"):
        f(jnp.ones((2, 3)), jnp.ones((4, 5)))


@pytest.mark.parametrize("fn, shapes", [
    (lambda a, b: (a.T @ b) + 1.0, ((0, 16), (0, 8))),        # empty contraction: a matrix of ones
    (lambda a, b: jnp.transpose(a) @ b, ((16, 0), (16, 8))),   # empty result
    (lambda x: jnp.transpose(x).reshape(-1) * 2.0, ((0, 4),)),
])
def test_zero_size_operands_are_xlas_by_choice(fn, shapes):
    """A cluster touching a tensor with no elements is left to XLA with a reason (no kernel, no
    fallback warning, no whole-rewrite failure: the cost model once divided by the empty K)."""
    args = [jnp.ones(s, jnp.float32) for s in shapes]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = vtc_jax.optimize(fn, backend="interpret")(*args)
    assert not [w for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)], [str(w.message) for w in rec]
    np.testing.assert_array_equal(out, jax.jit(fn)(*args))
    reasons = [why for _, _, why in vtc_jax.explain(fn)(*args).templates]
    assert reasons and all("has no elements" in why for why in reasons), reasons


def test_embedding_lookup_read_through_the_token_table_forward_and_grad():
    """``emb[tokens]`` feeding an RMSNorm: the norm kernel reads the embedding rows through the
    token table (no gathered copy), a negative token wraps and one past the table clamps as jax
    does; the value, ``grad`` of the optimized function and the optimized ``grad`` equal jit's."""
    rng = np.random.default_rng(0)
    emb = jnp.asarray(rng.standard_normal((50, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    tok = jnp.asarray([[1, 7, 49, -1], [0, 3, 3, 60]], jnp.int32)

    def loss(emb, w, tok):
        h = emb[tok]
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        return jnp.sum(jnp.tanh(h @ w) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        opt = vtc_jax.optimize(loss, backend="interpret", guard=None)
        got = (opt(emb, w, tok), jax.grad(opt, argnums=(0, 1))(emb, w, tok),
               vtc_jax.optimize(grad, backend="interpret", guard=None)(emb, w, tok))
        report = opt.explain(emb, w, tok)
    want = (jax.jit(loss)(emb, w, tok), grad(emb, w, tok), grad(emb, w, tok))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    (gather,) = [m for m in report.movement if m.primitive == "gather"]
    assert gather.eliminated and "indirect gather through table" in str(report)
