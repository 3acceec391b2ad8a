"""Stage 6: re-emit the program from the Graph and the Strategy.

Walking the clusters in order, each one becomes one of:

* nothing — a movement op the points-to graph eliminated (every output virtual, or every element
  of every output written directly by the producers of its inputs);
* a Pallas kernel — a compute cluster that reads or writes a virtual tensor; its block loads and
  stores go through the composed layouts (``kernels/vio.py``), its stage 2 is the cluster's own
  primitives re-bound on register blocks (:func:`block_fn`);
* the original primitives, re-bound — everything else is left to XLA, exactly as traced.

Physical tensors live in ``env`` as their *current version*: a buffer written piecewise by several
kernels (the KV cache at ``pos``, a concat buffer) is created by its first writer (uninitialised
elsewhere) and threaded through later writers with ``input_output_aliases``. Cluster order is a
topological order, so every reader comes after all writers of what it reads; the VTOG's legality
check already removed in-place edges whose old contents are read later.

Where a template cannot serve a cluster, the cluster falls back to XLA: its virtual inputs are
materialised with a gather and its virtual outputs scattered into their buffers. That is correct
and slow, and it is reported (``Lowered.fallbacks``), never silent.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cluster import ELEMENTWISE_PRIMITIVES, Cluster
from .graph import Graph, Op
from .indexmap import Layout, Piece
from .kernels.vio import VTensor
from .strategy import Strategy

__all__ = ["lower", "Lowered", "eliminated_ops", "block_fn", "TEMPLATE_KINDS"]

# Cluster kinds with a kernel template that can read/write virtual tensors.
TEMPLATE_KINDS = frozenset({"matmul", "pointwise", "attention", "conv"})
_BLOCK_SAFE = (ELEMENTWISE_PRIMITIVES - {"iota"}) | {"broadcast_in_dim"}


@dataclass(frozen=True, eq=False)
class Lowered:
    """The re-emitted program: ``fn(*flat_inputs) -> flat outputs`` plus what it is made of."""
    fn: Callable[..., tuple[Any, ...]]
    kernels: tuple[str, ...]          # one line per Pallas kernel: "matmul #c3 (dot_general ...)"
    skipped: tuple[int, ...]          # movement op ids nobody executes
    fallbacks: tuple[str, ...]        # clusters that touch virtual tensors but run in XLA, and why


# --------------------------------------------------------------------------------------------
# What vanishes
# --------------------------------------------------------------------------------------------

def eliminated_ops(graph: Graph, strategy: Strategy) -> frozenset[int]:
    """Movement ops no one has to execute under ``strategy``."""
    v = strategy.vtog
    chosen = [v.edges[i] for i in strategy.chosen]
    out: set[int] = set()
    ops = {e.op for e in chosen}
    for oid in ops:
        op = graph.ops[oid]
        ok = True
        for o in op.outputs:
            if strategy.is_virtual(o) and all(e.direction == "read" for e in strategy.points_to(o)):
                continue  # read through its map from data that exists elsewhere
            # physical, or itself written through a map: its producers (the op's inputs, through
            # this op's write edges) must fill all of it, or the op has to run
            covered = sum(_volume(e.box) for e in chosen
                          if e.op == oid and e.dst == o and e.direction == "write")
            if covered < graph.tensors[o].size:
                ok = False
                break
        if ok and op.primitive == "dynamic_update_slice" and any(
                e.inplace for e in strategy.points_to(op.outputs[0])):
            # in place: the update still has to land, unless its producer writes it there.
            upd = op.inputs[1]
            ok = any(e.op == oid and e.src == upd for e in chosen)
        if ok:
            out.add(oid)
    return frozenset(out)


def _volume(box: Sequence[tuple[int, int]]) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


# --------------------------------------------------------------------------------------------
# Stage 2: a cluster's primitives on register blocks
# --------------------------------------------------------------------------------------------

def block_supported(graph: Graph, op_ids: Sequence[int]) -> str | None:
    """Why the ops cannot be re-bound on blocks (None when they can): only shape-agnostic ones."""
    for oid in op_ids:
        op = graph.ops[oid]
        if op.primitive not in _BLOCK_SAFE:
            return f"{op.primitive} inside the cluster is not elementwise"
        if op.primitive == "broadcast_in_dim" and graph.tensors[op.inputs[0]].shape != ():
            return "a non-scalar broadcast inside the cluster"
    return None


def block_fn(graph: Graph, op_ids: Sequence[int], inputs: Sequence[int],
             outputs: Sequence[int]) -> Callable[..., Any]:
    """``f(*input_blocks) -> output block(s)``: the ops re-bound on blocks (paper: stage 2 untouched).

    Elementwise primitives are shape-agnostic, and jax's binary primitives accept rank-0 operands,
    so a scalar broadcast stays a scalar and everything else binds as traced.
    """
    ops = [graph.ops[i] for i in op_ids]

    def f(*blocks: Any) -> Any:
        env: dict[int, Any] = dict(zip(inputs, blocks))
        for op in ops:
            vals = [env[t] if t in env else _const(graph, t) for t in op.inputs]
            if op.primitive == "broadcast_in_dim":
                out = vals[0]
            else:
                out = op.prim.bind(*vals, **op.params)
            env.update(zip(op.outputs, out if op.prim.multiple_results else (out,)))
        res = tuple(env[t] for t in outputs)
        return res if len(res) > 1 else res[0]

    return f


def _const(graph: Graph, t: int) -> Any:
    c = graph.tensors[t].const
    if c is None:
        raise KeyError(f"t{t} has no value")
    return c


# --------------------------------------------------------------------------------------------
# Runtime state of the emitted program
# --------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Run:
    """Values during one call of the emitted function (created per trace, never shared)."""
    graph: Graph
    strategy: Strategy
    env: dict[int, Any] = field(default_factory=dict)     # physical tensor -> current buffer
    vals: dict[int, Any] = field(default_factory=dict)    # XLA-computed values of virtual tensors

    def symbols(self, layout: Layout) -> tuple[tuple[str, Any], ...]:
        out = {}
        for p in layout.pieces:
            for s in p.map.syms:
                src = self.value(int(s.name.lstrip("s")))
                out[s.name] = jnp.clip(jnp.asarray(src, jnp.int32), s.lo, s.hi)
        return tuple(sorted(out.items()))

    def value(self, t: int) -> Any:
        info = self.graph.tensors[t]
        if info.const is not None:
            return info.const
        if t in self.vals:
            return self.vals[t]
        if not self.strategy.is_virtual(t):
            if t not in self.env:
                self._early(t)
            return self.env[t]
        v = _materialise(self.strategy.layout(t), info.dtype, self.env, dict(self.symbols(self.strategy.layout(t))))
        self.vals[t] = v
        return v

    def _early(self, t: int) -> None:
        """Compute a scalar index tensor (``pos`` glue) before its cluster's turn: a kernel's map
        may need it earlier than the cluster order reaches the glue that computes it."""
        op = self.graph.producer(t)
        if op is None or self.graph.tensors[t].size > 32:
            raise RuntimeError(f"t{t} is needed before it is computed")
        out = op.prim.bind(*(self.value(x) for x in op.inputs), **op.params)
        for x, v in zip(op.outputs, out if op.prim.multiple_results else (out,)):
            self.env[x] = v

    def vtensor(self, t: int) -> Any:
        """A kernel input: the physical array, or a VTensor over the current buffers."""
        info = self.graph.tensors[t]
        if info.const is not None:
            return jnp.asarray(info.const)
        if not self.strategy.is_virtual(t):
            return self.env[t]
        return self._as_vtensor(self.strategy.layout(t), info.dtype, fresh_ok=False)

    def out_vtensor(self, t: int) -> VTensor:
        """A kernel output: fresh physical, or a VTensor writing into (possibly fresh) buffers."""
        info = self.graph.tensors[t]
        if not self.strategy.is_virtual(t):
            return VTensor.fresh(info.shape, info.dtype)
        return self._as_vtensor(self.strategy.layout(t), info.dtype, fresh_ok=True)

    def _as_vtensor(self, layout: Layout, dtype: Any, fresh_ok: bool) -> VTensor:
        targets = layout.targets
        pos = {tid: i for i, tid in enumerate(targets)}
        pieces = tuple(Piece(pos[p.target], p.map, p.where) for p in layout.pieces)
        bufs = []
        for tid in targets:
            if tid in self.env:
                bufs.append(self.env[tid])
            elif self.graph.tensors[tid].const is not None:  # a read edge onto a literal/const
                bufs.append(jnp.asarray(self.graph.tensors[tid].const))
            elif fresh_ok:
                ti = self.graph.tensors[tid]
                bufs.append(jax.ShapeDtypeStruct(ti.shape, ti.dtype))
            else:
                raise RuntimeError(f"t{tid} is read before any kernel wrote it")
        return VTensor(dataclasses.replace(layout, pieces=pieces), dtype, tuple(bufs), self.symbols(layout))

    def written(self, t: int, out: VTensor, buffers: Sequence[Any]) -> None:
        """Record a kernel's result buffers as the current versions of their tensors."""
        if not self.strategy.is_virtual(t):
            self.env[t] = buffers[0]
            return
        for tid, b in zip(self.strategy.layout(t).targets, buffers):
            self.env[tid] = b

    def update_in_place(self, op: Op) -> None:
        """A dynamic_update_slice whose output *is* its operand's buffer (in-place edge chosen) but
        whose update was computed in XLA: write just the update into that buffer."""
        from .movement import rules
        out, upd = op.outputs[0], op.inputs[1]
        edge = next((e for e in rules(op, self.graph) if e.src == upd), None)
        if edge is None:  # no map for the update (e.g. starts it cannot express): whole result
            value = op.prim.bind(*(self.value(t) for t in op.inputs), **op.params)
            self.scatter(self.strategy.layout(out), value)
            return
        self.scatter(self.strategy.layout(out).compose(edge.map), self.value(upd))

    def scatter(self, lay: Layout, value: Any) -> None:
        syms = dict(self.symbols(lay))
        for p in lay.pieces:
            ti = self.graph.tensors[p.target]
            buf = self.env.get(p.target, jnp.zeros(ti.shape, ti.dtype))
            self.env[p.target] = _scatter(p, value, buf, syms)

    def store(self, t: int, value: Any) -> None:
        """An XLA-computed tensor: physical -> keep; virtual written through -> scatter it home."""
        if not self.strategy.is_virtual(t):
            self.env[t] = value
            return
        self.vals[t] = value
        if all(e.direction == "write" for e in self.strategy.points_to(t)):
            self.scatter(self.strategy.layout(t), value)


