"""Packed sequences (THD) through K/V all-gather CP, one rank's compute on one GPU.

    python benchmarks/bench_thd_allgather.py --cp 2 4 --tokens 65536 131072 --json out.json

One process plays rank R (``--ranks``, default 0) of CP on PyTorch's fake group, whose
collectives move nothing (memory is filled with random values first, so what they return is
random, not zeros): the time is that rank's compute. Per pack (T tokens, Hq32 Hkv8, bf16, causal,
lengths random / one long among 64 short / equal), fwd+bwd medians, arms alternating over rounds:

- ``eager``: Llama 3's form by hand (``cp_inductor/testing/varlen_programs.py::allgather_thd``): K/V
  all-gathered, put in pack order, one ``varlen_attn`` (flash-2) per local chunk over a slice of
  the gathered K/V, K/V heads repeated (copies) as torchtitan feeds varlen_attn; ``pack`` balance
  (the pack cut in 2*CP chunks, rank r holding r and 2CP-1-r);
- ``inductor``: the same compiled with default Inductor;
- ``cp_off`` / ``cp_on``: compiled with cp_inductor, varlen_cudnn off / on (on: each call on the
  provider chosen for queries over longer key prefixes, reading the slice in place, the K/V
  repeat dropped); ``cp_cudnn`` / ``cp_fa4``: the provider forced;
- ``helper_pack`` / ``helper_doc``: ``cp_inductor.parallel.thd_allgather_attention`` compiled
  with cp_inductor, balance ``pack`` / ``document`` (FA4, one call per round reading the gathered
  K/V in place: cu_seqlens_k at the document starts, seqused_k);
- ``helper_doc_g4``: ``helper_doc`` with ``head_groups=4`` (a gather and the calls per group of
  heads: the gathered K/V and the kernels' workspace of a quarter of the heads alive at a time);
- ``floor_pack`` / ``floor_doc``: the fastest kernel alone over this rank's pieces and their key
  prefixes, no copies, no gather, no reorder: FA4's packed op per round on K/V already in pack order.

The table also gives each balance's max/mean attention work over ranks (query-key pairs: FLOPs
up to a constant) and the peak memory of each arm beyond its inputs.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from common import device_ms, fill_free_memory, measure_arms, peak_composition, write_rows

from cp_inductor.testing import varlen_programs as vp
from bench_thd import HKV, HQ, lengths_for

from cp_inductor.parallel import thd_allgather as tag

ARMS = ("eager", "inductor", "cp_off", "cp_on", "cp_cudnn", "cp_fa4", "helper_pack", "helper_doc", "helper_doc_g4", "floor_pack", "floor_doc")


def balance_of(lengths, cp: int, balance: str) -> float:
    work = tag.attention_work(tag.plan_pack(lengths, cp, balance), cp)
    return max(work) / statistics.mean(work)


def arms_for(lengths, head_dim: int, cp: int, rank: int) -> dict:
    import cp_inductor  # noqa: F401 - registers the backend

    chunk = sum(lengths) // (2 * cp)
    q, k, v, _, _ = vp.pack(lengths, HQ, HKV, head_dim, dtype=torch.bfloat16, device="cuda", seed=len(lengths))
    rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)]).cuda()
    plan = vp.chunk_plan(lengths, rank, cp)

    def steps(fn, tensors):
        ins = [t.detach().clone().requires_grad_() for t in tensors]
        grad = torch.randn(ins[0].shape, device="cuda", dtype=torch.bfloat16)
        return lambda: torch.autograd.grad(fn(*ins), ins, grad)

    def handwritten(a, b, c):
        return vp.allgather_thd(a, b, c, plan)

    def compiled(fn, backend="cp_inductor", **options):
        return torch.compile(fn, backend=backend, fullgraph=True,
                             options={f"cp_inductor.{k}": v for k, v in options.items()} if options else None)

    local = [t.index_select(0, rows) for t in (q, k, v)]
    torch._dynamo.reset()
    arms = {
        "eager": steps(handwritten, local),
        "inductor": steps(torch.compile(handwritten, backend="inductor", fullgraph=True), local),
        "cp_off": steps(compiled(handwritten, varlen_cudnn=False), local),
        "cp_on": steps(compiled(handwritten), local),
        "cp_cudnn": steps(compiled(handwritten, attention_provider="cudnn"), local),
        "cp_fa4": steps(compiled(handwritten, attention_provider="fa4"), local),
    }
    for balance, name in (("pack", "pack"), ("document", "doc")):
        shard = tag.make_shard(lengths, rank, cp, balance, device="cuda")
        mine = [t.index_select(0, shard.local_index) for t in (q, k, v)]

        def helper(a, b, c, shard=shard, groups=None):
            return tag.thd_allgather_attention(a, b, c, shard, head_groups=groups)

        def floor(a, b, c, shard=shard):
            return tag.pack_attention(a, b, c, shard, kernel="fa4")

        arms[f"helper_{name}"] = steps(compiled(helper), mine)
        if balance == "document":
            arms["helper_doc_g4"] = steps(compiled(lambda a, b, c, h=helper: h(a, b, c, groups=4)), mine)
        arms[f"floor_{name}"] = steps(floor, [mine[0], k, v])
    return arms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ranks", type=int, nargs="+", default=[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128])
    ap.add_argument("--kinds", nargs="+", default=["random", "one_long", "equal"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--composition", action="store_true",
                    help="also print what is alive at the peak of cp_on, helper_doc and helper_doc_g4 (first pack)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    vp.register_cpu_kernels()
    torch.cuda.set_device(0)
    print(f"filled {fill_free_memory(0.4):.0f} GiB with random values")
    print(f"K/V all-gather over a pack, one rank's compute (fake group), Hq{HQ} Hkv{HKV} bf16 causal, fwd+bwd ms")
    print(f"{'cp':>2} {'rk':>2} {'T':>6} {'D':>4} {'lengths':>8} | " + " ".join(f"{n:>11}" for n in ARMS)
          + " | on/ind help_doc/ind on/floor_p help_doc/floor_d | max/mean work pack doc | peak GiB ind/on/help_doc/g4")
    rows = []
    for cp in a.cp:
        for rank in a.ranks:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
            for tokens in a.tokens:
                for head_dim in a.head_dim:
                    for kind in a.kinds:
                        lengths = lengths_for(kind, tokens, seed=tokens + head_dim)
                        arms = arms_for(lengths, head_dim, cp, rank)
                        times, peaks = measure_arms(arms, a.rounds, lambda fn: device_ms(fn, a.iters))
                        if a.composition and not rows:
                            for name in ("cp_on", "helper_doc", "helper_doc_g4"):
                                print(name, json.dumps(peak_composition(arms[name], top=8), indent=1))
                        row = {"cp": cp, "rank": rank, "tokens": tokens, "head_dim": head_dim, "lengths": kind,
                               "docs": lengths, **{f"{n}_ms": t for n, t in times.items()},
                               **{f"{n}_peak_gib": p for n, p in peaks.items()},
                               "work_max_mean_pack": balance_of(lengths, cp, "pack"),
                               "work_max_mean_document": balance_of(lengths, cp, "document")}
                        row["on_vs_inductor"] = row["inductor_ms"] / row["cp_on_ms"]
                        row["helper_doc_vs_inductor"] = row["inductor_ms"] / row["helper_doc_ms"]
                        row["on_vs_floor"] = row["cp_on_ms"] / row["floor_pack_ms"]
                        row["helper_doc_vs_floor"] = row["helper_doc_ms"] / row["floor_doc_ms"]
                        rows.append(row)
                        cells = " ".join(f"{times[n]:11.2f}" for n in ARMS)
                        print(f"{cp:>2} {rank:>2} {tokens:>6} {head_dim:>4} {kind:>8} | {cells} | "
                              f"{row['on_vs_inductor']:5.2f}x {row['helper_doc_vs_inductor']:5.2f}x "
                              f"{row['on_vs_floor']:6.3f} {row['helper_doc_vs_floor']:6.3f} | "
                              f"{row['work_max_mean_pack']:.3f} {row['work_max_mean_document']:.3f} | "
                              f"{peaks['inductor']:.2f}/{peaks['cp_on']:.2f}/{peaks['helper_doc']:.2f}/{peaks['helper_doc_g4']:.2f}",
                              flush=True)
                        write_rows(a.json, a, rows)
            torch._dynamo.reset()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
