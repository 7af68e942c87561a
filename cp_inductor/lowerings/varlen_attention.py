"""``cp_inductor::varlen_attention``: attention over a packed batch (THD) on cuDNN's ragged SDPA.

    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, is_causal)

q is ``[T_q, H_q, D]``, k and v are ``[T_k, H_k, D]`` with ``H_q % H_k == 0`` (GQA as is, no
repeated K/V); sequence ``i`` is rows ``cu[i]:cu[i + 1]``; ``max_*`` bound the longest sequence.
``lse`` is the log-sum-exp per token and head, ``[T_q, H_q]`` fp32: what the backward needs
together with ``out`` (saved by the autograd formula registered here).

Causal masking follows flash-attention's varlen convention: a query row sees the keys up to its
own position counted from the END of its sequence (bottom-right), which is plain top-left causal
when the query and key lengths agree.

CUDA runs cuDNN's ragged attention through graphs of our own built with the cuDNN frontend's
graph API (``cudnn_ragged``, ``pip install "cp_inductor[cudnn]"``), one per shape bucket, with
the work on device (no host read of the lengths) and capturable in CUDA graphs. The frontend is
imported on first use. CPU runs a per-sequence SDPA reference, used by the tests
(``reference_kernels``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import cudnn_ragged

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_cpu_reference = False


@contextlib.contextmanager
def reference_kernels():
    """Let the rewrite put varlen attention on CPU tensors onto this op's CPU reference (tests:
    the graph and its numerics without a GPU). Outside it, CPU varlen attention is left alone."""
    global _cpu_reference
    before, _cpu_reference = _cpu_reference, True
    try:
        yield
    finally:
        _cpu_reference = before


def reference_enabled() -> bool:
    """Whether CPU attention may go to the reference kernels (inside ``reference_kernels()``)."""
    return _cpu_reference


@functools.cache
def _cuda_unavailable() -> str | None:
    from .cudnn_backward import unavailable as graph_api_unavailable  # CUDA, the frontend, its graph API

    reason = graph_api_unavailable()
    if reason is not None:
        return reason
    import cudnn

    if cudnn.backend_version() < 90500:
        return f"cuDNN {cudnn.backend_version()} is older than 9.5 (ragged attention)"
    return None


def unavailable(device: torch.device) -> str | None:
    """Why this op cannot run on ``device`` in this process, or None."""
    if device.type == "cuda":
        return _cuda_unavailable()
    if device.type == "cpu" and _cpu_reference:
        return None
    return f"{device.type}: only CUDA runs cuDNN's ragged attention"


def cudnn_shape_unavailable(device: torch.device, dtype: torch.dtype, head_dim) -> str | None:
    """Why this op cannot take attention at this dtype and head dim, or None."""
    if not isinstance(head_dim, int) or head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} (cuDNN takes multiples of 8 up to {MAX_HEAD_DIM})"
    if device.type == "cuda" and dtype not in DTYPES:
        return f"dtype {dtype} (cuDNN takes float16 and bfloat16)"
    return None


def cudnn_unavailable(device: torch.device, dtype: torch.dtype, head_dim) -> str | None:
    """Why this op cannot take attention at this dtype and head dim on ``device``, or None."""
    return cudnn_shape_unavailable(device, dtype, head_dim) or unavailable(device)


_lib = torch.library.Library("cp_inductor", "FRAGMENT")
_lib.define(
    "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "SymInt max_q, SymInt max_k, float scale, bool is_causal) -> (Tensor, Tensor)"
)
_lib.define(
    "varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_q, SymInt max_k, float scale, bool is_causal) "
    "-> (Tensor, Tensor, Tensor)"
)


@torch.library.register_fake("cp_inductor::varlen_attention", lib=_lib)
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal):
    return q.new_empty(q.shape[:2] + v.shape[2:]), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("cp_inductor::varlen_attention_backward", lib=_lib)
def _(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, is_causal):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)


def bucket(n: int, smallest: int = 1) -> int:
    """``n`` rounded up to 4-7 times a power of two (at least ``smallest``): at most 1/4 more,
    four buckets per doubling."""
    n = max(int(n), smallest)
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


# Bucketed (sequence count, bound q, bound k) shapes whose graphs are built, per call signature.
# A pack whose own bucket has no graph runs on the smallest built one that covers it within
# twice the count and twice the bounds: a few empty thread blocks, at most 4% of the kernels'
# time measured (H200, D256 with count and bounds x2; within 1% at T64K; benchmarks/
# bench_ragged_bounds.py). Its own graph is built only once it has run ``_BUILD_AFTER`` times
# so: a build (0.1-0.2 s, and the frontend holds the GIL meanwhile, so it stalls the step even
# on another thread) costs what 4% of a 14 ms step does over about
# 300 steps. Lengths that change every step then stop costing builds as soon as the packs seen
# are covered, and a bucket that keeps coming gets its own graph. Where nothing built covers the
# pack, or under deterministic algorithms (which graph runs must not depend on history), its own
# is built at once.
_built: dict[tuple, set] = {}
_covered_runs: dict[tuple, int] = {}
_COVER = 2
_BUILD_AFTER = 256


def _shape_for(signature: tuple, shape: tuple) -> tuple:
    """The (sequence count, bound q, bound k) to run ``shape`` (bucketed) as."""
    built = _built.setdefault(signature, set())
    if shape in built:
        return shape
    covering = [s for s in built if all(x <= y <= _COVER * x for x, y in zip(shape, s))]
    if covering and not torch.are_deterministic_algorithms_enabled():
        runs = _covered_runs[signature, shape] = _covered_runs.get((signature, shape), 0) + 1
        if runs < _BUILD_AFTER:
            return min(covering, key=lambda s: s[0] * s[1] * s[2])
    built.add(shape)
    return shape


def _bucketed(signature, cu_q, cu_k, max_q, max_k):
    """The frontend builds one cuDNN graph per (sequence count, longest sequence): both rounded
    up to 4 buckets per doubling (or to a built graph that covers them, ``_shape_for``), so packs
    whose lengths change every step soon reuse the graphs built. Extra sequences are empty
    (cu_seqlens repeats its total, on device: no sync); a longer bound adds thread blocks that
    find nothing to do. Measured on one H200 (T32K, one long document and 64 short): powers of
    two cost 13% (20.27 against 17.86 ms exact), 8 buckets per doubling 3% but a graph build
    (0.1-0.2 s) in most steps of lengths that change every step."""
    sequences = cu_q.shape[0] - 1
    count, max_q, max_k = _shape_for(signature, (bucket(sequences), bucket(max_q, 64), bucket(max_k, 64)))
    pad = count - sequences
    if pad:
        cu_q = torch.cat([cu_q, cu_q[-1:].expand(pad)])
        cu_k = None if cu_k is None else torch.cat([cu_k, cu_k[-1:].expand(pad)])
    return cu_q, cu_q if cu_k is None else cu_k, max_q, max_k


def _signature(direction: str, q, k, v, is_causal, bottom_right) -> tuple:
    return (direction, q.device, q.dtype, tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:]), is_causal, bottom_right)


def _cuda_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal):
    bottom_right = is_causal and cu_q is not cu_k
    signature = _signature("forward", q, k, v, is_causal, bottom_right)
    cu_q, cu_k, max_q, max_k = _bucketed(signature, cu_q, cu_k if cu_k is not cu_q else None, max_q, max_k)
    return cudnn_ragged.forward(q, k, v, cu_q, cu_k, cu_q.shape[0] - 1, max_q, max_k, scale, is_causal, bottom_right)


def _token_bound(tokens: int) -> int:
    # The backward's graph is sized by the token totals (they size cuDNN's fp32 dq accumulator,
    # an upper bound): rounded to 64 only, since packs usually keep their total from step to step
    # and a coarser bucket would cost accumulator memory.
    return -(-int(tokens) // 64) * 64


def _cuda_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, is_causal):
    bottom_right = is_causal and cu_q is not cu_k
    totals = _token_bound(q.shape[0]), _token_bound(k.shape[0])
    signature = _signature("backward", q, k, v, is_causal, bottom_right) + totals
    cu_q, cu_k, max_q, max_k = _bucketed(signature, cu_q, cu_k if cu_k is not cu_q else None, max_q, max_k)
    return cudnn_ragged.backward(grad_out, q, k, v, out, lse, cu_q, cu_k, cu_q.shape[0] - 1, max_q, max_k, *totals, scale,
                                 is_causal, bottom_right)


def kept_keys(s_q: int, s_k: int, is_causal: bool, window_left: int = -1, device=None) -> torch.Tensor | None:
    """[S_q, S_k] bool: the keys each query of one sequence reads, or None (all). Causal is
    bottom-right: row i sees keys up to i + (S_k - S_q); a window (``window_left >= 0``, with
    causal) also from i + (S_k - S_q) - window_left, as FA's ``window_size=(left, 0)``."""
    if not is_causal:
        if window_left >= 0:
            raise ValueError("a window is taken with causal only (FA's window_size=(left, 0))")
        return None
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(s_k - s_q)
    if window_left >= 0:
        keep = keep & ~torch.ones(s_q, s_k, dtype=torch.bool, device=device).tril(s_k - s_q - window_left - 1)
    return keep


