"""The engine that runs the table of ``passes/pipeline.py`` (:data:`ENGINE`, an :class:`Engine` of
its passes and detectors): what every pass gets from one place.

For every pass, whatever its unit (``record.py``): its switch (off: the reason is
:data:`~.record.DISABLED`, in one wording), its ``why_not`` and ``apply`` behind the error fence
(``guard.py``: a bug in a pass costs that pass, never the compile; raised under ``strict``), the
``excludes`` it declares, its counters (``counters["cp_inductor"][name]``), its log line and its
trace artifacts (``observe.py``), and its checked apply:

* region passes: every region's rewrites of a hook tried together on one copy of the graph and
  checked (``checked_rewrite.py``); if that fails, each tried alone and the failing ones undone
  and reported;
* call passes (packed sequences, on the Dynamo graph): what a call's apply inserted is erased if
  it raises, and the next pass is tried on that call;
* graph passes: what an apply inserted is erased if it raises; the graph is linted after it.

Two places in Inductor run the post-grad stage, both with the compile's config snapshot:
:meth:`Engine.analyze` on each graph AOTAutograd hands to Inductor, before any post-grad pass (the
report: regions, and per region what :meth:`Engine.decide` says of each rewrite; it runs on every
compile, also when the FX graph cache then serves the code), and :meth:`Engine.run_hook` inside
Inductor's post-grad passes, which applies. The graph is analysed once: the hook takes the
regions and decisions the analysis left on the graph (:class:`Analysis`) while the graph holds
the same nodes in the same order under the same config, and detects afresh only where something
changed it (Inductor's dead-code pass runs in between; tests call the two apart); a region
reached after an earlier rewrite changed the graph is decided again (:meth:`Engine._decider`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.fx
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.pattern_matcher import stable_topological_sort

from ..config_snapshot import ConfigSnapshot, snapshot
from ..reporting import BackwardRoute, Region, Rejected
from . import checked_rewrite
from .analysis import accumulators
from .analysis.graph_walk import node_order
from .detect import a2a, forward_seen, ring
from .dynamo import varlen_calls
from .editing.fx_emit import REPLACES, replaying_values
from .guard import internal_error, reason_or_error
from .observe import rewrite_observed, timed
from .pipeline import DETECTORS, PASSES
from .record import (CANONICAL, DISABLED, HOOKS, POST_GRAD, CallPass, GraphPass, InputsPass, Pass, RegionPass, Verdicts,
                     check_order, qualified_name)
PACKED_REASON = "packed (THD) region: this rewrite works on dense [B, S, H, D] attention"



def switch_reason(p: Pass, cfg: ConfigSnapshot) -> str | None:
    """:data:`DISABLED` if ``p``'s switch is off, else None."""
    return DISABLED if p.switched and cfg[p.name] in (False, "off") else None


def _excluded(p: RegionPass, verdicts: Verdicts) -> str | None:
    for other in p.excludes:
        if verdicts.applies(other):
            return f"{other} applies to this region (the two exclude each other)"
    return None


# --- what the engine does the same for every table --------------------------------------------
# graph passes


def _run_graph_pass(p: GraphPass, graph: torch.fx.Graph, cfg: ConfigSnapshot, where: str) -> int:
    """``p`` on the whole ``graph``: how many changes it made (0 where it did not run or failed)."""
    with timed(p.name, where) as outcome:
        reason = switch_reason(p, cfg) or reason_or_error(p.why_not, graph, cfg, cfg=cfg)
        if reason is not None:
            outcome["did"] = f"skipped: {reason}"
            return 0
        before = set(graph.nodes)
        try:
            changes = p.apply(graph, cfg) or 0
        except Exception as e:  # noqa: BLE001 - a bug in a pass costs the pass, not the compile
            for node in reversed([n for n in graph.nodes if n not in before]):
                if not node.users:
                    graph.erase_node(node)
            outcome["did"] = internal_error(e, cfg)
            return 0
        if changes:
            graph.lint()
            counters["cp_inductor"][p.name] += changes
        outcome["did"] = f"{changes} changes"
        return changes


