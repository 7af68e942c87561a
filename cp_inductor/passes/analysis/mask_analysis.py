"""Which attention masks the packed kernels compute without building them (reads only).

A mask of shape ``[..., T_q, T_kv]`` is read from the aten graph that builds it
(``mask_graph.trace``) as a predicate of its indices ``(b, h, q, kv)``: aranges are the indices,
``table[b, q]`` gathers from a tensor the program computed (a *table*), comparisons and ``&``
combine. The predicate is accepted when it is a conjunction of

    same document   table[b, q] == table[b, kv]          (document ids, one row per batch entry)
    causal          kv <= q    (also tril, and HF's positions[b, kv] <= positions[b, q] where the
                               document ids are the cumulative count of position resets: within a
                               document positions then step by one, so the two agree)

given as a boolean mask or an additive one (0 where kept, -inf or the dtype's lowest where not).
The document ids must form contiguous runs in each row for the packed kernels to compute the same
thing: proven where they are a cumulative sum of non-negative values along the row (HF's packed
path), else checked on device each step (``document_attention``: the dense path where they are
not). A causal sliding window (``kv >= q - w``) rides along. Causal masks that bound the other
side by a table read at one index (torchtitan's packed-document fast path) are documents too,
where the table holds each document's first (last) token:

    keys from the query's document start    kv <= q  &  start[q] <= kv   (start: any table read at q)
    queries up to the key's document end    kv <= q  &  q <= end[b, kv]

the table itself then serves as the document ids (``DocumentMask.bound``); that it holds run
starts (ends) is checked on device each step, where the dense path computes the mask as written.
Everything else is kept, with the
reason: padding (keys masked by a per-token table), disjunctions, a mask that comes in from
outside the graph, real-valued biases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx

from . import mask_graph

aten = torch.ops.aten

PROVEN = "proven (cumulative sum of non-negatives)"
CHECKED = "checked on device"


@dataclass(frozen=True)
class Lin:
    """An integer affine function of the mask's indices: sum(coef * index[axis]) + const."""

    coefs: tuple = ()  # ((axis, coef), ...), sorted, no zero coefs
    const: int | torch.SymInt = 0

    @staticmethod
    def of(terms: dict, const=0) -> Lin:
        return Lin(tuple(sorted((a, c) for a, c in terms.items() if c != 0)), const)

    def __add__(self, other: Lin) -> Lin:
        terms = dict(self.coefs)
        for a, c in other.coefs:
            terms[a] = terms.get(a, 0) + c
        return Lin.of(terms, self.const + other.const)

    def scaled(self, k) -> Lin:
        return Lin.of({a: c * k for a, c in self.coefs}, self.const * k)

    def map_axes(self, fn) -> Lin | Pos | Gather:
        """Substitute index ``a`` by ``fn(a)`` (an int axis, or a Lin)."""
        out = Lin((), self.const)
        for a, c in self.coefs:
            new = fn(a)
            if isinstance(new, (Pos, Gather)):  # a table read at a position a mask_mod computes
                if self.coefs != ((a, 1),) or self.const != 0:
                    raise NotAMask("arithmetic on a position a mask_mod computes")
                return new
            out = out + (new if isinstance(new, Lin) else Lin(((new, 1),))).scaled(c)
        return out


@dataclass(frozen=True)
class Gather:
    table: torch.fx.Node  # a tensor of the traced graph the mask reads by index
    index: tuple  # one Lin per table dim

    def map_axes(self, fn) -> Gather:
        return Gather(self.table, tuple(i.map_axes(fn) for i in self.index))


@dataclass(frozen=True)
class Pos:
    """An integer function of one index of a flex ``mask_mod`` (and of the batch index) that the
    reader does not take apart: the position a query or key index stands for, as torch's CP
    block masks compute it (``q_idx`` of a local shard to its place in the pack, through a load
    balancer's permutation). ``node`` computes it in the traced graph."""

    node: torch.fx.Node
    axis: int

    def map_axes(self, fn) -> Pos:
        new = fn(self.axis)
        if isinstance(new, Lin):
            if len(new.coefs) != 1 or new.coefs[0][1] != 1 or new.const != 0:
                raise NotAMask("a table of positions read at positions other than its own index")
            new = new.coefs[0][0]
        return Pos(self.node, new)


@dataclass(frozen=True)
class Cmp:
    op: str  # "eq" "ne" "le" "lt" "ge" "gt"
    lhs: Lin | Gather | Pos | Shifted
    rhs: Lin | Gather | Pos | Shifted

    def map_axes(self, fn) -> Cmp:
        return Cmp(self.op, self.lhs.map_axes(fn), self.rhs.map_axes(fn))


@dataclass(frozen=True)
class Logic:
    op: str  # "and" "or" "not"
    items: tuple

    def map_axes(self, fn) -> Logic:
        return Logic(self.op, tuple(i.map_axes(fn) for i in self.items))


@dataclass(frozen=True)
class Shifted:
    """A table read plus a constant: ``positions[b, q] - window`` (HF's sliding window over the
    positions it remaps a packed batch to)."""

    table: Gather
    by: object

    def map_axes(self, fn) -> Shifted:
        return Shifted(self.table.map_axes(fn), self.by)


@dataclass(frozen=True)
class Truth:
    value: bool

    def map_axes(self, fn) -> Truth:
        return self


class NotAMask(Exception):
    """The mask is not one the packed kernels compute; the message says why."""


class _Opaque(Exception):
    """An op the reader does not know: its value is read as a table."""


