"""vtc_jax.cluster: kernel-shaped clusters, a partition of the graph in topological order."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vtc_jax.cluster import Cluster, cluster
from vtc_jax.primitives import MOVEMENT, is_movement_op
from vtc_jax.graph import Graph, trace

H, KV, HD, D, S = 4, 2, 8, 32, 16
f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731


def rmsnorm(x, w, eps=1e-6):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype) * w


def llama_block(x, params, cache_k, cache_v, *, pos):
    """Decode step: rmsnorm -> qkv dot -> split/reshape -> KV-cache update at pos -> GQA attention -> dot."""
    b, t, _ = x.shape
    qkv = rmsnorm(x, params["norm"]) @ params["wqkv"]
    q, k, v = jnp.split(qkv, [H * HD, (H + KV) * HD], axis=-1)
    q = q.reshape(b, t, KV, H // KV, HD)
    p = jnp.clip(pos, 0, cache_k.shape[1] - t)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.reshape(b, t, KV, HD), (0, p, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.reshape(b, t, KV, HD), (0, p, 0, 0))
    s = jnp.einsum("btkgd,bskd->bkgts", q, cache_k) / np.sqrt(HD)
    mask = jnp.arange(cache_k.shape[1])[None, :] <= (p + jnp.arange(t))[:, None]
    a = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", a, cache_v).reshape(b, t, H * HD)
    return x + o @ params["wo"], cache_k, cache_v


def llama_args(batch: int = 2):
    params = {"norm": f32(D), "wqkv": f32(D, (H + 2 * KV) * HD), "wo": f32(H * HD, D)}
    return (f32(batch, 1, D), params, f32(batch, S, KV, HD), f32(batch, S, KV, HD)), {
        "pos": jax.ShapeDtypeStruct((), jnp.int32)}


def check_partition(g: Graph, clusters: tuple[Cluster, ...]) -> None:
    """Each op in exactly one cluster; clusters topological; inputs/outputs as INTERNALS.md says."""
    owner = {o: c.id for c in clusters for o in c.ops}
    assert sorted(o for c in clusters for o in c.ops) == list(range(len(g.ops)))
    assert [c.id for c in clusters] == list(range(len(clusters)))
    available = set(g.inputs) | {t.id for t in g.tensors if t.const is not None}
    for c in clusters:
        assert list(c.ops) == sorted(c.ops)
        made = {t for o in c.ops for t in g.ops[o].outputs}
        read = {t for o in c.ops for t in g.ops[o].inputs}
        assert set(c.inputs) == read - made
        assert set(c.inputs) <= available, f"cluster {c.id} reads a tensor of a later cluster"
        escaping = {t for t in made if t in g.outputs or any(owner[u.id] != c.id for u in g.consumers(t))}
        assert set(c.outputs) == escaping
        available |= made


def kinds_of(g: Graph, clusters, primitive: str) -> list[str]:
    return [c.kind for c in clusters for o in c.ops if g.ops[o].primitive == primitive]


def test_llama_block_clusters():
    args, kwargs = llama_args()
    g = trace(llama_block, *args, **kwargs)
    cs = cluster(g)
    check_partition(g, cs)
    (attn,) = [c for c in cs if c.kind == "attention"]
    attn_prims = [g.ops[o].primitive for o in attn.ops]
    assert attn_prims.count("dot_general") == 2
    assert {"reduce_max", "exp", "reduce_sum", "select_n", "div"} <= set(attn_prims)
    assert len(attn.outputs) == 1 and g.producer(attn.outputs[0]).primitive == "dot_general"
    assert sorted(kinds_of(g, cs, "dot_general")) == ["attention", "attention", "matmul", "matmul"]
    assert kinds_of(g, cs, "rsqrt") == ["reduction"] and kinds_of(g, cs, "reduce_sum").count("reduction") == 1
    assert kinds_of(g, cs, "split") == ["movement"]
    assert kinds_of(g, cs, "dynamic_update_slice") == ["movement", "movement"]
    assert set(kinds_of(g, cs, "reshape")) == {"movement"}
    for c in cs:
        if c.kind == "movement":
            assert len(c.ops) == 1 and is_movement_op(g.ops[c.ops[0]], g)
    # clamping pos is scalar integer glue, and it feeds the cache updates
    glue = [c for c in cs if c.kind == "glue" and "min" in [g.ops[o].primitive for o in c.ops]]
    assert glue and glue[0].reason
    dus_index_inputs = {t for o in g.ops if o.primitive == "dynamic_update_slice" for t in o.inputs[2:]}
    assert dus_index_inputs & set(glue[0].outputs)
    # the residual add reads a full-size non-broadcast operand: not a matmul epilogue
    assert kinds_of(g, cs, "add")[-1] == "pointwise"


def test_llama_block_paper_size_bf16():
    """Same structure at batch 16 / context 4096 / bf16, analysed from ShapeDtypeStructs only."""
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    params = {"norm": bf(D), "wqkv": bf(D, (H + 2 * KV) * HD), "wo": bf(H * HD, D)}
    g = trace(llama_block, bf(16, 1, D), params, bf(16, 4096, KV, HD), bf(16, 4096, KV, HD),
              pos=jax.ShapeDtypeStruct((), jnp.int32))
    cs = cluster(g)
    check_partition(g, cs)
    assert sorted(kinds_of(g, cs, "dot_general")) == ["attention", "attention", "matmul", "matmul"]


def test_sort_and_control_flow_are_opaque():
    def fn(x):
        carry, _ = jax.lax.scan(lambda c, r: (c + r, c), jnp.zeros(x.shape[1:]), x)
        return jnp.sort(x, axis=-1) + 1.0, carry

    g = trace(fn, f32(4, 8))
    cs = cluster(g)
    check_partition(g, cs)
    reasons = {g.ops[c.ops[0]].primitive: c.reason for c in cs if c.kind == "opaque"}
    assert set(reasons) == {"sort", "scan"}
    assert "sort" in reasons["sort"] and "scan" in reasons["scan"]


def test_matmul_epilogue_swiglu():
    def mlp(x, wg, wu, wd, b):
        return (jax.nn.silu(x @ wg + b) * (x @ wu)) @ wd

    g = trace(mlp, f32(4, 16), f32(16, 32), f32(16, 32), f32(32, 16), f32(32))
    cs = cluster(g)
    check_partition(g, cs)
    fused = [c for c in cs if c.kind == "matmul" and len(c.ops) > 1]
    assert [[g.ops[o].primitive for o in c.ops] for c in fused] == [["dot_general", "add", "logistic", "mul"]]
    assert len(fused[0].outputs) == 1
    # gate * up reads two full-size matmul results: its own pointwise kernel
    assert [c.kind for c in cs].count("pointwise") == 1


def test_epilogue_never_duplicates_work():
    def fn(x, w):
        y = x @ w
        return jnp.exp(y), y  # y is needed outside: exp cannot be fused without writing y too

    g = trace(fn, f32(4, 8), f32(8, 8))
    cs = cluster(g)
    check_partition(g, cs)
    (mm,) = [c for c in cs if c.kind == "matmul"]
    assert [g.ops[o].primitive for o in mm.ops] == ["dot_general"]
    assert kinds_of(g, cs, "exp") == ["pointwise"]


def test_norms_and_softmax_are_reductions():
    def layernorm(x, gamma, beta):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * gamma + beta

    for fn, args in [(layernorm, (f32(4, 16), f32(16), f32(16))),
                     (lambda x: jax.nn.softmax(x, axis=-1), (f32(4, 16),)),
                     (rmsnorm, (f32(4, 16), f32(16)))]:
        g = trace(fn, *args)
        cs = cluster(g)
        check_partition(g, cs)
        (red,) = [c for c in cs if c.kind == "reduction"]
        assert [c.kind for c in cs if c is not red] in ([], ["movement"], ["movement", "movement"])
        assert all(g.ops[c.ops[0]].primitive == "broadcast_in_dim" for c in cs if c is not red)
        assert len(red.outputs) == 1 and red.outputs[0] == g.outputs[0]


def test_conv_with_epilogue():
    def fn(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.silu(y + b)

    g = trace(fn, f32(1, 8, 8, 4), f32(3, 3, 4, 8), f32(8))
    cs = cluster(g)
    check_partition(g, cs)
    (conv,) = [c for c in cs if c.kind == "conv"]
    assert [g.ops[o].primitive for o in conv.ops] == ["conv_general_dilated", "add", "logistic", "mul"]


def test_pointwise_groups_stay_acyclic():
    def fn(x):
        a = jnp.exp(x)
        s = jnp.sum(a * 2.0, axis=-1, keepdims=True)  # reduction between two elementwise ops on a
        return jnp.tanh(a) * s, jnp.sort(a, axis=-1) - a

    g = trace(fn, f32(4, 8))
    cs = cluster(g)
    check_partition(g, cs)  # would fail if exp and the final mul shared a cluster around the reduce


def test_deep_graph_partition():
    def deep(x, params, ck, cv, *, pos):
        for _ in range(4):
            x, ck, cv = llama_block(x, params, ck, cv, pos=pos)
        return x, ck, cv

    args, kwargs = llama_args()
    g = trace(deep, *args, **kwargs)
    cs = cluster(g)
    check_partition(g, cs)
    assert [c.kind for c in cs].count("attention") == 4


def test_movement_table():
    assert MOVEMENT >= {"transpose", "reshape", "dynamic_update_slice", "concatenate", "split", "pad",
                        "broadcast_in_dim"}
    assert "add" not in MOVEMENT
    g = trace(lambda x: (x.astype(jnp.float32), x.astype(jnp.bfloat16)), f32(4))
    converts = [op for op in g.ops if op.primitive == "convert_element_type"]
    assert [is_movement_op(op, g) for op in converts] == [False]  # the same-dtype astype is elided
    # a weakly typed python float converted to float32 keeps the dtype: a copy, i.e. movement
    g2 = trace(lambda x: jnp.zeros(64) + jax.lax.convert_element_type(x, jnp.float32), 1.0)
    (same,) = [op for op in g2.ops if op.primitive == "convert_element_type"]
    assert is_movement_op(same, g2)


def test_attention_output_cast_is_the_kernels_store():
    """``o = (p @ v in f32).astype(bf16)`` then the head transpose: the narrowing cast stays next to
    the second dot (graph._sink_elementwise leaves casts to narrower dtypes where they are) and is
    part of the attention cluster, whose one output is bf16 — the kernel stores bf16 instead of a
    lone cast launching between the Pallas kernel and the next GEMM. A widening cast still sinks
    past a view. Values equal jax.jit (bf16, 2e-2)."""
    import warnings
    import vtc_jax

    def attn(q, k, v):   # (B, H, 1, D) q, (B, H, T, D) k and v, bf16
        s = jnp.einsum("bhqd,bhtd->bhqt", q, k, preferred_element_type=jnp.float32) / 4.0
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("bhqt,bhtd->bhqd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)
        return jnp.transpose(o, (0, 2, 1, 3)).reshape(q.shape[0], -1)

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((2, 4, 1, 16), (2, 4, 32, 16), (2, 4, 32, 16)))
    g = trace(attn, q, k, v)
    (att,) = [c for c in cluster(g) if c.kind == "attention"]
    assert g.ops[max(att.ops)].primitive == "convert_element_type"
    assert [g.tensors[t].dtype for t in att.outputs] == [jnp.bfloat16]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = vtc_jax.optimize(attn)(q, k, v)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(jax.jit(attn)(q, k, v), np.float32),
                               rtol=2e-2, atol=2e-2)
    widen = trace(lambda x: jnp.transpose(x.astype(jnp.float32), (1, 0)), jnp.zeros((3, 5), jnp.bfloat16))
    assert [op.primitive for op in widen.ops] == ["transpose", "convert_element_type"]
    narrow = trace(lambda x: jnp.transpose(x.astype(jnp.bfloat16), (1, 0)), jnp.zeros((3, 5), jnp.float32))
    assert [op.primitive for op in narrow.ops] == ["convert_element_type", "transpose"]
    # and a narrowing cast after a view moves up to the producer (graph._hoist_narrowing_casts):
    # jax's batch-1 matmul puts a size-1 broadcast between the second dot and ``.astype``
    # (only onto a contraction: after an elementwise producer the cast stays where it is)
    f = lambda x, w: jnp.transpose((x @ w)[None], (1, 0, 2)).astype(jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5)), jnp.float32)
    hoist = trace(f, x, x.T)
    assert [op.primitive for op in hoist.ops][:2] == ["dot_general", "convert_element_type"]
    assert hoist.tensors[hoist.outputs[0]].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(hoist.evaluate(x, x.T)[0], np.float32),
                                  np.asarray(jax.jit(f)(x, x.T), np.float32))
    stay = trace(lambda x: jnp.transpose(jnp.tanh(x)[None], (1, 0, 2)).astype(jnp.bfloat16), x)
    assert [op.primitive for op in stay.ops][-1] == "convert_element_type"
    q1, k1, v1 = q[:1], k[:1], v[:1]     # batch 1
    g1 = trace(attn, q1, k1, v1)
    (att1,) = [c for c in cluster(g1) if c.kind == "attention"]
    assert [g1.tensors[t].dtype for t in att1.outputs] == [jnp.bfloat16]


def test_cycle_check_cut_gives_the_partition_of_the_full_walk(monkeypatch):
    """The cycle check stops at the first op id no group straddles (``_Groups._cut``): nothing after
    it can lead back. The partitions with and without that stop must be the same, on programs whose
    groups interleave (a residual stream across layers, GQA attention, windows, an MoE dispatch, a
    sampler, a training step's backward pass)."""
    import sys
    from pathlib import Path
    import vtc_jax.cluster as C
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import llama3_decode as L
    from tests.zoo.corpus import CORPUS

    def two_layers(params, x, kc, vc, pos):
        x, k1, v1 = L.step(params, x, kc, vc, pos)
        x, k2, v2 = L.step(params, x, k1, v1, pos)
        return x, k2, v2

    args, kwargs = llama_args()
    graphs = [trace(two_layers, *L.example_args("small", batch=2)), trace(llama_block, *args, **kwargs)]
    for name in ("swin_window_attention_linen", "moe_gshard_onehot_dispatch", "sampler_vllm_sort_topk_topp",
                 "gpt2_train_step_nnx"):
        e = CORPUS[name]("paper")
        graphs.append(trace(e.step, *e.args))
    cut = [cluster(g) for g in graphs]
    monkeypatch.setattr(C._Groups, "_cut", lambda self, top: len(self.of))   # walk everything
    full = [cluster(g) for g in graphs]
    for a, b in zip(cut, full):
        assert [(c.kind, c.ops) for c in a] == [(c.kind, c.ops) for c in b]
    assert sum(len(c) for c in cut) > 20
