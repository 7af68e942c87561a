"""Find ring CP attention regions in an ATen graph: K/V rotate from rank to rank.

A rotation is an ``all_to_all_single`` that sends the whole tensor to one rank and receives the
whole tensor from one rank (one non-zero split size on each side): ``funcol.permute_tensor``,
PyTorch native CP's all-to-all rotation, a hand-written ring's autograd all-to-all. A forward
region::

    kv_local -> rotate -> wait -> rotate -> wait -> ...     (step s: s rotations)
                           |                  |
                    split / view         split / view
                           v                  v
    q_local ------> attention(q, k, v)   attention(q, k, v) ... -> merged by log-sum-exp

One attention op is one match; its ``step`` is the number of rotations its K/V went through.
Step 0 reads local K/V: it is a region when those K/V are what the first rotation sends. Between the wait and
attention any layout op, ``cat``/``split`` (K and V rotated as one flat buffer), slice (the
zigzag layout's halves) or cast may sit. q must not rotate (query-rotating rings are reported
with that reason).

A backward region is an attention backward op whose dK and dV reach a rotation (each step's
gradients travel back to the rank that owns those K/V) through accumulation and layout ops,
while dQ stays on this rank.

The rewrites of ring regions: ``ce_rotation`` (rotations by the copy engines).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.fx

from ..analysis.graph_walk import MAX_NODES, Walk, node_order
from ..analysis.layout_algebra import SPLIT_OPS, LayoutError, is_layout_op, is_value_op
from ..analysis.match import CPMatch, attention_facts
from ..analysis.sdpa_ops import SDPA_FORWARD, bound_args
from ..analysis.sym_sizes import NotASize, size_of
from . import find_with, in_graph_order, kv_gradients_reach, match_or_none, moved_from, query_layout, reached_below
from .allgather import ACCUMULATE_OPS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass
class RingMatch(CPMatch):
    """An attention op of a ring region: the rotations its K/V went through (forward) or its
    dK/dV go back through (backward)."""

    style: ClassVar[str] = "ring"
    rotations: tuple = field(default_factory=tuple)  # all_to_all_single nodes, graph order
    # Every rotation that carries this op's K and V (both, where they rotate separately) or its
    # dK/dV, graph order: what a transport rewrite replaces.
    moved_by: tuple = field(default_factory=tuple)

    @property
    def step(self) -> int:
        return len(self.rotations)

    def describe(self) -> str:
        if self.direction == "backward":
            return super().describe()
        return f"Hq={self.heads_q} Hkv={self.heads_kv} step={self.step}" + (" causal" if self.is_causal else "")


STYLE = RingMatch.style


def rotation(node) -> tuple[int, str] | None:
    """(cp, group) if ``node`` is an all_to_all_single that moves its whole input to one rank
    and receives one rank's whole tensor, else None."""
    # Dynamo's graphs call the op packet, AOTAutograd's the overload.
    if not isinstance(node, torch.fx.Node) or node.target not in (c10d.all_to_all_single.default, c10d.all_to_all_single):
        return None
    if len(node.args) < 4:  # splits or group passed by keyword: not a form we read
        return None
    _, out_splits, in_splits, group = node.args[:4]
    if not isinstance(out_splits, (list, tuple)) or not isinstance(in_splits, (list, tuple)):
        return None
    try:  # sizes, not SymInts: a SymInt's truth value would add a guard
        out_splits, in_splits = [size_of(s) for s in out_splits], [size_of(s) for s in in_splits]
    except NotASize:
        return None
    if sum(1 for s in out_splits if s != 0) != 1 or sum(1 for s in in_splits if s != 0) != 1:
        return None
    return len(out_splits), group


# Set by a pass on a call that rotates K/V inside it (the ring the context-parallel pass inserts,
# an autograd.Function AOTAutograd traces through): the graph rotates, though no node of it does.
ROTATES_INSIDE = "cp_rotates_inside"


