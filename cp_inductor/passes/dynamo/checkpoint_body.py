"""Activation-checkpointed regions as Dynamo hands them over: ``torch.utils.checkpoint(...,
use_reentrant=False)`` (HF's gradient checkpointing) becomes ``tag_activation_checkpoint(body,
*args)`` with ``body`` a graph attribute whose inputs are ``args`` one to one. The passes that
rewrite attention inside one read the outer graph's values through it and hand the body new
ones::

    tag_activation_checkpoint(body, q, k, v, mask)          # body: (q, k, v, mask) -> sdpa(q, k, v, mask)
    ->
    tag_activation_checkpoint(body, q, k, v, plan, ...)     # body: (q, k, v, plan, ...) -> ours(q, k, v, plan, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

CHECKPOINT = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)


def regions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The checkpointed calls of ``gm`` whose body is one of its graph attributes."""
    return [n for n in gm.graph.nodes if CHECKPOINT is not None and n.op == "call_function" and n.target is CHECKPOINT
            and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr"]


@dataclass
class CheckpointBody:
    """One checkpointed call of the outer graph (``hop``), its body, and the outer values handed
    to the body as new inputs."""

    hop: torch.fx.Node
    gm: torch.fx.GraphModule
    inputs: dict = field(default_factory=dict)  # outer node -> the body's placeholder for it

    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def outer(self, node):
        """The outer graph's argument an input of the body receives (anything else as it is)."""
        if not isinstance(node, torch.fx.Node) or node.op != "placeholder" or node.graph is not self.gm.graph:
            return node
        return self.hop.args[1 + self.placeholders().index(node)]

    def input_for(self, outer: torch.fx.Node | None, name: str | None = None):
        """``outer`` (a node of the outer graph) as an input of the body: a new placeholder, and
        the checkpoint call's new last argument, once (None stays None)."""
        if outer is None:
            return None
        if outer not in self.inputs:
            with self.gm.graph.inserting_after(self.placeholders()[-1]):
                inner = self.gm.graph.placeholder(name or f"cp_{outer.name}")
            if "example_value" in outer.meta:
                inner.meta["example_value"] = outer.meta["example_value"]
            self.hop.args = (*self.hop.args, outer)
            self.inputs[outer] = inner
        return self.inputs[outer]

    def drop_unread(self, placeholder) -> torch.fx.Node | None:
        """An input of the body nothing reads any more, out of the body and the call; the outer
        node it received (None where there is nothing to drop)."""
        if not isinstance(placeholder, torch.fx.Node) or placeholder.op != "placeholder" or placeholder.users \
                or placeholder.graph is not self.gm.graph:
            return None
        index = self.placeholders().index(placeholder)
        outer = self.hop.args[1 + index]
        self.hop.args = self.hop.args[: 1 + index] + self.hop.args[2 + index:]
        self.gm.graph.erase_node(placeholder)
        return outer
