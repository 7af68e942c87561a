"""The pass record: everything the engine needs to know about one pass.

Each pass is one module that defines ``PASS``; ``passes/pipeline.py`` lists them, and
``passes/engine.py`` runs them. What a pass works on (``unit``) fixes its record (``RegionPass``,
``CallPass``, ``GraphPass``) and the signatures of its two functions (typed by the Protocols
below, which mypy checks every pass against):

============  ===========================================  ===================================
unit          ``why_not`` (a reason, or None: it applies)  ``apply``
============  ===========================================  ===================================
``REGION``    ``(match, cfg, verdicts)``: a CP region       ``(graph, match, cfg)`` -> the tensors
                                                           it handed on ``[(old value, new node,
                                                           strides kept?)]``
``CALL``      ``(call, cfg)``: a packed-sequence call       ``(gm, call)``
``GRAPH``     ``(graph, cfg)``: the whole graph             ``(graph, cfg)`` -> how many changes
``INPUTS``    ``(gm, cfg)``: the graph Dynamo hands the     ``(gm, example_inputs, cfg)`` ->
              backend                                      ``(gm, example_inputs, supply)``
============  ===========================================  ===================================

An ``INPUTS`` pass gives a copy of the graph inputs the program does not pass (``supply(compiled)`` wraps the
compiled function to hand them in on every call). It runs first and without the error fence the
others have: it runs only where the user asked for what it does (context parallelism), and the
program without it would compute another answer, so what it cannot do fails the compile.

A region pass's relations to the others are declared in ``passes/pipeline.py`` alone
(:func:`related`, checked when the pipeline loads, :func:`check_order`), so no pass module names
another: ``after``: passes whose verdict on the same region this one's ``why_not`` reads (as
``verdicts.earlier``); ``replaces``: passes this one performs itself where both apply;
``excludes``: passes that cannot apply with this one to one region (the one decided first wins;
the engine says so).
Call passes are tried in order on each call until one applies; a call pass with its own
``finds`` is tried alone on the calls it finds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch.fx

# Stages: where in torch.compile a pass runs.
DYNAMO = "dynamo"  # the graph Dynamo hands the backend, before AOTAutograd
CANONICAL = "canonical"  # every graph detection reads, first (forms the detectors rely on)
JOINT = "joint_custom_pre_pass"  # the joint forward+backward graph, before the partitioner
JOINT_POST = "joint_custom_post_pass"
POST_GRAD = "post_grad_custom_pre_pass"  # forward, backward and inference graphs
POST_GRAD_POST = "post_grad_custom_post_pass"
HOOKS = (JOINT, JOINT_POST, POST_GRAD, POST_GRAD_POST)  # Inductor's hook keys, in its order

REGION, CALL, GRAPH, INPUTS = "region", "call", "graph", "inputs"

DISABLED = "disabled by config"


def _applies(*_) -> None:
    return None


@dataclass(frozen=True)
class Earlier:
    """The verdict of a pass its reader's record is decided ``after``: its name, and why it does
    not apply (None: it applies)."""

    name: str
    reason: str | None

    @property
    def applies(self) -> bool:
        return self.reason is None


class Verdicts:
    """The verdicts of the passes decided so far on one region or call: ``why_not`` reads them,
    those of the passes its record is decided after as :attr:`earlier`."""

    def __init__(self) -> None:
        self._reasons: dict = {}
        self.earlier: tuple[Earlier, ...] = ()

    def seen_by(self, p: Any) -> Verdicts:
        """These verdicts, with :attr:`earlier` the verdicts of ``p.after``, in that order."""
        self.earlier = tuple(Earlier(name, self._reasons[name]) for name in getattr(p, "after", ()) if name in self._reasons)
        return self

    def record(self, name: str, reason: str | None) -> None:
        self._reasons[name] = reason

    def applies(self, name: str) -> bool:
        """Whether ``name`` was decided and applies (the engine's ``excludes``)."""
        return name in self._reasons and self._reasons[name] is None


class RegionWhyNot(Protocol):
    def __call__(self, match: Any, cfg: Any, verdicts: Verdicts, /) -> str | None: ...


class RegionApply(Protocol):  # -> the tensors it handed on: [(old value, new node, strides kept?)]
    def __call__(self, graph: torch.fx.Graph, match: Any, cfg: Any, /) -> list: ...


class CallWhyNot(Protocol):
    def __call__(self, call: Any, cfg: Any, /) -> str | None: ...


class CallApply(Protocol):
    def __call__(self, gm: torch.fx.GraphModule, call: Any, /) -> None: ...


class GraphWhyNot(Protocol):
    def __call__(self, graph: torch.fx.Graph, cfg: Any, /) -> str | None: ...


class GraphApply(Protocol):  # -> how many changes
    def __call__(self, graph: torch.fx.Graph, cfg: Any, /) -> int | None: ...


@dataclass(frozen=True)
class Pass:
    """What every pass says about itself; its unit's record (below) adds its functions."""

    name: str  # its name in the report and the logs, and its config switch (see ``switched``)
    stage: str  # DYNAMO, CANONICAL, or the Inductor hook key it runs on
    _: KW_ONLY
    unit: ClassVar[str]
    # Whether ``cfg[name]`` turns it off (False or "off"); a pass that is not switched always
    # runs (canonical forms) or is chosen by other config (fa4_dense: attention_provider).
    switched: bool = True
    # wanted(gm, example_inputs, cfg) -> whether the program Dynamo hands the backend can give
    # it work; a hook key is set only where one of its passes is wanted (Inductor sorts, lints
    # and recompiles a joint graph for any custom joint pass, one that changes nothing too).
    # None: always.
    wanted: Callable | None = None
    # AOTAutograd config the whole compile needs where this pass's hook is set.
    functorch_patches: dict = field(default_factory=dict)
    # The Python functions (not ops) it puts into the graph Dynamo hands the backend, by
    # qualified name (module.name). AOTAutograd's cache serves no graph that calls a function it
    # does not know; the engine names these cacheable, keyed by our sources and torch's version
    # (``Engine.cache_patches``).
    emits: tuple[str, ...] = ()
    # backward_route(node, cfg) -> the op it sends this attention backward to (``.path``,
    # ``.reason``), or None where the node is not of its kind: the report's route lines.
    backward_route: Callable | None = None


@dataclass(frozen=True, kw_only=True)
class RegionPass(Pass):
    """A rewrite of the CP regions the detectors find, decided per region in table order."""

    unit: ClassVar[str] = REGION
    apply: RegionApply
    why_not: RegionWhyNot = _applies
    styles: tuple[str, ...] = ()  # the CP styles whose regions it concerns
    # Passes decided before it whose verdicts its why_not reads (decided for it even where a
    # caller asks for this pass alone).
    after: tuple[str, ...] = ()
    replaces: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    # Inductor config a graph is compiled with when this pass is kept on one of its regions.
    inductor_patches: dict = field(default_factory=dict)
    # detail(match, cfg) -> what the report adds to the region's detail when it applies.
    detail: Callable | None = None
    packed: bool = False  # takes packed-sequence (THD) regions too, not only dense ones


@dataclass(frozen=True, kw_only=True)
class CallPass(Pass):
    """A lowering of attention calls on the graph Dynamo hands the backend."""

    unit: ClassVar[str] = CALL
    apply: CallApply
    why_not: CallWhyNot = _applies
    # finds(gm, cfg) -> the calls of its own kind it lowers (each with ``route()`` for the report);
    # None: the packed-sequence calls ``varlen_calls.find`` reads, shared by such passes.
    finds: Callable | None = None


@dataclass(frozen=True, kw_only=True)
class GraphPass(Pass):
    """A pass over a whole graph."""

    unit: ClassVar[str] = GRAPH
    apply: GraphApply
    why_not: GraphWhyNot = _applies


def related(p: RegionPass, *, after=(), replaces=(), excludes=()) -> RegionPass:
    """``p`` with its relations to passes listed before it (each a record or a tuple of them)."""
    def names(records) -> tuple[str, ...]:
        return tuple(r.name for r in (records if isinstance(records, tuple) else (records,)))

    return replace(p, after=p.after + names(after), replaces=p.replaces + names(replaces),
                   excludes=p.excludes + names(excludes))


class InputsWhyNot(Protocol):
    def __call__(self, gm: torch.fx.GraphModule, cfg: Any, /) -> str | None: ...


class InputsApply(Protocol):  # -> (its copy of gm, example_inputs, supply: compiled -> compiled)
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, cfg: Any, /) -> tuple[torch.fx.GraphModule, list, Callable]: ...


@dataclass(frozen=True, kw_only=True)
class InputsPass(Pass):
    """A pass on the graph Dynamo hands the backend that adds inputs to it (see the module docstring)."""

    unit: ClassVar[str] = INPUTS
    apply: InputsApply
    why_not: InputsWhyNot = _applies


def qualified_name(target) -> str:
    """A function's name as ``Pass.emits`` holds it and AOTAutograd's cache reads it."""
    return f"{getattr(target, '__module__', None)}.{getattr(target, '__name__', None)}"


def check_order(passes) -> None:
    """Every name a record declares is a pass decided before it (raises otherwise)."""
    seen: set[str] = set()
    for p in passes:
        for relation in ("after", "replaces", "excludes"):
            for name in getattr(p, relation):
                if name not in seen:
                    raise AssertionError(f"pass {p.name!r}: {relation} {name!r} is not a pass listed before it")
        seen.add(p.name)


def size_text(nbytes: int) -> str:
    """``nbytes`` for the report: 1.5 GiB, 256 MiB, 12 KiB, 80 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
