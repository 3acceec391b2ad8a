"""Attention clusters: dot → scale / soft-cap / mask → softmax → dot, one flash kernel.

The matcher reads the cluster by *meaning*, not by spelling. It walks the cluster's primitives
in order and gives every value a role — scores (with the scale, soft-cap and masks applied so
far), their row max, ``scores - max``, ``exp``, the row sum, probabilities — or declines naming
the step it did not recognise. Accepted between q·k and p·v:

* scaling: ``mul``/``div`` by anything that folds to a scalar constant (``1/sqrt(D)``,
  ``lax.rsqrt(D)``, ``/ jnp.sqrt(D)``); scaling *after* a soft-cap is folded into the cap.
  (``q * scale`` before the first dot is not part of the cluster: the kernel reads the scaled q.)
* soft-cap ``tanh(s / c) * c`` (in any arrangement of the two scalings around the ``tanh``);
* masks: ``select_n`` (``jnp.where(mask, s, neg)`` or ``jnp.where(~mask, neg, s)``) and additive
  biases ``s + b`` where ``b`` only takes the values 0 and a large negative. ``neg`` may be
  ``-inf``, ``finfo.min`` or any value ``<= NEG_BOUND`` (-1e4 as bf16 stores it, -9984): the kernels treat such lanes as
  -inf, which equals jax's numbers whenever a row has one valid key (``exp(neg + s - max)``
  underflows to exactly 0 in f32 for scores of magnitude < ~5e3). A row with *no* valid key (a
  runtime position < 0, say) gets what jax computes (:func:`_empty_rows`): NaN for ``-inf``
  selects, and a second pass over all T keys at jax's masked values for one finite fill or one
  additive bias value (the mean of V, or the softmax of ``(s + b) * f`` rounded as jax rounds it);
  other combinations are declined when such a row can happen. Scaling after a mask must keep the
  masked value <= NEG_BOUND.
* a mask computed from the scores themselves: ``jnp.where(s != 0, s, neg)`` (a port that starts
  from a zero cache masks the rows never written by their zero score), any comparison of the
  scores with 0, negated or mirrored (``0 == s``, ``~(s < 0)``). The kernels compare their own
  scaled, capped scores (``kernels.flash.score_lanes``), which equal the program's at that stage
  up to rounding and the positive scalings allowed after a mask: the same sign, so only a
  comparison with 0 is the program's, and only before any additive term (the kernels add biases
  after they compare). It can empty any row (:func:`_empty_rows`), as a padding mask can.
* additive biases that are no mask (:func:`_biases`), added before every selecting mask and not
  scaled after: ALiBi as a constant ``slope · t`` (the key position ``t``, one slope per score
  row: BLOOM's and Falcon's ``slopes[:, None] * arange(T)``, equal bit for bit in f32), which the
  kernels compute from an f32 slopes operand; and any other bias — T5's bucketed relative
  positions, Swin's table, ALiBi against ``pos`` or the query row, MLA's second score term —,
  which XLA computes and the kernels read blockwise through its layout (broadcast where it does
  not vary: a per-head table is never repeated over the batch).
* the mask given to the softmax, ``jax.nn.softmax(s, where=m)`` (flax's and equinox's code): a
  select mask whose repeated select of the scores before it is the same value, and whose
  ``where(m, ·, 0)`` on the numerator and on the probabilities changes only a row with no valid
  key — 0 in jax, the kernels' ``"zero"`` row, where ``m`` is that row's only mask (with other
  masks jax's row is NaN in some lanes: declined when such a row can happen);
* an attention sink (gpt-oss): ``softmax(concatenate([s, sink], keys))[..., :-1]`` — one logit per
  row (a learned per-head value, broadcast), in front or behind, joining the softmax's denominator
  and sliced off before ``p·v``; it joins the scores as they are (nothing but the softmax may
  follow), and the kernels read it as an operand and fold it into each row once
  (:func:`kernels.flash.with_sink`): a row with no valid key is 0, as jax's;
* softmax: ``jax.nn.softmax`` or by hand (``exp(x - max) / sum``, ``stop_gradient`` on the max,
  ``e * (1 / sum)``), f32 up/down casts, reshapes/transposes that keep the axes, in any order of
  the dimensions (the reductions must be over the key axis);
* head grouping by reshape: scores computed per ``(kv_head, group)`` and reshaped to one row per
  query head for the mask and softmax, then back to the groups for ``p·v`` (flax ports of Gemma
  write it so). The merged axis is tracked as the group of first-dot axes it holds
  (:func:`_view_axes`); masks must not vary along a group, and ``p·v`` must read the scores' own
  axes again.

The mask itself is read numerically, not syntactically: the mask operand's producers (outside
the cluster: iotas, comparisons, ``&``, ``jnp.tril``, broadcasts, constants) are evaluated on
compact numpy arrays for a set of values of the one runtime scalar they may depend on (``pos``),
and the result is fitted to the family the kernels implement::

    valid(i, t)  <=>  lo(i) <= t < hi(i),   hi(i) = min(T, a·i + c [+ pos]),   lo = max(0, hi - W)

(``a`` = 1: causal by query position ``i``; ``W``: sliding window, measured from the unclamped
end as jax does), or a causal bound capped at a runtime key length, ``hi(i) = min(i + c, len [+ 1])``
(``jax.nn.dot_product_attention(is_causal=True, key_value_seq_lengths=len)``: the prefill kernel's
``causal`` with ``kv_len``; :func:`_capped_causal`). The runtime scalar is probed over [0, T) and outside it (negative, past the
end): the kernels compute the same bounds for any position (|x| < 2^30), so a mask that leaves
the family outside the cache (``t <= clip(pos, 0, T - 1)``) is declined, not extrapolated.
A mask computed lane by lane from a runtime boolean tensor — a padding mask, ``where(valid[:, None,
None, :], s, neg)``, or HF's additive ``select(attention_mask > 0, 0, finfo.min)`` of an int 0/1
mask compared to a constant — is no bound: its tensor is read by the kernels blockwise through its
layout (its broadcast is never written out) and keeps the keys it keeps (:func:`_runtime_mask`;
probing the boolean with True and False is every case, as each lane's value depends on that
boolean's lane alone). It can empty any row: jax's row (NaN, the mean of V, the softmax of
``s + b``) as for the bounds, in the prefill kernel when that takes the second pass. Other masks
that vary along the batch or head axes, or depend on a non-integer runtime tensor, are declined
with that reason — unless XLA's boolean for the select is small (:func:`_computed_mask`: before its
broadcasts at most 1/64 of the keys' elements, a decode step's ``(B, T)``: a left-padded batch's
``start[b] <= t <= pos``), when the kernels read it as they read a padding mask. The one exception is a vector of positions, one per sequence (continuous batching: ``t <= pos[b]``): probed with every entry equal it must fit the
family like a scalar, then with distinct entries batch entry ``b`` must see the family at ``pos[b]`` (:func:`_check_per_row`); the decode kernel takes it as a
``(B,)`` operand, as does the prefill kernel (program ``z`` of ``B · Hkv`` reads entry ``z // Hkv``). An additive bias with other values
is a bias (above), not a mask.

Decode (every query row sees the same keys, at most 16 query rows per batch·head — one token,
GQA heads folded in) runs ``kernels.attention.decode_attention``; everything else (prefill,
causal or not, and a window whose end can pass T) ``kernels.prefill_attention.prefill_attention``. GQA is not a parameter: both
kernels read K/V through their layouts and the group size is read off the layout
(:func:`_group_size`: a head index that does not appear in K's map is a repeat).

Both kernel dots compute at the program's dots' ``precision`` (:func:`_precision`): f32 attention at
jax's default precision runs on TF32 tensor cores as ``jax.jit``'s does, at ``HIGHEST`` IEEE f32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..cluster import Cluster, operand_chain
from ..graph import Graph
from ..kernels.flash import Prologue, narrow_range
from ..kernels.attention import decode_attention
from ..kernels.prefill_attention import prefill_attention
from ..kernels.tiling import dtype_unsupported, f32_math, more_precise, native_precision, precision_unsupported
from ..kernels.vio import OverlayError, VTensor
from ..primitives import TABLE, Kind, is_movement_op
from .base import Decline, Run, Step, Template
from .island import Apply, IslandPlan, Load, leaf_vtensor
from .island import plan as island_plan
from .island import program as island_program
from .stage2 import block_fn, block_supported, broadcast_input, buffers_of

__all__ = ["TEMPLATE", "NEG_BOUND", "DECODE_MAX_ROWS"]

# a mask value at or below this is -inf for the kernels: -1e4 as bf16 stores it (-9984; HF's old
# ``(1 - mask) * -10000.0`` and ``jnp.where(m, s, -1e4)`` on bf16 scores), the argument unchanged:
# ``exp(neg + s - max)`` underflows to exactly 0 in f32 for scores of magnitude < ~5e3
NEG_BOUND = -9984.0
INT32_POSITION_LIMIT = 1 << 30   # positions the kernels bound exactly (the matcher probes inside it)
DECODE_MAX_ROWS = 16      # query rows per batch·head the decode kernel takes (one MIN_DOT tile)
# lanes a numeric probe of a mask evaluates at most (per probe value; the heads only where the
# mask varies along them): 4 Mi is batch 4 x 1,000^2 or batch 1 x 2,048^2. A per-sequence mask is
# evaluated some 25 times to fit it, about 0.06 s each at 16 Mi lanes: 4 Mi keeps a layer's fit
# near 0.5 s (batch 1 x 4,096^2 of padded prefill took 2 s a layer)
_MAX_PROBE_ELEMS = 1 << 22
_VIEWS = frozenset(n for n, r in TABLE.items() if r.score_view)
_COMPARE = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
_MIRROR = {"eq": "eq", "ne": "ne", "lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}   # c op s == s op' c


@dataclass(frozen=True)
class _AttnMatch:
    q: int
    k: int
    v: int
    out: int
    q_perm: tuple[int, ...]     # q axes in canonical order (batch..., query rows..., D)
    k_perm: tuple[int, ...]     # (batch..., T, D)
    v_perm: tuple[int, ...]     # (batch..., T, Dv)
    out_perm: tuple[int, ...]   # (batch..., query rows..., Dv)
    batch: tuple[int, ...]      # sizes of the batch axes (the last one is the head axis)
    rows: int                   # query rows per batch entry (groups x S)
    seq: int                    # S: row r is query position r % S
    T: int
    D: int
    Dv: int
    scale: float
    soft_cap: float | None
    causal: bool                # hi(i) = min(T, i + c [+ x])
    hi_const: int               # c
    hi_scalar: int | None       # runtime scalar tensor x (None: static)
    window: int | None
    decode: bool
    empty_rows: str = "zero"    # a row with no valid key: "nan" (every mask fills -inf, as jax),
                                # "uniform" (one finite fill value: jax averages V), "zero" (never
                                # happens: no probe found such a row)
    per_row: bool = False       # hi_scalar is a vector: one position per sequence (decode only)
    precision: Any = None       # of both kernel dots: the two dots' param (the more precise one
                                # when they differ, :func:`kernels.tiling.more_precise`)
    slopes: Any = field(default=None, compare=False)   # ALiBi: f32 (batch..., rows) slope per
                                # query row, the bias slope · t (None: no bias)
    bias: Any = None            # another additive bias: (tensor, its int axes' sizes, their
                                # positions in increasing first-dot order, those first-dot axes,
                                # canonical first-dot order, first-dot shape, the scaling after
                                # it), read by the kernels
    keep: Any = None            # a runtime mask (a padding mask): (its view as ``bias``'s, which
                                # values keep a key: "nonzero" | "false" | "zero"), read by the kernels
    score_keep: tuple[str, bool] | None = None   # a mask computed from the scores: keys where
                                # ``(s op 0) == when`` (``kernels.flash.score_lanes``)
    kv_cap: int | None = None   # causal only: hi_scalar is a key length capping each row's end,
                                # hi(i) = min(i + hi_const, x + kv_cap) (prefill's ``kv_len``)
    inclusive: bool = False     # the runtime end as the last valid key, saturating past it (jax's
                                # ``t <= pos`` at pos = 2**31 - 1), not ``pos + c`` wrapping
    sink: Any = None            # an attention sink: its logits' view as ``bias``'s (key axis of
                                # size 1), one per row, read by the kernels (None: no sink)
    score_dtype: Any = None     # the first dot's result type where its range is narrower than f32's
                                # (f16 scores: the kernels round to it, ``flash.narrow_range``)
    prologues: tuple[Any, ...] = (None, None, None)   # q's, K's, V's: None, or (the tensor the
                                # kernel loads, the cluster's ops making the operand from it, the
                                # broadcast operands they read: ``cluster.operand_chain``), or an
                                # :class:`_IslandPrologue` (movement among them: a rotary embedding)

    @property
    def kernel(self) -> str:
        return "decode" if self.decode else "prefill"


# --------------------------------------------------------------------------------------------
# Numeric evaluation of mask producers (compact numpy arrays: size-1 axes stand for broadcasts)
# --------------------------------------------------------------------------------------------

class _NoFold(Exception):
    pass


_BIN = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
        "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor, "lt": np.less,
        "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
        "ne": np.not_equal, "pow": np.power, "atan2": np.arctan2}
_UN = {"neg": np.negative, "abs": np.abs, "sign": np.sign, "sqrt": np.sqrt, "exp": np.exp,
       "log": np.log, "tanh": np.tanh, "floor": np.floor, "ceil": np.ceil,
       "rsqrt": lambda x: 1.0 / np.sqrt(x)}


class _Eval:
    """Evaluate tensors of ``graph`` from constants, iotas and the runtime values in ``env``."""

    def __init__(self, graph: Graph, env: dict[int, Any] | None = None) -> None:
        self.g, self.env, self.cache = graph, dict(env or {}), {}

    def leaves(self, t: int, seen: set[int] | None = None) -> set[int]:
        """Runtime tensors the value of ``t`` depends on (graph inputs / unfoldable ops' outputs)."""
        seen = set() if seen is None else seen
        if t in seen:
            return set()
        seen.add(t)
        info = self.g.tensors[t]
        if info.const is not None:
            return set()
        op = self.g.producer(t)
        if op is None or not self._foldable(op):
            return {t}
        return set().union(*(self.leaves(x, seen) for x in op.inputs)) if op.inputs else set()

    @staticmethod
    def _foldable(op: Any) -> bool:
        p = op.primitive
        return op.opaque_reason is None and (p in _BIN or p in _UN or p in _VIEWS or p in (
            "iota", "select_n", "not", "div", "rem", "clamp", "integer_pow", "squeeze"))

    def __call__(self, t: int) -> np.ndarray:
        if t in self.cache:
            return self.cache[t]
        info = self.g.tensors[t]
        rank = len(info.shape)
        if t in self.env:
            val = np.asarray(self.env[t], info.dtype).reshape((1,) * rank if np.size(self.env[t]) == 1
                                                              else info.shape)
        elif info.const is not None:
            c = np.asarray(info.const, info.dtype)
            val = c.reshape((1,) * rank) if c.size == 1 else c.reshape(info.shape)
        else:
            op = self.g.producer(t)
            if op is None or not self._foldable(op):
                raise _NoFold(t)
            val = self._op(op, t)
        self.cache[t] = val
        return val

    def _op(self, op: Any, t: int) -> np.ndarray:
        p, info = op.primitive, self.g.tensors[t]
        shape, dt = info.shape, np.dtype(info.dtype)
        xs = [self(x) for x in op.inputs]
        ins = [self.g.tensors[x] for x in op.inputs]
        if p == "iota":
            d = op.params["dimension"]
            val = np.arange(shape[d]).reshape(tuple(n if i == d else 1 for i, n in enumerate(shape)))
        elif p in ("convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision", "pvary"):
            val = xs[0]
        elif p == "broadcast_in_dim":
            new = [1] * len(shape)
            for j, bd in enumerate(op.params["broadcast_dimensions"]):
                new[bd] = xs[0].shape[j]
            val = xs[0].reshape(new)
        elif p == "transpose":
            val = np.transpose(xs[0], op.params["permutation"])
        elif p in ("reshape", "squeeze"):
            x, old = xs[0], ins[0].shape
            if [n for n in old if n != 1] == [n for n in shape if n != 1]:
                kept = iter(x.shape[i] for i, n in enumerate(old) if n != 1)
                val = x.reshape(tuple(next(kept) if n != 1 else 1 for n in shape))
            else:
                if int(np.prod(old)) > _MAX_PROBE_ELEMS:
                    raise _NoFold(t)
                val = np.broadcast_to(x, old).reshape(shape)
        elif p == "select_n":
            pred, *cases = xs
            val = cases[0] if len(cases) == 1 else np.choose(pred.astype(np.int32), cases) \
                if len(cases) > 2 else np.where(pred.astype(bool), cases[1], cases[0])
        elif p == "not":
            val = np.logical_not(xs[0]) if dt == np.bool_ else np.invert(xs[0])
        elif p == "div":
            val = (np.trunc(np.true_divide(xs[0], xs[1])) if np.issubdtype(dt, np.integer)
                   else np.true_divide(*[x.astype(np.float32) if x.dtype.itemsize < 4 else x for x in xs]))
        elif p == "rem":
            val = np.fmod(xs[0], xs[1])
        elif p == "clamp":
            val = np.clip(xs[1], xs[0], xs[2])
        elif p == "integer_pow":
            val = np.power(xs[0], op.params["y"])
        elif p in _BIN:
            a, b = (x.astype(np.float32) if x.dtype.kind == "V" or (x.dtype.kind == "f" and x.dtype.itemsize < 4)
                    else x for x in xs)
            val = _BIN[p](a, b)
        elif p in _UN:
            a = xs[0].astype(np.float32) if xs[0].dtype.itemsize < 4 else xs[0]
            with np.errstate(all="ignore"):
                val = _UN[p](a)
        else:
            raise _NoFold(t)
        val = np.asarray(val)
        if val.ndim != len(shape) or any(a not in (1, b) for a, b in zip(val.shape, shape)):
            val = np.broadcast_to(val, shape) if val.size == 1 or val.ndim != len(shape) else val
        return val.astype(dt)


def _fold_scalar(graph: Graph, t: int) -> float | None:
    """The value of ``t`` if it is a constant that holds one value (possibly broadcast)."""
    ev = _Eval(graph)
    try:
        if ev.leaves(t):
            return None
        val = ev(t)
    except (_NoFold, ValueError, TypeError):
        return None
    flat = np.asarray(val, np.float64).reshape(-1)
    return float(flat[0]) if flat.size and np.all(flat == flat[0]) else None


# --------------------------------------------------------------------------------------------
# The matcher: roles of the cluster's values
# --------------------------------------------------------------------------------------------

@dataclass
class _Role:
    kind: str                   # s | spred | max | shift | exp | sum | rsum | p
    stage: int
    axes: tuple[Any, ...]       # per axis: the first dot's output axis it is (None: size 1)
    cmp: tuple[str, bool] | None = None   # spred: (op, when): the value is ``(s op 0) == when``


@dataclass
class _Mask:
    tensor: int                 # the pred (select) or the bias (add)
    keep: bool | None           # select: pred value that keeps the score; None: additive bias
    axes: tuple[Any, ...]       # axes of the scores where it is applied
    fill: float | None = None   # select: the (largest) value of the masked lanes
    fill_lo: float | None = None  # select: the smallest (== fill for one constant value)
    factor: float = 1.0         # scaling applied to the scores after this mask
    stage: int = 0              # the scores' stage this mask produced
    when: tuple[int, bool] | None = None   # applied only where this scalar pred has this value
    score: str | None = None    # computed from the scores: keeps lanes where ``(s score 0) == keep``


def _view_axes(graph: Graph, op: Any, axes: tuple[Any, ...], sizes: dict[int, int]) -> tuple[Any, ...] | None:
    """The first-dot axes of a view's output (None: the view regroups axes another way).

    A reshape may merge adjacent axes into one (a *group*: the tuple of the first-dot axes it
    holds, outermost first) and split a group back into its axes: how flax's Gemma and
    grouped-query code fold ``(kv_heads, group)`` into ``heads`` on the scores and unfold them
    for ``p @ v``. ``sizes``: each first-dot axis's length."""
    p = op.primitive
    src, dst = graph.tensors[op.inputs[0]].shape, graph.tensors[op.outputs[0]].shape
    if p in ("convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision"):
        return axes
    if p == "transpose":
        return tuple(axes[i] for i in op.params["permutation"])
    if p == "broadcast_in_dim" and int(np.prod(src)) != int(np.prod(dst)):
        return None
    if [n for n in src if n != 1] == [n for n in dst if n != 1]:
        kept = iter(a for a, n in zip(axes, src) if n != 1)
        return tuple(next(kept) if n != 1 else None for n in dst)
    if p != "reshape":
        return None
    # the first-dot axes, in order, that the source's non-unit axes hold
    flat: list[int] = []
    for a, n in zip(axes, src):
        if n != 1:
            if a is None:
                return None
            flat.extend(a if isinstance(a, tuple) else (a,))
    out: list[Any] = []
    for n in dst:
        if n == 1:
            out.append(None)
            continue
        take, size = [], 1
        while flat and size < n:
            take.append(flat.pop(0))
            size *= sizes[take[-1]]
        if size != n:
            return None
        out.append(take[0] if len(take) == 1 else tuple(take))
    return tuple(out) if not flat else None


def _pred_key(graph: Graph, t: int) -> tuple:
    """A mask operand up to the broadcasts and reshapes that place it on the scores: equal keys,
    equal values (``jax.nn.softmax(s, where=m)`` broadcasts ``m`` once for each of its selects)."""
    chain = []
    while (op := graph.producer(t)) is not None and op.primitive in ("broadcast_in_dim", "reshape"):
        chain.append((op.primitive, tuple(sorted((k, str(v)) for k, v in op.params.items())),
                      tuple(graph.tensors[t].shape)))
        t = op.inputs[0]
    return t, tuple(chain)


def _prologue_ops(graph: Graph, c: Cluster) -> set[int]:
    """The cluster's ops before its first dot or on V's way into the second: the chains widening
    q, K, V (``cluster._attention_prologues``), applied by the kernels to the blocks they load."""
    own = set(c.ops)
    dots = sorted(o for o in own if graph.ops[o].primitive == "dot_general")
    if len(dots) != 2:
        return set()
    region = {dots[0]}
    for o in sorted(own):   # program order: what the first dot's result reaches
        if o > dots[0] and any((p := graph.producer(t)) is not None and p.id in region for t in graph.ops[o].inputs):
            region.add(o)
    return own - region


# Transcendentals a decode kernel would evaluate on a prologue's blocks (libdevice calls: their
# registers count for the whole kernel, whose main loop is bandwidth-bound on its occupancy)
_REGISTER_HEAVY = frozenset("sin cos tan pow exp exp2 log log1p expm1 tanh logistic erf erfc erf_inv "
                            "atan atan2 asin acos sinh cosh asinh acosh atanh cbrt lgamma digamma".split())


@dataclass(frozen=True)
class _IslandPrologue:
    """q made by element-wise ops *and movement* inside the cluster (a rotary embedding: the query
    rotated by halves, ``cluster.query_prologue_islands``): the kernel loads every block it needs
    of q through the island's index maps (:mod:`templates.island`) and recomputes q in registers,
    so the rotated q is never written. ``ops``: the island's ops."""
    plan: IslandPlan
    ops: tuple[int, ...]


def _ancestors(graph: Graph, x: int, ops: set[int]) -> set[int]:
    """The ops of ``ops`` that ``x`` is computed from."""
    found: set[int] = set()
    todo = [x]
    while todo:
        p = graph.producer(todo.pop())
        if p is not None and p.id in ops and p.id not in found:
            found.add(p.id)
            todo.extend(p.inputs)
    return found


def _island_prologue(graph: Graph, x: int, ops: set[int]) -> _IslandPrologue:
    """The island making operand ``x`` from the cluster's ``ops`` (checked: it plans, and maps
    zeros to zero — padded lanes load 0 from every input, index inputs included)."""
    made = {t for o in ops for t in graph.ops[o].outputs}
    inputs = tuple(dict.fromkeys(t for o in sorted(ops) for t in graph.ops[o].inputs if t not in made
                                 and not (graph.tensors[t].const is not None and graph.tensors[t].size == 1)))
    plan = island_plan(graph, sorted(ops), inputs, [x])
    if not plan.inputs or not isinstance(plan.inputs[0], Load):
        raise Decline("the movement making an operand loads no tensor first")
    f = island_program(graph, plan)
    n = len(plan.inputs) + (len(plan.shape) if plan.uses_index else 0)
    with jax.ensure_compile_time_eval():
        zero = f(*(jnp.zeros((), graph.tensors[s.tensor].dtype if isinstance(s, Load) else jnp.int32)
                   for s in plan.inputs), *([jnp.zeros((), jnp.int32)] * (n - len(plan.inputs))))
    if bool(np.asarray(zero) != 0):
        raise Decline("the ops making an operand map 0 elsewhere (padded lanes would count)")
    return _IslandPrologue(plan, tuple(sorted(ops)))


def _prologues(graph: Graph, c: Cluster, operands: tuple[int, int, int], decode: bool) -> tuple[Any, ...]:
    """Per q, K, V: None, or ``(base, chain, side operands)`` of the chain the kernel applies to
    each block it loads of ``base`` (checked: it runs on register blocks and maps zeros to zero,
    since padded lanes load 0 and the dots read them), or the :class:`_IslandPrologue` of an
    operand the cluster makes through movement."""
    pro = _prologue_ops(graph, c)
    out: list[Any] = []
    for x in operands:
        own = _ancestors(graph, x, pro)
        if any(is_movement_op(graph.ops[o], graph) for o in own):
            p = _island_prologue(graph, x, own)
            if decode and (heavy := sorted({graph.ops[s.op].primitive for s in p.plan.steps
                                            if isinstance(s, Apply) and graph.ops[s.op].primitive in _REGISTER_HEAVY})):
                raise Decline(f"the ops making q compute {', '.join(heavy)} in registers: in the decode kernel that "
                              "costs its occupancy (Llama-3's rotation tables recomputed there: 64 -> 198 "
                              "registers, 1.93x -> 1.83x of jit measured on an H200 at batch 16)")
            out.append(p)
            continue
        base, chain, side = operand_chain(graph, x, lambda p: p.id in pro)
        if not chain:
            out.append(None)
            continue
        why = block_supported(graph, chain)
        if why:
            raise Decline(f"the chain widening an operand: {why}")
        f = block_fn(graph, chain, [base, *side], [x])
        with jax.ensure_compile_time_eval():   # matched while jit traces the program: evaluate now
            zero = f(*(jnp.zeros((), graph.tensors[t].dtype) for t in (base, *side)))
        if bool(np.asarray(zero) != 0):
            raise Decline("the chain widening an operand maps 0 elsewhere (padded lanes would count)")
        out.append((base, chain, side))
    if sum(len(p.ops) if isinstance(p, _IslandPrologue) else len(p[1]) for p in out if p is not None) != len(pro):
        raise Decline("element-wise ops before the first dot that do not make q, K or V from one tensor")
    return tuple(out)


def _analyse(graph: Graph, c: Cluster) -> dict[str, Any]:
    """Walk the cluster in program order; give each value a role or raise Decline."""
    pro = _prologue_ops(graph, c)
    ops = [graph.ops[i] for i in sorted(c.ops) if i not in pro]
    dots = [op for op in ops if op.primitive == "dot_general"]
    if len(dots) != 2:
        raise Decline(f"expected two dot_generals (q·k and p·v), found {len(dots)}")
    if len(c.outputs) != 1:
        raise Decline("the cluster has more than one output")
    d1, d2 = dots
    s0 = d1.outputs[0]
    role: dict[int, _Role] = {s0: _Role("s", 0, tuple(range(len(graph.tensors[s0].shape))))}
    sizes = dict(enumerate(graph.tensors[s0].shape))   # first-dot axis -> its length
    st = dict(stage=0, inner=1.0, outer=1.0, tanh=False, masks=[], key=None,
              nomax=False, zeroes={}, sink=None)
    after_d2: list[Any] = []

    def fail(op: Any, why: str) -> None:
        raise Decline(f"{op.primitive} (op #{op.id}) {why}")

    def latest(op: Any, r: _Role) -> None:
        if r.stage != st["stage"]:
            fail(op, "modifies an earlier version of the scores (the scores branch)")

    def scale_by(op: Any, a: float) -> None:
        if not np.isfinite(a) or a == 0:
            fail(op, f"scales the scores by {a}")
        if st["masks"]:
            if a < 0:
                fail(op, "scales masked scores by a negative factor (the mask would flip)")
            for m in st["masks"]:
                m.factor *= a
        if st["tanh"]:
            st["outer"] *= a
        else:
            st["inner"] *= a

    def new_stage(t: int, axes: tuple[Any, ...]) -> None:
        st["stage"] += 1
        role[t] = _Role("s", st["stage"], axes)

    def conditional_mask(op: Any, tagged: list[tuple[int, _Role]]) -> None:
        """``select_n(pred, s, masked(s))``: masks applied only for one value of a scalar pred —
        a sliding window under ``lax.cond`` (``canonical.speculable_cond`` made it a select)."""
        (ia, a), (ib, b) = sorted(tagged, key=lambda t: t[1].stage)
        if b.stage != st["stage"] or a.stage == b.stage or a.axes != b.axes:
            fail(op, "selects between scores that are not one mask apart")
        between = [m for m in st["masks"] if a.stage < m.stage <= b.stage]
        if len(between) != b.stage - a.stage or any(m.when is not None for m in between):
            fail(op, "selects between scores that differ by more than a mask")
        for m in between:   # select_n's case 1 is taken where the pred is true
            m.when = (op.inputs[0], ib == 2)
        new_stage(op.outputs[0], b.axes)

    def score_compare(op: Any, r: _Role, i0: int, other: int) -> None:
        """``s op 0``: a mask computed from the scores (``where(s != 0, s, -inf)``). The kernels
        compare their own scores, which equal these up to the positive scalings that may follow a
        mask: the same sign, so only a comparison with 0 is the program's, and only of scores no
        additive term has touched (the kernels add a bias after they compare)."""
        c0 = _fold_scalar(graph, other)
        if c0 != 0.0:
            fail(op, f"compares the scores with {'a runtime value' if c0 is None else c0}: a mask computed "
                     "from the scores is taken against 0 only (the kernels' scores equal the program's "
                     "up to rounding, which keeps just their sign)")
        if any(m.keep is None for m in st["masks"]):
            fail(op, "compares scores an additive term was added to (the kernels compare them before "
                     "adding it)")
        role[op.outputs[0]] = _Role("spred", r.stage, r.axes,
                                    (op.primitive if i0 == 0 else _MIRROR[op.primitive], True))

    def score_select(op: Any, tagged: list[tuple[int, _Role]]) -> None:
        """A comparison of the scores, negated by ``not`` or used by the ``select_n`` it feeds:
        ``where(s op 0, s, neg)`` masks the lanes it does not keep."""
        r, out = tagged[0][1], op.outputs[0]
        if op.primitive == "not" and len(op.inputs) == 1:
            role[out] = _Role("spred", r.stage, r.axes, (r.cmp[0], not r.cmp[1]))
            return
        if not (op.primitive == "select_n" and len(op.inputs) == 3 and tagged[0][0] == 0
                and len(tagged) == 2 and tagged[1][1].kind == "s"):
            fail(op, "uses a comparison of the scores other than to select the scores it compared")
        i1, rs = tagged[1]
        latest(op, rs)
        if rs.stage != r.stage or rs.axes != r.axes:
            fail(op, "selects scores by a comparison of other scores")
        rng = _fold_range(graph, op.inputs[3 - i1])
        v = None if rng is None else rng[1]
        if v is None or v > NEG_BOUND:
            fail(op, f"selects the scores against {'a runtime value' if v is None else v}, "
                     f"not a mask value <= {NEG_BOUND:g} (-inf, finfo.min, -1e9, ...)")
        if any(m.score for m in st["masks"]):
            fail(op, "is a second mask computed from the scores")
        op_, when = r.cmp   # case 2 (the scores) is taken where the pred is true
        st["masks"].append(_Mask(op.inputs[0], when if i1 == 2 else not when, rs.axes, fill=v,
                                 fill_lo=rng[0], stage=st["stage"] + 1, score=op_))
        new_stage(out, rs.axes)

    def applied(pred: int, keep: bool, axes: tuple[Any, ...], stage: int) -> _Mask | None:
        """The select mask already applied, by ``stage``, with this pred (up to its broadcasts),
        polarity and axes — ``jax.nn.softmax(s, where=m)`` selects by ``m`` three more times."""
        key = _pred_key(graph, pred)
        return next((m for m in st["masks"] if m.keep is not None and m.keep == keep and m.when is None and m.score is None
                     and m.stage <= stage and m.axes == axes and _pred_key(graph, m.tensor) == key), None)

    def reselect(op: Any, r: _Role, i0: int) -> bool:
        """``where(m, s, fill)`` again, on the scores just before the last mask, where that mask is
        this one: the same value as the masked scores (softmax(where=)'s ``x_safe``, after its
        masked max)."""
        last = st["masks"][-1] if st["masks"] else None
        rng = _fold_range(graph, op.inputs[3 - i0])
        return (last is not None and last.stage == st["stage"] and r.stage == st["stage"] - 1
                and rng is not None and (last.fill_lo, last.fill) == rng
                and applied(op.inputs[0], i0 == 2, r.axes, st["stage"]) is last)

    def zeroes(op: Any, r: _Role, i0: int) -> None:
        """``where(m, e, 0)`` on the softmax numerator or the probabilities, ``m`` a select mask
        already applied to the scores they come from: their masked lanes are 0 already in every
        row with a valid key (``exp(-inf) = 0``), so only a row with none changes —
        ``softmax(where=m)`` zeroes it (:func:`_empty_rows`)."""
        latest(op, r)
        if applied(op.inputs[0], i0 == 2, r.axes, r.stage) is None:
            fail(op, f"zeroes the {_NAMES[r.kind]} where no mask applied to the scores does")
        st["zeroes"][r.kind] = (_pred_key(graph, op.inputs[0]), i0 == 2)

    def sink_logit(op: Any, r: _Role, i0: int) -> None:
        """``concatenate([s, sink], key axis)`` (either order): gpt-oss's attention sink, one
        logit per row that joins the softmax and whose probability is sliced off before ``p·v``
        (:func:`drop_sink`). It joins the scores as they are (scaled, capped, biased, masked):
        only the softmax may follow, which the kernels compute with the sink folded in once
        (:func:`kernels.flash.with_sink`)."""
        latest(op, r)
        if st["sink"] is not None:
            fail(op, "concatenates a second logit to the scores")
        dim = op.params["dimension"]
        key, other = r.axes[dim], op.inputs[1 - i0]
        if key is None or isinstance(key, tuple) or (st["key"] is not None and st["key"] != key):
            fail(op, "concatenates to the scores along an axis other than the keys")
        if graph.tensors[other].shape[dim] != 1:
            fail(op, f"concatenates {graph.tensors[other].shape[dim]} logits per row to the scores "
                     "(an attention sink is one)")
        st["sink"] = dict(tensor=other, axes=r.axes, key=key, dim=dim, first=i0 == 1, dropped=False)
        new_stage(op.outputs[0], r.axes)

    def drop_sink(op: Any, r: _Role) -> None:
        """``p[..., :-1]`` (``p[..., 1:]`` for a sink in front): the sink's probability sliced off
        the softmax over the scores and the sink; every other axis whole."""
        sk = st["sink"]
        src, dst = graph.tensors[op.inputs[0]].shape, graph.tensors[op.outputs[0]].shape
        axis = r.axes.index(sk["key"]) if sk["key"] in r.axes else None
        want = [(0, n) for n in src]
        if axis is not None:
            want[axis] = (1, src[axis]) if sk["first"] else (0, src[axis] - 1)
        strides = op.params.get("strides")
        if axis is None or list(zip(op.params["start_indices"], op.params["limit_indices"])) != want or \
                (strides is not None and any(x != 1 for x in strides)) or dst[axis] != src[axis] - 1:
            fail(op, f"slices the {_NAMES[r.kind]} otherwise than to drop the sink logit")
        sk["dropped"] = True
        role[op.outputs[0]] = _Role(r.kind, r.stage, r.axes)

    def key_of(op: Any, r: _Role, axes_param: Any) -> None:
        ax = tuple(r.axes[a] for a in axes_param)
        if len(ax) != 1 or ax[0] is None or isinstance(ax[0], tuple):
            fail(op, f"reduces over axes {tuple(axes_param)}, not one key axis")
        if st["key"] is None:
            st["key"] = ax[0]
        elif st["key"] != ax[0]:
            fail(op, "reduces over a different axis than the softmax max")

    for op in ops:
        if op is d1:
            continue
        if op is d2:
            continue
        if op.id > d2.id:
            after_d2.append(op)
            continue
        p = op.primitive
        tagged = [(i, role[x]) for i, x in enumerate(op.inputs) if x in role]
        others = [x for x in op.inputs if x not in role]
        out = op.outputs[0]
        if not tagged:
            fail(op, "inside the attention region does not read the scores")
        i0, r = tagged[0]
        k = r.kind
        if p == "slice" and k in ("exp", "p") and st["sink"] is not None and not st["sink"]["dropped"]:
            drop_sink(op, r)
            continue
        if p in _VIEWS and len(op.inputs) == 1:
            if k in ("max", "smax", "sum", "rsum"):      # row statistics: their keepdims broadcasts
                role[out] = _Role(k, r.stage, ())
                continue
            axes = _view_axes(graph, op, r.axes, sizes)
            if axes is None:
                fail(op, f"regroups the axes of the {_NAMES[k]} ({graph.tensors[op.inputs[0]].shape}"
                         f" -> {graph.tensors[out].shape})")
            role[out] = _Role(k, r.stage, axes, r.cmp)
            continue
        if k == "spred":
            score_select(op, tagged)
            continue
        if p == "select_n" and len(op.inputs) == 3 and len(tagged) == 2 and \
                all(t.kind == "s" for _, t in tagged) and graph.tensors[op.inputs[0]].shape == () \
                and op.inputs[0] not in role:
            conditional_mask(op, tagged)
            continue
        if k == "s" and len(tagged) == 1:
            if p == "select_n" and len(op.inputs) == 3 and i0 in (1, 2) and reselect(op, r, i0):
                role[out] = _Role("s", st["stage"], r.axes)
                continue
            if p == "concatenate" and len(op.inputs) == 2:
                sink_logit(op, r, i0)
                continue
            latest(op, r)
            if st["sink"] is not None and p not in ("reduce_max", "exp"):
                fail(op, "on the scores after the sink logit joined them (only the softmax may follow it)")
            if p in ("mul", "div") and len(others) == 1:
                a = _fold_scalar(graph, others[0])
                if a is None:
                    fail(op, "scales the scores by a value that is not a scalar constant")
                if p == "div":
                    if i0 != 0:
                        fail(op, "divides a constant by the scores")
                    a = 1.0 / a
                scale_by(op, a)
                new_stage(out, r.axes)
                continue
            if p == "tanh":
                if st["tanh"]:
                    fail(op, "is a second tanh on the scores")
                if st["masks"]:
                    fail(op, "soft-caps scores that are already masked (tanh(-inf) is not a mask)")
                st["tanh"] = True
                new_stage(out, r.axes)
                continue
            if p == "select_n" and len(op.inputs) == 3 and i0 in (1, 2):
                fill = op.inputs[3 - i0]
                rng = _fold_range(graph, fill)
                v = None if rng is None else rng[1]
                if v is None or v > NEG_BOUND:
                    fail(op, f"selects the scores against {'a runtime value' if v is None else v}, "
                             f"not a mask value <= {NEG_BOUND:g} (-inf, finfo.min, -1e9, ...)")
                st["masks"].append(_Mask(op.inputs[0], i0 == 2, r.axes, fill=v, fill_lo=rng[0],
                                         stage=st["stage"] + 1))
                new_stage(out, r.axes)
                continue
            if p == "add" and len(others) == 1:
                st["masks"].append(_Mask(others[0], None, r.axes, stage=st["stage"] + 1))
                new_stage(out, r.axes)
                continue
            if p == "reduce_max":
                key_of(op, r, op.params["axes"])
                role[out] = _Role("max", r.stage, ())
                continue
            if p == "exp":
                st["nomax"] = True
                role[out] = _Role("exp", r.stage, r.axes)
                continue
            if p in _COMPARE and len(others) == 1:
                score_compare(op, r, i0, others[0])
                continue
            fail(op, f"on the scores is not a scale, soft-cap, mask or softmax step")
        if k in ("max", "smax") and p in ("max", "min") and len(others) == 1:
            v = _fold_scalar(graph, others[0])
            if p == "max" and v is not None and (v == -np.inf or v <= NEG_BOUND):
                role[out] = _Role(k, r.stage, ())
                continue
            fail(op, "clamps the softmax max by something other than a very negative constant")
        if k == "shift" and p == "reduce_max":
            # the scores less their max, shifted again by a softmax (HF's eager gpt-oss: ``c - c.max()``
            # then ``softmax(c)``): the second max is exactly 0, so the second shift changes nothing
            key_of(op, r, op.params["axes"])
            role[out] = _Role("smax", r.stage, ())
            continue
        if p == "sub" and len(tagged) == 2 and tagged[0][1].kind == "shift" and tagged[1][1].kind == "smax":
            if tagged[0][1].stage != tagged[1][1].stage:
                fail(op, "subtracts the max of different scores")
            role[out] = _Role("shift", r.stage, r.axes)
            continue
        if p == "sub" and len(tagged) == 2 and tagged[0][1].kind == "s" and tagged[1][1].kind == "max":
            if tagged[0][1].stage != tagged[1][1].stage:
                fail(op, "subtracts the max of different scores")
            role[out] = _Role("shift", r.stage, r.axes)
            continue
        if k == "shift" and p == "exp":
            role[out] = _Role("exp", r.stage, r.axes)
            continue
        if k in ("exp", "p") and p == "select_n" and len(op.inputs) == 3 and len(tagged) == 1 and \
                i0 in (1, 2) and _fold_scalar(graph, op.inputs[3 - i0]) == 0.0:
            zeroes(op, r, i0)
            role[out] = _Role(k, r.stage, r.axes)
            continue
        if k == "exp" and p == "reduce_sum" and len(tagged) == 1:
            key_of(op, r, op.params["axes"])
            role[out] = _Role("sum", r.stage, ())
            continue
        if k == "sum" and p == "div" and len(others) == 1 and tagged[0][0] == 1:
            if _fold_scalar(graph, others[0]) != 1.0:
                fail(op, "divides a constant other than 1 by the softmax sum")
            role[out] = _Role("rsum", r.stage, ())
            continue
        if len(tagged) == 2 and {tagged[0][1].kind, tagged[1][1].kind} in ({"exp", "sum"}, {"exp", "rsum"}):
            e = next(t for _, t in tagged if t.kind == "exp")
            n = next(t for _, t in tagged if t.kind != "exp")
            if e.stage != n.stage:
                fail(op, "normalises by the sum of different scores")
            if (p == "div" and n.kind == "sum" and tagged[0][1].kind == "exp") or (p == "mul" and n.kind == "rsum"):
                role[out] = _Role("p", e.stage, e.axes)
                continue
        fail(op, f"on the {_NAMES[k]} is not a step of the softmax")

    for m in st["masks"]:
        if m.fill is not None and m.fill * m.factor > NEG_BOUND:
            raise Decline(f"masked scores are scaled to {m.fill * m.factor:g} after the mask: "
                          f"above {NEG_BOUND:g}, no longer a mask")
    if st["sink"] is not None and not st["sink"]["dropped"]:
        raise Decline("the sink logit's probability is not sliced off before p·v")
    if any(op.primitive not in ("convert_element_type",) for op in after_d2):
        raise Decline("ops after the second dot other than a dtype conversion")
    prob = [(i, role[x]) for i, x in enumerate(d2.inputs) if x in role]
    if len(prob) != 1 or prob[0][1].kind != "p":
        raise Decline("the second dot does not read the softmax probabilities "
                      f"({[role[x].kind for x in d2.inputs if x in role] or 'nothing from the scores'})")
    return dict(d1=d1, d2=d2, st=st, prob=prob[0])


_NAMES = {"s": "scores", "max": "softmax max", "smax": "max of the shifted scores", "shift": "scores - max", "exp": "softmax numerator",
          "sum": "softmax sum", "rsum": "softmax 1/sum", "p": "probabilities"}


def _fold_range(graph: Graph, t: int) -> tuple[float, float] | None:
    """(smallest, largest) value of a constant tensor (None when it depends on runtime values)."""
    ev = _Eval(graph)
    try:
        if ev.leaves(t):
            return None
        a = np.asarray(ev(t), np.float64)
        return float(np.min(a)), float(np.max(a))
    except (_NoFold, ValueError, TypeError):
        return None


# --------------------------------------------------------------------------------------------
# Dimension roles and the mask fit
# --------------------------------------------------------------------------------------------

def _dims(graph: Graph, a: dict[str, Any]) -> dict[str, Any]:
    d1, d2, st = a["d1"], a["d2"], a["st"]
    (c1l, c1r), (b1l, b1r) = d1.params["dimension_numbers"]
    lhs, rhs = d1.inputs
    rank = lambda t: len(graph.tensors[t].shape)
    free = lambda t, cs, bs: tuple(i for i in range(rank(t)) if i not in cs and i not in bs)
    nb = len(b1l)
    lf, rf = free(lhs, c1l, b1l), free(rhs, c1r, b1r)
    # first-dot output axes: batch, lhs free, rhs free
    out_axes = [("b", j) for j in range(nb)] + [("l", i) for i in lf] + [("r", i) for i in rf]
    key = st["key"]
    if key is None:
        raise Decline("no softmax over a key axis")
    side, key_axis = out_axes[key]
    if side == "b":
        raise Decline("the softmax runs over a batch axis of the first dot")
    if side == "l":
        k, q, kc, qc, kb, qb, kf, qf, qbase = lhs, rhs, c1l, c1r, b1l, b1r, lf, rf, nb + len(lf)
    else:
        k, q, kc, qc, kb, qb, kf, qf, qbase = rhs, lhs, c1r, c1l, b1r, b1l, rf, lf, nb
    if len(kf) != 1:
        raise Decline(f"K has {len(kf)} free axes (several key axes)")
    if len(kc) != 1:
        raise Decline(f"q·k contracts {len(kc)} axes (expected one head dim)")
    q_free_d1 = tuple(range(qbase, qbase + len(qf)))   # first-dot axes of q's free axes
    # second dot: p (probabilities) and v
    (c2l, c2r), (b2l, b2r) = d2.params["dimension_numbers"]
    pi, pr = a["prob"]
    v = d2.inputs[1 - pi]
    pc, vc, pb, vb = (c2l, c2r, b2l, b2r) if pi == 0 else (c2r, c2l, b2r, b2l)
    if any(isinstance(a, tuple) for a in pr.axes):
        raise Decline("the probabilities reach the second dot with axes grouped by a reshape "
                      f"({pr.axes}): p·v must read them with the scores' own axes")
    if len(pc) != 1 or pr.axes[pc[0]] != key:
        raise Decline("the second dot does not contract the probabilities over the key axis")
    pbd1 = [pr.axes[i] for i in pb]
    if sorted(x for x in pbd1 if x is not None) != list(range(nb)) or len(pbd1) != nb:
        raise Decline("the second dot's batch axes are not the first dot's batch axes")
    v_batch = [vb[pbd1.index(j)] for j in range(nb)]
    pfree = [i for i in range(len(pr.axes)) if i not in pc and i not in pb]
    if any(pr.axes[i] is not None and pr.axes[i] not in q_free_d1 for i in pfree):
        raise Decline("the probabilities keep an axis that is not a query axis")
    vf = [i for i in range(rank(v)) if i not in vc and i not in vb]
    if len(vf) != 1:
        raise Decline(f"v has {len(vf)} free axes (expected one head dim)")
    # d2 output axes: batch (d2 order), lhs free, rhs free
    lhs_free = pfree if pi == 0 else vf
    rhs_free = vf if pi == 0 else pfree
    out_lab: list[Any] = [("b", pbd1[j]) for j in range(len(pb))]
    for part in (lhs_free, rhs_free):
        for i in part:
            out_lab.append(("dv",) if part is vf else (("q", pr.axes[i]) if pr.axes[i] is not None else ("1",)))
    return dict(q=q, k=k, v=v, nb=nb, qb=qb, kb=kb, qf=qf, qc=qc, kf=kf, kc=kc, v_batch=v_batch,
                vc=vc, vf=vf, q_free_d1=q_free_d1, key=key, out_lab=out_lab)


def _mask_arrays(graph: Graph, masks: list[_Mask], env: dict[int, Any], rank: int,
                 bias_values: set[float] | None = None) -> np.ndarray:
    """The valid lanes of the combined mask over the first dot's output axes (compact); the
    masked values of additive biases go to ``bias_values``."""
    ev = _Eval(graph, env)
    valid = np.ones((1,) * rank, bool)
    for m in masks:
        val = ev(m.tensor)
        if m.keep is None:
            b = np.asarray(val, np.float32)
            bad = (b != 0) & (b * m.factor > NEG_BOUND)
            if bad.any():
                raise Decline(f"additive bias t{m.tensor} takes values other than 0 and <= {NEG_BOUND:g} "
                              f"(e.g. {float(b[bad].reshape(-1)[0]):g}): a general bias is not supported")
            keep = b == 0
            if bias_values is not None:
                bias_values.update(np.unique(b[~keep]).astype(np.float64).tolist())
        else:
            keep = val.astype(bool) if m.keep else ~val.astype(bool)
        if m.when is not None and bool(np.asarray(ev(m.when[0])).reshape(())) != m.when[1]:
            keep = np.ones_like(np.asarray(keep, bool))   # the pred turns this mask off
        valid = valid & _on_scores(np.asarray(keep, bool), m.axes, rank, "a mask")
    return valid


def _fit_mask(graph: Graph, masks: list[_Mask], dims: dict[str, Any], shape: tuple[int, ...],
              bias_values: set[float] | None = None):
    """(seq axis, causal, c, scalar, window, empty, per_row) with
    valid(i, t) = lo <= t < min(T, a·i + c [+ x]); ``empty``: some probed value of the runtime
    scalar (or the static mask) leaves a row with no valid key; ``per_row``: ``x`` is a vector, one
    value per batch entry (:func:`_check_per_row`)."""
    rank = len(shape)
    T = shape[dims["key"]]
    if not masks:
        return None, False, T, None, None, False, False, None, False
    ev = _Eval(graph)
    leaves: set[int] = set()
    try:
        for m in masks:
            leaves |= ev.leaves(m.tensor)
    except _NoFold as e:
        raise Decline(f"mask t{e} cannot be evaluated")
    for m in masks:   # a float runtime term added to the scores is no mask (MLA's rope scores, a bias)
        floats = [t for t in ev.leaves(m.tensor)
                  if not np.issubdtype(np.dtype(graph.tensors[t].dtype), np.integer)
                  and np.dtype(graph.tensors[t].dtype) != np.bool_]
        if m.keep is None and floats:
            raise Decline(f"the scores get t{m.tensor} added, computed from runtime "
                          f"{np.dtype(graph.tensors[floats[0]].dtype).name} tensor t{floats[0]}: a second score "
                          "term or a learned bias, not a mask of positions")
    if len(leaves) > 1:
        raise Decline(f"the mask depends on several runtime tensors ({sorted(leaves)})")
    x = next(iter(leaves), None)
    per_row = False
    if x is not None:
        info = graph.tensors[x]
        if not np.issubdtype(np.dtype(info.dtype), np.integer):
            raise Decline(f"the mask depends on a runtime {np.dtype(info.dtype).name} tensor of shape "
                          f"{info.shape} (a padding mask?): the kernels take integer positions only")
        # a vector: one position per batch entry (checked below); probed first with every entry
        # equal (a size-1 value broadcasts), which must fit the family like a scalar does
        per_row = info.size != 1
    # probe positions inside the cache, [0, T), and outside it (a negative position, one past
    # the end, ...): the kernels compute the family's bounds for any value of the scalar
    # (|x| < 2^30), so a mask that leaves the family outside [0, T) (``t <= clip(pos, 0, T-1)``) is
    # declined rather than extrapolated
    if x is None:
        xs: list[Any] = [None]
    else:
        n = 48 if T * max((shape[a] for a in dims["q_free_d1"]), default=1) <= (1 << 18) else 12
        xs = sorted({*np.linspace(0, T - 1, min(n, T)).astype(int).tolist(), 0, 1, 2, T // 2, T - 1,
                     -2 * T - 3, -T - 1, -T, -3, -2, -1, T, T + 1, T + 2, 2 * T + 5})
    arrays = {}
    try:
        for xv in xs:
            arrays[xv] = _mask_arrays(graph, masks, {} if x is None else {x: xv}, rank, bias_values)
    except _NoFold as e:
        raise Decline(f"mask t{e} cannot be evaluated")
    # independent of the batch axes and of all query axes but one
    seq_axis = None
    for xv, arr in arrays.items():
        for ax in range(rank):
            if ax == dims["key"] or arr.shape[ax] == 1:
                continue
            if np.all(arr == arr.take([0], axis=ax)):
                continue
            if ax < dims["nb"]:
                raise Decline("the mask varies along a batch/head axis: the kernels take one mask for "
                              "all batch entries")
            if seq_axis not in (None, ax):
                raise Decline("the mask varies along two query axes")
            seq_axis = ax
    S = shape[seq_axis] if seq_axis is not None else 1

    def mat_of(arr: np.ndarray) -> np.ndarray:   # the (S, T) valid lanes of one probe
        idx = [0] * rank
        for ax in range(rank):
            if ax in (dims["key"], seq_axis):
                idx[ax] = slice(None)
        m = arr[tuple(idx)]
        if seq_axis is not None and seq_axis > dims["key"]:
            m = m.T
        return np.broadcast_to(m.reshape((-1, m.shape[-1])) if m.ndim == 2 else m.reshape(1, -1), (S, T))
    mats = {xv: mat_of(arr) for xv, arr in arrays.items()}
    # rows' [lo, hi), per probe: (probe value, row indices with a valid key, their lo, their hi),
    # whole arrays at once (a Python loop over 4,096 rows per probe took seconds)
    rows = []
    for xv, m in mats.items():
        live = np.nonzero(m.any(axis=1))[0]
        rows.append((xv, live, np.argmax(m[live], axis=1), T - np.argmax(m[live][:, ::-1], axis=1)))

    def first(pick: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[Any, int, int, int] | None:
        """The first row (probe order, then row order) whose (lo, hi) ``pick`` selects."""
        for xv, live, lo, hi in rows:
            j = np.nonzero(pick(lo, hi))[0]
            if j.size:
                return xv, int(live[j[0]]), int(lo[j[0]]), int(hi[j[0]])
        return None

    ends_inside = first(lambda lo, hi: hi < T)          # the end from a row that ends inside the keys
    starts_past = first(lambda lo, hi: lo > 0)          # the window from a row that starts past key 0,
    found = None                                        # against the unclamped end (a probe past T)
    for causal in ((True, False) if seq_axis is not None else (False,)):
        for use_x in ((True, False) if x is not None else (False,)):
            c = w = None
            if ends_inside is not None:
                xv, i, lo, hi = ends_inside
                c = hi - (i if causal else 0) - (xv if use_x else 0)
            c = T if c is None else c
            if starts_past is not None:
                xv, i, lo, hi = starts_past
                w = c + (i if causal else 0) + (xv if use_x else 0) - lo
            if all(np.array_equal(_family(m.shape[0], T, causal, c + (xv if use_x else 0), w), m)
                   for xv, m in mats.items()):
                found = (seq_axis, causal, c, x if use_x else None, w)
                break
        if found:
            break
    cap = None
    if found is None and x is not None and seq_axis is not None:
        found, cap = _capped_causal(mats, T, seq_axis)
    if found is None:
        raise Decline("the mask is not a causal / key-length / sliding-window bound on key positions "
                      "(valid keys hi(i) - W <= t < hi(i) with hi = [i +] c [+ pos], or a causal bound "
                      "capped at a key length, min(i + c, len [+ 1])) for every position, in [0, T) and "
                      "outside it")
    empty = any(not row.any() for m in mats.values() for row in m)
    if per_row:
        _check_per_row(graph, masks, dims, shape, x, found, xs, cap)
    inclusive = False
    if found[3] is not None and np.dtype(graph.tensors[x].dtype) == np.int32:
        inclusive = _int32_extremes(graph, masks, x, found, T, S, lambda xv: mat_of(_mask_arrays(
            graph, masks, {x: np.full(graph.tensors[x].shape, xv, np.int32)}, rank)))
    return (*found, empty, per_row, None if cap is None else (x, cap), inclusive)


_INT32_EXTREMES = (2 ** 31 - 1, 2 ** 31 - 2, -2 ** 31, -2 ** 31 + 1)


def _wrap32(v: Any) -> Any:
    """int32 two's-complement wrap of (int64) ``v``."""
    return (np.asarray(v, np.int64) + 2 ** 31) % 2 ** 32 - 2 ** 31


def _int32_extremes(graph: Graph, masks: list[_Mask], x: int, found: tuple, T: int, S: int,
                    jax_mat: Any) -> bool:
    """How the kernels form the runtime end so that jax's mask holds at int32's extremes too
    (positions far past the probes, where int32 arithmetic wraps): ``False`` — ``x + c`` wrapping,
    as ``t < pos + 1`` computes it — or ``True`` — ``x + c - 1`` as the last valid key, one past it
    saturating (``t <= pos``, ``t <= pos + i``: jax compares ``t <= 2**31 - 1`` as all keys). The
    form that equals jax at more of ``±2**31`` (and ``±2**31 ∓ 1``); a mask whose own arithmetic
    wraps another way there (the rolling cache's ``pos - (pos - t) % W`` near ``-2**31``) keeps the
    closer form: the kernels' bound is exact for positions inside ``±2**30``, which the fit probes."""
    _, causal, c, _, w = found
    i = np.arange(S)[:, None] if causal else 0
    t = np.arange(T)[None, :]
    with np.errstate(over="ignore"):   # (jax's int32 arithmetic wraps; so does numpy's)
        mats = {xv: jax_mat(xv) for xv in _INT32_EXTREMES}
    score = {}
    for inclusive in (False, True):
        score[inclusive] = 0
        for xv in _INT32_EXTREMES:
            v = _wrap32(xv + c - inclusive + i)
            hi = np.where(v == 2 ** 31 - 1, v, v + 1) if inclusive else v
            valid = t < np.minimum(hi, T)
            if w is not None:
                valid = valid & (t >= np.maximum(_wrap32(hi - w), 0))
            score[inclusive] += bool(np.array_equal(np.broadcast_to(valid, (S, T)), mats[xv]))
    return score[True] > score[False]


def _capped_causal(mats: dict[Any, np.ndarray], T: int, seq_axis: int) -> tuple[tuple | None, int | None]:
    """The causal bound capped at the runtime value, ``hi(i) = min(i + c, x + c2)``:
    ``jax.nn.dot_product_attention(is_causal=True, key_value_seq_lengths=x)`` (``c2 = 0``) or
    ``t <= i & t <= x`` (``c2 = 1``). ``c`` is read from the probe past every key (no cap there);
    the fit must hold at every probe. ``((seq_axis, True, c, None, None), c2)``, else ``(None, None)``."""
    top = max(mats)
    m = mats[top]
    live = [i for i in range(m.shape[0]) if m[i].any()]
    if not live:
        return None, None
    i0 = live[0]
    c = T - int(np.argmax(m[i0][::-1])) - i0
    t = np.arange(T)[None, :]
    for c2 in (0, 1):
        if all(np.array_equal(_family(mm.shape[0], T, True, c, None) & (t < xv + c2), mm) for xv, mm in mats.items()):
            return (seq_axis, True, c, None, None), c2
    return None, None


def _check_per_row(graph: Graph, masks: list[_Mask], dims: dict[str, Any], shape: tuple[int, ...],
                   x: int, found: tuple, probes: list[Any], cap: int | None = None) -> None:
    """A vector ``x`` (per-sequence positions, continuous batching): with distinct values in its
    entries, batch entry ``b`` of the scores (the batch axes but the head axis, flattened) must see
    exactly the family at ``x[b]`` — so ``x`` has one entry per batch entry, in batch order, and
    the mask does not vary along the heads. Probed with three assignments of the probe values
    (negative, inside and past the cache) to the entries; Decline otherwise."""
    seq_axis, causal, c, use_x, w = found
    info = graph.tensors[x]
    nb, key = dims["nb"], dims["key"]
    if use_x is None and cap is None:
        raise Decline(f"the mask depends on runtime tensor t{x} but not as a bound on key positions")
    if nb < 1:
        raise Decline(f"the mask depends on a runtime tensor of shape {info.shape} but the scores have "
                      "no batch axis")
    B = int(np.prod(shape[:nb - 1])) if nb > 1 else 1
    if info.size != B:
        raise Decline(f"the mask depends on a runtime tensor of shape {info.shape} ({info.size} values; "
                      f"{B} sequences): per-sequence positions need one value per sequence")
    T = shape[key]
    S = shape[seq_axis] if seq_axis is not None else 1
    for r in range(3):
        vals = np.asarray([probes[(j * (2 * r + 3) + r) % len(probes)] for j in range(info.size)],
                          np.dtype(info.dtype))
        try:
            arr = _mask_arrays(graph, masks, {x: vals.reshape(info.shape)}, len(shape))
        except _NoFold as e:
            raise Decline(f"mask t{e} cannot be evaluated")
        # the heads axis only where the mask varies along it (a padding mask broadcast over 32
        # heads is checked once per sequence, not 32 times: batch 4 x 1,000 tokens was refused)
        heads = arr.shape[nb - 1]
        if B * heads * S * T > _MAX_PROBE_ELEMS:
            raise Decline(f"the mask over {shape} is too large to probe per sequence")
        arr = np.broadcast_to(arr, tuple(shape[:nb - 1]) + arr.shape[nb - 1:])
        arr = arr.reshape((B, heads) + arr.shape[nb:])         # (B, heads or 1, query/key axes...)
        keep = [a - nb + 2 for a in (seq_axis, key) if a is not None]
        others = [a for a in range(2, arr.ndim) if a not in keep]
        for a in others:   # one mask for every value of the other query axes
            if arr.shape[a] != 1 and not np.all(arr == arr.take([0], axis=a)):
                raise Decline("the mask varies along two query axes")
        idx = tuple(slice(None) if a < 2 or a in keep else 0 for a in range(arr.ndim))
        mats = arr[idx]                                         # (B, heads, [S,] T) in some order
        if seq_axis is not None and seq_axis > key:
            mats = np.swapaxes(mats, -1, -2)
        mats = np.broadcast_to(mats.reshape(mats.shape[:2] + (-1, T)), (B, mats.shape[1], S, T))
        for b in range(B):
            want = (_family(S, T, causal, c + int(vals[b]), w) if cap is None else
                    _family(S, T, causal, c, w) & (np.arange(T)[None, :] < int(vals[b]) + cap))
            if not all(np.array_equal(mats[b, h], want) for h in range(mats.shape[1])):
                raise Decline(f"the mask depends on runtime tensor t{x} of shape {info.shape}, but not as "
                              "one position per sequence (entry b bounding batch entry b's keys)")


def _empty_rows(graph: Graph, masks: list[_Mask], bias_values: set[float], empty: bool,
                zeroes: dict[str, tuple] | None = None) -> Any:
    """What the kernels output for a row with no valid key, to equal jax (the kernels'
    ``empty_rows``, :func:`vtc_jax.kernels.attention.empty_rows_mode`): NaN where every mask fills
    ``-inf``; jax's softmax of the masked scores where every masked lane holds one value (selects
    filling one constant: the mean of V) or one additive bias value (``(s + b) * f``); 0 where the
    probabilities are zeroed by the one mask that empties the row (``jax.nn.softmax(s, where=m)``'s
    last ``where(m, p, 0)``). Otherwise jax's row depends on which mask each lane went through:
    declined if such a row can happen for some value of the runtime scalar (``empty``).
    ``zeroes``: ``{"exp" | "p": (pred key, keep)}``, the ``where(m, ·, 0)`` the matcher let
    through on the softmax numerator and the probabilities."""
    zeroes = zeroes or {}
    if not masks or not empty:
        return "zero"     # no such row for any probed value: the kernels emit no empty-row pass
    if "p" in zeroes:
        if all(m.keep is not None and (_pred_key(graph, m.tensor), m.keep) == zeroes["p"] for m in masks):
            return "zero"
        raise Decline("a row can have no valid key and the probabilities are zeroed by one of several "
                      "masks: jax's row is NaN in the lanes that mask keeps, 0 in the others")
    selects = [m for m in masks if m.keep is not None]
    additive = [m for m in masks if m.keep is None]
    if selects and not additive and all(m.fill is not None and np.isneginf(m.fill) for m in selects):
        return "nan"      # (a zeroed numerator: NaN too, ``NaN / 0``)
    if "exp" in zeroes:
        raise Decline("a row can have no valid key, its masked lanes hold a finite value and the softmax "
                      "numerator is zeroed by a mask: jax divides by a sum of none of them")
    fills = {m.fill * m.factor for m in selects if m.fill is not None}
    if selects and not additive and len(fills) == 1 and np.isfinite(next(iter(fills))) and \
            all(m.fill == m.fill_lo for m in selects):
        return ("fill", next(iter(fills)))
    if len(additive) == 1 and not selects and len(bias_values) == 1:
        return ("bias", next(iter(bias_values)), additive[0].factor)
    raise Decline("a row can have no valid key (e.g. at a position < 0) and its masked lanes do not "
                  "all hold one value: jax's softmax of such a row is not what the kernels compute")


def _family(S: int, T: int, causal: bool, base: int, w: int | None) -> np.ndarray:
    i = np.arange(S)[:, None]
    t = np.arange(T)[None, :]
    hi = base + (i if causal else 0)
    valid = t < np.minimum(hi, T)
    if w is not None:
        valid &= t >= hi - w            # from the unclamped end
    return valid


def _precision(graph: Graph, d1: Any, d2: Any) -> Any:
    """The precision both kernel dots compute at: the two dots' own (resolved when the kernel is
    built, as XLA's GPU backend runs them: f32 on TF32 at jax's default, IEEE at ``HIGHEST``; a
    preset that restates the operands' own 16-bit type is the default), the more precise one when
    they differ; declined where Pallas' Triton dot has no such algorithm or two different
    algorithms have no order."""
    for t in (*d1.inputs, *d2.inputs, d1.outputs[0]):
        why = dtype_unsupported(graph.tensors[t].dtype)
        if why:
            raise Decline(why)
    ps = tuple(native_precision(d.params.get("precision"), graph.tensors[d.inputs[0]].dtype) for d in (d1, d2))
    for p in ps:
        why = precision_unsupported(p)
        if why:
            raise Decline(why)
    try:
        return more_precise(*ps)
    except ValueError as exc:
        raise Decline(str(exc)) from None


def _on_scores(arr: np.ndarray, axes: tuple[Any, ...], rank: int, what: str) -> np.ndarray:
    """``arr``, given over the axes ``axes`` of the scores (first-dot axes, None for a unit axis,
    a group for axes a reshape merged), as an array over the first-dot axes (size 1 where it
    does not vary)."""
    arr = np.asarray(arr).reshape((1,) * (len(axes) - np.ndim(arr)) + np.shape(arr))
    for i, a in enumerate(axes):
        if isinstance(a, tuple) and arr.shape[i] != 1:
            raise Decline(f"{what} varies along axes grouped by a reshape of the scores")
        if a is None and arr.shape[i] != 1:
            raise Decline(f"{what} varies along an axis the scores do not have")
    kept = [i for i, a in enumerate(axes) if isinstance(a, int)]
    out = np.transpose(arr, kept + [i for i in range(arr.ndim) if i not in kept])
    out = out.reshape(out.shape[:len(kept)])
    order = sorted(range(len(kept)), key=lambda j: axes[kept[j]])
    out = np.transpose(out, order)
    full = [1] * rank
    for j, o in enumerate(order):
        full[axes[kept[o]]] = out.shape[j]
    return out.reshape(full)


def _is_mask_term(graph: Graph, m: _Mask, T: int) -> bool:
    """An additive term that only takes the values 0 and <= NEG_BOUND (after the scaling that
    follows it), for every probed value of the one integer runtime tensor it may depend on: a mask
    (:func:`_fit_mask` fits it). Anything else added to the scores is a bias."""
    ev = _Eval(graph)
    try:
        leaves = ev.leaves(m.tensor)
    except _NoFold:
        return False
    if len(leaves) > 1 or any(not np.issubdtype(np.dtype(graph.tensors[t].dtype), np.integer) for t in leaves):
        return False
    probes: list[Any] = [None] if not leaves else [-T - 1, -1, 0, 1, T // 2, T - 1, T, 2 * T + 5]
    x = next(iter(leaves), None)
    try:
        for v in probes:
            b = np.asarray(_Eval(graph, {} if x is None else {x: v})(m.tensor), np.float64)
            if ((b != 0) & (b * m.factor > NEG_BOUND)).any():
                return False
    except (_NoFold, ValueError, TypeError):
        return False
    return True


def _bias_masks_nothing(graph: Graph, m: _Mask, T: int) -> None:
    """A bias read by the kernels must not also mask: the kernels add it, so a lane it sends to
    ``finfo.min`` scores that (not -inf), and a row with every key so masked would not be jax's
    row. A bias of integer runtime values (``pos``) is probed; one mixing runtime floats and
    integers (a learned table plus a padding mask) cannot be, and is declined."""
    ev = _Eval(graph)
    try:
        leaves = ev.leaves(m.tensor)
    except _NoFold:
        return
    ints = [t for t in leaves if np.issubdtype(np.dtype(graph.tensors[t].dtype), np.integer)
            or np.dtype(graph.tensors[t].dtype) == np.bool_]
    if not ints:
        return
    if len(ints) != len(leaves) or len(ints) > 1:
        raise Decline("an additive bias computed from runtime integers and other runtime tensors (a "
                      "padding mask folded into a learned bias?): it may mask whole rows, which the "
                      "kernels would not output as jax does")
    for v in (-T - 1, -1, 0, 1, T // 2, T - 1, T, 2 * T + 5):
        try:
            b = np.asarray(_Eval(graph, {ints[0]: v})(m.tensor), np.float64)
        except (_NoFold, ValueError, TypeError):
            raise Decline("an additive bias of a runtime integer that cannot be probed") from None
        if (b <= NEG_BOUND).any():
            raise Decline(f"an additive bias that also masks (values <= {NEG_BOUND:g} for some position): a row "
                          "with every key masked would not be jax's")


_LANE_VIEWS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"})


def _boolean_source(graph: Graph, x: int) -> int | None:
    """The boolean tensor a runtime mask is a function of, lane by lane: ``x`` itself when it is
    boolean, or the one comparison of ``x`` with a constant that reads it (``attention_mask > 0``,
    an int 0/1 padding mask as HF's models compare it, also after broadcasts and reshapes of it);
    None otherwise (the mask could then take
    values no probe of two sees)."""
    if np.dtype(graph.tensors[x].dtype) == np.bool_:
        return x
    users = graph.consumers(x)
    while len(users) == 1 and users[0].primitive in _LANE_VIEWS:   # broadcast / reshape first
        x = users[0].outputs[0]
        users = graph.consumers(x)
    if len(users) != 1 or users[0].primitive not in _COMPARE:
        return None
    op = users[0]
    other = [t for t in op.inputs if t != x]
    if len(other) != 1 or _fold_scalar(graph, other[0]) is None:
        return None
    return op.outputs[0]


def _runtime_mask(graph: Graph, st: dict[str, Any], dims: dict[str, Any], shape: tuple[int, ...],
                  bias_values: set[float]) -> _Mask | None:
    """A mask computed from a runtime boolean tensor (a padding mask: ``where(mask[:, None, None, :],
    s, neg)``, or HF's additive ``select(attention_mask > 0, 0, finfo.min)``), taken out of
    ``st["masks"]``: the kernels read its tensor blockwise through its layout (a broadcast of the
    ``(B, T)`` mask is never materialised) and keep the lanes it keeps.

    Its value at each lane is a function of one boolean lane (and of constants and iotas): probing
    that boolean with True and with False is every case. A select must fill one constant; an
    additive mask must only take 0 and values <= NEG_BOUND (after the scaling that follows it) —
    else it is a bias (and a bias of runtime integers is declined by :func:`_bias_masks_nothing`).
    The masked values go to ``bias_values`` (what a row it empties outputs, :func:`_empty_rows`)."""
    found = []
    for m in st["masks"]:
        if m.when is not None or any(isinstance(a, tuple) for a in m.axes):
            continue
        try:
            leaves = _Eval(graph).leaves(m.tensor)
        except _NoFold:
            continue
        if len(leaves) != 1 or graph.tensors[next(iter(leaves))].size == 1:
            continue
        y = _boolean_source(graph, next(iter(leaves)))
        if y is None:
            continue
        masked: set[float] = set()
        try:
            for v in (True, False):
                val = np.asarray(_Eval(graph, {y: v})(m.tensor))
                if m.keep is None:
                    b = val.astype(np.float64)
                    if ((b != 0) & (b * m.factor > NEG_BOUND)).any():
                        break
                    masked.update(np.unique(b[b != 0]).tolist())
            else:
                found.append((m, masked))
        except (_NoFold, ValueError, TypeError):
            continue
    if not found:
        return None
    if len(found) > 1:
        raise Decline("two masks computed from runtime tensors (padding masks)")
    m, masked = found[0]
    if any(o.keep is None and o is not m and o.stage < m.stage for o in st["masks"]) and m.keep is None:
        raise Decline("a runtime additive mask after another additive term")
    bias_values.update(masked)
    st["masks"] = [o for o in st["masks"] if o is not m]
    return m


COMPUTED_MASK_SHARE = 64   # a computed mask is read from XLA's tensor when it has <= 1/64 the keys' elements


def _computed_mask(graph: Graph, st: dict[str, Any], dims: dict[str, Any], shape: tuple[int, ...],
                   bias_values: set[float]) -> _Mask | None:
    """A select mask outside the bound family, read from the boolean tensor XLA computes for it,
    where that tensor is small: a left-padded batch's ``start[b] <= t <= pos`` (two runtime
    tensors), any lane-wise predicate of runtime values. Tried only when the masks do not fit the
    family (:func:`_fit_mask`), and taken out of ``st["masks"]`` as a runtime mask is: the kernels
    read the pred blockwise through its layout (its broadcasts over heads and query rows virtual)
    and keep the lanes it keeps. Its tensor before those broadcasts must hold at most
    1/``COMPUTED_MASK_SHARE`` of the keys' elements (a decode step's ``(B, T)``: XLA writes it in
    one small fusion; a prefill's ``(B, S, T)`` would be read by every head at the size of the
    keys, and stays declined). The select fills one constant, as a padding mask must."""
    keys = graph.tensors[dims["k"]].size
    for m in reversed(st["masks"]):
        if m.keep is None or m.when is not None or m.score is not None or m.fill != m.fill_lo or \
                any(isinstance(a, tuple) for a in m.axes) or np.dtype(graph.tensors[m.tensor].dtype) != np.bool_:
            continue
        y = m.tensor
        while (op := graph.producer(y)) is not None and op.primitive in _LANE_VIEWS:
            y = op.inputs[0]
        if graph.tensors[y].size * COMPUTED_MASK_SHARE > keys:
            continue
        rest = [o for o in st["masks"] if o is not m]
        try:
            _fit_mask(graph, rest, dims, shape, set(bias_values))
        except Decline:
            continue
        st["masks"] = rest
        return m
    return None


def _operand_view(graph: Graph, m: _Mask, dims: dict[str, Any], qf_d1: list[int], shape: tuple[int, ...],
                  what: str) -> tuple:
    """How the kernels read a tensor applied to the scores (a bias, a runtime mask): (tensor, its
    int axes' sizes, their positions in increasing first-dot order, those first-dot axes,
    canonical first-dot order, first-dot shape, the scaling after it)."""
    ints = [i for i, a in enumerate(m.axes) if isinstance(a, int)]
    bshape = graph.tensors[m.tensor].shape
    if any(bshape[i] != 1 for i, a in enumerate(m.axes) if not isinstance(a, int)):
        raise Decline(f"{what} varies along an axis the scores do not have")
    order = sorted(ints, key=lambda i: m.axes[i])
    return (m.tensor, tuple(bshape[i] for i in ints), tuple(order), tuple(m.axes[i] for i in order),
            tuple(range(dims["nb"])) + tuple(qf_d1) + (dims["key"],), tuple(shape), float(m.factor))


def _biases(graph: Graph, st: dict[str, Any], dims: dict[str, Any], shape: tuple[int, ...]
            ) -> tuple[np.ndarray | None, _Mask | None]:
    """The additive terms on the scores that are no mask, taken out of ``st["masks"]``:

    * ALiBi: a constant ``b = slope · t`` exactly in f32 (``t`` the key position, one slope per
      score row), as BLOOM and Falcon add ``slopes[:, None] * arange(T)``: returned as the slopes
      over the first-dot axes (key axis of size 1); the kernels compute it from an f32 slopes
      operand;
    * any other bias (T5's bucketed relative positions, Swin's table, a learned or runtime bias,
      ALiBi written ``slope · (t - pos)``): returned as its term; the kernels read it blockwise as
      an operand through its layout (what XLA computes for it stays XLA's).

    Each must come before every mask that selects (the masked lanes then hold the fill alone), and
    there is at most one of each. ALiBi must not be scaled after it is added (the kernels add it to
    the scaled, capped scores); a bias operand may be (``(s + b) / c``, MLA's two score terms:
    the kernels add ``b · (1/c)`` to ``s · (1/c)``, one f32 rounding apart)."""
    key, rank, T = dims["key"], len(shape), shape[dims["key"]]
    slopes, bias = None, None
    taken = []
    for m in [m for m in st["masks"] if m.keep is None]:
        if _is_mask_term(graph, m, T):
            continue
        if m.when is not None:
            raise Decline("an additive bias under a condition")
        if any(o.keep is not None and o.stage < m.stage for o in st["masks"]):
            raise Decline("an additive bias added after a mask")
        ev = _Eval(graph)
        try:
            b = None if ev.leaves(m.tensor) else np.asarray(ev(m.tensor))
        except (_NoFold, ValueError, TypeError):
            b = None
        if b is not None and b.dtype == np.float32 and slopes is None and T > 1 and m.factor == 1.0:
            full = _on_scores(b, m.axes, rank, "an additive bias")
            slope = full.take([1], axis=key)
            tt = np.arange(T, dtype=np.float32).reshape([T if a == key else 1 for a in range(rank)])
            both = np.broadcast_shapes(full.shape, tt.shape)
            if full.shape[key] == T and np.array_equal(np.broadcast_to(slope * tt, both), np.broadcast_to(full, both)):
                slopes = slope
                taken.append(m)
                continue
        if bias is not None:
            raise Decline("two additive biases on the scores")
        if any(isinstance(a, tuple) for a in m.axes):
            raise Decline("an additive bias on axes grouped by a reshape of the scores")
        _bias_masks_nothing(graph, m, T)
        bias = m
        taken.append(m)
    st["masks"] = [m for m in st["masks"] if all(m is not t for t in taken)]
    return slopes, bias


def _match(graph: Graph, c: Cluster) -> _AttnMatch:
    a = _analyse(graph, c)
    precision = _precision(graph, a["d1"], a["d2"])
    st = a["st"]
    dims = _dims(graph, a)
    d1 = a["d1"]
    shape = graph.tensors[d1.outputs[0]].shape
    bias_values: set[float] = set()
    score = [m for m in st["masks"] if m.score]          # computed from the scores: no tensor to fit
    st["masks"] = [m for m in st["masks"] if not m.score]
    keep = _runtime_mask(graph, st, dims, shape, bias_values)
    alibi, bias = _biases(graph, st, dims, shape)
    if score and (alibi is not None or bias is not None):
        raise Decline("an additive bias with a mask computed from the scores (the kernels compare the "
                      "scores before adding it)")
    try:
        fit = _fit_mask(graph, st["masks"], dims, shape, bias_values)
    except Decline:
        if keep is not None or score or (keep := _computed_mask(graph, st, dims, shape, bias_values)) is None:
            raise
        fit = _fit_mask(graph, st["masks"], dims, shape, bias_values)
    seq_axis, causal, hi_c, hi_x, window, empty, per_row, kv_cap, inclusive = fit
    if kv_cap is not None:   # the causal end capped at a runtime key length: x + kv_cap
        hi_x, kv_cap = kv_cap
    # a padding mask, or a mask computed from the scores, can empty any row
    empty_rows = _empty_rows(graph, st["masks"] + ([keep] if keep else []) + score, bias_values,
                             empty or keep is not None or bool(score), st["zeroes"])
    inner, outer = st["inner"], st["outer"]
    if st["tanh"]:
        scale, cap = inner * outer, outer
    else:
        scale, cap = inner * outer, None
    nb = dims["nb"]
    qf_d1 = list(dims["q_free_d1"])
    if seq_axis is not None:
        qf_d1.remove(seq_axis)
        qf_d1.append(seq_axis)
    # canonical permutations
    q, k, v = dims["q"], dims["k"], dims["v"]
    qfree_of = dict(zip(dims["q_free_d1"], dims["qf"]))
    q_perm = tuple(dims["qb"]) + tuple(qfree_of[x] for x in qf_d1) + tuple(dims["qc"])
    k_perm = tuple(dims["kb"]) + tuple(dims["kf"]) + tuple(dims["kc"])
    v_perm = tuple(dims["v_batch"]) + tuple(dims["vc"]) + tuple(dims["vf"])
    lab = dims["out_lab"]
    order = [("b", j) for j in range(nb)] + [("q", x) for x in qf_d1] + [("dv",)]
    out_perm = tuple(i for i, x in enumerate(lab) if x[0] == "1") + tuple(
        lab.index(o) for o in order if o in lab)
    if sorted(out_perm) != list(range(len(lab))):
        raise Decline("cannot place the output axes")
    qs, ks, vs = graph.tensors[q].shape, graph.tensors[k].shape, graph.tensors[v].shape
    batch = tuple(qs[i] for i in dims["qb"])
    rows = int(np.prod([shape[x] for x in qf_d1])) if qf_d1 else 1
    S = shape[seq_axis] if seq_axis is not None else rows
    T, D, Dv = ks[dims["kf"][0]], ks[dims["kc"][0]], vs[dims["vf"][0]]
    if window is not None and window < 1:
        raise Decline(f"sliding window of {window} keys")
    # the decode kernel's split programs cannot tell a row a runtime mask empties: jax's softmax of
    # its masked scores (a finite fill) is the prefill kernel's
    decode = not causal and rows <= DECODE_MAX_ROWS and (
        (keep is None and not score) or empty_rows in ("zero", "nan"))
    if seq_axis is None:
        S = rows
    # the bias's / runtime mask's axes onto the first-dot axes, then canonical order
    bias_view = None if bias is None else _operand_view(graph, bias, dims, qf_d1, shape, "an additive bias")
    keep_view = None
    if keep is not None:
        keep_view = (_operand_view(graph, keep, dims, qf_d1, shape, "a runtime mask"),
                     "zero" if keep.keep is None else "nonzero" if keep.keep else "false")
    sink = None
    if st["sink"] is not None:
        sk = st["sink"]
        sink = _operand_view(graph, _Mask(sk["tensor"], None, sk["axes"]), dims, qf_d1, shape, "the sink logit")
    slopes = None
    if alibi is not None:   # one slope per kernel row: (batch..., query rows...) in canonical order
        full = np.broadcast_to(alibi, tuple(1 if a == dims["key"] else n for a, n in enumerate(shape)))
        slopes = np.ascontiguousarray(np.transpose(full, list(range(nb)) + qf_d1 + [dims["key"]]),
                                      np.float32).reshape(batch + (rows,))
    return _AttnMatch(q, k, v, c.outputs[0], q_perm, k_perm, v_perm, out_perm, batch, rows, S, T, D, Dv,
                      float(scale), None if cap is None else float(cap), causal, int(hi_c), hi_x,
                      None if window is None else int(window), decode, empty_rows, per_row, precision,
                      slopes, bias_view, keep_view, (score[0].score, bool(score[0].keep)) if score else None,
                      kv_cap, inclusive, sink, narrow_range(graph.tensors[d1.outputs[0]].dtype),
                      _prologues(graph, c, (q, k, v), decode))


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------

def _group_size(k: Any, heads: int) -> int:
    """Largest G such that K is identical across each group of G heads (a GQA repeat): read off
    the layout — the within-group index must not appear in any piece's map."""
    b, h, t, d = k.shape
    for g in sorted((g for g in range(1, heads + 1) if heads % g == 0), reverse=True):
        if g == 1:
            return 1
        lay = k.layout.reshape((b, h // g, g, t, d))
        if all(2 not in e.dims() for p in lay.pieces for e in p.map.exprs) and \
                all(2 not in c.expr.dims() for p in lay.pieces for c in (*p.where, *p.map.conds)):
            return g
    return 1


def _build(graph: Graph, c: Cluster, m: _AttnMatch, backend: str) -> Step:
    H = m.batch[-1] if m.batch else 1
    B = int(np.prod(m.batch)) // H if m.batch else 1
    R, T, D, Dv = m.rows, m.T, m.D, m.Dv

    def view(x: Any, perm: tuple[int, ...], shape: tuple[int, ...]) -> VTensor:
        x = VTensor.of(x)
        return VTensor(x.layout.transpose(perm).reshape(shape), x.dtype, x.buffers, x.symbols)

    def re(x: VTensor, shape: tuple[int, ...]) -> VTensor:
        return VTensor(x.layout.reshape(shape), x.dtype, x.buffers, x.symbols)

    def bias_of(run: Run, view: Any) -> VTensor | None:
        """The bias (or runtime mask) as a (B, H, R, T) VTensor: its own axes onto the first-dot
        axes (a broadcast layout where it does not vary), then the canonical order (no copy)."""
        if view is None:
            return None
        t, sizes, order, axes, canon, full, _ = view
        x = VTensor.of(run.vtensor(t))
        lay = x.layout.reshape(tuple(x.shape[i] for i in sorted(order)) or (1,))
        pos = {i: j for j, i in enumerate(sorted(order))}
        lay = lay.transpose(tuple(pos[i] for i in order))
        lay = lay.broadcast(full, axes) if axes else lay.reshape(()).broadcast(full, ())
        lay = lay.transpose(canon).reshape((B, H, R, T))
        return VTensor(lay, x.dtype, x.buffers, x.symbols)

    def sink_of(run: Run) -> VTensor | None:
        """The sink logits as a (B, H, R) VTensor: the (B, H, R, T) view of its operand (broadcast
        along the keys, where it has size 1), its first key."""
        if m.sink is None:
            return None
        x = bias_of(run, m.sink)
        return VTensor(x.layout.slice((0,) * 4, (B, H, R, 1)).reshape((B, H, R)), x.dtype, x.buffers, x.symbols)

    # the chains widening q, K, V: applied by the kernel to each block it loads of their bases
    fns = tuple(None if p is None else f32_math(island_program(graph, p.plan)) if isinstance(p, _IslandPrologue)
                else f32_math(block_fn(graph, p[1], [p[0], *p[2]], [x]))
                for p, x in zip(m.prologues, (m.q, m.k, m.v)))

    def operand(run: Run, i: int, perm: tuple[int, ...], shape: tuple[int, ...]) -> tuple[VTensor, Prologue | None]:
        """q, K or V (``i``) in the kernel's logical shape: the tensor itself, or its prologue's
        base with the prologue (its broadcast operands viewed alike). An island's inputs are read
        through its index maps, and the index steps it evaluates take each lane's index from
        a small ``arange`` per axis broadcast over the operand (viewed like the rest)."""
        p = m.prologues[i]
        if p is None:
            return view(run.vtensor((m.q, m.k, m.v)[i]), perm, shape), None
        if isinstance(p, _IslandPrologue):
            ins = [view(leaf_vtensor(run.vtensor(s.tensor) if isinstance(s, Load) else None, s), perm, shape)
                   for s in p.plan.inputs]
            full = p.plan.shape
            idx = []
            if p.plan.uses_index:   # every axis's indices in one constant (XLA would launch a
                # kernel per ``iota`` a custom call reads, and finds iotas among constants)
                table = VTensor.of(np.concatenate([np.arange(n, dtype=np.int32) for n in full]))
                starts = np.cumsum((0,) + full)
                idx = [view(VTensor(table.layout.slice((int(starts[a]),), (int(starts[a + 1]),)).broadcast(full, (a,)),
                                    table.dtype, table.buffers, table.symbols), perm, shape)
                       for a in range(len(full))]
            return ins[0], Prologue(fns[i], tuple(ins[1:] + idx))
        full = tuple(graph.tensors[p[0]].shape)   # side operands broadcast to it by numpy's rules
        return view(run.vtensor(p[0]), perm, shape), Prologue(
            fns[i], tuple(view(broadcast_input(VTensor.of(run.vtensor(t)), full), perm, shape) for t in p[2]))

    def each(x: VTensor, p: Prologue | None, f: Callable[[VTensor], VTensor]) -> tuple[VTensor, Prologue | None]:
        """``f`` (a re-view) applied to an operand and its prologue's operands alike."""
        return f(x), None if p is None else Prologue(p.fn, tuple(f(o) for o in p.operands))

    def step(run: Run) -> None:
        q, qp = operand(run, 0, m.q_perm, (B, H, R, D))
        k, kp = operand(run, 1, m.k_perm, (B, H, T, D))
        v, vp = operand(run, 2, m.v_perm, (B, H, T, Dv))
        out0 = run.out_vtensor(m.out)
        out = view(out0, m.out_perm, (B, H, R, Dv))
        g = min(_group_size(x, H) for x in (k, v, *(() if kp is None else kp.operands),
                                            *(() if vp is None else vp.operands)))
        hk = H // g

        def per_group(x: VTensor) -> VTensor:
            lay = x.layout.reshape((B, hk, g) + tuple(x.shape[2:])).slice(
                (0,) * 5, (B, hk, 1) + tuple(x.shape[2:])).reshape((B, hk) + tuple(x.shape[2:]))
            return VTensor(lay, x.dtype, x.buffers, x.symbols)

        # The valid keys' end, hi_const [+ pos] (+ the query position when causal), handed to the
        # kernels as their own bound arguments: a static int, or the runtime int32 scalar / (B,)
        # vector ``pos`` shifted by a static amount (the kernels take it as an int32 operand).
        pos: Any = None
        if m.hi_scalar is not None:   # one scalar, or one per sequence (B,)
            pos = jnp.asarray(run.value(m.hi_scalar))
            if pos.dtype.itemsize > 4:   # an int64 position (x64): saturated, not wrapped, into int32
                pos = jnp.clip(pos, -INT32_POSITION_LIMIT, INT32_POSITION_LIMIT)
            pos = pos.astype(jnp.int32).reshape((B,) if m.per_row else ())

        def end_minus(c: int) -> Any:
            """``hi_const + pos - c``: a static int, or ``pos`` shifted (no op when it cancels)."""
            if pos is None:
                return int(m.hi_const) - c
            return pos if m.hi_const == c else pos + (m.hi_const - c)

        kw: dict[str, Any] = {} if m.window is None else {"window": m.window}
        if m.inclusive:   # the last valid key x + c - 1, its end saturating (jax's t <= pos)
            kw["inclusive"] = True
        if m.score_dtype is not None:
            kw["score_dtype"] = m.score_dtype
        if m.decode:
            q, qp = each(q, qp, lambda x: re(x, (B, hk, g * R, D)))
            k, kp = each(k, kp, per_group)
            v, vp = each(v, vp, per_group)
            kw.update(q_prologue=qp, k_prologue=kp, v_prologue=vp)
            if m.hi_scalar is not None and (m.hi_const == 1 or m.inclusive):
                kw["pos"] = end_minus(1)   # keys t <= pos: the decode kernel's own form
            elif m.hi_scalar is not None or m.hi_const < T or m.window is not None:
                kw["kv_len"] = end_minus(0)   # a window counts from the unclamped end
            if m.slopes is not None:
                kw["slopes"] = jnp.asarray(m.slopes.reshape(B, hk, g * R))
            if m.bias is not None:
                kw.update(bias=re(bias_of(run, m.bias), (B, hk, g * R, T)), bias_scale=m.bias[-1])
            if m.keep is not None:
                kw.update(keep=re(bias_of(run, m.keep[0]), (B, hk, g * R, T)), keep_when=m.keep[1])
            if m.score_keep is not None:
                kw["score_keep"] = m.score_keep
            if m.sink is not None:
                kw["sink"] = re(sink_of(run), (B, hk, g * R))
            # The cache updates lowering left to this kernel (new rows handed to the step): it
            # performs them where it can (vio.OverlayError otherwise: they run first, in XLA, and
            # the operands are read again over the updated buffers).
            homes = run.pending_for(c.id)
            if homes:
                kw["updates"] = tuple(run.take_update(h) for h in homes)
            try:
                res = decode_attention(q, k, v,
                                       sm_scale=m.scale, soft_cap=m.soft_cap, out=re(out, (B, hk, g * R, Dv)),
                                       backend=backend, empty_rows=m.empty_rows, precision=m.precision, **kw)
            except OverlayError:
                if not homes:
                    raise
                for h in homes:
                    run.flush(h)
                return step(run)
            if homes:
                res, landed = res
                for h, buf in zip(homes, landed):
                    run.landed(h, buf)
        else:
            q, qp = each(q, qp, lambda x: re(x, (B * hk, g * R, D)))
            k, kp = each(k, kp, lambda x: re(per_group(x), (B * hk, T, D)))
            v, vp = each(v, vp, lambda x: re(per_group(x), (B * hk, T, Dv)))
            kw.update(q_prologue=qp, k_prologue=kp, v_prologue=vp)
            if m.causal and m.kv_cap is not None:   # the runtime value caps the causal ends
                kw.update(causal=True, q_offset=int(m.hi_const) - 1, kv_len=pos if m.kv_cap == 0 else pos + m.kv_cap)
            elif m.causal:
                kw.update(causal=True, q_offset=end_minus(1))
            elif m.hi_scalar is not None or m.hi_const < T or m.window is not None:
                kw["kv_len"] = end_minus(1 if m.inclusive else 0)
            if m.slopes is not None:
                kw["slopes"] = jnp.asarray(m.slopes.reshape(B * hk, g * R))
            if m.bias is not None:
                kw.update(bias=re(bias_of(run, m.bias), (B * hk, g * R, T)), bias_scale=m.bias[-1])
            if m.keep is not None:
                kw.update(keep=re(bias_of(run, m.keep[0]), (B * hk, g * R, T)), keep_when=m.keep[1])
            if m.score_keep is not None:
                kw["score_keep"] = m.score_keep
            if m.sink is not None:
                kw["sink"] = re(sink_of(run), (B * hk, g * R))
            res = prefill_attention(q, k, v, seq_len=m.seq, sm_scale=m.scale,
                                    soft_cap=m.soft_cap, out=re(out, (B * hk, g * R, Dv)),
                                    backend=backend, empty_rows=m.empty_rows, precision=m.precision,
                                    **kw)
        run.written(m.out, out0, buffers_of(res))

    return step


TEMPLATE = Template(Kind.ATTENTION, library=False, match=_match, build=_build,
                    updates=lambda m: bool(m.decode))
