"""SDPA calls of the graph Dynamo hands the backend: their arguments, the K/V head repeat HF puts
before them, and the nodes a rewritten call leaves unread. Shared by the passes that replace such
calls."""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import guard_float

from ..analysis.op_schema import value
from . import varlen_calls

SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_args(node: torch.fx.Node) -> dict:
    """An SDPA call's arguments by name."""
    return {**dict(zip(SDPA_ARGS, node.args)), **node.kwargs}


def softmax_scale(g: torch.fx.Graph, args: dict):
    """The call's softmax scale where ``g`` inserts: its own, else 1/sqrt(head dim). Under symbolic
    shapes the head dim is a symbol: the scale is then a node reading the query's size, since a
    SymFloat put among a node's arguments is a value of the trace, not of the graph."""
    scale = args.get("scale")
    if scale is not None:
        return float(scale)
    query = args["query"]
    head_dim = value(query).shape[-1]
    if isinstance(head_dim, int):
        return head_dim ** -0.5
    size = g.call_function(torch.ops.aten.sym_size.int, (query, value(query).dim() - 1))
    return g.call_function(operator.pow, (size, -0.5))


# Floats Dynamo lifts to graph inputs under ``dynamic=True`` (HF's ``attention_dropout`` and
# ``scaling``): read at their values, with a guard, once a call is taken.
LIFTED_FLOATS = ("dropout_p", "scale")


def lifted_float_reason(args: dict) -> str | None:
    """Why a float the call takes as a graph input keeps it, or None where each such float is a
    SymFloat with a value to read (a dropout one only at 0)."""
    for name in LIFTED_FLOATS:
        if not isinstance(args.get(name), torch.fx.Node):
            continue
        sym = value(args[name])
        hint = sym.node.hint if isinstance(sym, torch.SymFloat) else None
        if hint is None:
            return f"{name} is a float the graph takes as an input (dynamic): not known when compiling"
        if name == "dropout_p" and hint != 0:
            return f"dropout {hint}"
    return None


def read_lifted_floats(args: dict) -> None:
    """A taken call's lifted floats at their values, each with a guard (another value compiles
    again): call only once ``lifted_float_reason`` is None and the call is taken, since a guard
    taken for a call that is kept would recompile for nothing."""
    for name in LIFTED_FLOATS:
        if isinstance(args.get(name), torch.fx.Node):
            args[name] = guard_float(value(args[name]))


def computed_dtype(node: torch.fx.Node, query: torch.fx.Node) -> torch.dtype:
    """The dtype an attention call computes in: an SDPA call's output's (autocast, the graph's or
    the caller's, casts query, key and value to it; without autocast it is theirs), a flex call's
    query's (its value is (out, lse); flex is not on autocast's list)."""
    out = value(node)
    return out.dtype if isinstance(out, torch.Tensor) else value(query).dtype


def autocast_inputs(graph: torch.fx.Graph, node: torch.fx.Node, tensors: dict) -> dict:
    """``tensors`` (query, key, value by name, of SDPA call ``node``) as the call computes them:
    under autocast SDPA casts them to ``computed_dtype``, an op put in its place does not (it is
    not on autocast's list), so the casts are made explicit, ``.to`` before ``node``. Unchanged
    without autocast."""
    result = value(node)
    out = dict(tensors)
    if not isinstance(result, torch.Tensor):  # flex's (out, lse): flex is not on autocast's list
        return out
    dtype = result.dtype
    for name, x in tensors.items():
        example = value(x)
        if isinstance(example, torch.Tensor) and example.is_floating_point() and example.dtype != dtype:
            with graph.inserting_before(node):
                out[name] = graph.call_method("to", (x, dtype))
            with getattr(example, "fake_mode", None) or contextlib.nullcontext():  # the example's own mode
                out[name].meta["example_value"] = example.to(dtype)
    return out


def unrepeated(node, q_heads):
    """``x`` where ``node`` is HF's K/V head repeat ``x[:, :, None].expand(B, Hkv, g, T, D)
    .reshape(B, Hq, T, D)`` (or ``repeat_interleave(g, dim=1)``) read only by SDPA, else None."""
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
        return None
    kv_heads = [g for g in range(2, q_heads + 1) if q_heads % g == 0]
    for groups in kv_heads:
        x = varlen_calls.head_repeat(node, groups)
        if x is not None:
            return x
    if not (node.op == "call_method" and node.target == "reshape") or len(node.args[0].users) != 1:
        return None
    expand = node.args[0]
    if not (expand.op == "call_method" and expand.target == "expand") or len(expand.args[0].users) != 1:
        return None
    inserted = expand.args[0]
    x = None
    if inserted.op == "call_function" and inserted.target is operator.getitem:
        index = inserted.args[1]
        full = slice(None, None, None)
        if isinstance(index, tuple) and 3 <= len(index) <= 5 and index[2] is None and all(i == full for i in index[:2] + index[3:]):
            x = inserted.args[0]
    elif inserted.op == "call_method" and inserted.target == "unsqueeze" and inserted.args[1] == 2:
        x = inserted.args[0]
    if x is None:
        return None
    xv, out = value(x), value(node)
    if xv is None or xv.dim() != 4 or value(expand).shape[:2] != xv.shape[:2] or out.shape[1] != q_heads:
        return None
    if value(expand).shape[1] * value(expand).shape[2] != q_heads or tuple(out.shape[2:]) != tuple(xv.shape[2:]):
        return None
    return x


def erase_dead(graph: torch.fx.Graph, node) -> None:
    """``node`` and what only it read, where nothing reads them (placeholders stay)."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in erased or n.users or n.op in ("placeholder", "get_attr", "output"):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)
