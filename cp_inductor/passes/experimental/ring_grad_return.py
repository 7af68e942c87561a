"""ring_grad_return: at cp = 2 a ring's backward sends each rank's contribution to the peer's
dK/dV home once, instead of sending the accumulator around and back.

A ring's dK/dV accumulator travels with its K/V block: at cp = 2 the owner sends its own
contribution to the peer (rotation A), the peer adds its contribution and sends the sum home
(rotation B), which nothing hides: it follows the last attention backward. Before::

    acc = f0(dK0)                               # the owner's step-0 contribution, fp32
    r = wait(all_to_all(acc))                   # A: to the peer
    ... step-1 attention backward -> c         # the peer's contribution to the K/V it holds
    home = wait(all_to_all(r + c))              # B: the sum, home
    dK = home

After::

    ... step-1 attention backward -> c
    d = wait-later(all_to_all(0 + c))           # only the contribution
    ... step-0 attention backward -> acc        # moved after the send: the transfer hides under it
    dK = acc + d

Exact: every element of ``r + c`` holds one accumulator element plus at most one contribution
(checked: at most one addition on every path from ``r`` to what B sends), so ``acc + (0 + c)``
is the same fp32 addition as the peer's ``r + c`` with ``r = acc`` (addition commutes; a
contribution of -0.0 may come home as +0.0). ``0 + c`` travels in the accumulator's dtype: what a
rank sends must not depend on what only its graph shows (native CP causal without load balance:
rank 0 has no step-1 attention and sends zeros), and the transfer hides under the step-0
backward anyway.

Needs cp = 2, a backward region whose dK/dV take two rotations (A, then B home) where what B
sends depends on A's result only through layout ops, slices, ``slice_scatter``, ``cat`` and one
addition per element, and A's result read nowhere else. Each rank decides by its own graph,
which native CP and hand-written rings write alike for both ranks in these respects (the tests
compile both ranks). Off by default: not measured on GPUs yet.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..editing.fx_emit import Emitter
from ..analysis.graph_walk import Walk, node_order
from ..analysis.layout_algebra import LAYOUT_OPS, SPLIT_OPS
from ..analysis.graph_walk import ancestors, descendants
from ..detect.ring import RingMatch, rotation, rotations_fed
from ..record import POST_GRAD, RegionPass
from ..post_grad.transport import only_wait

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
NAME = "ring_grad_return"

# Ops through which the received accumulator may reach what B sends: pure moves and updates of
# slices (each keeps one accumulator element per output element).
_MOVES = set(LAYOUT_OPS) | set(SPLIT_OPS) | {operator.getitem, aten.slice.Tensor, aten.select.int}
_UPDATES = {aten.slice_scatter.default, aten.cat.default, aten.add.Tensor}


def _pair(region: RingMatch):
    """(A, B, their waits): B a rotation that sends home what is made from A's received
    accumulator, with A or B among the rotations the region's dK/dV take (the step-0 region
    reaches A, the step-1 region B: whichever comes first in the graph rewrites the pair, before
    ce_rotation moves either); None if there is no such pair."""
    for rot in region.moved_by:
        if rot._erased or rotation(rot) is None:
            continue
        above = _rotations_feeding(rot)
        if len(above) == 1:
            a, b = above.pop(), rot
        else:
            wait = only_wait(rot)
            below = rotations_fed(wait) if wait is not None else set()
            if len(below) != 1:
                continue
            a, b = rot, below.pop()
        waits = [only_wait(a), only_wait(b)]
        if None not in waits:
            return (a, b, *waits)
    return None


def _rotations_feeding(rot: torch.fx.Node) -> set:
    """The rotations whose received data ``rot``'s payload is made from."""
    def received(n):
        return n.target is c10d.wait_tensor.default and rotation(n.args[0]) is not None

    return {n.args[0] for n in Walk([rot.args[0]], lambda n: () if received(n) else n.all_input_nodes) if received(n)}


def _path(start: torch.fx.Node, end: torch.fx.Node) -> list | None:
    """Nodes on every path from ``start`` down to ``end`` in graph order, or None when one of
    them is read off the path or is not a move, a slice update or an addition."""
    order = node_order(start.graph)
    below = {u for u in descendants([start]) if order[u] <= order[end]}  # what start reaches first
    if end not in below:
        return None
    above = (ancestors([end]) & below) | {end}  # ... that end depends on
    path = sorted(above, key=order.__getitem__)
    for n in path:
        if n.op != "call_function" or n.target not in _MOVES | _UPDATES:
            return None
        if n is not end and any(u not in above for u in n.users):
            return None
    for u in start.users:
        if u not in above:
            return None
    return path


def _one_addition_per_element(start: torch.fx.Node, path: list) -> bool:
    """Whether every path from ``start`` through ``path`` passes at most one addition."""
    on_path = set(path) | {start}
    adds = {start: 0}
    for n in path:
        inputs = n.all_input_nodes
        if n.target is aten.slice.Tensor:
            inputs = [_untouched_source(n)]  # a slice_scatter elsewhere did not add here
        counts = [adds[a] for a in inputs if a in adds]
        if n.target is aten.add.Tensor:
            if sum(a in on_path for a in n.args[:2]) != 1:  # accumulator + contribution
                return False
            counts = [c + 1 for c in counts]
        adds[n] = max(counts)
        if adds[n] > 1:
            return False
    return True


