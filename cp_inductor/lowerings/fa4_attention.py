"""FlashAttention-4 (``flash_attn.cute``) as registered ops of ours: packed (THD) and dense.

    out, lse = fa4_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q, max_k, scale, is_causal)
    out, lse = fa4_sdpa(q, k, v, scale, is_causal)

Packed: q ``[T_q, H_q, D]``, k and v ``[T_k, H_k, D]``, ``H_q % H_k == 0`` (GQA as is); sequence
``i`` is query rows ``cu_q[i]:cu_q[i+1]`` against key rows ``cu_k[i]:cu_k[i] + n_k`` with
``n_k = seqused_k[i]`` when given (keys read in place from a larger buffer: an all-gathered K/V
with ``cu_k`` at the document starts) or ``cu_k[i+1] - cu_k[i]``. ``lse`` is ``[H_q, T_q]`` fp32.
Dense: laid out as aten's SDPA ops take it, q ``[B, H_q, S_q, D]``, k and v ``[B, H_k, S_k, D]``
(any strides with the head_dim innermost); ``out`` is ``[B, H_q, S_q, D]`` over a
``[B, S_q, H_q, D]`` buffer and ``lse`` ``[B, H_q, S_q]`` fp32, as aten's flash op returns them,
so a pass can put this op where aten's was. Causal is bottom-right (flash-attention's convention): a
query row sees the keys up to its own position counted from the END of its sequence; top-left
and bottom-right agree when the query and key lengths do. ``lse`` is differentiable: a caller
that merges partial outputs by their log-sum-exp (ring attention) gets its gradient through.

FA4's Python entry points are autograd.Functions around a JIT compiler, which Dynamo cannot trace
(``fullgraph=True`` fails on them): as ops they are opaque calls in one graph, and the JIT runs
on the first (eager, warm-up) call of each configuration, before any CUDA-graph capture. Its
kernel choice keys on dtype, head dims, GQA ratio, causal and which of cu_seqlens / seqused are
given, not on lengths, so packs whose lengths change every step reuse one compiled kernel; the
compiled kernels are kept on disk beside Inductor's cache (``persistent_kernel_cache``), for a
restarted job to load as it loads Inductor's graphs. ``flash_attn.cute`` is imported on first
use (``pip install "cp_inductor[fa4]"``). CPU runs a per-sequence reference (under
``varlen_attention.reference_kernels()``: the tests).
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from . import varlen_attention

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (8, 256)  # FA4's Hopper kernels: 8..256, multiples of 8 (16 bytes)
ARCHS = (9, 10, 11)  # compute capability majors whose forward and backward FA4 runs


KERNEL_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
KERNEL_CACHE_DIR_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


def persistent_kernel_cache() -> str | None:
    """Turn on FA4's on-disk kernel cache, in ``flash_attention_cute/`` of Inductor's cache dir,
    before FA4 is imported (it reads the switch at import); returns the dir, or None where the
    program set the switch itself, imported FA4 first (its choice stands) or switched Inductor's
    caches off (``force_disable_caches``: none of ours either).

    FA4 compiles its kernels in every process, off by default: a restarted job whose graphs
    Inductor loads from disk would still compile every FA4 kernel its graphs call again.
    """
    import torch._inductor.config as inductor_config

    if ("flash_attn.cute.cache_utils" in sys.modules or KERNEL_CACHE_ENV in os.environ
            or inductor_config.force_disable_caches):
        return None
    if KERNEL_CACHE_DIR_ENV not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        os.environ[KERNEL_CACHE_DIR_ENV] = os.path.join(cache_dir(), "flash_attention_cute")
    os.environ[KERNEL_CACHE_ENV] = "1"
    return os.environ[KERNEL_CACHE_DIR_ENV]


@functools.cache
def _import_error() -> str | None:
    persistent_kernel_cache()
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as error:  # ImportError, or the CuTe DSL failing to load
        return f"flash-attn-4 is not importable ({type(error).__name__}: {error}; pip install \"cp_inductor[fa4]\")"
    return None


@functools.cache
def installed() -> bool:
    """Whether a flash-attn package is installed (a cheap check, no import of FA4's JIT stack;
    FlashAttention-2 has the same top-level package, so it may answer yes for FA2 alone: the
    import, when a call is considered, is what tells)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def device_unavailable(device: torch.device, imported: bool = True) -> str | None:
    """Why FA4 cannot run on ``device`` at all in this process, or None (CPU: only the tests'
    reference kernels). ``imported=False``: FA4 installed is enough (no import of its JIT stack,
    about a second: a restart whose graphs come from the cache may never call FA4)."""
    if device.type == "cpu":
        return None if varlen_attention.reference_enabled() else "cpu: FA4 runs on CUDA only"
    if device.type != "cuda":
        return f"{device.type}: FA4 runs on CUDA only"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in ARCHS:
        return f"compute capability {major}.x (FA4's forward and backward run on 9.x-11.x)"
    if not imported:
        return None if installed() else "flash-attn-4 is not installed (pip install \"cp_inductor[fa4]\")"
    return _import_error()


