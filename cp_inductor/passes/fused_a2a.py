"""fused_a2a: the q, k, v all-to-alls of a Ulysses region become ONE all-to-all over one buffer
(forward), and so do the dq, dk, dv all-to-alls (backward).

Before::

    q_send -> all_to_all -> wait -> q_recv -> unpack -> attention        (k, v likewise)

After::

    cat([pack(q_send), pack(k_send), pack(v_send)], heads)   # [cp, S/cp, B, Hq/cp + 2*Hkv/cp, D]
      -> all_to_all -> wait -> buf
    contiguous(relayout(buf[..., q heads, :])) -> unpack -> attention  # same layout q_recv had

The buffer is sequence-major with the three tensors' heads side by side, so every chunk a rank
sends is one contiguous block. Each slice is made contiguous in exactly the layout the old
all-to-all delivered, so everything downstream (attention, saved tensors, backward) is untouched;
Inductor fuses that copy with the unpack copy that follows. One collective launch instead of
three; the bytes are the same.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._dynamo.utils import counters
from torch._inductor.pattern_matcher import stable_topological_sort

from .. import config
from .detect_a2a import A2ACrossing, A2ARegion, find_regions
from .fx_emit import Emitter
from .layout_algebra import Layout, LayoutError, plan_relayout

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
NAME = "fused_a2a"


def _crossings(region: A2ARegion) -> list[A2ACrossing]:
    if "dq" in region.outgoing:
        return [region.outgoing[n] for n in ("dq", "dk", "dv")]
    return [region.incoming[n] for n in ("q", "k", "v")]


def _pack_layout(c: A2ACrossing, cp: int) -> Layout:
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
    crossings = _crossings(region)
    vals = [c.a2a.args[0].meta.get("val") for c in crossings]
    if any(v is None for v in vals):
        return "no tensor metadata on an all_to_all input"
    if len({v.dtype for v in vals}) != 1:
        return "q/k/v (or their gradients) have different dtypes"
    try:
        layouts = [_pack_layout(c, region.cp) for c in crossings]
        for c, lay in zip(crossings, layouts):
            plan_relayout(c.send, lay)
            plan_relayout(lay.all_to_all(region.cp), c.send.all_to_all(region.cp))
    except LayoutError as e:
        return f"cannot relayout: {e}"
    shapes = [lay.shape for lay in layouts]
    if len({(s[0], s[1], s[2], s[4]) for s in shapes}) != 1:
        return "q/k/v differ in batch, sequence or head_dim"
    return None


def _rewrite(graph: torch.fx.Graph, region: A2ARegion) -> None:
    crossings = _crossings(region)
    cp, group = region.cp, region.group_name
    order = {n: i for i, n in enumerate(graph.nodes)}
    sends = [c.a2a.args[0] for c in crossings]
    last_send = max(sends, key=order.__getitem__)
    emit = Emitter(graph, last_send.next)

    layouts = [_pack_layout(c, cp) for c in crossings]
    packs = [emit.relayout(s, plan_relayout(c.send, lay)) for s, c, lay in zip(sends, crossings, layouts)]
    buf = emit(aten.cat.default, packs, 3)
    n0 = int(buf.meta["val"].shape[0])
    splits = [n0 // cp] * cp
    recv = emit(c10d.wait_tensor.default, emit(c10d.all_to_all_single.default, buf, splits, splits, group))

    offset = 0
    for c, lay in zip(crossings, layouts):
        heads = lay.shape[3]
        part = emit(aten.slice.Tensor, recv, 3, offset, offset + heads)
        offset += heads
        part = emit.relayout(part, plan_relayout(lay.all_to_all(cp), c.send.all_to_all(cp)))
        part = emit(aten.clone.default, part, memory_format=torch.contiguous_format)
        c.wait.replace_all_uses_with(part)
    for c in crossings:
        graph.erase_node(c.wait)
        graph.erase_node(c.a2a)


def fused_a2a_pass(graph: torch.fx.Graph) -> None:
    if not config.fused_a2a:
        return
    changed = False
    for region in find_regions(graph, "post_grad"):
        if ineligible(region) is None:
            _rewrite(graph, region)
            counters["cp_inductor"][NAME] += 1
            changed = True
    if changed:
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
        graph.lint()


fused_a2a_pass.rewrite = NAME
