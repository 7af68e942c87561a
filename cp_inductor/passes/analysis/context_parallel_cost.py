"""What each context-parallel style would cost one rank for one attention call, and the cheapest.

The context-parallel pass (``passes/dynamo/context_parallel.py``) asks, per attention call, with
the layout ``shard_batch`` made for the batch the compile sees::

    work(style)    = query-key pairs the slowest rank computes, query heads it holds, rounds
    model_ms       = pairs x heads / rate(head_dim, mask, GQA, document length)
                     + (rounds - 1) x ROUND_MS [+ Ulysses' row-order copies]
    key_mib        = rounds x every key of the full rows x K/V heads held x head_dim x itemsize
                     / 2^20: the per-round passes over all keys (the backward's dK / dV), which
                     the kernel rate does not count
    compute_ms     = slope(style) x model_ms + per_mib(style) x key_mib + intercept(style)
                     (calibration(): measured); the ring's at least per_step x cp (its host
                     launches each step: small calls wait on it), one line per cuDNN backward
                     its steps run (the frontend's or aten's: their host times differ)
    comm_ms        = sum over the style's collectives of latency + bytes leaving a rank / bus bandwidth
    total          = compute_ms + comm_ms   (no overlap: the pass's collectives finish before attention)

* ``allgather``: this rank's queries (its head-tail pieces of every document) over the keys of
  every rank, all query heads; forward two all-gathers (K, V), backward two reduce-scatters.
  A rank's pieces of one document are separate segments, run as separate rounds.
* ``ulysses``: every token, this rank's ``Hq / cp`` heads; four all-to-alls forward (q, k, v,
  out) and four backward. K/V heads are repeated up to ``lcm(Hkv, cp)`` where ``Hkv`` is not a
  multiple of cp (possible while that divides ``Hq``). The tokens arrive rank after rank and are
  put in row order (one round), which copies q, k, v and out, and their gradients, once more:
  ``+ bytes read and written / PERMUTE_GBPS``.

* ``ring`` (rows of one document, head-tail): this rank's queries, all query heads, over one
  rank's K/V per step, ``cp`` steps on the ring helper's kernels (cuDNN on sm90+); each step
  merges out and log-sum-exp in fp32 forward, and adds dQ and the travelling dK/dV in fp32
  backward: the second term is those fp32 passes over every step (``B x T x (Hq + 2 Hkv) x D x 4``
  bytes). Forward ``cp - 1`` rotations of K and V, backward ``cp - 1`` of K and V and ``cp`` of
  the fp32 dK/dV, each the whole buffer to one neighbour (priced on the all-to-all's bandwidth).
  Priced only where ``calibration()`` has measured ring rows; ``auto`` chooses among the priced.

``rate`` is read from the attention-provider cost map (``cost_data/attention_providers_*.json``,
the kernel the shard op runs: FA4 varlen): every row of the call's head_dim, mask, GQA class and
dtype gives pairs x heads per ms at its work-weighted document length; the rate at the call's
length is interpolated in log2 of it. Latencies and bandwidths are read from
``cost_data/collectives_*.json`` (measured; the machine's name picks the file). Where a device has
no tables the styles are not priced and ``auto`` keeps the all-gather.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ...batch_layout import document_bounds
from ...lowerings import cudnn_backward

ALLGATHER, ULYSSES, RING = "allgather", "ulysses", "ring"
STYLES = (ALLGATHER, ULYSSES)  # offered for every call; the ring only where the pass says
PRICED = (*STYLES, RING)
DATA = Path(__file__).resolve().parents[2] / "cost_data"
# Each round past the first: one more FA4 launch forward and backward over every query row (the
# rows of other rounds read no key) and a select of out and lse. A first guess, kept because the
# calibration was fitted over the model with it: what a round really costs is in calibration()'s
# lines (docs/passes/context_parallel.md).
ROUND_MS = 0.05
# Effective copy bandwidth (bytes read + written per ms x 1e-6) of Ulysses' row-order gathers.
PERMUTE_GBPS = 4000.0
COLLECTIVES = {  # per style: (op, which tensor's local bytes, how many of them) forward + backward
    ALLGATHER: (("all_gather", "kv", 2), ("reduce_scatter", "kv", 2)),
    ULYSSES: (("all_to_all", "q", 4), ("all_to_all", "kv", 4)),
}
RING_KERNEL = "cudnn"  # the provider map's column the ring's rate is read from (parallel/kernels.py)
# The ring's eager cuDNN backward: the frontend's op (torch < 2.14 with the frontend installed) or
# aten's; measured 0.8-1.1 against 0.4 ms of host time a step: one line each (rows say which).
FRONTEND, ATEN = "frontend", "aten"


@dataclass(frozen=True)
class Call:
    """One attention call as this rank sees it before the rewrite (local tokens)."""

    batch: int
    tokens: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    itemsize: int
    dtype: str


@dataclass(frozen=True)
class Work:
    pairs: int  # query-key pairs of the slowest rank, per query head
    heads: int  # query heads of a rank
    length: float  # work-weighted document length
    rounds: int


@dataclass(frozen=True)
class Estimate:
    style: str
    compute_ms: float
    comm_ms: float
    model_ms: float  # the kernel-rate term before calibration (what calibration() is fitted against)
    key_mib: float  # the per-round passes over every key (calibration()'s second term)

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.comm_ms

    def describe(self) -> str:
        return f"{self.style} {self.total_ms:.2f} ms (compute {self.compute_ms:.2f} + comm {self.comm_ms:.2f})"


def ulysses_kv_heads(call: Call, cp: int) -> tuple[int | None, str | None]:
    """K/V heads Ulysses sends (``Hkv`` or its repeat up to ``lcm(Hkv, cp)``), or None and why not."""
    if call.heads_q % cp:
        return None, f"ulysses needs query heads divisible by cp={cp} (query {call.heads_q})"
    heads = math.lcm(call.heads_kv, cp)
    if call.heads_q % heads:
        return None, (f"ulysses needs key/value heads divisible by cp={cp} or repeatable to a multiple of it "
                      f"that divides the query heads (query {call.heads_q}, key/value {call.heads_kv})")
    return heads, None


@dataclass(frozen=True)
class Line:
    """A style's measured one-rank compute against the model's terms::

        compute_ms = max(slope x model_ms + per_mib x key_mib + intercept,  per_step x steps)

    ``slope``: the style's kernel efficiency against the provider map's; ``per_mib``: its passes
    over every key per round; ``intercept``: its costs per call (the plan's host read, FA4's
    launches). ``per_step``: the host's time per step of a style that launches each step's
    kernels and merges from Python (the ring: ``cp`` steps), the floor small calls sit on while
    the GPU waits (0 for the others)."""

    slope: float
    per_mib: float
    intercept: float
    per_step: float = 0.0

    def ms(self, model_ms: float, key_mib: float, steps: int = 1) -> float:
        return max(self.slope * model_ms + self.per_mib * key_mib + self.intercept, self.per_step * steps)

    def kernel_ms(self, terms: torch.Tensor) -> torch.Tensor:
        """The kernel line at rows of ``(model_ms, key_mib, 1)``."""
        return terms @ torch.tensor([self.slope, self.per_mib, self.intercept], dtype=terms.dtype)


# Styles whose host launches every step from Python (``steps`` = cp): their line gets a host floor.
HOST_STEPPED = (RING,)


@functools.cache
def calibration(ring_backward: str = FRONTEND) -> dict[str, Line]:
    """Per style its :class:`Line`, fitted to ``cost_data/context_parallel_styles.json``'s rows
    (``benchmarks/calibrate_context_parallel.py`` writes them); the ring's to the rows of its
    ``ring_backward``."""
    return fit_lines(json.loads((DATA / "context_parallel_styles.json").read_text())["rows"], ring_backward)


def _least_relative_error(terms: torch.Tensor, measured: torch.Tensor) -> list[float]:
    """The coefficients of ``terms`` (one row per measurement) of least summed squared relative
    error (each row weighted by 1 / measured^2): the goal is a bound on measured / predicted,
    small calls and large alike."""
    return [float(x) for x in torch.linalg.lstsq(terms / measured[:, None], torch.ones_like(measured)[:, None],
                                                driver="gelsd").solution[:, 0]]  # SVD: rank-deficient terms too


def _host_floor_fit(terms: torch.Tensor, steps: torch.Tensor, measured: torch.Tensor) -> Line | None:
    """The kernel line and the host's time per step of least summed squared relative error, or
    None where the rows do not measure a kernel line. For each per-step time on a 0.01 ms grid
    (up to the largest measured time a step), the line is fitted to the rows above the floor
    (first those the floor is under by 5% or more, then those the line puts above it) until that
    split holds; a line needs a positive slope and as many rows as it has terms. The floor alone
    (no line) is a candidate too: where it fits best, the rows sit on the floor and say nothing of
    the kernels, and a line fitted to them would price every large call wrongly, so None."""
    best: tuple[float, Line | None] | None = None
    for i in range(math.ceil(float((measured / steps).max()) * 100) + 1):
        per_step = i / 100
        floor = per_step * steps
        candidates: list[Line | None] = [None]  # the floor alone
        bound = floor < 0.95 * measured
        for _ in range(len(measured)):
            if int(bound.sum()) < terms.shape[1]:
                break
            slope, per_mib, intercept = _least_relative_error(terms[bound], measured[bound])
            line = Line(slope, per_mib, intercept, per_step)
            split = line.kernel_ms(terms) >= floor
            if torch.equal(split, bound):
                if slope > 0:
                    candidates.append(line)
                break
            bound = split
        for candidate in candidates:
            predicted = floor if candidate is None else torch.maximum(candidate.kernel_ms(terms), floor)
            error = float(((measured / predicted - 1) ** 2).sum())
            if best is None or error < best[0] - 1e-12:
                best = (error, candidate)
    return best[1] if best else None


def backward_of(row: dict) -> str:
    """Which cuDNN backward a measured ring row ran (rows that do not say: the frontend's)."""
    return row.get("backward", FRONTEND)


def ring_backward_of(query) -> str:
    """The ring line a call of ``query`` is priced with: aten's where the ring's eager steps would
    run aten's cuDNN backward on this CUDA device, else the frontend's (off CUDA the tables priced
    are another machine's, whose torch < 2.14 runs the frontend's)."""
    return ATEN if query.is_cuda and not cudnn_backward.runs_eagerly_on_frontend(query) else FRONTEND


def fit_lines(rows: list[dict], ring_backward: str = FRONTEND) -> dict[str, Line]:
    """Per style its :class:`Line` of least relative error over its rows (a style with fewer
    than 3 rows: the all-gather and Ulysses the identity, the ring none: not priced; the ring
    also none where its rows measure no kernel line); the ring's over its ``ring_backward`` rows."""
    fits = {}
    for style in PRICED:
        mine = [r for r in rows if r["style"] == style and r["measured_ms"] > 0
                and (style != RING or backward_of(r) == ring_backward)]
        if len(mine) < 3:
            if style in STYLES:
                fits[style] = Line(1.0, 0.0, 0.0)
            continue
        terms = torch.tensor([[r["model_ms"], r["key_mib"], 1.0] for r in mine], dtype=torch.float64)
        measured = torch.tensor([r["measured_ms"] for r in mine], dtype=torch.float64)
        if style in HOST_STEPPED:
            steps = torch.tensor([float(host_steps(style, r["cp"])) for r in mine], dtype=torch.float64)
            line = _host_floor_fit(terms, steps, measured)
            if line is not None:
                fits[style] = line
        else:
            slope, per_mib, intercept = _least_relative_error(terms, measured)
            fits[style] = Line(slope, per_mib, intercept)
    return fits


def calibrated(style: str, ring_backward: str = FRONTEND) -> bool:
    """Whether ``style`` has a line: the all-gather and Ulysses always (the identity where
    fewer than 3 rows are measured), the ring only where its rows are (priced only then)."""
    return style in calibration(ring_backward)


def host_steps(style: str, cp: int) -> int:
    """The steps ``style``'s host launches per call (its line's floor counts them)."""
    return cp if style in HOST_STEPPED else 1


def calibrated_ms(style: str, model_ms: float, key_mib: float, cp: int, ring_backward: str = FRONTEND) -> float:
    return calibration(ring_backward)[style].ms(model_ms, key_mib, host_steps(style, cp))


def sent_kv_heads(call: Call, style: str, cp: int) -> int | None:
    """The K/V heads ``style`` moves and attends with, None where it cannot take the call."""
    return ulysses_kv_heads(call, cp)[0] if style == ULYSSES else call.heads_kv


# --- work, from the layout ----------------------------------------------------------------------


def _runs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of each row: its document's first place and length ([B, T] each)."""
    start, end = document_bounds(ids)
    return start, end + 1 - start


def _rounds(ids: torch.Tensor, places: torch.Tensor) -> int:
    """Most segments (runs of consecutive places) of one document among ``places`` of a row."""
    doc = ids.gather(1, places)
    new = torch.ones_like(places, dtype=torch.bool)
    new[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (places[:, 1:] != places[:, :-1] + 1)
    return max(int(torch.unique(doc[r][new[r]], return_counts=True)[1].max()) for r in range(doc.shape[0]))


def work(doc_ids: torch.Tensor, key_positions: torch.Tensor, cp: int, causal: bool, heads_q: int,
         window: int = -1) -> dict[str, Work]:
    """Per style, the slowest rank's work for one call over these documents (``doc_ids`` [B, T]
    of the full rows; ``key_positions`` [B, T]: every rank's tokens' places, rank after rank;
    ``window``: causal over the last ``window + 1`` keys at most, -1 none)."""
    ids, places = doc_ids.cpu().long(), key_positions.cpu().long()
    start, length = _runs(ids)
    place = torch.arange(ids.shape[1]).expand_as(ids)
    pairs = (place - start + 1) if causal else length  # keys each query reads
    if window >= 0:
        pairs = pairs.clamp(max=window + 1)
    local = places.shape[1] // cp
    per_rank = [int(pairs.gather(1, places[:, r * local:(r + 1) * local]).sum()) for r in range(cp)]
    weight = pairs.double()
    doc_length = float((weight * length).sum() / weight.sum())
    gathered = max(_rounds(ids, places[:, r * local:(r + 1) * local]) for r in range(cp))
    return {ALLGATHER: Work(max(per_rank), heads_q, doc_length, gathered),
            ULYSSES: Work(int(pairs.sum()), heads_q // cp, doc_length, _rounds(ids, places.sort(dim=1).values)),
            RING: Work(max(per_rank), heads_q, doc_length, cp)}


# --- the measured tables ------------------------------------------------------------------------


@functools.cache
def _tables(kind: str) -> tuple[dict, ...]:
    return tuple(json.loads(p.read_text()) for p in sorted(DATA.glob(f"{kind}_*.json")))


def tables_for(device_name: str) -> tuple[dict | None, dict | None]:
    """The attention-provider map and the collectives table measured on ``device_name``."""
    def find(kind):
        return next((t for t in _tables(kind) if t.get("device") == device_name), None)
    return find("attention_providers"), find("collectives")


def _weighted_length(lengths: list[int], causal: bool) -> tuple[float, float]:
    """(pairs of one row's documents, their work-weighted length)."""
    weights = [n * (n + 1) / 2 if causal else n * n for n in lengths]
    return sum(weights), sum(w * n for w, n in zip(weights, lengths)) / sum(weights)


def rate(providers: dict, call: Call, length: float, provider: str = "fa4") -> float | None:
    """Pairs x query heads per ms of ``provider`` at documents of ``length``, interpolated in
    log2 of the length between the map's rows of the call's class (None: no such row)."""
    points = []
    for r in providers["rows"]:
        if (r["head_dim"] != call.head_dim or r["causal"] != call.causal or r["dtype"] != call.dtype
                or (r["heads_q"] == r["heads_kv"]) != (call.heads_q == call.heads_kv)
                or provider not in r["ms"] or "lengths" not in r):
            continue
        pairs, at = _weighted_length(r["lengths"], call.causal)
        points.append((math.log2(at), pairs * r["heads_q"] / r["ms"][provider]))
    if not points:
        return None
    points.sort()
    x = math.log2(max(length, 1.0))
    i = bisect.bisect_left([p[0] for p in points], x)
    if i == 0 or i == len(points):
        return points[min(i, len(points) - 1)][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else (y0 + y1) / 2


def collective_ms(collectives: dict, op: str, bytes_leaving: float) -> float:
    """``latency + bytes / bus bandwidth``: the op's bandwidth from its row, the latency the mean
    over the timed rows (ms - bytes / bandwidth) of any op."""
    busbw = {r["op"]: r["busbw_gbps"] for r in collectives["rows"] if "busbw_gbps" in r}
    timed = [r for r in collectives["rows"] if "ms" in r and r["op"] in busbw]
    latency = sum(r["ms"] - _leaving(r) / (busbw[r["op"]] * 1e6) for r in timed) / len(timed)
    return latency + bytes_leaving / (busbw[op] * 1e6)


def _leaving(row: dict) -> float:
    return row["mib_per_rank"] * 2**20 * (row["ranks"] - 1) / row["ranks"]


def _permute_ms(style: str, call: Call, cp: int, kv_heads: int) -> float:
    """Ulysses' row-order gathers: q, k, v and out forward, their gradients backward, each read
    and written once, over every token of this rank's heads."""
    if style != ULYSSES:
        return 0.0
    tokens = call.batch * call.tokens * cp * call.head_dim * call.itemsize
    moved = 2 * 2 * (2 * tokens * call.heads_q // cp + 2 * tokens * kv_heads // cp)
    return moved / (PERMUTE_GBPS * 1e6)


def _comm_ms(collectives: dict, style: str, call: Call, cp: int, kv_heads: int) -> float:
    local = call.batch * call.tokens * call.head_dim * call.itemsize
    size = {"q": local * call.heads_q, "kv": local * kv_heads}
    if style == RING:  # K and V: cp - 1 hops each way; the fp32 dK/dV: cp hops (the last one home)
        kv = 2 * size["kv"]
        return (2 * (cp - 1) * collective_ms(collectives, "all_to_all", kv)
                + cp * collective_ms(collectives, "all_to_all", kv * 4 / call.itemsize))
    total = 0.0
    for op, tensor, count in COLLECTIVES[style]:
        leaving = size[tensor] * (cp - 1) if op != "all_to_all" else size[tensor] * (cp - 1) / cp
        total += count * collective_ms(collectives, op, leaving)
    return total


# --- the choice ---------------------------------------------------------------------------------


def model_terms(call: Call, works: dict[str, Work], cp: int, device_name: str) -> dict[str, tuple[float, float] | str]:
    """Per style the model's uncalibrated terms (model_ms, key_mib), or why it cannot take the
    call or cannot be priced."""
    providers, _ = tables_for(device_name)
    if providers is None:
        return {style: f"no measured costs for {device_name}" for style in PRICED}
    out: dict[str, tuple[float, float] | str] = {}
    for style in PRICED:
        kv_heads = sent_kv_heads(call, style, cp)
        w = works[style]
        kernel = RING_KERNEL if style == RING else "fa4"
        speed = rate(providers, call, w.length, kernel) if kv_heads is not None else None
        if kv_heads is None:
            out[style] = ulysses_kv_heads(call, cp)[1] or ""
        elif speed is None:
            out[style] = f"the cost map has no {call.dtype} D{call.head_dim} {kernel} row"
        else:
            rows = call.batch * call.tokens * cp * call.head_dim  # every token of the full rows, per head
            held = kv_heads if style == ALLGATHER else kv_heads // cp
            passes = (rows * (call.heads_q + 2 * kv_heads) * 4 if style == RING
                      else w.rounds * rows * held * call.itemsize)
            out[style] = (w.pairs * w.heads / speed + (w.rounds - 1) * ROUND_MS + _permute_ms(style, call, cp, kv_heads),
                          passes / 2**20)
    return out


def estimates(call: Call, works: dict[str, Work], cp: int, device_name: str,
              ring_backward: str = FRONTEND) -> tuple[dict[str, Estimate | str], str]:
    """Per style its estimate, or why it cannot take the call or cannot be priced; and which
    tables. ``ring_backward``: the cuDNN backward the ring's steps would run (its line's)."""
    providers, collectives = tables_for(device_name)
    if providers is None or collectives is None:
        why = f"no measured costs for {device_name}"
        return {style: why for style in PRICED}, why
    out: dict[str, Estimate | str] = {}
    for style, terms in model_terms(call, works, cp, device_name).items():
        if isinstance(terms, str):
            out[style] = terms
            continue
        if not calibrated(style, ring_backward):
            out[style] = "not priced yet (no measured rows to calibrate it)"
            continue
        kv_heads = sent_kv_heads(call, style, cp)
        assert kv_heads is not None  # model_terms gave the reason where the style cannot take the call
        out[style] = Estimate(style, calibrated_ms(style, *terms, cp, ring_backward), _comm_ms(collectives, style, call, cp, kv_heads), *terms)
    return out, f"measured on {device_name}"


def forced_style(setting: str, ordinal: int) -> str:
    """The style ``context_parallel_style`` sets for the ``ordinal``-th attention call of a graph
    (from 0, in the order the report lists them): one style for every call, or a comma-separated
    list of one per call, the calls past its end taking its last."""
    styles = [s.strip() for s in setting.split(",")]
    for style in styles:
        if style != "auto" and style not in PRICED:
            raise ValueError(f"context_parallel_style={setting!r}: expected auto or one of {PRICED} "
                             "(or a comma-separated list of them, one per attention call)")
    return styles[min(ordinal, len(styles) - 1)]


def choose(call: Call, works: dict[str, Work], cp: int, device_name: str, forced: str,
           ring_why_not: str | None, ring_backward: str = FRONTEND) -> tuple[str, str]:
    """(style, why: the forced style or the priced candidates, cheapest first). The ring is a
    candidate where ``ring_why_not`` is None; ``auto`` takes it where it is priced (measured
    rows calibrate it) and cheapest, a forced ring where it is a candidate; ``ring_backward``:
    the cuDNN backward its steps would run (said where it is aten's)."""
    priced, tables = estimates(call, works, cp, device_name, ring_backward)
    kv_heads, why_not = ulysses_kv_heads(call, cp)
    able = [s for s in STYLES if not (s == ULYSSES and kv_heads is None)]
    if ring_why_not is None:
        able.append(RING)
    ranked = sorted((e for s, e in priced.items() if isinstance(e, Estimate) and s in able), key=lambda e: e.total_ms)
    listing = " < ".join(e.describe() for e in ranked)
    unpriced = "; ".join(f"{s}: {why}" for s, why in priced.items() if isinstance(why, str) and s in STYLES and s in able)
    notes = [x for x in (listing, unpriced) if x]
    if why_not:
        notes.append(why_not)
    if kv_heads and kv_heads != call.heads_kv and ULYSSES in able:
        notes.append(f"ulysses: key/value heads repeated to {kv_heads}")
    if ring_why_not:
        notes.append(f"{RING}: {ring_why_not}")
    elif not isinstance(priced[RING], Estimate):
        notes.append(f"{RING}: taken where forced, {priced[RING]}")
    elif ring_backward != FRONTEND:
        notes.append(f"{RING}: priced with {ring_backward}'s cuDNN backward")
    detail = "; ".join(notes)
    if forced != "auto":
        if forced not in PRICED:
            raise ValueError(f"context_parallel_style={forced!r}: expected auto or one of {PRICED}")
        if forced in able:
            return forced, f"set by config; {detail}"
        return ALLGATHER, f"context_parallel_style={forced} cannot take it; {detail}"
    if not ranked:
        return ALLGATHER, f"auto, {tables}: the default; {detail}"
    return ranked[0].style, f"auto, predicted ({tables}): {detail}"
