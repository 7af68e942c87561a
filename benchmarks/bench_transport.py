"""Copy-engine all-to-all (lowerings/ce_transport.py) against NCCL's: alone, and under attention.

    torchrun --nproc-per-node 2 benchmarks/bench_transport.py --json out.json

Table 1: one equal-split all-to-all of N MiB per rank (median ms, GB/s of what leaves each rank),
and one ring rotation of the same tensor (all of it to the next rank): NCCL's one-hot
``all_to_all_single`` and ``ce_rotate_start``.
Table 2: cuDNN attention fwd+bwd (B1, S, H heads, D, causal, bf16) alone, the transfers alone,
and both issued together (transfers queued first, waited after attention): with NCCL (on its own
stream) and with the copy engines. Perfect overlap is max(attention, transfers).
Times are the slowest rank's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import teardown

from cp_inductor.lowerings import ce_transport

ops = torch.ops.cp_inductor


def slowest_median(fn, iters: int) -> float:
    """GPU time of ``fn``: the host queues it while a sleep kernel holds the stream, so host
    overhead (Python around the copies, launches) is not counted, as in a training step whose
    host runs ahead or a CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000_000)  # ~50 ms on H200: longer than the host needs to queue fn
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor(statistics.median(times), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", default="16,64,256")
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--transfers", type=int, default=4, help="all-to-alls under attention")
    parser.add_argument("--transfer-mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="rank 0's GPU ops of attention+ce")
    parser.add_argument("--json")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    group = dist.group.WORLD.group_name
    world = dist.get_world_size()
    reason = ce_transport.why_unavailable(group, "cuda")
    if rank == 0:
        print("transport:", reason or "copy engines available")
    results = {"args": vars(args), "world": world, "torch": torch.__version__, "alone": {}, "under_attention": {}}

    def nccl_a2a(x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return out

    def ce_a2a(x, slot=0):
        return ops.ce_all_to_all_wait(ops.ce_all_to_all_start(x, slot, group), x, slot, group)

    dst, src = (rank + 1) % world, (rank - 1) % world  # a ring rotation

    def nccl_rotate(x):
        out = torch.empty_like(x)
        one_hot = lambda r: [x.shape[0] if i == r else 0 for i in range(world)]  # noqa: E731
        dist.all_to_all_single(out, x, one_hot(src), one_hot(dst))
        return out

    def ce_rotate(x, slot=0):
        return ops.ce_all_to_all_wait(ops.ce_rotate_start(x, dst, src, slot, group), x, slot, group)

    rows = []
    for mib in map(int, args.sizes_mib.split(",")):
        x = torch.randn(mib << 19, device="cuda", dtype=torch.bfloat16)  # mib MiB of bf16
        leaving = (mib << 20) * (world - 1) / world / 1e9
        nccl_ms = slowest_median(lambda: nccl_a2a(x), args.iters)
        ce_ms = slowest_median(lambda: ce_a2a(x), args.iters)
        nccl_rot = slowest_median(lambda: nccl_rotate(x), args.iters)
        ce_rot = slowest_median(lambda: ce_rotate(x), args.iters)
        results["alone"][mib] = {"nccl_ms": nccl_ms, "ce_ms": ce_ms, "nccl_rotate_ms": nccl_rot, "ce_rotate_ms": ce_rot}
        rows.append(f"{mib:>8} {nccl_ms:9.3f} {leaving / nccl_ms * 1e3:8.0f} {ce_ms:9.3f} {leaving / ce_ms * 1e3:8.0f}"
                    f" {nccl_rot:9.3f} {ce_rot:9.3f}")
    if rank == 0:
        print(f"\nalone, {world} ranks (all-to-all: GB/s leaving a rank; rotation: all of it to the next rank)")
        print(f"{'MiB/rank':>8} {'nccl ms':>9} {'GB/s':>8} {'ce ms':>9} {'GB/s':>8} {'nccl rot':>9} {'ce rot':>9}")
        print("\n".join(rows))

    shape = (1, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    d_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    payload = [torch.randn(args.transfer_mib << 19, device="cuda", dtype=torch.bfloat16) for _ in range(args.transfers)]
    nccl_stream = torch.cuda.Stream()

    def attention():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), d_out)

    def nccl_transfers():
        return [nccl_a2a(x) for x in payload]

    def ce_transfers():
        return [ce_a2a(x, i) for i, x in enumerate(payload)]

    def nccl_under():
        nccl_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(nccl_stream):
            outs = nccl_transfers()
        attention()
        torch.cuda.current_stream().wait_stream(nccl_stream)
        return outs

    def ce_under():
        tokens = [ops.ce_all_to_all_start(x, i, group) for i, x in enumerate(payload)]
        attention()
        return [ops.ce_all_to_all_wait(t, x, i, group) for i, (t, x) in enumerate(zip(tokens, payload))]

    arms = {"attention": attention, "nccl_alone": nccl_transfers, "ce_alone": ce_transfers,
            "attention+nccl": nccl_under, "attention+ce": ce_under}
    for name, fn in arms.items():
        results["under_attention"][name] = slowest_median(fn, args.iters)
    if args.profile:
        for name in ("attention+ce", "attention+nccl"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.cuda._sleep(100_000_000)
                arms[name]()
                torch.cuda.synchronize()
            if rank == 0:
                print(f"\n{name}: GPU ops of rank 0 (start, end in ms from the first)")
                events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                                key=lambda e: e.time_range.start)
                events = [e for e in events if "sleep" not in e.name]
                t0 = events[0].time_range.start
                for e in events:
                    print(f"  {e.name[:48]:48} {(e.time_range.start - t0) / 1e3:8.3f} {(e.time_range.end - t0) / 1e3:8.3f}")
    if rank == 0:
        r = results["under_attention"]
        print(f"\nattention fwd+bwd B1 S{args.seq} H{args.heads} D{args.head_dim} causal bf16, "
              f"{args.transfers} x {args.transfer_mib} MiB all-to-alls")
        for name, ms in r.items():
            print(f"{name:>16} {ms:9.3f} ms")
        for kind in ("nccl", "ce"):
            ideal = max(r["attention"], r[f"{kind}_alone"])
            print(f"{kind:>4}: exposed beyond max(attention, transfers) {r[f'attention+{kind}'] - ideal:7.3f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    ce_transport.release()
    teardown()


if __name__ == "__main__":
    main()
