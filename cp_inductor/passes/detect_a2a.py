"""Find Ulysses (all-to-all) CP attention regions in an ATen graph by their layout algebra.

A forward (or inference) region::

    q_local -> views -> all_to_all -> wait -> views -> q_heads  \
    k_local -> ...                                   -> k_heads  > SDPA -> out -> views -> all_to_all -> wait -> views
    v_local -> ...                                   -> v_heads  /

and a backward region is the mirror: ``grad_out`` arrives through an all-to-all, ``dq/dk/dv``
leave through one each. Which reshapes/permutes/copies sit around the collectives does not matter:
each chain is run through :mod:`layout_algebra` and accepted iff attention sees
``[batch, head block of this rank, (source rank, local position), head_dim]`` and what leaves is
the full head set of this rank's sequence slice again. An all-to-all that does not produce that
(an MoE dispatch, a batch exchange) is not a region. On the way out one ``sum`` over head factors
may sit in the chain (a GQA backward that replicated K/V heads by ``expand`` sums the replicas'
gradients): then the reduced tensor is the crossing's source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from .guard import internal_error
from .layout_algebra import (
    LAYOUT_OPS,
    RANK_AXIS,
    Factor,
    Layout,
    LayoutError,
    apply_chain,
    canonical,
    is_broadcast,
)
from .sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD, bound_args, tuple_outputs

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ROLE_NAMES = "bhsd"  # roles of the four attention dims


@dataclass
class A2ACrossing:
    """One all-to-all of a region and the layout ops on both sides of it."""

    a2a: torch.fx.Node
    wait: torch.fx.Node
    before: list  # layout-op nodes from the rank-local side to the all_to_all (in order)
    after: list  # layout-op nodes from the wait to the attention side (in order)
    layout: str  # layout of the sequence-sharded tensor on the rank-local side
    send: Layout  # logical layout of the all_to_all input
    roles: dict  # factor -> "b" | "h" | "s" | "d" (batch factors in attention order)
    source: torch.fx.Node  # where ``before`` starts: the rank-local tensor, or attention's output
    source_layout: Layout


@dataclass
class A2ARegion:
    graph: str  # "forward" | "backward" | "inference"
    attention: torch.fx.Node
    cp: int
    group_name: str
    layout: str
    incoming: dict = field(default_factory=dict)  # "q"/"k"/"v" or "grad_out" -> A2ACrossing
    outgoing: dict = field(default_factory=dict)  # "out" or "dq"/"dk"/"dv" -> A2ACrossing
    is_causal: bool = False
    heads_q: int = 0
    heads_kv: int = 0
    has_mask: bool = False
    dropout_p: float = 0.0


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_layout_op(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in LAYOUT_OPS


def _a2a_behind_wait(node):
    if isinstance(node, torch.fx.Node) and node.target is c10d.wait_tensor.default:
        src = node.args[0]
        if isinstance(src, torch.fx.Node) and src.target is c10d.all_to_all_single.default:
            return src
    return None


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _equal_split_cp(a2a: torch.fx.Node) -> int:
    inp, out_splits, in_splits, group_name = a2a.args[:4]
    cp = _group_size(group_name)
    n0 = _val(inp).shape[0]
    # Comparing symbolic sizes would add guards: the compiler must not specialize the user's graph.
    if any(isinstance(x, torch.SymInt) for x in [n0, *(out_splits or ()), *(in_splits or ())]):
        raise LayoutError("dynamic shapes")
    for splits in (out_splits, in_splits):
        if splits is not None and (len(splits) != cp or any(s * cp != n0 for s in splits)):
            raise LayoutError(f"uneven all_to_all splits {splits}")
    return cp


def _walk_up(node):
    chain = []
    while _is_layout_op(node):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


# --- roles ---------------------------------------------------------------------------------


def _roles_at_attention(lay: Layout, allow_broadcast: bool) -> dict:
    """Check the Ulysses layout at an attention input; return factor -> role."""
    if len(lay.dims) != 4:
        raise LayoutError(f"attention input has {len(lay.dims)} dims")
    b, h, s, d = (canonical(x) for x in lay.dims)
    if len(s) != 2 or s[0].axis != RANK_AXIS:
        raise LayoutError("sequence dim is not (source rank, local position)")
    if len(d) != 1 or any(f.axis == RANK_AXIS for f in b + h + d):
        raise LayoutError("head_dim or batch mixes in other axes")
    heads = tuple(f for f in h if not is_broadcast(f))
    if len(heads) != len(h) and not allow_broadcast:
        raise LayoutError("broadcast heads on a query")
    p = lay.pinned
    if p.axis == RANK_AXIS or len(heads) > 1:
        raise LayoutError("head dim is not one run of heads")
    # One local head (H == cp) leaves no head factor: the pinned block is the head.
    if heads and not (p.axis == heads[0].axis and p.stride == heads[0].end):
        raise LayoutError("this rank's head block is not the outer split of the heads")
    roles = {f: "b" for f in b}
    roles.update({f: "h" for f in heads + (p,)})
    roles.update({s[0]: "s", s[1]: "s", d[0]: "d"})
    return roles


def _role_of(f: Factor, roles: dict) -> str | None:
    found = {r for g, r in roles.items() if g.overlaps(f) or (g == f)}
    return found.pop() if len(found) == 1 else None


def _layout_name(lay: Layout, roles: dict) -> str | None:
    names = []
    for dim in lay.dims:
        rs = {_role_of(f, roles) for f in canonical(dim)}
        if len(rs) > 1 or None in rs:
            return None
        names.append(rs.pop() if rs else "?")
    missing = set(ROLE_NAMES) - set(names)
    if names.count("?") == 1 and len(missing) == 1:
        # A size-1 dim (batch 1, say) has no factor; it is the one role not seen elsewhere.
        names[names.index("?")] = missing.pop()
    return "".join(names) if sorted(names) == sorted(ROLE_NAMES) else None


def _gathered(lay: Layout, roles: dict) -> bool:
    """After the return all-to-all: this rank's sequence slice again, every role in natural order."""
    if lay.pinned.axis != RANK_AXIS:
        return False
    flat = [f for dim in lay.dims for f in canonical(dim)]
    if any(f.axis == RANK_AXIS for f in flat):
        return False
    for role in "hsd":
        mine = [f for f in flat if _role_of(f, roles) == role]
        if len(canonical(mine)) != 1:
            return False
    return True


