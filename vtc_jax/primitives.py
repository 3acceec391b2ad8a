"""The one vocabulary: what every stage needs to know about a primitive, in one table.

Each row says a primitive's *role* (movement, elementwise, reduction, contraction, generator, and
the call-like and control-flow primitives the tracer inlines or keeps opaque), which operands
carry data (the rest are runtime indices), whether XLA runs it as a free view (bitcast), which
operand its output may alias (an in-place update), whether a template's stage 2 may re-bind it on
register blocks, and what each stage may do with it (the boolean fields of :class:`PrimInfo`,
each documented with the reason). Cluster kinds, edge directions and profitability classes are
enums here too. Stages read this table; none keeps its own list of primitive names.

Adding a movement primitive: a row here plus its rule in :mod:`movement` (``movement.RULES``;
``tests/test_primitives.py`` checks the two agree). Nothing else: every other stage asks this
table (``tests/test_movement.py``'s ``sharding_constraint`` tests show it).
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Protocol, Sequence

import numpy as np


class Op(Protocol):
    """What the table's helpers read of an op (``graph.Op`` has it): the vocabulary sits below
    the trace, so it names the shape it needs instead of importing the tracer's types."""
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]
    opaque_reason: str | None


class Graph(Protocol):
    """What the table's helpers read of a graph: its tensors (``dtype``, ``size``) by id."""
    tensors: Sequence[Any]

__all__ = ["Role", "Kind", "Direction", "EdgeClass", "PrimInfo", "TABLE", "role_of", "cluster_kind",
           "is_movement_op", "is_view", "data_inputs", "inplace_operand", "kernel_aliases", "block_safe",
           "MOVEMENT", "ELEMENTWISE", "REDUCTION", "CONTRACTION", "CALL_LIKE", "CONTROL_FLOW", "KERNEL_CALLS"]


class Role(enum.StrEnum):
    MOVEMENT = "movement"
    ELEMENTWISE = "elementwise"
    GENERATOR = "generator"      # iota: elementwise in shape, but depends on the index
    REDUCTION = "reduction"
    CONTRACTION = "contraction"
    CALL = "call"                # wraps a body of ordinary ops (jit, custom_jvp_call, remat): inlined
    CONTROL = "control"          # control flow (scan, while, cond): kept opaque (graph._opaque_reason)
    KERNEL = "kernel"            # a compiled kernel (pallas_call): XLA's opaque custom call, nothing fuses across it


class Kind(enum.StrEnum):
    """Cluster kinds (a ``StrEnum``: equal to, and printed as, the plain names)."""
    MATMUL = "matmul"
    CONV = "conv"
    ATTENTION = "attention"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    MOVEMENT = "movement"
    GLUE = "glue"
    OPAQUE = "opaque"


class Direction(enum.StrEnum):
    READ = "read"     # src is the op's output: its consumers read through the map
    WRITE = "write"   # src is an input: its producer writes through the map


class EdgeClass(enum.StrEnum):
    I = "I"           # fully contiguous (or sector-covering) map: always profitable
    II = "II"         # strided / repeated access: the cost model decides


