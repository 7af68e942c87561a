"""cp_inductor's ragged attention op against the cuDNN frontend's own ragged ops, one GPU.

    python benchmarks/bench_ragged_op.py --json out.json

Per pack (Hq32 Hkv8, bf16, causal; lengths random, equal, or one long document among 64 short):
forward and backward of ``cp_inductor::varlen_attention`` (the backward reading the log-sum-exp
through ragged offsets, and re-padded per sequence: ``cudnn_ragged.PADDED_STATS_FROM_HEAD_DIM``
picks one by head_dim), and of ``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd`` on the same bucketed
bounds. Medians of CUDA-event times, ms; the largest relative difference of each gradient.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from bench_thd import HKV, HQ, lengths_for
from common import write_rows

CASES = [(32768, 128, "random"), (32768, 128, "equal"), (65536, 128, "random"), (32768, 128, "one_long"),
         (32768, 256, "random"), (32768, 256, "equal"), (32768, 64, "random")]


def time_ms(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(tokens: int, head_dim: int, kind: str, iters: int) -> dict:
    from cudnn.sdpa.packed_lse import prepare_padded_lse

    from cp_inductor.lowerings import cudnn_ragged, varlen_attention

    lengths = lengths_for(kind, tokens, seed=tokens + head_dim)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest, bound = max(lengths), varlen_attention.bucket(max(lengths), 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, HQ, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(tokens, HKV, head_dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    scale = head_dim ** -0.5
    ours = torch.ops.cp_inductor

    def forward():
        return ours.varlen_attention(q, k, v, cu, cu, longest, longest, scale, True)

    def frontend_forward():
        return torch.ops.cudnn.sdpa_fwd(q, k, v, scale, is_causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                        max_seqlen_q=bound, max_seqlen_kv=bound, return_lse=True)

    out, lse = forward()
    ref_out, ref_lse = frontend_forward()

    def frontend_backward():
        padded = prepare_padded_lse(ref_lse.view(tokens, HQ), cu, bound)
        return torch.ops.cudnn.sdpa_bwd(dout, q, k, v, ref_out, padded, scale, is_causal=True, cu_seqlens_q=cu,
                                        cu_seqlens_kv=cu, max_seqlen_q=bound, max_seqlen_kv=bound)

    row = {"tokens": tokens, "head_dim": head_dim, "lengths": kind, "documents": len(lengths),
           "forward_ms": time_ms(forward, iters), "frontend_forward_ms": time_ms(frontend_forward, iters),
           "forward_max_diff": float((out.float() - ref_out.float()).abs().max())}
    chosen = cudnn_ragged.PADDED_STATS_FROM_HEAD_DIM
    grads = {}
    try:
        for layout, threshold in (("ragged", 10**9), ("padded", 0)):
            cudnn_ragged.PADDED_STATS_FROM_HEAD_DIM = threshold

            def backward():
                return ours.varlen_attention_backward(dout, q, k, v, out, lse, cu, cu, longest, longest, scale, True)

            grads[layout] = backward()
            row[f"backward_{layout}_ms"] = time_ms(backward, iters)
    finally:
        cudnn_ragged.PADDED_STATS_FROM_HEAD_DIM = chosen
    row["backward_chosen"] = "padded" if head_dim >= chosen else "ragged"
    ref = frontend_backward()
    row["frontend_backward_ms"] = time_ms(frontend_backward, iters)
    row["grad_rel_diff_vs_frontend"] = [float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                        for a, b in zip(grads[row["backward_chosen"]], ref)]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import cudnn.sdpa.fwd.torch_op  # noqa: F401 - registers the frontend's ops, the peer here

    import cp_inductor  # noqa: F401 - registers our ops

    rows = [measure(*case, a.iters) for case in CASES]
    print("| T | D | lengths | fwd ours | fwd frontend | bwd ragged | bwd padded | bwd frontend | chosen |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens'] // 1024}K | {r['head_dim']} | {r['lengths']} | {r['forward_ms']:.2f} | "
              f"{r['frontend_forward_ms']:.2f} | {r['backward_ragged_ms']:.2f} | {r['backward_padded_ms']:.2f} | "
              f"{r['frontend_backward_ms']:.2f} | {r['backward_chosen']} |")
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
