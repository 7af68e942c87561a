"""gather_overlap: attention that needs nothing gathered runs while the K/V all-gather (forward)
or the dK/dV reduce-scatter (backward) travels.

Causal load-balanced all-gather CP splits each local query chunk into a call over its prefix
(gathered keys) and a call over its own block (the rank's own K/V, no gathered data), merged
by log-sum-exp. Programs write the prefix call first, so the local call waits for a gather it
does not read; in the backward both calls run before the reduce-scatter, which then follows the
last attention with nothing to hide under. Before::

    kv = wait(all_gather(kv_local))
    o_p = attention(q, kv[:prefix])              # reads the gather
    o_d = attention(q, kv_local, causal)         # does not
    ...
    g_p = attention_backward(do, q, kv[:prefix])
    g_d = attention_backward(do, q, kv_local)
    dkv = wait(reduce_scatter(pack(g_p))) + g_d

After (only the order changes: the same ops, the same bits)::

    kv_ = all_gather(kv_local)
    o_d = attention(q, kv_local, causal)         # while the gather travels
    kv = wait(kv_);  o_p = attention(q, kv[:prefix])
    ...
    g_p = attention_backward(do, q, kv[:prefix])
    rs = reduce_scatter(pack(g_p))
    g_d = attention_backward(do, q, kv_local)    # while the reduce-scatter travels
    dkv = wait(rs) + g_d

The calls moved are those that read the region's queries (the same tensor, up to layout ops)
and depend neither on the region's gather (forward) nor feed its reduce-scatter (backward);
everything they need moves with them, everything else keeps its order (``schedule.resort``).
In the backward this also gives ``owner_grad_return`` an attention to hide its pulls under.
Graphs it reorders compile with Inductor's ``reorder_for_peak_memory`` off (it would sink the
collectives back next to their waits). Off by default: not measured on GPUs yet.
"""

from __future__ import annotations

import torch
import torch.fx

from ..analysis.graph_walk import node_order
from ..analysis.graph_walk import ancestors, descendants
from ..editing.schedule import resort
from ..analysis.sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD, bound_args
from ..detect import moved_from
from ..detect.allgather import AllGatherMatch
from ..record import POST_GRAD, RegionPass

c10d = torch.ops._c10d_functional
NAME = "gather_overlap"


def _query_sources(node: torch.fx.Node) -> set:
    return moved_from(bound_args(node)["query"])[0]


def _waits(collectives) -> list:
    return [u for c in collectives for u in c.users if u.target is c10d.wait_tensor.default]


def _plan(region: AllGatherMatch):
    """(first node to reorder, nodes that go first, nodes that go last) or None: the calls of
    the region's queries that need nothing in flight, and where they would wait for it now."""
    graph = region.attention.graph
    order = node_order(graph)
    queries = _query_sources(region.attention)
    if region.direction == "forward":
        waits = _waits(c for gs in region.gathers.values() for c in gs)
        blocked = descendants(waits) | set(waits)
        ops = SDPA_FORWARD
    else:
        scatters = [r for rs in region.reduce_scatters.values() for r in rs]
        blocked = ancestors(scatters) | set(scatters)
        ops = SDPA_BACKWARD
    local = [
        n for t in ops for n in graph.find_nodes(op="call_function", target=t)
        if n not in blocked and _query_sources(n) & queries
    ]
    if region.direction == "forward":
        if not waits:
            return None
        # From the first wait on (a wait orders the compute stream after the transfer): the
        # local calls and what they need first, the rest in its order.
        first = min(waits, key=order.__getitem__)
        late = [n for n in local if order[n] > order[first]]
        early = ancestors(late) | set(late)
        return (first, early, set()) if late else None
    first_scatter = min(scatters, key=order.__getitem__)
    early_calls = [n for n in local if order[n] < order[first_scatter]]
    if not early_calls:
        return None
    # The reduce-scatters and their inputs first, then what does not wait for them, then the
    # waits and what reads them.
    waiting = descendants(_waits(scatters)) | set(_waits(scatters))
    return min(early_calls, key=order.__getitem__), blocked, waiting


def why_not(region: AllGatherMatch, cfg, verdicts) -> str | None:
    if _plan(region) is None:
        what = "gather" if region.direction == "forward" else "reduce-scatter"
        return (f"no attention call of this region's queries that the {what} does not concern is "
                f"ordered where it would wait for it (one call per chunk, or already ahead)")
    return None


def apply(graph: torch.fx.Graph, region: AllGatherMatch, cfg) -> list:
    plan = _plan(region)
    if plan is None:
        return []
    start, early, late = plan
    resort(graph, start, lambda n: 0 if n in early else (2 if n in late else 1))
    return []


def detail(region: AllGatherMatch, cfg) -> str:
    where = "gather" if region.direction == "forward" else "reduce-scatter"
    return f"local attention moved under the {where}"


PASS = RegionPass(
    NAME, stage=POST_GRAD, styles=("allgather",), why_not=why_not, apply=apply, detail=detail,
    inductor_patches={"reorder_for_peak_memory": False},
)
