"""Find Ulysses (all-to-all) CP attention regions in an ATen graph by their layout algebra.

A forward (or inference) region::

    q_local -> views -> all_to_all -> wait -> views -> q_heads  \
    k_local -> ...                                   -> k_heads  > SDPA -> out -> views -> all_to_all -> wait -> views
    v_local -> ...                                   -> v_heads  /

and a backward region is the mirror: ``grad_out`` arrives through an all-to-all, ``dq/dk/dv``
leave through one each. Which reshapes/permutes/copies sit around the collectives does not matter:
each chain is run through :mod:`layout_algebra` and accepted iff attention sees
``[batch, head block of this rank, (source rank, local position), head_dim]`` (varlen attention
over a pack: ``[(source rank, local token), head block, head_dim]``, layout ``thd``) and what
leaves is the full head set of this rank's sequence slice again. An all-to-all that does not produce that
(an MoE dispatch, a batch exchange) is not a region. On the way out one ``sum`` over head factors
may sit in the chain (a GQA backward that replicated K/V heads by ``expand`` sums the replicas'
gradients): then the reduced tensor is the crossing's source.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import ClassVar, cast

import torch
import torch.fx

from ..analysis.collectives import Collective, collective_at, collective_of
from ..analysis.graph_walk import Walk
from ..analysis.layout_algebra import (
    LAYOUT_OPS,
    RANK_AXIS,
    Factor,
    Layout,
    LayoutError,
    apply_chain,
    base_axis,
    canonical,
    dim_size,
    replicated_block,
    is_broadcast,
    is_layout_op,
    is_value_op,
    node_val,
)
from ..analysis.match import CPMatch, attention_facts
from ..analysis.sym_sizes import Size, exact_div, hint, may_guard, size_of, sizes_of, specialize
from ..analysis.sdpa_ops import ATTENTION, BACKWARD, FORWARD, bound_args, tuple_outputs
from . import find_with, match_or_none

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ROLE_NAMES = "bhsd"  # roles of the four attention dims
# Under dynamic=True even head counts are symbols (a model's views name them as ints).
SYMBOLIC_HEADS = "symbolic head counts (dynamic=True)"
# The reason for an attention op no all-to-all feeds: not this style's (another may claim it).
NO_ALL_TO_ALL = "input does not come from an all_to_all"


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
    opaque: str | None = None  # why the collective cannot be replaced (a third-party op), or None

    @property
    def pure(self) -> bool:
        """``after`` only relabels indices (no pointwise op between the wait and attention)."""
        return all(is_layout_op(n) for n in self.after)


@dataclass
class A2AMatch(CPMatch):
    """A Ulysses region: attention plus the all-to-all crossings that feed it and carry its
    results back."""

    style: ClassVar[str] = "a2a"
    incoming: dict = field(default_factory=dict)  # "q"/"k"/"v" or "grad_out" -> A2ACrossing
    outgoing: dict = field(default_factory=dict)  # "out" or "dq"/"dk"/"dv" -> A2ACrossing


def _next_layout(lay: Layout, node) -> Layout:
    return lay if is_value_op(node) and not is_layout_op(node) else LAYOUT_OPS[node.target](lay, node)


def _equal_split_cp(coll: Collective) -> int:
    cp = _group_size(coll.group_name)
    # Read as sizes, not compared as SymInts: that would add guards to the user's program.
    n0 = size_of(node_val(coll.input).shape[0])
    for splits in coll.splits:
        if splits is not None and (len(splits) != cp or any(size_of(s) * cp != n0 for s in splits)):
            raise LayoutError(f"uneven all_to_all splits {splits}")
    return cp


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


def _walk_up(node, pieces: bool = True):
    """Up through layout ops to where the chain starts. With ``pieces=False`` (the rank-local
    side of a send) a select, slice or split piece starts the chain (a pack copies that piece,
    not the tensor it was cut from), and so does a tensor the program uses elsewhere too (the
    previous layer's output, in the shape the program gave it)."""
    chain: list[torch.fx.Node] = []
    while is_layout_op(node) and (pieces or (node.target not in _PIECE_OPS and (not chain or len(node.users) == 1))):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


_PIECE_OPS = (aten.select.int, aten.slice.Tensor, operator.getitem)


def _walk_to_collective(node):
    """Attention input -> (collective, nodes from its received tensor to ``node``). Layout ops
    and pointwise ops may sit between."""
    after = []
    while True:
        node, chain = _walk_up(node)
        after = chain + after
        coll = collective_at(node)
        if coll is not None:
            return coll, after
        if not is_value_op(node):
            raise LayoutError(NO_ALL_TO_ALL)
        after.insert(0, node)
        node = node.args[0]


# --- roles ---------------------------------------------------------------------------------


def _axes(factors) -> set:
    return {base_axis(f.axis) for f in factors}


def _roles_at_attention(lay: Layout, allow_broadcast: bool) -> dict:
    """Check the Ulysses layout at an attention input ([B, H, S, D], or a pack's [T, H, D]);
    return factor -> role (a pack's tokens take the sequence role)."""
    b: tuple[Factor, ...]  # the batch dim's factors (none in a pack)
    if len(lay.dims) == 3:
        b, (s, h, d) = (), (canonical(x) for x in lay.dims)
    elif len(lay.dims) == 4:
        b, h, s, d = (canonical(x) for x in lay.dims)
    else:
        raise LayoutError(f"attention input has {len(lay.dims)} dims")
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
    # The head block must be heads: a rank's block of the sequence or of a token list shares its
    # source axis with what attention sees as sequence or batch, a head block never does (also
    # with one local head, where no head factor is left to compare). Heads may share an axis with
    # head_dim only from outside it (a projection's [.., H * D] output viewed as heads x head_dim);
    # with one local head that is indistinguishable from head_dim split across ranks.
    head_axes = _axes(heads) | {base_axis(p.axis)}
    for role, factors in (("sequence", s[1:]), ("batch", b)):
        if head_axes & _axes(factors):
            raise LayoutError(f"the head block shares a source axis with {role}: not a Ulysses head split")
    if any(f.axis == d[0].axis and f.stride < d[0].end for f in heads + (p,)):
        raise LayoutError("the head block lies inside head_dim: not a Ulysses head split")
    # Which heads this rank holds (a block, every cp-th head, a slice of a fused q|k|v dim) is
    # the program's choice; that q's and k/v's choices pair heads as one device would is
    # checked per region (_check_head_pairing).
    roles = {f: "b" for f in b}
    roles.update({f: "h" for f in heads + (p,)})
    roles.update({s[0]: "s", s[1]: "s", d[0]: "d"})
    return roles


def _heads_of(lay: Layout) -> tuple:
    return canonical(lay.dims[1])  # [B, H, S, D] and a pack's [T, H, D] alike


def _static_heads(lay: Layout, guard: bool) -> Layout:
    """``lay`` with its head factors (and the rank's block) as static sizes. Under dynamic=True
    head counts are symbols; a forward graph guards them to the traced counts (a model's head
    count never changes; a later call where one did would recompile), a backward graph reads
    the forward's guards."""
    def static(f: Factor) -> Factor:
        f = f.refreshed()
        if guard and not (isinstance(f.stride, int) and isinstance(f.size, int)):
            f = Factor(f.axis, specialize(f.stride), specialize(f.size))
        if not (isinstance(f.stride, int) and isinstance(f.size, int)):
            raise LayoutError(f"{SYMBOLIC_HEADS}: heads are paired on static head counts")
        return f

    dims = list(lay.dims)
    dims[1] = tuple(static(f) for f in lay.dims[1])
    return Layout(tuple(dims), static(lay.pinned), lay.fixed)


def _head_ids(lay: Layout, cp: int) -> tuple[list, int]:
    """For an attention-side layout (static head factors): ``ids[r][i]``, the head that rank
    ``r`` sees at local head index ``i``, numbered densely over the real (not broadcast) head
    factors and the rank's block factor, outer to inner by source stride; and how many distinct
    heads there are."""
    heads = _heads_of(lay)
    real = [f for f in (lay.pinned, *heads) if not is_broadcast(f)]
    axes = list(dict.fromkeys(base_axis(f.axis) for f in real))
    order = sorted(real, key=lambda f: (axes.index(base_axis(f.axis)), -f.stride))
    shared = replicated_block(lay.pinned)  # ranks that hold the same replicated K/V head
    weight, w = {}, 1
    for f in reversed(order):
        weight[f], w = w, w * (f.size // shared if f is lay.pinned else f.size)
    local = dim_size(heads)
    ids = []
    for r in range(cp):
        row = []
        for i in range(local):
            digits, rest = {lay.pinned: r // shared}, i
            for f in reversed(heads):
                digits[f], rest = rest % f.size, rest // f.size
            row.append(sum(digits[f] * weight[f] for f in real))
        ids.append(row)
    return ids, w


def _check_head_pairing(q_lay: Layout, kv_lays, cp: int, guard: bool = False) -> None:
    """Raise unless attention pairs every rank's query heads with the key/value heads one device
    would: query head ``n`` with key/value head ``n // (Hq / Hkv)`` (a GQA group), local index
    ``i`` with ``i // (local Hq / local Hkv)`` as attention does."""
    q_ids, hq = _head_ids(_static_heads(q_lay, guard), cp)
    for lay in kv_lays:
        kv_ids, hkv = _head_ids(_static_heads(lay, guard), cp)
        local_q, local_kv = len(q_ids[0]), len(kv_ids[0])
        if hq % hkv or not local_kv or local_q % local_kv:
            raise LayoutError(f"{hq} query heads do not group over {hkv} key/value heads")
        group, local_group = hq // hkv, local_q // local_kv
        if any(q_ids[r][i] // group != kv_ids[r][i // local_group] for r in range(cp) for i in range(local_q)):
            raise LayoutError("query and key/value heads pair otherwise than on one device "
                              "(the ranks' head blocks of q and of k/v differ)")


def _role_of(f: Factor, roles: dict) -> str | None:
    found = {r for g, r in roles.items() if _as_source(g).overlaps(f) or (g == f)}
    return found.pop() if len(found) == 1 else None


def _as_source(g: Factor) -> Factor:
    """A rank block over replicated heads as the run of source indices it covers."""
    shared = replicated_block(g)
    return g if shared == 1 else Factor(base_axis(g.axis), g.stride, g.size // shared)


def _split_by_roles(f: Factor, roles: dict) -> list:
    """``f`` as the role factors it is made of, outer to inner (a [B * S] dim is batch then
    sequence), or ``[f]``."""
    inside = sorted((g for g in roles if g.within(f)), key=lambda g: -hint(g.stride))
    if len(inside) < 2 or canonical(inside) != (f,):
        return [f]
    return inside


def _layout_name(lay: Layout, roles: dict) -> str | None:
    names: list[str] = []
    for dim in lay.dims:
        rs = {_role_of(f, roles) for f in canonical(dim)}
        if len(rs) > 1 or None in rs:
            return None
        names.append(cast(str, rs.pop()) if rs else "?")  # (None is not in rs)
    if len(names) == 3 and sorted(names) == sorted("hsd"):
        return "".join(names).replace("s", "t")  # a pack: tokens, heads, head_dim
    missing = set(ROLE_NAMES) - set(names)
    if names.count("?") == 1 and len(missing) == 1:
        # A size-1 dim (batch 1, say) has no factor; it is the one role not seen elsewhere.
        names[names.index("?")] = missing.pop()
    return "".join(names) if sorted(names) == sorted(ROLE_NAMES) else None


def _gathered(lay: Layout, roles: dict) -> bool:
    """After the return all-to-all: this rank's sequence slice again, with the heads in their
    natural order. In the flattened order of the dims each role is one stretch that merges into
    one run (heads may be gone, summed over replicas); factors of no role (the piece index of a
    packed q/k/v gradient) may sit between roles."""
    if lay.pinned.axis != RANK_AXIS:
        return False
    dims = [[g for f in canonical(dim) for g in _split_by_roles(f, roles)] for dim in lay.dims]
    flat = [f for dim in dims for f in dim]
    if any(f.axis == RANK_AXIS for f in flat):
        return False
    for dim in dims:  # heads merged into the sequence (or batch): not this rank's slice back
        rs = {_role_of(f, roles) for f in dim}
        if "h" in rs and rs & {"s", "b"}:
            return False
    seq = [_role_of(f, roles) for f in flat]
    for role in "bhsd":
        idx = [i for i, r in enumerate(seq) if r == role]
        if idx and idx != list(range(idx[0], idx[-1] + 1)):
            return False  # another role sits inside this one's stretch
        runs = canonical([flat[i] for i in idx])
        if role == "h" and len(runs) > 1 and _in_order(runs):
            continue  # heads cut out of a fused q|k|v dim: in order, with the others' heads between
        if len(runs) > 1 or (role in "sd" and len(runs) != 1):
            return False
    return True


def _in_order(factors) -> bool:
    """Factors of one source axis, outer to inner, none reaching into the next outer one: heads
    enumerated in their order along a fused axis, other heads between."""
    if len({base_axis(f.axis) for f in factors}) != 1:
        return False
    return all(outer.stride >= inner.end for outer, inner in zip(factors, factors[1:]))


# --- one crossing at a time -----------------------------------------------------------------


_ROW_OPS = (aten.mm.default, aten.addmm.default)  # row i of the result is computed from row i alone


def _provenance(node, cp: int, memo: dict | None = None, budget: list | None = None):
    """Where the rows of ``node`` come from: a Layout whose pinned factor is the rank axis for
    this rank's own data, or another factor for rows an all-to-all brought from elsewhere;
    None where that is not known. Followed up through layout ops, pointwise ops, matmuls on the
    last dim (row i from row i) and all-to-alls; attention's outputs are not known; any other
    op is this rank's own data when all its tensor inputs are."""
    memo = {} if memo is None else memo
    budget = [256] if budget is None else budget
    if node in memo:
        return memo[node]
    budget[0] -= 1
    if budget[0] < 0 or not isinstance(node, torch.fx.Node) or not isinstance(node_val(node), torch.Tensor):
        return None
    memo[node] = None  # a cycle cannot happen in a graph; this only bounds re-entry

    def follow(x):
        return _provenance(x, cp, memo, budget)

    try:
        coll = collective_at(node)
        if coll is not None:
            inner = follow(coll.input)
            out = None if inner is None else _received(inner, node, _equal_split_cp(coll))
        elif is_layout_op(node):
            inner = follow(node.args[0])
            out = LAYOUT_OPS[node.target](inner, node) if inner is not None else None
        elif is_value_op(node):
            out = follow(node.args[0])
        elif node.target in _ROW_OPS:
            inner = follow(node.args[1] if node.target is aten.addmm.default else node.args[0])
            out = _matmul_rows(inner, node) if inner is not None and len(inner.dims) == 2 else None
        elif node.op == "call_function" and (node.target in ATTENTION or _is_attention_piece(node)):
            out = None
        else:
            inputs = [a for a in node.all_input_nodes if isinstance(node_val(a), torch.Tensor)]
            known = [follow(a) for a in inputs]
            local = all(k is not None and k.pinned.axis == RANK_AXIS for k in known)
            out = Layout.source(node_val(node).shape, node.name, cp) if local else None
    except LayoutError:
        out = None
    memo[node] = out
    return out


def _matmul_rows(rows: Layout, node: torch.fx.Node) -> Layout:
    """A matmul's result: the rows of ``rows``, columns of an axis of its own."""
    cols = (Factor((node.name, 1), 1, size_of(node_val(node).shape[1])),)
    return Layout((rows.dims[0], canonical(cols)), rows.pinned, rows.fixed)


def _received(sent: Layout, node: torch.fx.Node, cp: int) -> Layout:
    """What an all-to-all of ``sent`` delivers; where the algebra cannot follow the split (the
    chunks cut across factors), rows from elsewhere all the same."""
    try:
        return sent.all_to_all(cp)
    except LayoutError:
        fresh = Layout.source(node_val(node).shape, node.name, cp)
        return replace(fresh, pinned=Factor(("received", node.name), 1, cp))


def _is_attention_piece(node) -> bool:
    src = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in ATTENTION


def _incoming(node: torch.fx.Node, allow_broadcast: bool):
    """Attention input -> (crossing, roles, layout at attention, cp, group) or raise LayoutError."""
    coll, after = _walk_to_collective(node)
    cp = _equal_split_cp(coll)
    source, before = _walk_up(coll.input, pieces=False)
    if node_val(source) is None:
        raise LayoutError("no shape on the rank-local tensor")
    sent = _provenance(source, cp)
    if sent is not None and sent.pinned.axis != RANK_AXIS:
        # An MoE combine: the rows it sends back are tokens an earlier all-to-all dispatched here.
        raise LayoutError("the all_to_all sends rows another all_to_all brought here (a token dispatch "
                          "and combine), not this rank's sequence")
    pre = apply_chain(Layout.source(node_val(source).shape, source.name, cp), before)
    post = [pre[-1].all_to_all(cp)]
    for n in after:
        post.append(_next_layout(post[-1], n))
    roles = _roles_at_attention(post[-1], allow_broadcast)
    names = [n for n in (_layout_name(x, roles) for x in pre) if n]
    crossing = A2ACrossing(
        coll.node, coll.wait, before, after, names[0] if names else "?", pre[-1], roles, source, pre[0], coll.opaque,
    )
    return crossing, roles, post[-1], cp, coll.group_name


def _summed_over_heads(lay: Layout, node: torch.fx.Node, roles: dict) -> Layout:
    """The layout after ``aten.sum.dim_IntList`` over head factors only, or raise.

    A GQA backward that replicated K/V heads (by ``expand`` after the all-to-all, or by
    ``repeat_interleave`` before it) sums the replicas' gradients: before the return all-to-all
    the reduced tensor is what crosses; after it, the sum is part of the way back."""
    dims, keepdim = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None or not dims:
        raise LayoutError("sum with a dtype or over every dim")
    summed = {d % len(lay.dims) for d in dims}
    for d in summed:
        if any(_role_of(f, roles) != "h" for f in canonical(lay.dims[d])):
            raise LayoutError("sum over something other than heads")
    kept = tuple(() if i in summed else dim for i, dim in enumerate(lay.dims) if keepdim or i not in summed)
    return Layout(kept, lay.pinned, lay.fixed)


def _merged(lay: Layout, node: torch.fx.Node, tracked: torch.fx.Node, roles: dict | None = None) -> Layout:
    """The layout of the tracked tensor's elements in the result of a merge of gradients, or raise:
    ``add`` of same-shaped tensors (q, k and v were one tensor) or ``cat`` of equal pieces (the
    backward of a packed q/k/v cut by unbind, split or chunk)."""
    if node.target is aten.add.Tensor:
        vals = [node_val(a) for a in node.args[:2]]
        if node.kwargs.get("alpha", 1) != 1 or any(not isinstance(v, torch.Tensor) for v in vals):
            raise LayoutError("add of a scaled or non-tensor operand")
        if sizes_of(vals[0].shape) != sizes_of(vals[1].shape):
            raise LayoutError("add that broadcasts")
        return lay
    parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0))
    shapes = {sizes_of(node_val(p).shape) for p in parts}
    dim = dim % len(lay.dims)
    cut = canonical(lay.dims[dim])
    # (a stack's new dim has no factor; a piece with one local head neither, but pieces differ)
    along_heads = roles is not None and (bool(cut) or len(shapes) != 1) and all(_role_of(f, roles) == "h" for f in cut)
    if len(shapes) != 1 and not along_heads:
        raise LayoutError("cat of pieces of different shapes, not along the heads")
    if along_heads:
        # The gradients of q, k and v cut out of one fused heads dim, put back together: the
        # merged tensor is what crosses, this rank's block of the fused heads.
        total = size_of(node_val(node).shape[dim])
        axis = ("cat", node.name)
        dims = lay.dims[:dim] + ((Factor(axis, 1, total),),) + lay.dims[dim + 1:]
        return Layout(dims, Factor(axis, total, lay.pinned.size), lay.fixed)
    piece = Factor(("piece", node.name), 1, len(parts))
    index = parts.index(tracked)
    dims = lay.dims[:dim] + (((piece,) + tuple(lay.dims[dim])),) + lay.dims[dim + 1:]
    return Layout(dims, lay.pinned, lay.fixed + ((piece, index),))


_MERGE_OPS = (aten.add.Tensor, aten.cat.default)


def _merges(node, tracked) -> bool:
    if node.target is aten.cat.default:
        return isinstance(node.args[0], (list, tuple)) and tracked in node.args[0]
    return any(a is tracked for a in node.args[:2])


def _only_backward_reads(out: torch.fx.Node) -> bool:
    """Whether only attention backward ops read ``out`` (through aliases and views)."""
    def is_alias(u):
        return u.op == "call_function" and u.target in (aten.alias.default, aten.detach.default)

    readers = [u for n in Walk([out], lambda n: [u for u in n.users if is_alias(u)]) for u in n.users if not is_alias(u)]
    return bool(readers) and all(u.op == "call_function" and u.target in BACKWARD for u in readers)


def _outgoing(node: torch.fx.Node, start: Layout, roles: dict, cp: int):
    """Attention output -> its crossing, if a chain of layout ops reaches an all-to-all. On the
    way: pointwise ops (the crossing then starts after them), one sum over replicated heads, and
    merges with the other gradients (then the crossing is shared)."""
    found = []

    def visit(n, chain, lay, source, source_lay, depth=0):
        if depth > 64:
            return
        for user in n.users:
            coll = collective_of(user)
            if coll is not None and coll.input is n:
                found.append((coll, chain, lay, source, source_lay))
            elif is_layout_op(user) and user.args[0] is n:
                try:
                    visit(user, chain + [user], LAYOUT_OPS[user.target](lay, user), source, source_lay, depth + 1)
                except LayoutError:
                    pass
            elif user.target in _MERGE_OPS and _merges(user, n):
                try:
                    merged = _merged(lay, user, n, roles)
                except LayoutError:
                    continue
                visit(user, [], merged, user, merged, depth + 1)
            elif user.target is aten.sum.dim_IntList and user.args[0] is n:
                try:
                    reduced = _summed_over_heads(lay, user, roles)
                except LayoutError:
                    continue
                visit(user, [], reduced, user, reduced, depth + 1)
            elif is_value_op(user) and user.args[0] is n:
                visit(user, [], lay, user, lay, depth + 1)

    visit(node, [], start, node, start)
    if not found and _only_backward_reads(node):
        raise LayoutError("output read only by the attention backward (a forward recomputed for it: "
                          "activation checkpointing; the backward op is its own region)")
    if len({f[0].node for f in found}) != 1:
        raise LayoutError(f"output reaches {len({f[0].node for f in found})} all_to_alls")
    coll, before, lay, source, source_lay = found[0]
    if source is not node:
        # Roles of the merged or reduced tensor's own factors (pack layouts are built from them).
        flat = [f for dim in source_lay.dims for f in canonical(dim)]
        roles = {**{f: r for f in flat if (r := _role_of(f, roles))}, source_lay.pinned: "h"}
        roles.update({f: "h" for f in flat if isinstance(f.axis, tuple) and f.axis[0] == "cat"})
    send = lay
    if _equal_split_cp(coll) != cp:
        raise LayoutError("return all_to_all on another group size")
    lay = lay.all_to_all(cp)
    # Follow the way back (layout ops, a sum over replicated heads) while it is one path; where
    # it ends, this rank's sequence slice must be whole again with its heads in order.
    n, after = coll.wait, []
    while True:
        # The way back ends where the program uses the tensor (saving it for the backward does
        # not count): that is the layout it computes with.
        users = [u for u in n.users if u.op != "output"]
        if len(users) != 1 or users[0].args[0] is not n:
            break
        if not (is_layout_op(users[0]) or users[0].target is aten.sum.dim_IntList):
            break
        (user,) = users
        try:
            if is_layout_op(user):
                lay = LAYOUT_OPS[user.target](lay, user)
            elif user.target is aten.sum.dim_IntList:
                lay = _summed_over_heads(lay, user, roles)
            else:
                break
        except LayoutError:
            break
        n = user
        after.append(n)
    if not _gathered(lay, roles):
        raise LayoutError("return all_to_all does not give back the sequence slice with heads in order")
    if _rows_sent_on(n, lay, roles, cp):
        raise LayoutError("the rows that come back are sent on by rows by another all_to_all "
                          "(a token dispatch's way back), not this rank's sequence")
    name = _layout_name(lay, roles) or "?"
    crossing = A2ACrossing(coll.node, coll.wait, before, after, name, send, roles, source, source_lay, coll.opaque)
    return crossing, coll.group_name


def _rows_sent_on(node: torch.fx.Node, lay: Layout, roles: dict, cp: int) -> bool:
    """Whether the tensor that came back is, through layout ops, pointwise ops and matmuls on
    its rows, sent by another all-to-all whose chunks are blocks of its batch or sequence: the
    way back of a token dispatch (an MoE expert's input gradient) rather than this rank's
    sequence, which the next layer scatters by heads."""
    stack, seen = [(node, lay)], 0
    while stack and seen < 32:
        n, cur = stack.pop()
        seen += 1
        for user in n.users:
            try:
                coll = collective_of(user)
                if coll is not None and coll.input is n:
                    dim0 = canonical(cur.dims[0]) if cur.dims else ()
                    if dim0 and _role_of(dim0[0], roles) in ("b", "s"):
                        return True
                elif is_layout_op(user) and user.args[0] is n:
                    stack.append((user, LAYOUT_OPS[user.target](cur, user)))
                elif _pointwise_on(user, n):
                    stack.append((user, cur))
                elif user.target is aten.mm.default and user.args[0] is n and len(cur.dims) == 2:
                    stack.append((user, _matmul_rows(cur, user)))
            except LayoutError:
                continue
    return False


def _pointwise_on(user: torch.fx.Node, n: torch.fx.Node) -> bool:
    """``user`` is pointwise and ``n`` one of its operands of its own shape (an activation's
    backward ``where(mask, 0, grad)`` too)."""
    if user.op != "call_function" or torch.Tag.pointwise not in getattr(user.target, "tags", ()):
        return False
    out, val = node_val(user), node_val(n)
    return n in user.args and isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor) and sizes_of(out.shape) == sizes_of(val.shape)


def _with_head_dim(lay: Layout, like: torch.fx.Node, axis: tuple) -> Layout:
    """An attention-side layout with the head_dim of ``like`` (the output takes v's head_dim), on
    source axis ``axis``."""
    head_dim = (Factor(axis, 1, size_of(node_val(like).shape[-1])),)
    return Layout(lay.dims[:-1] + (head_dim,), lay.pinned)


def _fresh_heads_layouts(like: Layout, heads: int, head_dim: int, name: str, cp: int) -> list:
    """Attention-side layouts for k/v gradients: q's batch and sequence (a pack's tokens), heads
    and head_dim of their own, one per way this rank's heads may sit among all ``heads * cp``:
    rank r's block (``r * heads + i``) first, then every split ``(outer, rank, inner)`` with a
    smaller inner run down to one head in cp (``i * cp + r``)."""
    axis, d = (name, "h"), (Factor((name, "d"), 1, head_dim),)
    out = []
    # (a symbolic head count: only the block)
    splits = range(heads - 1, 0, -1) if isinstance(heads, int) else ()
    for inner in [heads] + [n for n in splits if heads % n == 0]:
        outer = cast(Size, exact_div(heads, inner))  # inner divides heads
        h = canonical((Factor(axis, inner * cp, outer), Factor(axis, 1, inner)))
        dims = (like.dims[0], h, d) if len(like.dims) == 3 else (like.dims[0], h, like.dims[2], d)
        out.append(Layout(dims, Factor(axis, inner, cp)))
    return out


def _with_sequence_of(lay: Layout, kv: torch.Tensor, name: str, cp: int) -> Layout:
    """``lay`` (q's side of attention) with the sequence length of ``kv`` (attention's k or v):
    under dynamic shapes the two lengths are separate symbols, equal only where the program
    makes them so. The sequence keeps q's (source rank, local position) order."""
    seq = 0 if len(lay.dims) == 3 else 2
    want = size_of(kv.shape[seq])
    if dim_size(lay.dims[seq]) == want:
        return lay
    local = [f for f in canonical(lay.dims[seq]) if f.axis != RANK_AXIS]
    per_rank = exact_div(want, cp)
    if len(local) != 1 or per_rank is None:
        raise LayoutError(f"{name}'s sequence of {want} does not split over cp={cp} like the query's")
    dim = tuple(f if f.axis == RANK_AXIS else Factor((name, "s"), 1, per_rank) for f in canonical(lay.dims[seq]))
    return Layout(lay.dims[:seq] + (dim,) + lay.dims[seq + 1:], lay.pinned, lay.fixed)


def _roles_for(lay: Layout) -> dict:
    return _roles_at_attention(lay, allow_broadcast=True)


STYLE = A2AMatch.style


def find(graph: torch.fx.Graph, graph_kind: str, cfg, log=None) -> list[A2AMatch]:
    """Every Ulysses region in ``graph``. ``log(node, reason)`` hears why an attention op is
    not one."""
    return find_with(_region, graph, graph_kind, cfg, log, ops=ATTENTION)


def match_at(node: torch.fx.Node, graph_kind: str, cfg) -> A2AMatch | None:
    """The region of the attention op ``node``, or None (the reason is find's to log)."""
    return match_or_none(_region, node, graph_kind, cfg)


def _region(node, graph_kind) -> A2AMatch:
    if node.target in FORWARD:
        return _forward_region(node, graph_kind)
    return _backward_region(node, graph_kind)


def _forward_region(node, graph_kind) -> A2AMatch:
    args = bound_args(node)
    crossings, groups = {}, set()
    q_cross, _, q_lay, cp, g = _incoming(args["query"], allow_broadcast=False)
    crossings["q"] = q_cross
    groups.add(g)
    kv_lays = []
    for name in ("key", "value"):
        c, _, lay, cp_kv, g = _incoming(args[name], allow_broadcast=True)
        if cp_kv != cp:
            raise LayoutError("q and k/v cross different group sizes")
        crossings[name[0]] = c
        kv_lays.append(lay)
        groups.add(g)
    _check_head_pairing(q_lay, kv_lays, cp, guard=may_guard(node.graph))
    outs = tuple_outputs(node)
    if 0 not in outs:
        raise LayoutError("attention output unused")
    out_start = _with_head_dim(q_lay, args["value"], ("out", "d"))
    out_roles = _roles_for(out_start)
    out_cross, g = _outgoing(outs[0], out_start, out_roles, cp)
    groups.add(g)
    if len(groups) != 1:
        raise LayoutError("crossings use different process groups")
    return A2AMatch(
        graph_kind=graph_kind, attention=node, cp=cp, group_name=groups.pop(), layout=q_cross.layout,
        incoming=crossings, outgoing={"out": out_cross}, **attention_facts(args, heads_per_rank=cp),
    )


def _backward_region(node, graph_kind) -> A2AMatch:
    args = bound_args(node)
    go_cross, _, go_lay, cp, g = _incoming(args["grad_out"], allow_broadcast=False)
    groups = {g}
    outs = tuple_outputs(node)
    outgoing, starts = {}, {}
    for idx, (name, like) in enumerate((("dq", "query"), ("dk", "key"), ("dv", "value"))):
        if idx not in outs:
            raise LayoutError(f"{name} unused")
        shape = node_val(args[like]).shape
        if name == "dq":
            candidates = [_with_head_dim(go_lay, args[like], ("dq", "d"))]
        else:
            # k and v arrive saved from the forward: which heads this rank holds shows only in
            # where their gradients go back to. A block first (the usual split), then the others.
            like_lay = _with_sequence_of(go_lay, node_val(args[like]), name, cp)
            candidates = _fresh_heads_layouts(like_lay, size_of(shape[1]), size_of(shape[-1]), name, cp)
        errors = []
        for start in candidates:
            try:
                c, g = _outgoing(outs[idx], start, _roles_for(start), cp)
                break
            except LayoutError as e:
                errors.append(e)
        else:
            raise errors[0]
        outgoing[name], starts[name] = c, start
        groups.add(g)
    _check_head_pairing(starts["dq"], [starts["dk"], starts["dv"]], cp, guard=may_guard(node.graph))
    if len(groups) != 1:
        raise LayoutError("crossings use different process groups")
    return A2AMatch(
        graph_kind=graph_kind, attention=node, cp=cp, group_name=groups.pop(), layout=go_cross.layout,
        incoming={"grad_out": go_cross}, outgoing=outgoing, **attention_facts(args, heads_per_rank=cp),
    )
