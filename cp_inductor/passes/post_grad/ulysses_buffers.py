"""What fused_a2a and head_overlap share: how a Ulysses region's tensors are laid out in the
one buffer an all-to-all sends, and how attention reads what arrives.

The send buffer of one tensor is ``[cp, S/cp, B, H, D]`` (destination rank, local position,
batch, heads, head_dim): sequence-major, so each destination's chunk is one contiguous block and
what arrives, viewed as ``[B, H, S, D]``, is attention's input with no copy. A pack of sequences
(THD) has no batch: ``[cp, T/cp, 1, H, D]`` arrives as the ``[T, H, D]`` varlen attention reads.
"""

from __future__ import annotations

import torch
import torch.fx

from ..analysis.cost_model import UnpackChoice, choose_unpack
from ..editing.fx_emit import Emitter
from ..analysis.layout_algebra import Layout, LayoutError, apply_chain, canonical, plan_relayout
from ..analysis.sdpa_ops import bound_args
from ..analysis.sym_sizes import hint, size_of
from ..detect.a2a import A2ACrossing, A2AMatch

aten = torch.ops.aten


# Packed sequences on GPUs: one rank's compute of Ulysses over a pack (H200, fake group, rank 0 of
# cp = 2, T64K, 8 random documents, cuDNN ragged attention; bench_thd.py --fake-rank, JSON
# run log h200_thd_ulysses_unpack_fake_rank0of2_2026-12-02.json (git history)): the program's own
# unpack 27.18 / 52.14 ms at D128 / D256, fused_a2a with one copy 27.65 / 53.01, with views
# 28.16 / 53.71. The 0.5-0.9 ms it adds exceed what its 4 fewer collectives save (about 0.16 ms,
# SAVED_COLLECTIVE_MS), so packs keep their all-to-alls unless the config forces an unpack.
PACKED_SKIP = ("packed sequences: fused_a2a measured 1.7% slower per rank than the program's own unpack "
               "(H200, T64K D128/D256), more than its 4 fewer collectives save; fused_a2a_unpack='copy' forces it")


def unpack_choice(region: A2AMatch, cfg) -> UnpackChoice:
    """Views of the received buffer, one copy out of it, or no rewrite ("skip")
    (``cfg.fused_a2a_unpack``; "auto": the cost model on this rank's attention shapes, views
    or skip). Forward and backward regions of one attention see the same shapes, so they choose
    alike."""
    if cfg.fused_a2a_unpack != "auto":
        if cfg.fused_a2a_unpack not in ("views", "copy"):
            raise ValueError(f"fused_a2a_unpack={cfg.fused_a2a_unpack!r}: expected auto, views or copy")
        return UnpackChoice(cfg.fused_a2a_unpack, "set by config")
    args = bound_args(region.attention)
    q, k = args["query"].meta["val"], args["key"].meta["val"]
    if q.device.type != "cuda":
        # The map is measured on GPUs; elsewhere (the CPU tests) the full rewrite is the default.
        return UnpackChoice("views", f"no cost map for {q.device.type}")
    if q.dim() == 3:
        return UnpackChoice("skip", PACKED_SKIP)
    # Symbolic sizes: the map is read at the traced ones (the report says which).
    b, hq, s, d = (hint(size_of(x)) for x in q.shape)
    choice = choose_unpack(b, s, hq, hint(size_of(k.shape[1])), d, region.is_causal, q.element_size())
    if any(not isinstance(size_of(x), int) for x in (*q.shape, *k.shape)):
        choice = UnpackChoice(choice.choice, f"{choice.reason}; sizes symbolic, read at the traced B{b} S{s}")
    return choice


def crossing_groups(region: A2AMatch, unpack: str = "views") -> list[tuple[list, list]]:
    """Crossings to fuse together, each with the attention argument it feeds (None: it leaves)."""
    # Incoming groups first: rewriting them changes attention's output strides, which the
    # outgoing packs then plan from. A lone tensor gains only from the sequence-major layout
    # (its unpack (dO) or pack (out) becomes a view), so it is rewritten only with views.
    views = unpack == "views"
    if region.direction == "backward":
        grad_out = [([region.incoming["grad_out"]], [region.attention.args[0]])]
        return (grad_out if views else []) + [([region.outgoing[n] for n in ("dq", "dk", "dv")], [None] * 3)]
    out = [([region.outgoing["out"]], [None])]
    return [([region.incoming[n] for n in "qkv"], list(region.attention.args[:3]))] + (out if views else [])


def pack_layout(c: A2ACrossing, cp: int) -> Layout:
    """[chunk destination, local seq, batch, heads, head_dim] of this crossing's send."""
    # (refreshed: a forward graph may have guarded symbolic head counts since detection)
    swapped = c.send.all_to_all(cp).pinned.refreshed()  # the factor that chooses the destination rank
    by_role: dict[str, list] = {"b": [], "h": [], "s": [], "d": []}
    for f, role in c.roles.items():
        if f.refreshed() not in (swapped, c.send.pinned.refreshed()):
            by_role[role].append(f.refreshed())
    if len(by_role["s"]) != 1 or len(by_role["d"]) != 1 or len(by_role["h"]) > 1:
        raise LayoutError("cannot name sequence, head and head_dim factors")
    dims = ((swapped,), tuple(by_role["s"]), tuple(by_role["b"]), tuple(by_role["h"]), tuple(by_role["d"]))
    return Layout(dims, c.send.pinned)


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
    if len(want.dims) == 3:  # a pack: [T, H, D]
        mine = lay.all_to_all(cp).reshape((cp_ * s_l, h, d))
    else:
        mine = lay.all_to_all(cp).reshape((cp_ * s_l, b, h, d)).permute((1, 2, 0, 3))
    return [canonical(x) for x in mine.refreshed().dims] == [canonical(x) for x in want.refreshed().dims]


def heads_view(emit: Emitter, part, packed: bool = False) -> torch.fx.Node:
    """``[cp, S/cp, B, H, D]`` received part -> ``[B, H, S, D]`` view (cuDNN and flash read it
    at full speed); ``packed``: -> a pack's ``[T, H, D]``."""
    cp_, s_l, b, h, d = part.meta["val"].shape
    if packed:
        return emit(aten.view.default, part, [cp_ * s_l, h, d])
    return emit(aten.permute.default, emit(aten.view.default, part, [cp_ * s_l, b, h, d]), [1, 2, 0, 3])


def as_delivered(emit: Emitter, part, lay: Layout, c: A2ACrossing, cp: int) -> torch.fx.Node:
    """The received ``part`` (sent as ``lay``) copied into exactly the layout the old all-to-all
    delivered: everything downstream stays as it was, and Inductor fuses this copy with the
    unpack copy that follows."""
    part = emit.relayout(part, plan_relayout(lay.all_to_all(cp), c.send.all_to_all(cp)))
    return emit(aten.clone.default, part, memory_format=torch.contiguous_format)


def packed_source(emit: Emitter, c) -> torch.fx.Node:
    """The crossing's source cast to the dtype it travels in (a cast in its chain, which the
    pack copy then does)."""
    dtype = c.a2a.args[0].meta["val"].dtype
    if c.source.meta["val"].dtype == dtype:
        return c.source
    return emit(torch.ops.prims.convert_element_type.default, c.source, dtype)
