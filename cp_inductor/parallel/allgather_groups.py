"""K/V all-gather attention in G head groups.

The plain all-gather block (:func:`allgather_attention` without ``head_groups``) keeps the
whole gathered K/V alive from the forward to the backward, and its backward holds, all at
once and for every head, the full-sequence dK/dV, each call's dK/dV of its prefix and the
kernel's fp32 dQ workspace. Here every one of those exists for one head group at a time::

    forward,  per group g:  gather K/V heads g -> attention of q heads g per stretch -> out[:, g]
                            (eager: gathered K/V freed; q, k, v, out and log-sum-exp saved)
    backward, per group g:  gather K/V heads g again -> attention backward per stretch
                            -> dK/dV of the prefixes in sequence order -> reduce-scatter
                            -> + the local diagonal blocks' dK/dV -> dk[:, g], dv[:, g]

Group g+1's gather is issued before group g's attention (it can travel while g computes; 5%
faster at G=4 on H200 than issuing it after), and group g's reduce-scatter is waited for after
group g+1's compute, so at most two groups' full-sequence dK/dV buffers are alive. Workspace
falls to about 1/G; the price is smaller kernel calls and 3G collectives, each a point where a
rank waits for the slower one (README: -16% peak at +3..5% time for G=2). In eager the
backward gathers K/V again; under torch.compile AOTAutograd's CSE merges that gather with the
forward's (same collective, same inputs) and the gathered K/V are saved instead.

GQA pairs stay together: group g holds q heads ``[g*Hq/G, (g+1)*Hq/G)`` and K/V heads
``[g*Hkv/G, (g+1)*Hkv/G)``.

Every call goes to a fused kernel that returns the log-sum-exp (``KERNELS``); a stretch of
consecutive chunks (``chunk_runs``) with a prefix and a diagonal block merges the two calls by
log-sum-exp, and the backward of each call takes the merged output and log-sum-exp, which makes
the gradients exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .kernels import KERNELS
from .sharding import chunk_runs, sequence_order

c10d = torch.ops._c10d_functional


def _gather(k: torch.Tensor, v: torch.Tensor, g: int, gkv: int, cp: int, group_name: str) -> torch.Tensor:
    """Issue the all-gather of group ``g``'s k, v heads stacked: ``[cp*2, B, H/G, S/cp, D]`` once
    waited for."""
    heads = slice(g * gkv, (g + 1) * gkv)
    return c10d.all_gather_into_tensor(torch.stack([k[:, heads], v[:, heads]]).contiguous(), cp, group_name)


def _wait_and_prefetch(pending, k, v, g: int, groups: int, gkv: int, cp: int, group_name: str):
    """(group g's gathered K/V, the next group's gather in flight or None): the next group's
    gather is issued before group g's attention, so it travels while g computes."""
    gathered = c10d.wait_tensor(pending)
    return gathered, (_gather(k, v, g + 1, gkv, cp, group_name) if g + 1 < groups else None)


