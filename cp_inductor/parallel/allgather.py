"""K/V all-gather context-parallel attention (Llama3 style) in plain PyTorch.

Each rank keeps its query shard and gathers every rank's K and V (small under GQA). The
gather runs on dim 0 (``all_gather_tensor_autograd``: its backward is the reduce-scatter of
dK/dV; torch 2.11 breaks the graph for other gather dims).

* Not causal: one attention call of the local queries over the gathered K/V, in any key order.
* Causal: queries must see keys in sequence order up to their own position. With
  ``load_balanced=True`` (the default; shard with ``shard_sequence(..., load_balanced=True)``)
  rank r holds chunks r and 2cp-1-r of 2cp equal chunks, so every rank does the same work. Each
  stretch of consecutive local chunks (one chunk, or both on rank cp-1, which holds chunks cp-1
  and cp) attends to its causal prefix, bottom-right aligned: the keys before the stretch in
  full (gathered), its own block causally (the rank's own K/V: a square block, where SDPA's
  top-left causal mask is the right one, and a call that needs nothing gathered: the
  ``gather_overlap`` rewrite runs it while the gather is in flight, and its backward while the
  reduce-scatter is; eager runs it after the wait). The two calls are merged by their log-sum-exp; a stretch at position 0 has no
  prefix and is one causal call. No S x S mask is built: every call is one the fused kernels
  take. The diagonal blocks' dK/dV stay local; only the prefixes' go through the
  reduce-scatter. Fewer, larger calls run closer to the floor: rank 1 at cp = 2, 2 calls
  instead of 4 (``benchmarks/bench_allgather_blocks.py``, plan ``runs``).

Layouts as in :mod:`cp_inductor.parallel.ulysses`: ``"bshd"`` ``[B, S/cp, H, D]`` or ``"bhsd"``
``[B, H, S/cp, D]``; GQA when k/v have fewer heads than q.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from .allgather_groups import HeadGroupedAllGather
from .kernels import KERNELS, _kernel
from .sharding import chunk_runs, gqa, load_balanced_chunks, sequence_order
from .ulysses import LAYOUTS

aten = torch.ops.aten


def _to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return x.transpose(1, 2) if layout == "bshd" else x


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the all-gather's backward is a
    reduce-scatter, which NCCL only takes contiguous, and the reorders after the gather hand it
    a permuted gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _ContiguousGrad.apply(funcol.all_gather_tensor_autograd(x.contiguous(), 0, group))


def _gather_sequence(k: torch.Tensor, v: torch.Tensor, cp: int, group, load_balanced: bool):
    """This rank's k, v ``[B, H, S/cp, D]`` -> every rank's, ``[B, H, S, D]`` in sequence order.
    One all-gather of k and v stacked: one reduce-scatter in the backward, so every rank issues
    the same collectives in the same order whatever order autograd reaches dK and dV in."""
    return sequence_order(_all_gather(torch.stack([k, v]), group), cp, load_balanced)


class _PrefixThenDiagonal(torch.autograd.Function):
    """Query chunk over ``[prefix keys | its own block]``: the prefix in full, the block causally,
    merged by log-sum-exp. The backward of each call takes the merged output and log-sum-exp,
    which makes its probabilities the merged softmax's: the gradients are exact."""

    @staticmethod
    def forward(ctx, q, k_prefix, v_prefix, k_diag, v_diag, scale: float, kernel: str):
        forward, _ = KERNELS[kernel]
        out_p, lse_p, ctx.extra_p = forward(q, k_prefix, v_prefix, False, scale)
        out_d, lse_d, ctx.extra_d = forward(q, k_diag, v_diag, True, scale)
        # Kernels differ in the log-sum-exp's trailing dims ([B, H, L] or [B, H, L, 1]).
        ctx.lse_shape = lse_p.shape
        lse_p, lse_d = (x.reshape(q.shape[:3]) for x in (lse_p, lse_d))
        lse = torch.logaddexp(lse_p, lse_d)
        out = (out_p * (lse_p - lse).exp().unsqueeze(-1) + out_d * (lse_d - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, out, lse)
        ctx.scale, ctx.kernel = scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_prefix, v_prefix, k_diag, v_diag, out, lse = ctx.saved_tensors
        _, backward = KERNELS[ctx.kernel]
        # O and dO contiguous: every call of a q/k/v signature then passes one dO layout (aten's
        # cuDNN plan cache, before torch 2.14, ignores dO's layout and would mix two), the one
        # the frontend's backward reads without a copy of its own.
        dout, out, lse = dout.contiguous(), out.contiguous(), lse.reshape(ctx.lse_shape)
        dq_p, dk_p, dv_p = backward(dout, q, k_prefix, v_prefix, out, lse, ctx.extra_p, False, ctx.scale)
        dq_d, dk_d, dv_d = backward(dout, q, k_diag, v_diag, out, lse, ctx.extra_d, True, ctx.scale)
        return dq_p + dq_d, dk_p, dv_p, dk_d, dv_d, None, None


def _stretch_attention(q, k, v, k_full, v_full, start: int, scale: float, kernel: str) -> torch.Tensor:
    """Local queries at sequence positions ``[start, start + len)`` over their causal prefix,
    bottom-right aligned: their own block is the local k, v (no gathered data), the keys before
    it come from the gathered ``k_full``, ``v_full``."""
    if start == 0:
        # The first block is read from the gathered copy: were it all a rank holds (rank 0, not
        # load balanced) and read locally, that rank would not use the gather, and a compiled
        # graph would drop its all-gather and reduce-scatter while the others wait.
        length = q.shape[2]
        k, v = k_full[:, :, :length], v_full[:, :, :length]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa(q.shape[1], k.shape[1]))
    return _PrefixThenDiagonal.apply(q, k_full[:, :, :start], v_full[:, :, :start], k, v, scale, kernel)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    layout: str = "bshd",
    is_causal: bool = False,
    load_balanced: bool = True,
    scale: float | None = None,
    kernel: str = "auto",
    head_groups: int | None = None,
) -> torch.Tensor:
    """K/V all-gather CP attention over sequence-sharded q, k, v; returns q's layout.

    Causal attention needs q, k, v sharded as ``shard_sequence(..., load_balanced=...)`` with the
    same ``load_balanced``; without causality the sharding does not matter. ``kernel`` names the
    log-sum-exp attention kernel of the causal prefix calls (``KERNELS``; "auto": per device).
    ``head_groups=G`` (G >= 2) runs G head groups one after the other, each with its own gather,
    attention and reduce-scatter (:mod:`cp_inductor.parallel.allgather_groups`): about 1/G of
    the backward's workspace for smaller kernel calls and more collectives (README: -16% peak at
    +3..5% time for G=2 on H200); G must divide the query and the K/V heads. ``None`` or 1: one
    group, K/V saved (the grouped code with one group gave wrong cuDNN gradients at S32K on
    H200, run log h200x2_allgather_s32k_hg1_run23.json (git history), so it is not used)."""
    group = group if group is not None else dist.group.WORLD
    cp = dist.get_world_size(group)
    q, k, v = (_to_bhsd(x, layout) for x in (q, k, v))
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads {hkv}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if head_groups not in (None, 1):
        return _head_grouped(q, k, v, group, layout, is_causal, load_balanced, scale, kernel, head_groups)
    if not is_causal:
        # Key order does not matter without a mask: [cp*2, B, H, S/cp, D] -> [B, H, S, D] any order.
        kv = _all_gather(torch.stack([k, v]), group).view(cp, 2, *k.shape)
        k_all, v_all = kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k_all, v_all, scale=scale, enable_gqa=gqa(hq, hkv))
        return out.transpose(1, 2) if layout == "bshd" else out

    _check_even(q, load_balanced)
    rank = dist.get_rank(group)
    k_full, v_full = _gather_sequence(k, v, cp, group, load_balanced)
    kernel = _kernel(q.device, kernel)
    chunks = load_balanced_chunks(rank, cp) if load_balanced else (rank,)
    parts = [
        _stretch_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], k_full, v_full, start, scale, kernel)
        for start, rows in chunk_runs(chunks, q.shape[2] // len(chunks))
    ]
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2) if layout == "bshd" else out


def _check_even(q: torch.Tensor, load_balanced: bool) -> None:
    if load_balanced and q.shape[2] % 2:
        raise ValueError(f"load-balanced causal attention needs an even local sequence, got {q.shape[2]}")


def _head_grouped(q, k, v, group, layout, is_causal, load_balanced, scale, kernel, groups):
    hq, hkv = q.shape[1], k.shape[1]
    if groups < 2 or hq % groups or hkv % groups:
        raise ValueError(f"head_groups={groups} must divide the query heads {hq} and the key/value heads {hkv}")
    if is_causal:
        _check_even(q, load_balanced)
        rank = dist.get_rank(group)
        chunks = load_balanced_chunks(rank, cp=dist.get_world_size(group)) if load_balanced else (rank,)
    else:  # one call over every key, in gather order
        chunks, load_balanced = (None,), False
    out = HeadGroupedAllGather.apply(
        q, k, v, dist.get_world_size(group), group.group_name, chunks, load_balanced, groups, scale,
        _kernel(q.device, kernel),
    )
    return out.transpose(1, 2) if layout == "bshd" else out
