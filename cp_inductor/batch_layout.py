"""Where a batch cut for context parallelism sits: the record ``parallel.shard_batch`` keeps beside
the tensors it returns, and the CP group of a mesh. Apart from the helpers in ``parallel/`` so that
the backend's context-parallel pass reads it without loading them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist


POSITION_KEYS = ("position_ids", "positions")  # the positions' names: HF transformers', torchtitan's
# What a BlockMask shard_batch cut for this rank reads as its documents (``key_of``'s answer).
BLOCK_MASK_DOCUMENTS = "block mask documents"


@dataclass(frozen=True)
class BatchShard:
    """Where this rank's tokens sit in the full batch (tensors on the batch's device)."""

    cp: int
    rank: int
    group_name: str
    doc_ids: torch.Tensor  # [B, T] int64: each token's document in its row (the full batch)
    query_positions: torch.Tensor  # [B, T_local] int64: the local tokens' places in their row
    key_positions: torch.Tensor  # [B, cp * T_local] int64: every rank's local tokens' places, rank after rank

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the compiled CP program takes beside the model's own inputs."""
        return self.doc_ids, self.query_positions, self.key_positions


def head_tail_places(local: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """The places in its row of a rank's local tokens ``local`` (0, 1, ...) where the rank holds
    pieces ``rank`` and ``2cp - 1 - rank`` of ``2cp`` equal pieces of the row: the ring's layout,
    and ``shard_batch``'s for a row of one document. Index arithmetic over ``local``'s own length
    (a cat of pieces would guard on its size in a graph)."""
    half = local.shape[-1] // 2
    return local + torch.where(local < half, rank * half, (2 * cp - 2 - rank) * half)


def document_bounds(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of each row of ``ids`` ``[B, T]`` (a document: a run of equal ids), its
    document's first and last place ([B, T] each)."""
    rows, tokens = ids.shape
    place = torch.arange(tokens, device=ids.device).expand(rows, tokens)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    last = torch.ones_like(ids, dtype=torch.bool)
    last[:, :-1] = first[:, 1:]
    start = torch.cummax(torch.where(first, place, 0), 1).values
    end = torch.where(last, place, tokens).flip(1).cummin(1).values.flip(1)
    return start, end


_SHARDS: dict[int, tuple[weakref.ref, BatchShard, str]] = {}


def remember(tensor: torch.Tensor, shard: BatchShard, key: str) -> None:
    at = id(tensor)
    _SHARDS[at] = (weakref.ref(tensor), shard, key)
    weakref.finalize(tensor, _SHARDS.pop, at, None)


def _entry(tensor):
    entry = _SHARDS.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
    return entry if entry is not None and entry[0]() is tensor else None


def shard_of(tensor) -> BatchShard | None:
    """The layout :func:`shard_batch` cut ``tensor`` (that very tensor) with, or None."""
    entry = _entry(tensor)
    return entry[1] if entry is not None else None


def key_of(tensor) -> str | None:
    """Which entry of the batch :func:`shard_batch` returned ``tensor`` as, or None."""
    entry = _entry(tensor)
    return entry[2] if entry is not None else None


def group_of(mesh) -> dist.ProcessGroup:
    """The CP process group of ``mesh``: a 1-d DeviceMesh, a ProcessGroup, or None (the world)."""
    if mesh is None:
        return dist.group.WORLD
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    if hasattr(mesh, "get_group"):
        if mesh.ndim != 1:
            raise ValueError(f"context parallelism takes a 1-d mesh (the CP dim), got {mesh.ndim} dims: pass mesh['cp']")
        return mesh.get_group()
    raise TypeError(f"expected a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}")
