"""Ring context-parallel attention in plain PyTorch, written the way CP projects write it for
``torch.compile``: one autograd.Function.

Forward: K and V, flattened into one buffer, travel one rank per step (an all-to-all that sends
the whole buffer to rank+1 and receives rank-1's); each step attends with a fused kernel that
returns its log-sum-exp, and the steps merge in fp32. Backward: K/V travel again, each step's
attention backward runs against the merged output and log-sum-exp (which makes its
probabilities the merged softmax's: the gradients are exact), dQ stays local, and each block's
dK/dV accumulator travels with the block, one more hop returning it to its owner. (The
log-sum-exp of SDPA's kernels has no gradient, so autograd through the merge would be wrong:
rings write their backward.)

Causal attention needs the load-balanced two-chunk layout (``shard_sequence(...,
load_balanced=True)``: rank r holds chunks r and 2cp-1-r): step 0 is causal over the local
block; K/V of an earlier rank are seen by both local chunks but only through that rank's first
chunk; K/V of a later rank only by the second local chunk. Every rank then does the same work
and reads every rotated buffer (with contiguous shards rank 0 would never read one, and a
compiled graph would drop its collectives while the other ranks wait in theirs).

The kernels are the all-gather helper's (:data:`cp_inductor.parallel.kernels.KERNELS`: cuDNN
on sm90+, else flash; CPU flash on CPU), GQA without replicated K/V heads. Compiled with
``backend="cp_inductor"`` the rotations are ring regions (``ce_rotation`` moves large ones to
the copy engines).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch_layout import head_tail_places
from .allgather import _check_even, _to_bhsd
from .kernels import KERNELS, _kernel

c10d = torch.ops._c10d_functional


def _rotate(x: torch.Tensor, rank: int, cp: int, group_name: str) -> torch.Tensor:
    """Send the buffer to rank+1, receive rank-1's."""
    n = x.numel()
    send = [n if dst == (rank + 1) % cp else 0 for dst in range(cp)]
    recv = [n if src == (rank - 1) % cp else 0 for src in range(cp)]
    return c10d.wait_tensor(c10d.all_to_all_single(x, recv, send, group_name))


