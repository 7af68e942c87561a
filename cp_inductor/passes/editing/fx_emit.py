"""Inserting ATen nodes into a post-grad graph with the fake-tensor metadata Inductor reads."""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import weakref

import sympy
import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils._sympy.functions import FloorDiv

from ..analysis.layout_algebra import Relayout
from ..analysis.sym_sizes import NotASize, size_of, sizes_of

aten = torch.ops.aten

# meta key on the ops a rewrite put in place of an attention op: the old op's name (the pipeline
# finds the region again through the first of them for the rewrites that follow).
REPLACES = "cp_inductor_replaces"


def _fake_mode(graph: torch.fx.Graph, anchor: torch.fx.Node):
    """The graph's fake mode, read from the anchor's neighbourhood (every value of one graph shares
    it); the whole graph only where none is there: reading every value per rewrite made the
    passes' time grow with the square of the layers."""
    near = [anchor, *anchor.all_input_nodes, *anchor.users]
    for nodes in (near, graph.nodes):
        vals = [n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        if vals:
            return detect_fake_mode(vals)
    return None


class Emitter:
    """Creates nodes before ``anchor`` (in call order) and fills ``meta["val"]``."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node):
        self.graph = graph
        self.anchor = anchor
        self.fake_mode = _fake_mode(graph, anchor)
        # (old value, new node, strides kept?) per tensor handed on in place of an old one: what
        # checked_rewrite.check compares.
        self.replaced: list = []
        self.created: list = []  # every node made, in order
        # Symbolic size -> node: the graph's SymInt inputs, then the sizes this emitter computed
        # (before its own anchor, so no other emitter may reuse them).
        self._sizes = dict(_graph_sizes(graph))

    def replace(self, old: torch.fx.Node, new: torch.fx.Node, strides: bool = True, **kwargs) -> None:
        """``old.replace_all_uses_with(new)``, recorded for the check. ``strides=False`` where the
        new tensor is meant to have other strides (attention reading a view)."""
        self.replaced.append((old.meta.get("val"), new, strides))
        old.replace_all_uses_with(new, **kwargs)

    def __call__(self, target, *args, **kwargs) -> torch.fx.Node:
        args, kwargs = self._sizes_as_nodes(args), self._sizes_as_nodes(kwargs)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        replayed = _replayed(target)
        if replayed is not None:
            node.meta["val"] = replayed[0]
        else:
            fake_args, fake_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
            with self.fake_mode:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        if _values.recording is not None:
            _values.recording.append((target, node.meta["val"]))
        self.created.append(node)
        return node

    def relayout(self, x: torch.fx.Node, plan: Relayout) -> torch.fx.Node:
        if plan.split != sizes_of(x.meta["val"].shape):
            x = self(aten.reshape.default, x, list(plan.split))
        if plan.perm != tuple(range(len(plan.perm))):
            x = self(aten.permute.default, x, list(plan.perm))
        if plan.shape != sizes_of(x.meta["val"].shape):
            x = self(aten.reshape.default, x, list(plan.shape))
        return x

    # --- symbolic sizes ---
    def _sizes_as_nodes(self, x):
        """Arguments with each symbolic size (a SymInt, or a sympy expression from the layout
        algebra) replaced by a node computing it: an FX graph passes sizes as nodes."""
        if isinstance(x, (list, tuple)):
            return type(x)(self._sizes_as_nodes(a) for a in x)
        if isinstance(x, dict):
            return {k: self._sizes_as_nodes(v) for k, v in x.items()}
        if isinstance(x, (torch.SymInt, sympy.Basic)):
            x = size_of(x)
            return x if isinstance(x, int) else self._size_node(x)
        return x

    def _size_node(self, expr) -> torch.fx.Node:
        known = self._sizes
        if expr in known:
            return known[expr]
        if isinstance(expr, sympy.Symbol):
            node = _symbol_from_shapes(self.graph, expr)
            if node is None:
                raise NotASize(f"no input of the graph carries the size {expr}")
            node = self(aten.sym_size.int, *node)
        elif isinstance(expr, sympy.Add):
            node = functools.reduce(lambda a, b: self(operator.add, a, b), [self._operand(t) for t in expr.args])
        elif isinstance(expr, sympy.Mul):
            coeff, terms = expr.as_coeff_mul()
            node = functools.reduce(lambda a, b: self(operator.mul, a, b), [self._operand(t) for t in terms])
            if coeff.p != 1:
                node = self(operator.mul, node, int(coeff.p))
            if coeff.q != 1:  # exact: the size is whole
                node = self(operator.floordiv, node, int(coeff.q))
        elif isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 1:
            base = self._operand(expr.base)
            node = functools.reduce(lambda a, _: self(operator.mul, a, base), range(int(expr.exp) - 1), base)
        elif isinstance(expr, FloorDiv):
            node = self(operator.floordiv, self._operand(expr.args[0]), self._operand(expr.args[1]))
        else:
            raise NotASize(f"cannot compute the size {expr} in the graph")
        known[expr] = node
        return node

    def _operand(self, expr):
        return int(expr) if expr.is_number else self._size_node(size_of(expr))


class _Values:
    """The values a rewrite's trial computed, handed to the same rewrite on the real graph: it
    emits the same ops in the same order, and fake-tensor propagation was most of the passes'
    time (``checked_rewrite.apply_checked``)."""

    recording: list | None = None
    replay: collections.deque | None = None


_values = _Values()


@contextlib.contextmanager
def recording_values():
    """Collect ``(target, value)`` of every node emitted inside."""
    _values.recording = []
    try:
        yield _values.recording
    finally:
        _values.recording = None


@contextlib.contextmanager
def replaying_values(values: list):
    """Emitters inside take each node's value from ``values`` while the targets agree, then
    compute their own."""
    _values.replay = collections.deque(values)
    try:
        yield
    finally:
        _values.replay = None


def _replayed(target) -> tuple | None:
    replay = _values.replay
    if not replay:
        return None
    want, value = replay.popleft()
    if want is not target:  # the apply went another way: compute from here on
        replay.clear()
        return None
    return (value,)


_SIZES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _graph_sizes(graph: torch.fx.Graph) -> dict:
    """Symbolic size -> the graph's SymInt input that holds it (read once per graph)."""
    if graph not in _SIZES:
        _SIZES[graph] = {
            size_of(n.meta["val"]): n for n in graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt) and n.meta["val"].node.maybe_as_int() is None
        }
    return _SIZES[graph]


def _symbol_from_shapes(graph: torch.fx.Graph, symbol) -> tuple | None:
    """(input tensor, dim) whose size is ``symbol``, for ``sym_size``."""
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt) and size_of(s) == symbol:
                    return n, d
    return None


def stride_order(t: torch.Tensor) -> list:
    """Dims from outermost to innermost in memory (ties keep the logical order)."""
    return sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))

