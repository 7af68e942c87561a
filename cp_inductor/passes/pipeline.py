"""Every cp_inductor pass, in the order it runs: the one place to read the pipeline.

    canonicalize  forms the detectors rely on, made first (in-place collectives' copies)
    DETECTORS     one module per CP style; each finds its regions and returns match records
    REWRITES      the rewrites in decision order; each record says which styles it concerns,
                  why it cannot apply, how it applies, on which Inductor hook, and which
                  rewrites it reads the verdict of, performs or steps aside for (checked here)
    GRAPH_PASSES  whole-graph passes that always run on a hook after the rewrites
    VARLEN_LOWERINGS  packed-sequence attention lowerings, on the graph Dynamo hands the
                  backend, before AOTAutograd (the ops they put in bring their own autograd)

Two places in Inductor run this code, both with the compile's config snapshot:

* :func:`analyze` on each graph AOTAutograd hands to Inductor (forward, backward or inference),
  before any post-grad pass: it detects the regions and :func:`decide`\\ s each, which is what
  the report shows. It runs on every compile, also when the FX graph cache then serves the code.
* :func:`run_hook` inside Inductor's post-grad passes (one ``CPGraphPass`` per hook key): it
  detects once, and per region decides and applies the rewrites that run on that hook, each
  checked on a copy of the graph first (``checked_rewrite``). Report and rewrite agree because
  both ask :func:`decide`.

Adding a CP style: a detector module in ``detect/`` and one line in DETECTORS. Adding a rewrite:
a module in ``rewrites/`` defining a ``Rewrite`` record, and one line in REWRITES.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import stable_topological_sort

from ..config_snapshot import ConfigSnapshot, snapshot
from ..reporting import BackwardRoute, Region, Rejected
from .analysis import accumulators, varlen_calls
from .analysis.fx_emit import REPLACES, replaying_values
from .analysis.graph_walk import node_order
from . import checked_rewrite
from .checked_rewrite import apply_checked
from .detect import a2a, allgather, forward_seen, ring
from .guard import internal_error, reason_or_error
from .observe import rewrite_observed, timed
from .rewrites import (
    POST_GRAD,
    Rewrite,
    Verdicts,
    ce_rotation,
    check_order,
    fused_a2a,
    gather_overlap,
    head_overlap,
    head_split,
    narrow_rotation,
    owner_grad_return,
    ring_grad_return,
)
from .whole_graph import (
    canonicalize,
    cat_of_slices,
    collective_cse,
    cudnn_frontend_backward,
    fa4_dense,
    uniform_thd,
    varlen_cudnn,
)

DETECTORS = (a2a, allgather, ring)  # Ulysses, K/V all-gather, ring (K/V rotated)

# Decision order: a rewrite's why_not sees the verdicts of those before it on the same region
# (head_overlap builds on fused_a2a's buffers). The report lists each region's rewrites in
# this order.
REWRITES: tuple[Rewrite, ...] = (
    fused_a2a.REWRITE,
    head_overlap.REWRITE,
    head_split.REWRITE,
    gather_overlap.REWRITE,  # before owner_grad_return: it gives the pulls attention to hide under
    owner_grad_return.REWRITE,
    ring_grad_return.REWRITE,  # before narrow_rotation and ce_rotation: they see its rotation
    narrow_rotation.REWRITE,  # before ce_rotation: it moves the narrowed rotation
    ce_rotation.REWRITE,
)
check_order(REWRITES)

JOINT = "joint_custom_pre_pass"  # the joint forward+backward graph, before the partitioner


def _ring_joint_graph(graph: torch.fx.Graph, cfg: ConfigSnapshot) -> None:
    if cfg.ring_cse == "aot" or not any(ring.rotation(n) is not None for n in graph.nodes):
        return  # graphs compiled with AOTAutograd's CSE (the backend's choice): left to it
    if cfg.ring_cse == "collective":
        collective_cse.merge_repeated(graph)
    collective_cse.pin_collectives(graph)


def _fenced(graph_pass):
    """``graph_pass(graph, cfg)`` whose bug leaves aten's ops in place, never fails the compile
    (raised under ``strict``)."""
    def run(graph: torch.fx.Graph, cfg: ConfigSnapshot) -> None:
        try:
            graph_pass(graph, cfg)
        except Exception:  # noqa: BLE001 - see the docstring
            if cfg.strict:
                raise

    run.__name__ = f"_{graph_pass.__name__.removesuffix('_pass')}"
    return run


_cudnn_frontend_backward = _fenced(cudnn_frontend_backward.cudnn_frontend_backward_pass)
_fa4_dense = _fenced(fa4_dense.fa4_dense_pass)


def _cat_of_slices(graph: torch.fx.Graph, cfg: ConfigSnapshot) -> None:
    if not cfg.cat_of_slices:
        return
    try:
        removed = cat_of_slices.cat_of_slices_pass(graph)
    except Exception:  # noqa: BLE001 - a bug here must cost the pass, not the compile
        if cfg.strict:
            raise
        return
    if removed:
        counters["cp_inductor"][cat_of_slices.NAME] += removed


def _rewrap_rng(graph: torch.fx.Graph, cfg: ConfigSnapshot) -> None:
    canonicalize.rewrap_rng_attention(graph)


# Whole-graph passes, ``graph_pass(graph, cfg)``: the joint graph of a ring program (compiled without
# AOTAutograd's CSE) gets the merges every rank makes alike and its collectives pinned to their
# graph; a cat that reassembles slices of one tensor is that tensor; cuDNN's attention backward
# runs where its plan cache keys on dO's layout (after the rewrites: it sees the calls they
# made); a CUDA generator input canonicalize unwrapped is read by one RNG wrapper again, as
# Inductor needs.
GRAPH_PASSES = {JOINT: (_ring_joint_graph,), "joint_custom_post_pass": (_fa4_dense,), POST_GRAD: (_cat_of_slices, _cudnn_frontend_backward, _rewrap_rng)}

HOOKS = (JOINT, "joint_custom_post_pass", POST_GRAD, "post_grad_custom_post_pass")

# Packed-sequence (THD) attention, lowered before AOTAutograd traces the program (the ops they
# put in bring their own autograd formulas): each call goes to the first of these whose why_not
# is None, or stays with every reason in the report. Equal lengths to dense SDPA, then any
# lengths to cuDNN's ragged SDPA.
VARLEN_LOWERINGS = (uniform_thd, varlen_cudnn)


def run_dynamo_passes(gm: torch.fx.GraphModule, cfg: ConfigSnapshot) -> list:
    """The whole-graph passes on the graph Dynamo hands the backend; returns the report's lines. Our errors keep the program's ops (and
    raise under ``strict``)."""
    try:
        calls = varlen_calls.find(gm)
    except Exception as e:  # noqa: BLE001 - analysis must never fail the user's compile
        internal_error(e, cfg)
        return []
    programs_fa4 = varlen_calls.fa4_calls(gm)
    for call in calls:
        if call.reasons:  # kept on reading it (flash-attn's Function in a form we do not take)
            continue
        reason = reason_or_error(varlen_calls.shared_reason, call, cfg=cfg)
        if reason is not None:
            call.reasons["varlen"] = reason
            continue
        for lowering in VARLEN_LOWERINGS:
            reason = reason_or_error(lowering.why_not, call, cfg, cfg=cfg)
            if reason is None:
                with rewrite_observed(lowering.NAME, f"the Dynamo graph, {call.name}", gm.graph) as outcome:
                    reason = _apply_or_undo(gm, lowering, call, cfg)
                    outcome["kept"] = reason is None
                    outcome["did"] = f"-> {call.path}" if reason is None else f"undone: {reason}"
            if reason is None:
                break
            call.reasons[lowering.NAME] = reason
    for call in calls:  # a call that stays needs none of the views reading it made
        for node in reversed(call.inserted if call.path == varlen_calls.KEPT else ()):
            if not node.users:
                gm.graph.erase_node(node)
    if any(c.path != varlen_calls.KEPT for c in calls):
        gm.graph.lint()
        gm.recompile()
        gm.delete_all_unused_submodules()  # a lowered autograd.Function's bodies
    return programs_fa4 + [c.route() for c in calls]


def _apply_or_undo(gm: torch.fx.GraphModule, lowering, call, cfg) -> str | None:
    """Apply ``lowering`` to ``call``; where it raises before rewiring, erase what it inserted."""
    before = set(gm.graph.nodes)
    try:
        lowering.apply(gm, call)
        return None
    except Exception as e:  # noqa: BLE001 - see internal_error
        for node in reversed(list(gm.graph.nodes)):
            if node not in before and not node.users:
                gm.graph.erase_node(node)
        return internal_error(e, cfg)


@dataclass
class Decision:
    """What the pipeline does to one region: rewrite names that apply, reasons for the rest."""

    applied: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)

    def to_run(self, hook: str) -> list[Rewrite]:
        """The applied rewrites that run on ``hook``, minus those another applied one performs."""
        chosen = [r for r in REWRITES if r.name in self.applied]
        replaced = {name for r in chosen for name in r.replaces}
        return [r for r in chosen if r.hook == hook and r.name not in replaced]


def decide(match, cfg: ConfigSnapshot, only=None) -> Decision:
    """Per rewrite of ``match``'s style: applies, or why not. ``only``: decide just these names
    (the others are left out, not skipped)."""
    decision, verdicts = Decision(), Verdicts()
    for rewrite in REWRITES:
        if match.style not in rewrite.styles or (only is not None and rewrite.name not in only):
            continue
        if not cfg[rewrite.name]:
            reason = "disabled by config"
        elif match.layout == "thd" and not rewrite.packed:
            reason = PACKED_REASON
        else:
            reason = reason_or_error(rewrite.why_not, match, cfg, verdicts, cfg=cfg)
        verdicts.record(rewrite.name, reason)
        if reason is None:
            decision.applied.append(rewrite.name)
        else:
            decision.skipped[rewrite.name] = reason
    return decision


PACKED_REASON = "packed (THD) region: this rewrite works on dense [B, S, H, D] attention"


def _detector(match):
    return next(d for d in DETECTORS if d.STYLE == match.style)


def _op_name(node) -> str:
    return node.target.__name__.split(".")[0]


def analyze(graph: torch.fx.Graph, graph_kind: str, rejected: list | None = None, cfg=None,
            canonical: bool = False) -> list[Region]:
    """The report rows of one graph: its CP regions and what the pipeline does to each.
    Attention ops that are not regions go to ``rejected`` with the reason. ``cfg``: the
    compile's snapshot (default: the global config as it is now). ``canonical``: the caller has
    put the graph in canonical form already (the backend does, to recompile what changed)."""
    cfg = cfg if cfg is not None else snapshot()
    if not cfg.detect:
        return []
    if not canonical:
        canonicalize.canonicalize(graph, cfg.strict)

    order = node_order(graph)
    rows, reasons = [], {}  # reasons: attention node -> {style: why it is not that style's region}
    for detector in DETECTORS:
        for match in detector.find(graph, graph_kind, cfg, log=_reasons_into(reasons, detector.STYLE)):
            decision = decide(match, cfg)
            detail = match.describe()
            for rewrite in REWRITES:
                if rewrite.name in decision.applied and rewrite.detail is not None:
                    detail += " " + rewrite.detail(match, cfg)
            if cudnn_frontend_backward.is_cudnn_backward(match.attention):
                detail += f" backward={cudnn_frontend_backward.route(match.attention, cfg).path}"
            notes = [n for n in (accumulators.note(match), _proved_alone(match, detector)) if n]
            rows.append((order[match.attention], Region(
                style=match.style, cp_size=match.cp, layout=match.layout, graph_kind=graph_kind,
                applied=decision.applied, skipped=decision.skipped, attention=_op_name(match.attention),
                detail=detail, notes=notes,
            )))
    matched = {i for i, _ in rows}
    if rejected is not None:
        for node in sorted(reasons, key=order.__getitem__):
            if order[node] not in matched:
                rejected.append(Rejected(graph_kind, _op_name(node), _why_no_region(reasons[node], node)))
    return [row for _, row in sorted(rows, key=lambda r: r[0])]


def _proved_alone(match, detector) -> str | None:
    """A backward region paired with no forward op (its forward graph not analysed, or the op
    called in an autograd.Function's backward, which AOTAutograd numbers apart) is proved from
    the backward alone; one paired with its forward is a region because its forward is one."""
    if match.direction != "backward" or forward_seen(match.attention, detector.__name__):
        return None
    return "backward region proved on its own (no forward op paired with it)"


def backward_routes(graph: torch.fx.Graph, graph_kind: str, cfg=None) -> list[BackwardRoute]:
    """Each cuDNN attention backward of ``graph`` and the op it will run on (the report's
    lines; the post-grad pass asks the same :func:`cudnn_frontend_backward.route`)."""
    cfg = cfg if cfg is not None else snapshot()
    return [
        BackwardRoute(graph_kind, n.name, r.path, r.reason)
        for n in graph.nodes if cudnn_frontend_backward.is_cudnn_backward(n)
        for r in (cudnn_frontend_backward.route(n, cfg),)
    ]


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


def inductor_patches(rows: list[Region]) -> dict:
    """Inductor config for a graph with these report rows (what its applied rewrites need)."""
    by_name = {r.name: r for r in REWRITES}
    patches = {}
    for row in rows:
        for name in row.applied:
            patches.update(by_name[name].inductor_patches)
    return patches


def run_hook(hook: str, graph: torch.fx.Graph, cfg: ConfigSnapshot, only=None) -> None:
    """Everything the pipeline does on Inductor hook ``hook``: detect once, then per region (in
    graph order) decide and apply, then the hook's whole-graph passes. ``only``: just these
    rewrites, no whole-graph passes (tests run one rewrite alone)."""
    if any(r.hook == hook for r in REWRITES):
        _rewrite_regions(hook, graph, cfg, only)
    if only is None:
        for graph_pass in GRAPH_PASSES.get(hook, ()):
            with timed(graph_pass.__name__.lstrip("_"), hook) as outcome:
                before = len(graph.nodes)
                graph_pass(graph, cfg)
                outcome["did"] = f"{before} -> {len(graph.nodes)} nodes"


def _rewrite_regions(hook: str, graph: torch.fx.Graph, cfg: ConfigSnapshot, only) -> None:
    with timed("detect", hook) as outcome:
        canonicalize.canonicalize(graph, cfg.strict)
        matches = [m for d in DETECTORS for m in d.find(graph, "post_grad", cfg)]
        outcome["did"] = f"{len(matches)} regions"
    if not matches:
        return
    # Every region's rewrites are tried together on one copy of the graph, checked once; only if
    # that trial fails is each rewrite tried alone (and the failing ones undone). Trying and
    # checking per rewrite made our passes' time grow with the square of the layers.
    with timed("trial", hook) as outcome:
        trial = checked_rewrite.trial_all(graph, matches, _detector, lambda g, ms, apply: _each_region(g, ms, hook, cfg, only, apply), cfg)
        outcome["did"] = "passed" if trial is not None else "failed: each rewrite tried alone"
    if trial is not None:
        with replaying_values(trial.values):
            _each_region(graph, matches, hook, cfg, only, _apply_tried)
        if trial.sorted:
            stable_topological_sort(graph)  # in the order the trial's check sorted its copy into
    else:
        _each_region(graph, matches, hook, cfg, only, apply_checked)
    graph.eliminate_dead_code()
    graph.lint()


def _apply_tried(graph, match, rewrite, match_at, cfg, performs) -> bool:
    """``rewrite`` on ``match`` once the trial of every region passed: applied, counted."""
    rewrite.apply(graph, match, cfg)
    checked_rewrite.count(rewrite, performs)
    return True


def _each_region(graph: torch.fx.Graph, matches: list, hook: str, cfg: ConfigSnapshot, only, apply) -> bool:
    """Per region of ``matches`` (in graph order), the rewrites :func:`decide` chose for ``hook``,
    each through ``apply(graph, match, rewrite, match_at, cfg, performs) -> kept?``; whether any
    was kept."""
    order = node_order(graph)
    changed = False
    for match in sorted(matches, key=lambda m: order[m.attention]):
        detector = _detector(match)
        if match.attention._erased:
            continue
        if changed:
            # An earlier rewrite may have replaced nodes this region was found through (two
            # layers back to back share the first one's returned output): find it again.
            match = detector.match_at(match.attention, "post_grad", cfg)
            if match is None:
                continue
        changed |= _rewrite_region(graph, match, detector, hook, cfg, only, apply)
    return changed


def _rewrite_region(graph: torch.fx.Graph, match, detector, hook: str, cfg, only, apply) -> bool:
    """Apply what :func:`decide` chose for ``match`` on ``hook`` through ``apply``; whether any
    was kept."""
    kept = False
    decision = decide(match, cfg, only)
    for rewrite in decision.to_run(hook):
        performs = [name for name in rewrite.replaces if name in decision.applied]
        where = f"{hook}, {match.style} {match.direction} {match.attention.name}"
        if apply is checked_rewrite.apply_unchecked:  # the trial copy: nothing to show or log
            kept_now = apply(graph, match, rewrite, detector.match_at, cfg, performs)
        else:
            with rewrite_observed(rewrite.name, where, graph) as outcome:
                kept_now = outcome["kept"] = apply(graph, match, rewrite, detector.match_at, cfg, performs)
        if not kept_now:
            continue
        kept = True
        attention = match.attention
        if attention._erased:  # split into several calls: the region is found again by the first
            attention = next((n for n in graph.nodes if n.meta.get(REPLACES) == attention.name), None)
        match = None if attention is None else detector.match_at(attention, "post_grad", cfg)
        if match is None:
            break
    return kept


def rewrite_graph(graph: torch.fx.Graph, cfg=None, only=None) -> None:
    """The post-grad pipeline on ``graph`` outside a compile (tests; default config: the global
    one as it is now)."""
    run_hook(POST_GRAD, graph, cfg if cfg is not None else snapshot(), only)
