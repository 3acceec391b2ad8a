"""Never a wrong number, never an internal error: regression tests for the failure classes of
third-party code (complex RoPE and bf16 epilogues are in test_templates.py, PRNG keys in
test_optimize_keys.py, gradients in test_autodiff.py).

Every comparison is against ``jax.jit(fn)``: f32 within 1e-5 of the reference's largest magnitude,
bf16 within 2e-2.
"""
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vtc_jax
from vtc_jax.testing import cross_lower

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _rand(*shapes, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes))


def check_close(out, ref, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape
        finite = np.isfinite(b)
        assert (np.isfinite(a) == finite).all()
        assert np.max(np.abs(a - b)[finite], initial=0.0) <= rtol * max(np.max(np.abs(b[finite]), initial=0), 1.0)


def _optimize(f, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        opt = vtc_jax.optimize(f, backend="interpret", **kw)
        return opt, opt(*args)


# ---- failure class 5: ordinary attention code died with a bare KeyError --------------------

B, T, H, KV, D = 2, 16, 4, 2, 8


def _decode(mask_value):
    def step(x, wq, wk, wv, k_cache, v_cache, pos):
        q = (x @ wq).reshape(B, H, D)
        k = (x @ wk).reshape(B, 1, KV, D)
        v = (x @ wv).reshape(B, 1, KV, D)
        k_cache = lax.dynamic_update_slice(k_cache, k, (0, pos, 0, 0))
        v_cache = lax.dynamic_update_slice(v_cache, v, (0, pos, 0, 0))
        kk = jnp.repeat(k_cache, H // KV, axis=2)          # GQA by repeat
        vv = jnp.repeat(v_cache, H // KV, axis=2)
        s = jnp.einsum("bhd,bthd->bht", q, kk) / jnp.sqrt(D)
        s = jnp.where(jnp.arange(T)[None, None, :] <= pos, s, mask_value(s.dtype))
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bht,bthd->bhd", p, vv).reshape(B, H * D), k_cache, v_cache
    return step


@pytest.mark.parametrize("mask", ["-inf", "finfo.min", "-1e30"])
def test_decode_attention_in_another_dialect(mask):
    mask_value = {"-inf": lambda dt: -jnp.inf, "finfo.min": lambda dt: jnp.finfo(dt).min,
                  "-1e30": lambda dt: -1e30}[mask]
    step = _decode(mask_value)
    x, wq, wk, wv, kc, vc = _rand((B, 16), (16, H * D), (16, KV * D), (16, KV * D), (B, T, KV, D), (B, T, KV, D))
    pos = jnp.int32(5)
    ref = jax.jit(step)(x, wq, wk, wv, kc, vc, pos)
    _, out = _optimize(step, x, wq, wk, wv, kc, vc, pos)
    check_close(out, ref)


def test_decode_attention_with_donated_caches():
    step = _decode(lambda dt: -jnp.inf)
    x, wq, wk, wv, kc, vc = _rand((B, 16), (16, H * D), (16, KV * D), (16, KV * D), (B, T, KV, D), (B, T, KV, D))
    pos = jnp.int32(7)
    ref = jax.jit(step)(x, wq, wk, wv, kc, vc, pos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        opt = vtc_jax.optimize(step, backend="interpret", donate_argnums=(4, 5))
        out = opt(x, wq, wk, wv, jnp.array(kc), jnp.array(vc), pos)
    check_close(out, ref)


def test_prefill_attention_with_tril_mask():
    def f(x, wq, wk, wv):
        b, s, d = x.shape
        q = (x @ wq).reshape(b, s, 2, 8).transpose(0, 2, 1, 3)
        k = (x @ wk).reshape(b, s, 2, 8).transpose(0, 2, 1, 3)
        v = (x @ wv).reshape(b, s, 2, 8).transpose(0, 2, 1, 3)
        sc = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(8.0)
        sc = jnp.where(jnp.tril(jnp.ones((s, s), bool)), sc, jnp.finfo(sc.dtype).min)
        o = jax.nn.softmax(sc, axis=-1) @ v
        return o.transpose(0, 2, 1, 3).reshape(b, s, d)

    args = _rand((2, 8, 16), (16, 16), (16, 16), (16, 16))
    _, out = _optimize(f, *args)
    check_close(out, jax.jit(f)(*args), rtol=1e-4)


def test_explain_never_raises_an_internal_error(monkeypatch):
    """explain raises the user's own error, or VTCError — never an internal one."""
    import vtc_jax.analysis as analysis

    def boom(*a, **k):
        raise KeyError("internal")

    monkeypatch.setattr(analysis, "plan", boom)
    f = lambda x: jnp.transpose(x) + 1  # noqa: E731
    with pytest.raises(vtc_jax.VTCError, match="internal"):
        vtc_jax.explain(f)(jnp.ones((2, 3)))
    with pytest.raises(TypeError):          # the user's own error stays jax's
        vtc_jax.explain(lambda x, y: jnp.dot(x, y))(jnp.ones((2, 3)), jnp.ones((4, 5)))


# ---- failure class 7: the XLA boundary by gathers/scatters --------------------------------

def test_shufflenet_boundary_has_no_gather_or_scatter():
    """Under jit: 2 slices + 1 concat. Under VTC they used to become 2 gathers + 1 scatter."""
    import shufflenet_unit as S
    args = S.example_args("small")
    _, out = _optimize(S.step, *args)
    check_close(out, jax.jit(S.step)(*args), rtol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        text = cross_lower(vtc_jax.optimize(S.step, backend="triton"), *args).text
    base = cross_lower(jax.jit(S.step), *args).text
    for op in ("stablehlo.gather", "stablehlo.scatter"):
        assert text.count(op) <= base.count(op), op


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_outputs_of_one_kernel_written_into_one_concat(dtype):
    """One pointwise kernel produces both pieces of a concatenation (fuzz repro 5): the two
    outputs share the concat's buffer, so both pieces land in it (they used to come back as two
    buffers, one holding only its own piece: NaN in the other)."""
    def fn(k, a):
        c = a.astype(dtype)
        return jnp.concatenate([k[:, :2] * c, k[:, 2:] * c], axis=-1)

    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((1, 4)), dtype)
    a = rng.standard_normal((1, 1)).astype(np.float32)
    _, out = _optimize(fn, k, a)
    check_close(out, jax.jit(fn)(k, a), rtol=1e-5 if dtype == jnp.float32 else 2e-2)


# --------------------------------------------------------------------------------------------
# Attention at any runtime position: a row with no valid key (pos < 0) and windows past the end
# --------------------------------------------------------------------------------------------

_T, _D = 16, 16


def _decode_attn(fill, additive=False, window=None, clip=False, bias=None):
    def fn(pos, q, k, v):
        s = jnp.einsum('hd,htd->ht', q, k) / jnp.sqrt(jnp.float32(_D))
        t = jnp.arange(_T)
        m = t <= (jnp.clip(pos, 0, _T - 1) if clip else pos)
        if bias is not None:     # the window as an additive bias on top of a causal select
            s = jnp.where(m, s, fill) + jnp.where(t > pos - window, 0.0, bias)
            return jnp.einsum('ht,htd->hd', jax.nn.softmax(s, axis=-1), v)
        if window is not None:
            m = m & (t > pos - window)
        s = s + jnp.where(m, 0.0, fill) if additive else jnp.where(m, s, fill)
        return jnp.einsum('ht,htd->hd', jax.nn.softmax(s, axis=-1), v)
    return fn


def _prefill_attn(fill, additive=False):
    def fn(pos, q, k, v):   # 4 query rows at positions pos .. pos + 3 (a chunk of a prefill)
        s = jnp.einsum('hsd,htd->hst', q, k) * (_D ** -0.5)
        m = jnp.arange(_T)[None, :] <= jnp.arange(q.shape[1])[:, None] + pos
        s = s + jnp.where(m, 0.0, fill) if additive else jnp.where(m, s, fill)
        return jnp.einsum('hst,htd->hsd', jax.nn.softmax(s, axis=-1), v)
    return fn


_FMIN = float(jnp.finfo(jnp.float32).min)
_ANY_POS_CASES = {
    "decode finfo.min": (_decode_attn(_FMIN), False),
    "decode -1e9 select": (_decode_attn(-1e9), False),
    "decode additive -1e30": (_decode_attn(-1e30, True), False),
    "decode additive finfo.min": (_decode_attn(_FMIN, True), False),
    "decode window -inf": (_decode_attn(-jnp.inf, window=3), False),
    "decode window finfo.min": (_decode_attn(_FMIN, window=3), False),
    # Gemma-2 at paper size: window == cache length, so the window only bites at pos >= T
    "decode window = T": (_decode_attn(-jnp.inf, window=_T), False),
    "prefill finfo.min": (_prefill_attn(_FMIN), False),
    "prefill additive -1e30": (_prefill_attn(-1e30, True), False),
    # jax's row at pos < 0 depends on the rounding of s - 1e9: the kernels round the same way
    "decode additive -1e9": (_decode_attn(-1e9, True), False),
    # a select and a bias: an empty row's lanes hold finfo.min or finfo.min - 1e30 by lane: declined
    "decode select and bias": (_decode_attn(_FMIN, window=3, bias=-1e30), True),
    # the mask leaves the causal family for pos outside [0, T): declined, not extrapolated
    "decode clipped pos": (_decode_attn(-jnp.inf, clip=True), True),
}


@pytest.mark.parametrize("case", list(_ANY_POS_CASES))
def test_attention_equals_jit_at_any_position(case):
    """Positions outside the cache: pos < 0 leaves a row with no valid key (jax: NaN for a -inf
    mask, the mean of V for a finite one; the kernels used to give 0), and a sliding window at
    pos >= T starts at pos - window, not at T - window (the decode kernel counted from the clamped
    end). Attention the kernels cannot match falls back with a reason."""
    fn, declined = _ANY_POS_CASES[case]
    prefill = case.startswith("prefill")
    q, k, v = _rand((2, 4, _D) if prefill else (2, _D), (2, _T, _D), (2, _T, _D))
    opt = vtc_jax.optimize(fn, backend="interpret", guard=None)   # the kernels, whatever they win
    for pos in (-3, -1, 0, 5, _T - 1, _T, _T + 4, 3 * _T):
        ref = jax.jit(fn)(np.int32(pos), q, k, v)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
            out = opt(np.int32(pos), q, k, v)
        check_close(out, ref)
    _, lowered = opt.last
    served = any(name.startswith("attention") for name in lowered.kernels)
    assert served != declined, (lowered.kernels, opt.explain(np.int32(0), q, k, v).templates)
    if not declined:    # the empty-row pass lowers for CUDA too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
            mod = cross_lower(vtc_jax.optimize(fn, backend="triton", guard=None), np.int32(0), q, k, v)
        names = [kern.name for kern in mod.triton_kernels]
        assert any("attention" in n for n in names), names


def _rope_cache_step(x, w, wq, cache, pos, ang):
    """Gemma-style: the new K row is split -> rotated by per-batch angles -> concatenated and
    written into the cache at a runtime ``pos``; attention then reads the cache."""
    k = x @ w                                               # (B, D)
    k1, k2 = jnp.split(k, 2, axis=-1)
    c, s = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
    row = jnp.concatenate([k1 * c - k2 * s, k2 * c + k1 * s], axis=-1)
    cache = lax.dynamic_update_slice(cache, row[:, None, :], (0, pos, 0))
    sc = jnp.einsum("bd,btd->bt", x @ wq, cache) / jnp.sqrt(jnp.float32(cache.shape[-1]))
    sc = jnp.where(jnp.arange(cache.shape[1]) <= pos, sc, -jnp.inf)
    return jnp.einsum("bt,btd->bd", jax.nn.softmax(sc, axis=-1), cache), cache


@pytest.mark.parametrize("donate", [False, True])
def test_donated_cache_written_from_a_split_rotate_concat(donate):
    """Failure class 4: with the cache donated, the strategy turned the concat into write-side
    edges and the first piece was never written into the donated cache (the slot kept its old
    values and attention read them). Optimised with and without donation vs jax.jit with it."""
    bsz, dim, t = 2, 16, 8
    x, w, wq, cache = _rand((bsz, dim), (dim, dim), (dim, dim), (bsz, t, dim), seed=3)
    ang = jnp.array([0.3, -1.1], jnp.float32)
    pos = jnp.int32(5)
    ref = jax.jit(_rope_cache_step, donate_argnums=(3,) if donate else ())(x, w, wq, jnp.array(cache), pos, ang)
    opt = vtc_jax.optimize(_rope_cache_step, backend="interpret", donate_argnums=(3,) if donate else ())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        out = opt(x, w, wq, jnp.array(cache), pos, ang)
    check_close(out, ref)


# ---- a cache forked by two in-place updates (speculative decoding, beams) ---------------------

def _fork_rows(c, x):
    return c.at[1].set(x), c.at[2].set(2.0 * x)


def _fork_positions(q, kc, vc, k_a, v_a, k_b, v_b, pos):
    """Attention over the cache, then the cache forked for two draft tokens at pos and pos + 1."""
    s = jnp.einsum("bnh,btnh->bnt", q, kc) * q.shape[-1] ** -0.5
    s = jnp.where(jnp.arange(kc.shape[1]) < pos, s, -jnp.inf)
    o = jnp.einsum("bnt,btnh->bnh", jax.nn.softmax(s, -1), vc)
    return o, (kc.at[:, pos].set(k_a), vc.at[:, pos].set(v_a)), (kc.at[:, pos + 1].set(k_b), vc.at[:, pos + 1].set(v_b))


@pytest.mark.parametrize("guard", [None, "model"], ids=["unguarded", "guarded"])
@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_cache_forked_by_two_updates(guard, donate):
    """Two updates of one cache returned as two outputs: the second update was made in place, its
    row written into the cache's buffer by the kernel computing both rows, which ran before
    XLA's copy of the cache for the first update — the first output then held both rows
    (``vtog._inplace_problem`` counts the readers of the old cache from the earliest writer)."""
    c = jnp.arange(32.0).reshape(4, 8)
    x = jnp.ones((8,))
    ref = jax.jit(_fork_rows)(c, x)
    _, out = _optimize(_fork_rows, jnp.array(c), x, guard=guard, donate_argnums=(0,) if donate else ())
    check_close(out, ref)
    args = _rand((2, 4, 8), (2, 16, 4, 8), (2, 16, 4, 8), *[(2, 4, 8)] * 4, seed=5) + (jnp.int32(9),)
    ref = jax.jit(_fork_positions)(*args)
    _, out = _optimize(_fork_positions, *args, guard=guard,
                       donate_argnums=(1, 2) if donate else ())
    check_close(out, ref)


# ---- f16 scores past f16's range ---------------------------------------------------------------

def _f16_prefill(q, k, v, m):
    s = jnp.einsum("bnqh,bnkh->bnqk", q * 100, k * 100) * q.shape[-1] ** -0.5
    return jnp.einsum("bnqk,bnkh->bnqh", jax.nn.softmax(jnp.where(m, s, jnp.finfo(s.dtype).min), -1), v)


def _f16_decode(q, k, v, m):
    s = jnp.einsum("bnh,bnkh->bnk", q[:, :, 0] * 100, k * 100)
    return jnp.einsum("bnk,bnkh->bnh", jax.nn.softmax(jnp.where(jnp.arange(k.shape[2]) <= 9, s, -jnp.inf), -1), v)


@pytest.mark.parametrize("fn", [_f16_prefill, _f16_decode], ids=["prefill_runtime_mask", "decode_positions"])
def test_f16_scores_past_the_f16_range_are_inf_as_in_the_program(fn):
    """f16 q·k past 65504 is inf in the program (the dot's f16 result), its row NaN after the
    softmax; the kernels kept scores in f32 and gave finite rows there. They now round their
    scores to f16 after the dot and the scaling (``flash.Flash.rounded``): NaN where jit's is, the
    same numbers elsewhere."""
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((2, 4, 16, 8)), jnp.float16) for _ in range(3))
    m = jnp.asarray(r.random((2, 1, 16, 16)) > 0.3)
    ref = np.asarray(jax.jit(fn)(q, k, v, m), np.float32)
    assert np.isnan(ref).any() and np.isfinite(ref).any()   # the case is the overflow
    opt, out = _optimize(fn, q, k, v, m, guard=None)
    assert [r_ for _, kind, r_ in opt.explain(q, k, v, m).templates if kind == "attention"] == ["kernel"]
    out = np.asarray(out, np.float32)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    fin = np.isfinite(ref)
    assert np.abs(out - ref)[fin].max() <= 2e-2 * max(1.0, np.abs(ref[fin]).max())
    with warnings.catch_warnings():   # and the rounding lowers for CUDA inside the Triton kernels
        warnings.simplefilter("ignore", vtc_jax.VTCFallbackWarning)
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, m)]
        assert cross_lower(vtc_jax.optimize(fn, backend="triton", guard=None), *abstract).triton_kernels
