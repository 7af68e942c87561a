"""Packed-sequence (THD) attention onto cuDNN's ragged SDPA, on the graph Dynamo hands the backend.

torchtitan's ``VarlenAttention`` and anyone calling ``torch.nn.attention.varlen.varlen_attn``
reach ``torch_attn::_varlen_attn`` (others call ``aten._flash_attention_forward`` on the pack,
taken the same way), which runs flash-attention 2 and needs K/V heads repeated for GQA. cuDNN's ragged attention takes the same pack about 1.6x faster on H200, GQA as is
(``docs/rewrites/varlen_cudnn.md``)::

    k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    out, lse, rng = torch_attn._varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, ...)
    y = out
    ->
    out, lse = cp_inductor.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
    y = out

The rewrite runs before AOTAutograd, so our op's own autograd formula (out and its log-sum-exp
saved, ``cp_inductor.varlen_attention_backward`` in the backward graph) replaces the program's:
forward and backward cannot disagree about the log-sum-exp's layout. Calls ``uniform_thd`` sent
to dense SDPA are not seen here.
"""

from __future__ import annotations

import operator

import torch
from torch._dynamo.utils import counters

from ...lowerings import varlen_attention
from ..analysis import varlen_calls

NAME = "varlen_cudnn"
CUDNN_RAGGED = "cudnn_ragged"


def why_not(call: varlen_calls.VarlenCall, cfg) -> str | None:
    if not cfg.varlen_cudnn:
        return "switch varlen_cudnn is off"
    q = call.query
    head_dim = q.shape[-1]
    if not isinstance(head_dim, int) or head_dim > varlen_attention.MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} (cuDNN takes multiples of 8 up to {varlen_attention.MAX_HEAD_DIM})"
    if q.device.type == "cuda" and q.dtype not in varlen_attention.DTYPES:
        return f"dtype {q.dtype} (cuDNN takes float16 and bfloat16)"
    if q.device.type == "cuda" and (size := _size(q)) < cfg.varlen_cudnn_min_size:
        return (f"cost model: {size} tokens x query heads x head_dim is below varlen_cudnn_min_size="
                f"{cfg.varlen_cudnn_min_size}, where cuDNN's ragged attention measured slower than flash-2 "
                "(H200: 0.84x at 8K tokens Hq32 D128, 1.29x at 16K)")
    return varlen_calls.cuda_or_reference_reason(call)


def _size(q) -> int:
    """Tokens x query heads x head_dim, a dynamic token count read at its hint."""
    tokens = q.shape[0]
    if not isinstance(tokens, int):
        tokens = getattr(tokens.node, "hint", None) or 0
    return int(tokens) * int(q.shape[1]) * int(q.shape[2])


def apply(gm: torch.fx.GraphModule, call: varlen_calls.VarlenCall) -> None:
    a = call.args

    def build(k, v):
        attention = gm.graph.call_function(
            torch.ops.cp_inductor.varlen_attention.default,
            (a["query"], k, v, a["cu_seq_q"], a["cu_seq_k"], a["max_q"], a["max_k"], varlen_calls.scale(call), call.is_causal),
        )
        return gm.graph.call_function(operator.getitem, (attention, 0))

    varlen_calls.replace(gm, call, build, CUDNN_RAGGED)
    counters["cp_inductor"][NAME] += 1
