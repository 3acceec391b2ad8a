"""Tensor- and data-parallel decode layers (tests/zoo/tp.py, issue #22) against ``jax.jit``.

Each check runs in a subprocess of its own that sees 8 host devices (``XLA_FLAGS``; the rest of
the suite runs on one; the pattern of tests/test_shard_map.py) and compares
``vtc_jax.optimize(step, backend="interpret")`` with ``jax.jit(step)`` on a 4-device mesh:

* the numbers (f32: rtol = atol = 1e-5);
* every output's sharding (``is_equivalent_to``: a replicated or re-laid-out result would be a
  silent cost to the user's next step);
* the collectives in the compiled program: no more ``all-gather`` / ``all-reduce`` /
  ``reduce-scatter`` / ``all-to-all`` / ``collective-permute`` than jit's;
* whether VTC's kernels run (``pallas_call`` in the jaxpr of what ``optimize`` runs for these
  arguments: ``opt.trace``, which takes the same sharded-input route as a call).

What is expected, and why: a program given sharded arrays (``megatron_gspmd``, ``dp_cache``) is
rewritten to run per shard (``spmd.per_shard``: one shard_map over the mesh with the partitioner's
all-reduces) and its kernels run on shards, silently; ``shard_map_psum`` called the usual way has
its kernels in its own shard_map body already. A shard_map program
given unsharded arrays gets kernels per shard under ``check_vma=False``; under jax's default
``check_vma=True`` Pallas's interpreter cannot run kernels on varying values, so the body runs as
XLA with one warning (``program.INTERPRET_VARYING``). A check that meets a known limit prints
``xfail <reason>`` after its strict parts pass; the test then xfails with that reason.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import vtc_jax  # noqa: E402
from tests.zoo import tp  # noqa: E402
from vtc_jax.program import INTERPRET_VARYING  # noqa: E402

RTOL = ATOL = 1e-5
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
NESTED_CAUSE = ("inside an outer jax.jit the arguments are tracers that carry no sharding, so optimize "
                "cannot see that they are sharded (api._sharded_over) and builds its kernels; a "
                "pallas_call is opaque to XLA's SPMD partitioner, which gathers its operands")


def _collectives(fn, args) -> dict[str, int]:
    text = fn.lower(*args).compile().as_text()
    return {k: text.count(k) for k in COLLECTIVES}


def _kernels(fn, args) -> bool:
    return "pallas_call" in str(fn.trace(*args).jaxpr)


def _copy(args):
    """Fresh buffers with the same shardings (donation consumes the caches)."""
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, args)


class Run:
    """Calls under recorded warnings: VTC's notices and fallbacks, by message."""

    def __init__(self):
        self.notices: list[str] = []
        self.fallbacks: list[str] = []

    def __call__(self, fn, *args):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            out = fn(*args)
        for w in rec:
            if issubclass(w.category, vtc_jax.VTCFallbackWarning):
                self.fallbacks.append(str(w.message))
            elif issubclass(w.category, vtc_jax.VTCNotice) and "sharded over" in str(w.message):
                self.notices.append(str(w.message))
        return out


def compare(out, ref, opt_fn, ref_fn, args) -> dict[str, tuple[int, int]]:
    """Numbers and shardings strictly; returns the collectives where VTC's exceed jit's."""
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    mine, theirs = _collectives(opt_fn, args), _collectives(ref_fn, args)
    return {k: (mine[k], theirs[k]) for k in COLLECTIVES if mine[k] > theirs[k]}


# ---- the checks (each runs in a subprocess with 8 host devices) ------------------------------

def check_call(program, style):
    """Called with arrays placed by the program's shardings (caches donated for dp_cache, as jit
    is): jit's numbers, shardings and collectives. GSPMD and DP: run per shard, kernels, no
    notice, no more collectives than jit's. shard_map_psum: its kernels all sit in the shard_map body, so VTC's
    program runs (per shard), under check_vma=True and False."""
    donate = tp.DONATE.get(program, ())
    xfails = []
    for check_vma in ((True, False) if program == "shard_map_psum" else (True,)):
        step = tp.make(program, style, check_vma=check_vma)
        args = tp.example_args(program, "small", style)
        ref_fn = jax.jit(step, donate_argnums=donate)
        opt = vtc_jax.optimize(step, backend="interpret", donate_argnums=donate)
        run = Run()
        ref_args, opt_args = _copy(args), _copy(args)
        ref = ref_fn(*ref_args)
        out = run(opt, *opt_args)
        assert [a.is_deleted() for a in jax.tree.leaves(opt_args)] == \
            [a.is_deleted() for a in jax.tree.leaves(ref_args)]          # donated as jit donates
        extra = compare(out, ref, opt, ref_fn, args)
        assert not extra, extra
        if donate:   # a second call on fresh caches: the first donation ate nothing it reuses
            compare(run(opt, *_copy(args)), ref, opt, ref_fn, args)
        kernels = _kernels(opt, args)
        print(f"check_vma={check_vma}: kernels={kernels}")
        if program == "shard_map_psum":   # every kernel inside the shard_map: VTC's program, per shard
            assert not run.notices, run.notices
            if check_vma:   # the CPU interpreter cannot run kernels on varying values: said once
                assert len(run.fallbacks) == 1 and INTERPRET_VARYING in run.fallbacks[0], run.fallbacks
                assert not kernels
            else:
                assert not run.fallbacks, run.fallbacks
                assert kernels
        else:   # rewritten per shard (spmd.per_shard): the kernels see their shards, nothing said
            assert not run.notices, run.notices
            assert not run.fallbacks, run.fallbacks
            assert kernels
    return xfails


