"""Stage 6: re-emit the program from the Graph, the templates' matches and the Strategy.

Walking the clusters in order, each one becomes one of:

* nothing — a movement op the strategy eliminated (``Resolution.eliminated``);
* a Pallas kernel — a matched compute cluster that reads or writes a virtual tensor; the
  template (``templates``) builds it from the match stored at analysis time;
* the original primitives, re-bound — everything else is left to XLA, exactly as traced.

Physical tensors live in ``env`` as their *current version*: a buffer written piecewise by several
kernels (the KV cache at ``pos``, a concat buffer) is created by its first writer (uninitialised
elsewhere) and threaded through later writers with ``input_output_aliases``. Cluster order is a
topological order, so every reader comes after all writers of what it reads; the VTOG's legality
check already removed in-place edges whose old contents are read later.

The XLA boundary is written with the program's own primitives. Templates are matched before the
strategy, so only movement ops XLA still runs can meet a virtual tensor: such a tensor is
recomputed from the original movement chain (``reshape``/``transpose``/``slice``... re-bound, which
XLA fuses) or read as a strided window (``dynamic_slice`` + ``transpose`` + ``broadcast``); an
in-place update re-binds the original ``dynamic_update_slice`` on the operand's buffer. An
element-wise gather/scatter is the last resort and is listed in ``Lowered.gathers``.

A kernel step that raises while its kernel is built or traced raises
:class:`templates.KernelBuildError` naming the cluster: ``optimize`` then re-plans with that
cluster rejected (it runs in XLA, its tensors physical) — the per-cluster fallback.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Literal

from .cluster import Cluster
from .graph import Graph, Op
from .indexmap import Layout, Piece, point
from .kernels.vio import Update, VTensor
from .movement import TABLE_LIMIT, rules
from .primitives import CALL_LIKE, KERNEL_CALLS, Direction, Kind, Role, inplace_operand, role_of
from .strategy import Resolution, Strategy
from .templates import TEMPLATES, KernelBuildError, Match, Reject, Step
from .testing import cross_lower

EARLY_LIMIT = 32   # elements of a scalar index tensor (``pos`` glue) computed before its cluster's turn

__all__ = ["lower", "Lowered"]


@dataclass(frozen=True, eq=False)
class Lowered:
    """The re-emitted program: ``fn(*flat_inputs) -> flat outputs`` plus what it is made of."""
    fn: Callable[..., tuple[Any, ...]]
    kernels: tuple[str, ...]          # one line per Pallas kernel: "matmul cluster #3 (dot_general, ...)"
    skipped: tuple[int, ...]          # movement op ids nobody executes
    fallbacks: tuple[str, ...] = ()   # matched clusters touching virtual tensors left to XLA (should be none)
    gathers: list[str] = field(default_factory=list)  # virtual tensors XLA read element-wise (filled when traced)


# --------------------------------------------------------------------------------------------
# Runtime state of the emitted program
# --------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Run:
    """Values during one call of the emitted function (created per trace, never shared)."""
    graph: Graph
    strategy: Strategy
    gathers: list[str]
    env: dict[int, Any] = field(default_factory=dict)     # physical tensor -> current buffer
    vals: dict[int, Any] = field(default_factory=dict)    # XLA-computed values of virtual tensors
    fresh: dict[int, Any] = field(default_factory=dict)   # unallocated buffers handed to kernels
    # in-place row updates left to the kernel that reads their buffer next (:func:`deferred_updates`):
    # the buffer's tensor -> (the update op, the cluster that performs it)
    pending: dict[int, tuple[Op, int]] = field(default_factory=dict)

    @property
    def res(self) -> Resolution:
        assert self.strategy.resolution is not None, "lower needs a planned strategy (strategy.plan)"
        return self.strategy.resolution

    def layout(self, t: int) -> Layout:
        return self.res.layouts[t]

    def is_virtual(self, t: int) -> bool:
        return t in self.res.layouts

    def symbols(self, layout: Layout, *, in_kernel: bool = False) -> tuple[tuple[str, Any], ...]:
        """The layout's runtime symbols, clamped to their ranges as lax clamps dynamic starts.
        ``in_kernel``: for a kernel operand, unclamped — the kernel clamps them itself
        (``vio.Plan.sym_ranges``), so XLA needs no launch for the clamp of a ``pos`` input (a
        ``loop_minimum_fusion`` of one scalar before the first kernel)."""
        out = {}
        for p in layout.pieces:
            for s in p.map.syms:
                v = jnp.asarray(self.value(s.source, early=TABLE_LIMIT if s.is_table else EARLY_LIMIT), jnp.int32)
                out[s.name] = v if s.is_table or in_kernel else s.normalise(v, jnp)   # a table: each read clamps
        return tuple(sorted(out.items()))

    def value(self, t: int, early: int = 0) -> Any:
        """``t``'s value now; ``early``: a physical tensor not computed yet of at most this many
        elements is computed here from its producer (:meth:`_early`)."""
        info = self.graph.tensors[t]
        if info.const is not None:
            return info.const
        if t in self.vals:
            return self.vals[t]
        if not self.is_virtual(t):
            if t not in self.env:
                self._early(t, early)
            return self.env[t]
        v = self._by_ops(t)
        if v is None:
            self.gathers.append(f"t{t} {info.shape}")
            lay = self.layout(t)
            v = _gather(lay, info.dtype, self.env, dict(self.symbols(lay)))
        self.vals[t] = v
        return v

    def _early(self, t: int, limit: int) -> None:
        """Compute an index tensor before its cluster's turn: a kernel's map may need a scalar
        (``pos`` glue, up to ``EARLY_LIMIT`` elements) or an index table computed from input tables
        (``movement._computed_table``: up to ``TABLE_LIMIT``, its computation read-only on inputs)
        earlier than the cluster order reaches the glue that computes it."""
        op = self.graph.producer(t)
        if op is None or self.graph.tensors[t].size > max(limit, EARLY_LIMIT):
            raise RuntimeError(f"t{t} is needed before it is computed")
        out = op.bind(*(self.value(x, limit) for x in op.inputs))
        for x, v in zip(op.outputs, out if op.prim.multiple_results else (out,)):
            self.env[x] = v

    def _by_ops(self, t: int) -> Any:
        """A virtual tensor's value for XLA, written with ordinary ops (None: not expressible).

        Read through its producer's map: re-bind the producer (the original movement op) on its
        inputs' values (not for an in-place update's output: that *is* the updated buffer). Otherwise (written through a map into another buffer): a strided window
        of that buffer, when the layout is one unit-strided piece."""
        g = self.graph
        edges = self.strategy.points_to(t)
        op = g.producer(t)
        if op is not None and role_of(op, g) is Role.MOVEMENT and edges and all(
                e.direction == Direction.READ and e.op == op.id and not e.inplace for e in edges):
            out = op.bind(*(self.value(x) for x in op.inputs))
            outs = out if op.prim.multiple_results else (out,)
            for x, v in zip(op.outputs, outs):
                if x == t or self.is_virtual(x):
                    self.vals.setdefault(x, v)
            return self.vals[t]
        return _window(self.layout(t), g.tensors[t].dtype, self.env, dict(self.symbols(self.layout(t))))

    def vtensor(self, t: int) -> Any:
        """A kernel input: the physical array, or a VTensor over the current buffers."""
        info = self.graph.tensors[t]
        if info.const is not None:
            return jnp.asarray(info.const)
        if not self.is_virtual(t):
            return self.env[t]
        return self._as_vtensor(self.layout(t), info.dtype, fresh_ok=False)

    def out_vtensor(self, t: int) -> VTensor:
        """A kernel output: fresh physical, or a VTensor writing into (possibly fresh) buffers."""
        info = self.graph.tensors[t]
        if not self.is_virtual(t):
            return VTensor.fresh(info.shape, info.dtype)
        return self._as_vtensor(self.layout(t), info.dtype, fresh_ok=True)

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
            elif fresh_ok:   # one object per unwritten buffer: a kernel's outputs sharing it share a slot
                ti = self.graph.tensors[tid]
                bufs.append(self.fresh.setdefault(tid, jax.ShapeDtypeStruct(ti.shape, ti.dtype)))
            else:
                raise RuntimeError(f"t{tid} is read before any kernel wrote it")
        return VTensor(dataclasses.replace(layout, pieces=pieces), dtype, tuple(bufs),
                       self.symbols(layout, in_kernel=True))

    def _layout_of(self, t: int) -> Layout:
        info = self.graph.tensors[t]
        return self.layout(t) if self.is_virtual(t) else Layout.physical(t, info.shape)

    def concat(self, ts: Sequence[int], axis: int, *, out: bool = False) -> VTensor:
        """The tensors ``ts`` side by side along ``axis`` as one kernel operand (``out``: one
        output, each part written where its tensor goes): their layouts concatenated, a view."""
        lay = Layout.concatenate([self._layout_of(t) for t in ts], axis)
        return self._as_vtensor(lay, self.graph.tensors[ts[0]].dtype, fresh_ok=out)

    def written_concat(self, ts: Sequence[int], axis: int, buffers: Sequence[Any]) -> None:
        """Record the buffers a kernel wrote through :meth:`concat` ``(ts, axis, out=True)``."""
        for tid, b in zip(Layout.concatenate([self._layout_of(t) for t in ts], axis).targets, buffers):
            self.env[tid] = b

    def written(self, t: int, out: VTensor, buffers: Sequence[Any]) -> None:
        """Record a kernel's result buffers as the current versions of their tensors."""
        if not self.is_virtual(t):
            self.env[t] = buffers[0]
            return
        for tid, b in zip(self.layout(t).targets, buffers):
            self.env[tid] = b

    def update_in_place(self, op: Op) -> None:
        """An update whose output *is* its operand's buffer (in-place edge chosen) but whose update
        was computed in XLA: the original op re-bound on that buffer (XLA updates it in place)."""
        out = op.outputs[0]
        lay = self.layout(out)
        k = inplace_operand(op.primitive)
        p = lay.pieces[0] if len(lay.pieces) == 1 else None
        if k is not None and p is not None and not p.where and p.map.is_identity and not lay.fills:
            args = [self.env.get(p.target) if i == k else self.value(x) for i, x in enumerate(op.inputs)]
            if args[k] is not None:
                self.env[p.target] = op.bind(*args)
                return
        value = op.bind(*(self.value(x) for x in op.inputs))
        self.scatter(out, lay, value)

    def defer(self, op: Op, cluster: int) -> None:
        """Leave an update to ``cluster``'s kernel (which reads its buffer next). Its buffer is the
        operand's, updated in place (a physical output holds the operand's buffer until then)."""
        home = _update_home(op, self.res)
        if home == op.outputs[0]:
            self.env[home] = self.value(op.inputs[0])
        self.pending[home] = (op, cluster)

    def pending_for(self, cluster: int) -> tuple[int, ...]:
        """The buffers whose pending updates ``cluster``'s kernel is to perform."""
        return tuple(h for h, (_, c) in self.pending.items() if c == cluster)

    def landed(self, home: int, buffer: Any) -> None:
        """The kernel performed the pending update: ``buffer`` is the updated one."""
        del self.pending[home]
        self.env[home] = buffer

    def flush(self, home: int) -> None:
        """Perform a pending update here, in XLA, as it would have run (its kernel does not)."""
        op, _ = self.pending.pop(home)
        if op.id in self.res.inplace:
            self.update_in_place(op)
        else:
            self.env[home] = op.bind(*(self.value(x) for x in op.inputs))

    def take_update(self, home: int) -> Update:
        """A pending update as its kernel performs it: the rows and their write map onto the
        buffer (the scatter's write edge; the update's output is the buffer itself). It stays
        pending until the kernel hands the buffer back (:meth:`landed`) or it is flushed."""
        op, _ = self.pending[home]
        upd = op.inputs[2]
        e = _row_write(op, self.graph)
        assert e is not None, "deferred_updates takes only updates with a row write map"
        info = self.graph.tensors[upd]
        # the output is the buffer itself (identity layout): the write map lands on it directly
        lay = Layout(info.shape, (Piece(home, e.map, ()),), ())
        return Update(jnp.asarray(self.value(upd)), self._as_vtensor(lay, info.dtype, fresh_ok=False))

    def scatter(self, t: int, lay: Layout, value: Any) -> None:
        self.gathers.append(f"t{t} {tuple(value.shape)} (scattered)")
        syms = dict(self.symbols(lay))
        for p in lay.pieces:
            ti = self.graph.tensors[p.target]
            buf = self.env.get(p.target, jnp.zeros(ti.shape, ti.dtype))
            self.env[p.target] = _scatter(p, value, buf, syms)

    def store(self, t: int, value: Any) -> None:
        """An XLA-computed tensor: physical -> keep; written through maps -> write it home with
        the original ops (the consumer movement op re-bound, or a ``dynamic_update_slice`` of a
        slab), element-wise scatter only as the last resort."""
        if not self.is_virtual(t):
            self.env[t] = value
            return
        self.vals[t] = value
        edges = self.strategy.points_to(t)
        if not all(e.direction == Direction.WRITE for e in edges):
            return   # read through a map from data that exists elsewhere: nothing to write
        for e in edges:
            if not self._store_edge(t, e, value):
                lay = Layout.assemble(self.graph.tensors[t].shape, [(self._home(e.dst), e.map, e.box)])
                self.scatter(t, lay, value)

    def _store_window(self, lay: Layout, value: Any) -> bool:
        """Write ``value`` into its buffer with ``dynamic_update_slice`` when the layout is one
        unit-strided piece that keeps the dims in order (a concat slab, a cache row)."""
        win = _unit_window(lay)
        if win is None:
            return False
        p, sb = win
        mapped = [j for j, _, _ in sb if j is not None]
        if mapped != sorted(mapped) or any(n != 1 for j, n in enumerate(lay.shape) if j not in mapped):
            return False   # dims must keep their order; a virtual dim with no home must be size 1
        starts = _window_starts(sb, dict(self.symbols(lay)))
        shape = [lay.shape[j] if j is not None else 1 for j, _, _ in sb]
        ti = self.graph.tensors[p.target]
        buf = self.env.get(p.target, jnp.zeros(ti.shape, ti.dtype))
        self.env[p.target] = lax.dynamic_update_slice(buf, value.astype(buf.dtype).reshape(shape), starts)
        return True

    def _home(self, t: int) -> Layout:
        return self.layout(t) if self.is_virtual(t) else Layout.physical(t, self.graph.tensors[t].shape)

    def _store_edge(self, t: int, e: Any, value: Any) -> bool:
        g = self.graph
        op = g.ops[e.op]
        whole = tuple((0, n) for n in g.tensors[t].shape)
        if tuple(e.box) == whole and op.outputs == (e.dst,) and [x for x in op.inputs if g.tensors[x].const is None] == [t]:
            # a one-to-one op (reshape, transpose, ...): its output is the op applied to t
            out = op.bind(*(value if x == t else self.value(x) for x in op.inputs))
            # (a one-piece split, as jax.hessian / jacrev emit, returns its one output in a list)
            self.store(e.dst, out[0] if isinstance(out, (list, tuple)) else out)
            return True
        # a slab or a row of its home (through the home's own layout when that is virtual, e.g. a
        # cache updated in place): a dynamic_update_slice when the composed layout is a window
        lay = Layout.assemble(g.tensors[t].shape, [(self._home(e.dst), e.map, e.box)])
        return self._store_window(lay, value)

