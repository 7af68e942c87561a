"""fused_a2a: the q, k, v all-to-alls of a Ulysses region become ONE all-to-all over one buffer
(forward), and so do the dq, dk, dv all-to-alls (backward).

Before (forward)::

    q -> pack copy -> all_to_all -> wait -> unpack copy -> q_heads -\
    k -> ...                                               k_heads --> attention -> out -> pack -> all_to_all ...
    v -> ...                                               v_heads -/

After::

    cat([q, k, v] relaid as [cp, S/cp, B, H/cp, D], dim=heads) -> all_to_all -> wait -> buf
    q_heads = buf[:, :, :, q heads].view(S, B, Hq/cp, D).permute(1, 2, 0, 3)   # a view, no copy
    out -> relaid [cp, S/cp, B, Hq/cp, D] -> all_to_all ...   # a view when out is sequence-major

The buffer is sequence-major with the three tensors' heads side by side: every chunk a rank
sends is one contiguous block. How attention reads it is chosen per region
(:mod:`cost_model`, ``config.fused_a2a_unpack``); where the measured map says neither way wins,
the region is left as written, with the numbers as the skip reason:

* ``views``: each tensor's whole sequence is a strided view that cuDNN and flash read directly
  (as drawn above); the backward's dO (a lone tensor) is a view too, and out's pack is a view.
* ``copy``: the buffer keeps each tensor's rows together (``[cp, q | k | v]``) and one copy per
  tensor puts it straight into the layout attention had before the rewrite: attention runs
  exactly as under default Inductor, the unpack reads whole blocks as the user's own does; only
  the packs and the collectives are fused. Lone tensors (dO, out) are left as they were.

The backward packs dq, dk, dv into one buffer whose slices are copied back into the layout the
old all-to-alls delivered. Where attention does not read the plain received tensor (heads
replicated or a pointwise op between the collective and attention) the slice is copied into the
old received layout instead and everything downstream is untouched. Collective bytes are
unchanged; launches and copies go down.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from ..editing.fx_emit import Emitter, stride_order
from ..analysis import cudnn_backward_route
from ..analysis.graph_walk import node_order
from ..analysis.layout_algebra import LayoutError, plan_relayout
from ..analysis.sdpa_ops import bound_args
from ..analysis.sym_sizes import equal, may_guard
from ..detect.a2a import A2AMatch
from ..record import POST_GRAD, RegionPass
from .transport import all_to_all
from .ulysses_buffers import (
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
NAME = "fused_a2a"


def why_not(region: A2AMatch, cfg, verdicts=None) -> str | None:
    """Why fused_a2a cannot rewrite this region, or None."""
    unpack = unpack_choice(region, cfg)
    if unpack.choice == "skip":
        return f"cost model: {unpack.reason}"
    for crossings, _ in crossing_groups(region, unpack.choice):
        reason = _group_ineligible(region, crossings)
        if reason is not None:
            return reason
    return None


def _group_ineligible(region: A2AMatch, crossings: list) -> str | None:
    if (opaque := next((c.opaque for c in crossings if c.opaque), None)) is not None:
        return opaque
    if len({c.a2a for c in crossings}) != len(crossings):
        return "q/k/v (or their gradients) already share one all_to_all"
    vals = [c.a2a.args[0].meta.get("val") for c in crossings]
    if any(v is None for v in vals):
        return "no tensor metadata on an all_to_all input"
    if len({v.dtype for v in vals}) != 1:
        return "q/k/v (or their gradients) have different dtypes"
    read_by_attention = {id(c) for c in region.incoming.values()}
    for c in crossings:
        # Attention may read the buffer directly: a cast after the collective would be skipped
        # (a returned tensor keeps its chain after the wait, casts included). One before it
        # (q.to(bf16) ahead of the scatter) the pack makes (packed_source).
        ends = [c.a2a.args[0], c.after[-1] if c.after else c.wait]
        if id(c) in read_by_attention and len({getattr(n.meta.get("val"), "dtype", None) for n in ends}) != 1:
            return "dtype cast between the all_to_all and attention"
        if _cast_chain(c) is None:
            return "the chain to the all_to_all changes dtype other than by casts"
    try:
        layouts = [pack_layout(c, region.cp) for c in crossings]
        for c, lay in zip(crossings, layouts):
            plan_relayout(c.source_layout, lay)
            plan_relayout(lay.all_to_all(region.cp), c.send.all_to_all(region.cp))
    except LayoutError as e:
        return f"cannot relayout: {e}"
    # One buffer needs one batch, sequence and head_dim. Under dynamic shapes q's and k's lengths
    # may be separate symbols; a forward graph guards them equal (self-attention always is).
    shapes = [lay.shape for lay in layouts]
    guard = may_guard(region.attention.graph)
    if not all(equal(s[i], shapes[0][i], guard=guard) for s in shapes[1:] for i in (0, 1, 2, 4)):
        return "q/k/v differ in batch, sequence or head_dim"
    return None


def _cast_chain(c) -> torch.dtype | None:
    """The dtype the pack must cast the crossing's source to (its own where nothing casts), or
    None when something besides a cast changes the dtype on the way to the all-to-all."""
    sent = c.a2a.args[0].meta["val"].dtype
    if c.source.meta["val"].dtype == sent:
        return sent
    casts = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)
    changed = [n for n in c.before if n.meta["val"].dtype != n.args[0].meta["val"].dtype]
    return sent if all(n.target in casts for n in changed) else None


def _refresh_meta(node: torch.fx.Node, emit: Emitter) -> None:
    """Recompute an attention node's outputs after its inputs changed strides."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with emit.fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
    for user in node.users:
        if user.target is operator.getitem:
            user.meta["val"] = node.meta["val"][user.args[1]]


