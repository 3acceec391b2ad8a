"""shard_map: its body optimised per shard like a scan body, and ``shard_map(optimize(body))``.

jax sees 8 host devices only if ``XLA_FLAGS`` says so before it starts, and the rest of the suite
runs on one: each check below runs in a subprocess of its own with
``--xla_force_host_platform_device_count=8`` (and this worktree first on ``PYTHONPATH``); the
test is its exit status. Every result is compared with ``jax.jit`` of the same function (f32:
rtol 1e-5, atol 1e-5).

Pallas's interpreter (the CPU backend) cannot run a kernel on values typed as varying over a
manual axis (``check_vma=True``, jax's default: jax rejects the kernel body's own invariant
indices next to the varying blocks when it lowers the call). So kernels are *run* here inside
``check_vma=False`` bodies, and under the default checking the kernels' types are checked by
tracing with ``backend="triton"`` (each kernel lowered for CUDA; jax < 0.11: the whole program too)
while interpret mode runs the body as plain XLA, saying so once.
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
from jax.sharding import PartitionSpec as P

import vtc_jax
from vtc_jax.compat import JAX_VERSION, TritonBackendDeprecation, varying_axes
from vtc_jax.program import INTERPRET_VARYING
from vtc_jax.testing import cross_lower

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4
RTOL = ATOL = 1e-5
B, D, H = 32, 64, 4   # global rows, features, heads: 8 rows per shard


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), ("x",))


def chain(x, w):
    """matmul -> reshape -> transpose -> tanh: one matmul kernel writing through the transpose."""
    y = (x @ w).reshape(x.shape[0], H, D // H).transpose(1, 0, 2)
    return jnp.tanh(y)


def chain_psum(x, w):
    """The chain, then a collective: the psum stays an opaque op inside the body."""
    y = chain(x, w)
    return jax.lax.psum(y, "x") + y


def sharded(body, check_vma, out_specs=P(None, "x")):
    mesh = _mesh()

    def fn(x, w):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=out_specs,
                             check_vma=check_vma)(x, w)
    return fn


def _args():
    return (jax.random.normal(jax.random.PRNGKey(0), (B, D), jnp.float32),
            jax.random.normal(jax.random.PRNGKey(1), (D, D), jnp.float32) / 8)


def _run(fn, *args):
    """``fn(*args)`` and the VTCFallbackWarnings it raised (their messages)."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in rec if issubclass(w.category, vtc_jax.VTCFallbackWarning)]


