"""Positions a model makes from the token index, made the tokens' places in the full row.

Under the CP the model does not write, the model sees this rank's tokens only. A position it
makes from their index (an ``arange`` over their count: nanoGPT's ``pos = arange(T)``, a rotary
``t = arange(T)``, HF's ``cache_position``) or a table it slices to their count (torchtitan's
``freqs_cis[0:seqlen]``, a cached ``cos[:T]`` or ``cos.narrow(0, 0, T)``, a learned
``pos_emb[:, :T]``) would give each token its index here, not its place in the row. Each becomes the places ``shard_batch`` recorded (the
layout's ``cp_query_positions``, one row of them for all rows, as the arange was; that every row
was cut alike is checked on device by ``row_places``)::

    pos = torch.arange(T_local)                                  emb = table[:T_local]
    ->
    pos = row_places(cp_query_positions, 0, 1, dtype)            emb = table.index_select(0, row_places(...))

An arange read as a row index into the step's data (``logits[arange(B), i]``) is the same on
every layout and stays. Where the arange or the slice sits in a checkpointed body, the places are
handed to the body as an input of its own.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...lowerings import cp_collectives  # noqa: F401 - registers row_places
from ..analysis.graph_walk import Walk
from ..analysis.op_schema import value
from ..analysis.token_mixing import ARITHMETIC, Dims, TokenTrail, basic_index, op_name

NARROW = (torch.narrow, "narrow")
ARANGE = (torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


@dataclass(frozen=True)
class TokenIndex:
    """One op of ``module`` that gives each of this rank's tokens a value by its index among them."""

    node: torch.fx.Node
    module: torch.fx.GraphModule
    dim: int | None = None  # the table's dim cut to the tokens; None: an arange
    at: int = 0  # the dim of the op's output that runs over the tokens
    rest: tuple | None = None  # a getitem's index (Ellipsis spelled out) with the tokens' cut made whole

    def what(self) -> str:
        if self.dim is None:
            return f"{self.node.name}: an arange over this rank's tokens"
        return f"{self.node.name}: the first entries of {self.node.args[0].name} (dim {self.dim})"


class Unplaced(RuntimeError):
    """A position made from the token index that cannot be made the tokens' places."""


def _arange_bounds(n: torch.fx.Node) -> tuple[object, object]:
    """(start, step) of an arange call, as its arguments give them."""
    args = list(n.args)
    if len(args) == 1:
        args = [n.kwargs.get("start", 0), args[0]]
    return (args[0] if args else n.kwargs.get("start", 0)), (args[2] if len(args) > 2 else n.kwargs.get("step", 1))


def _row_index(index: torch.fx.Node, user: torch.fx.Node) -> bool:
    """``user`` reads tensor rows at ``index`` (advanced indexing), from a tensor of the step's
    own data rather than of the model's (a table of positions would be the model's)."""
    if user.target is not operator.getitem or not isinstance(user.args[1], tuple) or index not in user.args[1]:
        return False
    data = user.args[0]
    return isinstance(data, torch.fx.Node) and not is_module_state(data) and index is not data


def is_module_state(n: torch.fx.Node) -> bool:
    """A parameter or buffer of the model (not a tensor the step computes or passes in)."""
    if n.op == "get_attr":
        return True
    source = getattr(n, "_dynamo_source", None)
    name = getattr(source, "name", "")
    name = name() if callable(name) else name  # a method before torch 2.12, a property after
    return n.op == "placeholder" and any(part in name for part in ("buffers", "parameters", "_modules"))


def find(modules, trail: TokenTrail | None, live: Callable[[torch.fx.Graph], set], tokens) -> list[TokenIndex]:
    """Every live op of ``modules`` that gives each of this rank's ``tokens`` (the count, symbolic
    under dynamic shapes) a value by its index, read as positions: an arange of their count read
    otherwise than as a row index of the step's data, or a table that is not per-token data cut to
    its first entries along one dim, whose index runs along the token dim of the per-token values
    it meets (``trail``: their token dims). One of that length that meets them along another dim
    only (a rotary ``arange(head_dim // 2)`` of a model whose head_dim / 2 is the token count) is
    not a position; one that meets none, or both ways, cannot be told, and raises
    :class:`Unplaced`; so does an arange from another start or by another step, or combined with
    the token count (``arange(T) / T``: under CP the count is the rank's, not the row's)."""
    def tokens_long(x) -> bool:
        t = value(x)
        return isinstance(t, torch.Tensor) and t.dim() == 1 and statically_known_true(t.shape[0] == tokens)

    found = []
    for module in modules:
        alive = live(module.graph)
        for n in (n for n in module.graph.nodes if n in alive and n.op in ("call_function", "call_method")):
            bounds: tuple[object, object] = (0, 1)
            if n.target in ARANGE and tokens_long(n) and not all(_row_index(n, u) for u in n.users if u in alive):
                index, bounds = TokenIndex(n, module), _arange_bounds(n)
            elif (n.target is operator.getitem or n.target in NARROW) and isinstance(n.args[0], torch.fx.Node) \
                    and not (trail is not None and trail.of(n.args[0])) and (cut := _cut(n, tokens)) is not None:
                index = TokenIndex(n, module, *cut)
            else:
                continue
            if _along_tokens(index, trail, alive, tokens):
                if not all(isinstance(b, int) and b == want for b, want in zip(bounds, (0, 1))):
                    raise Unplaced(f"{index.what()} (from {bounds[0]} by {bounds[1]}, not from 0 by 1) gives each "
                                   "token a value by its index on this rank")
                found.append(index)
    return found


