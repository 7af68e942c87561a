"""Canonical forms the detectors and rewrites rely on, made before either looks at a graph.

Code written against ``torch.distributed``'s in-place collectives (DeepSpeed's and yunchang's
Ulysses, many hand-written all-gathers)::

    out = torch.empty_like(x); dist.all_to_all_single(out, x, group=g)

traces, under functionalization, to ``copy(empty, wait_tensor(all_to_all_single(x)))``: the
collective's result written into a fresh buffer. Functional ``aten.copy(dst, src)`` returns a new
tensor with ``dst``'s metadata and ``src``'s values, so where both have the same shape, dtype and
device and ``dst`` is dense it is exactly ``clone(src, memory_format=contiguous_format)``::

    copy(empty, wait)   ->   clone(wait)

which every detector already follows as a layout op (``empty_like`` of a permuted view is a
permuted buffer: ``permute -> clone -> permute back``, the same strides). Same values and
strides: Inductor generates the same copy kernel either way.

Activation checkpointing (``torch.utils.checkpoint`` under torch.compile) recomputes the
attention in the backward, and AOTAutograd wraps every random op it recomputes, attention
included (its ops are tagged ``nondeterministic_seeded`` for dropout), in an RNG-state
operator::

    run_and_save_rng_state(attention, q, k, v, ...)            (forward: (state, outputs))
    run_with_rng_state(state, attention, q, k, v, ...)         (backward recompute)
    graphsafe_run_with_rng_state(attention, q, k, v, ..., rng_state=generator state)
                                                                (both, on CUDA)

With ``dropout_p == 0`` the attention draws no random numbers, so the wrapper changes nothing:
it becomes the plain call, which every detector matches (the forward's saved state, which
only that recompute read, is still saved: by a wrapper around an empty allocation). Inductor
requires a generator input to be read by exactly one ``graphsafe_run_with_rng_state``: after the
rewrites, :func:`rewrap_rng_attention` puts the unwrapped call (or, where a rewrite replaced it,
another attention call without dropout) back inside one, which changes nothing either.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx

from .record import CANONICAL, POST_GRAD, GraphPass

aten = torch.ops.aten
GENERATOR = "cp_inductor_rng_generator"  # meta of an unwrapped call: the generator input it read
_ALLOCATIONS = (
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
    aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.full.default,
)


def _dense_order(t: torch.Tensor) -> list | None:
    """The dim order (outer to inner) in which ``t``'s memory is a contiguous tensor permuted,
    or None (overlapping or gapped strides)."""
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), -t.shape[i]))
    expected = 1
    strides = [0] * t.dim()
    for i in reversed(order):
        strides[i] = expected
        expected *= t.shape[i]
    same = all(t.shape[i] == 1 or t.stride(i) == strides[i] for i in range(t.dim()))
    return order if same else None


def _fresh_copy(node: torch.fx.Node) -> tuple | None:
    """``(src, dim order)`` of ``copy(dst, src)`` when it is ``src``'s values laid out densely
    in that order of dims, else None."""
    if node.op != "call_function" or node.target is not aten.copy.default or len(node.args) < 2:
        return None
    if node.kwargs.get("non_blocking") or (len(node.args) > 2 and node.args[2]):
        return None
    dst, src = node.args[:2]
    if not isinstance(dst, torch.fx.Node) or not isinstance(src, torch.fx.Node):
        return None
    d, s, out = dst.meta.get("val"), src.meta.get("val"), node.meta.get("val")
    if not all(isinstance(t, torch.Tensor) for t in (d, s, out)):
        return None
    if any(isinstance(x, torch.SymInt) for t in (d, s, out) for x in (*t.shape, *t.stride())):
        return None  # dynamic shapes: comparing them would add guards
    if d.shape != s.shape or d.dtype != s.dtype or d.device != s.device:
        return None
    order = _dense_order(out)
    return None if order is None else (src, order)


def fresh_copies_to_clones(graph: torch.fx.Graph) -> int:
    """Replace every ``copy(dst, src)`` that is a dense copy of ``src`` by that clone (permuted
    where ``dst`` is a permuted dense buffer, as ``empty_like`` of a transposed view makes);
    how many were replaced."""
    count = 0
    for node in list(graph.find_nodes(op="call_function", target=aten.copy.default)):
        found = _fresh_copy(node)
        if found is None:
            continue
        src, order = found
        identity = order == sorted(order)
        with graph.inserting_before(node), _undone_on_error(graph):
            x = src if identity else _call(graph, aten.permute.default, src, order)
            x = _call(graph, aten.clone.default, x, memory_format=torch.contiguous_format)
            if not identity:
                x = _call(graph, aten.permute.default, x, [order.index(i) for i in range(len(order))])
        x.meta.update(node.meta)
        dst = node.args[0]
        node.replace_all_uses_with(x)
        graph.erase_node(node)
        # The buffer only the copy wrote into (through views: empty_like of a permuted view).
        while not dst.users and (dst.target in _ALLOCATIONS or dst.target is aten.permute.default):
            up = dst.args[0] if dst.target is aten.permute.default else None
            graph.erase_node(dst)
            if not isinstance(up, torch.fx.Node):
                break
            dst = up
        count += 1
    return count


def _call(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs)
    src = args[0].meta["val"]
    with src.fake_mode if hasattr(src, "fake_mode") else contextlib.nullcontext():
        node.meta["val"] = target(src, *args[1:], **kwargs)
    return node


def _rng_wrapped(node: torch.fx.Node):
    """``(attention op, its args, its kwargs)`` of an RNG-state wrapper around an attention op
    without dropout, else None."""
    from .analysis.sdpa_ops import SDPA, bound_args

    hops = torch.ops.higher_order
    first = {hops.run_and_save_rng_state: 0, hops.run_with_rng_state: 1}
    graphsafe = getattr(hops, "graphsafe_run_with_rng_state", None)
    if graphsafe is not None:
        first[graphsafe] = 0
    if node.op != "call_function" or node.target not in first:
        return None
    op = node.args[first[node.target]]
    if op not in SDPA:
        return None
    kwargs = {k: v for k, v in node.kwargs.items() if k != "rng_state"}  # graphsafe: the generator state
    plain = torch.fx.Node(node.graph, "probe", "call_function", op, node.args[first[node.target] + 1:], kwargs)
    if bound_args(plain).get("dropout_p", 0.0) != 0.0:
        return None
    return op, plain.args, kwargs


def unwrap_rng_attention(graph: torch.fx.Graph) -> int:
    """Replace every RNG-state wrapper around an attention op without dropout by the plain
    call; how many were replaced."""
    count = 0
    for node in list(graph.nodes):
        found = _rng_wrapped(node)
        if found is None:
            continue
        op, args, kwargs = found
        val = _fake_run(op, args, kwargs)
        with graph.inserting_before(node):
            call = graph.call_function(op, args, kwargs)
            if node.target is torch.ops.higher_order.run_and_save_rng_state:
                # The state output stays (the backward's signature has it): saved by a wrapper
                # around an empty allocation on the attention's device.
                saver = graph.call_function(node.target, (aten.new_empty.default, args[0], [0]))
        call.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        call.meta["val"] = val
        if "rng_state" in node.kwargs:
            call.meta[GENERATOR] = node.kwargs["rng_state"]
        if node.target is torch.ops.higher_order.run_and_save_rng_state:
            for user in list(node.users):  # getitem 0: the state, getitem 1: the outputs
                if user.args[1] == 0:
                    user.replace_input_with(node, saver)
                else:
                    user.replace_all_uses_with(call)
                    graph.erase_node(user)
        else:
            node.replace_all_uses_with(call)
        graph.erase_node(node)
        count += 1
    return count


def rewrap_rng_attention(graph: torch.fx.Graph) -> int:
    """Give every generator input that :func:`unwrap_rng_attention` left unread its one
    ``graphsafe_run_with_rng_state`` again, around the call that was unwrapped, else around the
    first attention call without dropout; how many were wrapped."""
    from .analysis.sdpa_ops import SDPA, bound_args

    graphsafe = getattr(torch.ops.higher_order, "graphsafe_run_with_rng_state", None)
    count = 0
    for gen in graph.find_nodes(op="placeholder"):
        if gen.users or not isinstance(gen.meta.get("val"), torch.Generator):
            continue
        calls = [
            n for n in graph.nodes
            if n.op == "call_function" and n.target in SDPA
            and bound_args(n).get("dropout_p", 0.0) == 0.0 and n.meta.get("val") is not None
        ]
        marked = [n for n in calls if n.meta.get(GENERATOR) is gen]
        if graphsafe is None or not (marked or calls):
            continue
        call = (marked or calls)[0]
        with graph.inserting_before(call):
            wrapped = graph.call_function(graphsafe, (call.target, *call.args), {**call.kwargs, "rng_state": gen})
        wrapped.meta.update({k: v for k, v in call.meta.items() if k != GENERATOR})
        call.replace_all_uses_with(wrapped)
        graph.erase_node(call)
        count += 1
    return count


def _fake_run(op, args, kwargs):
    """``op``'s output values (fake tensors) for these graph arguments."""
    from torch._guards import detect_fake_mode

    vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    mode = detect_fake_mode(torch.utils._pytree.tree_leaves(vals))
    with mode if mode is not None else contextlib.nullcontext():
        return op(*vals[0], **vals[1])