def _shard_map_bodies(jaxpr):
    """The body jaxprs of every shard_map equation, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            out.append(eqn.params["jaxpr"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(_shard_map_bodies(inner))
    return out


def _flat_eqns(jaxpr):
    """Every equation, those of nested jaxprs (a jit inside the body, a kernel's own) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _flat_eqns(inner)


def _prims(jaxpr):
    return {e.primitive.name for e in _flat_eqns(jaxpr)}


def _kernels(jaxpr):
    return [e for e in _flat_eqns(jaxpr) if e.primitive.name == "pallas_call"]


# ---- the checks (each runs in a subprocess with 8 host devices) ------------------------------

CHECKS = {}


def check(f):
    CHECKS[f.__name__] = f
    return f


@check
def body_optimised_equals_jit():
    """A shard_map in the traced program is kept (re-bound, no wholesale fallback) and its body
    gets a kernel, on per-shard shapes; same numbers as jit, no fallback warning."""
    args = _args()
    fn = sharded(chain, check_vma=False)
    opt = vtc_jax.optimize(fn, backend="interpret", guard=None)
    out, warned = _run(opt, *args)
    assert not warned, warned
    np.testing.assert_allclose(out, jax.jit(fn)(*args), rtol=RTOL, atol=ATOL)
    assert out.shape == (H, B, D // H)
    assert [b.split(" #")[0] for b in opt._build.bodies] == ["shard_map"], opt._build.bodies
    (body,) = _shard_map_bodies(jax.make_jaxpr(opt)(*args).jaxpr)
    assert "pallas_call" in _prims(body)
    sizes = {int(np.prod(v.aval.shape)) for e in _kernels(body) for v in e.invars}
    assert (B // DEVICES) * D in sizes and B * D not in sizes, sizes   # the kernel reads x's shard


@check
def psum_in_body_stays_correct():
    """A collective in the body stays an opaque op next to the kernel; numbers equal jit."""
    args = _args()
    fn = sharded(chain_psum, check_vma=False)
    opt = vtc_jax.optimize(fn, backend="interpret", guard=None)
    out, warned = _run(opt, *args)
    assert not warned, warned
    np.testing.assert_allclose(out, jax.jit(fn)(*args), rtol=RTOL, atol=ATOL)
    (body,) = _shard_map_bodies(jax.make_jaxpr(opt)(*args).jaxpr)
    assert "pallas_call" in _prims(body) and any(p.startswith("psum") for p in _prims(body)), _prims(body)


@check
def body_without_kernels_is_kept():
    """A body VTC has nothing to do in (a collective and an add) runs as traced: no failure."""
    args = _args()

    def body(x, w):
        return jax.lax.psum(x, "x") + x

    fn = sharded(body, check_vma=True, out_specs=P("x"))
    out, warned = _run(vtc_jax.optimize(fn, backend="interpret", guard=None), *args)
    assert not [m for m in warned if "failed" in m], warned
    np.testing.assert_allclose(out, jax.jit(fn)(*args), rtol=RTOL, atol=ATOL)


@check
def default_checking_in_interpret_mode_equals_jit():
    """check_vma=True on the CPU: the function and ``shard_map(optimize(body))`` equal jit; the
    interpreter's limit is said once (not 'optimisation failed'), the body runs as XLA."""
    args = _args()
    for body in (chain, chain_psum):
        fn = sharded(body, check_vma=True)
        ref = jax.jit(fn)(*args)
        out, warned = _run(vtc_jax.optimize(fn, backend="interpret", guard=None), *args)
        np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
        assert warned and all(INTERPRET_VARYING in m for m in warned), warned
        inner = jax.jit(jax.shard_map(vtc_jax.optimize(body, backend="interpret", guard=None), mesh=_mesh(),
                                      in_specs=(P("x"), P()), out_specs=P(None, "x")))
        out, warned = _run(inner, *args)
        np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
        assert warned and all(INTERPRET_VARYING in m for m in warned), warned


@check
def optimize_inside_shard_map_runs_kernels():
    """``shard_map(optimize(body))`` (check_vma=False): kernels run in the body; equals jit. The
    body's psum is, to ``optimize``, an opaque primitive of the function it was given: said so."""
    args = _args()
    g = jax.jit(jax.shard_map(vtc_jax.optimize(chain_psum, backend="interpret", guard=None), mesh=_mesh(),
                              in_specs=(P("x"), P()), out_specs=P(None, "x"), check_vma=False))
    out, warned = _run(g, *args)
    assert all(m.startswith("vtc_jax: unsupported primitive psum") for m in warned), warned
    np.testing.assert_allclose(out, jax.jit(sharded(chain_psum, False))(*args), rtol=RTOL, atol=ATOL)
    assert "pallas_call" in _prims(jax.make_jaxpr(g)(*args).jaxpr)


@check
def default_checking_kernels_are_typed_varying():
    """check_vma=True with Triton kernels (traced on the CPU, each kernel lowered for CUDA):
    the kernels' outputs vary over the manual axis as jax's own ops would, both when the body of
    a traced shard_map is optimised and for ``shard_map(optimize(body))``."""
    sds = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _args())
    outer = vtc_jax.optimize(sharded(chain_psum, True), backend="triton", guard=None, strict=True)
    inner = jax.shard_map(vtc_jax.optimize(chain, backend="triton", guard=None, strict=True), mesh=_mesh(),
                          in_specs=(P("x"), P()), out_specs=P(None, "x"))
    for fn in (outer, inner):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TritonBackendDeprecation)
            (body,) = _shard_map_bodies(jax.make_jaxpr(fn)(*sds).jaxpr)
        kernels = _kernels(body)
        assert kernels, _prims(body)
        for e in kernels:
            assert all(varying_axes(v.aval) == {"x"} for v in e.outvars), [v.aval for v in e.outvars]
        if JAX_VERSION < (0, 11):   # jax >= 0.11 lowers for CUDA in a one-device H100 mesh, not a 4-CPU one
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TritonBackendDeprecation)
                assert cross_lower(fn, *sds).triton_kernels



