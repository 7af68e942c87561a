"""Context parallelism the program does not write: each self-attention call of a single-device
model becomes attention of this rank's tokens over the whole sequence.

With ``options={"cp_inductor.context_parallel": mesh}`` the model runs on this rank's share of the
batch (``cp_inductor.parallel.shard_batch``: head-tail per document). Attention must be the
model's only op that mixes tokens: one that does otherwise (a convolution or scan over the
sequence, a shift, a softmax over tokens, a matmul contracting them) fails the compile where
``analysis/token_mixing`` follows the token dim to it, and what it cannot follow stays the user's
promise; attention it cannot take fails the compile. Each attention call then reads the keys and values of
every rank and the layout ``shard_batch`` kept: the documents of the full rows and each token's
place in its row, added as graph inputs and handed in on every call. K/V all-gather (the default;
K/V heads HF repeats for SDPA gathered un-repeated)::

    mask = (ids[b, kv] == ids[b, q]) & (kv <= q)        # ids = cumsum(diff(position_ids) != 1), HF's
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)          # or is_causal=True, no mask
    ->
    k_all, v_all = all_gather_tensor_autograd(k, 2, cp), all_gather_tensor_autograd(v, 2, cp)
    plan, meta = cp_inductor.document_shard_plan(doc_ids, query_positions, key_positions, False, True, B, T_local, cp * T_local)
    out = cp_inductor.document_shard_attention(q, k_all, v_all, plan, meta, doc_ids, query_positions, key_positions, scale, True)[0]

(``doc_ids``, ``query_positions``, ``key_positions``: the new inputs; one document per row where
the model's call is causal or bidirectional without a mask; the plan made once per kind of
call.) Ulysses (query heads divisible by cp): q, k, v (K/V heads repeated up to a multiple of cp
where fewer) all-to-all'ed to every token of this rank's heads, the same op over them (queries
and keys at ``key_positions``), the output all-to-all'ed back. The ring (forced only: rows of one
document, no window): the ring helper's autograd function over this rank's q, k, v, its layout
checked on device (``parallel/ring.ring_in_graph``). Which one, per call:
``analysis/context_parallel_cost`` (``context_parallel_style``: auto, or forced). The attention op is the document-mask lowering of torch's flex CP:
FA4 varlen over each query segment's document prefix, reading the keys in place, where it runs.

What it proves per call, else the compile fails naming the call (computing this rank's tokens
alone would change the answer): SDPA or flex attention in the graph itself or in an
activation-checkpointed body, or a packed-sequence (varlen) call in the graph itself (the
program's FA4 calls, varlen calls in a subgraph and attention written out as a softmax over
``[T, T]`` scores are refused for now), no dropout, query and key length this rank's token
count, and a mask that is none, causal, or "same document and causal" over the documents of the
position ids ``shard_batch`` made (HF's packed detection), with or without a causal sliding window
(keys from ``q - w`` on, counted over the places in the full row: Mistral's), read by
``analysis/mask_analysis``.
Positions the model computes from the token index (an ``arange`` over the tokens it sees,
nanoGPT's, other than as a row index into the step's data; a table sliced to their count,
torchtitan's ``freqs_cis[:seqlen]``) become the tokens' places in the full row where a graph with
attention still reads them after the rewrite (``token_places``: one row of the layout's places,
every row cut alike checked on device; an arange feeding only the masks the rewrite drops is dead
by then). A graph without attention is not searched:
what it hands on may be positions or not (a ``cache_position`` arange can cross a graph break as
an output), so positions computed there, or in eager code, are not seen. Where a flex mask_mod reads its tables as inputs of the graph (HF transformers builds the
BlockMask before a graph break), a ``[B, T]`` table read as the documents and one read as
positions are taken as the runs of the position ids and the position ids, checked on device
before the plan reads the layout (``ids_checked``: a device error otherwise)::

    mask_mod = (positions[b, kv] <= positions[b, q]) & (ids[b, q] == ids[b, kv])   # HF's packed flex
    ->
    doc_ids = cp_inductor.ids_checked(cp_doc_ids, position_ids, [ids], [positions])

A BlockMask made before the model (torchtitan's) comes cut by ``shard_batch``: its mask_mod
reads the rank's documents from a table ``shard_batch`` keeps as the layout's own
(``BLOCK_MASK_DOCUMENTS``), taken as the layout's documents with nothing to check.

A varlen call over this rank's rows flattened (``torch.nn.attention.varlen_attn``; aten's
flash op with ``cum_seq_q`` and flash-attn's varlen function are read alike, as
``varlen_calls`` reads them, but have not run under CP: CUDA only) takes its documents from the
``cu_seqlens`` it is given: an input of the graph (the full pack's bounds, made by the data loader
before the model ran and passed through ``shard_batch`` untouched), checked on device against the
full rows (``cu_seqlens_ids``); bounds the graph computes from the tokens it sees are refused.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...lowerings import cp_collectives, document_attention  # noqa: F401 - register the ops it emits
from ...batch_layout import BLOCK_MASK_DOCUMENTS, POSITION_KEYS, BatchShard, head_tail_places, key_of, shard_of
from ...lowerings.cp_collectives import gather_heads, scatter_heads, tokens_at
from ...reporting import TokenMeanShare, VarlenRoute, record_token_mean, record_varlen
from ..analysis import context_parallel_cost, mask_analysis, mask_graph, token_mixing
from ..analysis.graph_walk import Walk
from ..analysis.context_parallel_cost import ALLGATHER, RING, ULYSSES
from ..analysis.op_schema import value
from ..detect.ring import ROTATES_INSIDE
from ..record import DYNAMO, InputsPass, qualified_name
from . import checkpoint_body, flex_calls, token_means, token_places, token_statistics, varlen_calls
from .checkpoint_body import CheckpointBody
from .token_places import is_module_state
from .sdpa_calls import (SDPA, autocast_inputs, erase_dead, lifted_float_reason, read_lifted_floats, sdpa_args,
                         softmax_scale, unrepeated)

NAME = "context_parallel"
INPUT_NAMES = ("cp_doc_ids", "cp_query_positions", "cp_key_positions")
LAYOUT_NAMES = ("cp_doc_ids", *(f"cp_plan_{i}" for i in range(7)), "cp_plan_meta", "cp_query_positions", "cp_key_positions",
                "cp_row_order", "cp_key_places")
DOCUMENTS, ONE_DOCUMENT = "documents", "one document per row"
CU_DOCUMENTS = "documents of its cu_seqlens (checked on device)"  # a varlen call's
CHECKED = " (the mask_mod's tables checked on device against the position ids)"
SHARD_OP = "(FA4 varlen per document segment where it runs)"
DETAIL = {
    ALLGATHER: f"K/V all-gathered, queries of this rank's head-tail pieces over every key {SHARD_OP}",
    ULYSSES: f"all-to-all of heads, every token of this rank's heads {SHARD_OP}",
    RING: "K/V rotated rank to rank, this rank's two pieces of each row over every key (a fused kernel per "
          "step, log-sum-exp merged; the layout checked on device)",
}


class ContextParallelError(RuntimeError):
    """The program cannot be made context-parallel as it is written (the message says why)."""


@dataclass(frozen=True)
class Semantics:
    """What one attention call computes over the full rows."""

    documents: str  # DOCUMENTS (the position ids' resets) or ONE_DOCUMENT
    causal: bool
    window: int = -1  # causal over keys from q - window on (a sliding window over the row's places), -1: none

    def describe(self) -> str:
        window = f", keys from q-{self.window}" if self.window >= 0 else ""
        return f"{self.documents}, {'causal' if self.causal else 'bidirectional'}{window}"


def _attention_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and (n.target in SDPA or n.target is flex_calls.FLEX)]


@dataclass
class Site:
    """An attention call, the graph module holding it, and where that is a checkpointed body
    (``torch.utils.checkpoint``, HF's gradient checkpointing), the region it is the body of."""

    node: torch.fx.Node
    module: torch.fx.GraphModule
    body: CheckpointBody | None = None

    @property
    def region(self) -> torch.fx.Node | None:
        return self.body.hop if self.body is not None else None

    def outer(self, n):
        """What ``n`` is in the outer graph."""
        return self.body.outer(n) if self.body is not None else n

    def thread(self, n: torch.fx.Node, name: str) -> torch.fx.Node:
        """Outer node ``n`` as the call's graph sees it."""
        return self.body.input_for(n, name) if self.body is not None else n

    def drop_if_unread(self, n) -> None:
        """A body input nothing reads any more, and the outer nodes only it read."""
        outer = self.body.drop_unread(n) if self.body is not None else None
        if outer is not None:
            erase_dead(outer.graph, outer)


def _checkpoints(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The outer graph's checkpointed calls whose body holds attention."""
    return [n for n in checkpoint_body.regions(gm) if _attention_calls(getattr(gm, n.args[0].target))]


def _sites(gm: torch.fx.GraphModule) -> list[Site]:
    """Every attention call of ``gm`` (our copy) in the outer graph's order; each checkpointed
    body that holds one becomes a copy of its own (Dynamo's stays as it was)."""
    sites = [Site(n, gm) for n in _attention_calls(gm)]
    for region in _checkpoints(gm):
        attr = region.args[0]
        body = getattr(gm, attr.target)
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(body.graph, {}))
        name, copies = f"{attr.target}_cp", 0
        while hasattr(gm, name):  # a body two regions share: a copy each (they get inputs of their own)
            copies += 1
            name = f"{attr.target}_cp{copies}"
        gm.add_submodule(name, torch.fx.GraphModule(body, graph))
        with gm.graph.inserting_before(region):
            attr_copy = gm.graph.get_attr(name)
        attr_copy.meta.update(attr.meta)
        region.update_arg(0, attr_copy)
        if not attr.users:
            gm.graph.erase_node(attr)
            gm.delete_submodule(attr.target)
        body = CheckpointBody(region, getattr(gm, name))
        sites += [Site(n, body.gm, body) for n in _attention_calls(body.gm)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(sites, key=lambda site: order[site.region or site.node])


def _untaken(gm: torch.fx.GraphModule, tokens) -> str | None:
    """An attention this pass does not take yet, which the program would then compute over this
    rank's tokens alone: a call inside a subgraph other than a checkpointed body of the graph
    itself, a packed-sequence (varlen) call inside any subgraph, the program's FA4 calls, or
    attention spelled as a softmax over ``[.., T, T]`` scores (HF's ``eager``)."""
    bodies = {n.args[0].target for n in _checkpoints(gm)}
    for name, module in gm.named_modules():
        if module is gm or not isinstance(module, torch.fx.GraphModule):
            continue
        if _attention_calls(module) and name not in bodies:
            return f"an attention call inside the subgraph {name} (of a higher-order op other than checkpoint, or nested)"
        if varlen_calls.find(module):
            return f"a packed-sequence (varlen) call inside the subgraph {name}"
    fa4 = [r.attention for r in varlen_calls.fa4_calls(gm)]
    if fa4:
        return f"the program's own FA4 call ({fa4[0]})"
    for n in gm.graph.nodes if tokens is not None else ():
        if n.op in ("call_function", "call_method") and "softmax" in str(n.target):
            scores = value(n.args[0]) if n.args else None
            if isinstance(scores, torch.Tensor) and scores.dim() >= 2 and all(
                    statically_known_true(s == tokens) for s in scores.shape[-2:]):
                return f"attention written out ({n.name}: a softmax over [.., T, T] scores)"
    return None


def _live(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes the graph's outputs read (its vmap bookkeeping, which a BlockMask built in the
    graph leaves behind, is impure but computes nothing the outputs read)."""
    stack = [n for n in graph.nodes if n.op == "output"]
    live: set[torch.fx.Node] = set()
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live


def why_not(gm: torch.fx.GraphModule, cfg) -> str | None:
    if not cfg.context_parallel:
        return "no CP group given (options={'cp_inductor.context_parallel': mesh})"
    return None  # a graph with no attention at all is left as it is by apply


def _layout_input(gm: torch.fx.GraphModule, example_inputs) -> tuple[int, torch.fx.Node, torch.fx.Node | None, BatchShard,
                                                                    torch.fx.Node | None] | None:
    """(the index of the first input shard_batch made, its node, the position_ids input if the
    graph reads it, the layout, the documents a BlockMask shard_batch cut reads if the graph
    reads them), or None where the graph reads none."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found: list[tuple[int, torch.fx.Node, BatchShard, str | None]] = []
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        shard = shard_of(x)
        if shard is not None:
            found.append((i, node, shard, key_of(x)))
    if not found:
        return None
    if len({id(shard) for _, _, shard, _ in found}) > 1:
        raise ContextParallelError("context_parallel: the inputs come from more than one shard_batch call")
    positions = next((node for _, node, _, key in found if key in POSITION_KEYS), None)
    documents = next((node for _, node, _, key in found if key == BLOCK_MASK_DOCUMENTS), None)
    return found[0][0], found[0][1], positions, found[0][2], documents


def _flex_mask(site: Site, args: dict) -> mask_analysis.DocumentMask:
    """What a flex call's mask_mod computes over the tables it reads (as the outer graph has them)."""
    traced = mask_graph.trace_mask_mod_with_tables(args["mask_mod"], tuple(site.outer(b) for b in args["mask_buffers"]),
                                                   value(args["query"]).device)
    if isinstance(traced, str):
        raise mask_analysis.NotAMask(traced)
    facts = mask_analysis.analyze_mask_mod(traced)
    indices = [n for n in traced.graph.nodes if n.op == "placeholder"][:4]  # b, h, q_idx, kv_idx
    if facts.doc_ids is not None and set(indices) & set(Walk([facts.doc_ids], lambda n: n.all_input_nodes)):
        raise mask_analysis.NotAMask("document ids computed from the mask_mod's indices")
    return facts


def _inputs_hint(site: Site, args: dict, positions) -> str:
    """What would let the pass read the mask: the position ids handed in, or, where a flex
    mask_mod reads tables this graph takes as inputs, tables it can check."""
    if positions is None:  # the model made positions of its own (HF's from an arange over its tokens)
        return ("; the model was not handed the position_ids shard_batch made (call it with every key of the "
                "batch shard_batch returned, compiled(**local)), so its mask reads positions it made itself")
    tables = [site.outer(b) for b in args.get("mask_buffers", ())]
    if any(isinstance(t, torch.fx.Node) and t.op == "placeholder" and t is not positions for t in tables):
        return ("; its mask_mod reads tables that come in as inputs of this graph, made in another (HF transformers "
                "builds flex's BlockMask before a graph break): a table of document ids read as it is, beside the "
                "position ids, is checked on device; this one is not that")
    return ""


@dataclass(frozen=True)
class Checks:
    """Tables a call's mask reads that the graph takes in, to check on device (``ids_checked``)."""

    ids: torch.fx.Node | None = None  # read as the documents: must be the runs of the position ids
    positions: torch.fx.Node | None = None  # read as positions: must be the position ids


def _semantics(site: Site, args: dict, positions: torch.fx.Node | None,
               documents: torch.fx.Node | None = None) -> tuple[Semantics, Checks]:
    """What the call computes over the full rows, and the tables to check on device where the
    graph takes them in rather than computing them from the position ids (``documents``: the
    documents of a BlockMask shard_batch cut, the layout's own: nothing to check)."""
    node, mask = site.node, site.outer(args.get("attn_mask"))
    if mask is None:
        return Semantics(ONE_DOCUMENT, bool(args.get("is_causal"))), Checks()
    if not isinstance(mask, (torch.fx.Node, tuple)):
        raise ContextParallelError(f"context_parallel: attention {node.name} takes a mask that is not a tensor of the graph")
    try:
        facts = _flex_mask(site, args) if args.get("flex") else mask_analysis.analyze(mask)
    except mask_analysis.NotAMask as e:
        raise ContextParallelError(f"context_parallel: attention {node.name}'s mask is not one it can shard: {e}") from None
    checks = Checks()
    layouts = documents is not None and site.outer(mask_analysis.table_input(facts, facts.doc_ids)) is documents
    if facts.doc_ids is not None and not layouts and not (
            positions is not None and site.outer(mask_analysis.reset_leaf(facts)) is positions):
        checks = Checks(ids=_input_like(site, mask_analysis.table_input(facts, facts.doc_ids), positions))
        if checks.ids is None:
            raise ContextParallelError(
                f"context_parallel: attention {node.name}'s documents ({facts.describe()}) are not the resets of the "
                f"position ids shard_batch made: their places in the full rows are not known"
                f"{_inputs_hint(site, args, positions)}")
    if facts.positions is not None:  # causal over a table of positions: HF's remap, within runs of +1 steps
        table = _input_like(site, mask_analysis.table_input(facts, facts.positions), positions)
        if table is None or facts.doc_ids is None:
            raise ContextParallelError(
                f"context_parallel: attention {node.name}'s mask ({facts.describe()}) is causal over positions that "
                f"are not the position ids shard_batch made{_inputs_hint(site, args, positions)}")
        checks = Checks(checks.ids, table if table is not positions else None)
    if facts.mapped or facts.bound:
        raise ContextParallelError(
            f"context_parallel: attention {node.name}'s mask ({facts.describe()}) is not taken yet "
            f"(documents from position ids, causal or not, with or without a sliding window, are)"
            f"{_inputs_hint(site, args, positions)}")
    # a window the analysis proves is over token indices within the documents: over the row's places here
    return Semantics(DOCUMENTS if facts.doc_ids is not None else ONE_DOCUMENT, facts.causal, facts.window), checks


def _input_like(site: Site, table: torch.fx.Node | None, positions: torch.fx.Node | None) -> torch.fx.Node | None:
    """``table`` (as the outer graph has it) where it is an integer input shaped as the position ids."""
    table = site.outer(table)
    return table if positions is not None and table is not None and _same_shape(table, positions) else None


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    x, y = value(a), value(b)
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() == y.dim() == 2
            and not x.is_floating_point() and all(statically_known_true(m == n) for m, n in zip(x.shape, y.shape)))


def _check_call(site: Site, tokens) -> dict:
    node = site.node
    args = flex_calls.flex_args(site.module, node)
    if args is not None:
        reason = flex_calls.call_reason(args, node)
        if reason is not None:
            raise ContextParallelError(f"context_parallel: flex_attention {node.name}: {reason}")
    else:
        args = sdpa_args(node)
    lifted = lifted_float_reason(args)
    if lifted is not None:
        raise ContextParallelError(f"context_parallel: attention {node.name}: {lifted}")
    read_lifted_floats(args)  # (every call is taken or the compile fails: the guard is never wasted)
    if args.get("dropout_p") not in (None, 0, 0.0):
        raise ContextParallelError(f"context_parallel: attention {node.name} has dropout")
    q, k = value(args["query"]), value(args["key"])
    # compared without a guard: under dynamic shapes both are the batch's symbolic length
    if q is None or k is None or q.dim() != 4 or not all(statically_known_true(t.shape[2] == tokens) for t in (q, k)):
        shapes = [tuple(t.shape) if t is not None else None for t in (q, k)]
        raise ContextParallelError(
            f"context_parallel: attention {node.name} is not self-attention over this rank's {tokens} tokens "
            f"(query, key shapes {shapes}): cross attention or another sequence is not taken")
    return args


def _add_inputs(gm: torch.fx.GraphModule, shard: BatchShard, batch_input: torch.fx.Node) -> list[torch.fx.Node]:
    """The layout's inputs, their example values sized by the batch input's (symbolic) sizes."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    like = value(batch_input)
    fake_mode = torch._guards.detect_fake_mode([like])
    rows, tokens = like.shape[:2]
    shapes = ((rows, tokens * shard.cp), (rows, tokens), (rows, tokens * shard.cp))
    added: list[torch.fx.Node] = []
    with gm.graph.inserting_after(placeholders[-1]):
        for name, tensor, shape in reversed(list(zip(INPUT_NAMES, shard.inputs(), shapes))):
            node = gm.graph.placeholder(name)
            if fake_mode is not None:
                with fake_mode:
                    node.meta["example_value"] = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            else:
                node.meta["example_value"] = tensor
            node._dynamo_source = None  # type: ignore[attr-defined]  # no user variable (AOTAutograd asks)
            added.insert(0, node)
    return added


def _call_of(args: dict, causal: bool) -> context_parallel_cost.Call:
    q, k = value(args["query"]), value(args["key"])
    b, hq, s_l, d = (_hint(x) for x in q.shape)
    return context_parallel_cost.Call(b, s_l, hq, _hint(k.shape[1]), d, causal, q.element_size(),
                                      str(q.dtype).removeprefix("torch."))


def _hint(n) -> int:  # a size at its hint where it is symbolic (the cost model only)
    return n if isinstance(n, int) else int(n.node.hint or 0)


def _priced_on(device: torch.device, cfg) -> str:
    if cfg.context_parallel_cost_device:
        return cfg.context_parallel_cost_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _ring_why_not(site: Site | None, semantics: Semantics, shard: BatchShard) -> str | None:
    """Why the ring cannot take a call, None where it can: it attends over whole rows (no window;
    a mask over documents where this batch has one per row) held as each rank's two pieces of
    ``2cp``, the layout ``shard_batch`` gives a row of one document (both checked on device in
    every step: a later batch may be packed)."""
    if site is None:
        return "a varlen call's documents (the ring attends over whole rows)"
    if site.body is not None:
        return "not inside an activation-checkpointed body yet"
    if semantics.documents not in (ONE_DOCUMENT, DOCUMENTS) or semantics.window >= 0:
        return "the ring attends over whole rows, without a window"
    if semantics.documents == DOCUMENTS and not bool((shard.doc_ids == shard.doc_ids[:, :1]).all()):
        return "this batch's rows hold several documents (the ring attends over whole rows)"
    expected = head_tail_places(torch.arange(shard.query_positions.shape[1]), shard.rank, shard.cp)
    if not bool((shard.query_positions.cpu() == expected).all()):
        return "this batch's rows are cut per document (a pack), not in the ring's two pieces of each row"
    return None


def style_of(args: dict, semantics: Semantics, shard: BatchShard, works: dict, cfg,
             ring_why_not: str | None, ordinal: int) -> tuple[str, str, int]:
    """(the style this call, the graph's ``ordinal``-th, goes over the ranks by, why, the K/V
    heads it sends)."""
    call = _call_of(args, semantics.causal)
    key = (semantics, call.heads_q)
    if key not in works:  # one layout, priced once per kind of call
        # (a varlen call's documents are priced as the layout's: the bounds come in with the batch)
        ids = torch.zeros_like(shard.doc_ids) if semantics.documents == ONE_DOCUMENT else shard.doc_ids
        works[key] = context_parallel_cost.work(ids, shard.key_positions, shard.cp, semantics.causal, call.heads_q,
                                                semantics.window)
    try:
        forced = context_parallel_cost.forced_style(cfg.context_parallel_style, ordinal)
        query = value(args["query"])
        # asked only where the ring can take the call: the question imports the cuDNN frontend
        ring_backward = (context_parallel_cost.ring_backward_of(query) if ring_why_not is None
                         else context_parallel_cost.FRONTEND)
        style, why = context_parallel_cost.choose(call, works[key], shard.cp, _priced_on(query.device, cfg),
                                                  forced, ring_why_not, ring_backward)
    except ValueError as e:
        raise ContextParallelError(str(e)) from None
    kv_heads = context_parallel_cost.sent_kv_heads(call, style, shard.cp)
    assert kv_heads is not None, (style, call)  # choose() returns a style that takes the call
    return style, why, kv_heads


def _plan(g: torch.fx.Graph, plans: dict, style: str, semantics: Semantics, inputs, anchor: torch.fx.Node,
          ids: torch.fx.Node | None = None):
    """The shard plan of one kind of call, made once per graph (before ``anchor``, its first
    reader): (ids, plan tensors, meta, query positions, key positions, row order, key places);
    ``ids``: the documents where they are not the layout's (a varlen call's).
    Ulysses' tokens are every rank's, put in row order first (``row order``: the slot of each
    place; ``key places``: the place of each slot, to put them back), so that each document is one
    segment read in one FA4 call (several would take a call each); its positions are the index
    (None)."""
    if style == RING:  # no shard plan: the ring's layout is checked by the ring call
        return (inputs[0] if semantics.documents == DOCUMENTS else None, *(None,) * 8, inputs[1], None, None, None)
    key = (style, semantics.documents if ids is None else ids, semantics.causal)  # a window reads the same segments
    if key not in plans:
        doc_ids, query_positions, key_positions = inputs
        with g.inserting_before(anchor):
            if ids is None:
                ids = doc_ids if semantics.documents == DOCUMENTS else g.call_function(torch.zeros_like, (doc_ids,))
            order = places = None
            if style == ULYSSES:
                places = key_positions
                order = g.call_function(torch.argsort, (places,), {"dim": 1})
                query_positions = key_positions = None
                sizes = ((doc_ids, 0), (doc_ids, 1), (doc_ids, 1))
            else:
                sizes = ((query_positions, 0), (query_positions, 1), (key_positions, 1))
            rows, queries, keys = (g.call_function(torch.ops.aten.sym_size.int, size) for size in sizes)
            plan = g.call_function(torch.ops.cp_inductor.document_shard_plan.default,
                                   (ids, query_positions, key_positions, False, semantics.causal, rows, queries, keys))
            parts = g.call_function(operator.getitem, (plan, 0))
            plans[key] = (ids, *(g.call_function(operator.getitem, (parts, i)) for i in range(7)),
                          g.call_function(operator.getitem, (plan, 1)), query_positions, key_positions, order, places)
    return plans[key]


def _rewrite(g: torch.fx.Graph, node: torch.fx.Node, args: dict, semantics: Semantics, style: str, layout: list,
             shard: BatchShard, kv_heads: int) -> dict[torch.fx.Node, torch.fx.Node]:
    """``node`` replaced in its graph ``g``; ``layout``: the plan's nodes (``_plan``) in ``g``.
    Returns the erased node that held the attention's output -> the node that holds it now."""
    with g.inserting_before(node):
        out = _cp_attention(g, args, semantics, style, layout, shard.group_name, shard.cp, kv_heads, shard.rank)
    if args.get("flex"):  # (out, lse), lse unread (_check_call)
        outputs = {user: out for user in node.users if user.args[1] == 0}
        flex_calls.replace(node, out)
        return outputs
    out.meta["example_value"] = value(node)
    node.replace_all_uses_with(out)
    g.erase_node(node)
    erase_dead(g, args.get("attn_mask"))
    return {node: out}