def _indices(shape: Sequence[int]) -> list[Any]:
    return [jax.lax.broadcasted_iota(jnp.int32, tuple(shape), k) for k in range(len(shape))]


def _materialise(layout: Layout, dtype: Any, env: Mapping[int, Any], syms: Mapping[str, Any]) -> Any:
    """Gather a virtual tensor into a physical array (the XLA fallback's stage 1).

    A layout that is its whole target unchanged (a cache updated in place, returned) is that
    buffer: no gather.
    """
    if len(layout.pieces) == 1:
        p = layout.pieces[0]
        if not p.where and p.map.is_identity and tuple(env[p.target].shape) == tuple(layout.shape):
            return env[p.target].astype(dtype)
    idx = _indices(layout.shape)
    out = jnp.full(layout.shape, layout.fill, dtype)
    for p in layout.pieces:
        tgt, valid = p.map.evaluate(idx, syms, xp=jnp)
        member = p.member(idx, jnp, syms)
        if valid is not None:
            member = member & valid
        buf = env[p.target]
        safe = tuple(jnp.clip(jnp.broadcast_to(x, layout.shape), 0, n - 1) for x, n in zip(tgt, buf.shape))
        got = buf[safe].astype(dtype) if buf.ndim else jnp.broadcast_to(buf, layout.shape).astype(dtype)
        out = got if member is True else jnp.where(member, got, out)
    return out


