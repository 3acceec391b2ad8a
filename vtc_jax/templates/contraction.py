"""Matmul and convolution clusters: the contraction plus its elementwise epilogue as one kernel
(a matmul also applies a unary prologue to the tiles it loads: a ReLU on an operand).

The epilogue is the cluster's other primitives re-bound on the accumulator tile
(:func:`stage2.block_fn`). The accumulator is first rounded to the contraction's own output
dtype — what the traced program's dot returns — so a bf16 epilogue sees bf16 values and bf16
literals, exactly like ``jax.jit``; 16-bit math runs op by op in f32 (``f32_math``), XLA's own
float normalisation.

The kernel's dot computes at the op's own ``precision`` param (resolved against
``jax_default_matmul_precision`` when the kernel is built, :func:`kernels.tiling.dot_precision`):
an f32 dot at jax's default runs on TF32 tensor cores as ``jax.jit``'s does, one at ``HIGHEST`` is
IEEE f32. An op asking for an algorithm Pallas' Triton dot lacks (FP8, F64) stays in XLA.

A matmul cluster may also hold a split (or slices) of the dot's result along a weight column dim
with an epilogue reading the parts (``selection`` merges a gated MLP's GEMM and its
``silu(gate) * up``): the kernel dots each A tile with each part's columns of the weight, read
through slices of it, and the epilogue takes every part's tile (``kernels.matmul``'s
``rhs_parts``). The dot's result is never formed. The parts may also be the results of sibling
dots of one A operand with weights of one shape (``silu(h @ w1) * (h @ w3)``): each part is a
whole weight. Or sibling dots of one A operand each with its own result (a layer's ``h @ wq``,
``h @ wk``, ``h @ wv``), their weights of one shape but along one free dim: one GEMM reads the
weights side by side (``indexmap.Layout.concatenate`` of their layouts, a view) and writes its
result side by side into the dots' results, each where the strategy put it (Q, a cache row).

Or a dot followed by an island (``selection`` merges a decode layer's QKV projection with the
kernel rotating q and k, the v part's view into its cache row along): the GEMM's split-K kernel
writes its f32 partial sums and the island's kernel (``templates.pointwise``'s, stage 2
``island.program``) sums them where it reads the dot's result (``island.summed``) — no reduce
kernel, the projection never written. Only where the GEMM splits K.

And it may hold the row norm its A operand is (``selection`` merges an RMSNorm into the
projection reading it): one sum over the contraction dim whose statistic enters the norm as one
row factor ``r`` multiplied in, then only casts and products with rows (``(x * r * w).astype``).
The kernel folds it (``kernels.matmul.Fold``): it dots the norm with ``r`` taken as 1, sums the
statistic's summand over the K tiles it loads anyway, and scales the accumulator rows by ``r``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..cluster import Cluster, epilogue_chain
from ..graph import Graph
from ..kernels.conv import conv
from ..kernels.matmul import Fold, matmul, splits
from ..kernels.pointwise import choose_block, f32_math, pointwise
from ..kernels.vio import VTensor
from ..kernels.vio import broadcast_input as rows_of
from ..kernels.tiling import DECODE_MAX_M, dtype_unsupported, precision_unsupported, prefill_tiles
from ..primitives import TABLE, Kind, Role, block_safe, is_movement_op, role_of
from .base import Decline, Run, Step, Template
from .island import ISLAND_BLOCK, IslandPlan, Load, Partial, leaf_vtensor, summed
from .island import plan as island_plan
from .island import program as island_program
from .stage2 import block_fn, block_supported, broadcast_input, buffers_of, kernel_inputs

__all__ = ["MATMUL", "CONV"]


@dataclass(frozen=True)
class FoldMatch:
    """A row norm the dot's A operand is, folded into the kernel (module docstring)."""
    inputs: tuple[int, ...]       # what the kernel loads: A's tensor (the dot's row shape) first, then rows
    ops: tuple[int, ...]          # the norm's ops (all of them, the sum included)
    summand: tuple[int, tuple[int, ...]]     # (the summed tensor, the ops computing it from the inputs)
    factor: tuple[int, int, tuple[int, ...]]  # (the sum, the row factor r, the ops computing r from it)
    rows: tuple[int, ...]         # the ops computing the A operand from the inputs and r
    operand: int                  # the dot's A operand (the norm's result)
    divides: bool = False         # the rows are divided by r (``x / sqrt(ms + eps)``), not multiplied


