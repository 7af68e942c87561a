"""The loop every Ulysses rewrite pass runs, and the check that keeps a buggy rewrite from ever
costing the user's compile.

Per region, in graph order: detect it afresh on the graph as it is now (an earlier rewrite may
have replaced nodes a neighbouring region was found through: two layers back to back share the
first one's returned output), try the rewrite on a copy of the graph, and check the copy: every
tensor that leaves the region keeps its shape, dtype and (where promised) strides, the graph
still sorts topologically (no cycle) and lints. Only a rewrite that passes is applied to the
real graph; one that fails leaves the graph as it was and says why in the report (strict mode
raises instead).
"""

from __future__ import annotations

import torch
import torch.fx
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import stable_topological_sort

from .. import config
from ..reporting import RewriteUndone, record_undone
from .detect_a2a import find_regions, region_at
from .guard import why_not


class RewriteCheckError(Exception):
    """A rewrite produced a graph that does not keep what leaves the region."""


def _copy(graph: torch.fx.Graph) -> tuple[torch.fx.Graph, dict]:
    copy, val_map = torch.fx.Graph(), {}
    copy.output(copy.graph_copy(graph, val_map))
    return copy, val_map


def _same_tensor(old, new, strides: bool) -> str | None:
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
        return None if type(old) is type(new) else f"{type(old).__name__} became {type(new).__name__}"
    if old.shape != new.shape or old.dtype != new.dtype:
        return f"{tuple(old.shape)} {old.dtype} became {tuple(new.shape)} {new.dtype}"
    if strides:
        significant = [i for i, n in enumerate(old.shape) if n > 1]
        if [old.stride(i) for i in significant] != [new.stride(i) for i in significant]:
            return f"strides {old.stride()} became {new.stride()}"
    return None


def check(graph: torch.fx.Graph, replaced: list) -> None:
    """Raise :class:`RewriteCheckError` unless the rewritten ``graph`` is sound.

    ``replaced``: ``(old value, new node, strides kept?)`` for each tensor the rewrite handed to
    the rest of the graph in place of an old one."""
    for old, new, strides in replaced:
        if (why := _same_tensor(old, new.meta.get("val"), strides)) is not None:
            raise RewriteCheckError(f"{new.name}: {why}")
    try:
        stable_topological_sort(graph)
    except AssertionError as e:
        raise RewriteCheckError("the rewritten graph has a cycle") from e
    graph.lint()


def rewrite_regions(graph: torch.fx.Graph, ineligible, rewrite, counted: tuple[str, ...]) -> None:
    """``rewrite(graph, region) -> replaced`` for every region ``ineligible(region)`` clears;
    each region that is kept counts once under every name in ``counted``
    (``counters["cp_inductor"]``)."""
    changed = False
    for attention in [r.attention for r in find_regions(graph, "post_grad")]:
        if getattr(attention, "_erased", False):
            continue
        region = region_at(attention, "post_grad")
        if region is None or why_not(ineligible, region) is not None:
            continue
        try:
            trial, val_map = _copy(graph)
            check(trial, rewrite(trial, region_at(val_map[attention], "post_grad")))
        except Exception as e:  # noqa: BLE001 - a bug in a rewrite costs the rewrite only
            if config.strict:
                raise
            record_undone(RewriteUndone(counted[0], attention.name, f"{type(e).__name__}: {e}"))
            counters["cp_inductor"][f"{counted[0]}_undone"] += 1
            continue
        rewrite(graph, region)
        stable_topological_sort(graph)  # the next region's trial copies the graph in order
        for name in counted:
            counters["cp_inductor"][name] += 1
        changed = True
    if changed:
        graph.eliminate_dead_code()
        graph.lint()
