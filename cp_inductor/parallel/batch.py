"""A training batch cut for context parallelism the model does not write.

    compiled = torch.compile(model, backend="cp_inductor", options={"cp_inductor.context_parallel": mesh})
    local = shard_batch(batch, mesh)       # every CP rank holds the same full batch
    loss = compiled(**local).loss          # this rank's share of the loss (see below)

Every per-token tensor of ``batch`` (shape ``[B, T, ...]``, ``T`` the sequence) is cut along the
sequence: each row's documents (where its positions do not step by one: a packed row's position
ids restart at 0; a row without ``position_ids`` is one document) are cut into ``2 * cp`` near-equal
pieces and rank ``r`` keeps pieces ``r`` and ``2cp - 1 - r`` of every document, in the row's order:
the causal work of every document splits evenly (head-tail per document; a plain row is head-tail).
Any document lengths, no padding; every rank must end up with the same number of tokens per row,
which holds where ``T`` is a multiple of ``2 * cp``.

The result holds the rank's tokens and ``position_ids``: the tokens' positions in the full batch,
as the model's rotary embedding needs them. Names: HF transformers' (``input_ids`` or
``inputs_embeds``, ``position_ids``) or torchtitan's (``tokens``, ``positions``: its models take
``model(tokens, positions=...)``); the positions come back under the batch's name, or the
family's where the batch has none. Where ``batch`` has ``labels``, it also holds
``shift_labels`` (the labels shifted by one over the FULL row, then cut: the last token of a piece
predicts the next token of the row, which may sit on another rank) and ``num_items_in_batch``, the
full batch's count of labelled tokens: HF transformers' loss divides this rank's summed loss by it,
so the ranks' losses SUM to the single-device loss, and the parameter gradients summed over the CP
ranks are the single-device gradients (``combine_losses`` and ``sum_gradients`` below). Labels of
one class per row (``[B]``: sequence classification) go to every rank as they are.

The layout (each local token's place in the full row, the documents of the full row) is kept for
the compiled model beside each per-token tensor returned: the backend's context-parallel pass
finds it through whichever of them the model reads and hands it to the graph as inputs, so every
step's batch may be packed differently without a recompile. A model called with tensors not made
here has no layout: the compiled CP program refuses it (it cannot know where the tokens sit).

A flex BlockMask in the batch (torchtitan builds one from the full batch before the model runs,
and hands it to the model as ``attention_masks``) is cut too, where its mask_mod is one the
context-parallel pass knows: documents read from a table of the full batch (``[B, T]`` or
``[T]``, each document one run of tokens) or keys from each query's document start on, causal or
not, a sliding window or not. Its documents
are then the batch's (any positions the batch has must agree, or step by one through each row),
and the model gets a BlockMask over this rank's tokens whose mask_mod reads this rank's document
ids: flex checks a BlockMask's lengths against q and k when the model is traced. That mask means
the full one only to the compiled CP program (the pass replaces the flex call by the CP
attention over the full rows); run without it, it would attend within this rank's tokens alone.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..batch_layout import BLOCK_MASK_DOCUMENTS, POSITION_KEYS, BatchShard, document_bounds, group_of, remember
from .thd_allgather import plan_pack

IGNORE_INDEX = -100  # HF transformers' label of a token that is not predicted
TOKEN_KEYS = ("input_ids", "inputs_embeds", "tokens")  # HF transformers' names, torchtitan's


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document of each token: a new document where the positions do not step by one."""
    starts = torch.ones_like(position_ids, dtype=torch.int64)
    starts[:, 1:] = (position_ids[:, 1:] - position_ids[:, :-1] != 1).long()
    return starts.cumsum(1) - 1


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` the label each token predicts: the next one's (the last predicts nothing)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def _row_places(doc_row: torch.Tensor, cp: int) -> list[list[int]]:
    """Per rank, its places in one row (in row order): pieces r and 2cp-1-r of every document."""
    lengths = torch.unique_consecutive(doc_row, return_counts=True)[1]
    places: list[list[int]] = [[] for _ in range(cp)]
    for piece in plan_pack(lengths, cp, "document"):
        places[piece.rank].extend(range(piece.start, piece.end))
    return places


def plan_places(doc_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """``[cp, B, T // cp]`` int64: each rank's places in each row. Raises ValueError where the
    ranks would hold different numbers of tokens of a row."""
    rows = [_row_places(row, cp) for row in doc_ids]
    counts = {len(places) for row in rows for places in row}
    if len(counts) != 1:
        raise ValueError(
            f"the sequence ({doc_ids.shape[1]} tokens) does not split evenly over {cp} ranks by document "
            f"(ranks would hold {sorted(counts)} tokens); use a length that is a multiple of 2 * cp = {2 * cp}")
    return torch.tensor(rows, dtype=torch.int64).transpose(0, 1).contiguous()


def _is_block_mask(x) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(x, BlockMask)


def _block_masks(value) -> list:
    """The flex BlockMasks ``value`` is or holds in any container pytree knows."""
    return [x for x in pytree.tree_leaves(value, is_leaf=_is_block_mask) if _is_block_mask(x)]


@dataclass(frozen=True)
class MaskMeaning:
    """What a BlockMask made for the full batch computes, as the context-parallel pass reads it."""

    doc_ids: torch.Tensor | None  # [B, T] int64, each document one run; None: one document per row
    causal: bool
    window: int  # keys from q - window on, -1: none


def block_mask_meaning(mask, size: int, tokens: int) -> MaskMeaning:
    """What ``mask`` (a BlockMask over the full batch) computes; raises ValueError with the reason
    where it is not documents / causal / a window the pass takes."""
    from ..passes.analysis import mask_analysis, mask_graph

    if tuple(mask.seq_lengths) != (tokens, tokens):
        raise ValueError(f"a BlockMask over {tuple(mask.seq_lengths)} tokens in a batch of {tokens}")
    traced = mask_graph.trace_python_mask_mod(mask.mask_mod, mask.kv_num_blocks.device)
    if isinstance(traced, str):
        raise ValueError(f"its mask_mod cannot be read: {traced}")
    try:
        facts = mask_analysis.analyze_mask_mod(traced)
    except mask_analysis.NotAMask as e:
        raise ValueError(f"its mask_mod is not a document, causal or sliding-window mask: {e}") from None
    if facts.bound and not facts.mapped and facts.positions is None and isinstance(facts.bound_position, torch.fx.Node):
        documents = _documents_from_bound(traced, facts.bound, facts.bound_position, size, tokens)
        return MaskMeaning(documents, facts.causal, facts.window)
    if facts.positions is not None or facts.mapped or facts.bound:
        raise ValueError(f"its mask_mod ({facts.describe()}) is not taken yet: documents read from a table at the "
                         "query and key index, keys from the query's document start or queries up to the key's "
                         "document end, causal or not, with or without a sliding window, are")
    if facts.doc_ids is None:
        if not facts.causal and facts.window < 0:
            raise ValueError("it attends everywhere (no documents, not causal): pass no mask")
        return MaskMeaning(None, facts.causal, facts.window)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    table = traced.leaves[placeholders.index(facts.doc_ids)] if facts.doc_ids in placeholders else None
    if table is None:
        raise ValueError("its mask_mod computes its document ids itself: documents read from a table are taken")
    table = table.detach().cpu().long()
    if table.dim() == 1 or (table.dim() == 2 and table.shape[0] == 1):
        table = table.reshape(1, -1).expand(size, -1)
    if tuple(table.shape) != (size, tokens):
        raise ValueError(f"its document table has shape {tuple(table.shape)}, not the batch's [{size}, {tokens}]")
    runs = document_ids_of_table(table)
    if any(int(row.unique().numel()) != int(r[-1]) + 1 for row, r in zip(table, runs)):
        raise ValueError("its document table holds one id in separate runs of tokens: a document must be one run")
    return MaskMeaning(runs, facts.causal, facts.window)


def _documents_from_bound(traced, bound: str, table: torch.fx.Node, size: int, tokens: int) -> torch.Tensor:
    """torchtitan's packed-document fast path: keys from ``start[q]`` on (one row) or queries up
    to ``end[b, kv]`` (several rows), the bound read through its tables at the query (key) index.
    The bound evaluated at every place must be each token's document's first (last) place; its
    runs are the documents."""
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in traced.graph.nodes:
        env[n] = sub.node_copy(n, lambda a: env[a])
        if n is table:
            break
    sub.output(env[table])
    # the indices on the tables' device (a BlockMask made on the GPU closes over GPU tables)
    device = next((t.device for t in traced.leaves[4:] if isinstance(t, torch.Tensor)), torch.device("cpu"))
    rows = torch.arange(size, device=device).view(size, 1)
    places = torch.arange(tokens, dtype=torch.int32, device=device).view(1, tokens)
    zero = torch.zeros(1, 1, dtype=torch.int32, device=device)
    q_idx, kv_idx = (places, zero) if bound == "start" else (zero, places)
    with torch.no_grad():
        values = torch.fx.GraphModule({}, sub)(rows, zero, q_idx, kv_idx, *traced.leaves[4:])
    values = values.long().cpu().expand(size, tokens)
    documents = document_ids_of_table(values)
    first, last = document_bounds(documents)
    if not torch.equal(values, first if bound == "start" else last):
        side, place, form = (("key", "first", "keys from start[q] on") if bound == "start" else
                             ("query", "last", "queries up to end[kv]"))
        raise ValueError(f"its {side} bound is not each token's document's {place} place ({form})")
    return documents


def document_ids_of_table(table: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` document of each token: a new document where the table's id changes."""
    starts = torch.zeros_like(table, dtype=torch.int64)
    starts[:, 1:] = (table[:, 1:] != table[:, :-1]).long()
    return starts.cumsum(1)


