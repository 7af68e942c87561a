"""Hand-written Ulysses variants as they appear in the wild, and all-to-alls that are not CP
attention. Detection must find the first kind by layout algebra and reject the second."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

a2a = funcol.all_to_all_single_autograd


def _cp(group):
    return dist.get_world_size(group)


def transpose_then_reshape(q, k, v, group=None, is_causal=True):
    """BSHD in, yunchang-style: the head split goes to dim 0 by a transpose, seq-major recv."""
    group = group or dist.group.WORLD
    cp = _cp(group)

    def scatter(x):  # [B, S/cp, H, D] -> [B, H/cp, S, D]
        b, s_l, h, d = x.shape
        t = x.reshape(b, s_l, cp, h // cp, d).transpose(0, 2).contiguous()  # [cp, S_l, B, Hl, D]
        out = a2a(t, None, None, group).reshape(cp * s_l, b, h // cp, d)  # [S, B, Hl, D]
        return out.permute(1, 2, 0, 3)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=is_causal)
    b, hl, s, d = o.shape
    t = o.reshape(b, hl, cp, s // cp, d).permute(2, 1, 0, 3, 4).contiguous()  # [cp, Hl, B, S_l, D]
    out = a2a(t, None, None, group).reshape(cp * hl, b, s // cp, d)  # [H, B, S_l, D]
    return out.permute(1, 2, 0, 3).contiguous()  # [B, S_l, H, D]


def flattened_buffer(q, k, v, group=None, is_causal=True):
    """BHSD in; every all-to-all runs on a flattened 1-D buffer."""
    group = group or dist.group.WORLD
    cp = _cp(group)

    def scatter(x):  # [B, H, S/cp, D] -> [B, H/cp, S, D]
        b, h, s_l, d = x.shape
        send = x.reshape(b, cp, h // cp, s_l, d).transpose(0, 1).contiguous().flatten()
        recv = a2a(send, None, None, group).view(cp, b, h // cp, s_l, d)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s_l, d)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=is_causal)
    b, hl, s, d = o.shape
    send = o.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous().flatten()
    recv = a2a(send, None, None, group).view(cp, b, hl, s // cp, d)
    return recv.transpose(0, 1).reshape(b, cp * hl, s // cp, d)


def seq_first(q, k, v, group=None, is_causal=True):
    """SBHD in, DeepSpeed-style: [S/cp, B, H, D] with a 5-D send buffer."""
    group = group or dist.group.WORLD
    cp = _cp(group)

    def scatter(x):  # [S/cp, B, H, D] -> [B, H/cp, S, D]
        s_l, b, h, d = x.shape
        send = x.reshape(s_l, b, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = a2a(send, None, None, group).reshape(cp * s_l, b, h // cp, d)
        return recv.permute(1, 2, 0, 3)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=is_causal)
    b, hl, s, d = o.shape
    send = o.permute(2, 0, 1, 3).reshape(cp, s // cp, b, hl, d).contiguous()
    recv = a2a(send, None, None, group)  # [cp (head block), S_l, B, Hl, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * hl, d)


def expanded_kv_heads(q, k, v):
    """GQA done by hand (Hq = 2 Hkv): k/v heads replicated by ``expand`` after the all-to-all;
    the backward sums the replicas' gradients before they cross back."""
    group = dist.group.WORLD
    cp = dist.get_world_size()

    def scatter(x, rep):
        b, s_l, h, d = x.shape
        send = x.reshape(b, s_l, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = a2a(send, None, None, group)
        y = recv.permute(1, 3, 0, 2, 4).reshape(b, h // cp, 1, cp * s_l, d)
        return y.expand(b, h // cp, rep, cp * s_l, d).reshape(b, h // cp * rep, cp * s_l, d)

    o = F.scaled_dot_product_attention(scatter(q, 1), scatter(k, 2), scatter(v, 2), is_causal=True)
    b, hl, s, d = o.shape
    send = o.reshape(b, hl, cp, s // cp, d).permute(2, 0, 3, 1, 4).contiguous()
    recv = a2a(send, None, None, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * hl, d)


def around(attend):
    """BSHD Ulysses by hand around ``attend(q, k, v) -> out`` (each [B, H/cp, S, D]): for
    attention calls the helpers do not make (another kernel, a mask)."""

    def ulysses(q, k, v, group=None):
        group = group or dist.group.WORLD
        cp = _cp(group)

        def scatter(x):  # [B, S/cp, H, D] -> [B, H/cp, S, D]
            b, s_l, h, d = x.shape
            send = x.reshape(b, s_l, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
            recv = a2a(send, None, None, group)
            return recv.permute(1, 3, 0, 2, 4).reshape(b, h // cp, cp * s_l, d)

        o = attend(scatter(q), scatter(k), scatter(v))
        b, hl, s, d = o.shape
        send = o.reshape(b, hl, cp, s // cp, d).permute(2, 0, 3, 1, 4).contiguous()
        recv = a2a(send, None, None, group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * hl, d)

    return ulysses


def moe_dispatch(tokens, w, group=None):
    """Not attention: tokens to experts and back."""
    group = group or dist.group.WORLD
    routed = a2a(tokens, None, None, group)
    return a2a(torch.relu(routed @ w), None, None, group)


def batch_exchange(q, k, v, group=None):
    """Attention after an all-to-all over the batch: no sequence is gathered, not Ulysses."""
    group = group or dist.group.WORLD
    q, k, v = (a2a(x.contiguous(), None, None, group) for x in (q, k, v))
    return a2a(F.scaled_dot_product_attention(q, k, v).contiguous(), None, None, group)


def interleaved_heads(q, k, v, group=None):
    """Heads dealt round-robin (rank r gets heads r, r+cp, ...) and the sequence gathered
    inner-major: attention sees tokens out of order, so it is not CP attention."""
    group = group or dist.group.WORLD
    cp = _cp(group)

    def scatter(x):  # [B, S/cp, H, D]
        b, s_l, h, d = x.shape
        send = x.reshape(b, s_l, h // cp, cp, d).permute(3, 0, 1, 2, 4).contiguous()
        recv = a2a(send, None, None, group)  # [cp, B, S_l, Hl, D]
        return recv.permute(1, 3, 2, 0, 4).reshape(b, h // cp, s_l * cp, d)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=True)
    b, hl, s, d = o.shape
    send = o.reshape(b, hl, s // cp, cp, d).permute(3, 0, 2, 1, 4).contiguous()
    return a2a(send, None, None, group).permute(1, 2, 3, 0, 4).reshape(b, s // cp, hl * cp, d)


def chained_layers(q, k, v, group=None):
    """Two Ulysses layers back to back; the second scatters the first's returned output again
    (q1 = out0, k1 = out0 * 0.5, v1 = tanh(out0)): both regions share that output."""
    layer = around(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out0 = layer(q, k, v, group)
    return layer(out0, out0 * 0.5, torch.tanh(out0), group)


def _scaled_query_attention(q, k, v):
    # q * 0.5 with twice the softmax scale is plain attention; the multiply sits between q's
    # all-to-all and attention, so attention does not read the received tensor itself.
    return F.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True, scale=2.0 / q.shape[-1] ** 0.5)


def scaled_query(q, k, v, group=None):
    """Ulysses by hand with a pointwise op on q between its all-to-all and attention."""
    return around(_scaled_query_attention)(q, k, v, group)


# --- torch.distributed's in-place collectives inside autograd.Functions (DeepSpeed's and
# yunchang's Ulysses, many hand-written all-gathers): traced as copy(empty, wait(...)).


class _InplaceAllToAll(torch.autograd.Function):
    """``dist.all_to_all_single(out, x)`` into a fresh buffer; the backward sends the gradient
    back the same way (an equal-split all-to-all is its own inverse)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _InplaceAllToAll.apply(grad.contiguous(), ctx.group), None


def inplace_bshd(q, k, v, group=None, is_causal=True):
    """BSHD in, yunchang-style ``SeqAllToAll4D``: heads to dim 0 by a transpose, in-place
    all-to-all, sequence-major receive."""
    group = group or dist.group.WORLD
    cp = _cp(group)

    def scatter(x):  # [B, S/cp, H, D] -> [B, H/cp, S, D]
        b, s_l, h, d = x.shape
        send = x.reshape(b, s_l, cp, h // cp, d).transpose(0, 2)  # [cp, S_l, B, Hl, D]
        recv = _InplaceAllToAll.apply(send, group).reshape(cp * s_l, b, h // cp, d)
        return recv.permute(1, 2, 0, 3)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=is_causal)
    b, hl, s, d = o.shape
    send = o.reshape(b, hl, cp, s // cp, d).permute(2, 0, 3, 1, 4)  # [cp, B, S_l, Hl, D]
    recv = _InplaceAllToAll.apply(send, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * hl, d)


def inplace_seq_first(q, k, v, group=None, is_causal=True):
    """BHSD in and out, Megatron/DeepSpeed-style inside: [S/cp, B, H, D] buffers, one
    ``single_all_to_all`` per tensor (scatter heads, gather the sequence; back the other way)."""
    group = group or dist.group.WORLD
    cp = _cp(group)

    def scatter(x):  # [B, H, S/cp, D] -> [B, H/cp, S, D]
        sbhd = x.permute(2, 0, 1, 3)
        s_l, b, h, d = sbhd.shape
        send = sbhd.reshape(s_l, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # [cp, S_l, B, Hl, D]
        return _InplaceAllToAll.apply(send, group).reshape(cp * s_l, b, h // cp, d).permute(1, 2, 0, 3)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=is_causal)
    b, hl, s, d = o.shape
    send = o.permute(2, 0, 1, 3).reshape(cp, s // cp, b, hl, d)  # [cp (seq block), S_l, B, Hl, D]
    recv = _InplaceAllToAll.apply(send, group)  # [cp (head block), S_l, B, Hl, D]
    return recv.permute(2, 0, 3, 1, 4).reshape(b, cp * hl, s // cp, d)


class _InplaceGather(torch.autograd.Function):
    """``dist.all_gather_into_tensor`` on dim 0 into a fresh buffer; the backward is
    ``dist.reduce_scatter_tensor`` into another."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((_cp(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // _cp(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def inplace_allgather(q, k, v, group=None):
    """BSHD, not causal (DiT style): K and V gathered along the sequence by in-place
    all-gathers (sequence to dim 0 and back), GQA through ``enable_gqa``."""
    group = group or dist.group.WORLD

    def gather(x):  # [B, S/cp, Hkv, D] -> [B, Hkv, S, D]
        return _InplaceGather.apply(x.transpose(0, 1), group).permute(1, 2, 0, 3)

    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), gather(k), gather(v), enable_gqa=q.shape[2] != k.shape[2]
    )
    return o.transpose(1, 2)


class _ListGather(torch.autograd.Function):
    """``dist.all_gather`` into a list of fresh tensors, concatenated along the sequence (dim 1,
    BSHD); the backward is ``dist.reduce_scatter_tensor`` (its list form does not trace)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(_cp(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        whole = grad.movedim(1, 0).contiguous()
        out = whole.new_empty((whole.shape[0] // _cp(ctx.group), *whole.shape[1:]))
        dist.reduce_scatter_tensor(out, whole, group=ctx.group)
        return out.movedim(0, 1), None


def list_allgather(q, k, v, group=None):
    """BSHD, not causal: K and V gathered with the list form of ``dist.all_gather`` and
    concatenated along the sequence, as much hand-written training code does."""
    group = group or dist.group.WORLD
    k, v = (_ListGather.apply(x, group).transpose(1, 2) for x in (k, v))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=q.shape[2] != k.shape[1])
    return o.transpose(1, 2)


def checkpointed(attend):
    """``attend`` under activation checkpointing (recomputed in the backward), as training
    code with gradient checkpointing runs every layer."""
    import torch.utils.checkpoint

    def run(q, k, v):
        return torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)

    return run