def _indices(shape: Sequence[int]) -> list[Any]:
    return [lax.broadcasted_iota(jnp.int32, tuple(shape), k) for k in range(len(shape))]


def _unit_window(layout: Layout) -> tuple[Piece, tuple[Any, ...]] | None:
    """``(piece, strided box)`` when the layout is one unconditional piece whose map is a strided
    box with unit strides: XLA reads or writes it as a window (``dynamic_slice`` /
    ``dynamic_update_slice``) instead of element-wise."""
    if len(layout.pieces) != 1 or layout.fills or layout.pieces[0].where:
        return None
    p = layout.pieces[0]
    sb = p.map.strided_box()
    if sb is None or any(j is not None and k != 1 for j, k, _ in sb):
        return None
    return p, sb


def _window_starts(sb: Sequence[Any], syms: Mapping[str, Any]) -> list[Any]:
    """The window's first index per target dim: the strided box's offsets (expressions over the
    runtime symbols) evaluated with jax.numpy."""
    at = point((), syms)
    return [jnp.asarray(off.evaluate(at, jnp), jnp.int32) for _, _, off in sb]


def _window(layout: Layout, dtype: Any, env: Mapping[int, Any], syms: Mapping[str, Any]) -> Any:
    """A one-piece, unit-strided layout read with ``dynamic_slice`` + ``transpose`` + broadcast
    (None when the layout is not of that form)."""
    win = _unit_window(layout)
    if win is None or win[0].target not in env:
        return None
    p, sb = win
    buf = env[p.target]
    if p.map.is_identity and tuple(buf.shape) == tuple(layout.shape):
        return buf.astype(dtype)
    starts = _window_starts(sb, syms)
    sizes = [layout.shape[j] if j is not None else 1 for j, _, _ in sb]
    x = lax.dynamic_slice(buf, starts, sizes)
    mapped = [j for j, _, _ in sb if j is not None]
    x = x.reshape([layout.shape[j] for j in mapped])              # drop unmapped (size-1) dims
    order = sorted(range(len(mapped)), key=lambda i: mapped[i])
    x = jnp.transpose(x, order) if order != list(range(len(mapped))) else x
    kept = sorted(mapped)
    x = lax.broadcast_in_dim(x, tuple(layout.shape), tuple(kept))   # dims with no home repeat
    return x.astype(dtype)


