"""torch's flex CP (torchtitan's only CP path for packed documents), one rank's attention compute
(fwd+bwd): this rank's queries over the all-gathered K/V under the CP BlockMask torch builds for
it (``_create_cp_block_mask``, as ``_context_parallel_shard`` does), compiled ``flex_attention``
under default Inductor and under cp_inductor, and the floor: the same FA4 calls with their plan
made once outside the step. The all-gather is left out (the same collective in every arm). Every
rank of the group is measured on one GPU; the table gives each and the slowest. Prints a table
and writes JSON.

    python benchmarks/bench_flex_cp.py --tokens 65536 --docs 16 --cp 2 --balances none headtail --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.nn.attention.flex_attention import flex_attention

from bench_flex_documents import pack
from common import add_attention_args, device_ms


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--balances", nargs="+", default=["none", "headtail"])
    add_attention_args(p)
    args = p.parse_args(argv)
    import cp_inductor
    from cp_inductor.lowerings import document_attention  # noqa: F401 - registers the plan op the floor calls
    from cp_inductor.testing.documents import cp_document_block_mask

    tokens, cp, local = args.tokens, args.cp, args.tokens // args.cp
    doc, _, _ = pack(tokens, args.docs)
    scale = args.head_dim ** -0.5
    g = torch.Generator().manual_seed(1)
    q_all, k_all, v_all = (torch.randn(1, h, tokens, args.head_dim, generator=g).cuda().bfloat16()
                           for h in (args.heads, args.kv_heads, args.kv_heads))

    def program(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, scale=scale)

    rows = []
    for balance in args.balances:
        for rank in range(cp):
            block_mask, order = cp_document_block_mask(doc, cp, rank, balance, "cuda", compile_builder=True)
            q = q_all[:, :, order][:, :, rank * local:(rank + 1) * local].contiguous().requires_grad_()
            k, v = (t[:, :, order].contiguous().requires_grad_() for t in (k_all, v_all))
            grad = torch.randn_like(q)
            positions = order[rank * local:(rank + 1) * local][None]
            keys = None if balance == "none" else order[None]
            plan, meta = torch.ops.cp_inductor.document_shard_plan(doc, positions, keys, False, True, 1, local, tokens)

            def floor(q, k, v, block_mask):
                return torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, doc, positions, keys, scale, True)[0]

            row = {"balance": balance, "rank": rank, "segments": int(meta[0]), "rounds": int(meta[1]), "ms": {},
                   "peak_gib": {}}
            outs = {}
            for arm, fn, backend in (("inductor", program, "inductor"), ("cp_inductor", program, "cp_inductor"),
                                     ("floor", floor, "eager")):
                torch._dynamo.reset()
                cp_inductor.clear_report()
                run = fn if backend == "eager" else torch.compile(fn, backend=backend)

                def step():
                    out = run(q, k, v, block_mask)
                    out.backward(grad)
                    return out

                outs[arm] = step().detach().float()
                torch.cuda.reset_peak_memory_stats()
                row["ms"][arm] = device_ms(step, args.iters, warmup=2)
                row["peak_gib"][arm] = torch.cuda.max_memory_allocated() / 2**30
                if arm == "cp_inductor":
                    row["report"] = [line for line in str(cp_inductor.report()).splitlines() if "attention" in line]
                q.grad = k.grad = v.grad = None
            row["max_abs_diff_vs_inductor"] = float((outs["cp_inductor"] - outs["inductor"]).abs().max())
            rows.append(row)
    summary = []
    for balance in args.balances:
        mine = [r for r in rows if r["balance"] == balance]
        slowest = {arm: max(r["ms"][arm] for r in mine) for arm in ("inductor", "cp_inductor", "floor")}
        summary.append({"balance": balance, "slowest_ms": slowest,
                        "speedup_vs_inductor": slowest["inductor"] / slowest["cp_inductor"],
                        "vs_floor": slowest["cp_inductor"] / slowest["floor"]})
    print(f"T{tokens}, {args.docs} documents, cp {cp}, Hq{args.heads} Hkv{args.kv_heads} D{args.head_dim} bf16 fwd+bwd")
    print("| balance | rank | segments / rounds | inductor ms | cp_inductor ms | floor ms | cp / inductor | peak GiB ind / cp | max |diff| |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms, mem = r["ms"], r["peak_gib"]
        print(f"| {r['balance']} | {r['rank']} | {r['segments']} / {r['rounds']} | {ms['inductor']:.2f} | {ms['cp_inductor']:.2f} | "
              f"{ms['floor']:.2f} | {ms['inductor'] / ms['cp_inductor']:.2f}x | {mem['inductor']:.1f} / {mem['cp_inductor']:.1f} | "
              f"{r['max_abs_diff_vs_inductor']:.2e} |")
    for s in summary:
        ms = s["slowest_ms"]
        print(f"slowest rank, {s['balance']}: inductor {ms['inductor']:.2f} ms, cp_inductor {ms['cp_inductor']:.2f} ms "
              f"({s['speedup_vs_inductor']:.2f}x), floor {ms['floor']:.2f} ms (cp / floor {s['vs_floor']:.3f})")
    for line in rows[0].get("report", []):
        print(f"  {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tokens": tokens, "docs": args.docs, "cp": cp,
                       "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