def _scatter(p: Piece, value: Any, buf: Any, syms: Mapping[str, Any]) -> Any:
    """Write a value's piece into its buffer (the XLA fallback's stage 3); other lanes dropped."""
    shape = value.shape
    idx = _indices(shape)
    tgt, valid = p.map.evaluate(idx, syms, xp=jnp)
    member = p.member(idx, jnp, syms)
    if valid is not None:
        member = member & valid
    tgt = tuple(jnp.where(member, jnp.broadcast_to(x, shape), n) for x, n in zip(tgt, buf.shape))
    return buf.at[tgt].set(value.astype(buf.dtype), mode="drop")


# --------------------------------------------------------------------------------------------
# Emission
# --------------------------------------------------------------------------------------------

Step = Callable[[_Run], None]


def _xla_step(graph: Graph, op_ids: Sequence[int]) -> Step:
    ops = [graph.ops[i] for i in op_ids]

    def step(run: _Run) -> None:
        for op in ops:
            if op.primitive == "dynamic_update_slice" and any(
                    e.inplace and e.op == op.id for e in run.strategy.points_to(op.outputs[0])):
                run.update_in_place(op)
                continue
            out = op.prim.bind(*(run.value(t) for t in op.inputs), **op.params)
            for t, v in zip(op.outputs, out if op.prim.multiple_results else (out,)):
                run.store(t, v)

    return step


