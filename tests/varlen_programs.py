"""Packed-sequence (THD) programs written the ways real projects write them, and CPU kernels for
torch's varlen attention ops (CUDA-only in torch) so CPU tests can run them eagerly."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from cp_inductor.lowerings.varlen_attention import reference, reference_backward


def _window(window_size, is_causal=False):
    return bool(is_causal) or list(window_size or [-1, -1]) == [-1, 0]


@functools.cache
def register_cpu_kernels() -> bool:
    """CPU kernels for ``torch_attn::_varlen_attn`` and its backward (the per-sequence reference),
    whatever the op's schema in this torch. False where this torch has no varlen_attn."""
    try:
        import torch.nn.attention.varlen  # noqa: F401 - defines the ops
    except ImportError:
        return False
    if not hasattr(torch.ops.torch_attn, "_varlen_attn"):
        return False

    def forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        bound = _bind(torch.ops.torch_attn._varlen_attn.default, (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args), kwargs)
        scale = bound.get("scale") or query.shape[-1] ** -0.5
        causal = _window(bound.get("window_size"), bound.get("is_causal", False))
        out, lse = reference(query, key, value, cu_seq_q, cu_seq_k if cu_seq_k is not None else cu_seq_q, scale, causal)
        return out, lse.transpose(0, 1).contiguous(), torch.zeros(2, dtype=torch.uint64)

    def backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        bound = _bind(torch.ops.torch_attn._varlen_attn_backward.default,
                      (grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, *args), kwargs)
        scale = bound.get("scale") or query.shape[-1] ** -0.5
        causal = _window(bound.get("window_size"), bound.get("is_causal", False))
        return reference_backward(grad_out, query, key, value, cu_seq_q, cu_seq_k, scale, causal)

    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", backward)
    return True


def _bind(op, args, kwargs) -> dict:
    names = [a.name for a in op._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def pack(lengths, heads_q, heads_kv, head_dim, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v of one packed row of documents with the given lengths, and cu_seqlens (int32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads_q, head_dim, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(total, heads_kv, head_dim, generator=g, device=device, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu, max(lengths)


def torchtitan_style(q, k, v, cu, max_len, causal=True):
    """torchtitan's VarlenAttention: varlen_attn on the pack, K/V heads repeated for GQA."""
    from torch.nn.attention.varlen import varlen_attn

    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    window = (-1, 0) if causal else (-1, -1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window)


def sequence_reference(q, k, v, cu, causal):
    """Per-sequence SDPA in fp64: the single-device reference."""
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        o = F.scaled_dot_product_attention(*(t[a:b].double().transpose(0, 1) for t in (q, k, v)),
                                           is_causal=causal, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)
