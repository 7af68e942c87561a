"""Means over this rank's tokens made the rank's share of the full batch's mean.

Under context parallelism the ranks' losses SUM to the single-device loss (``combine_losses``),
and so do their parameter gradients (``sum_gradients``): each rank's loss must be its tokens'
share of the full batch's, as HF transformers' loss is when it divides by the
``num_items_in_batch`` that ``shard_batch`` hands in. A loss that is a mean over the tokens the
rank holds (BERT's masked-LM head, a loss with ``num_items_in_batch`` ignored, nanoGPT's
``F.cross_entropy(logits.view(-1, V), targets.view(-1))``, a masked mean
``(l * m).sum() / m.sum()``) divides by this rank's count, and the ranks' sum is then about cp
times the loss (and not the loss's multiple at all where ranks hold different label counts).
Its denominator becomes the full batch's::

    loss = cross_entropy(logits, labels)                  # mean over this rank's labelled tokens
    ->
    count = all_reduce((labels != -100).sum(), "sum")     # the full batch's labelled tokens
    loss = cross_entropy(logits, labels, reduction="sum") / count

    loss = mse_loss(x, y)               ->  loss = mse_loss(x, y, reduction="sum") / (x.numel() * cp)
    loss = x.mean()                     ->  loss = x.sum(dtype=float32) / (x.numel() * cp)
    loss = (l * m).sum() / m.sum()      ->  loss = (l * m).sum() / all_reduce(m.sum(), "sum")

Taken: the classification losses (``cross_entropy``, ``nll_loss``: class indices with an ignore
index, or class probabilities), the element-wise losses (``mse_loss``, ``l1_loss``,
``smooth_l1_loss``, ``huber_loss``, ``binary_cross_entropy[_with_logits]``, ``kl_div``) with
``reduction="mean"``, ``kl_div`` with ``"batchmean"`` over a dim 0 that holds the tokens (cp times
its rows), ``mean()`` over every dim, and a quotient of two sums over every dim, where the reduced
tensor carries the token dim (``analysis/token_mixing``'s trail). Every rank holds as many tokens
(``shard_batch`` makes it so), so an element count is this rank's times cp.

The share is what the rank's outputs may hold only where it reaches them through sums and
scalings; one read otherwise (``exp(loss)``, a value read back at every token, ``x - x.mean()``)
fails the compile naming the op, as do a class-weighted mean and any other
``torch.nn.functional`` loss whose mean averages over the tokens (not taken yet).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx
import torch.nn.functional as F

from ..analysis.op_schema import value
from ..analysis.token_mixing import TokenTrail, op_name

CLASS_LOSSES = (F.cross_entropy, F.nll_loss)
ELEMENT_LOSSES = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
                  F.binary_cross_entropy_with_logits, F.kl_div)
SUMS = {"sum", "count_nonzero", "nansum"}
# ops a share may pass through on its way to the outputs (with the other operand of a product or
# quotient a number, or a tensor that carries no tokens and no share)
SCALES = {"mul", "truediv", "div", "imul", "itruediv"}
SUMS_OF_SHARES = {"add", "sub", "iadd", "isub", "neg"}
PASS_THROUGH = {"to", "float", "double", "half", "bfloat16", "type_as", "detach", "clone", "contiguous", "view",
                "reshape", "squeeze", "unsqueeze", "expand", "getitem"}
# value-wise ops between a sum and the quotient that reads it (``m.sum().clamp(min=1)``)
ON_A_SUM = {"to", "float", "double", "type_as", "clamp", "clamp_min", "clip", "max", "maximum"}


class ShareError(RuntimeError):
    """A mean over this rank's tokens that cannot be made the rank's share (the message says why)."""


@dataclass(frozen=True)
class LocalMean:
    """One mean over this rank's tokens: the node computing it and what it is."""

    node: torch.fx.Node
    form: str  # "class loss" | "element loss" | "batch loss" | "mean" | "quotient"
    denominator: torch.fx.Node | None = None  # a quotient's sum over this rank's tokens
    reader: torch.fx.Node | None = None  # the node on the denominator's path that reads that sum

    def describe(self) -> str:
        what = {"class loss": f"{op_name(self.node)} averaged over this rank's labelled tokens",
                "element loss": f"{op_name(self.node)} averaged over this rank's elements",
                "batch loss": f"{op_name(self.node)} summed over the size of its dim 0, this rank's tokens",
                "mean": "mean over this rank's tokens",
                "quotient": f"a sum over this rank's tokens divided by another ({self.denominator})"}[self.form]
        return f"{self.node.name}: {what}"


def _bound(n: torch.fx.Node) -> dict | None:
    try:
        bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _reduces_everything(n: torch.fx.Node) -> bool:
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0)


def _summed_loss(n: torch.fx.Node, trail: TokenTrail) -> dict | None:
    """``n``'s arguments where it is a loss call over this rank's tokens, else None."""
    if n.target not in CLASS_LOSSES and n.target not in ELEMENT_LOSSES:
        return None
    args = _bound(n)
    return args if args is not None and (trail.of(args["input"]) or trail.of(args["target"])) else None


