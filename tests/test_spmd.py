"""``spmd.per_shard``: sharded programs rewritten to run per shard, against ``jax.jit``.

Each case is a small program given inputs placed with ``NamedSharding``s on a mesh of 8 host
devices (``(2, 4)``: ``data`` x ``model`` with Auto axes or, as ``jax.make_mesh`` makes it,
Explicit ones; or a 1-D ``x`` of 8). ``optimize`` either runs it per
shard (``spmd.per_shard`` proved every split dimension parallel, or a contraction/sum over it
followed by the partitioner's collective) or refuses it with a reason and runs ``jax.jit(fn)``
itself, saying so once. Either way: jit's numbers (f32: rtol = atol = 1e-5) and jit's output
shardings. Which way each case goes is part of the case: a refusal the rules could have proved
wrong-free is a missed kernel; a case run per shard that should have been refused is a wrong
number, caught by the comparison. All cases run in one subprocess that sees 8 devices (the
pattern of tests/test_shard_map.py); the unit checks of the rules run in this process.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))

import vtc_jax  # noqa: E402
from vtc_jax import spmd  # noqa: E402

RTOL = ATOL = 1e-5
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _mesh2():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def _mesh2_explicit():
    """``jax.make_mesh``'s default on jax >= 0.7: Explicit axes (sharding in types)."""
    return jax.make_mesh((2, 4), ("data", "model"))


def _mesh1():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ---- the cases: (name, fn, [(shape, spec)], mesh, expected) -----------------------------------
# expected: "per shard" (with the collectives named) or "refused: <words of the reason>"

def rows_plus_index(x):
    return x * 2 + jnp.arange(x.shape[0], dtype=x.dtype)[:, None]          # iota along the split rows


def column_sums(x):
    return jnp.tanh(jnp.sum(x, axis=0)) + jnp.max(x, axis=0) - jnp.min(x, axis=0)   # psum, pmax, pmin


def softmax_rows(x, w):
    return jax.nn.softmax((x @ w) / 8, axis=-1)                            # a jit call, a custom_jvp


def heads(x, w):
    y = (x @ w).reshape(x.shape[0], 4, -1)                                 # (B, H*D) -> (B, H, D)
    return jnp.tanh(y.transpose(1, 0, 2))


def row_parallel(h, w):
    return jax.nn.gelu(h @ w)                                              # contraction over the split: psum


def contract_and_keep(x, w, v):
    return heads(x, w) * v.reshape(v.shape[0], 4, -1).transpose(1, 0, 2)   # contracts over x's split, keeps it on v


def mixed_axes(x, y, w):
    return heads(x + y, w)


def cache_update(cache, row, pos):
    cache = lax.dynamic_update_slice(cache, row[:, None], (0, pos, 0))
    return cache, jnp.tanh(cache.transpose(0, 2, 1)) * 2


def rows_reversed(x):
    return jnp.tanh(x)[::-1]


def with_constraint(x, w):
    mesh = _mesh2()
    y = lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P("data", "model")))
    return jnp.tanh(y) * 3


def scan_over_time(x, w):
    """A recurrence over time (dim 1, whole) of a batch split over ``data``: the scan's body runs
    per shard (its carry and xs keep the batch split; the scanned dim stays whole)."""
    def body(c, xt):
        c = jnp.tanh(c @ w + xt)
        return c, c
    _, ys = lax.scan(body, jnp.zeros((x.shape[0], w.shape[0])), x.transpose(1, 0, 2))
    return jnp.tanh(ys.transpose(1, 2, 0)) * 2


def scanned_layers(x, w1, w2):
    """Layers stacked and scanned (MaxText's scan_layers), Megatron-split weights: column-parallel
    up, row-parallel down (a psum inside the body)."""
    def layer(h, ws):
        a, b = ws
        return h + jnp.tanh(h @ a).reshape(h.shape[0], 4, -1).reshape(h.shape[0], -1) @ b, None
    return lax.scan(layer, x, (w1, w2))[0]


