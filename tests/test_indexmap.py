"""The index-map algebra: random movement chains against jax.lax, and hand-computed cases.

The backbone property (ARCHITECTURE.md, "Index maps"): for a random chain of movement ops, the
composed `Layout` evaluated on the physical numpy buffers equals the same ops applied with jax.lax.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
pytest.importorskip("hypothesis", reason="property tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax import lax

from vtc_jax.indexmap import (Dim, IndexMap, Layout, NotComposable, SymInfo, all_of, conds_mask, const, dim,
                              point, row_major_strides, sym)

MAX_ELEMS = 2000
MAX_RANK = 4
# One XLA compile per chain dominates the run time: tiny programs need no optimisation.
LAX_COMPILE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class Chain:
    """A virtual tensor under construction: its Layout, the lax reference value, the physical
    buffers and runtime symbols the Layout needs."""

    def __init__(self, data, fill: float):
        self.data, self.fill = data, fill
        self.buffers: dict[int, np.ndarray] = {}
        self.symbols: dict[str, int] = {}  # the symbols' (clamped) runtime values
        self.raw: dict[str, int] = {}      # the raw dynamic starts given to lax
        self.fns: list = []                # the lax program, one closure per op
        self.steps: list[str] = []
        shape = tuple(self.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        self.fresh(shape)
        self.layout = Layout.physical(0, shape)

    def draw(self, strategy):
        return self.data.draw(strategy)

    def fresh(self, shape) -> np.ndarray:
        """A new physical tensor; values are distinct across all buffers and never equal the fill."""
        tid = len(self.buffers)
        rng = np.random.default_rng(self.draw(st.integers(0, 2**32 - 1)))
        self.buffers[tid] = (rng.permutation(math.prod(shape)) + 1 + 10_000 * tid).astype(np.float32).reshape(shape)
        return self.buffers[tid]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    def fits(self, shape) -> bool:
        return len(shape) <= MAX_RANK and 0 < math.prod(shape) <= MAX_ELEMS and min(shape, default=1) >= 1


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


# Each op: draws its parameters, returns (new layout, lax closure (x, raw starts) -> y, description),
# or None when it does not apply to the current shape.

def op_transpose(c):
    perm = c.draw(st.permutations(range(len(c.shape))))
    return c.layout.transpose(perm), lambda x, e: lax.transpose(x, perm), f"transpose{tuple(perm)}"


def op_reshape(c):
    shape = list(c.shape)
    if shape and c.draw(st.booleans()):  # a clean merge of adjacent dims or split of one dim
        i = c.draw(st.integers(0, len(shape) - 1))
        fs = _factors(shape[i])
        if len(fs) > 1 and len(shape) < MAX_RANK and c.draw(st.booleans()):
            a = math.prod(fs[:c.draw(st.integers(1, len(fs) - 1))])
            shape[i:i + 1] = [a, shape[i] // a]
        elif i + 1 < len(shape):
            shape[i:i + 2] = [shape[i] * shape[i + 1]]
    else:  # any factorisation of the element count
        fs = c.draw(st.permutations(_factors(math.prod(shape))))
        k = c.draw(st.integers(1, MAX_RANK))
        cuts = sorted(c.draw(st.lists(st.integers(0, len(fs)), min_size=k - 1, max_size=k - 1)))
        shape = [math.prod(fs[a:b]) for a, b in zip([0] + cuts, cuts + [len(fs)])]
    return c.layout.reshape(shape), lambda x, e: lax.reshape(x, tuple(shape)), f"reshape{tuple(shape)}"


def op_slice(c):
    start, limit, strides = [], [], []
    for n in c.shape:
        s = c.draw(st.integers(0, n - 1))
        start.append(s)
        limit.append(c.draw(st.integers(s + 1, n)))
        strides.append(c.draw(st.integers(1, 3)))
    return (c.layout.slice(start, limit, strides), lambda x, e: lax.slice(x, start, limit, strides),
            f"slice{start, limit, strides}")


def op_expand_dims(c):
    if len(c.shape) >= MAX_RANK:
        return None
    d = c.draw(st.integers(0, len(c.shape)))
    return c.layout.expand_dims([d]), lambda x, e: lax.expand_dims(x, (d,)), f"expand_dims({d})"


def op_squeeze(c):
    ones = [i for i, n in enumerate(c.shape) if n == 1]
    if not ones:
        return None
    dims = c.draw(st.lists(st.sampled_from(ones), min_size=1, unique=True))
    return c.layout.squeeze(dims), lambda x, e: lax.squeeze(x, dims), f"squeeze{tuple(dims)}"


def op_broadcast(c):
    r = len(c.shape)
    r2 = c.draw(st.integers(max(r, 1), MAX_RANK))
    bdims = sorted(c.draw(st.lists(st.integers(0, r2 - 1), min_size=r, max_size=r, unique=True)))
    shape = [c.draw(st.integers(1, 3)) for _ in range(r2)]
    for j, bd in enumerate(bdims):
        shape[bd] = c.shape[j] if c.shape[j] != 1 else c.draw(st.integers(1, 3))
    if not c.fits(shape):
        return None
    return (c.layout.broadcast(shape, bdims), lambda x, e: lax.broadcast_in_dim(x, shape, bdims),
            f"broadcast{tuple(shape), tuple(bdims)}")


def op_concatenate(c):
    if not c.shape:
        return None
    axis = c.draw(st.integers(0, len(c.shape) - 1))
    shape = list(c.shape)
    shape[axis] = c.draw(st.integers(1, 3))
    grown = list(c.shape)
    grown[axis] += shape[axis]
    if not c.fits(grown):
        return None
    tid = len(c.buffers)
    other, lay = c.fresh(tuple(shape)), Layout.physical(tid, shape)
    # the other operand may be padded with its own fill (a concat of differently filled pads)
    pad_cfg = [(0, 0, 0)] * len(shape)
    fill = c.draw(st.sampled_from([None, 0.0, 1.0, -7.0]))
    if fill is not None:
        lo = c.draw(st.integers(0, 2))
        if lo and c.fits([g + lo if k == axis else g for k, g in enumerate(grown)]):
            pad_cfg[axis] = (lo, 0, 0)
            lay = lay.pad([p[0] for p in pad_cfg], [0] * len(shape), [0] * len(shape), fill)
    padded = lambda: other if pad_cfg[axis] == (0, 0, 0) else lax.pad(other, np.float32(fill), pad_cfg)
    first = c.draw(st.booleans())
    lays = [c.layout, lay] if first else [lay, c.layout]
    return (Layout.concatenate(lays, axis),
            lambda x, e: lax.concatenate([x, padded()] if first else [padded(), x], axis),
            f"concatenate(t{tid} padded {pad_cfg} with {fill}, axis={axis}, first={first})")


def op_split(c):
    axes = [i for i, n in enumerate(c.shape) if n >= 2]
    if not axes:
        return None
    axis = c.draw(st.sampled_from(axes))
    n = c.shape[axis]
    cuts = sorted(set(c.draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=2))))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    k = c.draw(st.integers(0, len(sizes) - 1))
    off = sum(sizes[:k])
    return (c.layout.offset(axis, off, sizes[k]), lambda x, e: lax.split(x, sizes, axis)[k],
            f"split({sizes}, axis={axis})[{k}]")


def op_rev(c):
    if not c.shape:
        return None
    dims = c.draw(st.lists(st.integers(0, len(c.shape) - 1), unique=True))
    return c.layout.rev(dims), lambda x, e: lax.rev(x, dims), f"rev{tuple(dims)}"


def op_pad(c):
    if not c.shape:
        return None
    config = []
    for n in c.shape:
        lo, hi, it = c.draw(st.integers(-2, 2)), c.draw(st.integers(-2, 2)), c.draw(st.integers(0, 2))
        if lo + hi + n + (n - 1) * it < 1:
            lo = hi = 0
        config.append((lo, hi, it))
    shape = [lo + hi + n + (n - 1) * it for (lo, hi, it), n in zip(config, c.shape)]
    if not c.fits(shape):
        return None
    lo, hi, it = zip(*config)
    fill = c.draw(st.sampled_from([c.fill, 0.0, 2.0]))   # pads in one chain may differ in fill
    return (c.layout.pad(lo, hi, it, fill), lambda x, e: lax.pad(x, np.float32(fill), config), f"pad{config} fill {fill}")


def op_dynamic_slice(c):
    sizes, starts, syms, names = [], [], [], []
    for n in c.shape:
        size = c.draw(st.integers(1, n))
        r = c.draw(st.integers(-3, n + 3))
        name = f"p{len(c.raw)}"
        c.raw[name] = r  # passed to the jitted lax program as a traced int32
        clamped = min(max(r + n if r < 0 else r, 0), n - size)  # lax wraps negatives, then clamps
        sizes.append(size)
        names.append(name)
        if c.draw(st.booleans()):  # the map sees a runtime symbol with the clamped range
            c.symbols[name] = clamped
            starts.append(sym(name))
            syms.append(SymInfo(name, 0, n - size))
        else:
            starts.append(clamped)
    return (c.layout.dynamic_slice(starts, sizes, syms),
            lambda x, e: lax.dynamic_slice(x, [e[k] for k in names], sizes),
            f"dynamic_slice({[c.raw[k] for k in names]}, {sizes})")


OPS = {f.__name__[3:]: f for f in [op_transpose, op_reshape, op_slice, op_expand_dims, op_squeeze, op_broadcast,
                                    op_concatenate, op_split, op_rev, op_pad, op_dynamic_slice]}


def random_chain(data) -> Chain:
    """A random chain of 6 to 9 movement ops on one physical tensor (others join by concatenate)."""
    c = Chain(data, fill=float(data.draw(st.sampled_from([-1.0, -2.5, 0.0]))))
    n_ops = data.draw(st.integers(6, 9))
    while len(c.steps) < n_ops:
        name = data.draw(st.sampled_from(sorted(OPS)))
        res = OPS[name](c)
        if res is None:
            continue
        c.layout, fn, step = res
        c.fns.append(fn)
        c.steps.append(step)
    return c


def _check_contiguity(m: IndexMap, symbols) -> None:
    """The claimed contiguous run really is consecutive physical elements (maps without masks)."""
    if m.conds or not m.domain:
        return
    c = m.contiguity(4)
    idx = np.indices(m.domain)
    tgt, _ = m.evaluate(point(list(idx), symbols))
    flat = sum(np.broadcast_to(t, m.domain) * s for t, s in zip(tgt, row_major_strides(m.target)))
    rows = flat.reshape(-1, c.run_elems)  # row-major: each row is one claimed run
    assert (np.diff(rows, axis=1) == 1).all(), (str(m), c)


# No shrinking: each example runs eager lax ops (slow to shrink); the failure message names the chain.
@settings(max_examples=200, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_random_chain_matches_lax(data):
    c = random_chain(data)

    def program(x, raw):
        # The barriers keep each op's own semantics: XLA's simplifier folds dynamic_slice of
        # dynamic_slice into one slice with the wrong clamp (jax 0.10.2: jit(ds(ds(x,[a],[2]),[b],[1]))
        # of [1,3,2] at a=6, b=0 gives [2.], op by op gives [3.]).
        for fn in c.fns:
            x = lax.optimization_barrier(fn(x, raw))
        return x

    raw = {k: np.int32(v) for k, v in c.raw.items()}
    want = np.asarray(jax.jit(program).lower(c.buffers[0], raw).compile(LAX_COMPILE_OPTIONS)(c.buffers[0], raw))
    got = c.layout.evaluate(c.buffers, c.symbols)
    assert got.shape == want.shape, c.steps
    np.testing.assert_array_equal(got, want, err_msg=" -> ".join(c.steps) + f"\n{c.layout}")
    for p in c.layout.pieces:
        if not p.where:
            _check_contiguity(p.map, c.symbols)


# --------------------------------------------------------------------------------------------
# Contiguity, by hand
# --------------------------------------------------------------------------------------------

def _contig(m: IndexMap, itemsize=4):
    c = m.contiguity(itemsize)
    return c.min_contiguous_dim, c.run_elems, c.run_bytes, c.full


def test_contiguity_identity():
    assert _contig(IndexMap.identity((4, 6, 8))) == (0, 192, 768, True)


def test_contiguity_transpose_last_two():
    assert _contig(IndexMap.identity((4, 6, 8)).transpose((0, 2, 1))) == (3, 1, 4, False)


def test_contiguity_transpose_keeps_innermost():
    assert _contig(IndexMap.identity((4, 6, 8)).transpose((1, 0, 2))) == (2, 8, 32, False)


def test_contiguity_slice_axis0_is_full():
    assert _contig(IndexMap.identity((16, 64)).slice((4, 0), (12, 64))) == (0, 512, 2048, True)


def test_contiguity_slice_axis1_of_wide_matrix():
    m = IndexMap.identity((4, 6144)).slice((0, 2048), (4, 3072))
    assert _contig(m, itemsize=2) == (1, 1024, 2048, False)  # bf16: 2 KiB runs
    assert m.contiguity(2).partial()


def test_contiguity_strided_slice_axis0_is_not_full():
    assert _contig(IndexMap.identity((16, 64)).slice((0, 0), (16, 64), (2, 1))) == (1, 64, 256, False)


def test_contiguity_gqa_repeat_then_transpose():
    """K cache (1, T, 8, 128) bf16 repeated to 32 heads then transposed to (1, 32, T, 128)."""
    t = 4096
    m = (IndexMap.identity((1, t, 8, 128)).expand_dims([3]).broadcast((1, t, 8, 4, 128), range(5))
         .reshape((1, t, 32, 128)).transpose((0, 2, 1, 3)))
    assert m.exprs == (const(0), dim(2), dim(1).floordiv(4), dim(3))
    assert _contig(m, itemsize=2) == (3, 128, 256, False)


def test_contiguity_gqa_heads_major_cache():
    """Heads-major cache (8, T, 128) repeated to (32, T, 128): each head is one contiguous run."""
    t = 4096
    m = IndexMap.identity((8, t, 128)).reshape((8, 1, t, 128)).broadcast((8, 4, t, 128), range(4)).reshape((32, t, 128))
    assert m.exprs == (dim(0).floordiv(4), dim(1), dim(2))
    assert _contig(m, itemsize=2) == (1, t * 128, t * 256, False)


def test_contiguity_clean_reshapes_are_full():
    for a, b in [((4, 6), (24,)), ((24,), (4, 6)), ((4, 6), (6, 4)), ((2, 3, 4), (6, 4)), ((6, 4), (2, 3, 2, 2))]:
        m = IndexMap.identity(a).reshape(b)
        assert m.contiguity(4).full, (a, b, m)
        assert IndexMap.identity(a).reshape(b).reshape(a).is_identity


def test_contiguity_pad_breaks_at_padded_dim():
    m = IndexMap.identity((4, 6)).pad((0, 0), (0, 2), (0, 0), 0.0)  # pad the last dim
    assert _contig(m) == (2, 1, 4, False)
    m = IndexMap.identity((4, 6)).pad((1, 0), (0, 0), (0, 0), 0.0)  # pad rows only
    assert _contig(m) == (1, 6, 24, False)


def test_contiguity_dynamic_slice_axis0_is_full():
    m = IndexMap.identity((1, 4096, 8, 128)).dynamic_slice([0, sym("pos"), 0, 0], (1, 1, 8, 128),
                                                           [SymInfo("pos", 0, 4095)])
    assert _contig(m, itemsize=2) == (0, 1024, 2048, True)


# --------------------------------------------------------------------------------------------
# Simplification
# --------------------------------------------------------------------------------------------

def test_floordiv_mod_simplify_with_ranges():
    b = {Dim(0): (0, 7), Dim(1): (0, 127)}
    e = dim(0) * 128 + dim(1)
    assert e.floordiv(128, b) == dim(0)
    assert e.mod(128, b) == dim(1)
    assert (e * 2 + 1).floordiv(2, b) == e
    assert dim(1).floordiv(128, b) == const(0)
    assert str(dim(1).floordiv(64, b)) == "(d1) floordiv 64"  # no range information helps here


def test_floordiv_mod_recombine():
    e = dim(0) * 4 + dim(1)
    assert e.floordiv(6) * 6 + e.mod(6) == e
    assert (e.floordiv(6) * 12 + e.mod(6) * 2) == e * 2
    m = IndexMap.identity((3, 8)).reshape((2, 12)).reshape((24,))
    assert m.exprs == (dim(0).floordiv(8), dim(0).mod(8))


def test_nested_floordiv():
    e = dim(0).floordiv(4).floordiv(3)
    assert e == dim(0).floordiv(12)


def test_merge_then_split_is_identity():
    m = IndexMap.identity((8, 128)).reshape((1024,)).reshape((8, 128))
    assert m.is_identity


def test_conflicting_symbol_ranges_do_not_compose():
    a = IndexMap.identity((10,)).dynamic_slice([sym("s")], (4,), [SymInfo("s", 0, 6)])
    with pytest.raises(NotComposable):
        a.dynamic_slice([sym("s")], (2,), [SymInfo("s", 0, 2)])


# --------------------------------------------------------------------------------------------
# Block evaluation
# --------------------------------------------------------------------------------------------

def _lanes(origin, block):
    """A block's lane indices at ``origin``, one broadcastable array per dim (as a kernel makes them)."""
    return [np.arange(b).reshape([b if k == j else 1 for k in range(len(block))]) + o
            for j, (o, b) in enumerate(zip(origin, block))]


