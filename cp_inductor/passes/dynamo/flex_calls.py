"""flex_attention calls of the graph Dynamo hands the backend: their arguments under SDPA's names,
whether the program reads more than the output of one, and swapping one for attention that
returns the output alone. Shared by the passes that replace such calls::

    out, lse = flex_attention(q, k, v, score_mod, block_mask, scale, ...)   # lse unread (HF drops it)
    ->
    out = ours(q, k, v, ...)
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..analysis.op_schema import value
from .sdpa_calls import erase_dead

FLEX = torch.ops.higher_order.flex_attention


def flex_args(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict | None:
    """A flex_attention call's arguments under SDPA's names, its mask_mod and buffers as the
    mask (``gm``: the module holding the call), or None for another call."""
    if node.op != "call_function" or node.target is not FLEX:
        return None
    q, k, v, score_mod, block_mask, scale, options, score_buffers, mask_buffers = node.args[:9]
    mask_mod = getattr(gm, block_mask[-1].target) if isinstance(block_mask[-1], torch.fx.Node) else None
    body = getattr(gm, score_mod.target) if isinstance(score_mod, torch.fx.Node) else None
    return {"query": q, "key": k, "value": v, "scale": scale, "attn_mask": (block_mask[-1], tuple(mask_buffers)),
            "mask_mod": mask_mod, "mask_buffers": tuple(mask_buffers), "score_mod": body, "score_buffers": score_buffers,
            "flex": True}


def call_reason(args: dict, node: torch.fx.Node) -> str | None:
    """Why a flex call is not plain attention under its mask: a score_mod that changes the
    scores, or a program that reads the log-sum-exp; None where it is."""
    body = args["score_mod"]
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"] if body is not None else []
    output = next((n for n in body.graph.nodes if n.op == "output"), None) if body is not None else None
    if not placeholders or output is None or output.args[0] is not placeholders[0] or args["score_buffers"]:
        return "a score_mod that changes the scores"
    if any(u.target is not operator.getitem or (u.args[1] != 0 and not unread(u)) for u in node.users):
        return "the program reads the log-sum-exp"
    return None


# What may read flex's log-sum-exp for it to count as unread when the readers are dead: views,
# casts and arithmetic that write nothing (HF scales it by ln 2 and casts it).
_PURE_METHODS = ("to", "transpose", "view", "reshape", "float", "type_as", "contiguous", "unsqueeze", "squeeze",
                 "permute", "expand", "flatten", "clone", "detach", "mul", "add", "sub", "div", "exp", "log",
                 "__mul__", "__add__", "__sub__", "__truediv__", "__neg__")
_PURE_FUNCTIONS = (operator.getitem, operator.mul, operator.add, operator.sub, operator.truediv, operator.neg,
                   torch.mul, torch.add, torch.sub, torch.div, torch.exp, torch.log)


def unread(node: torch.fx.Node) -> bool:
    """Whether nothing but dead pure ops read ``node`` (HF's flex path on CUDA asks for the
    log-sum-exp, which flex scales by ln 2 and HF casts and returns as its attention weights,
    which the decoder layer drops). A write (``copy_``, ``out=``) keeps it read."""
    def pure(u):
        if "out" in u.kwargs:
            return False
        if u.op == "call_method":
            return u.target in _PURE_METHODS
        return u.op == "call_function" and u.target in _PURE_FUNCTIONS

    return all(pure(u) and unread(u) for u in node.users)


def _erase_readers(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    for user in list(node.users):
        _erase_readers(graph, user)
    graph.erase_node(node)


def replace(node: torch.fx.Node, out: torch.fx.Node) -> None:
    """The flex call ``node`` (its log-sum-exp unread: :func:`call_reason`) out of its graph,
    ``out`` read where its output was, and its score_mod, mask_mod and what only they read with
    it (a checkpointed body's lint fails on a graph attribute left behind)."""
    g = node.graph
    out.meta["example_value"] = value(node)[0]
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(out)
        _erase_readers(g, user)
    modules = [x for x in (node.args[3], node.args[4][-1]) if isinstance(x, torch.fx.Node)]
    block_mask, buffers = node.args[4][:-1], (*node.args[7], *node.args[8])
    g.erase_node(node)
    for dead in (*block_mask, *buffers):
        erase_dead(g, dead)
    for module in modules:
        if not module.users:
            g.erase_node(module)
