"""head_overlap: a Ulysses region runs in G head groups, so the all-to-all of one group travels
while attention of another computes.

Before (backward, after fused_a2a)::

    pack dO -> all_to_all -> wait -> attention backward (all local heads)
            -> pack dq,dk,dv -> all_to_all -> wait -> unpack

After (G = 2)::

    pack dO as [G, cp, S/cp, B, H/G, D] -> all_to_all(group 0), all_to_all(group 1)
    wait(0) -> attention backward(heads of group 0) -> pack -> all_to_all(dq,dk,dv of group 0)
    wait(1) -> attention backward(heads of group 1) -> pack -> all_to_all(dq,dk,dv of group 1)
    wait, wait -> one copy back into the layout the old all_to_all delivered

Group 0's gradients travel while group 1 computes; only the first incoming and the last outgoing
collective stay exposed. Group g holds local heads ``[g*H/G, (g+1)*H/G)`` of every rank's block
and the matching k/v heads, so GQA pairs stay together; the saved q, k, v, out and log-sum-exp
are sliced per group (views). A forward region is split the same way (q,k,v in, out back) when
``head_overlap_forward`` is set; its q, k, v, out and log-sum-exp are saved for the backward,
so their pieces are concatenated back (copies).

Each group's all-to-all travels by NCCL or, with ``head_overlap_transport="copy_engine"``, as a
start/wait pair of the copy-engine ops (``lowerings/ce_transport.py``), whose transfers need no
SM and so move while another group's attention holds every SM; where they cannot run the
report's detail says why and NCCL carries it.

It builds on fused_a2a's buffers (one pack kernel for all groups, attention reading strided
views): it needs fused_a2a to apply and rewrites the region in its place. The emitted order
(every incoming collective first, then per group: wait, attention, send) is what overlaps, so
graphs it rewrites are compiled without Inductor's peak-memory reordering (the record's
``inductor_patches``). The K/V all-gather and ring counterpart, a split for memory, is
``head_split.py``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..editing.fx_emit import Emitter
from ..editing.head_groups import Partition, cat_like, common_groups, group_call
from ..analysis.graph_walk import node_order
from ..analysis.layout_algebra import Factor, Layout, plan_relayout
from ..analysis.sdpa_ops import bound_args, tuple_outputs
from ..detect.a2a import A2AMatch
from ..record import DISABLED, POST_GRAD, RegionPass
from ..post_grad.transport import Sender, transport_choice
from ..post_grad.ulysses_buffers import (
    as_delivered,
    crossing_groups,
    heads_view,
    pack_layout,
    packed_source,
    reads_as_view,
    unpack_choice,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
NAME = "head_overlap"

# Most groups the automatic choice takes. Each split costs attention time (one more tail wave
# and the per-call dO.O / dq-convert kernels: +1.5-3% per split on H200) while the exposed share
# of the collectives only falls from 1/2 to 1/G: G=2 measured best, G=4 and 8 slower.
AUTO_MAX_GROUPS = 2


def choose_groups(region, cfg) -> tuple[int, str | None]:
    """(G, None), or (1, why the region stays one group): the attention op sees this rank's
    head block."""
    hq, hkv = region.heads_q // region.cp, region.heads_kv // region.cp
    return common_groups(hq, hkv, cfg.head_overlap_groups, AUTO_MAX_GROUPS, "head_overlap_groups", "local heads", ("Hq/cp", "Hkv/cp"))


def why_not(region, cfg, verdicts) -> str | None:
    """Why head_overlap cannot rewrite this region, or None. It reads the verdict of the pass whose
    buffers it builds on (``verdicts.earlier``, declared in ``passes/pipeline.py``)."""
    (base,) = verdicts.earlier
    if base.reason == DISABLED:
        return f"needs {base.name} ({DISABLED})"
    if region.direction == "forward" and not cfg.head_overlap_forward:
        return "forward region (head_overlap_forward=False)"
    if base.reason is not None:
        return f"needs {base.name}: {base.reason}"
    if region.has_mask:
        return "attention mask or bias (not split by heads)"
    if region.dropout_p:
        return "dropout (each group would draw its own mask)"
    unpack = unpack_choice(region, cfg)
    if unpack.choice != "views":
        return f"needs {base.name}'s views; {base.name} copies ({unpack.reason})"
    groups = crossing_groups(region)
    for c, arg in zip(*groups[0]):
        if not reads_as_view(pack_layout(c, region.cp), c, region.cp, arg):
            return "attention does not read the received buffer as a view"
    outs = tuple_outputs(region.attention)
    if region.direction == "backward":
        for idx, name in enumerate(("dq", "dk", "dv")):
            if region.outgoing[name].source is not outs[idx]:
                return "a gradient is summed over replicated heads before its all_to_all"
            chain = region.outgoing[name].before
            first = chain[0] if chain else region.outgoing[name].a2a
            if set(outs[idx].users) != {first}:
                return "attention gradients used outside their all_to_all"
        if any(outs[i].users for i in outs if i > 2):
            return "attention returns a gradient the rewrite does not rebuild"
    return choose_groups(region, cfg)[1]


def _grouped(lay: Layout, groups: int) -> Layout:
    """``[cp, S/cp, B, H, D]`` -> ``[G, cp, S/cp, B, H/G, D]``: group g's send is one block."""
    dest, s, b, (h,), d = lay.dims
    outer = Factor(h.axis, h.stride * (h.size // groups), groups)
    inner = Factor(h.axis, h.stride, h.size // groups)
    return Layout(((outer,), dest, s, b, (inner,), d), lay.pinned)


def _send_layout(emit: Emitter, x: torch.fx.Node, cp: int) -> torch.fx.Node:
    """Attention-side ``[B, H, S, D]`` (S = source rank x local position) -> ``[cp, S/cp, B, H, D]``."""
    b, h, s, d = x.meta["val"].shape
    return emit(aten.permute.default, emit(aten.reshape.default, x, [b, h, cp, s // cp, d]), [2, 3, 0, 1, 4])


def _send_incoming(graph: torch.fx.Graph, region: A2AMatch, inc: list, p: Partition, sender: Sender):
    """One pack for every group, then all incoming all-to-alls at once: NCCL runs them back to
    back while each group's attention waits only for its own. Returns (sends, layouts)."""
    order = node_order(graph)
    last_send = max((c.a2a.args[0] for c in inc), key=order.__getitem__)
    emit = Emitter(graph, last_send.next)
    layouts = [_grouped(pack_layout(c, region.cp), p.groups) for c in inc]
    packs = [emit.relayout(packed_source(emit, c), plan_relayout(c.source_layout, lay)) for c, lay in zip(inc, layouts)]
    buf = packs[0] if len(packs) == 1 else emit(aten.cat.default, packs, 4)
    sends = [sender.start(emit, emit(aten.select.int, buf, 0, g)) for g in range(p.groups)]
    return sends, layouts


def _attend_per_group(emit: Emitter, region: A2AMatch, p: Partition, sender: Sender, sent: list, layouts: list,
                      names, n_out: int):
    """Per group: wait for its input, attention on its heads, send its results right away.
    Returns (attention calls, returning all-to-alls)."""
    calls, returned = [], []
    for g in range(p.groups):
        recv = sender.wait(emit, sent[g])
        inputs, offset = {}, 0
        for name, lay in zip(names, layouts):
            heads = lay.shape[4]
            part = recv if len(layouts) == 1 else emit(aten.slice.Tensor, recv, 3, offset, offset + heads)
            inputs[name] = heads_view(emit, part)
            offset += heads
        call = group_call(emit, region.attention, p, g, inputs)
        calls.append(call)
        results = [emit(operator.getitem, call, i) for i in range(n_out)]
        sends = [_send_layout(emit, r, region.cp) for r in results]
        buf = sends[0] if len(sends) == 1 else emit(aten.cat.default, sends, 3)
        returned.append(sender.start(emit, buf))
    return calls, returned


def _reassemble(emit: Emitter, region: A2AMatch, sender: Sender, outc: list, returned: list, groups: int) -> None:
    """What came back, per tensor, into the layout the old all-to-all delivered."""
    recvs = [sender.wait(emit, r) for r in returned]
    offset = 0
    for c in outc:
        lay = pack_layout(c, region.cp)
        heads = lay.shape[3] // groups
        parts = [r if len(outc) == 1 else emit(aten.slice.Tensor, r, 3, offset, offset + heads) for r in recvs]
        offset += heads
        # Post-grad graphs hold no aten.stack (it is decomposed): cat of unsqueezed parts.
        parts = [emit(aten.unsqueeze.default, x, 3) for x in parts]
        stacked = emit(aten.reshape.default, emit(aten.cat.default, parts, 3), list(lay.shape))
        emit.replace(c.wait, as_delivered(emit, stacked, lay, c, region.cp))


def _restore_full_tensors(emit: Emitter, node, calls: list, names, inc_args: list, backward: bool) -> None:
    """What else reads the full tensors (the forward saves q, k, v, out and log-sum-exp for the
    backward) gets them back concatenated: one copy each, after the last group."""
    outs = tuple_outputs(node)
    for name, arg in zip(names, inc_args):
        if any(u is not node for u in arg.users):
            full = cat_like(emit, [bound_args(call)[name] for call in calls], 1, arg.meta["val"])
            emit.replace(arg, full, delete_user_cb=lambda u: u is not node)
    if not backward:
        for idx in (0, 1):
            if idx in outs and outs[idx].users:
                pieces = [emit(operator.getitem, call, idx) for call in calls]
                emit.replace(outs[idx], cat_like(emit, pieces, 1, outs[idx].meta["val"]))
    for idx, item in outs.items():
        if idx > (1 if not backward else 2) and item.users:  # seeds, sizes: the same for every group
            emit.replace(item, emit(operator.getitem, calls[0], idx))


def _rewrite(graph: torch.fx.Graph, region: A2AMatch, p: Partition, transport: str) -> list:
    node = region.attention
    (inc, inc_args), (outc, _) = crossing_groups(region)
    backward = region.direction == "backward"
    names = ("grad_out",) if backward else ("query", "key", "value")
    outs = tuple_outputs(node)

    sender = Sender(graph, transport, region.cp, region.group_name)
    sent, layouts = _send_incoming(graph, region, inc, p, sender)
    emit = Emitter(graph, node)
    calls, returned = _attend_per_group(emit, region, p, sender, sent, layouts, names, len(outc))
    _reassemble(emit, region, sender, outc, returned, p.groups)
    _restore_full_tensors(emit, node, calls, names, inc_args, backward)

    dead = [c.wait for c in outc] + [n for c in outc for n in [c.a2a] + c.before[::-1]]
    dead += list(outs.values()) + [node]
    dead += [n for c in inc for n in c.after[::-1] + [c.wait, c.a2a] + c.before[::-1]]
    for n in dead:
        if not n.users:
            graph.erase_node(n)
    return emit.replaced


def apply(graph: torch.fx.Graph, region, cfg) -> list:
    groups, _ = choose_groups(region, cfg)
    hq, hkv = region.heads_q // region.cp // groups, region.heads_kv // region.cp // groups
    return _rewrite(graph, region, Partition(groups, hq, hkv), transport_choice(region, cfg)[0])


def detail(region, cfg) -> str:
    transport, why = transport_choice(region, cfg)
    return f"G={choose_groups(region, cfg)[0]}, transport={transport} ({why})"


# The emitted order (all incoming collectives, then per group: wait, attention, send) is what
# overlaps; Inductor's peak-memory reordering would sink each collective next to its wait.
PASS = RegionPass(
    NAME, stage=POST_GRAD, styles=("a2a",), why_not=why_not, apply=apply,
    inductor_patches={"reorder_for_peak_memory": False}, detail=detail,
)
