"""A gated MLP's GEMM with its ``act(gate) * up`` as the epilogue: one kernel dotting each A tile
with both halves of the weight (``cluster.gated_epilogues``, ``ContractionMatch.parts``,
``kernels.matmul``'s ``rhs_parts``), where XLA runs a GEMM writing both halves and a loop fusion
reading them back. Every result is compared with ``jax.jit`` (f32 at 1e-5 of the largest value,
bf16 at 2e-2) or with numpy."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vtc_jax
from vtc_jax.kernels.matmul import matmul
from vtc_jax.kernels.vio import VTensor
from vtc_jax.testing import cross_lower
from tests.optimized import TOL, assert_close, eqns, optimize_kernels


def _shapes_made(fn, args):
    """(primitive, output shape) of every equation of the emitted program."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [(e.primitive.name, tuple(v.aval.shape)) for e in eqns(jaxpr) for v in e.outvars]


# --- the styles --------------------------------------------------------------------------------

def llama_mlp(x, w_gate_up, w_down):
    """Llama / the example: one merged projection, ``jnp.split``, SiLU, f32 accumulation."""
    gu = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32)
    gate, up = jnp.split(gu, 2, axis=-1)
    return jnp.dot((jax.nn.silu(gate) * up).astype(x.dtype), w_down, preferred_element_type=jnp.float32).astype(x.dtype)


def gemma_mlp(x, w_gate_up, w_down):
    """Gemma / Phi-3 style: (B, T, D) activations by einsum, halves cut by slicing, tanh GELU."""
    f = w_gate_up.shape[-1] // 2
    gu = jnp.einsum("btd,df->btf", x, w_gate_up)
    return jnp.einsum("btf,fd->btd", jax.nn.gelu(gu[..., :f], approximate=True) * gu[..., f:], w_down)


def _args(style, dtype, d=64, f=128):
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    lead = (4,) if style is llama_mlp else (2, 3)
    return (jax.random.normal(ks[0], (*lead, d), dtype), (0.2 * jax.random.normal(ks[1], (d, 2 * f))).astype(dtype),
            (0.2 * jax.random.normal(ks[2], (f, d))).astype(dtype))


@pytest.mark.parametrize("style", [llama_mlp, gemma_mlp])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_gate_and_up_product_is_never_written(style, dtype):
    """The GEMM and ``act(gate) * up`` are one kernel writing (…, F): no equation makes the
    (…, 2F) product, and the result equals jit's."""
    args = _args(style, dtype)
    fn = optimize_kernels(style)
    assert_close(fn(*args), jax.jit(style)(*args), TOL[dtype])
    made = _shapes_made(fn, args)
    assert not [m for m in made if m[1][-1:] == (256,)], made
    assert ("pallas_call", (*args[0].shape[:-1], 128)) in made, made


def test_the_gated_kernel_under_vmap_and_grad():
    args = _args(llama_mlp, jnp.float32)
    fn = optimize_kernels(llama_mlp)
    batched = tuple(jnp.stack([a, 0.5 * a]) for a in args)
    assert_close(jax.vmap(fn)(*batched), jax.vmap(jax.jit(llama_mlp))(*batched), TOL[jnp.float32])

    def loss(f):
        return lambda x, w, wd: jnp.sum(f(x, w, wd) ** 2)
    for g, r in zip(jax.grad(loss(fn), argnums=(0, 1))(*args), jax.grad(loss(jax.jit(llama_mlp)), argnums=(0, 1))(*args)):
        assert_close(g, r, 1e-4)


def test_a_product_read_whole_as_well_is_left_as_it_was():
    """The merged product is also returned: no gated kernel (its halves would be computed twice),
    the results equal jit's."""
    def mlp_and_product(x, w, wd):
        gu = x @ w
        g, u = jnp.split(gu, 2, axis=-1)
        return (jax.nn.silu(g) * u) @ wd, gu
    args = _args(llama_mlp, jnp.float32)
    fn = optimize_kernels(mlp_and_product)
    for o, r in zip(fn(*args), jax.jit(mlp_and_product)(*args)):
        assert_close(o, r, TOL[jnp.float32])
    rep = vtc_jax.explain(mlp_and_product, guard=None)(*args)
    assert "fused into matmul cluster" not in str(rep), str(rep)


