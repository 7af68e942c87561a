"""The attention ops detection knows, forward and backward, and their argument names: the ATen
ops SDPA lowers to (dense ``[B, H, S, D]``), and the packed-sequence (THD, ``[T, H, D]`` with
cu_seqlens) ops of torch's ``varlen_attn`` and of our cuDNN lowering."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.fx

aten = torch.ops.aten


def _ops(*names):
    return tuple(getattr(aten, n).default for n in names if hasattr(aten, n))


# Each forward op takes (query, key, value, ...) and returns (out, logsumexp, ...).
SDPA_FORWARD = _ops(
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
# Each backward op takes (grad_out, query, key, value, ...) and returns (dq, dk, dv, ...).
SDPA_BACKWARD = _ops(
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_fused_attention_overrideable_backward",
)


def registered(name: str) -> torch._ops.OpOverload | None:
    """The default overload of ``namespace::name`` where torch's registry holds it, looked up
    without importing the module that registers it (``Ops`` says why)."""
    namespace, op = name.split("::")
    packet = getattr(getattr(torch.ops, namespace), op, None)
    return None if packet is None else packet.default


class Ops(Sequence):
    """Attention ops, some named ``namespace::name`` and looked up in torch's registry when asked
    rather than imported: a program's graph can hold torch's ``torch_attn`` ops only once it has
    imported ``torch.nn.attention.varlen`` (ours, once it has imported our lowerings), and
    importing that here would put its import on every process that imports the backend (a
    restarted job's first call included; measured in ``docs/measurements.md``), which default
    Inductor does not pay. While a name is missing it is looked up again after new imports."""

    def __init__(self, *parts) -> None:
        # OpOverloads and "namespace::name" strings; an Ops among them gives its own parts
        self._parts: tuple = tuple(q for p in parts for q in (p._parts if isinstance(p, Ops) else (p,)))
        self._found: tuple = ()
        self._modules: int | None = -1  # len(sys.modules) when last looked up; None once all were found

    def _ops(self) -> tuple:
        if self._modules is not None and self._modules != len(sys.modules):
            self._modules = len(sys.modules)
            found = [registered(p) if isinstance(p, str) else p for p in self._parts]
            self._found = tuple(op for op in found if op is not None)
            if len(self._found) == len(self._parts):
                self._modules = None
        return self._found

    def __getitem__(self, i):
        return self._ops()[i]

    def __len__(self) -> int:
        return len(self._ops())

    def __contains__(self, op) -> bool:
        return op in self._ops()

    def __add__(self, other) -> Ops:
        return Ops(self, other)


# Packed sequences: (query, key, value, cu_seqlens_q, cu_seqlens_k, max_q, max_k, ...) -> (out
# [T, Hq, Dv], lse, ...), and the backward (grad_out, query, key, value, out, lse, ...) -> (dq, dk, dv).
VARLEN_FORWARD = Ops("torch_attn::_varlen_attn", "cp_inductor::varlen_attention", "cp_inductor::fa4_varlen_attention")
VARLEN_BACKWARD = Ops("torch_attn::_varlen_attn_backward", "cp_inductor::varlen_attention_backward",
                      "cp_inductor::fa4_varlen_attention_backward")
# FA4 (``lowerings/fa4_attention.py``): the dense op takes and returns aten's layouts, so the
# detectors read it as one of aten's; its packed op reads like the varlen ones.
SDPA_FORWARD = Ops(*SDPA_FORWARD, "cp_inductor::fa4_sdpa")
SDPA_BACKWARD = Ops(*SDPA_BACKWARD, "cp_inductor::fa4_sdpa_backward")
FORWARD = SDPA_FORWARD + VARLEN_FORWARD
BACKWARD = SDPA_BACKWARD + VARLEN_BACKWARD
SDPA = SDPA_FORWARD + SDPA_BACKWARD
VARLEN = VARLEN_FORWARD + VARLEN_BACKWARD
ATTENTION = FORWARD + BACKWARD


# One spelling per role: the memory-efficient backward calls its first argument ``grad_out_``,
# our varlen ops say q, k, v.
_ALIASES = {"grad_out_": "grad_out", "q": "query", "k": "key", "v": "value"}


def arg_names(node: torch.fx.Node) -> list[str]:
    """Schema argument names of an attention op, in order, with one spelling per role."""
    return [_ALIASES.get(a.name, a.name) for a in node.target._schema.arguments]


def bound_args(node: torch.fx.Node) -> dict:
    """The node's arguments by (normalized) schema name, defaults filled in."""
    out = {}
    for i, (arg, name) in enumerate(zip(node.target._schema.arguments, arg_names(node))):
        if i < len(node.args) and not arg.kwarg_only:
            out[name] = node.args[i]
        elif arg.name in node.kwargs:
            out[name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[name] = arg.default_value
    return out


def tuple_outputs(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """getitem users of a multi-output node, by index."""
    import operator

    return {u.args[1]: u for u in node.users if u.target is operator.getitem}
