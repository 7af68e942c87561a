"""Which kernel runs an attention call the backend lowers: the program's own, cuDNN's or FA4's.

Every lowering that owns an attention call (packed calls, the dense call of an equal-length
pack, the dense calls of CP regions) asks ``choose(shape, candidates, cfg)``. ``candidates``
maps each provider the lowering can emit to None or the reason it cannot take this call (FA4
not installed, compute capability, dtype, head_dim, ...). Under ``attention_provider="auto"``
the choice is the fastest candidate in a measured cost map (``cost_data/attention_providers_*.json``,
written by ``benchmarks/bench_providers.py``): fwd+bwd milliseconds per shape bucket

    layout (thd | dense), dtype, causal, MHA or GQA, head_dim, tokens (B x S for dense), query heads

read at the nearest measured bucket of the same layout, dtype, mask, GQA class and head_dim
(nearest in log2 of tokens and heads). A call with less work (tokens x query heads) than a
quarter of the least the map measured in its class is not read off the map: launch costs, which
the map's rows do not show, decide such calls, so the lowering's default for unmeasured calls
takes it (the program's op for dense calls). A device with no map of its own reads the map of
its compute capability, and says so; with no measurement at all the program keeps its kernel.
``attention_provider="fa4"`` / ``"cudnn"`` / ``"program"`` force one, falling back to ``auto``
with the reason where the forced one cannot take the call.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

PROVIDERS = ("fa4", "cudnn", "program")
DATA = Path(__file__).resolve().parents[2] / "cost_data"


@dataclass(frozen=True)
class Shape:
    """The bucket key of one attention call."""

    layout: str  # "thd" (packed) or "dense"
    tokens: int  # T for a pack, B x S_q for dense
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    dtype: str  # "bfloat16", "float16", ...

    def describe(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.layout} T{self.tokens} Hq{self.heads_q} Hkv{self.heads_kv} D{self.head_dim} {mask} {self.dtype}"


@dataclass(frozen=True)
class Choice:
    provider: str
    reason: str


def shape_of(layout: str, q, k, causal: bool) -> Shape | None:
    """The bucket of a call from its q and k values (THD ``[T, H, D]``, dense ``[B, H, S, D]``),
    None where a size is symbolic."""
    if layout == "thd":
        dims = (q.shape[0], q.shape[1], k.shape[1], q.shape[-1])
    else:
        dims = (q.shape[0] * q.shape[2], q.shape[1], k.shape[1], q.shape[-1])
    if not all(isinstance(d, int) for d in dims):
        return None
    return Shape(layout, *dims, bool(causal), str(q.dtype).removeprefix("torch."))


@functools.cache
def _maps(extra: str) -> tuple[dict, ...]:
    """The user's map (``attention_provider_cost_map``) first, then the packaged ones."""
    paths = ([Path(extra)] if extra else []) + sorted(DATA.glob("attention_providers_*.json"))
    return tuple(json.loads(p.read_text()) for p in paths)


def _device_key(device: torch.device) -> tuple[str, str]:
    if device.type != "cuda" or not torch.cuda.is_available():
        return device.type, device.type
    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"sm{major}{minor}"


def cost_map_for(device: torch.device, extra: str = "") -> tuple[dict | None, str]:
    """The map measured on this device (by name), else on one of its compute capability, and
    which it is. A map given by ``attention_provider_cost_map`` comes first."""
    name, arch = _device_key(device)
    maps = _maps(extra)
    for m in maps:
        if m.get("device") == name:
            return m, f"measured on {name}"
    for m in maps:
        if m.get("arch") == arch:
            return m, f"measured on {m.get('device')}, read for {name} ({arch})"
    return None, f"no cost map for {name}"


SMALLEST_READ = 4  # a call down to 1/4 of the least measured work reads the map; below, it is unmeasured


def _same_class(rows: list[dict], shape: Shape) -> list[dict]:
    return [r for r in rows if r["layout"] == shape.layout and r["dtype"] == shape.dtype and r["causal"] == shape.causal
            and r["head_dim"] == shape.head_dim and (r["heads_q"] == r["heads_kv"]) == (shape.heads_q == shape.heads_kv)]


def _below_the_map(same: list[dict], shape: Shape) -> str | None:
    """Why ``shape`` is too small to be read off these rows, or None."""
    least = min(same, key=lambda r: r["tokens"] * r["heads_q"])
    if shape.tokens * shape.heads_q * SMALLEST_READ >= least["tokens"] * least["heads_q"]:
        return None
    return (f"{shape.describe()} is under a quarter of the least work measured (T{least['tokens']} Hq{least['heads_q']}): "
            "launch costs decide it, not measured")


def _nearest(same: list[dict], shape: Shape) -> dict:
    """The row of ``same`` (one class, not empty) nearest ``shape`` in log2 of tokens and heads."""

    def distance(r):
        return abs(math.log2(r["tokens"] / shape.tokens)) + abs(math.log2(r["heads_q"] / shape.heads_q))

    return min(same, key=distance)


def choose(shape: Shape | None, candidates: dict[str, str | None], cfg, device: torch.device,
           unmeasured: str = "program") -> Choice:
    """The provider for one call. ``candidates``: provider -> None (can take it) or why not;
    "program" is always a candidate (the call as written). ``unmeasured``: the provider where
    no measurement covers the call (if it can take it)."""
    candidates = {**candidates, "program": None}
    able = [p for p in PROVIDERS if candidates.get(p, "not offered here") is None]
    unable = "; ".join(f"{p}: {why}" for p, why in candidates.items() if why is not None)
    suffix = f"; {unable}" if unable else ""
    forced = cfg.attention_provider
    if forced not in ("auto", *PROVIDERS):
        return Choice("program", f"attention_provider={forced!r} is not one of auto, {', '.join(PROVIDERS)}")
    if forced != "auto":
        if forced in able:
            return Choice(forced, f"attention_provider={forced}")
        suffix = f"; attention_provider={forced} cannot take it{suffix}"
    if len(able) == 1:
        return Choice("program", f"only the program's op takes it{suffix}")
    fallback = unmeasured if unmeasured in able else "program"
    if shape is None:
        return Choice(fallback, f"symbolic sizes: no cost-map bucket{suffix}")
    cost_map, which = cost_map_for(device, cfg.attention_provider_cost_map)
    same = [] if cost_map is None else _same_class(cost_map["rows"], shape)
    if not same:
        return Choice(fallback, f"{which}: no measurement of {shape.describe()}{suffix}")
    small = _below_the_map(same, shape)
    if small:
        return Choice(fallback, f"{which}: {small}{suffix}")
    row = _nearest(same, shape)
    timed = sorted((row["ms"][p], p) for p in able if p in row["ms"])
    if not timed:
        return Choice(fallback, f"{which}: none of {', '.join(able)} timed at this bucket{suffix}")
    ranking = " < ".join(f"{p} {ms:.2f} ms" for ms, p in timed)
    bucket = f"T{row['tokens']} Hq{row['heads_q']} Hkv{row['heads_kv']}"
    return Choice(timed[0][1], f"cost map {which}, {shape.layout} {bucket} D{row['head_dim']}: {ranking}{suffix}")