@dataclass(frozen=True)
class PrimInfo:
    """One primitive's row. The boolean fields say what a stage may do with an op of it; each is
    read by one stage, named here so that the stage keeps no name list of its own."""
    name: str
    role: Role
    data: tuple[int, ...] | None = None  # operand positions that carry data (None: all)
    view: bool = False                   # a free bitcast in XLA (see :func:`is_view` for conditions)
    inplace: int | None = None           # operand the output may alias (dynamic_update_slice: 0)
    block_safe: bool = False             # stage 2 may re-bind it on register blocks
    contraction_kind: Kind | None = None
    # A pure read of its operand(s) at statically known indices (no runtime index, no scatter):
    # a pointwise kernel recomputes its value through the index map instead of copying
    # (templates/island.py).
    read_only: bool = False
    # A reshape or broadcast that, inside a reduction cluster, only moves the size-1 statistic
    # axis (the keepdims re-broadcast): the cluster keeps it (cluster._grow_reduction) and the
    # row-reduction kernel binds it as the identity on (rows, 1) blocks (templates/reduction.py).
    stat_view: bool = False
    # A one-operand rearrangement of the elements: an elementwise op commutes with it, so the
    # tracer sinks ``f`` below it and hoists a narrowing cast above it (graph._sink_elementwise,
    # graph._hoist_narrowing_casts).
    sinkable: bool = False
    # Cheap enough to compute for nothing, and no in-place update: a ``cond`` whose branches hold
    # only such ops becomes a ``select_n`` of both branches (canonical.speculable_cond).
    speculable: bool = False
    # On a complex value, the same op on the real and the imaginary part gives the parts of the
    # result (canonical.split_complex: movement and rounding, no arithmetic).
    componentwise: bool = False
    # The attention matcher reads through it: the scores keep their values (up to rounding) and
    # their axes (casts, copies, reshapes, transposes, broadcasts; templates/attention.py).
    score_view: bool = False
    # On bf16/f16 operands, computed in f32 and rounded back (XLA's float normalisation: its GPU
    # backend has no 16-bit transcendental or division); kernels/tiling.f32_math applies it to a
    # template's stage 2 so that the kernel rounds where jax.jit does.
    f32_math: bool = False
    # XLA's ``IsExpensive`` (floating point): a producer XLA does not duplicate into several
    # consumer fusions; a position table computed with one (``pow``, ``cos``) and read by two
    # fusions is a loop fusion of its own (xla.xla_program).
    expensive: bool = False
    # Role.CALL: the params holding the body the tracer inlines (graph.trace), in the order tried.
    # custom_jvp/custom_vjp calls keep only the primal computation (what the forward pass runs).
    call_body: tuple[str, ...] = ()
    # Role.CALL: nothing but its body (no custom derivative, no rematerialisation policy), so a
    # rewrite may evaluate the body in its place (canonical.split_complex).
    plain_call: bool = False


def _rows() -> dict[str, PrimInfo]:
    rows: dict[str, PrimInfo] = {}

    def add(names: str, role: Role, **kw: object) -> None:
        for n in names.split():
            rows[n] = PrimInfo(n, role, **kw)  # type: ignore[arg-type]

    def flag(names: str, **kw: bool) -> None:
        """Set what a stage may do with these (existing) rows; see the fields of PrimInfo."""
        for n in names.split():
            rows[n] = dataclasses.replace(rows[n], **kw)

    add("transpose slice concatenate split rev stack unstack device_put sharding_constraint reshard", Role.MOVEMENT)
    add("reshape squeeze copy copy_p", Role.MOVEMENT, view=True)
    # shard_map's type change (a replicated value used as varying over a manual axis): XLA lowers
    # it to nothing; it stays physical (movement.RULES: no edge) so kernels read it as typed
    add("pvary", Role.MOVEMENT, view=True)
    add("broadcast_in_dim", Role.MOVEMENT, view=True, block_safe=True)   # views when size-preserving
    add("pad", Role.MOVEMENT, data=(0,))
    add("dynamic_slice gather", Role.MOVEMENT, data=(0,))
    add("dynamic_update_slice", Role.MOVEMENT, data=(0, 1), inplace=0)
    # a scatter updates its operand's buffer in place (XLA's in-place scatter), like a DUS
    add("scatter scatter-add scatter_add scatter-mul scatter_mul scatter-min scatter_min scatter-max "
        "scatter_max scatter-sub scatter_sub", Role.MOVEMENT, data=(0, 2), inplace=0)
    add("add sub mul div rem pow max min neg sign abs floor ceil round nextafter exp exp2 log log1p "
        "expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt "
        "cbrt square integer_pow erf erfc erf_inv is_finite "
        "stop_gradient select_n clamp copysign eq ne lt le gt ge and or not xor shift_left "
        "shift_right_logical shift_right_arithmetic population_count real imag conj "
        "bitcast_convert_type "   # equal widths only (cluster.py keeps width changes opaque)
        "one_minus_square log2",   # jax >= 0.11 (tanh's and asin's derivatives; jnp.log2)
        Role.ELEMENTWISE, block_safe=True, speculable=True)
    # elementwise, but Pallas' Triton lowering has no rule for them (jax 0.10.2 and 0.12) and no
    # kernel computes them from others (``kernels.tiling.IN_KERNEL_MATH`` does erf, erfc, round):
    # a cluster holding one stays XLA's
    add("lgamma digamma reduce_precision", Role.ELEMENTWISE, speculable=True)
    # a dtype change is elementwise; the same dtype is a copy (a view): see role_of / is_view
    add("convert_element_type", Role.ELEMENTWISE, view=True, block_safe=True, speculable=True)
    add("iota", Role.GENERATOR, speculable=True)
    add("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin", Role.REDUCTION)
    rows["dot_general"] = PrimInfo("dot_general", Role.CONTRACTION, contraction_kind=Kind.MATMUL)
    rows["conv_general_dilated"] = PrimInfo("conv_general_dilated", Role.CONTRACTION, contraction_kind=Kind.CONV)
    add("pjit jit", Role.CALL, call_body=("jaxpr",), plain_call=True)
    add("closed_call core_call", Role.CALL, call_body=("call_jaxpr",), plain_call=True)
    add("custom_jvp_call", Role.CALL, call_body=("call_jaxpr",))
    add("custom_vjp_call", Role.CALL, call_body=("call_jaxpr", "fun_jaxpr"))
    add("custom_vjp_call_jaxpr", Role.CALL, call_body=("fun_jaxpr", "call_jaxpr"))
    add("remat remat2 checkpoint", Role.CALL, call_body=("jaxpr",))
    add("scan while cond shard_map", Role.CONTROL)
    add("pallas_call triton_kernel_call", Role.KERNEL)

    flag("transpose reshape squeeze broadcast_in_dim slice concatenate pad rev copy convert_element_type "
         "split stack unstack", read_only=True)
    flag("broadcast_in_dim reshape squeeze", stat_view=True)
    flag("transpose reshape squeeze", sinkable=True)
    flag("broadcast_in_dim reshape squeeze transpose copy slice concatenate pad rev", speculable=True)
    flag("broadcast_in_dim reshape transpose squeeze slice rev dynamic_slice copy copy_p reduce_precision",
         componentwise=True)
    flag("convert_element_type reshape squeeze transpose broadcast_in_dim copy copy_p stop_gradient "
         "reduce_precision pvary", score_view=True)
    # division and the transcendentals: computed in f32 on 16-bit operands, and XLA's expensive ops
    costly = ("div rem pow atan2 logistic tanh tan sin cos asin acos atan sinh cosh asinh acosh atanh "
              "exp exp2 expm1 log log1p sqrt rsqrt cbrt erf erfc erf_inv lgamma digamma")
    flag(costly + " nextafter", f32_math=True)
    flag(costly, expensive=True)
    return rows


