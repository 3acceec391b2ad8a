"""benchmarks/: the per-case accounting function on Llama-3 batch 1, and gpu.py on a machine without a GPU."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def accounting():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="cross-lowering for CUDA needs jax-cuda12-plugin")
    return _load("accounting")


def test_accounting_llama_batch1_is_self_consistent(accounting):
    case = accounting.account("llama3_decode", 1)
    m = case.modeled
    assert case.error is None and not case.lower_errors
    assert case.donated == (2, 3)                      # the K and V caches
    assert case.movement_ops > 0 and case.eliminated <= case.movement_ops
    assert case.analysis_seconds > 0
    # modelled bytes: compulsory <= optimised <= plain XLA; peak memory does not grow
    assert 0 < m["bytes_compulsory"] <= m["bytes_optimized"] <= m["bytes_baseline"]
    assert 0 < m["peak_optimized"] <= m["peak_baseline"]
    assert m["kernels_optimized"] <= m["kernels_baseline"]
    # lowered modules: the baseline has movement feeding dots/results, VTC none, and Triton kernels
    assert case.baseline.into_consumers and case.baseline.triton_kernels == 0
    # what still reaches a kernel/dot/result is XLA's cheap work: the caches' in-place row updates
    # (decode GEMMs stay XLA's) and transposes of a size-1 axis (bitcasts) — nothing cache-sized
    # but the in-place updates, while the baseline feeds its attention the repeated, transposed cache
    big = lambda ms: [m for m in ms if "x4096x" in m[2] and "dynamic_update_slice" not in m[0]]
    assert big(case.baseline.into_consumers) and big(case.optimized.into_consumers) == []
    assert case.optimized.triton_kernels >= 2
    assert set(case.optimized.movement_counts) == set(accounting.MOVEMENT_HLO)
    assert sum(case.baseline.movement_counts.values()) > 0
    # every kept movement op says which op and why
    assert all(k["primitive"] and k["reason"] for k in case.kept)
    assert 0 <= case.peak_saving < 100


def test_accounting_renders_markdown(accounting, tmp_path):
    case = accounting.account("llama3_decode", 1, lower=False)
    text = accounting.render([case], [{"layers": 1, "ops": 1, "movement_ops": 0, "eliminated": 0,
                                       "analysis_seconds": 0.5, "wall_seconds": 0.5}],
                             accounting.machine_info(), [], 1.0, None)
    assert text.startswith("# Benchmarks")
    assert accounting.COMMAND in text.split("##")[0]
    assert "modelled" in text and "llama3_decode" in text and "528.8" in text  # paper's Llama b1 figure


def test_gpu_script_without_gpu_exits_cleanly():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py")], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "no GPU: nothing measured (this script only runs on a GPU)" in proc.stdout


def _rendered_speed_ups(tmp_path, rows):
    """``gpu.py --render`` on ``rows`` (a jsonl file): the VTC rows' speed-up cells, and the table."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--render", str(path), "--info", "test"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr
    return [line.split("|")[8].strip() for line in proc.stdout.splitlines() if "| vtc |" in line], proc.stdout


def test_gpu_render_compares_at_the_same_position(tmp_path):
    """``gpu.py --render``: each speed-up is against jit at the same batch and decode position (a
    position sweep once divided by jit's time at another position)."""
    rows = [dict(kind="attention", name="llama3_attention", batch=16, pos=p, variant=v, median_ms=t,
                 p10_ms=t, p90_ms=t) for p, v, t in ((511, "jit", 0.5), (511, "vtc", 0.1),
                                                     (4095, "jit", 0.4), (4095, "vtc", 0.2))]
    speeds, table = _rendered_speed_ups(tmp_path, rows)
    assert speeds == ["5.00×", "2.00×"], table


