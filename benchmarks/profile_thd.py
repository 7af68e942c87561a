"""Where a packed-sequence attention step's time goes, one GPU: the kernels of each arm, the GPU's
idle time inside steps, and the clock the arm ran at.

    python benchmarks/profile_thd.py [--tokens 32768] [--head-dim 128] [--kv-heads 8 32]
                                     [--masks causal full] [--json out.json]

Per pack (8 random documents, bf16) and arm of ``bench_thd.py`` (``cp_on``, ``floor``,
``inductor``):
- ``step``: CUDA-event ms per step over ``--calls`` steps back to back (median of ``--iters``),
  with nvidia-smi's median SM clock and power draw while it ran (``common.gpu_clocks``);
- ``kernels`` and ``span``: from torch.profiler over ``--calls`` steps back to back, per step, the
  kernels' summed time and first-kernel-start to last-kernel-end; ``idle`` = span - kernels, the
  GPU waiting on the host inside the traced steps;
- the kernels by total time.
``step`` against ``kernels`` is not idle time: the trace is short and runs at a higher clock than
a sustained run (the H200 lowers its SM clock to hold 700 W), which the clock column shows.
"""

from __future__ import annotations

import argparse
import sys

from bench_thd import add_pack_options, arms_for, random_pack
from common import device_ms, gpu_clocks, kernel_trace, write_rows


def main() -> int:
    import cudnn.sdpa.fwd.torch_op  # noqa: F401 - the floor's op

    ap = argparse.ArgumentParser()
    add_pack_options(ap, kv_heads=[8, 32])
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    lengths = random_pack(a)
    print(f"T{a.tokens} D{a.head_dim} lengths {lengths}")
    out = []
    for mask in a.masks:
        for kv_heads in a.kv_heads:
            arms = arms_for(lengths, a.head_dim, causal=mask == "causal", kv_heads=kv_heads)
            for name in ("cp_on", "floor", "inductor"):
                clocks: dict = {}
                with gpu_clocks(clocks):
                    step_ms = device_ms(arms[name], a.iters, calls=a.calls)
                kernels_ms, span_ms, rows = kernel_trace(arms[name], a.calls)
                clock = f", {clocks['sm_mhz']:.0f} MHz {clocks['power_w']:.0f} W" if clocks else ""
                print(f"\nT{a.tokens} D{a.head_dim} Hkv{kv_heads} {mask} {name}: step {step_ms:.3f} ms{clock}; "
                      f"traced: kernels {kernels_ms:.3f} span {span_ms:.3f} idle {span_ms - kernels_ms:.3f} ms")
                for ms, n, kernel in rows[:a.top]:
                    print(f"  {ms:8.3f} ms  x{n:<3} {kernel[:100]}")
                out.append({"tokens": a.tokens, "head_dim": a.head_dim, "kv_heads": kv_heads, "mask": mask, "arm": name,
                            "step_ms": step_ms, **clocks, "kernels_ms": kernels_ms, "span_ms": span_ms,
                            "kernels": [{"ms": ms, "launches": n, "name": k} for ms, n, k in rows]})
    write_rows(a.json, a, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