def check_local(program, style):
    """shard_map_psum given unsharded arrays (the shard_map splits them): check_vma=True runs the
    body as XLA with the interpreter's one warning; check_vma=False runs kernels in the body.
    Both equal jit in numbers, shardings and collectives."""
    assert program == "shard_map_psum"
    args = tp.example_args(program, "small", style, place=False)
    for check_vma in (True, False):
        step = tp.make(program, style, check_vma=check_vma)
        opt = vtc_jax.optimize(step, backend="interpret")
        run = Run()
        out = run(opt, *args)
        extra = compare(out, jax.jit(step)(*args), opt, jax.jit(step), args)
        assert not extra, extra
        assert not run.notices, run.notices
        kernels = _kernels(opt, args)
        print(f"check_vma={check_vma}: kernels={kernels}")
        if check_vma:
            assert len(run.fallbacks) == 1 and INTERPRET_VARYING in run.fallbacks[0], run.fallbacks
            assert not kernels
        else:
            assert not run.fallbacks, run.fallbacks
            assert kernels
    return []


def check_nested(program, style):
    """``jax.jit(lambda *a: opt(*a))`` on sharded arrays (optimize inside the user's own jit):
    numbers and shardings strictly; kernels observed; the collectives must not exceed jit's.
    shard_map_psum under check_vma=False: the kernels sit inside the shard_map, per shard."""
    donate = tp.DONATE.get(program, ())
    step = tp.make(program, style, check_vma=False)
    args = tp.example_args(program, "small", style)
    opt = vtc_jax.optimize(step, backend="interpret")
    nested = jax.jit(lambda *a: opt(*a), donate_argnums=donate)
    ref_fn = jax.jit(step, donate_argnums=donate)
    run = Run()
    out = run(nested, *_copy(args))
    extra = compare(out, ref_fn(*_copy(args)), nested, ref_fn, args)
    assert not run.fallbacks, run.fallbacks
    kernels = _kernels(nested, args)
    print(f"kernels={kernels} extra collectives (vtc, jit)={extra}")
    if program == "shard_map_psum":
        assert kernels and not extra, (kernels, extra)
        return []
    if extra:
        assert kernels   # the cause below: kernels built on arrays the partitioner then gathers
        return [f"{NESTED_CAUSE}: collectives (vtc, jit) {extra}"]
    return []


def check_nested_explicit(program, style):
    """dp_cache inside the user's own ``jax.jit`` on a mesh with an Explicit axis (sharding in
    types, ``jax.make_mesh``'s default): the tracers' types carry the batch split, so ``optimize``
    rewrites the layer per shard there too (``api._sharding_of``): jit's numbers and shardings,
    kernels, no more collectives than jit's. (With Auto axes the split is invisible while jax
    traces: check_nested's xfail.)"""
    assert program == "dp_cache"
    donate = tp.DONATE[program]
    step = tp.make(program, style)
    args = tp.example_args(program, "small", style, explicit=True)
    opt = vtc_jax.optimize(step, backend="interpret")
    nested = jax.jit(lambda *a: opt(*a), donate_argnums=donate)
    ref_fn = jax.jit(step, donate_argnums=donate)
    run = Run()
    out = run(nested, *_copy(args))
    extra = compare(out, ref_fn(*_copy(args)), nested, ref_fn, args)
    assert not extra, extra
    assert not run.fallbacks and not run.notices, (run.fallbacks, run.notices)
    assert _kernels(nested, args)
    return []


CHECKS = {"call": check_call, "local": check_local, "nested": check_nested, "nested_explicit": check_nested_explicit}
CASES = [(p, s, c) for p in tp.PROGRAMS for s in tp.STYLES for c in CHECKS
         if (c != "local" or p == "shard_map_psum") and (c != "nested_explicit" or p == "dp_cache")]


