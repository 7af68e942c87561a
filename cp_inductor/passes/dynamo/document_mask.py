"""SDPA under a document mask onto packed attention, on the graph Dynamo hands the backend.

HF transformers under torch.compile (and programs that build masks by hand) hand SDPA a
``[B, 1, T, T]`` boolean or additive mask of packed documents, causal within each; default
Inductor computes the mask and runs the masked math or efficient kernel over all ``T x T``
pairs. Where ``analysis/mask_analysis`` proves the mask is "same document [and causal]" over a
table of document ids, the call becomes the packed kernel the cost map chooses (FA4 varlen or
cuDNN's ragged SDPA) over the documents; the mask is no longer built::

    ids = cumsum(diff(position_ids) != 1)                       # HF's packed-sequence detection
    mask = (pos[b, kv] <= pos[b, q]) & (ids[b, q] == ids[b, kv])
    k = k[:, :, None].expand(B, Hkv, g, T, D).reshape(B, Hq, T, D); v = ...
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ->
    ids = cumsum(diff(position_ids) != 1)
    cu_seqlens, meta = cp_inductor.document_plan(ids, None, check, B, T)   # once per mask, not per layer
    out = cp_inductor.document_attention(q, k0, v0, cu_seqlens, meta, ids, scale, True, "fa4")[0]

torch's flex CP (torchtitan's): the BlockMask's ``mask_mod`` maps this rank's query index (and,
under a load balancer, every index) to its place in the pack, and K/V come all-gathered; the
call becomes FA4 varlen over the shard's document segments, the keys read in place::

    out = flex_attention(q_local, k_all, v_all, block_mask=cp_mask)      # doc[b, place(q)] ...
    ->
    plan, meta = cp_inductor.document_shard_plan(doc, places, keys, check, True, B, T_local, T)
    out = cp_inductor.document_shard_attention(q_local, k_all, v_all, plan, meta, doc, places, keys, scale, True)[0]

A mask that is causal alone (``tril``, HF's plain batch where its ids are provably one document)
becomes SDPA with ``is_causal=True`` on the un-repeated K/V (``enable_gqa``), which the dense
lowerings take from there. K/V heads HF repeats only to feed SDPA are read un-repeated (GQA as
is). The switch ``document_mask`` off, or any mask the analysis cannot prove, keeps the call.
"""

from __future__ import annotations

import collections
import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...lowerings import document_attention, fa4_attention, varlen_attention
from ...reporting import VarlenRoute
from ..analysis import attention_provider, mask_analysis, mask_graph
from ..analysis.graph_walk import Walk
from ..analysis.op_schema import value
from ..guard import internal_error
from ..record import DYNAMO, CallPass
from . import checkpoint_body, flex_calls
from .checkpoint_body import CheckpointBody
from .sdpa_calls import (SDPA, autocast_inputs, computed_dtype, erase_dead, lifted_float_reason, read_lifted_floats,
                         sdpa_args, softmax_scale, unrepeated)

aten = torch.ops.aten

NAME = "document_mask"
KEPT = "kept"
PACKED = {"fa4": "fa4_varlen", "cudnn": "cudnn_ragged"}
DENSE_CAUSAL = "sdpa_is_causal"



@dataclass
class MaskedCall:
    """One SDPA call given a mask, what its mask is and where the call went."""

    node: torch.fx.Node
    args: dict
    facts: mask_analysis.DocumentMask | None = None
    analysis_reason: str | None = None  # why the mask is not one we lower
    path: str = KEPT
    reasons: dict = field(default_factory=dict)
    provider: str = "program"
    provider_reason: str = ""
    shared: dict = field(default_factory=dict)  # per mask node: what its first lowered call emitted
    check: bool = True  # the plan checks on device that the document ids are contiguous
    capacity: int = 0  # documents a pack may hold, asserted on device (0: the plan's numbers read on the host)
    # Inside an activation-checkpointed region, its mask an input of the body (``args["attn_mask"]``
    # is then the outer graph's node, which the analysis reads): the plan is built outside, once.
    body: CheckpointBody | None = None

    @property
    def graph(self) -> torch.fx.Graph:
        return self.node.graph

    @property
    def name(self) -> str:
        return self.node.name

    def route(self) -> VarlenRoute:
        detail = self.facts.describe() if self.facts is not None else "mask not read"
        reason = "; ".join(f"{k}: {v}" for k, v in self.reasons.items()) if self.path == KEPT else self.provider_reason
        facts = self.facts
        contiguity = facts.contiguity if facts is not None and (facts.doc_ids is not None or facts.bound) else "-"
        return VarlenRoute(self.name, "local", contiguity,
                           detail, self.path, reason, layout="mask")


