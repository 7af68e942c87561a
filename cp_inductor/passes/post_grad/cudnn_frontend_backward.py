"""cuDNN's attention backward on a plan cache that keys on dO's layout.

aten's cuDNN attention backward (torch 2.11-2.13) caches its cuDNN plan by q, k and v's sizes and
strides only, while the plan bakes in dO's strides: in one process, a backward with the same q,
k, v as an earlier one but another dO layout runs the earlier plan and returns wrong gradients
(eager, default Inductor and cp_inductor alike). Every such call in a graph cp_inductor compiles,
CP region or not, moves to the cuDNN frontend's op, whose cache keys on every layout and is kept
apart from aten's (``lowerings/cudnn_backward.py``)::

    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(dO, q, k, v, O, lse, seed, offset,
                                                                   None, cq, ck, mq, mk, 0.0, causal)
    ->
    dq, dk, dv = cp_inductor.cudnn_attention_backward(dO, q, k, v, O, lse, scale, causal)

The forward stays aten's (its plan is keyed on q, k, v and O is laid out like q). Where the call
cannot move (``analysis/cudnn_backward_route.route`` says why: torch 2.14 or newer, no frontend, dropout, a bias, CUDA
graphs, switched off) it keeps aten's op and the dO the program itself made, as eager and default Inductor
would pass it, so the call shares aten's cache entries with them rather than fighting them.
The report lists each call's route.
"""

from __future__ import annotations

import torch
import torch.fx

from ..analysis.cudnn_backward_route import FRONTEND, Route, is_cudnn_backward, route, scale_of
from ..analysis.sdpa_ops import bound_args
from ..editing.fx_emit import Emitter
from ..record import POST_GRAD, GraphPass

NAME = "cudnn_frontend_backward"


def cudnn_frontend_backward_pass(graph: torch.fx.Graph, cfg, frontend_unavailable=None) -> int:
    """Put every cuDNN attention backward :func:`route` sends to the frontend on it; how many."""
    moved = 0
    for node in list(graph.nodes):
        if not is_cudnn_backward(node) or route(node, cfg, frontend_unavailable).path != FRONTEND:
            continue
        args = bound_args(node)
        emit = Emitter(graph, node)
        new = emit(
            torch.ops.cp_inductor.cudnn_attention_backward.default,
            *(args[n] for n in ("grad_out", "query", "key", "value", "out", "logsumexp")),
            scale_of(args), bool(args["is_causal"]),
        )
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        moved += 1
    return moved


def _any_backward(graph: torch.fx.Graph, cfg) -> str | None:
    return None if any(is_cudnn_backward(n) for n in graph.nodes) else "no cuDNN attention backward"


def backward_route(node: torch.fx.Node, cfg) -> Route | None:
    return route(node, cfg) if is_cudnn_backward(node) else None


PASS = GraphPass(NAME, stage=POST_GRAD, why_not=_any_backward, apply=cudnn_frontend_backward_pass,
            backward_route=backward_route)