# --- one crossing at a time -----------------------------------------------------------------


def _incoming(node: torch.fx.Node, allow_broadcast: bool):
    """Attention input -> (crossing, roles, layout at attention, cp, group) or raise LayoutError."""
    wait, after = _walk_up(node)
    a2a = _a2a_behind_wait(wait)
    if a2a is None:
        raise LayoutError("input does not come from an all_to_all")
    cp = _equal_split_cp(a2a)
    source, before = _walk_up(a2a.args[0])
    if _val(source) is None:
        raise LayoutError("no shape on the rank-local tensor")
    pre = apply_chain(Layout.source(_val(source).shape, source.name, cp), before)
    post = apply_chain(pre[-1].all_to_all(cp), after)
    roles = _roles_at_attention(post[-1], allow_broadcast)
    names = [n for n in (_layout_name(x, roles) for x in pre) if n]
    crossing = A2ACrossing(a2a, wait, before, after, names[0] if names else "?", pre[-1], roles, source, pre[0])
    return crossing, roles, post[-1], cp, a2a.args[3]


def _summed_over_heads(lay: Layout, node: torch.fx.Node, roles: dict) -> Layout:
    """The layout after ``aten.sum.dim_IntList`` over head factors only, or raise.

    A GQA backward that replicated K/V heads by ``expand`` sums the replicas' gradients before
    they leave: the reduced tensor, not attention's output, is what crosses."""
    dims, keepdim = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None or not dims:
        raise LayoutError("sum with a dtype or over every dim")
    summed = {d % len(lay.dims) for d in dims}
    for d in summed:
        if any(_role_of(f, roles) != "h" for f in canonical(lay.dims[d])):
            raise LayoutError("sum over something other than heads")
    kept = tuple(() if i in summed else dim for i, dim in enumerate(lay.dims) if keepdim or i not in summed)
    return Layout(kept, lay.pinned)


def _outgoing(node: torch.fx.Node, start: Layout, roles: dict, cp: int):
    """Attention output -> its crossing, if some chain of layout ops (and at most one sum over
    replicated heads) reaches an all-to-all."""
    found = []

    def visit(n, chain, lay, source, source_lay):
        for user in n.users:
            if user.args[0] is not n:
                continue
            if user.target is c10d.all_to_all_single.default:
                found.append((user, chain, lay, source, source_lay))
            elif _is_layout_op(user):
                try:
                    visit(user, chain + [user], LAYOUT_OPS[user.target](lay, user), source, source_lay)
                except LayoutError:
                    pass
            elif user.target is aten.sum.dim_IntList and source is node:
                try:
                    reduced = _summed_over_heads(lay, user, roles)
                except LayoutError:
                    continue
                visit(user, [], reduced, user, reduced)

    visit(node, [], start, node, start)
    if len(found) != 1:
        raise LayoutError(f"output reaches {len(found)} all_to_alls")
    a2a, before, lay, source, source_lay = found[0]
    if source is not node:
        # Roles of the reduced tensor's own factors (pack layouts are built from them).
        flat = [f for dim in source_lay.dims for f in canonical(dim)]
        roles = {**{f: _role_of(f, roles) for f in flat}, source_lay.pinned: "h"}
    send = lay
    if _equal_split_cp(a2a) != cp:
        raise LayoutError("return all_to_all on another group size")
    waits = [u for u in a2a.users if u.target is c10d.wait_tensor.default]
    if len(waits) != 1:
        raise LayoutError("all_to_all without one wait")
    lay = lay.all_to_all(cp)
    n, after, best = waits[0], [], None
    while True:
        # Follow the single-user layout chain; the crossing ends at its last named gathered state.
        if _gathered(lay, roles):
            name = _layout_name(lay, roles)
            if best is None or name is not None:
                best = (len(after), name or "?")
        users = [u for u in n.users if _is_layout_op(u)]
        if len(n.users) != 1 or len(users) != 1:
            break
        n = users[0]
        after.append(n)
        try:
            lay = LAYOUT_OPS[n.target](lay, n)
        except LayoutError:
            break
    if best is None:
        raise LayoutError("return all_to_all does not give back the sequence slice")
    crossing = A2ACrossing(a2a, waits[0], before, after[: best[0]], best[1], send, roles, source, source_lay)
    return crossing, a2a.args[3]


