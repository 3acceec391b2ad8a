"""Derivatives of an optimised program: the forward pass is VTC's, the derivatives are the original's.

``optimize(fn)`` re-emits ``fn`` as a program of Pallas kernels reading and writing through index
maps. Those kernels are not differentiable in any useful sense: ``pallas_call`` has no transpose
rule, its JVP refuses ``input_output_aliases`` (in-place caches), and its interpret-mode discharge
trips over grid state. But the program computes *the same function* as ``fn`` — so its derivatives
are ``fn``'s derivatives, and those jax already knows how to compute.

Design: the optimised program is wrapped in a :func:`jax.custom_jvp` whose

* primal is the optimised program (VTC's kernels: what a plain call, ``jit``, ``vmap`` run);
* JVP rule returns that same primal (by calling the custom_jvp function itself, so an outer
  level of differentiation again goes through this rule and never into a kernel) and takes the
  tangents from ``jax.jvp`` of the ORIGINAL function, which runs as ordinary XLA.

Why ``custom_jvp`` and not ``custom_vjp``: ``custom_vjp`` only serves reverse mode (``jax.jvp``
of it raises), while from a JVP rule jax derives everything — ``jax.jvp`` uses the rule directly,
and ``jax.grad`` / ``jax.vjp`` / ``value_and_grad`` linearise it (the primal part, including VTC's
kernels, is known and only evaluated; the tangent part is ``fn``'s JVP, linear in the tangents,
which jax transposes). Higher orders (``hessian``) recurse through the rule. ``vmap`` batches the
primal (the kernels) and the rule. The cost: in reverse mode the forward pass also evaluates the
residuals of ``fn``'s linearisation in plain XLA (what ``jax.grad(jax.jit(fn))`` would compute
anyway); the primal outputs of that JVP are unused and removed as dead code.

Integer, boolean and PRNG-key inputs/outputs get ``float0`` tangents, which jax instantiates and
``jax.jvp`` of ``fn`` accepts and returns as usual.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.tree_util import PyTreeDef

__all__ = ["with_original_derivatives"]


def with_original_derivatives(program: Callable[..., tuple[Any, ...]], fn: Callable[..., Any],
                              in_tree: PyTreeDef) -> Callable[..., tuple[Any, ...]]:
    """``program`` (flat inputs -> flat outputs) made differentiable with ``fn``'s derivatives.

    ``fn(*args, **kwargs)`` is the original function, ``in_tree`` the structure of ``(args,
    kwargs)`` whose leaves are ``program``'s inputs; ``fn``'s output leaves must be ``program``'s
    outputs, in ``jax.tree_util`` order (what ``graph.trace`` guarantees).
    """
    def reference(*flat: Any) -> tuple[Any, ...]:
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
        return tuple(jax.tree_util.tree_leaves(fn(*args, **kwargs)))

    @jax.custom_jvp
    def optimised(*flat: Any) -> tuple[Any, ...]:
        return tuple(program(*flat))

    @optimised.defjvp
    def _jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        out = optimised(*primals)                       # VTC's kernels, never differentiated
        _, tangents_out = jax.jvp(reference, primals, tangents)
        return out, tangents_out

    return optimised