def _gather(layout: Layout, dtype: Any, env: Mapping[int, Any], syms: Mapping[str, Any]) -> Any:
    """Element-wise gather of a virtual tensor (the last resort; ``Lowered.gathers`` lists it):
    the layout's own evaluator, run with jax.numpy on the tensor's index grid."""
    return layout.gather(point(_indices(layout.shape), syms), env, dtype, jnp)


def _scatter(p: Piece, value: Any, buf: Any, syms: Mapping[str, Any]) -> Any:
    """Write a value's piece into its buffer element-wise (the last resort); other lanes dropped."""
    shape = value.shape
    at = point(_indices(shape), syms)
    tgt, m = p.map.targets(at, jnp), p.holds(at, jnp)
    m = True if m is None else m
    tgt = tuple(jnp.where(m, jnp.broadcast_to(x, shape), n) for x, n in zip(tgt, buf.shape))
    return buf.at[tgt].set(value.astype(buf.dtype), mode="drop")


# --------------------------------------------------------------------------------------------
# Emission
# --------------------------------------------------------------------------------------------

def _xla_step(graph: Graph, op_ids: Sequence[int], rewrite: Callable[[Op], Any] | None = None,
              deferred: Mapping[int, int] | None = None) -> Step:
    ops = [graph.ops[i] for i in op_ids]
    impls: dict[int, Any] = {}
    deferred = deferred or {}

    def step(run: _Run) -> None:
        for op in ops:
            if op.id in deferred:
                run.defer(op, deferred[op.id])
                continue
            if op.id in run.res.inplace:
                run.update_in_place(op)
                continue
            if op.id not in impls:   # control flow: its body optimised on its own (once per trace)
                impls[op.id] = rewrite(op) if rewrite is not None and op.opaque_reason else None
            vals = [run.value(t) for t in op.inputs]
            out = impls[op.id](*vals) if impls[op.id] is not None else op.bind(*vals)
            for t, v in zip(op.outputs, out if op.prim.multiple_results else (out,)):
                run.store(t, v)

    return step


