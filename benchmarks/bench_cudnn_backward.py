"""What cudnn_frontend_backward costs: cuDNN's attention backward through aten's op and through
the cuDNN frontend's op (``cp_inductor::cudnn_attention_backward``) on the same inputs, one GPU.

    python benchmarks/bench_cudnn_backward.py --json out.json

Per shape (bf16, causal): the backward alone through each op with dO laid out like O
("like_o") or read as [B, S, H, D] ("bshd", the Hugging Face epilogue's), and the forward once.
aten's plan cache ignores dO's layout, so each dO layout runs in a process of its own (the
script re-runs itself), where the arms alternate over rounds (the frontend never touches aten's
cache). Arms: aten's op, ours (``cp_inductor::cudnn_attention_backward``) and, for reference,
the frontend's own ``torch.ops.cudnn.sdpa_bwd``, and ours called as Inductor's generated code calls it
(the kernel named directly, no dispatcher: "direct"). Every call's gradients are checked against an
fp32 math reference. Per arm, in one process:

- ``ms``: one call between two events, the host's launch work included (the GPU idles on it);
- ``queued_ms``: per call of 8 back to back, the GPU's time once the host runs ahead;
- ``host_us``: the host's time to issue one call while the GPU is busy.

``--steps`` adds whole compiled training steps (forward and backward of the Hugging Face
epilogue) under default Inductor and cp_inductor, in one process: what a user sees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

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
    if op == "direct":  # what Inductor's generated code calls: the kernel, without the dispatcher
        from cp_inductor.lowerings.cudnn_backward import _cuda_kernel

        return _cuda_kernel(dout, q, k, v, out, lse, scale, True)
    if op == "frontend_op":
        return torch.ops.cudnn.sdpa_bwd(dout, q, k, v, out, lse, scale, is_causal=True)
    empty = torch.empty(0, device="cuda")
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, empty, empty, None, None, None, q.shape[2], k.shape[2], 0.0, True, scale=scale)


def _error(got, q, k, v, dout):
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    want = torch.autograd.grad(o, ref, dout.float())
    return max(float((a.float() - b).norm() / b.norm()) for a, b in zip(got, want))


def _host_us(call, calls: int = 100) -> float:
    """Host time to issue one call while the GPU is still busy with a long sleep kernel."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def steps(shapes, iters, rounds) -> list[dict]:
    """Compiled forward+backward of the Hugging Face epilogue: default Inductor against
    cp_inductor (cuDNN backward on the frontend) in one process, alternating. Inductor hands
    aten the program's dO, cp_inductor never touches aten's cache: no mixing."""
    import cp_inductor  # noqa: F401 - registers the backend

    def f(q, k, v, w):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, h, s, d = o.shape
        return (o.transpose(1, 2).contiguous().reshape(b, s, h * d) @ w).float().pow(2).sum()

    rows = []
    for b, h, s, d in shapes:
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        w = torch.randn(h * d, h * d, generator=g, device="cuda", dtype=torch.bfloat16) / (h * d) ** 0.5
        torch._dynamo.reset()  # three arms per shape: inside Dynamo's recompile limit for f
        arms = {name: torch.compile(f, backend=name, fullgraph=True) for name in ("inductor", "cp_inductor")}
        # cp_inductor with cuDNN's backward left on aten: what the rest of cp_inductor costs
        arms["cp_inductor_aten"] = torch.compile(f, backend="cp_inductor", fullgraph=True,
                                                 options={"cp_inductor.cudnn_frontend_backward": False})
        metrics = ("step_ms", "queued_step_ms", "host_step_us")
        times = {(name, metric): [] for name in arms for metric in metrics}
        for r in range(rounds):
            for name, fn in (list(arms.items()) if r % 2 == 0 else list(arms.items())[::-1]):
                step = lambda: torch.autograd.grad(fn(q, k, v, w), (q, k, v))  # noqa: B023, E731
                times[(name, "step_ms")].append(device_ms(step, iters))
                times[(name, "queued_step_ms")].append(device_ms(step, iters, calls=4))
                times[(name, "host_step_us")].append(_host_us(step, calls=iters))
        row = {"step_shape": [b, h, s, d], **{f"{n}_{m}": statistics.median(t) for (n, m), t in times.items()}}
        # the spread over rounds: these host-bound steps move by several percent between rounds
        row.update({f"{n}_{m}_quartiles": statistics.quantiles(t, n=4) for (n, m), t in times.items() if len(t) > 1})
        for m in metrics:  # paired: each round's ratio between arms timed side by side, then the median
            for arm, base in (("cp_inductor", "inductor"), ("cp_inductor", "cp_inductor_aten")):
                paired = [a / b for a, b in zip(times[(arm, m)], times[(base, m)])]
                key = "ratio" if base == "inductor" else "ratio_on_off"
                row[f"{key}_{m}"] = statistics.median(paired)
                row[f"{key}_{m}_quartiles"] = statistics.quantiles(paired, n=4)
        print(f"step B{b} H{h} S{s} D{d} (one step ms / 4 queued ms / host us per step): "
              + ", ".join(f"{n} {row[f'{n}_step_ms']:.3f} / {row[f'{n}_queued_step_ms']:.3f} / {row[f'{n}_host_step_us']:.0f}"
                          for n in arms)
              + f"; paired cp_inductor/inductor {row['ratio_step_ms']:.3f} / {row['ratio_queued_step_ms']:.3f} / "
              f"{row['ratio_host_step_us']:.3f}, on/off {row['ratio_on_off_step_ms']:.3f} / "
              f"{row['ratio_on_off_queued_step_ms']:.3f} / {row['ratio_on_off_host_step_us']:.3f}", flush=True)
        rows.append(row)
    return rows


