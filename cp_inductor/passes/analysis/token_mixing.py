"""Ops other than attention that mix a rank's tokens with each other, found by following the token
dim from the batch's per-token inputs through the graph.

Under context parallelism a rank holds some of each row's tokens. Attention is rewritten to read
every rank's keys; any other op whose output at one token reads other tokens of the row (a short
convolution over the sequence, a cumulative sum, a shift, a softmax over tokens, a matmul that
contracts the token dim, a top-k over tokens) would read only this rank's, and change the
answer; so would a slice of the token dim that keeps only some tokens (a shift written by hand:
``y[:, 1:] = x[:, :-1]``). A sort of tokens is not counted: MoE layers sort their tokens by
expert to dispatch them and put them back, a permutation each rank can make of its own::

    x = embed(input_ids)                      # [B, T, C]: dim 1 is the token dim
    h = conv1d(x.transpose(1, 2), w, groups=C, padding=3)[..., :T]   # dim 2 of conv1d's input
    -> "conv1d: conv1d over the token dim, kernel 4"

The token dim is followed, not guessed from sizes: from the inputs ``shard_batch`` cut (dim 1),
through element-wise ops (dims right-aligned, sizes equal; broadcasting only for the arithmetic
and comparison ops, any other op follows its first input), expands, views and reshapes (by the products
of the leading sizes), transposes and permutes, indexing, concatenation, reductions, embedding
lookups, ``one_hot``, matmuls, ``einsum`` and activation-checkpointed bodies; the inputs are the program's
per-token ones (a parameter whose dim 1 happens to have the token count is not). An op with no
rule carries its first input's token dim only where its output has that input's rank and size
there; otherwise the trail ends, so what it reports is an op it can name, never a guess, and what
it misses stays the user's promise, as before. Live means read by the outputs, or written in
place into a tensor they read. Sums, means and counts over tokens (a loss, a pooled
output) are not counted: a sum is the rank's share of the loss, and a mean is made one or the
full batch's (``passes/dynamo/token_means``, ``token_statistics``); one that keeps the token dim's
place (``keepdim=True``) and is read back at every token by arithmetic (``x - x.mean(1,
keepdim=True)``, or the dim dropped and put back by hand: ``x - x.mean(1)[:, None]``) is. Any
other reduction over the token dim (``amax``: max pooling; ``argmax``: HF's classifiers finding
the last token that is not padding; ``std``, ``logsumexp``, ...) is: over this rank's tokens it is
another value, and nothing makes it the full row's. Past an attention call the context-parallel
pass rewrote, the token dims go on from the new call's output (``carry``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

from .graph_walk import Walk
from .op_schema import value

Dims = frozenset

MIXING_ALONG_DIM = {  # name -> (position of ``dim``, its keyword, its default)
    "cumsum": (1, "dim", None), "cumprod": (1, "dim", None), "cummax": (1, "dim", None), "cummin": (1, "dim", None),
    "logcumsumexp": (1, "dim", None), "softmax": (1, "dim", None), "log_softmax": (1, "dim", None),
    "softmin": (1, "dim", None), "diff": (2, "dim", -1), "topk": (2, "dim", -1), "kthvalue": (2, "dim", -1),
    "flip": (1, "dims", None), "roll": (2, "dims", None), "fliplr": (None, None, 1), "flipud": (None, None, 0),
    "unfold": (1, "dimension", None),
    "fft_fft": (2, "dim", -1), "fft_ifft": (2, "dim", -1), "fft_rfft": (2, "dim", -1), "fft_irfft": (2, "dim", -1),
}
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "prod", "logsumexp", "std", "var", "norm", "any", "all",
              "argmax", "argmin", "count_nonzero", "nansum", "nanmean", "median", "nanmedian", "mode"}
# reductions whose value over this rank's tokens is not a share of the full row's and that no
# pass makes the full row's (sums, means and counts are: passes/dynamo/token_means, token_statistics)
ROW_ONLY_REDUCTIONS = {"amax", "amin", "max", "min", "prod", "logsumexp", "std", "var", "norm", "argmax", "argmin",
                       "median", "nanmedian", "mode", "aminmax"}
CONVOLUTIONS = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution"}
POOLS = {"avg_pool1d", "avg_pool2d", "max_pool1d", "max_pool2d", "adaptive_avg_pool1d", "adaptive_max_pool1d",
         "lp_pool1d", "max_pool1d_with_indices"}
BROADCASTING = {"add", "sub", "mul", "truediv", "div", "floordiv", "mod", "pow", "rsub", "where", "masked_fill",
                "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "logical_and",
                "logical_or", "addcmul", "addcdiv", "lerp", "iadd", "imul", "isub", "itruediv"}
CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
ARITHMETIC = BROADCASTING - {"eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "logical_and", "logical_or"}
VALUE_WISE = {"to", "float", "half", "bfloat16", "type_as", "contiguous", "clone", "neg", "abs", "sqrt", "rsqrt", "exp",
              "log", "reciprocal", "pow", "add", "sub", "mul", "div", "truediv", "rsub", "clamp", "sigmoid", "tanh"}


@dataclass(frozen=True)
class Mixing:
    """An op that mixes tokens: its node and how, in words for the error."""
    node: str
    how: str

    def __str__(self) -> str:
        return f"{self.node}: {self.how}"


def op_name(n: torch.fx.Node) -> str:
    if n.op == "call_method":
        return str(n.target)
    name = getattr(n.target, "__name__", str(n.target))
    return name.split(".")[0]


def _arg(n: torch.fx.Node, position: int | None, keyword: str | None, default=None):
    if position is not None and len(n.args) > position:
        return n.args[position]
    return n.kwargs.get(keyword, default) if keyword else default


def _hint(s) -> int | None:
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _shape(x) -> tuple | None:
    t = value(x) if isinstance(x, torch.fx.Node) else x
    if not isinstance(t, torch.Tensor):
        return None
    sizes = tuple(_hint(s) for s in t.shape)
    return None if None in sizes else sizes


def _norm(dims, ndim: int) -> set[int] | None:
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return {d % ndim for d in dims} if ndim else set()


def _right_aligned(inputs: Iterable[tuple[tuple, Dims]], out: tuple) -> Dims:
    """Element-wise and broadcasting: output dim j is a token dim where an input's token dim sits
    at the same place from the right with the same size."""
    found = set()
    for shape, dims in inputs:
        for i in dims:
            j = i - len(shape) + len(out)
            if 0 <= j < len(out) and out[j] == shape[i]:
                found.add(j)
    return Dims(found)


def _reshaped(shape: tuple, dims: Dims, out: tuple, tokens: int) -> Dims:
    """A view or reshape: the output dim holding an input token dim's elements (alone or merged
    with others, ``[B, T] -> [B*T]``); where one is split (``[B*T] -> [B, T]``), the part of the
    token count."""
    found = set()
    leads = [math.prod(out[:j]) for j in range(len(out))]
    for i in dims:
        before, through = math.prod(shape[:i]), math.prod(shape[:i + 1])
        holding = [j for j, size in enumerate(out) if size > 1 and leads[j] <= before and leads[j] * size >= through]
        parts = [j for j, size in enumerate(out) if size == tokens and before <= leads[j] and leads[j] * size <= through]
        found.update(holding[:1] or parts[-1:])
    return Dims(found)


def basic_index(shape: tuple, index) -> tuple | None:
    """A basic index (ints, slices, None) with its Ellipsis spelled out; None for a tensor index."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, (torch.fx.Node, list)) for i in index):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        used = sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - used) + index[at + 1:]
    return index


