"""The layout contract of ``cp_inductor::a2a_pack``, shared by the op (``a2a_pack.py``) and its
Triton kernel (``a2a_pack_triton.py``): what the inputs must be, and the pack in ATen ops.

    buf[r, s, b, offset_i + j, :] = x_i[b, s, r * H_i/cp + j, :]
"""

from __future__ import annotations

import torch


def check(tensors, cp):
    b, s_l, _, d = tensors[0].shape
    for x in tensors:
        if x.dim() != 4 or x.shape[0] != b or x.shape[1] != s_l or x.shape[3] != d or x.shape[2] % cp:
            raise ValueError(f"a2a_pack wants [B, S/cp, H, D] tensors with H divisible by cp={cp}")
        if x.dtype != tensors[0].dtype:
            raise ValueError("a2a_pack wants one dtype")


def reference(tensors: list[torch.Tensor], cp: int) -> torch.Tensor:
    """The pack in ATen ops (what fused_a2a emits and Inductor lowers)."""
    parts = []
    for x in tensors:
        b, s_l, h, d = x.shape
        parts.append(x.reshape(b, s_l, cp, h // cp, d).permute(2, 1, 0, 3, 4))
    return torch.cat(parts, dim=3)
