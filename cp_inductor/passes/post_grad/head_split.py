"""head_split: on K/V all-gather and ring regions, each attention call becomes G calls over head
groups, to bound the fused kernels' memory::

    dq, dk, dv = attention_backward(dO, q, k, v, O, lse)            # all heads: one workspace
    ->  dq_g, dk_g, dv_g = attention_backward(dO[:, g], q[:, g], k[:, g], ...)   for g < G
        dq, dk, dv = cat(dq_g), cat(dk_g), cat(dv_g)                  # on the head dim

Group g takes query heads ``[g*Hq/G, (g+1)*Hq/G)`` and K/V heads ``[g*Hkv/G, ...)``, so GQA pairs
stay together; masks broadcast over heads pass to every group. The collectives around the call
are untouched: the split is the same on every rank (it depends on the head counts only). On an
all-gather region the call on the rank's own K/V that reads the same queries (a causal chunk's
diagonal block) is split too. The group calls carry ``meta[REPLACES]``, the old op's name: the
pipeline finds the region again by the first of them, so the rewrites after it (ce_rotation,
narrow_rotation) still apply. A head slice of the log-sum-exp is copied dense where it is not
(batch > 1): flash's backward indexes it as a dense ``[B, H, S]``.

A fused backward kernel's allocations (dQ accumulated in fp32, dK/dV of every query head under
GQA) scale with the heads of the call; with ``head_split_groups=0`` only calls allocating at
least ``head_split_min_gib`` are split (smaller ones pay 2-3% time for little memory). Ulysses'
head groups, which also split the all-to-alls, are ``head_overlap.py``; both build the group
calls here.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..editing.fx_emit import REPLACES, Emitter
from ..editing.head_groups import Partition, cat_like, common_groups, group_call
from ..analysis.sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD, bound_args, tuple_outputs
from ..detect import moved_from
from ..detect.allgather import REORDER_OPS
from ..record import POST_GRAD, RegionPass, size_text

aten = torch.ops.aten

NAME = "head_split"
# Most groups the automatic choice takes: four took a cuDNN backward's allocations to what its
# outputs need (Hq32 Hkv8, 32K x 96K rows: 2.63 -> 1.25 GiB); eight saved nothing more.
AUTO_MAX_GROUPS = 4


def choose_groups(region, cfg) -> tuple[int, str | None]:
    return common_groups(region.heads_q, region.heads_kv, cfg.head_split_groups, AUTO_MAX_GROUPS, "head_split_groups", "heads", ("Hq", "Hkv"))


def why_not(region, cfg, verdicts=None) -> str | None:
    """Why ``region``'s attention call cannot be split by head groups, or None."""
    if region.direction == "forward" and not cfg.head_split_forward:
        return "forward region (head_split_forward=False; its kernel's workspace is small)"
    reason = _call_why_not(region.attention)
    if reason is None and cfg.head_split_groups == 0:
        nbytes = backward_allocation(region.attention)
        if nbytes < cfg.head_split_min_gib * 2**30:
            reason = (f"its backward allocates ~{size_text(nbytes)} beyond its gradients (< head_split_min_gib "
                      f"{cfg.head_split_min_gib:g}: smaller calls pay 2-3% time for the split); head_split_groups=G forces it")
    return reason or choose_groups(region, cfg)[1]


def backward_allocation(node: torch.fx.Node) -> int:
    """Bytes the fused backward of this attention call allocates beyond its gradients, as measured
    on H200 for cuDNN and flash alike (``bench_head_split.py``, results/head_split_run44.log: 32K x 96K rows, Hq32 Hkv8
    -> 2.0 GiB): dQ accumulated in fp32, and under GQA dK and dV for every query head."""
    args = bound_args(node)
    q, k = args["query"].meta["val"], args["key"].meta["val"]
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    nbytes = b * hq * sq * d * 4
    if hkv < hq:
        nbytes += 2 * b * hq * skv * k.shape[3] * k.element_size()
    return int(nbytes)


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


def siblings(region) -> list:
    """What is split with ``region``'s op: on an all-gather region, the attention ops on this
    rank's own K/V that read the same queries (a load-balanced causal block's diagonal call
    beside the chunk's prefix call over gathered keys: the same CP attention, and the largest
    allocation left once the region's calls are split). None on a ring region: its step on the
    local K/V is a region of its own."""
    if region.style != "allgather":
        return []
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
    ends, complete = moved_from(node, REORDER_OPS)
    return not complete or any(
        n.op == "call_function" and getattr(n.target, "namespace", None) in _COLLECTIVE_NAMESPACES for n in ends
    )


def _split_call(emit: Emitter, node: torch.fx.Node, p: Partition, backward: bool) -> None:
    """``node`` as ``p.groups`` calls over head groups, their head-carrying results (out and
    log-sum-exp; dq, dk, dv) concatenated back with the old strides, the rest (sizes, seeds:
    the same for every group) taken from the first call."""
    calls = [group_call(emit, node, p, g, {}) for g in range(p.groups)]
    for call in calls:
        call.meta[REPLACES] = node.name  # later rewrites find the region again by its first call
    per_head = 3 if backward else 2
    outs = tuple_outputs(node)
    for idx, item in outs.items():
        if not item.users:
            continue
        if idx < per_head:
            pieces = [emit(operator.getitem, call, idx) for call in calls]
            emit.replace(item, cat_like(emit, pieces, 1, item.meta["val"]))
        else:
            emit.replace(item, emit(operator.getitem, calls[0], idx))
    for n in list(outs.values()) + [node]:
        if not n.users:
            emit.graph.erase_node(n)


def apply(graph: torch.fx.Graph, region, cfg) -> list:
    """The region's attention op (and, on an all-gather region, its local siblings), each split
    into head groups."""
    groups, _ = choose_groups(region, cfg)
    p = Partition(groups, region.heads_q // groups, region.heads_kv // groups)
    replaced = []
    for node in [region.attention, *siblings(region)]:
        emit = Emitter(graph, node)
        _split_call(emit, node, p, region.direction == "backward")
        replaced += emit.replaced
    return replaced


def detail(region, cfg) -> str:
    count = len(siblings(region))
    also = f" and {count} call(s) on local K/V reading its queries" if count else ""
    whole = "gathers, reduce-scatters" if region.style == "allgather" else "rotations"
    return f"G={choose_groups(region, cfg)[0]}: attention call{also} split by head groups ({whole} whole)"


PASS = RegionPass(NAME, stage=POST_GRAD, styles=("allgather", "ring"), why_not=why_not, apply=apply, detail=detail)