# the Dynamo graph's packed-sequence calls


def _lower_own_calls(gm: torch.fx.GraphModule, p: CallPass, cfg: ConfigSnapshot) -> list:
    """The calls a call pass finds itself, each lowered by it or kept with the reason."""
    try:
        assert p.finds is not None  # run_dynamo_passes takes only the passes that find their own calls
        calls = p.finds(gm, cfg)
    except Exception as e:  # noqa: BLE001 - analysis must never fail the user's compile
        internal_error(e, cfg)
        return []
    for call in calls:
        _try_call(gm, p, call, cfg)
    return calls


def _try_call(gm: torch.fx.GraphModule, p: CallPass, call, cfg: ConfigSnapshot) -> bool:
    """``p`` on one call: applied (True), or the reason recorded on the call."""
    reason = switch_reason(p, cfg) or reason_or_error(p.why_not, call, cfg, cfg=cfg)
    if reason is None:
        with rewrite_observed(p.name, f"the Dynamo graph, {call.name}", gm.graph) as outcome:
            reason = _apply_or_undo(gm, p, call, cfg)
            outcome["kept"] = reason is None
            outcome["did"] = f"-> {call.path}" if reason is None else f"undone: {reason}"
    if reason is None:
        counters["cp_inductor"][p.name] += 1
        return True
    call.reasons[p.name] = reason
    return False


def _apply_or_undo(gm: torch.fx.GraphModule, p: CallPass, call, cfg) -> str | None:
    """Apply ``p`` to ``call``; where it raises before rewiring, erase what it inserted."""
    before = set(gm.graph.nodes)
    try:
        p.apply(gm, call)
        return None
    except Exception as e:  # noqa: BLE001 - see internal_error
        for node in reversed(list(gm.graph.nodes)):
            if node not in before and not node.users:
                gm.graph.erase_node(node)
        return internal_error(e, cfg)


# regions: the decision, the report


@dataclass
class Decision:
    """What the pipeline does to one region: rewrite names that apply, reasons for the rest."""

    applied: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)

    def to_run(self, hook: str, rewrites: tuple[RegionPass, ...]) -> list[RegionPass]:
        """The applied rewrites of ``rewrites`` that run on ``hook``, minus those another applied
        one performs."""
        chosen = [r for r in rewrites if r.name in self.applied]
        replaced = {name for r in chosen for name in r.replaces}
        return [r for r in chosen if r.stage == hook and r.name not in replaced]


def _op_name(node) -> str:
    return node.target.__name__.split(".")[0]


@dataclass
class Analysis:
    """One graph's regions and the decision on each, as :meth:`Engine.analyze` found them: the
    report shows them and the hook applies them while the graph is the one analysed."""

    cfg: ConfigSnapshot
    nodes: tuple  # the graph's nodes in order when analysed: reused only while they are the same
    matches: list
    decisions: dict  # (style, attention op's name) -> Decision: the trial's copy keeps the names

    def holds_for(self, graph: torch.fx.Graph, cfg: ConfigSnapshot) -> bool:
        return (self.cfg is cfg or self.cfg == cfg) and self.nodes == tuple(graph.nodes)


_ANALYSIS = "_cp_inductor_analysis"  # the graph's attribute that holds its Analysis


def take_analysis(graph: torch.fx.Graph) -> Analysis | None:
    """The analysis :meth:`Engine.analyze` left on ``graph``, taken off it (it holds nodes the
    passes may erase: nothing keeps it past the graph's compile)."""
    return graph.__dict__.pop(_ANALYSIS, None)


def _proved_alone(match, detector) -> str | None:
    """A backward region paired with no forward op (its forward graph not analysed, or the op
    called in an autograd.Function's backward, which AOTAutograd numbers apart) is proved from
    the backward alone; one paired with its forward is a region because its forward is one."""
    if match.direction != "backward" or forward_seen(match.attention, detector.__name__):
        return None
    return "backward region proved on its own (no forward op paired with it)"


