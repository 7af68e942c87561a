"""Ring attention written by hand the way CP projects write it for torch.compile: one
autograd.Function whose forward rotates K and V (flattened into one buffer) one rank per step
with an all-to-all that moves the whole buffer to the next rank, attends per step with a
kernel that returns its log-sum-exp and merges the outputs in fp32; its backward rotates K/V
again, runs each step's attention backward against the merged output and log-sum-exp, and
sends each block's dK/dV accumulator along with the block, one more hop returning it to its
owner. (The log-sum-exp of SDPA's kernels has no gradient, so autograd through the merge
would be wrong: real rings write the backward.)

Causal attention takes the load-balanced (zigzag) layout, rank r holding chunks r and 2cp-1-r:
step 0 is causal over the local block; K/V from an earlier rank are seen by both local chunks
but only through their first chunk; K/V from a later rank only by the second local chunk.
(With contiguous shards rank 0 would never read a rotated buffer, and a compiled graph would
drop its collectives while the other ranks wait in theirs.)

q, k, v are ``[B, S/cp, H, D]`` shards (BSHD); the result is the same layout. CPU kernel."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _rotate(x: torch.Tensor, rank: int, cp: int, group_name: str) -> torch.Tensor:
    """Send the buffer to rank+1, receive rank-1's."""
    n = x.numel()
    send = [n if dst == (rank + 1) % cp else 0 for dst in range(cp)]
    recv = [n if src == (rank - 1) % cp else 0 for src in range(cp)]
    return c10d.wait_tensor(c10d.all_to_all_single(x, recv, send, group_name))


def _blocks(q, src: int, rank: int, causal: bool):
    """(query rows, key rows, causal) of one step: rows as slices of the local block."""
    half = q.shape[2] // 2
    every = slice(None)
    if not causal:
        return every, every, False
    if src == rank:
        return every, every, True
    if src < rank:  # both local chunks see the first chunk of src's block
        return every, slice(0, half), False
    return slice(half, None), every, False  # only the second local chunk sees src's block


def _merge(acc, o, lse, rows):
    """Merge one step's (o, lse) for query ``rows`` into the running fp32 (out, lse)."""
    out, run = acc
    if out is None:  # the first step covers every row (causal: the local block)
        return o.float(), lse.float()
    new = torch.logaddexp(run[:, :, rows], lse)
    merged = out[:, :, rows] * (run[:, :, rows] - new).exp().unsqueeze(-1) + o.float() * (lse - new).exp().unsqueeze(-1)
    if rows == slice(None):
        return merged, new
    return torch.cat([out[:, :, :rows.start], merged], dim=2), torch.cat([run[:, :, :rows.start], new], dim=2)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, rank: int, cp: int, group_name: str):
        kv = torch.cat([k.flatten(), v.flatten()])
        acc = (None, None)
        for step in range(cp):
            if step:
                kv = _rotate(kv, rank, cp, group_name)
            k_s, v_s = (t.view_as(k) for t in kv.split(k.numel()))
            rows, cols, is_causal = _blocks(q, (rank - step) % cp, rank, causal)
            o, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, rows], k_s[:, :, cols], v_s[:, :, cols], 0.0, is_causal
            )[:2]
            acc = _merge(acc, o, lse, rows)
        out, lse = acc[0].to(q.dtype), acc[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, rank, cp, group_name)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, rank, cp, group_name = ctx.args
        kv = torch.cat([k.flatten(), v.flatten()])
        dq = dkv = None
        for step in range(cp):
            if step:
                kv = _rotate(kv, rank, cp, group_name)
                dkv = _rotate(dkv, rank, cp, group_name)  # the accumulator travels with its block
            k_s, v_s = (t.view_as(k) for t in kv.split(k.numel()))
            rows, cols, is_causal = _blocks(q, (rank - step) % cp, rank, causal)
            dq_s, dk_s, dv_s = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, :, rows], q[:, :, rows], k_s[:, :, cols], v_s[:, :, cols], out[:, :, rows],
                lse[:, :, rows], 0.0, is_causal,
            )
            pad_q = (0, 0, rows.start or 0, 0)
            dq = F.pad(dq_s, pad_q) if dq is None else dq + F.pad(dq_s, pad_q)
            pad_k = (0, 0, 0, k.shape[2] - (cols.stop or k.shape[2]))
            step_kv = torch.cat([F.pad(dk_s, pad_k).flatten(), F.pad(dv_s, pad_k).flatten()])
            dkv = step_kv if dkv is None else dkv + step_kv
        dkv = _rotate(dkv, rank, cp, group_name)  # home: every block's gradient to its owner
        dk, dv = (t.view_as(k) for t in dkv.split(k.numel()))
        return dq, dk, dv, None, None, None, None


