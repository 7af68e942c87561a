"""benchmarks/plot.py reads both JSON shapes the benchmark scripts write (no matplotlib needed)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plot  # noqa: E402


def test_reads_one_shape_per_file_and_rows_per_file():
    results = ROOT / "docs" / "results"
    one = plot.load([str(results / "ulysses_h200x2_b4_s8k_h16_d128.json")])
    assert [label for label, _ in one] == ["B4 S8K H16 D128"]
    assert one[0][1]["cp_inductor"] < one[0][1]["inductor"]
    rows = plot.load([str(results / "packed_attention_h200_d256.json")])
    assert [label for label, _ in rows] == ["T32K D256 random causal", "T32K D256 random full"]
    assert {"eager", "inductor", "cp_on", "cp_fa4", "floor"} <= set(rows[0][1])
    assert not any(key.endswith("_ms") or "peak" in key for _, times in rows for key in times)
