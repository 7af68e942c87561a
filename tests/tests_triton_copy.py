"""A minimal kernel to prove the interpreter fixture works (kernels of the package come later)."""

import triton
import triton.language as tl


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy(src, dst, block: int = 256):
    _copy_kernel[(triton.cdiv(src.numel(), block),)](src, dst, src.numel(), BLOCK=block)