def _in_bounds(idx, shape, block):
    return np.broadcast_to(all_of(i < n for i, n in zip(idx, shape)), block)


def test_flat_offsets_ragged_block():
    m = IndexMap.identity((5, 6)).transpose((1, 0))  # virtual (6, 5) over physical (5, 6)
    idx = _lanes((0, 0), (8, 8))
    off, mask = np.broadcast_to(m.flat_offsets(point(idx)), (8, 8)), _in_bounds(idx, m.domain, (8, 8))
    i, j = np.indices((8, 8))
    np.testing.assert_array_equal(mask, (i < 6) & (j < 5))
    np.testing.assert_array_equal(off[mask], (j * 6 + i)[mask])


def test_flat_offsets_with_symbol_and_origin():
    m = IndexMap.identity((16, 8)).dynamic_slice([sym("pos"), 0], (4, 8), [SymInfo("pos", 0, 12)])
    idx = _lanes((2, 4), (4, 4))
    off, mask = m.flat_offsets(point(idx, {"pos": 5})), _in_bounds(idx, m.domain, (4, 4))
    i, j = np.indices((4, 4))
    np.testing.assert_array_equal(mask, (i + 2 < 4) & (j + 4 < 8))
    np.testing.assert_array_equal(off[mask], ((i + 2 + 5) * 8 + j + 4)[mask])