def local_block_mask(documents: torch.Tensor, meaning: MaskMeaning, block_size):
    """A BlockMask over this rank's tokens whose mask_mod reads their documents (``documents``,
    ``[B, T_local]``; not read where the full mask has none). Every block is listed as partial:
    the CP program never reads the blocks (the pass replaces the call), and flex run without it
    would evaluate the mask_mod everywhere."""
    from torch.nn.attention.flex_attention import BlockMask

    shape, causal, window, by_document = documents.shape, meaning.causal, meaning.window, meaning.doc_ids is not None

    def rank_documents(b, h, q_idx, kv_idx):
        kept = [documents[b, q_idx] == documents[b, kv_idx]] if by_document else []
        if causal:
            kept.append(q_idx >= kv_idx)
        if window >= 0:
            kept.append(q_idx - kv_idx <= window)
        return functools.reduce(operator.and_, kept)

    rows, tokens = shape
    q_block, kv_block = (block_size, block_size) if isinstance(block_size, int) else block_size
    q_blocks, kv_blocks = -(-tokens // q_block), -(-tokens // kv_block)
    device = documents.device
    counts = torch.full((rows, 1, q_blocks), kv_blocks, dtype=torch.int32, device=device)
    indices = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(rows, 1, q_blocks, kv_blocks).contiguous()
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(q_block, kv_block), mask_mod=rank_documents,
                                    seq_lengths=(tokens, tokens))


