"""Sequence sharding for context parallelism: a rank's slice of a full-sequence tensor and back.

Contiguous sharding gives rank r tokens ``[r*S/cp, (r+1)*S/cp)``; load-balanced sharding (for
causal attention) splits the sequence into 2*cp chunks and gives rank r chunks r and 2*cp-1-r.
"""

from __future__ import annotations

import torch
import torch.distributed as dist



def gqa(heads_q, heads_kv) -> bool:
    """SDPA's ``enable_gqa`` for these head counts, as a Python bool: under ``dynamic=True`` head
    counts are symbolic and SDPA takes no SymBool, so the comparison is branched on (Dynamo
    guards on it, as it would on any head-count check)."""
    return True if heads_q != heads_kv else False

def load_balanced_chunks(rank: int, cp: int) -> tuple[int, int]:
    # Two-chunk (head-tail) causal balance: rank r holds chunks r and 2*cp-1-r.
    return rank, 2 * cp - 1 - rank


def chunk_runs(chunks, length: int) -> list[tuple[int, slice]]:
    """(first sequence position, this rank's rows) of each stretch of consecutive ``chunks`` of
    ``length`` tokens, in local order: rank cp-1 of the load-balanced layout holds chunks cp-1
    and cp, one stretch, whose causal attention is one prefix call and one square causal call
    instead of two of each."""
    runs: list[list[int]] = []
    for i, chunk in enumerate(chunks):
        if runs and chunk == chunks[runs[-1][1] - 1] + 1:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [(chunks[a] * length, slice(a * length, b * length)) for a, b in runs]


def shard_sequence(
    x: torch.Tensor, seq_dim: int, rank: int, cp: int, *, load_balanced: bool = False
) -> torch.Tensor:
    """This rank's slice of a full-sequence tensor (a copy)."""
    if x.shape[seq_dim] % (2 * cp if load_balanced else cp):
        raise ValueError(f"sequence length {x.shape[seq_dim]} does not split over cp={cp}")
    if not load_balanced:
        return x.chunk(cp, dim=seq_dim)[rank].contiguous()
    chunks = x.chunk(2 * cp, dim=seq_dim)
    first, second = load_balanced_chunks(rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def unshard_sequence(
    shards: list[torch.Tensor], seq_dim: int, *, load_balanced: bool = False
) -> torch.Tensor:
    """Full-sequence tensor from every rank's slice, in rank order (inverse of shard_sequence)."""
    cp = len(shards)
    if not load_balanced:
        return torch.cat(shards, dim=seq_dim)
    ordered: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = load_balanced_chunks(rank, cp)
        ordered[first], ordered[second] = shard.chunk(2, dim=seq_dim)
    return torch.cat(ordered, dim=seq_dim)


def gather_sequence(
    x: torch.Tensor, seq_dim: int, *, group=None, load_balanced: bool = False
) -> torch.Tensor:
    """All-gather every rank's slice and unshard (for checks; not differentiable)."""
    group = group if group is not None else dist.group.WORLD
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, seq_dim, load_balanced=load_balanced)


def sequence_order(gathered: torch.Tensor, cp: int, load_balanced: bool):
    """Gathered k, v stacked, ``[cp*2, B, H, S/cp, D]`` (rank-major) -> k, v ``[B, H, S, D]``
    in sequence order (in rank order when not load balanced: also the key order a
    non-causal call may use)."""
    _, b, h, s_l, d = gathered.shape
    gathered = gathered.view(cp, 2, b, h, s_l, d)
    if load_balanced:
        halves = gathered.view(cp, 2, b, h, 2, s_l // 2, d)
        # First halves are chunks 0..cp-1 in rank order; second halves chunks 2cp-1-r, so in
        # reversed rank order they are chunks cp..2cp-1.
        gathered = torch.cat([halves[:, :, :, :, 0], halves.flip(0)[:, :, :, :, 1]], dim=0)
    full = gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, -1, d)
    return full[0], full[1]