def _gathered_order(dfull: torch.Tensor, cp: int, load_balanced: bool) -> torch.Tensor:
    """Inverse of :func:`sequence_order`: ``[2, B, H, S, D]`` in key order -> the contiguous
    ``[cp*2, B, H, S/cp, D]`` the reduce-scatter takes (rank-major)."""
    two, b, h, s, d = dfull.shape
    if not load_balanced:
        return dfull.view(2, b, h, cp, s // cp, d).permute(3, 0, 1, 2, 4, 5).reshape(cp * 2, b, h, s // cp, d)
    chunks = dfull.view(2, b, h, 2 * cp, s // (2 * cp), d)
    # Rank r's block is [chunk r | chunk 2cp-1-r].
    halves = torch.stack([chunks[:, :, :, :cp], chunks[:, :, :, cp:].flip(3)], dim=4)
    return halves.permute(3, 0, 1, 2, 4, 5, 6).reshape(cp * 2, b, h, s // cp, d)


def _stretches(chunks: tuple, length: int) -> Sequence[tuple[int | None, slice]]:
    """(first sequence position, local rows) of each stretch of consecutive local chunks
    (``chunk_runs``); chunks ``(None,)``: not causal, one stretch over every row."""
    return [(None, slice(None))] if chunks == (None,) else chunk_runs(chunks, length)


def _calls(k_full, v_full, k_c, v_c, start: int | None, length: int):
    """The (key, value, causal) calls of one stretch of ``length`` local queries at sequence
    position ``start``: None is not causal (every key); position 0 is one causal call (read from
    the gathered copy, which keeps every rank's gather in use); a later stretch is its prefix in
    full, then its own block causally."""
    if start is None:
        return [(k_full, v_full, False, "full")]
    if start == 0:
        return [(k_full[:, :, :length], v_full[:, :, :length], True, "full")]
    return [(k_full[:, :, :start], v_full[:, :, :start], False, "full"), (k_c, v_c, True, "local")]


def _merge(q_dtype, results):
    """Outputs and log-sum-exps of the calls of one chunk -> (out, lse ``[B, H, L]``)."""
    if len(results) == 1:
        out, lse = results[0]
        return out, lse
    lses = [lse for _, lse in results]
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o * (l_ - lse).exp().unsqueeze(-1) for (o, l_) in results)
    return out.to(q_dtype), lse


class HeadGroupedAllGather(torch.autograd.Function):
    """``forward(q, k, v, ...)`` on ``[B, H, S/cp, D]`` shards; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, cp: int, group_name: str, chunks: tuple, load_balanced: bool, groups: int,
                scale: float, kernel: str):
        forward, _ = KERNELS[kernel]
        hq, hkv = q.shape[1], k.shape[1]
        gq, gkv = hq // groups, hkv // groups
        length = q.shape[2] // len(chunks)
        pending = _gather(k, v, 0, gkv, cp, group_name)
        out_all, lses, extras, lse_shapes = torch.empty_like(q), [], [], []
        for g in range(groups):
            gathered, pending = _wait_and_prefetch(pending, k, v, g, groups, gkv, cp, group_name)
            k_full, v_full = sequence_order(gathered, cp, load_balanced)
            hs_q, hs_kv = slice(g * gq, (g + 1) * gq), slice(g * gkv, (g + 1) * gkv)
            for start, ls in _stretches(chunks, length):
                q_c = q[:, hs_q, ls]
                results = []
                for kc, vc, causal, _ in _calls(k_full, v_full, k[:, hs_kv, ls], v[:, hs_kv, ls], start, q_c.shape[2]):
                    out, lse, extra = forward(q_c, kc, vc, causal, scale)
                    extras.append(extra)
                    lse_shapes.append(lse.shape)
                    results.append((out, lse.reshape(q_c.shape[:3])))
                out_all[:, hs_q, ls], lse = _merge(q.dtype, results)
                lses.append(lse)
        ctx.save_for_backward(q, k, v, out_all, *lses)
        ctx.extras, ctx.lse_shapes = extras, lse_shapes
        ctx.args = (cp, group_name, chunks, load_balanced, groups, scale, kernel)
        return out_all

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, *lses = ctx.saved_tensors
        cp, group_name, chunks, load_balanced, groups, scale, kernel = ctx.args
        _, backward = KERNELS[kernel]
        hq, hkv = q.shape[1], k.shape[1]
        gq, gkv = hq // groups, hkv // groups
        length = q.shape[2] // len(chunks)
        seq = cp * q.shape[2]
        extras, lse_shapes = iter(ctx.extras), iter(ctx.lse_shapes)
        lses = iter(lses)
        pending = _gather(k, v, 0, gkv, cp, group_name)
        # Pieces are written into dq as they come (no final concatenation holding two copies).
        dq_all, previous, dkvs = torch.empty_like(q), None, []
        for g in range(groups):
            gathered, pending = _wait_and_prefetch(pending, k, v, g, groups, gkv, cp, group_name)
            k_full, v_full = sequence_order(gathered, cp, load_balanced)
            hs_q, hs_kv = slice(g * gq, (g + 1) * gq), slice(g * gkv, (g + 1) * gkv)
            dfull, dlocal = None, []
            for start, ls in _stretches(chunks, length):
                q_c = q[:, hs_q, ls]
                # O and dO contiguous: one dO layout per q/k/v signature (allgather.py says why).
                dout_c, out_c = dout[:, hs_q, ls].contiguous(), out[:, hs_q, ls].contiguous()
                lse = next(lses)
                dq_c, dk_loc, dv_loc = 0, None, None
                for kc, vc, causal, source in _calls(k_full, v_full, k[:, hs_kv, ls], v[:, hs_kv, ls], start, q_c.shape[2]):
                    dq, dk, dv = backward(
                        dout_c, q_c, kc, vc, out_c, lse.reshape(next(lse_shapes)), next(extras), causal, scale
                    )[:3]
                    dq_c = dq_c + dq
                    if source == "local":
                        dk_loc, dv_loc = dk, dv
                        continue
                    # A prefix's dK/dV in sequence order, padded to the full sequence: Inductor
                    # fuses the pads, the add and the reorder into the reduce-scatter's input.
                    part = F.pad(torch.stack([dk, dv]), (0, 0, 0, seq - dk.shape[2]))
                    dfull = part if dfull is None else dfull + part
                dq_all[:, hs_q, ls] = dq_c
                dlocal.append((dk_loc, dv_loc, q_c.shape[2]))
            rs = c10d.reduce_scatter_tensor(_gathered_order(dfull, cp, load_balanced), "sum", cp, group_name)
            # The previous group's reduce-scatter had this group's compute to travel: wait for
            # it now, so at most two groups' full-sequence dK/dV buffers are alive.
            if previous is not None:
                dkvs.append(_local_grads(*previous))
            previous = (rs, dlocal)
        dkvs.append(_local_grads(*previous))
        dks, dvs = [d[0] for d in dkvs], [d[1] for d in dkvs]
        cat1 = lambda xs: torch.cat(xs, dim=1) if len(xs) > 1 else xs[0]  # noqa: E731
        return dq_all, cat1(dks), cat1(dvs), None, None, None, None, None, None, None


def _local_grads(rs: torch.Tensor, dlocal: list) -> torch.Tensor:
    """This rank's dK/dV of one head group, ``[2, B, H/G, S/cp, D]``: the reduce-scattered
    prefixes' plus the local diagonal blocks' (None for a stretch without one) of ``(dk, dv,
    rows)`` per stretch."""
    dkv = c10d.wait_tensor(rs)
    if all(dk is None for dk, _, _ in dlocal):
        return dkv
    two, b, h, _, d = dkv.shape
    diag = torch.cat([
        torch.stack([dk, dv]) if dk is not None else dkv.new_zeros(two, b, h, rows, d) for dk, dv, rows in dlocal
    ], dim=3)
    return dkv + diag
