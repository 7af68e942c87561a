"""The match record every CP detector produces: one attention op inside a CP region.

A detector (``passes/detect/<style>.py``) subclasses :class:`CPMatch` with what its rewrites
need (Ulysses: the all-to-all crossings on each side of attention); the pipeline, the report and
every rewrite's eligibility read the common fields below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.fx

from .layout_algebra import node_val
from .sdpa_ops import BACKWARD
from .sym_sizes import size_of


@dataclass
class CPMatch:
    style: ClassVar[str]  # "a2a" | "allgather" | "ring": the report's vocabulary

    graph_kind: str  # "forward" | "backward" | "inference" (the report), "post_grad" (the passes)
    attention: torch.fx.Node  # the ATen attention op, forward or backward
    cp: int  # size of the CP process group
    group_name: str
    layout: str  # "bshd" | "bhsd" | "sbhd" | ...: q/k/v (or dO) as the rank holds them
    is_causal: bool = False
    heads_q: int = 0  # global query heads
    heads_kv: int = 0  # global key/value heads
    has_mask: bool = False
    dropout_p: float = 0.0

    @property
    def direction(self) -> str:
        """"backward" for an attention backward op, else "forward"."""
        return "backward" if self.attention.target in BACKWARD else "forward"

    def describe(self) -> str:
        """The report's detail column: heads and masking."""
        return f"Hq={self.heads_q} Hkv={self.heads_kv}" + (" causal" if self.is_causal else "")


def attention_facts(args: dict, heads_per_rank: int = 1) -> dict:
    """CPMatch's attention fields from an attention op's bound arguments; ``heads_per_rank``
    turns the heads attention sees into global heads (cp for Ulysses, where each rank sees its
    head block)."""
    q, k = node_val(args["query"]), node_val(args["key"])
    window = args.get("window_size")  # torch's varlen_attn: causal is the window (-1, 0)
    return dict(
        is_causal=bool(args.get("is_causal", False)) or (window is not None and list(window) == [-1, 0]),
        heads_q=size_of(q.shape[1]) * heads_per_rank,
        heads_kv=size_of(k.shape[1]) * heads_per_rank,
        has_mask=any(args.get(n) is not None for n in ("attn_mask", "attn_bias")),
        dropout_p=float(args.get("dropout_p", 0.0) or 0.0),
    )