def _read_mask(args, cfg):
    """What the mask computes, or why it is kept (also where the reader itself fails: a mask we
    cannot read is a mask we keep)."""
    try:
        if not args.get("flex"):
            return mask_analysis.analyze(args["attn_mask"])
        buffers = args.get("outer_buffers", args["mask_buffers"])  # in a checkpointed region: the outer graph's
        traced = mask_graph.trace_mask_mod(args["mask_mod"], buffers, value(args["query"]).device)
        if isinstance(traced, str):
            raise mask_analysis.NotAMask(traced)
        return mask_analysis.analyze_mask_mod(traced)
    except mask_analysis.NotAMask as why:
        return str(why)
    except Exception as error:  # noqa: BLE001 - the reader's own failure keeps the call, with the reason
        internal_error(error, cfg)  # raises it under strict
        return f"the mask analysis failed ({type(error).__name__}: {str(error).strip()[:120]})"


def find(gm: torch.fx.GraphModule, cfg) -> list[MaskedCall]:
    """The SDPA calls of ``gm`` given an ``attn_mask`` and its flex_attention calls, their
    masks read once per mask."""
    calls: list[MaskedCall] = []
    # per mask (SDPA's mask node, flex's (mask_mod node, buffers)): what it computes or why it is kept,
    # and what its first lowered call emitted (MaskedCall.shared)
    facts: dict[object, mask_analysis.DocumentMask | str] = {}
    shared: dict[object, dict] = {}
    for owner, node, body in _attention_nodes(gm):
        args = flex_calls.flex_args(owner, node)
        if args is None and node.op == "call_function" and node.target in SDPA:
            args = sdpa_args(node)
            if not isinstance(args.get("attn_mask"), torch.fx.Node):
                continue
        if args is None:
            continue
        reason = None if body is None else _body_reason(args, body)
        if reason is not None:
            calls.append(MaskedCall(node, args, analysis_reason=reason, body=body))
            continue
        if body is not None and args.get("flex"):  # the mask_mod's tables as the outer graph has them
            outer = tuple(body.outer(b) for b in args["mask_buffers"])
            constants = tuple(id(operator.attrgetter(n.target)(args["mask_mod"])) for n in args["mask_mod"].graph.nodes
                              if n.op == "get_attr")
            sizes = (tuple(value(args["query"]).shape), tuple(value(args["key"]).shape))
            args["attn_mask"] = (args["mask_mod"].code, constants, sizes, outer)  # one plan for the regions sharing them
            args["outer_buffers"] = outer
        elif body is not None:  # the mask as the outer graph computes it
            args["attn_mask"] = body.outer(args["attn_mask"])
        mask = args["attn_mask"]
        if mask not in facts:
            facts[mask] = _read_mask(args, cfg)
        read = facts[mask]
        call = MaskedCall(node, args, shared=shared.setdefault(mask, {}), body=body)
        if isinstance(read, str):
            call.analysis_reason = read
        else:
            call.facts = read
        calls.append(call)
    # In the outer graph's order (a call in a checkpointed region at its region's place): the
    # first call lowered for a mask builds the plan before itself, so it must come first.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(calls, key=lambda c: order[c.body.hop] if c.body is not None else order[c.node])


