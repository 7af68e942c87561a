"""Which op runs a cuDNN attention backward: aten's, or the cuDNN frontend's (whose plan cache,
unlike aten's on torch 2.11-2.13, keys on dO's layout). The pass that moves the calls
(``passes/post_grad/cudnn_frontend_backward.py``) and every rewrite that chooses dO's layout read
the same route: where the call stays on aten's op, dO keeps the layout the program made, as eager
and default Inductor pass it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._inductor.config
import torch.fx

from ...lowerings import cudnn_backward
from .sdpa_ops import bound_args

aten = torch.ops.aten
ATEN_BACKWARD = getattr(aten, "_scaled_dot_product_cudnn_attention_backward", None)
FRONTEND = "cudnn_frontend"
ATEN = "aten"


@dataclass(frozen=True)
class Route:
    path: str  # FRONTEND | ATEN
    reason: str


def is_cudnn_backward(node: torch.fx.Node) -> bool:
    return ATEN_BACKWARD is not None and node.op == "call_function" and node.target is ATEN_BACKWARD.default


def scale_of(args: dict) -> float | None:
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
    if not cfg.cudnn_frontend_backward:
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
    q = args["query"].meta["val"]  # a node with a tensor value (checked above)
    why = None
    if args.get("dropout_p") != 0.0:
        why = "dropout"
    elif args.get("attn_bias") is not None:
        why = "an attention bias"
    elif q.dim() != 4 or q.dtype not in cudnn_backward.DTYPES:
        why = f"{q.dim()}-d {q.dtype} inputs"
    elif scale_of(args) is None:
        why = "a symbolic head_dim"
    if why is not None:
        return Route(ATEN, f"the cuDNN frontend's backward takes no {why}: aten's op, dO as the program made it")
    unavailable = cudnn_backward.unavailable() if frontend_unavailable is None else frontend_unavailable
    if unavailable:
        return Route(ATEN, f"{unavailable}: aten's op, dO as the program made it (its plan cache is keyed on q/k/v layouts only)")
    return Route(FRONTEND, "its plan cache keys on every layout, apart from aten's (torch < 2.14 keys on q/k/v only)")
