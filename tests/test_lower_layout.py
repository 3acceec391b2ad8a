"""lower's element-wise boundary with XLA runs the layout evaluator with jax.numpy: on random
layouts its gather equals the numpy reference, its window read (where a layout is one) too, and
scattering what was gathered writes back exactly the elements the layout reads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
pytest.importorskip("hypothesis", reason="property tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.test_indexmap import LAX_COMPILE_OPTIONS, random_chain
from vtc_jax.indexmap import point
from vtc_jax.lower import _gather, _scatter, _unit_window, _window


@settings(max_examples=40, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_gather_window_scatter_match_the_reference(data):
    c = random_chain(data)
    lay = c.layout
    want = lay.evaluate(c.buffers, c.symbols)

    def run(buffers, symbols):
        got = _gather(lay, np.float32, buffers, symbols)
        win = _window(lay, np.float32, buffers, symbols)
        back = [_scatter(p, got, jnp.zeros_like(buffers[p.target]), symbols) for p in lay.pieces]
        return got, win, back

    syms = {k: np.int32(v) for k, v in c.symbols.items()}
    got, win, back = jax.jit(run).lower(c.buffers, syms).compile(LAX_COMPILE_OPTIONS)(c.buffers, syms)
    msg = " -> ".join(c.steps) + f"\n{lay}"
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=msg)
    assert (win is None) == (_unit_window(lay) is None or (lay.pieces[0].target not in c.buffers)), msg
    if win is not None:
        np.testing.assert_array_equal(np.asarray(win), want, err_msg=msg)
    idx = list(np.indices(lay.shape, dtype=np.int64)) if lay.shape else []
    at = point(idx, c.symbols)
    for p, b in zip(lay.pieces, back):
        buf = c.buffers[p.target]
        held = np.broadcast_to(True if p.holds(at) is None else p.holds(at), lay.shape)
        touched = np.zeros(buf.shape, bool)
        tgt = tuple(np.broadcast_to(t, lay.shape)[held] for t in p.map.targets(at))
        touched[tgt] = True
        np.testing.assert_array_equal(np.asarray(b), np.where(touched, buf, 0), err_msg=msg)