def _attention_nodes(gm: torch.fx.GraphModule):
    """(the GraphModule holding it, node, its CheckpointBody or None) for every node of ``gm``
    and of the bodies of its activation-checkpointed regions."""
    for node in gm.graph.nodes:
        yield gm, node, None
    hops = checkpoint_body.regions(gm)
    readers = collections.Counter(hop.args[0].target for hop in hops)
    for hop in hops:
        body = getattr(gm, hop.args[0].target)
        if readers[hop.args[0].target] != 1:  # a body two regions share: new inputs would be one region's
            continue
        record = CheckpointBody(hop, body)
        for node in body.graph.nodes:
            yield body, node, record


def _body_reason(args: dict, body: CheckpointBody) -> str | None:
    """Why an attention call inside an activation-checkpointed region is kept, or None."""
    masks = args["mask_buffers"] if args.get("flex") else (args["attn_mask"],)
    if any(m.op != "placeholder" for m in masks):
        return "a mask built inside an activation-checkpointed region (not lowered yet)"
    placeholders = [n for n in body.gm.graph.nodes if n.op == "placeholder"]
    if len(body.hop.args) != len(placeholders) + 1 or not all(isinstance(body.outer(m), torch.fx.Node) for m in masks):
        return "an activation-checkpointed region whose inputs are not its call's arguments one to one"
    q = value(args["query"])
    if not isinstance(q, torch.Tensor) or not all(isinstance(d, int) for d in q.shape):
        return "symbolic sizes inside an activation-checkpointed region (not lowered yet)"
    return None


def why_not(call: MaskedCall, cfg) -> str | None:
    reason = _why_not(call, cfg)
    if reason is None:
        read_lifted_floats(call.args)
    return reason


