"""flash-attn's varlen attention on the graph Dynamo hands the backend, read as a varlen call.

``flash_attn_varlen_func`` wraps flash-attn's custom op in an autograd.Function. Dynamo keeps the
Function as a higher-order op whose forward and backward are subgraphs::

    apply = autograd_function_apply(fwd_body, bwd_body, q, k, v, cu_q, cu_k, ...)
        fwd_body(q, k, v, cu_q, cu_k):
            out, lse, _, rng = flash_attn._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 4096, 4096, 0.0, 0.088, causal=True)
            return ((out[..., :128], ...), (q, k, v, out, lse, cu_q, cu_k, rng))
        bwd_body: ... flash_attn._flash_attn_varlen_backward(...) ...
    y = apply[0]

Such a call is a varlen call (``varlen_calls.VarlenCall`` on the higher-order op's node, its
arguments under ``torch_attn::_varlen_attn``'s names, the outer graph's nodes standing for the
body's placeholders) when the forward does nothing but call the op and the backward calls
flash-attn's backward: the Function is then attention and its gradient, so our op's autograd
formula can stand in for both. Otherwise the call is kept, with the reason. A direct call of the
op (no Function: inference) is read the same way.

The packed Functions (``flash_attn_varlen_qkvpacked_func``, ``..._kvpacked_func``) take q, k and
v as views of one input (``q, k, v = qkv[:, 0].detach(), qkv[:, 1].detach(), ...``): the same
views of the outer input are put before the call (``FunctionRead.inserted``; the pipeline takes
them out again if the call stays), and autograd through them gives the packed gradient.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..analysis.op_schema import bind, qualname, value


@dataclass(frozen=True)
class FlashAttnOps:
    """One flash-attn release's pair of varlen ops, "namespace::name"."""

    forward: str
    backward: str


# Releases name their ops differently (the 2.7/2.8 wheels: flash_attn::, later: flashattn::);
# the schemas are the same. To recognize another release, add its row.
FLASH_ATTN_VARLEN = tuple(
    FlashAttnOps(f"{ns}::_flash_attn_varlen_forward", f"{ns}::_flash_attn_varlen_backward")
    for ns in ("flash_attn", "flashattn")
)
# keyed by str | None: looked up with qualname(target), which is None for a target that is no op
_BY_FORWARD: dict[str | None, FlashAttnOps] = {ops.forward: ops for ops in FLASH_ATTN_VARLEN}
_FUNCTION = torch.ops.higher_order.autograd_function_apply