def _untouched_source(node: torch.fx.Node) -> torch.fx.Node:
    """For ``x[s:e]`` along a dim: the tensor it reads, skipping ``slice_scatter`` ops along that
    dim that wrote outside [s, e) (the K half updated, then the V half read)."""
    x, d, s, e = (list(node.args) + [0, None, None])[:4]
    shape = x.meta["val"].shape
    d = d % len(shape)
    s = 0 if s is None else (s + shape[d] if s < 0 else s)
    e = shape[d] if e is None else min(shape[d], e + shape[d] if e < 0 else e)
    while x.op == "call_function" and x.target is aten.slice_scatter.default:
        xd, xs, xe = (list(x.args) + [0, None, None])[2:5]
        n = x.meta["val"].shape[d]
        xs = 0 if xs is None else (xs + n if xs < 0 else xs)
        xe = n if xe is None else min(n, xe + n if xe < 0 else xe)
        if xd % len(shape) != d or not (xe <= s or e <= xs):
            break
        x = x.args[0]
    return x


def _plan(region: RingMatch):
    pair = _pair(region)
    if pair is None:
        return None, "its dK/dV do not go home by a rotation that sends on one received accumulator"
    a, b, wait_a, wait_b = pair
    path = _path(wait_a, b.args[0])
    if path is None:
        return None, "what the home rotation sends is not the received accumulator moved, slice-updated and added to"
    if not _one_addition_per_element(wait_a, path):
        return None, "an element of the accumulator gets more than one addition on its way home (the sum would change order)"
    if a.args[0].meta["val"].shape != b.args[0].meta["val"].shape:
        return None, "the two rotations carry different shapes"
    return (a, b, wait_a, wait_b, path), None


def why_not(region: RingMatch, cfg, verdicts) -> str | None:
    if region.direction != "backward":
        return "a forward region: the rewrite returns dK/dV"
    if region.cp != 2:
        return f"cp={region.cp}: only at cp = 2 is the home rotation the peer's only contribution"
    return _plan(region)[1]


def apply(graph: torch.fx.Graph, region: RingMatch, cfg) -> list:
    plan, _ = _plan(region)
    if plan is None:  # the other backward region of the pair has done it
        return []
    a, b, wait_a, wait_b, path = plan
    acc = a.args[0]
    step0 = _attention_above(acc)
    emit = Emitter(graph, b)
    zeros = emit(aten.full.default, list(wait_a.meta["val"].shape), 0.0, dtype=wait_a.meta["val"].dtype,
                 device=wait_a.meta["val"].device)
    copied = {wait_a: zeros}
    for n in path:  # the peer's contribution alone: the same ops on zeros
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: copied.get(x, x))
        copied[n] = emit(n.target, *args, **kwargs)
    # In the accumulator's dtype: what each rank sends must not depend on what only its own
    # graph shows (a rank with no step-1 attention sends zeros; the peer's contribution may be
    # an exact bf16 upcast, but a per-rank choice of dtype would split one collective in two).
    sent = copied[b.args[0]]
    rot = emit(c10d.all_to_all_single.default, sent, *b.args[1:])
    received = Emitter(graph, wait_b)(c10d.wait_tensor.default, rot)
    home = Emitter(graph, wait_b)(aten.add.Tensor, acc, received)
    emit.replace(wait_b, home)
    for n in [wait_b, b, *reversed(path), wait_a, a]:
        if not n.users:
            graph.erase_node(n)
    if step0 is not None:
        _move_after(step0, rot)
    return emit.replaced


def _attention_above(node: torch.fx.Node):
    """The last attention backward the owner's accumulator is made from (its step 0), or None."""
    from ..analysis.sdpa_ops import SDPA_BACKWARD

    def is_backward(n):
        return n.op == "call_function" and n.target in SDPA_BACKWARD

    found = [n for n in Walk([node], lambda n: () if is_backward(n) else n.all_input_nodes) if is_backward(n)]
    return max(found, key=node_order(node.graph).__getitem__) if found else None


def _move_after(step0: torch.fx.Node, rot: torch.fx.Node) -> None:
    """Move the step-0 attention backward, and what reads it before ``rot``, after ``rot``: the
    transfer then travels under it. Left in place if ``rot`` depends on any of it."""
    order = node_order(rot.graph)
    if order[step0] > order[rot]:
        return
    moved = {step0} | {u for u in descendants([step0]) if order[u] < order[rot] and u.op == "call_function"}
    if moved & ancestors([rot]):
        return
    anchor = rot
    for n in sorted(moved, key=order.__getitem__):
        anchor.append(n)
        anchor = n


def detail(region: RingMatch, cfg) -> str:
    return "the step-1 contribution sent home once, the step-0 backward after it"


PASS = RegionPass(NAME, stage=POST_GRAD, styles=("ring",), why_not=why_not, apply=apply, detail=detail)