def _why_not(call: MaskedCall, cfg) -> str | None:
    a = call.args
    if call.analysis_reason is not None:
        return call.analysis_reason
    assert call.facts is not None  # find() sets the facts where it sets no analysis_reason
    reason = lifted_float_reason(a)
    if reason is not None:
        return reason
    if a.get("dropout_p") and not isinstance(a["dropout_p"], torch.fx.Node):  # a lifted one is 0 (above)
        return f"dropout {a['dropout_p']}"
    if a.get("is_causal"):
        return "is_causal with a mask"
    if a.get("flex"):
        reason = _flex_reason(call)
        if reason is not None:
            return reason
    q, k, v = (value(a[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k and v are not [batch, heads, tokens, head_dim]"
    if call.facts.mapped:
        if call.body is not None:
            return "a shard's mask inside an activation-checkpointed region (not lowered yet)"
        return _shard_reason(call, cfg, q, k, v)
    if not statically_known_true(q.shape[2] == k.shape[2]):
        return f"{q.shape[2]} queries over {k.shape[2]} keys (not self-attention over one pack)"
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int) and q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads"
    if call.facts.bound:
        rank = call.facts.traced.output.meta["val"].dim() if call.facts.traced is not None else 4
        why = _position_reason(call, call.facts.bound_position, rank - 2 if call.facts.bound == "start" else rank - 1, rank)
        if why is not None:
            return why
    elif call.facts.doc_ids is None and call.facts.window < 0:
        if not call.facts.causal:
            return "the mask keeps every key: SDPA without it is the same (not rewritten yet)"
        call.provider_reason = "one document per row: dense causal SDPA, K/V heads as they are"
        return None
    # (a sliding window without document ids: the packed kernels over one document a row)
    for table in (call.facts.doc_ids, call.facts.positions):
        if table is not None and table.meta["val"].dim() not in (1, 2):
            return f"a table of ids or positions of {table.meta['val'].dim()} dims"
    _checked(call, cfg)
    k0 = value(unrepeated(a["key"], q.shape[1]) or a["key"])  # the heads our op will read (GQA as is)
    dtype = computed_dtype(call.node, a["query"])  # (autocast's, where it casts q, k and v)
    candidates = {
        "fa4": fa4_attention.unavailable(q.device, dtype, q.shape[-1], v.shape[-1]),
        "cudnn": varlen_attention.cudnn_unavailable(q.device, dtype, q.shape[-1]),
    }
    if call.facts.window >= 0:
        candidates["cudnn"] = "a sliding window (cuDNN's ragged SDPA here takes none)"
    if cfg.document_mask_capacity and candidates["cudnn"] is None:
        candidates["cudnn"] = "document_mask_capacity (cuDNN's ragged graphs are built per document count)"
    dims = (q.shape[0] * q.shape[2], q.shape[1], k0.shape[1], q.shape[-1])
    shape = None if not all(isinstance(d, int) for d in dims) else attention_provider.Shape(
        "thd", *dims, call.facts.causal, str(dtype).removeprefix("torch."))
    unmeasured = "fa4" if candidates["fa4"] is None else "cudnn"
    choice = attention_provider.choose(shape, candidates, cfg, q.device, unmeasured=unmeasured)
    if choice.provider == "program":
        return choice.reason
    call.provider, call.provider_reason = choice.provider, choice.reason
    if cfg.document_mask_capacity:
        call.capacity = cfg.document_mask_capacity
        call.provider_reason += (f"; at most {call.capacity} documents a pack (document_mask_capacity, asserted on "
                                 "device): no host read, CUDA-graph safe")
    return None


# Ops a position a mask_mod computes from its indices may use: elementwise or a table read, so
# that the same ops compute it over the real index ranges (the trace's indices are small dummies).
_POSITION_OPS = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.floor_divide.default, aten.remainder.Scalar,
                 aten.remainder.Tensor, aten.div.Tensor_mode, aten.index.Tensor, aten.select.int, aten._to_copy.default,
                 aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, aten.neg.default)


def _checked(call: MaskedCall, cfg) -> None:
    """Whether the plan checks the ids' contiguity on device: not where the graph proves it or the
    user promises it (``document_mask_ids``); a table of document bounds is checked as bounds
    whatever the promise (the plan's bounds check does not read ``check``)."""
    facts = call.facts
    assert facts is not None  # (a read mask)
    if facts.doc_ids is None and not facts.bound:  # one document a row: nothing to check
        call.check = False
        return
    call.check = facts.contiguity != mask_analysis.PROVEN and (cfg.document_mask_ids != "promised" or bool(facts.bound))
    if facts.contiguity != mask_analysis.PROVEN and not call.check:
        facts.contiguity = "promised (document_mask_ids)"


def _shard_reason(call: MaskedCall, cfg, q, k, v) -> str | None:
    """A mask_mod reading the documents at positions it computes (torch's flex CP: a shard of
    the queries over every key, through a load balancer's permutation) goes to FA4 varlen over
    the shard's document segments, the keys read in place."""
    facts = call.facts
    # (why_not read the mask; the analysis keeps its trace; _classified maps positions only with
    # document ids or a table of document bounds)
    assert facts is not None and facts.traced is not None and (facts.doc_ids is not None or facts.bound)
    rank = facts.traced.output.meta["val"].dim()
    for node, axis in ((facts.query_positions, rank - 2), (facts.key_positions, rank - 1)):
        why = _position_reason(call, node, axis, rank)
        if why is not None:
            return why
    if facts.bound:
        if not call.args.get("flex") or not isinstance(facts.bound_at, torch.fx.Node):
            return f"a table of document {facts.bound}s read at mapped positions of an SDPA mask (not lowered yet)"
        axis = rank - 2 if facts.bound == "start" else rank - 1
        why = _position_reason(call, facts.bound_position, axis, rank)
        if why is not None:
            return why
        index = [n for n in facts.traced.graph.nodes if n.op == "placeholder"][axis]
        if index is not facts.bound_at and index in Walk(
                [facts.bound_position], lambda n: [] if n is facts.bound_at else n.all_input_nodes, limit=mask_graph.MAX_NODES):
            return (f"a table of document {facts.bound}s read at the index other than through its place "
                    "(not lowered: the pass evaluates it at the place over the pack)")
    elif facts.doc_ids is not None and facts.doc_ids.meta["val"].dim() not in (1, 2):
        return f"a table of document ids of {facts.doc_ids.meta['val'].dim()} dims"
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int) and q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads"
    why = fa4_attention.unavailable(q.device, computed_dtype(call.node, call.args["query"]), q.shape[-1], v.shape[-1])
    if why is not None:
        return f"a shard of the queries over every key runs on FA4 varlen only (keys read in place): {why}"
    _checked(call, cfg)
    call.provider = "fa4"
    call.provider_reason = "queries of a shard over every key: FA4 varlen per document segment, keys in place"
    return None


