"""Bar charts of benchmark JSON: each arm's median time per shape, relative to default Inductor.

    pip install -e ".[plot]"
    python benchmarks/plot.py --out docs/img/thd.png --title "..." docs/results/packed_attention_h200_d128.json
    python benchmarks/plot.py --out docs/img/ulysses.png docs/results/ulysses_h200x2_*.json

Reads the two shapes of JSON the benchmark scripts write:
- one shape per file, ``{"args": ..., "median_ms": {arm: ms}}`` (bench_ulysses.py, bench_allgather.py),
  labelled from its args (sequence, heads, head dim);
- many shapes per file, ``{"rows": [{"<arm>_ms": ms, ...}]}`` (bench_thd.py), labelled from the
  row's tokens, head dim and lengths.

A bar under 1.0 is faster than default Inductor (the ``inductor`` arm, which every table has); the
label above each bar is its time in ms. ``--arms`` picks and orders arms (default: every arm the
files share, in the order first seen).
"""

from __future__ import annotations

import argparse
import json
import sys

# What each arm is called on a chart; arms not listed keep their JSON name.
ARM_NAMES = {
    "eager": "eager", "inductor": "default Inductor", "cp_off": "cp_inductor, rewrites off",
    "cp_inductor": "cp_inductor", "cp_on": "cp_inductor", "cp_uniform": "cp_inductor, equal lengths promised",
    "native": "native CP (eager)", "native_cp": "native CP, cp_inductor", "floor": "floor (best kernel, one rank's share)",
    "dense": "dense cuDNN SDPA", "cp_cudnn": "cp_inductor on cuDNN", "cp_fa4": "cp_inductor on FA4",
}


def _shape_label(args: dict) -> str:
    seq = args.get("seq")
    heads = f"H{args.get('heads')}" + (f"/{args['kv_heads']}" if args.get("kv_heads") not in (None, args.get("heads")) else "")
    return f"B{args.get('batch', 1)} S{seq // 1024}K {heads} D{args.get('head_dim')}" if seq else str(args)


def _row_label(row: dict) -> str:
    tokens = row.get("tokens")
    mask = {"causal": " causal", "full": " full"}.get(row.get("mask"), "")
    return f"T{tokens // 1024}K D{row.get('head_dim')} {row.get('lengths', '')}{mask}".strip() if tokens else str(row.get("shape"))


def load(paths: list[str]) -> list[tuple[str, dict[str, float]]]:
    """(shape label, {arm: median ms}) per shape, in file order."""
    shapes = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if "inductor" in data.get("median_ms", {}):
            shapes.append((_shape_label(data.get("args", {})), dict(data["median_ms"])))
        for row in data.get("rows", []):
            times = {k[:-3]: v for k, v in row.items() if k.endswith("_ms") and isinstance(v, (int, float))}
            if "inductor" in times:  # the baseline every bar is read against
                shapes.append((_row_label(row), times))
    return shapes


def plot(shapes, arms: list[str], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(min(14.0, max(7.0, len(shapes) * (0.3 * len(arms) + 0.9))), 4.6))
    for i, arm in enumerate(arms):
        xs, ys, ms = [], [], []
        for j, (_, times) in enumerate(shapes):
            if arm in times:
                xs.append(j + (i - (len(arms) - 1) / 2) * width)
                ys.append(times[arm] / times["inductor"])
                ms.append(times[arm])
        bars = ax.bar(xs, ys, width, label=ARM_NAMES.get(arm, arm))
        for bar, t in zip(bars, ms):
            ax.annotate(f"{t:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=6, xytext=(0, 1), textcoords="offset points")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(shapes)), [label for label, _ in shapes], fontsize=8)
    ax.set_ylabel("time / default Inductor (lower is faster)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=min(len(arms), 5), frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="benchmark JSON files")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="median time per fwd+bwd step, relative to default Inductor")
    ap.add_argument("--arms", default=None, help="comma-separated arms, in bar order")
    a = ap.parse_args(argv)
    shapes = load(a.json)
    if not shapes:
        print("no benchmark rows in", a.json, file=sys.stderr)
        return 1
    arms = a.arms.split(",") if a.arms else list(dict.fromkeys(arm for _, times in shapes for arm in times))
    plot(shapes, arms, a.out, a.title)
    print(f"wrote {a.out}: {len(shapes)} shapes x {len(arms)} arms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