@dataclass(frozen=True)
class SideBySide:
    """Sibling dots of one A operand written as one GEMM over their weights side by side along
    ``rhs_dim`` (results side by side along ``out_dim``): each result lands in its own tensor."""
    outputs: tuple[int, ...]      # each dot's result (after its epilogue), in the order the weights are read
    weights: tuple[int, ...]
    rhs_dim: int
    out_dim: int
    # each epilogue operand: (its tensor per dot, the axis they are read side by side along) or
    # ((the one tensor all read,), -1); and the shape of the results side by side
    extras: tuple[tuple[tuple[int, ...], int], ...] = ()
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class ContractionMatch:
    op: int                       # the dot_general / conv op
    rest: tuple[int, ...]         # epilogue ops
    extras: tuple[int, ...]       # epilogue operands read from outside (bias, residual rows)
    operands: tuple[int, ...] = ()                  # what the kernel loads for lhs, rhs
    prologue: tuple[tuple[int, ...], ...] = ((), ())   # per operand: its unary chain's ops
    # a gated epilogue's parts of the dot result: (part tensor, its weight, weight dim, start, stop)
    # each — slices of one weight, or whole weights of sibling dots sharing the A operand
    parts: tuple[tuple[int, int, int, int, int], ...] = ()
    fold: FoldMatch | None = None   # the row norm A is, folded in
    side: SideBySide | None = None  # sibling dots with a result each (q, k, v of three weights)
    # the movement and element-wise ops after the dot as an island (its rotary embedding, its
    # parts written to caches), run on the split-K partials by the kernel that sums them
    island: IslandPlan | None = None


def _prologue(graph: Graph, c: Cluster, x: int) -> tuple[int, tuple[int, ...]]:
    """(the tensor the kernel loads, the cluster's ops between it and the dot operand ``x``)."""
    own, chain = set(c.ops), []
    while (p := graph.producer(x)) is not None and p.id in own:
        chain.append(p.id)
        x = next(t for t in p.inputs if graph.tensors[t].size > 1 or graph.tensors[t].const is None)
    return x, tuple(reversed(chain))


def _match(primitive: str) -> Callable[[Graph, Cluster], ContractionMatch]:
    def match(graph: Graph, c: Cluster) -> ContractionMatch:
        found = [o for o in c.ops if graph.ops[o].primitive == primitive]
        if not found:
            raise Decline(f"needs exactly one {primitive} and one output")
        op = graph.ops[found[0]]
        if primitive == "dot_general" and any(_moves_result(graph, c, graph.ops[o]) for o in found):
            try:   # (a gated epilogue's split is movement after the dot too)
                return _epilogue_match(graph, c, op, found, primitive)
            except Decline:
                return _island_epilogue(graph, c, [graph.ops[o] for o in found])
        return _epilogue_match(graph, c, op, found, primitive)
    return match


def _moves_result(graph: Graph, c: Cluster, op: Any) -> bool:
    """Whether the cluster moves the dot's result (movement ops downstream of it)."""
    own, stack, seen = set(c.ops), [op.outputs[0]], set()
    while stack:
        for u in graph.consumers(stack.pop()):
            if u.id in own and u.id not in seen:
                if is_movement_op(u, graph):
                    return True
                seen.add(u.id)
                stack.extend(u.outputs)
    return False


def _epilogue_match(graph: Graph, c: Cluster, op: Any, found: list[int], primitive: str) -> ContractionMatch:
    """The match of a contraction with an element-wise epilogue (and its variants: sibling dots
    side by side or as a gated epilogue's parts, a split's parts, a folded norm)."""
    if len(found) > 1 and primitive != "dot_general" or len(c.outputs) != 1 and len(c.outputs) != len(found):
        raise Decline(f"needs exactly one {primitive} and one output")
    if len(c.outputs) > 1:
        return _side_by_side(graph, c, [graph.ops[o] for o in found])
    siblings = _siblings(graph, c, [graph.ops[o] for o in found])
    if primitive == "conv_general_dilated" and op.params.get("batch_group_count", 1) != 1:
        raise Decline("batch_group_count != 1")
    why = precision_unsupported(op.params.get("precision"))
    if why:
        raise Decline(why)
    fold = _fold(graph, c, op) if primitive == "dot_general" else None
    (lhs, pa), (rhs, pb) = (_prologue(graph, c, x) for x in op.inputs[:2])
    if fold is not None:
        lhs, pa = fold.inputs[0], ()
    for t in dict.fromkeys((lhs, rhs, *op.inputs[:2], *(d.inputs[1] for d in siblings))):   # loaded, dotted
        dt = np.dtype(graph.tensors[t].dtype)
        if not jnp.issubdtype(dt, jnp.floating):
            raise Decline(f"{primitive} of {dt.name} operands: the kernel's dot takes floating "
                          "operands only (integer and boolean dots run in XLA)")
        if primitive == "conv_general_dilated" and (why := dtype_unsupported(dt)):
            raise Decline(why)
    rest = tuple(o for o in c.ops if o != op.id and o not in pa and o not in pb
                 and all(o != d.id for d in siblings))
    if siblings:
        parts, cuts = _sibling_parts(graph, c, op, siblings, pb), ()
    else:
        parts, cuts = _parts(graph, c, op) if primitive == "dot_general" else ((), ())
    if len(parts) > 1 and _big_tiles(graph, op, len(parts) if siblings else 1):
        raise Decline("a gated GEMM of prefill size: XLA's GEMM takes the large tiles a kernel dotting "
                      "each A tile with several parts cannot (its epilogue saves less than they gain)")
    rest = tuple(o for o in rest if o not in cuts and (fold is None or o not in fold.ops))
    why = block_supported(graph, rest + pa + pb)
    if why:
        raise Decline(why)
    if pa and pb and not all(_keeps_zero(graph, ch, base, x) for ch, base, x in
                             ((pa, lhs, op.inputs[0]), (pb, rhs, op.inputs[1]))):
        raise Decline("both operands' prologues map 0 elsewhere (masked lanes would count)")
    read = {t for o in rest for t in graph.ops[o].inputs}   # (the A operand too: x + rms(x) @ W)
    extras = tuple(t for t in kernel_inputs(graph, c) if t in read)
    out_shape = tuple(graph.tensors[c.outputs[0]].shape)
    if any(not _broadcasts_to(tuple(graph.tensors[t].shape), out_shape) for t in extras):
        raise Decline("the epilogue reads a tensor that does not broadcast to its result")
    return ContractionMatch(op.id, rest, extras, (lhs, rhs), (pa, pb), parts, fold)