def _position_reason(call: MaskedCall, node, axis: int, rank: int) -> str | None:
    """Why the pass cannot compute a position of the mask over the real index range, or None."""
    if node is None:
        return None
    if not isinstance(node, torch.fx.Node) or not call.args.get("flex"):
        return _unbuildable(node, axis, rank)
    ops = {n.target for n in _above(node) if n.op == "call_function"}
    if not ops <= set(_POSITION_OPS):
        other = sorted(str(t) for t in ops - set(_POSITION_OPS))[0]
        return f"a position the mask_mod computes with {other} (not evaluated over the real indices)"
    return None


def _flex_reason(call: MaskedCall) -> str | None:
    reason = flex_calls.call_reason(call.args, call.node)
    if reason is not None:
        return reason
    facts = call.facts
    assert facts is not None and facts.traced is not None  # (why_not read the mask; the analysis keeps its trace)
    indices = [n for n in facts.traced.graph.nodes if n.op == "placeholder"][:4]  # b, h, q_idx, kv_idx
    if facts.doc_ids is not None and set(indices) & _above(facts.doc_ids):
        return "document ids computed from the mask_mod's indices"
    return None


def _above(node: torch.fx.Node) -> set:
    """``node`` and every node it reads, in its traced mask graph (a few dozen ops)."""
    return set(Walk([node], lambda n: n.all_input_nodes, limit=mask_graph.MAX_NODES))


def _copy_tables(gm: torch.fx.GraphModule, facts: mask_analysis.DocumentMask, tables, before: torch.fx.Node) -> list:
    """The traced ops computing ``tables`` (document ids, positions), copied into ``gm`` before
    ``before``."""
    traced = facts.traced
    assert traced is not None  # the analysis keeps its trace
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders, traced.leaves))
    needed = {n for table in tables for n in _above(table) if n.op != "placeholder"}
    with gm.graph.inserting_before(before):
        for n in traced.graph.nodes:
            if n in needed:
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
                env[n].meta = {"example_value": n.meta.get("val")}
    return [env[t] for t in tables]


def _unbuildable(position, axis: int, rank: int) -> str | None:
    """Why the pass cannot compute a position expression of a traced SDPA mask, or None: it
    reads the index (plus an offset), tables, and the batch index of a 4-d mask."""
    if isinstance(position, torch.fx.Node):
        return None
    if isinstance(position, mask_analysis.Lin):
        axes = [a for a, _ in position.coefs]
        if axes and axes != [axis] and not (rank == 4 and axes == [0]):
            return f"a position over the mask's dims {axes}"
        return None
    if isinstance(position, mask_analysis.Gather):
        return next((why for i in position.index if (why := _unbuildable(i, axis, rank)) is not None), None)
    return f"a position the pass cannot compute ({type(position).__name__})"


def _built_position(gm: torch.fx.GraphModule, call: MaskedCall, position, axis: int, size, before) -> torch.fx.Node:
    """A position expression of an SDPA mask as a ``[B or 1, n]`` table over the real index
    range: aranges for the indices, the tables it reads copied from the traced mask."""
    g = gm.graph
    device = value(call.args["query"]).device
    facts = call.facts
    assert facts is not None  # (why_not read the mask)

    def built(x):
        if isinstance(x, torch.fx.Node):
            return _copy_tables(gm, facts, [x], before)[0]
        if isinstance(x, mask_analysis.Lin):
            if not x.coefs:
                return x.const
            (a, _), = x.coefs
            length = size if a == axis else _size(g, call, "query", 0)
            index = g.call_function(torch.arange, (length,), {"device": device})
            index = g.call_method("view", (index, 1, -1) if a == axis else (index, -1, 1))
            return g.call_function(operator.add, (index, x.const)) if x.const else index
        return g.call_function(operator.getitem, (built(x.table), tuple(built(i) for i in x.index)))

    with g.inserting_before(before):
        return g.call_method("reshape", (built(position), -1, size))