@contextlib.contextmanager
def _undone_on_error(graph: torch.fx.Graph):
    """On an error inside, erase the nodes made there (the graph is left as it was) and re-raise."""
    before = set(graph.nodes)
    try:
        yield
    except BaseException:
        for node in reversed([n for n in graph.nodes if n not in before]):
            if not node.users:
                graph.erase_node(node)
        raise


def canonicalize(graph: torch.fx.Graph, strict: bool = False) -> int:
    """Every canonical form above; how many nodes changed (idempotent: 0 the second time). An
    unexpected error leaves the rest of the graph as it is (detection then sees the raw form)
    unless ``strict``: our analysis must never fail the user's compile."""
    count = 0
    for form in (fresh_copies_to_clones, unwrap_rng_attention):
        try:
            count += form(graph)
        except Exception:  # noqa: BLE001 - see the docstring
            if strict:
                raise
    return count


# Not switched: detection reads these forms, and Inductor needs its RNG wrapper back.
PASS = GraphPass("canonicalize", stage=CANONICAL, switched=False,
            apply=lambda graph, cfg: canonicalize(graph, cfg.strict))
REWRAP_RNG = GraphPass("rewrap_rng", stage=POST_GRAD, switched=False,
                  apply=lambda graph, cfg: rewrap_rng_attention(graph))
