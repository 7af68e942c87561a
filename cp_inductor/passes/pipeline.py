"""Every cp_inductor pass, in the order it runs, and the analysis that fills the report.

Two places in Inductor run our code:

* ``analyze`` runs on each graph AOTAutograd hands to Inductor (forward, backward or inference,
  before post-grad passes). It finds the CP attention regions and decides, per rewrite, apply or
  skip with a reason; that is what the report shows. It runs on every compile, also when the FX
  graph cache then serves the compiled code.
* ``HOOKS`` lists, per Inductor hook key, the rewrites that run there. Each key gets ONE
  :class:`~cp_inductor.passes.custom_pass.CPGraphPass` that runs these in order, then any pass
  the user had already installed on that key.
"""

from __future__ import annotations

import torch.fx

from .. import config
from ..reporting import Region, Rejected
from . import detect_a2a, fused_a2a, grad_out_layout, head_partition
from .guard import why_not

# Which rewrites of the catalogue (README, "Rewrites") concern a region of each CP style.
REWRITES_BY_STYLE = {
    "a2a": ("fused_a2a", "zero_init", "head_partition", "uniform_thd"),
    "allgather": ("zero_init", "first_grad_reuse", "head_partition", "uniform_thd", "owner_grad_return"),
    "ring": ("zero_init", "first_grad_reuse", "uniform_thd"),
}

# Rewrites that have landed, by the hook key their pass runs on, in order.
HOOKS: dict[str, list] = {
    "joint_custom_pre_pass": [],
    "joint_custom_post_pass": [],
    # head_partition first: where it applies it emits fused_a2a's buffers itself, in G groups.
    # Then the guard that gives cuDNN's attention backward a dO laid out like O (always on).
    "post_grad_custom_pre_pass": [
        head_partition.head_partition_pass, fused_a2a.fused_a2a_pass, grad_out_layout.grad_out_layout_pass,
    ],
    "post_grad_custom_post_pass": [],
}

# Inductor settings a graph is compiled with when a rewrite applies to one of its regions.
# head_partition emits the order that overlaps (all incoming collectives, then per group: wait,
# attention, send); Inductor's peak-memory reordering would sink each collective next to its
# wait, which serializes them again.
INDUCTOR_PATCHES = {
    "head_partition": {"reorder_for_peak_memory": False},
}

# rewrite name -> function(region) giving the reason it cannot apply, or None. The pass asks the
# same function on the post-grad graph, so the report states what the pass does.
ELIGIBILITY = {
    fused_a2a.NAME: fused_a2a.ineligible,
    head_partition.NAME: head_partition.ineligible,
}


def _decide(style: str, region) -> tuple[list, dict]:
    applied, skipped = [], {}
    for name in REWRITES_BY_STYLE[style]:
        if not getattr(config, name):
            skipped[name] = "disabled by config"
        elif name not in ELIGIBILITY:
            skipped[name] = "not implemented yet"
        elif (reason := why_not(ELIGIBILITY[name], region)) is not None:
            skipped[name] = reason
        else:
            applied.append(name)
    return applied, skipped


def _op_name(node) -> str:
    return node.target.__name__.split(".")[0]


def analyze(graph: torch.fx.Graph, graph_kind: str, rejected: list | None = None) -> list[Region]:
    """The CP attention regions of one graph, with what the pipeline does to each. Attention
    ops that are not regions go to ``rejected`` with the reason."""
    if not config.detect:
        return []

    def reject(node, reason):
        if rejected is not None:
            rejected.append(Rejected(graph_kind, _op_name(node), reason))

    regions = []
    for r in detect_a2a.find_regions(graph, graph_kind, log=reject):
        applied, skipped = _decide("a2a", r)
        detail = f"Hq={r.heads_q} Hkv={r.heads_kv}" + (" causal" if r.is_causal else "")
        if fused_a2a.NAME in applied:
            unpack = fused_a2a.unpack_choice(r)  # ineligible() already asked: it cannot fail here
            detail += f" unpack={unpack.choice} ({unpack.reason})"
        regions.append(
            Region(
                style="a2a", cp_size=r.cp, layout=r.layout, graph=graph_kind, applied=applied,
                skipped=skipped, attention=_op_name(r.attention), detail=detail,
            )
        )
    return regions
