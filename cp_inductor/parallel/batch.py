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
ranks are the single-device gradients (``combine_losses`` and ``sum_gradients`` below).

The layout (each local token's place in the full row, the documents of the full row) is kept for
the compiled model beside each per-token tensor returned: the backend's context-parallel pass
finds it through whichever of them the model reads and hands it to the graph as inputs, so every
step's batch may be packed differently without a recompile. A model called with tensors not made
here has no layout: the compiled CP program refuses it (it cannot know where the tokens sit).
A flex BlockMask in the batch (torchtitan builds one from the full batch before the model runs)
is refused: build it in the model from the positions returned here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..batch_layout import POSITION_KEYS, BatchShard, group_of, remember
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


def _block_masks(value) -> bool:
    """Whether ``value`` is, or holds in any container pytree knows, a flex BlockMask."""
    import torch.utils._pytree as pytree
    from torch.nn.attention.flex_attention import BlockMask

    def block_mask(x) -> bool:
        return isinstance(x, BlockMask)

    return any(block_mask(x) for x in pytree.tree_leaves(value, is_leaf=block_mask))


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
    if mask is not None and bool((doc_ids[:, -1] > 0).any()):
        # HF reads documents from the position ids only without a mask: with one, the whole row
        # attends causally, which the model without the mask (what this rank runs) would not do
        raise ValueError("an attention_mask with position ids that restart: HF transformers then attends across "
                         "the documents; drop attention_mask to attend within them")
    places = plan_places(doc_ids, cp).to(device)
    mine = places[rank]
    out = {}
    full = dict(batch)
    full[positions_key] = positions
    labels = batch.get("labels")
    if labels is not None and not _per_token(labels, size, tokens):
        raise ValueError(f"labels of shape {tuple(labels.shape)} are not one per token ([B, T]): not a language-model batch")
    if labels is not None and batch.get("shift_labels") is None:
        full["shift_labels"] = shift_labels(labels)
    if labels is not None and batch.get("num_items_in_batch") is None:
        out["num_items_in_batch"] = (full["shift_labels"] != IGNORE_INDEX).sum()
    for key, value in full.items():
        if key == "attention_mask":
            continue  # all ones: the documents, not a padding mask, say what attends to what
        if _block_masks(value):
            # flex checks a BlockMask's lengths against q and k when the model is traced: one
            # made for the full rows fails there, and a mask over this rank's tokens alone would
            # be another answer than the model's
            raise ValueError(
                f"shard_batch: {key!r} holds a flex BlockMask made before the model, for the full batch's {tokens} "
                f"tokens; this rank's model sees {tokens // cp}. Build it in the model from the positions shard_batch "
                "returns (as HF transformers does; the context-parallel pass reads it there): a BlockMask made "
                "before the model is not sharded yet")
        if _per_token(value, size, tokens):
            index = mine.view(size, -1, *([1] * (value.dim() - 2))).expand(size, -1, *value.shape[2:])
            out[key] = value.gather(1, index.to(value.device))
        else:
            out[key] = value
    shard = BatchShard(cp=cp, rank=rank, group_name=group.group_name, doc_ids=doc_ids.to(device),
                       query_positions=mine.clone(), key_positions=places.transpose(0, 1).reshape(size, -1).contiguous())
    for key, value in out.items():  # each a tensor of its own (a gather): the layout is kept beside it
        if key in full and _per_token(full[key], size, tokens):
            remember(value, shard, key)
    return out


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
