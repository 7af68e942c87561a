"""Packed sequences of equal length (THD) onto dense SDPA, on the graph Dynamo hands the backend.

A pack of B sequences of S tokens each is a [B, S, H, D] batch: dense attention takes it with
no padding, on whatever SDPA backend the device picks (cuDNN on H200, where it beats ragged
attention on the same pack; ``docs/passes/uniform_thd.md``), with no new dependency::

    out, lse, rng = torch_attn._varlen_attn(q, k, v, cu, cu, S, S, causal, scale, window, ...)
    y = out
    ->
    [torch._assert_async(all(cu == arange(0, T + 1, S)))]      # promised lengths only
    o = F.scaled_dot_product_attention(q.view(B, S, H, D).transpose(1, 2), ..., is_causal=causal)
    y = o.transpose(1, 2).reshape(T, H, D)   # or o from cp_inductor.fa4_sdpa: attention_provider's choice

The lengths are equal when the graph proves it (``cu`` is ``arange(0, T + 1, S)`` or
``arange(B + 1) * S``) or when the user promises it: for every pack (``uniform_thd="promised"``) or for one call
(``cu = cp_inductor.equal_lengths(cu)``, which checks it in eager code too). A promise is
checked on device at every call, without a host sync (CUDA-graph safe): a broken one is a
device-side assertion, never a wrong answer.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F

from ...lowerings import fa4_attention
from ..analysis import attention_provider
from ..record import DYNAMO, CallPass
from . import varlen_calls

NAME = "uniform_thd"
DENSE = "dense_sdpa"
FA4_DENSE = "fa4_dense"


# Methods that move or convert integer positions without changing their values.
_SAME_VALUES = ("to", "int", "long", "cuda", "contiguous")


def _int(x):
    return x if isinstance(x, int) else None


def proven_length(cu) -> int | None:
    """S when ``cu`` is built as ``arange(0, T + 1, S)`` or ``arange(B + 1) * S``, else None."""
    if not isinstance(cu, torch.fx.Node):
        return None
    if cu.op == "call_method" and cu.target in _SAME_VALUES:  # .to(int32), .cuda(), ...
        return proven_length(cu.args[0])
    if cu.op != "call_function":
        return None
    if cu.target in (operator.mul, torch.mul) and len(cu.args) == 2:
        base, factor = cu.args if isinstance(cu.args[0], torch.fx.Node) else cu.args[::-1]
        step = proven_length(base)
        return step * factor if step == 1 and _int(factor) else None
    if cu.target is not torch.arange:
        return None
    args = [_int(a) for a in cu.args]
    if len(args) == 1:
        start, step = 0, 1
    elif len(args) in (2, 3):
        start, step = args[0], (args[2] if len(args) == 3 else 1)
    else:
        return None
    step = cu.kwargs.get("step", step)
    return step if start == 0 and _int(step) else None


def marked(cu) -> bool:
    """Whether ``cu`` comes from ``cp_inductor.equal_lengths`` (which checks it on device)."""
    return isinstance(cu, torch.fx.Node) and cu.op == "call_function" and cu.target in (
        torch.ops.cp_inductor.equal_lengths, torch.ops.cp_inductor.equal_lengths.default)


def why_not(call: varlen_calls.VarlenCall, cfg) -> str | None:
    a = call.args
    if a["cu_seq_k"] is not a["cu_seq_q"]:
        return "cu_seq_k is not cu_seq_q (cross attention)"
    step = proven_length(a["cu_seq_q"])
    if step is not None:
        lengths = "proven"
    elif cfg.uniform_thd == "promised" or marked(a["cu_seq_q"]):
        lengths = "promised"
    else:
        return "lengths unknown (cu_seqlens not built from arange, not marked equal_lengths, no uniform_thd=\"promised\")"
    cu, q = varlen_calls.value(a["cu_seq_q"]), call.query
    sequences, tokens = cu.shape[0] - 1, q.shape[0]
    if not all(isinstance(n, int) for n in (sequences, tokens)):
        return "symbolic token or sequence count"
    if sequences < 1 or tokens % sequences or (step is not None and step * sequences != tokens):
        return f"{tokens} tokens are not {sequences} sequences of one length"
    call.lengths = lengths
    _choose_provider(call, cfg)
    return None


def _choose_provider(call: varlen_calls.VarlenCall, cfg) -> None:
    """Dense SDPA as the device picks it ("program" in the dense rows of the cost map) or FA4,
    read at the dense bucket of the pack's tokens (B x S = T)."""
    q, k = call.query, varlen_calls.value(varlen_calls.unrepeated_kv(call)[0])
    v = varlen_calls.value(call.args["value"])
    shape = attention_provider.shape_of("thd", q, k, call.is_causal)
    shape = shape and dataclasses.replace(shape, layout="dense")
    fa4 = fa4_attention.unavailable(q.device, q.dtype, q.shape[-1], v.shape[-1])
    choice = attention_provider.choose(shape, {"fa4": fa4}, cfg, q.device)
    call.provider = "fa4" if choice.provider == "fa4" else "program"
    call.provider_reason = choice.reason


def apply(gm: torch.fx.GraphModule, call: varlen_calls.VarlenCall) -> None:
    a = call.args
    graph = gm.graph
    cu = a["cu_seq_q"]
    sequences, tokens = varlen_calls.value(cu).shape[0] - 1, call.query.shape[0]
    length = tokens // sequences
    heads_q = call.query.shape[1]

    def build(k, v):
        if call.lengths == "promised":  # marked too: dense SDPA leaves the marker's output unread
            expected = graph.call_function(torch.arange, (0, tokens + 1, length), {
                "dtype": varlen_calls.value(cu).dtype, "device": varlen_calls.value(cu).device})
            equal = graph.call_function(torch.all, (graph.call_function(operator.eq, (cu, expected)),))
            graph.call_function(torch._assert_async, (equal, "uniform_thd: the sequences of this pack are not of equal length"))

        def dense(t):
            return graph.call_method("transpose", (graph.call_method("view", (t, sequences, length, -1, varlen_calls.value(t).shape[-1])), 1, 2))

        heads_kv = varlen_calls.value(k).shape[1]
        if call.provider == "fa4":
            o = graph.call_function(torch.ops.cp_inductor.fa4_sdpa.default, (
                dense(a["query"]), dense(k), dense(v), varlen_calls.scale(call), call.is_causal))
            o = graph.call_function(operator.getitem, (o, 0))
        else:
            o = graph.call_function(F.scaled_dot_product_attention, (dense(a["query"]), dense(k), dense(v)), {
                "is_causal": call.is_causal, "scale": varlen_calls.scale(call), "enable_gqa": heads_kv != heads_q})
        return graph.call_method("reshape", (graph.call_method("transpose", (o, 1, 2)), tokens, heads_q, -1))

    varlen_calls.replace(gm, call, build, FA4_DENSE if call.provider == "fa4" else DENSE)


PASS = CallPass(NAME, stage=DYNAMO, why_not=why_not, apply=apply)


