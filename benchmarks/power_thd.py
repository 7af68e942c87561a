"""A packed-sequence attention step under sustained load, one GPU: how its time moves as the
H200 reaches its power cap, per arm.

    python benchmarks/power_thd.py [--tokens 32768] [--head-dim 128] [--kv-heads 8 ...] [--steps 200]
                                   [--rest 2.0] [--json out.json]

Per arm of ``bench_thd.py`` (``cp_on``, ``inductor``, ``floor``; the order twice), after
``--rest`` seconds idle: ``--steps`` steps back to back, each between two CUDA events, and the
median step of steps 1-5, 6-25, 26-100 and the rest; with the SM clock, power draw and the share of
samples the driver was holding the clock to the power limit (``common.gpu_clocks``, NVML through
the ``nvidia-ml-py`` wheel). Steps 1-5 run at the idle GPU's clock; the later windows are what a
training run sees.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench_thd import add_pack_options, arms_for, random_pack
from common import gpu_clocks, write_rows

WINDOWS = ((0, 5), (5, 25), (25, 100), (100, None))


def sustained(fn, steps: int) -> tuple[list[float], dict]:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    clocks: dict = {}
    with gpu_clocks(clocks, every_s=0.005):
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events], clocks


def main() -> int:
    import cudnn.sdpa.fwd.torch_op  # noqa: F401 - the floor's op

    ap = argparse.ArgumentParser()
    add_pack_options(ap, kv_heads=[8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rest", type=float, default=2.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    lengths = random_pack(a)
    rows = []
    for mask, kv_heads in ((m, h) for m in a.masks for h in a.kv_heads):
        arms = arms_for(lengths, a.head_dim, causal=mask == "causal", kv_heads=kv_heads)
        names = ("cp_on", "inductor", "floor")
        for name in names:  # compile and build before anything is timed
            for _ in range(3):
                arms[name]()
        torch.cuda.synchronize()
        print(f"T{a.tokens} D{a.head_dim} Hkv{kv_heads} {mask}, lengths {lengths}; median ms of steps "
              + ", ".join(f"{lo + 1}-{min(hi or a.steps, a.steps)}" for lo, hi in WINDOWS if lo < a.steps))
        for name in names * 2:
            time.sleep(a.rest)
            ms, clocks = sustained(arms[name], a.steps)
            windows = [statistics.median(ms[lo:hi]) for lo, hi in WINDOWS if lo < len(ms)]
            power = (f"{clocks['sm_mhz']:.0f} MHz, {clocks['power_w']:.0f} W, at the power limit "
                     f"{clocks['power_capped']:.0%} of samples") if clocks else "no NVML"
            print(f"  {name:9s} " + " ".join(f"{w:8.3f}" for w in windows) + f" | {power}", flush=True)
            rows.append({"tokens": a.tokens, "head_dim": a.head_dim, "kv_heads": kv_heads, "mask": mask, "arm": name,
                         "windows_ms": windows, **clocks})
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
