"""The virtual index-map algebra: how a virtual tensor's indices land in physical memory.

A virtual tensor owns no memory; it is an :class:`IndexMap` from its own index space onto a
physical tensor (or several, see :class:`Piece`). Every data-movement primitive is one method
here that returns the map of the moved tensor, so a chain of movement ops is a chain of method
calls and the composed map is what a kernel's load/store stage evaluates (paper §4.1,
``F_new = F_outer ∘ F_base``).

Expressions are kept in the canonical "sum of atoms" form that XLA's indexing analysis and MLIR's
affine maps use: ``const + Σ coeff·atom`` where an atom is a virtual index ``d_i``, a runtime
symbol (``pos``), or ``floordiv``/``mod`` of an expression by a positive constant. Division and
modulo are simplified with the ranges of the indices, which is what turns a reshape that merges
dimensions cleanly back into plain strides (``(d0*128 + d1) floordiv 128 -> d0`` when
``0 <= d1 < 128``). Without that, every reshape would leave a ``//``/``%`` in the kernel and every
contiguity question would be answered "unknown".

Evaluation is one code path with the array module as a parameter (``xp``): at a :data:`Point`
(index arrays per virtual dim, values per runtime symbol) :meth:`IndexMap.targets`,
:meth:`IndexMap.flat_offsets`, :meth:`Piece.holds` and :meth:`Layout.gather` compute with numpy
for the reference semantics (:meth:`Layout.evaluate`), with jax.numpy where ``lower`` must read or
write a virtual tensor in XLA, and with jax.numpy on a block's int32 lane indices inside a kernel
(``kernels.vio``). :func:`all_of` / :func:`conds_mask` are the one way conditions become a mask.
"""
from __future__ import annotations

import dataclasses

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "Expr", "Atom", "Dim", "Sym", "FloorDiv", "Mod", "Load", "Cond", "SymInfo", "IndexMap", "Piece",
    "Contiguity", "FillRegion", "Layout", "Movements", "box_conds", "NotComposable", "dim", "sym", "const",
    "row_major_strides", "Point", "point", "all_of", "conds_mask", "finish_read", "union_shape",
]


class NotComposable(ValueError):
    """Raised when two maps cannot be composed into one (e.g. two pads with different fills)."""


# --------------------------------------------------------------------------------------------
# Expressions
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, order=True)
class Dim:
    """Virtual index ``d_i``."""
    i: int

    def __str__(self) -> str:
        return f"d{self.i}"


@dataclass(frozen=True, order=True)
class Sym:
    """A runtime integer scalar (e.g. the decode position), supplied to kernels as an input."""
    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class FloorDiv:
    expr: "Expr"
    c: int

    def __str__(self) -> str:
        return f"({self.expr}) floordiv {self.c}"


@dataclass(frozen=True)
class Mod:
    expr: "Expr"
    c: int

    def __str__(self) -> str:
        return f"({self.expr}) mod {self.c}"


@dataclass(frozen=True)
class Load:
    """An index read at run time from an integer table: ``clip(w(table[index]), lo, hi)`` with
    ``w(v) = v + wrap`` where ``v < 0`` (numpy's negative indices, as jnp normalises them) and
    ``v`` elsewhere; the clip is the gather's own clamp of a start index (XLA's semantics). A
    paged KV cache's page ``block_table[b, t floordiv page]`` is one.

    Composed like the other compound atoms (``index`` is substituted and simplified; the value
    range is ``[lo, hi]`` whatever the table holds, so ``floordiv``/``mod`` of it simplify and
    bounds stay proven). ``table`` names a runtime symbol (:class:`SymInfo` with a ``shape``):
    the evaluator reads it from the :data:`Point` — a numpy/jax array, or inside a kernel an
    object with ``read(load, bounds)`` (``kernels.vio`` loads one table element per block row)."""
    table: str
    index: tuple["Expr", ...]
    lo: int
    hi: int
    wrap: int = 0

    def __str__(self) -> str:
        return f"{self.table}[{', '.join(str(e) for e in self.index)}]"


Atom = Dim | Sym | FloorDiv | Mod | Load


def _atom_key(a: Atom) -> tuple:
    # Dims first (by index), then symbols, then compound atoms: gives a stable canonical order.
    if isinstance(a, Dim):
        return (0, a.i, "")
    if isinstance(a, Sym):
        return (1, 0, a.name)
    return _compound_key(a)


@functools.lru_cache(maxsize=65536)
def _compound_key(a: Atom) -> tuple:
    """Printing a compound atom is the costly part of ordering terms: memoise it (atoms are
    immutable values, so the cache can never be stale)."""
    return (2, 0, str(a))


Bounds = Mapping[Atom, tuple[int, int]]  # inclusive ranges of dims / symbols


