"""Dense attention calls onto FlashAttention-4 where the cost map says it is faster, on the joint
(forward + backward) graph, CP regions included::

    out, lse, *rest = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=s)
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(dO, q, k, v, out, lse, *rest, ...)
    ->
    out, lse = cp_inductor.fa4_sdpa(q, k, v, s, causal)
    dq, dk, dv = cp_inductor.fa4_sdpa_backward(dO, None, q, k, v, out, lse, s, causal)

Each op is swapped where FA4 can take it and the cost map says it is faster; forward and
backward are read alike, so a pair goes together, before the partitioner decides what to save.
FA4's log-sum-exp and aten's mean the same (``[B, H, S]``, natural log; cuDNN's has a trailing
1): readers of one (a merge of partial outputs, a backward left on aten's op, or FA4's backward
given a merged out and log-sum-exp) get it viewed to the shape they expect. aten's ops do not differentiate their log-sum-exp; neither does this (no lse gradient
is passed). The CP detectors know ``fa4_sdpa`` as an attention op (``analysis/sdpa_ops.py``),
so the post-grad rewrites find their regions as before. Calls with a mask, dropout, top-left
causal over unequal lengths, or whose RNG outputs the program reads stay on aten's op, with
the reason in the report (``dense attention <node>: program: ...``).
"""

from __future__ import annotations

import operator

import torch

from ... import reporting
from ...lowerings import fa4_attention
from ..analysis import attention_provider, sdpa_ops
from ..editing.fx_emit import Emitter
from ..analysis.op_schema import value
from ..analysis.sym_sizes import equal
from ..record import JOINT_POST, GraphPass

NAME = "fa4_dense"
aten = torch.ops.aten


