"""Templates are matched before the strategy; whatever no template takes stays XLA, cleanly.

Each test compares ``optimize(f)`` with ``jax.jit(f)`` (interpret mode, f32 ≤ 1e-5 relative unless
stated) and checks the lowered module: a cluster no template matched never makes a tensor
virtual, so XLA never reads one element-wise (no ``gather``/``scatter`` where ``jax.jit`` has none).
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vtc_jax
from vtc_jax import templates
from vtc_jax.analysis import analyze
from vtc_jax.templates import Match, Reject
from vtc_jax.testing import cross_lower

RTOL = 1e-5


def _rand(*shapes, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes))


def _run(f, *args, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        opt = vtc_jax.optimize(f, backend="interpret", guard=None, **kw)
        out = opt(*args)
    msgs = [str(w.message) for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
    return opt, out, [m for m in msgs if "interpret mode" not in m]


def check_close(out, ref, rtol=RTOL):
    """Max abs difference within ``rtol`` of the reference's largest magnitude (bf16 rounds
    per element: an element-wise relative bound would judge the rounding of tiny values)."""
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape
        assert np.max(np.abs(a - b)) <= rtol * max(np.max(np.abs(b)), 1.0), np.max(np.abs(a - b))


def check_no_elementwise_gather(opt, *args):
    """Nothing VTC emitted for XLA reads or writes element-wise, in interpret mode and in the
    CUDA-lowered module (there the kernels are opaque Triton calls: any gather is XLA's)."""
    _, lowered = opt.last
    assert lowered.gathers == [], lowered.gathers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        tri = vtc_jax.optimize(opt.fn, backend="triton", guard=None)
        text = cross_lower(tri, *args).text
    base = cross_lower(jax.jit(opt.fn), *args).text
    for op in ("stablehlo.gather", "stablehlo.scatter"):
        assert text.count(op) <= base.count(op), op


def test_iota_pointwise_cluster_keeps_its_neighbours_physical_or_reads_the_table():
    """``tanh((x@w).T) * iota``: the iota is small next to the output? No — it is as large, so the
    pointwise cluster is rejected before the strategy and the transpose stays an XLA op."""
    def f(x, w):
        y = jnp.tanh((x @ w).T)
        return y * lax.broadcasted_iota(jnp.float32, y.shape, 1)

    args = _rand((8, 16), (16, 32))
    opt, out, _ = _run(f, *args)
    check_close(out, jax.jit(f)(*args))
    check_no_elementwise_gather(opt, *args)
    analysis, _ = opt.last
    rejected = [m for m in analysis.matches.values() if isinstance(m, Reject) and m.kind == "pointwise"]
    assert rejected and "iota" in rejected[0].reason


def test_small_iota_table_is_loaded_by_the_pointwise_kernel():
    """A position table (iota of one axis, broadcast) is computed in XLA and read by the kernel."""
    def f(x, w):
        y = (x @ w).reshape(8, 4, 8).transpose(1, 0, 2)
        return jnp.sin(y) + jnp.arange(8, dtype=jnp.float32)

    args = _rand((8, 16), (16, 32))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args))
    analysis, lowered = opt.last
    assert any(isinstance(m, Match) and m.kind == "pointwise" for m in analysis.matches.values())
    check_no_elementwise_gather(opt, *args)


def test_prefill_attention_runs_the_prefill_kernel_without_gathers():
    """Sequence > 1: the attention template serves it with the prefill kernel (head transposes
    read/written through maps); no gathers."""
    def f(x, wq, wk, wv):
        b, s, d = x.shape
        q = (x @ wq).reshape(b, s, 2, 8).transpose(0, 2, 1, 3)
        k = (x @ wk).reshape(b, s, 2, 8).transpose(0, 2, 1, 3)
        v = (x @ wv).reshape(b, s, 2, 8).transpose(0, 2, 1, 3)
        sc = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(8.0)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, -jnp.inf)
        o = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(sc, axis=-1), v)
        return o.transpose(0, 2, 1, 3).reshape(b, s, d)

    args = _rand((2, 8, 16), (16, 16), (16, 16), (16, 16))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args), rtol=1e-4)
    check_no_elementwise_gather(opt, *args)
    report = opt.explain(*args)
    verdicts = {k: why for _, k, why in report.templates}
    assert verdicts.get("attention") == "kernel", verdicts
    assert any(k.startswith("attention") for k in opt.last[1].kernels), opt.last[1].kernels


