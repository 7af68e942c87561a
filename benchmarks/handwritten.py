"""CP attention as users write it by hand. Ulysses (the style of yunchang's ``SeqAllToAll4D`` and of HF
integrations): ``-1`` in views, transposes then ``contiguous``, attention in BHSD by transposing
BSHD. Not our helper: the benchmark's ``hand_*`` arms compile this to show the passes find and
rewrite code they were not written with. K/V all-gather in the DiT / vision style: local queries over every
rank's keys, not causal, gathered on dim 0 and put in sequence order with a view."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F


def _scatter_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, H, D] -> [B, S, H/P, D]."""
    p = dist.get_world_size(group)
    b, s_l, h, d = x.shape
    send = x.reshape(b, s_l, p, -1, d).transpose(0, 2).contiguous()  # [P, S/P, B, H/P, D]
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.reshape(-1, b, h // p, d).transpose(0, 1).contiguous()  # [B, S, H/P, D]


def _gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, H/P, D] -> [B, S/P, H, D]."""
    p = dist.get_world_size(group)
    b, s, h_l, d = x.shape
    send = x.reshape(b, p, -1, h_l, d).transpose(0, 3).transpose(0, 1).contiguous()  # [P, H/P, S/P, B, D]
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.reshape(-1, s // p, b, d).transpose(0, 2).contiguous().reshape(b, s // p, -1, d)


def ulysses_by_hand(q, k, v, *, is_causal: bool = True, group=None):
    group = group if group is not None else dist.group.WORLD
    qh, kh, vh = (_scatter_heads(t, group).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2])
    return _gather_heads(out.transpose(1, 2), group)


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, H, D] -> [B, S, H, D]."""
    p = dist.get_world_size(group)
    b, s_l, h, d = x.shape
    g = funcol.all_gather_tensor_autograd(x.contiguous(), 0, group).view(p, b, s_l, h, d)
    return g.transpose(0, 1).reshape(b, p * s_l, h, d)


def allgather_by_hand(q, k, v, *, group=None):
    group = group if group is not None else dist.group.WORLD
    k_all, v_all = (_gather_sequence(t, group).transpose(1, 2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