@dataclass(frozen=True)
class Expr:
    """``const + Σ coeff·atom`` with atoms in canonical order and no zero coefficients."""
    terms: tuple[tuple[Atom, int], ...] = ()
    const: int = 0

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def of(x: "Expr | int | Atom") -> "Expr":
        if isinstance(x, Expr):
            return x
        if isinstance(x, (int, np.integer)):
            return Expr((), int(x))
        return Expr(((x, 1),), 0)

    @staticmethod
    def _make(coeffs: Mapping[Atom, int], c: int) -> "Expr":
        if any(isinstance(a, Mod) for a in coeffs):
            coeffs, c = _recombine(coeffs, int(c))
        items = [(a, k) for a, k in coeffs.items() if k != 0]
        if len(items) > 1:
            items.sort(key=lambda t: _atom_key(t[0]))
        return Expr(tuple(items), int(c))

    def __add__(self, other: "Expr | int") -> "Expr":
        if isinstance(other, (int, np.integer)):   # a constant moves no term: already canonical
            return Expr(self.terms, self.const + int(other))
        o = Expr.of(other)
        acc = dict(self.terms)
        for a, k in o.terms:
            acc[a] = acc.get(a, 0) + k
        return Expr._make(acc, self.const + o.const)

    __radd__ = __add__

    def __neg__(self) -> "Expr":
        return self * -1

    def __sub__(self, other: "Expr | int") -> "Expr":
        return self + (-Expr.of(other))

    def __rsub__(self, other: "Expr | int") -> "Expr":
        return Expr.of(other) - self

    def __mul__(self, k: int) -> "Expr":
        if not isinstance(k, (int, np.integer)):
            raise TypeError("index expressions are multiplied by integer constants only")
        k = int(k)
        if k == 0:
            return Expr((), 0)
        # a nonzero factor scales every coefficient alike: the order and the fold of _recombine
        # (k*c*(e floordiv c) + k*(e mod c)) are unchanged, so a canonical Expr stays canonical
        return Expr(tuple((a, c * k) for a, c in self.terms), self.const * k)

    __rmul__ = __mul__

    def floordiv(self, c: int, bounds: Bounds | None = None) -> "Expr":
        return _floordiv(self, int(c), bounds or {})

    def mod(self, c: int, bounds: Bounds | None = None) -> "Expr":
        return _mod(self, int(c), bounds or {})

    # -- queries ------------------------------------------------------------------------------
    @property
    def is_const(self) -> bool:
        return not self.terms

    def atoms(self) -> tuple[Atom, ...]:
        return tuple(a for a, _ in self.terms)

    def dims(self) -> frozenset[int]:
        """Every virtual index this expression depends on, also inside floordiv/mod."""
        out: set[int] = set()
        for a, _ in self.terms:
            if isinstance(a, Dim):
                out.add(a.i)
            elif isinstance(a, (FloorDiv, Mod)):
                out |= a.expr.dims()
            elif isinstance(a, Load):
                for e in a.index:
                    out |= e.dims()
        return frozenset(out)

    def symbols(self) -> frozenset[str]:
        out: set[str] = set()
        for a, _ in self.terms:
            if isinstance(a, Sym):
                out.add(a.name)
            elif isinstance(a, (FloorDiv, Mod)):
                out |= a.expr.symbols()
            elif isinstance(a, Load):
                out.add(a.table)
                for e in a.index:
                    out |= e.symbols()
        return frozenset(out)

    def loads(self) -> tuple[Load, ...]:
        """The table reads this expression makes (also inside floordiv/mod and other reads)."""
        out: list[Load] = []
        for a, _ in self.terms:
            if isinstance(a, (FloorDiv, Mod)):
                out += a.expr.loads()
            elif isinstance(a, Load):
                out.append(a)
                for e in a.index:
                    out += e.loads()
        return tuple(dict.fromkeys(out))

    def coeff(self, a: Atom) -> int:
        return dict(self.terms).get(a, 0)

    def range(self, bounds: Bounds) -> tuple[float, float]:
        """Inclusive [lo, hi] of the expression; ±inf where an unbounded symbol enters."""
        lo = hi = float(self.const)
        for a, k in self.terms:
            alo, ahi = _atom_range(a, bounds)
            if k > 0:
                lo, hi = lo + k * alo, hi + k * ahi
            else:
                lo, hi = lo + k * ahi, hi + k * alo
        return lo, hi

    def substitute(self, mapping: Mapping[Atom, "Expr"], bounds: Bounds) -> "Expr":
        """Replace atoms (dims, symbols) by expressions, re-simplifying floordiv/mod on the way."""
        out = Expr.of(self.const)
        for a, k in self.terms:
            if a in mapping:
                rep = mapping[a]
            elif isinstance(a, FloorDiv):
                rep = _floordiv(a.expr.substitute(mapping, bounds), a.c, bounds)
            elif isinstance(a, Mod):
                rep = _mod(a.expr.substitute(mapping, bounds), a.c, bounds)
            elif isinstance(a, Load):
                rep = Expr.of(dataclasses.replace(a, index=tuple(e.substitute(mapping, bounds) for e in a.index)))
            else:
                rep = Expr.of(a)
            out = out + rep * k
        return out

    def evaluate(self, at: "Point", xp: Any = np, bounds: Bounds | None = None) -> Any:
        """The expression's value at the point ``at`` (arrays or scalars bound to dims/symbols),
        computed with the array module ``xp`` (numpy or jax.numpy): only ``+``, ``*`` by
        constants and ``floordiv``/``mod`` by constants, so one code path serves both.

        Under jax, operands ``bounds`` prove non-negative use truncating ``lax.div``/``lax.rem``
        (cheaper than floor semantics in a kernel, and identical when the operand cannot be
        negative); numpy and unproven operands use floor semantics.
        """
        val: Any = self.const
        for a, k in self.terms:
            if isinstance(a, (Dim, Sym)):
                v = at[a]
            elif isinstance(a, Load):
                v = _read(a, at, xp, bounds)
            else:
                inner = a.expr.evaluate(at, xp, bounds)
                nonneg = bounds is not None and a.expr.range(bounds)[0] >= 0
                v = _div_or_mod(inner, a.c, isinstance(a, FloorDiv), nonneg, xp)
            val = val + (v if k == 1 else v * k)
        return val

    def __str__(self) -> str:
        parts = []
        for a, k in self.terms:
            s = str(a)
            parts.append(s if k == 1 else f"-{s}" if k == -1 else f"{s}*{k}")
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts).replace("+ -", "- ")

    __repr__ = __str__


def _recombine(coeffs: Mapping[Atom, int], c: int) -> tuple[dict[Atom, int], int]:
    """Fold ``k*c*(e floordiv c) + k*(e mod c)`` back into ``k*e`` (exact for floor semantics).

    This is what makes a reshape of a reshape, or the flat offset of an unravelled index, collapse
    back to plain strides (``(d0 floordiv 6)*6 + d0 mod 6 -> d0``).
    """
    out = {a: k for a, k in coeffs.items() if k != 0}
    changed = True
    while changed:
        changed = False
        for a in [a for a in out if isinstance(a, Mod)]:
            k, fd = out.get(a, 0), FloorDiv(a.expr, a.c)
            if k == 0 or out.get(fd, 0) != k * a.c:
                continue
            del out[a], out[fd]
            for b, kb in a.expr.terms:
                out[b] = out.get(b, 0) + k * kb
            out = {b: kb for b, kb in out.items() if kb != 0}
            c += k * a.expr.const
            changed = True
            break
    return out, c


