"""cat_of_slices: a ``cat`` that a collective sends and that puts back together consecutive
slices of one tensor is that tensor (or one slice of it), not a copy.

Ring code splits its flat dK/dV buffer into the K and V parts, updates each with a
``slice_scatter``, then concatenates the parts again to rotate them on (native CP's backward)::

    x = slice_scatter(slice_scatter(r, dk, 0, 0, n), dv, 0, n, 2n)
    cat([view(view(x[0:n], shape), [n]), view(view(x[n:2n], shape), [n])])     # a copy of x

    ->  x

Inductor writes ``x`` with one kernel and copies it into the ``cat`` buffer with another (0.25
ms at S32K H32 D128 cp=2, fp32: the kernel ``..._cat_slice_...`` in the profile). A piece may be
reached from its slice through ``view``/``reshape`` ops that come back to the slice's shape (the
same elements in the same order), and may be a piece of ``split``/``split_with_sizes``; pieces
must be consecutive along the ``cat`` dim, in order, from one tensor. Covering all of it gives
the tensor, covering a run of it gives ``slice`` (a view). A piece cut from a tensor that a later
``slice_scatter`` along the same dim left alone there counts as cut from the later one (native
CP's load-balanced ranks update the K half, then the V half, of their buffer). Skipped where the ``cat``'s result
(or a view of it) is a graph output: AOTAutograd expects fresh outputs.

Only cats a collective sends (through views and casts): there Inductor writes the cat into a
buffer of its own; a cat that pointwise kernels read it fuses into them, and removing one (dQ's
halves in native CP's backward) split a fused kernel in two (bf16, CPU). Runs on graphs with a
collective (the CP programs), on the post-grad hook; config switch ``cat_of_slices`` (off until
measured on GPUs).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..analysis.graph_walk import Walk
from ..record import POST_GRAD, GraphPass

aten = torch.ops.aten
NAME = "cat_of_slices"
# Collectives: NCCL's functional ones, the copy-engine transport's (ce_rotation replaces the
# former on GPUs before this pass runs).
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "cp_inductor")
_SAME_ORDER_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_VIEWS = _SAME_ORDER_VIEWS + (
    aten.permute.default, aten.slice.Tensor, aten.select.int, aten.expand.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.unsqueeze.default, aten.transpose.int, aten.alias.default, aten.t.default,
)


def _shape(node) -> tuple | None:
    """Static shape of a node's tensor; None if unknown or dynamic (comparing symbolic sizes
    would add guards)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or any(isinstance(n, torch.SymInt) for n in val.shape):
        return None
    return tuple(val.shape)


def _piece(node: torch.fx.Node, dim: int) -> tuple | None:
    """``(base, start, end)`` when ``node`` holds exactly ``base[start:end]`` along ``dim``,
    else None: a slice or a split piece, or row-major views of one that come back to its shape
    (the same elements in the same order)."""
    shape, cur = _shape(node), node
    for _ in range(8):
        if _shape(cur) == shape and cur.op == "call_function":
            found = _slice_of(cur, dim)
            if found is not None:
                return found
        if not (cur.op == "call_function" and cur.target in _SAME_ORDER_VIEWS):
            return None
        cur = cur.args[0]
    return None


def _slice_of(node: torch.fx.Node, dim: int) -> tuple | None:
    if node.target is aten.slice.Tensor:
        args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
        base, d, start, end, step = args[:5]
        base_shape = _shape(base)
        if base_shape is None or step != 1 or d % len(base_shape) != dim:
            return None
        n = base_shape[dim]
        start = 0 if start is None else (start + n if start < 0 else start)
        end = n if end is None else min(n, end + n if end < 0 else end)
        return base, start, end
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        split = node.args[0]
        if split.target not in (aten.split.Tensor, aten.split_with_sizes.default):
            return None
        base = split.args[0]
        base_shape = _shape(base)
        d = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if base_shape is None or d % len(base_shape) != dim:
            return None
        n = base_shape[dim]
        if split.target is aten.split.Tensor:
            sizes = [min(split.args[1], n - j) for j in range(0, n, split.args[1])]
        else:
            sizes = list(split.args[1])
        i = node.args[1]
        return base, sum(sizes[:i]), sum(sizes[:i + 1])
    return None