def test_gpu_render_reads_speed_ups_from_jit_timed_beside_the_row(tmp_path):
    """A row with ``jit_b2b_ms`` (jit's program timed back to back beside it, interleaved, in the
    same process) is compared with that; an older row without it, with jit's per-call median from
    its own process. Separate processes' back-to-back times are never divided (the same jit program
    read 45 and 65 µs in two processes on an H100)."""
    rows = [dict(kind="workload", name="w", batch=b, pos=0, variant=v, median_ms=m, p10_ms=m, p90_ms=m, **extra)
            for b, v, m, extra in ((1, "jit", 0.30, {"b2b_ms": 0.50}), (1, "vtc", 0.40, {"b2b_ms": 0.10, "jit_b2b_ms": 0.20}),
                                   (16, "jit", 0.60, {"b2b_ms": 0.1}), (16, "vtc", 0.30, {}))]
    speeds, table = _rendered_speed_ups(tmp_path, rows)
    assert speeds == ["2.00×", "2.00×"], table


def test_gpu_render_states_jits_spread_beside_a_speed_up(tmp_path):
    """A row timed with jit's program twice in each round (``jit_spread``: its two medians apart)
    shows that spread beside the speed-up: on a lent H200 the same program read 10% apart, and a
    speed-up inside that is noise."""
    rows = [dict(kind="workload", name="w", batch=1, pos=0, variant=v, median_ms=0.3, p10_ms=0.3, p90_ms=0.3,
                 **extra) for v, extra in (("jit", {"b2b_ms": 0.2}),
                                          ("vtc", {"b2b_ms": 0.22, "jit_b2b_ms": 0.2, "jit_spread": 0.1}))]
    speeds, table = _rendered_speed_ups(tmp_path, rows)
    assert speeds == ["0.91× (±10%)"], table


def test_gpu_back_to_back_timing_runs_with_donation():
    """``gpu.py``'s back-to-back timing (the code path, run on the CPU: no figure is read from it):
    two programs interleaved, each call given a fresh copy of the donated input; the one doing
    2000 sines per element times slower."""
    import importlib.util
    import jax
    import jax.numpy as jnp
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    fn = jax.jit(lambda c, x: c.at[0].set(x), donate_argnums=0)
    args = (jnp.zeros((4, 8)), jnp.ones(8))
    out = fn(*(jnp.zeros((4, 8)), jnp.ones(8)))
    slow = jax.jit(lambda c, x: c.at[0].set(jax.lax.fori_loop(0, 2000, lambda i, y: jnp.sin(y), x)),
                   donate_argnums=0)
    seconds = gpu._back_to_back([fn, slow], args, (0,), out, runs=3)
    assert 0 < seconds[0] < seconds[1] < 1.0
    assert not args[0].is_deleted()   # the caller's own input was never donated


def test_gpu_compares_outputs_that_are_prng_keys():
    """``gpu.py`` compares each output with jit's as f32 numbers: a sampler returning its next
    key (a typed PRNG key array) is compared by its key data (the first H100 run failed the row:
    "Cannot convert_element_type from key<fry> to float32")."""
    import importlib.util
    import jax
    import jax.numpy as jnp
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    keys = jax.random.split(jax.random.key(0), 2)
    out = (jnp.array([1.0, 2.0]), keys[0])
    assert gpu._max_rel(out, out) == 0.0
    assert gpu._max_rel((jnp.array([1.0, 2.0]), keys[1]), out) > 0.0
    assert bool(jnp.isfinite(gpu._numbers(keys[0])).all())


