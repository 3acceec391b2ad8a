"""Decode attention clusters: dot → scale / soft-cap / mask → softmax → dot, one flash-decoding kernel.

The matcher reads the template's parameters off the cluster's primitives (scale, soft-cap, the
causal ``pos`` / ``kv_len`` bound and a sliding window) or declines with the step it did not
recognise. GQA is not a parameter: the kernel reads K/V through their layouts, and the group
size is read off the layout (a head index that does not appear in K's map is a repeat).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..cluster import Cluster
from ..graph import Graph
from ..primitives import Kind
from . import Decline, Run, Step, Template
from .stage2 import buffers_of

__all__ = ["TEMPLATE"]

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


def _canonical(x: Any, dims: tuple[tuple[int, ...], ...]) -> Any:
    """View an operand as (batch..., then the dims in ``dims`` order) by transposing its layout."""
    from ..kernels.vio import VTensor
    x = VTensor.of(x)
    perm = tuple(d for group in dims for d in group)
    return VTensor(x.layout.transpose(perm), x.dtype, x.buffers, x.symbols)


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


def _match(graph: Graph, c: Cluster) -> _AttnMatch:
    m = _match_attention(graph, c)
    if isinstance(m, str):
        raise Decline(m)
    qs = graph.tensors[m.q].shape
    if not 1 <= len(m.q_dims[0]) <= 2 or int(np.prod([qs[i] for i in m.q_dims[1]])) != 1:
        raise Decline("not a single-query (decode) attention with (batch, head) or (head) batch dims")
    return m


def _build(graph: Graph, c: Cluster, m: _AttnMatch, backend: str) -> Step:
    from ..kernels.attention import decode_attention
    from ..kernels.vio import VTensor
    ks = graph.tensors[m.k].shape
    H = ks[m.k_dims[0][-1]]                      # the last batch dim is the head axis
    B = int(np.prod([ks[i] for i in m.k_dims[0]])) // H
    T, D = ks[m.k_dims[1][0]], ks[m.k_dims[2][0]]
    Dv = graph.tensors[m.v].shape[m.v_dims[2][0]]

    def view(x: VTensor, shape: tuple[int, ...]) -> VTensor:
        return VTensor(x.layout.reshape(shape), x.dtype, x.buffers, x.symbols)

    def step(run: Run) -> None:
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
        run.written(m.out, out, buffers_of(res))

    return step




TEMPLATE = Template(Kind.ATTENTION, library=False, match=_match, build=_build)