@dataclass
class DocumentMask:
    """What a mask computes, when the packed kernels compute it too."""

    doc_ids: torch.fx.Node | None  # the table of document ids in the traced graph (None: one document)
    causal: bool
    contiguity: str = ""  # PROVEN or CHECKED, where there are document ids
    traced: mask_graph.Traced | None = None
    # Causal over this table of positions (traced graph), which the graph does not prove to rise
    # within each document: checked on device with the ids.
    positions: torch.fx.Node | None = None
    # Where the documents are read at a position computed from the query / key index (torch's
    # CP block masks: a local query shard's place in the pack, a load balancer's permutation; a
    # hand-written CP mask: the index plus the shard's offset, or a table of places), the traced
    # node computing it (a flex mask_mod's), or its expression (Lin, Gather: the pass builds it
    # from the tables it reads); None: the index itself.
    query_positions: object = None
    key_positions: object = None
    window: int = -1  # causal with keys from q - window on (a sliding window), -1: none
    # "start" (keys from start[q] on) or "end" (queries up to end[kv]): ``bound_position`` (as
    # query_positions is: a traced node or an expression) read over its index is the table the
    # documents are read from; each token's value must be its document's first (last) token.
    # Where the positions are mapped (torch's flex CP), the table over the pack is
    # ``bound_position`` with ``bound_at`` (the mapped position it reads at) set to the pack index.
    bound: str = ""
    bound_position: object = None
    bound_at: object = None
    # The window was read over ``positions`` (not proven to step by one within each document, as
    # HF's flex tables that come in as inputs are not): checked on device that they do.
    positions_step: bool = False

    @property
    def mapped(self) -> bool:
        return self.query_positions is not None or self.key_positions is not None

    def describe(self) -> str:
        parts = []
        if self.doc_ids is not None:
            parts.append(f"documents from {self.doc_ids.name} ({self.contiguity})")
        if self.bound:
            who = "queries" if self.bound == "start" else "keys"
            parts.append(f"documents from the {who}' document {self.bound}s {position_text(self.bound_position)} "
                         f"({CHECKED})")
        parts.append("causal" if self.causal else "bidirectional")
        if self.window >= 0:
            parts[-1] += f", keys from q-{self.window}"
        if self.positions is not None:
            how = "stepping by one" if self.positions_step else "rising"
            parts[-1] += f" over positions {self.positions.name} ({how} within documents: checked on device)"
        for who, where in (("queries", self.query_positions), ("keys", self.key_positions)):
            if isinstance(where, torch.fx.Node):
                parts.append(f"{who} at positions the mask_mod computes ({where.name})")
            elif where is not None:
                parts.append(f"{who} at positions {position_text(where)}")
        return ", ".join(parts)


# --- the predicate of a traced tensor -------------------------------------------------------


