"""One CP rank's training step of HF transformers' Llama made context-parallel by the backend
(``options={"cp_inductor.context_parallel": group}``, the batch cut by ``shard_batch``), per style,
on PyTorch's fake group (one process plays rank R of cp; its collectives move nothing, so the
times are that rank's compute), next to the single-device step on the full batch under default
Inductor (whose time / cp is what perfect CP would give one rank). Prints a table, writes JSON.

    python benchmarks/bench_auto_cp.py --cp 2 4 8 --tokens 65536 --docs 1 16 --json out.json
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from bench_hf_masks import batch as make_batch
from bench_hf_masks import build
from common import device_ms, write_rows

STYLES = ("allgather", "ulysses")


def _step(model, inputs):
    def run():
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
    return run


def one_rank(args, cp: int, tokens: int, docs: int) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_inductor.parallel import shard_batch

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=cp)
    try:
        full, _, _ = make_batch(tokens, docs, args.vocab)
        local = shard_batch({**full, "use_cache": False}, dist.group.WORLD)
        row = {"cp": cp, "rank": args.rank, "tokens": tokens, "docs": docs}
        for style in STYLES:
            torch._dynamo.reset()
            model = build("sdpa", args.layers, args.hidden, args.heads, args.kv_heads, args.vocab)
            compiled = torch.compile(model, backend="cp_inductor", options={
                "cp_inductor.context_parallel": dist.group.WORLD, "cp_inductor.context_parallel_style": style})
            torch.cuda.reset_peak_memory_stats()
            row[f"{style}_ms"] = device_ms(_step(compiled, local), args.iters)
            row[f"{style}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del model, compiled
        return row
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def single_device(args, tokens: int, docs: int) -> float:
    torch._dynamo.reset()
    model = build("sdpa", args.layers, args.hidden, args.heads, args.kv_heads, args.vocab)
    full, _, _ = make_batch(tokens, docs, args.vocab)
    return device_ms(_step(torch.compile(model), {**full, "use_cache": False}), args.iters)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536])
    ap.add_argument("--docs", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'T':>7} {'docs':>4} {'cp':>3} {'single/cp ms':>12} " + " ".join(f"{s + ' ms':>13}" for s in STYLES))
    for tokens in args.tokens:
        for docs in args.docs:
            alone = single_device(args, tokens, docs)
            for cp in args.cp:
                row = one_rank(args, cp, tokens, docs)
                row["single_device_ms"] = alone
                rows.append(row)
                print(f"{tokens:>7} {docs:>4} {cp:>3} {alone / cp:>12.2f} "
                      + " ".join(f"{row[s + '_ms']:>13.2f}" for s in STYLES), flush=True)
    write_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
