"""One GPU, no CP: code without context parallelism compiled with backend="cp_inductor" must give
default Inductor's answer. Here: activation checkpointing, whose recomputed attention (and
dropout) AOTAutograd wraps in graphsafe_run_with_rng_state on CUDA, which canonicalize unwraps
for the detectors and wraps again for Inductor (skipped without a GPU)."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import cp_inductor

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _block(x, w, dropout_p):
    b, s, _ = x.shape
    q, k, v = (x @ w).view(b, s, 3, 4, -1).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    return F.dropout(o.transpose(1, 2).reshape(b, s, -1), p=dropout_p)


def _model(x, w, dropout_p):
    h = torch.utils.checkpoint.checkpoint(_block, x, w, dropout_p, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(_block, h, w, dropout_p, use_reentrant=False)


def _run(backend, dropout_p):
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(256, 768, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    fn = torch.compile(_model, backend=backend, fullgraph=True)
    torch.manual_seed(1)
    out = fn(x, w, dropout_p)
    out.float().pow(2).sum().backward()
    return [out, x.grad, w.grad]


@needs_gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_checkpointed_attention_same_as_inductor(dropout_p):
    cp_inductor.clear_report()
    ours = _run("cp_inductor", dropout_p)
    assert not cp_inductor.report().regions  # no CP here
    theirs = _run("inductor", dropout_p)
    # Same generator, same random draws (dropout included): the same numbers.
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
