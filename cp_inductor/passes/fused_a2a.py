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

from .. import config
from .detect_a2a import A2ACrossing, A2ARegion
from .cost_model import UnpackChoice, choose_unpack
from .fx_emit import Emitter, stride_order
from .layout_algebra import Layout, LayoutError, apply_chain, canonical, plan_relayout
from .region_rewrite import rewrite_regions
from .sdpa_ops import bound_args

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
NAME = "fused_a2a"


def unpack_choice(region: A2ARegion) -> UnpackChoice:
    """Views of the received buffer, one copy out of it, or no rewrite ("skip")
    (``config.fused_a2a_unpack``; "auto": the cost model on this rank's attention shapes, views
    or skip). Forward and backward regions of one attention see the same shapes, so they choose
    alike."""
    if config.fused_a2a_unpack != "auto":
        if config.fused_a2a_unpack not in ("views", "copy"):
            raise ValueError(f"fused_a2a_unpack={config.fused_a2a_unpack!r}: expected auto, views or copy")
        return UnpackChoice(config.fused_a2a_unpack, "set by config")
    args = bound_args(region.attention)
    q, k = args["query"].meta["val"], args["key"].meta["val"]
    if q.device.type != "cuda":
        # The map is measured on GPUs; elsewhere (the CPU tests) the full rewrite is the default.
        return UnpackChoice("views", f"no cost map for {q.device.type}")
    b, hq, s, d = (int(x) for x in q.shape)
    return choose_unpack(b, s, hq, int(k.shape[1]), d, region.is_causal, q.element_size())


def crossing_groups(region: A2ARegion, unpack: str = "views") -> list[tuple[list, list]]:
    """Crossings to fuse together, each with the attention argument it feeds (None: it leaves)."""
    # Incoming groups first: rewriting them changes attention's output strides, which the
    # outgoing packs then plan from. A lone tensor gains only from the sequence-major layout
    # (its unpack (dO) or pack (out) becomes a view), so it is rewritten only with views.
    views = unpack == "views"
    if "dq" in region.outgoing:
        grad_out = [([region.incoming["grad_out"]], [region.attention.args[0]])]
        return (grad_out if views else []) + [([region.outgoing[n] for n in ("dq", "dk", "dv")], [None] * 3)]
    out = [([region.outgoing["out"]], [None])]
    return [([region.incoming[n] for n in "qkv"], list(region.attention.args[:3]))] + (out if views else [])


def pack_layout(c: A2ACrossing, cp: int) -> Layout:
    """[chunk destination, local seq, batch, heads, head_dim] of this crossing's send."""
    swapped = c.send.all_to_all(cp).pinned  # the factor that chooses the destination rank
    by_role = {"b": [], "h": [], "s": [], "d": []}
    for f, role in c.roles.items():
        if f not in (swapped, c.send.pinned):
            by_role[role].append(f)
    if len(by_role["s"]) != 1 or len(by_role["d"]) != 1 or len(by_role["h"]) > 1:
        raise LayoutError("cannot name sequence, head and head_dim factors")
    dims = ((swapped,), tuple(by_role["s"]), tuple(by_role["b"]), tuple(by_role["h"]), tuple(by_role["d"]))
    return Layout(dims, c.send.pinned)


def ineligible(region: A2ARegion) -> str | None:
    """Why fused_a2a cannot rewrite this region, or None."""
    unpack = unpack_choice(region)
    if unpack.choice == "skip":
        return f"cost model: {unpack.reason}"
    for crossings, _ in crossing_groups(region, unpack.choice):
        reason = _group_ineligible(region, crossings)
        if reason is not None:
            return reason
    return None


def _group_ineligible(region: A2ARegion, crossings: list) -> str | None:
    if (opaque := next((c.opaque for c in crossings if c.opaque), None)) is not None:
        return opaque
    if len({c.a2a for c in crossings}) != len(crossings):
        return "q/k/v (or their gradients) already share one all_to_all"
    vals = [c.a2a.args[0].meta.get("val") for c in crossings]
    if any(v is None for v in vals):
        return "no tensor metadata on an all_to_all input"
    if len({v.dtype for v in vals}) != 1:
        return "q/k/v (or their gradients) have different dtypes"
    for c in crossings:
        # The pack reads c.source and attention may read the buffer directly: a cast on either
        # side of the collective would be skipped.
        ends = [c.source, c.a2a.args[0], c.after[-1] if c.after else c.wait]
        if len({getattr(n.meta.get("val"), "dtype", None) for n in ends}) != 1:
            return "dtype cast between the tensor, the all_to_all and attention"
    try:
        layouts = [pack_layout(c, region.cp) for c in crossings]
        for c, lay in zip(crossings, layouts):
            plan_relayout(c.source_layout, lay)
            plan_relayout(lay.all_to_all(region.cp), c.send.all_to_all(region.cp))
    except LayoutError as e:
        return f"cannot relayout: {e}"
    shapes = [lay.shape for lay in layouts]
    if len({(s[0], s[1], s[2], s[4]) for s in shapes}) != 1:
        return "q/k/v differ in batch, sequence or head_dim"
    return None


