"""Statistics over this rank's tokens made the full batch's, where a loss reads them.

A mean or sum over the token dim that keeps other dims (a statistic: ``probs.mean(0)`` per
expert, ``hidden.mean(1)`` per row, ``(l * m).sum(1)`` per row) and reaches the loss through
anything but sums is wrong under context parallelism when it is this rank's: the ranks' losses
sum to ``f(m_0) + f(m_1)``, not to ``f(m)`` of the full batch's. HF's MoE load-balancing loss is
one (``sum(tokens_per_expert * router_prob_per_expert) * E``, both means over the tokens); a
mean-pooled classifier, a per-row mean loss are others. Each such statistic becomes the full
batch's (all-reduced; every rank holds as many tokens, so the mean is the mean of the ranks'),
the same on every rank; where a value computed from the statistics alone (replicated) meets
the rank's own (a share of the loss: a sum with it, or an output), it is divided by cp, so that
the ranks' outputs again sum to the single-device ones::

    aux = (one_hot(top).float().mean(0) * probs.mean(0)).sum() * E
    loss = ce + 0.01 * aux
    ->
    stat = probs.mean(0)
    stat = (stat - stat.detach()) + all_reduce(stat.detach(), "sum") / cp      # likewise the other mean
    aux = (... * stat).sum() * E
    loss = ce + (0.01 * aux) / cp

The gradient reaches this rank's tokens as the single device's reaches them: the value is the
full batch's statistic, its derivative with respect to this rank's own is 1 for a mean (cp for a
sum: ``m * cp - m.detach() * cp``), and the replicated term's division by cp is the chain
rule's ``1 / cp`` of the mean over the ranks. A sum divided by a multiple of this rank's token
count (a mean written as a sum over a count the program read from its shapes: HF's tokens per
expert, ``histc(experts) / num_tokens``) is divided by cp times that count. (Where the count
is a number in the graph, as HF's is even under ``dynamic=True``, a constant of the program's that
happens to be such a multiple is read the same way.)

One token picked by its index in the row (``hidden[:, 0]``: BERT's pooler; ``x[:, -1]``) is a
statistic too: on this rank it is the sum of its tokens at that place (``cp_query_positions``, the
layout's places; only the rank holding it has one), then all-reduced like a sum::

    pooled = hidden[:, 0]
    ->
    pooled = (hidden * (cp_query_positions == 0)[:, :, None].to(hidden.dtype)).sum(1)   # then as above

Every scalar the graph hands out is the rank's share (``combine_losses`` sums them); a tensor
computed from means alone is handed out as the full batch's (pooled logits beside the loss, as
the single device returns them). Left as they are: statistics read back by per-token values
(``x - x.mean(1)``: ``analysis/token_mixing`` names those as mixing; a MoE's count of tokens per
expert ordering its own tokens is this rank's on purpose), counts or sums read beside this
rank's own values or handed out as tensors (split sizes a MoE reads on the host after a graph
break), and ``histc`` without a range (each rank's bins would span its own values). A replicated
value read with a share otherwise than added to it (``loss * balance``, ``loss ** balance``: the
values would agree, the gradients not), or a mean or picked token read beside this rank's own
values otherwise than per token (``stack([loss, balance])``, ``cat([h.mean(1), h.amax(1)])``),
fails the compile naming the op. Not followed: a statistic handed across a graph break and made
into a loss there.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx

from ..analysis.op_schema import value
from ..analysis.token_mixing import TokenTrail, op_name, reduced_token_dims, writes_state
from .token_means import ShareError, new_node

STATISTICS = ("mean", "sum")
MEAN, SUM, PICK = "mean", "sum", "pick"
COUNTS = ("histc",)  # counts over every element (HF's tokens per expert), over a range it is given
SUMS_OF_SHARES = {"add", "sub", "iadd", "isub"}  # a replicated term added to a share: divided by cp


@dataclass(frozen=True)
class TokenStatistic:
    """A mean or sum over this rank's tokens that keeps other dims, or one token picked by its
    index in the row (``hidden[:, 0]``: BERT's pooler)."""

    node: torch.fx.Node
    dims: tuple[int, ...]  # the token dims it reduces
    kind: str  # MEAN, SUM or PICK
    index: int = 0  # PICK's, in the full row (negative: from its end)

    def what(self) -> str:
        if self.kind == PICK:
            return f"{self.node.name}: the token at index {self.index} of each row (dim {self.dims[0]})"
        return f"{self.node.name}: {op_name(self.node)} over this rank's tokens (dim {', '.join(map(str, self.dims))})"

    def describe(self) -> str:
        held = " from the rank holding it" if self.kind == PICK else ""
        return f"{self.what()}: the full batch's (all-reduced{held}), the loss terms computed from it divided by cp"


@dataclass
class _Spread:
    """What each node's value is across the ranks: ``ranked`` (this rank's own: tokens, shares),
    ``replicated`` (the same on every rank, from the statistics); the rest reads neither."""

    ranked: set
    replicated: set


def find(gm: torch.fx.GraphModule, trail: TokenTrail, live: set[torch.fx.Node]) -> list[TokenStatistic]:
    """The live statistics of ``gm`` made the full batch's (``trail`` followed over it); raises
    ``ShareError`` where a value made from them is read with a share otherwise than as a term."""
    found = {}
    for n in gm.graph.nodes:
        if n not in live or n.op not in ("call_function", "call_method") or trail.of(n):
            continue
        kind, index = (MEAN if op_name(n) == "mean" else SUM), 0
        if op_name(n) in STATISTICS and _keeps_dims(n):
            dims = reduced_token_dims(trail, n)
        elif op_name(n) in COUNTS and _given_range(n):
            dims = set(trail.of(n.args[0] if n.args else None))
        elif (picked := _picked(n, trail)) is not None:
            (dim, index), kind = picked, PICK
            dims = {dim}
        else:
            continue
        if dims:
            found[n] = TokenStatistic(n, tuple(sorted(dims)), kind, index)
    while True:  # drop those read back at per-token values, then what only they made replicated
        spread = _spread(gm, trail, found)
        dropped = set()
        for r, u in ((r, u) for r in spread.replicated for u in r.users if _kept_local(r, u, spread)):
            for root in _roots(r, found, spread):
                if found[root].kind != SUM and u in spread.ranked and not trail.of(u):
                    raise ShareError(f"{found[root].what()}, made the full batch's, is read by {op_name(u)} "
                                     f"({u.name}) beside this rank's own values: not taken yet")
                if not _handed_out(r, u) or found[root].kind == SUM:
                    dropped.add(root)
        if not dropped:
            break
        found = {n: s for n, s in found.items() if n not in dropped}
    for r in spread.replicated:
        for u in r.users:
            _check_edge(r, u, spread)
    return list(found.values())


def rewrite(gm: torch.fx.GraphModule, statistics: list[TokenStatistic], trail: TokenTrail, cp: int,
            group_name: str, places: torch.fx.Node | None) -> list[str]:
    """Each of ``statistics`` the full batch's, the replicated terms of shares divided by cp;
    what became of each, in words (``places``: each local token's place in its row, ``[B, T]``,
    which a picked token is found by; None where the graph has none)."""
    g = gm.graph
    roots = {s.node: s for s in statistics}
    spread = _spread(gm, trail, roots)
    done = [s.describe() for s in statistics]
    for r in [n for n in g.nodes if n in spread.replicated]:
        for u in list(r.users):
            if _scaled(r, u, spread):
                with g.inserting_before(u):
                    term = new_node(g, "call_function", operator.truediv, (r, cp), example=value(r))
                u.replace_input_with(r, term)
            elif (count := _token_count(r, u, roots, spread, trail.tokens)) is not None:
                if isinstance(u.args[1], torch.fx.Node):
                    with g.inserting_before(u):
                        u.update_arg(1, new_node(g, "call_function", operator.mul, (u.args[1], cp), example=count * cp))
                else:
                    u.update_arg(1, u.args[1] * cp)
                done.append(f"{u.name}: a sum over the tokens divided by this rank's count ({count}): by the full "
                            f"batch's ({count} x {cp})")
    for s in statistics:
        m = _pick_by_place(g, s, places, cp) if s.kind == PICK else s.node
        weight = 1 if s.kind == MEAN else cp  # d(full batch's statistic) / d(this rank's) x cp
        with g.inserting_before(m.next):
            own = new_node(g, "call_method", "detach", (m,), example=value(m))
            full = new_node(g, "call_function", funcol.all_reduce, (own, "sum", group_name), example=value(m))
            if s.kind == MEAN:
                full = new_node(g, "call_function", operator.truediv, (full, cp), example=value(m))
            mine, detached = m, own
            if weight != 1:
                mine = new_node(g, "call_function", operator.mul, (m, weight), example=value(m))
                detached = new_node(g, "call_function", operator.mul, (own, weight), example=value(m))
            zero = new_node(g, "call_function", operator.sub, (mine, detached), example=value(m))
            statistic = new_node(g, "call_function", operator.add, (zero, full), example=value(m))
        made = {own, mine, zero}
        m.replace_all_uses_with(statistic, delete_user_cb=lambda user, made=made: user not in made)
    return done


def _picked(n: torch.fx.Node, trail: TokenTrail) -> tuple[int, int] | None:
    """The token dim and index where ``n`` picks one token by its index (``x[:, 0]``,
    ``x.select(1, -1)``), else None."""
    first = n.args[0] if n.args else None
    tokens = trail.of(first)
    if not tokens:
        return None
    if n.target is operator.getitem:
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        picks = [(d, ix) for d, ix in enumerate(index) if d in tokens and type(ix) is int]
        # the rest whole: full slices, or each row by its own index (``logits[arange(B), -1]``: HF's
        # sequence classifiers without a pad token)
        whole = all(ix == slice(None) or (d == 0 and _each_row(ix, value(first).shape[0]))
                    for d, ix in enumerate(index) if (d, ix) not in picks)
        return picks[0] if len(picks) == 1 and whole else None
    if op_name(n) == "select" and len(n.args) == 3 and type(n.args[1]) is int and type(n.args[2]) is int:
        dim = n.args[1] % value(first).dim()
        return (dim, n.args[2]) if dim in tokens else None
    return None


def _each_row(ix, rows) -> bool:
    """Whether index ``ix`` is ``arange(rows)``."""
    return (isinstance(ix, torch.fx.Node) and ix.target is torch.arange and not ix.kwargs.get("step")
            and list(ix.args) in ([rows], [0, rows]))


def _pick_by_place(g: torch.fx.Graph, s: TokenStatistic, places: torch.fx.Node | None, cp: int) -> torch.fx.Node:
    """Picked token ``s`` as the sum over this rank's tokens of those at its place in the row
    (none on every rank but the one holding it)."""
    x = s.node.args[0]
    shape = value(x).shape
    if places is None or s.dims != (1,) or len(shape) < 2 or _hint(shape[0]) != _hint(value(places).shape[0]):
        raise ShareError(f"{s.what()} reads one token, which one rank holds: taken from a [rows, tokens, ...] tensor "
                         "in a graph with attention only")
    with g.inserting_before(s.node):
        place: object = s.index
        if s.index < 0 and isinstance(shape[1], int):
            place = shape[1] * cp + s.index
        elif s.index < 0:  # from the end of the full row, whose length is a symbol
            local = new_node(g, "call_function", torch.ops.aten.sym_size.int, (x, 1), example=shape[1])
            row = new_node(g, "call_function", operator.mul, (local, cp), example=value(local) * cp)
            place = new_node(g, "call_function", operator.add, (row, s.index), example=value(row) + s.index)
        # the examples made from x's: the layout's inputs were faked apart from the graph's values
        hit = new_node(g, "call_function", operator.eq, (places, place),
                       example=value(x).new_empty(shape[:2], dtype=torch.bool))
        spread_over = (slice(None), slice(None), *([None] * (len(shape) - 2)))
        hit = new_node(g, "call_function", operator.getitem, (hit, spread_over), example=value(hit)[spread_over])
        # where, not a product with a 0/1 mask: an inf elsewhere in the row would make the sum NaN
        kept = new_node(g, "call_function", torch.where, (hit, x, 0), example=value(x).clone())
        picked = new_node(g, "call_method", "sum", (kept, 1), example=value(kept).sum(1))
    s.node.replace_all_uses_with(picked)
    index = s.node.args[1] if s.node.target is operator.getitem else ()
    g.erase_node(s.node)
    for ix in index if isinstance(index, tuple) else ():
        if isinstance(ix, torch.fx.Node) and not ix.users:  # the rows' arange
            g.erase_node(ix)
    return picked


def _given_range(n: torch.fx.Node) -> bool:
    """Whether histc ``n`` is given its range: without one each rank's bins span its own values."""
    low = n.args[2] if len(n.args) > 2 else n.kwargs.get("min", 0)
    high = n.args[3] if len(n.args) > 3 else n.kwargs.get("max", 0)
    return isinstance(low, (int, float)) and isinstance(high, (int, float)) and low < high


def _hint(size) -> int:
    return int(getattr(getattr(size, "node", None), "hint", size))


def _keeps_dims(n: torch.fx.Node) -> bool:
    """A reduction over some dims, not every one (those are ``token_means``'s)."""
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return dims is not None and not (isinstance(dims, (list, tuple)) and len(dims) == 0)


def _scalar(n: torch.fx.Node) -> bool:
    t = value(n)
    return isinstance(t, torch.Tensor) and t.dim() == 0


def _spread(gm: torch.fx.GraphModule, trail: TokenTrail, roots) -> _Spread:
    ranked, replicated = set(), set()
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        inputs = n.all_input_nodes
        if n in roots:
            replicated.add(n)
        elif trail.of(n) or any(x in ranked for x in inputs):
            ranked.add(n)
        elif any(x in replicated for x in inputs):
            replicated.add(n)
    return _Spread(ranked, replicated)


def _roots(n: torch.fx.Node, roots, spread: _Spread) -> set[torch.fx.Node]:
    """The statistics replicated ``n`` is computed from."""
    found, stack, seen = set(), [n], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x in roots:
            found.add(x)
        else:
            stack.extend(y for y in x.all_input_nodes if y in spread.replicated)
    return found


def _token_count(r: torch.fx.Node, u: torch.fx.Node, roots, spread: _Spread, tokens: int):
    """The count ``u`` divides replicated ``r``, made of sums over the tokens alone, by, where it
    is a multiple of this rank's token count (a mean written as a sum over a count the program
    took from its shapes: HF's tokens per expert); else None."""
    if op_name(u) not in ("truediv", "div") or u.args[0] is not r or len(u.args) != 2:
        return None
    if any(roots[x].kind != SUM for x in _roots(r, roots, spread)):
        return None
    count = value(u.args[1]) if isinstance(u.args[1], torch.fx.Node) else u.args[1]
    if isinstance(count, (torch.SymInt, torch.SymFloat)):
        count = count.node.hint
    if isinstance(count, bool) or not isinstance(count, (int, float)) or count < tokens or count % tokens:
        return None
    return count


def _scaled(r: torch.fx.Node, u: torch.fx.Node, spread: _Spread) -> bool:
    """Whether replicated ``r`` enters ``u`` as a term of a share (divided by cp there)."""
    if u.op == "output":
        return _scalar(r)
    return u in spread.ranked and op_name(u) in SUMS_OF_SHARES


def _handed_out(r: torch.fx.Node, u: torch.fx.Node) -> bool:
    """Whether ``u`` hands ``r`` out of the graph: returns it, or writes it into a module's buffer."""
    return u.op == "output" or (writes_state(u) and u.args[0] is not r)


def _kept_local(r: torch.fx.Node, u: torch.fx.Node, spread: _Spread) -> bool:
    """Whether replicated ``r`` read by ``u`` says its statistics are this rank's on purpose: read
    back by per-token values (a MoE's tokens per expert ordering its own tokens), or, for counts and
    sums, handed out as a tensor (split sizes read on the host after a graph break, tokens per
    expert added to a buffer that the trainer all-reduces itself)."""
    if _handed_out(r, u):
        return not _scalar(r)
    return u in spread.ranked and not _scalar(u)


def _check_edge(r: torch.fx.Node, u: torch.fx.Node, spread: _Spread) -> None:
    if u.op == "output" or u not in spread.ranked or op_name(u) in SUMS_OF_SHARES:
        return
    # a product with the share would give each rank's tokens its own share's gradient, not the
    # full loss's: the values agree, the gradients do not
    raise ShareError(f"{r.name}, computed from statistics over the full batch's tokens, is read by {op_name(u)} "
                     f"({u.name}) with this rank's share: the ranks' outputs and gradients sum to the single-device "
                     "ones only where it is added to the share")