@pytest.mark.parametrize("norm", ["rms", "layer", "softmax"])
def test_reduction_template_reads_and_writes_through_maps(norm):
    """Norms no longer pin their neighbours: a transposed/reshaped input is read through the map."""
    def f(x, w, g):
        h = (x @ w).reshape(4, 2, 16).transpose(1, 0, 2)          # (2, 4, 16), a view
        if norm == "rms":
            y = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * g
        elif norm == "layer":
            mu = jnp.mean(h, axis=-1, keepdims=True)
            y = (h - mu) * lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + 1e-5) * g
        else:
            y = jax.nn.softmax(h, axis=-1) * g
        return y.transpose(1, 0, 2).reshape(4, 32) @ w.T

    args = _rand((4, 8), (8, 32), (16,))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args), rtol=1e-4)
    _, lowered = opt.last
    assert any(k.startswith("reduction") for k in lowered.kernels), lowered.kernels
    check_no_elementwise_gather(opt, *args)


def test_kernel_build_failure_falls_back_per_cluster(monkeypatch):
    """A template that raises while its kernel is built: that cluster runs in XLA, re-planned
    (its tensors physical), one warning naming it; strict raises VTCError."""
    def f(x, w):
        return jnp.tanh((x @ w).T) + 1.0

    real = dict(templates.TEMPLATES)
    pw = real[vtc_jax.primitives.Kind.POINTWISE]

    def broken_build(graph, c, detail, backend):
        def step(run):
            raise NotImplementedError("synthetic kernel failure")
        return step

    monkeypatch.setitem(templates.TEMPLATES, vtc_jax.primitives.Kind.POINTWISE,
                        templates.Template(pw.kind, pw.library, pw.match, broken_build))
    args = _rand((8, 16), (16, 32))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args))
    assert any("synthetic kernel failure" in m and "pointwise cluster" in m for m in msgs), msgs
    check_no_elementwise_gather(opt, *args)
    with pytest.raises(vtc_jax.VTCError, match="synthetic kernel failure"):
        vtc_jax.optimize(f, backend="interpret", guard=None, strict=True)(*args)


def test_complex_rope_between_projections_stays_xla_for_that_part():
    """Failure class 1: complex arithmetic between two projections. A complex multiply is traced
    as real pairs (canonical.split_complex); a complex division is not, and no template takes
    complex numbers (decided in analysis): that part runs in XLA, the rest still optimises; same
    numbers as jax.jit."""
    def f(x, w1, w2, ang):
        h = (x @ w1).reshape(4, 8, 2)
        c = lax.complex(h[..., 0], h[..., 1]) / (2.0 + jnp.exp(1j * ang))
        r = jnp.stack([c.real, c.imag], axis=-1).reshape(4, 16)
        return r @ w2

    x, w1, w2 = _rand((4, 8), (8, 16), (16, 8))
    ang = jnp.linspace(0, 1, 8, dtype=jnp.float32)
    opt, out, msgs = _run(f, x, w1, w2, ang)
    check_close(out, jax.jit(f)(x, w1, w2, ang), rtol=1e-5)
    analysis, _ = opt.last
    assert any(isinstance(m, Reject) and "complex" in m.reason for m in analysis.matches.values())
    report = vtc_jax.explain(f)(x, w1, w2, ang)
    assert any("complex" in why for _, _, why in report.templates)


def test_bf16_gelu_epilogue_with_scalar_constants():
    """Failure class 2: a bf16 matmul whose epilogue is tanh-GELU (bf16 literals)."""
    def f(x, w):
        return jax.nn.gelu(x @ w[0], approximate=True) * (x @ w[1])

    x, w = _rand((8, 32), (2, 32, 64), dtype=jnp.bfloat16)
    opt, out, msgs = _run(f, x, w)
    check_close(out, jax.jit(f)(x, w), rtol=2e-2)
    _, lowered = opt.last
    assert not any("failed to build" in m for m in msgs), msgs


def test_closed_over_array_constant_is_a_kernel_operand():
    """A numpy array closed over by the function is loaded block by block, not bound whole."""
    table = np.linspace(-1, 1, 32, dtype=np.float32)

    def f(x, w):
        return jnp.tanh((x @ w).T) * table[:, None]

    args = _rand((8, 16), (16, 32))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args))