def _token_cut(shape: tuple, dims: Dims, index, out: tuple | None) -> int | None:
    """The token dim a basic index keeps only some tokens of (a slice that starts later, stops
    sooner or steps: a shift or a crop), or None."""
    index = basic_index(shape, index)
    j = i = 0
    for item in index or ():
        if item is None:
            j += 1
        elif isinstance(item, int):
            i += 1
        else:
            if i in dims and not (item.start in (None, 0) and item.step in (None, 1) and out is not None
                                  and j < len(out) and out[j] == shape[i]):
                return i
            i, j = i + 1, j + 1
    return None


def _spelled(index) -> str:
    """An index as Python writes it (``:, :-1``)."""
    def one(item) -> str:
        if isinstance(item, slice):
            text = f"{'' if item.start is None else item.start}:{'' if item.stop is None else item.stop}"
            return text + (f":{item.step}" if item.step is not None else "")
        return "..." if item is Ellipsis else str(item)
    return ", ".join(one(i) for i in (index if isinstance(index, tuple) else (index,)))


def _index(shape: tuple, dims: Dims, index) -> Dims:
    """Basic indexing (ints, slices, None, Ellipsis); a tensor index ends the trail."""
    index = basic_index(shape, index)
    if index is None:
        return Dims()
    found, j, i = set(), 0, 0
    for item in index:
        if item is None:
            j += 1
        elif isinstance(item, int):
            i += 1
        else:
            if i in dims:
                found.add(j)
            i, j = i + 1, j + 1
    found.update(j + (d - i) for d in dims if d >= i)
    return Dims(found)


