"""The Ulysses pack on one GPU: Inductor's generated kernel (what fused_a2a emits) vs the
hand-written Triton kernel (cp_inductor::a2a_pack) vs eager, against a plain copy of the same bytes.

    python benchmarks/bench_pack.py --json pack.json

Per shape: q [B, S/cp, Hq, D], k and v [B, S/cp, Hkv, D] in bf16 packed into
[cp, S/cp, B, (Hq+2Hkv)/cp, D]. Device time per call (``common.device_ms``: 20 back-to-back calls
per event pair, so host launch overhead is hidden); GB/s counts bytes read + written.
"""

from __future__ import annotations

import argparse
import json

import torch
from common import device_ms

from cp_inductor.lowerings import a2a_pack_triton
from cp_inductor.lowerings.a2a_pack_layout import reference

SHAPES = {  # name -> (B, S/cp, Hq, Hkv, D, cp)
    "B1 S32K H32 D128 cp2": (1, 16384, 32, 32, 128, 2),
    "B1 S32K Hq32 Hkv8 D128 cp2": (1, 16384, 32, 8, 128, 2),
    "B2 S16K H32 D256 cp2": (2, 8192, 32, 32, 256, 2),
    "B4 S8K H16 D128 cp2": (4, 4096, 16, 16, 128, 2),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    compiled = torch.compile(reference, fullgraph=True, dynamic=False)
    rows = {}
    print(f"{'shape':28s} {'arm':10s} {'ms':>8s} {'GB/s':>8s} {'vs copy':>8s}")
    for name, (b, s_l, hq, hkv, d, cp) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(b, s_l, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv)]
        want = reference(xs, cp)
        flat = torch.cat([x.flatten() for x in xs])
        dst = torch.empty_like(flat)
        arms = {
            "copy": lambda: dst.copy_(flat),
            "eager": lambda: reference(xs, cp),
            "inductor": lambda: compiled(xs, cp),
            "triton": lambda: a2a_pack_triton.pack(xs, cp),
        }
        assert torch.equal(compiled(xs, cp), want) and torch.equal(a2a_pack_triton.pack(xs, cp), want)
        nbytes = 2 * flat.numel() * flat.element_size()
        ms = {arm: device_ms(fn, iters=20, calls=20, warmup=10) for arm, fn in arms.items()}
        rows[name] = {arm: {"ms": t, "GBps": nbytes / t / 1e6} for arm, t in ms.items()}
        for arm, t in ms.items():
            print(f"{name:28s} {arm:10s} {t:8.3f} {nbytes / t / 1e6:8.0f} {ms['copy'] / t:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