def _shape(node: torch.fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def _fit(expr, in_shape, out_shape):
    """``expr`` over ``in_shape`` read over ``out_shape`` (broadcasting: dims aligned right,
    a size-1 dim reads index 0)."""
    shift = len(out_shape) - len(in_shape)

    def axis(a):
        if _is_one(in_shape[a]) and not _is_one(out_shape[a + shift]):
            return Lin((), 0)
        return a + shift

    return expr.map_axes(axis)


def _scalar(x):
    if isinstance(x, bool):
        return Truth(x)
    if isinstance(x, int):
        return Lin((), x)
    if isinstance(x, torch.SymInt):
        return Lin((), x)
    raise NotAMask(f"a {type(x).__name__} constant {x!r} in the mask")


_CMPS = {
    aten.eq.Tensor: "eq", aten.eq.Scalar: "eq", aten.ne.Tensor: "ne", aten.ne.Scalar: "ne",
    aten.le.Tensor: "le", aten.le.Scalar: "le", aten.lt.Tensor: "lt", aten.lt.Scalar: "lt",
    aten.ge.Tensor: "ge", aten.ge.Scalar: "ge", aten.gt.Tensor: "gt", aten.gt.Scalar: "gt",
}
_LOGIC = {
    aten.bitwise_and.Tensor: "and", aten.logical_and.default: "and", aten.bitwise_or.Tensor: "or",
    aten.logical_or.default: "or",
}
_SAME = (aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_SHAPE_OPS = (*_SAME, *_VIEWS, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor,
              aten.select.int)


class _Reader:
    def __init__(self, indices: dict | None = None):
        self.memo: dict = dict(indices or {})  # a flex mask_mod's index arguments: b, h, q_idx, kv_idx
        self.axis_of = {n: lin.coefs[0][0] for n, lin in (indices or {}).items()}  # node -> its axis
        self.deps: dict = {}

    def _depends(self, n) -> frozenset:
        """The mask_mod indices (axes) ``n`` is computed from."""
        if not isinstance(n, torch.fx.Node):
            return frozenset()
        if n not in self.deps:
            self.deps[n] = frozenset({self.axis_of[n]}) if n in self.axis_of else frozenset().union(
                *(self._depends(a) for a in n.all_input_nodes))
        return self.deps[n]

    def _position_axis(self, n: torch.fx.Node) -> int | None:
        """The query or key axis of a mask_mod whose position ``n`` computes (an integer function
        of that index, and maybe of the batch index), or None."""
        dtype = n.meta["val"].dtype
        if dtype == torch.bool or dtype.is_floating_point:
            return None
        axes = self._depends(n) - {0}
        return next(iter(axes)) if axes in ({2}, {3}) else None

    def read(self, x):
        """The predicate or integer function a traced value computes, by its own indices."""
        if not isinstance(x, torch.fx.Node):
            return _scalar(x)
        if not isinstance(x.meta.get("val"), torch.Tensor):
            # A scalar the graph computes from a size (a decoding cache's length under dynamic
            # shapes). Its symbol belongs to the trace's own shape env: a term decided by its value
            # here would hold no guard in Dynamo's, so the mask is kept.
            raise NotAMask("a mask term over a size the graph computes (symbolic): not known when compiling")
        if x not in self.memo:
            self.memo[x] = self._read(x)
        return self.memo[x]

    def _operand(self, x, out_shape):
        if not isinstance(x, torch.fx.Node):
            return _scalar(x)
        return _fit(self.read(x), _shape(x), out_shape)

    def _read(self, n: torch.fx.Node):
        """An op the reader does not know is a table read at its own indices: the document
        terms hold for any table, and what a table holds is proven or checked apart."""
        try:
            return self._known(n)
        except _Opaque:
            axis = self._position_axis(n)
            if axis is not None:
                return Pos(n, axis)
            return Gather(n, tuple(Lin(((a, 1),)) for a in range(len(_shape(n)))))

    def _known(self, n: torch.fx.Node):
        t, args = n.target, n.args
        if n.op != "call_function":
            raise _Opaque
        out = _shape(n)
        dtype = n.meta["val"].dtype
        if dtype.is_floating_point and t not in _SHAPE_OPS:
            return _additive(self, n)
        if t in _CMPS:
            return Cmp(_CMPS[t], self._operand(args[0], out), self._operand(args[1], out))
        if t in _LOGIC or (t in (aten.mul.Tensor,) and dtype == torch.bool):
            return Logic(_LOGIC.get(t, "and"), (self._operand(args[0], out), self._operand(args[1], out)))
        if t in (aten.bitwise_not.default, aten.logical_not.default):
            return _not((self.read(args[0]),))
        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            start, step = (0, 1) if t is aten.arange.default else (args[0], args[2] if len(args) > 2 else 1)
            return Lin(((0, step),), start)
        if t in (aten.add.Tensor, aten.sub.Tensor) and dtype != torch.bool and not dtype.is_floating_point:
            alpha = n.kwargs.get("alpha", 1) * (1 if t is aten.add.Tensor else -1)
            a, b = self._operand(args[0], out), self._operand(args[1], out)
            if isinstance(a, Lin) and isinstance(b, Lin):
                return a + b.scaled(alpha)
            if isinstance(a, Gather) and isinstance(b, Lin) and not b.coefs:
                return Shifted(a, b.const * alpha)
            if isinstance(b, Gather) and isinstance(a, Lin) and not a.coefs and alpha == 1:
                return Shifted(b, a.const)
        if t is aten.unsqueeze.default:
            dim = args[1] % len(out)
            return self.read(args[0]).map_axes(lambda a: a + (a >= dim))
        if t is aten.squeeze.dim:
            dim = args[1] % len(_shape(args[0]))
            return self.read(args[0]).map_axes(lambda a: Lin((), 0) if a == dim else a - (a > dim))
        if t is aten.expand.default or t in _SAME:
            return _fit(self.read(args[0]), _shape(args[0]), out)
        if t in _VIEWS:
            return self._view(n)
        if t is aten.slice.Tensor:
            return self._slice(n)
        if t is aten.select.int:
            dim, i = args[1] % len(_shape(args[0])), args[2]
            return self.read(args[0]).map_axes(lambda a: Lin((), i) if a == dim else a - (a > dim))
        if t is aten._to_copy.default and (dtype == torch.bool) == (args[0].meta["val"].dtype == torch.bool):
            if not dtype.is_floating_point:
                return self.read(args[0])
        if t is aten.index.Tensor:
            return self._index(n)
        if t in (aten.new_ones.default, aten.ones.default, aten.ones_like.default):
            return Truth(True) if dtype == torch.bool else Lin((), 1)
        if t in (aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default):
            return Truth(False) if dtype == torch.bool else Lin((), 0)
        if t in (aten.full.default, aten.new_full.default, aten.full_like.default) and not dtype.is_floating_point:
            return _scalar(bool(args[-1]) if dtype == torch.bool else args[-1])
        if t in (aten.tril.default, aten.triu.default):
            diagonal = args[1] if len(args) > 1 else 0
            q, kv = Lin(((len(out) - 2, 1),)), Lin(((len(out) - 1, 1),))
            op = "le" if t is aten.tril.default else "ge"
            band = Cmp(op, kv, q + Lin((), diagonal))  # tril keeps kv - q <= diagonal
            inner = self.read(args[0])
            return Logic("and", (inner, band)) if dtype == torch.bool else Logic("and", (Cmp("ne", inner, Lin((), 0)), band))
        raise _Opaque

    def _view(self, n):
        """A view that only adds or drops size-1 dims."""
        src, out = _shape(n.args[0]), _shape(n)
        keep_src = [i for i, s in enumerate(src) if not _is_one(s)]
        keep_out = [i for i, s in enumerate(out) if not _is_one(s)]
        if len(keep_src) != len(keep_out) or any(src[a] is not out[b] and src[a] != out[b] for a, b in zip(keep_src, keep_out)):
            raise NotAMask("a reshape in the mask that merges or splits its dims")
        where = dict(zip(keep_src, keep_out))
        return self.read(n.args[0]).map_axes(lambda a: where[a] if a in where else Lin((), 0))

    def _slice(self, n):
        args = list(n.args) + [0, None, None, 1][len(n.args) - 1:]
        src, dim, start, end, step = args[0], args[1], args[2], args[3], args[4]
        dim %= len(_shape(src))
        inner = self.read(src)
        start = start or 0
        if start == 0 and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62) or end is _shape(src)[dim]):
            return inner
        if not isinstance(start, int) or start < 0:
            raise NotAMask("a slice of the mask's indices from a symbolic or negative start")
        return inner.map_axes(lambda a: Lin(((a, step),), start) if a == dim else a)

    def _index(self, n):
        """``table[..., i, j, ...]``: leading dims skipped (``x[:, i]``) kept as they are, the
        indexed dims read where the index tensors (broadcast together) point."""
        table, indices = n.args
        skipped = next((j for j, i in enumerate(indices) if i is not None), len(indices))
        given = indices[skipped:]
        if not given or any(i is None for i in given):
            raise NotAMask("an index with skipped dims between or after the indexed ones in the mask")
        out, rank = _shape(n), len(_shape(table))
        width = len(out) - skipped - (rank - len(indices))  # the broadcast index dims, after the skipped ones
        exprs = [self._operand(i, out[skipped:skipped + width]).map_axes(lambda a: a + skipped) for i in given]
        if not all(isinstance(e, (Lin, Pos, Gather)) for e in exprs):
            raise NotAMask("a table is read at positions the indices do not give")
        axes = [Lin(((a, 1),)) for a in range(skipped)] + exprs
        axes += [Lin(((skipped + width + j, 1),)) for j in range(rank - len(indices))]
        return self.read(table).map_axes(lambda a: axes[a])