def lower(graph: Graph, clusters: Sequence[Cluster], strategy: Strategy, *, backend: str = "interpret",
          templates: Mapping[str, Callable[..., Step | str]] | None = None) -> Lowered:
    """Build the emitted program. ``templates`` maps a cluster kind to a builder returning a step
    (or a string: why it cannot serve this cluster); default :data:`TEMPLATES`."""
    if templates is None:
        templates = TEMPLATES
    skip = eliminated_ops(graph, strategy)
    steps: list[Step] = []
    kernels: list[str] = []
    fallbacks: list[str] = []
    for c in clusters:
        if c.kind == "movement" and all(o in skip for o in c.ops):
            continue
        touches = any(strategy.is_virtual(t) for t in (*c.inputs, *c.outputs))
        if touches and c.kind in templates:
            built = templates[c.kind](graph, c, backend=backend)
            if not isinstance(built, str):
                steps.append(built)
                kernels.append(f"{c.kind} cluster #{c.id} ({', '.join(graph.ops[o].primitive for o in c.ops[:4])}"
                               f"{', ...' if len(c.ops) > 4 else ''})")
                continue
            fallbacks.append(f"{c.kind} cluster #{c.id}: {built}")
        elif touches and c.kind not in ("movement", "glue"):
            fallbacks.append(f"{c.kind} cluster #{c.id}: no kernel template reads virtual tensors for it")
        steps.append(_xla_step(graph, c.ops))

    def fn(*flat: Any) -> tuple[Any, ...]:
        run = _Run(graph, strategy)
        run.env.update(zip(graph.inputs, flat))
        for step in steps:
            step(run)
        return tuple(run.value(t) for t in graph.outputs)

    return Lowered(fn, tuple(kernels), tuple(sorted(skip)), tuple(fallbacks))


# --------------------------------------------------------------------------------------------
# Cluster -> template adapters (each returns a Step, or a string saying why it cannot)
# --------------------------------------------------------------------------------------------