def _per_token(value, batch_size: int, tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch_size, tokens)


def shard_batch(batch: dict, mesh=None) -> dict:
    """This rank's share of ``batch`` (a dict of model inputs; see the module docstring)."""
    group = group_of(mesh)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens_key = next((key for key in TOKEN_KEYS if batch.get(key) is not None), None)
    if tokens_key is None:
        raise ValueError(f"shard_batch needs the tokens under one of {TOKEN_KEYS}")
    size, tokens = batch[tokens_key].shape[:2]
    device = batch[tokens_key].device
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("shard_batch takes no padding (an attention_mask with zeros): pack the documents instead")
    # the positions under the batch's own name, else the model family's (torchtitan's with "tokens")
    positions_key = next((key for key in POSITION_KEYS if batch.get(key) is not None),
                         "positions" if tokens_key == "tokens" else "position_ids")
    positions = batch.get(positions_key)
    if positions is None:
        positions = torch.arange(tokens, device=device).expand(size, tokens)
    positions = positions.expand(size, tokens).long()
    doc_ids = document_ids(positions.cpu())
    meanings = {}  # id -> (BlockMask, what it computes): torchtitan's, made from the full batch
    for key, value in batch.items():
        for block_mask in _block_masks(value):
            try:
                meanings[id(block_mask)] = (block_mask, block_mask_meaning(block_mask, size, tokens))
            except ValueError as e:
                raise ValueError(f"shard_batch: the flex BlockMask in {key!r} cannot be cut for context "
                                 f"parallelism: {e}") from None
    doc_ids = _documents_of(doc_ids, [meaning for _, meaning in meanings.values()], batch.get(positions_key) is not None)
    if mask is not None and bool((doc_ids[:, -1] > 0).any()):
        # HF reads documents from the position ids only without a mask: with one, the whole row
        # attends causally, which the model without the mask (what this rank runs) would not do
        raise ValueError("an attention_mask with position ids that restart: HF transformers then attends across "
                         "the documents; drop attention_mask to attend within them")
    places = plan_places(doc_ids, cp).to(device)
    mine = places[rank]
    out = {}
    rank_documents = doc_ids.to(device).gather(1, mine)  # what this rank's BlockMasks read
    full = dict(batch)
    full[positions_key] = positions
    labels = batch.get("labels")
    if labels is not None and not _per_token(labels, size, tokens):
        if labels.dim() == 0 or labels.shape[0] != size:
            raise ValueError(f"labels of shape {tuple(labels.shape)} are neither one per token ([B, T]) nor one per "
                             f"row ([B, ...]) of the batch's {size} rows")
        labels = None  # a row's (sequence classification): every rank its copy, as it is
    if labels is not None and batch.get("shift_labels") is None:
        full["shift_labels"] = shift_labels(labels)
    if labels is not None and batch.get("num_items_in_batch") is None:
        out["num_items_in_batch"] = (full["shift_labels"] != IGNORE_INDEX).sum()
    for key, value in full.items():
        if key == "attention_mask":
            continue  # all ones: the documents, not a padding mask, say what attends to what
        if _block_masks(value):
            out[key] = pytree.tree_map(lambda x: local_block_mask(rank_documents, meanings[id(x)][1], x.BLOCK_SIZE)
                                       if _is_block_mask(x) else x, value, is_leaf=_is_block_mask)
        elif _per_token(value, size, tokens):
            index = mine.view(size, -1, *([1] * (value.dim() - 2))).expand(size, -1, *value.shape[2:])
            out[key] = value.gather(1, index.to(value.device))
        else:
            out[key] = value
    shard = BatchShard(cp=cp, rank=rank, group_name=group.group_name, doc_ids=doc_ids.to(device),
                       query_positions=mine.clone(), key_positions=places.transpose(0, 1).reshape(size, -1).contiguous())
    for key, value in out.items():  # each a tensor of its own (a gather): the layout is kept beside it
        if key in full and _per_token(full[key], size, tokens):
            remember(value, shard, key)
    remember(rank_documents, shard, BLOCK_MASK_DOCUMENTS)
    return out