def _sequence_probs(q, k, scale, is_causal, window_left=-1):
    """One sequence ([S, H, D], K heads repeated): the attention probabilities [H, S_q, S_k] and
    the log-sum-exp [H, S_q] (the keys ``kept_keys`` says)."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    keep = kept_keys(q.shape[0], k.shape[0], is_causal, window_left, q.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0), lse  # a row with no keys: all zero


def _sequences(cu_q, cu_k):
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        yield slice(bounds_q[i], bounds_q[i + 1]), slice(bounds_k[i], bounds_k[i + 1])


def _repeat(t, groups):
    return t.repeat_interleave(groups, dim=1)


def reference(q, k, v, cu_q, cu_k, scale, is_causal, window_left=-1):
    """Per-sequence attention in the inputs' dtype: out [T_q, H_q, D_v], lse [T_q, H_q] fp32."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for sq, sk in _sequences(cu_q, cu_k):
        probs, lse = _sequence_probs(q[sq], _repeat(k[sk], groups), scale, is_causal, window_left)
        outs.append(torch.einsum("hqk,khd->qhd", probs, _repeat(v[sk], groups)))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs).to(q.dtype), torch.cat(lses).float()


def reference_backward(grad_out, q, k, v, cu_q, cu_k, scale, is_causal):
    """The reference's gradients, written out (a kernel runs below autograd): dq, dk, dv."""
    groups = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, sk in _sequences(cu_q, cu_k):
        ks, vs = _repeat(k[sk], groups), _repeat(v[sk], groups)
        probs, _ = _sequence_probs(q[sq], ks, scale, is_causal)
        d_out = grad_out[sq]
        d_probs = torch.einsum("qhd,khd->hqk", d_out, vs)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * scale
        dq[sq] = torch.einsum("hqk,khd->qhd", d_scores, ks).to(q.dtype)
        # K/V heads were repeated in groups: their gradients sum over each group
        dk[sk] = torch.einsum("hqk,qhd->khd", d_scores, q[sq]).unflatten(1, (-1, groups)).sum(2).to(k.dtype)
        dv[sk] = torch.einsum("hqk,qhd->khd", probs, d_out).unflatten(1, (-1, groups)).sum(2).to(v.dtype)
    return dq, dk, dv


