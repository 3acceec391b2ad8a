"""vtc_jax.explain: the analysis half on the paper's motivating subgraph and on bad input."""
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import vtc_jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import llama3_decode as L  # noqa: E402

FIG2_PRIMITIVES = {"split", "reshape", "dynamic_update_slice", "broadcast_in_dim", "transpose"}


def _fig2_report(batch=16, donate=(2, 3)):
    return vtc_jax.explain(L.attention_block, donate_argnums=donate)(*L.attention_block_args("paper", batch))


def test_fig2_subgraph_at_llama3_8b_size_is_fully_eliminated_in_under_a_second():
    _fig2_report()                      # first call pays jax's one-off tracing set-up
    cpu = []                            # process CPU time: wall time on a shared 2-core box
    for _ in range(2):                  # (pytest -n 2, other jobs) measures the neighbours
        t0 = time.process_time()
        report = _fig2_report()
        cpu.append(time.process_time() - t0)
    assert min(cpu) < 1.0, f"analysis took {min(cpu):.3f} s CPU (wall {report.analysis_seconds:.3f} s)"
    prims = {m.primitive for m in report.movement}
    assert FIG2_PRIMITIVES <= prims, prims
    kept = [(m.op, m.primitive, m.reason) for m in report.movement if not m.eliminated]
    # the QKV split is eliminated only by making the M = 16 projection a Pallas kernel: the greedy
    # does that only where the template streams the weights as fast as XLA's GEMM
    from vtc_jax.costmodel import GPUS, decode_gemm_loss
    if decode_gemm_loss(GPUS["h100-sxm"], 1, 16, 6144, 4096, 2, 2) > 0:
        assert {p for _, p, _ in kept} <= {"split", "transpose"}, kept
        assert [p for _, p, _ in kept].count("split") == 1, kept
    else:   # split-K template: the split goes; at most the attention output's transpose of a
        # size-1 axis stays (a bitcast for XLA) where the greedy preferred its reshape's edge
        assert {p for _, p, _ in kept} <= {"transpose"} and len(kept) <= 1, kept
    assert all(m.reason for m in report.movement)
    # the reason names the chosen edges of every op that became virtual through the VTOG
    assert any("dynamic_update_slice" == m.primitive and "⇢" in m.reason for m in report.movement)
    m = report.modeled
    assert m.bytes_compulsory <= m.bytes_optimized < m.bytes_baseline
    assert m.peak_optimized < m.peak_baseline
    # without donation the caches must be copied before the in-place write: modelled, not hidden
    undonated = _fig2_report(donate=()).modeled
    assert undonated.bytes_optimized > m.bytes_optimized
    assert undonated.bytes_compulsory <= undonated.bytes_optimized


def test_report_renders_as_text_json_and_dot():
    report = _fig2_report(batch=1)
    text = str(report)
    assert "Data-movement ops" in text and "modelled" in text.lower() or "Modelled" in text
    data = json.loads(report.to_json())
    assert len(data["vtog"]["edges"]) == len(report.vtog.edges) > 0
    assert data["strategy"]["chosen"] == list(report.strategy.chosen)
    assert {"bytes_baseline", "bytes_optimized", "bytes_compulsory", "peak_baseline",
            "peak_optimized"} <= set(data["modeled"])
    dot = report.to_dot()
    assert dot.startswith("digraph VTOG")
    assert dot.count("color=red") == len(report.strategy.chosen)


def _stack(n):
    def f(params, x, kcs, vcs, pos):
        ks, vs = [], []
        for i in range(n):
            x, k, v = L.step(params[i], x, kcs[i], vcs[i], pos)
            ks.append(k)
            vs.append(v)
        return x, ks, vs
    p, x, kc, vc, pos = L.example_args("paper", batch=16)
    return f, ([p] * n, x, [kc] * n, [vc] * n, pos)


