"""The one vocabulary: primitives.TABLE agrees with the movement rules and the stages' use of it."""
import jax
import jax.numpy as jnp
import numpy as np

from vtc_jax import movement, primitives
from vtc_jax.graph import trace
from vtc_jax.primitives import Direction, Kind, Role


def test_every_movement_primitive_has_exactly_one_rule():
    """Adding a movement primitive = a TABLE row + a movement.RULES entry; the two must agree."""
    assert set(movement.RULES) - {"convert_element_type"} == set(primitives.MOVEMENT)
    assert primitives.TABLE["convert_element_type"].role is Role.ELEMENTWISE   # a copy only when same dtype


def test_roles_of_ops_and_views():
    def f(x):
        y = x.reshape(4, 8).astype(jnp.float32)        # same dtype: a copy, a view
        z = jnp.transpose(y) * 2.0
        return z.astype(jnp.bfloat16), jnp.broadcast_to(y[None], (1, 4, 8))

    g = trace(f, jax.ShapeDtypeStruct((32,), jnp.float32))
    roles = {op.primitive: primitives.role_of(op, g) for op in g.ops}
    assert roles["transpose"] is Role.MOVEMENT and roles["mul"] is Role.ELEMENTWISE
    views = {op.primitive for op in g.ops if primitives.is_view(op, g)}
    assert "reshape" in views and "transpose" not in views and "mul" not in views
    dtype_changes = [op for op in g.ops if op.primitive == "convert_element_type"
                     and np.dtype(g.tensors[op.outputs[0]].dtype) == np.dtype(jnp.bfloat16)]
    assert dtype_changes and not primitives.is_movement_op(dtype_changes[0], g)


def test_in_place_and_data_operands():
    assert primitives.inplace_operand("dynamic_update_slice") == 0
    assert primitives.inplace_operand("transpose") is None
    assert not primitives.block_safe("iota") and primitives.block_safe("tanh")


def test_enums_are_the_plain_names():
    assert Kind.MATMUL == "matmul" and f"{Kind.ATTENTION}" == "attention"
    assert Direction.READ == "read" and str(Direction.WRITE) == "write"


def test_what_a_stage_may_do_is_a_field_of_the_row():
    """The stages' former name lists are fields of the table (one owner); ``expand_dims`` is not
    a jax primitive (jax binds broadcast_in_dim or reshape) and appears nowhere."""
    T = primitives.TABLE

    def having(field):
        return {n for n, r in T.items() if getattr(r, field)}

    assert "expand_dims" not in T
    assert having("sinkable") == {"transpose", "reshape", "squeeze"}
    assert having("stat_view") == {"broadcast_in_dim", "reshape", "squeeze"}
    assert having("read_only") <= primitives.MOVEMENT | {"convert_element_type"}
    assert {"gather", "dynamic_slice", "scatter"}.isdisjoint(having("read_only"))   # runtime indices
    assert having("componentwise") <= primitives.MOVEMENT | {"reduce_precision"}
    assert primitives.ELEMENTWISE <= having("speculable")
    assert not having("speculable") & (primitives.REDUCTION | primitives.CONTRACTION | {"dynamic_update_slice"})
    assert having("score_view") >= {"convert_element_type", "reshape", "transpose", "stop_gradient"}
    assert having("plain_call") == {"pjit", "jit", "closed_call", "core_call"} < primitives.CALL_LIKE
    assert all(T[n].call_body for n in primitives.CALL_LIKE)
    assert primitives.CONTROL_FLOW == {"scan", "while", "cond", "shard_map"}
    from vtc_jax import canonical, cluster, graph
    from vtc_jax.templates import attention, island, reduction
    assert cluster._STAT_VIEWS == reduction._STAT_VIEWS == having("stat_view")
    assert island.READ_ONLY == having("read_only") and attention._VIEWS == having("score_view")
    assert canonical._PAIRWISE == having("componentwise") and graph.CONTROL_FLOW == primitives.CONTROL_FLOW


def test_cluster_kind_of_each_role():
    def f(x, w, i):
        y = jnp.tanh(x @ w)
        s = jnp.sum(y, axis=-1)
        c = jax.lax.cond(i > 0, lambda a: a + 1.0, lambda a: a - jnp.max(a), s)   # a reduction: kept
        return jnp.transpose(y), c

    g = trace(f, jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32),
              jax.ShapeDtypeStruct((), jnp.int32))
    kinds = {op.primitive: primitives.cluster_kind(op, g) for op in g.ops}
    assert kinds["dot_general"] is Kind.MATMUL and kinds["tanh"] is Kind.POINTWISE
    assert kinds["reduce_sum"] is Kind.REDUCTION and kinds["transpose"] is Kind.MOVEMENT
    (cond,) = [op for op in g.ops if op.primitive == "cond"]
    assert kinds["cond"] is Kind.OPAQUE and primitives.role_of(cond, g) is Role.CONTROL and cond.opaque_reason


def test_an_opaque_op_is_not_movement():
    """A scatter with a combiner (``.at[].add``) is traced opaque: not a movement op."""
    g = trace(lambda x, i, u: x.at[i].add(u), jax.ShapeDtypeStruct((8, 4), jnp.float32),
              jax.ShapeDtypeStruct((3,), jnp.int32), jax.ShapeDtypeStruct((3, 4), jnp.float32))
    (sc,) = [op for op in g.ops if op.primitive == "scatter-add"]
    assert sc.opaque_reason and primitives.role_of(sc, g) is Role.MOVEMENT
    assert not primitives.is_movement_op(sc, g)


def test_f32_math_rows_are_the_kernels_list():
    """kernels/tiling.py derives F32_MATH_PRIMITIVES from the table (``PrimInfo.f32_math``)."""
    from vtc_jax.kernels.tiling import F32_MATH_PRIMITIVES
    assert {n for n, r in primitives.TABLE.items() if r.f32_math} == F32_MATH_PRIMITIVES
