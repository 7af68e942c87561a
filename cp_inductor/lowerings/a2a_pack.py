"""``cp_inductor::a2a_pack``: a hand-written Triton pack for the Ulysses all-to-all, kept to
measure Inductor's own pack against (issue: "Triton kernels with 16-byte accesses, or Inductor
lowerings that fuse into one kernel: show which is faster").

    a2a_pack([q, k, v], cp) -> buf[cp, S/cp, B, sum(H_i)/cp, D]
    buf[r, s, b, offset_i + j, :] = x_i[b, s, r * H_i/cp + j, :]

the buffer fused_a2a sends. Every destination row ``(r, s, b)`` is one contiguous run of
``H_i/cp * D`` elements per input, so the kernel is a gather of long contiguous runs: each
program copies ``BLOCK`` elements of one run, which Triton turns into 16-byte vector loads and
stores when the run is 16-byte aligned.

fused_a2a does not use this op: measured on H200 (``benchmarks/bench_pack.py``), Inductor's
generated pack (a ``cat`` of relaid views, one Triton kernel) moves 93-95% of a plain copy's
bandwidth, this kernel 82-92% (three launches, one per input), eager ATen 35-38%; an opaque op
would also stop Inductor from fusing the pack with whatever produces q, k, v.
"""

from __future__ import annotations

import torch

from .a2a_pack_layout import check, reference


@torch.library.custom_op("cp_inductor::a2a_pack", mutates_args=())
def a2a_pack(tensors: list[torch.Tensor], cp: int) -> torch.Tensor:
    check(tensors, cp)
    return reference(tensors, cp)


@a2a_pack.register_fake
def _(tensors, cp):
    check(tensors, cp)
    b, s_l, _, d = tensors[0].shape
    heads = sum(x.shape[2] for x in tensors) // cp
    return tensors[0].new_empty((cp, s_l, b, heads, d))


@a2a_pack.register_kernel("cuda")
def _(tensors, cp):
    from . import a2a_pack_triton

    return a2a_pack_triton.pack(tensors, cp)