@dataclass(frozen=True)
class Additive:
    """A float mask added to the scores: 0 where ``kept`` holds, -inf (or the dtype's lowest) where not."""

    kept: Cmp | Logic | Truth

    def map_axes(self, fn) -> Additive:
        return Additive(self.kept.map_axes(fn))


def _kept(reader: _Reader, x: torch.fx.Node, out_shape):
    value = _fit(reader.read(x), _shape(x), out_shape)
    if not isinstance(value, Additive):
        raise NotAMask("a real-valued bias (not where(mask, 0, -inf) or masked_fill(-inf))")
    return value.kept


def _additive(reader: _Reader, n: torch.fx.Node) -> Additive:
    """The predicate of an additive mask: 0 where kept, -inf (or the dtype's lowest) where not."""
    dtype = n.meta["val"].dtype

    def masked(x) -> bool:
        return isinstance(x, (int, float)) and (x == -math.inf or x <= torch.finfo(dtype).min)

    def zero(x) -> bool:
        if isinstance(x, torch.fx.Node) and x.target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
            return True
        if isinstance(x, torch.fx.Node) and x.target in (aten.full_like.default, aten.new_full.default):
            return x.args[-1] == 0
        return _const(x) == 0

    t, args, out = n.target, n.args, _shape(n)
    if t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar):
        if zero(args[1]) and masked(_const(args[2])):
            return Additive(_fit(reader.read(args[0]), _shape(args[0]), out))
        if masked(_const(args[1])) and zero(args[2]):
            return Additive(_not((_fit(reader.read(args[0]), _shape(args[0]), out),)))
    if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and masked(_const(args[2])):
        kept = _not((_fit(reader.read(args[1]), _shape(args[1]), out),))
        return Additive(kept if zero(args[0]) else Logic("and", (_kept(reader, args[0], out), kept)))
    if t is aten.add.Tensor and all(isinstance(a, torch.fx.Node) for a in args):
        return Additive(Logic("and", tuple(_kept(reader, a, out) for a in args)))
    if t is aten._to_copy.default and args[0].meta["val"].dtype.is_floating_point:
        return reader.read(args[0])
    if t is aten._to_copy.default and args[0].meta["val"].dtype == torch.bool:
        raise NotAMask("a boolean mask turned into 0/1 values (a real-valued bias, not a mask)")
    raise NotAMask(f"a real-valued bias ({n.target} is not where(mask, 0, -inf) or masked_fill(-inf))")


def _not(items: tuple):
    (x,) = items
    if isinstance(x, Logic) and x.op == "not":
        return x.items[0]
    if isinstance(x, Truth):
        return Truth(not x.value)
    return Logic("not", (x,))


def _const(x):
    if isinstance(x, torch.fx.Node) and x.target in (aten.scalar_tensor.default, aten.lift_fresh_copy.default, aten.full.default):
        return x.args[0] if x.target is aten.scalar_tensor.default else x.args[-1] if x.target is aten.full.default else None
    return x


# --- the predicate, classified --------------------------------------------------------------


def _conjuncts(p) -> list:
    if isinstance(p, Logic) and p.op == "and":
        return [c for item in p.items for c in _conjuncts(item)]
    if isinstance(p, Logic) and p.op == "not" and isinstance(p.items[0], Cmp):
        negated = {"eq": "ne", "ne": "eq", "le": "gt", "lt": "ge", "ge": "lt", "gt": "le"}
        c = p.items[0]
        return [Cmp(negated[c.op], c.lhs, c.rhs)]
    if isinstance(p, Logic) and p.op == "not" and isinstance(p.items[0], Logic) and p.items[0].op == "or":
        return [c for item in p.items[0].items for c in _conjuncts(_not((item,)))]
    return [p]


def _strip(node):
    """A table through the ops that do not change its values along a row."""
    while isinstance(node, torch.fx.Node) and (node.target in _SAME or node.target is aten.expand.default or (
            node.target is aten._to_copy.default and not node.meta["val"].dtype.is_floating_point)):
        node = node.args[0]
    return node


