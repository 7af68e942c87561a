"""The rewrite record: everything the pipeline needs to know about one rewrite.

Each implemented rewrite is one module here that defines ``REWRITE``; ``accumulators.py`` holds
two that have only an eligibility check so far (it says why Inductor leaves them nothing to do);
``planned.py`` holds the
catalogue entries that exist as config switches but not yet as code. The pipeline
(``passes/pipeline.py``) lists them in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

POST_GRAD = "post_grad_custom_pre_pass"


@dataclass(frozen=True)
class Rewrite:
    name: str  # its config switch and its name in the report
    styles: tuple[str, ...]  # CP styles whose matches it concerns
    # why_not(match, cfg, decided) -> reason or None; ``decided`` holds the earlier rewrites'
    # verdicts on this match (name -> reason, None = applies). None: not implemented yet.
    why_not: Callable | None = None
    # apply(graph, match, cfg) -> [(old value, new node, strides kept?)]: the tensors it handed
    # to the rest of the graph in place of old ones (checked before the rewrite is kept).
    apply: Callable | None = None
    hook: str = POST_GRAD  # the Inductor hook key it runs on
    # Rewrites this one performs itself where it applies (it rewrites their buffers in its own
    # way): they are not run separately, and the region counts for them too.
    replaces: tuple[str, ...] = ()
    # Inductor config a graph is compiled with when this rewrite applies to one of its regions.
    inductor_patches: dict = field(default_factory=dict)
    # detail(match, cfg) -> text the report adds to the region's detail when it applies.
    detail: Callable | None = None

    @property
    def implemented(self) -> bool:
        return self.apply is not None


def size_text(nbytes: int) -> str:
    """``nbytes`` for the report: 1.5 GiB, 256 MiB, 12 KiB, 80 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
