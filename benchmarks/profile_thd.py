"""Where a packed-sequence attention step's time goes, one GPU: the kernels of each arm.

    python benchmarks/profile_thd.py [--tokens 32768] [--head-dim 128] [--kv-heads 8 32]

Per pack (8 random documents, bf16, causal unless ``--masks full``) and arm of
``bench_thd.py`` (``cp_on``, ``floor``, ``inductor``): the step's CUDA-event time, the sum of its
kernels' times (the difference is the GPU waiting on the host: an isolated step's launch
latency), and its kernels by total time, from torch.profiler over 3 steps.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench_thd import arms_for, lengths_for
from common import device_ms, fill_free_memory

STEPS = 3


def kernel_table(fn) -> tuple[float, list]:
    """Per step: the kernels' total ms, and (ms, launches, name) per kernel name, largest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn()
            torch.cuda.synchronize()
    table: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = table.setdefault(e.name, [0.0, 0])
            row[0] += e.device_time / 1000 / STEPS
            row[1] += 1
    rows = sorted(((ms, n // STEPS, name) for name, (ms, n) in table.items()), reverse=True)
    return sum(r[0] for r in rows), rows


def main() -> int:
    import cudnn.sdpa.fwd.torch_op  # noqa: F401 - the floor's op

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--masks", nargs="+", default=["causal"], choices=["causal", "full"])
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    print(f"filled {fill_free_memory(0.4):.0f} GiB with random values")
    lengths = lengths_for("random", a.tokens, seed=a.tokens + a.head_dim)
    for mask in a.masks:
        for kv_heads in a.kv_heads:
            arms = arms_for(lengths, a.head_dim, causal=mask == "causal", kv_heads=kv_heads)
            for name in ("cp_on", "floor", "inductor"):
                event_ms = device_ms(arms[name], 5)
                kernels_ms, rows = kernel_table(arms[name])
                print(f"\nT{a.tokens} D{a.head_dim} Hkv{kv_heads} {mask} {name}: step {event_ms:.3f} ms, kernels "
                      f"{kernels_ms:.3f} ms")
                for ms, n, kernel in rows[:a.top]:
                    print(f"  {ms:8.3f} ms  x{n:<3} {kernel[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