def test_32_decoder_layers_analyse_in_time_that_grows_about_linearly():
    """The analysis of 32 unrolled layers takes at most 64 times one layer's (twice linear; 35-50x
    measured): a quadratic step would take hundreds of times. Measured as this process's CPU time
    (wall time on a shared 2-core machine measures the neighbours), one layer after a warm-up
    call. The absolute figure (issue #20: under 10 s for 32 layers) is a benchmark's
    (``benchmarks/accounting.py``), not a timed test: the code of 2149f23 passed under 10 s in its
    CI run and read 11.7 s CPU on this project's machine a day later; at ebd38c9, 6.8-7.8 s where
    98e4cbe read 9.2-9.4 s in the same minutes."""
    f1, a1 = _stack(1)
    vtc_jax.explain(f1)(*a1)
    t0 = time.process_time()
    for _ in range(3):                  # a tenth of a second, once, is noise: the mean of three
        vtc_jax.explain(f1)(*a1)
    one = (time.process_time() - t0) / 3
    f, args = _stack(32)
    t0 = time.process_time()
    report = vtc_jax.explain(f)(*args)
    cpu = time.process_time() - t0
    assert cpu < 64 * one, f"{cpu:.1f} s CPU for 32 layers, {one:.2f} s for one (wall {report.analysis_seconds:.1f} s)"
    assert len(report.movement) >= 32 * 20
    one = vtc_jax.explain(L.step)(*L.example_args("paper", batch=16))
    assert len(report.eliminated) >= 32 * len(one.eliminated) - 32


def test_unsupported_primitive_becomes_opaque_with_a_reason():
    def fn(x, w):
        y = jnp.sort(jnp.dot(x, w), axis=-1)
        return jnp.transpose(y)

    report = vtc_jax.explain(fn)(jax.ShapeDtypeStruct((8, 16), jnp.float32),
                                 jax.ShapeDtypeStruct((16, 16), jnp.float32))
    assert any(p == "sort" and r for p, r in report.opaque)


def test_bad_input_gives_jit_like_errors():
    with pytest.raises(TypeError, match="callable"):
        vtc_jax.explain(42)
    f = lambda x, y: x @ y
    with pytest.raises(TypeError):
        vtc_jax.explain(f)(jnp.ones((2, 3)))                      # missing argument
    with pytest.raises(TypeError):
        vtc_jax.explain(f)(jnp.ones((2, 3)), jnp.ones((4, 5)))    # shape mismatch, as jax.jit
    with pytest.raises(TypeError):
        jax.jit(f)(jnp.ones((2, 3)), jnp.ones((4, 5)))
    g = lambda tree: tree["a"] + tree["b"]
    with pytest.raises((TypeError, KeyError)):
        vtc_jax.explain(g)({"a": jnp.ones(3)})                  # mismatched pytree


def test_static_and_keyword_arguments():
    def fn(x, *, axis, n):
        return jnp.transpose(jnp.concatenate([x] * n, axis=axis))

    report = vtc_jax.explain(fn, static_argnames=("axis", "n"))(jnp.ones((4, 8)), axis=1, n=3)
    assert {m.primitive for m in report.movement} >= {"concatenate", "transpose"}


def test_cli_explain_prints_the_report():
    out = subprocess.run([sys.executable, "-m", "vtc_jax", "explain", str(ROOT / "examples" / "llama3_decode.py")],
                         capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Data-movement ops" in out.stdout and "dynamic_update_slice" in out.stdout


def test_kept_op_names_the_data_tensor_that_stays_physical():
    """A kept pad says why its *data* must stay physical (its output feeds a narrowing cast XLA
    fuses into the matmul), not that its fill value is a constant — which pins nothing that
    matters. (A widening cast would be the matmul's prologue and the pad eliminated.)"""
    def f(v, w):
        p = jnp.pad(v, ((0, 1), (0, 0)), constant_values=1.0)
        return p.astype(jnp.bfloat16) @ w

    rep = vtc_jax.explain(f)(jnp.ones((64, 32), jnp.float32), jnp.ones((32, 16), jnp.bfloat16))
    (pad,) = [m for m in rep.movement if m.primitive == "pad"]
    assert not pad.eliminated
    assert "stays physical" in pad.reason and "XLA" in pad.reason, pad.reason
    assert "compile-time constant" not in pad.reason and "glue" not in pad.reason, pad.reason