def _reasons_into(reasons: dict, style: str):
    def log(node, reason):
        reasons.setdefault(node, {})[style] = reason

    return log


NO_COLLECTIVE = "no all_to_all or all_gather feeds q, k or v (attention on local data)"
P2P = (
    "K/V arrive by point-to-point send/recv (batch_isend_irecv, traced with "
    "TORCHDYNAMO_ENABLE_P2P_COMPILATION=1): ring detection follows all_to_all rotations only; "
    "reported, not rewritten"
)


def _why_no_region(by_style: dict, node) -> str:
    """One reason from each detector's: the ones that saw their collective, else what feeds it
    (point-to-point receives, or nothing: an op no all-gather feeds gets no reason from that
    detector)."""
    specific = [r for style, r in by_style.items() if not (style == a2a.STYLE and r == a2a.NO_ALL_TO_ALL)]
    if specific:
        return "; ".join(specific)
    return P2P if ring.received_point_to_point(node) else NO_COLLECTIVE


def _set_inductor_patches(rewrite: RegionPass) -> None:
    """The Inductor config ``rewrite`` needs, set once it is kept on a graph: Inductor reads it
    after the post-grad hooks (its scheduler), so a rewrite the trial undid sets nothing."""
    for key, value in rewrite.inductor_patches.items():
        setattr(inductor_config, key, value)


def _apply_tried(graph, match, rewrite, match_at, cfg, performs) -> bool:
    """``rewrite`` on ``match`` once the trial of every region passed: applied, counted."""
    rewrite.apply(graph, match, cfg)
    checked_rewrite.count(rewrite, performs)
    return True


_TRIED = checked_rewrite.Applier(_apply_tried)


MARKED_CACHEABLE = "unsafe_marked_cacheable_functions"  # Inductor's config: function name -> cache key