def test_matches_are_computed_once_and_pin_what_they_reject():
    def f(x, w):
        y = jnp.tanh((x @ w).T)
        return y * lax.broadcasted_iota(jnp.float32, y.shape, 1)

    a = analyze(f, _rand((8, 16), (16, 32)), {})
    for cid, m in a.matches.items():
        c = a.clusters[cid]
        if isinstance(m, Reject):
            assert all(t in a.vtog.physical for t in (*c.inputs, *c.outputs))
            assert not any(a.strategy.is_virtual(t) for t in (*c.inputs, *c.outputs))


@pytest.mark.parametrize("axes", [None, (1, 2), (0,), (0, 2)])
def test_reduction_over_adjacent_axes(axes):
    """Sums over several axes (a loss, a global average pool) run in the row kernel, reading a
    transposed view; non-adjacent axes through one more transpose (the reduced axes last)."""
    def f(x, w):
        h = (x @ w).reshape(4, 4, 8).transpose(1, 0, 2)
        return jnp.sum(jnp.tanh(h), axis=axes), jnp.mean(h * h, axis=axes, keepdims=True)

    args = _rand((4, 8), (8, 32))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args), rtol=1e-5)
    _, lowered = opt.last
    assert any(k.startswith("reduction") for k in lowered.kernels), lowered.kernels


def test_widening_cast_before_a_dot_is_the_matmul_prologue():
    """``v.astype(f32) @ kᵀ.astype(f32)`` on bf16 values (EfficientViT-style linear attention as
    equinox models write it): the casts are the matmul's prologue, so the pad of v and the
    transpose of k are read through maps instead of XLA writing f32 copies. Equal to jax.jit; the
    kernel cross-lowers."""
    from vtc_jax.testing import cross_lower

    def f(v, k, q):
        v = jnp.pad(v, ((0, 0), (0, 1), (0, 0)), constant_values=1.0)
        vk = v.astype(jnp.float32) @ jnp.swapaxes(k, -1, -2).astype(jnp.float32)
        out = vk @ jax.nn.relu(q).astype(jnp.float32)
        return (out[:, :-1] / (out[:, -1:] + 1e-15)).astype(v.dtype)

    rng = np.random.default_rng(7)
    args = tuple(jnp.asarray(rng.standard_normal((4, 16, 50)), jnp.bfloat16) for _ in range(3))
    rep = vtc_jax.explain(f)(*args)
    assert all(m.eliminated for m in rep.movement if m.primitive in ("pad", "transpose")), rep.movement
    a = vtc_jax.analysis.analyze(f, args, {})
    g = a.graph
    casts = [o.id for o in g.ops if o.primitive == "convert_element_type"
             and g.tensors[o.outputs[0]].dtype == jnp.float32 and len(g.tensors[o.outputs[0]].shape) == 3]
    of = {o: c for c in a.clusters for o in c.ops}
    assert casts and all(of[o].kind == "matmul" for o in casts), [(o, of[o].kind) for o in casts]
    with warnings.catch_warnings():   # both operands' prologues checked for 0 -> 0 under jit's trace
        warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
        out, ref = vtc_jax.optimize(f, backend="interpret", guard=None)(*args), jax.jit(f)(*args)
        mod = cross_lower(vtc_jax.optimize(f, backend="triton", guard=None), *args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)
    assert any(k.name.startswith("vtc_matmul") for k in mod.triton_kernels)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8])
def test_integer_dots_are_declined_by_the_matcher_not_at_build(dtype):
    """An integer matmul is the matcher's decline (explain() says so before anything is built),
    not a kernel that fails to build; the program stays equal to jax.jit."""
    f = lambda a, b: (a.T @ b) + 1   # noqa: E731
    a = jnp.arange(32 * 16, dtype=jnp.int32).reshape(32, 16).astype(dtype) % 7
    b = jnp.arange(32 * 8, dtype=jnp.int32).reshape(32, 8).astype(dtype) % 5
    (verdict,) = [why for _, kind, why in vtc_jax.explain(f)(a, b).templates if kind == "matmul"]
    assert "floating operands only" in verdict and "failed to build" not in verdict
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        np.testing.assert_array_equal(vtc_jax.optimize(f, backend="interpret", guard=None)(a, b), jax.jit(f)(a, b))