def _kernel_step(graph: Graph, c: Cluster, m: Match, backend: str) -> Step:
    """The template's step, with any failure while building or tracing it named by cluster."""
    prims = [graph.ops[o].primitive for o in c.ops]
    try:
        inner = TEMPLATES[m.kind].build(graph, c, m.detail, backend)
    except Exception as exc:  # noqa: BLE001 - becomes the per-cluster fallback
        raise KernelBuildError(c.id, c.kind, prims, exc) from exc

    def step(run: _Run) -> None:
        try:
            with jax.named_scope(f"vtc_cluster_{c.id}"):
                inner(run)
            if run.pending_for(c.id):   # read without the update: never a wrong number
                raise RuntimeError(f"the kernel left pending updates of t{list(run.pending_for(c.id))}")
        except KernelBuildError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise KernelBuildError(c.id, c.kind, prims, exc) from exc

    return step


def _update_home(op: Op, res: Resolution) -> int | None:
    """The buffer a scatter XLA would run updates: its operand's, when its output is that buffer
    (the in-place edge chosen: an identity layout onto it), or its own physical output (XLA's
    buffer assignment updates a donated operand in place, else copies it first); None when its
    output or operand is virtual in another way."""
    y = op.outputs[0]
    lay = res.layouts.get(y)
    if op.id in res.inplace:
        ok = lay is not None and len(lay.pieces) == 1 and not lay.fills and not lay.pieces[0].where \
            and lay.pieces[0].map.is_identity
        return lay.pieces[0].target if ok else None
    return y if lay is None and op.inputs[0] not in res.layouts else None


