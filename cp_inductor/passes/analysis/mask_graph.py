"""The aten graph that builds one tensor of a Dynamo graph: what the mask analysis reads.

Dynamo's graph spells a mask in torch-level calls (``x[(b, q)]``, ``torch.diff``, ``.to``);
tracing the mask's ancestors alone with ``make_fx`` gives the few aten ops the analysis knows
(index, arange, comparisons, cumsum ...), under symbolic sizes where the program's are. The
traced inputs stand for the Dynamo graph's leaves (placeholders, attributes) the mask reads; the
trace runs on fake tensors, so no ``T x T`` mask is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .graph_walk import Walk
from .op_schema import value

MAX_NODES = 400  # a mask is a few dozen ops; beyond this it is not one we read
MAX_LEAF_BYTES = 64 << 20


@dataclass
class Traced:
    graph: torch.fx.Graph  # aten ops; placeholder i stands for ``leaves[i]``
    leaves: list  # the Dynamo graph's nodes the traced ops read (None: a flex mask_mod's index)
    output: torch.fx.Node  # the traced tensor in ``graph``


def _leaf(node: torch.fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def _dummy(node: torch.fx.Node):
    """A real stand-in of a leaf (shape at its hints), or why there is none."""
    v = value(node)
    if isinstance(v, torch.SymInt):
        return int(v.node.hint) if v.node.hint is not None else None
    if isinstance(v, (int, float, bool)):
        return v
    if not isinstance(v, torch.Tensor):
        return None
    shape = [int(s.node.hint) if isinstance(s, torch.SymInt) else s for s in v.shape]
    if v.dtype.itemsize * torch.Size(shape).numel() > MAX_LEAF_BYTES:
        return None
    return torch.zeros(shape, dtype=v.dtype, device=v.device)


def _copy_producers(nodes: list, sub: torch.fx.Graph, env: dict) -> list[torch.fx.Node] | str:
    """The ops of ``nodes``' graph computing them, copied into ``sub`` (``env``: theirs by the
    graph's), their leaves as new placeholders; the leaves, or why it cannot be had."""
    graph = nodes[0].graph
    above = set(Walk(nodes, lambda n: () if _leaf(n) else n.all_input_nodes, limit=MAX_NODES))
    if len(above) >= MAX_NODES:
        return f"the mask is built by more than {MAX_NODES} ops"
    leaves: list[torch.fx.Node] = []
    for n in graph.nodes:
        if n not in above:
            continue
        if _leaf(n):
            env[n] = sub.placeholder(f"leaf_{len(leaves)}")
            leaves.append(n)
        elif n.op in ("call_function", "call_method"):
            env[n] = sub.node_copy(n, lambda a: env[a])
        else:
            return f"the mask reads {n.op} {n.target}"
    return leaves


def trace(node: torch.fx.Node) -> Traced | str:
    """The aten graph computing ``node`` from the leaves it reads, or why it cannot be had."""
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    leaves = _copy_producers([node], sub, env)
    if isinstance(leaves, str):
        return leaves
    sub.output(env[node])
    return trace_module(torch.fx.GraphModule(node.graph.owning_module, sub), leaves, [_dummy(n) for n in leaves])


def trace_mask_mod_with_tables(mask_mod: torch.fx.GraphModule, buffers, device: torch.device) -> Traced | str:
    """:func:`trace_mask_mod` with the ops of the Dynamo graph that compute its tables traced in
    too (its leaves: the graph's inputs), so that a table the graph builds (HF's document ids from
    the position ids, its ``cache_position`` arange) reads as what it computes."""
    tables = [b for b in buffers if isinstance(b, torch.fx.Node)]
    if len(tables) != len(buffers) or not tables:
        return trace_mask_mod(mask_mod, buffers, device)
    sub = torch.fx.Graph()
    indices = [sub.placeholder(f"index_{i}") for i in range(4)]
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    leaves = _copy_producers(tables, sub, env)
    if isinstance(leaves, str):
        return leaves
    inner = [n for n in mask_mod.graph.nodes if n.op == "placeholder"]
    mapped = {p: x for p, x in zip(inner, [*indices, *(env[b] for b in tables)])}
    sub.output(sub.graph_copy(mask_mod.graph, mapped))
    attrs = {n.target: _attr(mask_mod, n.target) for n in mask_mod.graph.nodes if n.op == "get_attr"}
    attrs.update({n.target: _attr(tables[0].graph.owning_module, n.target) for n in leaves if n.op == "get_attr"})
    module = torch.fx.GraphModule(attrs, sub)
    # the indices' leaves stay None (they stand for themselves), as trace_mask_mod's do
    index = [torch.zeros([2 + i if d == i else 1 for d in range(4)], dtype=torch.int32, device=device) for i in range(4)]
    return trace_module(module, [None] * 4 + leaves, index + [_dummy(n) for n in leaves], "fake")


