"""The check that keeps a buggy rewrite from ever costing the user's compile.

Every region rewrite of a hook is first tried on one copy of the graph (:func:`trial_all`: the
matches found again there), and the copy is checked: every tensor that leaves a region keeps its
shape, dtype and (where promised) strides, the graph still sorts topologically (no cycle) and
lints. Only then are the rewrites applied to the real graph, the fake-tensor values the trial
computed replayed. If the trial fails, each rewrite is tried alone (:func:`apply_checked`): one
that fails leaves the graph as it was and says why in the report (strict mode raises instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import stable_topological_sort

from ..reporting import RewriteUndone, record_undone
from .editing.fx_emit import recording_values, replaying_values


class RewriteCheckError(Exception):
    """A rewrite produced a graph that does not keep what leaves the region."""


def _copy(graph: torch.fx.Graph) -> tuple[torch.fx.Graph, dict]:
    copy = torch.fx.Graph()
    val_map: dict[torch.fx.Node, torch.fx.Node] = {}
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


def check(graph: torch.fx.Graph, replaced: list) -> bool:
    """Raise :class:`RewriteCheckError` unless the rewritten ``graph`` is sound; returns whether
    it had to be sorted topologically (nodes emitted after a reader of theirs).

    ``replaced``: ``(old value, new node, strides kept?)`` for each tensor the rewrite handed to
    the rest of the graph in place of an old one."""
    for old, new, strides in replaced:
        if (why := _same_tensor(old, new.meta.get("val"), strides)) is not None:
            raise RewriteCheckError(f"{new.name}: {why}")
    try:
        graph.lint()  # also: every argument defined before its use, i.e. in topological order
        return False
    except RuntimeError:
        pass
    try:
        stable_topological_sort(graph)
    except AssertionError as e:
        raise RewriteCheckError("the rewritten graph has a cycle") from e
    graph.lint()
    return True


def apply_checked(graph: torch.fx.Graph, match, rewrite, match_at, cfg, performs=()) -> bool:
    """Apply ``rewrite`` (a region :class:`~cp_inductor.passes.record.Pass`) to ``match`` if its
    trial on a copy of ``graph`` passes :func:`check`; ``match_at(node, graph_kind, cfg)`` finds
    the match again on the copy. Counts the kept rewrite (and ``performs``: the rewrites it
    replaces that also apply to this match) in ``counters["cp_inductor"]``; returns whether it
    was kept."""
    attention = match.attention
    try:
        trial, val_map = _copy(graph)
        with recording_values() as values:
            replaced = rewrite.apply(trial, match_at(val_map[attention], match.graph_kind, cfg), cfg)
        sorted_trial = check(trial, replaced)
    except Exception as e:  # noqa: BLE001 - a bug in a rewrite costs the rewrite only
        if cfg.strict:
            raise
        record_undone(RewriteUndone(rewrite.name, attention.name, f"{type(e).__name__}: {e}"))
        counters["cp_inductor"][f"{rewrite.name}_undone"] += 1
        return False
    with replaying_values(values):
        rewrite.apply(graph, match, cfg)
    if sorted_trial:
        stable_topological_sort(graph)  # in the order the trial's check sorted its copy into
    count(rewrite, performs)
    return True


def count(rewrite, performs=()) -> None:
    """A kept ``rewrite`` (and the rewrites it performs) in ``counters["cp_inductor"]``."""
    for name in (rewrite.name, *performs):
        counters["cp_inductor"][name] += 1


@dataclass(frozen=True)
class Applier:
    """How the engine applies a region's rewrite: ``run(graph, match, rewrite, match_at, cfg,
    performs) -> kept?``, and whether the graph is the trial's copy (nothing there is shown,
    logged, counted or configured: the real graph's turn does that)."""

    run: Callable[..., bool]
    on_copy: bool = False


@dataclass
class Trial:
    """Every region's rewrites tried together on one copy, checked: the values the emitters
    computed there (replayed on the graph) and whether the copy had to be sorted."""

    values: list
    sorted: bool


def apply_unchecked(graph, match, rewrite, match_at, cfg, performs) -> bool:
    """On the trial copy: ``rewrite`` applied, the tensors it hands on compared with the old."""
    for old, new, strides in rewrite.apply(graph, match, cfg):
        if (why := _same_tensor(old, new.meta.get("val"), strides)) is not None:
            raise RewriteCheckError(f"{rewrite.name}: {new.name}: {why}")
    return True


ON_COPY = Applier(apply_unchecked, on_copy=True)
CHECKED = Applier(apply_checked)  # each rewrite alone, undone where its check fails


def trial_all(graph: torch.fx.Graph, matches: list, detector_of, each_region, cfg) -> Trial | None:
    """``each_region(copy, matches on the copy, ON_COPY)`` on one copy of ``graph``, then
    :func:`check`; None if anything raised or the check failed (the caller then tries each
    rewrite alone, which finds and reports the culprit). ``detector_of(match)``: the detector
    that finds ``match`` again on the copy."""
    try:
        trial, val_map = _copy(graph)
        found = [detector_of(m).match_at(val_map[m.attention], m.graph_kind, cfg) for m in matches]
        if any(m is None for m in found):
            return None  # a region the copy does not show would go unchecked on the graph
        with recording_values() as values:
            each_region(trial, found, ON_COPY)
        return Trial(values, check(trial, []))
    except Exception:  # noqa: BLE001 - the rewrites are then tried one by one
        return None
