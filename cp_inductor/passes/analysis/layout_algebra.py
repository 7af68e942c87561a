"""Logical layout algebra: where each element of a tensor comes from, through views and all-to-alls.

A tensor's layout is a list of dims; each dim is a list of factors, outer to inner. A factor
``(axis, stride, size)`` is a run of ``size`` indices of a source axis spaced ``stride`` apart, so
a dim's index decomposes mixed-radix into its factors. Reshapes split and merge factors, permutes
reorder dims; neither looks at memory strides, because the algebra tracks logical indices.

SPMD adds one more thing: the factor ``pinned`` whose index is this rank. A sequence-sharded
source starts with ``pinned = RANK`` (the rank axis of the global sequence). An equal-split
``all_to_all_single`` sends chunk j of dim 0 to rank j and stacks what it receives by source rank,
so it swaps the outer cp-sized factor of dim 0 with ``pinned``: after a Ulysses scatter the head
block is pinned and dim 0 enumerates source ranks, i.e. the sequence's outer factor.

Two kinds of factor name a derived axis: ``("slice", axis, stride, offset)``, a run cut out of
a factor that is no aligned block of it (q, k or v heads cut from a fused heads dim), and
``("replicated", axis, k)``, a rank block over broadcast copies where k ranks hold each index
(K/V heads replicated before the collective, fewer than cp). :func:`base_axis` gives the source
axis of either.

This is what lets detection check the algebra instead of one op sequence: any chain of
reshape/permute/contiguous around any 4-D, 5-D or flattened all-to-all is accepted iff the
layout that reaches attention is the Ulysses one.

Sizes and strides may be symbolic (:mod:`sym_sizes`): a factor of ``s0`` tokens splits or merges
only where the split provably divides it for every ``s0``, so what holds at the traced sizes holds
at every size the compiled graph runs with.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, replace

import sympy
import torch

from .sym_sizes import NotASize, equal, exact_div, hint, less, prod, size_of, sizes_of

aten = torch.ops.aten
prims = torch.ops.prims


class LayoutError(Exception):
    """The chain does something the algebra cannot follow (the caller skips the match)."""


@dataclass(frozen=True)
class Factor:
    axis: object
    stride: int
    size: int

    def __post_init__(self):
        # Symbolic sizes in the environment's current form (a guard since may have equated two).
        for name in ("stride", "size"):
            if not isinstance(getattr(self, name), int):
                object.__setattr__(self, name, size_of(getattr(self, name)))

    def refreshed(self) -> "Factor":
        return self if isinstance(self.size, int) and isinstance(self.stride, int) else Factor(self.axis, self.stride, self.size)

    @property
    def end(self) -> int:
        return self.stride * self.size

    def within(self, other: "Factor") -> bool:
        """Whether this run of source indices lies inside ``other``'s (same axis) at every size."""
        try:
            return self.axis == other.axis and not less(self.stride, other.stride) and not less(other.end, self.end)
        except NotASize:
            return False

    def overlaps(self, other: "Factor") -> bool:
        if self.axis != other.axis:
            return False
        try:
            return less(self.stride, other.end) and less(other.stride, self.end)
        except NotASize as e:
            raise LayoutError(str(e)) from None


RANK_AXIS = "rank"
_bcast_ids = itertools.count()

Dim = tuple  # tuple[Factor, ...]


def is_broadcast(f: Factor) -> bool:
    return isinstance(f.axis, tuple) and f.axis[0] == "broadcast"


def base_axis(axis):
    """The source axis a factor's elements lie on (a non-aligned slice's own axis names it, and
    so does a rank block of replicated heads)."""
    while isinstance(axis, tuple) and axis and axis[0] in ("slice", "replicated"):
        axis = axis[1]
    return axis


def replicated_block(f: Factor) -> int:
    """How many ranks share each index of ``f`` when ``f`` is a rank block over replicated
    heads (:meth:`Layout.all_to_all`), else 1."""
    return f.axis[2] if isinstance(f.axis, tuple) and f.axis and f.axis[0] == "replicated" else 1


def canonical(factors) -> tuple:
    """Drop size-1 factors and merge neighbours that form one contiguous run of an axis (two
    neighbouring broadcasts are one: every element along either is the same)."""
    out: list[Factor] = []
    for f in factors:
        if f.size == 1:
            continue
        if out and out[-1].axis == f.axis and out[-1].stride == f.end:
            out[-1] = Factor(f.axis, f.stride, out[-1].size * f.size)
        elif out and is_broadcast(out[-1]) and is_broadcast(f):
            out[-1] = Factor(out[-1].axis, 0, out[-1].size * f.size)
        else:
            out.append(f)
    return tuple(out)


