"""Pointwise clusters: connected elementwise ops over one index space, one kernel.

A cluster that also holds movement ops (an island fused by ``cluster.fuse_islands``: RoPE) is the
same kernel whose stage 2 is ``island.program``: the movement ops are index maps on its inputs
(``island.plan``), the values they move are recomputed at the mapped indices."""
from __future__ import annotations

from dataclasses import dataclass

from ..cluster import Cluster
from ..graph import Graph
from ..kernels.pointwise import choose_block, pointwise
from ..primitives import Kind, is_movement_op
from .island import ISLAND_BLOCK, IslandPlan, Load, leaf_vtensor
from .island import plan as island_plan
from .island import program as island_program
from .base import Decline, Run, Step, Template
from .stage2 import block_fn, block_supported, broadcast_input, buffers_of, kernel_inputs

__all__ = ["TEMPLATE"]


IOTA_SHARE = 4   # an iota is computed in XLA and loaded when it is at most 1/4 of the output


@dataclass(frozen=True)
class PointwiseMatch:
    shape: tuple[int, ...]
    inputs: tuple[int, ...]       # kernel inputs, in the cluster's order (iota outputs last)
    iotas: tuple[int, ...] = ()   # iota ops computed in XLA before the kernel (position tables)
    island: IslandPlan | None = None   # movement inside the cluster: its recompute plan


def _match(graph: Graph, c: Cluster) -> PointwiseMatch:
    shapes = {tuple(graph.tensors[o].shape) for o in c.outputs}
    if any(is_movement_op(graph.ops[o], graph) for o in c.ops):   # an island: iotas in registers
        # (outputs of several shapes: one grid over their union, each output read and written
        # only within its own extent — sibling islands, ``cluster.sibling_islands``)
        p = island_plan(graph, c.ops, kernel_inputs(graph, c), c.outputs)
        loaded = tuple(dict.fromkeys(s.tensor for s in p.inputs if isinstance(s, Load)))
        return PointwiseMatch(p.shape, loaded, (), p)
    if len(shapes) != 1:
        raise Decline("outputs of different shapes")
    shape = shapes.pop()
    size = max(1, graph.tensors[c.outputs[0]].size)
    iotas = tuple(o for o in c.ops if graph.ops[o].primitive == "iota")
    if any(graph.tensors[graph.ops[o].outputs[0]].size * IOTA_SHARE > size for o in iotas):
        raise Decline("an iota as large as the output (an index-dependent kernel)")
    iota_outs = tuple(graph.ops[o].outputs[0] for o in iotas)
    why = block_supported(graph, [o for o in c.ops if o not in iotas])
    if why:
        raise Decline(why)
    return PointwiseMatch(shape, kernel_inputs(graph, c) + iota_outs, iotas)


def _build(graph: Graph, c: Cluster, m: PointwiseMatch, backend: str) -> Step:
    iota_out = {graph.ops[o].outputs[0]: graph.ops[o] for o in m.iotas}

    def load(run: Run, t: int) -> object:
        op = iota_out.get(t)
        return run.vtensor(t) if op is None else op.prim.bind(**op.params)

    if m.island is not None:
        fn = island_program(graph, m.island)

        def inputs(run: Run) -> list[object]:
            return [leaf_vtensor(load(run, s.tensor) if isinstance(s, Load) else None, s)
                    for s in m.island.inputs]
    else:
        fn = block_fn(graph, [o for o in c.ops if o not in m.iotas], m.inputs, c.outputs)

        def inputs(run: Run) -> list[object]:
            return [broadcast_input(load(run, t), m.shape) for t in m.inputs]

    def step(run: Run) -> None:
        outs = [run.out_vtensor(o) for o in c.outputs]
        # an island recomputes (index maps, tables) per element: a quarter of the usual block
        # keeps its registers well under the limit (no spills at paper size, BENCHMARKS.md)
        block = None if m.island is None else choose_block(m.shape, 4, ISLAND_BLOCK)
        res = pointwise(fn, inputs(run), out_shape=m.shape, outs=outs, backend=backend,
                        index_args=m.island is not None and m.island.uses_index, block=block)
        res = (res,) if len(outs) == 1 else res
        for o, v, r in zip(c.outputs, outs, res):
            run.written(o, v, buffers_of(r))

    return step


TEMPLATE = Template(Kind.POINTWISE, library=False, match=_match, build=_build)