@pytest.mark.parametrize("groups", [1, 4])
def test_group_norm_statistics_over_non_adjacent_axes(groups):
    """GroupNorm's statistics as hand-written ports compute them: (N, H, W, C) -> (N, H, W, G,
    C/G), mean and variance over (H, W, C/G) — not adjacent — with keepdims, normalised in that
    view (the affine part per group): the row kernel reads and writes S through a transpose that
    puts the reduced axes last (no copy), equal to jit. (Normalising after reshaping back to
    (N, H, W, C) — flax's ``nn.GroupNorm``, a per-channel scale — is the next test's.)"""
    def f(x, w, scale, bias):
        h = jnp.tanh(x @ w).reshape(2, 4, 4, groups, 16 // groups)
        mu = jnp.mean(h, axis=(1, 2, 4), keepdims=True)
        var = jnp.mean(jnp.square(h - mu), axis=(1, 2, 4), keepdims=True)
        y = (h - mu) * lax.rsqrt(var + 1e-5) * scale[:groups, None] + bias[:groups, None]
        return y.reshape(32, 16) @ w.T

    args = _rand((32, 8), (8, 16), (16,), (16,))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args), rtol=1e-5)
    assert any(k.startswith("reduction") for k in opt.last[1].kernels), opt.last[1].kernels


def _group_norm(spelling, groups):
    """A GroupNorm over 16 channels as codebases write it: flax's ``nn.GroupNorm`` (channels last:
    statistics of ``(N, H, W, G, C/G)`` broadcast to ``(N, G, C/G)``, reshaped to ``(N, C)`` and
    ``(N, 1, 1, C)``, applied to ``(N, H, W, C)`` with a per-channel scale and bias); a PyTorch
    port on NCHW (``(N, G, C/G·H·W)`` statistics, the affine part ``weight[None, :, None, None]``
    on ``(N, C, H, W)``); equinox's ``GroupNorm`` vmapped over channel-first samples."""
    if spelling == "flax":
        import flax.linen as nn
        gn = nn.GroupNorm(num_groups=groups)
        params = gn.init(jax.random.PRNGKey(1), jnp.ones((2, 4, 4, 16)))
        return lambda x: gn.apply(params, x), (2, 4, 4, 16)
    if spelling == "equinox":
        import equinox as eqx
        gn = eqx.nn.GroupNorm(groups, 16)
        return lambda x: jax.vmap(gn)(x), (2, 16, 4, 4)
    w, b = jnp.linspace(0.5, 1.5, 16), jnp.linspace(-1.0, 1.0, 16)

    def torch_port(x):   # x (N, C, H, W)
        n = x.shape[0]
        h = x.reshape(n, groups, -1)
        mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        h = ((h - mu) / jnp.sqrt(var + 1e-5)).reshape(x.shape)
        return h * w[None, :, None, None] + b[None, :, None, None]
    return torch_port, (2, 16, 4, 4)


@pytest.mark.parametrize("groups", [1, 4, 16])
@pytest.mark.parametrize("spelling", ["flax", "torch_port", "equinox"])
def test_group_norm_statistics_applied_in_another_layout(spelling, groups):
    """GroupNorm whose statistics are applied to the unsplit ``(N, H, W, C)`` (or ``(N, C, H,
    W)``): each tensor of that layout is read as S's by splitting its axes (``_refine``), and the
    statistics' broadcasts and reshapes into it are checked row by row (``_statistic_rows``), so
    the whole norm, its affine part and the SiLU after it are row-reduction kernels, no fallback,
    equal to jit (one group: LayerNorm over all; 16: InstanceNorm). flax's two statistics, ``E[x]``
    and ``E[x²]`` of the same rows, are one cluster: one kernel reading the rows once for both."""
    norm, shape = _group_norm(spelling, groups)

    def f(x, w):
        return jax.nn.silu(norm(jnp.tanh(x @ w).reshape(shape)))
    args = _rand((32, 8), (8, 16))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args), rtol=1e-5)
    assert not msgs, msgs
    assert any(k.startswith("reduction") for k in opt.last[1].kernels), opt.last[1].kernels
    if spelling == "flax":   # E[x] and E[x²] one pass over the rows: one kernel (cluster._sibling_statistic)
        (x4,) = _rand(shape, seed=1)
        opt4, out4, msgs4 = _run(norm, x4)
        check_close(out4, jax.jit(norm)(x4), rtol=1e-5)
        assert sum(k.startswith("reduction") for k in opt4.last[1].kernels) == 1, opt4.last[1].kernels
    if spelling == "flax" and groups == 4:
        mod = cross_lower(vtc_jax.optimize(f, backend="triton", guard=None), *args)
        assert any(k.name.startswith("reduction") for k in mod.triton_kernels), mod.triton_kernels


