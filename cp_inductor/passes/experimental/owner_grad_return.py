"""owner_grad_return: a K/V all-gather backward returns dK/dV to their owners by copy-engine
pulls and a local sum in rank order, instead of NCCL's reduce-scatter.

Before (backward)::

    dK/dV over the gathered sequence, reordered -> x[cp * m, ...]
    reduce_scatter_tensor(x, "sum") -> wait -> this rank's [m, ...]

After::

    ce_all_to_all_start(x) -> ... -> ce_all_to_all_wait -> y[cp, m, ...]   # y[r] = rank r's block for us
    (y[0].float() + y[1].float() + ... + y[cp-1].float()).to(dtype)         # rank order, fp32

Each owner receives every rank's contribution to its chunks (with the load-balanced layout, the
chunks o and 2cp-1-o) and adds them itself, always in rank order: the gradients are the same
bits whatever order the transfers arrive in, run after run (NCCL's reduce-scatter sums in bf16
along its ring). The transfer needs no SM, so where the backward is split (head groups), group
g's return travels under group g+1's attention, where NCCL's kernels starve.

It needs the copy-engine transport (one host, NCCL group, CUDA, ``cuda-bindings``): elsewhere the
report gives the transport's reason. It skips regions whose reduce-scatters no attention
follows (one group, or the last group): there the pulls hide under nothing and the staging
copies and the sum only add (measured +1.9% at S32K). Off by default: measured no faster than
NCCL's reduce-scatter yet (head groups G=4, S32K and S128K: within +-0.5%).
"""

from __future__ import annotations

import torch
import torch.fx

from ..editing.fx_emit import Emitter
from ..analysis.graph_walk import node_order
from ..analysis.sdpa_ops import SDPA_BACKWARD
from ..detect.allgather import AllGatherMatch
from ..record import POST_GRAD, RegionPass
from ..post_grad.transport import Sender, copy_engine_unavailable, only_wait, retire

aten = torch.ops.aten
NAME = "owner_grad_return"


def _reduce_scatters(region: AllGatherMatch) -> list:
    order = node_order(region.attention.graph)
    nodes = {r for group in region.reduce_scatters.values() for r in group}
    return sorted(nodes, key=order.__getitem__)


def why_not(region: AllGatherMatch, cfg, verdicts) -> str | None:
    if region.direction != "backward":
        return "forward region (the rewrite returns the backward's dK/dV)"
    scatters = _reduce_scatters(region)
    for rs in scatters:
        if rs.args[1] != "sum":
            return f"reduce-scatter reduces by {rs.args[1]!r}, not sum"
        if only_wait(rs) is None:
            return "reduce-scatter result used other than through one wait"
    graph = region.attention.graph
    order = node_order(graph)
    first = min(order[rs] for rs in scatters)
    overlapped = any(e.applies for e in verdicts.earlier)  # it moves attention after the reduce-scatter
    if not overlapped and not any(
        order[n] > first for target in SDPA_BACKWARD for n in graph.find_nodes(op="call_function", target=target)
    ):
        return ("no attention runs after its reduce-scatter, so the pulls would hide under nothing "
                "(measured: +1.9% at S32K without head groups; head groups give later groups' attention)")
    return copy_engine_unavailable(region)


def apply(graph: torch.fx.Graph, region: AllGatherMatch, cfg) -> list:
    sender = Sender(graph, "copy_engine", region.cp, region.group_name)
    replaced = []
    for rs in _reduce_scatters(region):
        wait = only_wait(rs)
        x = rs.args[0]
        emit = Emitter(graph, wait)
        # Started where the reduce-scatter started, waited where it was waited for: what the
        # program runs in between (a later head group, gather_overlap's local attention) hides it.
        received = sender.wait(emit, sender.start(Emitter(graph, rs), x))
        shape = list(x.meta["val"].shape)
        blocks = emit(aten.view.default, received, [region.cp, shape[0] // region.cp, *shape[1:]])
        total = None
        for r in range(region.cp):
            part = emit(aten.select.int, blocks, 0, r)
            part = emit(torch.ops.prims.convert_element_type.default, part, torch.float32)
            total = part if total is None else emit(aten.add.Tensor, total, part)
        out = emit(torch.ops.prims.convert_element_type.default, total, x.meta["val"].dtype)
        replaced += retire(graph, emit, rs, wait, out)
    return replaced


def detail(region: AllGatherMatch, cfg) -> str:
    return f"{len(_reduce_scatters(region))} reduce-scatter(s) -> copy-engine pulls + rank-order fp32 sum"


# Inductor's peak-memory reordering would sink each start back next to its wait.
PASS = RegionPass(
    NAME, stage=POST_GRAD, styles=("allgather",), why_not=why_not, apply=apply, detail=detail,
    inductor_patches={"reorder_for_peak_memory": False},
)
