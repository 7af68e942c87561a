"""``cp_inductor::cudnn_attention_backward``: cuDNN's attention backward through the cuDNN
frontend's own torch op, whose plan cache keys on every tensor's layout.

    dq, dk, dv = cudnn_attention_backward(dO, q, k, v, O, lse, scale, is_causal)

takes exactly what ``aten._scaled_dot_product_cudnn_attention_backward`` takes from aten's cuDNN
forward (O and its log-sum-exp, no dropout, no bias) and returns the same gradients, laid out
like q, k and v.

Why it exists: aten's cuDNN backward (torch 2.11 through 2.13) caches the cuDNN graph it builds
under a key of q, k and v's sizes and strides only, but bakes dO's strides into that graph. In
one process, a second backward with the same q, k, v and a dO laid out otherwise reuses the
first plan and silently reads dO with the wrong strides (``tests/test_gpu_one.py`` reproduces
it in eager). torch 2.14's aten carries the O, dO and log-sum-exp layouts in the key. The cuDNN
frontend (``pip install "cp_inductor[cudnn]"``, package ``nvidia-cudnn-frontend``) keys its own
cache on every stride and keeps it apart from aten's, so a call through it can neither be hit by
nor leave behind a wrong plan for eager or default-Inductor code in the same process.

The frontend is imported on first use; without it :func:`unavailable` says why and callers keep
aten's op. The op is capturable: the frontend builds its graph on the first (eager, warm-up)
call, allocates from torch's caching allocator, runs on torch's current stream and never syncs.
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten

# First torch release whose aten cuDNN backward keys its plan cache on O's, dO's and the
# log-sum-exp's layouts (read from the release binaries; 2.11.0, 2.12.x and 2.13.0 lack it).
ATEN_KEY_COMPLETE_FROM = (2, 14)
DTYPES = (torch.float16, torch.bfloat16)


def aten_cache_key_complete() -> bool:
    return torch.torch_version.TorchVersion(torch.__version__) >= ATEN_KEY_COMPLETE_FROM


@functools.cache
def unavailable() -> str | None:
    """Why the cuDNN frontend's backward cannot run in this process, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import cudnn.sdpa.fwd.torch_op  # noqa: F401 - registers torch.ops.cudnn.sdpa_bwd
    except Exception as e:  # noqa: BLE001 - any import failure means: keep aten's op
        return f"nvidia-cudnn-frontend is not importable ({type(e).__name__}: {e}); pip install 'cp_inductor[cudnn]'"
    if not hasattr(torch.ops.cudnn, "sdpa_bwd"):
        return "this nvidia-cudnn-frontend has no torch op cudnn::sdpa_bwd (1.32 or newer has it)"
    return None


def _laid_out_like(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``grad`` with the strides ``empty_like(like)`` has, which the fake promises Inductor."""
    want = torch.empty_like(like, device="meta").stride()
    return grad if grad.stride() == want else torch.empty_like(like).copy_(grad)


@torch.library.custom_op("cp_inductor::cudnn_attention_backward", mutates_args=())
def cudnn_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    scale: float,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError("cp_inductor::cudnn_attention_backward runs on CUDA only")


@cudnn_attention_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, scale, is_causal):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@cudnn_attention_backward.register_kernel("cuda")
def _(grad_out, query, key, value, out, logsumexp, scale, is_causal):
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"cp_inductor::cudnn_attention_backward: {reason}")
    dq, dk, dv = torch.ops.cudnn.sdpa_bwd(grad_out, query, key, value, out, logsumexp, scale, is_causal=is_causal)
    return _laid_out_like(dq, query), _laid_out_like(dk, key), _laid_out_like(dv, value)


def default_scale(query) -> float:
    return query.shape[-1] ** -0.5


def runs_eagerly_on_frontend(query: torch.Tensor) -> bool:
    """Whether an eager cuDNN backward of ``query``'s kind goes through this op: aten's cache key
    is incomplete in this torch, the frontend runs, the switch is on, the dtype is one it takes."""
    from .. import config

    return (
        config.cudnn_frontend_backward and not aten_cache_key_complete() and query.dim() == 4
        and query.dtype in DTYPES and query.is_cuda and unavailable() is None
    )