def unavailable(device: torch.device, dtype: torch.dtype, head_dim, head_dim_v=None) -> str | None:
    """Why FA4 cannot take attention on ``device`` at this dtype and head dim, or None."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if not all(isinstance(d, int) for d in (head_dim, head_dim_v)):
        return "symbolic head_dim"
    if head_dim != head_dim_v:
        return f"head_dim {head_dim} of q/k differs from v's {head_dim_v}"
    if not HEAD_DIMS[0] <= head_dim <= HEAD_DIMS[1] or head_dim % 8:
        return f"head_dim {head_dim} (FA4 takes multiples of 8 from {HEAD_DIMS[0]} to {HEAD_DIMS[1]})"
    if device.type == "cuda" and dtype not in DTYPES:
        return f"dtype {dtype} (FA4 takes float16 and bfloat16)"
    return device_unavailable(device)


def _interface():
    persistent_kernel_cache()
    from flash_attn.cute import interface

    return interface


# ---- the ops ---------------------------------------------------------------------------------

_lib = torch.library.Library("cp_inductor", "FRAGMENT")
_lib.define(
    "fa4_varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "Tensor? seqused_k, SymInt max_q, SymInt max_k, float scale, bool is_causal, int window_left=-1) -> (Tensor, Tensor)"
)
_lib.define(
    "fa4_varlen_attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, SymInt max_q, SymInt max_k, "
    "float scale, bool is_causal, int window_left=-1) -> (Tensor, Tensor, Tensor)"
)
_lib.define("fa4_sdpa(Tensor q, Tensor k, Tensor v, float scale, bool is_causal) -> (Tensor, Tensor)")
_lib.define(
    "fa4_sdpa_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor lse, float scale, bool is_causal) -> (Tensor, Tensor, Tensor)"
)


def _grads_like(q, k, v):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


@torch.library.register_fake("cp_inductor::fa4_varlen_attention", lib=_lib)
def _(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, is_causal, window_left=-1):
    out = q.new_empty(q.shape[:2] + v.shape[2:])
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.register_fake("cp_inductor::fa4_varlen_attention_backward", lib=_lib)
def _(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, seqused_k, max_q, max_k, scale, is_causal, window_left=-1):
    return _grads_like(q, k, v)


def _bhsd(t, last=None):
    """A fresh [B, H, S, D] tensor like ``t`` over a [B, S, H, D] buffer (FA4's layout)."""
    b, h, s, d = t.shape[0], t.shape[1], t.shape[2], t.shape[3] if last is None else last
    return t.new_empty((b, s, h, d)).transpose(1, 2)


@torch.library.register_fake("cp_inductor::fa4_sdpa", lib=_lib)
def _(q, k, v, scale, is_causal):
    return _bhsd(q, v.shape[3]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake("cp_inductor::fa4_sdpa_backward", lib=_lib)
def _(grad_out, grad_lse, q, k, v, out, lse, scale, is_causal):
    return _bhsd(q), _bhsd(k), _bhsd(v)


# CUDA: FA4's forward entry (return_lse, under no autograd: the op is below it) and its backward
# function; FA4 has changed how many values these return (torch's own FA4 switch unpacks two and
# fails on 4.0.0b36), so only the leading ones are read.

def _window(window_left: int) -> tuple:
    """FA's (left, right) window: keys from ``window_left`` before the query (causal), or none."""
    return (window_left, 0) if window_left >= 0 else (None, None)


def _cuda_varlen_forward(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, is_causal, window_left=-1):
    with torch.no_grad():
        result = _interface().flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k, max_seqlen_q=max_q,
            max_seqlen_k=max_k, softmax_scale=scale, causal=is_causal, window_size=_window(window_left), return_lse=True)
    return result[0], result[1]


def _contiguous_grads(q, k, v, fill=torch.empty) -> dict:
    """dq, dk, dv laid out as the fake impls say (contiguous in FA4's layout): FA4 would make
    them like its inputs, whose strides a program's views decide."""
    return {name: fill(t.shape, dtype=t.dtype, device=t.device) for name, t in (("dq", q), ("dk", k), ("dv", v))}


def _cuda_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, seqused_k, max_q, max_k, scale, is_causal,
                          window_left=-1):
    # With seqused_k, FA4 writes dK/dV only for the keys a sequence uses (measured: the rest of
    # the buffer kept whatever memory held); keys no query reads have gradient zero.
    fill = torch.empty if seqused_k is None else torch.zeros
    grads = _contiguous_grads(q, k, v, fill)
    result = _interface()._flash_attn_bwd(
        q, k, v, out, grad_out.contiguous(), lse, scale, is_causal, window_size_left=_window(window_left)[0],
        window_size_right=_window(window_left)[1], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        seqused_k=seqused_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dlse=grad_lse, **grads)
    return tuple(result[:3])


