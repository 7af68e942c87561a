"""One CP rank's compute under the context-parallel pass (``options={"cp_inductor.context_parallel":
group}``, the batch cut by ``shard_batch``), per style forced and ``auto``, on PyTorch's fake group
(one process plays rank R of cp; its collectives move nothing, so the times are that rank's
compute). Prints tables, writes JSON.

- ``--level attention``: one attention call (rotary, then SDPA with HF's document mask on a pack,
  ``is_causal`` on one document) fwd+bwd, beside the cost model's predicted compute for it
  (``passes/analysis/context_parallel_cost.py``) and the style ``auto`` chose;
- ``--level model``: HF transformers' Llama training step, beside the single-device step on the
  full batch under cp_inductor without CP (its time / cp is what perfect CP would give one rank).

The styles are compiled first, then timed in alternating rounds (``--rounds`` x ``--iters``).

    python benchmarks/bench_auto_cp.py --level attention --cp 2 4 8 --tokens 65536 --docs 1 16 --json out.json
    python benchmarks/bench_auto_cp.py --level attention --docs 1 --styles allgather ulysses ring

(The ring takes rows of one document only: ``--docs 1``. ``auto`` does not price it yet,
docs/passes/context_parallel.md.)
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import alternating_rounds, device_ms, write_rows

from cp_inductor.passes.analysis import context_parallel_cost as cost

STYLES = ("allgather", "ulysses", "auto")
DEVICE = "cuda"  # --device cpu: a smoke run of the script itself
COST_DEVICE = ""  # --cost-device: price with another machine's tables (default: this one's)


def _fake_group(rank: int, cp: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    return dist.group.WORLD


def _compiled(fn, style: str):
    import cp_inductor

    cp_inductor.clear_report()
    return torch.compile(fn, backend="cp_inductor", options={
        "cp_inductor.context_parallel": dist.group.WORLD, "cp_inductor.context_parallel_style": style,
        "cp_inductor.context_parallel_cost_device": COST_DEVICE})


def _chosen() -> tuple[str, str]:
    import cp_inductor

    lines = [r.line() for r in cp_inductor.report().varlen if r.layout == "cp"]
    return (lines[0].split(": ")[1].split(",")[0], lines[0]) if lines else ("none", "")


def _packed(tokens: int, docs: int) -> dict:
    g = torch.Generator().manual_seed(tokens + docs)
    if docs <= 1:
        return {"input_ids": torch.zeros(1, tokens, dtype=torch.long, device=DEVICE),
                "position_ids": torch.arange(tokens, device=DEVICE)[None]}
    cuts = torch.sort(torch.randperm(tokens - 1, generator=g)[: docs - 1] + 1).values
    lengths = torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]).diff()
    return {"input_ids": torch.zeros(1, tokens, dtype=torch.long, device=DEVICE),
            "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()])[None].to(DEVICE)}


def _predicted(args, local: dict, cp: int, causal_only: bool, ring_backward: str) -> dict:
    """The cost model's estimate per style for this call, from the layout shard_batch kept."""
    from cp_inductor.batch_layout import shard_of

    shard = shard_of(local["position_ids"])
    ids = torch.zeros_like(shard.doc_ids) if causal_only else shard.doc_ids
    call = cost.Call(1, local["position_ids"].shape[1], args.heads, args.kv_heads, args.head_dim, True, 2, "bfloat16")
    works = cost.work(ids, shard.key_positions, cp, True, args.heads)
    here = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    priced, _ = cost.estimates(call, works, cp, COST_DEVICE or here, ring_backward)
    return {s: e for s, e in priced.items() if isinstance(e, cost.Estimate)}