TABLE: dict[str, PrimInfo] = _rows()

MOVEMENT = frozenset(n for n, r in TABLE.items() if r.role is Role.MOVEMENT)
ELEMENTWISE = frozenset(n for n, r in TABLE.items() if r.role in (Role.ELEMENTWISE, Role.GENERATOR))
REDUCTION = frozenset(n for n, r in TABLE.items() if r.role is Role.REDUCTION)
CONTRACTION = frozenset(n for n, r in TABLE.items() if r.role is Role.CONTRACTION)
CALL_LIKE = frozenset(n for n, r in TABLE.items() if r.role is Role.CALL)
CONTROL_FLOW = frozenset(n for n, r in TABLE.items() if r.role is Role.CONTROL)
KERNEL_CALLS = frozenset(n for n, r in TABLE.items() if r.role is Role.KERNEL)

# The kind of cluster a lone op of each role seeds (contractions: their row's contraction_kind).
# Calls and control flow that reach the graph (not inlined) are opaque, like primitives the table
# does not know.
_SEEDS = MappingProxyType({Role.MOVEMENT: Kind.MOVEMENT, Role.ELEMENTWISE: Kind.POINTWISE,
                           Role.GENERATOR: Kind.POINTWISE, Role.REDUCTION: Kind.REDUCTION,
                           Role.CALL: Kind.OPAQUE, Role.CONTROL: Kind.OPAQUE, Role.KERNEL: Kind.OPAQUE})


def _same_dtype(op: Op, graph: Graph) -> bool:
    a, b = graph.tensors[op.inputs[0]].dtype, graph.tensors[op.outputs[0]].dtype
    try:
        return np.dtype(a) == np.dtype(b)
    except TypeError:   # extended dtypes (PRNG keys) are not numpy dtypes
        return a == b


def role_of(op: Op, graph: Graph) -> Role | None:
    """The op's role (None: not in the table). A convert that keeps the dtype is movement (a copy)."""
    r = TABLE.get(op.primitive)
    if r is None:
        return None
    if op.primitive == "convert_element_type" and _same_dtype(op, graph):
        return Role.MOVEMENT
    return r.role


def cluster_kind(op: Op, graph: Graph) -> Kind:
    """The kind of cluster the op seeds on its own, from its role (``Kind.OPAQUE``: a primitive
    the table does not know, or a call / control flow the tracer kept). ``cluster._kind`` refines
    it (glue, opaque reasons); this is the table's part."""
    r = role_of(op, graph)
    if r is None:
        return Kind.OPAQUE
    if r is Role.CONTRACTION:
        kind = TABLE[op.primitive].contraction_kind
        assert kind is not None, op.primitive
        return kind
    return _SEEDS[r]


