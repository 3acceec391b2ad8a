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
