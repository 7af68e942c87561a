"""Find K/V all-gather CP attention regions (Llama3 style) in an ATen graph.

A forward (or inference) region::

    q_local ------------------------------------------------> attention(q, k, v)
    k_local -> all_gather -> wait -> reorder / slice / GQA repeat -^      ^
    v_local -> all_gather -> wait -> ...  ------------------------------/

One attention op is one match: a load-balanced causal block makes several per rank (chunk 0's
causal call; a later chunk's prefix call and diagonal call, merged by log-sum-exp). Between the
wait and attention any layout op, ``cat`` of pieces (chunk reorders, or heads gathered a few at
a time), ``rev``/``flip``, ``index_select``, a cast may sit, as long as every piece comes from
an all-gather of the same group; a mask (per-chunk bottom-right causality) is allowed; q must not come from a collective (a gathered q means every rank attends over the whole
sequence: not context parallelism).

A backward region is an attention backward op whose dK and dV reach ``reduce_scatter_tensor``
ops of one group (the all-gathers' backward) through scatters into the full-sequence gradient, adds, sums over
replicated heads and layout ops, while dQ stays on this rank.

PyTorch's flex-attention CP (``cplib::flex_cp_allgather`` and its backward) gathers inside one
opaque custom op: its attention is reported with that reason (``FLEX_REASON``), never matched.

This finds and reports regions; which rewrites apply is the pipeline's decision.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.fx

from ..analysis.graph_walk import MAX_NODES
from ..analysis.layout_algebra import LayoutError, is_layout_op, is_value_op
from ..analysis.match import CPMatch, attention_facts
from ..analysis.sdpa_ops import ATTENTION, FORWARD, VARLEN, bound_args
from . import find_with, in_graph_order, kv_gradients_reach, match_or_none, moved_from, query_layout, reached_below

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

# Ops that move or pick elements of the gathered K/V on its way to attention (first argument is
# the tracked tensor), besides the layout algebra's own.
REORDER_OPS = (
    prims.rev.default, aten.flip.default, aten.index_select.default, aten.index.Tensor, aten.repeat_interleave.self_int,
)
# Ops through which a dK/dV contribution reaches the reduce-scatter: the tracked tensor is any
# tensor argument.
ACCUMULATE_OPS = (
    aten.slice_scatter.default, aten.select_scatter.default, aten.add.Tensor, aten.sum.dim_IntList,
    aten.cat.default, prims.rev.default, aten.flip.default, aten.index_add.default, aten.index_put.default,
    aten.constant_pad_nd.default,  # a prefix's dK/dV padded to the full sequence
    aten.index_select.default, aten.index.Tensor, aten.where.self,  # a pack order's rows gathered back
)
_MAX_DEPTH = MAX_NODES // 2  # nodes a walk may visit; deeper means it is not one attention's K/V


@dataclass
class AllGatherMatch(CPMatch):
    """An attention op of a K/V all-gather region: where its K/V were gathered (forward) or
    where its dK/dV are reduce-scattered (backward)."""

    style: ClassVar[str] = "allgather"
    gathers: dict = field(default_factory=dict)  # "k"/"v" -> its all_gather_into_tensor nodes
    reduce_scatters: dict = field(default_factory=dict)  # "dk"/"dv" -> its reduce_scatter_tensor nodes


STYLE = AllGatherMatch.style


def _gather_of_wait(node):
    """The all_gather_into_tensor whose result ``node`` waits for, or None."""
    if isinstance(node, torch.fx.Node) and node.target is c10d.wait_tensor.default:
        src = node.args[0]
        if isinstance(src, torch.fx.Node) and src.target is c10d.all_gather_into_tensor.default:
            return src
    return None


def _sources(node) -> tuple[set, bool]:
    """Walk up from an attention input: (all-gathers reached, whether every path ends at one).
    Other collectives and compute end a path without a gather."""
    ends, complete = moved_from(node, REORDER_OPS, _MAX_DEPTH)
    found = [_gather_of_wait(n) for n in ends]
    return {g for g in found if g is not None}, complete and None not in found


def _gathered_input(node, name: str) -> tuple:
    """The all-gathers ``node`` (k or v) comes from, in graph order: one, or several when heads
    are gathered a few at a time and concatenated; () if it comes from none."""
    gathers, complete = _sources(node)
    if not gathers:
        return ()
    if not complete:
        raise LayoutError(f"{name} mixes gathered and local data")
    return in_graph_order(gathers, node.graph)


def _head_block_of_gathered(query, key, gathers) -> bool:
    """Whether attention reads 1/cp of what was gathered for the query, at the full sequence
    length of the keys: a block of the heads (sequence-gathered q would keep them all)."""
    q, k = query.meta.get("val"), key.meta.get("val")
    gathered = [g.meta.get("val") for g in gathers]
    if q is None or k is None or any(v is None for v in gathered) or q.dim() < 2:
        return False
    cp = _group(next(iter(gathers)))[0]
    return q.shape[-2] == k.shape[-2] and q.numel() * cp == sum(v.numel() for v in gathered)


def _group(gather) -> tuple[int, str]:
    _, size, name = gather.args[:3]
    if isinstance(size, torch.SymInt):
        raise LayoutError("dynamic shapes")
    return int(size), name


def _forward_match(node, graph_kind) -> AllGatherMatch | None:
    args = bound_args(node)
    gathers = {n: _gathered_input(args[arg], arg) for n, arg in (("k", "key"), ("v", "value"))}
    if not any(gathers.values()):
        return None
    if not all(gathers.values()):
        raise LayoutError("only one of key and value comes from an all_gather")
    q_gathers = _sources(args["query"])[0]
    if q_gathers:
        if _head_block_of_gathered(args["query"], args["key"], q_gathers):
            raise LayoutError(
                "q, k, v gathered whole, then this rank's block of heads taken: Ulysses done with "
                "all-gathers (as DTensor's Shard(seq) -> Shard(heads) redistribute traces); not "
                "rewritten: an all_to_all would move 1/cp of the bytes, but which block a rank takes "
                "is a constant of its own graph, and every rank must make the same choice")
        raise LayoutError("query is gathered too: every rank attends over the whole sequence")
    groups = {_group(g) for gs in gathers.values() for g in gs}
    if len(groups) != 1:
        raise LayoutError("key and value are gathered over different groups")
    (cp, group), = groups
    return AllGatherMatch(
        graph_kind=graph_kind, attention=node, cp=cp, group_name=group, layout=_layout(node, args["query"]),
        gathers=gathers, **attention_facts(args),
    )


def _layout(attention, rank_tensor) -> str:
    """"thd" for packed-sequence attention (``[tokens, heads, head_dim]`` with cu_seqlens), else how
    the rank holds q or dO."""
    if attention.target in VARLEN:
        return "thd"
    return query_layout(rank_tensor)


def _reduce_scatter_below(node) -> set:
    """The reduce_scatter_tensor ops a gradient reaches going down through accumulation and
    layout ops."""
    return reached_below(
        [node], lambda u: u.target is c10d.reduce_scatter_tensor.default,
        lambda u: is_layout_op(u) or is_value_op(u) or u.target in ACCUMULATE_OPS, _MAX_DEPTH,
    )


def _backward_match(node, graph_kind) -> AllGatherMatch | None:
    scatters = kv_gradients_reach(
        node, _reduce_scatter_below, "only one of dK and dV reaches a reduce_scatter", "dQ is reduce-scattered too"
    )
    if scatters is None:
        return None
    rs = {name: in_graph_order(s, node.graph) for name, s in scatters.items()}
    sizes = {(int(r.args[2]), r.args[3]) for group in rs.values() for r in group}
    if len(sizes) != 1:
        raise LayoutError("dK and dV are reduce-scattered over different groups")
    (cp, group), = sizes
    args = bound_args(node)
    return AllGatherMatch(
        graph_kind=graph_kind, attention=node, cp=cp, group_name=group, layout=_layout(node, args["grad_out"]),
        reduce_scatters=rs, **attention_facts(args),
    )


def _match(node, graph_kind) -> AllGatherMatch | None:
    if node.target in FORWARD:
        return _forward_match(node, graph_kind)
    return _backward_match(node, graph_kind)


# PyTorch's flex-attention CP gathers K and V (and reduce-scatters their gradients) inside one
# custom op each.
_FLEX_GATHER, _FLEX_GATHER_BACKWARD = "cplib.flex_cp_allgather.default", "cplib.flex_cp_allgather_backward.default"
FLEX_REASON = (
    "the K/V all-gather (or its backward) is PyTorch's flex CP op {op}: its collectives run and "
    "wait inside one opaque custom op, so Inductor can neither overlap, fuse nor re-route them: "
    "reported, not rewritten"
)


def _flex_attention_ops(graph: torch.fx.Graph):
    """(attention op, the flex CP op it reads from or feeds), for every flex CP op: the ops that
    read its gathered K/V (forward), or that produce the gradients it reduce-scatters."""
    for node in graph.nodes:
        name = str(node.target)
        if name == _FLEX_GATHER:
            outs = [u for u in node.users if u.target is operator.getitem]
            readers = {r for o in outs for r in o.users}
        elif name == _FLEX_GATHER_BACKWARD:
            grads = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
            readers = {g.args[0] if g.target is operator.getitem else g for g in grads}
        else:
            continue
        for reader in readers:
            if "attention" in str(reader.target):
                yield reader, name.removesuffix(".default").replace(".", "::")


def find(graph: torch.fx.Graph, graph_kind: str, cfg, log=None) -> list[AllGatherMatch]:
    """Every K/V all-gather attention op in ``graph``. ``log(node, reason)`` hears why an attention
    op fed by an all-gather is not a region (ops no all-gather feeds are not this detector's),
    including the attention of PyTorch's flex CP (``FLEX_REASON``)."""
    matches = find_with(_match, graph, graph_kind, cfg, log, ops=ATTENTION)
    if log is not None:
        for attention, op in _flex_attention_ops(graph):
            log(attention, FLEX_REASON.format(op=op))
    return matches


def match_at(node: torch.fx.Node, graph_kind: str, cfg) -> AllGatherMatch | None:
    return match_or_none(_match, node, graph_kind, cfg)