def _row_write(op: Op, graph: Graph) -> Any:
    """The scatter's write edge (its rows ⇢ its output through the index table), whether or not
    the VTOG offers it (it does not where the rows are a graph input); None where the rule
    offers none."""
    try:
        edges = rules(op, graph)
    except Exception:  # noqa: BLE001 - no edge: the update stays XLA's
        return None
    found = [e for e in edges if e.direction == Direction.WRITE and not e.inplace and e.src == op.inputs[2]]
    return found[0] if len(found) == 1 else None


def deferred_updates(graph: Graph, clusters: Sequence[Cluster], matches: Mapping[int, Match | Reject],
                     strategy: Strategy) -> dict[int, int]:
    """In-place row updates left to the kernel that reads their buffer next: update op -> cluster.

    Why: where the new rows of a cache are program inputs (a serving step handed the new K/V
    rows of a paged or per-sequence cache), no kernel produces them to write them home, and XLA
    runs the scatter in place as one more launch before the attention. The attention kernel can
    perform it instead (:class:`.kernels.vio.Update`: what it computes from its loads takes the
    rows, its programs write them). Taken where: the update is a scatter of whole windows XLA
    would run (its rows written by no producer; its output the operand's buffer, or a physical
    buffer of its own: :func:`_update_home`), the next cluster touching the buffer is
    a kernel whose template performs updates (``Template.updates``), and nothing in between —
    no later op of the update's own cluster either — reads the updated tensor (a skipped movement
    op reads it through that kernel's maps only)."""
    res = strategy.resolution
    assert res is not None
    out: dict[int, int] = {}
    for ci, c in enumerate(clusters):
        for k, oid in enumerate(c.ops):
            op = graph.ops[oid]
            if op.primitive != "scatter" or oid in res.eliminated:
                continue
            home, y = _update_home(op, res), op.outputs[0]
            if home is None or _row_write(op, graph) is None:
                continue

            def touches(d: Cluster, after: int = 0) -> bool:
                ts = {t for o in d.ops[after:] for t in (*graph.ops[o].inputs, *graph.ops[o].outputs)}
                return any(t in (home, y) or (t in res.layouts and home in res.layouts[t].targets) for t in ts)

            if touches(c, k + 1):
                continue
            nxt = next((d for d in clusters[ci + 1:] if touches(d) and not (
                d.kind == Kind.MOVEMENT and all(o in res.eliminated for o in d.ops))), None)
            verdict = None if nxt is None else matches.get(nxt.id)
            if isinstance(verdict, Match) and TEMPLATES[verdict.kind].updates(verdict.detail) \
                    and any(t in res.layouts for t in (*nxt.inputs, *nxt.outputs)):   # lowered as a kernel
                out[oid] = nxt.id
    return out


