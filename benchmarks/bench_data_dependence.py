"""One GPU: how much cuDNN attention's time depends on the values it reads (same shapes, same
kernels). Zeros toggle fewer bits: less power, higher clocks. Why a benchmark must never time
attention on buffers nothing wrote (the fake process group's collective outputs, say).

    python benchmarks/bench_data_dependence.py --seq 32768 --heads 16 --json out.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import device_ms, write_rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    a = p.parse_args(argv)
    mk = lambda: torch.randn(1, a.heads, a.seq, a.head_dim, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(), mk(), mk(), mk()
    zero, nan = torch.zeros_like(q), torch.full_like(q, float("nan"))
    cases = {
        "random": (q, k, v, do), "zero k, v": (q, zero, zero, do), "zero q, k, v": (zero, zero, zero, do),
        "zero everything": (zero, zero, zero, zero), "nan k": (q, nan, v, do), "zero dO": (q, k, v, zero),
    }

    def step(q, k, v, do):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    rows = [{"round": r, "inputs": name, "ms": device_ms(step(*xs), a.iters)} for r in range(a.rounds) for name, xs in cases.items()]
    print(f"causal SDPA fwd+bwd, B1 H{a.heads} S{a.seq} D{a.head_dim} bf16, median of {a.iters} (ms)")
    for row in rows:
        print(f"round {row['round']}  {row['inputs']:16s} {row['ms']:8.2f}")
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
