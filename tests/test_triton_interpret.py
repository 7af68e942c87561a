"""The Triton-interpreter fixture runs @triton.jit kernels on the CPU."""

import torch


def test_fixture_runs_a_kernel_on_cpu(triton_interpret):
    kernels = triton_interpret("tests_triton_copy")
    x = torch.randn(1000).to(torch.bfloat16)
    y = torch.empty_like(x)
    kernels.copy(x, y)
    assert torch.equal(x, y)  # copies are exact in bf16 under the interpreter
