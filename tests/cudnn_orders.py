"""Eager, default Inductor and cp_inductor in one process, in a chosen order, on one GPU: the
gradients each arm gets, against an fp32 math-backend reference (the shape of check a user makes).

aten's cuDNN attention backward (torch < 2.14) caches its plan by q/k/v layout only, so what a
call returns can depend on what ran before it in the process. Each order runs at a sequence
length of its own: a new q/k/v signature, a cache state of its own, in one process.

    run_order(case, ("eager", "inductor", "cp_inductor"), seq) -> {arm: relative error}, {arm: routes}
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, HKV, D = 1, 8, 2, 128
ARMS = {
    "eager": None,
    "inductor": ("inductor", {}),
    "cp_inductor": ("cp_inductor", {"cp_inductor.fused_a2a_unpack": "views"}),
    # cuDNN's backward left on aten's op: it must get the dO the program made.
    "cp_inductor_aten": ("cp_inductor", {"cp_inductor.fused_a2a_unpack": "views", "cp_inductor.cudnn_frontend_backward": False}),
}


def _hf_epilogue(o, w):
    b, h, s, d = o.shape
    return (o.transpose(1, 2).contiguous().reshape(b, s, h * d) @ w).float().pow(2).sum()


def _bhsd(q, k, v, w, c):
    """The Hugging Face epilogue on q, k, v given as [B, H, S, D]."""
    return _hf_epilogue(F.scaled_dot_product_attention(q, k, v, is_causal=True), w)


def _bshd(q, k, v, w, c):
    """q, k, v given as [B, S, H, D] (transposed for SDPA), the same epilogue."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return _hf_epilogue(o, w)


def _gqa(q, k, v, w, c):
    return _hf_epilogue(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), w)


def _keeps_o_layout(q, k, v, w, c):
    """A consumer that reads O as it is: dO is laid out like O."""
    return (F.scaled_dot_product_attention(q, k, v, is_causal=True).float() * c).sum()


def _reads_o_as_bshd(q, k, v, w, c):
    """A consumer that reads O as [B, S, H, D]: dO's strides differ from O's."""
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (o.permute(0, 2, 1, 3).float() * c).sum()


def _ulysses_views(q, k, v, w, c):
    """The Ulysses helper (BSHD, cp=2 on the mirrored group): fused_a2a's views of the received
    buffer change q, k, v's and O's layouts."""
    from cp_inductor.parallel import ulysses_attention

    o = ulysses_attention(q, k, v, is_causal=True)
    b, s, h, d = o.shape
    return (o.reshape(b, s, h * d) @ w).float().pow(2).sum()


# name -> (fn, q/k/v/c layout, K/V heads, cp (mirrored world) or None)
CASES = {
    "hf_epilogue": (_bhsd, "bhsd", H, None),
    "bshd_inputs": (_bshd, "bshd", H, None),
    "gqa": (_gqa, "bhsd", HKV, None),
    "keeps_o_layout": (_keeps_o_layout, "bhsd", H, None),
    "reads_o_as_bshd": (_reads_o_as_bshd, "bhsd", H, None),
    "fused_a2a_views": (_ulysses_views, "bshd", H, 2),
}


def _inputs(case: str, seq: int):
    _, layout, hkv, _ = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seq)
    shape = (lambda h: (B, seq, h, D)) if layout == "bshd" else (lambda h: (B, h, seq, D))  # noqa: E731
    q, k, v = (torch.randn(shape(h), generator=g, device="cuda", dtype=torch.bfloat16) for h in (H, hkv, hkv))
    w = torch.randn(H * D, 256, generator=g, device="cuda", dtype=torch.bfloat16) / (H * D) ** 0.5
    c_shape = (B, seq, H, D) if case == "reads_o_as_bshd" else (B, H, seq, D)
    c = torch.randn(c_shape, generator=g, device="cuda")
    return q, k, v, w, c


def _grads(fn, tensors, arm: str | None, dtype=None):
    ins = [t.to(dtype) if dtype is not None else t for t in tensors[:4]]
    ins = [t.detach().clone().requires_grad_() for t in ins]
    if arm is not None and ARMS[arm] is not None:
        backend, options = ARMS[arm]
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options or None)
    loss = fn(*ins, tensors[4])
    return torch.autograd.grad(loss, ins, allow_unused=True)  # w: some cases do not read it


def _error(got, want) -> float:
    pairs = [(a, b) for a, b in zip(got, want) if b is not None]
    return max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in pairs)


def run_order(case: str, order: tuple, seq: int) -> tuple[dict, dict]:
    """Run ``order``'s arms one after another at ``seq`` tokens: each arm's relative error (q, k,
    v and w gradients) against the fp32 math reference, and the paths cp_inductor's report gives
    its cuDNN attention backward calls (and, under ``<arm>:applied``, the rewrites it applied)."""
    import cp_inductor

    fn, _, _, cp = CASES[case]
    world = contextlib.nullcontext()
    if cp is not None:
        from cp_inductor.testing.mirror_group import mirrored_world

        world = mirrored_world(cp)
    with world:
        tensors = _inputs(case, seq)
        with sdpa_kernel(SDPBackend.MATH):
            want = _grads(fn, tensors, None, dtype=torch.float32)
        errors, routes = {}, {}
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for arm in order:
                cp_inductor.clear_report()
                errors[arm] = _error(_grads(fn, tensors, arm), want)
                report = cp_inductor.report()
                routes[arm] = sorted({r.path for r in report.backward_routes})
                routes[arm + ":applied"] = sorted({a for r in report.regions for a in r.applied})
        torch._dynamo.reset()
    return errors, routes