def _pairs() -> dict:
    names = {
        "_scaled_dot_product_cudnn_attention": "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention": "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
    return {getattr(aten, f).default: getattr(aten, b).default for f, b in names.items() if hasattr(aten, f)}


BACKWARD_OF = _pairs()


def why_not(node: torch.fx.Node, cfg, swapped_backward=frozenset()) -> tuple[str | None, str]:
    """(None, choice reason) where FA4 takes this forward or backward op, else (why not, "" or
    "unavailable": FA4 cannot run on this device at all, which the printed report leaves out).
    A forward whose RNG outputs feed anything but a backward in ``swapped_backward`` stays."""
    a = sdpa_ops.bound_args(node)
    q, k, v = (value(a.get(n)) for n in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k and v are not [B, H, S, D]", ""
    if a.get("attn_bias") is not None or a.get("attn_mask") is not None:
        return "an attention mask is given", ""
    if a.get("dropout_p"):
        return f"dropout {a['dropout_p']}", ""
    causal = bool(a.get("is_causal"))
    # Runs on the joint (or inference) graph, inside the forward's compile: it may guard the
    # lengths equal under dynamic shapes (self-attention's q and k are separate symbols).
    if causal and not equal(q.shape[2], k.shape[2], guard=True):
        return "top-left causal over query and key lengths not known equal (FA4's causal is bottom-right)", ""
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int) and q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads", ""
    if node.target in BACKWARD_OF:
        readers = {u for i, g in sdpa_ops.tuple_outputs(node).items() if i >= 2 for u in g.users}
        if readers - set(swapped_backward):
            return "the program reads the op's RNG state or sequence bounds", ""
    if (no_fa4 := fa4_attention.device_unavailable(q.device)) is not None:
        return no_fa4, "unavailable"
    fa4 = fa4_attention.unavailable(q.device, q.dtype, q.shape[-1], v.shape[-1])
    choice = attention_provider.choose(attention_provider.shape_of("dense", q, k, causal), {"fa4": fa4}, cfg, q.device)
    if choice.provider != "fa4":
        return choice.reason, ""
    return None, choice.reason


def _scale_causal(a: dict) -> tuple[float, bool]:
    scale = a.get("scale")
    return (float(scale) if scale is not None else value(a["query"]).shape[-1] ** -0.5), bool(a.get("is_causal"))


def _swap_outputs(graph, old: torch.fx.Node, new: torch.fx.Node, emit: Emitter, shapes: dict) -> None:
    """Each getitem of ``old`` read from ``new`` (viewed to ``shapes[i]`` where given); the rest dropped."""
    for i, g in sdpa_ops.tuple_outputs(old).items():
        if g.users and i <= 2:
            item = emit(operator.getitem, new, i)
            if i in shapes and list(item.meta["val"].shape) != shapes[i]:
                item = emit(aten.view.default, item, shapes[i])
            g.replace_all_uses_with(item)
        graph.erase_node(g)
    graph.erase_node(old)


def apply_forward(graph: torch.fx.Graph, forward: torch.fx.Node) -> None:
    a = sdpa_ops.bound_args(forward)
    emit = Emitter(graph, forward)
    fa4 = emit(torch.ops.cp_inductor.fa4_sdpa.default, a["query"], a["key"], a["value"], *_scale_causal(a))
    lse = sdpa_ops.tuple_outputs(forward).get(1)  # aten's shape for its readers: [B, H, S] or [B, H, S, 1]
    _swap_outputs(graph, forward, fa4, emit, {} if lse is None else {1: list(value(lse).shape)})
    _copy_meta(forward, emit.created)


def apply_backward(graph: torch.fx.Graph, backward: torch.fx.Node) -> None:
    a = sdpa_ops.bound_args(backward)
    emit = Emitter(graph, backward)
    lse = a["logsumexp"]
    if value(lse).dim() == 4:  # cuDNN's [B, H, S, 1]
        lse = emit(aten.view.default, lse, list(value(lse).shape[:3]))
    grads = emit(torch.ops.cp_inductor.fa4_sdpa_backward.default, a["grad_out"], None, a["query"], a["key"], a["value"],
                 a["out"], lse, *_scale_causal(a))
    _swap_outputs(graph, backward, grads, emit, {})
    _copy_meta(backward, emit.created)


def _copy_meta(old: torch.fx.Node, created: list) -> None:
    """What the partitioner and Inductor read besides the value (stack trace, seq_nr, tags)."""
    for new in created:
        for key, item in old.meta.items():
            if key not in ("val", "tensor_meta"):
                new.meta.setdefault(key, item)


def fa4_dense_pass(graph: torch.fx.Graph, cfg) -> int:
    """Every dense attention op of the joint graph, backward ops first (a forward whose RNG
    outputs a backward reads goes only with it): swapped, or reported with the reason. A
    backward is swapped on its own too: it reads the out and log-sum-exp it is given (a merged
    pair, where the program merges partial attentions), whoever made them. Returns the count."""
    ops = [n for n in graph.nodes if n.op == "call_function"]
    swapped_backward, swapped = set(), 0
    for backward in [n for n in ops if n.target in BACKWARD_OF.values()]:
        reason, _ = why_not(backward, cfg)
        if reason is None:
            swapped_backward.add(backward)
    chosen = []
    for forward in [n for n in ops if n.target in BACKWARD_OF]:
        reason, choice = why_not(forward, cfg, swapped_backward)
        if reason is None:
            chosen.append(forward)
        reporting.record_dense(reporting.DenseRoute(forward.name, "program" if reason else "fa4", reason or choice,
                                                    considered=choice != "unavailable"))
    for backward in swapped_backward:  # first: they read the RNG outputs of the forwards
        apply_backward(graph, backward)
    for forward in chosen:
        apply_forward(graph, forward)
        swapped += 1
    if swapped or swapped_backward:
        graph.lint()
    return swapped + len(swapped_backward)


def wanted(gm: torch.fx.GraphModule, example_inputs, cfg) -> bool:
    """Where FA4 may be chosen and can run on an input's device. Asked on every compile, a
    cached one too, before the cache is read: FA4 installed is enough here, its import waits
    for a call the pass considers."""
    devices = {t.device for t in example_inputs if isinstance(t, torch.Tensor)}
    return cfg.attention_provider in ("auto", "fa4") and any(
        not fa4_attention.device_unavailable(d, imported=False) for d in devices)


PASS = GraphPass(NAME, stage=JOINT_POST, switched=False, apply=fa4_dense_pass,  # attention_provider chooses
            wanted=wanted)