def _cp_attention(g: torch.fx.Graph, args: dict, semantics: Semantics, style: str, layout: list, group_name: str,
                  cp: int, kv_heads: int, rank: int) -> torch.fx.Node:
    """The CP attention of ``args``' ``[B, H, T, D]`` query, key and value over the ranks by
    ``style``, inserted where ``g`` inserts; its output node."""
    ids, *parts, meta, query_positions, key_positions, order, places = layout
    q = args["query"]
    scale = softmax_scale(g, args)
    if style == RING:
        from ...parallel import ring  # the helpers load only where a ring is put in

        out = g.call_function(ring.ring_in_graph, (q, args["key"], args["value"], query_positions, ids,
                                                   semantics.causal, rank, cp, group_name, scale))
        out.meta[ROTATES_INSIDE] = True  # the graph rotates K/V (collective_cse reads it before AOTAutograd)
        return out
    if style == ULYSSES:  # every rank's tokens (rank after rank: at key_positions) of this rank's heads
        k, v = args["key"], args["value"]
        repeat = kv_heads // value(k).shape[1]
        if repeat > 1:  # fewer K/V heads than ranks: each rank its copy (grouping kept: q head h reads h // (Hq / kv_heads))
            k, v = (g.call_method("repeat_interleave", (x, repeat), {"dim": 1}) for x in (k, v))
        q, k, v = (g.call_function(tokens_at, (g.call_function(scatter_heads, (x, "bhsd", cp, group_name)), order))
                   for x in (args["query"], k, v))
    else:
        k, v = (g.call_function(funcol.all_gather_tensor_autograd, (g.call_method("contiguous", (args[name],)), 2, group_name))
                for name in ("key", "value"))
    attention = g.call_function(torch.ops.cp_inductor.document_shard_attention.default,
                                (q, k, v, parts, meta, ids, query_positions, key_positions, scale, semantics.causal),
                                {"window_left": semantics.window} if semantics.window >= 0 else {})
    out = g.call_function(operator.getitem, (attention, 0))
    if style == ULYSSES:  # back to rank order (slot j holds place key_positions[j]), then to this rank's tokens
        out = g.call_function(gather_heads, (g.call_function(tokens_at, (out, places)), "bhsd", cp, group_name))
    return out


