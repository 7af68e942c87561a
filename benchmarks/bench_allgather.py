"""K/V all-gather CP attention, forward + backward, on GPUs: eager / Inductor / cp_inductor (each
rewrite OFF and ON, head groups G) / PyTorch native context_parallel / the one-GPU floor.

    torchrun --nproc-per-node 2 benchmarks/bench_allgather.py --batch 1 --seq 32768 --heads 32 \
        --kv-heads 8 --head-dim 128 --json out.json

The user code is ``cp_inductor.parallel.allgather_attention`` (causal: load-balanced shards, rank r
holds chunks r and 2cp-1-r) or, for the ``hand_*`` arms, a hand-written DiT-style non-causal block
(benchmarks/handwritten.py). Method, checks and peak memory as in bench_ulysses.py (the same
Bench, arms alternate per round, slowest rank per iteration, medians of paired ratios). The floor
is one GPU running one rank's share of the FLOPs in one call: Hq/cp query heads (Hkv/cp K/V heads)
over the whole sequence, with SDPA's own kernel choice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

from bench_ulysses import Bench, build_arms, parse_args, print_table, profile_arms, time_arms
from common import teardown
from handwritten import allgather_by_hand

from cp_inductor import parallel

OFF = {f"cp_inductor.{n}": False for n in ("zero_init", "first_grad_reuse", "head_partition")}
ARMS = {  # name -> (backend, options); "cp_off" is cp_inductor with every all-gather rewrite off
    "eager": (None,),
    "inductor": ("inductor",),
    "cp_off": ("cp_inductor", OFF),
    "cp_inductor": ("cp_inductor",),
}
HAND_ARMS = {f"hand_{n}": ARMS[n] for n in ("eager", "inductor", "cp_off", "cp_inductor")}
# The helper's log-sum-exp kernel for the causal chunks, eager and under default Inductor.
KERNEL_ARMS = {f"{arm}_{k}": (ARMS[arm], k) for arm in ("eager", "inductor") for k in ("flash", "cudnn")}
# Inductor's own compute/communication reordering (sinks waits, raises collectives).
ARMS["inductor_reorder"] = ("inductor", {"reorder_for_compute_comm_overlap": True})


class AllGatherBench(Bench):
    title = "K/V all-gather"

    def _local(self, layout):
        sd = 1 if layout == "bshd" else 2
        conv = (lambda t: t) if layout == "bshd" else (lambda t: t.transpose(1, 2))
        lb = self.args.causal
        return {
            n: parallel.shard_sequence(conv(t), sd, self.rank, self.cp, load_balanced=lb) for n, t in self.full.items()
        }, sd

    kernel = "auto"  # the helper's log-sum-exp kernel (--kernel)

    def allgather_arm(self, backend, options=None, code="helper", kernel=None):
        a, kernel = self.args, kernel or self.kernel
        layout = a.layout if code == "helper" else "bshd"
        local, sd = self._local(layout)
        q, k, v = (local[n].clone().requires_grad_() for n in "qkv")
        if code == "helper":
            fn = lambda q, k, v: parallel.allgather_attention(  # noqa: E731
                q, k, v, layout=layout, is_causal=a.causal, kernel=kernel
            )
        else:
            fn = allgather_by_hand
        if backend is not None:
            fn = torch.compile(fn, backend=backend, fullgraph=True, options=options)
        state = {}

        def step():
            q.grad = k.grad = v.grad = None
            out = fn(q, k, v)
            out.backward(local["dout"])
            state["out"] = out

        def results():
            conv = (lambda t: t) if layout == "bshd" else (lambda t: t.transpose(1, 2))
            got = {"out": state["out"].detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            return {n: conv(parallel.gather_sequence(t, sd, load_balanced=a.causal)) for n, t in got.items()}

        return step, results

    def arm(self, name: str):
        if name in ("native", "floor"):
            return super().arm(name)
        if name in KERNEL_ARMS:
            arm, kernel = KERNEL_ARMS[name]
            return self.allgather_arm(*arm, kernel=kernel)
        if name in HAND_ARMS:
            if self.args.causal:
                raise ValueError("the hand-written all-gather block is not causal: run with --no-causal")
            return self.allgather_arm(*HAND_ARMS[name], code="hand")
        return self.allgather_arm(*ARMS[name])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kernel", default="auto")
    extra, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    if args.arms == parse_args([]).arms:  # bench_ulysses' default arms: ours instead
        args.arms = "eager,inductor,cp_off,cp_inductor,native,floor"
    if args.profile == parse_args([]).profile:
        args.profile = "inductor,cp_inductor"
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    bench = AllGatherBench(args)
    bench.kernel = extra.kernel
    ref = bench.reference() if bench.rank == 0 and args.reference else None
    torch.cuda.empty_cache()

    arms, checks, compile_s, memory = build_arms(bench, args.arms.split(","), ref)
    del ref
    kernels = profile_arms(bench, arms, args.profile, args.trace)
    medians = time_arms(bench, arms, args.rounds)

    if bench.rank == 0:
        vs_default = print_table(bench, medians, checks, memory, kernels)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({
                    "args": vars(args), "kernel": extra.kernel, "cp": bench.cp, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(), "round_medians_ms": medians,
                    "median_ms": {n: statistics.median(v) for n, v in medians.items()},
                    "vs_best_default_paired": vs_default, "peak_gib": memory, "kernel_ms_rank0": kernels,
                    "max_rel_err": checks, "compile_s": compile_s,
                    "method": "one process per shape, arms alternate order per round, slowest rank per iteration",
                }, f, indent=1)
    teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