def rotates(node) -> bool:
    """Whether ``node`` is a rotation or a call marked as rotating inside (``ROTATES_INSIDE``)."""
    return rotation(node) is not None or (isinstance(node, torch.fx.Node) and bool(node.meta.get(ROTATES_INSIDE)))


def _rotation_of_wait(node):
    if isinstance(node, torch.fx.Node) and node.target is c10d.wait_tensor.default and rotation(node.args[0]):
        return node.args[0]
    return None


def _walk_up(node) -> tuple[set, set]:
    """(what an attention input is a relabelling, piece, cast or concatenation of, the rotations
    on the way): walking up through layout, value, cat and split ops, and through each rotation
    to the ones before it."""
    found = set()

    def expand(n):
        rot = _rotation_of_wait(n)
        if rot is not None:
            found.add(rot)
            return [rot.args[0]]
        if n.op == "call_function" and n.target is aten.cat.default:
            return n.args[0]
        if is_layout_op(n) or is_value_op(n) or (n.op == "call_function" and n.target in SPLIT_OPS):
            return [n.args[0]]
        return ()

    return Walk([node], expand).run().seen, found


def _rotations_above(node) -> set:
    return _walk_up(node)[1]


def _sending_rotations(node) -> set:
    """The rotations that send an attention input on to the next rank (step 0 of a ring: local
    K/V, flattened and concatenated into the buffer the first rotation sends)."""
    return reached_below(
        _walk_up(node)[0], rotation,
        lambda u: is_layout_op(u) or is_value_op(u) or u.target is aten.cat.default, MAX_NODES,
    )


def _rotations_below(node) -> set:
    """The rotations a gradient reaches going down through accumulation and layout ops."""
    return reached_below(
        [node], rotation, lambda u: is_layout_op(u) or is_value_op(u) or u.target in ACCUMULATE_OPS, MAX_NODES
    )


def _one_group(rotations, what: str) -> tuple[int, str]:
    groups = {rotation(r) for r in rotations}
    if len(groups) != 1:
        raise LayoutError(f"{what} rotate over different groups")
    group = next(iter(groups))
    assert group is not None  # the rotations are nodes rotation() read
    return group


def _forward_match(node, graph_kind) -> RingMatch | None:
    args = bound_args(node)
    k, v = _rotations_above(args["key"]), _rotations_above(args["value"])
    if not k and not v:
        return _step_zero(node, args, graph_kind)
    if not (k and v):
        raise LayoutError("only one of key and value rotates")
    if _rotations_above(args["query"]):
        raise LayoutError("the query rotates (query-rotating rings are not supported)")
    if len(k) != len(v):
        raise LayoutError("key and value went through different numbers of rotations")
    cp, group = _one_group(k | v, "key and value")
    return RingMatch(
        graph_kind=graph_kind, attention=node, cp=cp, group_name=group, layout=query_layout(args["query"]),
        rotations=in_graph_order(k, node.graph), moved_by=in_graph_order(k | v, node.graph), **attention_facts(args),
    )


def _step_zero(node, args, graph_kind) -> RingMatch | None:
    """Attention on local K/V that the same rank sends around the ring: its step 0."""
    sent = {name: _sending_rotations(args[name]) for name in ("key", "value")}
    if not (sent["key"] and sent["value"]) or _rotations_above(args["query"]):
        return None
    cp, group = _one_group(sent["key"] | sent["value"], "key and value")
    return RingMatch(
        graph_kind=graph_kind, attention=node, cp=cp, group_name=group, layout=query_layout(args["query"]),
        **attention_facts(args),
    )


def _backward_match(node, graph_kind) -> RingMatch | None:
    below = kv_gradients_reach(
        node, _rotations_below, "only one of dK and dV rotates back",
        "dQ rotates too (query-rotating rings are not supported)",
    )
    if below is None:
        return None
    cp, group = _one_group(below["dk"] | below["dv"], "dK and dV")
    args = bound_args(node)
    return RingMatch(
        graph_kind=graph_kind, attention=node, cp=cp, group_name=group, layout=query_layout(args["grad_out"]),
        rotations=in_graph_order(below["dk"] | below["dv"], node.graph),
        moved_by=in_graph_order(below["dk"] | below["dv"], node.graph), **attention_facts(args),
    )