def _mask_inputs(args: dict, site: Site) -> list:
    """What a call's mask came in by: SDPA's mask, flex's BlockMask tensors and mask_mod tables."""
    if args.get("flex"):
        return [*site.node.args[4][:-1], *args["mask_buffers"]]
    return [args.get("attn_mask")]


def _own_copy(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, torch.fx.Node]]:
    """``gm`` on a graph of its own, and its nodes by the original's: Dynamo reads its graph's
    placeholders after the backend returns (one per input it passes), so the inputs we add must
    not reach it."""
    graph = torch.fx.Graph()
    nodes: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, nodes))
    for old, new in nodes.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source  # type: ignore[attr-defined]
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    for name in ("_param_name_to_source",):  # what AOTAutograd reads of a Dynamo graph module
        if hasattr(gm, name):
            setattr(copy, name, getattr(gm, name))
    return copy, nodes


def apply(gm: torch.fx.GraphModule, example_inputs: list, cfg) -> tuple[torch.fx.GraphModule, list, Callable]:
    layout = _layout_input(gm, example_inputs)
    rows, tokens = value(layout[1]).shape[:2] if layout is not None else (None, None)
    calls, untaken = _attention_calls(gm) + _checkpoints(gm) + [c.node for c in varlen_calls.find(gm)], _untaken(gm, tokens)
    if not calls and untaken is None:  # nothing mixes the sequence here (as far as it can tell)
        if layout is not None:  # a loss after a graph break reads this rank's labels
            copy = _own_copy(gm)[0]
            shares = _token_means(copy, token_mixing.trail_of(copy, tokens, _per_token(copy), rows), layout[3], cfg)
            for share in shares:
                record_token_mean(TokenMeanShare(share))
            if shares:
                copy.recompile()
                gm = copy
        return gm, example_inputs, _unchanged
    if layout is None:
        raise ContextParallelError(
            "context_parallel: no input of this graph was made by cp_inductor.parallel.shard_batch; call the "
            "compiled model with the batch shard_batch returns (it says where each token sits), in one graph "
            "from its inputs to the attention calls")
    if untaken is not None:
        raise ContextParallelError(f"context_parallel: {untaken} is not taken yet; computing it over this "
                                   "rank's tokens alone would change the answer")
    gm, nodes = _own_copy(gm)
    index, batch_input, positions, shard, documents = layout
    batch_input, positions = nodes[batch_input], nodes.get(positions) if positions is not None else None
    documents = nodes.get(documents) if documents is not None else None
    if shard.group_name != cfg.context_parallel:
        raise ContextParallelError(
            f"context_parallel: the batch was sharded over group {shard.group_name!r}, the compile was given "
            f"{cfg.context_parallel!r}")
    sites = _sites(gm)
    # the token dims followed through the graph as the program wrote it (the CP ops put in carry
    # no example values to follow), read on what is live after the rewrite; after _sites, whose
    # copies of the checkpointed bodies are what the rewrite changes and the checks read
    trail = token_mixing.trail_of(gm, tokens, _per_token(gm), rows)
    checked = [(site, _check_call(site, tokens)) for site in sites]
    semantics = [(site, args, *_semantics(site, args, positions, documents)) for site, args in checked]
    packed = [(call, _check_varlen(call, value(batch_input).shape[0], tokens)) for call in varlen_calls.find(gm)]
    inputs = _add_inputs(gm, shard, batch_input)
    # AOTAutograd fakes a real input Dynamo did not see with sizes of its own, symbols no
    # guard can name (Inductor's 32-bit index check guarded one at T64K on a GPU, and Dynamo
    # failed to build the guards): it gets the fakes sized by the batch input instead
    added_examples = [value(n) for n in inputs]
    id_tables = tuple({c.ids: None for *_, c in semantics if c.ids is not None})
    position_tables = tuple({c.positions: None for *_, c in semantics if c.positions is not None})
    if id_tables or position_tables:  # tables the graph takes in, read as documents: checked first
        with gm.graph.inserting_after(inputs[-1]):
            checked_ids = gm.graph.call_function(torch.ops.cp_inductor.ids_checked.default,
                                                 (inputs[0], positions, list(id_tables), list(position_tables)))
        checked_ids.meta["example_value"] = value(inputs[0])
        inputs[0] = checked_ids
    plans: dict = {}
    works: dict = {}
    routes: list[VarlenRoute] = []
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}  # calls' outputs taken so far (one may feed the next call)
    for ordinal, (site, args, meaning, checks) in enumerate(semantics):
        args = {key: replaced.get(x, x) if isinstance(x, torch.fx.Node) else x for key, x in args.items()}
        name = site.node.name if site.region is None else f"{site.region.name}/{site.node.name}"  # checkpointed
        repeated = (args["key"], args["value"])
        heads = value(args["query"]).shape[1]
        k, v = (unrepeated(x, heads) for x in repeated)  # K/V heads HF repeats only for SDPA: gathered as they are
        if k is not None and v is not None:
            args = {**args, "key": k, "value": v}
        args = {**args, **autocast_inputs(site.module.graph, site.node, {x: args[x] for x in ("query", "key", "value")})}
        style, why, kv_heads = style_of(args, meaning, shard, works, cfg, _ring_why_not(site, meaning, shard), ordinal)
        masks = _mask_inputs(args, site)
        layout_nodes = _plan(gm.graph, plans, style, meaning, inputs, site.region or site.node)
        replaced.update(_rewrite(site.module.graph, site.node, args, meaning, style,
                                 [site.thread(n, name) if n is not None else None for n, name in zip(layout_nodes, LAYOUT_NAMES)],
                                 shard, kv_heads))
        for x in repeated:
            erase_dead(site.module.graph, x)
        for mask in masks:  # inputs of a checkpointed body nothing reads now
            site.drop_if_unread(mask)
        routes.append(VarlenRoute(
            attention=name, style=style, lengths="proven", layout="cp", path="ring" if style == RING else "document_shard",
            reason=why,
            detail=f"cp={shard.cp}, {meaning.describe()}{CHECKED if checks != Checks() else ''}, {DETAIL[style]}"))
    for ordinal, (call, meaning) in enumerate(packed, len(semantics)):
        routes.append(_rewrite_varlen(gm, call, meaning, shard, inputs, batch_input, plans, works, cfg, ordinal))
    modules = {id(m): m for m in (gm, *(site.module for site in sites))}.values()
    if trail is not None:  # the checks below read past attention
        trail.carry(replaced)
    placed = _token_places(modules, sites, inputs[1], trail, tokens)
    _refuse_mixing(gm, trail)
    shares = _token_means(gm, trail, shard, cfg, inputs[1])
    for route in routes:  # reported once nothing refused the graph
        record_varlen(route)
    for share in shares:
        record_token_mean(TokenMeanShare(share))
    for position in placed:
        record_token_mean(TokenMeanShare(position, kind="positions"))
    for module in modules:
        module.graph.lint()
        module.recompile()
    return gm, [*example_inputs, *added_examples], _supplier(index, shard.group_name)


