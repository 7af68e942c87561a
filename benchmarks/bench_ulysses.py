"""Ulysses CP attention, forward + backward, on GPUs: eager / Inductor / cp_inductor / PyTorch
native context_parallel (ring) / the one-GPU compute floor.

    torchrun --nproc-per-node 2 benchmarks/bench_ulysses.py --batch 1 --seq 32768 --heads 32 \
        --head-dim 128 --layout bshd --json out.json

Method (docs/architecture.md, "Measuring"): every arm is compiled and warmed up, then the arms run in rounds,
the order alternating between rounds; each round times ``--iters`` iterations after
``--warmup`` more, with CUDA events; per iteration the slowest rank counts; the median over the
round is reported, and ratios are medians of per-round ratios (paired). Arms share one process
per shape (not a fresh process per arm: compile time on the lent machine is the limit), which
the JSON records. Every arm's output and q/k/v gradients are checked against a one-GPU fp32
reference. Peak memory is torch.cuda.max_memory_allocated per rank above what was allocated before
the arm was built (inputs of earlier arms stay alive), max over ranks, during its second step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import (alternating_rounds, fill_free_memory, init_group, paired_ratio, peak_composition, slowest_rank_ms,
                    teardown)
from handwritten import ulysses_by_hand

from cp_inductor import parallel


def _merge(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _uncovered(spans, cover) -> float:
    """Length of the union of ``spans`` not inside the union of ``cover``."""
    total = 0.0
    cover = _merge(cover)
    for a, b in _merge(spans):
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in cover)
        total += (b - a) - covered
    return total


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


class Bench:
    title = "Ulysses"

    def __init__(self, args):
        self.args = args
        self.rank, self.cp = dist.get_rank(), dist.get_world_size()
        # who prints the table and writes the JSON: rank 0, or the one process of --fake-rank
        self.lead = self.rank == 0 or args.fake_rank is not None
        self.dev = torch.device("cuda", torch.cuda.current_device())
        b, s, hq, hkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
        g = torch.Generator(device=self.dev).manual_seed(0)
        mk = lambda h: torch.randn(b, s, h, d, device=self.dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
        self.full = {"q": mk(hq), "k": mk(hkv), "v": mk(hkv), "dout": mk(hq)}  # BSHD, whole sequence

    # --- arms: each returns (step, results) where step() runs fwd+bwd once ---
    load_balanced = False  # shards are chunks r and 2cp-1-r (the all-gather bench, causal)

    def _local(self, layout):
        sd = 1 if layout == "bshd" else 2
        conv = (lambda t: t) if layout == "bshd" else (lambda t: t.transpose(1, 2))
        return {
            n: parallel.shard_sequence(conv(t), sd, self.rank, self.cp, load_balanced=self.load_balanced)
            for n, t in self.full.items()
        }, sd

    def cp_arm(self, fn, layout, backend, options=None):
        """CP attention ``fn(q, k, v)`` on this rank's shards in ``layout``, compiled with
        ``backend`` (None: eager); results() gathers output and gradients back to BSHD."""
        local, sd = self._local(layout)
        q, k, v = (local[n].clone().requires_grad_() for n in "qkv")
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
            return {n: conv(parallel.gather_sequence(t, sd, load_balanced=self.load_balanced)) for n, t in got.items()}

        return step, results

    def ulysses_arm(self, backend, options=None, code="helper"):
        a = self.args
        if code == "helper":
            fn = lambda q, k, v: parallel.ulysses_attention(q, k, v, layout=a.layout, is_causal=a.causal)  # noqa: E731
            return self.cp_arm(fn, a.layout, backend, options)
        # the user's own Ulysses (BSHD), not our helper
        return self.cp_arm(lambda q, k, v: ulysses_by_hand(q, k, v, is_causal=a.causal), "bshd", backend, options)

    def native_arm(self, backend=None, options=None):
        """PyTorch's native context_parallel (ring; ``--native-rotate``), eager or its SDPA call
        compiled with ``backend`` (and ``options``)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

        a = self.args
        set_rotate_method(a.native_rotate)
        if not hasattr(self, "mesh"):
            self.mesh = init_device_mesh("cuda", (self.cp,))
        mesh = self.mesh
        bufs = [self.full[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "dout")]  # BHSD
        ctx = context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs))
        ctx.__enter__()  # left open for the arm's lifetime: SDPA calls are dispatched to the ring
        q, k, v = (t.detach().clone().requires_grad_() for t in bufs[:3])
        dout = bufs[3]
        state = {}
        attn = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=a.causal, enable_gqa=a.heads != a.kv_heads
        )
        if backend is not None:
            attn = torch.compile(attn, backend=backend, fullgraph=True, options=options)

        def step():
            q.grad = k.grad = v.grad = None
            out = attn(q, k, v)
            out.backward(dout)
            state["out"] = out

        def results():
            got = [state["out"].detach(), q.grad, k.grad, v.grad]
            full = context_parallel_unshard(mesh, got, [2] * 4)
            return {n: t.transpose(1, 2) for n, t in zip(("out", "dq", "dk", "dv"), full)}

        step.close = lambda: ctx.__exit__(None, None, None)
        return step, results

    def floor_arm(self):
        """This rank's share of attention on one GPU: Hq/cp heads over the whole sequence, on the
        fastest kernel there is (FA4 where the [fa4] extra runs, else aten's SDPA: cuDNN on H200)."""
        a = self.args
        hq, hkv = a.heads // self.cp, a.kv_heads // self.cp
        q, k, v, dout = (
            self.full[n][:, :, :h].transpose(1, 2).contiguous() for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("dout", hq))
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        from cp_inductor.lowerings import fa4_attention

        def attention(q, k, v):
            if fa4_attention.unavailable(q.device, q.dtype, q.shape[-1]) is None:
                return torch.ops.cp_inductor.fa4_sdpa(q, k, v, q.shape[-1] ** -0.5, a.causal)[0]
            return F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, enable_gqa=hq != hkv)

        def step():
            q.grad = k.grad = v.grad = None
            attention(q, k, v).backward(dout)

        return step, None

    def arm(self, name: str):
        """(step, results) of the arm called ``name`` (ARMS, HAND_ARMS, NATIVE_ARMS, floor)."""
        if name in NATIVE_ARMS:
            return self.native_arm(*NATIVE_ARMS[name])
        if name == "floor":
            return self.floor_arm()
        if name in HAND_ARMS:
            return self.ulysses_arm(*HAND_ARMS[name], code="hand")
        return self.ulysses_arm(*ARMS[name])

    # --- measurement ---
    def time_round(self, step) -> list[float]:
        return slowest_rank_ms(step, self.args.iters, self.args.warmup, self.args.back_to_back)

    def host_ms(self, step, iters: int = 5) -> float:
        """Host time to queue one step while the GPU is busy (a sleep kernel): what the host
        needs per step in a loop that runs ahead of the GPU."""
        import time

        step()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the host never waits for the GPU
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        return statistics.median(times)

    def breakdown(self, step, iters: int = 5, trace: str | None = None) -> dict:
        """Kernel time per iteration on this rank by kind, from the profiler timeline (ms), and
        the NCCL time no other kernel overlaps ("exposed")."""
        from torch.profiler import ProfilerActivity, profile

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
        if trace:
            prof.export_chrome_trace(trace)
        # "copy": copy-engine transfers (memcpy activities, no SM): neither compute nor NCCL.
        kinds = {"nccl": 0.0, "attention": 0.0, "other": 0.0, "copy": 0.0}
        spans = {"nccl": [], "compute": []}
        copies: dict = {}  # "other" kernels by name: ms per iteration (pack/unpack bandwidth)
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            name = e.name.lower()
            if "memcpy" in name:
                kinds["copy"] += (e.time_range.end - e.time_range.start) / 1000 / iters
                continue
            kind = "nccl" if "nccl" in name else (
                "attention" if any(w in name for w in ("attn", "attention", "cudnn", "flash", "fmha", "sm90")) else "other"
            )
            ms = (e.time_range.end - e.time_range.start) / 1000 / iters
            kinds[kind] += ms
            if kind == "other":
                copies[e.name] = copies.get(e.name, 0.0) + ms
            spans["nccl" if kind == "nccl" else "compute"].append((e.time_range.start, e.time_range.end))
        kinds["exposed_nccl"] = _uncovered(spans["nccl"], spans["compute"]) / 1000 / iters
        kinds["other_kernels"] = copies
        return kinds

    def reference(self) -> dict:
        """One-GPU fp32 SDPA on the whole sequence (memory-efficient kernel: no S x S buffer)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        a = self.args
        q, k, v = (self.full[n].transpose(1, 2).float().requires_grad_() for n in "qkv")
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            kv = lambda t: t.repeat_interleave(a.heads // a.kv_heads, dim=1)  # noqa: E731
            out = F.scaled_dot_product_attention(q, kv(k), kv(v), is_causal=a.causal)
            out.backward(self.full["dout"].transpose(1, 2).float())
        return {n: t.transpose(1, 2) for n, t in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


# Ulysses arms: name -> (backend, options). "cp_off" is cp_inductor with every rewrite off.
ARMS = {
    "eager": (None,),
    "inductor": ("inductor",),
    "cp_off": ("cp_inductor", {"cp_inductor.fused_a2a": False}),
    "cp_copy": ("cp_inductor", {"cp_inductor.fused_a2a_unpack": "copy"}),  # fused, one unpack copy
    "cp_views": ("cp_inductor", {"cp_inductor.fused_a2a_unpack": "views"}),  # fused, attention reads views
    "cp_inductor": ("cp_inductor",),
    # the attention provider: the program's kernel (cp_inductor before FA4) / FA4 forced
    "cp_program": ("cp_inductor", {"cp_inductor.attention_provider": "program"}),
    "cp_fa4": ("cp_inductor", {"cp_inductor.attention_provider": "fa4"}),
    # head_overlap with G head groups (0: the rewrite's choice); backward regions only, the default
    **{
        f"cp_hp{g or ''}": ("cp_inductor", {"cp_inductor.head_overlap": True, "cp_inductor.head_overlap_groups": g})
        for g in (0, 2, 4, 8)
    },
    # ... and forward regions too
    **{
        f"cp_hpf{g}": ("cp_inductor", {
            "cp_inductor.head_overlap": True, "cp_inductor.head_overlap_groups": g, "cp_inductor.head_overlap_forward": True,
        })
        for g in (2, 4)
    },
    # head_overlap on fused_a2a's views (what it needs: the cost model may copy instead), per
    # transport: hp{G}_nccl / hp{G}_ce backward regions only, hpf{G}_* forward regions too.
    **{
        f"hp{'f' if fwd else ''}{g}_{short}": ("cp_inductor", {
            "cp_inductor.head_overlap": True, "cp_inductor.head_overlap_groups": g, "cp_inductor.head_overlap_forward": fwd,
            "cp_inductor.fused_a2a_unpack": "views", "cp_inductor.head_overlap_transport": transport,
        })
        for g in (2, 4) for fwd in (False, True) for short, transport in (("nccl", "nccl"), ("ce", "copy_engine"))
    },
}


# PyTorch's native context_parallel: eager, its SDPA call under default Inductor, under cp_inductor.
# native_cp is cp_inductor's defaults (ce_rotation where the rotations are large enough);
# native_cp_nccl: ce_rotation off; native_cp_ce: ce_rotation forced at any size.
NATIVE_ARMS = {
    "native": (None,), "native_inductor": ("inductor",), "native_cp": ("cp_inductor",),
    "native_cp_nccl": ("cp_inductor", {"cp_inductor.ce_rotation": False}),
    "native_cp_ce": ("cp_inductor", {"cp_inductor.ce_rotation": True, "cp_inductor.ce_rotation_min_bytes": 0}),
    # the defaults with the last dK/dV rotation left in fp32 (narrow_rotation off)
    "native_cp_wide": ("cp_inductor", {"cp_inductor.narrow_rotation": False}),
    "native_cp_nccl_wide": ("cp_inductor", {"cp_inductor.ce_rotation": False, "cp_inductor.narrow_rotation": False}),
    # cp = 2: the step-1 contribution sent home once, the step-0 backward under it
    "native_cp_rgr": ("cp_inductor", {"cp_inductor.ring_grad_return": True}),
    # ring_grad_return with NCCL rotations (on --fake-rank: what it changes in one rank's compute)
    "native_cp_nccl_rgr": ("cp_inductor", {"cp_inductor.ce_rotation": False, "cp_inductor.ring_grad_return": True}),
    # the defaults with cat_of_slices (the dK/dV buffer rotated home without its cat copy)
    "native_cp_cat": ("cp_inductor", {"cp_inductor.cat_of_slices": True}),
    # cat_of_slices off (runs 54/55, when it was on by default)
    "native_cp_nocat": ("cp_inductor", {"cp_inductor.cat_of_slices": False}),
    # the defaults with each backward step's attention call split in 4 head groups (memory)
    "native_cp_hp4": ("cp_inductor", {"cp_inductor.head_overlap": True, "cp_inductor.head_overlap_groups": 4}),
}


def best_default(medians: dict, arm: str) -> float | None:
    """Median over rounds of ``arm`` / min(cp_off, inductor) of the same code in the same round:
    the goal is <= 1.005 for every cp_inductor arm."""
    prefix = "hand_" if arm.startswith("hand_") else ""
    base = [medians[prefix + b] for b in ("cp_off", "inductor") if prefix + b in medians]
    if not base or not arm.startswith(prefix + "cp_"):
        return None
    return statistics.median(a / min(r) for a, *r in zip(medians[arm], *base))


# The same arms on hand-written user code (benchmarks/handwritten.py) instead of our helper.
HAND_ARMS = {f"hand_{n}": ARMS[n] for n in ("eager", "inductor", "cp_off", "cp_copy", "cp_views", "cp_inductor")}


def parse_args(argv=None, **defaults) -> argparse.Namespace:
    """The command line; ``defaults`` override argument defaults (another bench's arms, say)."""
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layout", default="bshd", choices=parallel.LAYOUTS)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--arms", default="inductor,cp_off,cp_inductor,hand_inductor,hand_cp_off,hand_cp_inductor,floor")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--back-to-back", action="store_true",
                   help="time --iters steps queued back to back (no barrier per step), as a training loop")
    p.add_argument("--host", action="store_true", help="also measure each arm's host time to queue one step")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the one-GPU fp32 reference check (shapes whose full problem does not fit one GPU)")
    p.add_argument("--trace", default=None, help="directory for chrome traces of the profiled arms")
    p.add_argument("--profile", default="cp_off,cp_inductor,cp_hp", help="arms to break down by kernel kind")
    p.add_argument("--native-rotate", default="allgather", choices=("allgather", "alltoall"),
                   help="native context_parallel's K/V rotation (set_rotate_method)")
    p.add_argument("--fake-rank", default=None, metavar="R/CP",
                   help="one GPU, no torchrun: play rank R of CP on PyTorch's fake group (compute only, no checks)")
    p.add_argument("--memory", default="", help="arms whose peak is broken down by allocation site (rank 0)")
    p.set_defaults(**defaults)
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.fake_rank is not None:
        args.reference = False  # the fake group's collectives return garbage
    return args


