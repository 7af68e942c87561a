"""One GPU: what splitting causal load-balanced all-gather attention into kernel calls costs.

    python benchmarks/bench_allgather_blocks.py --seq 32768 --heads 32 --kv-heads 8 --cp 2 --json out.json

Every rank of K/V all-gather CP does the floor's FLOPs (Hq/cp heads over the whole sequence, one
causal call) as several calls of all Hq heads: per local chunk c (rank r holds chunks r and
2cp-1-r of 2cp) its causal diagonal block and, for c > 0, its prefix of c chunks in full. This
times, per simulated rank, cuDNN attention forward + backward of those call sets only (no
collectives, no log-sum-exp merges: random gathered K/V) against the floor, for the call plans

* ``separate``: what ``allgather_attention`` runs (one diagonal call per chunk),
* ``batched``: both chunks' diagonal blocks as ONE causal call of batch 2B (a view of BSHD q/k/v),
* ``shared_prefix``: batched diagonals, the prefix both chunks share as one batch-2B call, the
  rest of the later chunk's prefix alone,
* ``runs``: consecutive chunks as one query block (rank cp-1 holds chunks cp-1 and cp, one
  contiguous stretch): its prefix in one call, its own keys as one square causal call; other
  ranks as ``separate``.

Prints a table (median ms, x floor: the median of per-round ratios) and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from common import alternating_rounds, device_ms, write_rows
from torch.nn.attention import SDPBackend, sdpa_kernel

class joined(tuple):
    """Query chunks that are one stretch of the sequence: flattened into it, not into the batch."""


PLANS = ("separate", "batched", "shared_prefix", "runs")


def calls(plan: str, chunks: tuple[int, int], length: int) -> list[tuple[str, tuple, tuple, bool]]:
    """(q rows, key rows, causal) per call: q rows as (batch chunks, ...), keys as a range; a
    ``joined`` tuple of q rows is one stretch of the sequence (not batched)."""
    a, b = chunks
    out = []
    if plan == "runs" and b == a + 1:
        return [(joined((a, b)), (0, a * length), False), (joined((a, b)), None, True)]
    if plan in ("separate", "runs"):
        out += [((c,), (c * length, (c + 1) * length), True) for c in chunks]
    else:
        out.append(((a, b), None, True))  # diagonal blocks, batched
    if plan in ("separate", "batched"):
        out += [((c,), (0, c * length), False) for c in chunks if c > 0]
    else:
        if a > 0:
            out.append(((a, b), (0, a * length), False))
        out.append(((b,), (a * length, b * length), False))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cp", type=int, nargs="+", default=[2])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    b, s, hq, hkv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    rows = []

    def fwd_bwd(pairs):
        def step():
            for q, k, v in pairs:
                q.grad = k.grad = v.grad = None
                out = F.scaled_dot_product_attention(q, k, v, is_causal=q.causal, enable_gqa=hq != hkv)
                out.backward(torch.ones_like(out))

        return step

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for cp in a.cp:
            # Every call set of this cp (the floor, each rank's plans) is built first, then timed in
            # rounds of alternating order: the same calls timed one after the other drifted by up
            # to 5% on H200, so ratios are paired per round.
            fq, fk = (torch.randn(b, h // cp, s, d, device=dev, dtype=dt) for h in (hq, hkv))
            fq.causal = True
            sets = {("-", "floor"): [(fq.requires_grad_(), fk.clone().requires_grad_(), fk.clone().requires_grad_())]}
            length = s // (2 * cp)
            keys = [torch.randn(b, s, hkv, d, device=dev, dtype=dt) for _ in range(2)]
            local_q = torch.randn(b, 2, length, hq, d, device=dev, dtype=dt)
            for rank in range(cp):
                chunks = (rank, 2 * cp - 1 - rank)
                local_kv = [x.view(b, 2 * cp, length, hkv, d)[:, list(chunks)] for x in keys]
                for plan in PLANS:
                    pairs = []
                    for rows_q, key_range, causal in calls(plan, chunks, length):
                        idx = [chunks.index(c) for c in rows_q]
                        dims = (1, 2) if isinstance(rows_q, joined) else (0, 1)
                        q = local_q[:, idx].flatten(*dims).transpose(1, 2).detach().requires_grad_()
                        if key_range is None:  # diagonal blocks: the rank's own K/V, batched like q
                            k, v = (x[:, idx].flatten(*dims).transpose(1, 2).detach().requires_grad_() for x in local_kv)
                        else:
                            k, v = (x[:, key_range[0]:key_range[1]].transpose(1, 2).detach().requires_grad_() for x in keys)
                            if len(idx) > 1 and not isinstance(rows_q, joined):
                                k, v = (t.detach().unsqueeze(1).expand(b, len(idx), *t.shape[1:]).flatten(0, 1).requires_grad_() for t in (k, v))
                        q.causal = causal
                        pairs.append((q, k, v))
                    sets[(rank, plan)] = pairs
            steps = {key: fwd_bwd(pairs) for key, pairs in sets.items()}
            medians = alternating_rounds(list(steps), a.rounds, lambda key: [device_ms(steps[key], a.iters)])
            for (rank, plan), ms in medians.items():
                ratios = [m / f for m, f in zip(ms, medians[("-", "floor")])]
                rows.append({"cp": cp, "rank": rank, "plan": plan, "calls": len(sets[(rank, plan)]),
                             "ms": statistics.median(ms), "x_floor": statistics.median(ratios)})
            steps.clear()  # this cp's tensors go before the next cp's
            sets.clear()
    print(f"B{b} S{s} Hq{hq} Hkv{hkv} D{d} bf16 causal, cuDNN fwd+bwd, one GPU, {a.rounds} rounds of "
          f"alternating order x median of {a.iters}; x floor: median of per-round ratios")
    print(f"{'cp':>3s} {'rank':>5s} {'plan':>14s} {'calls':>6s} {'ms':>9s} {'x floor':>8s}")
    for r in rows:
        print(f"{r['cp']:3d} {str(r['rank']):>5s} {r['plan']:>14s} {r['calls']:6d} {r['ms']:9.3f} {r['x_floor']:8.3f}")
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
