"""One detector per CP style. Each module exposes

* ``STYLE``: the style's name in the report,
* ``find(graph, graph_kind, cfg, log=None) -> list[match]``: every region of that style, in graph
  order; ``log(attention_node, reason)`` hears why an attention op is not one,
* ``match_at(attention_node, graph_kind, cfg) -> match | None``: the region of one attention op on
  the graph as it is now (after an earlier rewrite replaced nodes it was found through),

where a match is a :class:`~cp_inductor.passes.analysis.match.CPMatch`. ``a2a`` (Ulysses), ``allgather``
(K/V all-gather) and ``ring`` (K/V rotated) exist; packed (THD) layouts come next.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx

from ..analysis import graph_walk
from ..analysis.graph_walk import MAX_NODES, node_order, reached_below  # noqa: F401 - reached_below: the detectors' import
from ..analysis.layout_algebra import LayoutError, is_layout_op, is_value_op, node_val
from ..analysis.sdpa_ops import BACKWARD, SDPA, tuple_outputs
from ..guard import internal_error

aten = torch.ops.aten


def find_with(match_one, graph: torch.fx.Graph, graph_kind: str, cfg, log=None, ops=SDPA) -> list:
    """``match_one(attention_node, graph_kind)`` on every attention op of ``graph`` (``ops``: the
    dense SDPA ops unless the style takes more): the matches
    it returns, in graph order. A ``LayoutError`` is the reason the op is not a region, an
    unexpected error becomes one (strict mode raises); both go to ``log(node, reason)``; ``None``
    means the op is not this style's business."""
    matches = []
    style = match_one.__module__
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        try:
            match = match_one(node, graph_kind)
            if match is not None and node.target in BACKWARD:
                _agree_with_forward(node, style)
        except LayoutError as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - see guard.py
            reason = internal_error(e, cfg)
        else:
            if match is not None:
                matches.append(match)
                _record_forward(node, style, None)
            continue
        _record_forward(node, style, reason)
        if log is not None:
            log(node, reason)
    return matches


# What each style made of each forward attention op, per compile (the fake mode its forward and
# backward graphs share): AOTAutograd's ``seq_nr`` -> None (a region) or the reason it is not.
_FORWARD_VERDICTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _verdicts(node) -> dict | None:
    val = node_val(node)
    first = val[0] if isinstance(val, (tuple, list)) and val else val
    mode = getattr(first, "fake_mode", None)
    if mode is None or node.meta.get("seq_nr") is None:
        return None
    return _FORWARD_VERDICTS.setdefault(mode, {})


def _record_forward(node, style: str, reason: str | None) -> None:
    verdicts = _verdicts(node) if node.target not in BACKWARD else None
    if verdicts is not None:
        # A region stays one: a later look at the rewritten forward graph finds other chains.
        if verdicts.get((style, node.meta["seq_nr"]), "") is not None:
            verdicts[(style, node.meta["seq_nr"])] = reason


def _agree_with_forward(node, style: str) -> None:
    """A region is one thing in both graphs: a backward op whose forward op this style found not
    to be a region is not one either (its rewrite would assume what the forward's check refused)."""
    verdicts = _verdicts(node)
    reason = verdicts.get((style, node.meta["seq_nr"])) if verdicts is not None else None
    if reason is not None:
        raise LayoutError(f"{FORWARD_NOT_A_REGION}: {reason}")


FORWARD_NOT_A_REGION = "its forward is not a region"


def forward_seen(node, style: str) -> bool:
    """Whether this style analysed the forward op of the backward op ``node`` (else the backward
    region was proved on its own)."""
    verdicts = _verdicts(node)
    return verdicts is not None and (style, node.meta["seq_nr"]) in verdicts


def match_or_none(match_one, node: torch.fx.Node, graph_kind: str, cfg):
    """``match_one(node, graph_kind)``, or None where it raises (strict mode raises unexpected
    errors)."""
    try:
        return match_one(node, graph_kind)
    except LayoutError:
        return None
    except Exception as e:  # noqa: BLE001 - see guard.py
        internal_error(e, cfg)
        return None


def in_graph_order(nodes, graph: torch.fx.Graph) -> tuple:
    order = node_order(graph)
    return tuple(sorted(nodes, key=order.__getitem__))


def query_layout(node) -> str:
    """How the rank holds q (forward) or dO (backward), from the permutes between the tensor its
    chain starts at and attention's [B, H, S, D] (slices and copies keep the order)."""
    where = [0, 1, 2, 3]  # attention dim i is dim where[i] of the tensor at the walk's position
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is aten.permute.default:
            where = [node.args[1][w] for w in where]
        elif node.target is aten.transpose.int:
            a, b = (x % 4 for x in node.args[1:3])
            where = [b if w == a else a if w == b else w for w in where]
        elif node.target not in (aten.clone.default, aten.alias.default, aten.slice.Tensor, aten.contiguous.default):
            break
        node = node.args[0]
    src = node_val(node)
    if not isinstance(src, torch.Tensor) or src.dim() != 4:
        return "?"
    return "".join(sorted("bhsd", key=lambda c: where["bhsd".index(c)]))


def moved_from(node, also=(), max_depth: int = MAX_NODES // 2) -> tuple[set, bool]:
    """What ``node`` is a relabelling, piece, cast or concatenation of, through layout and value
    ops (``graph_walk.moved_from``)."""
    return graph_walk.moved_from(node, lambda n: is_layout_op(n) or is_value_op(n), also, max_depth)


def kv_gradients_reach(node, below, only_one: str, dq_too: str) -> dict | None:
    """``{"dk": ..., "dv": ...}``: what ``below(gradient)`` finds for an attention backward op's
    dK and dV; None when neither reaches anything. Raises ``only_one`` when just one does and
    ``dq_too`` when dQ does as well (it must stay on this rank)."""
    outs = tuple_outputs(node)
    found = {name: below(outs[i]) if i in outs else set() for i, name in ((1, "dk"), (2, "dv"))}
    if not any(found.values()):
        return None
    if not all(found.values()):
        raise LayoutError(only_one)
    if 0 in outs and below(outs[0]):
        raise LayoutError(dq_too)
    return found
