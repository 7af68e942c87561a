"""Walking an FX graph: the node order, the reach of a node up or down, and the bounded walks the
detectors and rewrites use to see what a value is made of or where it goes.

Every walk that can run into a whole model stops after ``MAX_NODES`` nodes and says so: a
region is found within a few dozen nodes of its attention op, and a walk that goes further
is walking the model, not the region.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.fx

aten = torch.ops.aten
MAX_NODES = 512


def node_order(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each node's position in ``graph``."""
    return {n: i for i, n in enumerate(graph.nodes)}


def _reach(nodes: Iterable[torch.fx.Node], edges: Callable) -> set:
    found, stack = set(), list(nodes)
    while stack:
        for n in edges(stack.pop()):
            if n not in found:
                found.add(n)
                stack.append(n)
    return found


def ancestors(nodes: Iterable[torch.fx.Node]) -> set:
    """Every node ``nodes`` depend on (not the nodes themselves)."""
    return _reach(nodes, lambda n: n.all_input_nodes)


def descendants(nodes: Iterable[torch.fx.Node]) -> set:
    """Every node that depends on ``nodes`` (not the nodes themselves)."""
    return _reach(nodes, lambda n: n.users)


def moved_from(node, through: Callable[[torch.fx.Node], bool], also=(), max_depth: int = MAX_NODES // 2) -> tuple[set, bool]:
    """What ``node`` is a relabelling, piece, cast or concatenation of: (the first nodes going up
    through ``cat`` and the ops ``through`` accepts or ``also`` names (first argument) that are
    none of those, whether the walk ended within ``max_depth`` nodes)."""
    ends, seen, stack = set(), set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > max_depth:
            return ends, False
        if n.op == "call_function" and n.target is aten.cat.default:
            stack.extend(x for x in n.args[0] if isinstance(x, torch.fx.Node))
        elif through(n) or (n.op == "call_function" and n.target in also):
            stack.append(n.args[0])
        else:
            ends.add(n)
    return ends, True


def reached_below(starts, is_target, passes, max_depth: int) -> set:
    """The ops ``is_target`` accepts that are reached going down from ``starts`` through users
    ``passes`` accepts (a target is not walked past)."""
    found, seen, stack = set(), set(), list(starts)
    while stack:
        n = stack.pop()
        if n in seen or len(seen) > max_depth:
            continue
        seen.add(n)
        for user in n.users:
            if is_target(user):
                found.add(user)
            elif passes(user):
                stack.append(user)
    return found
