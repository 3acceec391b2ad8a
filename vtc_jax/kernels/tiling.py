"""Tiling helpers shared by the kernel templates: power-of-two blocks, grids, loops, f32 math.

Everything here is static planning or scalar index arithmetic; nothing touches memory (that is
:mod:`vio`'s job). A template combines them as the Pallas GPU ops do: a kernel body taking its
static configuration, a launch building the grid, and a thin public wrapper.

* Blocks: :func:`next_pow2`, :func:`check_pow2`, :func:`choose_block` (pointwise / elementwise
  tiles), :func:`choose_blocks` (the (bm, bn, bk) of a dot), :func:`split_block` (one group's block
  split over several dims), :class:`Group` (a group of dims tiled together and the per-dim origins
  of a tile index).
* Grids and loops: :func:`cdiv`, :func:`program_id` (the Python int 0 on a size-1 grid axis, so
  vio sees a static origin), :func:`grid_origin` (a 1-D grid over blocks), :func:`fori` (a loop
  that is just the body when it runs once).
* Dots: :func:`dot_config` (precision and accumulator dtype of the in-kernel ``tt.dot``).
* 16-bit math: :func:`f32_math` and :data:`F32_MATH_PRIMITIVES` (per-op f32 for the primitives
  Triton cannot run on bf16/f16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["MIN_DOT_BLOCK", "next_pow2", "cdiv", "check_pow2", "choose_block", "choose_blocks",
           "split_block", "Group", "program_id", "grid_origin", "fori", "dot_config", "f32_math",
           "F32_MATH_PRIMITIVES"]

MIN_DOT_BLOCK = 16  # tt.dot needs M, N, K >= 16 (and K >= 16 for 16-bit types in the front end)
_TARGET = 2048      # elements per elementwise block (fits 4 warps comfortably for a few live values)
_MAX_1D = 1024      # elementwise block of a rank-1 tensor


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------

def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(n: int, d: int) -> int:
    return -(-int(n) // int(d))


def check_pow2(name: str, v: int, minimum: int = MIN_DOT_BLOCK) -> None:
    """Raise ``ValueError`` unless ``v`` is a power of two ``>= minimum``."""
    if v < minimum or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two >= {minimum}")


def choose_block(shape: Sequence[int], itemsize: int = 4, target: int = _TARGET) -> tuple[int, ...]:
    """Power-of-two block for ``shape``, filled from the innermost dim outwards up to ~``target``
    elements: the last dim at most 128 (4-byte) / 256 (2-byte) wide, outer dims get what is left
    of the budget (1 once it is spent: those dims are collapsed into the grid)."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return ()
    if len(shape) == 1:
        return (min(next_pow2(shape[0]), _MAX_1D),)
    last = min(next_pow2(shape[-1]), 256 if itemsize <= 2 else 128)
    out, budget = [last], max(1, target // last)
    for n in reversed(shape[:-1]):
        b = min(next_pow2(n), budget)
        out.append(b)
        budget = max(1, budget // b)
    return tuple(reversed(out))


def choose_blocks(m: int, n: int, k: int, *, block_m: int = 64, block_n: int = 64,
                  block_k: int = 32) -> tuple[int, int, int]:
    """The effective (bm, bn, bk) for logical sizes M, N, K: ``max(16, next_pow2(size))`` capped
    at the requested block (the M = 1..16 decode case gets bm = 16)."""
    return tuple(min(cap, max(MIN_DOT_BLOCK, next_pow2(s)))  # type: ignore[return-value]
                 for s, cap in ((m, block_m), (n, block_n), (k, block_k)))


def split_block(sizes: Sequence[int], cap: int, minimum: int = MIN_DOT_BLOCK) -> tuple[int, ...]:
    """Blocks (powers of two) for a group: the total is ``min(cap, max(minimum, padded size))``,
    handed out from the innermost dim; any surplus (group smaller than ``minimum``) is masked lanes
    on the innermost dim."""
    if not sizes:
        return ()
    total = min(int(cap), max(minimum, math.prod(next_pow2(s) for s in sizes)))
    blocks = [1] * len(sizes)
    rem = total
    for i in reversed(range(len(sizes))):
        b = min(next_pow2(sizes[i]), rem)
        blocks[i] = b
        rem //= b
    # Surplus lanes go on the innermost dim that has more than one element: a block wider than
    # 1 on a size-1 dim is a dim with no physical home, which stores cannot serve strided.
    big = [i for i, s in enumerate(sizes) if s > 1]
    blocks[big[-1] if big else -1] *= rem
    return tuple(blocks)


@dataclass(frozen=True)
class Group:
    """A group of logical dims tiled together (a dot's B, M, N or K): sizes, blocks, tiles per dim."""
    sizes: tuple[int, ...]
    blocks: tuple[int, ...]

    @property
    def tiles(self) -> tuple[int, ...]:
        return tuple(-(-s // b) for s, b in zip(self.sizes, self.blocks))

    @property
    def ntiles(self) -> int:
        return math.prod(self.tiles)

    @property
    def block(self) -> int:
        return math.prod(self.blocks)

    def origins(self, t: Any) -> tuple[Any, ...]:
        """Per-dim origins of tile ``t`` (traced int32 or Python int), innermost dim fastest."""
        out: list[Any] = [0] * len(self.sizes)
        stride = 1
        for i in reversed(range(len(self.sizes))):
            n, b = self.tiles[i], self.blocks[i]
            if n > 1:
                # lax.div/rem on int32 (operands are non-negative): jnp's floor-mod expands into
                # selects whose constants the Triton lowering mistypes (i1 vs i32).
                q = t if stride == 1 else _div(t, stride)
                if stride * n < self.ntiles:
                    q = _rem(q, n)
                out[i] = q * b
            stride *= n
        return tuple(out)


def _div(x: Any, c: int) -> Any:
    return x // c if isinstance(x, int) else lax.div(x, jnp.int32(c))


def _rem(x: Any, c: int) -> Any:
    return x % c if isinstance(x, int) else lax.rem(x, jnp.int32(c))


# --------------------------------------------------------------------------------------------
# Grids and loops
# --------------------------------------------------------------------------------------------

def program_id(axis: int, size: int) -> Any:
    """The program id along a grid axis, as the Python int 0 when the axis has one program: vio
    then knows the block origin statically and emits no bounds mask along that dim."""
    return 0 if size == 1 else pl.program_id(axis)


def grid_origin(shape: Sequence[int], block: Sequence[int], pid: Any) -> tuple[tuple[Any, ...], int]:
    """(origin of program ``pid``'s block, grid size) for a 1-D grid over blocks, last dim fastest.

    Dims covered by a single block get the static origin ``0`` (vio then skips their masks when
    the block also fits exactly). Returns the grid size as the second element.
    """
    counts = [max(1, -(-int(n) // int(b))) for n, b in zip(shape, block)]
    origin: list[Any] = []
    stride = 1
    for n, b in reversed(list(zip(counts, block))):
        if n == 1:
            origin.append(0)
        else:
            q = pid if stride == 1 else pid // stride
            origin.append((q % n) * b if stride * n < math.prod(counts) else q * b)
        stride *= n
    return tuple(reversed(origin)), math.prod(counts)


def fori(n: int, step: Callable[[Any, Any], Any], init: Any) -> Any:
    """``lax.fori_loop(0, n, step, init)``, or just ``step(0, init)`` when it runs once."""
    return step(0, init) if n == 1 else lax.fori_loop(0, n, step, init)


# --------------------------------------------------------------------------------------------
# Dots
# --------------------------------------------------------------------------------------------

def dot_config(compute_dtype: Any, precision: Any = None) -> tuple[Any, np.dtype]:
    """(precision, accumulator dtype) of an in-kernel dot over ``compute_dtype`` operands.

    ``precision`` None means ``HIGHEST`` for f32 operands (IEEE f32 FMA on the GPU, as exact as
    interpret mode; ``DEFAULT`` would be TF32); the accumulator is f32 for 16/32-bit floats.
    """
    compute_dtype = np.dtype(compute_dtype)
    if precision is None and compute_dtype == np.float32:
        precision = lax.Precision.HIGHEST
    return precision, np.dtype(jnp.float32) if compute_dtype.itemsize <= 4 else compute_dtype


# --------------------------------------------------------------------------------------------
# 16-bit math
# --------------------------------------------------------------------------------------------

# Primitives computed in f32 (inputs upcast, result rounded back) when they see 16-bit floats.
F32_MATH_PRIMITIVES = frozenset({
    "div", "rem", "pow", "atan2", "nextafter", "logistic", "tanh", "tan", "sin", "cos", "asin",
    "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "exp", "exp2", "expm1", "log",
    "log1p", "sqrt", "rsqrt", "cbrt", "erf", "erfc", "erf_inv", "lgamma", "digamma",
})
_LOW = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def f32_math(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` evaluated primitive by primitive, with :data:`F32_MATH_PRIMITIVES` on bf16/f16
    operands computed in f32 and rounded back (call-like primitives — jit, custom_jvp/vjp — are
    inlined). Everything else is re-bound unchanged. A no-op for f32 programs."""
    def wrapped(*args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _eval_f32_math(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)
    return wrapped


def _eval_f32_math(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                      if isinstance(eqn.params.get(k), jcore.ClosedJaxpr)), None)
        if inner is not None and eqn.primitive.name in ("pjit", "jit", "closed_call", "core_call",
                                                         "custom_jvp_call", "custom_vjp_call",
                                                         "custom_vjp_call_jaxpr", "remat", "checkpoint"):
            outs = _eval_f32_math(inner.jaxpr, inner.consts, invals)
        elif eqn.primitive.name in F32_MATH_PRIMITIVES and any(
                np.dtype(v.aval.dtype) in _LOW for v in eqn.invars if hasattr(v.aval, "dtype")):
            up = [jnp.asarray(x).astype(jnp.float32) if np.dtype(v.aval.dtype) in _LOW else x
                  for v, x in zip(eqn.invars, invals)]
            outs = eqn.primitive.bind(*up, **eqn.params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            outs = [o.astype(v.aval.dtype) if np.dtype(v.aval.dtype) in _LOW else o
                    for o, v in zip(outs, eqn.outvars)]
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]
