"""Attention calls split by head groups: what head_split (all-gather, ring) and head_overlap
(Ulysses) both emit. Group ``g`` takes query heads ``[g*Hq/G, (g+1)*Hq/G)`` and K/V heads
``[g*Hkv/G, ...)``, so GQA pairs stay together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..analysis.sdpa_ops import bound_args
from .fx_emit import Emitter, stride_order

aten = torch.ops.aten

# Attention arguments that carry query heads / key-value heads on dim 1 (forward and backward).
_Q_HEAD_ARGS = ("query", "grad_out", "out", "logsumexp")
_KV_HEAD_ARGS = ("key", "value")


@dataclass
class Partition:
    """How one region is split."""

    groups: int
    heads_q: int  # local query heads per group
    heads_kv: int  # local key/value heads per group


def cat_like(emit: Emitter, parts: list, dim: int, like: torch.Tensor) -> torch.fx.Node:
    """Concatenate ``parts`` along ``dim`` into a tensor with ``like``'s strides: it replaces a
    saved tensor whose strides the backward graph was compiled for."""
    order = stride_order(like)
    inverse = [order.index(i) for i in range(like.dim())]
    permuted = [emit(aten.permute.default, p, order) for p in parts]
    return emit(aten.permute.default, emit(aten.cat.default, permuted, order.index(dim)), inverse)


def group_call(emit: Emitter, node: torch.fx.Node, p: Partition, g: int, inputs: dict) -> torch.fx.Node:
    """``node`` (an attention op) on the heads of group ``g``: ``inputs`` replaces some arguments,
    the rest are sliced on their head dim or passed as they are."""
    args, kwargs = list(node.args), dict(node.kwargs)
    schema = node.target._schema.arguments
    for i, (name, value) in enumerate(bound_args(node).items()):
        if name in inputs:
            value = inputs[name]
        elif name in _Q_HEAD_ARGS and isinstance(value, torch.fx.Node):
            value = emit(aten.slice.Tensor, value, 1, g * p.heads_q, (g + 1) * p.heads_q)
            if name == "logsumexp" and not value.meta["val"].is_contiguous():
                # The flash backward indexes its log-sum-exp as a dense [B, H, S]: a head slice
                # of a batch > 1 gave wrong gradients on H200 (results/gpu_tests_run45.log). It is small: copy it.
                value = emit(aten.clone.default, value, memory_format=torch.contiguous_format)
        elif name in _KV_HEAD_ARGS and isinstance(value, torch.fx.Node):
            value = emit(aten.slice.Tensor, value, 1, g * p.heads_kv, (g + 1) * p.heads_kv)
        else:
            continue
        if i < len(args):
            args[i] = value
        else:
            kwargs[schema[i].name] = value
    return emit(node.target, *args, **kwargs)


def common_groups(hq: int, hkv: int, want: int, auto_max: int, knob: str, label: str, names) -> tuple[int, str | None]:
    """Head groups for ``hq`` query and ``hkv`` key/value heads: (``want``, None) if it divides
    both, (the largest common divisor up to ``auto_max``, None) for ``want`` = 0, else (1, why)."""
    common = [g for g in range(2, hkv + 1) if hq % g == 0 and hkv % g == 0]
    if want == 1:
        return 1, f"{knob}=1"
    shown = f"{names[0]}={hq}, {names[1]}={hkv}"
    if want > 1:
        if want in common:
            return want, None
        return 1, f"{knob}={want} does not divide the {label} ({shown})"
    fitting = [g for g in common if g <= auto_max]
    if not fitting:
        return 1, f"{label} {shown} have no common divisor in 2..{auto_max}"
    return fitting[-1], None