def test_halves_cut_along_rows_are_no_gated_epilogue():
    """A split of the product's rows is not a part of the weight: left as it was, equal to jit."""
    def rows(x, w):
        a, b = jnp.split(x @ w, 2, axis=0)
        return jax.nn.silu(a) * b
    args = _args(llama_mlp, jnp.float32)[:2]
    fn = optimize_kernels(rows)
    assert_close(fn(*args), jax.jit(rows)(*args), TOL[jnp.float32])
    assert "fused into matmul cluster" not in str(vtc_jax.explain(rows, guard=None)(*args))


@pytest.mark.parametrize("split_k", [None, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_dots_each_part_and_hands_all_to_the_epilogue(split_k, dtype):
    """``kernels.matmul`` with ``rhs_parts``, with and without split-K (each part's partial sums
    in the workspace), three parts of a weight read through slices: equals numpy."""
    ks = jax.random.split(jax.random.PRNGKey(5), 2)
    a = jax.random.normal(ks[0], (8, 256), dtype)
    w = (0.1 * jax.random.normal(ks[1], (256, 96))).astype(dtype)
    wv = VTensor.physical(w)
    parts = [wv.with_layout(wv.layout.slice((0, 32 * i), (256, 32 * i + 32))) for i in range(3)]
    out = matmul(a, parts[0], rhs_parts=parts[1:], dimension_numbers=(((1,), (0,)), ((), ())),
                 epilogue=lambda g, u, v: jax.nn.silu(g) * u + v, split_k=split_k, block_k=32,
                 preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    p = np.asarray(a, np.float64) @ np.asarray(w, np.float64)
    g, u, v = p[:, :32], p[:, 32:64], p[:, 64:]
    assert_close(out, g / (1 + np.exp(-g)) * u + v, 1e-5 if dtype == jnp.float32 else 2e-2)


def test_parts_without_an_epilogue_are_refused():
    w = VTensor.physical(jnp.ones((16, 32)))
    with pytest.raises(ValueError, match="needs an epilogue"):
        matmul(jnp.ones((16, 16)), w, rhs_parts=[w], dimension_numbers=(((1,), (0,)), ((), ())))


def test_the_gated_kernel_lowers_for_cuda_reading_its_weight_once():
    """Cross-lowered for CUDA: one Triton matmul kernel for the gated GEMM, verified IR, the
    merged weight passed once (both halves are views of it)."""
    args = _args(llama_mlp, jnp.bfloat16)
    mod = cross_lower(optimize_kernels(llama_mlp, backend="triton"), *args)
    names = [k.name for k in mod.triton_kernels]
    assert names.count("vtc_matmul") == 1, names
    jaxpr = jax.make_jaxpr(optimize_kernels(llama_mlp, backend="triton"))(*args).jaxpr
    (call,) = [e for e in eqns(jaxpr) if e.primitive.name == "pallas_call"]
    assert [tuple(v.aval.shape) for v in call.invars].count((64, 256)) == 1, call.invars


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_three_parts_and_an_epilogue_reading_the_a_operand_build(dtype):
    """Found by probing: a three-way split (its staged weight tile of 16 KB over three parts was no
    power of two) and ``x + silu(g) * u`` (the epilogue reads the A operand): the kernels build
    (fallbacks as errors) and equal jit's."""
    ks = jax.random.split(jax.random.PRNGKey(6), 2)
    x = jax.random.normal(ks[0], (16, 64), dtype)

    def three(x, W):
        a, b, c = jnp.split(x @ W, 3, -1)
        return jax.nn.silu(a) * b + c

    def reads_x(x, W):
        g, u = jnp.split(x @ W, 2, -1)
        return x + jax.nn.silu(g) * u
    for f, n in ((three, 144), (reads_x, 128)):
        W = (0.1 * jax.random.normal(ks[1], (64, n))).astype(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
            out = vtc_jax.optimize(f, guard=None)(x, W)
        assert_close(out, jax.jit(f)(x, W), TOL[dtype])


# --- two weights: silu(h @ w1) * (h @ w3) --------------------------------------------------------

def meta_mlp(x, w1, w3, w2):
    """Meta's reference Llama / Hugging Face's ``gate_proj``/``up_proj``: two weights, one A operand."""
    return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


def hf_prenorm_mlp(x, nw, w1, w3, w2):
    """A pre-norm block as Hugging Face writes it: RMSNorm in f32, (B, T, D) einsums, a residual."""
    h = x.astype(jnp.float32)
    h = (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)).astype(x.dtype) * nw
    g = jnp.einsum("btd,df->btf", h, w1)
    u = jnp.einsum("btd,df->btf", h, w3)
    return x + jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, w2)


def _two_weight_args(dtype, lead=(4,), d=64, f=128, norm=False):
    ks = jax.random.split(jax.random.PRNGKey(8), 5)
    ws = [(0.2 * jax.random.normal(k, s)).astype(dtype) for k, s in zip(ks[1:], ((d, f), (d, f), (f, d)))]
    x = jax.random.normal(ks[0], (*lead, d), dtype)
    return (x, (1 + 0.1 * jax.random.normal(ks[4], (d,))).astype(dtype), *ws) if norm else (x, *ws)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("style", [meta_mlp, hf_prenorm_mlp])
def test_two_projections_of_one_operand_are_one_gated_kernel(style, dtype):
    """``silu(h @ w1) * (h @ w3)``: one kernel dots each A tile with both weights and applies the
    product (the pre-norm folded in as well): one kernel writes the (…, F) product, nothing else
    makes an (…, F) tensor or a row sum; equal to jit's."""
    norm = style is hf_prenorm_mlp
    args = _two_weight_args(dtype, lead=(2, 3) if norm else (4,), norm=norm)
    fn = optimize_kernels(style)
    assert_close(fn(*args), jax.jit(style)(*args), TOL[dtype])
    made = _shapes_made(fn, args)
    f_shape = (*args[0].shape[:-1], 128)
    assert [m for m in made if m[1] == f_shape] == [("pallas_call", f_shape)], made
    assert not [m for m in made if m[0] == "reduce_sum"], made


def test_flax_dense_gate_and_up_layers_are_one_kernel():
    """flax linen's ``nn.Dense`` gate and up layers (no bias), as a model writes them."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            g = nn.Dense(128, use_bias=False, name="gate_proj")(x)
            u = nn.Dense(128, use_bias=False, name="up_proj")(x)
            return nn.Dense(64, use_bias=False, name="down_proj")(nn.silu(g) * u)
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 64))
    params = MLP().init(jax.random.PRNGKey(2), x)
    fn = optimize_kernels(MLP().apply)
    assert_close(fn(params, x), jax.jit(MLP().apply)(params, x), TOL[jnp.float32])
    made = _shapes_made(fn, (params, x))
    assert [m for m in made if m[1] == (4, 128)] == [("pallas_call", (4, 128))], made


def test_two_weight_kernel_under_vmap_and_grad():
    args = _two_weight_args(jnp.float32)
    fn = optimize_kernels(meta_mlp)
    batched = tuple(jnp.stack([a, 0.5 * a]) for a in args)
    assert_close(jax.vmap(fn)(*batched), jax.vmap(jax.jit(meta_mlp))(*batched), TOL[jnp.float32])

    def loss(f):
        return lambda *a: jnp.sum(f(*a) ** 2)
    for g, r in zip(jax.grad(loss(fn), argnums=(0, 1, 2))(*args),
                    jax.grad(loss(jax.jit(meta_mlp)), argnums=(0, 1, 2))(*args)):
        assert_close(g, r, 1e-4)


def test_a_projection_read_elsewhere_too_stays_its_own_kernel():
    """``h @ w3`` is also returned: no gated kernel (its product is needed whole); equal to jit."""
    def both(x, w1, w3, w2):
        u = x @ w3
        return (jax.nn.silu(x @ w1) * u) @ w2, u
    args = _two_weight_args(jnp.float32)
    fn = optimize_kernels(both)
    for o, r in zip(fn(*args), jax.jit(both)(*args)):
        assert_close(o, r, TOL[jnp.float32])
    made = _shapes_made(fn, args)
    assert len([m for m in made if m[1] == (4, 128)]) >= 3, made   # both products and the gated one


def test_different_operands_or_weight_casts_are_not_merged():
    """Two dots of different A operands, and a weight cast inside the kernel: left as separate
    kernels, equal to jit's."""
    def two_inputs(x, y, w1, w3):
        return jax.nn.silu(x @ w1) * (y @ w3)

    def cast_weight(x, w1, w3):
        return jax.nn.silu(x @ w1.astype(jnp.bfloat16)) * (x @ w3.astype(jnp.bfloat16))
    x, w1, w3, _ = _two_weight_args(jnp.float32)
    for f, args in ((two_inputs, (x, 0.5 * x, w1, w3)), (cast_weight, (x.astype(jnp.bfloat16), w1, w3))):
        fn = optimize_kernels(f)
        assert_close(fn(*args), jax.jit(f)(*args), TOL[jnp.bfloat16 if f is cast_weight else jnp.float32])
        made = _shapes_made(fn, args)
        assert len([m for m in made if m[1] == (4, 128)]) >= 2, made   # the products apart