def _rewrite(graph: torch.fx.Graph, region: A2AMatch, crossings: list, attn_args: list, unpack: str, cfg) -> list:
    cp, group = region.cp, region.group_name
    order = node_order(graph)
    last_send = max((c.a2a.args[0] for c in crossings), key=order.__getitem__)
    emit = Emitter(graph, last_send.next)

    # Pack straight from where each chain starts (the old pack copies go dead): one copy into
    # the buffer, or none for a lone tensor already sequence-major (cuDNN's output).
    layouts = [pack_layout(c, cp) for c in crossings]
    packs = [emit.relayout(packed_source(emit, c), plan_relayout(c.source_layout, lay)) for c, lay in zip(crossings, layouts)]
    # views: the tensors' heads side by side ([cp, S/cp, B, Hq+2Hkv, D]), so each is a strided
    # view. copy: each tensor's rows together per destination ([cp, q | k | v]): every unpack then
    # reads whole [S/cp, B, H, D] blocks, as default Inductor's own unpack does (the copy out of
    # the interleaved buffer runs at 0.5-0.8 TB/s on H200, bench_attention_layouts.py unpack_ms).
    grouped = unpack == "copy" and len(packs) > 1
    if grouped:
        buf = emit(aten.cat.default, [emit(aten.reshape.default, p, [cp, -1]) for p in packs], 1)
    else:
        buf = packs[0] if len(packs) == 1 else emit(aten.cat.default, packs, 3)
    recv = emit(c10d.wait_tensor.default, all_to_all(emit, buf, cp, group))

    offset, strided, dead = 0, False, []
    for c, lay, attn_arg in zip(crossings, layouts, attn_args):
        if grouped:
            size = math.prod(lay.shape[1:])
            part = emit(aten.view.default, emit(aten.slice.Tensor, recv, 1, offset, offset + size), list(lay.shape))
            offset += size
        else:
            heads = lay.shape[3]
            part = recv if len(crossings) == 1 else emit(aten.slice.Tensor, recv, 3, offset, offset + heads)
            offset += heads
        if reads_as_view(lay, c, cp, attn_arg):
            like = _layout_required(region, attn_arg, cfg)
            view = None if grouped else heads_view(emit, part, packed=attn_arg.meta["val"].dim() == 3)
            # (view is None only where grouped, and grouped unpacks by "copy")
            if (unpack == "views" and view is not None
                    and (like is None or stride_order(view.meta["val"]) == stride_order(like))):
                emit.replace(attn_arg, view, strides=False)
                strided = True
            else:
                # One copy straight into the layout attention had (or the one dO must keep).
                target = like if like is not None else attn_arg.meta["val"]
                emit.replace(attn_arg, _copy_heads(emit, part, target), strides=target is attn_arg.meta["val"])
            dead.extend(reversed(c.after))  # the old unpack chain
        else:
            emit.replace(c.wait, as_delivered(emit, part, lay, c, cp))
        dead += [c.wait, c.a2a] + c.before[::-1]
    if strided:
        _refresh_meta(region.attention, emit)
    # Erase only now: the emitter's anchor may be one of these nodes.
    for node in dead:
        if not node.users:
            graph.erase_node(node)
    return emit.replaced