def _fold(graph: Graph, c: Cluster, op: Any) -> FoldMatch | None:
    """The row norm the dot's A operand is, when the cluster holds one (None: it holds no
    reduction); :class:`Decline` when it holds one the kernel cannot fold."""
    ops = [graph.ops[o] for o in c.ops]
    reds = [o for o in ops if role_of(o, graph) is Role.REDUCTION]
    if not reds:
        return None
    (lc, _), (lb, _) = op.params["dimension_numbers"]
    h = op.inputs[0]
    shape = tuple(graph.tensors[h].shape)
    nd = len(shape)
    if len(reds) != 1 or reds[0].primitive != "reduce_sum":
        raise Decline("a reduction beside the dot other than one sum (a norm's statistic)")
    red = reds[0]
    u, stat = red.inputs[0], red.outputs[0]
    if tuple(lb) or tuple(lc) != (nd - 1,) or tuple(graph.tensors[u].shape) != shape \
            or tuple(red.params["axes"]) != (nd - 1,):
        raise Decline("the norm's sum is not over the dot's one contracting dim, its operand's last")
    made = {t: o for o in ops for t in o.outputs}

    def up(t: int, seen: set[int]) -> set[int]:
        o = made.get(t)
        if o is None or o.id in seen or o.id == op.id:
            return seen
        seen.add(o.id)
        for x in o.inputs:
            up(x, seen)
        return seen

    norm = up(h, set()) | up(u, set())
    scalar = {t for o in ops for t in o.inputs if graph.tensors[t].size == 1 and graph.tensors[t].const is not None}
    statistic: set[int] = {stat}
    for o in ops:   # (program order) the tensors computed from the statistic alone
        if o.id in norm and o.id != red.id and all(x in statistic or x in scalar for x in o.inputs):
            statistic.update(o.outputs)
    factor_ops = tuple(o.id for o in ops if o.id in norm and o.id != red.id and set(o.outputs) <= statistic)
    mixing = [o for o in ops if o.id in norm and o.id not in factor_ops and o.id != red.id
              and any(x in statistic for x in o.inputs)]
    if len(mixing) != 1 or len(mixing[0].inputs) != 2 or not (
            mixing[0].primitive == "mul" or mixing[0].primitive == "div" and mixing[0].inputs[1] in statistic):
        raise Decline("the norm's statistic is not one row factor the rows are multiplied or divided by")
    r = next(x for x in mixing[0].inputs if x in statistic)
    t = mixing[0].outputs[0]
    path = [t]
    while t != h:   # the factor reaches the operand through casts and products with rows only
        users = [o for o in ops if t in o.inputs]
        if len(users) != 1 or users[0].id not in norm or users[0].primitive not in ("mul", "convert_element_type") \
                or users[0].inputs.count(t) != 1:   # (h * h would carry r twice)
            raise Decline("the norm's row factor meets more than casts and products by rows before the dot")
        t = users[0].outputs[0]
        path.append(t)
    if any(np.dtype(graph.tensors[x].dtype) not in _FOLD_DTYPES for x in path):
        raise Decline("the norm's rows before the factor would be rounded to a type narrower in range than f32 "
                      "(f16 overflows where the normalised rows do not) or to an integer")
    rows = tuple(o.id for o in ops if o.id in norm and o.id not in factor_ops and o.id != red.id)
    for o in ops:
        if o.id in factor_ops and not (block_safe(o.primitive) or o.primitive in _STAT_VIEWS and _keeps_rows(graph, o)):
            raise Decline(f"{o.primitive} in the norm's row factor")
        if o.id in rows and not block_safe(o.primitive) and not _trailing_broadcast(graph, o):
            raise Decline(f"{o.primitive} in the norm's rows cannot be computed on tiles")
    inputs = [x for x in dict.fromkeys(x for o in ops if o.id in rows for x in o.inputs)
              if x not in made and x not in scalar and x != r]
    if not inputs or any(not _broadcasts_to(graph.tensors[x].shape, shape) for x in inputs):
        raise Decline("the norm reads a tensor that is not one of its rows")
    first = next((x for x in inputs if tuple(graph.tensors[x].shape) == shape), None)
    if first is None:
        raise Decline("no input of the norm spans its rows")
    inputs = [first, *(x for x in inputs if x != first)]
    summand = tuple(o for o in rows if o in up(u, set()))
    fm = FoldMatch(tuple(inputs), tuple(sorted(norm)), (u, summand), (stat, r, factor_ops), rows, h,
                   mixing[0].primitive == "div")
    with jax.ensure_compile_time_eval():   # masked lanes (K past its end) must add nothing
        zeros = [jnp.zeros((), graph.tensors[x].dtype) for x in inputs]
        ok = [float(np.asarray(f(*zeros))) == 0.0 for f in (block_fn(graph, summand, inputs, [u]),
                                                            _unit_factor(graph, fm))]
    if not all(ok):
        raise Decline("the norm maps a masked (zero) lane to a nonzero value")
    return fm


