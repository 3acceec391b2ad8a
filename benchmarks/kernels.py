#!/usr/bin/env python
"""Offline compile of the kernel templates (verification ladder, rung 2b): registers, spills, smem.

    JAX_PLATFORMS=cpu python benchmarks/kernels.py            # rewrites benchmarks/kernels.md

Each kernel template in its default configuration (block sizes, warps, stages chosen by the
template) at paper-relevant shapes is cross-lowered for CUDA with ``backend="triton"``, and every
Triton kernel of the module is compiled to PTX and a cubin for sm_90 with XLA's bundled Triton and
``ptxas`` (``vtc_jax.offline.compile_lowered``); no GPU is needed. A second table does the same
for the kernels ``vtc_jax.optimize(step, backend="triton")`` emits for each workload of
``examples/`` at paper size.

:func:`examples` yields ``(name, kernel_call, args)`` in the ``check_kernel`` convention
(``kernel_call(*args, backend=...)``, args are ``ShapeDtypeStruct``s) — what ``vtc-jax kernels``
without a PATH asks ``vtc_jax.kernels.examples()`` for. It depends only on ``jax`` and ``vtc_jax``, so
it can be moved into the package unchanged.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_TRACEBACK_FILTERING", "off")  # so a lowering failure names the frame that raised

import argparse
import functools
import importlib.util
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "JAX_PLATFORMS=cpu python benchmarks/kernels.py"
GPU = "sm_90"


# --------------------------------------------------------------------------------------------
# The template cases (movable into vtc_jax.kernels as ``examples()``)
# --------------------------------------------------------------------------------------------

def examples() -> Iterator[tuple[str, Callable[..., Any], tuple]]:
    """``(name, kernel_call, args)`` for every kernel template in its default configuration.

    ``kernel_call(*args, backend=...)``; ``args`` are ``jax.ShapeDtypeStruct``s (cross-lowering
    needs no data). Shapes: Llama-3-8B decode (d_model 4096, 32 query / 8 KV heads of 128, context
    4096, batch 16) and a few generic ones.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    from vtc_jax.indexmap import Layout, SymInfo, sym
    from vtc_jax.kernels.attention import decode_attention
    from vtc_jax.kernels.matmul import matmul
    from vtc_jax.kernels.pointwise import pointwise
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


# --------------------------------------------------------------------------------------------
# Compile and tabulate
# --------------------------------------------------------------------------------------------

def _status(r: Any) -> str:
    from vtc_jax.offline import SMEM_LIMIT
    if r.error or not r.cubin_ok:
        return "FAIL: " + ((r.error or "").strip().splitlines() or [""])[0][:120]
    if not r.fits(GPU):
        return f"shared memory > {SMEM_LIMIT[GPU]} B"
    return "spills" if r.spills else "ok"