def _copy_positions(gm: torch.fx.GraphModule, call: MaskedCall, before: torch.fx.Node) -> list:
    """The mapped query and key positions over the real index ranges, as ``[B or 1, n]``
    tables (None where the index is its own position): a flex mask_mod's traced ops with aranges
    in place of its index arguments, or an SDPA mask's position expression built."""
    facts = call.facts
    assert facts is not None and facts.traced is not None  # (why_not read the mask; the analysis keeps its trace)
    rank = facts.traced.output.meta["val"].dim()
    env: dict = {}
    return [None if node is None else _position_table(gm, call, node, axis, before, env)
            for node, axis in ((facts.query_positions, rank - 2), (facts.key_positions, rank - 1))]


def _position_table(gm: torch.fx.GraphModule, call: MaskedCall, node, axis: int, before: torch.fx.Node,
                    env: dict) -> torch.fx.Node:
    """One position of the mask (a traced node or an expression, over ``axis``: the query's or
    the key's of a rank-``r`` mask, ``r - 2`` or ``r - 1``) as a ``[B or 1, n]`` table over the
    real index range. ``env``: the mask_mod's ops copied so far (shared by a call's positions)."""
    facts, a, g = call.facts, call.args, gm.graph
    assert facts is not None and facts.traced is not None  # (why_not read the mask; the analysis keeps its trace)
    rank = facts.traced.output.meta["val"].dim()
    with g.inserting_before(before):
        size = _size(g, call, "query" if axis == rank - 2 else "key", 2)
        if not a.get("flex") or not isinstance(node, torch.fx.Node):
            return _built_position(gm, call, node, axis, size, before)
        if not env:
            env.update(_mask_mod_indices(gm, call))
        for n in facts.traced.graph.nodes:
            if n in _above(node) and n not in env:
                env[n] = g.node_copy(n, lambda x: env[x])
                env[n].meta = {}  # the trace's values have its dummy index sizes: none is better
        return g.call_method("reshape", (env[node], -1, size))


def _pack_bounds(gm: torch.fx.GraphModule, call: MaskedCall, before: torch.fx.Node) -> torch.fx.Node:
    """A mapped mask's table of document bounds over the pack: the mask_mod's ops reading it,
    with the pack index (every key's place) where they read the mapped position."""
    facts, a, g = call.facts, call.args, gm.graph
    assert facts is not None and facts.traced is not None and isinstance(facts.bound_at, torch.fx.Node)  # (_shard_reason)
    axis = 2 if facts.bound == "start" else 3  # a mask_mod's (b, h, q_idx, kv_idx)
    with g.inserting_before(before):
        env = _mask_mod_indices(gm, call)
        size = g.call_function(torch.ops.aten.sym_size.int, (a["key"], 2))
        index = g.call_function(torch.arange, (size,), {"dtype": torch.int32, "device": value(a["query"]).device})
        env[facts.bound_at] = g.call_method("view", (index, *[-1 if d == axis else 1 for d in range(4)]))
        for n in facts.traced.graph.nodes:
            if n in _above(facts.bound_position) and n not in env:
                env[n] = g.node_copy(n, lambda x: env[x])
                env[n].meta = {}
        return g.call_method("reshape", (env[facts.bound_position], -1, size))


def _size(g: torch.fx.Graph, call: MaskedCall, name: str, dim: int):
    """A size of the call's ``name`` tensor where ``g`` can read it: a ``sym_size`` node, or the
    number inside a checkpointed region (static there: ``_body_reason``), whose nodes the outer
    graph cannot read."""
    if call.body is not None:
        return value(call.args[name]).shape[dim]
    return g.call_function(torch.ops.aten.sym_size.int, (call.args[name], dim))


