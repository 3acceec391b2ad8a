"""Stage 1: trace a JAX function into a flat, inlined dataflow `Graph` (see docs/INTERNALS.md).

Why a graph of our own instead of the jaxpr: later stages need dense tensor ids, producer/consumer
lookups and one flat op list. Call-like primitives (`jit`, `custom_jvp_call`, `remat2`, ...) only
wrap ordinary ops, so they are inlined; primitives with their own semantics (control flow, ...) stay
single ops with `opaque_reason` set. A few equations are spliced in as an equivalent canonical form
(`canonical.rewrite`: a one-window scatter becomes a guarded dynamic_update_slice;
`canonical.fold_transposes`: a transpose of a transpose is one transpose). Tracing goes
through `jax.make_jaxpr`, which only needs shapes
and dtypes, so `jax.ShapeDtypeStruct` arguments describe paper-size models without allocating.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
from jax.tree_util import PyTreeDef

from . import canonical
from .interpret import rebind
from .primitives import CONTRACTION, CONTROL_FLOW, TABLE, Role


def is_extended(dtype: Any) -> bool:
    """True for jax's extended dtypes (PRNG key types such as ``key<fry>``, ``key<rbg>``).

    They are not numpy dtypes: ``np.dtype(d)``, ``np.issubdtype(d, ...)`` and ``np.asarray`` of such
    an array raise. ``d.itemsize`` works (the size of the key data). Tensors of these dtypes are
    only ever produced and consumed by ordinary XLA ops (``random_seed``, ``random_wrap``,
    ``random_bits``, ``random_split``, ...), which later stages re-bind unchanged.
    """
    if dtype is None or isinstance(dtype, np.dtype):
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:
        return False


def as_dtype(dtype: Any) -> Any:
    """``np.dtype(dtype)``, except that jax extended dtypes (PRNG keys) are returned unchanged."""
    if dtype is None:
        return np.dtype(object)
    if is_extended(dtype):
        return dtype
    return np.dtype(dtype)


SMALL_VALUE = 64   # elements: index arithmetic and scalars (value-numbered, see Graph.same_value)


@dataclass(frozen=True)
class TensorInfo:
    id: int
    shape: tuple[int, ...]
    dtype: np.dtype              # or a jax extended dtype (PRNG key: ``key<fry>``), see is_extended
    const: object | None = None  # numpy value for literals / closed-over consts (a jax array for
                                 # key-typed consts, which numpy cannot hold), else None

    @property
    def size(self) -> int:
        return math.prod(self.shape)   # Python ints: exact, and far cheaper than numpy's reduce


@dataclass(frozen=True)
class Speculated:
    """A ``cond`` the trace computes as a select of all its branches (``canonical.speculable_cond``),
    as the user's program holds it: what XLA is given under plain ``jax.jit``. ``operands`` and
    ``outputs``: the tensors it reads (the index first) and the selected results; ``empty_branch``:
    a branch returns its operands unchanged; ``primitives``: every primitive its branches run."""
    operands: tuple[int, ...]
    outputs: tuple[int, ...]
    branches: int
    empty_branch: bool
    primitives: frozenset[str]


@dataclass(frozen=True, eq=False)
class Op:
    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]
    prim: jcore.Primitive
    opaque_reason: str | None = None
    conv_index: int | None = None   # a conv: its place among the traced function's convs (see trace)

    def bind(self, *values: Any) -> Any:
        """The op's primitive re-bound on ``values`` with its own params (``interpret.rebind``:
        as ``eval_jaxpr`` binds it, so ``shard_map`` gets its body back as a function)."""
        return rebind(self.prim, values, self.params)


@dataclass(frozen=True, eq=False)
class Graph:
    tensors: tuple[TensorInfo, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    in_tree: PyTreeDef
    out_tree: PyTreeDef
    speculated: tuple[Speculated, ...] = ()   # conds traced as selects (what plain jit keeps)
    # (tensor, primitive): results of the user's equations the trace wrote in other primitives
    # (``canonical.rewrite``: a scatter as a dynamic_update_slice), the primitive XLA is given
    rewritten: tuple[tuple[int, str], ...] = ()
    # per output: whether ``fn``'s result is weakly typed (a Python scalar's promotion, which
    # jax.jit returns and which later promotion reads: ``bf16 + out`` stays bf16)
    weak_outputs: tuple[bool, ...] = ()
    # the program as the user wrote it, where this graph was traced with convolutions rewritten
    # channels-last (``trace_with(channels_last=...)``): what plain ``jax.jit`` compiles, and so
    # what the model of XLA prices jit on (XLA folds those transposes into the conv's layouts;
    # priced as ops they were two launches over on YOLO's C3k2)
    as_written: "Graph | None" = None

    def origin(self, t: int) -> str | None:
        """The primitive of the user's program that computes ``t``, where the trace wrote it in
        others (``canonical.rewrite``), else None."""
        return self._origin.get(t)

    @functools.cached_property
    def _origin(self) -> dict[int, str]:
        return dict(self.rewritten)

    @functools.cached_property
    def _producers(self) -> dict[int, Op]:
        return {t: op for op in self.ops for t in op.outputs}

    @functools.cached_property
    def _consumers(self) -> dict[int, tuple[Op, ...]]:
        users: dict[int, list[Op]] = {}
        for op in self.ops:
            for t in dict.fromkeys(op.inputs):  # an op reading a tensor twice is one consumer
                users.setdefault(t, []).append(op)
        return {t: tuple(ops) for t, ops in users.items()}

    @functools.cached_property
    def _same_value(self) -> dict[int, int]:
        """Value numbering of small computed tensors: each maps to the first tensor computed by
        the same primitive with the same params from the same values. Why: jax normalises a
        dynamic index at every ``dynamic_slice`` / ``dynamic_update_slice`` it emits (``i < 0 ?
        i + n : i``), so the window a guarded cache write reads and the window it writes start
        at two tensors of one value; as two runtime symbols their index maps differ and the
        write cannot be seen to touch exactly what was read."""
        rep: dict[int, int] = {}
        seen: dict[tuple, int] = {}
        for op in self.ops:
            if (len(op.outputs) != 1 or op.opaque_reason is not None or self.tensors[op.outputs[0]].size > SMALL_VALUE
                    or any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in op.params.values())
                    or "rng" in op.primitive or "random" in op.primitive or op.prim.multiple_results):
                continue
            ins = tuple(rep.get(t, t) for t in op.inputs)
            consts = tuple(None if self.tensors[t].const is None or self.tensors[t].size > SMALL_VALUE
                           else (str(self.tensors[t].dtype), np.asarray(self.tensors[t].const).tobytes())
                           for t in ins)
            key = (op.primitive, repr(sorted(op.params.items())), tuple(t if c is None else c for t, c in zip(ins, consts)))
            t = op.outputs[0]
            rep[t] = seen.setdefault(key, t)
        return rep

    def same_value(self, t: int) -> int:
        """The first tensor computed like ``t`` (``t`` itself unless a small value is recomputed)."""
        return self._same_value.get(t, t)

    def producer(self, t: int) -> Op | None:
        """The op writing tensor `t`, or None for graph inputs and consts."""
        return self._producers.get(t)

    def consumers(self, t: int) -> tuple[Op, ...]:
        """The ops reading tensor `t`, in graph order, each once."""
        return self._consumers.get(t, ())

    def evaluate(self, *flat_inputs: Any) -> tuple[Any, ...]:
        """Re-bind every op in order; equal to the traced function (proves the graph is faithful)."""
        if len(flat_inputs) != len(self.inputs):
            raise TypeError(f"evaluate expects {len(self.inputs)} flat inputs, got {len(flat_inputs)}")
        env: dict[int, Any] = {t.id: t.const for t in self.tensors if t.const is not None}
        env.update(zip(self.inputs, flat_inputs))
        for op in self.ops:
            out = op.bind(*(env[t] for t in op.inputs))
            env.update(zip(op.outputs, out if op.prim.multiple_results else (out,)))
        return tuple(env[t] for t in self.outputs)

    def unflatten_outputs(self, flat: Any) -> Any:
        return jax.tree_util.tree_unflatten(self.out_tree, list(flat))


def normalize_param(value: Any) -> Any:
    """np.integer -> int, recursively inside tuples (params must hash/compare like jax's own)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, tuple):
        items = [normalize_param(v) for v in value]
        # NamedTuples (ConvDimensionNumbers, GatherDimensionNumbers...) keep their type: jax's
        # shape rules check it when the op is re-bound.
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


@dataclass(frozen=True)
class _RawOp:
    eqn: jcore.JaxprEqn
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    conv_index: int | None = None


class _Builder:
    """Mutable scratch state of one `trace` call: tensors and ops in creation order."""

    def __init__(self, channels_last: frozenset[int] = frozenset()) -> None:
        self.channels_last = channels_last   # conv_index of convs to write channels-last
        self.convs = 0                       # convolutions of the user's program seen so far
        self.tensors: list[tuple[tuple[int, ...], np.dtype, object | None]] = []
        self.ops: list[_RawOp] = []
        self.producers: dict[int, _RawOp] = {}   # tensor -> the op writing it (canonical folds)
        self.speculated: list[Speculated] = []   # conds inlined as selects (tensor ids of this builder)
        self.rewritten: dict[int, str] = {}      # tensor -> the primitive canonical.rewrite replaced

    def tensor(self, aval: Any, const: object | None = None) -> int:
        dtype = as_dtype(getattr(aval, "dtype", None))
        if const is not None:
            # numpy cannot hold PRNG keys: a key-typed const stays a (concrete) jax array
            const = jax.numpy.asarray(const) if is_extended(dtype) else np.asarray(const, dtype=dtype)
        self.tensors.append((tuple(int(d) for d in getattr(aval, "shape", ())), dtype, const))
        return len(self.tensors) - 1

    def read(self, env: dict[jcore.Var, int], atom: Any) -> int:
        if isinstance(atom, jcore.Literal):
            return self.tensor(atom.aval, atom.val)
        return env[atom]

    def fold_scalar(self, eqn: jcore.JaxprEqn, ins: list[int]) -> list[int] | None:
        """Scalar arithmetic on constants computed now, as XLA's constant folding does: its outputs
        become constants (None: not such an equation). A ``select_n`` by a constant scalar is the
        case it picks. Why: ``jnp.var`` computes its divisor and a ``divisor > 0`` guard from
        ``ddof`` passed into its own ``jit`` (equinox's LayerNorm), and left as ops those scalars
        kept the LayerNorm's reduction from the row-reduction template."""
        const = [self.tensors[t][2] for t in ins]
        if (eqn.effects or any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in eqn.params.values())
                or "rng" in eqn.primitive.name or "random" in eqn.primitive.name):
            return None
        if eqn.primitive.name == "select_n" and const[0] is not None and np.size(const[0]) == 1 and \
                all(v.aval == eqn.outvars[0].aval for v in eqn.invars[1:]):
            return [ins[1 + int(np.asarray(const[0]).reshape(()))]]
        if any(c is None or np.size(c) != 1 or is_extended(self.tensors[t][1]) for c, t in zip(const, ins)) or \
                any(getattr(v.aval, "shape", None) != () for v in eqn.outvars):
            return None
        try:   # (eagerly: the trace may run inside a jit's)
            with jax.ensure_compile_time_eval():
                vals = eqn.primitive.bind(*[np.asarray(c) for c in const], **eqn.params)
                vals = [np.asarray(x) for x in (vals if eqn.primitive.multiple_results else [vals])]
        except Exception:   # a primitive that cannot run eagerly here: left as it is
            return None
        return [self.tensor(v.aval, x) for v, x in zip(eqn.outvars, vals)]

    def inline(self, jaxpr: jcore.Jaxpr, consts: list[Any], args: list[int], conv_index: int | None = None
               ) -> list[int]:
        """Splice `jaxpr` into the graph with its invars bound to `args`; returns its outputs.
        ``conv_index``: `jaxpr` is that conv's channels-last form (its conv keeps the index)."""
        env: dict[jcore.Var, int] = {v: self.tensor(v.aval, c) for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            ins = [self.read(env, a) for a in eqn.invars]
            index = None
            if eqn.primitive.name == "conv_general_dilated":
                index = conv_index if conv_index is not None else self.convs
                self.convs += conv_index is None
                if conv_index is None and index in self.channels_last:
                    body = canonical.channels_last(eqn)
                    if body is not None:
                        env.update(zip(eqn.outvars, self.inline(body[0], body[1], ins, index)))
                        continue
            body = _inlined_body(eqn)
            rewrite = body is None and (body := canonical.rewrite(eqn)) is not None
            inner = self.producers.get(ins[0]) if body is None and ins else None
            folded = canonical.fold_transposes(eqn, inner.eqn if inner else None)
            if folded is not None:
                body, ins = folded, [inner.inputs[0]]
            if body is not None:
                outs = self.inline(body[0], body[1], ins)
                if rewrite:
                    self.rewritten.update((t, eqn.primitive.name) for t in outs if t not in ins)
                if canonical.speculable_cond(eqn):
                    branches = [br.jaxpr for br in eqn.params["branches"]]
                    self.speculated.append(Speculated(
                        tuple(ins), tuple(outs), len(branches), any(not br.eqns for br in branches),
                        frozenset(e.primitive.name for br in branches for e in _all_eqns(br))))
            elif (folded_outs := self.fold_scalar(eqn, ins)) is not None:
                outs = folded_outs
            else:
                outs = [self.tensor(v.aval) for v in eqn.outvars]
                raw = _RawOp(eqn, tuple(ins), tuple(outs), index)
                self.ops.append(raw)
                self.producers.update((t, raw) for t in outs)
            env.update(zip(eqn.outvars, outs))
        return [self.read(env, a) for a in jaxpr.outvars]


def _all_eqns(jaxpr: jcore.Jaxpr) -> list[jcore.JaxprEqn]:
    """``jaxpr``'s equations, those of the calls it makes (nested ``jit``) in place of the call."""
    out = []
    for e in jaxpr.eqns:
        inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
        out += _all_eqns(getattr(inner, "jaxpr", inner)) if inner is not None else [e]
    return out


def _inlined_body(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, list[Any]] | None:
    """(jaxpr, consts) of a call-like equation to inline (its row's ``call_body`` params, tried in
    order), or None to keep the equation as an op."""
    row = TABLE.get(eqn.primitive.name)
    for name in row.call_body if row is not None else ():
        body = eqn.params.get(name)
        if isinstance(body, jcore.ClosedJaxpr):
            body, consts = body.jaxpr, list(body.consts)
        else:
            consts = []
        if isinstance(body, jcore.Jaxpr) and len(body.invars) == len(eqn.invars) \
                and len(body.outvars) == len(eqn.outvars):
            return body, consts
    return None


def _opaque_reason(eqn: jcore.JaxprEqn) -> str | None:
    name = eqn.primitive.name
    if name in CONTROL_FLOW:
        return f"control flow ({name}) kept opaque"
    if any(True for _ in jcore.jaxprs_in_params(eqn.params)):
        return f"higher-order primitive ({name}) kept opaque"
    return None


def _sink_elementwise(raw: list[_RawOp], b: "_Builder", outputs: list[int]) -> list[_RawOp]:
    """``view(f(x))`` traced as ``f(view(x))`` for a unary elementwise ``f`` (its other operands
    rank-0) whose result only the view reads: ``transpose(relu(k))`` becomes ``relu(transpose(k))``.

    Why: elementwise ops commute with views, and with ``f`` next to the dot that reads it the
    matmul cluster takes ``f`` as a prologue applied to the tiles it loads (cluster._grow_prologue:
    EfficientViT's ReLU on k, behind a transpose and a squeeze), instead of a pointwise kernel
    writing ``f(k)`` for the dot to read back. The same values, in the same dtype per op.
    A cast to a narrower dtype is not moved: next to its producer it is that kernel's epilogue
    (the attention's f32 output stored as bf16, half the bytes), where sunk past the head
    transpose it became a lone cast between a Pallas kernel and XLA's GEMM — a launch of its own."""
    uses: dict[int, int] = {}
    for r in raw:
        for t in r.inputs:
            uses[t] = uses.get(t, 0) + 1
    made = {t: i for i, r in enumerate(raw) for t in r.outputs}
    out = list(raw)
    changed = True
    while changed:
        changed = False
        for j, m in enumerate(out):
            if not _sinkable(m.eqn.primitive.name) or len(m.inputs) != 1 or len(m.outputs) != 1:
                continue
            i = made.get(m.inputs[0])
            if i is None or i >= j:
                continue
            e = out[i]
            info = TABLE.get(e.eqn.primitive.name)
            t = m.inputs[0]
            if info is None or info.role is not Role.ELEMENTWISE or len(e.outputs) != 1 or e.eqn.effects \
                    or uses.get(t, 0) != 1 or t in outputs:
                continue
            big = [x for x in e.inputs if b.tensors[x][0] != ()]
            if len(big) != 1 or b.tensors[big[0]][0] != b.tensors[t][0]:
                continue
            x = big[0]
            if _narrows(b.tensors[x][1], b.tensors[t][1]):
                continue   # a narrowing cast stays with its producer (docstring)
            shape = b.tensors[m.outputs[0]][0]
            moved = b.tensor(jax.ShapeDtypeStruct(shape, b.tensors[x][1]))
            out[i] = _RawOp(m.eqn, (x,), (moved,))
            out[j] = _RawOp(e.eqn, tuple(moved if y == x else y for y in e.inputs), m.outputs)
            made[moved], made[m.outputs[0]] = i, j
            uses[moved] = 1
            changed = True
    return out


def _sink_into_dot_operands(raw: list[_RawOp], b: "_Builder", outputs: list[int]) -> list[_RawOp]:
    """``view(f(x, s))`` traced as ``f(view(x), view(s))`` on the way into a dot operand that widens
    what is stored: ``jnp.repeat(cache.astype(jnp.bfloat16) * scale, G, axis=2)``, GQA's K and V
    from an int8 cache, or a bf16 cache repeated and attended in f32.

    The path (:func:`_widening_path`) runs back from a dot operand through single-use views
    (broadcasts, rearrangements) and element-wise ops, each op's other operands scalars or smaller
    tensors it broadcasts (a per-token scale), and holds a cast from an integer or a narrower
    float. Each element-wise op of it moves below the view after it, the view applied to each of
    its operands (a side operand keeps its size-1 dims through a broadcast; through a
    rearrangement it must already have the op's shape).

    Why: next to the dot the element-wise ops are the prologue of the blocks the attention kernel
    loads (``cluster.operand_chain``), which then reads the int8 or bf16 cache and its scales as
    stored, through the repeat's views, where ``f`` left behind the repeat is a kernel writing the
    widened, repeated cache out. The same values per element."""
    out = list(raw)
    while True:
        readers: dict[int, list[int]] = {}
        for i, r in enumerate(out):
            for t in r.inputs:
                readers.setdefault(t, []).append(i)
        made = {t: i for i, r in enumerate(out) for t in r.outputs}
        path: dict[int, int] = {}   # op index -> the input the path continues through
        for r in out:
            if r.eqn.primitive.name == "dot_general":
                for t in r.inputs[:2]:
                    path.update(_widening_path(out, b, t, made, readers, outputs))
        moves: dict[int, int] = {}   # view index -> the element-wise op's index it moves past
        for j in sorted(path):
            m = out[j]
            i = made.get(m.inputs[0])
            if not _view_like(m) or i not in path or _view_like(out[i]) or i in moves.values():
                continue
            e, shape = out[i], b.tensors[m.inputs[0]][0]
            broadcast = m.eqn.primitive.name == "broadcast_in_dim"
            if any(x != path[i] and b.tensors[x][0] != () and not broadcast and b.tensors[x][0] != shape
                   for x in e.inputs):
                continue   # a side operand with size-1 dims cannot take a rearrangement's view
            moves[j] = i
        if not moves:
            return out
        # every move of this round at once (disjoint pairs; a path of k ops takes about k rounds)
        new: list[_RawOp] = []
        for k, r in enumerate(out):
            if k in moves.values():
                continue
            if k not in moves:
                new.append(r)
                continue
            e = out[moves[k]]
            ins = []
            for x in e.inputs:
                if b.tensors[x][0] == ():
                    ins.append(x)
                    continue
                y = b.tensor(jax.ShapeDtypeStruct(b.tensors[r.outputs[0]][0], b.tensors[x][1]))
                new.append(_RawOp(r.eqn, (x,), (y,)))
                ins.append(y)
            new.append(_RawOp(e.eqn, tuple(ins), r.outputs))
        out = new


def _widening_path(out: list[_RawOp], b: "_Builder", t: int, made: Mapping[int, int],
                   readers: Mapping[int, list[int]], outputs: list[int]) -> dict[int, int]:
    """``{op index: its input on the path}`` of :func:`_sink_into_dot_operands`' path back from the
    dot operand ``t`` (empty when it holds no widening cast). Through an element-wise op the path
    follows the operand of the most elements below the views (the cache, not its scale); a tie
    ends it."""
    path: dict[int, int] = {}
    widens = False
    while (i := made.get(t)) is not None and len(readers.get(t, ())) == 1 and t not in outputs:
        r = out[i]
        if _view_like(r):
            path[i] = t = r.inputs[0]
            continue
        info = TABLE.get(r.eqn.primitive.name)
        if info is None or info.role is not Role.ELEMENTWISE or len(r.outputs) != 1 or r.eqn.effects:
            break
        shape = b.tensors[r.outputs[0]][0]
        ins = list(dict.fromkeys(x for x in r.inputs if b.tensors[x][0] != ()))
        if not ins or any(len(b.tensors[x][0]) != len(shape) or
                          not all(n in (1, f) for n, f in zip(b.tensors[x][0], shape)) for x in ins):
            break
        roots = [_root_elements(out, b, x, made) for x in ins]
        if roots.count(max(roots)) > 1 or b.tensors[ins[roots.index(max(roots))]][0] != shape:
            break
        src = ins[roots.index(max(roots))]
        if r.eqn.primitive.name == "convert_element_type":
            try:
                a, z = np.dtype(b.tensors[src][1]), np.dtype(b.tensors[r.outputs[0]][1])
                widens |= bool(jax.numpy.issubdtype(z, jax.numpy.floating)) and (   # (numpy's misses bfloat16)
                    bool(jax.numpy.issubdtype(a, jax.numpy.integer)) or a.itemsize < z.itemsize)
            except TypeError:   # extended dtypes
                break
        path[i] = t = src
    return path if widens else {}


def _root_elements(out: list[_RawOp], b: "_Builder", t: int, made: Mapping[int, int]) -> int:
    """The elements ``t`` is made of through views (a repeated cache: the cache's)."""
    while (i := made.get(t)) is not None and _view_like(out[i]):
        t = out[i].inputs[0]
    return int(np.prod(b.tensors[t][0], dtype=np.int64))


def _view_like(r: _RawOp) -> bool:
    """A one-operand view an element-wise op commutes with: a broadcast or a rearrangement."""
    return len(r.inputs) == 1 and len(r.outputs) == 1 and (
        r.eqn.primitive.name == "broadcast_in_dim" or _sinkable(r.eqn.primitive.name))


def _hoist_narrowing_casts(raw: list[_RawOp], b: "_Builder", outputs: list[int]) -> list[_RawOp]:
    """``cast(view(x))`` traced as ``view(cast(x))`` for a cast to a narrower dtype whose operand
    only it reads (:func:`_commutes_with_cast`: transpose, reshape, squeeze, a broadcast that adds
    only size-1 dims): the mirror of :func:`_sink_elementwise` for narrowing casts.

    Why: a narrowing cast belongs with the producer — its epilogue stores fewer bytes (the
    attention kernel's bf16 store, ``cluster._attention``). jax's batched matmul at batch 1 puts a
    size-1 broadcast between the second dot and ``.astype(q.dtype)``; hoisted above it, the cast
    is the dot's own. Only casts of a contraction's result move: a cast after an elementwise
    producer is in that pointwise cluster either way, and moving it above a reshape would change
    the cluster's output shape (a complex RoPE's ``(…, 64, 2) → (…, 128)`` row, which then no
    longer matches the V row it shares a launch with). The same values: a cast commutes with any
    view."""
    uses: dict[int, int] = {}
    for r in raw:
        for t in r.inputs:
            uses[t] = uses.get(t, 0) + 1
    made = {t: i for i, r in enumerate(raw) for t in r.outputs}
    out = list(raw)
    changed = True
    while changed:
        changed = False
        for j, c in enumerate(out):
            if c.eqn.primitive.name != "convert_element_type" or len(c.inputs) != 1:
                continue
            t = c.inputs[0]
            i = made.get(t)
            if i is None or i >= j or uses.get(t, 0) != 1 or t in outputs or not _commutes_with_cast(out[i], b):
                continue
            v = out[i]
            x = v.inputs[0]
            root = made.get(x)   # through a chain of such views, only onto a contraction: after an
            while root is not None and _commutes_with_cast(out[root], b):   # elementwise op the
                root = made.get(out[root].inputs[0])                        # cast is in its cluster
            if not _narrows(b.tensors[x][1], b.tensors[c.outputs[0]][1]) or root is None \
                    or out[root].eqn.primitive.name not in CONTRACTION:
                continue
            cast = b.tensor(jax.ShapeDtypeStruct(b.tensors[x][0], b.tensors[c.outputs[0]][1]))
            out[i] = _RawOp(c.eqn, (x,), (cast,))
            out[j] = _RawOp(v.eqn, (cast,), c.outputs)
            made[cast], made[c.outputs[0]] = i, j
            uses[cast] = 1
            changed = True
    return out


def _sinkable(primitive: str) -> bool:
    """A one-operand rearrangement an elementwise op commutes with (``PrimInfo.sinkable``)."""
    row = TABLE.get(primitive)
    return row is not None and row.sinkable


def _commutes_with_cast(r: _RawOp, b: "_Builder") -> bool:
    """A one-operand, one-result rearrangement a cast commutes with: a sinkable primitive, or a
    broadcast that only adds size-1 dims. (Not :func:`primitives.is_view`, XLA's free bitcasts:
    a transpose moves data but still commutes with a cast.)"""
    if len(r.inputs) != 1 or len(r.outputs) != 1:
        return False
    if r.eqn.primitive.name == "broadcast_in_dim":
        return int(np.prod(b.tensors[r.inputs[0]][0])) == int(np.prod(b.tensors[r.outputs[0]][0]))
    return _sinkable(r.eqn.primitive.name)


def _narrows(src: Any, dst: Any) -> bool:
    """A cast from ``src`` to a dtype of fewer bytes per element."""
    try:
        return np.dtype(dst).itemsize < np.dtype(src).itemsize
    except TypeError:   # extended dtypes (PRNG keys)
        return False


def _slices_as_split(raw: list[_RawOp], b: "_Builder") -> list[_RawOp]:
    """Static slices of one tensor that tile it along one axis (``kv[0]``, ``kv[1]`` of a fused K/V
    projection; ``x[..., :h]``, ``x[..., h:]``) traced as ONE ``split`` (``canonical``'s spirit,
    across equations). Why: a slice offers only a read edge — the sliced tensor's other part
    would have no home — so the producer of ``kv`` could never write ``kv[1]`` straight into the
    V cache; a split also offers the write edges ``kv ⇢ part`` (``movement._split``), the
    producer writing each part where its reader wants it. Same values; XLA lowers a split as the
    same slices."""
    groups: dict[tuple[int, int], list[_RawOp]] = {}
    for r in raw:
        if r.eqn.primitive.name != "slice" or r.eqn.params.get("strides") not in (None, ()) and \
                any(int(st) != 1 for st in r.eqn.params["strides"]):
            continue
        shape = b.tensors[r.inputs[0]][0]
        start, limit = r.eqn.params["start_indices"], r.eqn.params["limit_indices"]
        cut = [d for d in range(len(shape)) if (int(start[d]), int(limit[d])) != (0, shape[d])]
        if len(cut) == 1:
            groups.setdefault((r.inputs[0], cut[0]), []).append(r)
    replace: dict[int, _RawOp | None] = {}
    for (x, axis), rs in groups.items():
        rs = sorted(rs, key=lambda r: int(r.eqn.params["start_indices"][axis]))
        spans = [(int(r.eqn.params["start_indices"][axis]), int(r.eqn.params["limit_indices"][axis])) for r in rs]
        n = b.tensors[x][0][axis]
        if len(rs) < 2 or spans[0][0] != 0 or spans[-1][1] != n or \
                any(a[1] != c[0] for a, c in zip(spans, spans[1:])) or any(id(r) in replace for r in rs):
            continue
        shape, dtype, _ = b.tensors[x]
        try:
            split = jax.make_jaxpr(lambda a: jax.lax.split(a, [hi - lo for lo, hi in spans], axis))(
                jax.ShapeDtypeStruct(shape, dtype)).jaxpr.eqns[0]
        except Exception:   # noqa: BLE001 - a jax without lax.split: keep the slices
            continue
        first = min(rs, key=raw.index)
        replace[id(first)] = _RawOp(split, (x,), tuple(r.outputs[0] for r in rs))
        replace.update({id(r): None for r in rs if r is not first})
    if not replace:
        return raw
    return [replace.get(id(r), r) for r in raw if replace.get(id(r), r) is not None]


def _live_ops(raw: list[_RawOp], outputs: list[int]) -> list[_RawOp]:
    """Dead-code elimination: keep ops some output needs, and every effectful op."""
    needed, kept = set(outputs), []
    for r in reversed(raw):
        if r.eqn.effects or needed.intersection(r.outputs):
            needed.update(r.inputs)
            kept.append(r)
    return kept[::-1]


def trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
    """Trace `fn(*args, **kwargs)` into a `Graph`. Leaves may be arrays or `jax.ShapeDtypeStruct`s."""
    return trace_with(fn, args, kwargs)


def trace_with(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
               channels_last: frozenset[int] = frozenset()) -> Graph:
    """`trace`, with the convolutions whose ``Op.conv_index`` is in ``channels_last`` written in
    channels-last form (``canonical.channels_last``; ``api.analyze`` picks them)."""
    if not callable(fn):
        raise TypeError(f"trace: expected a callable, {fn!r} is not callable")
    leaves, in_tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))

    def flat_fn(*flat: Any) -> Any:
        a, k = jax.tree_util.tree_unflatten(in_tree, flat)
        return fn(*a, **k)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
    closed = canonical.split_complex(closed) or closed
    out_tree = jax.tree_util.tree_structure(out_shape)
    b = _Builder(frozenset(channels_last))
    inputs = [b.tensor(v.aval) for v in closed.jaxpr.invars]
    outputs = b.inline(closed.jaxpr, list(closed.consts), inputs)
    live = _slices_as_split(_hoist_narrowing_casts(_sink_into_dot_operands(
        _sink_elementwise(_live_ops(b.ops, outputs), b, outputs), b, outputs), b, outputs), b)

    # Renumber densely: tensors still referenced, ops by position.
    used = dict.fromkeys([*inputs, *outputs, *(t for r in live for t in (*r.inputs, *r.outputs))])
    new_id = {t: i for i, t in enumerate(sorted(used))}
    tensors = tuple(TensorInfo(new_id[t], *b.tensors[t]) for t in sorted(used))
    ops = tuple(
        Op(id=i, primitive=r.eqn.primitive.name,
           inputs=tuple(new_id[t] for t in r.inputs), outputs=tuple(new_id[t] for t in r.outputs),
           params={k: normalize_param(v) for k, v in r.eqn.params.items()},
           prim=r.eqn.primitive, opaque_reason=_opaque_reason(r.eqn), conv_index=r.conv_index)
        for i, r in enumerate(live))
    speculated = tuple(Speculated(tuple(new_id[t] for t in c.operands if t in new_id),
                                  tuple(new_id[t] for t in c.outputs if t in new_id),
                                  c.branches, c.empty_branch, c.primitives)
                       for c in b.speculated if any(t in new_id for t in c.outputs))
    rewritten = tuple((new_id[t], name) for t, name in b.rewritten.items() if t in new_id)
    return Graph(tensors=tensors, ops=ops, inputs=tuple(new_id[t] for t in inputs),
                 outputs=tuple(new_id[t] for t in outputs), in_tree=in_tree, out_tree=out_tree,
                 speculated=speculated, rewritten=rewritten,
                 weak_outputs=tuple(bool(getattr(v.aval, "weak_type", False)) for v in closed.jaxpr.outvars))
