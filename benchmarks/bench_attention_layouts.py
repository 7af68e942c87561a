"""The cost map fused_a2a chooses from: attention fwd+bwd on one device with q, k, v (and dO) in
the memory layouts each way of receiving a Ulysses all-to-all hands it, and the copy that turns
the fused buffer into contiguous inputs.

    python benchmarks/bench_attention_layouts.py --grid --json out.json           # the grid
    python benchmarks/bench_attention_layouts.py --seq 32768 --heads 16           # one shape
    python benchmarks/bench_attention_layouts.py --grid --part 0/2                # half of it

Layouts (fwd+bwd, same values in each):

* ``cp_off``: q, k, v and dO contiguous [B, H, S, D] (the user's unpack copies, default Inductor);
* ``views``: q, k, v strided views of ONE received buffer [S, B, Hq + 2 Hkv, D], dO a view of its
  own [S, B, Hq, D] buffer (fused_a2a reading the buffer in place);
* ``seq_major``: q, k, v, dO views of one [S, B, H, D] buffer each (for reference);
* ``mismatched_do``: q, k, v contiguous, dO a seq-major view: dO's strides differ from the
  output's. It shares q, k, v's layout with ``cp_off``, and aten's cuDNN backward (torch < 2.14)
  caches its plan by q/k/v layout only, ignoring dO's: in one process the second of the two runs
  the first one's plan and is wrong. So it runs in a process of its own (the script re-runs
  itself), where it is right (``mismatched_do_max_diff``).

fused_a2a's ``copy`` choice hands attention exactly ``cp_off``'s inputs (one unpack copy), so its
attention time is the ``cp_off`` column. ``unpack_ms``: that copy, from the fused receive buffer
``[cp, S/cp, B, Hq + 2 Hkv, D]`` into contiguous q, k, v, compiled by Inductor, timed over
back-to-back calls (host launch overhead hidden); ``unpack_gbps`` its bandwidth (read + write).
Every layout's results are compared with ``cp_off``'s (``<layout>_max_diff``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import subprocess
import sys

import torch
import torch.nn.functional as F
from common import device_ms

LAYOUTS = ("cp_off", "views", "seq_major", "mismatched_do")
OWN_PROCESS = ("mismatched_do",)  # shares cp_off's q/k/v layout: aten's cache would mix the two


def grid() -> list[dict]:
    """Tokens per rank 4K..32K at cp=2 (S = 8K..64K after the all-to-all), local heads 4..32, head
    dims 64/128/256, MHA and GQA (4 q heads per k/v head), causal and not; plus batch > 1 points."""
    points = []
    for s, h, d, causal, group in itertools.product(
        (8192, 16384, 32768, 65536), (4, 8, 16, 32), (64, 128, 256), (True, False), (1, 4)
    ):
        work = s * s * h * d * (0.5 if causal else 1.0)
        if work > 65536 * 65536 * 16 * 128 * 0.5:  # more than B1 S64K H16 D128 causal: skip
            continue
        if not causal and (d != 128 or group != 1):  # non-causal: one column of the grid
            continue
        points.append(dict(batch=1, seq=s, heads=h, kv_heads=h // group if h >= group else h, head_dim=d, causal=causal))
    for b, s, h, d in ((4, 8192, 8, 128), (8, 4096, 16, 128), (2, 16384, 16, 256), (4, 8192, 16, 128)):
        points.append(dict(batch=b, seq=s, heads=h, kv_heads=h, head_dim=d, causal=True))
    return points


def make_inputs(p: dict, dtype, device) -> dict:
    b, s, hq, hkv, d = p["batch"], p["seq"], p["heads"], p["kv_heads"], p["head_dim"]
    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(b, h, s, d, generator=g, dtype=dtype, device=device) for h in (hq, hkv, hkv)]
    dout = torch.randn(b, hq, s, d, generator=g, dtype=dtype, device=device)
    seq_major = lambda x: x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # noqa: E731
    fused = torch.cat([x.permute(2, 0, 1, 3) for x in base], dim=2).contiguous()  # [S, B, Htot, D]
    bounds = [0, hq, hq + hkv, hq + 2 * hkv]
    views = [fused[:, :, lo:hi].permute(1, 2, 0, 3) for lo, hi in zip(bounds, bounds[1:])]
    return {
        "cp_off": ([x.contiguous() for x in base], dout.contiguous()),
        "views": (views, seq_major(dout)),
        "seq_major": ([seq_major(x) for x in base], seq_major(dout)),
        "mismatched_do": ([x.contiguous() for x in base], seq_major(dout)),
        "fused": fused,
    }


def step(q, k, v, dout, causal, gqa):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    o.backward(dout)
    return o.detach(), q.grad, k.grad, v.grad


def unpack_fn(cp: int, hq: int, hkv: int):
    """Received fused buffer [cp, S/cp, B, Htot, D] -> contiguous [B, H, S, D] q, k, v (Inductor)."""

    def unpack(buf):
        c, s_l, b, _, d = buf.shape
        bounds = [0, hq, hq + hkv, hq + 2 * hkv]
        return [
            buf[:, :, :, lo:hi].reshape(c * s_l, b, hi - lo, d).permute(1, 2, 0, 3).contiguous()
            for lo, hi in zip(bounds, bounds[1:])
        ]

    return torch.compile(unpack, fullgraph=True)


def compiled_backend(q, k, v, causal: bool, gqa: bool):
    """The SDPA backend a compiled graph is traced with (chosen on the contiguous inputs). Every
    layout runs on it: after a rewrite the graph still calls that op, whatever the strides, while
    eager dispatch could pick another kernel for strided inputs and time something else."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=gqa))
    except Exception:  # noqa: BLE001 - older signatures: let dispatch choose
        return None


