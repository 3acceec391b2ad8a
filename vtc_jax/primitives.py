"""The one vocabulary: what every stage needs to know about a primitive, in one table.

Each row says a primitive's *role* (movement, elementwise, reduction, contraction, generator),
which operands carry data (the rest are runtime indices), whether XLA runs it as a free view
(bitcast), which operand its output may alias (an in-place update), and whether a template's
stage 2 may re-bind it on register blocks. Cluster kinds, edge directions and profitability
classes are enums here too. Stages read this table; none keeps its own list.

Adding a movement primitive: a row here plus its rule in :mod:`movement` (``movement.RULES``;
``tests/test_primitives.py`` checks the two agree).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .graph import Graph, Op

__all__ = ["Role", "Kind", "Direction", "EdgeClass", "PrimInfo", "TABLE", "info", "role_of",
           "is_movement_op", "is_view", "data_inputs", "inplace_operand", "block_safe",
           "MOVEMENT", "ELEMENTWISE", "REDUCTION", "CONTRACTION"]


class Role(enum.StrEnum):
    MOVEMENT = "movement"
    ELEMENTWISE = "elementwise"
    GENERATOR = "generator"      # iota: elementwise in shape, but depends on the index
    REDUCTION = "reduction"
    CONTRACTION = "contraction"


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
    name: str
    role: Role
    data: tuple[int, ...] | None = None  # operand positions that carry data (None: all)
    view: bool = False                   # a free bitcast in XLA (see :func:`is_view` for conditions)
    inplace: int | None = None           # operand the output may alias (dynamic_update_slice: 0)
    block_safe: bool = False             # stage 2 may re-bind it on register blocks
    contraction_kind: Kind | None = None


def _rows() -> dict[str, PrimInfo]:
    rows: dict[str, PrimInfo] = {}

    def add(names: str, role: Role, **kw: object) -> None:
        for n in names.split():
            rows[n] = PrimInfo(n, role, **kw)  # type: ignore[arg-type]

    add("transpose slice concatenate split rev stack unstack device_put", Role.MOVEMENT)
    add("reshape squeeze copy copy_p", Role.MOVEMENT, view=True)
    add("broadcast_in_dim", Role.MOVEMENT, view=True, block_safe=True)   # views when size-preserving
    add("pad", Role.MOVEMENT, data=(0,))
    add("dynamic_slice gather", Role.MOVEMENT, data=(0,))
    add("dynamic_update_slice", Role.MOVEMENT, data=(0, 1), inplace=0)
    add("scatter scatter-add scatter_add scatter-mul scatter_mul scatter-min scatter_min scatter-max "
        "scatter_max scatter-sub scatter_sub", Role.MOVEMENT)
    add("add sub mul div rem pow max min neg sign abs floor ceil round nextafter exp exp2 log log1p "
        "expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt "
        "cbrt square integer_pow erf erfc erf_inv lgamma digamma is_finite reduce_precision "
        "stop_gradient select_n clamp copysign eq ne lt le gt ge and or not xor shift_left "
        "shift_right_logical shift_right_arithmetic population_count real imag conj "
        "bitcast_convert_type "   # equal widths only (cluster.py keeps width changes opaque)
        "one_minus_square log2",   # jax >= 0.11 (tanh's and asin's derivatives; jnp.log2)
        Role.ELEMENTWISE, block_safe=True)
    # a dtype change is elementwise; the same dtype is a copy (a view): see role_of / is_view
    add("convert_element_type", Role.ELEMENTWISE, view=True, block_safe=True)
    add("iota", Role.GENERATOR)
    add("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin", Role.REDUCTION)
    rows["dot_general"] = PrimInfo("dot_general", Role.CONTRACTION, contraction_kind=Kind.MATMUL)
    rows["conv_general_dilated"] = PrimInfo("conv_general_dilated", Role.CONTRACTION, contraction_kind=Kind.CONV)
    return rows


TABLE: dict[str, PrimInfo] = _rows()

MOVEMENT = frozenset(n for n, r in TABLE.items() if r.role is Role.MOVEMENT)
ELEMENTWISE = frozenset(n for n, r in TABLE.items() if r.role in (Role.ELEMENTWISE, Role.GENERATOR))
REDUCTION = frozenset(n for n, r in TABLE.items() if r.role is Role.REDUCTION)
CONTRACTION = frozenset(n for n, r in TABLE.items() if r.role is Role.CONTRACTION)


def info(name: str) -> PrimInfo | None:
    return TABLE.get(name)


def _same_dtype(op: "Op", graph: "Graph") -> bool:
    a, b = graph.tensors[op.inputs[0]].dtype, graph.tensors[op.outputs[0]].dtype
    try:
        return np.dtype(a) == np.dtype(b)
    except TypeError:   # extended dtypes (PRNG keys) are not numpy dtypes
        return a == b


def role_of(op: "Op", graph: "Graph") -> Role | None:
    """The op's role (None: not in the table). A convert that keeps the dtype is movement (a copy)."""
    r = TABLE.get(op.primitive)
    if r is None:
        return None
    if op.primitive == "convert_element_type" and _same_dtype(op, graph):
        return Role.MOVEMENT
    return r.role


def is_movement_op(op: "Op", graph: "Graph") -> bool:
    return role_of(op, graph) is Role.MOVEMENT


def is_view(op: "Op", graph: "Graph") -> bool:
    """XLA runs the op as a free bitcast: reshape (without ``dimensions``), squeeze, expand_dims,
    copy, a size-preserving broadcast, a convert that keeps the dtype. The one definition."""
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


def data_inputs(op: "Op") -> tuple[int, ...]:
    """The operands that carry data (not dynamic start indices, gather indices or pad values)."""
    r = TABLE.get(op.primitive)
    if r is None or r.data is None:
        return op.inputs
    return tuple(op.inputs[i] for i in r.data if i < len(op.inputs))


def inplace_operand(primitive: str) -> int | None:
    """Position of the operand whose buffer the output may be (an in-place update), if any."""
    r = TABLE.get(primitive)
    return None if r is None else r.inplace


def block_safe(primitive: str) -> bool:
    r = TABLE.get(primitive)
    return bool(r and r.block_safe)
