"""Programs that already call FlashAttention-4 (``flash_attn.cute``'s ``flash_attn_varlen_func``
and ``flash_attn_func``), in one graph: Dynamo traces those functions as our FA4 ops.

FA4's functions are autograd.Functions around a JIT compiler, which Dynamo cannot trace: under
``fullgraph=True`` they fail ("Attempted to call function marked as skipped"), otherwise they
break the graph. ``register()`` gives Dynamo a traceable stand-in for each
(``torch.compiler.substitute_in_graph``): a call whose arguments our ops cover becomes
``cp_inductor.fa4_varlen_attention`` / ``cp_inductor.fa4_sdpa`` (the same kernels, as registered
ops: no graph break, capturable in CUDA graphs); any other call (paged K/V, score or mask mods,
sinks, softcap, windows, deterministic backward, ...) runs FA4's own function, as before.
The backend calls ``register()`` when it is loaded if ``flash_attn.cute`` is already imported;
a program that imports FA4 later calls ``cp_inductor.trace_fa4_functions()`` itself. The
substitution is process-wide: other backends then see our ops too (same kernels, same answers).
"""

from __future__ import annotations

import inspect
import sys

import torch

from . import fa4_attention  # also registers the ops

_registered: set[int] = set()

# The arguments our ops take; every other argument must be left at its default.
_VARLEN_TAKEN = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_k",
                 "softmax_scale", "causal", "window_size", "return_lse")
_DENSE_TAKEN = ("q", "k", "v", "softmax_scale", "causal", "window_size", "return_lse")
_NO_WINDOW = ((None, None), (-1, -1), [None, None], [-1, -1])


def _parameters(fn) -> tuple[tuple[str, ...], dict]:
    params = inspect.signature(fn).parameters.values()
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names, {p.name: p.default for p in params if p.default is not p.empty}


def _bind(names, defaults, args, kwargs) -> dict:
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _at_default(value, default) -> bool:
    return value is default or (not isinstance(value, torch.Tensor) and value == default)


def _taken(bound: dict, defaults: dict, taken: tuple) -> bool:
    others_default = all(_at_default(bound[n], d) for n, d in defaults.items() if n not in taken)
    return others_default and bound["window_size"] in _NO_WINDOW


def _lse(lse, return_lse):
    return lse if return_lse else lse.detach()  # FA4 differentiates its lse only when asked for it


def _as_written(original):
    """``original`` called as the program wrote it: outside the graph (a graph break, as before;
    under fullgraph an error), since calling it in the stand-in would reach the stand-in again."""
    try:
        return torch._dynamo.disable(original, reason="FA4 called with arguments cp_inductor's ops do not take")
    except TypeError:  # a torch whose disable() takes no reason
        return torch._dynamo.disable(original)


def _varlen_stand_in(original):
    names, defaults = _parameters(original)
    as_written = _as_written(original)

    def flash_attn_varlen_func(*args, **kwargs):
        a = _bind(names, defaults, args, kwargs)
        if not _taken(a, defaults, _VARLEN_TAKEN) or a["cu_seqlens_q"] is None or a["cu_seqlens_k"] is None:
            return as_written(*args, **kwargs)
        q, k, v = a["q"], a["k"], a["v"]
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else q.shape[-1] ** -0.5
        max_q = a["max_seqlen_q"] if a["max_seqlen_q"] is not None else q.shape[0]
        max_k = a["max_seqlen_k"] if a["max_seqlen_k"] is not None else k.shape[0]
        out, lse = torch.ops.cp_inductor.fa4_varlen_attention(
            q, k, v, a["cu_seqlens_q"], a["cu_seqlens_k"], a["seqused_k"], max_q, max_k, scale, bool(a["causal"]))
        return out, _lse(lse, a["return_lse"])

    return flash_attn_varlen_func


def _dense_stand_in(original):
    names, defaults = _parameters(original)
    as_written = _as_written(original)

    def flash_attn_func(*args, **kwargs):
        a = _bind(names, defaults, args, kwargs)
        if not _taken(a, defaults, _DENSE_TAKEN):
            return as_written(*args, **kwargs)
        q, k, v = a["q"], a["k"], a["v"]  # [B, S, H, D]
        scale = a["softmax_scale"] if a["softmax_scale"] is not None else q.shape[-1] ** -0.5
        out, lse = torch.ops.cp_inductor.fa4_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale,
                                                  bool(a["causal"]))
        return out.transpose(1, 2), _lse(lse, a["return_lse"])

    return flash_attn_func


def register(module=None) -> list[str]:
    """Give Dynamo our stand-ins for FA4's functions (``module``: ``flash_attn.cute.interface``
    or a module with the same functions); returns the names registered now."""
    if module is None:
        module = fa4_attention._interface()
    done = []
    for name, stand_in in (("flash_attn_varlen_func", _varlen_stand_in), ("flash_attn_func", _dense_stand_in)):
        original = getattr(module, name, None)
        if original is None or id(original) in _registered:
            continue
        torch.compiler.substitute_in_graph(original, skip_signature_check=True)(stand_in(original))
        _registered.add(id(original))
        done.append(name)
    return done


def register_if_imported() -> None:
    """``register()`` when the program has imported FA4 already (never imports it: it is heavy)."""
    module = sys.modules.get("flash_attn.cute.interface")
    if module is not None:
        register(module)