def lower(graph: Graph, clusters: Sequence[Cluster], matches: Mapping[int, Match | Reject], strategy: Strategy,
          *, backend: str = "interpret", rewrite: Callable[[Op], Any] | None = None) -> Lowered:
    """Build the emitted program (``strategy`` must come from ``strategy.plan``). ``rewrite(op)``
    gives an implementation of an opaque control-flow op (``impl(*values) -> outputs``, its body
    optimised), or None to keep it."""
    res = strategy.resolution
    if res is None:
        raise ValueError("lower needs a planned strategy (strategy.plan attaches its resolution)")
    steps: list[Step] = []
    kernels: list[str] = []
    fallbacks: list[str] = []
    deferred = deferred_updates(graph, clusters, matches, strategy)
    for c in clusters:
        if c.kind == Kind.MOVEMENT and all(o in res.eliminated for o in c.ops):
            continue
        touches = any(t in res.layouts for t in (*c.inputs, *c.outputs))
        verdict = matches.get(c.id)
        if isinstance(verdict, Match) and (touches or TEMPLATES[verdict.kind].fuses_beyond_xla(verdict.detail)):
            steps.append(_kernel_step(graph, c, verdict, backend))
            kernels.append(f"{c.kind} cluster #{c.id} ({', '.join(graph.ops[o].primitive for o in c.ops[:4])}"
                           f"{', ...' if len(c.ops) > 4 else ''})")
            continue
        if touches and c.kind not in (Kind.MOVEMENT, Kind.GLUE):   # the VTOG pins these: a planning bug
            fallbacks.append(f"{c.kind} cluster #{c.id} reads or writes a virtual tensor but runs in XLA")
        steps.append(_xla_step(graph, c.ops, rewrite, deferred))
    gathers: list[str] = []

    def fn(*flat: Any) -> tuple[Any, ...]:
        run = _Run(graph, strategy, gathers)
        run.env.update(zip(graph.inputs, flat))
        for step in steps:
            step(run)
        for h in list(run.pending):   # (none: each deferred update's kernel performs it)
            run.flush(h)
        return tuple(run.value(t) for t in graph.outputs)

    return Lowered(fn, tuple(kernels), tuple(sorted(res.eliminated)), tuple(fallbacks), gathers)