def _nonnegative(node) -> bool:
    node = _strip(node)
    val = node.meta["val"]
    if val.dtype == torch.bool:
        return True
    return node.target in (aten.abs.default,) or (node.target in (aten.clamp_min.default, aten.clamp.default) and
                                                    isinstance(node.args[1], (int, float)) and node.args[1] >= 0)


def _row_cumsum(node):
    """The summand of a cumulative sum along the last dim, or None."""
    node = _strip(node)
    if node.target is aten.cumsum.default:
        dim = node.args[1]
        if dim % len(_shape(node)) == len(_shape(node)) - 1:
            return node.args[0]
    return None


def _diff_of(node):
    """``p`` where ``node`` is ``torch.diff(p, prepend=..., dim=-1)`` (``cat([pre, p])[1:] - [:-1]``)."""
    node = _strip(node)
    if node.target is not aten.sub.Tensor:
        return None
    late, early = node.args
    if not all(isinstance(s, torch.fx.Node) and s.target is aten.slice.Tensor for s in (late, early)):
        return None
    cat = late.args[0]
    if early.args[0] is not cat or cat.target is not aten.cat.default or late.args[2] != 1 or early.args[2] not in (0, None):
        return None
    pieces, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    rank = len(_shape(cat))
    if dim % rank != rank - 1 or len(pieces) != 2 or _shape(pieces[0])[-1] != 1:
        return None
    return pieces[1]


def _resets_of(doc_ids) -> torch.fx.Node | None:
    """``p`` where the document ids are ``cumsum(diff(p) != 1)``: positions that restart."""
    summand = _row_cumsum(doc_ids)
    summand = _strip(summand) if summand is not None else None
    if summand is None or summand.target is not aten.ne.Scalar or summand.args[1] != 1:
        return None
    return _strip(_diff_of(summand.args[0]))


def reset_leaf(facts: DocumentMask) -> torch.fx.Node | None:
    """The Dynamo graph's input whose resets are ``facts``' documents (``ids = cumsum(diff(p) != 1)``,
    HF's packed-sequence detection of ``p = position_ids``), or None. A table handed to a flex
    mask_mod (HF builds the ids outside it) is read where the Dynamo graph computes it."""
    if facts.doc_ids is None or facts.traced is None:
        return None
    return _reset_input(facts.doc_ids, facts.traced)


def table_input(facts: DocumentMask, table: torch.fx.Node | None) -> torch.fx.Node | None:
    """The Dynamo graph's input a table of ``facts`` (its document ids, its positions) is read
    from as it is (a table a flex mask_mod reads at ``[b, index]`` that the graph takes in: HF
    transformers builds them before a graph break), or None. What it holds is not known from the
    graph: a pass that relies on it checks it on device."""
    if table is None or facts.traced is None or table.op != "placeholder":
        return None
    leaf = facts.traced.leaves[[n for n in facts.traced.graph.nodes if n.op == "placeholder"].index(table)]
    return leaf if isinstance(leaf, torch.fx.Node) and leaf.op == "placeholder" else None


def _reset_input(ids: torch.fx.Node, traced: mask_graph.Traced, hops: int = 1) -> torch.fx.Node | None:
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if ids.op == "placeholder":
        leaf = traced.leaves[placeholders.index(ids)]
        if hops == 0 or not isinstance(leaf, torch.fx.Node) or leaf.op not in ("call_function", "call_method"):
            return None
        producers = mask_graph.trace(leaf)
        return _reset_input(producers.output, producers, hops - 1) if not isinstance(producers, str) else None
    p = _resets_of(ids)
    if not isinstance(p, torch.fx.Node) or p.op != "placeholder":
        return None
    return traced.leaves[placeholders.index(p)]


def _axis_of(x) -> int | None:
    """The one query/key index ``x`` is a position of (the index itself, a ``Pos`` of it, a
    table read there), or None. The batch index may take part."""
    if isinstance(x, Lin):  # the index itself, or the index plus an offset (a shard's place)
        return x.coefs[0][0] if len(x.coefs) == 1 and x.coefs[0][1] == 1 and isinstance(x.const, int) else None
    if isinstance(x, Pos):
        return x.axis
    if isinstance(x, Gather):
        axes = set()
        for i in x.index:
            if isinstance(i, Lin) and (not i.coefs or i == Lin(((0, 1),))):
                continue  # a constant row, or the batch row
            axes.add(_axis_of(i))
        return axes.pop() if len(axes) == 1 else None
    return None


def _mapped(x) -> bool:
    """Whether position ``x`` is computed from an index, not the index itself."""
    return _axis_of(x) is not None and not (isinstance(x, Lin) and x.const == 0)


def _axes(lin: Lin) -> dict:
    return dict(lin.coefs)