def measure(shape, arms, iters, rounds) -> dict:
    import cp_inductor.lowerings.cudnn_backward  # noqa: F401 - registers the op

    if any(op == "frontend_op" for op, _ in arms):
        import cudnn.sdpa.fwd.torch_op  # noqa: F401 - registers torch.ops.cudnn.sdpa_bwd

    b, hq, hkv, s, d = shape
    inputs = {layout: _inputs(b, hq, hkv, s, d, layout) for layout in {layout for _, layout in arms}}
    row = {"shape": list(shape)}
    for op, layout in arms:
        row[f"{op}_{layout}_err"] = _error(_call(op, *inputs[layout]), *(inputs[layout][i] for i in (0, 1, 2, 5)))
    times = {(arm, metric): [] for arm in arms for metric in ("ms", "queued_ms", "host_us")}
    for r in range(rounds):
        for op, layout in (arms if r % 2 == 0 else arms[::-1]):
            call = lambda: _call(op, *inputs[layout])  # noqa: E731
            times[((op, layout), "ms")].append(device_ms(call, iters))
            times[((op, layout), "queued_ms")].append(device_ms(call, iters, calls=8))
            times[((op, layout), "host_us")].append(_host_us(call))
    for ((op, layout), metric), ts in times.items():
        row[f"{op}_{layout}_{metric}"] = statistics.median(ts)
    q, k, v = inputs[arms[0][1]][:3]
    row["forward_ms"] = device_ms(lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False), iters)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", action="store_true", help="also time compiled training steps")
    ap.add_argument("--steps-only", action="store_true", help="only the compiled training steps")
    ap.add_argument("--step-rounds", type=int, default=8, help="alternating rounds per training-step arm")
    ap.add_argument("--shapes", type=int, nargs="*", default=None, help="indices into SHAPES (default: all)")
    ap.add_argument("--child", default=None, help="internal: one (shape index, arms) in this process")
    a = ap.parse_args()
    if a.child is not None:
        index, arms = json.loads(a.child)
        print(json.dumps(measure(SHAPES[index], [tuple(x) for x in arms], a.iters, a.rounds)))
        return 0
    rows = []
    print("ours / aten: ms = one call, host launch included; queued = 8 back to back; host = us to issue one call")
    print(f"{'B':>2} {'Hq':>3} {'Hkv':>3} {'S':>6} {'D':>4} {'dO':>6} | {'fwd':>6} | {'aten ms':>8} {'ours ms':>8} {'ratio':>6} | "
          f"{'aten q':>7} {'ours q':>7} {'ratio':>6} | {'host us aten/ours/direct/fe op':>31} | max err")
    for i, shape in enumerate([] if a.steps_only else SHAPES):
        if a.shapes is not None and i not in a.shapes:
            continue
        row = {"shape": list(shape), "forward_ms": []}
        for layout in ("like_o", "bshd"):  # one dO layout per process: aten's cache would mix two
            arms = [("aten", layout), ("frontend", layout), ("direct", layout), ("frontend_op", layout)]
            child = subprocess.run([sys.executable, __file__, "--iters", str(a.iters), "--rounds", str(a.rounds),
                                    "--child", json.dumps([i, arms])], capture_output=True, text=True, check=True)
            got = json.loads(child.stdout.strip().splitlines()[-1])
            row["forward_ms"].append(got.pop("forward_ms"))
            got.pop("shape")
            row.update(got)
            r = got
            errs = max(v for key, v in r.items() if key.endswith("_err"))
            print(f"{shape[0]:>2} {shape[1]:>3} {shape[2]:>3} {shape[3]:>6} {shape[4]:>4} {layout:>6} | {min(row['forward_ms']):6.2f} | "
                  f"{r[f'aten_{layout}_ms']:8.3f} {r[f'frontend_{layout}_ms']:8.3f} {r[f'frontend_{layout}_ms'] / r[f'aten_{layout}_ms']:6.3f} | "
                  f"{r[f'aten_{layout}_queued_ms']:7.3f} {r[f'frontend_{layout}_queued_ms']:7.3f} "
                  f"{r[f'frontend_{layout}_queued_ms'] / r[f'aten_{layout}_queued_ms']:6.3f} | "
                  f"{r[f'aten_{layout}_host_us']:7.1f} {r[f'frontend_{layout}_host_us']:7.1f} {r[f'direct_{layout}_host_us']:7.1f} {r[f'frontend_op_{layout}_host_us']:7.1f} | "
                  f"{errs:.1e}", flush=True)
        row["forward_ms"] = min(row["forward_ms"])
        rows.append(row)
        write_rows(a.json, a, rows)
    if a.steps or a.steps_only:
        rows.extend(steps([(1, 8, 1024, 128), (1, 8, 4096, 128), (4, 16, 4096, 64), (1, 32, 8192, 128)], a.iters,
                          a.step_rounds))
        write_rows(a.json, a, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
