"""The match record every CP detector produces: one attention op inside a CP region.

A detector (``passes/detect/<style>.py``) subclasses :class:`CPMatch` with what its rewrites
need (Ulysses: the all-to-all crossings on each side of attention); the pipeline, the report and
every rewrite's eligibility read the common fields below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.fx

from .sdpa_ops import SDPA_BACKWARD


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
        return "backward" if self.attention.target in SDPA_BACKWARD else "forward"

    def describe(self) -> str:
        """The report's detail column: heads and masking."""
        return f"Hq={self.heads_q} Hkv={self.heads_kv}" + (" causal" if self.is_causal else "")
