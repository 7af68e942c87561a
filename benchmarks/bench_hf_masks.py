"""HF transformers' LlamaForCausalLM trained one step (fwd+bwd) on packed documents or a plain
batch: eager, default Inductor, cp_inductor, and the floor (a custom HF attention function on
FA4's varlen op over the documents, no mask built, under default Inductor). Prints a table and
writes JSON.

    python benchmarks/bench_hf_masks.py --impl sdpa --tokens 16384 --docs 8 --json out.json

CUDA-graph arms (``mode="reduce-overhead"``): ``inductor_graphs`` (default Inductor) and
``cp_graphs`` (cp_inductor with ``document_mask_capacity=--capacity``: its step has nothing for the
host to read, so Inductor's cudagraph trees record it; without a capacity they skip the graphs
holding the document plan):

    python benchmarks/bench_hf_masks.py --arms inductor,cp_inductor,inductor_graphs,cp_graphs --capacity 32

Default Inductor arms run as torch ships (a ``warnings.warn`` breaks the graph: HF's flex BlockMask
warns every step); ``inductor_no_break`` is default Inductor tracing over warnings as cp_inductor
does (``backend.trace_over_warnings``), to tell that part of the gain from the lowering's.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from common import arm_ratios, device_ms, print_arm_table, print_kernels, write_device_rows

ARMS = ("eager", "inductor", "cp_inductor", "floor")
GRAPH_ARMS = {"inductor_graphs": "inductor", "cp_graphs": "cp_inductor"}  # mode="reduce-overhead"
WARNINGS_BREAK = ("inductor", "inductor_graphs")  # as torch ships


def _floor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FA4 varlen over the documents the batch's cu_seqlens give (the floor's attention)."""
    b, h, t, d = query.shape
    cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value)]
    out, _ = torch.ops.cp_inductor.fa4_varlen_attention(*flat, cu, cu, None, longest, longest, scaling, True)
    return out.reshape(b, t, h, d), None


def _register_floor():
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register("fa4_floor", _floor_attention)
    AttentionMaskInterface.register("fa4_floor", lambda *args, **kwargs: None)


def build(impl: str, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, intermediate: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         attn_implementation=impl, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def batch(tokens: int, docs: int, vocab: int, seed: int = 0):
    """Input ids, and (packed) position ids restarting at each document with its cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=g, device="cpu").cuda()
    if docs <= 1:
        return {"input_ids": ids, "labels": ids}, torch.tensor([0, tokens], dtype=torch.int32, device="cuda"), tokens
    cuts = torch.sort(torch.randperm(tokens - 1, generator=g)[: docs - 1] + 1).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])])
    lengths = bounds.diff()
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None].cuda()
    cu = bounds.to(torch.int32).cuda()
    return {"input_ids": ids, "labels": ids, "position_ids": positions}, cu, int(lengths.max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", default="sdpa")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--docs", type=int, nargs="+", default=[8, 1])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    # 5632: the goals' model (issue 49's table is reproduced by it, docs/passes/document_mask.md);
    # the rows before 2026-12-07 ran 4 x hidden (8192)
    p.add_argument("--intermediate", type=int, default=5632, help="MLP width (0: 4 x hidden)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--capacity", type=int, default=32, help="cp_graphs: document_mask_capacity")
    p.add_argument("--profile", action="store_true", help="print each arm's kernels and idle time")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import cp_inductor  # noqa: F401 - registers the backend and our ops

    _register_floor()
    rows = []
    for docs in args.docs:
        inputs, cu, longest = batch(args.tokens, docs, args.vocab)
        row = {"impl": args.impl, "tokens": args.tokens, "docs": docs, "intermediate": args.intermediate or 4 * args.hidden, "ms": {}, "peak_gib": {}, "report": []}
        for arm in args.arms.split(","):
            impl = "fa4_floor" if arm == "floor" else args.impl
            model = build(impl, args.layers, args.hidden, args.heads, args.kv_heads, args.vocab,
                          args.intermediate or 4 * args.hidden)
            extra = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest} if arm == "floor" else {}
            torch._dynamo.reset()
            cp_inductor.clear_report()
            backend = GRAPH_ARMS.get(arm, "cp_inductor" if arm == "cp_inductor" else "inductor")
            # (cp_inductor's arms trace over warnings where the backend does: not on torch 2.11)
            dynamo = {"ignore_logging_functions": set() if arm in WARNINGS_BREAK else {warnings.warn}} \
                if arm in (*WARNINGS_BREAK, "inductor_no_break") else {}
            graphs = arm in GRAPH_ARMS
            options = {"cp_inductor.document_mask_capacity": args.capacity} if arm == "cp_graphs" else None
            run = model if arm == "eager" else torch.compile(model, backend=backend, options=options,
                                                             mode="reduce-overhead" if graphs else None)

            def step():
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with torch._dynamo.config.patch(dynamo):  # read where Dynamo traces
                    loss = run(**inputs, **extra, use_cache=False).loss
                loss.backward()
                for q in model.parameters():
                    q.grad = None

            torch.cuda.reset_peak_memory_stats()
            row["ms"][arm] = device_ms(step, args.iters, warmup=3)
            row["peak_gib"][arm] = torch.cuda.max_memory_allocated() / 2**30
            if args.profile:
                row.setdefault("profile", {})[arm] = print_kernels(f"{args.impl} T{args.tokens} docs {docs} {arm}", step,
                                                                   top=16)
            if arm in ("cp_inductor", "cp_graphs"):
                row["report" if arm == "cp_inductor" else "report_graphs"] = str(cp_inductor.report()).splitlines()
            if graphs:
                from torch._dynamo.utils import counters

                row.setdefault("cudagraph_skips", {})[arm] = counters["inductor"]["cudagraph_skips"]
                counters["inductor"].clear()
                torch._inductor.cudagraph_trees.reset_cudagraph_trees()
            model = run = None  # free both before the next arm builds its model
            torch.cuda.empty_cache()
            print(f"{args.impl} T{args.tokens} docs {docs} {arm}: {row['ms'][arm]:.2f} ms", file=sys.stderr, flush=True)
        arm_ratios(row)
        ms, nan = row["ms"], float("nan")
        row["graphs_speedup"] = ms.get("inductor_graphs", nan) / ms.get("cp_graphs", nan)
        rows.append(row)
    print_arm_table(rows, args.arms.split(","), {"impl": "impl", "T": "tokens", "docs": "docs"},
                    {"cp_graphs / inductor_graphs": ("graphs_speedup", ".2f")})
    for r in rows:
        if r.get("cudagraph_skips"):
            print(f"  docs {r['docs']}: graphs Inductor skipped: {r['cudagraph_skips']}")
        for line in r["report"]:
            if "attention" in line:
                print(f"  docs {r['docs']}: {line}")
    write_device_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