def _without(dims: Dims, removed: set[int]) -> Dims:
    return Dims(d - sum(1 for r in removed if r < d) for d in dims if d not in removed)


class TokenTrail:
    """Per node of a graph (and of the checkpointed bodies it calls), the dims that are token dims."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.dims: dict[torch.fx.Node, object] = {}
        # values pooled over the token dim (``x.mean(1, keepdim=True)``, ``x.mean(1)``), and what
        # they became through views and value-wise ops: read back at every token, they mix them
        self.pooled: dict[torch.fx.Node, str] = {}

    def seed(self, inputs: Iterable[torch.fx.Node], rows: int | None = None) -> None:
        """``inputs``: the per-token inputs (their dim 1 this rank's tokens, or, where the batch
        has ``rows`` rows, their dim 0 the rows' tokens flattened: a MoE's router logits handed
        across a graph break); a parameter whose dim happens to have that size is not one."""
        for n in inputs:
            shape = _shape(n)
            if shape is not None and len(shape) >= 2 and shape[1] == self.tokens:
                self.dims[n] = Dims({1})
            elif shape and rows is not None and shape[0] == rows * self.tokens:
                self.dims[n] = Dims({0})

    def carry(self, replaced: dict[torch.fx.Node, torch.fx.Node]) -> None:
        """The token dims of nodes a rewrite replaced, given to what replaced them (the ops
        after them were followed from the old ones)."""
        for old, new in replaced.items():
            if old in self.dims:
                self.dims[new] = self.dims[old]

    def of(self, x) -> Dims:
        got = self.dims.get(x) if isinstance(x, torch.fx.Node) else None
        return got if isinstance(got, frozenset) else Dims()

    def follow(self, module: torch.fx.GraphModule, only: set[torch.fx.Node] | None = None) -> None:
        """The token dims of ``module``'s nodes (of ``only``, where given) from those known."""
        for n in module.graph.nodes:
            if n.op in ("call_function", "call_method") and (only is None or n in only):
                got = self._rule(module, n)
                if got:
                    self.dims[n] = got
                first = n.args[0] if n.args else None
                if n not in self.pooled and first in self.pooled and op_name(n) in VIEWS | VALUE_WISE:
                    self.pooled[n] = self.pooled[first]

    def _rule(self, module, n: torch.fx.Node):
        name, out = op_name(n), _shape(n)
        first = n.args[0] if n.args else None
        source = self.of(first)
        if n.target is CHECKPOINT:
            return self._checkpoint(module, n)
        parts = self.dims.get(first) if isinstance(first, torch.fx.Node) else None
        if n.target is operator.getitem and isinstance(parts, tuple):
            return parts[n.args[1]] if isinstance(n.args[1], int) and n.args[1] < len(parts) else None
        values = value(n)
        if isinstance(values, (tuple, list)):  # split, chunk, unbind, sort, topk, max(dim): per element
            shape = _shape(first)
            if name == "unbind" and shape:  # its dim taken out of each
                return (_without(source, {_arg(n, 1, "dim", 0) % len(shape)}),) * len(values)
            return tuple(_right_aligned([(shape, source)], v_shape) if shape and (v_shape := _shape(v)) else Dims()
                         for v in values)
        if out is None:
            return None
        shape = _shape(first)
        if n.target is operator.getitem:
            return _index(shape, source, n.args[1]) if shape and source else None
        if name in ("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "_unsafe_view"):
            return _reshaped(shape, source, out, self.tokens) if shape and source else None
        if name in ("transpose", "swapaxes", "swapdims", "t", "permute", "movedim", "moveaxis") or (
                name == "getattr" and n.args[1] in ("T", "mT", "H", "mH")):
            return self._permuted(n, name, shape, source)
        if name == "one_hot":  # a trailing dim of classes: the index's dims stay where they were
            return source
        if name in ("outer", "ger"):  # a's entries down the rows, b's along them
            other = n.args[1] if len(n.args) > 1 else None
            return Dims({*(0 for _ in source), *(1 for _ in self.of(other))}) if shape and len(shape) == 1 else None
        if name in ("expand", "expand_as", "broadcast_to"):  # new leading dims, the others as they were
            return _right_aligned([(shape, source)], out) if shape and source else None
        if name in ("unsqueeze", "squeeze", "embedding", "cat", "concat", "concatenate", "stack"):
            return self._inserted(n, name, shape, source, out)
        if name in REDUCTIONS:
            dims = _norm(_arg(n, 1, "dim"), len(shape)) if shape else None
            if dims is not None and dims & source:  # kept or dropped (then put back by hand: x.mean(1)[:, None])
                self.pooled[n] = f"{name} over the token dim"
            if dims is not None and _arg(n, 2, "keepdim", False):
                return Dims(source - dims)  # the reduced dims stay, of size 1
            if dims is None:
                return None
            return _without(source, dims)
        if name in ("matmul", "bmm", "mm") or n.target is operator.matmul:
            return self._matmul(n, n.args[0], n.args[1])
        if name in ("addmm", "baddbmm"):  # GPT-2's Conv1D: bias + x @ w
            return self._matmul(n, n.args[1], n.args[2])
        if name == "linear":
            return source if shape and len(shape) - 1 not in source else None
        if name == "einsum":
            return self._einsum(n)[0]
        tensors = [x for x in (*n.args, *n.kwargs.values()) if isinstance(x, torch.fx.Node)]
        if name not in BROADCASTING:  # an op with no rule: its first input alone, of the output's rank
            tensors = tensors[:1] if shape is not None and len(shape) == len(out) else []
        shapes = [(_shape(x), self.of(x)) for x in tensors]
        return _right_aligned([(s, d) for s, d in shapes if s is not None and d and len(s) <= len(out)], out)

    def _permuted(self, n, name, shape, source):
        if not shape or not source:
            return None
        order = list(range(len(shape)))
        if name == "t" or (name == "getattr" and n.args[1] in ("T", "H")):
            order = order[::-1]
        elif name == "getattr":  # .mT, .mH
            order[-2:] = order[:-3:-1]
        elif name == "permute":
            given = _arg(n, 1, "dims")
            given = n.args[1:] if isinstance(given, int) else given
            if not isinstance(given, (list, tuple)):
                return None
            order = [d % len(shape) for d in given]
        elif name in ("movedim", "moveaxis"):
            a, b = _arg(n, 1, "source"), _arg(n, 2, "destination")
            if not (isinstance(a, int) and isinstance(b, int)):
                return None
            order.remove(a % len(shape))
            order.insert(b % len(shape), a % len(shape))
        else:
            a, b = (_arg(n, k, kw) for k, kw in ((1, "dim0"), (2, "dim1")))
            a, b = a % len(shape), b % len(shape)
            order[a], order[b] = order[b], order[a]
        return Dims(j for j, i in enumerate(order) if i in source)

    def _inserted(self, n, name, shape, source, out):
        if name == "embedding":  # the indices' dims, then the table's row
            return source
        if name in ("cat", "concat", "concatenate", "stack"):
            tensors = _arg(n, 0, "tensors", ())
            tensors = tensors if isinstance(tensors, (list, tuple)) else ()
            parts = [self.of(x) for x in tensors]
            common = Dims.intersection(*parts) if parts and all(parts) else Dims()
            if name != "stack":
                return common
            at = _arg(n, 1, "dim", 0) % len(out)
            return Dims(d + (d >= at) for d in common)
        if not shape or not source:
            return None
        if name == "unsqueeze":
            at = _arg(n, 1, "dim") % len(out)
            return Dims(d + (d >= at) for d in source)
        squeezed = _norm(_arg(n, 1, "dim"), len(shape))
        removed = {d for d in (squeezed if squeezed is not None else range(len(shape))) if shape[d] == 1}
        return _without(source, removed)

    def _matmul(self, n, left, right) -> Dims | None:
        a, b = _shape(left), _shape(right)
        if not a or not b or len(a) < 2 or len(b) < 2:
            return None
        da, db = self.of(left), self.of(right)
        out = _shape(n)
        if out is None or len(out) < 2:
            return None
        batch = _right_aligned([(a[:-2], Dims(d for d in da if d < len(a) - 2)),
                                (b[:-2], Dims(d for d in db if d < len(b) - 2))], out[:-2])
        return Dims({*batch, *({len(out) - 2} if len(a) - 2 in da else ()), *({len(out) - 1} if len(b) - 1 in db else ())})

    def _einsum(self, n) -> tuple[Dims | None, set[str]]:
        """The output's token dims and the letters contracted that were token dims."""
        equation = n.args[0] if isinstance(n.args[0], str) else None
        operands = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        if equation is None or "->" not in equation or "." in equation:
            return None, set()
        ins, out = equation.replace(" ", "").split("->")
        token_letters = {spec[d] for spec, x in zip(ins.split(","), operands) for d in self.of(x) if d < len(spec)}
        return Dims(j for j, letter in enumerate(out) if letter in token_letters), token_letters - set(out)

    def _checkpoint(self, module, n):
        body = getattr(module, n.args[0].target, None) if isinstance(n.args[0], torch.fx.Node) else None
        if not isinstance(body, torch.fx.GraphModule):
            return None
        for placeholder, x in zip(body.graph.find_nodes(op="placeholder"), n.args[1:]):
            if self.of(x):
                self.dims[placeholder] = self.of(x)
        self.follow(body)
        result = body.graph.output_node().args[0]
        return tuple(self.of(x) for x in result) if isinstance(result, (tuple, list)) else None

    def mixing(self, module: torch.fx.GraphModule, live: set[torch.fx.Node]) -> Mixing | None:
        """The first live op of ``module`` (or of a body it checkpoints) that mixes tokens."""
        for n in module.graph.nodes:
            if n.target is CHECKPOINT and n in live:
                body = getattr(module, n.args[0].target, None)
                found = self.mixing(body, set(body.graph.nodes)) if isinstance(body, torch.fx.GraphModule) else None
                if found is not None:
                    return found
            if n in live and n.op in ("call_function", "call_method"):
                how = self._mixes(n)
                if how is not None:
                    return Mixing(n.name, how)
        return None

    def _mixes(self, n: torch.fx.Node) -> str | None:
        name = op_name(n)
        first = n.args[0] if n.args else None
        shape, source = _shape(first), self.of(first)
        if name in ARITHMETIC and self.of(n):
            pooled = next((self.pooled[x] for x in n.all_input_nodes if x in self.pooled), None)
            if pooled is not None:
                return f"{pooled}, read back at every token ({name})"
        if n.target is operator.getitem and shape and source and isinstance(first, torch.fx.Node):
            if _token_cut(shape, source, n.args[1], _shape(n)) is not None:
                return f"a slice of the token dim keeping some of its tokens (a shift or a crop: [{_spelled(n.args[1])}])"
        if name == "narrow" and shape and source:
            dim, out = _arg(n, 1, "dim"), _shape(n)
            dim = dim % len(shape) if isinstance(dim, int) else None
            if dim is not None and dim in source and out is not None and out[dim] != shape[dim]:
                return "narrow of the token dim keeping some of its tokens (a shift or a crop)"
        if name in ROW_ONLY_REDUCTIONS and shape and source:
            dims = _arg(n, 2 if name == "norm" else 1, "dim")  # norm(x, p, dim)
            if isinstance(dims, torch.fx.Node) or (name in ("max", "min") and len(n.args) > 1 and not isinstance(dims, int)):
                return None  # element-wise against another tensor
            reduced = _norm(dims, len(shape)) if dims is not None else set(range(len(shape)))
            if reduced is not None and reduced & source:
                return f"{name} over the token dim (this rank's tokens' alone, which no pass makes the full row's)"
        if name in CONVOLUTIONS or name in POOLS:
            spatial = set(range(2 if shape and len(shape) > 2 else 1, len(shape or ())))
            if not source & spatial:
                return None
            weight = _shape(n.args[1]) if name in CONVOLUTIONS and len(n.args) > 1 else None
            if weight is not None and all(k == 1 for k in weight[2:]):
                return None  # a 1-wide kernel reads each token alone
            return f"{name} over the token dim" + (f", kernel {'x'.join(map(str, weight[2:]))}" if weight else "")
        if name in MIXING_ALONG_DIM and shape and source:
            position, keyword, default = MIXING_ALONG_DIM[name]
            dims = _norm(_arg(n, position, keyword, default), len(shape))
            if name == "roll" and dims is None:
                dims = set(range(len(shape)))  # rolled flat
            if dims and dims & source:
                return f"{name} along the token dim"
        if name == "pad" and shape and source:
            pad = _arg(n, 1, "pad")
            if isinstance(pad, (list, tuple)):
                padded = {len(shape) - 1 - k // 2 for k, amount in enumerate(pad) if amount != 0}
                if padded & source:
                    return "pad along the token dim"
        operands: tuple = n.args[:2] if name in ("matmul", "bmm", "mm") or n.target is operator.matmul else \
            n.args[1:3] if name in ("addmm", "baddbmm") else ()
        if len(operands) == 2:
            left, right = operands
            a, b = _shape(left), _shape(right)
            if a and b and len(b) >= 2 and ((len(a) - 1) in self.of(left) or len(b) - 2 in self.of(right)):
                return "a matmul contracting the token dim"
        if name == "linear" and shape and len(shape) - 1 in source:
            return "a linear layer over the token dim"
        if name == "einsum":
            _, contracted = self._einsum(n)
            if contracted:
                return f"einsum contracting the token dim ({''.join(sorted(contracted))})"
        return None


VIEWS = {"getitem", "view", "reshape", "transpose", "permute", "narrow", "select", "slice", "unsqueeze", "squeeze",
         "expand", "flatten", "unflatten", "as_strided", "view_as", "t", "movedim", "chunk", "split", "unbind", "diagonal"}


def live_nodes(graph: torch.fx.Graph, unread: Iterable[tuple[object, Iterable[int]]] = ()) -> set[torch.fx.Node]:
    """The nodes the graph's outputs read, not through the argument positions ``unread`` names per
    op (tables the CP rewrite checks against the layout rather than computes with); an in-place op
    (``add_``, ``copy_``, a setitem: no user reads it) is live where the tensor it writes, or the
    base it views, is."""
    skip = {target: set(positions) for target, positions in unread}

    def read(n: torch.fx.Node) -> list:
        positions = skip.get(n.target, ())
        args = [a for k, a in enumerate(n.args) if k not in positions]
        found: list[torch.fx.Node] = []
        torch.fx.node.map_arg((args, n.kwargs), found.append)
        return found

    writes = [n for n in graph.nodes if n.op in ("call_function", "call_method") and _writes(n)]
    live = Walk(graph.find_nodes(op="output"), read, limit=math.inf).run().seen
    while more := [n for n in writes if n not in live and _base(n.args[0]) in live]:
        live = Walk(more, read, limit=math.inf).run().seen | live
    return live


def _writes(n: torch.fx.Node) -> bool:
    name = op_name(n)
    return bool(n.args) and isinstance(n.args[0], torch.fx.Node) and (
        n.target is operator.setitem or (name.endswith("_") and not name.startswith("_")))


def writes_state(n: torch.fx.Node) -> bool:
    """Whether ``n`` writes in place into a tensor the graph takes in or holds (a module's buffer)."""
    return _writes(n) and _base(n.args[0]).op in ("placeholder", "get_attr")


def _base(x: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``x`` views (through indexing and view ops)."""
    while x.op in ("call_function", "call_method") and op_name(x) in VIEWS and x.args and isinstance(x.args[0], torch.fx.Node):
        x = x.args[0]
    return x


def reduced_token_dims(trail: TokenTrail, n: torch.fx.Node) -> set[int]:
    """The token dims of its input that reduction ``n`` (over the dims it is given) reduces."""
    first = n.args[0] if n.args else None
    shape = _shape(first)
    dims = _norm(_arg(n, 1, "dim"), len(shape)) if shape else None
    return set(dims & trail.of(first)) if dims else set()


def trail_of(module: torch.fx.GraphModule, tokens, inputs=None, rows=None) -> TokenTrail | None:
    """The token dims of every node of ``module`` from its per-token placeholders ``inputs`` (all
    of them where not given; ``rows``: the batch's, where inputs may come flattened), or None
    where the token count has no hint."""
    count = _hint(tokens)
    if count is None:
        return None
    trail = TokenTrail(count)
    trail.seed(inputs if inputs is not None else module.graph.find_nodes(op="placeholder"), _hint(rows))
    trail.follow(module)
    return trail


def first_mixing(module: torch.fx.GraphModule, tokens, unread=(), inputs=None) -> Mixing | None:
    """The first op of ``module`` past attention that mixes this rank's ``tokens``, or None;
    ``inputs``: the per-token placeholders (all of them where not given)."""
    trail = trail_of(module, tokens, inputs)
    return trail.mixing(module, live_nodes(module.graph, unread)) if trail is not None else None
