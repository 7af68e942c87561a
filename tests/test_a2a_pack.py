"""cp_inductor::a2a_pack: the op's contract (opcheck), its layout, and its Triton kernel on the
Triton CPU interpreter."""

import pytest
import torch

from cp_inductor.lowerings.a2a_pack import a2a_pack
from cp_inductor.lowerings.a2a_pack_layout import reference


def inputs(b=2, s_l=4, heads=(4, 2, 2), d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s_l, h, d, generator=g).to(dtype) for h in heads]


def by_index(tensors, cp):
    """buf[r, s, b, offset_i + j, :] = x_i[b, s, r * H_i/cp + j, :], element by element."""
    b, s_l, _, d = tensors[0].shape
    total = sum(x.shape[2] for x in tensors) // cp
    buf = torch.empty(cp, s_l, b, total, d, dtype=tensors[0].dtype)
    for r in range(cp):
        offset = 0
        for x in tensors:
            h = x.shape[2] // cp
            for j in range(h):
                buf[r, :, :, offset + j] = x[:, :, r * h + j].transpose(0, 1)
            offset += h
    return buf


@pytest.mark.parametrize("cp", [2, 4])
def test_reference_layout(cp):
    xs = inputs(heads=(8, 4, 4))
    assert torch.equal(reference(xs, cp), by_index(xs, cp))


def test_opcheck():
    xs = inputs()
    torch.library.opcheck(torch.ops.cp_inductor.a2a_pack.default, (xs, 2))
    assert torch.equal(a2a_pack(xs, 2), by_index(xs, 2))


@pytest.mark.parametrize("block", [32, 2048])
def test_triton_kernel_on_the_interpreter(triton_interpret, block):
    kernels = triton_interpret("cp_inductor.lowerings.a2a_pack_triton")
    # GQA heads at cp=3: runs of 32 (q) and 16 (k, v) elements; with BLOCK=32 the k/v chunks are masked.
    xs = inputs(heads=(6, 3, 3), dtype=torch.bfloat16)
    assert torch.equal(kernels.pack(xs, 3, block=block), by_index(xs, 3))  # copies are exact in bf16