def _div_or_mod(x: Any, c: int, is_div: bool, nonneg: bool, xp: Any) -> Any:
    if xp is np or not hasattr(x, "dtype") or not nonneg:
        return x // c if is_div else x % c
    from jax import lax  # only needed for jnp evaluation
    cc = np.asarray(c, dtype=x.dtype)
    return lax.div(x, cc) if is_div else lax.rem(x, cc)


def _read(a: Load, at: "Point", xp: Any, bounds: Bounds | None) -> Any:
    """The value of a table read at ``at`` (see :class:`Load`): index lanes outside the table
    (lanes a mask drops) are clipped into it, so they never read out of bounds."""
    table = at[Sym(a.table)]
    if hasattr(table, "read"):           # inside a kernel: the kernel's own table reader
        return table.read(a, bounds)
    idx = tuple(xp.clip(e.evaluate(at, xp, bounds), 0, n - 1) for e, n in zip(a.index, table.shape))
    if idx:
        idx = tuple(xp.broadcast_arrays(*idx)) if len(idx) > 1 else idx
    v = table[idx] if idx else table
    return finish_read(a, v, xp)


def finish_read(a: Load, v: Any, xp: Any) -> Any:
    """What a :class:`Load` makes of the table element ``v``: wrap a negative value, clamp."""
    if a.wrap:
        v = xp.where(v < 0, v + a.wrap, v)
    return xp.clip(v, a.lo, a.hi)


def _atom_range(a: Atom, bounds: Bounds) -> tuple[float, float]:
    if isinstance(a, (Dim, Sym)):
        return bounds.get(a, (-math.inf, math.inf))
    if isinstance(a, Load):
        return a.lo, a.hi
    lo, hi = a.expr.range(bounds)
    if isinstance(a, FloorDiv):
        return (math.floor(lo / a.c) if lo > -math.inf else -math.inf,
                math.floor(hi / a.c) if hi < math.inf else math.inf)
    if lo >= 0 and hi < a.c:
        return lo, hi
    return 0, a.c - 1