def _attr(module: torch.nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def trace_mask_mod(mask_mod: torch.fx.GraphModule, buffers, device: torch.device) -> Traced | str:
    """A flex ``mask_mod(b, h, q_idx, kv_idx, *buffers)`` body in aten ops: its first four
    inputs (the indices, no leaf of the Dynamo graph) stand for themselves."""
    # Each index along its own dim, as flex's vmap broadcasts them (a 0-d integer tensor would
    # index as a Python int, read by a data-dependent .item()).
    index = [torch.zeros([2 + i if d == i else 1 for d in range(4)], dtype=torch.int32, device=device) for i in range(4)]
    return trace_module(mask_mod, [None] * 4 + list(buffers), index + [_dummy(n) for n in buffers], "fake")


def trace_python_mask_mod(mask_mod, device: torch.device) -> Traced | str:
    """A flex ``mask_mod`` as a Python function (a BlockMask's, made before the model), in aten
    ops: its four index inputs, then one input per tensor it reads from its closures (leaves: those
    tensors, None for the indices). Traced on small index tensors with the tables as they are."""
    from torch.fx.experimental.proxy_tensor import make_fx

    index = [torch.zeros([2 + i if d == i else 1 for d in range(4)], dtype=torch.int32, device=device) for i in range(4)]
    try:
        with torch._guards.tracing(None):
            module = make_fx(lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx), tracing_mode="real")(*index)
    except Exception as error:  # noqa: BLE001 - a mask we cannot trace is a mask we cannot shard
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        return f"tracing the mask_mod failed ({type(error).__name__}: {first})"
    graph, env = torch.fx.Graph(), {}
    inputs = [n for n in module.graph.nodes if n.op == "placeholder"]
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    tables: dict[str, torch.fx.Node] = {}
    leaves: list = [None] * len(inputs)
    for n in module.graph.nodes:
        if n.op == "get_attr" and n.target not in tables:
            with graph.inserting_after(list(graph.nodes)[len(inputs) + len(tables) - 1]):
                tables[n.target] = graph.placeholder(f"table_{len(tables)}")
            tables[n.target].meta = dict(n.meta)
            leaves.append(_attr(module, n.target))
    for n in module.graph.nodes:
        if n.op == "get_attr":
            env[n] = tables[n.target]
        elif n.op == "call_function":
            env[n] = graph.node_copy(n, lambda a: env[a])
        elif n.op == "output":
            output = n.args[0]
    if not isinstance(output, torch.fx.Node) or len(inputs) != 4:
        return "the mask_mod does not take (b, h, q_idx, kv_idx) and return one tensor"
    graph.output(env[output])
    return Traced(graph, leaves, env[output])


def trace_module(module: torch.fx.GraphModule, leaves: list, dummies: list, mode: str = "symbolic") -> Traced | str:
    if any(d is None for d in dummies):
        return "the mask reads an input the analysis cannot stand in for (not a tensor or size, or over 64 MiB)"
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        with torch._guards.tracing(None):  # its own shape env: no guard of ours reaches Dynamo's
            traced = make_fx(module, tracing_mode=mode)(*dummies)
    except Exception as error:  # noqa: BLE001 - a mask we cannot trace is a mask we keep
        first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
        return f"tracing the mask's ops failed ({type(error).__name__}: {first})"
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    output = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    if len(placeholders) != len(leaves) or not isinstance(output, torch.fx.Node):
        return "tracing the mask's ops changed its inputs"
    return Traced(traced.graph, leaves, output)