class Engine:
    """The passes of a table and the detectors of the CP styles, run: ``Engine(PASSES,
    DETECTORS)`` is the pipeline (:data:`ENGINE`); a test may build one of fewer passes."""

    def __init__(self, passes: tuple[Pass, ...], detectors: tuple) -> None:
        self.passes = passes
        self.detectors = detectors
        self.rewrites: tuple[RegionPass, ...] = tuple(p for p in passes if isinstance(p, RegionPass))  # decision order
        check_order(self.rewrites)

    # --- which hooks and patches a compile needs ----------------------------------------------

    def hooks_with_passes(self) -> tuple[str, ...]:
        """Inductor's hook keys the table has a pass on, in Inductor's order."""
        stages = {p.stage for p in self.passes}
        return tuple(h for h in HOOKS if h in stages)

    def hooks_with_work(self, gm: torch.fx.GraphModule, example_inputs, cfg: ConfigSnapshot) -> tuple[str, ...]:
        """The hook keys where a pass of the table is wanted for this program (``Pass.wanted``)."""
        return tuple(h for h in self.hooks_with_passes()
                     if any(p.wanted is None or p.wanted(gm, example_inputs, cfg) for p in self.passes if p.stage == h))

    def functorch_patches(self, hooks) -> dict:
        """The AOTAutograd config the passes on ``hooks`` need for the whole compile."""
        patches = {}
        for p in self.passes:
            if p.stage in hooks:
                patches.update(p.functorch_patches)
        return patches

    def cache_patches(self, gm: torch.fx.GraphModule, inductor_patches: dict) -> dict:
        """Inductor config that lets AOTAutograd's and Inductor's caches serve ``gm`` where our
        Dynamo passes put Python functions into it (their records' ``emits``): each such function
        in ``gm`` named cacheable (beside those the user's ``inductor_patches`` or config name),
        keyed by our sources and torch's version, so that a change to either is a new key.
        Without it a restarted job compiles again what it compiled before."""
        emitted = {name for p in self.passes for name in p.emits}
        found = {name for n in gm.graph.nodes
                 if n.op == "call_function" and (name := qualified_name(n.target)) in emitted}
        if not found or not hasattr(inductor_config, MARKED_CACHEABLE):
            return {}
        from .hook_pass import source_hash

        key = f"cp_inductor {source_hash()} torch {torch.__version__}"
        users = inductor_patches.get(MARKED_CACHEABLE, getattr(inductor_config, MARKED_CACHEABLE))
        return {MARKED_CACHEABLE: {**users, **dict.fromkeys(sorted(found), key)}}

    def _graph_passes(self, stage: str) -> tuple[GraphPass, ...]:
        return tuple(p for p in self.passes if p.stage == stage and isinstance(p, GraphPass))

    def run_input_passes(self, gm: torch.fx.GraphModule, example_inputs, cfg: ConfigSnapshot):
        """The passes that add graph inputs (``InputsPass``), first, unfenced: (the graph module to
        compile, the example inputs with theirs, ``supply(compiled) -> compiled`` handing them in)."""
        supplies = []
        for p in (p for p in self.passes if isinstance(p, InputsPass)):
            reason = switch_reason(p, cfg) or p.why_not(gm, cfg)
            if reason is None:
                with timed(p.name, "the Dynamo graph"):
                    gm, example_inputs, supply = p.apply(gm, example_inputs, cfg)
                supplies.append(supply)

        def supply_all(compiled):
            for supply in reversed(supplies):
                compiled = supply(compiled)
            return compiled

        return gm, example_inputs, supply_all

    def _call_passes(self) -> tuple[CallPass, ...]:
        return tuple(p for p in self.passes if isinstance(p, CallPass))

    # --- graphs: canonical forms, the Dynamo graph's calls --------------------------------------

    def canonicalize(self, graph: torch.fx.Graph, cfg: ConfigSnapshot) -> int:
        """The forms detection relies on (the table's CANONICAL passes); how many nodes changed."""
        return sum(_run_graph_pass(p, graph, cfg, "the graph detection reads") for p in self._graph_passes(CANONICAL))

    def run_dynamo_passes(self, gm: torch.fx.GraphModule, cfg: ConfigSnapshot) -> list:
        """The call passes on the graph Dynamo hands the backend: those that find their own calls
        (masked SDPA), then each packed call to the first that applies, else it stays with every
        reason; returns the report's lines."""
        found_per_pass = [_lower_own_calls(gm, p, cfg) for p in self._call_passes() if p.finds is not None]
        own = [c for found in found_per_pass for c in found]
        try:
            calls = varlen_calls.find(gm)
        except Exception as e:  # noqa: BLE001 - analysis must never fail the user's compile
            internal_error(e, cfg)
            calls = []
        programs_fa4 = varlen_calls.fa4_calls(gm)
        for call in calls:
            if not call.reasons:  # else kept on reading it (flash-attn's Function in a form we do not take)
                self._lower_call(gm, call, cfg)
        for call in calls:  # a call that stays needs none of the views reading it made
            for node in reversed(call.inserted if call.path == varlen_calls.KEPT else ()):
                if not node.users:
                    gm.graph.erase_node(node)
        if any(c.path != varlen_calls.KEPT for c in (*own, *calls)):
            gm.graph.lint()
            gm.recompile()
            gm.delete_all_unused_submodules()  # a lowered autograd.Function's bodies
        return programs_fa4 + [c.route() for c in (*own, *calls)]

    def _lower_call(self, gm: torch.fx.GraphModule, call, cfg: ConfigSnapshot) -> None:
        reason = reason_or_error(varlen_calls.shared_reason, call, cfg=cfg)
        if reason is not None:
            call.reasons["varlen"] = reason
            return
        for p in (p for p in self._call_passes() if p.finds is None):
            if _try_call(gm, p, call, cfg):
                return

    # --- regions: the decision, the report --------------------------------------------------

    def decide(self, match, cfg: ConfigSnapshot, only=None) -> Decision:
        """Per rewrite of ``match``'s style: applies, or why not. ``only``: decide just these names
        (the others are left out, not skipped)."""
        decision, verdicts = Decision(), Verdicts()
        needed = self._with_prerequisites(only)
        for rewrite in self.rewrites:
            if match.style not in rewrite.styles or (needed is not None and rewrite.name not in needed):
                continue
            reason = switch_reason(rewrite, cfg) or _excluded(rewrite, verdicts)
            if reason is None and match.layout == "thd" and not rewrite.packed:
                reason = PACKED_REASON
            if reason is None:
                reason = reason_or_error(rewrite.why_not, match, cfg, verdicts.seen_by(rewrite), cfg=cfg)
            verdicts.record(rewrite.name, reason)
            if only is not None and rewrite.name not in only:  # decided for the verdict a later one reads
                continue
            if reason is None:
                decision.applied.append(rewrite.name)
            else:
                decision.skipped[rewrite.name] = reason
        return decision

    def _with_prerequisites(self, only):
        """``only`` and the passes their records say are decided before them (``after``), whose
        verdicts they read; None for every pass."""
        if only is None:
            return None
        needed, by_name = set(only), {r.name: r for r in self.rewrites}
        stack = list(only)
        while stack:
            for name in getattr(by_name.get(stack.pop()), "after", ()):
                if name not in needed:
                    needed.add(name)
                    stack.append(name)
        return needed

    def _detector(self, match):
        return next(d for d in self.detectors if d.STYLE == match.style)

    def analyze(self, graph: torch.fx.Graph, graph_kind: str, rejected: list | None = None, cfg=None,
                canonical: bool = False) -> list[Region]:
        """The report rows of one graph: its CP regions and what the pipeline does to each.
        Attention ops that are not regions go to ``rejected`` with the reason. ``cfg``: the
        compile's snapshot (default: the global config as it is now). ``canonical``: the caller has
        put the graph in canonical form already (the backend does, to recompile what changed)."""
        cfg = cfg if cfg is not None else snapshot()
        if not cfg.detect:
            return []
        if not canonical:
            self.canonicalize(graph, cfg)

        order = node_order(graph)
        rows = []
        reasons: dict[torch.fx.Node, dict[str, str]] = {}  # attention node -> {style: why it is not that style's region}
        analysis = Analysis(cfg, tuple(graph.nodes), [], {})
        for detector in self.detectors:
            for match in detector.find(graph, graph_kind, cfg, log=_reasons_into(reasons, detector.STYLE)):
                decision = analysis.decisions[match.style, match.attention.name] = self.decide(match, cfg)
                analysis.matches.append(match)
                rows.append((order[match.attention], self._region_row(match, decision, detector, graph_kind, cfg)))
        setattr(graph, _ANALYSIS, analysis)
        matched = {i for i, _ in rows}
        if rejected is not None:
            for node in sorted(reasons, key=order.__getitem__):
                if order[node] not in matched:
                    rejected.append(Rejected(graph_kind, _op_name(node), _why_no_region(reasons[node], node)))
        return [row for _, row in sorted(rows, key=lambda r: r[0])]

    def _region_row(self, match, decision: Decision, detector, graph_kind: str, cfg) -> Region:
        detail = match.describe()
        for rewrite in self.rewrites:
            if rewrite.name in decision.applied and rewrite.detail is not None:
                detail += " " + rewrite.detail(match, cfg)
        route = self._backward_route(match.attention, cfg)
        if route is not None:
            detail += f" backward={route.path}"
        notes = [n for n in (accumulators.note(match), _proved_alone(match, detector)) if n]
        return Region(
            style=match.style, cp_size=match.cp, layout=match.layout, graph_kind=graph_kind,
            applied=decision.applied, skipped=decision.skipped, attention=_op_name(match.attention),
            detail=detail, notes=notes,
        )

    def _backward_route(self, node: torch.fx.Node, cfg):
        """Where a pass of the table sends this attention backward (``Pass.backward_route``), or None."""
        for p in self.passes:
            route = p.backward_route(node, cfg) if p.backward_route is not None else None
            if route is not None:
                return route
        return None

    def backward_routes(self, graph: torch.fx.Graph, graph_kind: str, cfg=None) -> list[BackwardRoute]:
        """Each attention backward of ``graph`` a pass routes, and the op it will run on (the
        report's lines; the pass decides by the same route)."""
        cfg = cfg if cfg is not None else snapshot()
        return [
            BackwardRoute(graph_kind, n.name, r.path, r.reason)
            for n in graph.nodes
            for r in (self._backward_route(n, cfg),) if r is not None
        ]

    def inductor_patch_keys(self) -> dict:
        """The Inductor config keys a rewrite may set, with their values now: the compile of a graph
        runs under a patch of them (``backend._inner_compile``), so that what a kept rewrite sets
        (:func:`_set_inductor_patches`) lasts for that graph's compile only."""
        return {key: getattr(inductor_config, key) for r in self.rewrites for key in r.inductor_patches}

    # --- Inductor's hooks -------------------------------------------------------------------

    def run_hook(self, hook: str, graph: torch.fx.Graph, cfg: ConfigSnapshot, only=None) -> None:
        """Everything the pipeline does on Inductor hook ``hook``: detect once, then per region (in
        graph order) decide and apply, then the hook's graph passes in table order. ``only``: just
        these rewrites, no graph passes (tests run one rewrite alone)."""
        if any(r.stage == hook for r in self.rewrites):
            self._rewrite_regions(hook, graph, cfg, only)
        if only is None:
            for p in self._graph_passes(hook):
                _run_graph_pass(p, graph, cfg, hook)

    def _rewrite_regions(self, hook: str, graph: torch.fx.Graph, cfg: ConfigSnapshot, only) -> None:
        analysis = take_analysis(graph)
        changed = self.canonicalize(graph, cfg)
        if changed or only is not None or analysis is None or not analysis.holds_for(graph, cfg):
            analysis = None
        with timed("detect", hook) as outcome:
            if analysis is not None:
                matches = [dataclasses.replace(m, graph_kind="post_grad") for m in analysis.matches]
                outcome["did"] = f"{len(matches)} regions (the report's analysis)"
            else:
                matches = [m for d in self.detectors for m in d.find(graph, "post_grad", cfg)]
                outcome["did"] = f"{len(matches)} regions"
        if not matches:
            return
        analysed = {} if analysis is None else analysis.decisions
        decide_once = self._decider(analysed, cfg, only)
        # Every region's rewrites are tried together on one copy of the graph, checked once; only if
        # that trial fails is each rewrite tried alone (and the failing ones undone). Trying and
        # checking per rewrite made our passes' time grow with the square of the layers.
        with timed("trial", hook) as outcome:
            trial = checked_rewrite.trial_all(
                graph, matches, self._detector, lambda g, ms, apply: self._each_region(g, ms, hook, cfg, decide_once, apply), cfg)
            outcome["did"] = "passed" if trial is not None else "failed: each rewrite tried alone"
        if trial is not None:
            with replaying_values(trial.values):  # the trial's steps again: its decisions hold
                self._each_region(graph, matches, hook, cfg, decide_once, _TRIED)
            if trial.sorted:
                stable_topological_sort(graph)  # in the order the trial's check sorted its copy into
        else:
            self._each_region(graph, matches, hook, cfg, self._decider(analysed, cfg, only), checked_rewrite.CHECKED)
        graph.eliminate_dead_code()
        graph.lint()

    def _decider(self, analysed: dict, cfg: ConfigSnapshot, only):
        """``decision_of(match, changed)``: a region reached while the graph is still the one
        analysed takes the analysis's decision (``analysed``: :attr:`Analysis.decisions`); one
        reached after an earlier rewrite changed the graph is decided on its match found again (its
        verdicts may read what that rewrite left), once for the trial and the apply that repeats
        the trial's steps."""
        decided: dict = {}

        def decision_of(match, changed: bool) -> Decision:
            key = (match.style, match.attention.name)
            if not changed and key in analysed:
                return analysed[key]
            if key not in decided:
                decided[key] = self.decide(match, cfg, only)
            return decided[key]

        return decision_of

    def _each_region(self, graph: torch.fx.Graph, matches: list, hook: str, cfg: ConfigSnapshot, decision_of,
                     apply: checked_rewrite.Applier) -> bool:
        """Per region of ``matches`` (in graph order), the rewrites ``decision_of(match, changed)`` chose for
        ``hook``, each through ``apply`` (:class:`checked_rewrite.Applier`); whether any was kept."""
        order = node_order(graph)
        changed = False
        for match in sorted(matches, key=lambda m: order[m.attention]):
            detector = self._detector(match)
            if match.attention._erased:
                continue
            if changed:
                # An earlier rewrite may have replaced nodes this region was found through (two
                # layers back to back share the first one's returned output): find it again.
                match = detector.match_at(match.attention, "post_grad", cfg)
                if match is None:
                    continue
            changed |= self._rewrite_region(graph, match, detector, hook, cfg, decision_of(match, changed), apply)
        return changed

    def _rewrite_region(self, graph: torch.fx.Graph, match, detector, hook: str, cfg, decision: Decision,
                        apply: checked_rewrite.Applier) -> bool:
        """Apply what ``decision`` chose for ``match`` on ``hook`` through ``apply``; whether any
        was kept."""
        kept = False
        for rewrite in decision.to_run(hook, self.rewrites):
            performs = [name for name in rewrite.replaces if name in decision.applied]
            if apply.on_copy:
                kept_now = apply.run(graph, match, rewrite, detector.match_at, cfg, performs)
            else:
                where = f"{hook}, {match.style} {match.direction} {match.attention.name}"
                with rewrite_observed(rewrite.name, where, graph) as outcome:
                    kept_now = outcome["kept"] = apply.run(graph, match, rewrite, detector.match_at, cfg, performs)
            if not kept_now:
                continue
            if not apply.on_copy:
                _set_inductor_patches(rewrite)
            kept = True
            attention = match.attention
            if attention._erased:  # split into several calls: the region is found again by the first
                attention = next((n for n in graph.nodes if n.meta.get(REPLACES) == attention.name), None)
            match = None if attention is None else detector.match_at(attention, "post_grad", cfg)
            if match is None:
                break
        return kept

    def rewrite_graph(self, graph: torch.fx.Graph, cfg=None, only=None) -> None:
        """The post-grad stage on ``graph`` outside a compile (tests; default config: the global
        one as it is now)."""
        self.run_hook(POST_GRAD, graph, cfg if cfg is not None else snapshot(), only)


