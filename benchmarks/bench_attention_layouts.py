"""Attention fwd+bwd on one device with q, k, v in the memory layouts the Ulysses variants hand it.

    python benchmarks/bench_attention_layouts.py --seq 32768 --heads 16 --head-dim 128

Question it answers: at B1 S32K H32 (cp=2, 16 local heads) fused_a2a's arm spends ~0.7 ms more in
cuDNN attention than cp_off (README, "Measured"). The layouts differ only in strides:

* ``bhsd``: contiguous [B, H, S, D] (what a plain transpose + contiguous gives);
* ``bshd``: views of contiguous [B, S, H, D] (cp_off's unpack copy);
* ``sbhd``: views of [S, B, H, D] per tensor (a sequence-major receive buffer per tensor);
* ``fused``: views of ONE [S, B, Hq + 2 Hkv, D] buffer (fused_a2a's received q, k, v).

Same values in every layout; CUDA-event median per fwd+bwd, and the max difference to ``bhsd``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def layouts(b, s, hq, hkv, d, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(b, h, s, d, generator=g, dtype=dtype, device=device) for h in (hq, hkv, hkv)]
    out = {"bhsd": [x.contiguous() for x in base]}
    out["bshd"] = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in base]
    out["sbhd"] = [x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for x in base]
    fused = torch.cat([x.permute(2, 0, 1, 3) for x in base], dim=2).contiguous()  # [S, B, Htot, D]
    bounds = [0, hq, hq + hkv, hq + 2 * hkv]
    out["fused"] = [fused[:, :, lo:hi].permute(1, 2, 0, 3) for lo, hi in zip(bounds, bounds[1:])]
    return out


def step(q, k, v, dout, causal, gqa):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16, help="local query heads")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    hkv = a.kv_heads or a.heads
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    inputs = layouts(a.batch, a.seq, a.heads, hkv, a.head_dim, dtype, device)
    dout = torch.randn(a.batch, a.heads, a.seq, a.head_dim, dtype=dtype, device=device)
    gqa = hkv != a.heads
    want = step(*inputs["bhsd"], dout, True, gqa)
    rows = {}
    for name, (q, k, v) in inputs.items():
        got = step(q, k, v, dout, True, gqa)
        diff = max(float((x - y).abs().max()) for x, y in zip(got, want))
        times = []
        for _ in range(a.iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(q, k, v, dout, True, gqa)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                import time

                t0 = time.perf_counter()
                step(q, k, v, dout, True, gqa)
                times.append((time.perf_counter() - t0) * 1e3)
        strides = [tuple(x.stride()) for x in (q, k, v)]
        rows[name] = {"ms": statistics.median(times), "max_diff_vs_bhsd": diff, "strides": strides}
        print(f"{name:6s} {rows[name]['ms']:9.3f} ms  diff {diff:.1e}  q strides {strides[0]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
