"""Before the trace: a program given sharded inputs, rewritten to run per shard under ``shard_map``.

Why. A Pallas call is a custom call that XLA's SPMD partitioner cannot look into: given sharded
operands it gathers them onto every device and replicates the result (issue #22). vtc_jax already
optimises ``shard_map`` bodies per shard (``program._shard_map``). So a program whose inputs are
sharded is rewritten *as the partitioner would run it* — one ``shard_map`` over the inputs' mesh,
whose body is the traced program on per-shard shapes with the collectives the partitioner would
insert — and that program is optimised instead: every kernel sees its shard, as its pure-JAX
counterpart does under ``jax.jit``.

How (the model: Shardy's factor propagation, on the jaxpr). Every dimension of every value is a
node; each primitive's rule (``RULES``) unifies the dimensions that must be split alike (an
elementwise op's operands and result, a matmul's batch dims, a reshape's leading dims of a group
of equal size products, a cache update's whole dims) and *pins* the dimensions a shard cannot
hold a block of (a concatenated, sliced, padded, scanned or sorted dimension; anything an
unknown primitive touches). The inputs' ``NamedSharding``s (and ``with_sharding_constraint``s)
seed the nodes with mesh axes. A dimension a matmul or a sum contracts, once split, makes the
result a partial sum: a ``psum`` over those axes follows it (``pmax``/``pmin`` for max/min), as
the partitioner's all-reduce does. The plan is refused (``per_shard`` returns the reason; the
caller runs plain ``jax.jit``) when two axes meet on one node, a pinned node is split, a split
does not divide a size, or an input's sharding is not a ``NamedSharding`` over one mesh. A
refused plan is never a wrong number: only what the rules prove per-shard runs per shard.

Localised parameters: shapes written into a primitive's params (``reshape``'s ``new_sizes``,
``broadcast_in_dim``'s ``shape``, ``iota``'s, a whole-dim ``slice``/``dynamic_slice``) take the
per-shard sizes; an ``iota`` along a split dimension adds its shard's offset (``axis_index``).
Calls (``pjit``, custom derivatives, remat) are inlined: the body runs on shards; a ``scan``'s body
is propagated and run per shard inside ``lax.scan`` (scanned layers, recurrences over time);
other control flow (``while``, ``cond``) pins what it touches. Derivatives of the rewritten
program are the user's own (``api`` keeps ``fn``'s derivatives, ``autodiff``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.extend.core as jcore
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from .compat import scan_counts
from .interpret import rebind
from .primitives import CALL_LIKE, ELEMENTWISE, TABLE

__all__ = ["PerShard", "per_shard", "RULES"]

Key = tuple[int, int]          # (value, dimension)
Axes = tuple[str, ...]         # mesh axes a dimension is split over, major to minor


class Refused(Exception):
    """The program cannot run per shard as written (the message says why)."""


# --------------------------------------------------------------------------------------------
# The flat program: calls inlined, every value numbered
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Body:
    """A loop body's flat program (``scan``): its inputs' numbers (consts, carry, xs), steps and
    outputs (carry, ys), in the same numbering as the program around it."""
    ins: tuple[int, ...]
    steps: tuple["Step", ...]
    outs: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class Step:
    """One equation of the flat program: its primitive and params, and its values' numbers
    (an int) or literal constants (``jcore.Literal``); a ``scan`` carries its body."""
    eqn: Any
    ins: tuple[Any, ...]
    outs: tuple[int, ...]
    body: Body | None = None


@dataclass
class _Flat:
    shapes: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    consts: dict[int, Any] = dataclasses.field(default_factory=dict)
    steps: list[Step] = dataclasses.field(default_factory=list)

    def new(self, aval: Any) -> int:
        self.shapes.append(tuple(getattr(aval, "shape", ())))
        return len(self.shapes) - 1


def _body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """An inlinable call's body (jaxpr, consts), as the tracer reads it (``PrimInfo.call_body``)."""
    for name in TABLE[eqn.primitive.name].call_body:
        body = eqn.params.get(name)
        if body is None:
            continue
        jaxpr = getattr(body, "jaxpr", body)
        if hasattr(jaxpr, "eqns") and len(jaxpr.invars) == len(eqn.invars):
            return jaxpr, getattr(body, "consts", ())
    return None