ENGINE = Engine(PASSES, DETECTORS)
# What the backend and the tests call, the pipeline's engine's own.
hooks_with_passes = ENGINE.hooks_with_passes
hooks_with_work = ENGINE.hooks_with_work
functorch_patches = ENGINE.functorch_patches
cache_patches = ENGINE.cache_patches
canonicalize = ENGINE.canonicalize
run_dynamo_passes = ENGINE.run_dynamo_passes
run_input_passes = ENGINE.run_input_passes
decide = ENGINE.decide
analyze = ENGINE.analyze
backward_routes = ENGINE.backward_routes
inductor_patch_keys = ENGINE.inductor_patch_keys
rewrite_graph = ENGINE.rewrite_graph


def run_hook(hook: str, graph: torch.fx.Graph, cfg: ConfigSnapshot, only=None) -> None:
    """:meth:`Engine.run_hook` of the pipeline's engine; a function, not a bound method: our hook
    pass holds it in Inductor's config, which Inductor deep-copies (an engine holds modules)."""
    ENGINE.run_hook(hook, graph, cfg, only)


__all__ = ["ENGINE", "HOOKS", "Engine", "analyze", "backward_routes", "cache_patches", "canonicalize", "decide", "functorch_patches",
           "hooks_with_passes", "hooks_with_work", "inductor_patch_keys", "rewrite_graph", "run_dynamo_passes",
           "run_hook", "run_input_passes"]
