"""What cp_inductor found and did, since the last ``torch._dynamo.reset()`` or ``clear_report()``.

``cp_inductor.report()`` returns a :class:`Report`; ``str(report)`` is a table. The same
decisions go to the ``TORCH_LOGS=cp_inductor`` artifact.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import logging

# TORCH_LOGS=cp_inductor enables this: torch accepts any importable package name there.
log = logging.getLogger(__name__)


@dataclass
class Region:
    """One row of the report: a CP attention region of one graph and what was done to it."""

    style: str  # "a2a" | "allgather" | "ring"
    cp_size: int
    layout: str  # "bshd" | "bhsd" | "sbhd" | "thd": sequence-sharded q/k/v as they enter
    graph_kind: str  # "forward" | "backward" | "inference"
    applied: list = field(default_factory=list)  # rewrite names
    skipped: dict = field(default_factory=dict)  # rewrite name -> reason
    attention: str = ""  # the ATen attention op
    detail: str = ""  # heads, causal, ...
    notes: list = field(default_factory=list)  # analysis facts that are not rewrites (accumulators)

    @property
    def graph(self) -> str:
        """The graph kind, under the field's earlier name."""
        return self.graph_kind

    def row(self) -> list[str]:
        skipped = "; ".join(f"{k}: {v}" for k, v in self.skipped.items())
        return [
            self.graph_kind, self.style, str(self.cp_size), self.layout, self.attention, self.detail,
            ", ".join(self.applied) or "-", skipped or "-",
        ]


_HEADER = ["graph", "style", "cp", "layout", "attention", "detail", "applied", "skipped"]


@dataclass
class Rejected:
    """An attention op that is not a CP region, and why (nothing is rewritten there)."""

    graph_kind: str
    attention: str
    reason: str

    @property
    def graph(self) -> str:
        """The graph kind, under the field's earlier name."""
        return self.graph_kind


@dataclass
class BackwardRoute:
    """Which op runs one cuDNN attention backward of a compiled graph, CP region or not, and why
    (``passes/post_grad/cudnn_frontend_backward.py``)."""

    graph_kind: str
    attention: str  # the node's name in the graph Inductor was handed
    path: str  # "cudnn_frontend" | "aten"
    reason: str


@dataclass
class VarlenRoute:
    """One packed-sequence (THD) attention call of a compiled program and where it runs
    (``passes/dynamo/varlen_cudnn.py``)."""

    attention: str  # the call's node in the graph Dynamo handed the backend
    style: str  # "local" | "a2a" (an all-to-all delivers its tokens)
    lengths: str  # "proven" | "promised" | "unknown"
    detail: str
    path: str  # "cudnn_ragged" | "fa4_varlen" | "dense_sdpa" | "fa4_dense" | "fa4" | "kept"
    reason: str = ""
    # "bshd": a program's own dense FA4 call (flash_attn_func); "mask": SDPA given a mask; "cp": a call
    # made context-parallel (passes/dynamo/context_parallel.py)
    layout: str = "thd"

    def line(self) -> str:
        route = self.path if not self.reason else f"{self.path}: {self.reason}"
        if self.layout == "mask":
            return f"masked attention {self.attention}: {self.detail}: {route}"
        if self.layout == "cp":
            return f"context-parallel attention {self.attention}: {self.style}, {self.detail}: {route}"
        if self.layout != "thd":
            return f"attention {self.attention}: {self.style}, {self.layout}, {self.detail}: {route}"
        return f"varlen attention {self.attention}: {self.style}, thd, lengths {self.lengths}, {self.detail}: {route}"


@dataclass
class RewriteUndone:
    """A rewrite that failed its check (or raised) and was not kept: the graph stays as it was."""

    rewrite: str
    attention: str  # the attention node's name in the post-grad graph
    reason: str


@dataclass
class DenseRoute:
    """Which kernel runs one dense attention call (forward and its backward) of a compiled
    training graph, CP region or not (``passes/joint/fa4_dense.py``)."""

    attention: str  # the forward op's node in the joint graph
    provider: str  # "fa4" | "program"
    reason: str
    considered: bool = True  # False where FA4 could not take it on this device (not printed)

    def line(self) -> str:
        return f"dense attention {self.attention}: {self.provider}: {self.reason}"


