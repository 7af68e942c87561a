"""A torchtitan-style decoder (``cp_inductor.testing.titan``: documents from EOS tokens, a
compiled ``create_block_mask`` per step, flex behind a nested compile, each block compiled on its
own) trained one step (fwd+bwd) on a packed batch: default Inductor, cp_inductor, and the floor
(the same blocks with FA4's varlen op over the documents, their cu_seqlens given, no BlockMask
built). The BlockMask is built inside the step, as torchtitan does per batch. Prints a table and
writes JSON.

    python benchmarks/bench_titan_block.py --tokens 16384 --docs 8 --json out.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench_flex_documents import pack
from common import arm_ratios, device_ms, print_arm_table, write_device_rows

EOS = 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--docs", type=int, nargs="+", default=[8])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--arms", default="inductor,cp_inductor,floor")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import cp_inductor
    from cp_inductor.testing import titan

    rows = []
    for docs in args.docs:
        _, cu, longest = pack(args.tokens, docs)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(1, args.vocab, (1, args.tokens), generator=g)
        tokens[0, cu[1:].cpu().long() - 1] = EOS  # each document ends with EOS
        tokens = tokens.cuda()

        def floor_attend(q, k, v, block_mask):
            flat = [x[0].transpose(0, 1) for x in (q, k, v)]
            out, _ = torch.ops.cp_inductor.fa4_varlen_attention(*flat, cu, cu, None, longest, longest, q.shape[-1] ** -0.5,
                                                                True)
            return out.transpose(0, 1)[None]

        row = {"tokens": args.tokens, "docs": docs, "ms": {}, "peak_gib": {}}
        for arm in args.arms.split(","):
            torch.manual_seed(0)
            model = titan.Decoder(args.vocab, args.dim, args.layers, args.heads, args.kv_heads).cuda().bfloat16()
            for block in model.layers.values():
                if arm == "floor":
                    block.attention.attend = floor_attend
            titan.compile_blocks(model, backend="cp_inductor" if arm == "cp_inductor" else "inductor")
            torch._dynamo.reset()
            cp_inductor.clear_report()

            def step():
                block_mask = titan.document_causal_mask(tokens, EOS) if arm != "floor" else None
                logits = model(tokens, block_mask)
                F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
                for q in model.parameters():
                    q.grad = None

            torch.cuda.reset_peak_memory_stats()
            row["ms"][arm] = device_ms(step, args.iters, warmup=3)
            row["peak_gib"][arm] = torch.cuda.max_memory_allocated() / 2**30
            if arm == "cp_inductor":
                row["report"] = [line for line in str(cp_inductor.report()).splitlines() if "attention" in line]
            model = None
            torch.cuda.empty_cache()
            print(f"T{args.tokens} docs {docs} {arm}: {row['ms'][arm]:.2f} ms", file=sys.stderr, flush=True)
        arm_ratios(row)
        rows.append(row)
    print_arm_table(rows, args.arms.split(","), {"T": "tokens", "docs": "docs"})
    for r in rows:
        for line in r.get("report", []):
            print(f"  docs {r['docs']}: {line}")
    write_device_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