class _Classifier:
    def __init__(self, rank: int):
        self.q, self.kv = rank - 2, rank - 1
        self.batch = 0 if rank == 4 else None  # SDPA aligns a mask's dims right: a 3-d mask's first is the heads
        self.doc_ids: set = set()
        self.causal = False
        self.position_causal: list = []  # tables p with p[kv] <= p[q]
        self.maps: dict = {}  # axis -> the position expression the documents read it at (None: the index itself)
        self.mapped_causal: list = []  # (query position, key position) with key <= query
        self.bounds: list = []  # (P(q), P(kv)) with P(q) <= P(kv): a document start or end bounds one side
        self.index_causal = False  # kv <= q over the indices themselves
        self.window: int | None = None  # kv >= q - window
        self.stepping_positions: set = set()  # tables a band was read over as if they were the indices
        self.bands: list = []  # comparisons of the indices themselves

    def _map(self, axis: int, col) -> None:
        position = col if _mapped(col) else None
        if self.maps.setdefault(axis, position) != position:
            raise NotAMask("the documents are read at two different positions of one index")

    def _row(self, g: Gather, which: int) -> bool:
        """Whether ``g`` reads its table at row b (or a table of one row) and column ``which``
        (the index itself, or the position a flex mask_mod computes from it)."""
        *lead, col = g.index
        if _axis_of(col) != which:
            return False
        if not lead:
            return True
        if len(lead) != 1:
            return False
        if self.batch is not None and lead[0] == Lin(((self.batch, 1),)):
            return True
        # A fixed row reads the same documents for every row of the batch: what the packed kernels
        # compute (row b over row b's ids) only where the table has that one row.
        return lead[0] == Lin() and _is_one(_shape(g.table)[0])

    def _first_of_many_rows(self, g) -> bool:
        """Whether ``g`` reads row 0 of a table of several rows at the query or the key."""
        return (isinstance(g, Gather) and len(g.index) == 2 and g.index[0] == Lin()
                and not _is_one(_shape(g.table)[0]) and _axis_of(g.index[-1]) in (self.q, self.kv))

    def _sides(self, c: Cmp):
        """(q-side, kv-side) gathers of one table, or None."""
        for a, b in ((c.lhs, c.rhs), (c.rhs, c.lhs)):
            if isinstance(a, Gather) and isinstance(b, Gather) and _strip(a.table) is _strip(b.table):
                if self._row(a, self.q) and self._row(b, self.kv):
                    return a, b
        return None

    def add(self, atom) -> None:
        if isinstance(atom, Truth):
            if not atom.value:
                raise NotAMask("the mask hides every key")
            return
        if isinstance(atom, Logic):
            raise NotAMask("a disjunction of masks (or_masks, |): not a document mask")
        if isinstance(atom, Gather) and self._row(atom, self.kv) and not self._row(atom, self.q):
            raise NotAMask("keys masked by a per-token table (padding holes)")  # HF's 2-D attention_mask, bool
        if not isinstance(atom, Cmp):
            raise NotAMask(f"a term of the mask that is not a comparison ({type(atom).__name__})")
        if isinstance(atom.lhs, Lin) and isinstance(atom.rhs, Lin):
            self.bands.append(atom)  # read once the positions the documents are read at are known
            return None
        if any(isinstance(x, Shifted) for x in (atom.lhs, atom.rhs)):
            return self._position_band(atom)
        sides = self._sides(atom)
        ordered = atom.op in ("le", "lt", "ge", "gt")
        if sides is None and ordered and {_axis_of(atom.lhs), _axis_of(atom.rhs)} == {self.q, self.kv}:
            return self._mapped_band(atom)
        if sides is not None:
            qside, kvside = sides
            flipped = qside is atom.rhs  # kv op q
            op = _FLIP[atom.op] if flipped else atom.op
            if op == "eq":
                self.doc_ids.add(_strip(qside.table))
                self._map(self.q, qside.index[-1])
                self._map(self.kv, kvside.index[-1])
                return None
            if op == "ge" and (_mapped(qside.index[-1]) or _mapped(kvside.index[-1])):  # P(q) >= P(kv)
                return self._mapped_band(atom)
            if op == "ge":  # p[q] >= p[kv]
                self.position_causal.append(_strip(qside.table))
                return None
            raise NotAMask(f"a table of the mask compared {atom.op!r} between query and key")
        tables = [g for g in (atom.lhs, atom.rhs) if isinstance(g, Gather)]
        if any(self._row(g, self.kv) for g in tables) and not any(self._row(g, self.q) for g in tables):
            raise NotAMask("keys masked by a per-token table (padding holes)")
        if any(self._first_of_many_rows(g) for g in tables):
            raise NotAMask("row 0 of a table of several rows read for every row of the batch (not each row's own documents)")
        raise NotAMask("a table read in the mask at positions other than (batch, query) and (batch, key)")

    def _band(self, c: Cmp) -> None:
        assert isinstance(c.lhs, Lin) and isinstance(c.rhs, Lin)  # a band compares index expressions only
        d = c.lhs + c.rhs.scaled(-1)  # d op 0
        coefs = _axes(d)
        if set(coefs) - {self.q, self.kv}:
            raise NotAMask("a mask term over the batch or head index")
        if not coefs:
            return self.add(Truth(_holds(c.op, d.const)))
        if coefs.get(self.q) != -coefs.get(self.kv, 0):
            raise NotAMask("a mask term that is not a band around the diagonal")
        sign = coefs[self.kv]  # d = sign * (kv - q) + const
        if not isinstance(d.const, int):
            raise NotAMask("a band of symbolic width")
        op = c.op if sign > 0 else _FLIP[c.op]
        bound = -d.const // sign if sign > 0 else d.const // -sign  # (kv - q) op bound
        if abs(sign) != 1:
            raise NotAMask("a band with a slope")
        upper = {"le": bound, "lt": bound - 1}.get(op)
        if op in ("le", "lt") and upper == 0:
            self.causal = self.index_causal = True
            return None
        if op in ("ge", "gt"):
            lower = bound if op == "ge" else bound + 1  # kv - q >= lower
            if lower > 0:
                raise NotAMask(f"keys from q{lower:+d} on: the query's own key masked")
            self.window = -lower if self.window is None else min(self.window, -lower)
            return None
        raise NotAMask(f"a band kv - q {op} {bound} other than causal")


    def _position_band(self, c: Cmp) -> None:
        """``p[b, kv] op p[b, q] + c`` over one table of positions: the band ``kv - q op c``
        where positions step by one within each document (checked in ``_classified``)."""
        def parts(x):
            return (x.table, x.by) if isinstance(x, Shifted) else (x, 0)

        (lhs, shift_l), (rhs, shift_r) = parts(c.lhs), parts(c.rhs)
        if not (isinstance(lhs, Gather) and isinstance(rhs, Gather) and isinstance(shift_l, int) and isinstance(shift_r, int)):
            raise NotAMask("a shifted table compared with something other than the same table")
        sides = self._sides(Cmp(c.op, lhs, rhs))
        if sides is None or sides[0].index[-1] != Lin(((self.q, 1),)) or sides[1].index[-1] != Lin(((self.kv, 1),)):
            raise NotAMask("a shifted table compared other than as positions[b, q] and positions[b, kv]")
        # (lhs + shift_l) op (rhs + shift_r), read over the indices where positions step by one
        index = {id(sides[0]): Lin(((self.q, 1),)), id(sides[1]): Lin(((self.kv, 1),))}
        self.stepping_positions.add(_strip(lhs.table))
        self._band(Cmp(c.op, index[id(lhs)] + Lin((), shift_l), index[id(rhs)] + Lin((), shift_r)))

    def _mapped_band(self, c: Cmp) -> None:
        """``P(q) >= P(kv)`` where a position is computed from an index (torch's CP masks)."""
        for qs, kvs, op in ((c.lhs, c.rhs, c.op), (c.rhs, c.lhs, _FLIP[c.op])):
            if _axis_of(qs) == self.q and _axis_of(kvs) == self.kv:
                if op == "le":  # start[P(q)] <= P(kv) or P(q) <= end[P(kv)]: _bounded decides which
                    self.bounds.append((qs, kvs))
                    return None
                if op != "ge":
                    raise NotAMask(f"query and key positions compared {op!r} (not causal)")
                self.mapped_causal.append((qs, kvs))
                return None
        raise NotAMask("a comparison of positions that are not a query's and a key's")

    def maps_of(self) -> tuple:
        """(query positions, key positions): position expressions, None where the index is its own
        position; the bands over the indices read now, over the positions where those are the
        index plus an offset."""
        q, kv = self.maps.get(self.q), self.maps.get(self.kv)
        offsets = {axis: 0 if m is None else m.const if isinstance(m, Lin) else None for axis, m in ((self.q, q), (self.kv, kv))}
        for band in self.bands:
            if None in offsets.values() or not any(offsets.values()):
                self._band(band)  # over the indices (where positions come from a table: checked below)
                continue
            # positions = index + offset (a shard's place): the band read over the positions
            def to_positions(a):
                return Lin(((a, 1),), -offsets[a]) if a in offsets else a

            over_indices = self.index_causal
            self._band(Cmp(band.op, band.lhs.map_axes(to_positions), band.rhs.map_axes(to_positions)))
            self.index_causal = over_indices
        for qs, kvs in self.mapped_causal:
            if (qs if _mapped(qs) else None) != q or (kvs if _mapped(kvs) else None) != kv:
                raise NotAMask("causal over positions other than the ones the documents are read at")
            self.causal = True
        if (q is not None or kv is not None) and self.index_causal:
            raise NotAMask("causal over the local indices where the documents are read at mapped positions")
        return q, kv


