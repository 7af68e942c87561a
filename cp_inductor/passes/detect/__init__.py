"""One detector per CP style. Each module exposes

* ``STYLE``: the style's name in the report,
* ``find(graph, graph_kind, cfg, log=None) -> list[match]``: every region of that style, in graph
  order; ``log(attention_node, reason)`` hears why an attention op is not one,
* ``match_at(attention_node, graph_kind, cfg) -> match | None``: the region of one attention op on
  the graph as it is now (after an earlier rewrite replaced nodes it was found through),

where a match is a :class:`~cp_inductor.passes.match.CPMatch`. ``a2a`` (Ulysses) exists; all-gather,
ring and packed (THD) layouts come next.
"""

from __future__ import annotations

import torch.fx

from ..guard import internal_error
from ..layout_algebra import LayoutError
from ..sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD


def find_with(match_one, graph: torch.fx.Graph, graph_kind: str, cfg, log=None) -> list:
    """``match_one(attention_node, graph_kind)`` on every attention op of ``graph``: the matches
    it returns, in graph order. A ``LayoutError`` is the reason the op is not a region, an
    unexpected error becomes one (strict mode raises); both go to ``log(node, reason)``; ``None``
    means the op is not this style's business."""
    matches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA_FORWARD + SDPA_BACKWARD:
            continue
        try:
            match = match_one(node, graph_kind)
        except LayoutError as e:
            reason = str(e)
        except Exception as e:  # noqa: BLE001 - see guard.py
            reason = internal_error(e, cfg)
        else:
            if match is not None:
                matches.append(match)
            continue
        if log is not None:
            log(node, reason)
    return matches


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