def _cpu_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal):
    return reference(q, k, v, cu_q, cu_k, scale, is_causal)


def _cpu_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, is_causal):
    return reference_backward(grad_out, q, k, v, cu_q, cu_k, scale, is_causal)


_lib.impl("varlen_attention", _cuda_forward, "CUDA")
_lib.impl("varlen_attention_backward", _cuda_backward, "CUDA")
_lib.impl("varlen_attention", _cpu_forward, "CPU")
_lib.impl("varlen_attention_backward", _cpu_backward, "CPU")


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, is_causal)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.cp_inductor.varlen_attention_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("cp_inductor::varlen_attention", _backward, setup_context=_setup_context, lib=_lib)


# A per-call promise that a pack's sequences are of one length (``uniform_thd``'s marker):
# ``cu = cp_inductor.equal_lengths(cu)`` before the attention call. It checks on device, with
# no host sync, that cu is 0, S, 2S, ..., and returns a copy of it.
_lib.define("equal_lengths(Tensor cu_seqlens) -> Tensor")


def _equal_lengths(cu):
    length = cu[1:2] - cu[0:1]
    expected = torch.arange(cu.shape[0], dtype=cu.dtype, device=cu.device) * length
    torch._assert_async(torch.all(cu == expected), "equal_lengths: the sequences of this pack are not of one length")
    return cu.clone()


_lib.impl("equal_lengths", _equal_lengths, "CompositeExplicitAutograd")
torch.library.register_fake("cp_inductor::equal_lengths", lambda cu: torch.empty_like(cu), lib=_lib)


def equal_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens``, promised (and checked on device) to describe sequences of one length: a
    varlen attention call reading it goes to dense SDPA under ``uniform_thd="proven"`` too."""
    return torch.ops.cp_inductor.equal_lengths(cu_seqlens)
