"""Reordering an FX graph without changing what it computes.

Inductor emits extern kernels (attention, collectives) in the order of the post-grad graph
(with ``reorder_for_peak_memory`` off), so a rewrite that wants a kernel to run while a transfer
travels moves the node. :func:`resort` does it as a topological sort of the graph's tail by
priority: a node never moves ahead of its inputs, whatever the priorities say.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch.fx

from ..analysis.graph_walk import node_order


def resort(graph: torch.fx.Graph, start: torch.fx.Node, priority: Callable[[torch.fx.Node], int]) -> bool:
    """Reorder the nodes from ``start`` up to the output: whenever several are ready (their
    inputs placed), the lowest ``priority``, then the earliest in the old order, goes next.
    Returns whether anything moved."""
    order = node_order(graph)
    tail = [n for n in graph.nodes if order[n] >= order[start] and n.op != "output"]
    members = set(tail)
    waiting = {n: sum(1 for a in set(n.all_input_nodes) if a in members) for n in tail}
    ready = [(priority(n), order[n], n) for n in tail if waiting[n] == 0]
    heapq.heapify(ready)
    placed = []
    while ready:
        _, _, n = heapq.heappop(ready)
        placed.append(n)
        for u in n.users:
            if u in members:
                waiting[u] -= 1
                if waiting[u] == 0:
                    heapq.heappush(ready, (priority(u), order[u], u))
    assert len(placed) == len(tail), "graph tail is not acyclic"
    if placed == tail:
        return False
    anchor = start.prev
    for n in placed:
        anchor.append(n)
        anchor = n
    return True
