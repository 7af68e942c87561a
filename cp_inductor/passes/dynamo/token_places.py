"""Positions a model makes from the token index, made the tokens' places in the full row.

Under the CP the model does not write, the model sees this rank's tokens only. A position it
makes from their index (an ``arange`` over their count: nanoGPT's ``pos = arange(T)``, a rotary
``t = arange(T)``, HF's ``cache_position``) or a table it slices to their count (torchtitan's
``freqs_cis[0:seqlen]``, a cached ``cos[:T]`` or ``cos.narrow(0, 0, T)``, a learned
``pos_emb[:, :T]``) would give each token its index here, not its place in the row. Each becomes the places ``shard_batch`` recorded (the
layout's ``cp_query_positions``, one row of them for all rows, as the arange was; that every row
was cut alike is checked on device by ``row_places``)::

    pos = torch.arange(start, start + T_local, step)             emb = table[:T_local]
    ->
    pos = row_places(cp_query_positions, start, step, dtype)     emb = table.index_select(0, row_places(...))

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
from ..analysis.token_mixing import Dims, TokenTrail

NARROW = (torch.narrow, "narrow")
ARANGE = (torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


@dataclass(frozen=True)
class TokenIndex:
    """One op of ``module`` that gives each of this rank's tokens a value by its index among them."""

    node: torch.fx.Node
    module: torch.fx.GraphModule
    dim: int | None = None  # the table's dim cut to the tokens; None: an arange
    start: object = 0  # the arange's (an int or a symbolic size's node)
    step: object = 1

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


def _integral(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) or (isinstance(x, torch.fx.Node) and isinstance(value(x), (int, torch.SymInt)))


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


def find(modules, trail: TokenTrail | None, live: Callable[[torch.fx.Graph], set]) -> list[TokenIndex]:
    """Every live op of ``modules`` that gives each of this rank's tokens a value by its index,
    read as positions: an arange of their count read otherwise than as a row index of the step's
    data, or a table the graph takes in or holds sliced to its first entries along one dim, whose
    index runs along the token dim of the per-token values it meets (``trail``: their token dims).
    One of that length that meets them along another dim only (a rotary ``arange(head_dim // 2)``
    of a model whose head_dim / 2 is the token count) is not a position; one that meets none,
    or both ways, cannot be told, and raises :class:`Unplaced`."""
    tokens = trail.tokens if trail is not None else None

    def tokens_long(x) -> bool:
        t = value(x)
        return isinstance(t, torch.Tensor) and t.dim() == 1 and statically_known_true(t.shape[0] == tokens)

    found = []
    for module in modules:
        alive = live(module.graph)
        for n in (n for n in module.graph.nodes if n in alive and n.op in ("call_function", "call_method")):
            if n.target in ARANGE and tokens_long(n) and not all(_row_index(n, u) for u in n.users if u in alive):
                index = TokenIndex(n, module, None, *_arange_bounds(n))
            elif (n.target is operator.getitem or n.target in NARROW) and isinstance(n.args[0], torch.fx.Node) \
                    and n.args[0].op in ("placeholder", "get_attr") and (dim := _cut_dim(n, tokens)) is not None:
                index = TokenIndex(n, module, dim)
            else:
                continue
            if _along_tokens(index, trail, alive):
                found.append(index)
    return found


def _along_tokens(index: TokenIndex, trail: TokenTrail | None, alive: set) -> bool:
    """Whether ``index``'s entries run along the token dim of the per-token values they meet."""
    if trail is None:
        raise Unplaced(f"{index.what()} gives each token a value by its index on this rank, and the token count has "
                       "no hint to follow the token dim by")
    mine = TokenTrail(trail.tokens)
    mine.dims[index.node] = Dims({index.dim or 0})
    mine.follow(index.module, Walk([index.node], lambda n: list(n.users), float("inf")).run().seen)
    ways = set()
    for n, dims in mine.dims.items():
        met = trail.of(n)
        if isinstance(dims, frozenset) and dims and met and n in alive:
            ways.add("along" if dims & met else "across")
    if ways == {"along"}:
        return True
    if not ways:
        raise Unplaced(f"{index.what()} gives each token a value by its index on this rank and meets no per-token "
                       "value, so it cannot be told a position or not")
    if ways == {"along", "across"}:
        raise Unplaced(f"{index.what()} gives each token a value by its index on this rank and meets per-token "
                       "values both along their tokens and along another dim")
    return False


def _cut_dim(n: torch.fx.Node, tokens) -> int | None:
    """The dim ``n`` (a getitem of slices, or ``narrow``) cuts to the first ``tokens`` entries of a
    longer table."""
    whole, part = value(n.args[0]), value(n)
    if not (isinstance(whole, torch.Tensor) and isinstance(part, torch.Tensor)):
        return None
    if n.target in NARROW:
        dim, start = (n.args[1:3] if len(n.args) >= 3 else (n.kwargs.get("dim"), n.kwargs.get("start")))
        index = (slice(None),) * (dim % whole.dim()) + (slice(0, None),) if isinstance(dim, int) and start == 0 else ()
    else:
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if not index or not all(isinstance(i, slice) for i in index):
        return None
    for d, cut in enumerate(index):
        if (cut.start in (None, 0) and cut.step in (None, 1) and d < part.dim()
                and statically_known_true(part.shape[d] == tokens) and not statically_known_true(whole.shape[d] == tokens)):
            return d
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
                if not (_integral(index.start) and _integral(index.step)):
                    raise Unplaced(f"{index.what()} (from {index.start} by {index.step}: not integers) gives each token "
                                   "a value by its index on this rank")
                example = value(n)
                row = g.call_function(torch.ops.cp_inductor.row_places.default,
                                      (places, index.start, index.step, example.dtype))
                row.meta["example_value"] = example
                n.replace_all_uses_with(row, delete_user_cb=lambda user: not _row_index(n, user))
            else:
                row = _set_value(g.call_function(torch.ops.cp_inductor.row_places.default, (places, 0, 1, torch.int64)),
                                 places, lambda p: p[0].clone())
                table, cuts = n.args[0], n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
                tokens = value(n).shape[index.dim]
                picked = _set_value(g.call_function(torch.index_select, (table, index.dim, row)), table,
                                    lambda t: t.narrow(index.dim, 0, tokens).contiguous())
                out = picked
                if n.target is operator.getitem:  # the table's other dims cut as the program cut them
                    rest = tuple(slice(None) if d == index.dim else cut for d, cut in enumerate(cuts))
                    out = g.call_function(operator.getitem, (picked, rest))
                    out.meta["example_value"] = value(n)
                n.replace_all_uses_with(out)
        if not n.users:
            g.erase_node(n)
    return made
