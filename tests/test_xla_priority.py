"""``xla_priority``: the simulation of XLA's priority fusion the model of XLA replays on an island
past its duplication bound. Its prices are checked against XLA's own dump in
``tests/test_benchmarks.py``; here, what the model relies on besides: a chain fuses into one
kernel, a cheap value is recomputed in its readers, and islands equal up to their ids (a model's layers) are one
:class:`Problem` whose kernels, mapped back, are those of the island itself."""
from __future__ import annotations

from vtc_jax.xla_priority import Node, canonical, fuse


def _tree(width: int, levels: int, base: int = 0) -> tuple[list[Node], dict[int, tuple[int, int]], set[int]]:
    """An up-sweep of ``levels`` levels over ``2**levels`` rows of ``width`` f32: each level
    multiplies its even rows by its odd rows (two strided slices of the level below)."""
    rows = 2 ** levels
    src = base + 10_000
    inputs = {src: (rows * width, rows * width * 4)}
    nodes, prev, nid = [], src, base
    for _ in range(levels):
        rows //= 2
        size = rows * width
        even, odd, prod = nid, nid + 1, nid + 2
        nodes += [Node(even, "slice", size, size * 4, (prev,), (rows, width)),
                  Node(odd, "slice", size, size * 4, (prev,), (rows, width)),
                  Node(prod, "elementwise", size, size * 4, (even, odd), (rows, width), 3)]
        prev, nid = prod, nid + 3
    return nodes, inputs, {prev}


def test_an_elementwise_chain_is_one_kernel_writing_its_output():
    n = 1 << 20
    nodes = [Node(0, "elementwise", n, 4 * n, (100,), (n,), 80),
             Node(1, "elementwise", n, 4 * n, (0, 101), (n,), 7),
             Node(2, "elementwise", n, 4 * n, (1,), (n,), 3)]
    kernels = fuse(nodes, {100: (n, 4 * n), 101: (n, 4 * n)}, {2})
    assert [(k.writes, k.reads) for k in kernels] == [((2,), frozenset({100, 101}))]


def _shared(width: int, readers: int) -> tuple[list[Node], dict[int, tuple[int, int]], set[int]]:
    """``exp`` of ``(readers + 1, width)`` read by ``readers`` fusions, each slicing a different
    number of its rows and writing a result of its own (a scan level read by the down-sweep)."""
    rows = readers + 1
    nodes = [Node(0, "elementwise", rows * width, rows * width * 4, (100,), (rows, width), 80)]
    for r in range(1, readers + 1):
        size = r * width
        nodes += [Node(2 * r - 1, "slice", size, size * 4, (0,), (r, width), 3, ((0, r), (0, width))),
                  Node(2 * r, "elementwise", size, size * 4, (2 * r - 1,), (r, width), 7)]
    return nodes, {100: (rows * width, rows * width * 4)}, {2 * r for r in range(1, readers + 1)}


def test_a_value_read_by_many_fusions_is_recomputed_in_each_when_a_launch_costs_more():
    """XLA's performance model: at 16 elements a row the launch of a fusion of its own costs
    more than recomputing ``exp`` in each of the 8 readers (each reads the rows it slices)."""
    narrow = fuse(*_shared(16, 8))
    assert all(0 not in k.writes for k in narrow) and len(narrow) == 8, narrow
    assert all(k.reads == frozenset({100}) for k in narrow), narrow


def test_islands_equal_up_to_ids_are_one_problem_with_the_same_kernels():
    a, b = _tree(65536, 8), _tree(65536, 8, base=500)
    pa, back_a = canonical(*a)
    pb, back_b = canonical(*b)
    assert pa == pb and hash(pa) == hash(pb)
    for (nodes, inputs, outputs), back in ((a, back_a), (b, back_b)):
        mapped = {(tuple(back[t] for t in k.writes), frozenset(back[x] for x in k.reads)) for k in pa.fuse()}
        assert mapped == {(k.writes, k.reads) for k in fuse(nodes, inputs, outputs)}