def test_kernel_examples_cross_lower():
    """benchmarks/kernels.py's examples(): unique names, and a case cross-lowers to Triton IR."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="cross-lowering for CUDA needs jax-cuda12-plugin")
    import functools

    from vtc_jax.testing import cross_lower
    kernels = _load("kernels")
    cases = list(kernels.examples())
    names = [n for n, _, _ in cases]
    assert len(names) == len(set(names)) >= 10
    assert any(n.startswith("decode_attention_bf16") for n in names)
    name, call, args = next(c for c in cases if c[0] == "matmul_bf16_qkv_onto_q_kcache_vcache")
    assert cross_lower(functools.partial(call, backend="triton"), *args).triton_kernels


def test_compiled_renders_table_model_error_and_worse_cases():
    compiled = _load("compiled")
    mem = {"argument_size_in_bytes": 100, "output_size_in_bytes": 10, "alias_size_in_bytes": 0,
           "temp_size_in_bytes": 5, "generated_code_size_in_bytes": 0}
    def prog(launches, nbytes, total):
        return {"launches": launches, "triton": 1, "bytes": nbytes, "bytes_per_launch": nbytes / launches,
                "in_place": 0, "memory": {**mem, "total": total}, "per_launch": [["k", "kCustomKernel", True, 1, 1, 0, 0]],
                "kernels": [["k", 32, 0, 0, 1024, 4, 2]], "kernel_error": None}
    row = {"workload": "llama3_decode", "batch": 16,
           "modeled": {"kernels_baseline": 49, "kernels_optimized": 27, "bytes_baseline": 2 * 2**20,
                       "bytes_optimized": 2**20, "peak_baseline": 3 * 2**20, "peak_optimized": 2**20},
           "jit": prog(20, 2**20, 2 * 2**20), "vtc": prog(22, 2**20, 2**20)}
    text = compiled.render([row], "info")
    assert "| llama3_decode | 16 | 20 → 22 | 1 |" in text
    assert "49 [49] / 20 (+145%)" in text                  # the model's launch error against the compile
    row["modeled"].update(kernels_xla=21, bytes_xla=2**20)   # the XLA-fusion model, when present
    assert "21 [49] / 20 (+5%)" in compiled.render([row], "info")
    assert "2 more launches" in text                       # where VTC does worse, said
    assert "1787.3" in text or "1,787.3" in text           # the paper's table stays beside ours


def test_compiled_keeps_every_other_scripts_block(tmp_path):
    """compiled.py rewrites BENCHMARKS.md around its tables: every block another script maintains
    (``<!-- name:begin -->`` ... ``<!-- name:end -->``) survives, in place of its placeholder or
    after the tables in file order (a fixed list of names once dropped tp.py's and firstcall.py's)."""
    compiled = _load("compiled")
    path = tmp_path / "B.md"
    path.write_text("# old\n<!-- gpu:begin -->\nG\n<!-- gpu:end -->\n\n<!-- tp:begin -->\nT\n<!-- tp:end -->\n"
                    "<!-- firstcall:begin -->\nF\n<!-- firstcall:end -->\n")
    compiled._write(path, "# new\n<!-- gpu:begin -->\n<!-- gpu:end -->\ntables\n", [])
    text = path.read_text()
    assert text.startswith("# new\n<!-- gpu:begin -->\nG\n<!-- gpu:end -->\ntables")
    assert text.index("<!-- tp:begin -->\nT\n<!-- tp:end -->") < text.index("<!-- firstcall:begin -->\nF")


def test_benchmarks_md_comes_from_the_compile():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert "benchmarks/compiled.py" in text and "deviceless" in text
    assert "(modelled)" not in text.split("## The analytical model")[0]


def test_roofline_model_and_table():
    """benchmarks/roofline.py: a launch under one HBM round trip is latency-bound, an XLA launch
    streams at HBM bandwidth, a Pallas kernel with too few CTAs is bound by what it keeps in flight
    (Little's law); the table has a row per compiled workload and batch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import roofline
    from vtc_jax.costmodel import GPUS
    gpu = GPUS["h100-sxm"]
    tiny = roofline.launch_model(["f", "kCustomKernel", False, 64, 64, 0, 0, [1]])
    assert tiny["bound"] == "latency" and tiny["modelled_us"] == pytest.approx(gpu.hbm_latency * 1e6)
    big = roofline.launch_model(["g", "kCustomKernel", False, 2**30, 0, 0, 0, [1024]])
    assert big["bound"] == "bandwidth" and big["modelled_us"] == pytest.approx(2**30 / gpu.hbm_bandwidth * 1e6)
    few = roofline.launch_model(["k", "kCustomKernel", True, 2**30, 0, 0, 16384, [4, 1, 1]])
    assert few["bound"] == "in flight"
    assert few["modelled_us"] == pytest.approx(2**30 / (4 * 16384 / gpu.hbm_latency) * 1e6)
    # occupancy: the same per-CTA staging, a large grid of small CTAs (40 registers, 4 warps, 16 KB)
    # — 12 resident per SM (registers: 4 warps × 1,280) — keeps 12× the bytes in flight of one CTA per SM
    assert gpu.resident_ctas(40, 128, 16384) == 12 and gpu.resident_ctas(255, 256, 0) == 1
    assert gpu.resident_ctas(64, 128, 147456) == 1
    many = roofline.launch_model(["m", "kCustomKernel", True, 2**30, 0, 0, 16384, [4096]],
                                 ["m", 40, 0, 0, 16384, 4, 1])
    assert many["bound"] == "bandwidth"
    one_per_sm = roofline.launch_model(["m", "kCustomKernel", True, 2**30, 0, 0, 16384, [4096]])
    assert one_per_sm["bound"] == "in flight"
    data = json.loads((ROOT / "benchmarks" / "compiled.json").read_text())
    table = roofline.render(data)
    for r in data["rows"]:
        assert f"| {r['workload']} | {r['batch']} |" in table


@pytest.mark.offline
def test_xla_diff_prints_only_where_the_model_and_the_compile_part():
    """``benchmarks/xla_diff.py`` keys the model's launch groups and the compile's launches by what
    they write: where they agree (a GEMM and its tanh epilogue, one launch) only the header is
    printed; a group the compile lacks is listed under the key of what it writes."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from vtc_jax.cluster import cluster
    from vtc_jax.graph import trace
    from vtc_jax.offline import compile_program
    from vtc_jax.xla import Fusion, xla_program
    xd = _load("xla_diff")

    def fn(x, w):
        return jnp.tanh(x @ w)

    shapes = [(1024, 512), (512, 768)]
    graph = trace(fn, *[jnp.zeros(s) for s in shapes])
    price = xla_program(graph, cluster(graph))
    compiled = compile_program(jax.jit(fn), *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes], kernels=False)
    lines = xd.diff(graph, price, compiled)
    assert len(lines) == 1 and lines[0].startswith(f"model: {price.launches} launches"), lines
    extra = dataclasses.replace(price, fusions=price.fusions + (Fusion((), "copy", 1, 0, made=(graph.outputs[0],)),))
    lines = xd.diff(graph, extra, compiled)
    assert len(lines) == 2 and lines[1].startswith("f32[786432]: model 2, compile 1"), lines


@pytest.mark.offline
def test_priority_fusion_simulation_against_xlas_own_dump(tmp_path):
    """benchmarks/priority_fusion.py: XLA's priority fusion, simulated with XLA's performance
    model on the HLO the pass fused, against the pass's own dump (deviceless H100). A linear
    recurrence over 512 steps, 1 Ki and 64 Ki elements a step: every producer's first priority
    within 0.05 µs of XLA's (each is hundreds of µs at 64 Ki), and the kernels within one of the
    compile's (6 at 1 Ki, 13 at 64 Ki): the width decides, through the prices, not a bound on
    emissions, and the simulation follows it."""
    pf = _load("priority_fusion")
    compiled, simulated = {}, {}
    for width in (1024, 65536):
        where = pf.compile_with_dump(pf.linear_recurrence, pf.recurrence_args(512, width), tmp_path / str(width))
        program = pf.read_program(where)
        mine = pf.simulated_priorities(program)
        assert len(mine) > 100, sorted(program.first_priorities)[:5]
        worst = max(abs(mine[k] - v) for k, v in program.first_priorities.items() if k in mine)
        assert worst < 0.05, (width, worst)
        compiled[width], simulated[width] = program.after_multi_output, pf.simulated_kernels(program)[1]
        assert abs(simulated[width] - compiled[width]) <= 1, (width, compiled, simulated)
    assert compiled[65536] >= compiled[1024] + 5 and simulated[65536] >= simulated[1024] + 5, (compiled, simulated)
