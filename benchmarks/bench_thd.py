"""Packed-sequence (THD) attention, forward and backward, one GPU: what varlen_cudnn buys.

    python benchmarks/bench_thd.py --json out.json [--tokens 32768 65536] [--head-dim 128 256]

Per pack (T tokens, Hq32 Hkv8 or, with ``--kv-heads 32``, MHA; bf16, causal or, with ``--masks full``, not; lengths equal,
random, or one long document among many short ones), alternating over rounds in one process,
fwd+bwd medians of:

- ``eager``: torchtitan's form, K/V repeated to the query heads, ``varlen_attn`` (flash-2), or
  with ``--programs flash_attn`` flash-attn's ``flash_attn_varlen_func`` (GQA as is);
- ``inductor``: the same compiled with default Inductor;
- ``cp_off`` / ``cp_on``: compiled with cp_inductor, varlen_cudnn off / on (``cp_on``: the
  provider the cost map chooses); ``cp_cudnn`` / ``cp_fa4``: the provider forced;
- ``floor``: the fastest kernel called directly on unrepeated K/V (no compiler): FA4's packed op
  where the [fa4] extra runs, else the cuDNN frontend's ragged op;
- ``dense`` (equal lengths): ``F.scaled_dot_product_attention`` over [B, H, S, D] on cuDNN;
- ``cp_uniform`` (equal lengths): cp_inductor with ``uniform_thd="promised"`` (dense SDPA).

Random packs are seeded by T + D (so D128 and D256 differ), or, with ``--seeds S ...``, one
row per seed. Each arm's row also has the median SM clock it ran at (``common.gpu_clocks``): the
H200 lowers it to hold its 700 W cap, so it says how much of a difference is power, not work.

``--varying-steps N``: N steps whose lengths and document counts change every step (``--kinds``
with no kind: only those).

``--block``: a torchtitan Llama block (dim 4096, SwiGLU 14336, rotary, varlen attention with K/V
repeated) per pack, fwd+bwd over the input and every weight, arms ``eager``, ``inductor``,
``cp_off``, ``cp_cudnn`` (the packed call on cuDNN, as before FA4), ``cp_on`` (the chosen
provider); next to it attention alone under default Inductor and cp_inductor, so the table says
attention's share of the block's time and what the rewrite saves of the step.

``--ulysses`` (under ``torchrun``, NCCL) or ``--fake-rank R/CP`` (one rank's compute on
PyTorch's fake group, whose collectives move nothing): Ulysses over the pack (DeepSpeed ALST's
form, ``cp_inductor/testing/varlen_programs.py::ulysses_thd``: T/CP tokens per rank, all-to-alls around varlen
attention over all T tokens), per iteration the slowest rank's time, peak memory the largest
rank's; arms
``eager``, ``inductor``, cp_inductor with fused_a2a / varlen_cudnn off and on (``cp_off``,
``cp_a2a``, ``cp_cudnn``, ``cp_on``; ``cp_on_cudnn``: cp_on with the packed call on cuDNN, as
before FA4; ``cp_views``: cp_on with fused_a2a's unpack as views of the
received buffer), and ``floor`` (FA4's packed op, or without it the frontend's ragged op, on
this rank's share: all T tokens, HQ/CP query and HKV/CP K/V heads).

Peak memory is per arm's step beyond the inputs. Memory is filled with random values first.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F
from common import device_ms, fill_free_memory, largest_rank, measure_arms, slowest_rank_ms, write_rows

from cp_inductor.testing import varlen_programs as vp

HQ, HKV, DOCS = 32, 8, 8


def lengths_for(kind: str, tokens: int, seed: int, docs: int = DOCS) -> list[int]:
    if kind == "equal":
        return [tokens // docs] * docs
    rng = random.Random(seed)
    if kind == "random":
        cuts = sorted(rng.sample(range(1, tokens), docs - 1))
        return [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]
    long = tokens // 2  # one long document, the rest in 64 short ones
    short = [(tokens - long) // 64] * 64
    short[-1] += tokens - long - sum(short)
    return [long, *short]


def add_pack_options(ap, kv_heads: list[int]) -> None:
    """The one random pack the profiling scripts time: ``--tokens``, ``--head-dim``, ``--kv-heads``, ``--masks``."""
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, nargs="+", default=kv_heads)
    ap.add_argument("--masks", nargs="+", default=["causal"], choices=["causal", "full"])


def random_pack(a) -> list[int]:
    """After filling memory with random values: the lengths of that pack (seeded by T + D)."""
    print(f"filled {fill_free_memory(0.4):.0f} GiB with random values")
    return lengths_for("random", a.tokens, seed=a.tokens + a.head_dim)


def fastest_kernel(q, k, v, cu, max_len, causal):
    """The floor: packed attention on the fastest kernel there is, called directly on unrepeated
    K/V: FA4's packed op where the [fa4] extra runs, else the cuDNN frontend's ragged op."""
    from cp_inductor.lowerings import fa4_attention

    scale = q.shape[-1] ** -0.5
    if fa4_attention.unavailable(q.device, q.dtype, q.shape[-1]) is None:
        return torch.ops.cp_inductor.fa4_varlen_attention(q, k, v, cu, cu, None, max_len, max_len, scale, causal)[0]
    out, _ = torch.ops.cudnn.sdpa_fwd(q, k, v, scale, is_causal=causal, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                      max_seqlen_q=max_len, max_seqlen_kv=max_len, return_lse=True)
    return out


def arms_for(lengths, head_dim, causal=True, program="torchtitan", kv_heads=HKV):
    import cp_inductor  # noqa: F401 - registers the backend

    q, k, v, cu, m = vp.pack(lengths, HQ, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda", seed=len(lengths))
    ins = [t.requires_grad_() for t in (q, k, v)]
    grad = torch.randn(q.shape[:2] + v.shape[2:], device="cuda", dtype=torch.bfloat16)
    attention = PROGRAMS[program]
    if program == "flash_attn":
        vp.flash_attn_like()  # registers its ops before compiling

    def titan(q, k, v):
        return attention(q, k, v, cu, m, causal)

    def step(fn):
        return lambda: torch.autograd.grad(fn(*ins), ins, grad)

    torch._dynamo.reset()
    arms = {
        "eager": step(titan),
        "inductor": step(torch.compile(titan, backend="inductor", fullgraph=True)),
        "cp_off": step(torch.compile(titan, backend="cp_inductor", fullgraph=True, options={"cp_inductor.varlen_cudnn": False})),
        "cp_on": step(torch.compile(titan, backend="cp_inductor", fullgraph=True)),
        "cp_cudnn": step(torch.compile(titan, backend="cp_inductor", fullgraph=True, options={"cp_inductor.attention_provider": "cudnn"})),
        "cp_fa4": step(torch.compile(titan, backend="cp_inductor", fullgraph=True, options={"cp_inductor.attention_provider": "fa4"})),
    }

    def floor(q, k, v):
        return fastest_kernel(q, k, v, cu, m, causal)

    arms["floor"] = step(floor)
    if len(set(lengths)) == 1:
        b, s = len(lengths), lengths[0]

        def dense(q, k, v):
            q, k, v = (t.view(b, s, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).transpose(1, 2).reshape(b * s, HQ, head_dim)

        arms["dense"] = step(dense)
        arms["cp_uniform"] = step(torch.compile(titan, backend="cp_inductor", fullgraph=True,
                                                options={"cp_inductor.uniform_thd": "promised"}))
    return arms


# How the program reaches attention: torchtitan's varlen_attn with K/V repeated, or flash-attn's
# flash_attn_varlen_func with GQA as is (its ops under flash-attn's schemas on aten's flash-2
# kernels, the ones flash-attn ships: cp_inductor/testing/varlen_programs.py; flash-attn is not installed).
PROGRAMS = {"torchtitan": vp.torchtitan_style, "flash_attn": vp.flash_attn_style}
DIM, FFN = 4096, 14336  # Llama-3-8B's widths: Hq32 x D128 = 4096


class TitanBlock(torch.nn.Module):
    """torchtitan's Llama block on a pack (bf16): RMSNorm, q/k/v projections (Hq32 Hkv8), rotary
    embedding, varlen attention with K/V repeated to the query heads, output projection, RMSNorm,
    SwiGLU feed-forward; residuals around both."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq = torch.nn.Linear(DIM, HQ * head_dim, bias=False)
        self.wkv = torch.nn.Linear(DIM, 2 * HKV * head_dim, bias=False)
        self.wo = torch.nn.Linear(HQ * head_dim, DIM, bias=False)
        self.w13 = torch.nn.Linear(DIM, 2 * FFN, bias=False)
        self.w2 = torch.nn.Linear(FFN, DIM, bias=False)
        self.norms = torch.nn.ModuleList([torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)])

    def rope(self, x, positions):
        half = self.head_dim // 2
        freq = positions[:, None].float() * (10000.0 ** (-torch.arange(half, device=x.device) / half))
        cos, sin = freq.cos()[:, None, :].to(x.dtype), freq.sin()[:, None, :].to(x.dtype)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x, positions, cu, max_len):
        h = self.norms[0](x)
        q = self.wq(h).view(-1, HQ, self.head_dim)
        k, v = self.wkv(h).view(-1, 2, HKV, self.head_dim).unbind(1)
        q, k = self.rope(q, positions), self.rope(k, positions)
        x = x + self.wo(vp.torchtitan_style(q, k, v, cu, max_len).flatten(1))
        gate, up = self.w13(self.norms[1](x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def block_arms_for(lengths, head_dim):
    """``--block``: one TitanBlock step (fwd+bwd, weights and input) per arm."""
    import cp_inductor  # noqa: F401 - registers the backend

    torch.manual_seed(0)
    block = TitanBlock(head_dim).to("cuda", torch.bfloat16)
    _, _, _, cu, m = vp.pack(lengths, 1, 1, 8, device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    x = torch.randn(sum(lengths), DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    params = [x, *block.parameters()]

    def step(fn):
        return lambda: torch.autograd.grad(fn(x, positions, cu, m), params, grad)

    torch._dynamo.reset()
    return {
        "eager": step(block),
        "inductor": step(torch.compile(block, backend="inductor", fullgraph=True)),
        "cp_off": step(torch.compile(block, backend="cp_inductor", fullgraph=True, options={"cp_inductor.varlen_cudnn": False})),
        "cp_on": step(torch.compile(block, backend="cp_inductor", fullgraph=True)),
        # cp_inductor before FA4: the packed call on cuDNN's ragged attention
        "cp_cudnn": step(torch.compile(block, backend="cp_inductor", fullgraph=True,
                                       options={"cp_inductor.attention_provider": "cudnn"})),
    }


def blocks(a) -> list[dict]:
    """The block step per pack, next to attention alone in the same process: how much of the
    block's time attention is, and what the rewrite saves of the whole step."""
    names = ("eager", "inductor", "cp_off", "cp_cudnn", "cp_on")
    print(f"torchtitan block (dim {DIM}, FFN {FFN}), fwd+bwd ms")
    print(f"{'T':>6} {'D':>4} {'lengths':>8} | " + " ".join(f"{n:>9}" for n in names)
          + " | attention alone inductor/on | attention share | block on/inductor")
    rows = []
    for tokens in a.tokens:
        for head_dim in a.head_dim:
            for kind in a.kinds:
                lengths = lengths_for(kind, tokens, seed=tokens + head_dim)
                attention, _ = measure_arms({n: f for n, f in arms_for(lengths, head_dim).items() if n in ("inductor", "cp_on")},
                                            a.rounds, lambda fn: device_ms(fn, a.iters, calls=a.calls))
                times, peaks = measure_arms(block_arms_for(lengths, head_dim), a.rounds,
                                            lambda fn: device_ms(fn, a.iters, calls=a.calls))
                row = {"block": True, "tokens": tokens, "head_dim": head_dim, "lengths": kind, "docs": lengths,
                       **{f"{n}_ms": t for n, t in times.items()}, **{f"{n}_peak_gib": p for n, p in peaks.items()},
                       "attention_inductor_ms": attention["inductor"], "attention_cp_on_ms": attention["cp_on"]}
                row["attention_share"] = attention["inductor"] / times["inductor"]
                row["on_vs_inductor"] = times["inductor"] / times["cp_on"]
                rows.append(row)
                print(f"{tokens:>6} {head_dim:>4} {kind:>8} | " + " ".join(f"{times[n]:9.2f}" for n in names)
                      + f" | {attention['inductor']:.2f}/{attention['cp_on']:.2f} | {row['attention_share']:.2f}"
                      f" | {row['on_vs_inductor']:.3f}x", flush=True)
                write_rows(a.json, a, rows)
    return rows


def ulysses_arms_for(lengths, head_dim, cp, rank, causal=True):
    """This rank's arms of Ulysses over the pack (``--ulysses``, ``--fake-rank``)."""
    import cp_inductor  # noqa: F401 - registers the backend

    tokens = sum(lengths)
    q, k, v, cu, m = vp.pack(lengths, HQ, HKV, head_dim, dtype=torch.bfloat16, device="cuda", seed=len(lengths))
    mine = slice(rank * tokens // cp, (rank + 1) * tokens // cp)
    ins = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(ins[0].shape, device="cuda", dtype=torch.bfloat16)

    def alst(q, k, v):
        return vp.ulysses_thd(q, k, v, cu, m, causal)

    def step(fn):
        return lambda: torch.autograd.grad(fn(*ins), ins, grad)

    def compiled(**options):
        return torch.compile(alst, backend="cp_inductor", fullgraph=True,
                             options={f"cp_inductor.{k}": v for k, v in options.items()})

    torch._dynamo.reset()
    arms = {
        "eager": step(alst),
        "inductor": step(torch.compile(alst, backend="inductor", fullgraph=True)),
        "cp_off": step(compiled(fused_a2a=False, varlen_cudnn=False)),
        "cp_a2a": step(compiled(varlen_cudnn=False)),
        "cp_on_cudnn": step(compiled(attention_provider="cudnn")),  # cp_inductor before FA4
        "cp_cudnn": step(compiled(fused_a2a=False)),
        "cp_on": step(compiled()),
        # fused_a2a's other unpack: attention reads q, k, v as views of the received buffer
        "cp_views": step(compiled(fused_a2a_unpack="views")),
    }
    share = [t[:, : t.shape[1] // cp].detach().clone().requires_grad_() for t in (q, k, v)]
    full_grad = torch.randn(share[0].shape, device="cuda", dtype=torch.bfloat16)

    def floor():
        return torch.autograd.grad(fastest_kernel(*share, cu, m, causal), share, full_grad)

    arms["floor"] = floor
    return arms


# How a pack whose bucket has no cuDNN graph runs (varlen_attention's cover rule): on a covering
# graph (the default), or on its own, built at once (the cover off).
POLICIES = {"cover": {"_COVER": 2}, "wait": {"_COVER": 1}}


def varying(tokens: int, head_dim: int, steps: int, iters: int, policies) -> list[dict]:
    """Lengths (and document counts, 6-12) new at every step, compiled once per backend (and per
    cover policy). The last third of the steps, each timed once as it comes, against the same
    packs each timed again (``iters`` runs) once every graph is built: what changing lengths cost
    beyond the packs' own work. With Dynamo's graph count, the cuDNN graphs built in that third,
    and per step its time, its host time (the call's return, kernels queued) and its builds."""
    from torch._dynamo.utils import counters

    from cp_inductor.lowerings import cudnn_ragged
    from cp_inductor.lowerings import varlen_attention as va

    rng = random.Random(tokens)
    packs = [vp.pack(lengths_for("random", tokens, seed=i, docs=rng.randint(6, 12)), HQ, HKV, head_dim,
                     dtype=torch.bfloat16, device="cuda", seed=i) for i in range(steps)]
    grad = torch.randn(tokens, HQ, head_dim, device="cuda", dtype=torch.bfloat16)
    rows = []
    for backend, policy in [("inductor", None)] + [("cp_inductor", p) for p in policies]:
        torch._dynamo.reset()
        counters.clear()
        for name, value in POLICIES.get(policy, {}).items():
            setattr(va, name, value)
        va._built.clear()
        va._covered_runs.clear()
        cudnn_ragged._forward_plans.clear()
        cudnn_ragged._backward_plans.clear()
        fn = torch.compile(vp.torchtitan_style, backend=backend, fullgraph=True)

        def step(pack):
            q, k, v, cu, m = pack
            ins = [t.requires_grad_() for t in (q, k, v)]
            return torch.autograd.grad(fn(*ins, cu, m), ins, grad)

        warm = 2 * steps // 3  # Dynamo makes the lengths dynamic, the first graphs get built
        for pack in packs[:warm]:
            step(pack)
        before = dict(cudnn_ragged.builds)
        per_step = []
        for p in packs[warm:]:
            torch.cuda.synchronize()
            counts = sum(cudnn_ragged.builds.values())
            host = [0.0]

            def timed(p=p):
                t0 = time.perf_counter()
                step(p)
                host[0] = (time.perf_counter() - t0) * 1e3

            ms = device_ms(timed, 1, warmup=0)
            per_step.append({"ms": ms, "host_ms": host[0], "builds": sum(cudnn_ragged.builds.values()) - counts})
        built = sum(cudnn_ragged.builds.values()) - sum(before.values())
        again = [device_ms(lambda p=p: step(p), iters, warmup=1) for p in packs[warm:]]
        as_they_come = [s["ms"] for s in per_step]
        row = {"tokens": tokens, "head_dim": head_dim, "backend": backend, "policy": policy, "steps_timed": len(again),
               "varying_ms": statistics.median(as_they_come), "fixed_ms": statistics.median(again),
               "varying_vs_fixed": sum(as_they_come) / sum(again), "slowest_step_ms": max(as_they_come),
               "dynamo_graphs": counters["stats"]["unique_graphs"],
               "cudnn_graphs_built_in_steady_state": built,
               "steps": [{**s, "again_ms": a} for s, a in zip(per_step, again)]}
        print(f"varying lengths T{tokens} D{head_dim} {backend} {policy or ''}: median {row['varying_ms']:.2f} ms per step, "
              f"the same packs again {row['fixed_ms']:.2f} ms (total {row['varying_vs_fixed']:.3f}x, slowest step "
              f"{row['slowest_step_ms']:.2f} ms), Dynamo graphs {row['dynamo_graphs']}, cuDNN graphs built in steady "
              f"state {built}", flush=True)
        for i, s in enumerate(row["steps"]):
            print(f"  step {i}: {s['ms']:.2f} ms (again {s['again_ms']:.2f}), host {s['host_ms']:.2f} ms, cuDNN graphs "
                  f"built {s['builds']}")
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--kinds", nargs="*", default=["equal", "random", "one_long"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1,
                    help="steps timed back to back per measurement (> 1: the host queues the next step while the "
                         "GPU runs this one, as in training, so no arm's launch latency is timed)")
    ap.add_argument("--varying-steps", type=int, default=0, help="also run this many steps of changing lengths")
    ap.add_argument("--policies", nargs="+", default=["cover"], choices=list(POLICIES),
                    help="--varying-steps: how a pack whose bucket has no cuDNN graph runs")
    ap.add_argument("--programs", nargs="+", default=["torchtitan"], choices=list(PROGRAMS),
                    help="how the program calls varlen attention")
    ap.add_argument("--masks", nargs="+", default=["causal"], choices=["causal", "full"],
                    help="causal, and/or full (no mask) attention")
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[HKV],
                    help="K/V heads of the main table (32 = MHA, 8 = GQA with 4 query heads each)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="random packs: one row per seed (default: one pack, seeded by T + D)")
    ap.add_argument("--fake-rank", default=None, help="R/CP: one rank's compute of Ulysses over the pack")
    ap.add_argument("--ulysses", action="store_true", help="Ulysses over the pack on NCCL (under torchrun)")
    ap.add_argument("--block", action="store_true", help="a torchtitan block step per pack, next to attention alone")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import cudnn.sdpa.fwd.torch_op  # noqa: F401 - the floor's op

    if a.fake_rank or a.ulysses:
        from common import init_group

        init_group(a.fake_rank)
        return ulysses(a)

    print(f"filled {fill_free_memory(0.5):.0f} GiB with random values")
    if a.block:
        blocks(a)
        return 0
    rows = []
    print(f"{'program':>10} {'T':>6} {'D':>4} {'Hkv':>3} {'lengths':>8} {'mask':>6} | " + " ".join(f"{n:>9}" for n in ("eager", "inductor", "cp_off", "cp_on", "cp_cudnn", "cp_fa4", "floor", "dense", "cp_uniform"))
          + " | on/inductor  on/floor | peak GiB inductor/on | SM clock inductor/on")
    for tokens in a.tokens:
        for head_dim in a.head_dim:
            seeds = {k: a.seeds if a.seeds and k == "random" else [tokens + head_dim] for k in a.kinds}
            for program, kind, seed, mask, kv_heads in ((p, k, s, m, h) for p in a.programs for k in a.kinds
                                                        for s in seeds[k] for m in a.masks for h in a.kv_heads):
                lengths = lengths_for(kind, tokens, seed=seed)
                clocks: dict = {}
                times, peaks = measure_arms(arms_for(lengths, head_dim, causal=mask == "causal", program=program,
                                                     kv_heads=kv_heads),
                                            a.rounds, lambda fn: device_ms(fn, a.iters, calls=a.calls), clocks=clocks)
                row = {"program": program, "tokens": tokens, "head_dim": head_dim, "kv_heads": kv_heads, "lengths": kind,
                       "seed": seed, "mask": mask,
                       "docs": lengths,
                       **{f"{n}_ms": t for n, t in times.items()},
                       **{f"{n}_peak_gib": p for n, p in peaks.items()},
                       **{f"{n}_sm_mhz": c for n, c in clocks.items()}}
                row["on_vs_inductor"] = row["inductor_ms"] / row["cp_on_ms"]
                row["on_vs_floor"] = row["cp_on_ms"] / row["floor_ms"]
                rows.append(row)
                cells = " ".join(f"{row.get(n + '_ms', float('nan')):9.2f}" for n in ("eager", "inductor", "cp_off", "cp_on", "cp_cudnn", "cp_fa4", "floor", "dense", "cp_uniform"))
                label = f"{kind[:4]}{seed}" if a.seeds and kind == "random" else kind
                print(f"{program:>10} {tokens:>6} {head_dim:>4} {kv_heads:>3} {label:>8} {mask:>6} | {cells} | {row['on_vs_inductor']:10.2f}x {row['on_vs_floor']:8.3f} | "
                      f"{peaks['inductor']:.2f}/{peaks['cp_on']:.2f}"
                      + (f" | MHz {clocks['inductor']:.0f}/{clocks['cp_on']:.0f}" if clocks else ""), flush=True)
                write_rows(a.json, a, rows)
    if a.varying_steps:
        rows += varying(a.tokens[0], a.head_dim[0], a.varying_steps, a.iters, a.policies)
        write_rows(a.json, a, rows)
    return 0


def ulysses(a) -> int:
    import torch.distributed as dist

    rank, cp = dist.get_rank(), dist.get_world_size()
    writer = rank == 0 or bool(a.fake_rank)  # a fake rank is the only process
    say = print if writer else (lambda *args, **kwargs: None)
    say(f"filled {fill_free_memory(0.5):.0f} GiB with random values")
    names = ("eager", "inductor", "cp_off", "cp_a2a", "cp_cudnn", "cp_on_cudnn", "cp_on", "cp_views", "floor")
    where = "fake group: no communication" if a.fake_rank else "NCCL, slowest rank"
    say(f"Ulysses over the pack, rank {rank} of {cp} ({where}), Hq{HQ} Hkv{HKV}, fwd+bwd ms")
    say(f"{'T':>6} {'D':>4} {'lengths':>8} | " + " ".join(f"{n:>9}" for n in names) + " | on/inductor on/floor | peak GiB inductor/on")
    rows = []
    for tokens in a.tokens:
        for head_dim in a.head_dim:
            for kind in a.kinds:
                lengths = lengths_for(kind, tokens, seed=tokens + head_dim)
                times, peaks = measure_arms(ulysses_arms_for(lengths, head_dim, cp, rank), a.rounds,
                                            lambda fn: statistics.median(slowest_rank_ms(fn, a.iters)), largest_rank)
                row = {"tokens": tokens, "head_dim": head_dim, "lengths": kind, "fake_rank": a.fake_rank, "cp": cp, "docs": lengths,
                       **{f"{n}_ms": t for n, t in times.items()},
                       **{f"{n}_peak_gib": p for n, p in peaks.items()}}
                row["on_vs_inductor"] = row["inductor_ms"] / row["cp_on_ms"]
                row["on_vs_floor"] = row["cp_on_ms"] / row["floor_ms"]
                rows.append(row)
                cells = " ".join(f"{row[n + '_ms']:9.2f}" for n in names)
                say(f"{tokens:>6} {head_dim:>4} {kind:>8} | {cells} | {row['on_vs_inductor']:10.2f}x {row['on_vs_floor']:7.3f} | "
                    f"{peaks['inductor']:.2f}/{peaks['cp_on']:.2f}", flush=True)
                if writer:
                    write_rows(a.json, a, rows)
    from common import teardown

    teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
