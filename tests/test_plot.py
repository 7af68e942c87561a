"""benchmarks/plot.py reads both JSON shapes the benchmark scripts write (no matplotlib needed)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plot  # noqa: E402


def test_reads_one_shape_per_file_and_rows_per_file():
    results = ROOT / "benchmarks" / "results"
    one = plot.load([str(results / "h200x2_table_run11_2.json")])
    assert [label for label, _ in one] == ["B4 S8K H16 D128"]
    assert one[0][1]["cp_inductor"] < one[0][1]["inductor"]
    rows = plot.load([str(results / "h200_thd_d256_2026-12-01.json")])
    assert [label for label, _ in rows] == ["T32K D256 random", "T32K D256 equal"]
    assert {"eager", "inductor", "cp_on", "floor"} <= set(rows[0][1])
    assert not any(key.endswith("_ms") or "peak" in key for _, times in rows for key in times)