_FLIP = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}  # a op b == b FLIP[op] a


def _holds(op: str, x) -> bool:
    if not isinstance(x, int):  # deciding on a symbol of the trace would guard nothing in Dynamo
        raise NotAMask("a mask term over a symbolic size: not known when compiling")
    return {"eq": x == 0, "ne": x != 0, "le": x <= 0, "lt": x < 0, "ge": x >= 0, "gt": x > 0}[op]


def analyze(mask: torch.fx.Node) -> DocumentMask:
    """What ``mask`` (a node of a Dynamo graph, SDPA's ``attn_mask``) computes; raises
    :class:`NotAMask` with the reason where it is not a document / causal mask."""
    traced = mask_graph.trace(mask)
    if isinstance(traced, str):
        raise NotAMask(traced)
    return analyze_traced(traced)


def analyze_traced(traced: mask_graph.Traced) -> DocumentMask:
    out = traced.output
    if out.op == "placeholder":
        raise NotAMask("the mask comes in from outside the graph (its values are not known to the compiler)")
    val = out.meta["val"]
    reader = _Reader()
    predicate = reader.read(out)
    if val.dim() < 2:
        raise NotAMask("a mask of fewer than two dims")
    if val.dtype.is_floating_point:
        if not isinstance(predicate, Additive):
            raise NotAMask("a real-valued bias (not where(mask, 0, -inf) or masked_fill(-inf))")
        predicate = predicate.kept
    elif val.dtype != torch.bool:
        raise NotAMask(f"a {val.dtype} mask")
    return _classified(predicate, traced, val.dim())


def position_text(x, axis: int | None = None) -> str:
    """A position expression for the report: ``index+32``, ``cat[index]``, ``places[b, index]``
    (a traced node: its name)."""
    if isinstance(x, torch.fx.Node):
        return x.name
    if isinstance(x, Lin):
        if not x.coefs:
            return str(x.const)
        name = "index" if axis is None or x.coefs[0][0] == axis else "b"
        return name + (f"{x.const:+d}" if x.const else "")
    if isinstance(x, Pos):
        return x.node.name
    if isinstance(x, Gather):
        axis = _axis_of(x) if axis is None else axis
        return f"{_strip(x.table).name}[{', '.join(position_text(i, axis) for i in x.index)}]"
    return type(x).__name__