def _bshd(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)


def _cuda_forward(q, k, v, scale, is_causal):
    with torch.no_grad():
        result = _interface().flash_attn_func(*_bshd(q, k, v), softmax_scale=scale, causal=is_causal, return_lse=True)
    return result[0].transpose(1, 2), result[1]


def _cuda_backward(grad_out, grad_lse, q, k, v, out, lse, scale, is_causal):
    q, k, v, out, grad_out = _bshd(q, k, v, out, grad_out)
    result = _interface()._flash_attn_bwd(q, k, v, out, grad_out, lse, scale, is_causal, dlse=grad_lse,
                                          **_contiguous_grads(q, k, v))
    return _bshd(*result[:3])


# CPU: the per-sequence reference (varlen_attention's), in FA4's lse layouts.

def _sequences(cu_q, cu_k, seqused_k):
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    for i in range(len(starts_q) - 1):
        if starts_q[i + 1] == starts_q[i]:
            continue  # an empty sequence (a static batch's unused slot)
        end_k = starts_k[i + 1] if used is None else starts_k[i] + used[i]
        yield slice(starts_q[i], starts_q[i + 1]), slice(starts_k[i], end_k)


def _cpu_varlen_forward(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, is_causal, window_left=-1):
    out = q.new_zeros(q.shape[:2] + v.shape[2:])
    lse = q.new_full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32)
    for sq, sk in _sequences(cu_q, cu_k, seqused_k):
        o, l = varlen_attention.reference(q[sq], k[sk], v[sk], _whole(q[sq]), _whole(k[sk]), scale, is_causal, window_left)
        out[sq], lse[:, sq] = o, l.transpose(0, 1)
    return out, lse


def _whole(t):
    return torch.tensor([0, t.shape[0]], dtype=torch.int32)


