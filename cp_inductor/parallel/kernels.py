"""The fused attention kernels that return the log-sum-exp a merge needs, by name, as
``(forward, backward)``; all take fewer K/V heads than query heads (GQA). ``"auto"`` picks per
device. Used by the all-gather and ring helpers."""

from __future__ import annotations

import torch

from ..lowerings import cudnn_backward

aten = torch.ops.aten


# The fused kernels that return the log-sum-exp the merge needs, by name: (forward, backward).
# All take fewer K/V heads than query heads (GQA). "auto" picks per device (_auto_kernel).
def _cpu_forward(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, extra, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _flash_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(dout, q, k, v, out, lse, extra, causal, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
    )


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, extra, causal, scale):
    # Run eagerly, the call goes where cuDNN's plan cache keys on dO's layout (aten's, before
    # torch 2.14, keys on q/k/v only). Traced, it stays aten's op, which the detectors know; the
    # compiled graph's cudnn_frontend_backward pass moves it the same way.
    if not torch.compiler.is_compiling() and cudnn_backward.runs_eagerly_on_frontend(q):
        return torch.ops.cp_inductor.cudnn_attention_backward(dout, q, k, v, out, lse, scale, causal)
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale
    )


KERNELS = {
    "cpu": (_cpu_forward, _cpu_backward),
    "flash": (_flash_forward, _flash_backward),
    "cudnn": (_cudnn_forward, _cudnn_backward),
}


@torch.compiler.assume_constant_result  # a fact of the machine: traced code takes it as a constant
def _cuda_kernel(index: int) -> str:
    index = torch.cuda.current_device() if index < 0 else index
    # cuDNN where SDPA may use it (fwd+bwd 1.6x faster than flash on H200, B1 S32K Hq32 Hkv8
    # D128 causal: run log h200x2_allgather_kernels_run16.json (git history)), else flash.
    cudnn = torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available()
    return "cudnn" if cudnn and torch.cuda.get_device_capability(index) >= (9, 0) else "flash"


def _auto_kernel(device: torch.device) -> str | None:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return _cuda_kernel(-1 if device.index is None else device.index)
    return None


def _kernel(device: torch.device, kernel: str) -> str:
    name = _auto_kernel(device) if kernel == "auto" else kernel
    if name not in KERNELS:
        raise ValueError(f"no log-sum-exp attention kernel {kernel!r} for device {device.type!r}")
    return name
