"""One GPU: what splitting one attention call into G calls over head groups costs and saves.

    python benchmarks/bench_head_split.py --q-rows 32768 --kv-rows 98304 --heads 32 --kv-heads 8

The largest call of a K/V all-gather rank (a later chunk's prefix over the gathered keys, the
rank's local q heads over all K/V heads) is run forward + backward as one call and as G calls
over head groups (group g: q heads [g*Hq/G, ...), K/V heads [g*Hkv/G, ...): GQA pairs stay
together), the groups' gradients concatenated back on the head dim, as ``head_split``
emits for all-gather regions. Tensors are BSHD in memory (the groups read strided views).
Per kernel and G: median ms of the backward alone, and the peak the backward allocates above
what was alive before it (its outputs, its workspace, the concatenation). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse

import torch
from common import device_ms, write_rows

from cp_inductor.parallel.allgather import KERNELS


def split_backward(kernel, groups, do, q, k, v, out, lse, extra, causal):
    """dq, dk, dv from ``groups`` backward calls over head groups, concatenated on the head dim."""
    backward = KERNELS[kernel][1]
    if groups == 1:
        return backward(do, q, k, v, out, lse, extra, causal, None)[:3]
    hq, hkv = q.shape[1] // groups, k.shape[1] // groups
    parts = []
    for g in range(groups):
        qs, ks = slice(g * hq, (g + 1) * hq), slice(g * hkv, (g + 1) * hkv)
        parts.append(backward(do[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, qs], extra, causal, None))
    return tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-rows", type=int, default=32768)
    p.add_argument("--kv-rows", type=int, default=98304)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--kernels", nargs="+", default=["cudnn", "flash"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    bshd = lambda rows, h: torch.randn(a.batch, rows, h, a.head_dim, device=dev, dtype=dt).transpose(1, 2)  # noqa: E731
    q, k, v = bshd(a.q_rows, a.heads), bshd(a.kv_rows, a.kv_heads), bshd(a.kv_rows, a.kv_heads)
    do = bshd(a.q_rows, a.heads)
    rows = []
    for kernel in a.kernels:
        try:
            out, lse, extra = KERNELS[kernel][0](q, k, v, a.causal, None)
        except RuntimeError as error:
            print(f"{kernel}: {str(error).splitlines()[0]}")
            continue
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # as O is saved: BSHD like q
        ref = None
        for groups in a.groups:
            if a.heads % groups or a.kv_heads % groups:
                continue
            run = lambda: split_backward(kernel, groups, do, q, k, v, out, lse, extra, a.causal)  # noqa: E731
            ms = device_ms(run, a.iters)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            grads = run()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 2**30
            if ref is None:
                ref, diff = grads, 0.0
            else:
                diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads, ref))
            del grads
            rows.append({"kernel": kernel, "groups": groups, "ms": ms, "peak_gib": peak, "max_diff_vs_g1": diff})
    print(f"B{a.batch} q {a.q_rows} x kv {a.kv_rows} rows, Hq{a.heads} Hkv{a.kv_heads} D{a.head_dim} bf16"
          f"{' causal' if a.causal else ''}, attention backward, one GPU, median of {a.iters}")
    print(f"{'kernel':>7s} {'G':>3s} {'ms':>9s} {'x G=1':>7s} {'peak GiB':>9s} {'max diff':>9s}")
    base = {}
    for r in rows:
        base.setdefault(r["kernel"], r["ms"])
        print(f"{r['kernel']:>7s} {r['groups']:3d} {r['ms']:9.3f} {r['ms'] / base[r['kernel']]:7.3f} "
              f"{r['peak_gib']:9.3f} {r['max_diff_vs_g1']:9.2e}")
    write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