def _cpu_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, seqused_k, max_q, max_k, scale, is_causal,
                         window_left=-1):
    """FA4's backward in plain torch: the probabilities from the log-sum-exp it is GIVEN, the
    softmax correction from the out it is given (a caller that merged partial attentions passes
    the merged pair, and each part's gradients come out right), plus the lse's own gradient."""
    acc = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc) for t in (q, k, v))
    for sq, sk in _sequences(cu_q, cu_k, seqused_k):
        qs, do = q[sq].to(acc), grad_out[sq].to(acc)
        ks, vs = (t[sk].to(acc).repeat_interleave(groups, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        keep = varlen_attention.kept_keys(qs.shape[0], ks.shape[0], is_causal, window_left)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        rows_lse = lse[:, sq].to(acc)[..., None]
        probs = torch.where(torch.isfinite(rows_lse), torch.exp(scores - rows_lse), 0.0)  # a row with no keys: 0
        delta = (do * out[sq].to(acc)).sum(-1).transpose(0, 1)[..., None]
        d_scores = probs * (torch.einsum("qhd,khd->hqk", do, vs) - delta)
        if grad_lse is not None:
            d_scores = d_scores + probs * grad_lse[:, sq].to(acc)[..., None]
        d_scores = d_scores * scale
        dq[sq] += torch.einsum("hqk,khd->qhd", d_scores, ks)
        # keys read by several sequences (seqused_k into one buffer) sum; GQA's groups sum
        dk[sk] += torch.einsum("hqk,qhd->khd", d_scores, qs).unflatten(1, (-1, groups)).sum(2)
        dv[sk] += torch.einsum("hqk,qhd->khd", probs, do).unflatten(1, (-1, groups)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _flat(*tensors):
    """Dense [B, H, S, D] tensors as packs [B * S, H, D] (FA4's layout, copied)."""
    return tuple(t.transpose(1, 2).flatten(0, 1) for t in tensors)


def _unflat(t, batch):
    return t.unflatten(0, (batch, -1)).transpose(1, 2)


def _cu(batch, length):
    return torch.arange(batch + 1, dtype=torch.int32) * length


def _cpu_forward(q, k, v, scale, is_causal):
    b, s_q, s_k = q.shape[0], q.shape[2], k.shape[2]
    out, lse = _cpu_varlen_forward(*_flat(q, k, v), _cu(b, s_q), _cu(b, s_k), None, s_q, s_k, scale, is_causal)
    return _unflat(out, b), lse.unflatten(1, (b, s_q)).transpose(0, 1).contiguous()


def _cpu_backward(grad_out, grad_lse, q, k, v, out, lse, scale, is_causal):
    b, s_q, s_k = q.shape[0], q.shape[2], k.shape[2]

    def flat_lse(t):  # [B, H, S] -> [H, B * S]
        return None if t is None else t.transpose(0, 1).flatten(1)

    grads = _cpu_varlen_backward(*_flat(grad_out), flat_lse(grad_lse), *_flat(q, k, v, out), flat_lse(lse), _cu(b, s_q),
                                 _cu(b, s_k), None, s_q, s_k, scale, is_causal)
    return tuple(_unflat(g, b) for g in grads)


for _name, _cuda, _cpu in (
    ("fa4_varlen_attention", _cuda_varlen_forward, _cpu_varlen_forward),
    ("fa4_varlen_attention_backward", _cuda_varlen_backward, _cpu_varlen_backward),
    ("fa4_sdpa", _cuda_forward, _cpu_forward),
    ("fa4_sdpa_backward", _cuda_backward, _cpu_backward),
):
    _lib.impl(_name, _cuda, "CUDA")
    _lib.impl(_name, _cpu, "CPU")


# ---- autograd: out and lse saved; the lse's gradient reaches the backward ----------------------

def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, is_causal, *window = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, seqused_k)
    ctx.args = (max_q, max_k, scale, is_causal, *window)
    ctx.count = len(inputs)


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k, seqused_k = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = torch.ops.cp_inductor.fa4_varlen_attention_backward(
        grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, seqused_k, *ctx.args)
    return (dq, dk, dv) + (None,) * (ctx.count - 3)


def _dense_setup(ctx, inputs, output):
    q, k, v, scale, is_causal = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (scale, is_causal)


def _dense_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = torch.ops.cp_inductor.fa4_sdpa_backward(grad_out, grad_lse, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None


torch.library.register_autograd("cp_inductor::fa4_varlen_attention", _varlen_backward, setup_context=_varlen_setup, lib=_lib)
torch.library.register_autograd("cp_inductor::fa4_sdpa", _dense_backward, setup_context=_dense_setup, lib=_lib)
