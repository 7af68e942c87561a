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
cannot move (:func:`route` says why: torch 2.14 or newer, no frontend, dropout, a bias, CUDA
graphs, switched off) it keeps aten's op and the dO the program itself made, as eager and default Inductor
would pass it, so the call shares aten's cache entries with them rather than fighting them.
The report lists each call's route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._inductor.config
import torch.fx

from ...lowerings import cudnn_backward
from ..editing.fx_emit import Emitter
from ..analysis.sdpa_ops import bound_args
from ..record import GRAPH, POST_GRAD, Pass

aten = torch.ops.aten
NAME = "cudnn_frontend_backward"
ATEN_BACKWARD = getattr(aten, "_scaled_dot_product_cudnn_attention_backward", None)
FRONTEND = "cudnn_frontend"
ATEN = "aten"


@dataclass(frozen=True)
class Route:
    path: str  # FRONTEND | ATEN
    reason: str


def is_cudnn_backward(node: torch.fx.Node) -> bool:
    return ATEN_BACKWARD is not None and node.op == "call_function" and node.target is ATEN_BACKWARD.default


def _scale(args: dict) -> float | None:
    scale = args.get("scale")
    if scale is not None:
        return float(scale)
    head_dim = args["query"].meta["val"].shape[-1]
    return cudnn_backward.default_scale(args["query"].meta["val"]) if isinstance(head_dim, int) else None


def route(node: torch.fx.Node, cfg, frontend_unavailable=None) -> Route:
    """Which op runs this cuDNN attention backward, and why. ``frontend_unavailable``: the
    frontend's state (default: this process's, :func:`cudnn_backward.unavailable`)."""
    if cudnn_backward.aten_cache_key_complete():
        return Route(ATEN, f"torch {torch.__version__} keys aten's cuDNN plan cache on dO's layout")
    if not cfg[NAME]:
        return Route(ATEN, "disabled by config: aten's plan cache is keyed on q/k/v layouts only, dO as the program made it")
    if torch._inductor.config.triton.cudagraphs:
        # In a process that had run other compiled code, the frontend's gradients escaped the
        # CUDA-graph pool during cudagraph trees' warm-up (its pool check raised), though right
        # in a fresh one: not understood yet, so graphs captured stay on aten's op.
        return Route(ATEN, "CUDA graphs (reduce-overhead): aten's op, dO as the program made it (its plan cache is keyed on q/k/v layouts only)")
    args = bound_args(node)
    vals = {n: args.get(n) for n in ("grad_out", "query", "key", "value", "out", "logsumexp")}
    if not all(isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) for v in vals.values()):
        return Route(ATEN, "an input without a tensor value")
    q = vals["query"].meta["val"]
    why = None
    if args.get("dropout_p") != 0.0:
        why = "dropout"
    elif args.get("attn_bias") is not None:
        why = "an attention bias"
    elif q.dim() != 4 or q.dtype not in cudnn_backward.DTYPES:
        why = f"{q.dim()}-d {q.dtype} inputs"
    elif _scale(args) is None:
        why = "a symbolic head_dim"
    if why is not None:
        return Route(ATEN, f"the cuDNN frontend's backward takes no {why}: aten's op, dO as the program made it")
    unavailable = cudnn_backward.unavailable() if frontend_unavailable is None else frontend_unavailable
    if unavailable:
        return Route(ATEN, f"{unavailable}: aten's op, dO as the program made it (its plan cache is keyed on q/k/v layouts only)")
    return Route(FRONTEND, "its plan cache keys on every layout, apart from aten's (torch < 2.14 keys on q/k/v only)")


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
            _scale(args), bool(args["is_causal"]),
        )
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        moved += 1
    return moved


def _any_backward(graph: torch.fx.Graph, cfg) -> str | None:
    return None if any(is_cudnn_backward(n) for n in graph.nodes) else "no cuDNN attention backward"


def backward_route(node: torch.fx.Node, cfg) -> Route | None:
    return route(node, cfg) if is_cudnn_backward(node) else None


PASS = Pass(NAME, stage=POST_GRAD, unit=GRAPH, why_not=_any_backward, apply=cudnn_frontend_backward_pass,
            backward_route=backward_route)
