"""Calibrates the context-parallel cost model (``passes/analysis/context_parallel_cost.py``) from
``bench_auto_cp.py --level attention`` runs: per forced style, the model's uncalibrated terms
(``model_ms``, ``key_mib``) beside the measured one-rank compute, written as the rows of
``cp_inductor/cost_data/context_parallel_styles.json`` that ``calibration()`` is fitted to.

Every row's terms are recomputed here on the CPU from its shape (the same pack, the same
``shard_batch`` layout on the fake group, the same tables), so runs of any age calibrate alike.
``--check`` runs are held out: the fit to ``--fit`` is printed against them, not fitted to them.

    python benchmarks/calibrate_context_parallel.py --fit run1.json --check run2.json [--write]
    python benchmarks/calibrate_context_parallel.py --styles ring --fit ring_run.json --write
    python benchmarks/calibrate_context_parallel.py --styles ring --ring-backward aten --fit ring_aten.json --write

The ring's rows are fitted per cuDNN backward (``--ring-backward``: the one its run's eager steps
took, which ``bench_auto_cp.py`` records per row; older runs say nothing: the frontend's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import bench_auto_cp as bench
from cp_inductor.passes.analysis import context_parallel_cost as cost

STYLES_JSON = cost.DATA / "context_parallel_styles.json"


def _terms(row: dict, args, cache: dict) -> tuple[float, float]:
    """The row's (model_ms, key_mib), recomputed from its shape."""
    from cp_inductor.parallel import shard_batch

    from cp_inductor.batch_layout import shard_of

    key = (row["tokens"], row["docs"], row["cp"], row["rank"])
    if key not in cache:
        bench.DEVICE = "cpu"
        group = bench._fake_group(row["rank"], row["cp"])
        try:
            positions = shard_batch(bench._packed(row["tokens"], row["docs"]), group)["position_ids"]
        finally:
            dist.destroy_process_group()
        shard = shard_of(positions)
        ids = torch.zeros_like(shard.doc_ids) if row["docs"] <= 1 else shard.doc_ids
        call = cost.Call(1, positions.shape[1], args.heads, args.kv_heads, args.head_dim, True, 2, "bfloat16")
        cache[key] = cost.model_terms(call, cost.work(ids, shard.key_positions, row["cp"], True, args.heads), row["cp"],
                                      args.cost_device)
    return cache[key][row["style"]]


def rows_of(paths: list[str], args, cache: dict) -> list[dict]:
    out = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            # a forced style that could not take the call ran as another (the ring on a pack)
            if r["level"] != "attention" or r["style"] not in args.styles or r["chosen"] != r["style"]:
                continue
            model, key_mib = _terms(r, args, cache)
            backward = {"backward": r.get("ring_backward", args.ring_backward)} if r["style"] == cost.RING else {}
            out.append({"style": r["style"], "tokens": r["tokens"], "documents": r["docs"], "cp": r["cp"],
                        "heads_q": args.heads, "heads_kv": args.kv_heads, "head_dim": args.head_dim,
                        "model_ms": round(model, 3), "key_mib": round(key_mib, 3),
                        "measured_ms": round(r["ms"], 3), **backward, "run": Path(path).name})
    return out


def _replaced(row: dict, args) -> bool:
    """Whether ``--write`` replaces this stored row (its style fitted now; a ring row: of this backward)."""
    return row["style"] in args.styles and (row["style"] != cost.RING or cost.backward_of(row) == args.ring_backward)


def _print(rows: list[dict], fits: dict, label: str, ring_backward: str) -> float:
    worst = 0.0
    print(f"{label}:\n{'style':>9} {'T':>7} {'docs':>4} {'cp':>3} {'model':>8} {'key MiB':>8} {'measured':>9} "
          f"{'predicted':>9} {'meas/pred':>9}")
    for r in sorted(rows, key=lambda r: (r["style"], r["tokens"], r["documents"], r["cp"])):
        if r["style"] not in fits or (r["style"] == cost.RING and cost.backward_of(r) != ring_backward):
            continue
        predicted = fits[r["style"]].ms(r["model_ms"], r["key_mib"], cost.host_steps(r["style"], r["cp"]))
        worst = max(worst, abs(r["measured_ms"] / predicted - 1))
        print(f"{r['style']:>9} {r['tokens']:>7} {r['documents']:>4} {r['cp']:>3} {r['model_ms']:>8.2f} {r['key_mib']:>8.1f} "
              f"{r['measured_ms']:>9.2f} {predicted:>9.2f} {r['measured_ms'] / predicted:>9.3f}")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", nargs="+", required=True, help="bench_auto_cp.py JSON runs to fit")
    ap.add_argument("--check", nargs="*", default=[], help="runs held out: printed against the fit")
    ap.add_argument("--cost-device", default="NVIDIA H200", help="whose tables the model was read on")
    ap.add_argument("--measured-on", default="", help="the GPU the runs were timed on")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--styles", nargs="+", default=None,
                    help=f"the styles fitted from --fit (default: those it has); {STYLES_JSON.name}'s rows of the others are kept")
    ap.add_argument("--ring-backward", choices=(cost.FRONTEND, cost.ATEN), default=cost.FRONTEND,
                    help="the cuDNN backward the ring's rows ran where a run does not say; the ring's line of it is fitted")
    ap.add_argument("--write", action="store_true", help=f"replace {STYLES_JSON.name}'s rows of --styles with the --fit rows")
    args = ap.parse_args()
    cache: dict = {}
    if args.styles is None:
        args.styles = sorted({r["style"] for p in args.fit for r in json.loads(Path(p).read_text())["rows"]
                              if r["style"] in cost.PRICED})
    kept = [r for r in json.loads(STYLES_JSON.read_text())["rows"] if not _replaced(r, args)]
    fit_rows, check_rows = rows_of(args.fit, args, cache), rows_of(args.check, args, cache)
    fits = cost.fit_lines(kept + fit_rows, args.ring_backward)
    print("  ".join(f"{s}: {f.slope:.3f} x model + {f.per_mib:.4f} ms/MiB x key MiB + {f.intercept:.2f} ms"
                    + (f", at least {f.per_step:.2f} ms x cp" if f.per_step else "") for s, f in fits.items()))
    worst = {"fitted": _print(fit_rows, fits, "fitted rows", args.ring_backward)}
    if check_rows:
        worst["held out"] = _print(check_rows, fits, "held-out rows", args.ring_backward)
    print("worst |measured / predicted - 1|: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))
    if args.write:
        STYLES_JSON.write_text(json.dumps({
            "source": "benchmarks/calibrate_context_parallel.py --fit " + " ".join(sorted({r["run"] for r in kept + fit_rows})),
            "measured_on": args.measured_on, "tables": args.cost_device,
            "what": "one rank's fwd+bwd of one attention call on the fake group (rotary embedding included), "
                    "beside the model's uncalibrated terms",
            "rows": kept + fit_rows}, indent=1) + "\n")
        print(f"wrote {STYLES_JSON}")


if __name__ == "__main__":
    main()
