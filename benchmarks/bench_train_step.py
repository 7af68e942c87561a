"""CP training step time: eager / default Inductor / cp_inductor / cp_inductor + CUDA graphs.

    torchrun --nproc-per-node 2 benchmarks/bench_train_step.py --seq 8192 --dim 1024 --heads 8 \
        --kv-heads 4 --json out.json                  # ~4K tokens per rank: launch overhead shows
    torchrun --nproc-per-node 2 benchmarks/bench_train_step.py --seq 65536 --dim 4096 --heads 32

The step is cp_inductor.testing.train_step (norm, QKV, Ulysses attention, out proj, MLP, loss, in-graph
backward, gradient all-reduce, SGD). Each arm gets fresh weights from one seed; rounds alternate
the arm order; per iteration the slowest rank counts (host clock after a device sync, since a
CUDA-graph replay is one launch); medians and paired ratios vs Inductor; peak memory per rank.
Every arm's losses are checked against the eager arm's.
"""

from __future__ import annotations

import argparse
from collections import Counter
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from common import alternating_rounds, paired_ratio, teardown

import cp_inductor
from torch._dynamo.utils import counters
from cp_inductor.testing.train_step import StepConfig, TransformerBlock, compile_step, make_step, step_inputs

HP = {"cp_inductor.head_overlap": True}
ARMS = {  # name -> (backend, mode, options); backend None = eager
    "eager": (None, None, None),
    "inductor": ("inductor", None, None),
    "cp_inductor": ("cp_inductor", None, None),
    "cp_views": ("cp_inductor", None, {"cp_inductor.fused_a2a_unpack": "views"}),
    "cp_copy": ("cp_inductor", None, {"cp_inductor.fused_a2a_unpack": "copy"}),
    "cp_inductor+cudagraphs": ("cp_inductor", "reduce-overhead", None),
    "cp_hp+cudagraphs": ("cp_inductor", "reduce-overhead", HP),
}


def build(name, cfg, device, dtype):
    torch.manual_seed(0)
    model = TransformerBlock(cfg).to(device=device, dtype=dtype)
    step = make_step(model, cfg)
    backend, mode, options = ARMS[name]
    return step if backend is None else compile_step(step, backend=backend, mode=mode, options=options)


def time_round(step, x, y, warmup, iters, device) -> list[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step(x, y)
    sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step(x, y)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--layout", default="bshd")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def build_steps(arms: list, cfg, x, y, device, dtype) -> tuple[dict, dict, dict, dict]:
    """Compile every arm: (steps, first three losses, peak GiB, rewrites the report applied)."""
    cuda = device.type == "cuda"
    steps, first_losses, memory, rewritten = {}, {}, {}, {}
    for name in arms:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        cp_inductor.clear_report()
        steps[name] = build(name, cfg, device, dtype)
        first_losses[name] = [float(steps[name](x, y)) for _ in range(3)]  # compile + check
        # What the passes did to the step graph (from the report, which a warm FX cache also
        # fills): an arm without rewrites measures nothing of ours.
        rewritten[name] = dict(Counter(a for r in cp_inductor.report().regions for a in r.applied))
        if counters["cp_inductor"]["cudnn_frontend_backward"]:  # calls moved (cold cache only)
            rewritten[name]["cudnn_frontend_backward"] = counters["cp_inductor"]["cudnn_frontend_backward"]
        counters.clear()
        if cuda:
            memory[name] = torch.cuda.max_memory_allocated() / 2**30
    return steps, first_losses, memory, rewritten


def print_table(args, cfg, cp: int, arms: list, medians: dict, first_losses: dict, memory: dict, rewritten: dict):
    base = "inductor" if "inductor" in arms else arms[0]
    ref = first_losses.get("eager", first_losses[arms[0]])
    print(f"\nCP training step, cp={cp}, B{args.batch} S{args.seq} dim{args.dim} H{args.heads} "
          f"Hkv{cfg.kv_heads} {args.dtype}, {args.rounds} rounds x {args.iters} iters, slowest rank")
    print(f"{'arm':24s} {'median ms':>10s} {f'vs {base} (paired)':>22s} {'peak GiB':>9s} {'loss diff':>10s}  rewrites")
    for n in arms:
        med = statistics.median(medians[n])
        paired = paired_ratio(medians, n, base)
        diff = max(abs(a - b) / abs(b) for a, b in zip(first_losses[n], ref))
        print(f"{n:24s} {med:10.3f} {paired:22.3f} {memory.get(n, float('nan')):9.2f} {diff:10.2e}  {rewritten[n]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    cfg = StepConfig(
        layout=args.layout, batch=args.batch, seq=args.seq, dim=args.dim, heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
    )
    x, y = (t.to(dtype) for t in step_inputs(cfg, rank, cp, device=device))

    arms = [a for a in args.arms.split(",") if a in ARMS]
    steps, first_losses, memory, rewritten = build_steps(arms, cfg, x, y, device, dtype)
    medians = alternating_rounds(
        arms, args.rounds, lambda name: time_round(steps[name], x, y, args.warmup, args.iters, device)
    )
    if rank == 0:
        print_table(args, cfg, cp, arms, medians, first_losses, memory, rewritten)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "cp": cp, "round_medians_ms": medians, "peak_gib": memory,
                           "first_losses": first_losses, "rewritten": rewritten}, f, indent=1)
    teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
