"""The one assertion every numerics test makes on ``cp_inductor.testing.checks.check_cp_attention``."""

from __future__ import annotations


def assert_cp_results(results, tol: float, applied=("fused_a2a",), cp: int | None = None, check_layout=False):
    """Eager and compiled CP attention within ``tol`` (relative L2) of the fp64 reference for the
    output and every gradient; the report applied exactly ``applied`` and the passes really
    rewrote the forward and the backward region with each (their counters agree with the
    report). With ``cp``: the report's rows are that forward and backward Ulysses region, and with
    ``check_layout`` in the case's layout."""
    for r in results:
        for key in ("eager_vs_ref", "compiled_vs_ref"):
            for name, err in r[key].items():
                assert err < tol, f"{r['case']} {key} {name}: {err:.2e}"
        assert r["applied"] == list(applied) and r["rewritten"] == {name: 2 for name in applied}, r
        if cp is not None:
            rows = [row if check_layout else row[:3] for row in r["report"]]
            tail = (r["case"].layout,) if check_layout else ()
            assert rows == [("forward", "a2a", cp) + tail, ("backward", "a2a", cp) + tail], rows