def is_flash_forward(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and qualname(node.target) in _BY_FORWARD


def normalized(bound: dict) -> dict:
    """flash-attn's forward arguments under ``torch_attn::_varlen_attn``'s names, its extras
    (dropout, softcap, ALiBi, paging, the probabilities) kept for the shared checks."""
    left, right = bound.get("window_size_left", -1), bound.get("window_size_right", -1)
    return {
        "query": bound["q"], "key": bound["k"], "value": bound["v"], "cu_seq_q": bound["cu_seqlens_q"],
        "cu_seq_k": bound["cu_seqlens_k"], "max_q": bound["max_seqlen_q"], "max_k": bound["max_seqlen_k"],
        "is_causal": bound["causal"], "scale": bound["softmax_scale"],
        "window_size": None if (left, right) == (-1, -1) else [left, right],
        "dropout_p": bound.get("dropout_p", 0.0), "softcap": bound.get("softcap", 0.0),
        "alibi_slopes": bound.get("alibi_slopes"), "return_debug_mask": bound.get("return_softmax", False),
        "block_table": bound.get("block_table"), "seqused_k": bound.get("seqused_k"), "leftpad_k": bound.get("leftpad_k"),
        "num_splits": None,
    }


@dataclass
class FunctionRead:
    """What a flash-attn autograd.Function call reads as: its forward call's name, and either
    its arguments (outer nodes and constants) or why it is kept; ``inserted``: the outer views
    made for a packed Function's q, k, v."""

    name: str
    is_causal: bool
    args: dict | None = None
    why_kept: str | None = None
    inserted: tuple = ()


def _body(gm: torch.fx.GraphModule, node) -> torch.fx.GraphModule | None:
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        body = getattr(gm, node.target, None)
        return body if isinstance(body, torch.fx.GraphModule) else None
    return None


def _is_op_output(node, call: torch.fx.Node) -> bool:
    """``node`` is the call's out, or a slice ``out[..., :n]`` that keeps all of it (flash-attn
    undoing its head_dim padding, a no-op at a head_dim that is a multiple of 8)."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    source, index = node.args
    if source is call:
        return index == 0
    if not (_is_op_output(source, call) and isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis):
        return False
    kept = index[1]
    width = value(source).shape[-1]
    return isinstance(kept, slice) and kept.start in (None, 0) and kept.step in (None, 1) and (kept.stop or width) >= width


_DETACH = (torch.Tensor.detach, torch.detach, torch.ops.aten.detach.default)


def _operand_view(node, placeholders) -> tuple | None:
    """``(placeholder, index)`` when ``node`` is ``placeholder[index]`` (ints and full slices),
    perhaps detached: how flash-attn's packed Functions take q, k, v out of qkv or kv."""
    if not isinstance(node, torch.fx.Node):
        return None
    if (node.op == "call_method" and node.target == "detach") or (node.op == "call_function" and node.target in _DETACH):
        node = node.args[0]
    if node.op != "call_function" or node.target is not operator.getitem or node.args[0] not in placeholders:
        return None
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not all((isinstance(i, int) and not isinstance(i, bool)) or i == slice(None) for i in index):
        return None
    return node.args[0], index


def _inert(node: torch.fx.Node, call: torch.fx.Node, placeholders) -> bool:
    return (node.op in ("placeholder", "output") or node is call or _is_op_output(node, call)
            or _operand_view(node, placeholders) is not None
            or (node.op == "call_function" and node.target is operator.getitem and node.args[0] is call)
            or (node.op == "call_function" and node.target is torch._C._set_grad_enabled))


# what a body op that keeps the Function usually means
_EXTRA_MEANS = {"pad": " (flash-attn pads a head_dim off 8)", "getitem": " (a view that is not a whole slice of an input)"}


def read_function(gm: torch.fx.GraphModule, node: torch.fx.Node) -> FunctionRead | None:
    """``node`` read as flash-attn's varlen attention, or None when it is no flash-attn call."""
    if node.op != "call_function":
        return None
    if is_flash_forward(node):  # called directly, outside an autograd.Function
        args = normalized(bind(node))
        return FunctionRead(node.name, args["is_causal"] is True, args)
    if node.target is not _FUNCTION or len(node.args) < 2:
        return None
    forward, backward = _body(gm, node.args[0]), _body(gm, node.args[1])
    if forward is None or backward is None:
        return None
    calls = [n for n in forward.graph.nodes if is_flash_forward(n)]
    if not calls:
        return None
    call = calls[0]
    read = FunctionRead(call.name, bind(call).get("causal") is True)
    if len(calls) > 1:
        read.why_kept = f"the autograd.Function's forward calls flash-attn {len(calls)} times"
        return read
    ops = _BY_FORWARD[qualname(call.target)]
    if not any(n.op == "call_function" and qualname(n.target) == ops.backward for n in backward.graph.nodes):
        read.why_kept = f"the autograd.Function's backward does not call {ops.backward}"
        return read
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    extra = [n for n in forward.graph.nodes if not _inert(n, call, placeholders)]
    if extra:
        what = extra[0].target if extra[0].op != "call_function" else getattr(extra[0].target, "__name__", extra[0].target)
        read.why_kept = f"the autograd.Function's forward also runs {what}{_EXTRA_MEANS.get(what, '')}"
        return read
    operands = list(node.args[2:])
    if len(placeholders) == len(operands) + 1:  # a ctx placeholder first
        placeholders = placeholders[1:]
    (output,) = (n for n in forward.graph.nodes if n.op == "output")
    results = output.args[0]
    shaped = (len(placeholders) == len(operands) and isinstance(results, tuple) and len(results) == 2
              and isinstance(results[0], (tuple, list)) and results[0])
    if not shaped or not (isinstance(results[0][0], torch.fx.Node) and _is_op_output(results[0][0], call)):
        read.why_kept = "the autograd.Function's body is not in a form this pass reads (its first output is not the op's)"
        return read
    outer = dict(zip(placeholders, operands))
    args, views = {}, {}
    for name, arg in bind(call).items():
        if isinstance(arg, torch.fx.Node):
            if arg in outer:
                arg = outer[arg]
            elif (view := _operand_view(arg, outer)) is not None and isinstance(outer[view[0]], torch.fx.Node):
                views[name] = (outer[view[0]], view[1])
            else:
                read.why_kept = f"flash-attn's {name} is computed inside the autograd.Function"
                return read
        args[name] = arg
    made = {}  # (source, repr(index)) -> view: one view per distinct slice (slices do not hash before 3.12)
    with gm.graph.inserting_before(node):
        for name, (source, index) in views.items():
            key = (source, repr(index))
            if key not in made:
                made[key] = gm.graph.call_function(operator.getitem, (source, index))
                made[key].meta["example_value"] = value(source)[index]
            args[name] = made[key]
    read.args, read.inserted = normalized(args), tuple(made.values())
    return read
