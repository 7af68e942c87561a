"""Triton kernel and launcher of ``cp_inductor::a2a_pack`` (the op: ``a2a_pack.py``; the layout:
``a2a_pack_layout.py``). A module of its own so tests can rebuild it under
``TRITON_INTERPRET=1`` and run it on CPU tensors."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .a2a_pack_layout import check


@triton.jit
def _pack_kernel(src, dst, run, src_stride_b, src_stride_s, dst_row, dst_offset, s_l, batch, BLOCK: tl.constexpr):
    # Program (row, chunk): row = (r, s, b) of the destination, chunk = BLOCK elements of its run.
    # The source run x[b, s, r*h:(r+1)*h, :] is contiguous in a BSHD tensor.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = row % batch
    s = (row // batch) % s_l
    r = row // (batch * s_l)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < run
    src_start = b.to(tl.int64) * src_stride_b + s.to(tl.int64) * src_stride_s + r.to(tl.int64) * run
    dst_start = row.to(tl.int64) * dst_row + dst_offset
    vals = tl.load(src + src_start + cols, mask=mask)
    tl.store(dst + dst_start + cols, vals, mask=mask)


def pack(tensors: list[torch.Tensor], cp: int, out: torch.Tensor | None = None, block: int = 2048) -> torch.Tensor:
    """One launch per input tensor, each writing its heads' columns of every destination row."""
    check(tensors, cp)
    b, s_l, _, d = tensors[0].shape
    heads = sum(x.shape[2] for x in tensors) // cp
    if out is None:
        out = torch.empty((cp, s_l, b, heads, d), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for x in tensors:
        if x.stride(3) != 1 or x.stride(2) != d:
            x = x.contiguous()  # each (b, s) row of heads must be one run
        run = x.shape[2] // cp * d
        grid = (cp * s_l * b, triton.cdiv(run, block))
        _pack_kernel[grid](x, out, run, x.stride(0), x.stride(1), heads * d, offset, s_l, b, BLOCK=block)
        offset += run
    return out