def test_flat_offsets_pad_mask():
    m = IndexMap.identity((3,)).pad((1,), (0,), (1,), 0.0)  # [f, a, f, b, f, c]
    idx = _lanes((0,), (8,))
    at = point(idx)
    off, mask = m.flat_offsets(at), _in_bounds(idx, m.domain, (8,)) & m.valid(at)
    np.testing.assert_array_equal(mask, [False, True, False, True, False, True, False, False])
    np.testing.assert_array_equal(off[mask], [0, 1, 2])


def test_all_of_and_conds_mask():
    a, b = np.array([True, False, True]), np.array([True, True, False])
    assert all_of([]) is None and all_of([None, True, np.bool_(True)]) is None
    assert all_of([a, None, False]) is False                      # a static False wins
    np.testing.assert_array_equal(all_of([a, True, b]), a & b)
    m = IndexMap.identity((3,)).pad((1,), (1,), (0,), 0.0)          # valid where 1 <= d0 < 4
    assert conds_mask((), point([np.arange(5)])) is None
    np.testing.assert_array_equal(conds_mask(m.conds, point([np.arange(5)])), [False, True, True, True, False])
    np.testing.assert_array_equal(m.valid(point([np.arange(5)])), [False, True, True, True, False])



def test_a_given_mask_joins_the_conditions_in_one_chain():
    """``conds_mask(..., given=m)`` is ``((m & c1) & c2)``: one left-to-right chain with the known
    mask first, as the kernels emitted it before the evaluator was shared. Joining ``m`` last,
    ``m & (c1 & c2)``, computes the same lanes but changed ptxas's register allocation
    (EfficientViT's depthwise conv went from 32 to 45 registers). Values equal numpy's."""
    m = IndexMap.identity((4, 6)).pad((1, 2), (1, 2), (0, 0), 0.0)   # 1 <= d0 < 5 and 2 <= d1 < 8
    assert len(m.conds) == 2
    r, c = np.meshgrid(np.arange(6), np.arange(10), indexing="ij")
    given = (r + c) % 3 != 0

    def f(r, c, g):
        return conds_mask(m.conds, point([r, c]), jnp, m.bounds, given=g)

    args = (jnp.asarray(r), jnp.asarray(c), jnp.asarray(given))
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    ands = [e for e in jaxpr.eqns if e.primitive.name == "and"]
    joins_given = [k for k, e in enumerate(ands) if jaxpr.invars[2] in e.invars]
    assert joins_given and joins_given[0] < len(ands) - 1, "the given mask must open the chain"
    np.testing.assert_array_equal(f(*args), given & (r >= 1) & (r < 5) & (c >= 2) & (c < 8))