def _sum_of_tokens(x, trail: TokenTrail, reader: torch.fx.Node | None = None) -> tuple[torch.fx.Node, torch.fx.Node | None] | None:
    """The sum over every dim of a tensor carrying this rank's tokens (or a loss call summing over
    them) that ``x`` (read by ``reader``) is, through the value-wise ops of ``ON_A_SUM``, and the
    node reading that sum; or None."""
    while isinstance(x, torch.fx.Node) and x.op in ("call_function", "call_method"):
        name = op_name(x)
        if name in SUMS and _reduces_everything(x) and trail.of(x.args[0] if x.args else None):
            return x, reader
        if (args := _summed_loss(x, trail)) is not None and args.get("reduction") == "sum":
            return x, reader
        if name not in ON_A_SUM or not x.args or (name in ("max", "maximum") and isinstance(x.args[0], torch.fx.Node)
                                                   and len(x.args) > 1 and isinstance(x.args[1], torch.fx.Node)):
            return None
        x, reader = x.args[0], x
    return None


def find(gm: torch.fx.GraphModule, trail: TokenTrail, live: set[torch.fx.Node]) -> list[LocalMean]:
    """The live means over this rank's tokens in ``gm`` (``trail`` followed over it)."""
    found: list[LocalMean] = []
    for n in gm.graph.nodes:
        if n not in live or n.op not in ("call_function", "call_method"):
            continue
        if n.target in CLASS_LOSSES or n.target in ELEMENT_LOSSES:
            args = _summed_loss(n, trail)
            if args is not None and args.get("reduction") == "batchmean" and 0 in trail.of(args["input"]):
                found.append(LocalMean(n, "batch loss"))  # kl_div's sum over dim 0's size, which holds the tokens
                continue
            if args is None or args.get("reduction") != "mean":
                continue
            if args.get("size_average") is not None or args.get("reduce") is not None:
                raise ShareError(f"{n.name}: {op_name(n)} with the deprecated size_average / reduce arguments "
                                 "averages over this rank's tokens: pass reduction= instead")
            if n.target in CLASS_LOSSES and args.get("weight") is not None:
                raise ShareError(f"{n.name}: {op_name(n)} with class weights averages over this rank's labelled "
                                 "tokens by their weights, which is not taken yet: use reduction='sum' and divide by "
                                 "the full batch's total weight")
            found.append(LocalMean(n, "class loss" if n.target in CLASS_LOSSES else "element loss"))
        elif (averaged := _other_loss_mean(n, trail)) is not None:
            raise ShareError(f"{n.name}: {op_name(n)} with reduction={averaged!r} averages over this rank's tokens, "
                             "which is not taken yet: use reduction='sum' and divide by the full batch's count")
        elif op_name(n) == "mean" and _reduces_everything(n) and trail.of(n.args[0] if n.args else None):
            found.append(LocalMean(n, "mean"))
        elif op_name(n) in ("truediv", "div") and len(n.args) == 2 and _sum_of_tokens(n.args[0], trail) is not None:
            denominator = _sum_of_tokens(n.args[1], trail, n)
            if denominator is not None:
                found.append(LocalMean(n, "quotient", *denominator))
    return found


def _other_loss_mean(n: torch.fx.Node, trail: TokenTrail) -> str | None:
    """The reduction of a ``torch.nn.functional`` loss other than those taken that averages over a
    tensor carrying this rank's tokens (``poisson_nll_loss``, ``cosine_embedding_loss``, ...), or None."""
    if n.op != "call_function" or getattr(n.target, "__module__", None) != F.__name__:
        return None
    args = _bound(n)
    if args is None or args.get("reduction") not in ("mean", "batchmean"):
        return None
    carrying = [x for x in args.values() if isinstance(x, torch.fx.Node) and trail.of(x)]
    if not carrying or (args["reduction"] == "batchmean" and 0 not in trail.of(carrying[0])):
        return None
    return args["reduction"]


def new_node(g: torch.fx.Graph, kind: str, target, args: tuple, kwargs: dict | None = None, example=None) -> torch.fx.Node:
    n = g.create_node(kind, target, args, kwargs or {})
    n.meta["example_value"] = example
    return n


