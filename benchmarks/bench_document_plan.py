"""What a document plan costs around FA4's varlen kernels, one GPU: host time of each launch with
the GPU idle (what a host read of the plan exposes), and the kernels' time when ``cu_seqlens``
is padded to a capacity of documents (empty trailing documents) or ``max_seqlen`` is the token
count instead of the longest document (what a plan without a host read would pass).

    python benchmarks/bench_document_plan.py --tokens 32768 --docs 8 --capacity 64 256 1024 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench_flex_documents import pack
from common import add_attention_args, device_ms


def host_ms(fn, iters: int = 20) -> float:
    """Median host ms of one call of ``fn`` started with the GPU idle."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--capacity", type=int, nargs="+", default=[64, 256, 1024, 4096])
    add_attention_args(p)
    args = p.parse_args(argv)
    from cp_inductor.lowerings import document_attention

    ops = torch.ops.cp_inductor
    doc, cu, longest = pack(args.tokens, args.docs)
    t, scale = args.tokens, args.head_dim ** -0.5
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, args.head_dim, generator=g).cuda().bfloat16()
               for h in (args.heads, args.kv_heads, args.kv_heads))
    out, lse = ops.fa4_varlen_attention(q, k, v, cu, cu, None, longest, longest, scale, True)
    grad = torch.randn_like(out)

    def forward(cu_seqlens=cu, most=longest):
        return ops.fa4_varlen_attention(q, k, v, cu_seqlens, cu_seqlens, None, most, most, scale, True)

    def backward(cu_seqlens=cu, most=longest):
        return ops.fa4_varlen_attention_backward(grad, None, q, k, v, out, lse, cu_seqlens, cu_seqlens, None, most, most,
                                                 scale, True)

    def plan(check=False):
        found, meta = ops.document_plan(doc, None, check, 1, t)
        document_attention._settle(meta)  # as the first op that reads it does
        return int(meta[0])

    host = {"fa4 forward": host_ms(forward), "fa4 backward": host_ms(backward), "plan + host read": host_ms(plan),
            "plan (checked) + host read": host_ms(lambda: plan(True))}
    print(f"T{t} docs {args.docs} Hq{args.heads} Hkv{args.kv_heads} D{args.head_dim}: host ms per call, GPU idle")
    for name, ms in host.items():
        print(f"  {name:28s} {ms:7.3f}")

    def step(cu_seqlens, most):
        def run():
            forward(cu_seqlens, most)
            backward(cu_seqlens, most)
        return device_ms(run, args.iters, calls=3)

    rows = [{"capacity": args.docs, "max_seqlen": longest, "ms": step(cu, longest)},
            {"capacity": args.docs, "max_seqlen": t, "ms": step(cu, t)}]
    for capacity in args.capacity:
        padded = torch.cat([cu, cu.new_full((capacity - args.docs,), t)])
        rows.append({"capacity": capacity, "max_seqlen": t, "ms": step(padded, t)})
    print("| documents passed | max_seqlen | fwd+bwd kernels ms | vs exact |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['capacity']} | {r['max_seqlen']} | {r['ms']:.3f} | {r['ms'] / rows[0]['ms']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "host_ms": host, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