def test_group_statistics_laid_out_across_the_wrong_channels_are_declined():
    """Statistics of ``(N, G)`` broadcast to ``(N, C/G, G)`` before the reshape to ``(N, C)`` land
    on channel ``j·G + g``, not on their group's ``g·C/G + j``: not a row's statistic (the check
    carries row indices through the views), so the template declines, named, and the program
    stays equal to jit."""
    def f(x):
        h = x.reshape(2, 4, 4, 4, 4)
        mu = h.mean(axis=(1, 2, 4))                                   # (N, G)
        wrong = jnp.broadcast_to(mu[:, None, :], (2, 4, 4)).reshape(2, 16)
        return x - wrong[:, None, None, :]
    (x,) = _rand((2, 4, 4, 16))
    reasons = [why for _, kind, why in vtc_jax.explain(f)(x).templates if kind == "reduction"]
    assert any("other than along their rows" in r for r in reasons), reasons
    opt, out, msgs = _run(f, x)
    check_close(out, jax.jit(f)(x), rtol=1e-6)


@pytest.mark.parametrize("spelling", ["jnp.var", "jnp.std", "equinox"])
def test_layer_norm_by_jnp_var_is_one_row_reduction_kernel(spelling):
    """``jnp.var`` (equinox's ``LayerNorm``, hand-written norms, ``jnp.std``) computes its divisor
    ``n - ddof`` and a ``divisor > 0`` guard from ``ddof`` passed into its own ``jit``: folded as
    constants while tracing (``graph``), the norm is the row-reduction template's — no fallback,
    equal to jit."""
    def norm(x):
        if spelling == "equinox":
            import equinox as eqx
            return jax.vmap(eqx.nn.LayerNorm(64))(x)
        mu = x.mean(-1, keepdims=True)
        sd = jnp.sqrt(x.var(-1, keepdims=True) + 1e-5) if spelling == "jnp.var" else x.std(-1, keepdims=True) + 1e-5
        return (x - mu) / sd

    def f(x, w):
        return (norm(x) @ w).T.reshape(16, 32)
    args = _rand((8, 64), (64, 64))
    opt, out, msgs = _run(f, *args)
    check_close(out, jax.jit(f)(*args), rtol=1e-5)
    assert not msgs, msgs
    assert any(k.startswith("reduction") for k in opt.last[1].kernels), opt.last[1].kernels


@pytest.mark.parametrize("form", ["sum_of_scaled", "rms_norm_of_scaled"])
def test_a_runtime_scalar_in_a_reduction_is_a_row_broadcast(form):
    """A runtime scalar input (a dequantisation scale ``s`` of shape ``()``) read by a row reduction:
    one value broadcast to every row, loaded through a broadcast layout (it was declined as
    "neither a row nor a statistic"); equal to jit, and cross-lowered for CUDA."""
    from vtc_jax.testing import cross_lower

    def f(x, s, w):
        if form == "sum_of_scaled":
            return jnp.sum(x.reshape(2, 16, 4, 32).transpose(0, 2, 1, 3).astype(jnp.float32) * s, axis=-1)
        h = x.astype(jnp.float32) * s
        return (h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)).astype(x.dtype) * w
    r = np.random.default_rng(4)
    args = (jnp.asarray(r.standard_normal((2, 16, 128)), jnp.bfloat16), jnp.float32(0.37), jnp.ones(128, jnp.bfloat16))
    opt = vtc_jax.optimize(f, backend="interpret", guard=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always", vtc_jax.VTCFallbackWarning)
        out = opt(*args)
    assert not [w for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]
    assert [r for _, kind, r in vtc_jax.explain(f)(*args).templates if kind == "reduction"] == ["kernel"]
    ref = jax.jit(f)(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=1e-5,
                               atol=1e-5 if form == "sum_of_scaled" else 1e-2)
    mod = cross_lower(vtc_jax.optimize(f, backend="triton", guard=None), *args)
    assert [k.name for k in mod.triton_kernels] == ["reduction"]