def _count(g: torch.fx.Graph, mean: LocalMean, cp: int, group_name: str) -> torch.fx.Node | int:
    """The full batch's count the mean divides by (built before ``mean.node``)."""
    if mean.form == "mean":
        return _elements(g, mean.node.args[0], cp)
    args = _bound(mean.node) or {}
    x, target = args["input"], args["target"]
    if mean.form == "batch loss":
        rows = value(x).shape[0]
        if isinstance(rows, int):
            return rows * cp
        size = new_node(g, "call_function", torch.ops.aten.sym_size.int, (x, 0), example=rows)
        return new_node(g, "call_function", operator.mul, (size, cp), example=rows * cp)
    if mean.form == "element loss":
        shape = torch.broadcast_shapes(value(x).shape, value(target).shape)
        widest = next((t for t in (x, target) if value(t).shape == shape), None)
        if widest is None:
            raise ShareError(f"{mean.describe()}, over a broadcast of its input and target, is not taken yet")
        return _elements(g, widest, cp)
    if value(target).is_floating_point():  # class probabilities: a mean over the samples
        classes = value(x).shape[1 if value(x).dim() > 1 else 0]
        return _elements(g, x, cp, per=classes)
    ignore = args["ignore_index"]
    kept = new_node(g, "call_function", operator.ne, (target, ignore), example=value(target).ne(ignore))
    labelled = new_node(g, "call_method", "sum", (kept,), example=value(kept).sum())
    return _all_reduced(g, labelled, group_name)


def _elements(g: torch.fx.Graph, x: torch.fx.Node, cp: int, per=1) -> torch.fx.Node | int:
    """cp times ``x``'s element count over ``per``: a number, or nodes where the count is symbolic
    (a raw symbol in the graph would have no input to come from)."""
    count = value(x).numel()
    if isinstance(count, int) and isinstance(per, int):
        return count // per * cp
    numel = new_node(g, "call_function", torch.ops.aten.sym_numel.default, (x,), example=count)
    if per != 1:
        numel = new_node(g, "call_function", operator.floordiv, (numel, per), example=count // per)
    return new_node(g, "call_function", operator.mul, (numel, cp), example=value(numel) * cp)


def _all_reduced(g: torch.fx.Graph, x: torch.fx.Node, group_name: str) -> torch.fx.Node:
    return new_node(g, "call_function", funcol.all_reduce, (x, "sum", group_name), example=value(x).clone())


def rewrite(gm: torch.fx.GraphModule, means: list[LocalMean], trail: TokenTrail, cp: int, group_name: str) -> list[str]:
    """Each of ``means`` as this rank's share of the full batch's; what became of each, in words
    (raises ``ShareError`` first where one is read otherwise than by sums and scalings)."""
    g, done = gm.graph, []
    shares = {m.node for m in means}
    for mean in means:
        _check_read(mean, trail, shares)
    for mean in means:
        n, example = mean.node, value(mean.node)
        if mean.form == "quotient" and mean.denominator is not None and mean.reader is not None:
            with g.inserting_after(mean.denominator):
                mean.reader.replace_input_with(mean.denominator, _all_reduced(g, mean.denominator, group_name))
            done.append(f"{mean.describe()}: the denominator all-reduced over the ranks")
            continue
        with g.inserting_before(n):
            count = _count(g, mean, cp, group_name)
            if mean.form == "mean":
                x = n.args[0]
                wide = torch.promote_types(value(x).dtype, torch.float32)
                summed = new_node(g, "call_method", "sum", (x,), {"dtype": wide}, value(x).sum(dtype=wide))
                quotient = new_node(g, "call_function", operator.truediv, (summed, count), example=value(summed))
                share = new_node(g, "call_method", "to", (quotient, value(x).dtype), example=example)
            else:
                summed = new_node(g, "call_function", n.target, *_summing(n), example=example)
                share = new_node(g, "call_function", operator.truediv, (summed, count), example=example)
        n.replace_all_uses_with(share)
        g.erase_node(n)
        done.append(f"{mean.describe()}: divided by the full batch's count")
    return done


def _summing(n: torch.fx.Node) -> tuple[tuple, dict]:
    """The arguments of loss call ``n`` with ``reduction="sum"``, where it was given or not."""
    at = list(inspect.signature(n.target).parameters).index("reduction")
    if len(n.args) > at:
        return (*n.args[:at], "sum", *n.args[at + 1:]), dict(n.kwargs)
    return tuple(n.args), {**n.kwargs, "reduction": "sum"}


def _check_read(mean: LocalMean, trail: TokenTrail, shares: set) -> None:
    """The share must reach the outputs through sums and scalings by numbers or tensors that
    carry no tokens (the ranks' outputs then sum to the single-device ones)."""
    stack, seen = [mean.node], set()
    while stack:
        n = stack.pop()
        for user in n.users:
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            name = op_name(user)
            others = [a for a in user.all_input_nodes if a is not n]
            if name in SUMS_OF_SHARES:
                carrying = next((a for a in others if trail.of(a)), None)
                if carrying is not None:
                    raise ShareError(f"{mean.describe()}, is read back at every token ({name} with {carrying.name})")
            elif name in SCALES and (name in ("mul", "imul") or user.args[0] is n):
                mixed = next((a for a in others if trail.of(a) or a in shares), None)
                if mixed is not None:
                    raise ShareError(f"{mean.describe()}, is scaled by {mixed.name} ({name}), which carries tokens "
                                     "or is itself a share")
            elif name not in PASS_THROUGH:
                raise ShareError(f"{mean.describe()}, is read by {name} ({user.name}); the ranks' outputs sum to the "
                                 "single-device ones only where such a value reaches them through sums and scalings")
            stack.append(user)