def _returned(node: torch.fx.Node) -> bool:
    """Whether ``node`` or a view of it is a graph output."""
    views = Walk([node], lambda n: [u for u in n.users if u.op == "call_function" and u.target in _VIEWS and u.args[0] is n],
                 limit=float("inf"))
    return any(user.op == "output" for n in views for user in n.users)


def _sent(node: torch.fx.Node) -> bool:
    """Whether ``node`` is (through views and casts) what a collective sends: there Inductor
    must write the cat into a buffer of its own; a cat read by pointwise kernels it fuses into
    them instead (removing one there split a fused kernel in two, bf16 on CPU)."""
    def moves(n):
        for user in n.users:
            if user.op != "call_function":
                continue
            if (user.target in _VIEWS or user.target is torch.ops.prims.convert_element_type.default) and user.args[0] is n:
                yield user
            elif user.target is aten.cat.default and n in user.args[0]:  # a piece of a sent cat
                yield user

    return any(getattr(user.target, "namespace", None) in _COLLECTIVE_NAMESPACES and user.args and user.args[0] is n
               for n in Walk([node], moves, limit=float("inf")) for user in n.users)


def _whole(cat: torch.fx.Node) -> tuple | None:
    """``(base, start, end)`` the ``cat`` node reassembles, or None."""
    tensors = cat.args[0]
    out = _shape(cat)
    if out is None or len(tensors) < 2:
        return None
    dim = (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) % len(out)
    found = [_piece(t, dim) for t in tensors]
    pieces = [p for p in found if p is not None]
    if len(pieces) < len(found):
        return None
    base = pieces[-1][0]
    if any(not _same_there(base, p, dim) for p in pieces) or any(a[2] != b[1] for a, b in zip(pieces, pieces[1:])):
        return None
    base_shape = _shape(base)
    assert base_shape is not None  # _slice_of cuts pieces only from a base of static shape
    if base_shape[:dim] + base_shape[dim + 1:] != out[:dim] + out[dim + 1:]:
        return None
    return base, dim, pieces[0][1], pieces[-1][2]


def _same_there(base: torch.fx.Node, piece: tuple, dim: int) -> bool:
    """Whether ``base[start:end]`` equals ``piece`` = (its tensor, start, end): the same tensor, or
    one ``base`` was made from by ``slice_scatter`` calls along ``dim`` that leave [start, end)
    alone (native CP updates the K and the V half of its buffer one after the other)."""
    src, start, end = piece
    cur = base
    for _ in range(16):
        if cur is src:
            return True
        if cur.op != "call_function" or cur.target is not aten.slice_scatter.default:
            return False
        args = list(cur.args) + [0, None, None, 1][len(cur.args) - 2:]
        d, s, e, step = args[2:6]
        shape = _shape(cur)
        if shape is None:
            return False
        n = shape[dim]
        s = 0 if s is None else (s + n if s < 0 else s)
        e = n if e is None else min(n, e + n if e < 0 else e)
        if d % len(shape) != dim or step != 1 or not (e <= start or end <= s):
            return False
        cur = cur.args[0]
    return False


def cat_of_slices_pass(graph: torch.fx.Graph, cfg=None) -> int:
    """Replace every ``cat`` of consecutive slices of one tensor by the tensor or its slice; how
    many were replaced."""
    if not any(getattr(n.target, "namespace", None) in _COLLECTIVE_NAMESPACES for n in graph.nodes):
        return 0
    count = 0
    for cat in list(graph.find_nodes(op="call_function", target=aten.cat.default)):
        found = _whole(cat)
        if found is None or _returned(cat) or not _sent(cat):
            continue
        base, dim, start, end = found
        base_shape = _shape(base)
        assert base_shape is not None  # _whole found a base of static shape
        if (start, end) == (0, base_shape[dim]):
            cat.replace_all_uses_with(base)
        else:
            with graph.inserting_before(cat):
                view = graph.call_function(aten.slice.Tensor, (base, dim, start, end))
            view.meta["val"] = base.meta["val"].narrow(dim, start, end - start)
            cat.replace_all_uses_with(view)
        graph.erase_node(cat)
        count += 1
    return count


PASS = GraphPass(NAME, stage=POST_GRAD, apply=cat_of_slices_pass)
