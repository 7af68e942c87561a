"""narrow_rotation: a rotation whose every reader casts the data down travels already cast.

Rings accumulate dK/dV in fp32 and send the accumulator home with a last rotation after the last
attention backward, where nothing hides it; the program casts the gradients to the inputs'
dtype only once they are home. A rotation only moves data and a cast acts on each element
alone, so casting first gives the same bits and sends half the bytes (bf16). Before::

    dkv_home = wait(all_to_all(dkv_fp32))        # 2 x S/cp x H x D fp32
    dk = convert(view(slice(dkv_home)), bf16);  dv = convert(view(slice(dkv_home)), bf16)

After::

    dkv_home = wait(all_to_all(convert(dkv_fp32, bf16)))
    dk = view(slice(dkv_home));  dv = view(slice(dkv_home))

Eligible: every reader of the rotated data reaches a cast through slices, splits and layout ops
only, all to one narrower floating dtype. The rotations that carry a running accumulator on to
the next step are read by additions and keep their dtype. Each rank decides by the code after
its rotation, which ring programs write alike for every rank (the tests compile each rank's
graphs and compare).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..editing.fx_emit import Emitter
from ..analysis.graph_walk import Walk, node_order
from ..analysis.layout_algebra import LAYOUT_OPS, SPLIT_OPS
from ..detect.ring import RingMatch, chained_rotations
from ..record import POST_GRAD, RegionPass
from .transport import only_wait

aten, prims = torch.ops.aten, torch.ops.prims
c10d = torch.ops._c10d_functional
NAME = "narrow_rotation"

_MOVES = set(LAYOUT_OPS) | set(SPLIT_OPS) | {operator.getitem, aten.slice.Tensor, aten.select.int}
_CAST = prims.convert_element_type.default


def _readers(wait: torch.fx.Node):
    """(data-movement nodes in graph order, casts, their dtype) if everything read from ``wait``
    is cast to one narrower floating dtype after moves only; else None."""
    moves, casts = [], []
    def moved(n):  # a cast ends the walk: it is what the rewrite moves
        return [u for u in n.users if u.op == "call_function" and u.target is not _CAST and u.target in _MOVES]

    for node in Walk([wait], moved):
        for user in node.users:
            if user.op != "call_function" or user.args[0] is not node:
                return None
            if user.target is _CAST:
                casts.append(user)
            elif user.target in _MOVES:
                moves.append(user)
            else:
                return None
    dtypes = {c.args[1] for c in casts}
    if len(dtypes) != 1:
        return None
    dtype, source = dtypes.pop(), wait.meta["val"].dtype
    if not (dtype.is_floating_point and source.is_floating_point and dtype.itemsize < source.itemsize):
        return None
    order = node_order(wait.graph)
    return sorted(moves, key=order.__getitem__), casts, dtype


def _narrowable(region: RingMatch) -> list:
    out = []
    for rot in chained_rotations(region):
        wait = only_wait(rot)
        readers = _readers(wait) if wait is not None else None
        if readers is not None:
            out.append((rot, wait, *readers))
    return out


def why_not(region: RingMatch, cfg, verdicts) -> str | None:
    if region.direction != "backward":
        return "a forward region: attention reads its rotated K/V as they are"
    for earlier in verdicts.earlier:
        if earlier.applies:
            return f"{earlier.name} sends the home contribution itself (narrowed where exact)"
    if not _narrowable(region):
        return "no rotation of its dK/dV is read only through a cast to a narrower dtype (running accumulators travel on; an fp32 program casts nothing)"
    return None


def apply(graph: torch.fx.Graph, region: RingMatch, cfg) -> list:
    replaced = []
    for rot, wait, moves, casts, dtype in _narrowable(region):
        emit = Emitter(graph, rot)
        sent = emit(c10d.all_to_all_single.default, emit(_CAST, rot.args[0], dtype), *rot.args[1:])
        new = {wait: Emitter(graph, wait)(c10d.wait_tensor.default, sent)}
        for node in moves:  # the same moves on the narrow data, each where the old one was
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: new.get(a, a))
            new[node] = Emitter(graph, node)(node.target, *args, **kwargs)
        for cast in casts:
            emit.replace(cast, new[cast.args[0]])
            graph.erase_node(cast)
        for node in reversed([wait, *moves]):
            graph.erase_node(node)
        graph.erase_node(rot)
        replaced += emit.replaced
    return replaced


def detail(region: RingMatch, cfg) -> str:
    return f"{len(_narrowable(region))} rotation(s) sent cast down"


PASS = RegionPass(NAME, stage=POST_GRAD, styles=("ring",), why_not=why_not, apply=apply, detail=detail)
