"""Flex document-causal attention alone (fwd+bwd): compiled ``flex_attention`` with a BlockMask
of document ids and causal (torchtitan's form) under default Inductor and cp_inductor, and the
floor (FA4's varlen op on the same pack, its cu_seqlens given). ``floor_plan`` is the floor with
its cu_seqlens found from the document ids by ``document_plan`` in the step (what cp_inductor's
lowering pays on top of the kernels); ``--profile`` prints each arm's kernels and idle time.
Prints a table and writes JSON.

    python benchmarks/bench_flex_documents.py --tokens 32768 65536 --docs 8 16 --json out.json
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.nn.attention.flex_attention import flex_attention

from common import add_attention_args, arm_ratios, device_ms, print_arm_table, print_kernels, write_device_rows


def pack(tokens: int, docs: int, seed: int = 0, equal: bool = False):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(tokens - 1, generator=g)[: docs - 1] + 1).values
    if equal:  # documents of one length (the last takes the remainder)
        cuts = torch.arange(1, docs) * (tokens // docs)
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    doc = torch.repeat_interleave(torch.arange(docs), bounds.diff())[None].cuda()
    return doc, bounds.to(torch.int32).cuda(), int(bounds.diff().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--docs", type=int, nargs="+", default=[8, 16])
    p.add_argument("--arms", default="inductor,cp_inductor,floor")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--seeds", type=int, default=1, help="random packs per shape (seeds 0..N-1): the ratio is the pack's")
    p.add_argument("--packs", nargs="+", default=["random"], choices=["random", "equal"],
                   help="random cuts (per seed), or documents of one length")
    add_attention_args(p)
    args = p.parse_args(argv)
    import cp_inductor
    from cp_inductor.lowerings import document_attention
    from cp_inductor.testing.documents import document_causal_block_mask

    rows = []
    shapes = [(t, d, s, kind) for kind in args.packs for t, d in zip(args.tokens, args.docs)
              for s in (range(args.seeds) if kind == "random" else [0])]
    for tokens, docs, seed, kind in shapes:
        doc, cu, longest = pack(tokens, docs, seed, equal=kind == "equal")

        block_mask = document_causal_block_mask(doc, tokens, "cuda")
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, h, tokens, args.head_dim, generator=g).cuda().bfloat16().requires_grad_()
                   for h in (args.heads, args.kv_heads, args.kv_heads))
        grad = torch.randn_like(q)
        scale = args.head_dim ** -0.5

        def program(q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, scale=scale)

        def floor(q, k, v, block_mask):
            flat = [x[0].transpose(0, 1) for x in (q, k, v)]
            out, _ = torch.ops.cp_inductor.fa4_varlen_attention(*flat, cu, cu, None, longest, longest, scale, True)
            return out.transpose(0, 1)[None]

        def floor_plan(q, k, v, block_mask):
            found, meta = torch.ops.cp_inductor.document_plan(doc, None, False, 1, tokens)
            document_attention._settle(meta)  # as the first op that reads it does
            count, most = int(meta[0]), int(meta[1])
            flat = [x[0].transpose(0, 1) for x in (q, k, v)]
            out, _ = torch.ops.cp_inductor.fa4_varlen_attention(*flat, found[:count + 1], found[:count + 1], None, most,
                                                                 most, scale, True)
            return out.transpose(0, 1)[None]

        arms = {"inductor": (program, "inductor"), "cp_inductor": (program, "cp_inductor"), "floor": (floor, "inductor"),
                "floor_plan": (floor_plan, None)}
        row = {"tokens": tokens, "docs": docs, "pack": kind, "seed": seed, "longest": longest, "ms": {}}
        outs = {}
        for arm in args.arms.split(","):
            fn, backend = arms[arm]
            torch._dynamo.reset()
            cp_inductor.clear_report()
            run = torch.compile(fn, backend=backend) if backend else fn

            def step():
                out = run(q, k, v, block_mask)
                out.backward(grad)
                return out

            outs[arm] = step().detach().float()
            row["ms"][arm] = device_ms(step, args.iters, warmup=2)
            if args.profile:
                row.setdefault("profile", {})[arm] = print_kernels(f"T{tokens} docs {docs} {arm}", step)
            if arm == "cp_inductor":
                row["report"] = [line for line in str(cp_inductor.report()).splitlines() if "attention" in line]
            q.grad = k.grad = v.grad = None
        row["max_abs_diff_vs_inductor"] = float((outs["cp_inductor"] - outs["inductor"]).abs().max()) \
            if "cp_inductor" in outs and "inductor" in outs else float("nan")
        arm_ratios(row)
        rows.append(row)
    print_arm_table(rows, args.arms.split(","), {"T": "tokens", "docs": "docs", "pack": "pack", "seed": "seed", "longest": "longest"},
                    {"max |out diff|": ("max_abs_diff_vs_inductor", ".2e")})
    for r in rows:
        for line in r.get("report", []):
            print(f"  T{r['tokens']}: {line}")
    write_device_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