def reads_as_view(lay: Layout, c: A2ACrossing, cp: int, attn_arg) -> bool:
    """Whether attention's input ``attn_arg`` is a permuted view of the received buffer.

    ``lay`` is the send ``[cp, S/cp, B, H, D]`` of one tensor, sequence-major, so what arrives
    viewed as ``[B, H, S, D]`` is the attention input unless heads were replicated or reordered
    between the collective and attention."""
    if attn_arg is None or not c.pure:
        return False
    if (c.after[-1] if c.after else c.wait) is not attn_arg:
        return False
    cp_, s_l, b, h, d = lay.shape
    want = apply_chain(c.send.all_to_all(cp), c.after)[-1]
    mine = lay.all_to_all(cp).reshape((cp_ * s_l, b, h, d)).permute((1, 2, 0, 3))
    return [canonical(x) for x in mine.dims] == [canonical(x) for x in want.dims]


def heads_view(emit: Emitter, part) -> torch.fx.Node:
    """``[cp, S/cp, B, H, D]`` received part -> ``[B, H, S, D]`` view (cuDNN and flash read it
    at full speed)."""
    cp_, s_l, b, h, d = part.meta["val"].shape
    return emit(aten.permute.default, emit(aten.view.default, part, [cp_ * s_l, b, h, d]), [1, 2, 0, 3])


def all_to_all(emit: Emitter, buf, cp: int, group: str) -> torch.fx.Node:
    """Equal-split all_to_all_single of ``buf`` along dim 0 (the caller waits on it)."""
    splits = [int(buf.meta["val"].shape[0]) // cp] * cp
    return emit(c10d.all_to_all_single.default, buf, splits, splits, group)


def as_delivered(emit: Emitter, part, lay: Layout, c: A2ACrossing, cp: int) -> torch.fx.Node:
    """The received ``part`` (sent as ``lay``) copied into exactly the layout the old all-to-all
    delivered: everything downstream stays as it was, and Inductor fuses this copy with the
    unpack copy that follows."""
    part = emit.relayout(part, plan_relayout(lay.all_to_all(cp), c.send.all_to_all(cp)))
    return emit(aten.clone.default, part, memory_format=torch.contiguous_format)


def _refresh_meta(node: torch.fx.Node, emit: Emitter) -> None:
    """Recompute an attention node's outputs after its inputs changed strides."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with emit.fake_mode:
        node.meta["val"] = node.target(*args, **kwargs)
    for user in node.users:
        if user.target is operator.getitem:
            user.meta["val"] = node.meta["val"][user.args[1]]


def _rewrite(graph: torch.fx.Graph, region: A2ARegion, crossings: list, attn_args: list, unpack: str) -> list:
    cp, group = region.cp, region.group_name
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_send = max((c.a2a.args[0] for c in crossings), key=order.__getitem__)
    emit = Emitter(graph, last_send.next)

    # Pack straight from where each chain starts (the old pack copies go dead): one copy into
    # the buffer, or none for a lone tensor already sequence-major (cuDNN's output).
    layouts = [pack_layout(c, cp) for c in crossings]
    packs = [emit.relayout(c.source, plan_relayout(c.source_layout, lay)) for c, lay in zip(crossings, layouts)]
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
            like = _layout_required(region, attn_arg)
            view = None if grouped else heads_view(emit, part)
            if unpack == "views" and (like is None or stride_order(view.meta["val"]) == stride_order(like)):
                emit.replace(attn_arg, view, strides=False)
                strided = True
            else:
                # One copy straight into the layout attention had (or, for dO, the layout of O).
                target = like if like is not None else attn_arg.meta["val"]
                emit.replace(attn_arg, _copy_heads(emit, part, target), strides=like is None)
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
    """Received ``[cp, S/cp, B, H, D]`` -> one copy into a ``[B, H, S, D]`` tensor with ``like``'s
    stride order (S = source rank x local position; ``part`` need not be one strided view)."""
    order = stride_order(like)  # over (B, H, S, D)
    order5 = [j for i in order for j in ((2, 3) if i == 2 else (i + (i == 3),))]  # S -> (rank, pos)
    inverse5 = [order5.index(i) for i in range(5)]
    bh = emit(aten.permute.default, part, [2, 3, 0, 1, 4])  # [B, H, cp, S/cp, D]
    dense = emit(aten.clone.default, emit(aten.permute.default, bh, order5), memory_format=torch.contiguous_format)
    return emit(aten.view.default, emit(aten.permute.default, dense, inverse5), list(like.shape))


def _layout_required(region: A2ARegion, attn_arg) -> torch.Tensor | None:
    """The layout an attention input must keep whatever we hand it, or None. cuDNN's backward
    (torch 2.11, cuDNN 9.19, H200) returns wrong gradients when dO's strides differ from O's
    (benchmarks/bench_attention_layouts.py, ``mismatched_do``): dO must be laid out like O."""
    args = bound_args(region.attention)
    if "grad_out" in args and args["grad_out"] is attn_arg and isinstance(args.get("out"), torch.fx.Node):
        return args["out"].meta["val"]
    return None


def _rewrite_region(graph: torch.fx.Graph, region: A2ARegion) -> list:
    unpack = unpack_choice(region).choice
    return [
        r for crossings, attn_args in crossing_groups(region, unpack)
        for r in _rewrite(graph, region, crossings, attn_args, unpack)
    ]


def fused_a2a_pass(graph: torch.fx.Graph) -> None:
    if config.fused_a2a:
        rewrite_regions(graph, ineligible, _rewrite_region, (NAME,))


fused_a2a_pass.rewrite = NAME