@dataclass
class TokenMeanShare:
    """A value over one rank's tokens under the CP the model does not write, and what became of
    it: a mean or statistic (``passes/dynamo/token_means.py``, ``token_statistics.py``) or a
    position made from the token index (``token_places.py``)."""

    what: str
    kind: str = "mean"

    def line(self) -> str:
        return f"context-parallel {self.kind} {self.what}"


@dataclass
class Report:
    regions: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    undone: list = field(default_factory=list)
    backward_routes: list = field(default_factory=list)
    varlen: list = field(default_factory=list)
    dense: list = field(default_factory=list)
    token_means: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = []
        if self.regions:
            rows = [_HEADER] + [r.row() for r in self.regions]
            widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
            lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
            lines.insert(1, "  ".join("-" * w for w in widths))
        elif not (any(v.layout != "mask" for v in self.varlen) or self.dense):  # masked SDPA lines are no regions
            lines.append("cp_inductor: no CP attention regions found")
        for r in self.regions:
            lines += [f"note ({r.graph_kind} {r.style} {r.attention}): {n}" for n in r.notes]
        for r in self.rejected:
            lines.append(f"not a CP region ({r.graph_kind}): {r.attention}: {r.reason}")
        for u in self.undone:
            lines.append(f"rewrite undone: {u.rewrite} at {u.attention}: {u.reason}")
        for b in self.backward_routes:
            lines.append(f"cuDNN attention backward ({b.graph_kind}) {b.attention}: {b.path}: {b.reason}")
        lines += [v.line() for v in self.varlen]
        lines += [d.line() for d in self.dense if d.considered]
        lines += [m.line() for m in self.token_means]
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.regions)


_lock = threading.Lock()
_regions: list[Region] = []
_rejected: list[Rejected] = []
_undone: list[RewriteUndone] = []
_backward_routes: list[BackwardRoute] = []
_varlen: list[VarlenRoute] = []
_dense: list[DenseRoute] = []
_token_means: list[TokenMeanShare] = []


def record_dense(route: DenseRoute) -> None:
    with _lock:
        _dense.append(route)
    log.info("cp_inductor %s", route.line())


def record_varlen(route: VarlenRoute) -> None:
    with _lock:
        _varlen.append(route)
    log.info("cp_inductor: %s", route.line())


def record_token_mean(share: TokenMeanShare) -> None:
    with _lock:
        _token_means.append(share)
    log.info("cp_inductor: %s", share.line())


def record_backward_route(route: BackwardRoute) -> None:
    with _lock:
        _backward_routes.append(route)
    log.info("cp_inductor %s: cuDNN attention backward %s runs on %s: %s", route.graph_kind, route.attention, route.path, route.reason)


def record_undone(undone: RewriteUndone) -> None:
    with _lock:
        _undone.append(undone)
    log.warning("cp_inductor: %s at %s was undone: %s", undone.rewrite, undone.attention, undone.reason)


def record_rejected(rejected: Rejected) -> None:
    with _lock:
        _rejected.append(rejected)
    log.info("cp_inductor %s: %s is not a CP region: %s", rejected.graph_kind, rejected.attention, rejected.reason)


def record(region: Region) -> None:
    with _lock:
        _regions.append(region)
    log.info(
        "cp_inductor %s region: style=%s cp=%d layout=%s attention=%s %s applied=%s skipped=%s",
        region.graph_kind, region.style, region.cp_size, region.layout, region.attention,
        region.detail, region.applied, region.skipped,
    )


_LISTS: tuple[list, ...] = (_regions, _rejected, _undone, _backward_routes, _varlen, _dense, _token_means)


def mark() -> tuple[int, ...]:
    """Where the report stands: ``since(mark())`` is what is recorded after this."""
    with _lock:
        return tuple(len(entries) for entries in _LISTS)


def since(where: tuple[int, ...]) -> list[list]:
    with _lock:
        return [list(entries[n:]) for entries, n in zip(_LISTS, where)]


def replay(recorded: list[list]) -> None:
    """Record again what ``since`` returned (a compile the cache served: report_cache.py)."""
    with _lock:
        for entries, new in zip(_LISTS, recorded):
            entries.extend(new)
    log.info("cp_inductor: %d report entries replayed for a compile the cache served", sum(map(len, recorded)))


def report() -> Report:
    with _lock:
        return Report(*(list(entries) for entries in _LISTS))


def clear_report() -> None:
    with _lock:
        for entries in _LISTS:
            entries.clear()
