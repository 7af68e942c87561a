"""The attention-provider cost map: fwd+bwd time of each kernel per shape bucket, one GPU.

    python benchmarks/bench_providers.py --layouts thd dense --map cp_inductor/cost_data/attention_providers_h200.json

Per bucket (bf16; Hq32 with Hkv8 (GQA) and Hkv32 (MHA); head_dim 64/128/256; causal and not),
alternating providers over rounds in one process, median fwd+bwd ms of:

- ``thd`` (8 random documents per pack, T = 8K-64K tokens): ``program`` = torchtitan's
  ``varlen_attn`` (flash-2, K/V repeated), ``cudnn`` = our ragged op (``cp_inductor::varlen_attention``,
  GQA as is), ``fa4`` = ``cp_inductor::fa4_varlen_attention`` (GQA as is);
- ``dense`` (B1, S = 4K-32K): ``program`` = ``F.scaled_dot_product_attention`` as a program calls
  it (``enable_gqa`` for GQA; aten picks the kernel), ``fa4`` = ``cp_inductor::fa4_sdpa``.

Each row is also checked: every provider's output and gradients against the first provider's
(relative error printed). ``--map`` writes what ``passes/analysis/attention_provider.py`` reads.

``--split`` (``thd`` only) times each direction apart instead: the forward of cuDNN's ragged op
and of FA4's varlen op, and each one's backward fed by either forward (the lse transposed between
their layouts), to price a forward of one provider with the backward of the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from common import alternating_rounds, device_ms, fill_free_memory, write_rows

from cp_inductor.testing import varlen_programs as vp
from bench_thd import lengths_for

HQ = 32


def pack_lengths(layout: str, tokens: int, head_dim: int) -> list[int]:
    """The documents of one row: 8 random ones per pack (seeded by T + D), one for dense."""
    return lengths_for("random", tokens, seed=tokens + head_dim) if layout == "thd" else [tokens]


def thd_providers(tokens, heads_kv, head_dim, causal):
    import cp_inductor.lowerings.fa4_attention  # noqa: F401 - registers the ops (ours and FA4's)

    lengths = pack_lengths("thd", tokens, head_dim)
    q, k, v, cu, m = vp.pack(lengths, HQ, heads_kv, head_dim, dtype=torch.bfloat16, device="cuda", seed=len(lengths))
    scale = head_dim ** -0.5
    ops = torch.ops.cp_inductor
    calls = {
        "program": lambda q, k, v: vp.torchtitan_style(q, k, v, cu, m, causal),
        "cudnn": lambda q, k, v: ops.varlen_attention(q, k, v, cu, cu, m, m, scale, causal)[0],
        "fa4": lambda q, k, v: ops.fa4_varlen_attention(q, k, v, cu, cu, None, m, m, scale, causal)[0],
    }
    return (q, k, v), calls


def dense_providers(tokens, heads_kv, head_dim, causal):
    import cp_inductor.lowerings.fa4_attention  # noqa: F401

    g = torch.Generator(device="cuda").manual_seed(tokens + head_dim)
    q = torch.randn(1, HQ, tokens, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, heads_kv, tokens, head_dim, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    calls = {
        "program": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads_kv != HQ),
        "fa4": lambda q, k, v: torch.ops.cp_inductor.fa4_sdpa(q, k, v, head_dim ** -0.5, causal)[0],
    }
    return (q, k, v), calls


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(inputs, calls, rounds, iters):
    ins = [t.detach().requires_grad_() for t in inputs]
    grad = torch.randn_like(calls["program"](*ins))
    steps = {n: (lambda f=f: torch.autograd.grad(f(*ins), ins, grad)) for n, f in calls.items()}
    results = {n: (calls[n](*ins), *steps[n]()) for n in calls}  # the first call JITs / builds
    errors = {n: max(rel(x, y) for x, y in zip(results[n], results["program"])) for n in calls}
    medians = alternating_rounds(list(calls), rounds, lambda n: [device_ms(steps[n], iters, warmup=2)])
    return {n: statistics.median(ms) for n, ms in medians.items()}, errors


def split_directions(tokens, heads_kv, head_dim, causal, rounds, iters):
    """Forward and backward of each thd provider timed apart; each backward from each forward."""
    import cp_inductor.lowerings.fa4_attention  # noqa: F401

    lengths = pack_lengths("thd", tokens, head_dim)
    q, k, v, cu, m = vp.pack(lengths, HQ, heads_kv, head_dim, dtype=torch.bfloat16, device="cuda", seed=len(lengths))
    scale, ops = head_dim ** -0.5, torch.ops.cp_inductor
    forward = {"cudnn": lambda: ops.varlen_attention(q, k, v, cu, cu, m, m, scale, causal),
               "fa4": lambda: ops.fa4_varlen_attention(q, k, v, cu, cu, None, m, m, scale, causal)}
    saved = {"cudnn": forward["cudnn"](), "fa4": forward["fa4"]()}
    grad = torch.randn_like(q)

    def lse_for(backward: str, made_by: str):  # cuDNN's lse is [T, H], FA4's [H, T]
        lse = saved[made_by][1]
        return lse if backward == made_by else lse.transpose(0, 1).contiguous()

    def backward(name: str, made_by: str):
        out, lse = saved[made_by][0], lse_for(name, made_by)
        if name == "cudnn":
            return lambda: ops.varlen_attention_backward(grad, q, k, v, out, lse, cu, cu, m, m, scale, causal)
        return lambda: ops.fa4_varlen_attention_backward(grad, None, q, k, v, out, lse, cu, cu, None, m, m, scale, causal)

    arms = {f"fwd_{n}": f for n, f in forward.items()}
    arms.update({f"bwd_{b}_from_{f}": backward(b, f) for b in forward for f in forward})
    want = arms["bwd_fa4_from_fa4"]()
    errors = {n: max(rel(x, y) for x, y in zip(arms[n](), want)) for n in arms if n.startswith("bwd")}
    errors["fwd"] = rel(saved["cudnn"][0], saved["fa4"][0])
    medians = alternating_rounds(list(arms), rounds, lambda n: [device_ms(arms[n], iters, warmup=2)])
    return {n: statistics.median(ms) for n, ms in medians.items()}, errors, lengths


def main_split(a) -> int:
    rows = []
    for head_dim in a.head_dims:
        for heads_kv in a.kv_heads:
            for causal in (True, False):
                for tokens in a.tokens:
                    ms, errors, lengths = split_directions(tokens, heads_kv, head_dim, causal, a.rounds, a.iters)
                    pairs = {f"{f}+{b}": ms[f"fwd_{f}"] + ms[f"bwd_{b}_from_{f}"] for f in ("cudnn", "fa4") for b in ("cudnn", "fa4")}
                    rows.append({"layout": "thd", "tokens": tokens, "heads_q": HQ, "heads_kv": heads_kv, "head_dim": head_dim,
                                 "causal": causal, "ms": ms, "pairs_ms": pairs, "rel_err": errors, "lengths": lengths})
                    best = min(pairs, key=pairs.get)
                    print(f"T{tokens} Hkv{heads_kv} D{head_dim} {'causal' if causal else 'full'}: "
                          + " ".join(f"{n} {t:.3f}" for n, t in ms.items()) + " | "
                          + " ".join(f"{n} {t:.3f}" for n, t in pairs.items())
                          + f" | best {best}, fa4+fa4 / best {pairs['fa4+fa4'] / pairs[best]:.3f}, max rel err "
                          f"{max(errors.values()):.1e}", flush=True)
                    torch.cuda.empty_cache()
                    write_rows(a.json, a, rows)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="+", default=["thd", "dense"], choices=["thd", "dense"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--map", help="write (merge into) the cost map the backend reads")
    ap.add_argument("--split", action="store_true", help="each direction apart, and mixed forward/backward pairs")
    a = ap.parse_args()
    print(f"filled {fill_free_memory(0.3):.0f} GiB with random values")
    if a.split:
        return main_split(a)
    build = {"thd": thd_providers, "dense": dense_providers}
    rows = []
    print(f"{'layout':>6} {'T':>6} {'Hkv':>3} {'D':>3} {'mask':>6} | {'program':>8} {'cudnn':>8} {'fa4':>8} | best  program/best  max rel err")
    for layout in a.layouts:
        for head_dim in a.head_dims:
            for heads_kv in a.kv_heads:
                for causal in (True, False):
                    for tokens in a.tokens:
                        inputs, calls = build[layout](tokens, heads_kv, head_dim, causal)
                        ms, errors = measure(inputs, calls, a.rounds, a.iters)
                        best = min(ms, key=ms.get)
                        row = {"layout": layout, "tokens": tokens, "heads_q": HQ, "heads_kv": heads_kv, "head_dim": head_dim,
                               "causal": causal, "dtype": "bfloat16", "ms": ms, "rel_err": errors,
                               "lengths": pack_lengths(layout, tokens, head_dim)}
                        rows.append(row)
                        cells = " ".join(f"{ms.get(p, float('nan')):8.3f}" for p in ("program", "cudnn", "fa4"))
                        print(f"{layout:>6} {tokens:>6} {heads_kv:>3} {head_dim:>3} {'causal' if causal else 'full':>6} | {cells} | "
                              f"{best:>5} {ms['program'] / ms[best]:6.3f}  {max(errors.values()):.1e}", flush=True)
                        del inputs, calls
                        torch.cuda.empty_cache()
                        write_rows(a.json, a, rows)  # after every row: a run cut short keeps what it measured
                        if a.map:
                            write_map(a.map, rows)
    return 0


def write_map(path: str, rows: list) -> None:
    major, minor = torch.cuda.get_device_capability()
    try:
        with open(path) as f:
            old = json.load(f)
    except FileNotFoundError:
        old = {"rows": []}
    keys = ("layout", "tokens", "heads_q", "heads_kv", "head_dim", "causal", "dtype")
    fresh = {tuple(r[k] for k in keys) for r in rows}
    kept = [r for r in old["rows"] if tuple(r[k] for k in keys) not in fresh]
    data = {"source": "benchmarks/bench_providers.py", "device": torch.cuda.get_device_name(), "arch": f"sm{major}{minor}",
            "torch": torch.__version__, "rows": kept + [{k: r[k] for k in (*keys, "ms", "lengths")} for r in rows]}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