def _check_varlen(call: varlen_calls.VarlenCall, rows, tokens) -> Semantics:
    """What a packed-sequence (varlen) call computes over the full rows: its documents are the
    bounds it is given (an input of the graph: the pack's, made before the model ran), checked on
    device against the rows (``cu_seqlens_ids``); else the compile fails naming the call."""
    reason = varlen_calls.shared_reason(call)
    if reason is not None:
        raise ContextParallelError(f"context_parallel: varlen attention {call.name}: {reason}")
    q, k = value(call.args["query"]), value(call.args["key"])
    if not all(statically_known_true(t.shape[0] == rows * tokens) for t in (q, k)):
        raise ContextParallelError(
            f"context_parallel: varlen attention {call.name} is not self-attention over this rank's {rows} x {tokens} "
            f"tokens (query, key shapes {tuple(q.shape)}, {tuple(k.shape)})")
    cu_q, cu_k = call.args["cu_seq_q"], call.args["cu_seq_k"]
    if cu_q is not cu_k:
        raise ContextParallelError(f"context_parallel: varlen attention {call.name} has query bounds other than its "
                                   "key bounds (cross attention is not taken)")
    if not (isinstance(cu_q, torch.fx.Node) and cu_q.op == "placeholder"):
        raise ContextParallelError(
            f"context_parallel: varlen attention {call.name}'s cu_seqlens are computed in the graph, from this rank's "
            "tokens: pass the bounds of the full pack in with the batch (made before the model runs)")
    return Semantics(CU_DOCUMENTS, call.is_causal)


