"""head_partition: a Ulysses region runs in G head groups, so the all-to-all of one group travels
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
``head_partition_forward`` is set; its q, k, v, out and log-sum-exp are saved for the backward,
so their pieces are concatenated back (copies).

Each group's all-to-all travels by NCCL or, with ``transport="copy_engine"``, as a start/wait
pair of the copy-engine ops (``lowerings/ce_transport.py``), whose transfers need no SM and so
move while another group's attention holds every SM; where they cannot run the report's detail
says why and NCCL carries it.

A K/V all-gather region (``allgather``) is split where its memory goes: each attention call (the
backward by default, the forward too with ``head_partition_forward``) becomes G calls over head
groups, reading head slices (views) of q, dO, O, log-sum-exp and of the gathered K/V, and so does
the call on the rank's own K/V that reads the same queries (a load-balanced causal chunk's
diagonal block: not a region itself, but the same attention)::

    dq, dk, dv = attention_backward(dO, q, k, v, O, lse)            # all heads: one workspace
    ->  dq_g, dk_g, dv_g = attention_backward(dO[:, g], q[:, g], k[:, g], ...)   for g < G
        dq, dk, dv = cat(dq_g), cat(dk_g), cat(dv_g)                  # on the head dim

A fused backward kernel's allocations (dQ accumulated in fp32, dK/dV of every query head under
GQA) scale with the heads of the call: on H200 one cuDNN backward of Hq32 Hkv8 over 32K x 96K
rows allocates 2.63 GiB, four head groups 1.25 GiB, for 1.4% more time
(``benchmarks/bench_head_split.py``). The gathers and reduce-scatters stay whole: per-group
collectives each wait for the slower rank (measured 2.6-12% slower with the helper's
``head_groups``, README), and a gathered K/V is small beside that workspace under GQA.

On Ulysses regions this rewrite builds on fused_a2a's buffers (one pack kernel for all groups,
attention reading strided views): it needs fused_a2a to apply and rewrites the region in its place. The emitted
order (every incoming collective first, then per group: wait, attention, send) is what overlaps,
so graphs it rewrites are compiled without Inductor's peak-memory reordering (the record's
``inductor_patches``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..detect.a2a import A2AMatch
from ..detect.allgather import REORDER_OPS
from ..fx_emit import Emitter, stride_order
from ..layout_algebra import Factor, Layout, is_layout_op, is_value_op, plan_relayout
from ..sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD, bound_args, tuple_outputs
from . import Rewrite, fused_a2a
from .transport import Sender, transport_choice
from .ulysses_buffers import (
    as_delivered,
    crossing_groups,
    heads_view,
    pack_layout,
    reads_as_view,
    unpack_choice,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
NAME = "head_partition"

# Attention arguments that carry query heads / key-value heads on dim 1 (forward and backward).
_Q_HEAD_ARGS = ("query", "grad_out", "out", "logsumexp")
_KV_HEAD_ARGS = ("key", "value")

# Most groups the automatic choice takes. Each split costs attention time (one more tail wave
# and the per-call dO.O / dq-convert kernels: +1.5-3% per split on H200) while the exposed share
# of the collectives only falls from 1/2 to 1/G: G=2 measured best, G=4 and 8 slower (README).
AUTO_MAX_GROUPS = 2
# All-gather regions split for memory: four groups took a cuDNN backward's allocations to what its
# outputs need (Hq32 Hkv8, 32K x 96K rows: 2.63 -> 1.25 GiB); eight saved nothing more.
AUTO_MAX_GROUPS_ALLGATHER = 4


@dataclass
class Partition:
    """How one region is split."""

    groups: int
    heads_q: int  # local query heads per group
    heads_kv: int  # local key/value heads per group


def choose_groups(region, cfg) -> tuple[int, str | None]:
    """(G, None), or (1, why the region stays one group)."""
    if region.style == "a2a":  # the attention op sees this rank's head block
        hq, hkv, label, auto_max = region.heads_q // region.cp, region.heads_kv // region.cp, "local heads", AUTO_MAX_GROUPS
        names = ("Hq/cp", "Hkv/cp")
    else:
        hq, hkv, label, auto_max = region.heads_q, region.heads_kv, "heads", AUTO_MAX_GROUPS_ALLGATHER
        names = ("Hq", "Hkv")
    common = [g for g in range(2, hkv + 1) if hq % g == 0 and hkv % g == 0]
    want = cfg.head_groups
    if want == 1:
        return 1, "head_groups=1"
    shown = f"{names[0]}={hq}, {names[1]}={hkv}"
    if want > 1:
        if want in common:
            return want, None
        return 1, f"head_groups={want} does not divide the {label} ({shown})"
    fitting = [g for g in common if g <= auto_max]
    if not fitting:
        return 1, f"{label} {shown} have no common divisor in 2..{auto_max}"
    return fitting[-1], None


def why_not(region: A2AMatch, cfg, decided: dict) -> str | None:
    """Why head_partition cannot rewrite this region, or None. ``decided["fused_a2a"]`` is
    fused_a2a's verdict on the same region."""
    if region.style == "allgather":
        return _split_calls_why_not(region, cfg)
    if region.style != "a2a":
        return f"not implemented yet for {region.style}"
    if not cfg.fused_a2a:
        return "needs fused_a2a (disabled by config)"
    if region.direction == "forward" and not cfg.head_partition_forward:
        return "forward region (head_partition_forward=False)"
    reason = decided[fused_a2a.NAME] if fused_a2a.NAME in decided else fused_a2a.why_not(region, cfg)
    if reason is not None:
        return f"needs fused_a2a: {reason}"
    if region.has_mask:
        return "attention mask or bias (not split by heads)"
    if region.dropout_p:
        return "dropout (each group would draw its own mask)"
    unpack = unpack_choice(region, cfg)
    if unpack.choice != "views":
        return f"needs fused_a2a's views; fused_a2a copies ({unpack.reason})"
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