def attention_rank(args, cp: int, tokens: int, docs: int) -> list[dict]:
    from cp_inductor.parallel import shard_batch
    from cp_inductor.testing.auto_cp import document_mask, rotary

    group = _fake_group(args.rank, cp)
    rows = []
    try:
        local = shard_batch(_packed(tokens, docs), group)
        positions, t_local = local["position_ids"], local["position_ids"].shape[1]

        def attention(q, k, v, position_ids):
            q, k = rotary(q, position_ids), rotary(k, position_ids)
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
            if docs <= 1:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(position_ids), enable_gqa=True)

        def tensor(heads):
            return torch.randn(1, t_local, heads, args.head_dim, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)

        q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
        ring_backward = cost.ring_backward_of(q)
        predicted = _predicted(args, local, cp, docs <= 1, ring_backward)
        arms, chosen = {}, {}
        torch._dynamo.reset()
        for style in args.styles:
            fn = _compiled(attention, style)

            def step(fn=fn):
                torch.autograd.grad(fn(q, k, v, positions).sum(), (q, k, v))

            step()
            arms[style], chosen[style] = step, _chosen()
        rows = []
        for style, (ms, spread, peak) in _timed(arms, args).items():
            picked, line = chosen[style]
            guess = predicted.get(picked)
            rows.append({"level": "attention", "cp": cp, "rank": args.rank, "tokens": tokens, "docs": docs,
                         "style": style, "chosen": picked, "ms": ms, "round_ms": spread,
                         "predicted_compute_ms": guess.compute_ms if guess else None,
                         "predicted_comm_ms": guess.comm_ms if guess else None,
                         "model_ms": guess.model_ms if guess else None,
                         "peak_gib": peak, "report": line, "ring_backward": ring_backward})
        return rows
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def _timed(arms: dict, args) -> dict:
    """Per arm (median ms, each round's ms, peak GiB): the arms alternate over ``args.rounds``
    rounds of ``args.iters`` timed steps each, so drift of the clock or the host hits all alike."""
    peaks = {}

    def time_arm(name):
        _reset_peak()
        ms = device_ms(arms[name], args.iters, warmup=1)
        peaks[name] = _peak_gib()
        return [ms]

    rounds = alternating_rounds(list(arms), args.rounds, time_arm)
    return {n: (statistics.median(r), r, peaks[n]) for n, r in rounds.items()}


def _reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def _step(model, inputs):
    def run():
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
    return run


def model_rank(args, cp: int, tokens: int, docs: int, alone: float) -> list[dict]:
    from bench_hf_masks import batch as make_batch
    from bench_hf_masks import build

    from cp_inductor.parallel import shard_batch

    group = _fake_group(args.rank, cp)
    rows = []
    try:
        full, _, _ = make_batch(tokens, docs, args.vocab)
        local = shard_batch({**full, "use_cache": False}, group)
        arms, chosen = {}, {}
        torch._dynamo.reset()
        for style in args.styles:
            model = build("sdpa", args.layers, args.heads * args.head_dim, args.heads, args.kv_heads, args.vocab)
            arms[style] = _step(_compiled(model, style), local)
            arms[style]()
            chosen[style] = _chosen()[0]
        for style, (ms, spread, peak) in _timed(arms, args).items():
            rows.append({"level": "model", "cp": cp, "rank": args.rank, "tokens": tokens, "docs": docs, "style": style,
                         "chosen": chosen[style], "ms": ms, "round_ms": spread, "single_device_ms": alone,
                         "peak_gib": peak})
        return rows
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def single_device(args, tokens: int, docs: int) -> float:
    from bench_hf_masks import batch as make_batch
    from bench_hf_masks import build

    torch._dynamo.reset()
    model = build("sdpa", args.layers, args.heads * args.head_dim, args.heads, args.kv_heads, args.vocab)
    full, _, _ = make_batch(tokens, docs, args.vocab)
    return device_ms(_step(torch.compile(model, backend="cp_inductor"), {**full, "use_cache": False}), args.iters)


def _print(row: dict) -> None:
    guess = row.get("predicted_compute_ms")
    extra = (f" {guess:>10.2f} {row['ms'] / guess:>6.3f}" if guess else f" {'-':>10} {'-':>6}") \
        if row["level"] == "attention" else f" {row['single_device_ms'] / row['cp']:>10.2f} {'':>6}"
    print(f"{row['level']:>9} {row['tokens']:>7} {row['docs']:>4} {row['cp']:>3} {row['style']:>9} {row['chosen']:>9} "
          f"{row['ms']:>9.2f}{extra} {row['peak_gib']:>6.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--level", choices=["attention", "model", "both"], default="attention")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536])
    ap.add_argument("--docs", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds the styles alternate over")
    ap.add_argument("--styles", nargs="+", default=list(STYLES), help="also: ring (rows of one document)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cost-device", default="", help='price with the tables of this device, e.g. "NVIDIA H200"')
    args = ap.parse_args()
    global DEVICE, COST_DEVICE
    DEVICE, COST_DEVICE = args.device, args.cost_device
    rows = []
    print(f"{'level':>9} {'T':>7} {'docs':>4} {'cp':>3} {'style':>9} {'chosen':>9} {'ms':>9} "
          f"{'pred / 1cp':>10} {'meas/pred':>6} {'GiB':>6}  (attention: predicted compute; model: single-device / cp)")
    for tokens in args.tokens:
        for docs in args.docs:
            alone = single_device(args, tokens, docs) if args.level != "attention" else None
            for cp in args.cp:
                if args.level != "model":
                    rows += attention_rank(args, cp, tokens, docs)
                    [_print(r) for r in rows[-len(args.styles):]]
                if args.level != "attention":
                    rows += model_rank(args, cp, tokens, docs, alone)
                    [_print(r) for r in rows[-len(args.styles):]]
                write_rows(args.json, args, rows)


if __name__ == "__main__":
    main()
