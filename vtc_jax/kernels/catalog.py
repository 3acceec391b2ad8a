"""A catalogue of every kernel template in its default configuration, at paper-relevant shapes.

``examples()`` yields ``(name, kernel_call, args)`` in the ``check_kernel`` convention
(``kernel_call(*args, backend=...)``; ``args`` are ``jax.ShapeDtypeStruct``s, since cross-lowering
needs no data). ``vtc-jax kernels`` and ``benchmarks/kernels.py`` compile them offline to read
registers, spills and shared memory.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable, Iterator


def examples() -> Iterator[tuple[str, Callable[..., Any], tuple]]:
    """``(name, kernel_call, args)`` for every kernel template in its default configuration.

    ``kernel_call(*args, backend=...)``; ``args`` are ``jax.ShapeDtypeStruct``s (cross-lowering
    needs no data). Shapes: Llama-3-8B decode (d_model 4096, 32 query / 8 KV heads of 128, context
    4096, batch 16) and a few generic ones.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vtc_jax.indexmap import Layout, SymInfo, sym
    from vtc_jax.kernels.attention import decode_attention
    from vtc_jax.kernels.matmul import matmul
    from vtc_jax.kernels.pointwise import pointwise
    from vtc_jax.kernels.prefill_attention import prefill_attention
    from vtc_jax.kernels.reduction import rms_norm, softmax
    from vtc_jax.kernels.vio import VTensor

    S = jax.ShapeDtypeStruct
    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    MM = (((1,), (0,)), ((), ()))
    tag = {f32: "f32", bf16: "bf16"}

    # matmul: (M, K) @ (K, N)
    for dt in (f32, bf16):
        for m, k, n in ((1, 4096, 4096), (16, 4096, 4096), (512, 512, 512), (16, 4096, 28672)):
            yield (f"matmul_{tag[dt]}_{m}x{k}x{n}", functools.partial(matmul, dimension_numbers=MM),
                   (S((m, k), dt), S((k, n), dt)))

    # QKV projection written onto three buffers: Q fresh, K and V caches at runtime pos (in place).
    B, D, T, HQ, HKV, DH = 16, 4096, 4096, 32, 8, 128

    def qkv_three(x: Any, w: Any, kc: Any, vc: Any, pos: Any, *, backend: str) -> Any:
        syms = [SymInfo("pos", 0, T - 1)]
        q = Layout.physical(0, (B, 1, HQ, DH)).reshape((B, 1, HQ * DH))
        kv = [Layout.physical(i, (B, T, HKV, DH)).offset(1, sym("pos"), 1, syms).reshape((B, 1, HKV * DH))
              for i in (1, 2)]
        out = VTensor(Layout.concatenate([q, *kv], 2), x.dtype,
                      (S((B, 1, HQ, DH), x.dtype), kc, vc), (("pos", pos),))
        return matmul(x, w, dimension_numbers=(((2,), (0,)), ((), ())), out=out, backend=backend)

    yield ("matmul_bf16_qkv_onto_q_kcache_vcache", qkv_three,
           (S((B, 1, D), bf16), S((D, (HQ + 2 * HKV) * DH), bf16), S((B, T, HKV, DH), bf16),
            S((B, T, HKV, DH), bf16), S((), i32)))

    # decode attention, GQA G = 4: K/V read straight from the (B, T, Hkv, D) cache (transpose layout),
    # and from physical (B, Hkv, T, D) arrays.
    G = HQ // HKV

    def cache_view(c: Any) -> Any:
        return VTensor(Layout.physical(0, c.shape).transpose((0, 2, 1, 3)), c.dtype, (c,))

    def attn_cache(q: Any, kc: Any, vc: Any, pos: Any, *, backend: str) -> Any:
        return decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, backend=backend)

    def attn_phys(q: Any, k: Any, v: Any, pos: Any, *, backend: str) -> Any:
        return decode_attention(q, k, v, pos=pos, backend=backend)

    for dt in (bf16, f32):
        yield (f"decode_attention_{tag[dt]}_from_cache_B{B}_H{HKV}_G{G}_T{T}_D{DH}", attn_cache,
               (S((B, HKV, G, DH), dt), S((B, T, HKV, DH), dt), S((B, T, HKV, DH), dt), S((), i32)))
    yield (f"decode_attention_bf16_physical_B{B}_H{HKV}_G{G}_T{T}_D{DH}", attn_phys,
           (S((B, HKV, G, DH), bf16), S((B, HKV, T, DH), bf16), S((B, HKV, T, DH), bf16), S((), i32)))
    yield (f"decode_attention_bf16_from_cache_B1_H{HKV}_G{G}_T{T}_D{DH}", attn_cache,
           (S((1, HKV, G, DH), bf16), S((1, T, HKV, DH), bf16), S((1, T, HKV, DH), bf16), S((), i32)))
    # a finite mask (finfo.min / -1e30): the kernel carries the empty-row pass (jax's row for pos < 0)
    def attn_cache_fill(q: Any, kc: Any, vc: Any, pos: Any, *, backend: str) -> Any:
        return decode_attention(q, cache_view(kc), cache_view(vc), pos=pos, backend=backend,
                                empty_rows=("fill", float(np.finfo(np.float32).min)))

    yield (f"decode_attention_bf16_from_cache_finite_mask_B{B}_H{HKV}_G{G}_T{T}_D{DH}", attn_cache_fill,
           (S((B, HKV, G, DH), bf16), S((B, T, HKV, DH), bf16), S((B, T, HKV, DH), bf16), S((), i32)))
    # continuous batching: one position per sequence, a (B,) operand
    yield (f"decode_attention_bf16_from_cache_per_sequence_pos_B{B}_H{HKV}_G{G}_T{T}_D{DH}", attn_cache,
           (S((B, HKV, G, DH), bf16), S((B, T, HKV, DH), bf16), S((B, T, HKV, DH), bf16), S((B,), i32)))

    # prefill attention, GQA G = 4 folded into the query rows (M = G * S): a causal 2k prompt, and
    # a 512-token chunk at a runtime cache offset (the kernel's int32 bound operand)
    S_PRE, CHUNK = 2048, 512

    def prefill(q: Any, k: Any, v: Any, *, backend: str) -> Any:
        return prefill_attention(q, k, v, causal=True, seq_len=S_PRE, backend=backend)

    def prefill_chunk(q: Any, k: Any, v: Any, off: Any, *, backend: str) -> Any:
        return prefill_attention(q, k, v, causal=True, q_offset=off, seq_len=CHUNK, backend=backend)

    Z = HKV
    yield (f"prefill_attention_bf16_causal_Z{Z}_G{G}_S{S_PRE}_D{DH}", prefill,
           (S((Z, G * S_PRE, DH), bf16), S((Z, S_PRE, DH), bf16), S((Z, S_PRE, DH), bf16)))
    yield (f"prefill_attention_bf16_chunk_at_runtime_offset_Z{Z}_G{G}_S{CHUNK}_T{T}_D{DH}", prefill_chunk,
           (S((Z, G * CHUNK, DH), bf16), S((Z, T, DH), bf16), S((Z, T, DH), bf16), S((), i32)))

    # pointwise
    def silu_mul(g: Any, u: Any, *, backend: str) -> Any:
        fn = lambda a, b: (jax.nn.silu(a.astype(f32)) * b.astype(f32)).astype(a.dtype)  # noqa: E731
        return pointwise(fn, [g, u], backend=backend, name="silu_mul")

    def add_transposed(a: Any, b: Any, *, backend: str) -> Any:
        bt = VTensor(Layout.physical(0, b.shape).transpose((1, 0)), b.dtype, (b,))
        return pointwise(lambda x, y: x + y, [a, bt], backend=backend, name="add_transposed")

    for dt in (bf16, f32):
        yield f"pointwise_{tag[dt]}_silu_mul_16x14336", silu_mul, (S((16, 14336), dt), S((16, 14336), dt))
    yield "pointwise_f32_add_transposed_1024x1024", add_transposed, (S((1024, 1024), f32), S((1024, 1024), f32))

    # reductions
    def rms(x: Any, w: Any, *, backend: str) -> Any:
        return rms_norm(x, w, 1e-5, backend=backend)

    def soft(x: Any, *, backend: str) -> Any:
        return softmax(x, axis=-1, backend=backend)

    for dt in (bf16, f32):
        yield f"rms_norm_{tag[dt]}_16x4096", rms, (S((16, 4096), dt), S((4096,), dt))
        yield f"softmax_{tag[dt]}_512x4096", soft, (S((512, 4096), dt),)
    yield "rms_norm_bf16_1x4096", rms, (S((1, 4096), bf16), S((4096,), bf16))

    # convolution (when the template exists)
    if importlib.util.find_spec("vtc_jax.kernels.conv") is not None:
        from vtc_jax.kernels.conv import conv
        nchw = ("NCHW", "OIHW", "NCHW")

        def conv_call(x: Any, w: Any, *, backend: str, stride: int = 1, groups: int = 1) -> Any:
            return conv(x, w, window_strides=(stride, stride), padding="SAME", dimension_numbers=nchw,
                        feature_group_count=groups, backend=backend)

        for name, x, w, kw in (
            ("conv_f32_3x3_yolo_16to8_160x160", (1, 16, 160, 160), (8, 16, 3, 3), {}),
            ("conv_f32_1x1_yolo_48to64_160x160_b16", (16, 48, 160, 160), (64, 48, 1, 1), {}),
            ("conv_f32_3x3_depthwise_shufflenet_58_28x28", (1, 58, 28, 28), (58, 1, 3, 3), {"groups": 58}),
            ("conv_f32_1x1_efficientvit_256to768_64x64", (1, 256, 64, 64), (768, 256, 1, 1), {}),
            ("conv_bf16_3x3_stride2_64to128_56x56", (1, 64, 56, 56), (128, 64, 3, 3), {"stride": 2}),
        ):
            dt = bf16 if "bf16" in name else f32
            yield name, functools.partial(conv_call, **kw), (S(x, dt), S(w, dt))
