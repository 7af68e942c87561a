"""Packed-sequence (THD) attention onto cuDNN's ragged SDPA, on the graph Dynamo hands the backend.

torchtitan's ``VarlenAttention`` and anyone calling ``torch.nn.attention.varlen.varlen_attn``
reach ``torch_attn::_varlen_attn``, which runs flash-attention 2 and needs K/V heads repeated
for GQA. cuDNN's ragged attention takes the same pack about 1.6x faster on H200
(``docs/rewrites/varlen_cudnn.md``)::

    out, lse, rng = torch_attn._varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, ...)
    y = out
    ->
    out, lse = cp_inductor.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
    y = out

The rewrite runs before AOTAutograd, so our op's own autograd formula (out and its log-sum-exp
saved, ``cp_inductor.varlen_attention_backward`` in the backward graph) replaces the
program's; the forward and backward cannot disagree about the log-sum-exp's layout. A call that
cannot move keeps the program's op, with the reason in the report.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch._dynamo.utils import counters

from ..lowerings import varlen_attention
from ..reporting import VarlenRoute

NAME = "varlen_cudnn"
CUDNN_RAGGED = "cudnn_ragged"
KEPT = "kept"


def _varlen_ops() -> tuple:
    try:
        import torch.nn.attention.varlen  # noqa: F401 - defines torch_attn::_varlen_attn
    except ImportError:
        return ()
    packet = getattr(torch.ops.torch_attn, "_varlen_attn", None)
    return () if packet is None else (packet, packet.default)


@dataclass
class VarlenCall:
    """One varlen attention call, its arguments read by the op's schema names (which differ
    between torch versions), and where it goes."""

    node: torch.fx.Node
    args: dict
    is_causal: bool
    path: str = KEPT
    reason: str = ""
    repeat_dropped: bool = False  # K/V heads were repeated only to feed the call

    def route(self) -> VarlenRoute:
        detail = "causal" if self.is_causal else "full"
        if self.repeat_dropped:
            detail += ", K/V head repeat dropped"
        return VarlenRoute(self.node.name, "local", "unknown", detail, self.path, self.reason)


def _bind(node: torch.fx.Node) -> dict:
    target = node.target if isinstance(node.target, torch._ops.OpOverload) else node.target.default
    arguments = target._schema.arguments
    bound = {a.name: a.default_value for a in arguments if a.has_default_value()}
    bound.update(zip((a.name for a in arguments), node.args))
    bound.update(node.kwargs)
    return bound


def _val(x):
    return x.meta.get("example_value", x.meta.get("val")) if isinstance(x, torch.fx.Node) else x


def _why_not(call: VarlenCall, cfg) -> str | None:
    a = call.args
    window = list(a.get("window_size") or [-1, -1])
    if not cfg.varlen_cudnn:
        return "switch varlen_cudnn is off"
    if window not in ([-1, -1], [-1, 0]):
        return f"sliding window {window} (only none or causal)"
    for name in ("seqused_k", "block_table", "num_splits"):
        if a.get(name) is not None:
            return f"{name} is given (paged or split-KV inference)"
    users = {u.args[1] for u in call.node.users if u.target is operator.getitem}
    if users - {0} or len(users) != len(call.node.users):
        return "the program reads the log-sum-exp or the RNG state"
    q, k, v = (_val(a[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return "q, k and v are not [tokens, heads, head_dim]"
    head_dim = q.shape[-1]
    if not isinstance(head_dim, int) or head_dim > varlen_attention.MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} (cuDNN takes multiples of 8 up to {varlen_attention.MAX_HEAD_DIM})"
    if q.device.type == "cuda" and q.dtype not in varlen_attention.DTYPES:
        return f"dtype {q.dtype} (cuDNN takes float16 and bfloat16)"
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int) and q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads"
    return varlen_attention.unavailable(q.device)


def _head_repeat(node, groups: int):
    """The input of ``x.repeat_interleave(groups, dim=1)`` when that is all ``node`` is, else None."""
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
        return None
    is_method = node.op == "call_method" and node.target == "repeat_interleave"
    is_function = node.op == "call_function" and node.target in (torch.repeat_interleave, torch.Tensor.repeat_interleave)
    if not (is_method or is_function) or len(node.args) < 2:
        return None
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if node.args[1] != groups or dim not in (1, -2) or node.kwargs.get("output_size") is not None:
        return None
    return node.args[0]


def _drop_head_repeat(call: VarlenCall, k, v):
    """cuDNN takes GQA as is: K/V repeated per query head only to feed the call go unrepeated
    (and with them the backward's sum over the repeats)."""
    q_heads, kv = _val(call.args["query"]).shape[1], _val(k)
    for groups in range(2, q_heads + 1):
        if q_heads % groups == 0 and kv is not None and kv.shape[1] == q_heads:
            k0, v0 = _head_repeat(k, groups), _head_repeat(v, groups)
            if k0 is not None and v0 is not None and _val(k0).shape[1] * groups == q_heads:
                return k0, v0
    return None


def find(graph: torch.fx.Graph) -> list[VarlenCall]:
    ops = _varlen_ops()
    calls = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in ops:
            args = _bind(node)
            causal = bool(args.get("is_causal", False)) or list(args.get("window_size") or []) == [-1, 0]
            calls.append(VarlenCall(node, args, causal))
    return calls


def run(gm: torch.fx.GraphModule, cfg) -> list[VarlenRoute]:
    """Decides every varlen call of the graph and rewrites those that can move; returns the
    report's line for each."""
    calls = find(gm.graph)
    for call in calls:
        try:
            reason = _why_not(call, cfg)
        except Exception as e:  # noqa: BLE001 - a check that cannot decide keeps the program's op
            reason = f"could not be checked ({type(e).__name__}: {e})"
        if reason is not None:
            call.reason = reason
            continue
        a = call.args
        q = _val(a["query"])
        scale = a.get("scale")
        scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
        cu_k = a["cu_seq_k"] if a.get("cu_seq_k") is not None else a["cu_seq_q"]
        k, v = a["key"], a["value"]
        unrepeated = _drop_head_repeat(call, k, v)
        if unrepeated is not None:
            k, v = unrepeated
        with gm.graph.inserting_before(call.node):
            new = gm.graph.call_function(
                torch.ops.cp_inductor.varlen_attention.default,
                (a["query"], k, v, a["cu_seq_q"], cu_k, a["max_q"], a["max_k"], scale, call.is_causal),
            )
        for user in list(call.node.users):  # getitem 0 (out): the same index on ours
            user.replace_input_with(call.node, new)
        call.path, call.repeat_dropped = CUDNN_RAGGED, unrepeated is not None
        gm.graph.erase_node(call.node)  # its name stays readable for the report
        for dead in ([a["key"], a["value"]] if unrepeated is not None else []):
            if not dead.users:
                gm.graph.erase_node(dead)
        counters["cp_inductor"][NAME] += 1
    if any(c.path == CUDNN_RAGGED for c in calls):
        gm.graph.lint()
        gm.recompile()
    return [c.route() for c in calls]
