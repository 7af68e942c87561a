"""A whole-graph pass, not a region rewrite: common-subexpression elimination of a ring
program's joint graph that every rank does alike where collectives are concerned.

Graphs with ring rotations compile without AOTAutograd's CSE (``config.ring_cse``): it
merges any two nodes that agree, collectives included, and ring programs trace different graphs
per rank (load balancing slices by rank), so whether two collectives agree may depend on the
rank; a merge on some ranks only leaves the ranks' NCCL calls unpaired (a hang). Without any CSE
a backward that rotates K/V again pays the rotation twice (the ring helper at B1 S32K H32 D128
cp=2 on NCCL: 1.04x slower than default Inductor, results/ring_helper_s32k_run39.log) and recomputes what the forward had.

This pass merges every pure node computed twice from the same inputs, as AOTAutograd's CSE
would (merging computation never changes which collectives run), but a collective only where
both copies' inputs are built from graph inputs by rank-free ops (views, cat, dtype casts,
clones and other such collectives): then a rank merges exactly when the program, the same on
every rank up to its sliced data, repeats the collective. Slices, index ops and arithmetic are
not rank-free: their arguments are where ring programs differ per rank. Before (joint graph)::

    kv = cat(view(k), view(v));  kv1 = wait(all_to_all(kv, ...))      # forward
    kv' = cat(view(k), view(v)); kv1' = wait(all_to_all(kv', ...))    # backward, same inputs

After::

    kv = cat(view(k), view(v));  kv1 = wait(all_to_all(kv, ...))      # the backward reads kv1

It runs on the joint graph (Inductor's ``joint_custom_pre_pass``), before the partitioner
decides what the backward saves: the merged K/V are saved, as under AOTAutograd's CSE.

:func:`pin_collectives` then keeps every collective in the graph it was written in. The
partitioner copies each node whose inputs a graph has into that graph and never drops a
collective as dead code, so a collective whose inputs are saved anyway (or a backward one
that only reads the forward's inputs) ran in both graphs; what is saved is the min-cut's
choice on this rank's graph, and native CP's all-to-all rotation at cp=4 ran one more backward
rotation on ranks 1-3 than on rank 0 (the hang ``config.ring_cse`` describes).
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..detect.ring import rotates, rotation
from ..record import JOINT, GraphPass

aten, prims = torch.ops.aten, torch.ops.prims
c10d = torch.ops._c10d_functional
NAME = "ring_cse"  # the config switch choosing between this pass and AOTAutograd's CSE

_COLLECTIVES = {c10d.all_to_all_single.default, c10d.all_gather_into_tensor.default, c10d.wait_tensor.default}
_RANK_FREE = _COLLECTIVES | {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.cat.default,
    aten.clone.default, aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.alias.default,
    prims.convert_element_type.default, aten._to_copy.default,
}


def _writes(graph: torch.fx.Graph) -> tuple[bool, set]:
    """(whether any node writes, the nodes written to): reading a written placeholder before and
    after the write is not the same value."""
    any_write, written = False, set()
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            continue
        any_write = True
        for arg, value in zip(schema.arguments, node.args):
            if arg.is_write and isinstance(value, torch.fx.Node):
                written.add(value)
    return any_write, written


def _pure(node: torch.fx.Node) -> bool:
    """An ATen op whose result depends on its arguments only (no write, no random numbers), or
    a getitem; collectives and our transport ops are not."""
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("_c10d_functional", "cp_inductor"):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags and (
        target.overloadpacket not in (aten.empty, aten.empty_strided, aten.empty_like)
    )


def _output_storages(graph: torch.fx.Graph) -> set:
    """Storages the graph returns: a node on one of them stays (two returned tensors that were
    separate in eager must stay separate)."""
    storages = set()
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for value in output.all_input_nodes:
        storage = _storage(value)
        if storage is not None:
            storages.add(storage)
    return storages


def _storage(node: torch.fx.Node):
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except NotImplementedError:
        return None


def merge_repeated(graph: torch.fx.Graph) -> int:
    """Merge every pure node, and every collective with rank-free inputs, computed twice from the
    same inputs; the number of collectives merged."""
    writes, mutated = _writes(graph)
    returned = _output_storages(graph)
    same: dict = {}  # node -> the first node computing the same
    rank_free: dict = {}  # node -> built from graph inputs by rank-free ops only
    first: dict = {}  # key -> that first node
    merged = 0
    for node in list(graph.nodes):
        same[node] = node
        inputs = node.all_input_nodes
        if node.op == "placeholder":
            rank_free[node] = node not in mutated
            continue
        rank_free[node] = node.target in _RANK_FREE and all(rank_free[a] for a in inputs)
        if node.op != "call_function":
            continue
        if node.target in _COLLECTIVES:
            mergeable = rank_free[node]
        else:  # where the graph writes anywhere, only collectives (their inputs are never written)
            mergeable = not writes and _pure(node) and _storage(node) not in returned
        key = _key(node, same) if mergeable else None
        if key is None:
            continue
        if key not in first:
            first[key] = node
            continue
        same[node] = first[key]
        node.replace_all_uses_with(first[key])
        merged += node.target in _COLLECTIVES and node.target is not c10d.wait_tensor.default
        graph.erase_node(node)
    if merged:
        graph.lint()
    return merged


class _Symbolic(Exception):
    pass


def _key(node: torch.fx.Node, same: dict):
    """The node's target and arguments, each input node replaced by the first node computing
    the same; None where an argument is symbolic (a dynamic size)."""

    def freeze(x):
        if isinstance(x, torch.fx.Node):
            return same[x]
        if isinstance(x, (list, tuple)):
            return tuple(freeze(v) for v in x)
        if isinstance(x, dict):
            return tuple(sorted((k, freeze(v)) for k, v in x.items()))
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Symbolic
        return (type(x).__name__, x)  # 1 and 1.0 and True are different arguments

    try:
        key = (node.target, freeze(node.args), freeze(node.kwargs))
        hash(key)
    except (_Symbolic, TypeError):  # TypeError: an argument Python cannot hash
        return None
    return key


def pin_collectives(graph: torch.fx.Graph) -> int:
    """Tag each collective of a joint graph ``must_be_in_forward`` or ``must_be_in_backward``
    by the part AOTAutograd traced it in; the number tagged (0: not a joint graph, or a torch
    whose partitioner does not read these tags)."""
    from torch._functorch import partitioners

    nodes = list(graph.nodes)
    joint = any(n.meta.get("partitioner_tag") == "is_forward" for n in nodes) and any(
        n.op == "placeholder" and "tangents" in str(n.target) for n in nodes
    )
    if not joint or not hasattr(partitioners, "_has_tag_must_be_in_backward"):
        return 0
    tagged = 0
    for node in nodes:
        if node.meta.get("recompute") is not None:
            continue  # activation checkpointing's: the user chose to recompute it in the backward
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
            forward = node.meta.get("partitioner_tag") in ("is_forward", "must_be_in_forward")
            node.meta["partitioner_tag"] = "must_be_in_forward" if forward else "must_be_in_backward"
            tagged += 1
    return tagged


def why_not(graph: torch.fx.Graph, cfg) -> str | None:
    if cfg.ring_cse == "aot":
        return "ring_cse='aot': the graph was compiled with AOTAutograd's CSE"
    if not any(rotation(n) is not None for n in graph.nodes):
        return "no ring rotation in the graph"
    return None


def apply(graph: torch.fx.Graph, cfg) -> int:
    """Merges every rank makes alike (``ring_cse="collective"``), then every collective pinned
    to its graph; the collectives merged."""
    merged = merge_repeated(graph) if cfg.ring_cse == "collective" else 0
    pin_collectives(graph)
    return merged


def wanted(gm: torch.fx.GraphModule, example_inputs, cfg) -> bool:
    """Where the program rotates K/V (also in an autograd.Function's body, or in a call marked
    as rotating inside), unless AOTAutograd's CSE was chosen."""
    return cfg.ring_cse != "aot" and any(
        rotates(n) for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
    )


# Its joint graph is compiled without AOTAutograd's CSE: the merges it makes instead are rank-safe.
PASS = GraphPass(NAME, stage=JOINT, why_not=why_not, apply=apply, wanted=wanted,
            functorch_patches={"cse": False})