def _as_block(x, shape, xp):
    """An evaluation result as a full array: None (everywhere) is all-true; scalars broadcast."""
    return xp.broadcast_to(xp.asarray(True if x is None else x), shape)


def _evaluations(lay: Layout, at, xp) -> list:
    """Everything the one evaluator computes for a layout at a point: per piece its targets, where
    it holds and its flat offsets; per fill region where it holds."""
    out = []
    for p in lay.pieces:
        out += [_as_block(t, lay.shape, xp) for t in p.map.targets(at, xp)]
        out += [_as_block(p.holds(at, xp), lay.shape, xp), _as_block(p.map.flat_offsets(at, xp), lay.shape, xp)]
    out += [_as_block(r.holds(at, xp), lay.shape, xp) for r in lay.fills]
    return out


@settings(max_examples=60, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_evaluator_numpy_and_jnp_agree(data):
    """The one layout evaluator gives identical targets, masks, flat offsets and elements with
    numpy (int64 index grid, Python-int symbols: the reference) and with jax.numpy (int32 iota,
    traced int32 symbols, truncating division where the ranges prove operands non-negative:
    what ``lower`` emits for XLA) on random layouts."""
    c = random_chain(data)
    lay = c.layout
    at = point(list(np.indices(lay.shape, dtype=np.int64)) if lay.shape else [], c.symbols)
    want = _evaluations(lay, at, np) + [lay.evaluate(c.buffers, c.symbols)]

    def under_jax(buffers, symbols):
        at = point([lax.broadcasted_iota(jnp.int32, lay.shape, k) for k in range(len(lay.shape))], symbols)
        return _evaluations(lay, at, jnp) + [lay.gather(at, buffers, np.float32, jnp)]

    syms = {k: np.int32(v) for k, v in c.symbols.items()}
    got = jax.jit(under_jax).lower(c.buffers, syms).compile(LAX_COMPILE_OPTIONS)(c.buffers, syms)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"result {k}: " + " -> ".join(c.steps) + f"\n{lay}")