def ring_by_hand(q, k, v, *, causal: bool = False, group=None):
    group = group if group is not None else dist.group.WORLD
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S/cp, D]
    out = RingAttention.apply(q, k, v, causal, dist.get_rank(group), dist.get_world_size(group), group.group_name)
    return out.transpose(1, 2)


def _native_attention_module():
    """PyTorch native CP's ring module (its place moved between releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # older layout
        from torch.distributed.tensor.experimental import _attention
    return _attention


@contextlib.contextmanager
def native_options(rotate: str = "alltoall", load_balance: bool = True):
    """Native CP's global options (``set_rotate_method``, load balance) for a trace and its runs:
    set outside compiled code, as native CP's users do."""
    opts = _native_attention_module()._cp_options
    before = opts.rotate_method, opts.enable_load_balance
    opts.rotate_method = {"alltoall": type(before[0]).ALL_TO_ALL, "allgather": type(before[0]).ALL_GATHER}[rotate]
    opts.enable_load_balance = load_balance
    try:
        yield
    finally:
        opts.rotate_method, opts.enable_load_balance = before


def _cpu_backward(grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0):
    # Native CP passes ``out=`` by keyword, which Dynamo would take for an out-variant call.
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal
    )


class NativeRing(torch.autograd.Function):
    """PyTorch native context_parallel's own ring code (``_templated_ring_attention`` and its
    backward, what its SDPA handlers run per rank) around the CPU kernel, which native CP does not
    dispatch: the graph native CP traces to, on gloo. Rotation and load balance: native CP's
    options (:func:`native_options`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool):
        native = _native_attention_module()
        out, lse = native._templated_ring_attention(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=causal
        )[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        native = _native_attention_module()
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = native._templated_ring_attention_backward(
            dist.group.WORLD, 2, _cpu_backward, dout, "grad_out",
            q, k, v, out, lse, ctx.causal, dropout_p=0.0,
        )[:3]
        return dq, dk, dv, None


def native_ring(q, k, v, *, causal: bool = False):
    """BSHD shards in and out, as :func:`ring_by_hand`; native CP's load balance must match the
    sharding (on: zigzag, for causal attention only)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return NativeRing.apply(q, k, v, causal).transpose(1, 2)


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses: ``[B, S/n, H, D]`` -> ``[B, S, H/n, D]`` over ``group`` (its n ranks' sequence)."""
    import torch.distributed._functional_collectives as funcol

    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_heads_to_sequence`."""
    import torch.distributed._functional_collectives as funcol

    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def usp_by_hand(q, k, v, *, ulysses_group, ring_group):
    """Unified sequence parallelism (yunchang's USP) by hand, not causal: Ulysses all-to-all over
    ``ulysses_group`` (heads for sequence), ring attention over ``ring_group`` on what arrives,
    Ulysses back. Contiguous shards, rank = ring rank * Ulysses size + Ulysses rank."""
    q, k, v = (_heads_to_sequence(t, ulysses_group) for t in (q, k, v))
    out = ring_by_hand(q, k, v, causal=False, group=ring_group)
    return _sequence_to_heads(out, ulysses_group)