def _copy_heads(emit: Emitter, part, like: torch.Tensor) -> torch.fx.Node:
    """Received ``[cp, S/cp, B, H, D]`` -> one copy into a ``[B, H, S, D]`` tensor (a pack's
    ``[T, H, D]``) with ``like``'s stride order (S = source rank x local position; ``part`` need
    not be one strided view)."""
    order = stride_order(like)  # over (B, H, S, D), or a pack's (T, H, D)
    if like.dim() == 3:  # T = (rank, position) stays one dim
        cp_, s_l, _, h, d = part.meta["val"].shape
        tokens_first = emit(aten.reshape.default, part, [cp_ * s_l, h, d])
        dense = emit(aten.clone.default, emit(aten.permute.default, tokens_first, order), memory_format=torch.contiguous_format)
        return emit(aten.permute.default, dense, [order.index(i) for i in range(3)])
    order5 = [j for i in order for j in ((2, 3) if i == 2 else (i + (i == 3),))]  # S -> (rank, pos)
    inverse5 = [order5.index(i) for i in range(5)]
    bh = emit(aten.permute.default, part, [2, 3, 0, 1, 4])  # [B, H, cp, S/cp, D]
    dense = emit(aten.clone.default, emit(aten.permute.default, bh, order5), memory_format=torch.contiguous_format)
    return emit(aten.view.default, emit(aten.permute.default, dense, inverse5), list(like.shape))


def _layout_required(region: A2AMatch, attn_arg, cfg) -> torch.Tensor | None:
    """The layout an attention input must keep whatever we hand it, or None. dO: laid out like
    O, which every backward kernel reads without a copy of its own; but where cuDNN's backward
    stays on aten's op (``analysis/cudnn_backward_route``), whose plan cache ignores dO's layout,
    dO keeps the layout the program gave it, as eager and default Inductor pass it."""
    args = bound_args(region.attention)
    if "grad_out" not in args or args["grad_out"] is not attn_arg or not isinstance(args.get("out"), torch.fx.Node):
        return None
    node = region.attention
    if cudnn_backward_route.is_cudnn_backward(node) and cudnn_backward_route.route(node, cfg).path == cudnn_backward_route.ATEN:
        return attn_arg.meta["val"]
    return args["out"].meta["val"]


def apply(graph: torch.fx.Graph, region: A2AMatch, cfg) -> list:
    unpack = unpack_choice(region, cfg).choice
    return [
        r for crossings, attn_args in crossing_groups(region, unpack)
        for r in _rewrite(graph, region, crossings, attn_args, unpack, cfg)
    ]


def detail(region: A2AMatch, cfg) -> str:
    unpack = unpack_choice(region, cfg)  # why_not already asked: it cannot fail here
    return f"unpack={unpack.choice} ({unpack.reason})"


PASS = RegionPass(NAME, stage=POST_GRAD, styles=("a2a",), why_not=why_not, apply=apply, detail=detail, packed=True)