def _mask_mod_indices(gm: torch.fx.GraphModule, call: MaskedCall) -> dict:
    """The traced mask_mod's inputs in ``gm``: aranges over the real index ranges for its index
    arguments (b, h, q_idx, kv_idx, each along its own dim as flex's vmap broadcasts them), the
    Dynamo graph's nodes for its buffers."""
    assert call.facts is not None and call.facts.traced is not None  # (a read mask_mod's trace)
    traced, g = call.facts.traced, gm.graph
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    env = dict(zip(placeholders[4:], traced.leaves[4:]))
    for axis, (name, dim) in enumerate((("query", 0), ("query", 1), ("query", 2), ("key", 2))):
        size = _size(g, call, name, dim)
        index = g.call_function(torch.arange, (size,), {"dtype": torch.int32, "device": value(call.args["query"]).device})
        env[placeholders[axis]] = g.call_method("view", (index, *[-1 if d == axis else 1 for d in range(4)]))
    return env


def _apply_shard(gm: torch.fx.GraphModule, call: MaskedCall, q, k, v, scale: float | torch.fx.Node) -> torch.fx.Node:
    a, g = call.args, gm.graph
    assert call.facts is not None  # (why_not read the mask)
    if "plan" not in call.shared:
        if call.facts.bound:
            ids = _pack_bounds(gm, call, call.node)
        else:
            (ids,) = _copy_tables(gm, call.facts, [call.facts.doc_ids], call.node)
        query_positions, key_positions = _copy_positions(gm, call, call.node)
        with g.inserting_before(call.node):
            sizes = [g.call_function(torch.ops.aten.sym_size.int, x) for x in ((a["query"], 0), (a["query"], 2), (a["key"], 2))]
            plan = g.call_function(torch.ops.cp_inductor.document_shard_plan.default,
                                   (ids, query_positions, key_positions, call.check, call.facts.causal, *sizes), _bounds(call))
            tables = g.call_function(operator.getitem, (plan, 0))
            parts = [g.call_function(operator.getitem, (tables, i)) for i in range(7)]
            meta = g.call_function(operator.getitem, (plan, 1))
        call.shared["plan"] = (ids, query_positions, key_positions, parts, meta)
    ids, query_positions, key_positions, parts, meta = call.shared["plan"]
    with g.inserting_before(call.node):
        attention = g.call_function(torch.ops.cp_inductor.document_shard_attention.default,
                                    (q, k, v, parts, meta, ids, query_positions, key_positions,
                                     scale, call.facts.causal))
        return g.call_function(operator.getitem, (attention, 0))


def apply(gm: torch.fx.GraphModule, call: MaskedCall) -> None:
    a, g = call.args, call.graph  # the call's own graph: gm's, or a checkpointed body's
    assert call.facts is not None  # (why_not read the mask)
    q_heads = value(a["query"]).shape[1]
    k, v = (unrepeated(a[name], q_heads) for name in ("key", "value"))
    if k is None or v is None:
        k, v = a["key"], a["value"]
    q, k, v = autocast_inputs(g, call.node, {"query": a["query"], "key": k, "value": v}).values()
    with g.inserting_before(call.node):
        scale = softmax_scale(g, a)
    if call.facts.mapped:
        out = _apply_shard(gm, call, q, k, v, scale)
        call.path = PACKED[call.provider]
    elif call.facts.doc_ids is None and not call.facts.bound and call.facts.window < 0:
        with g.inserting_before(call.node):
            gqa = bool(value(k).shape[1] != q_heads)  # symbolic heads (dynamic=True): decided with Dynamo's guard
            out = g.call_function(torch.nn.functional.scaled_dot_product_attention, (q, k, v),
                                  {"is_causal": True, "scale": scale, "enable_gqa": gqa})
        call.path = DENSE_CAUSAL
    else:
        if "plan" not in call.shared:  # the first call reading this mask, in graph order: it dominates the rest
            call.shared["plan"] = _plan(gm, call)
        ids, positions, cu, meta = call.shared["plan"]
        if call.body is not None:  # the plan is the outer graph's: handed to the body as inputs
            ids, positions, cu, meta = (call.body.input_for(x) for x in (ids, positions, cu, meta))
        with g.inserting_before(call.node):
            attention = g.call_function(torch.ops.cp_inductor.document_attention.default,
                                        (q, k, v, cu, meta, ids, positions, scale, call.facts.causal, call.provider,
                                         *([call.facts.window] if call.facts.window >= 0 or call.capacity else []),
                                         *_capacity(call)), _bounds(call))
            out = g.call_function(operator.getitem, (attention, 0))
        call.path = PACKED[call.provider]
    body_masks = _mask_inputs(call) if call.body is not None else []
    if a.get("flex"):  # (out, lse): the readers of out read ours; what reads lse is dead
        flex_calls.replace(call.node, out)
    else:
        out.meta["example_value"] = value(call.node)
        call.node.replace_all_uses_with(out)
        g.erase_node(call.node)
    for dead in (a["key"], a["value"], *a.get("mask_buffers", ()), a["attn_mask"] if call.body is None and not a.get("flex") else None):
        erase_dead(g, dead)
    if call.body is not None:  # the body no longer takes the mask; the outer graph no longer builds it
        for mask in body_masks:
            call.body.drop_unread(mask)
        erase_dead(gm.graph, a["attn_mask"])
        call.body.gm.recompile()