def _broadcast(x: Any, shape: tuple[int, ...]) -> Any:
    """Numpy-rule broadcast of a kernel input to ``shape`` — through its layout, never a copy."""
    if not isinstance(x, VTensor) or tuple(x.shape) == shape:
        return x
    lay = x.layout
    if len(lay.shape) < len(shape):
        lay = lay.reshape((1,) * (len(shape) - len(lay.shape)) + tuple(lay.shape))
    return VTensor(lay.broadcast(shape, tuple(range(len(shape)))), x.dtype, x.buffers, x.symbols)


def _buffers(res: Any) -> tuple[Any, ...]:
    return tuple(res) if isinstance(res, (tuple, list)) else (res,)


def _contraction_template(graph: Graph, c: Cluster, primitive: str,
                          call: Callable[..., Any]) -> Step | str:
    """A contraction (dot_general or conv) plus its elementwise epilogue as one kernel.

    ``call(lhs, rhs, params, out=, epilogue=, epilogue_args=)`` runs the template; the epilogue is
    the cluster's other primitives re-bound on the accumulator tile (``block_fn``).
    """
    found = [o for o in c.ops if graph.ops[o].primitive == primitive]
    if len(found) != 1 or len(c.outputs) != 1:
        return f"needs exactly one {primitive} and one output"
    op = graph.ops[found[0]]
    rest = [o for o in c.ops if o != op.id]
    why = block_supported(graph, rest)
    if why:
        return why
    lhs, rhs = op.inputs
    o = c.outputs[0]
    extras = [t for t in c.inputs if t not in (lhs, rhs) and graph.tensors[t].const is None]
    epi = block_fn(graph, rest, [op.outputs[0], *extras], [o]) if rest else None
    shape = tuple(graph.tensors[o].shape)

    def step(run: _Run) -> None:
        out = run.out_vtensor(o)
        res = call(run.vtensor(lhs), run.vtensor(rhs), op.params, out=out, epilogue=epi,
                   epilogue_args=[_broadcast(run.vtensor(t), shape) for t in extras])
        run.written(o, out, _buffers(res))

    return step


def _matmul_template(graph: Graph, c: Cluster, *, backend: str) -> Step | str:
    from .kernels.matmul import matmul

    def call(a: Any, b: Any, p: Mapping[str, Any], **kw: Any) -> Any:
        return matmul(a, b, dimension_numbers=p["dimension_numbers"],
                      preferred_element_type=p.get("preferred_element_type"), backend=backend, **kw)

    return _contraction_template(graph, c, "dot_general", call)


def _conv_template(graph: Graph, c: Cluster, *, backend: str) -> Step | str:
    from .kernels.conv import conv

    def call(x: Any, w: Any, p: Mapping[str, Any], **kw: Any) -> Any:
        if p.get("batch_group_count", 1) != 1:
            raise NotImplementedError("batch_group_count != 1")
        return conv(x, w, window_strides=p["window_strides"], padding=p["padding"],
                    lhs_dilation=p.get("lhs_dilation"), rhs_dilation=p.get("rhs_dilation"),
                    dimension_numbers=p["dimension_numbers"], feature_group_count=p["feature_group_count"],
                    preferred_element_type=p.get("preferred_element_type"), backend=backend, **kw)

    if any(graph.ops[o].params.get("batch_group_count", 1) != 1 for o in c.ops
           if graph.ops[o].primitive == "conv_general_dilated"):
        return "batch_group_count != 1"
    return _contraction_template(graph, c, "conv_general_dilated", call)


