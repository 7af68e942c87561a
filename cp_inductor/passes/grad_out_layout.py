"""A guard, not a rewrite: cuDNN's attention backward gets a dO laid out like O.

On H200 with torch 2.11 / cuDNN 9.19, ``_scaled_dot_product_cudnn_attention_backward`` returns
wrong gradients when dO's strides differ from O's (every shape of the layout grid,
``benchmarks/bench_attention_layouts.py``, ``mismatched_do_max_diff``). fused_a2a's views change
O's strides in the forward (cuDNN lays O out like q); if the backward region is then not
rewritten the same way, the program's own dO no longer matches. Before::

    dq, dk, dv = cudnn_attention_backward(dO, q, k, v, O, lse, ...)     # dO BHSD, O sequence-major

After::

    dO' = copy of dO in O's stride order
    dq, dk, dv = cudnn_attention_backward(dO', q, k, v, O, lse, ...)

It runs on every backward graph after the rewrites and changes nothing where the layouts agree.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._dynamo.utils import counters

from .fx_emit import Emitter, stride_order
from .sdpa_ops import bound_args

aten = torch.ops.aten
NAME = "grad_out_layout"
_CUDNN_BACKWARD = getattr(aten, "_scaled_dot_product_cudnn_attention_backward", None)


def grad_out_layout_pass(graph: torch.fx.Graph) -> None:
    if _CUDNN_BACKWARD is None:
        return
    for node in list(graph.nodes):
        if node.target is not _CUDNN_BACKWARD.default:
            continue
        args = bound_args(node)
        d_out, out = args.get("grad_out"), args.get("out")
        if not isinstance(d_out, torch.fx.Node) or not isinstance(out, torch.fx.Node):
            continue
        want, have = out.meta.get("val"), d_out.meta.get("val")
        if want is None or have is None or stride_order(want) == stride_order(have):
            continue
        emit = Emitter(graph, node)
        order = stride_order(want)
        inverse = [order.index(i) for i in range(want.dim())]
        dense = emit(aten.clone.default, emit(aten.permute.default, d_out, order), memory_format=torch.contiguous_format)
        node.replace_input_with(d_out, emit(aten.permute.default, dense, inverse))
        counters["cp_inductor"][NAME] += 1  # a copy the program did not have