def compile_cases(cases: Sequence[tuple[str, Callable[[], Any]]], desc: str) -> list[dict[str, Any]]:
    """``cases``: (label, thunk returning a LoweredModule). One row per Triton kernel (or per failure)."""
    from tqdm import tqdm
    from vtc_jax.offline import compile_lowered
    rows = []
    for label, make in tqdm(cases, desc=desc, unit="case"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lowered = make()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows.append({"case": label, "kernel": "-",
                         "status": f"lowering failed: {_accounting().describe_error(exc)}"})
            continue
        if not lowered.triton_kernels:
            rows.append({"case": label, "kernel": "-", "status": "no Triton kernel in the lowered module"})
            continue
        for k, r in zip(lowered.triton_kernels, compile_lowered(lowered)):
            rows.append({"case": label, "kernel": r.name, "grid": "×".join(map(str, k.grid)),
                         "warps": r.num_warps, "stages": r.num_stages, "regs": r.registers,
                         "spill": f"{r.spill_store_bytes or 0}/{r.spill_load_bytes or 0}" if r.cubin_ok else "-",
                         "smem": r.smem_bytes, "target": r.gpu_name, "status": _status(r)})
    return rows


def template_cases(only: str | None = None) -> list[tuple[str, Callable[[], Any]]]:
    from vtc_jax.testing import cross_lower
    return [(name, functools.partial(lambda c, a: cross_lower(functools.partial(c, backend="triton"), *a), call, args))
            for name, call, args in examples() if only is None or only in name]


def workload_cases(workloads: Sequence[str], batches: Sequence[int]) -> list[tuple[str, Callable[[], Any]]]:
    import vtc_jax
    from vtc_jax.testing import cross_lower
    acc = _accounting()
    out = []
    for w in workloads:
        mod = acc.load_example(w)
        if mod is None:
            print(f"skipped {w}: examples/{w}.py does not exist yet")
            continue
        for b in batches:
            def make(mod: Any = mod, b: int = b) -> Any:
                f = vtc_jax.optimize(mod.step, backend="triton", donate_argnums=acc.donate_argnums(mod))
                return cross_lower(f, *mod.example_args("paper", batch=b))
            out.append((f"{w} b{b}", make))
    return out


def _accounting() -> Any:
    here = Path(__file__).resolve().parent
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    import accounting
    return accounting


def markdown(rows: list[dict[str, Any]]) -> str:
    acc = _accounting()
    cols = ["case", "kernel", "grid", "warps", "stages", "regs", "spill", "smem", "status"]
    head = ["case", "kernel", "grid", "warps", "stages", "registers", "spill st/ld B", "smem B", "status"]
    return acc._md_table(head, [[("-" if r.get(c) is None else r.get(c)) for c in cols] for r in rows],
                         "llrrrrrrl")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "kernels.md"))
    p.add_argument("--only", default=None, help="template cases whose name contains this")
    p.add_argument("--workloads", default=None,
                   help="comma-separated example modules for the second table ('' to skip; default all)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--check", action="store_true", help="exit 1 if any kernel fails, spills or exceeds smem")
    ns = p.parse_args(argv)
    acc = _accounting()
    t0 = time.perf_counter()
    info = acc.machine_info()
    templ = compile_cases(template_cases(ns.only), "templates")
    names = [w.module for w in acc.WORKLOADS] if ns.workloads is None else [w for w in ns.workloads.split(",") if w]
    work = compile_cases(workload_cases(names, [int(b) for b in ns.batches.split(",") if b]), "workloads") \
        if names else []
    elapsed = time.perf_counter() - t0

    def summary(rows: list[dict[str, Any]]) -> str:
        n = len(rows)
        ok = sum(r["status"] == "ok" for r in rows)
        bad = [r for r in rows if r["status"] != "ok"]
        return f"{ok} of {n} kernels compile for {GPU} without spills within the shared-memory limit" + (
            f"; not ok: {', '.join(sorted({r['case'] + ('' if r['kernel'] == '-' else ' ' + r['kernel']) for r in bad}))}."
            if bad else ".")

    text = "\n".join([
        "# Offline compile of the Triton kernels (sm_90)", "",
        "Regenerate with one command:", "", "```sh", COMMAND, "```", "",
        f"Generated {info['date']} in {elapsed / 60:.1f} min on {info['cpu']} ({info['cores']} cores, {info['ram']}); "
        f"Python {info['python']}, jax {info['jax']}, jaxlib {info['jaxlib']}, vtc_jax {info['vtc_jax']} "
        f"(git {info['commit']}). No GPU: each case is cross-lowered for CUDA (`backend=\"triton\"`) and every Triton "
        "kernel compiled to PTX by XLA's bundled Triton, then to a cubin by `ptxas` "
        "(`vtc_jax.offline.compile_lowered`, compute capability 9.0). Registers and spills from `ptxas -v`; "
        "smem = Triton's dynamic shared memory + static; the limit checked is the sm_90 opt-in maximum per block "
        "(232,448 B). Warps/stages are what the template put in the launch configuration. This says the kernels "
        "build and fit, nothing about their speed.", "",
        "## Kernel templates, default configurations", "",
        summary(templ), "", markdown(templ), "",
        "## Kernels `vtc_jax.optimize(step, backend=\"triton\")` emits for each workload (paper size)", "",
        (summary(work) if work else "skipped") + "", "",
        markdown(work) if work else "", "",
    ])
    Path(ns.out).write_text(text)
    print(text)
    print(f"wrote {ns.out} in {elapsed:.0f} s")
    bad = [r for r in templ + work if r["status"] != "ok"]
    return 1 if (ns.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