# dtypes the rows may hold before the factor scales them (f32's exponent range: unnormalised rows
# that f16 would overflow stay finite), and the views that only move a statistic's size-1 axis
_FOLD_DTYPES = frozenset({np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float64)})
_STAT_VIEWS = frozenset(n for n, row in TABLE.items() if row.stat_view)


def _keeps_rows(graph: Graph, o: Any) -> bool:
    """A view of a row statistic that only adds or drops size-1 axes (its rows in their order)."""
    src, dst = (tuple(n for n in graph.tensors[t].shape if n != 1) for t in (o.inputs[0], o.outputs[0]))
    return src == dst and (o.primitive != "broadcast_in_dim" or graph.tensors[o.inputs[0]].size
                           == graph.tensors[o.outputs[0]].size)


def _trailing_broadcast(graph: Graph, o: Any) -> bool:
    """A numpy-style broadcast (new dims leading): an identity on tiles loaded broadcast already."""
    if o.primitive != "broadcast_in_dim":
        return False
    n_in, n_out = len(graph.tensors[o.inputs[0]].shape), len(o.params["shape"])
    return tuple(o.params["broadcast_dimensions"]) == tuple(range(n_out - n_in, n_out))


def _broadcasts_to(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    return len(src) <= len(dst) and all(a in (1, b) for a, b in zip(src[::-1], dst[::-1]))


def _unit_factor(graph: Graph, f: FoldMatch) -> Callable[..., Any]:
    """The A operand from the norm's tiles with the row factor taken as 1."""
    _, r, _ = f.factor
    g = block_fn(graph, f.rows, [*f.inputs, r], [f.operand])
    dt = graph.tensors[r].dtype
    return lambda *tiles: g(*tiles, jnp.ones((), dt))   # (made in the kernel: no captured constant)


def _side_by_side(graph: Graph, c: Cluster, dots: list[Any]) -> ContractionMatch:
    """The match of sibling dots of one A operand each writing a result of the cluster (module
    docstring): their weights agree but along one free dim, each is followed by the same epilogue
    (``cluster.epilogue_chain``: none, a bias, a cast) whose other operands are one tensor for
    all or each its dot's columns of a tensor read side by side, and only the A operand's prologue
    or a folded norm precede them."""
    op = dots[0]
    base = _siblings_side_by_side(graph, dots)   # (the weights side by side: their dim, the results')
    d, out_dim = base.rhs_dim, base.out_dim
    (lc, _), (lb, _) = op.params["dimension_numbers"]
    a_shape = graph.tensors[op.inputs[0]].shape
    if math.prod(n for k, n in enumerate(a_shape) if k not in lc and k not in lb) > DECODE_MAX_M:
        raise Decline("sibling dots of more rows than a decode step's: XLA's merged GEMM takes the large "
                      "tiles a kernel loading each weight under its own mask cannot")
    chains = [epilogue_chain(graph, c.ops, x) for x in dots]
    if any(ch is None or ch[1] != chains[0][1] for ch in chains):
        raise Decline("sibling dots with different epilogues")
    ends = [graph.ops[ch[0][-1]].outputs[0] if ch[0] else x.outputs[0] for ch, x in zip(chains, dots)]
    if sorted(c.outputs) != sorted(ends):
        raise Decline("a kernel of sibling dots writes something besides their results")
    fold = _fold(graph, c, op)
    lhs, pa = _prologue(graph, c, op.inputs[0])
    if fold is not None:
        lhs, pa = fold.inputs[0], ()
    if any(_prologue(graph, c, x.inputs[1])[1] for x in dots):
        raise Decline("a weight of several dots is computed in the kernel (a cast, say)")
    if set(c.ops) - {x.id for x in dots} - set(pa) - set(fold.ops if fold else ()) - {o for ch in chains for o in ch[0]}:
        raise Decline("ops beside the sibling dots, their epilogues and the A operand's prologue")
    for t in dict.fromkeys((lhs, op.inputs[0], *(x.inputs[1] for x in dots))):
        if not jnp.issubdtype(np.dtype(graph.tensors[t].dtype), jnp.floating):
            raise Decline("dot_general of non-floating operands: the kernel's dot takes floating operands only")
    why = block_supported(graph, tuple(pa) + chains[0][0])
    if why:
        raise Decline(why)
    rank = len(graph.tensors[op.outputs[0]].shape)
    extras = []
    for j, x0 in enumerate(chains[0][2]):   # each operand: one for all, or side by side
        xs = tuple(ch[2][j] for ch in chains)
        shapes = [tuple(graph.tensors[x].shape) for x in xs]
        axis = out_dim - (rank - len(shapes[0]))
        widths = [graph.tensors[x.outputs[0]].shape[out_dim] for x in dots]
        if len(set(xs)) == 1 and (axis < 0 or shapes[0][axis] == 1):
            extras.append((xs[:1], -1))
        elif axis >= 0 and all(len(sh) == len(shapes[0]) and sh[axis] == n and
                               all(a == b for k, (a, b) in enumerate(zip(sh, shapes[0])) if k != axis)
                               for sh, n in zip(shapes, widths)):
            extras.append((xs, axis))
        else:
            raise Decline("an epilogue operand of sibling dots is neither shared nor their columns side by side")
    out_shape = list(graph.tensors[ends[0]].shape)
    out_shape[out_dim] = sum(graph.tensors[e].shape[out_dim] for e in ends)
    if any(not _broadcasts_to(tuple(graph.tensors[x].shape), tuple(graph.tensors[ends[0]].shape))
           for x in chains[0][2]):
        raise Decline("the epilogue reads a tensor that does not broadcast to its result")
    side = SideBySide(tuple(ends), tuple(x.inputs[1] for x in dots), d, out_dim, tuple(extras), tuple(out_shape))
    return ContractionMatch(op.id, chains[0][0], chains[0][2], (lhs, op.inputs[1]), (pa, ()), (), fold, side)


def _island_epilogue(graph: Graph, c: Cluster, dots: list[Any]) -> ContractionMatch:
    """The match of a dot followed by an island (``cluster.reduce_islands``: a decode layer's QKV
    projection, its split into q, k and v, the rotations of q and k and the reshapes taking each
    to its cache row), or of sibling dots of one A operand read side by side (``h @ wq``,
    ``h @ wk``, ``h @ wv``, as :func:`_side_by_side`) followed by one: the GEMM's split-K kernel
    writes its partial sums and the island's kernel sums them where it reads a dot's result
    (``island.summed``) — the reduce kernel and the result's round trip through memory go. The
    dots' epilogues (a bias, a cast) are island ops. Only where the GEMM splits K (a decode GEMM,
    M <= 64): unsplit, the result is written once anyway and the island is its own kernel."""
    op = dots[0]
    why = precision_unsupported(op.params.get("precision"))
    if why:
        raise Decline(why)
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    a, b = (graph.tensors[x] for x in op.inputs[:2])
    if tuple(lb) or len(lc) != 1:
        raise Decline("an island after a batched dot or one of several contracting dims")
    side = _siblings_side_by_side(graph, dots) if len(dots) > 1 else None
    m = math.prod(n for k, n in enumerate(a.shape) if k not in lc)
    n = sum(math.prod(n for k, n in enumerate(graph.tensors[d.inputs[1]].shape) if k not in rc) for d in dots)
    if m == a.size or n * len(dots) == sum(graph.tensors[d.inputs[1]].size for d in dots):
        raise Decline("an island after a matrix-vector dot")
    fold = _fold(graph, c, op)
    lhs, pa = _prologue(graph, c, op.inputs[0])
    if fold is not None:
        lhs, pa = fold.inputs[0], ()
    if pa or any(_prologue(graph, c, d.inputs[1])[1] for d in dots):
        raise Decline("an operand prologue beside an island epilogue")
    for t in dict.fromkeys((lhs, op.inputs[0], *(d.inputs[1] for d in dots))):
        if not jnp.issubdtype(np.dtype(graph.tensors[t].dtype), jnp.floating):
            raise Decline("dot_general of non-floating operands: the kernel's dot takes floating operands only")
    if splits(m, n, a.shape[lc[0]], a_itemsize=a.dtype.itemsize, b_itemsize=b.dtype.itemsize,
              pieces=(1, len(dots))) < 2:
        raise Decline("the GEMM does not split K at these sizes: its result is written once anyway, and an "
                      "island after it is a kernel of its own")
    results = [d.outputs[0] for d in dots]
    if any(t in graph.outputs or t in c.outputs for t in results):
        raise Decline("a dot's result is a result of the cluster")
    rest = tuple(o for o in c.ops if all(o != d.id for d in dots) and (fold is None or o not in fold.ops))
    inputs = [t for t in kernel_inputs(graph, c) if any(t in graph.ops[o].inputs for o in rest)]
    plan = island_plan(graph, rest, [*results, *inputs], c.outputs)
    if not any(isinstance(x, Load) and x.tensor in results for x in plan.steps):
        raise Decline("the island does not read the dot's result")
    return ContractionMatch(op.id, rest, tuple(inputs), (lhs, op.inputs[1]), ((), ()), (), fold, side, island=plan)


def _siblings_side_by_side(graph: Graph, dots: list[Any]) -> SideBySide:
    """Sibling dots of one A operand as one GEMM over their weights side by side (their results,
    before any epilogue, side by side): the weights agree but along one free dim."""
    op = dots[0]
    key = ("dimension_numbers", "precision", "preferred_element_type")
    w0 = graph.tensors[op.inputs[1]]
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    rf = [k for k in range(len(w0.shape)) if k not in rc and k not in rb]
    differ = {k for d in dots for k, (x, y) in enumerate(zip(graph.tensors[d.inputs[1]].shape, w0.shape)) if x != y}
    if any(d.inputs[0] != op.inputs[0] or any(d.params.get(k) != op.params.get(k) for k in key)
           or graph.tensors[d.inputs[1]].dtype != w0.dtype or len(graph.tensors[d.inputs[1]].shape) != len(w0.shape)
           for d in dots) or len(differ) > 1 or not set(differ) <= set(rf):
        raise Decline("several dots that are not one A operand's products with weights side by side")
    d = next(iter(differ)) if differ else rf[-1]
    n_lf = len(graph.tensors[op.inputs[0]].shape) - len(lc) - len(lb)
    out_dim = len(lb) + n_lf + rf.index(d)
    shape = list(graph.tensors[op.outputs[0]].shape)
    shape[out_dim] = sum(graph.tensors[x.outputs[0]].shape[out_dim] for x in dots)
    return SideBySide(tuple(x.outputs[0] for x in dots), tuple(x.inputs[1] for x in dots), d, out_dim, (), tuple(shape))


def _big_tiles(graph: Graph, op: Any, copies: int) -> bool:
    """Whether XLA's GEMM (and a kernel of one part) of dot ``op``'s result, ``copies`` times as
    wide, takes the large prefill tiles (``tiling.prefill_tiles``: a 16-bit GEMM of many rows)."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    a, b = (graph.tensors[x] for x in op.inputs[:2])
    m = math.prod(n for k, n in enumerate(a.shape) if k not in lc and k not in lb)
    n = math.prod(n for k, n in enumerate(b.shape) if k not in rc and k not in rb) * copies
    return prefill_tiles(m, n, batch=math.prod(a.shape[k] for k in lb),
                         itemsize=max(a.dtype.itemsize, b.dtype.itemsize)) is not None


def _siblings(graph: Graph, c: Cluster, dots: list[Any]) -> list[Any]:
    """The dots beside the first (``[]`` for one), when every dot of the cluster dots the same A
    operand with a weight of one shape at one precision; :class:`Decline` otherwise."""
    op, rest = dots[0], dots[1:]
    key = ("dimension_numbers", "precision", "preferred_element_type")
    for d in rest:
        if d.inputs[0] != op.inputs[0] or any(d.params.get(k) != op.params.get(k) for k in key) \
                or tuple(graph.tensors[d.inputs[1]].shape) != tuple(graph.tensors[op.inputs[1]].shape) \
                or graph.tensors[d.inputs[1]].dtype != graph.tensors[op.inputs[1]].dtype:
            raise Decline("several dots that are not one A operand's products with weights of one shape")
    return rest


def _sibling_parts(graph: Graph, c: Cluster, op: Any, siblings: list[Any], pb: tuple[int, ...]
                   ) -> tuple[tuple[int, int, int, int, int], ...]:
    """Each dot's result as a part (its whole weight): a gated MLP written with two weights,
    ``silu(h @ w1) * (h @ w3)``. The parts are read only by the epilogue, which is element-wise
    over them."""
    dots = [op, *siblings]
    own = set(c.ops)
    if pb or any(_prologue(graph, c, d.inputs[1])[1] for d in siblings):
        raise Decline("a weight of several dots is computed in the kernel (a cast, say)")
    if any(u.id not in own for d in dots for u in graph.consumers(d.outputs[0])) \
            or any(d.outputs[0] in graph.outputs for d in dots):
        raise Decline("a dot's result is read outside the kernel")
    shape = tuple(graph.tensors[op.outputs[0]].shape)
    if tuple(graph.tensors[c.outputs[0]].shape) != shape:
        raise Decline("the epilogue's result is not of the dots' shape")
    (_, rc), (_, rb) = op.params["dimension_numbers"]
    w = graph.tensors[op.inputs[1]].shape
    d = max(k for k in range(len(w)) if k not in rc and k not in rb)
    return tuple((x.outputs[0], x.inputs[1], d, 0, int(w[d])) for x in dots)


def _parts(graph: Graph, c: Cluster, op: Any) -> tuple[tuple[tuple[int, int, int, int, int], ...], tuple[int, ...]]:
    """``(parts, the cutting ops)`` when the cluster reads the dot's result only through a split or
    unit-stride slices along one rhs free dim, all parts of one shape, the cluster's result of that
    shape (its epilogue is element-wise over a part); ``((), ())`` when it reads no part."""
    own, d = set(c.ops), op.outputs[0]
    readers = [u for u in graph.consumers(d) if u.id in own]
    if not any(u.primitive in ("split", "slice") for u in readers):
        return (), ()
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = (graph.tensors[x] for x in op.inputs[:2])
    n_lf = len(lhs.shape) - len(lc) - len(lb)
    rf = [k for k in range(len(rhs.shape)) if k not in rc and k not in rb]
    shape = tuple(graph.tensors[d].shape)
    parts, cuts, dims = [], [], set()
    for u in readers:
        if u.primitive == "split":
            axis = u.params["axis"]
            starts = np.cumsum((0, *u.params["sizes"][:-1]))
            spans = [(x, axis, int(a), int(a) + int(n)) for x, a, n in zip(u.outputs, starts, u.params["sizes"])]
        elif u.primitive == "slice" and not any(st not in (None, 1) for st in (u.params.get("strides") or ())):
            lo, hi = u.params["start_indices"], u.params["limit_indices"]
            cut = [k for k in range(len(shape)) if (lo[k], hi[k]) != (0, shape[k])]
            if len(cut) > 1:
                raise Decline("the dot's result is sliced along more than one dim")
            axis = cut[0] if cut else len(shape) - 1
            spans = [(u.outputs[0], axis, int(lo[axis]), int(hi[axis]))]
        else:
            raise Decline(f"the dot's result is read by {u.primitive} beside the parts an epilogue reads")
        cuts.append(u.id)
        for x, axis, a, b in spans:
            dims.add(axis)
            if graph.consumers(x):   # (a split's part nobody reads is not computed)
                parts.append((x, axis, a, b))
    j = next(iter(dims)) - len(lb) - n_lf
    if len(dims) != 1 or not 0 <= j < len(rf):
        raise Decline("the dot's result is cut along a dim that is not one of the weight's columns")
    if not parts or len({tuple(graph.tensors[x].shape) for x, *_ in parts}) != 1:
        raise Decline("the parts of the dot's result differ in shape")
    if tuple(graph.tensors[c.outputs[0]].shape) != tuple(graph.tensors[parts[0][0]].shape):
        raise Decline("the epilogue's result is not of the parts' shape")
    return tuple((x, op.inputs[1], rf[j], a, b) for x, _, a, b in parts), tuple(cuts)


def _keeps_zero(graph: Graph, chain: tuple[int, ...], base: int, x: int) -> bool:
    f = block_fn(graph, chain, [base], [x])
    with jax.ensure_compile_time_eval():   # matched while jit traces the program: evaluate now
        return bool(np.asarray(f(jnp.zeros((), graph.tensors[base].dtype))) == 0)


def _build(call_kernel: Callable[..., Any]) -> Callable[[Graph, Cluster, ContractionMatch, str], Step]:
    def build(graph: Graph, c: Cluster, m: ContractionMatch, backend: str) -> Step:
        op = graph.ops[m.op]
        lhs, rhs = m.operands or op.inputs[:2]
        if m.island is not None:
            return _island_step(graph, c, m, op, lhs, rhs, backend)
        pro = tuple(f32_math(block_fn(graph, ch, [base], [x])) if ch else None
                    for ch, base, x in zip(m.prologue, (lhs, rhs), op.inputs[:2]))
        kw_pro = {"prologue": pro} if any(f is not None for f in pro) else {}
        after = tuple(graph.tensors[x].dtype for x in op.inputs[:2])   # a prologue may cast
        if any(f is not None for f in pro) and after != tuple(graph.tensors[t].dtype for t in (lhs, rhs)):
            kw_pro["prologue_dtypes"] = after
        side = m.side
        o = side.outputs[0] if side is not None else c.outputs[0]   # (side by side: the first dot's)
        results = [x for x, *_ in m.parts] or [op.outputs[0]]
        epi = f32_math(block_fn(graph, m.rest, [*results, *m.extras], [o])) if m.rest else None
        shape = side.shape if side is not None else tuple(graph.tensors[o].shape)

        def rhs_views(run: Run) -> tuple[Any, list[Any]]:
            """The weight, or each part's columns of its weight (slices: views, nothing copied)."""
            if not m.parts:
                return run.vtensor(rhs), []
            views = []
            for _, t, d, a, b in m.parts:
                w = VTensor.of(run.vtensor(t))
                full = tuple(w.shape)
                views.append(w if (a, b) == (0, full[d]) else
                             w.with_layout(w.layout.slice(tuple(a if k == d else 0 for k in range(len(full))),
                                                          tuple(b if k == d else n for k, n in enumerate(full)))))
            return views[0], views[1:]

        fm = m.fold
        if fm is not None:
            a_shape = tuple(graph.tensors[fm.inputs[0]].shape)
            fns = _fold_fns(graph, fm)
            kw_pro["prologue_dtypes"] = (graph.tensors[op.inputs[0]].dtype, None)

        def step(run: Run) -> None:
            if side is not None:   # the weights, results and epilogue operands side by side: views
                out = run.concat(side.outputs, side.out_dim, out=True)
                w, more = run.concat(side.weights, side.rhs_dim), []
                extra = [run.concat(xs, axis) if axis >= 0 else run.vtensor(xs[0]) for xs, axis in side.extras]
            else:
                out = run.out_vtensor(o)
                w, more = rhs_views(run)
                extra = [run.vtensor(t) for t in m.extras]
            kw_parts = {"rhs_parts": more} if more else {}
            if fm is not None:
                kw_parts["fold"] = Fold(*fns, inputs=tuple(rows_of(run.vtensor(t), a_shape)
                                                          for t in fm.inputs[1:]))
            res = call_kernel(run.vtensor(lhs), w, op.params, backend, out=out, epilogue=epi,
                              epilogue_args=[broadcast_input(x, shape) for x in extra],
                              **kw_pro, **kw_parts)
            if side is not None:
                run.written_concat(side.outputs, side.out_dim, buffers_of(res))
            else:
                run.written(o, out, buffers_of(res))

        return step
    return build


def _fold_fns(graph: Graph, fm: FoldMatch) -> tuple[Callable[..., Any], ...]:
    """A folded norm's ``kernels.matmul.Fold`` functions: the A tile with the factor taken as 1,
    the statistic's summand, the row factor from the summed statistic."""
    (u, summand), (stat, r, factor_ops) = fm.summand, fm.factor
    factor = f32_math(block_fn(graph, factor_ops, [stat], [r], views=_STAT_VIEWS))
    return (f32_math(_unit_factor(graph, fm)), f32_math(block_fn(graph, summand, list(fm.inputs), [u])),
            (lambda s: 1.0 / factor(s).astype(jnp.float32)) if fm.divides else factor)


def _island_step(graph: Graph, c: Cluster, m: ContractionMatch, op: Any, lhs: int, rhs: int, backend: str) -> Step:
    """A dot with an island epilogue (:func:`_island_epilogue`): the split-K kernel's partials,
    then the island's kernel (``templates.pointwise``'s, stage 2 ``island.program``) summing them
    where it reads the dot's result."""
    fm, side, d = m.fold, m.side, op.outputs[0]
    a_shape = tuple(graph.tensors[lhs].shape)
    fns = _fold_fns(graph, fm) if fm is not None else None
    shape = side.shape if side is not None else tuple(graph.tensors[d].shape)
    columns = {d: (0, 0)}   # each dot's result: (the axis, its offset) in the GEMM's result
    if side is not None:
        offsets = np.cumsum([0] + [graph.tensors[t].shape[side.out_dim] for t in side.outputs])
        columns = {t: (side.out_dim, int(o)) for t, o in zip(side.outputs, offsets)}

    def step(run: Run) -> None:
        kw: dict[str, Any] = {}
        if fm is not None:
            kw["prologue_dtypes"] = (graph.tensors[op.inputs[0]].dtype, None)
            kw["fold"] = Fold(*fns, inputs=tuple(rows_of(run.vtensor(t), a_shape) for t in fm.inputs[1:]))
        w = run.concat(side.weights, side.rhs_dim) if side is not None else run.vtensor(rhs)
        sums = _matmul(run.vtensor(lhs), w, op.params, backend,
                       out=VTensor.fresh(shape, graph.tensors[d].dtype), partial_sums=True, **kw)
        plan = summed(m.island, columns, shape, sums[0].shape[0], stats=fm is not None)
        fn = island_program(graph, plan, scale=fns[2] if fm is not None else None)
        outs = [run.out_vtensor(o) for o in c.outputs]   # (first: an input read where it writes, as the
        ins = [leaf_vtensor(sums[1] if x.stat else sums[0], x) if isinstance(x, Partial)   # pointwise template)
               else leaf_vtensor(run.vtensor(x.tensor) if isinstance(x, Load) else None, x) for x in plan.inputs]
        res = pointwise(fn, ins, out_shape=plan.shape, outs=outs, backend=backend, index_args=plan.uses_index,
                        block=choose_block(plan.shape, 4, ISLAND_BLOCK))
        for o, v, r in zip(c.outputs, outs, (res,) if len(outs) == 1 else res):
            run.written(o, v, buffers_of(r))

    return step


def _matmul(a: Any, b: Any, p: Mapping[str, Any], backend: str, **kw: Any) -> Any:
    return matmul(a, b, dimension_numbers=p["dimension_numbers"],
                  preferred_element_type=p.get("preferred_element_type"), precision=p.get("precision"),
                  backend=backend, **kw)


def _conv(x: Any, w: Any, p: Mapping[str, Any], backend: str, **kw: Any) -> Any:
    return conv(x, w, window_strides=p["window_strides"], padding=p["padding"],
                lhs_dilation=p.get("lhs_dilation"), rhs_dilation=p.get("rhs_dilation"),
                dimension_numbers=p["dimension_numbers"], feature_group_count=p["feature_group_count"],
                preferred_element_type=p.get("preferred_element_type"), precision=p.get("precision"),
                backend=backend, **kw)


MATMUL = Template(Kind.MATMUL, library=True, match=_match("dot_general"), build=_build(_matmul),
                  fuses_beyond_xla=lambda m: len(m.parts) > 1 or m.fold is not None or m.side is not None
                  or m.island is not None)
CONV = Template(Kind.CONV, library=True, match=_match("conv_general_dilated"), build=_build(_conv))
