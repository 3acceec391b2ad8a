"""Virtual tensor I/O through a copy kernel: every access path (strided box, gather/scatter,
several pieces, masks, runtime symbols, in-place outputs) equals the layout's numpy semantics,
in interpret mode and cross-lowered to Triton IR."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from vtc_jax.indexmap import Layout, SymInfo, sym
from vtc_jax.kernels.vio import Plan, VTensor
from vtc_jax.testing import check_kernel

RNG = np.random.default_rng(0)


def _copy(x: VTensor, out: VTensor, block, backend):
    plan = Plan.build([x], [out])
    grid = tuple(-(-n // b) for n, b in zip(x.shape, block))

    def body(ins, outs):
        origin = tuple(pl.program_id(k) * b for k, b in enumerate(block))
        outs[0].store(origin, block, ins[0].load(origin, block))

    return plan.call(body, grid=grid, backend=backend)[0]


def check_read_case(layout, bufs, block):
    """Copy a virtual input into a fresh physical output; reference = Layout.evaluate."""
    ref = layout.evaluate({i: np.asarray(b) for i, b in enumerate(bufs)})

    def call(*bufs, backend):
        v = VTensor(layout, bufs[0].dtype, tuple(bufs))
        return _copy(v, VTensor.fresh(layout.shape, bufs[0].dtype), block, backend)[0]

    check_kernel(call, lambda *b: ref, bufs, rtol=0, atol=0)


A = jnp.asarray(RNG.standard_normal((20, 36)), jnp.float32)
B = jnp.asarray(RNG.standard_normal((20, 12)), jnp.float32)
K = jnp.asarray(RNG.standard_normal((2, 5, 3)), jnp.float32)


@pytest.mark.parametrize("name,layout,bufs,block", [
    ("transpose", Layout.physical(0, (20, 36)).transpose((1, 0)), (A,), (8, 16)),
    ("slice", Layout.physical(0, (20, 36)).slice((3, 4), (20, 30)), (A,), (8, 16)),
    ("rev+strided (gather)", Layout.physical(0, (20, 36)).rev((1,)).slice((0, 0), (20, 36), (2, 3)), (A,), (8, 16)),
    ("concat+pad", Layout.concatenate([Layout.physical(0, (20, 36)), Layout.physical(1, (20, 12))], 1)
     .pad((1, 0), (2, 3), (0, 0), -1.0), (A, B), (8, 16)),
    ("broadcast (GQA repeat)", Layout.physical(0, (2, 5, 3)).expand_dims((2,))
     .broadcast((2, 5, 4, 3), (0, 1, 2, 3)).reshape((2, 20, 3)), (K,), (2, 8, 4)),
    ("reshape of transpose (div/mod)", Layout.physical(0, (20, 36)).transpose((1, 0)).reshape((20, 36)), (A,), (8, 16)),
])
def test_read_paths(name, layout, bufs, block):
    check_read_case(layout, bufs, block)


def test_write_qkv_into_three_buffers_at_pos():
    """The paper's Fig. 3: one (B, 48) output lands in Q, the K cache and the V cache at ``pos``."""
    nb, t = 3, 10
    x = jnp.asarray(RNG.standard_normal((nb, 48)), jnp.float32)
    kc = jnp.asarray(RNG.standard_normal((nb, t, 2, 8)), jnp.float32)
    vc = jnp.asarray(RNG.standard_normal((nb, t, 2, 8)), jnp.float32)
    pos = jnp.int32(4)
    info = [SymInfo("pos", 0, t - 1)]
    q = Layout.physical(0, (nb, 1, 4, 4)).reshape((nb, 16))
    k = Layout.physical(1, (nb, t, 2, 8)).dynamic_slice([0, sym("pos"), 0, 0], (nb, 1, 2, 8), info).reshape((nb, 16))
    v = Layout.physical(2, (nb, t, 2, 8)).dynamic_slice([0, sym("pos"), 0, 0], (nb, 1, 2, 8), info).reshape((nb, 16))
    layout = Layout.concatenate([q, k, v], 1)

    def call(x, kc, vc, pos, *, backend):
        out = VTensor(layout, jnp.float32, (jax.ShapeDtypeStruct((nb, 1, 4, 4), jnp.float32), kc, vc),
                      (("pos", pos),))
        return _copy(VTensor.physical(x), out, (4, 16), backend)

    def ref(x, kc, vc, pos):
        kk = np.asarray(kc).copy()
        vv = np.asarray(vc).copy()
        kk[:, 4] = np.asarray(x[:, 16:32]).reshape(nb, 2, 8)
        vv[:, 4] = np.asarray(x[:, 32:]).reshape(nb, 2, 8)
        return np.asarray(x[:, :16]).reshape(nb, 1, 4, 4), kk, vv

    res = check_kernel(call, ref, (x, kc, vc, pos), rtol=0, atol=0)
    assert res.text.count("tf.aliasing_output") >= 2 or "output_operand_alias" in res.text


def test_symbol_missing_is_a_clear_error():
    lay = Layout.physical(0, (4, 8)).dynamic_slice([sym("p"), 0], (2, 8), [SymInfo("p", 0, 2)])
    with pytest.raises(ValueError, match="runtime symbols"):
        VTensor(lay, jnp.float32, (jnp.zeros((4, 8)),))