def dim_size(dim: Dim) -> int:
    return prod(f.size for f in dim)


@dataclass(frozen=True)
class Layout:
    dims: tuple  # tuple[Dim, ...]
    pinned: Factor
    # Factors fixed to one index by select/slice/split (which of a packed q/k/v this is).
    fixed: tuple = ()  # tuple[tuple[Factor, int], ...]

    @staticmethod
    def source(shape, name: object, cp: int) -> "Layout":
        """A rank-local tensor: axis i of ``name`` for each dim, the rank axis pinned."""
        dims = tuple((Factor((name, i), 1, n),) for i, n in enumerate(_static(shape)))
        return Layout(tuple(canonical(d) for d in dims), Factor(RANK_AXIS, 1, cp))

    @property
    def shape(self) -> tuple:
        return tuple(dim_size(d) for d in self.dims)

    def refreshed(self) -> "Layout":
        """The same layout with symbolic sizes in the shape environment's current form."""
        dims = tuple(canonical([f.refreshed() for f in d]) for d in self.dims)
        return Layout(dims, self.pinned.refreshed(), tuple((f.refreshed(), i) for f, i in self.fixed))

    # --- view algebra ---
    def reshape(self, shape) -> "Layout":
        shape = _infer_size(_static(shape), prod(self.shape))
        if not equal(prod(shape), prod(self.shape)):
            raise LayoutError(f"reshape {self.shape} -> {shape} changes numel")
        queue = [f for d in self.dims for f in canonical(d)]
        dims = []
        for n in shape:
            cur: list[Factor] = []
            need = n
            while need != 1:
                if not queue:
                    raise LayoutError(f"reshape to {shape} splits a factor unevenly")
                f = queue.pop(0)
                rest = exact_div(need, f.size)
                if rest is not None:  # the whole factor fits
                    cur.append(f)
                    need = rest
                    continue
                inner = exact_div(f.size, need)  # the factor's outer part fills the dim
                if inner is None:
                    raise LayoutError(f"reshape to {shape} splits a factor unevenly")
                cur.append(Factor(f.axis, f.stride * inner, need))
                queue.insert(0, Factor(f.axis, f.stride, inner))
                need = 1
            dims.append(tuple(cur))
        return replace(self, dims=tuple(dims))

    def permute(self, perm) -> "Layout":
        perm = [p % len(self.dims) for p in perm]
        if sorted(perm) != list(range(len(self.dims))):
            raise LayoutError(f"bad permutation {perm}")
        return replace(self, dims=tuple(self.dims[p] for p in perm))

    def transpose(self, a: int, b: int) -> "Layout":
        perm = list(range(len(self.dims)))
        a, b = a % len(perm), b % len(perm)
        perm[a], perm[b] = perm[b], perm[a]
        return self.permute(perm)

    def unsqueeze(self, d: int) -> "Layout":
        d = d % (len(self.dims) + 1)
        return replace(self, dims=self.dims[:d] + ((),) + self.dims[d:])

    def squeeze(self, dims) -> "Layout":
        dims = {d % len(self.dims) for d in dims}
        kept = tuple(x for i, x in enumerate(self.dims) if i not in dims or dim_size(x) != 1)
        return replace(self, dims=kept)

    def expand(self, sizes) -> "Layout":
        sizes = _static(sizes)
        lead = len(sizes) - len(self.dims)
        if lead < 0:
            raise LayoutError("expand to fewer dims")
        old = ((),) * lead + self.dims
        dims = []
        for d, n in zip(old, sizes):
            if n == -1 or n == dim_size(d):
                dims.append(d)
            elif dim_size(d) == 1:
                # A broadcast factor: the same element repeated n times (GQA head replication).
                dims.append((Factor(("broadcast", next(_bcast_ids)), 0, n),))
            else:
                raise LayoutError(f"expand {dim_size(d)} -> {n}")
        return replace(self, dims=tuple(dims))

    def select(self, dim: int, index: int) -> "Layout":
        """``x.select(dim, index)``: the dim's factors are fixed to the digits of ``index``."""
        dim = dim % len(self.dims)
        factors = canonical(self.dims[dim])
        if not isinstance(index, int) or (index < 0 and not isinstance(dim_size(factors), int)):
            raise LayoutError("select at a symbolic index")
        index = index % dim_size(factors) if factors and index < 0 else index
        fixed = []
        for f in reversed(factors):  # inner to outer: mixed-radix digits
            if not isinstance(f.size, int) and index:
                raise LayoutError("select at an index past a symbolic factor")
            fixed.append((f, index % f.size if isinstance(f.size, int) else 0))
            index = index // f.size if isinstance(f.size, int) else 0
        return Layout(self.dims[:dim] + self.dims[dim + 1:], self.pinned, self.fixed + tuple(fixed[::-1]))

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> "Layout":
        """``x[..., start:end]`` along ``dim``: an aligned block of the dim (a split of it)."""
        dim = dim % len(self.dims)
        n = dim_size(self.dims[dim])
        start, end = _clamp(start, n), _clamp(end, n)
        length = _exact_sub(end, start)
        if step != 1 or length is None or length == 0:
            raise LayoutError(f"slice [{start}:{end}:{step}] of a dim of {n} is not an aligned block")
        if length == n:
            return self
        blocks, block = exact_div(n, length), exact_div(start, length) if start != 0 else 0
        if blocks is not None and block is not None:
            if not isinstance(block, int):
                raise LayoutError(f"slice [{start}:{end}] picks a symbolic block")
            shape = list(self.shape)
            shape[dim:dim + 1] = [blocks, length]
            return self.reshape(shape).select(dim, block)
        if not all(isinstance(x, int) for x in (n, start, length)):
            raise LayoutError(f"slice [{start}:{end}] of a dim of {n} is not an aligned block of every size")
        return self._part_of_inner_factor(dim, start, length)

    def _part_of_inner_factor(self, dim: int, start: int, length: int) -> "Layout":
        """A slice that is no aligned block but lies inside one run of the dim's innermost
        factor (a fused [q | k | v] heads dim cut after the collective): the outer factors are
        fixed, the run becomes a factor of an axis of its own, ``("slice", axis, stride,
        offset)``, whose index ``j`` is the source index ``stride * (offset + j)``."""
        factors = canonical(self.dims[dim])
        n = dim_size(factors)
        inner = factors[-1] if factors else None
        if inner is None or is_broadcast(inner) or start // inner.size != (start + length - 1) // inner.size:
            raise LayoutError(f"slice [{start}:{start + length}:1] of a dim of {n} is not an aligned block")
        lay = self
        if inner.size != n:
            shape = list(self.shape)
            shape[dim:dim + 1] = [n // inner.size, inner.size]
            lay = self.reshape(shape).select(dim, start // inner.size)
        offset = start % inner.size
        part = Factor(("slice", inner.axis, inner.stride, offset), inner.stride, length)
        return replace(lay, dims=lay.dims[:dim] + ((part,),) + lay.dims[dim + 1:])

    # --- the collective ---
    def all_to_all(self, cp: int) -> "Layout":
        """Equal-split all_to_all_single along dim 0: swap dim 0's outer cp-factor with ``pinned``."""
        if not self.dims:
            raise LayoutError("all_to_all of a scalar")
        dim0 = canonical(self.dims[0])
        if not dim0 or exact_div(dim_size(dim0), cp) is None:
            raise LayoutError(f"dim 0 of size {dim_size(dim0)} does not split over cp={cp}")
        head = dim0[0]
        per_rank = exact_div(head.size, cp)
        if per_rank is None:
            return self._all_to_all_of_replicas(cp, dim0)
        outer = Factor(head.axis, head.stride * per_rank, cp)
        rest = (Factor(head.axis, head.stride, per_rank),) + dim0[1:]
        return Layout(((self.pinned,) + canonical(rest),) + self.dims[1:], outer, self.fixed)

    def _all_to_all_of_replicas(self, cp: int, dim0: tuple) -> "Layout":
        """dim 0's outer factor has fewer indices than cp ranks and each is repeated by a
        broadcast just inside it (K/V heads replicated before the collective, fewer than cp):
        ``k = cp / size`` ranks receive each index. The rank's block is then the factor
        ``("replicated", axis, k)``: rank r holds index ``r // k`` of the outer factor."""
        head = dim0[0]
        k = cp // head.size if isinstance(head.size, int) and head.size and cp % head.size == 0 else 0
        if not k or len(dim0) < 2 or not is_broadcast(dim0[1]) or (copies := exact_div(dim0[1].size, k)) is None:
            raise LayoutError("the cp-chunks of dim 0 cut across a factor")
        outer = Factor(("replicated", head.axis, k), head.stride, cp)
        rest = (Factor(dim0[1].axis, 0, copies),) + dim0[2:]
        return Layout(((self.pinned,) + canonical(rest),) + self.dims[1:], outer, self.fixed)


def _static(shape) -> tuple:
    """A shape argument's sizes (ints, or symbolic sizes read from its SymInts or size nodes)."""
    try:
        return tuple(size_of(s) for s in shape)
    except NotASize as e:
        raise LayoutError(str(e)) from None


def _infer_size(shape: tuple, numel) -> tuple:
    """Resolve the one ``-1`` a view or reshape may hold."""
    if -1 not in shape:
        return shape
    known = prod(s for s in shape if s != -1)
    inferred = exact_div(numel, known) if known != 0 else None
    if shape.count(-1) != 1 or inferred is None:
        raise LayoutError(f"cannot infer {shape} from {numel} elements")
    return tuple(inferred if s == -1 else s for s in shape)


def _clamp(i, n):
    """A slice bound in ``[0, n]`` (Python's rules); symbolic bounds are taken as written."""
    if isinstance(i, int) and isinstance(n, int):
        return max(0, min(n, i + n if i < 0 else i))
    if isinstance(i, int) and i >= 2**62:  # "to the end"
        return n
    if isinstance(i, int) and i < 0:
        return n + i
    return i


def _exact_sub(end, start):
    """``end - start`` where it is a size (non-negative for every value), else None."""
    d = size_of(end - start) if not isinstance(end - start, int) else end - start
    if isinstance(d, int):
        return max(d, 0)
    return d if _positive_form(d) else None


def _positive_form(expr) -> bool:
    """A polynomial with non-negative coefficients in positive symbols: non-negative everywhere."""
    try:
        return all(c >= 0 for c in sympy.Poly(expr, *sorted(expr.free_symbols, key=str)).coeffs())
    except sympy.PolynomialError:
        return False


def _same_shape_only(layout: Layout, node) -> Layout:
    return layout


def _dtype_cast(layout: Layout, node) -> Layout:
    kwargs = set(node.kwargs) - {"dtype", "memory_format", "layout", "device", "non_blocking"}
    if kwargs:
        raise LayoutError(f"{node.target} with {sorted(kwargs)}")
    return layout


# Ops that only relabel indices (or copy without changing the logical tensor). Everything else
# ends a chain.
LAYOUT_OPS = {
    aten.view.default: lambda l, n: l.reshape(n.args[1]),
    aten._unsafe_view.default: lambda l, n: l.reshape(n.args[1]),
    aten.reshape.default: lambda l, n: l.reshape(n.args[1]),
    aten.permute.default: lambda l, n: l.permute(n.args[1]),
    aten.transpose.int: lambda l, n: l.transpose(n.args[1], n.args[2]),
    aten.t.default: lambda l, n: l.transpose(0, 1),
    aten.unsqueeze.default: lambda l, n: l.unsqueeze(n.args[1]),
    aten.squeeze.dim: lambda l, n: l.squeeze([n.args[1]]),
    aten.squeeze.dims: lambda l, n: l.squeeze(n.args[1]),
    aten.expand.default: lambda l, n: l.expand(n.args[1]),
    aten.clone.default: _same_shape_only,
    aten.alias.default: _same_shape_only,
    aten.detach.default: _same_shape_only,
    aten._to_copy.default: _dtype_cast,
    prims.convert_element_type.default: _same_shape_only,
    aten.select.int: lambda l, n: l.select(n.args[1], n.args[2]),
    aten.slice.Tensor: lambda l, n: l.slice(*_slice_args(n)),
    # split/unbind return lists: the list keeps the layout, its getitem selects a piece.
    aten.split.Tensor: _same_shape_only,
    aten.split_with_sizes.default: _same_shape_only,
    aten.unbind.int: _same_shape_only,
    operator.getitem: lambda l, n: _piece(l, n),
}
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)


def is_layout_op(node) -> bool:
    """Whether ``node`` only relabels the indices of its first argument (a getitem counts only
    when it takes a piece of a split/unbind)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in LAYOUT_OPS:
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in SPLIT_OPS
    return True


def node_val(node):
    """The fake tensor (or value) a graph node computes, None if unknown."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def is_value_op(node) -> bool:
    """A pointwise op on the tracked tensor (its first argument) that keeps its shape: a scale,
    a cast, an activation. It changes values, not where they sit."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()) or not node.args:
        return False
    src, out = node_val(node.args[0]), node_val(node)
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and _same_shape(src, out)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return sizes_of(a.shape) == sizes_of(b.shape)
    except NotASize:
        return False


def _slice_args(node) -> tuple:
    args = list(node.args[1:]) + [None] * 4
    dim, start, end, step = args[:4]
    dim = node.kwargs.get("dim", dim if dim is not None else 0)
    start = node.kwargs.get("start", start) or 0
    end = node.kwargs.get("end", end)
    step = node.kwargs.get("step", step) or 1
    start, step = _static((start, step))
    return dim, start, _static((end,))[0] if end is not None else 2**62, step


def _piece(layout: Layout, node) -> Layout:
    """Piece ``i`` of ``split(x, size, dim)``, ``split_with_sizes(x, sizes, dim)`` or ``unbind(x, dim)``."""
    src, i = node.args[0], node.args[1]
    if src.target is aten.unbind.int:
        return layout.select(src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0), i)
    dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
    n = layout.shape[dim % len(layout.dims)]
    if src.target is aten.split.Tensor:
        size = _static((src.args[1],))[0]
        if isinstance(size, int) and isinstance(n, int):
            sizes = [min(size, n - j) for j in range(0, n, size)]
        elif exact_div(n, size) is not None:  # equal pieces, whatever the length
            sizes = [size] * (i + 1)
        else:
            raise LayoutError(f"split of {n} into pieces of {size}")
    else:
        sizes = list(_static(src.args[1]))
    start = sum(sizes[:i])
    return layout.slice(dim, start, start + sizes[i])


def apply_chain(layout: Layout, nodes) -> list[Layout]:
    """Layouts after each node of a chain of LAYOUT_OPS (first element: the input layout)."""
    states = [layout]
    for n in nodes:
        states.append(LAYOUT_OPS[n.target](states[-1], n))
    return states


# --- planning a relayout -----------------------------------------------------------------------


@dataclass(frozen=True)
class Relayout:
    """``x.reshape(split).permute(perm).reshape(shape)`` turns a tensor of one layout into another."""

    split: tuple
    perm: tuple
    shape: tuple


def _atoms_of(axis_factors: list) -> dict:
    """Per axis, the finest mixed-radix cut that refines every given factor of it."""
    bounds: dict = {}
    for f in axis_factors:
        bounds.setdefault(f.axis, set()).update({f.stride, f.end})
    atoms = {}
    for axis, bs in bounds.items():
        bs = sorted(bs, key=hint)  # bounds that nest are ordered alike at every size
        found = [exact_div(hi, lo) for lo, hi in zip(bs, bs[1:])]
        ratios = [r for r in found if r is not None]
        if len(ratios) < len(found):
            raise LayoutError(f"factors of {axis} do not nest")
        atoms[axis] = [Factor(axis, lo, r) for lo, r in zip(bs, ratios)]
    return atoms


def _split(f: Factor, atoms: dict) -> list:
    inside = [a for a in atoms[f.axis] if a.within(f)]
    return sorted(inside, key=lambda a: -hint(a.stride))  # outer to inner


def plan_relayout(src: Layout, dst: Layout) -> Relayout:
    """How to view/copy a tensor laid out as ``src`` into ``dst`` (same elements, same pinned)."""
    if src.pinned.refreshed() != dst.pinned.refreshed():
        raise LayoutError("relayout cannot change which block this rank holds")
    src_f = [f for d in src.dims for f in canonical([g.refreshed() for g in d])]
    dst_f = [f for d in dst.dims for f in canonical([g.refreshed() for g in d])]
    if any(is_broadcast(f) for f in src_f + dst_f):
        raise LayoutError("relayout of broadcast factors")
    atoms = _atoms_of(src_f + dst_f)
    src_atoms = [a for f in src_f for a in _split(f, atoms)]
    dst_atoms = [a for f in dst_f for a in _split(f, atoms)]
    if sorted(src_atoms, key=repr) != sorted(dst_atoms, key=repr) or len(set(src_atoms)) != len(src_atoms):
        raise LayoutError("layouts hold different elements")
    perm = tuple(src_atoms.index(a) for a in dst_atoms)
    return Relayout(tuple(a.size for a in src_atoms), perm, dst.shape)
