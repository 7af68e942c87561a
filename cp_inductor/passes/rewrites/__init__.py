"""The rewrite record: everything the pipeline needs to know about one rewrite.

Each rewrite is one module here that defines ``REWRITE``; the pipeline (``passes/pipeline.py``)
lists them in decision order. A record declares its relations to the others by name, and the
pipeline checks them when it loads (:func:`check_order`):

* ``after``: rewrites whose verdict on the same region this one's ``why_not`` reads (they must
  be decided first);
* ``replaces``: rewrites this one performs itself where both apply (they are not run
  separately, and the region counts for them too);
* ``excludes``: rewrites that cannot apply with this one to one region (the one decided first
  wins; this one says why it steps aside).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

POST_GRAD = "post_grad_custom_pre_pass"


class Verdicts:
    """The verdicts of the rewrites decided so far on one region: ``why_not`` reads them."""

    def __init__(self):
        self._reasons: dict = {}

    def record(self, name: str, reason: str | None) -> None:
        self._reasons[name] = reason

    def decided(self, name: str) -> bool:
        return name in self._reasons

    def applies(self, name: str) -> bool:
        """Whether ``name`` was decided and applies."""
        return name in self._reasons and self._reasons[name] is None

    def reason(self, name: str) -> str | None:
        """Why ``name`` does not apply (None: it applies). ``name`` must have been decided."""
        return self._reasons[name]


@dataclass(frozen=True)
class Rewrite:
    name: str  # its config switch and its name in the report
    styles: tuple[str, ...]  # CP styles whose matches it concerns
    # why_not(match, cfg, verdicts) -> reason or None (applies).
    why_not: Callable
    # apply(graph, match, cfg) -> [(old value, new node, strides kept?)]: the tensors it handed
    # to the rest of the graph in place of old ones (checked before the rewrite is kept).
    apply: Callable
    hook: str = POST_GRAD  # the Inductor hook key it runs on
    after: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    # Inductor config a graph is compiled with when this rewrite applies to one of its regions.
    inductor_patches: dict = field(default_factory=dict)
    # detail(match, cfg) -> text the report adds to the region's detail when it applies.
    detail: Callable | None = None
    packed: bool = False  # takes packed-sequence (THD) regions too, not only dense attention


def check_order(rewrites) -> None:
    """Every name a record declares is a rewrite decided before it (raises otherwise)."""
    seen = set()
    for r in rewrites:
        for relation in ("after", "replaces", "excludes"):
            for name in getattr(r, relation):
                if name not in seen:
                    raise AssertionError(f"rewrite {r.name!r}: {relation} {name!r} is not a rewrite listed before it")
        seen.add(r.name)


def size_text(nbytes: int) -> str:
    """``nbytes`` for the report: 1.5 GiB, 256 MiB, 12 KiB, 80 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