def _pointwise_template(graph: Graph, c: Cluster, *, backend: str) -> Step | str:
    from .kernels.pointwise import pointwise
    why = block_supported(graph, c.ops)
    if why:
        return why
    shapes = {tuple(graph.tensors[o].shape) for o in c.outputs}
    if len(shapes) != 1:
        return "outputs of different shapes"
    shape = shapes.pop()
    ins = [t for t in c.inputs if graph.tensors[t].const is None]
    fn = block_fn(graph, c.ops, ins, c.outputs)

    def step(run: _Run) -> None:
        outs = [run.out_vtensor(o) for o in c.outputs]
        res = pointwise(fn, [_broadcast(run.vtensor(t), shape) for t in ins], out_shape=shape,
                        outs=outs, backend=backend)
        res = (res,) if len(outs) == 1 else res
        for o, v, r in zip(c.outputs, outs, res):
            run.written(o, v, _buffers(r))

    return step


_SOFTMAX_OPS = frozenset({"reduce_max", "max", "stop_gradient", "sub", "exp", "reduce_sum", "div",
                          "broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims"})


@dataclass(frozen=True)
class _AttnMatch:
    q: int
    k: int
    v: int
    out: int
    q_dims: tuple[tuple[int, ...], ...]   # q: (batch dims, free dims, contract dims)
    k_dims: tuple[tuple[int, ...], ...]   # k: (batch dims, free (T) dims, contract dims)
    v_dims: tuple[tuple[int, ...], ...]   # v: (batch dims, contract (T) dims, free dims)
    scale: float
    soft_cap: float | None
    pos: int | None                       # scalar tensor: keys t <= pos valid
    kv_len: int | None                    # scalar tensor: keys t < kv_len valid
    window: int | None = None             # static: keys t > pos - window valid too


def _match_attention(graph: Graph, c: Cluster) -> _AttnMatch | str:
    """Read the decode-attention parameters off the cluster's primitives (or say what differs)."""
    ops = [graph.ops[i] for i in c.ops]
    dots = [op for op in ops if op.primitive == "dot_general"]
    if len(dots) != 2 or len(c.outputs) != 1:
        return "expected two dot_generals and one output"
    d1, d2 = dots
    s = d1.outputs[0]
    scale, cap, pos, kv_len, window = 1.0, None, None, None, None
    producers = {t: op for op in ops for t in op.outputs}
    # walk forward from s over the score modifiers until the softmax starts
    cur = s
    users = lambda t: [op for op in ops if t in op.inputs]
    while True:
        us = users(cur)
        if len(us) != 1:
            break
        u = us[0]
        other = [t for t in u.inputs if t != cur]
        if u.primitive in ("mul", "div") and other and _scalar(graph, other[0]) is not None \
                and not (u.primitive == "div" and users(u.outputs[0]) and users(u.outputs[0])[0].primitive == "tanh"):
            val = _scalar(graph, other[0])
            scale = scale * val if u.primitive == "mul" else scale / val
        elif u.primitive == "div" and other and _scalar(graph, other[0]) is not None:
            capv = _scalar(graph, other[0])
            t1 = users(u.outputs[0])[0]
            t2 = users(t1.outputs[0])
            if not t2 or t2[0].primitive != "mul" or _scalar(graph, [t for t in t2[0].inputs if t != t1.outputs[0]][0]) != capv:
                return "unrecognised tanh soft-cap"
            cap = capv
            u = t2[0]
        elif u.primitive in ("convert_element_type", "reshape", "squeeze", "expand_dims") or (
                u.primitive == "broadcast_in_dim"
                and graph.tensors[u.outputs[0]].size == graph.tensors[cur].size):
            pass  # dtype or view changes of the scores: nothing to do in the kernel
        elif u.primitive == "select_n":
            pred, on_false, on_true = u.inputs
            if on_true != cur or _scalar_const_of(graph, on_false) != -np.inf:
                return "select_n is not a -inf mask of the scores"
            found = _mask_bounds(graph, pred)
            if isinstance(found, str):
                return found
            pos, kv_len, window = found
        else:
            break
        cur = u.outputs[0]
    if not any(op.primitive == "reduce_max" for op in users(cur)):
        return f"scores feed {[op.primitive for op in users(cur)]}, not a softmax"
    start = producers[cur].id if cur in producers else d1.id
    for op in ops:
        if start < op.id < d2.id and op.primitive not in _SOFTMAX_OPS:
            return f"{op.primitive} between the softmax and the second dot"
    after = [op for op in ops if op.id > d2.id]
    if any(op.primitive != "convert_element_type" for op in after):
        return "ops after the second dot other than a dtype conversion"
    (c1l, c1r), (b1l, b1r) = d1.params["dimension_numbers"]
    (c2l, c2r), (b2l, b2r) = d2.params["dimension_numbers"]
    q, k = d1.inputs
    p, v = d2.inputs
    free = lambda t, cs, bs: tuple(i for i in range(len(graph.tensors[t].shape)) if i not in cs and i not in bs)
    qf, kf, vf = free(q, c1l, b1l), free(k, c1r, b1r), free(v, c2r, b2r)
    if len(kf) != 1 or len(c2r) != 1 or len(c1l) != 1 or len(vf) != 1:
        return "attention with several key / head-dim axes"
    return _AttnMatch(q, k, v, c.outputs[0], (tuple(b1l), qf, tuple(c1l)), (tuple(b1r), kf, tuple(c1r)),
                      (tuple(b2r), tuple(c2r), vf), scale, cap, pos, kv_len, window)