def _blocks(length: int, src: int, rank: int, causal: bool):
    """(query rows, key rows, causal) of the step that holds ``src``'s K/V, as slices of the
    local block of ``length`` rows."""
    every = slice(None)
    if not causal:
        return every, every, False
    if src == rank:
        return every, every, True
    half = length // 2
    if src < rank:  # both local chunks see the first chunk of src's block
        return every, slice(0, half), False
    return slice(half, None), every, False  # only the second local chunk sees src's block


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, rank: int, cp: int, group_name: str, scale: float, kernel: str):
        forward, _ = KERNELS[kernel]
        kv = torch.cat([k.flatten(), v.flatten()])
        out = lse = None
        extras = []
        for step in range(cp):
            if step:
                kv = _rotate(kv, rank, cp, group_name)
            k_s, v_s = (t.view_as(k) for t in kv.split(k.numel()))
            rows, cols, is_causal = _blocks(q.shape[2], (rank - step) % cp, rank, causal)
            o, step_lse, extra = forward(q[:, :, rows], k_s[:, :, cols], v_s[:, :, cols], is_causal, scale)
            extras.append(extra)
            # Kernels differ in the log-sum-exp's trailing dims ([B, H, L] or [B, H, L, 1]).
            ctx.lse_tail = step_lse.shape[3:]
            step_lse = step_lse.reshape(o.shape[:3]).float()
            if out is None:  # step 0 covers every row (causal: the local block)
                out, lse = o.float(), step_lse
                continue
            assert lse is not None  # set with out at step 0
            new = torch.logaddexp(lse[:, :, rows], step_lse)
            merged = out[:, :, rows] * (lse[:, :, rows] - new).exp().unsqueeze(-1) + o.float() * (step_lse - new).exp().unsqueeze(-1)
            if rows == slice(None):
                out, lse = merged, new
            else:
                out = torch.cat([out[:, :, :rows.start], merged], dim=2)
                lse = torch.cat([lse[:, :, :rows.start], new], dim=2)
        assert out is not None  # step 0 ran (cp >= 1)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args, ctx.extras = (causal, rank, cp, group_name, scale, kernel), extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, rank, cp, group_name, scale, kernel = ctx.args
        _, backward = KERNELS[kernel]
        # O and dO contiguous (the merges leave O in whatever layout they computed): one dO
        # layout per q/k/v signature, as in the all-gather helper (aten's cuDNN plan cache
        # before torch 2.14 ignores dO's layout).
        dout, out = dout.contiguous(), out.contiguous()
        kv = torch.cat([k.flatten(), v.flatten()])
        dq = dkv = None
        for step in range(cp):
            if step:
                kv = _rotate(kv, rank, cp, group_name)
                dkv = _rotate(dkv, rank, cp, group_name)  # the accumulator travels with its block
            k_s, v_s = (t.view_as(k) for t in kv.split(k.numel()))
            rows, cols, is_causal = _blocks(q.shape[2], (rank - step) % cp, rank, causal)
            # A half of the rows is a strided slice: the kernels index the log-sum-exp as a dense
            # [B, H, L], and O and dO stay in one layout.
            step_lse = lse[:, :, rows].contiguous()
            step_lse = step_lse.reshape(*step_lse.shape, *ctx.lse_tail)
            dout_s, out_s = (t[:, :, rows].contiguous() for t in (dout, out))
            dq_s, dk_s, dv_s = backward(
                dout_s, q[:, :, rows], k_s[:, :, cols], v_s[:, :, cols], out_s, step_lse,
                ctx.extras[step], is_causal, scale,
            )[:3]
            pad_q = (0, 0, rows.start or 0, 0)
            dq = F.pad(dq_s.float(), pad_q) if dq is None else dq + F.pad(dq_s.float(), pad_q)
            pad_k = (0, 0, 0, k.shape[2] - (cols.stop or k.shape[2]))
            step_kv = torch.cat([F.pad(dk_s.float(), pad_k).flatten(), F.pad(dv_s.float(), pad_k).flatten()])
            dkv = step_kv if dkv is None else dkv + step_kv
        dkv = _rotate(dkv, rank, cp, group_name)  # home: every block's gradient to its owner
        dk, dv = (t.view_as(k).to(k.dtype) for t in dkv.split(k.numel()))
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    layout: str = "bshd",
    is_causal: bool = False,
    scale: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Ring CP attention over sequence-sharded q, k, v (causal: load-balanced shards); returns
    q's layout (``"bshd"`` ``[B, S/cp, H, D]`` or ``"bhsd"``). dQ and the dK/dV accumulators
    are fp32 until the end, as in PyTorch's native ring."""
    group = group if group is not None else dist.group.WORLD
    q, k, v = (_to_bhsd(x, layout) for x in (q, k, v))
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    if is_causal:
        _check_even(q, True)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = _Ring.apply(
        q, k, v, is_causal, dist.get_rank(group), dist.get_world_size(group), group.group_name, scale,
        _kernel(q.device, kernel),
    )
    return out.transpose(1, 2) if layout == "bshd" else out


def ring_in_graph(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor,
                  doc_ids: torch.Tensor | None, is_causal: bool, rank: int, cp: int, group_name: str,
                  scale: float) -> torch.Tensor:
    """The ring over ``[B, H, S/cp, D]`` q, k, v as the context-parallel pass calls it from a
    graph it rewrote (the group by name, the rank fixed at compile time, the kernels by device).
    ``query_positions`` ``[B, S/cp]``: each local token's place in its row, which must be pieces
    ``rank`` and ``2cp - 1 - rank`` of ``2cp`` equal pieces of the row (the ring's layout;
    ``shard_batch``'s for a row of one document); ``doc_ids`` ``[B, S]`` where the call's mask
    is over documents: one per row. Both checked on device, a device error otherwise."""
    if doc_ids is not None:
        torch._assert_async((doc_ids == doc_ids[:, :1]).all(),
                             "cp_inductor ring: a row holds several documents; the ring attends over whole rows")
    expected = head_tail_places(torch.arange(query_positions.shape[1], device=query_positions.device), rank, cp)
    torch._assert_async((query_positions == expected).all(),
                         "cp_inductor ring: this rank's tokens are not its two pieces of each row (a packed batch "
                         "balanced per document?): the ring's layout")
    return _Ring.apply(q, k, v, is_causal, rank, cp, group_name, scale, _kernel(q.device, "auto"))
