"""Packed-sequence (THD) attention onto cuDNN's ragged SDPA or FlashAttention-4, on the graph
Dynamo hands the backend.

torchtitan's ``VarlenAttention`` and anyone calling ``torch.nn.attention.varlen.varlen_attn``
reach ``torch_attn::_varlen_attn`` (others call ``aten._flash_attention_forward`` on the pack,
taken the same way), which runs flash-attention 2 and needs K/V heads repeated for GQA. cuDNN's ragged attention takes the same pack about 1.6x faster on H200, GQA as is
(``docs/passes/varlen_cudnn.md``)::

    k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    out, lse, rng = torch_attn._varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, ...)
    y = out
    ->
    out, lse = cp_inductor.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
    y = out                     # or cp_inductor.fa4_varlen_attention(q, k, v, cu_q, cu_k, None, ...)

Which kernel takes the call is ``attention_provider``'s choice (``analysis/attention_provider.py``:
the measured cost map, among the providers that can take it); on H200, cuDNN's ragged attention
took 1.00-1.55x FA4's time over the measured packs. The switch keeps its first name: off, every call keeps the
program's kernel.

The rewrite runs before AOTAutograd, so our op's own autograd formula (out and its log-sum-exp
saved, ``cp_inductor.varlen_attention_backward`` in the backward graph) replaces the program's:
forward and backward cannot disagree about the log-sum-exp's layout. Calls ``uniform_thd`` sent
to dense SDPA are not seen here.
"""

from __future__ import annotations

import dataclasses
import operator

import torch

from ...lowerings import fa4_attention, varlen_attention
from ..analysis import attention_provider
from ..record import DYNAMO, CallPass
from . import varlen_calls

NAME = "varlen_cudnn"
CUDNN_RAGGED = "cudnn_ragged"
FA4_VARLEN = "fa4_varlen"


def why_not(call: varlen_calls.VarlenCall, cfg) -> str | None:
    q, v = call.query, varlen_calls.value(call.args["value"])
    candidates = {
        "cudnn": _cudnn_why_not(call, cfg),
        "fa4": fa4_attention.unavailable(q.device, q.dtype, q.shape[-1], v.shape[-1]),
    }
    k = varlen_calls.value(varlen_calls.unrepeated_kv(call)[0])  # the heads our op will read (GQA as is)
    shape = attention_provider.shape_of("thd", q, k, call.is_causal)
    unmeasured = "cudnn"
    cu_apart = call.args["cu_seq_k"] is not call.args["cu_seq_q"]
    if shape is not None and (k.shape[0] != q.shape[0] or (cu_apart and call.is_causal)):
        # Queries over their documents' key prefixes (K/V all-gather's chunks), or causal with
        # cu_seqlens_k apart from cu_seqlens_q (flash-attn's calls pass both): our cuDNN graphs
        # mask bottom-right then, which measured 1.6x (D128) and 1.8x (D256) FA4's time on
        # all-gather chunks, 0.88x / 1.17x flash-2's (bench_thd_allgather.py, H200); the cost
        # map's packs are self-attention. FA4, else cuDNN up to D128, else the program's op.
        shape = dataclasses.replace(shape, layout="thd_cross")
        unmeasured = "fa4" if candidates["fa4"] is None else "cudnn" if q.shape[-1] <= 128 else "program"
    choice = attention_provider.choose(shape, candidates, cfg, q.device, unmeasured=unmeasured)
    if choice.provider == "program":
        return choice.reason
    call.provider, call.provider_reason = choice.provider, choice.reason
    return None


def _cudnn_why_not(call: varlen_calls.VarlenCall, cfg) -> str | None:
    q = call.query
    reason = varlen_attention.cudnn_shape_unavailable(q.device, q.dtype, q.shape[-1])
    if reason is None and q.device.type == "cuda" and (size := _size(q)) < cfg.varlen_cudnn_min_size:
        return (f"cost model: {size} tokens x query heads x head_dim is below varlen_cudnn_min_size="
                f"{cfg.varlen_cudnn_min_size}, where cuDNN's ragged attention measured slower than flash-2 "
                "(H200: 0.84x at 8K tokens Hq32 D128, 1.29x at 16K)")
    return reason or varlen_attention.unavailable(q.device)


def _size(q) -> int:
    """Tokens x query heads x head_dim, a dynamic token count read at its hint."""
    tokens = q.shape[0]
    if not isinstance(tokens, int):
        tokens = getattr(tokens.node, "hint", None) or 0
    return int(tokens) * int(q.shape[1]) * int(q.shape[2])


def apply(gm: torch.fx.GraphModule, call: varlen_calls.VarlenCall) -> None:
    a = call.args
    fa4 = call.provider == "fa4"

    def build(k, v):
        lengths = (a["cu_seq_q"], a["cu_seq_k"], *((None,) if fa4 else ()), a["max_q"], a["max_k"])
        op = torch.ops.cp_inductor.fa4_varlen_attention if fa4 else torch.ops.cp_inductor.varlen_attention
        attention = gm.graph.call_function(op.default, (a["query"], k, v, *lengths, varlen_calls.scale(call), call.is_causal))
        return gm.graph.call_function(operator.getitem, (attention, 0))

    varlen_calls.replace(gm, call, build, FA4_VARLEN if fa4 else CUDNN_RAGGED)


PASS = CallPass(NAME, stage=DYNAMO, why_not=why_not, apply=apply)