def _collectives(compiled_text: str) -> dict[str, int]:
    return {k: compiled_text.count(k) for k in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                                                "collective-permute")}


def reversed_rows(x, w):
    """The chain with its rows reversed: a shard's block of rows is another shard's."""
    return chain(x, w)[:, ::-1]


@check
def sharded_inputs_run_per_shard():
    """Inputs sharded over several devices (jax's SPMD partitioner, no shard_map): the program is
    rewritten to run per shard (``spmd.per_shard``) and its kernels see their rows, silently: jit's
    numbers, jit's output sharding, no more collectives than jit's. (Before: a Pallas call is opaque
    to the partitioner, which gathered its operands: a replicated output, three all-reduces.)
    Derivatives are fn's own, partitioned as under jit; ``vmap`` batches the per-shard program."""
    mesh = _mesh()
    x, w = _args()
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("x", None)))
    ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, P()))
    opt = vtc_jax.optimize(chain, backend="interpret", guard=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = opt(xs, ws)
    said = [str(r.message) for r in rec if issubclass(r.category, (vtc_jax.VTCNotice, vtc_jax.VTCFallbackWarning))]
    assert not said, said
    ref = jax.jit(chain)(xs, ws)
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    assert out.sharding.is_equivalent_to(ref.sharding, out.ndim), (out.sharding, ref.sharding)
    assert "pallas_call" in str(opt.trace(xs, ws).jaxpr)
    mine, jits = (_collectives(f.lower(xs, ws).compile().as_text()) for f in (opt, jax.jit(chain)))
    assert all(mine[k] <= jits[k] for k in mine), (mine, jits)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) ** 2)   # noqa: E731
    for g, r in zip(jax.grad(loss(opt), argnums=(0, 1))(xs, ws), jax.grad(loss(chain), argnums=(0, 1))(xs, ws)):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL)
    rep = jax.device_put(x, jax.sharding.NamedSharding(mesh, P()))
    np.testing.assert_allclose(opt(rep, ws), jax.jit(chain)(rep, ws), rtol=RTOL, atol=ATOL)
    assert "pallas_call" in _prims(jax.make_jaxpr(opt)(rep, ws).jaxpr)   # replicated: VTC's program


@check
def sharded_inputs_that_cannot_run_per_shard_keep_jit():
    """Rows reversed along the split dimension cannot run per shard: ``optimize`` runs
    ``jax.jit(fn)`` itself and says why once (a notice, not a fallback): jit's output sharding,
    jit's collectives, jit's numbers."""
    mesh = _mesh()
    x, w = _args()
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("x", None)))
    ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, P()))
    opt = vtc_jax.optimize(reversed_rows, backend="interpret", guard=None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = opt(xs, ws)
        opt(xs, ws)
    notes = [str(r.message) for r in rec if issubclass(r.category, vtc_jax.VTCNotice) and "sharded" in str(r.message)]
    assert len(notes) == 1 and "plain jax.jit" in notes[0] and "rev" in notes[0], [str(r.message) for r in rec]
    assert not [r for r in rec if issubclass(r.category, vtc_jax.VTCFallbackWarning)], rec
    ref = jax.jit(reversed_rows)(xs, ws)
    np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
    assert out.sharding == ref.sharding, (out.sharding, ref.sharding)
    assert _collectives(opt.lower(xs, ws).compile().as_text()) == \
        _collectives(jax.jit(reversed_rows).lower(xs, ws).compile().as_text())

# ---- the tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CHECKS))
def test_shard_map(name):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, env=env,
                          cwd=str(ROOT), timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert f"ok {name}" in proc.stdout


if __name__ == "__main__":   # one check, in a process that sees 8 host devices
    assert len(jax.devices()) >= DEVICES, jax.devices()
    assert Path(vtc_jax.__file__).resolve().parents[1] == ROOT, vtc_jax.__file__
    CHECKS[sys.argv[1]]()
    print(f"ok {sys.argv[1]}")
