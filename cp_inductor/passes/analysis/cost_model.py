"""How fused_a2a hands attention what one all-to-all received: as strided views, copied out, or
not at all (the region left as written).

After fused_a2a's single all-to-all the q, k and v of this rank's heads sit side by side in one
sequence-major buffer ``[S, B, Hq + 2 Hkv, D]``. The choices:

* ``views``: attention reads strided views of the buffer (no copy); dO, in the backward, a
  sequence-major view of its own buffer.
* ``copy``: one copy puts q, k, v into the layout attention had before the rewrite (the
  user's own unpack): attention sees exactly what default Inductor gives it.
* no rewrite: the region stays as the program wrote it.

Views save that copy (and the copies of the lone dO and out) but make cuDNN slower on the
interleaved buffer (its rows are 3x wider). Both terms are measured
(``benchmarks/bench_attention_layouts.py``, H200, JSON in ``cp_inductor/cost_data/``); per
region::

    penalty_ms = (views_ms / cp_off_ms - 1) at the nearest measured shapes x attention_ms
    copy_ms    = 2 x bytes(q, k, v, dO, out) / COPY_GBPS
    fused_ms   = COLLECTIVES_SAVED x SAVED_COLLECTIVE_MS
    choose views iff copy_ms + fused_ms - penalty_ms > max(MARGIN_MS, MIN_GAIN x attention_ms), else skip

``attention_ms`` scales the nearest measured cp_off time by the work ratio (B S^2 Hq D). The
nearest shapes: same causality and MHA/GQA class, the ``NEIGHBOURS`` closest in log2 of
(batch, sequence, heads, head_dim); their penalties are averaged, because one measurement of a
small difference is noisy.

``auto`` never picks ``copy`` (measured no faster than leaving the region alone wherever views did
not win); it stays a config choice. The constants below and what calibrated them:
``docs/passes/fused_a2a.md``, "The cost model's constants".
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "cost_data" / "h200_attention_layouts.json"  # cp_inductor/cost_data

# Effective bandwidth (read + write, GB/s) of the copies views save, inside the compiled step.
COPY_GBPS = 1800.0
# Fusing sends q, k, v (and dq, dk, dv) through one all-to-all instead of three: two collectives
# fewer per direction, with their waits and their pack/unpack kernel launches.
SAVED_COLLECTIVE_MS = 0.04
COLLECTIVES_SAVED = 4
# Views must win by more than this (ms) and by MIN_GAIN of attention time: a smaller predicted
# win is within the noise between identical arms.
MARGIN_MS = 0.02
MIN_GAIN = 0.02
NEIGHBOURS = 3


@dataclass(frozen=True)
class UnpackChoice:
    choice: str  # "views" | "copy" | "skip"
    reason: str  # the numbers behind it, for the report


@functools.cache
def _rows() -> tuple:
    with open(DATA) as f:
        return tuple(json.load(f)["rows"])


def _features(batch, seq, heads, head_dim) -> tuple:
    return (math.log2(batch), math.log2(seq), math.log2(heads), math.log2(head_dim))


def predict(batch: int, seq: int, heads_q: int, heads_kv: int, head_dim: int, causal: bool, itemsize: int):
    """(attention_ms, views penalty ms, copy ms) for this rank's attention, fwd+bwd."""
    rows = [r for r in _rows() if r["causal"] == causal and (r["kv_heads"] < r["heads"]) == (heads_kv < heads_q)]
    if not rows:  # no measurement of this class: fall back to every row
        rows = list(_rows())
    here = _features(batch, seq, heads_q, head_dim)
    dist = lambda r: math.dist(here, _features(r["batch"], r["seq"], r["heads"], r["head_dim"]))  # noqa: E731
    near = sorted(rows, key=lambda r: (dist(r), r["seq"], r["heads"], r["head_dim"]))[:NEIGHBOURS]
    work = lambda b, s, h, d: b * s * s * h * d  # noqa: E731
    attention = sum(
        r["cp_off_ms"] * work(batch, seq, heads_q, head_dim) / work(r["batch"], r["seq"], r["heads"], r["head_dim"])
        for r in near
    ) / len(near)
    penalty = attention * sum(r["views_ms"] / r["cp_off_ms"] - 1 for r in near) / len(near)
    # Views also skip the copies of the lone dO (backward) and out (forward) tensors.
    moved = batch * seq * (2 * heads_q + 2 * heads_kv + 2 * heads_q) * head_dim * itemsize
    copy = 2 * moved / (COPY_GBPS * 1e6)
    return attention, penalty, copy


def choose_unpack(batch, seq, heads_q, heads_kv, head_dim, causal, itemsize) -> UnpackChoice:
    """The cost model's choice for one region (shapes are this rank's, after the all-to-all):
    "views", or "skip" (leave the region as the program wrote it)."""
    attention, penalty, copy = predict(batch, seq, heads_q, heads_kv, head_dim, causal, itemsize)
    fused = COLLECTIVES_SAVED * SAVED_COLLECTIVE_MS
    gain = copy + fused - penalty
    need = max(MARGIN_MS, MIN_GAIN * attention)
    if gain > need:
        return UnpackChoice(
            "views",
            f"views save copies {copy:.2f} ms + {COLLECTIVES_SAVED} collectives {fused:.2f} ms > attention penalty "
            f"{penalty:+.2f} ms (attention ~{attention:.1f} ms)",
        )
    return UnpackChoice(
        "skip",
        f"views would save {gain:+.2f} ms (copies {copy:.2f} ms, {COLLECTIVES_SAVED} collectives {fused:.2f} ms, "
        f"attention penalty {penalty:+.2f} ms), under {100 * MIN_GAIN:.0f}% of attention ~{attention:.1f} ms; "
        "copy was no faster than no rewrite",
    )