def _mask_inputs(call: MaskedCall) -> list:
    """The inputs of the call's checkpointed region its mask came through: SDPA's mask, or flex's
    BlockMask tensors and mask_mod tables."""
    if not call.args.get("flex"):
        return [sdpa_args(call.node)["attn_mask"]]
    block_mask = [x for x in call.node.args[4] if isinstance(x, torch.fx.Node) and x.op == "placeholder"]
    return list(dict.fromkeys([*call.args["mask_buffers"], *block_mask]))


def _plan(gm: torch.fx.GraphModule, call: MaskedCall) -> tuple:
    """(ids, positions, cu_seqlens, meta): the plan of ``call``'s mask, in the graph that computes
    the mask, before the call (or before the checkpointed region holding it)."""
    facts, g = call.facts, gm.graph
    assert facts is not None and (facts.doc_ids is not None or facts.bound or facts.window >= 0)  # (a document mask)
    before = call.node if call.body is None else call.body.hop
    positions: list[torch.fx.Node] = []  # a table of positions to check causal over, where there is one
    if facts.doc_ids is None and not facts.bound:  # a window over rows of one document: one id for every token
        with g.inserting_before(before):
            ids = g.call_function(torch.zeros, (_size(g, call, "query", 2),),
                                  {"dtype": torch.int32, "device": value(call.args["query"]).device})
    elif facts.bound:  # the bound over its index is the ids' table
        rank = facts.traced.output.meta["val"].dim() if facts.traced is not None else 4
        ids = _position_table(gm, call, facts.bound_position, rank - 2 if facts.bound == "start" else rank - 1,
                              before, {})
    else:
        tables = [facts.doc_ids] + ([facts.positions] if facts.positions is not None else [])
        ids, *positions = _copy_tables(gm, facts, tables, before)
    with g.inserting_before(before):
        sizes = [_size(g, call, "query", d) for d in (0, 2)]
        plan = g.call_function(torch.ops.cp_inductor.document_plan.default,
                               (ids, *(positions or [None]), call.check, *sizes, *_capacity(call)),
                               {**_bounds(call), **({"stepping": True} if facts.positions_step else {})})
        cu, meta = (g.call_function(operator.getitem, (plan, i)) for i in (0, 1))
    return ids, positions[0] if positions else None, cu, meta


def _capacity(call: MaskedCall) -> list:
    """The ops' trailing ``capacity`` argument, where there is one (goldens without it unchanged)."""
    return [call.capacity] if call.capacity else []


def _bounds(call: MaskedCall) -> dict:
    """The ops' ``bounds`` keyword where the ids are a table of document starts or ends."""
    assert call.facts is not None  # (a lowered call)
    return {"bounds": document_attention.BOUNDS[call.facts.bound]} if call.facts.bound else {}


PASS = CallPass(NAME, stage=DYNAMO, why_not=why_not, apply=apply, finds=find)
assert document_attention.PROVIDERS == tuple(PACKED)