def measure(p: dict, iters: int, layouts=LAYOUTS, cp: int = 2) -> dict:
    from torch.nn.attention import sdpa_kernel

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    inputs = make_inputs(p, dtype, device)
    gqa = p["kv_heads"] != p["heads"]
    backend = compiled_backend(*inputs["cp_off"][0], p["causal"], gqa)
    row = dict(p, backend=str(backend))
    # The reference: cp_off's results, from its own q/k/v layout (seq_major's where cp_off's
    # layout is the one measured: the same values, a plan cache entry of its own).
    ref = "cp_off" if "cp_off" in layouts else "seq_major"
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        if ref == "cp_off":
            want = step(*inputs[ref][0], inputs[ref][1], p["causal"], gqa)
        for name in layouts:
            (q, k, v), dout = inputs[name]
            got = step(q, k, v, dout, p["causal"], gqa)
            row[f"{name}_ms"] = device_ms(lambda: step(q, k, v, dout, p["causal"], gqa), iters)
            if ref == "seq_major":
                want = step(*inputs[ref][0], inputs[ref][1], p["causal"], gqa)
            row[f"{name}_max_diff"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, want))
    if "cp_off" in layouts:
        s, b, htot, d = inputs["fused"].shape
        buf = inputs["fused"].reshape(cp, s // cp, b, htot, d)
        unpack = unpack_fn(cp, p["heads"], p["kv_heads"])
        row["unpack_ms"] = device_ms(lambda: unpack(buf), max(iters, 10), calls=20, warmup=3)
        row["unpack_gbps"] = 2 * buf.numel() * buf.element_size() / row["unpack_ms"] / 1e6
    del inputs, want
    if cuda:
        torch.cuda.empty_cache()
    return row


def measure_cache_safe(p: dict, iters: int) -> dict:
    """Every layout of ``p``, those in OWN_PROCESS each in a fresh process."""
    row = measure(p, iters, [n for n in LAYOUTS if n not in OWN_PROCESS])
    for name in OWN_PROCESS:
        child = subprocess.run([sys.executable, __file__, "--child", json.dumps([p, name]), "--iters", str(iters)],
                               capture_output=True, text=True, check=True)
        got = json.loads(child.stdout.strip().splitlines()[-1])
        row.update({k: got[k] for k in (f"{name}_max_diff", f"{name}_ms")})
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", action="store_true", help="the whole cost-map grid")
    ap.add_argument("--part", default="0/1", help="i/n: this process takes every n-th grid point from i")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16, help="local query heads")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sample", type=int, default=1, help="with --grid: every n-th point of the part")
    ap.add_argument("--child", default=None, help="internal: one (point, layout) in this process")
    a = ap.parse_args()
    if a.child is not None:
        p, name = json.loads(a.child)
        print(json.dumps(measure(p, a.iters, [name])))
        return 0
    if a.grid:
        i, n = (int(x) for x in a.part.split("/"))
        points = grid()[i::n][::a.sample]
    else:
        points = [dict(batch=a.batch, seq=a.seq, heads=a.heads, kv_heads=a.kv_heads or a.heads, head_dim=a.head_dim, causal=a.causal)]
    rows = []
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

    def save():  # after every row: a run stopped at its time limit keeps what it measured
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": dev, "torch": torch.__version__, "iters": a.iters, "cp": 2, "rows": rows}, f, indent=1)

    print(f"{'B':>2} {'S':>6} {'Hq':>3} {'Hkv':>3} {'D':>4} {'causal':>6} " + " ".join(f"{n:>10}" for n in LAYOUTS)
          + f" {'unpack':>8} {'GB/s':>6} {'views/off':>10}")
    for p in points:
        r = measure_cache_safe(p, a.iters)
        rows.append(r)
        print(f"{p['batch']:>2} {p['seq']:>6} {p['heads']:>3} {p['kv_heads']:>3} {p['head_dim']:>4} {str(p['causal']):>6} "
              + " ".join(f"{r[n + '_ms']:10.3f}" for n in LAYOUTS)
              + f" {r['unpack_ms']:8.3f} {r['unpack_gbps']:6.0f} {r['views_ms'] / r['cp_off_ms']:10.4f}", flush=True)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
