"""What running a pack on a bigger cuDNN ragged graph costs, one GPU: the cover rule's price.

    python benchmarks/bench_ragged_bounds.py --json out.json

Per pack (Hq32 Hkv8, bf16, causal; 8 random documents at T32K / T64K and D128 / D256, one long
document among 64 short at T32K), forward and backward of ``cudnn_ragged`` on the pack's own
bucket and on graphs with longer bounds (x1.25, x1.5, x2, the token total) and twice the
sequence count (empty sequences appended): what ``varlen_attention``'s cover rule pays when a
pack runs on a graph built for another. Every graph is built first; then medians over rounds
(each variant once per round, the order reversed every other round) of CUDA-event times, ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_thd import HKV, HQ, lengths_for
from common import device_ms, fill_free_memory, write_rows

from cp_inductor.testing import varlen_programs as vp

CASES = [("random", 32768, 128), ("random", 65536, 128), ("one_long", 32768, 128), ("random", 32768, 256)]


def variants(docs: int, exact: int, tokens: int, bucket) -> list:
    return [("exact", docs, exact), ("bound x1.25", docs, bucket(int(exact * 1.25), 64)),
            ("bound x1.5", docs, bucket(int(exact * 1.5), 64)), ("bound x2", docs, 2 * exact),
            ("bound T", docs, tokens), ("count x2", 2 * docs, exact), ("count x2, bound x2", 2 * docs, 2 * exact)]


def main() -> int:
    from cp_inductor.lowerings import cudnn_ragged
    from cp_inductor.lowerings.varlen_attention import bucket

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(f"filled {fill_free_memory(0.5):.0f} GiB with random values")
    rows = []
    print(f"{'lengths':>8} {'T':>6} {'D':>4} {'graph':>20} {'count':>5} {'bound':>6} | fwd ms  bwd ms  total  vs exact")
    for kind, tokens, head_dim in CASES:
        lengths = lengths_for(kind, tokens, seed=0)
        q, k, v, cu, longest = vp.pack(lengths, HQ, HKV, head_dim, dtype=torch.bfloat16, device="cuda", seed=1)
        grad = torch.randn_like(q)
        calls = {}
        for name, count, bound in variants(len(lengths), bucket(longest, 64), tokens, bucket):
            cu_run = torch.cat([cu, cu[-1:].expand(count - len(lengths))]) if count > len(lengths) else cu
            args = (cu_run, cu_run, count, bound, bound)

            def forward(args=args):
                return cudnn_ragged.forward(q, k, v, *args, head_dim ** -0.5, True, False)

            out, lse = forward()  # builds the graphs before any timing

            def backward(args=args, out=out, lse=lse):
                return cudnn_ragged.backward(grad, q, k, v, out, lse, *args, tokens, tokens, head_dim ** -0.5, True, False)

            backward()
            calls[name] = (count, bound, forward, backward)
        # every variant timed once per round, the order reversed every other round: no variant
        # is always the first timed (clocks, caches)
        times = {name: ([], []) for name in calls}
        for r in range(a.rounds):
            for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                _, _, forward, backward = calls[name]
                times[name][0].append(device_ms(forward, a.iters))
                times[name][1].append(device_ms(backward, a.iters))
        exact_total = None
        for name, (count, bound, _, _) in calls.items():
            fwd, bwd = (statistics.median(t) for t in times[name])
            exact_total = exact_total or fwd + bwd
            row = {"lengths": kind, "tokens": tokens, "head_dim": head_dim, "graph": name, "docs": len(lengths),
                   "count": count, "bound": bound, "longest": longest, "fwd_ms": fwd, "bwd_ms": bwd,
                   "total_ms": fwd + bwd, "vs_exact": (fwd + bwd) / exact_total}
            rows.append(row)
            print(f"{kind:>8} {tokens:>6} {head_dim:>4} {name:>20} {count:>5} {bound:>6} | {fwd:6.2f} {bwd:7.2f} "
                  f"{fwd + bwd:6.2f} {row['vs_exact']:8.3f}", flush=True)
        write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