def _node_of(position, reader: _Reader | None) -> torch.fx.Node | None:
    """The traced node computing a mapped position (the lowering evaluates it on device)."""
    if position is None:
        return None
    if isinstance(position, Pos):
        return position.node
    found = [n for n, e in (reader.memo.items() if reader else ()) if e == position and isinstance(n, torch.fx.Node)]
    return found[0] if found else position  # else the expression: the pass builds it from its tables


def _classified(predicate, traced: mask_graph.Traced, rank: int, reader: _Reader | None = None) -> DocumentMask:
    classify = _Classifier(rank)
    for atom in _conjuncts(predicate):
        classify.add(atom)
    if len(classify.doc_ids) > 1:
        raise NotAMask("two tables of document ids")
    doc_ids = next(iter(classify.doc_ids), None)
    if classify.bounds and len(classify.mapped_causal) == 1:  # the positions the bound is read at
        for axis, position in zip((classify.q, classify.kv), classify.mapped_causal[0]):
            classify._map(axis, position)
    query_positions, key_positions = (_node_of(p, reader) for p in classify.maps_of())
    mapped = query_positions is not None or key_positions is not None
    if classify.window is not None and (mapped or not classify.causal and not classify.position_causal):
        raise NotAMask(f"a sliding window (keys from q-{classify.window}) " + (
            "over mapped positions" if mapped else "that is not causal") + ": not lowered yet")
    if mapped and classify.position_causal:
        raise NotAMask("causal over a table of positions where the documents are read at mapped positions")
    if classify.mapped_causal and doc_ids is None and not classify.bounds:
        raise NotAMask("causal over mapped positions without document ids (not lowered yet)")
    checked_positions = None
    for positions in set(classify.position_causal):
        if doc_ids is None:
            raise NotAMask("causal over a table of positions without document ids")
        if _resets_of(doc_ids) is not positions:
            if checked_positions is not None:
                raise NotAMask("causal over two tables of positions")
            checked_positions = positions
        classify.causal = True
    stepping = False
    for positions in classify.stepping_positions:  # a band over positions is one over indices where they step by one
        if doc_ids is None:
            raise NotAMask("a band over a table of positions without document ids")
        if _resets_of(doc_ids) is not positions:  # not proven (a table from outside): checked on device
            if positions not in classify.position_causal:  # (a failed check's dense path reads causal over it)
                raise NotAMask("a band over a table of positions not proven to step by one within each document, "
                               "causal over something else")
            checked_positions, stepping = positions, True
    window = -1 if classify.window is None else classify.window
    if classify.bounds:
        return _bounded(classify, doc_ids, query_positions, key_positions, traced, reader)
    if doc_ids is None:
        return DocumentMask(None, classify.causal, traced=traced, window=window)
    summand = _row_cumsum(doc_ids)
    proven = summand is not None and _nonnegative(summand)
    return DocumentMask(doc_ids, classify.causal, PROVEN if proven else CHECKED, traced, checked_positions,
                        query_positions, key_positions, window, positions_step=stepping)


def _bounded(classify: _Classifier, doc_ids, query_positions, key_positions, traced, reader) -> DocumentMask:
    """A causal mask ``P(kv) <= P(q)`` bounded on the other side by a table read at one
    position: ``start[P(q)] <= P(kv)`` or ``P(q) <= end[P(kv)]`` (P: the index itself, or the
    place torch's flex CP maps it to): documents whose first (last) token the table holds
    (checked on device)."""
    if len(classify.bounds) > 1:
        raise NotAMask("a mask bounded by two tables of document starts or ends")
    (qs, kvs), = classify.bounds
    if classify.mapped_causal:
        at_q, at_kv = classify.mapped_causal[0]
    elif classify.index_causal:
        at_q, at_kv = Lin(((classify.q, 1),)), Lin(((classify.kv, 1),))
    else:
        raise NotAMask("query and key positions compared 'le' (not causal)")
    if kvs == at_kv and isinstance(qs, Gather) and _reads_at(qs, at_q):
        bound, position, at = "start", qs, at_q
    elif qs == at_q and isinstance(kvs, Gather) and _reads_at(kvs, at_kv):
        bound, position, at = "end", kvs, at_kv
    else:
        raise NotAMask("query and key positions compared 'le' (not causal)")
    if doc_ids is not None or classify.position_causal:
        raise NotAMask(f"a table of document {bound}s with document ids (not lowered yet)")
    if classify.window is not None:
        raise NotAMask(f"a sliding window with a table of document {bound}s (not lowered yet)")
    mapped = query_positions is not None or key_positions is not None
    return DocumentMask(None, True, CHECKED, traced, None, query_positions, key_positions, -1, bound,
                        _node_of(position, reader), _node_of(at, reader) if mapped else None)


def _reads_at(table: Gather, position) -> bool:
    """Whether ``table`` reads (through tables it reads, maybe) at ``position``."""
    return any(i == position or (isinstance(i, Gather) and _reads_at(i, position)) for i in table.index)


def analyze_mask_mod(traced: mask_graph.Traced) -> DocumentMask:
    """What a flex ``mask_mod(b, h, q_idx, kv_idx, *buffers)`` computes (its first four traced
    inputs are the indices); raises :class:`NotAMask` where it is not a document / causal mask."""
    index = [n for n in traced.graph.nodes if n.op == "placeholder"][:4]
    reader = _Reader({n: Lin(((axis, 1),)) for axis, n in enumerate(index)})
    if traced.output.meta["val"].dtype != torch.bool:
        raise NotAMask(f"a mask_mod returning {traced.output.meta['val'].dtype}")
    return _classified(reader.read(traced.output), traced, 4, reader)