def _match(node, graph_kind) -> RingMatch | None:
    if node.target in SDPA_FORWARD:
        return _forward_match(node, graph_kind)
    return _backward_match(node, graph_kind)


def chained_rotations(match: RingMatch) -> list:
    """The rotations ``match`` carries, and the rotations its data goes on through that no
    region of this rank carries (graph order). A transport or dtype choice must cover those too:
    a rank whose later ring steps have no attention (native CP causal without load balance: rank
    0 skips the peer's future block) has no region for them, and the peer, which has one, must
    not send through that collective differently (another dtype, another transport: a hang)."""
    order = node_order(match.attention.graph)
    own = [r for r in match.moved_by if not r._erased and rotation(r) is not None]
    candidates = []
    for rot in own:
        candidates += _fed_by(rot)
    if not own and match.direction == "forward":  # step 0: the rotations that send its K/V
        args = bound_args(match.attention)
        candidates += list(_sending_rotations(args["key"]) | _sending_rotations(args["value"]))
    def uncarried(rots):
        return [r for r in rots if r not in own and not r._erased and not _carried(r)]

    found = Walk(own + uncarried(candidates), lambda rot: uncarried(_fed_by(rot))).run().seen
    return sorted(found, key=order.__getitem__)


def _fed_by(rot) -> list:
    waits = [u for u in rot.users if u.target is c10d.wait_tensor.default]
    return list(rotations_fed(waits[0])) if len(waits) == 1 else []


def _carried(rot) -> bool:
    """Whether a region of this graph carries ``rot``: an attention reads what it delivers
    (forward) or an attention backward's dK/dV reach what it sends (backward), with no other
    rotation in between."""
    from ..analysis.sdpa_ops import SDPA_BACKWARD

    attention = set(SDPA_FORWARD) | set(SDPA_BACKWARD)
    waits = [u for u in rot.users if u.target is c10d.wait_tensor.default]
    def is_call(u, targets=None):
        return u.op == "call_function" and (targets is None or u.target in targets)

    down = Walk(waits, lambda n: [u for u in n.users if is_call(u) and rotation(u) is None])  # what it delivers
    if any(is_call(u, attention) for n in down for u in n.users):
        return True
    up = Walk([rot.args[0]], lambda n: n.all_input_nodes if _rotation_of_wait(n) is None else ())  # what it sends
    return any(is_call(n, SDPA_BACKWARD) for n in up)


def rotations_fed(wait: torch.fx.Node) -> set:
    """The rotations the data received at ``wait`` is sent on by."""
    return reached_below([wait], lambda u: rotation(u) is not None, lambda u: u.op == "call_function", MAX_NODES)


def find(graph: torch.fx.Graph, graph_kind: str, cfg, log=None) -> list[RingMatch]:
    """Every ring attention op in ``graph``; ``log(node, reason)`` hears why an attention op
    that rotated data reaches is not a region (ops no rotation reaches are not this detector's)."""
    return find_with(_match, graph, graph_kind, cfg, log)


def match_at(node: torch.fx.Node, graph_kind: str, cfg) -> RingMatch | None:
    return match_or_none(_match, node, graph_kind, cfg)


def received_point_to_point(node: torch.fx.Node) -> bool:
    """Whether attention ``node``'s key or value is (a relabelling of) what a ``batch_p2p_ops``
    received: a ring written with ``batch_isend_irecv`` (ring-flash-attention's way), which
    Dynamo traces only with TORCHDYNAMO_ENABLE_P2P_COMPILATION=1."""
    args = bound_args(node)
    for name in ("key", "value"):
        for end in moved_from(args[name])[0]:
            src = end.args[0] if end.target is c10d.wait_tensor.default else end
            if src.target is operator.getitem:
                src = src.args[0]
            if "batch_p2p_ops" in str(getattr(src, "target", "")):
                return True
    return False
