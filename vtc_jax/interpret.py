"""Evaluate a jaxpr equation by equation, with a rule that may replace any equation.

Two passes re-run a traced function op by op under a different number representation:
``canonical.split_complex`` (complex values as pairs of real tensors) and
``kernels.tiling.f32_math`` (16-bit math computed in f32, XLA's float normalisation). They share
this loop; each supplies only its rule. ``rebind`` is the one way every stage re-binds a traced
primitive on new values.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.extend.core as jcore

__all__ = ["interpret", "rebind", "Rule"]

# rule(eqn, input values) -> the outputs, or None to bind the equation's primitive unchanged
Rule = Callable[[Any, list[Any]], "list[Any] | None"]


def rebind(primitive: Any, args: Sequence[Any], params: Any) -> list[Any] | Any:
    """``primitive`` bound on ``args`` with an equation's ``params``, as ``jax.core.eval_jaxpr``
    binds it: through ``primitive.get_bind_params``. Why not ``bind(*args, **params)``: a
    higher-order primitive may take its body as a function rather than as the traced jaxpr param
    (``shard_map``: ``jaxpr`` becomes ``subfuns``; bound with the jaxpr it raises
    ``KeyError: 'subfuns'``). Multiple results come back as a list (``shard_map`` binds to a
    FlatTree of them), a single result as itself."""
    res = primitive.bind(*args, **primitive.get_bind_params(dict(params)))
    return list(res) if primitive.multiple_results else res


def interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rule: Rule) -> list[Any]:
    """The outputs of ``jaxpr`` on ``args``, each equation evaluated by ``rule`` or re-bound."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = rule(eqn, invals)
        if outs is None:
            res = rebind(eqn.primitive, invals, eqn.params)
            outs = res if eqn.primitive.multiple_results else [res]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