CASES = {
    "iota along split rows": (rows_plus_index, [((16, 8), P("x", None))], _mesh1, "per shard"),
    "sum, max, min over split rows": (column_sums, [((16, 8), P("x", None))], _mesh1, "per shard: psum pmax pmin"),
    "softmax of a data-parallel matmul": (softmax_rows, [((16, 32), P("data", None)), ((32, 16), P())], _mesh2,
                                          "per shard"),
    "column-parallel heads (compound reshape)": (heads, [((8, 32), P()), ((32, 64), P(None, "model"))], _mesh2,
                                                 "per shard"),
    "row-parallel matmul": (row_parallel, [((8, 32), P(None, "model")), ((32, 16), P("model", None))], _mesh2,
                            "per shard: psum"),
    "2-D split over (data, model)": (rows_plus_index, [((16, 8), P(("data", "model"), None))], _mesh2, "per shard"),
    "heads not divisible by the split": (heads, [((8, 8), P()), ((8, 8), P(None, "x"))], _mesh1,
                                         "refused: does not split"),
    "contraction mixing blocks of its result": (contract_and_keep, [((8, 32), P(None, "x")), ((32, 16), P()),
                                                                    ((8, 16), P(None, "x"))], _mesh1,
                                                "refused: split twice"),
    "two axes on one dimension": (mixed_axes, [((16, 8), P("data", None)), ((16, 8), P("model", None)), ((8, 16), P())], _mesh2,
                                  "refused: split over"),
    "cache update on a split batch": (cache_update, [((8, 16, 4), P("x")), ((8, 4), P("x")), ((), P())], _mesh1,
                                      "per shard"),
    "cache update at a split position": (cache_update, [((8, 16, 4), P(None, "x")), ((8, 4), P()), ((), P())],
                                         _mesh1, "refused: update at a runtime start"),
    "rows reversed": (rows_reversed, [((16, 8), P("x"))], _mesh1, "refused: rev"),
    "with_sharding_constraint": (with_constraint, [((16, 32), P("data")), ((32, 16), P())], _mesh2, "per shard"),
    "explicit axes: column-parallel heads": (heads, [((16, 32), P("data")), ((32, 64), P(None, "model"))],
                                             _mesh2_explicit, "per shard"),
    "explicit axes: data-parallel softmax": (softmax_rows, [((16, 32), P("data", None)), ((32, 16), P())],
                                             _mesh2_explicit, "per shard"),
    "scan over a split batch": (scan_over_time, [((8, 4, 16), P("data")), ((16, 16), P())], _mesh2,
                                "per shard"),
    "scan along a split time": (scan_over_time, [((8, 4, 16), P(None, "model")), ((16, 16), P())], _mesh2,
                                "refused: a scanned dimension"),
    "scanned layers, row-parallel": (scanned_layers, [((4, 16), P()), ((3, 16, 32), P(None, None, "model")),
                                                      ((3, 32, 16), P(None, "model", None))], _mesh2,
                                     "per shard: psum"),
}


def _args(specs, mesh):
    out = []
    for i, (shape, spec) in enumerate(specs):
        if shape == ():
            out.append(jax.device_put(jnp.int32(5), NamedSharding(mesh, spec)))
        else:
            out.append(jax.device_put(_rand(shape, i), NamedSharding(mesh, spec)))
    return out


def run_case(name):
    fn, specs, mesh_of, expected = CASES[name]
    mesh = mesh_of()
    args = _args(specs, mesh)
    opt = vtc_jax.optimize(fn, backend="interpret", guard=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = opt(*args)
    said = [str(r.message) for r in rec if issubclass(r.category, (vtc_jax.VTCNotice, vtc_jax.VTCFallbackWarning))]
    ref = jax.jit(fn)(*args)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (name, a.sharding, b.sharding)
    closed = jax.make_jaxpr(fn)(*args)
    if expected.startswith("per shard"):
        assert not said, (name, said)
        plan = spmd.per_shard(closed, [a.sharding for a in args])
        names = sorted(c.split()[0] for c in plan.collectives)
        assert names == sorted(expected.partition(":")[2].split()), (name, plan.collectives)
        mine, jits = (opt.lower(*args).compile().as_text(), jax.jit(fn).lower(*args).compile().as_text())
        extra = {k: (mine.count(k), jits.count(k)) for k in COLLECTIVES if mine.count(k) > jits.count(k)}
        assert not extra, (name, extra)
    else:
        words = expected.partition(": ")[2]
        try:
            spmd.per_shard(closed, [a.sharding for a in args])
        except spmd.Refused as why:
            assert words in str(why), (name, str(why))
        else:
            raise AssertionError(f"{name}: run per shard, expected a refusal ({words})")
        notes = [m for m in said if "plain jax.jit" in m]
        assert len(notes) == 1 and words in notes[0], (name, said)
    print(f"{name}: {expected}")


# ---- in this process: the rules' own units --------------------------------------------------

def test_reshape_groups():
    """Dims grouped by equal products, size-1 dims alone: the split may only ride a group's
    leading dim."""
    assert list(spmd._groups((8, 32), (8, 4, 8))) == [([0], [0]), ([1], [1, 2])]
    assert list(spmd._groups((2, 1, 6), (12,))) == [([0, 1, 2], [0])]   # a 1 inside a group stays in it
    assert list(spmd._groups((1, 12), (3, 4))) == [([0], []), ([1], [0, 1])]


def test_every_rule_names_a_primitive_the_table_knows():
    """A rule for a primitive vtc_jax has no row for would be a typo: one vocabulary."""
    from vtc_jax.primitives import TABLE
    extra = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "optimization_barrier"}
    assert set(spmd.RULES) - set(TABLE) <= extra, set(spmd.RULES) - set(TABLE) - extra