def is_movement_op(op: Op, graph: Graph) -> bool:
    """The op only moves data: a movement primitive, or a convert that keeps the dtype (a copy),
    that the tracer did not keep opaque (a ``scatter-add`` with its combiner jaxpr is opaque).
    The one definition: whether it offers VTOG edges is ``movement.rules``' business (a gather at
    runtime indices is movement that offers none, ``movement.explain_no_edges`` says why)."""
    return op.opaque_reason is None and role_of(op, graph) is Role.MOVEMENT


def is_view(op: Op, graph: Graph) -> bool:
    """XLA runs the op as a free bitcast: reshape (without ``dimensions``), squeeze, copy, a
    size-preserving broadcast, a convert that keeps the dtype. The one definition."""
    r = TABLE.get(op.primitive)
    if r is None or not r.view:
        return False
    if op.primitive == "reshape":
        return op.params.get("dimensions") is None
    if op.primitive == "broadcast_in_dim":
        return len(op.inputs) == 1 and graph.tensors[op.inputs[0]].size == graph.tensors[op.outputs[0]].size
    if op.primitive == "convert_element_type":
        return _same_dtype(op, graph)
    return True


def is_fill(op: Op, graph: Graph) -> bool:
    """The op broadcasts one element (``jnp.ones``, ``jnp.full``, a scalar operand): XLA never
    writes it out for a reader, it makes the value inside every fusion that reads it, so it moves
    no data. The one definition."""
    return op.primitive == "broadcast_in_dim" and len(op.inputs) == 1 and graph.tensors[op.inputs[0]].size == 1


def is_expensive(op: Op) -> bool:
    """XLA's ``IsExpensive`` for the op: its row's flag, and an integer power with a negative
    exponent, which XLA computes as a division (``x ** -2`` is ``1 / (x * x)``: a
    ``loop_divide_fusion`` of its own in front of the reduction reading it; a positive one is
    multiplies). The one definition."""
    r = TABLE.get(op.primitive)
    if op.primitive == "integer_pow":
        return int(op.params.get("y", 1)) < 0
    return r is not None and r.expensive


def data_inputs(op: Op) -> tuple[int, ...]:
    """The operands that carry data (not dynamic start indices, gather indices or pad values)."""
    r = TABLE.get(op.primitive)
    if r is None or r.data is None:
        return op.inputs
    return tuple(op.inputs[i] for i in r.data if i < len(op.inputs))


def inplace_operand(primitive: str) -> int | None:
    """Position of the operand whose buffer the output may be (an in-place update), if any."""
    r = TABLE.get(primitive)
    return None if r is None else r.inplace


def kernel_aliases(op: Op) -> dict[int, int]:
    """``{output position: operand position}`` of a kernel call's in-place outputs (Pallas's
    ``input_output_aliases``): XLA hands the kernel the operand's buffer as that output, so the
    kernel writes no new one (it touches what it stores), and reads it only where
    :func:`kernel_reads_in_place` says so."""
    if TABLE.get(op.primitive) is None or TABLE[op.primitive].role is not Role.KERNEL:
        return {}
    return {int(o): int(i) for i, o in op.params.get("input_output_aliases", ())}


READS_IN_PLACE = "vtc_reads_in_place"   # pallas_call metadata: aliased operands the kernel reads whole


def kernel_reads_in_place(op: Op) -> frozenset[int]:
    """The operand positions of a Pallas kernel call that it updates in place *and* reads whole,
    as the kernel declares them (its ``metadata[READS_IN_PLACE]``, comma-separated positions, set
    by ``kernels.vio.Plan`` for a buffer passed ``over``: a decode attention performing the cache
    update it reads). A kernel that reads an aliased operand only where it writes it (an
    element-wise in-place update) declares nothing: it touches what it stores."""
    meta = dict(op.params.get("metadata") or {})   # (a jax FrozenDict: .get takes no default)
    found = meta.get(READS_IN_PLACE) or ""
    aliased = set(kernel_aliases(op).values())
    return frozenset(int(i) for i in str(found).split(",") if i.strip() and int(i) in aliased)


def block_safe(primitive: str) -> bool:
    r = TABLE.get(primitive)
    return bool(r and r.block_safe)
