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


class Walk:
    """The nodes reached from ``starts``, each once, depth first: iterating yields a node, then
    goes on to what ``expand(node)`` returns (an empty result ends that branch; entries that are
    not nodes, such as constant arguments, are skipped). It stops after ``limit`` nodes (``float("inf")``:
    never); ``complete`` then says False. Every walk of the passes is one of these."""

    def __init__(self, starts: Iterable, expand: Callable[[torch.fx.Node], Iterable], limit: float = MAX_NODES):
        self._stack, self._expand, self._limit = list(starts), expand, limit
        self.seen: set = set()
        self.complete = True

    def __iter__(self):
        stack, seen = self._stack, self.seen
        while stack:
            n = stack.pop()
            if not isinstance(n, torch.fx.Node) or n in seen:
                continue
            if len(seen) >= self._limit:
                self.complete = False
                return
            seen.add(n)
            yield n
            stack.extend(self._expand(n))

    def run(self) -> "Walk":
        """Walk to the end (for walks whose ``expand`` collects what they look for)."""
        for _ in self:
            pass
        return self


def inputs(n: torch.fx.Node):
    return n.all_input_nodes


def users(n: torch.fx.Node):
    return n.users


def ancestors(nodes: Iterable[torch.fx.Node]) -> set:
    """Every node ``nodes`` depend on (not the nodes themselves)."""
    return set(Walk((i for n in nodes for i in n.all_input_nodes), inputs, limit=float("inf")))


def descendants(nodes: Iterable[torch.fx.Node]) -> set:
    """Every node that depends on ``nodes`` (not the nodes themselves)."""
    return set(Walk((u for n in nodes for u in n.users), users, limit=float("inf")))


def moved_from(node, through: Callable[[torch.fx.Node], bool], also=(), max_depth: int = MAX_NODES // 2) -> tuple[set, bool]:
    """What ``node`` is a relabelling, piece, cast or concatenation of: (the first nodes going up
    through ``cat`` and the ops ``through`` accepts or ``also`` names (first argument) that are
    none of those, whether the walk ended within ``max_depth`` nodes)."""
    ends = set()

    def expand(n):
        if n.op == "call_function" and n.target is aten.cat.default:
            return n.args[0]
        if through(n) or (n.op == "call_function" and n.target in also):
            return [n.args[0]]
        ends.add(n)
        return ()

    return ends, Walk([node], expand, max_depth).run().complete


def reached_below(starts, is_target, passes, max_depth: int = MAX_NODES) -> set:
    """The ops ``is_target`` accepts that are reached going down from ``starts`` through users
    ``passes`` accepts (a target is not walked past)."""
    found = set()

    def expand(n):
        found.update(u for u in n.users if is_target(u))
        return [u for u in n.users if not is_target(u) and passes(u)]

    Walk(starts, expand, max_depth).run()
    return found