def _cat_like(emit: Emitter, parts: list, dim: int, like: torch.Tensor) -> torch.fx.Node:
    """Concatenate ``parts`` along ``dim`` into a tensor with ``like``'s strides: it replaces a
    saved tensor whose strides the backward graph was compiled for."""
    order = stride_order(like)
    inverse = [order.index(i) for i in range(like.dim())]
    permuted = [emit(aten.permute.default, p, order) for p in parts]
    return emit(aten.permute.default, emit(aten.cat.default, permuted, order.index(dim)), inverse)


def _group_call(emit: Emitter, node: torch.fx.Node, p: Partition, g: int, inputs: dict) -> torch.fx.Node:
    """``node`` (an attention op) on the heads of group ``g``: ``inputs`` replaces some arguments,
    the rest are sliced on their head dim or passed as they are."""
    args, kwargs = list(node.args), dict(node.kwargs)
    schema = node.target._schema.arguments
    for i, (name, value) in enumerate(bound_args(node).items()):
        if name in inputs:
            value = inputs[name]
        elif name in _Q_HEAD_ARGS and isinstance(value, torch.fx.Node):
            value = emit(aten.slice.Tensor, value, 1, g * p.heads_q, (g + 1) * p.heads_q)
            if name == "logsumexp" and not value.meta["val"].is_contiguous():
                # The flash backward indexes its log-sum-exp as a dense [B, H, S]: a head slice
                # of a batch > 1 gave wrong gradients on H200 (run 45). It is small: copy it.
                value = emit(aten.clone.default, value, memory_format=torch.contiguous_format)
        elif name in _KV_HEAD_ARGS and isinstance(value, torch.fx.Node):
            value = emit(aten.slice.Tensor, value, 1, g * p.heads_kv, (g + 1) * p.heads_kv)
        else:
            continue
        if i < len(args):
            args[i] = value
        else:
            kwargs[schema[i].name] = value
    return emit(node.target, *args, **kwargs)


def _send_incoming(graph: torch.fx.Graph, region: A2AMatch, inc: list, p: Partition, sender: Sender):
    """One pack for every group, then all incoming all-to-alls at once: NCCL runs them back to
    back while each group's attention waits only for its own. Returns (sends, layouts)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_send = max((c.a2a.args[0] for c in inc), key=order.__getitem__)
    emit = Emitter(graph, last_send.next)
    layouts = [_grouped(pack_layout(c, region.cp), p.groups) for c in inc]
    packs = [emit.relayout(c.source, plan_relayout(c.source_layout, lay)) for c, lay in zip(inc, layouts)]
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
        call = _group_call(emit, region.attention, p, g, inputs)
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
            full = _cat_like(emit, [bound_args(call)[name] for call in calls], 1, arg.meta["val"])
            emit.replace(arg, full, delete_user_cb=lambda u: u is not node)
    if not backward:
        for idx in (0, 1):
            if idx in outs and outs[idx].users:
                pieces = [emit(operator.getitem, call, idx) for call in calls]
                emit.replace(outs[idx], _cat_like(emit, pieces, 1, outs[idx].meta["val"]))
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


def _split_calls_why_not(region, cfg) -> str | None:
    """An all-gather region's attention call split by head groups: why not, or None."""
    if region.direction == "forward" and not cfg.head_partition_forward:
        return "forward region (head_partition_forward=False; its kernel's workspace is small)"
    return _call_why_not(region.attention) or choose_groups(region, cfg)[1]


