"""Inserting ATen nodes into a post-grad graph with the fake-tensor metadata Inductor reads."""

from __future__ import annotations

import torch
import torch.fx
from torch._guards import detect_fake_mode

from .layout_algebra import Relayout

aten = torch.ops.aten

# meta key on the ops a rewrite put in place of an attention op: the old op's name (the pipeline
# finds the region again through the first of them for the rewrites that follow).
REPLACES = "cp_inductor_replaces"


def _fake_mode(graph: torch.fx.Graph, anchor: torch.fx.Node):
    """The graph's fake mode, read from the anchor's neighbourhood (every value of one graph shares
    it); the whole graph only where none is there: reading every value per rewrite made the
    passes' time grow with the square of the layers."""
    near = [anchor, *anchor.all_input_nodes, *anchor.users]
    for nodes in (near, graph.nodes):
        vals = [n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        if vals:
            return detect_fake_mode(vals)
    return None


class Emitter:
    """Creates nodes before ``anchor`` (in call order) and fills ``meta["val"]``."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node):
        self.graph = graph
        self.anchor = anchor
        self.fake_mode = _fake_mode(graph, anchor)
        # (old value, new node, strides kept?) per tensor handed on in place of an old one: what
        # checked_rewrite.check compares.
        self.replaced: list = []
        self.created: list = []  # every node made, in order

    def replace(self, old: torch.fx.Node, new: torch.fx.Node, strides: bool = True, **kwargs) -> None:
        """``old.replace_all_uses_with(new)``, recorded for the check. ``strides=False`` where the
        new tensor is meant to have other strides (attention reading a view)."""
        self.replaced.append((old.meta.get("val"), new, strides))
        old.replace_all_uses_with(new, **kwargs)

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        self.created.append(node)
        return node

    def relayout(self, x: torch.fx.Node, plan: Relayout) -> torch.fx.Node:
        shape = tuple(x.meta["val"].shape)
        if plan.split != shape:
            x = self(aten.reshape.default, x, list(plan.split))
        if plan.perm != tuple(range(len(plan.perm))):
            x = self(aten.permute.default, x, list(plan.perm))
        if plan.shape != tuple(x.meta["val"].shape):
            x = self(aten.reshape.default, x, list(plan.shape))
        return x


def stride_order(t: torch.Tensor) -> list:
    """Dims from outermost to innermost in memory (ties keep the logical order)."""
    return sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))