def _with_head_dim(lay: Layout, like: torch.fx.Node, name: str) -> Layout:
    """An attention-side layout with the head_dim of ``like`` (the output takes v's head_dim)."""
    head_dim = (Factor(name, 1, int(_val(like).shape[-1])),)
    return Layout(lay.dims[:3] + (head_dim,), lay.pinned)


def _fresh_heads_layout(like: Layout, heads: int, head_dim: int, name: str, cp: int):
    """Attention-side layout for k/v gradients: q's batch and sequence, heads/head_dim of their own."""
    b, _, s, _ = like.dims
    dims = (b, (Factor((name, "h"), 1, heads),), s, (Factor((name, "d"), 1, head_dim),))
    return Layout(dims, Factor((name, "h"), heads, cp))


def _roles_for(lay: Layout) -> dict:
    return _roles_at_attention(lay, allow_broadcast=True)


def find_regions(graph: torch.fx.Graph, graph_kind: str, log=None) -> list[A2ARegion]:
    """Every Ulysses region in ``graph``. ``log(node, reason)`` hears why an attention op is
    not one."""
    regions = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        try:
            if node.target in SDPA_FORWARD:
                regions.append(_forward_region(node, graph_kind))
            elif node.target in SDPA_BACKWARD:
                regions.append(_backward_region(node, graph_kind))
        except LayoutError as e:
            if log is not None:
                log(node, str(e))
        except Exception as e:  # noqa: BLE001 - see guard.py
            reason = internal_error(e)
            if log is not None:
                log(node, reason)
    return regions


def _attention_facts(args, cp: int) -> dict:
    q, k = args["query"], args["key"]
    return dict(
        is_causal=bool(args.get("is_causal", False)),
        heads_q=int(_val(q).shape[1]) * cp,
        heads_kv=int(_val(k).shape[1]) * cp,
        has_mask=any(args.get(n) is not None for n in ("attn_mask", "attn_bias")),
        dropout_p=float(args.get("dropout_p", 0.0) or 0.0),
    )


def _forward_region(node, graph_kind) -> A2ARegion:
    args = bound_args(node)
    crossings, groups = {}, set()
    q_cross, q_roles, q_lay, cp, g = _incoming(args["query"], allow_broadcast=False)
    crossings["q"] = q_cross
    groups.add(g)
    for name in ("key", "value"):
        c, _, _, cp_kv, g = _incoming(args[name], allow_broadcast=True)
        if cp_kv != cp:
            raise LayoutError("q and k/v cross different group sizes")
        crossings[name[0]] = c
        groups.add(g)
    outs = tuple_outputs(node)
    if 0 not in outs:
        raise LayoutError("attention output unused")
    out_start = _with_head_dim(q_lay, args["value"], ("out", "d"))
    out_roles = _roles_for(out_start)
    out_cross, g = _outgoing(outs[0], out_start, out_roles, cp)
    groups.add(g)
    if len(groups) != 1:
        raise LayoutError("crossings use different process groups")
    return A2ARegion(
        graph=graph_kind, attention=node, cp=cp, group_name=groups.pop(), layout=q_cross.layout,
        incoming=crossings, outgoing={"out": out_cross}, **_attention_facts(args, cp),
    )


def _backward_region(node, graph_kind) -> A2ARegion:
    args = bound_args(node)
    go_cross, _, go_lay, cp, g = _incoming(args["grad_out"], allow_broadcast=False)
    groups = {g}
    outs = tuple_outputs(node)
    outgoing = {}
    for idx, (name, like) in enumerate((("dq", "query"), ("dk", "key"), ("dv", "value"))):
        if idx not in outs:
            raise LayoutError(f"{name} unused")
        shape = _val(args[like]).shape
        if name == "dq":
            start = _with_head_dim(go_lay, args[like], ("dq", "d"))
        else:
            start = _fresh_heads_layout(go_lay, int(shape[1]), int(shape[3]), name, cp)
        c, g = _outgoing(outs[idx], start, _roles_for(start), cp)
        outgoing[name] = c
        groups.add(g)
    if len(groups) != 1:
        raise LayoutError("crossings use different process groups")
    return A2ARegion(
        graph=graph_kind, attention=node, cp=cp, group_name=groups.pop(), layout=go_cross.layout,
        incoming={"grad_out": go_cross}, outgoing=outgoing, **_attention_facts(args, cp),
    )
