"""Ulysses (all-to-all) context-parallel attention in plain PyTorch: functional collectives + SDPA.

Eager, this is the OFF baseline; under ``torch.compile(backend="cp_inductor")`` the passes find
these regions and rewrite them. It traces with ``fullgraph=True``.

Layouts name the sequence-sharded q/k/v a rank holds: ``"bshd"`` is ``[B, S/cp, H, D]``,
``"bhsd"`` is ``[B, H, S/cp, D]``. The sequence is sharded contiguously: rank r holds tokens
``[r*S/cp, (r+1)*S/cp)`` (see :func:`cp_inductor.parallel.sharding.shard_sequence`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from .sharding import gqa

LAYOUTS = ("bshd", "bhsd")


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _seq_dim(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "bshd" else 2


def scatter_heads(x: torch.Tensor, layout: str, cp: int, group) -> torch.Tensor:
    """Sequence-sharded ``x`` -> all heads' full sequence for this rank's head block, BHSD."""
    if layout == "bshd":
        b, s_l, h, d = x.shape
        # [cp, B, S_l, H/cp, D]: chunk j holds head block j, sent to rank j.
        send = x.reshape(b, s_l, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = funcol.all_to_all_single_autograd(send, None, None, group)
        # recv chunk j is source rank j's sequence slice: sequence = (rank, local position).
        return recv.permute(1, 3, 0, 2, 4).reshape(b, h // cp, cp * s_l, d)
    b, h, s_l, d = x.shape
    send = x.reshape(b, cp, h // cp, s_l, d).transpose(0, 1).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s_l, d)


def gather_heads(out: torch.Tensor, layout: str, cp: int, group) -> torch.Tensor:
    """BHSD output for this rank's head block -> sequence-sharded output in ``layout``."""
    b, h_l, s, d = out.shape
    s_l = s // cp
    if layout == "bshd":
        send = out.reshape(b, h_l, cp, s_l, d).permute(2, 0, 3, 1, 4).contiguous()
        recv = funcol.all_to_all_single_autograd(send, None, None, group)
        # recv chunk j is head block j of this rank's sequence slice.
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s_l, cp * h_l, d)
    send = out.reshape(b, h_l, cp, s_l, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.transpose(0, 1).reshape(b, cp * h_l, s_l, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    layout: str = "bshd",
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Ulysses (all-to-all) CP attention over sequence-sharded q, k, v.

    q: ``[B, S/cp, Hq, D]`` (bshd) or ``[B, Hq, S/cp, D]`` (bhsd); k, v likewise with Hkv heads
    (GQA when Hkv < Hq). Needs ``Hq % cp == 0`` and ``Hkv % cp == 0``. Returns q's layout.
    """
    group = group if group is not None else dist.group.WORLD
    cp = _group_size(group)
    h_dim = 2 if layout == "bshd" else 1
    _seq_dim(layout)
    hq, hkv = q.shape[h_dim], k.shape[h_dim]
    if hq % cp or hkv % cp:
        raise ValueError(f"Ulysses needs heads divisible by cp={cp}: Hq={hq}, Hkv={hkv}")
    qh = scatter_heads(q, layout, cp, group)
    kh = scatter_heads(k, layout, cp, group)
    vh = scatter_heads(v, layout, cp, group)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=gqa(hq, hkv)
    )
    return gather_heads(out, layout, cp, group)