def _rewrite_varlen(gm: torch.fx.GraphModule, call: varlen_calls.VarlenCall, meaning: Semantics, shard: BatchShard,
                    inputs: list, batch_input: torch.fx.Node, plans: dict, works: dict, cfg, ordinal: int) -> VarlenRoute:
    """``call`` (``[B*T, H, D]``: this rank's rows flattened; the graph's ``ordinal``-th attention
    call) as the CP attention of its rows::

        out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_q, max_k, is_causal=True)
        ->
        ids = cu_seqlens_ids(cu_seqlens, cp_key_positions)                   # [B, T_full], checked
        out = <CP attention>(q.unflatten(0, (B, T)).transpose(1, 2), ...).transpose(1, 2).flatten(0, 1)
    """
    g = gm.graph
    rows_tokens = tuple(value(batch_input).shape[:2])
    found: dict = {}

    def build(k, v):
        with g.inserting_before(call.node):
            rows, tokens = (g.call_function(torch.ops.aten.sym_size.int, (batch_input, d)) for d in (0, 1))
            bhsd = {}
            for name, x in (("query", call.args["query"]), ("key", k), ("value", v)):
                y = g.call_method("transpose", (g.call_method("unflatten", (x, 0, (rows, tokens))), 1, 2))
                y.meta["example_value"] = value(x).unflatten(0, rows_tokens).transpose(1, 2)
                bhsd[name] = y
            args = {**bhsd, "scale": call.args.get("scale")}
            style, why, kv_heads = style_of(args, meaning, shard, works, cfg, _ring_why_not(None, meaning, shard), ordinal)
            bounds = ("cu_seqlens", call.args["cu_seq_q"])  # checked once, one plan for every call reading them
            if bounds not in plans:
                plans[bounds] = g.call_function(torch.ops.cp_inductor.cu_seqlens_ids.default, (call.args["cu_seq_q"], inputs[2]))
        layout = _plan(g, plans, style, meaning, inputs, call.node, ids=plans[bounds])
        with g.inserting_before(call.node):
            out = _cp_attention(g, args, meaning, style, layout, shard.group_name, shard.cp, kv_heads, shard.rank)
            flat = g.call_method("flatten", (g.call_method("transpose", (out, 1, 2)), 0, 1))
        flat.meta["example_value"] = value(call.args["query"]).new_empty(
            (*value(call.args["query"]).shape[:2], value(call.args["value"]).shape[-1]))
        found["route"] = (style, why)
        return flat

    varlen_calls.replace(gm, call, build, "document_shard")
    style, why = found["route"]
    return VarlenRoute(attention=call.name, style=style, lengths="checked", layout="cp", path="document_shard", reason=why,
                       detail=f"cp={shard.cp}, {meaning.describe()}, {DETAIL[style]}")