def test_strided_box():
    assert IndexMap.identity((5, 6)).transpose((1, 0)).strided_box() == ((1, 1, const(0)), (0, 1, const(0)))
    assert IndexMap.identity((5, 6)).slice((1, 0), (5, 6), (2, 3)).strided_box() == \
        ((0, 2, const(1)), (1, 3, const(0)))
    m = IndexMap.identity((16, 8)).dynamic_slice([sym("pos"), 2], (4, 4), [SymInfo("pos", 0, 12)])
    assert m.strided_box() == ((0, 1, sym("pos")), (1, 1, const(2)))
    assert IndexMap.identity((4, 6)).reshape((6, 4)).strided_box() is None  # floordiv/mod: not a box
    assert IndexMap.identity((4, 6)).pad((1, 0), (0, 0), (0, 0), 0.0).strided_box() is None


def test_layout_concat_pieces_and_boxes():
    lay = Layout.concatenate([Layout.physical(1, (1, 64)), Layout.physical(2, (1, 16)),
                              Layout.physical(3, (1, 16))], 1)
    assert [p.target for p in lay.pieces] == [1, 2, 3]
    assert [p.box() for p in lay.pieces] == [((0, 1), (0, 64)), ((0, 1), (64, 80)), ((0, 1), (80, 96))]
    heads = lay.reshape((1, 6, 16)).transpose((1, 0, 2))
    assert [p.box() for p in heads.pieces] == [((0, 4), (0, 1), (0, 16)), ((4, 5), (0, 1), (0, 16)),
                                               ((5, 6), (0, 1), (0, 16))]
    bufs = {1: np.arange(64.0).reshape(1, 64), 2: 100 + np.arange(16.0).reshape(1, 16),
            3: 200 + np.arange(16.0).reshape(1, 16)}
    want = np.concatenate([bufs[1], bufs[2], bufs[3]], 1).reshape(1, 6, 16).transpose(1, 0, 2)
    np.testing.assert_array_equal(heads.evaluate(bufs), want)