def build_arms(bench: Bench, names: list, ref: dict | None) -> tuple[dict, dict, dict, dict]:
    """Compile every arm once: (steps, errors vs the reference (rank 0), compile seconds, peak
    GiB of its second step above what was allocated before the arm was built, max over ranks).
    An arm that fails to build is reported and left out (one bad arm must not lose the run)."""
    arms, checks, compile_s, memory = {}, {}, {}, {}
    for name in names:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        # Earlier arms keep their tensors alive: count this arm's peak above what was allocated.
        before = torch.cuda.memory_allocated()
        try:
            step, results = bench.arm(name)
            step()  # compiles
        except Exception as e:  # noqa: BLE001 - reported, the other arms still run
            if bench.lead:
                print(f"arm {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            dist.barrier()
            continue
        torch.cuda.synchronize()
        compile_s[name] = time.perf_counter() - t0
        if results is not None and bench.args.reference:
            got = results()
            if bench.lead:
                checks[name] = {n: _rel(got[n], ref[n]) for n in ref}
            del got
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()  # the peak of a step after the first (compile-time buffers gone)
        torch.cuda.synchronize()
        mem = torch.tensor([(torch.cuda.max_memory_allocated() - before) / 2**30], device=bench.dev)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        memory[name] = float(mem)
        if hasattr(step, "close"):
            step.close()
        arms[name] = step
    return arms, checks, compile_s, memory


def profile_arms(bench: Bench, arms: dict, names: str, trace_dir: str | None) -> dict:
    kernels = {}
    for name in names.split(",") if names else ():
        if name not in arms:
            continue
        trace = None
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            trace = os.path.join(trace_dir, f"{name}_rank{bench.rank}.json")
        # context_parallel's dispatcher is on only inside its context: enter it for the profile.
        step = bench.native_arm(*NATIVE_ARMS[name])[0] if name in NATIVE_ARMS else arms[name]
        kernels[name] = bench.breakdown(step, trace=trace)
        if name in NATIVE_ARMS:
            step.close()
    return kernels


def time_arms(bench: Bench, arms: dict, rounds: int) -> dict:
    def time_arm(name):
        if name not in NATIVE_ARMS:
            return bench.time_round(arms[name])
        # context_parallel's dispatcher is on only inside its context: re-enter per round.
        step, _ = bench.native_arm(*NATIVE_ARMS[name])
        times = bench.time_round(step)
        step.close()
        return times

    return alternating_rounds(list(arms), rounds, time_arm)


def print_table(bench: Bench, medians: dict, checks: dict, memory: dict, kernels: dict) -> dict:
    """The table (rank 0); returns each cp arm's median paired ratio to the best default."""
    args = bench.args
    med = {n: statistics.median(v) for n, v in medians.items()}
    floor = med.get("floor")
    base = next((b for b in ("cp_off", "inductor", "hand_cp_off", "hand_inductor") if b in med), next(iter(med)))
    print(f"\n{bench.title} fwd+bwd, cp={bench.cp}, B{args.batch} S{args.seq} Hq{args.heads} Hkv{args.kv_heads} "
          f"D{args.head_dim} {args.layout} {'causal' if args.causal else 'full'} bf16, "
          f"{args.rounds} rounds x {args.iters} iters, slowest rank")
    print(f"{'arm':16s} {'median ms':>10s} {'vs floor':>9s} {f'vs {base} (paired)':>22s} {'vs best default':>16s} "
          f"{'peak GiB':>9s} {'max rel err':>12s}")
    vs_default = {}
    for n in med:
        paired = paired_ratio(medians, n, base)
        best = best_default(medians, n)
        if best is not None:
            vs_default[n] = best
        vs_floor = f"{med[n] / floor:.3f}x" if floor else "-"
        err = f"{max(checks[n].values()):.2e}" if n in checks else "-"
        best = f"{best:.3f}" if best is not None else "-"
        print(f"{n:16s} {med[n]:10.2f} {vs_floor:>9s} {paired:22.3f} {best:>16s} {memory[n]:9.2f} {err:>12s}")
    if kernels:
        print(f"kernel time per iteration, rank {bench.rank} (ms): arm, attention, nccl, exposed nccl, other kernels, "
              "iteration - (attention + exposed nccl + other)")
        for n, k in kernels.items():
            gap = med[n] - k["attention"] - k["exposed_nccl"] - k["other"]
            top = sorted(k["other_kernels"].items(), key=lambda kv: -kv[1])[:4]
            top = ", ".join(f"{name[:32]} {ms:.3f}" for name, ms in top)
            print(f"  {n:12s} {k['attention']:8.2f} {k['nccl']:8.2f} {k['exposed_nccl']:8.2f} {k['other']:8.2f} {gap:8.2f}"
                  f"   copy engines {k.get('copy', 0.0):.2f}; largest other: {top}")
    return vs_default


def run(bench: Bench, extra_json: dict | None = None) -> None:
    """Build, profile and time the arms of ``bench``; rank 0 prints the table and writes the JSON."""
    args = bench.args
    ref = bench.reference() if bench.rank == 0 and args.reference else None
    torch.cuda.empty_cache()
    if args.fake_rank is not None:  # what the fake collectives return must not be zeros
        print(f"fake rank {args.fake_rank}: {fill_free_memory():.0f} GiB of free memory filled with random values")

    arms, checks, compile_s, memory = build_arms(bench, args.arms.split(","), ref)
    del ref
    kernels = profile_arms(bench, arms, args.profile, args.trace)
    composition = {n: peak_composition(arms[n]) for n in args.memory.split(",") if n in arms}
    medians = time_arms(bench, arms, args.rounds)
    host = {n: bench.host_ms(step) for n, step in arms.items()} if args.host else {}

    if bench.lead:
        vs_default = print_table(bench, medians, checks, memory, kernels)
        if host:
            print("host ms to queue one step (rank 0): " + ", ".join(f"{n} {ms:.2f}" for n, ms in host.items()))
        for n, comp in composition.items():
            print(f"peak of {n}, rank 0: {comp['peak_gib']:.2f} GiB above the step's start; largest live blocks:")
            for row in comp["blocks"]:
                print(f"  {row['gib']:7.3f} GiB  x{row['count']:<3d} {row['where']}")
            print(f"  {comp['rest_gib']:7.3f} GiB  the rest")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({
                    "args": vars(args), **(extra_json or {}), "cp": bench.cp, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(), "round_medians_ms": medians,
                    "median_ms": {n: statistics.median(v) for n, v in medians.items()},
                    "vs_best_default_paired": vs_default, "peak_gib": memory, "kernel_ms_rank0": kernels,
                    "peak_composition_rank0": composition, "host_ms_rank0": host,
                    "max_rel_err": checks, "compile_s": compile_s,
                    "method": "one process per shape, arms alternate order per round, slowest rank per iteration",
                }, f, indent=1)
    teardown()


def main(argv=None) -> int:
    args = parse_args(argv)
    init_group(args.fake_rank)
    run(Bench(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