def _token_places(modules, sites: list[Site], places: torch.fx.Node,
                  trail: token_mixing.TokenTrail | None, tokens) -> list[str]:
    """Positions the model makes from the token index made the tokens' places in the row
    (``token_places``; ``places``: the layout's ``cp_query_positions``, handed to a checkpointed
    body that makes them); what became of each, for the report."""
    bodies = {id(site.module): site.body for site in sites if site.body is not None}
    try:
        found = token_places.find(modules, trail, _live, tokens)
        return token_places.rewrite(found, lambda m: bodies[id(m)].input_for(places, "cp_query_positions")
                                    if id(m) in bodies else places)
    except token_places.Unplaced as e:
        raise ContextParallelError(
            f"context_parallel: {e}; under CP a token's place in the full row is not its index here: compute "
            "positions from the position_ids shard_batch makes (pass them to the model)") from None


def _per_token(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The program's per-token inputs (not its parameters; taken before the layout inputs are added)."""
    return [n for n in gm.graph.find_nodes(op="placeholder") if not is_module_state(n)]


def _refuse_mixing(gm: torch.fx.GraphModule, trail: token_mixing.TokenTrail | None) -> None:
    # the tables ids_checked reads are checked against the layout, not computed with
    live = token_mixing.live_nodes(gm.graph, unread=[(torch.ops.cp_inductor.ids_checked.default, (2, 3))])
    found = trail.mixing(gm, live) if trail is not None else None
    if found is not None:
        raise ContextParallelError(
            f"context_parallel: {found} mixes tokens outside attention; over this rank's tokens alone it would "
            "change the answer (attention must be the model's only op that reads other tokens)")


def _token_means(gm: torch.fx.GraphModule, trail: token_mixing.TokenTrail | None, shard: BatchShard, cfg,
                 places: torch.fx.Node | None = None) -> list[str]:
    """The means over this rank's tokens (a loss that ignores ``num_items_in_batch``) made its
    share of the full batch's (``token_means``), and the statistics a loss reads made the full
    batch's (``token_statistics``; ``places``: the layout's ``cp_query_positions``, which picked
    tokens are found by); what became of each, for the report."""
    if trail is None:
        return []
    try:
        live = _live(gm.graph)
        statistics = token_statistics.find(gm, trail, live)
        means = token_means.find(gm, trail, live)
        if not cfg.context_parallel_global_means:
            kept = "kept, this rank's {} (context_parallel_global_means=False)"
            return [*(f"{s.what()}: {kept.format('statistic')}" for s in statistics),
                    *(f"{m.describe()}: {kept.format('mean')}" for m in means)]
        made = token_statistics.rewrite(gm, statistics, trail, shard.cp, shard.group_name, places)
        return [*made, *token_means.rewrite(gm, means, trail, shard.cp, shard.group_name)]
    except token_means.ShareError as e:
        raise ContextParallelError(f"context_parallel: {e}") from None


def _unchanged(compiled):
    return compiled


def _supplier(index: int, group_name: str):
    """``compiled`` wrapped to hand in, after the program's inputs, the layout of the batch input
    ``index`` (a tensor ``shard_batch`` returned) belongs to."""
    def supply(compiled):
        def with_layout(*args):
            shard = shard_of(args[index])
            if shard is None or shard.group_name != group_name:
                raise ContextParallelError(
                    "context_parallel: this call's batch was not made by cp_inductor.parallel.shard_batch over "
                    f"group {group_name!r}: the compiled program cannot know where its tokens sit")
            return compiled(*args, *shard.inputs())

        return with_layout

    return supply


# The Python functions _cp_attention and token_means put into the graph, by the names
# AOTAutograd's cache reads (the ring's by name: its module loads only where a ring is put in).
EMITS = (*map(qualified_name, (scatter_heads, gather_heads, tokens_at, funcol.all_gather_tensor_autograd, funcol.all_reduce)),
         "cp_inductor.parallel.ring.ring_in_graph")

PASS = InputsPass(NAME, stage=DYNAMO, why_not=why_not, apply=apply, switched=False, emits=EMITS)