def _scalar(graph: Graph, t: int) -> float | None:
    c = graph.tensors[t].const
    if c is None or np.size(c) != 1:
        return None
    return float(np.asarray(c).reshape(()))


def _scalar_const_of(graph: Graph, t: int) -> float | None:
    """The value of a (broadcast, converted) scalar constant."""
    while True:
        v = _scalar(graph, t)
        if v is not None:
            return v
        op = graph.producer(t)
        if op is None or op.primitive not in ("broadcast_in_dim", "convert_element_type", "reshape"):
            return None
        t = op.inputs[0]


def _mask_bounds(graph: Graph, pred: int) -> tuple[int | None, int | None, int | None] | str:
    """``(pos, kv_len, window)`` of a causal mask, optionally ``&`` a sliding window
    ``iota > pos - window`` (Gemma-2's local layers)."""
    t = pred
    while (op := graph.producer(t)) is not None and op.primitive in ("broadcast_in_dim", "reshape"):
        t = op.inputs[0]
    if op is not None and op.primitive == "and":
        parts = [_mask_bound(graph, x) for x in op.inputs]
        ends = [p for p in parts if not isinstance(p, str) and p[0] in ("pos", "kv_len")]
        starts = [p for p in parts if not isinstance(p, str) and p[0] == "after"]
        if len(ends) != 1 or len(starts) != 1:
            return "mask is not a causal bound and a sliding window"
        kind, end = ends[0]
        window = _window(graph, starts[0][1], end, kind)
        if window is None:
            return "sliding window start is not `pos - constant`"
        return (end, None, window) if kind == "pos" else (None, end, window)
    found = _mask_bound(graph, pred)
    if isinstance(found, str):
        return found
    kind, end = found
    if kind == "after":
        return "mask keeps keys after a position (not causal)"
    return (end, None, None) if kind == "pos" else (None, end, None)


def _window(graph: Graph, start: int, end: int, kind: str) -> int | None:
    """``start == end - w`` (keys ``t > pos - w``): the window ``w`` the template expects."""
    op = graph.producer(start)
    if op is None or op.primitive not in ("sub", "add") or op.inputs[0] != end:
        return None
    c = _scalar(graph, op.inputs[1])
    if c is None:
        return None
    w = int(c) if op.primitive == "sub" else -int(c)
    return w if kind == "pos" else None


