"""The engine on a table of its own (``Engine(passes, detectors)``): a toy detector finds every
``relu`` as a region, a toy rewrite turns a region whose input is not already rewritten into
``abs``. What it shows of the engine: the report's analysis is applied by the hook, each region
decided once, and a region reached after an earlier rewrite changed the graph decided again on
the graph as that rewrite left it."""

import types
from dataclasses import dataclass

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from cp_inductor.config_snapshot import ConfigSnapshot, snapshot
from cp_inductor.passes.analysis.match import CPMatch
from cp_inductor.passes.engine import Engine
from cp_inductor.passes.record import POST_GRAD, RegionPass

aten = torch.ops.aten


@dataclass
class ToyMatch(CPMatch):
    style = "toy"


def _match_at(node, graph_kind, cfg):
    if node.op == "call_function" and node.target is aten.relu.default:
        return ToyMatch(graph_kind=graph_kind, attention=node, cp=2, group_name="toy", layout="bshd")
    return None


TOY = types.ModuleType("toy_detector")
TOY.STYLE = "toy"
TOY.match_at = _match_at
TOY.find = lambda graph, graph_kind, cfg, log=None: [
    m for n in graph.nodes if (m := _match_at(n, graph_kind, cfg)) is not None]


asked: list = []  # the attention ops the toy rewrite was asked about, in order


def _why_not(match, cfg, verdicts):
    asked.append(match.attention.name)
    source = match.attention.args[0]
    return "its input was rewritten" if getattr(source, "target", None) is aten.abs.default else None


def _apply(graph, match, cfg):
    relu = match.attention
    with graph.inserting_after(relu):
        new = graph.call_function(aten.abs.default, relu.args)
    new.meta.update(relu.meta)
    relu.replace_all_uses_with(new)
    graph.erase_node(relu)
    return [(relu.meta["val"], new, False)]


TO_ABS = RegionPass("toy_abs", stage=POST_GRAD, styles=("toy",), why_not=_why_not, apply=_apply)


def _two_relus():
    return make_fx(lambda x: x.relu().relu(), tracing_mode="fake")(torch.randn(4))


def _ops(gm):
    return [n.target.__name__.split(".")[0] for n in gm.graph.nodes if n.op == "call_function"]


def test_the_hook_applies_the_analysis_and_decides_again_after_a_rewrite():
    engine, cfg = Engine((TO_ABS,), (TOY,)), ConfigSnapshot({**snapshot(), "toy_abs": True})
    gm = _two_relus()
    asked.clear()
    rows = engine.analyze(gm.graph, "forward", cfg=cfg)
    # The report, per region as analysed: both relus read a relu.
    assert [r.applied for r in rows] == [["toy_abs"], ["toy_abs"]] and asked == ["relu", "relu_1"]
    engine.run_hook(POST_GRAD, gm.graph, cfg)
    # The first region takes the analysis's decision; the second, reached once the first was
    # rewritten, is decided again on the graph it left (once: the trial and the apply share it).
    assert asked == ["relu", "relu_1", "relu_1"]
    assert _ops(gm) == ["abs", "relu"]


def test_a_graph_changed_since_the_analysis_is_detected_afresh():
    engine, cfg = Engine((TO_ABS,), (TOY,)), ConfigSnapshot({**snapshot(), "toy_abs": True})
    gm = _two_relus()
    asked.clear()
    engine.analyze(gm.graph, "forward", cfg=cfg)
    first = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    with gm.graph.inserting_before(first):  # a node the analysis did not see
        gm.graph.call_function(aten.neg.default, first.args).meta.update(first.meta)
    engine.run_hook(POST_GRAD, gm.graph, cfg)
    assert asked == ["relu", "relu_1", "relu", "relu_1"]  # analysed, then decided afresh (once each)
    assert _ops(gm) == ["abs", "relu"]  # the unused neg went with the hook's dead-code pass
    assert not hasattr(gm.graph, "_cp_inductor_analysis")  # taken off either way