def _call_why_not(node: torch.fx.Node) -> str | None:
    """Why one attention op cannot be split by heads as it is, or None."""
    args = bound_args(node)
    if args.get("dropout_p"):
        return "dropout (each group would draw its own mask)"
    for name in ("attn_mask", "attn_bias"):
        mask = args.get(name)
        if isinstance(mask, torch.fx.Node):
            shape = mask.meta["val"].shape
            if len(shape) == 4 and shape[1] != 1:
                return f"{name} has a head dim (not split by heads)"
    outs = tuple_outputs(node)
    if node.target in SDPA_BACKWARD and any(outs[i].users for i in outs if i > 2):
        return "attention returns a gradient the rewrite does not rebuild (the bias's)"
    return None


def local_siblings(region) -> list:
    """Attention ops on this rank's own K/V that read the same queries as ``region``'s op: a
    load-balanced causal block's diagonal call beside the chunk's prefix call over gathered
    keys (the same CP attention; the largest allocation left once the region's calls are split)."""
    node = region.attention
    query = bound_args(node)["query"]
    ops = SDPA_BACKWARD if region.direction == "backward" else SDPA_FORWARD
    out = []
    for user in query.users:
        if user is node or user.op != "call_function" or user.target not in ops:
            continue
        args = bound_args(user)
        if (args["query"] is query and not any(_after_collective(args[n]) for n in ("key", "value"))
                and args["key"].meta["val"].shape[1] == region.heads_kv and _call_why_not(user) is None):
            out.append(user)
    return out


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "cp_inductor")


def _after_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` comes, through layout ops, slices, casts and ``cat``, from a collective:
    such an op is some CP region's (gathered or rotated K/V), not the rank's own attention."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, torch.fx.Node):
            continue
        seen.add(n)
        if n.op != "call_function":
            continue
        if getattr(n.target, "namespace", None) in _COLLECTIVE_NAMESPACES:
            return True
        if n.target is aten.cat.default:
            stack.extend(n.args[0])
        elif is_layout_op(n) or is_value_op(n) or n.target in REORDER_OPS:
            stack.append(n.args[0])
    return False


def _split_call(emit: Emitter, node: torch.fx.Node, p: Partition, backward: bool) -> None:
    """``node`` as ``p.groups`` calls over head groups, their head-carrying results (out and
    log-sum-exp; dq, dk, dv) concatenated back with the old strides, the rest (sizes, seeds:
    the same for every group) taken from the first call."""
    calls = [_group_call(emit, node, p, g, {}) for g in range(p.groups)]
    per_head = 3 if backward else 2
    outs = tuple_outputs(node)
    for idx, item in outs.items():
        if not item.users:
            continue
        if idx < per_head:
            pieces = [emit(operator.getitem, call, idx) for call in calls]
            emit.replace(item, _cat_like(emit, pieces, 1, item.meta["val"]))
        else:
            emit.replace(item, emit(operator.getitem, calls[0], idx))
    for n in list(outs.values()) + [node]:
        if not n.users:
            emit.graph.erase_node(n)


def _split_calls(graph: torch.fx.Graph, region, p: Partition) -> list:
    """The region's attention op and its local siblings, each split by head groups."""
    replaced = []
    for node in [region.attention, *local_siblings(region)]:
        emit = Emitter(graph, node)
        _split_call(emit, node, p, region.direction == "backward")
        replaced += emit.replaced
    return replaced


def apply(graph: torch.fx.Graph, region, cfg) -> list:
    groups, _ = choose_groups(region, cfg)
    if region.style == "allgather":
        return _split_calls(graph, region, Partition(groups, region.heads_q // groups, region.heads_kv // groups))
    hq, hkv = region.heads_q // region.cp // groups, region.heads_kv // region.cp // groups
    return _rewrite(graph, region, Partition(groups, hq, hkv), transport_choice(region, cfg)[0])


def detail(region, cfg) -> str:
    if region.style == "allgather":
        siblings = len(local_siblings(region))
        also = f" and {siblings} call(s) on local K/V reading its queries" if siblings else ""
        return f"G={choose_groups(region, cfg)[0]}: attention call{also} split by head groups (gathers, reduce-scatters whole)"
    transport, why = transport_choice(region, cfg)
    return f"G={choose_groups(region, cfg)[0]}, transport={transport} ({why})"


# The emitted order (all incoming collectives, then per group: wait, attention, send) is what
# overlaps; Inductor's peak-memory reordering would sink each collective next to its wait.
REWRITE = Rewrite(
    NAME, styles=("a2a", "allgather"), why_not=why_not, apply=apply, replaces=(fused_a2a.NAME,),
    inductor_patches={"reorder_for_peak_memory": False}, detail=detail,
)