@pytest.mark.parametrize("name", sorted(CASES))
def test_spmd(name):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env,
                          cwd=str(ROOT), timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.strip().splitlines()[-1].startswith(name), proc.stdout


# ---- fuzz: the rules against jit on random programs and random shardings ---------------------

FUZZ_EXAMPLES = 120 * int(os.environ.get("VTC_FUZZ_EXAMPLES", "1"))   # VTC_FUZZ_EXAMPLES=N: N times more


def fuzz() -> None:
    """The programs of tests/test_fuzz_optimize.py (movement chains between matmuls, reductions,
    pointwise ops and decode attention), each input split at random over a (2, 2) mesh (every dim
    that 2 divides, with probability 1/2, over one axis or both). Where ``per_shard`` plans, its
    program (``jax.jit(plan)``, no kernels: the rules are what is tested) must equal
    ``jax.jit(fn)`` — a wrong rule is a wrong number; where it refuses, it must say why. At least
    a third of the drawn programs must run per shard, with a collective in some (else the test
    would prove nothing)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hypothesis import given
    from hypothesis import strategies as st
    import test_fuzz_optimize as tf

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    tally = {"per shard": 0, "refused": 0, "collectives": 0}

    @tf.fuzz_settings(FUZZ_EXAMPLES)
    @given(st.one_of(tf.pipelines(["matmul"]), tf.pipelines(["pointwise", "reduction", "input"]), tf.meetings(),
                     tf.attentions()), st.randoms(use_true_random=False))
    def check(prog, rnd):
        fn = prog.make()
        args = prog.inputs()
        specs = [P()]
        for a in args[1:]:
            entries, used = [], set()
            for n in a.shape:
                pick = rnd.choice([None, None, ("a",), ("b",), ("a", "b")]) if n % 2 == 0 else None
                if pick == ("a", "b") and n % 4:
                    pick = ("a",)
                if pick is None or used & set(pick):
                    entries.append(None)
                    continue
                used |= set(pick)
                entries.append(pick[0] if len(pick) == 1 else pick)
            specs.append(P(*entries))
        placed = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        closed = jax.make_jaxpr(fn)(*placed)
        try:
            plan = spmd.per_shard(closed, [x.sharding for x in placed])
        except spmd.Refused as why:
            assert str(why), "a refusal without a reason"
            tally["refused"] += 1
            return
        tally["per shard"] += 1
        tally["collectives"] += bool(plan.collectives)
        out = jax.jit(plan)(*placed)
        ref = jax.tree.leaves(jax.jit(fn)(*placed))
        tf._judge(prog, fn, args, list(out), ref)

    check()
    print("fuzz tally", tally)
    assert tally["per shard"] >= (tally["per shard"] + tally["refused"]) / 3, tally
    assert tally["collectives"] > 0, tally


def test_spmd_fuzz():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, __file__, "--fuzz"], capture_output=True, text=True, env=env,
                          cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, f"fuzz failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-8000:]}"
    print(proc.stdout)


if __name__ == "__main__":   # one case (or the fuzz), in a process that sees 8 host devices
    assert len(jax.devices()) >= 8, jax.devices()
    if sys.argv[1] == "--fuzz":
        fuzz()
    else:
        run_case(sys.argv[1])


def test_literal_operands_of_any_primitive_are_no_internal_error():
    """A primitive with no rule, or a one-to-one rule, given a literal operand (a ``while`` from a
    literal start, a ``cumsum`` of a literal-derived value) is pinned, never a crash: the rules'
    shapes of literals are the literals' own. One device: a 1-way split, per shard trivially."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))

    def fn(x):
        n = lax.while_loop(lambda c: c < 3, lambda c: c + 1, 0)
        return x * n + jnp.cumsum(x, axis=1)

    x = jnp.ones((4, 8), jnp.float32)
    closed = jax.make_jaxpr(fn)(x)
    plan = spmd.per_shard(closed, [NamedSharding(mesh, P("x", None))])
    assert plan.in_specs == (P("x", None),)
    np.testing.assert_allclose(jax.jit(plan)(x)[0], jax.jit(fn)(x), rtol=RTOL, atol=ATOL)