# --------------------------------------------------------------------------------------------
# Triton validation (backend="triton"): every kernel must lower for CUDA, or its cluster falls back
# --------------------------------------------------------------------------------------------

def _pallas_eqns(jaxpr: Any) -> list[Any]:
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(eqn)
            continue
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out.extend(_pallas_eqns(inner))
    return out


def _live_eqns(jaxpr: Any) -> list[Any]:
    """The equations some output of ``jaxpr`` needs (or with effects), in program order: what the
    tracer (``graph.trace``'s dead-code elimination) and XLA keep. Why: a kernel whose result the
    program no longer reads (a mask the attention kernel recomputes) is not launched, and counting
    it misaligned the guard's kernels with the emitted graph's calls (LoRA's attention: three
    kernel equations, two calls), which left every kernel's math unpriced."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return live[::-1]


def kernel_clusters(jaxpr: Any) -> list[int | None]:
    """The cluster id of each Pallas kernel the program launches itself, in program order: the
    kernels of its live equations (:func:`_live_eqns`) and of the calls the tracer inlines
    (``jit``), not of control-flow bodies (those are built, and guarded, on their own)."""
    out: list[int | None] = []
    for eqn in _live_eqns(jaxpr):
        if eqn.primitive.name in KERNEL_CALLS:
            out.append(_cluster_of(eqn))
        elif eqn.primitive.name in CALL_LIKE:
            for v in eqn.params.values():
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    out.extend(kernel_clusters(inner))
                    break
    return out


def has_kernels(jaxpr: Any, outside: frozenset[str] = frozenset()) -> bool:
    """Whether the program launches a Pallas kernel anywhere: in its equations, in the calls the
    tracer inlines, or in a control-flow body (scan, cond, while and custom-derivative rules) —
    except in the bodies of the primitives named in ``outside`` (e.g. ``shard_map``)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KERNEL_CALLS:
            return True
        if eqn.primitive.name in outside:
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and has_kernels(inner, outside):
                    return True
    return False


def _cluster_of(eqn: Any) -> int | None:
    stack = str(getattr(eqn.source_info, "name_stack", ""))
    for part in stack.split("/"):
        if part.startswith("vtc_cluster_"):
            return int(part[len("vtc_cluster_"):])
    return None


def triton_failures(closed: Any) -> dict[int, str]:
    """Lower every Pallas kernel of a traced emitted program for CUDA (Triton IR), one by one:
    ``{cluster id: why}`` for those that fail. If every kernel fails with the same error, the
    lowering machinery itself is missing (no CUDA plugin): that is raised, not blamed on clusters."""
    failures: dict[int, tuple[str, str]] = {}
    eqns = _pallas_eqns(closed.jaxpr)
    for eqn in eqns:
        cid = _cluster_of(eqn)
        if cid is None or cid in failures:
            continue
        args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        try:
            cross_lower(lambda *xs, eqn=eqn: eqn.primitive.bind(*xs, **eqn.params), *args)
        except Exception as exc:  # noqa: BLE001 - reported per cluster
            failures[cid] = (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    if failures and len(failures) == len({_cluster_of(e) for e in eqns} - {None}) and len(set(failures.values())) == 1:
        kind, msg = next(iter(failures.values()))
        raise RuntimeError(f"no kernel lowers for CUDA ({kind}: {msg}); is jax's CUDA plugin installed?")
    return {c: f"{k}: {m}" for c, (k, m) in failures.items()}