@functools.lru_cache(maxsize=4096)
def _divisors_desc(c: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(c) + 1) if c % d == 0]
    return tuple(sorted(set(small + [c // d for d in small]), reverse=True))


def _split_by(e: Expr, d: int) -> tuple[Expr, Expr]:
    """e = d*big + small, with big's terms exactly those whose coefficient d divides."""
    big = {a: k // d for a, k in e.terms if k % d == 0}
    small = {a: k for a, k in e.terms if k % d != 0}
    return Expr._make(big, e.const // d), Expr._make(small, e.const % d)


def _floordiv(e: Expr, c: int, bounds: Bounds) -> Expr:
    if c <= 0:
        raise ValueError("floordiv by a non-positive constant")
    if c == 1:
        return e
    q, r = _split_by(e, c)  # (c*q + r) floordiv c == q + r floordiv c, exactly
    if q.terms or q.const:
        return q + _floordiv(r, c, bounds)
    for d in _divisors_desc(c):
        if d == 1:
            break
        big, small = _split_by(e, d)
        lo, hi = small.range(bounds)
        if lo >= 0 and hi < d:  # small contributes nothing to e // d
            return big if d == c else _floordiv(big, c // d, bounds)
    if len(e.terms) == 1 and e.const == 0 and e.terms[0][1] == 1 and isinstance(e.terms[0][0], FloorDiv):
        inner = e.terms[0][0]
        return _floordiv(inner.expr, inner.c * c, bounds)
    lo, hi = e.range(bounds)
    if lo >= 0 and hi < c:
        return Expr.of(0)
    return Expr.of(FloorDiv(e, c))


def _mod(e: Expr, c: int, bounds: Bounds) -> Expr:
    if c <= 0:
        raise ValueError("mod by a non-positive constant")
    if c == 1:
        return Expr.of(0)
    big, small = _split_by(e, c)  # terms with coefficients divisible by c vanish
    e = small
    for d in _divisors_desc(c):
        if d == 1:
            break
        big, small = _split_by(e, d)
        lo, hi = small.range(bounds)
        if lo >= 0 and hi < d:
            if d == c:
                return small
            return _mod(big, c // d, bounds) * d + small
    if len(e.terms) == 1 and e.const == 0 and e.terms[0][1] == 1 and isinstance(e.terms[0][0], Mod):
        inner = e.terms[0][0]
        if inner.c % c == 0:
            return _mod(inner.expr, c, bounds)
    lo, hi = e.range(bounds)
    if lo >= 0 and hi < c:
        return e
    return Expr.of(Mod(e, c))


def dim(i: int) -> Expr:
    return Expr.of(Dim(i))


def sym(name: str) -> Expr:
    return Expr.of(Sym(name))


def const(c: int) -> Expr:
    return Expr.of(int(c))


# --------------------------------------------------------------------------------------------
# Index maps
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cond:
    """Element valid iff ``lo <= expr < hi`` (the masks that ``pad`` introduces)."""
    expr: Expr
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.lo} <= {self.expr} < {self.hi}"


# --------------------------------------------------------------------------------------------
# Evaluation: one evaluator, the array module a parameter
# --------------------------------------------------------------------------------------------

Point = Mapping[Atom, Any]
"""Where an expression is evaluated: a value (an index array, or a scalar) for every atom
``Dim(i)`` / ``Sym(name)`` it uses. The values' array module decides how it is computed."""


def point(indices: Sequence[Any], symbols: Mapping[str, Any] | None = None) -> dict[Atom, Any]:
    """The :data:`Point` of virtual index arrays ``indices`` (``d_0, d_1, ...``) and runtime
    symbols by name."""
    at: dict[Atom, Any] = {Dim(i): x for i, x in enumerate(indices)}
    at.update({Sym(k): v for k, v in (symbols or {}).items()})
    return at


def all_of(masks: Iterable[Any]) -> Any:
    """The conjunction of lane masks: the one place a list of conditions becomes one mask.

    None means "every lane" and drops out, as does a static truth (a condition the evaluator
    decided while tracing, e.g. one on Python-int symbols, arrives as a Python/numpy bool); a
    static False is returned as ``False`` (callers broadcast it). None when nothing constrains,
    so callers skip the select entirely (a kernel then emits no mask at all).
    """
    out = None
    for m in masks:
        if m is None or (isinstance(m, (bool, np.bool_)) and m):
            continue
        if isinstance(m, (bool, np.bool_)):
            return False
        out = m if out is None else out & m
    return out


def conds_mask(conds: Iterable[Cond], at: Point, xp: Any = np, bounds: Bounds | None = None,
               given: Any = None) -> Any:
    """Where every ``lo <= expr < hi`` of ``conds`` holds at ``at`` (None: no conditions).
    ``bounds`` let non-negative floordiv/mod use truncating division under jax (see
    :meth:`Expr.evaluate`). ``given``: a mask already known (a kernel block's in-bounds lanes),
    joined first and in the same chain — one flat conjunction, which is what the kernels emitted
    before this helper existed (regrouping the ``and``s changed ptxas's register allocation: a
    depthwise conv went from 32 to 45 registers)."""
    def one(c: Cond) -> Any:
        v = c.expr.evaluate(at, xp, bounds)
        return (v >= c.lo) & (v < c.hi)
    return all_of([given, *(one(c) for c in conds)])


@dataclass(frozen=True)
class SymInfo:
    """A runtime scalar and its range (already clamped the way lax clamps dynamic starts).

    ``source`` is the graph tensor holding the scalar (None for symbols a kernel test makes up).
    A ``shape`` makes it a table (an integer array :class:`Load` atoms read; ``lo``/``hi`` are
    then unused: each read carries its own clamp)."""
    name: str
    lo: int
    hi: int
    source: int | None = None
    shape: tuple[int, ...] = ()
    # lax's wrap of a negative dynamic start (``i + dim`` where ``i < 0``), folded into the symbol
    # so the raw index is its source (0: none): ``normalise`` applies it before the clamp
    wrap: int = 0

    @property
    def is_table(self) -> bool:
        return bool(self.shape)

    @property
    def bounds(self) -> tuple[int, int, int]:
        """(lo, hi, wrap): what :meth:`normalise` needs, for a kernel that clamps the raw value."""
        return self.lo, self.hi, self.wrap

    def normalise(self, v: Any, xp: Any = np) -> Any:
        """The symbol's value from its source's: wrapped (``wrap``) and clamped to [lo, hi]."""
        return normalise_start(v, self.bounds, xp)


def normalise_start(v: Any, bounds: tuple[int, int, int], xp: Any = np) -> Any:
    """A dynamic start as lax takes it: ``v + wrap`` if ``v < 0`` (with a ``wrap``), then clamped to
    ``[lo, hi]``. One definition for the XLA side (``lower``) and the kernels (``vio``)."""
    lo, hi, wrap = (int(b) for b in bounds)
    dt = getattr(v, "dtype", None)
    c = (lambda k: k) if dt is None else (lambda k: xp.asarray(k, dt))   # no weak-typed literals
    if wrap:
        v = xp.where(v < c(0), v + c(wrap), v)
    return xp.clip(v, c(lo), c(hi))


@dataclass(frozen=True)
class Contiguity:
    """Paper §4.3: minimal contiguous dimension and the contiguous run it gives."""
    min_contiguous_dim: int   # 0-based; 0 means fully contiguous
    run_elems: int
    run_bytes: int
    full: bool

    def partial(self, unit_bytes: int = 32) -> bool:
        """Partially contiguous: each run covers at least one memory transaction (32 B sector)."""
        return self.run_bytes >= unit_bytes


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= int(n)
    return tuple(reversed(out))


class Movements:
    """One method per movement primitive, shared by :class:`IndexMap` and :class:`Layout`.

    Each builds the primitive's own map (new index -> old index) and hands it to ``_movement``,
    which composes it with whatever the receiver already describes.
    """
    _shape: tuple[int, ...]

    def _movement(self, new_domain: Sequence[int], exprs: Sequence[Expr], conds: Sequence[Cond] = (),
                  fill: float | None = None, syms: Sequence[SymInfo] = ()) -> Any:
        inner = IndexMap(tuple(int(n) for n in new_domain), tuple(exprs), self._shape, tuple(conds),
                         fill, tuple(syms))
        return self.compose(inner)

    def compose(self, inner: "IndexMap") -> Any:
        raise NotImplementedError

    # -- one method per movement primitive ----------------------------------------------------
    def transpose(self, perm: Sequence[int]) -> Any:
        perm = tuple(int(p) for p in perm)
        new = tuple(self._shape[p] for p in perm)
        inv = [0] * len(perm)
        for k, p in enumerate(perm):
            inv[p] = k
        return self._movement(new, [dim(inv[j]) for j in range(len(perm))])

    def reshape(self, new_shape: Sequence[int]) -> Any:
        new_shape = tuple(int(n) for n in new_shape)
        if math.prod(new_shape) != math.prod(self._shape):
            raise ValueError(f"cannot reshape {self._shape} to {new_shape}")
        b = {Dim(i): (0, n - 1) for i, n in enumerate(new_shape)}
        flat = sum((dim(i) * s for i, s in enumerate(row_major_strides(new_shape))), const(0))
        old_strides = row_major_strides(self._shape)
        exprs = [flat.floordiv(s, b).mod(n, b) for s, n in zip(old_strides, self._shape)]
        return self._movement(new_shape, exprs)

    def broadcast(self, shape: Sequence[int], broadcast_dimensions: Sequence[int]) -> Any:
        """``broadcast_in_dim``: many virtual elements read one physical element (read side only)."""
        shape = tuple(int(n) for n in shape)
        exprs = [const(0) if self._shape[j] == 1 and shape[bd] != 1 else dim(bd)
                 for j, bd in enumerate(broadcast_dimensions)]
        return self._movement(shape, exprs)

    def slice(self, start: Sequence[int], limit: Sequence[int], strides: Sequence[int] | None = None) -> Any:
        strides = tuple(strides) if strides else (1,) * len(start)
        new = tuple(max(0, -(-(l - s) // st)) for s, l, st in zip(start, limit, strides))
        return self._movement(new, [dim(i) * st + s for i, (s, st) in enumerate(zip(start, strides))])

    def dynamic_slice(self, starts: Sequence[Expr | int], sizes: Sequence[int],
                      syms: Sequence[SymInfo] = ()) -> Any:
        """``starts`` are expressions over runtime symbols, already clamped (``syms`` give ranges)."""
        return self._movement(sizes, [dim(i) + Expr.of(s) for i, s in enumerate(starts)], syms=syms)

    def offset(self, axis: int, amount: Expr | int, size: int, syms: Sequence[SymInfo] = ()) -> Any:
        """A window of ``size`` along ``axis`` starting at ``amount`` (concat/split pieces, DUS)."""
        new = list(self._shape)
        new[axis] = int(size)
        exprs = [dim(i) + (Expr.of(amount) if i == axis else 0) for i in range(len(new))]
        return self._movement(new, exprs, syms=syms)

    def rev(self, dims: Iterable[int]) -> Any:
        dims = set(int(d) for d in dims)
        return self._movement(self._shape, [const(n - 1) - dim(i) if i in dims else dim(i)
                                            for i, n in enumerate(self._shape)])

    def pad(self, lo: Sequence[int], hi: Sequence[int], interior: Sequence[int], fill: float) -> Any:
        """``lax.pad``: the padded tensor reads the original where the mask holds, else ``fill``."""
        new, exprs, conds = [], [], []
        b: dict[Atom, tuple[int, int]] = {}
        for i, (n, l, h, it) in enumerate(zip(self._shape, lo, hi, interior)):
            size = l + h + n + max(n - 1, 0) * it
            new.append(size)
            b[Dim(i)] = (0, size - 1)
        for i, (n, l, it) in enumerate(zip(self._shape, lo, interior)):
            shifted = dim(i) - l
            step = it + 1
            exprs.append(shifted.floordiv(step, b) if step > 1 else shifted)
            conds.append(Cond(shifted, 0, (n - 1) * step + 1))
            if step > 1:
                conds.append(Cond(shifted.mod(step, b), 0, 1))
        return self._movement(new, exprs, _prune_conds(conds, b), float(fill))

    def squeeze(self, dims: Iterable[int]) -> Any:
        dims = set(int(d) for d in dims)
        keep = [i for i in range(len(self._shape)) if i not in dims]
        pos = {j: k for k, j in enumerate(keep)}
        return self._movement([self._shape[j] for j in keep],
                              [dim(pos[j]) if j in pos else const(0) for j in range(len(self._shape))])

    def expand_dims(self, dims: Iterable[int]) -> Any:
        dims = sorted(int(d) for d in dims)
        rank = len(self._shape) + len(dims)
        old = [i for i in range(rank) if i not in dims]
        new = [1] * rank
        for j, i in enumerate(old):
            new[i] = self._shape[j]
        return self._movement(new, [dim(i) for i in old])


@dataclass(frozen=True)
class IndexMap(Movements):
    """Map from a virtual tensor's indices (``domain``) onto a physical tensor (``target``).

    Methods named after movement primitives return the map of the moved tensor onto the same
    target: ``m.transpose(p)`` describes ``transpose(V, p)`` where ``V`` is what ``m`` describes.
    """
    domain: tuple[int, ...]
    exprs: tuple[Expr, ...]
    target: tuple[int, ...]
    conds: tuple[Cond, ...] = ()
    fill: float | None = None
    syms: tuple[SymInfo, ...] = ()

    def __post_init__(self) -> None:
        if len(self.exprs) != len(self.target):
            raise ValueError(f"{len(self.exprs)} expressions for a rank-{len(self.target)} target")

    # -- basics -------------------------------------------------------------------------------
    @staticmethod
    def identity(shape: Sequence[int]) -> "IndexMap":
        shape = tuple(int(s) for s in shape)
        return IndexMap(shape, tuple(dim(i) if s != 1 else const(0) for i, s in enumerate(shape)), shape)

    @property
    def bounds(self) -> dict[Atom, tuple[int, int]]:
        b: dict[Atom, tuple[int, int]] = {Dim(i): (0, n - 1) for i, n in enumerate(self.domain)}
        b.update({Sym(s.name): (s.lo, s.hi) for s in self.syms if not s.is_table})
        return b

    @property
    def is_identity(self) -> bool:
        return (self.domain, self.exprs, self.conds) == (self.target, IndexMap.identity(self.domain).exprs, ())

    @property
    def _shape(self) -> tuple[int, ...]:
        return self.domain

    def compose(self, inner: "IndexMap", refine: Sequence[Cond] = ()) -> "IndexMap":
        """``self ∘ inner``: inner maps X -> self.domain, the result maps X -> self.target.

        ``refine`` are conditions known to hold on X (a piece's membership box): they tighten
        the index ranges used to simplify floordiv/mod, never change the result.
        """
        if tuple(inner.target) != tuple(self.domain):
            raise NotComposable(f"cannot compose: inner target {inner.target} != domain {self.domain}")
        if self.conds and inner.conds and self.fill != inner.fill:
            raise NotComposable("two masks with different fill values")
        syms = _merge_syms(self.syms, inner.syms)
        b: dict[Atom, tuple[int, int]] = {Dim(i): (0, n - 1) for i, n in enumerate(inner.domain)}
        b.update({Sym(s.name): (s.lo, s.hi) for s in syms if not s.is_table})
        b = _refine_bounds(b, refine)
        sub = {Dim(i): e for i, e in enumerate(inner.exprs)}
        exprs = tuple(e.substitute(sub, b) for e in self.exprs)
        conds = list(inner.conds) + [Cond(c.expr.substitute(sub, b), c.lo, c.hi) for c in self.conds]
        conds = _prune_conds(conds, b)
        fill = self.fill if self.conds else inner.fill
        # size-1 domain dims are always index 0: drop them from the expressions.
        zero = {Dim(i): const(0) for i, n in enumerate(inner.domain) if n == 1}
        if zero:
            exprs = tuple(e.substitute(zero, b) for e in exprs)
            conds = _prune_conds([Cond(c.expr.substitute(zero, b), c.lo, c.hi) for c in conds], b)
        return IndexMap(inner.domain, exprs, self.target, tuple(conds), fill if conds else None, syms)

    def restrict(self, box: Sequence[tuple[int, int]]) -> "IndexMap":
        """The map seen from inside ``box`` (box-relative indices): a piece's local view."""
        return self._movement([hi - lo for lo, hi in box], [dim(i) + lo for i, (lo, _) in enumerate(box)])

    # -- evaluation ---------------------------------------------------------------------------
    def targets(self, at: Point, xp: Any = np, each: Callable[[Any], Any] | None = None) -> tuple[Any, ...]:
        """The target index of every target dim at the point ``at`` (see :func:`point`).
        ``each`` is applied to each index as soon as it is computed (a kernel broadcasting it to
        its block: the emitted ops stay in per-dim order, which ptxas's allocation is sensitive to)."""
        b = self.bounds
        return tuple(e.evaluate(at, xp, b) if each is None else each(e.evaluate(at, xp, b)) for e in self.exprs)

    def valid(self, at: Point, xp: Any = np) -> Any:
        """Where the map's own conditions (a ``pad``'s mask) hold at ``at``; None: everywhere."""
        return conds_mask(self.conds, at, xp, self.bounds)

    def evaluate(self, at: Point, xp: Any = np) -> tuple[tuple[Any, ...], Any]:
        """``(targets(at), valid(at))``: where the point lands and whether it lands at all."""
        return self.targets(at, xp), self.valid(at, xp)

    def flat_offsets(self, at: Point, xp: Any = np, strides: Sequence[int] | None = None,
                     base: Any = 0) -> Any:
        """The flat physical offset ``base + Σ target_k * stride_k`` at ``at`` (row-major target
        strides by default). Lanes where :meth:`valid` fails, or outside the domain, get
        whatever offset they compute: callers mask them. ``base`` fixes the result's shape and
        dtype where the caller needs them (a kernel's int32 block of zeros)."""
        strides = tuple(strides) if strides is not None else row_major_strides(self.target)
        b = self.bounds
        off = base
        for e, s in zip(self.exprs, strides):
            if s:
                off = off + e.evaluate(at, xp, b) * s
        return off

    # -- analysis -----------------------------------------------------------------------------
    def flat_expr(self) -> Expr:
        """The physical element offset as one expression (row-major target)."""
        acc = const(0)
        for e, s in zip(self.exprs, row_major_strides(self.target)):
            acc = acc + e * s
        return acc

    def contiguity(self, itemsize: int) -> Contiguity:
        """Minimal contiguous dimension (paper Def. 3) of the map, from the simplified offset.

        Dimension ``d`` is contiguous when every dim ``i >= d`` appears only as a bare index with
        coefficient equal to the suffix product of the domain, and no floordiv/mod atom involves
        those dims (so the bias is constant once the outer indices are fixed).
        """
        flat = self.flat_expr()
        compound_dims: set[int] = set()
        for a, _ in flat.terms:
            if isinstance(a, (FloorDiv, Mod, Load)):
                compound_dims |= Expr.of(a).dims()
        cond_dims: set[int] = set()
        for c in self.conds:
            cond_dims |= c.expr.dims()
        d, run = len(self.domain), 1
        for i in reversed(range(len(self.domain))):
            n = self.domain[i]
            if n == 1:
                d = i
                continue
            if i in compound_dims or i in cond_dims or flat.coeff(Dim(i)) != run:
                break
            run *= n
            d = i
        full = d == 0 or all(n == 1 for n in self.domain[:d])
        return Contiguity(0 if full else d, run, run * itemsize, full)

    def strided_box(self) -> tuple[tuple[int | None, int, Expr], ...] | None:
        """Per target dim ``(domain dim or None, stride, offset)`` when the map is a strided box.

        That is the case a kernel can serve with ``ref.at[pl.ds(...)]`` plus an in-register
        transpose instead of a gather: every target index is ``offset + stride*d_j`` for at most
        one distinct domain dim ``j`` (offsets may contain runtime symbols, not dims).
        """
        if self.conds:
            return None
        out, used = [], set()
        for e in self.exprs:
            dims = [(a, k) for a, k in e.terms if isinstance(a, Dim)]
            rest = Expr._make({a: k for a, k in e.terms if not isinstance(a, Dim)}, e.const)
            if rest.dims() or len(dims) > 1:
                return None
            if dims:
                (a, k), = dims
                if a.i in used:
                    return None
                used.add(a.i)
                out.append((a.i, k, rest))
            else:
                out.append((None, 0, rest))
        return tuple(out)

    def __str__(self) -> str:
        ds = ", ".join(f"d{i}" for i in range(len(self.domain)))
        s = f"({ds}) -> ({', '.join(str(e) for e in self.exprs)})"
        if self.conds:
            s += f" if {' and '.join(str(c) for c in self.conds)} else {self.fill}"
        return s


def _merge_syms(a: Sequence[SymInfo], b: Sequence[SymInfo]) -> tuple[SymInfo, ...]:
    out = {s.name: s for s in a}
    for s in b:
        if out.get(s.name, s) != s:  # a symbol is a clamped value: two clamps are two values
            raise NotComposable(f"symbol {s.name} used with two ranges: {out[s.name]} and {s}")
        out[s.name] = s
    return tuple(sorted(out.values(), key=lambda s: s.name))


def _normalise_cond(c: Cond, bounds: Bounds) -> Cond:
    """``lo <= k*q + r < hi`` with ``0 <= r < k`` and ``k | lo, hi`` is ``lo/k <= q < hi/k``."""
    g = math.gcd(c.lo, c.hi)
    for d in _divisors_desc(g) if g > 1 else ():
        if d == 1:
            break
        big, small = _split_by(c.expr, d)
        lo, hi = small.range(bounds)
        if lo >= 0 and hi < d:
            return Cond(big, c.lo // d, c.hi // d)
    return c


def _prune_conds(conds: Sequence[Cond], bounds: Bounds) -> list[Cond]:
    """Drop conditions the index ranges already guarantee."""
    out = []
    for c in map(lambda c: _normalise_cond(c, bounds), conds):
        lo, hi = c.expr.range(bounds)
        if lo >= c.lo and hi < c.hi:
            continue
        if c not in out:
            out.append(c)
    return out


def _refine_bounds(bounds: dict[Atom, tuple[int, int]], conds: Sequence[Cond]) -> dict[Atom, tuple[int, int]]:
    """Tighten dim ranges with conditions of the form ``lo <= d_i + c < hi``."""
    out = dict(bounds)
    for c in conds:
        if len(c.expr.terms) == 1 and c.expr.terms[0][1] == 1 and isinstance(c.expr.terms[0][0], Dim):
            a = c.expr.terms[0][0]
            lo, hi = out.get(a, (-math.inf, math.inf))
            out[a] = (max(lo, c.lo - c.expr.const), min(hi, c.hi - 1 - c.expr.const))
    return out


def union_shape(shapes: Iterable[Sequence[int]]) -> tuple[int, ...] | None:
    """The smallest index space holding every one of ``shapes`` at its origin (one rank; each
    extent the largest), where it has no more elements than the shapes together: one grid then
    serves kernels of several output shapes, each output's lanes beyond its own extent masked (a
    decode step's q and k rotations, ``(B, 1, H, D)`` and ``(B, 1, KV, D)``, in one launch). None
    for shapes of different ranks, or a union larger than them together (``(1, N)`` and ``(N, 1)``)."""
    shapes = [tuple(int(n) for n in s) for s in shapes]
    if not shapes or len({len(s) for s in shapes}) != 1:
        return None
    union = tuple(max(ns) for ns in zip(*shapes)) if shapes[0] else ()
    return union if math.prod(union) <= sum(math.prod(s) for s in set(shapes)) else None


def box_conds(box: Sequence[tuple[int, int]], shape: Sequence[int]) -> tuple[Cond, ...]:
    """Membership conditions of a box, omitting dims the box spans entirely."""
    return tuple(Cond(dim(i), lo, hi) for i, ((lo, hi), n) in enumerate(zip(box, shape)) if (lo, hi) != (0, n))


@dataclass(frozen=True)
class Piece:
    """Part of a virtual tensor: where ``where`` holds, index ``x`` lives in ``target`` at ``map(x)``.

    ``map`` takes the virtual index itself (not piece-relative), so composing a movement op onto a
    layout is the same substitution for the map and for the membership conditions.
    """
    target: int
    map: IndexMap
    where: tuple[Cond, ...] = ()

    def holds(self, at: Point, xp: Any = np, given: Any = None) -> Any:
        """Where this piece holds a valid element at ``at``: its membership and its map's own
        conditions (both may involve runtime symbols; a symbol-only condition gives a scalar),
        and ``given`` (see :func:`conds_mask`). None: everywhere."""
        return conds_mask(self.where + self.map.conds, at, xp, self.map.bounds, given)

    def box(self) -> tuple[tuple[int, int], ...] | None:
        """The membership as a static box, when it is one (the common concat/split case)."""
        b = _refine_bounds({Dim(i): (0, n - 1) for i, n in enumerate(self.map.domain)}, self.where)
        if len(_prune_conds(self.where, b)) != 0:
            return None
        return tuple((int(b[Dim(i)][0]), int(b[Dim(i)][1]) + 1) for i in range(len(self.map.domain)))


@dataclass(frozen=True)
class FillRegion:
    """Where ``where`` holds (over the virtual index) and no piece holds a valid element, the
    tensor reads ``value``: the border a ``pad`` added. Regions are per part of a layout, so a
    concatenation of two pads with different fills keeps each pad's own value."""
    where: tuple[Cond, ...]
    value: float

    def holds(self, at: Point, xp: Any = np, given: Any = None) -> Any:
        """Where the region holds at ``at`` (and ``given``, see :func:`conds_mask`); None: everywhere."""
        return conds_mask(self.where, at, xp, None, given)


@dataclass(frozen=True)
class Layout(Movements):
    """A tensor's layout: physical (one identity piece) or virtual (pieces onto physical tensors).

    This is the paper's virtual tensor ``(F, {P_1..P_n})``: ``F`` is the piecewise map, the
    pieces' targets are the ``P_j``. Movement methods return the layout of the moved tensor.
    An element is read from the first piece whose membership (``where``) and map conditions hold;
    an element no piece holds (only ``pad`` makes them) reads the value of the first
    :class:`FillRegion` containing it (0 if none). Piece maps' own ``fill`` is not consulted.
    """
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    fills: tuple[FillRegion, ...] = ()

    @staticmethod
    def physical(target: int, shape: Sequence[int]) -> "Layout":
        shape = tuple(int(n) for n in shape)
        return Layout(shape, (Piece(target, IndexMap.identity(shape)),))

    @property
    def _shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def targets(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(p.target for p in self.pieces))

    def compose(self, inner: IndexMap) -> "Layout":
        """The layout of a tensor whose index ``x`` is this tensor's index ``inner(x)``."""
        b = inner.bounds
        sub = {Dim(i): e for i, e in enumerate(inner.exprs)}
        pieces = []
        for p in self.pieces:
            where = tuple(_prune_conds([Cond(c.expr.substitute(sub, b), c.lo, c.hi) for c in p.where], b))
            if any(_never(c, b) for c in where):
                continue
            # inside a layout the fill comes from the regions: piece maps may carry any fill
            m = inner if not (p.map.conds and inner.conds) else dataclasses.replace(inner, fill=p.map.fill)
            pieces.append(Piece(p.target, p.map.compose(m, refine=where), where))
        fills = []
        for r in self.fills:   # an old border is only where the new map lands inside the old tensor
            where = tuple(_prune_conds([Cond(c.expr.substitute(sub, b), c.lo, c.hi) for c in r.where]
                                       + list(inner.conds), b))
            if not any(_never(c, b) for c in where):
                fills.append(FillRegion(where, r.value))
        if inner.conds:
            fills.append(FillRegion((), float(inner.fill if inner.fill is not None else 0.0)))
        return Layout(inner.domain, tuple(pieces), _dedupe_fills(fills))

    def restrict_box(self, box: Sequence[tuple[int, int]]) -> "Layout":
        """The same layout, with membership limited to ``box`` (one edge of a concat/split)."""
        extra = box_conds(box, self.shape)
        return Layout(self.shape, tuple(Piece(p.target, p.map, tuple(dict.fromkeys(p.where + extra)))
                                        for p in self.pieces),
                      tuple(FillRegion(tuple(dict.fromkeys(r.where + extra)), r.value) for r in self.fills))

    @staticmethod
    def assemble(shape: Sequence[int], parts: Sequence[tuple["Layout", IndexMap, Sequence[tuple[int, int]]]]) -> "Layout":
        """The one composition rule for a virtual tensor: ``parts`` are ``(target layout, map from
        this tensor onto the target, box of this tensor the part covers)``; each part is the
        target's layout composed with the map, restricted to its box (pieces and fill regions)."""
        return Layout.union(shape, [Layout.part(base, m, box) for base, m, box in parts])

    @staticmethod
    def part(base: "Layout", m: IndexMap, box: Sequence[tuple[int, int]]) -> "Layout":
        """One part of :meth:`assemble` (cacheable on its own: the cost model re-uses parts)."""
        lay = base.compose(m)
        if any((lo, hi) != (0, n) for (lo, hi), n in zip(box, lay.shape)):
            lay = lay.restrict_box(box)
        return lay

    @staticmethod
    def union(shape: Sequence[int], parts: Sequence["Layout"]) -> "Layout":
        """Disjoint parts (from :meth:`part`) as one layout."""
        if len(parts) == 1:
            return parts[0]
        return Layout(tuple(int(n) for n in shape), tuple(p for lay in parts for p in lay.pieces),
                      _dedupe_fills([r for lay in parts for r in lay.fills]))

    @staticmethod
    def concatenate(layouts: Sequence["Layout"], axis: int) -> "Layout":
        """Layout of ``concatenate(layouts, axis)``: each operand becomes pieces in its slab."""
        total = sum(l.shape[axis] for l in layouts)
        shape = list(layouts[0].shape)
        shape[axis] = total
        parts = []
        off = 0
        for l in layouts:
            n = l.shape[axis]
            m = IndexMap(tuple(shape), tuple(dim(i) - (off if i == axis else 0) for i in range(len(shape))),
                         l.shape)
            box = [(0, s) for s in shape]
            box[axis] = (off, off + n)
            parts.append((l, m, box))
            off += n
        return Layout.assemble(shape, parts)

    def gather(self, at: Point, buffers: Mapping[int, Any], dtype: Any, xp: Any = np) -> Any:
        """The tensor's elements at the point ``at`` (index arrays spanning the whole tensor),
        read from its physical buffers with the array module ``xp``: numpy for the reference
        semantics (:meth:`evaluate`), ``jax.numpy`` where XLA must read a virtual tensor
        element-wise. Fill regions first (the first containing a lane wins), then each piece
        where it holds; target indices are clipped so that lanes a piece does not hold never
        read out of bounds."""
        shape = self.shape
        out = xp.zeros(shape, dtype)
        for r in reversed(self.fills):
            m = r.holds(at, xp)
            out = xp.where(True if m is None else m, xp.asarray(r.value, dtype), out)
        for p in self.pieces:
            tgt, m = p.map.targets(at, xp), p.holds(at, xp)
            buf = buffers[p.target]
            if buf.ndim:
                got = buf[tuple(xp.clip(xp.broadcast_to(t, shape), 0, n - 1) for t, n in zip(tgt, buf.shape))]
            else:
                got = xp.broadcast_to(buf, shape)
            got = got.astype(dtype)
            out = got if m is None else xp.where(m, got, out)
        return out

    def evaluate(self, buffers: Mapping[int, np.ndarray], symbols: Mapping[str, Any] | None = None) -> np.ndarray:
        """Materialise the tensor from physical buffers with numpy (the reference semantics)."""
        dtype = np.result_type(*[buffers[p.target].dtype for p in self.pieces]) if self.pieces else np.float32
        idx = list(np.indices(self.shape, dtype=np.int64)) if self.shape else []
        return np.asarray(self.gather(point(idx, symbols), buffers, dtype, np))

    def __str__(self) -> str:
        s = " | ".join(f"t{p.target}{list(p.box() or p.where)}: {p.map}" for p in self.pieces)
        for r in self.fills:
            s += f" | {r.value} where {' and '.join(str(c) for c in r.where) or 'elsewhere'}"
        return s


def _dedupe_fills(fills: Sequence[FillRegion]) -> tuple[FillRegion, ...]:
    """Drop regions after an unconditional one (never reached) and exact repeats."""
    out: list[FillRegion] = []
    for r in fills:
        if r in out:
            continue
        out.append(r)
        if not r.where:
            break
    return tuple(out)


def _never(c: Cond, bounds: Bounds) -> bool:
    lo, hi = c.expr.range(bounds)
    return hi < c.lo or lo >= c.hi