def _flatten(flat: _Flat, jaxpr: Any, consts: Sequence[Any], ins: Sequence[Any],
             steps: list[Step] | None = None) -> list[Any]:
    """Append ``jaxpr``'s equations to ``steps`` (default: the program's), calls inlined, a
    ``scan``'s body flattened into its own :class:`Body`; returns the outputs' numbers."""
    steps = flat.steps if steps is None else steps
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v if isinstance(v, jcore.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = flat.new(v.aval)
        flat.consts[env[v]] = c
    env.update(zip(jaxpr.invars, ins))
    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        body = _body(eqn) if eqn.primitive.name in CALL_LIKE else None
        if body is not None:
            outs = _flatten(flat, body[0], body[1], args, steps)
        else:
            outs = [flat.new(v.aval) for v in eqn.outvars]
            loop = None
            if eqn.primitive.name == "scan":
                inner = eqn.params["jaxpr"]
                bins = [flat.new(v.aval) for v in inner.jaxpr.invars]
                bsteps: list[Step] = []
                bouts = _flatten(flat, inner.jaxpr, inner.consts, bins, bsteps)
                loop = Body(tuple(bins), tuple(bsteps), tuple(bouts))
            steps.append(Step(eqn, tuple(args), tuple(outs), loop))
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


# --------------------------------------------------------------------------------------------
# Factor propagation
# --------------------------------------------------------------------------------------------

class _Nodes:
    """Union-find over dimensions; a root holds the mesh axes its class is split over (None:
    not decided) and whether a shard may hold a block of it."""

    def __init__(self, flat: _Flat) -> None:
        self.shapes = flat.shapes
        self.parent: dict[Key, Key] = {}
        self.axes: dict[Key, Axes | None] = {}
        self.pinned: dict[Key, str] = {}

    def find(self, k: Key) -> Key:
        root = k
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while k != root:
            self.parent[k], k = root, self.parent.get(k, k)
        return root

    def union(self, a: Key, b: Key) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        self.parent[rb] = ra
        self._merge(ra, self.axes.pop(rb, None), f"{_name(b)} and {_name(a)}")
        if rb in self.pinned:
            self.pinned.setdefault(ra, self.pinned.pop(rb))
        self._check(ra)

    def seed(self, k: Key, axes: Axes, why: str) -> None:
        r = self.find(k)
        self._merge(r, axes, why)
        self._check(r)

    def pin(self, k: Key, why: str) -> None:
        r = self.find(k)
        self.pinned.setdefault(r, why)
        self._check(r)

    def _merge(self, r: Key, axes: Axes | None, why: str) -> None:
        mine = self.axes.get(r)
        if axes is None or mine == axes:
            return
        if mine is not None and (mine or axes):
            raise Refused(f"{why}: split over {mine or '()'} on one side and {axes or '()'} on the other")
        self.axes[r] = axes

    def _check(self, r: Key) -> None:
        if self.axes.get(r) and r in self.pinned:
            raise Refused(f"a dimension split over {self.axes[r]} meets {self.pinned[r]}")

    def split(self, k: Key) -> Axes:
        return self.axes.get(self.find(k)) or ()


def _name(k: Key) -> str:
    return f"dimension {k[1]} of value {k[0]}"


# A rule reads an equation's params and its values' numbers and shapes, and unifies/pins nodes;
# it returns the reductions the equation performs: [(collective, [contracted dims], result)].
Reduction = tuple[str, list[Key], int]
Rule = Callable[[_Nodes, Step, Callable[[Any], tuple[int, ...]]], list[Reduction]]


def _dims(x: Any, shape: tuple[int, ...]) -> list[Key]:
    return [] if isinstance(x, jcore.Literal) else [(x, d) for d in range(len(shape))]


def _pin_all(nodes: _Nodes, s: Step, shape: Callable[[Any], tuple[int, ...]], why: str) -> None:
    for x in (*s.ins, *s.outs):
        if not isinstance(x, jcore.Literal):
            for k in _dims(x, shape(x)):
                nodes.pin(k, why)


def _elementwise(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    """Operands and results dim for dim; a scalar operand, or a size-1 dim an operand broadcasts
    (jaxprs of jax >= 0.11 broadcast size-1 dims in binary ops), follows nothing."""
    out = s.outs[0]
    for x in (*s.ins, *s.outs[1:]):
        if isinstance(x, jcore.Literal) or not shape(x):
            continue
        if len(shape(x)) != len(shape(out)):
            _pin_all(nodes, Step(s.eqn, (x,), ()), shape, f"{s.eqn.primitive}'s operand of another rank")
            continue
        for d, (n, m) in enumerate(zip(shape(x), shape(out))):
            if n == m:
                nodes.union((out, d), (x, d))
    return []


def _same_dims(nodes: _Nodes, a: int, b: int, skip: Sequence[int], shape: Any, why: str) -> None:
    """Unify ``a``'s and ``b``'s dims one to one except ``skip`` (pinned on both)."""
    for d in range(len(shape(a))):
        if d in skip:
            nodes.pin((a, d), why)
            nodes.pin((b, d), why)
        else:
            nodes.union((a, d), (b, d))


def _one_to_one(skip_of: Callable[[Step, Any], Sequence[int]], why: str) -> Rule:
    """Operand 0 and every result dim for dim (a slice, a cumulative op, a reversal), except the
    dims ``skip_of`` names: those a shard cannot hold a block of."""
    def rule(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
        if isinstance(s.ins[0], jcore.Literal):
            _pin_all(nodes, s, shape, f"{s.eqn.primitive} of a literal")
            return []
        skip = list(skip_of(s, shape))
        for x in (*s.ins, *s.outs):
            if not isinstance(x, jcore.Literal) and x != s.ins[0] and shape(x) and len(shape(x)) == len(shape(s.ins[0])):
                _same_dims(nodes, s.ins[0], x, skip, shape, f"{s.eqn.primitive} along it ({why})")
        return []
    return rule


def _broadcast(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    x, out = s.ins[0], s.outs[0]
    if isinstance(x, jcore.Literal):
        return []
    for i, d in enumerate(s.eqn.params["broadcast_dimensions"]):
        if shape(x)[i] == shape(out)[d]:
            nodes.union((x, i), (out, d))
        else:
            nodes.pin((x, i), "a size-1 dimension broadcast")
    return []


def _groups(a: Sequence[int], b: Sequence[int]) -> Iterator[tuple[list[int], list[int]]]:
    """The dims of two shapes of one size in groups of equal products (size-1 dims alone)."""
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            yield [i], []
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            yield [], [j]
            j += 1
            continue
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(i)
                pa *= a[i]
                i += 1
            else:
                gb.append(j)
                pb *= b[j]
                j += 1
        yield ga, gb


def _reshape(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    """A group ``(h d) <-> h d``: a block of the merged dim is a block of its leading dim (when
    the split divides it, checked at the end), the other dims of the group stay whole."""
    x, out = s.ins[0], s.outs[0]
    if s.eqn.params.get("dimensions") is not None or 0 in shape(x):
        _pin_all(nodes, s, shape, "a reshape with dimensions or of an empty value")
        return []
    for ga, gb in _groups(shape(x), shape(out)):
        if ga and gb:
            nodes.union((x, ga[0]), (out, gb[0]))
        for d in ga[1:] if gb else ga:
            nodes.pin((x, d), "a reshape's minor dimension")
        for d in gb[1:] if ga else gb:
            nodes.pin((out, d), "a reshape's minor dimension")
    return []


def _squeeze(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    x, out = s.ins[0], s.outs[0]
    kept = [d for d in range(len(shape(x))) if d not in s.eqn.params["dimensions"]]
    for o, d in enumerate(kept):
        nodes.union((x, d), (out, o))
    return []


def _transpose(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    for o, d in enumerate(s.eqn.params["permutation"]):
        nodes.union((s.ins[0], d), (s.outs[0], o))
    return []


def _dot(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    (lc, rc), (lb, rb) = s.eqn.params["dimension_numbers"]
    lhs, rhs, out = s.ins[0], s.ins[1], s.outs[0]
    if isinstance(lhs, jcore.Literal) or isinstance(rhs, jcore.Literal):
        _pin_all(nodes, s, shape, "a dot of a literal")
        return []
    o = 0
    for a, b in zip(lb, rb):
        nodes.union((lhs, a), (out, o))
        nodes.union((rhs, b), (out, o))
        o += 1
    for x, skip in ((lhs, (*lc, *lb)), (rhs, (*rc, *rb))):
        for d in range(len(shape(x))):
            if d not in skip:
                nodes.union((x, d), (out, o))
                o += 1
    for a, b in zip(lc, rc):
        nodes.union((lhs, a), (rhs, b))
    return [("psum", [(lhs, a) for a in lc], out)]


_REDUCE = {"reduce_sum": "psum", "reduce_max": "pmax", "reduce_min": "pmin"}


def _reduce(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    x, out = s.ins[0], s.outs[0]
    axes = s.eqn.params["axes"]
    kept = [d for d in range(len(shape(x))) if d not in axes]
    for o, d in enumerate(kept):
        nodes.union((x, d), (out, o))
    collective = _REDUCE.get(s.eqn.primitive.name)
    if collective is None:
        for d in axes:
            nodes.pin((x, d), f"{s.eqn.primitive} over it")
        return []
    return [(collective, [(x, d) for d in axes], out)]


def _update(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    """``dynamic_update_slice``: the result is the operand; the update's whole dims go with the
    operand's; a dim written partly (at a runtime start) stays whole."""
    x, u, out = s.ins[0], s.ins[1], s.outs[0]
    for d in range(len(shape(x))):
        nodes.union((x, d), (out, d))
        if not isinstance(u, jcore.Literal) and shape(u)[d] == shape(x)[d]:
            nodes.union((x, d), (u, d))
        else:
            nodes.pin((x, d), "an update at a runtime start")
            if not isinstance(u, jcore.Literal):
                nodes.pin((u, d), "an update at a runtime start")
    return []


def _partial_dims(s: Step, shape: Any) -> list[int]:
    p, x = s.eqn.params, shape(s.ins[0])
    name = s.eqn.primitive.name
    if name == "slice":
        strides = p["strides"] or (1,) * len(x)
        return [d for d in range(len(x)) if (p["start_indices"][d], p["limit_indices"][d], strides[d]) != (0, x[d], 1)]
    if name == "dynamic_slice":
        return [d for d in range(len(x)) if p["slice_sizes"][d] != x[d]]
    if name == "pad":
        return [d for d, cfg in enumerate(p["padding_config"]) if tuple(cfg) != (0, 0, 0)]
    if name == "rev":
        return list(p["dimensions"])
    if name in ("concatenate", "split"):
        return [p["dimension"] if name == "concatenate" else p["axis"]]
    if name in ("argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or"):
        return list(p["axes"])
    if name == "sort":
        return [p["dimension"]]
    return [p["axis"]]   # cumsum, cumprod, cummax, cummin, cumlogsumexp


def _concat(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    d0 = s.eqn.params["dimension"] if s.eqn.primitive.name == "concatenate" else s.eqn.params["axis"]
    vals = [x for x in (*s.ins, *s.outs) if not isinstance(x, jcore.Literal)]
    for x in vals:
        nodes.pin((x, d0), f"{s.eqn.primitive} along it")
        for d in range(len(shape(x))):
            if d != d0:
                nodes.union((vals[0], d), (x, d))
    return []


def _reduce_keep(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    """argmax/argmin, reduce_prod/and/or: the reduced dims whole, the kept ones follow."""
    x, out = s.ins[0], s.outs[0]
    axes = s.eqn.params["axes"]
    for d in axes:
        nodes.pin((x, d), f"{s.eqn.primitive} over it")
    for o, d in enumerate(k for k in range(len(shape(x))) if k not in axes):
        nodes.union((x, d), (out, o))
    return []


def _conv(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    """Data parallel only: the batch dim of the input and output (no feature groups); every
    other dim whole (a split spatial dim would need halos)."""
    p = s.eqn.params
    lhs, rhs, out = s.ins[0], s.ins[1], s.outs[0]
    dn = p["dimension_numbers"]
    lb, ob = dn.lhs_spec[0], dn.out_spec[0]
    grouped = p["feature_group_count"] != 1 or p["batch_group_count"] != 1
    for x, keep in ((lhs, lb), (rhs, None), (out, ob)):
        for d in range(len(shape(x))):
            if d != keep or grouped:
                nodes.pin((x, d), "a convolution's non-batch dimension")
    if not grouped:
        nodes.union((lhs, lb), (out, ob))
    return []


def _constraint(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    x, out = s.ins[0], s.outs[0]
    for d in range(len(shape(out))):
        nodes.union((x, d), (out, d))
    sharding = s.eqn.params.get("sharding")
    if isinstance(sharding, NamedSharding):
        for d, axes in enumerate(_spec_axes(sharding.spec, len(shape(out)))):
            if axes is not None:
                nodes.seed((out, d), axes, "a with_sharding_constraint")
    return []


def _identity(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    for x, out in zip(s.ins, s.outs):
        if not isinstance(x, jcore.Literal):
            for d in range(len(shape(out))):
                nodes.union((x, d), (out, d))
    return []


def _scan(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    """``scan``: its body's inputs go with the operands (consts and carry whole, xs without the
    scanned leading dim), its outputs with the results (carry whole, ys without the stacked
    leading dim), and the carry's output with its input; the scanned and stacked dims stay whole.
    The body's own steps are propagated by :func:`_propagate`."""
    assert s.body is not None
    nc, ncar = scan_counts(s.eqn.params)
    body = s.body

    def tie(outer: Any, inner: Any, skip_lead: bool) -> None:
        if isinstance(outer, jcore.Literal) or isinstance(inner, jcore.Literal):
            return
        if skip_lead:
            nodes.pin((outer, 0), "a scanned dimension")
        for d in range(len(shape(inner))):
            nodes.union((outer, d + skip_lead), (inner, d))

    for i, (x, b) in enumerate(zip(s.ins, body.ins)):
        tie(x, b, i >= nc + ncar)
    for j, (o, b) in enumerate(zip(s.outs, body.outs)):
        tie(o, b, j >= ncar)
    for j in range(ncar):
        tie(body.ins[nc + j], body.outs[j], False)
    return []


def _generator(nodes: _Nodes, s: Step, shape: Any) -> list[Reduction]:
    return []   # iota: any split; the shard's offset is added where its dimension is split


RULES: dict[str, Rule] = {
    **{n: _elementwise for n in ELEMENTWISE if n != "iota"},
    "iota": _generator,
    "broadcast_in_dim": _broadcast,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "transpose": _transpose,
    "dot_general": _dot,
    **{n: _reduce for n in _REDUCE},
    **{n: _reduce_keep for n in ("argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or")},
    "dynamic_update_slice": _update,
    **{n: _one_to_one(_partial_dims, "a shard holds a block") for n in
       ("slice", "dynamic_slice", "pad", "rev", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    "sort": _one_to_one(_partial_dims, "sorted"),
    "concatenate": _concat,
    "split": _concat,
    "conv_general_dilated": _conv,
    "sharding_constraint": _constraint,
    "scan": _scan,
    "copy": _identity,
    "copy_p": _identity,
    "device_put": _identity,
    "optimization_barrier": _identity,
}


def _spec_axes(spec: PartitionSpec, ndim: int) -> list[Axes | None]:
    """A PartitionSpec's mesh axes per dimension (None: replicated there, free to follow)."""
    out: list[Axes | None] = []
    for d in range(ndim):
        entry = spec[d] if d < len(spec) else None
        if entry is None:
            out.append(None)
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return out


# --------------------------------------------------------------------------------------------
# The plan and the per-shard program
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class PerShard:
    """The program run per shard: ``shard_map(body, mesh, in_specs, out_specs)`` over the flat
    inputs. ``collectives`` lists the reductions it inserted (the partitioner's all-reduces)."""
    mesh: Any
    in_specs: tuple[PartitionSpec, ...]
    out_specs: tuple[PartitionSpec, ...]
    collectives: tuple[str, ...]
    body: Callable[..., tuple[Any, ...]]

    def __call__(self, *flat: Any) -> tuple[Any, ...]:
        # check_vma=False: the body is the user's program, not written for varying types; the
        # specs are proved here, and Pallas's interpreter runs kernels only on unvarying values.
        # Explicit mesh axes (sharding in types): the inputs typed with their specs first — a no-op
        # on the arrays, which carry them; vtc_jax traces its programs on untyped avals
        if _explicit(self.mesh):
            flat = tuple(jax.sharding.reshard(x, NamedSharding(self.mesh, s)) if hasattr(x, "shape") else x
                         for x, s in zip(flat, self.in_specs))
        return tuple(jax.shard_map(self.body, mesh=self.mesh, in_specs=self.in_specs, out_specs=self.out_specs,
                                   check_vma=False)(*flat))


def _explicit(mesh: Any) -> bool:
    return any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()))


def _mesh_key(mesh: Any) -> Any:
    """A mesh's identity: a concrete mesh by itself, an abstract one (a tracer's type inside the
    user's jit) by its axes."""
    return (tuple(mesh.axis_names), tuple(mesh.axis_sizes), tuple(map(str, mesh.axis_types)), type(mesh).__name__)


def _mesh_of(shardings: Sequence[Any]) -> Any:
    meshes = {_mesh_key(s.mesh): s.mesh for s in shardings if isinstance(s, NamedSharding)}
    if any(s is not None and not isinstance(s, NamedSharding) and not getattr(s, "is_fully_replicated", False)
           for s in shardings):
        raise Refused("an input is split by a sharding other than a NamedSharding")
    if len(meshes) != 1:
        raise Refused(f"the inputs are sharded over {len(meshes)} meshes")
    mesh = next(iter(meshes.values()))
    types = getattr(mesh, "axis_types", ())
    if any("Manual" in str(t) for t in types):
        raise Refused("the mesh has Manual axes (the program runs inside a shard_map already)")
    return mesh


def per_shard(closed: Any, shardings: Sequence[Any]) -> PerShard:
    """The per-shard program for ``closed`` (a ClosedJaxpr over the flat inputs) given each
    input's sharding (None: unplaced), or :class:`Refused` with the reason."""
    mesh = _mesh_of(shardings)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    flat = _Flat()
    ins = [flat.new(v.aval) for v in closed.jaxpr.invars]
    outs = _flatten(flat, closed.jaxpr, closed.consts, ins)
    nodes = _Nodes(flat)
    shape = lambda x: tuple(getattr(x.aval, "shape", ())) if isinstance(x, jcore.Literal) else flat.shapes[x]  # noqa: E731
    for x, sh in zip(ins, shardings):
        if isinstance(sh, NamedSharding):
            for d, axes in enumerate(_spec_axes(sh.spec, len(shape(x)))):
                if axes is not None:
                    nodes.seed((x, d), axes, f"input {ins.index(x)}")
    for c in flat.consts:
        for d in range(len(shape(c))):
            nodes.pin((c, d), "a constant of the program")
    reductions: dict[Step, list[Reduction]] = {}
    _propagate(nodes, flat.steps, shape, reductions)
    # every split divides its sizes, and no value is split twice over one axis
    for x, sh in enumerate(flat.shapes):
        seen: list[str] = []
        for d, n in enumerate(sh):
            axes = nodes.split((x, d))
            k = math.prod(sizes[a] for a in axes)
            if n % k:
                raise Refused(f"{_name((x, d))} (size {n}) does not split {k} ways over {axes}")
            seen.extend(axes)
        if len(seen) != len(set(seen)):
            raise Refused(f"value {x} is split twice over one mesh axis ({seen})")
    spec = lambda x: PartitionSpec(*(_entry(nodes.split((x, d))) for d in range(len(shape(x)))))  # noqa: E731
    local = [tuple(n // math.prod(sizes[a] for a in nodes.split((x, d))) for d, n in enumerate(sh))
             for x, sh in enumerate(flat.shapes)]
    collectives: list[str] = []
    after: dict[Step, list[tuple[str, Axes]]] = {}
    for step, found in reductions.items():
        for name, keys, out in found:
            axes = tuple(a for k in keys for a in nodes.split(k))
            kept = {a for d in range(len(shape(out))) for a in nodes.split((out, d))}
            if kept & set(axes):   # a shard's partial sum would mix blocks of its result
                raise Refused(f"{step.eqn.primitive} contracts and keeps dimensions split over {axes}")
            if axes:
                after.setdefault(step, []).append((name, axes))
                collectives.append(f"{name} over {axes} after {step.eqn.primitive}")
    in_specs = tuple(spec(x) for x in ins)
    out_specs = tuple(spec(x) if not isinstance(x, jcore.Literal) else PartitionSpec() for x in outs)
    body = _body_fn(flat, ins, outs, local, nodes, sizes, after)
    return PerShard(mesh, in_specs, out_specs, tuple(collectives), body)


def _propagate(nodes: _Nodes, steps: Sequence[Step], shape: Any, reductions: dict[Step, list[Reduction]]) -> None:
    """Every step's rule (a primitive with none pins all it touches), loop bodies included."""
    for s in steps:
        rule = RULES.get(s.eqn.primitive.name)
        if rule is None or (s.eqn.primitive.name == "scan" and s.body is None):
            _pin_all(nodes, s, shape, f"{s.eqn.primitive} (no per-shard rule)")
            continue
        found = rule(nodes, s, shape)
        if found:
            reductions[s] = found
        if s.body is not None:
            _propagate(nodes, s.body.steps, shape, reductions)


def _entry(axes: Axes) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _localise(s: Step, local: list[tuple[int, ...]]) -> dict[str, Any]:
    """The equation's params with the shapes they hold made per-shard."""
    p = dict(s.eqn.params)
    for k in ("sharding", "out_sharding"):   # the traced (global, Auto) sharding: per shard, none
        if p.get(k) is not None and k in p:
            p[k] = None
    name = s.eqn.primitive.name
    out = local[s.outs[0]] if s.outs else ()
    if name == "reshape":
        p["new_sizes"] = out
    elif name in ("broadcast_in_dim", "iota"):
        p["shape"] = out
    elif name == "slice":   # a whole dimension (the others are pinned: the same on every shard)
        glob, x = s.eqn.invars[0].aval.shape, local[s.ins[0]]
        p["limit_indices"] = tuple(x[d] if (st, lim) == (0, glob[d]) else lim
                                   for d, (st, lim) in enumerate(zip(p["start_indices"], p["limit_indices"])))
    elif name == "dynamic_slice":
        p["slice_sizes"] = out
    return p


def _offset(axes: Axes, sizes: dict[str, int]) -> Any:
    """This shard's block index along a dimension split over ``axes`` (major to minor)."""
    idx = 0
    for a in axes:
        idx = idx * sizes[a] + lax.axis_index(a)
    return idx


def _body_fn(flat: _Flat, ins: Sequence[int], outs: Sequence[Any], local: list[tuple[int, ...]], nodes: _Nodes,
             sizes: dict[str, int], after: dict[Step, list[tuple[str, Axes]]]) -> Callable[..., tuple[Any, ...]]:
    def body(*xs: Any) -> tuple[Any, ...]:
        env: dict[int, Any] = dict(flat.consts)
        env.update(zip(ins, xs))
        return _run(flat.steps, outs, env, local, nodes, sizes, after)

    return body


_COLLECTIVE = {"psum": lax.psum, "pmax": lax.pmax, "pmin": lax.pmin}


def _run(steps: Sequence[Step], outs: Sequence[Any], env: dict[int, Any], local: list[tuple[int, ...]],
         nodes: _Nodes, sizes: dict[str, int], after: dict[Step, list[tuple[str, Axes]]]) -> tuple[Any, ...]:
    """Evaluate ``steps`` per shard in ``env`` (values by number); the values of ``outs``."""
    def read(x: Any) -> Any:
        return x.val if isinstance(x, jcore.Literal) else env[x]

    for s in steps:
        name = s.eqn.primitive.name
        if name == "sharding_constraint":   # a hint to the partitioner: per shard, the identity
            env[s.outs[0]] = read(s.ins[0])
            continue
        args = [read(x) for x in s.ins]
        if s.body is not None:
            vals = _scan_local(s, args, env, local, nodes, sizes, after)
        else:
            res = rebind(s.eqn.primitive, args, _localise(s, local))
            vals = list(res) if s.eqn.primitive.multiple_results else [res]
        if name == "iota":
            d = s.eqn.params["dimension"]
            axes = nodes.split((s.outs[0], d))
            if axes:
                vals[0] = vals[0] + (_offset(axes, sizes) * local[s.outs[0]][d]).astype(vals[0].dtype)
        for name_, axes in after.get(s, ()):
            vals = [_COLLECTIVE[name_](v, axes) for v in vals]
        env.update(zip(s.outs, vals))
    return tuple(read(x) for x in outs)


def _scan_local(s: Step, args: list[Any], env: dict[int, Any], local: list[tuple[int, ...]], nodes: _Nodes,
                sizes: dict[str, int], after: dict[Step, list[tuple[str, Axes]]]) -> list[Any]:
    """A ``scan`` per shard: ``lax.scan`` (the public API, whose params every supported jax
    spells alike) over the body's steps, run per shard like the program around it."""
    assert s.body is not None
    p, body = s.eqn.params, s.body
    nc, ncar = scan_counts(p)
    consts, init, xs = args[:nc], args[nc:nc + ncar], args[nc + ncar:]

    def step(carry: tuple, x: tuple) -> tuple[tuple, tuple]:
        inner = dict(env)
        inner.update(zip(body.ins, (*consts, *carry, *x)))
        out = _run(body.steps, body.outs, inner, local, nodes, sizes, after)
        return tuple(out[:ncar]), tuple(out[ncar:])

    carry, ys = lax.scan(step, tuple(init), tuple(xs), length=p["length"], reverse=p["reverse"],
                         unroll=p.get("unroll", 1))
    return [*carry, *ys]