# --------------------------------------------------------------------------------------------
# Indirection: Load atoms (an index read from a runtime table)
# --------------------------------------------------------------------------------------------

def _paged(pages: int = 13, page: int = 4, b: int = 3, m: int = 4, d: int = 8, wrap: int = 13) -> Layout:
    """``(B, T, D) -> pages[table[b, t floordiv page], t mod page, d]`` (a paged KV cache)."""
    from vtc_jax.indexmap import Load
    load = Load("tbl", (dim(0), dim(1).floordiv(page)), 0, pages - 1, wrap)
    bounds = {Dim(0): (0, b - 1), Dim(1): (0, m * page - 1), Dim(2): (0, d - 1)}
    exprs = (Expr_of(load), dim(1).mod(page, bounds), dim(2))
    info = SymInfo("tbl", 0, 0, shape=(b, m))
    return Layout.physical(0, (pages, page, d)).compose(IndexMap((b, m * page, d), exprs, (pages, page, d),
                                                                  syms=(info,)))


def Expr_of(a):
    from vtc_jax.indexmap import Expr
    return Expr.of(a)


def _paged_reference(buf, table, page, wrap):
    b, m = table.shape
    t = np.arange(m * page)
    v = table[:, t // page]
    v = np.clip(np.where(v < 0, v + wrap, v), 0, buf.shape[0] - 1)
    return buf[v, (t % page)[None, :]]


@pytest.mark.parametrize("entries", ["in range", "negative", "out of range"])
def test_load_atom_evaluates_as_a_clamped_wrapped_table_read(entries):
    """A Load reads the table, wraps a negative entry (as jnp normalises indices) and clamps (as
    XLA clamps a gather's starts): the layout's reference evaluation equals numpy's."""
    rng = np.random.default_rng(3)
    buf = rng.standard_normal((13, 4, 8)).astype(np.float32)
    table = rng.permutation(13)[:12].reshape(3, 4)
    if entries == "negative":
        table[0, 1], table[2, 3] = -1, -13
    elif entries == "out of range":
        table[1, 2], table[2, 0] = 40, -90
    lay = _paged()
    got = lay.evaluate({0: buf}, {"tbl": table})
    np.testing.assert_array_equal(got, _paged_reference(buf, table, 4, 13))


def test_load_atom_composes_and_simplifies_through_movement():
    """Movement on top of an indirect map substitutes into the read's index; the read's value range
    (its clamp) lets floordiv/mod of it simplify away: a reshape that splits T back into
    (pages, page) gives the table read and the offset in the page as plain terms."""
    lay = _paged()
    split = lay.reshape((3, 4, 4, 8))           # (B, M, page, D)
    (p,) = split.pieces
    assert [str(e) for e in p.map.exprs] == ["tbl[d0, d1]", "d2", "d3"], p.map
    moved = split.transpose((1, 0, 2, 3))       # (M, B, page, D): the read's index follows
    assert str(moved.pieces[0].map.exprs[0]) == "tbl[d1, d0]"
    flat = moved.reshape((4 * 3 * 4 * 8,))
    e = flat.pieces[0].map.flat_expr()
    assert e.loads() and all(a.lo == 0 and a.hi == 12 for a in e.loads())
    c = moved.pieces[0].map.contiguity(4)
    assert (c.min_contiguous_dim, c.run_elems) == (2, 32)   # a page (page rows x D) is one run
    rng = np.random.default_rng(4)
    buf = rng.standard_normal((13, 4, 8)).astype(np.float32)
    table = rng.integers(-20, 20, (3, 4))
    ref = _paged_reference(buf, table, 4, 13).reshape(3, 4, 4, 8).transpose(1, 0, 2, 3).reshape(-1)
    np.testing.assert_array_equal(flat.evaluate({0: buf}, {"tbl": table}), ref)
