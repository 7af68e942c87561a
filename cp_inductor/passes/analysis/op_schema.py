"""A call's op by its schema name, its arguments by the schema's names, and what an argument
holds: how passes read ops whose argument lists differ between releases (torch's varlen_attn,
flash-attn's ops)."""

from __future__ import annotations

import torch
import torch.fx


def qualname(target) -> str | None:
    """"namespace::name" of an op or op packet (not every packet has a default overload)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else None


def bind(node: torch.fx.Node) -> dict:
    """The call's arguments by the op's schema names, defaults filled in."""
    target = node.target if isinstance(node.target, torch._ops.OpOverload) else node.target.default
    arguments = target._schema.arguments
    bound = {a.name: a.default_value for a in arguments if a.has_default_value()}
    bound.update(zip((a.name for a in arguments), node.args))
    bound.update(node.kwargs)
    return bound


def value(x):
    """A node's example value (Dynamo's graph) or value (AOT's), or the constant itself."""
    return x.meta.get("example_value", x.meta.get("val")) if isinstance(x, torch.fx.Node) else x
