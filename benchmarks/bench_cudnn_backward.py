"""What cudnn_frontend_backward costs: cuDNN's attention backward through aten's op and through
the cuDNN frontend's op (``cp_inductor::cudnn_attention_backward``) on the same inputs, one GPU.

    python benchmarks/bench_cudnn_backward.py --json out.json

Per shape (bf16, causal): the backward alone through each op with dO laid out like O
("like_o") or read as [B, S, H, D] ("bshd", the Hugging Face epilogue's), and the forward once.
aten's plan cache ignores dO's layout, so each dO layout runs in a process of its own (the
script re-runs itself), where aten's and the frontend's calls alternate over rounds (the
frontend never touches aten's cache). Every call's gradients are checked against an fp32 math
reference. The table gives medians and the ratio frontend / aten measured in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from common import device_ms, write_rows

aten = torch.ops.aten
SHAPES = [  # B, Hq, Hkv, S, D
    (1, 32, 32, 8192, 128), (1, 32, 8, 16384, 128), (1, 16, 16, 32768, 128),
    (2, 16, 16, 8192, 256), (4, 16, 16, 4096, 64),
]


def _inputs(b, hq, hkv, s, d, layout):
    g = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    if layout == "like_o":
        dout = torch.randn(out.shape, generator=g, device="cuda", dtype=torch.bfloat16)
    else:
        dout = torch.randn(b, s, hq, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return q, k, v, out, lse, dout


def _call(op, q, k, v, out, lse, dout):
    scale = q.shape[-1] ** -0.5
    if op == "frontend":
        return torch.ops.cp_inductor.cudnn_attention_backward(dout, q, k, v, out, lse, scale, True)
    empty = torch.empty(0, device="cuda")
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, empty, empty, None, None, None, q.shape[2], k.shape[2], 0.0, True, scale=scale)


def _error(got, q, k, v, dout):
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    want = torch.autograd.grad(o, ref, dout.float())
    return max(float((a.float() - b).norm() / b.norm()) for a, b in zip(got, want))


def measure(shape, arms, iters, rounds) -> dict:
    import cp_inductor.lowerings.cudnn_backward  # noqa: F401 - registers the op

    b, hq, hkv, s, d = shape
    inputs = {layout: _inputs(b, hq, hkv, s, d, layout) for layout in {layout for _, layout in arms}}
    row = {"shape": list(shape)}
    for op, layout in arms:
        row[f"{op}_{layout}_err"] = _error(_call(op, *inputs[layout]), *(inputs[layout][i] for i in (0, 1, 2, 5)))
    times = {arm: [] for arm in arms}
    for r in range(rounds):
        for op, layout in (arms if r % 2 == 0 else arms[::-1]):
            times[(op, layout)].append(device_ms(lambda: _call(op, *inputs[layout]), iters))
    for (op, layout), ts in times.items():
        row[f"{op}_{layout}_ms"] = statistics.median(ts)
    q, k, v = inputs[arms[0][1]][:3]
    row["forward_ms"] = device_ms(lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False), iters)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help="internal: one (shape index, arms) in this process")
    a = ap.parse_args()
    if a.child is not None:
        index, arms = json.loads(a.child)
        print(json.dumps(measure(SHAPES[index], [tuple(x) for x in arms], a.iters, a.rounds)))
        return 0
    rows = []
    print(f"{'B':>2} {'Hq':>3} {'Hkv':>3} {'S':>6} {'D':>4} | {'fwd':>6} | {'aten like_o':>11} {'fe like_o':>9} {'ratio':>6} | "
          f"{'aten bshd':>9} {'fe bshd':>8} {'ratio':>6} | max err")
    for i, shape in enumerate(SHAPES):
        # one dO layout per process: aten's cache would mix two
        groups = [[("aten", layout), ("frontend", layout)] for layout in ("like_o", "bshd")]
        row = {"forward_ms": []}
        for arms in groups:
            child = subprocess.run([sys.executable, __file__, "--iters", str(a.iters), "--rounds", str(a.rounds),
                                    "--child", json.dumps([i, arms])], capture_output=True, text=True, check=True)
            got = json.loads(child.stdout.strip().splitlines()[-1])
            row["forward_ms"].append(got.pop("forward_ms"))
            row.update(got)
        row["forward_ms"] = min(row["forward_ms"])
        rows.append(row)
        errs = max(v for key, v in row.items() if key.endswith("_err"))
        print(f"{shape[0]:>2} {shape[1]:>3} {shape[2]:>3} {shape[3]:>6} {shape[4]:>4} | {row['forward_ms']:6.2f} | "
              f"{row['aten_like_o_ms']:11.3f} {row['frontend_like_o_ms']:9.3f} {row['frontend_like_o_ms'] / row['aten_like_o_ms']:6.3f} | "
              f"{row['aten_bshd_ms']:9.3f} {row['frontend_bshd_ms']:8.3f} {row['frontend_bshd_ms'] / row['aten_bshd_ms']:6.3f} | {errs:.1e}", flush=True)
        write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
