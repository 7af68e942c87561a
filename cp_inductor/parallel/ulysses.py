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
import torch.nn.functional as F

from ..lowerings.cp_collectives import gather_heads, scatter_heads
from .sharding import gqa

LAYOUTS = ("bshd", "bhsd")


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _seq_dim(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "bshd" else 2


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