def _documents_of(from_positions: torch.Tensor, meanings: list, positions_given: bool) -> torch.Tensor:
    """The batch's documents: the positions' (where they restart), or those of the BlockMasks it
    holds, which must agree with each other and with restarting positions."""
    tables = [m.doc_ids for m in meanings if m.doc_ids is not None]
    if not tables:
        return from_positions
    if any(not torch.equal(t, tables[0]) for t in tables[1:]):
        raise ValueError("shard_batch: the batch's BlockMasks read different documents")
    if positions_given and bool((from_positions != 0).any()) and not torch.equal(from_positions, tables[0]):
        raise ValueError("shard_batch: the BlockMask's documents are not where the batch's positions restart")
    return tables[0]


def combine_losses(loss: torch.Tensor, mesh=None) -> torch.Tensor:
    """The single-device loss from each rank's share (their sum: each share is already divided by
    the full batch's count, ``num_items_in_batch``); for logging, not differentiated."""
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group_of(mesh))
    return loss


def sum_gradients(module: torch.nn.Module, mesh=None) -> None:
    """After each rank's ``loss.backward()``: every parameter's gradient summed over the CP ranks,
    the single-device gradient. A data-parallel wrapper whose group spans the CP ranks too (as
    torchtitan's FSDP mesh does) reduces them itself, but averages over all its ranks: scale
    the loss by cp before ``backward`` (or, on NCCL, FSDP2's ``set_gradient_divide_factor`` set to
    the data-parallel degree alone) to make it this sum over the CP ranks."""
    group = group_of(mesh)
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
