"""The ATen attention ops that SDPA lowers to, forward and backward, and their argument names."""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def _ops(*names):
    return tuple(getattr(aten, n).default for n in names if hasattr(aten, n))


# Each forward op takes (query, key, value, ...) and returns (out, logsumexp, ...).
SDPA_FORWARD = _ops(
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
# Each backward op takes (grad_out, query, key, value, ...) and returns (dq, dk, dv, ...).
SDPA_BACKWARD = _ops(
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
)


# The memory-efficient backward calls its first argument ``grad_out_``; everything else says
# ``grad_out``.
_ALIASES = {"grad_out_": "grad_out"}


def arg_names(node: torch.fx.Node) -> list[str]:
    """Schema argument names of an attention op, in order, with one spelling per role."""
    return [_ALIASES.get(a.name, a.name) for a in node.target._schema.arguments]


def bound_args(node: torch.fx.Node) -> dict:
    """The node's arguments by (normalized) schema name, defaults filled in."""
    out = {}
    for i, (arg, name) in enumerate(zip(node.target._schema.arguments, arg_names(node))):
        if i < len(node.args) and not arg.kwarg_only:
            out[name] = node.args[i]
        elif arg.name in node.kwargs:
            out[name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[name] = arg.default_value
    return out


def tuple_outputs(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """getitem users of a multi-output node, by index."""
    import operator

    return {u.args[1]: u for u in node.users if u.target is operator.getitem}
