"""The loop every Ulysses rewrite pass runs: find the regions of a post-grad graph, rewrite the
ones the rewrite's eligibility check clears, count them, and leave the graph tidy."""

from __future__ import annotations

import torch.fx
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import stable_topological_sort

from .detect_a2a import find_regions
from .guard import why_not


def rewrite_regions(graph: torch.fx.Graph, ineligible, rewrite, counted: tuple[str, ...]) -> None:
    """``rewrite(graph, region)`` for every region ``ineligible(region)`` clears; each rewritten
    region counts once under every name in ``counted`` (``counters["cp_inductor"]``)."""
    changed = False
    for region in find_regions(graph, "post_grad"):
        if why_not(ineligible, region) is not None:
            continue
        rewrite(graph, region)
        for name in counted:
            counters["cp_inductor"][name] += 1
        changed = True
    if changed:
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
        graph.lint()
