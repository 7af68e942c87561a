"""What our passes did, where torch's own tooling looks.

* ``TORCH_LOGS=cp_inductor`` (or ``torch._logging.set_logs(cp_inductor=logging.INFO)``) turns on
  the ``cp_inductor`` logger: the report's lines, and per pass what it did and how long it took.
* Each applied rewrite leaves the graph before and after as ``trace_structured`` artifacts
  (``cp_inductor_<rewrite>_before`` / ``_after``), beside Inductor's own pass graphs, where
  ``TORCH_TRACE`` and tlparse show them. The graph is printed only while a trace is recorded.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch.fx
from torch._logging._internal import register_log, trace_log, trace_structured

register_log("cp_inductor", "cp_inductor")
log = logging.getLogger("cp_inductor.passes")


def _graph_text(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src


def tracing() -> bool:
    """Whether a structured trace is being recorded (``TORCH_TRACE``, tlparse's input)."""
    return bool(trace_log.handlers)


def graph_artifact(name: str, graph: torch.fx.Graph, text: str | None = None) -> None:
    """``graph`` (or its ``text``, printed earlier) as the artifact ``cp_inductor_<name>``."""
    if not tracing():
        return
    trace_structured("artifact", metadata_fn=lambda: {"name": f"cp_inductor_{name}", "encoding": "string"},
                     payload_fn=lambda: text if text is not None else _graph_text(graph))


@contextlib.contextmanager
def timed(pass_name: str, where: str):
    """Logs ``cp_inductor pass <name> on <where>: <what it did> (<ms>)``; the block yields a dict
    whose ``did`` it sets."""
    outcome: dict = {"did": "ran"}
    start = time.perf_counter()
    try:
        yield outcome
    finally:
        if log.isEnabledFor(logging.INFO):
            log.info("cp_inductor pass %s on %s: %s (%.1f ms)", pass_name, where, outcome["did"],
                     (time.perf_counter() - start) * 1e3)


@contextlib.contextmanager
def rewrite_observed(name: str, where: str, graph: torch.fx.Graph):
    """Around one rewrite's apply: timed, and, if it was kept (the block sets ``kept`` in the
    dict it yields), the graph before and after as trace artifacts."""
    before = _graph_text(graph) if tracing() else None
    outcome: dict = {"kept": False}
    with timed(name, where) as logged:
        yield outcome
        logged["did"] = outcome.get("did") or ("applied" if outcome["kept"] else "undone (see the report)")
    if outcome["kept"] and before is not None:
        graph_artifact(f"{name}_before", graph, before)
        graph_artifact(f"{name}_after", graph)