# the Gemma layer is sharded as the Llama one: in CI it is called (each check a new process, 10-20 s),
# its other checks run with -m slow
@pytest.mark.parametrize("program,style,check", [
    pytest.param(*c, id="-".join(c), marks=[pytest.mark.slow] if c[1] == "gemma" and c[2] != "call" else [])
    for c in CASES])
def test_tp(program, style, check):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, __file__, program, style, check], capture_output=True, text=True,
                          env=env, cwd=str(ROOT), timeout=300)
    assert proc.returncode == 0, f"{program} {style} {check} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert "ok" in proc.stdout.splitlines()[-1:], proc.stdout
    print(proc.stdout)
    reasons = [ln[len("xfail "):] for ln in proc.stdout.splitlines() if ln.startswith("xfail ")]
    if reasons:
        pytest.xfail("; ".join(reasons))


if __name__ == "__main__":   # one check, in a process that sees 8 host devices
    assert len(jax.devices()) >= tp.DEVICES, jax.devices()
    assert Path(vtc_jax.__file__).resolve().parents[1] == ROOT, vtc_jax.__file__
    program, style, check = sys.argv[1:]
    for reason in CHECKS[check](program, style):
        print(f"xfail {reason}")
    print("ok")


# ---- paper size, compiled for a node of H100s (deviceless, in this process) ------------------

# every program on 8 devices with the Llama layer in CI; the Gemma layer (the same sharding) and the
# 4-device meshes (50-60 s each on a 2-core machine) with -m slow
PAPER = [pytest.param(p, s, n, id=f"{p}-{s}-{n}", marks=[pytest.mark.slow] if s == "gemma" or n == 4 else [])
         for p, s, n in [(p, s, 8) for p in tp.PROGRAMS for s in tp.STYLES]
         + [(p, s, 4) for p in ("megatron_gspmd", "shard_map_psum") for s in tp.STYLES]]


@pytest.mark.offline
@pytest.mark.parametrize("program,style,n", PAPER)
def test_paper_size_on_h100s(program, style, n):
    """The layers at Llama-3-8B / Gemma-2-9B size on a mesh of n compile-only H100s
    (``offline.h100_devices``, topology 1x1xn; benchmarks/tp.py prints the table for 2, 4 and 8),
    lowered as a user lowers them (``optimize(step, backend="triton").lower(sharded
    ShapeDtypeStructs).compile()``, no context manager; ``compile_program(placed=True)`` only adds
    XLA's dump options): jit's collectives, and per device no more launches, bytes or temporary
    buffers than jit's. Triton kernels run in the data-parallel layers and, on 4 devices, in the
    tensor-parallel ones (per shard; shard_map_psum under jax's default ``check_vma``). On 8
    devices (one KV head each) the TP layers' kernels lose to XLA's fusions (25 launches against
    20) and the guard, compiling the shard_map body as each device runs it (``guard._alone``),
    undoes them: shard_map_psum is then jit's program launch for launch, and the GSPMD layer the
    per-shard program (``spmd.per_shard``), which moves about a third fewer bytes than GSPMD's
    (Llama's keeps some of its kernels there)."""
    from vtc_jax import offline
    devices = offline.h100_devices(n)
    step = tp.make(program, style, devices=devices)
    args = tp.example_args(program, "paper", style, devices=devices)
    donate = tp.DONATE.get(program, ())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        jit = offline.compile_program(step, *args, donate_argnums=donate, placed=True, kernels=False)
        opt = vtc_jax.optimize(step, backend="triton", donate_argnums=donate)
        with warnings.catch_warnings():
            warnings.simplefilter("error", vtc_jax.VTCFallbackWarning)
            vtc = offline.compile_program(opt, *args, placed=True, kernels=False)
    count = lambda p: {k: p.hlo.count(f" {k}(") + p.hlo.count(f" {k}-start(") for k in COLLECTIVES}  # noqa: E731
    assert count(vtc) == count(jit), (count(vtc), count(jit))
    assert len(vtc.launches) <= len(jit.launches), (len(vtc.launches), len(jit.launches))
    assert vtc.bytes <= jit.bytes, (vtc.bytes, jit.bytes)
    assert vtc.memory["temp_size_in_bytes"] <= jit.memory["temp_size_in_bytes"]
    if n == 4 or program == "dp_cache":
        assert vtc.triton_launches, "no kernels"
    elif program == "shard_map_psum":
        assert (len(vtc.launches), vtc.bytes) == (len(jit.launches), jit.bytes) and not vtc.triton_launches