def _along_tokens(index: TokenIndex, trail: TokenTrail | None, alive: set, tokens) -> bool:
    """Whether ``index``'s entries run along the token dim of the per-token values they meet."""
    if trail is None:
        raise Unplaced(f"{index.what()} gives each token a value by its index on this rank, and the token count has "
                       "no hint to follow the token dim by")
    mine = TokenTrail(trail.tokens)
    mine.dims[index.node] = Dims({index.at})
    mine.follow(index.module, Walk([index.node], lambda n: list(n.users), float("inf")).run().seen)
    ways, counted = set(), []
    for n, dims in mine.dims.items():
        met = trail.of(n)
        if isinstance(dims, frozenset) and dims and met and n in alive:
            ways.add("along" if dims & met else "across")
        elif isinstance(dims, frozenset) and dims and n in alive and op_name(n) in ARITHMETIC and any(
                _is_token_count(a, tokens) for a in (*n.args, *n.kwargs.values()) if a is not index.node):
            counted.append(n.name)
    if ways == {"along"} and counted:
        raise Unplaced(f"{index.what()} is combined with this rank's token count ({counted[0]}); under CP the "
                       "count is this rank's, not the row's")
    if ways == {"along"}:
        return True
    if not ways:
        raise Unplaced(f"{index.what()} gives each token a value by its index on this rank and meets no per-token "
                       "value the token dim could be followed to, so it cannot be told a position or not")
    if ways == {"along", "across"}:
        raise Unplaced(f"{index.what()} gives each token a value by its index on this rank and meets per-token "
                       "values both along their tokens and along another dim")
    return False


def _is_token_count(a, tokens) -> bool:
    """``a`` is the token count, or one less (``T - 1 - arange(T)``), as a number or a size."""
    a = value(a) if isinstance(a, torch.fx.Node) else a
    return isinstance(a, (int, float, torch.SymInt)) and not isinstance(a, bool) and (
        statically_known_true(a == tokens) or statically_known_true(a == tokens - 1))


def _cut(n: torch.fx.Node, tokens) -> tuple[int, int, tuple | None] | None:
    """(the table's dim, the output's dim, the index with that cut made whole) where ``n`` (a
    getitem of slices, ints and Nones, or ``narrow``) cuts a longer table to its first ``tokens``
    entries, or None."""
    whole, part = value(n.args[0]), value(n)
    if not (isinstance(whole, torch.Tensor) and isinstance(part, torch.Tensor)):
        return None
    if n.target in NARROW:
        dim, start = (n.args[1:3] if len(n.args) >= 3 else (n.kwargs.get("dim"), n.kwargs.get("start")))
        if not (isinstance(dim, int) and isinstance(start, int) and start == 0):
            return None
        dim %= whole.dim()
        cuts = statically_known_true(part.shape[dim] == tokens) and not statically_known_true(whole.shape[dim] == tokens)
        return (dim, dim, None) if cuts else None
    index = basic_index(tuple(whole.shape), n.args[1])
    if index is None or not all(i is None or isinstance(i, (int, slice)) for i in index):
        return None
    table_dim = out_dim = 0
    for k, item in enumerate(index):
        if item is None:
            out_dim += 1
        elif isinstance(item, int):
            table_dim += 1
        else:
            if (item.start in (None, 0) and item.step in (None, 1) and out_dim < part.dim()
                    and statically_known_true(part.shape[out_dim] == tokens)
                    and not statically_known_true(whole.shape[table_dim] == tokens)):
                return table_dim, out_dim, index[:k] + (slice(None),) + index[k + 1:]
            table_dim, out_dim = table_dim + 1, out_dim + 1
    return None


def _set_value(node: torch.fx.Node, like: torch.fx.Node, fn) -> torch.fx.Node:
    """``node`` with the example value ``fn`` computes from ``like``'s (in its fake mode)."""
    example = value(like)
    with getattr(example, "fake_mode", contextlib.nullcontext()):
        node.meta["example_value"] = fn(example)
    return node


def rewrite(found: list[TokenIndex], places_in: Callable[[torch.fx.GraphModule], torch.fx.Node]) -> list[str]:
    """Each of ``found`` made the tokens' places (``places_in(module)``: the layout's
    ``cp_query_positions`` as that module's graph has it); what became of each, for the report."""
    made = []
    for index in found:
        g, n = index.module.graph, index.node
        made.append(f"{index.what()}: this rank's places in the row (rows cut alike, checked on device)")
        places = places_in(index.module)
        with g.inserting_before(n):
            if index.dim is None:
                example = value(n)
                row = g.call_function(torch.ops.cp_inductor.row_places.default,
                                      (places, 0, 1, example.dtype))
                row.meta["example_value"] = example
                n.replace_all_uses_with(row, delete_user_cb=lambda user: not _row_index(n, user))
            else:
                row = _set_value(g.call_function(torch.ops.cp_inductor.row_places.default, (places, 0, 1, torch.int64)),
                                 places, lambda p: p[0].clone())
                table, count = n.args[0], value(n).shape[index.at]
                picked = _set_value(g.call_function(torch.index_select, (table, index.dim, row)), table,
                                    lambda t: t.narrow(index.dim, 0, count).contiguous())
                out = picked
                if index.rest is not None:  # the table's other dims cut as the program cut them
                    out = g.call_function(operator.getitem, (picked, index.rest))
                    out.meta["example_value"] = value(n)
                n.replace_all_uses_with(out)
        if not n.users:
            g.erase_node(n)
    return made