def _mask_bound(graph: Graph, pred: int) -> tuple[str, int] | str:
    """``iota <= pos`` (or ``iota < kv_len``) behind broadcasts: which bound, and its scalar tensor."""
    t = pred
    while (op := graph.producer(t)) is not None and op.primitive in ("broadcast_in_dim", "reshape"):
        t = op.inputs[0]
    if op is None or op.primitive not in ("le", "lt", "ge", "gt"):
        return "mask is not a comparison of key positions with a scalar"
    a, b = op.inputs
    prim = op.primitive
    if graph.producer(b) is not None and graph.producer(b).primitive == "iota":
        a, b = b, a
        prim = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}[prim]
    if graph.producer(a) is None or graph.producer(a).primitive != "iota" or graph.tensors[b].shape != ():
        return "mask is not a comparison of key positions with a scalar"
    if prim == "le":
        return ("pos", b)
    if prim == "lt":
        return ("kv_len", b)
    if prim == "gt":
        return ("after", b)
    return "mask keeps keys from a position on (ge): not a supported window form"


def _canonical(x: Any, dims: tuple[tuple[int, ...], ...]) -> VTensor:
    """View an operand as (batch..., then the dims in ``dims`` order) by transposing its layout."""
    x = VTensor.of(x)
    perm = tuple(d for group in dims for d in group)
    return VTensor(x.layout.transpose(perm), x.dtype, x.buffers, x.symbols)


def _group_size(k: VTensor, heads: int) -> int:
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


def _attention_template(graph: Graph, c: Cluster, *, backend: str) -> Step | str:
    from .kernels.attention import decode_attention
    m = _match_attention(graph, c)
    if isinstance(m, str):
        return m
    qs, ks = graph.tensors[m.q].shape, graph.tensors[m.k].shape
    if not 1 <= len(m.q_dims[0]) <= 2 or int(np.prod([qs[i] for i in m.q_dims[1]])) != 1:
        return "not a single-query (decode) attention with (batch, head) or (head) batch dims"
    H = ks[m.k_dims[0][-1]]                      # the last batch dim is the head axis
    B = int(np.prod([ks[i] for i in m.k_dims[0]])) // H
    T, D = ks[m.k_dims[1][0]], ks[m.k_dims[2][0]]
    Dv = graph.tensors[m.v].shape[m.v_dims[2][0]]

    def view(x: VTensor, shape: tuple[int, ...]) -> VTensor:
        return VTensor(x.layout.reshape(shape), x.dtype, x.buffers, x.symbols)

    def step(run: _Run) -> None:
        q = view(_canonical(run.vtensor(m.q), m.q_dims), (B, H, 1, D))
        k = view(_canonical(run.vtensor(m.k), m.k_dims), (B, H, T, D))
        v = view(_canonical(run.vtensor(m.v), m.v_dims), (B, H, T, Dv))
        g = min(_group_size(k, H), _group_size(v, H))
        hk = H // g

        def per_group(x: VTensor) -> VTensor:
            lay = x.layout.reshape((B, hk, g) + tuple(x.shape[2:])).slice(
                (0,) * 5, (B, hk, 1) + tuple(x.shape[2:])).reshape((B, hk) + tuple(x.shape[2:]))
            return VTensor(lay, x.dtype, x.buffers, x.symbols)

        qg = view(q, (B, hk, g, D))
        out = run.out_vtensor(m.out)
        og = view(out, (B, hk, g, Dv))
        kw = {}
        if m.pos is not None:
            kw["pos"] = jnp.asarray(run.value(m.pos), jnp.int32)
        if m.kv_len is not None:
            kw["kv_len"] = jnp.asarray(run.value(m.kv_len), jnp.int32)
        if m.window is not None:
            kw["window"] = m.window
        res = decode_attention(qg, per_group(k), per_group(v), sm_scale=m.scale, soft_cap=m.soft_cap,
                               out=og, backend=backend, **kw)
        run.written(m.out, out, _buffers(res))

    return step


TEMPLATES: Mapping[str, Callable[..., Step | str]] = {
    "conv": _conv_template,
    "matmul": _matmul_template,
    "pointwise": _pointwise_template,
    "attention": _attention_template,
}
