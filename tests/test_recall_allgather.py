"""Recall and precision of K/V all-gather detection on seeded random programs
(tests/allgather_programs.py): every valid program found in its forward AND backward graph, no
region in a program that is not CP attention, every all-gather rewrite forced on applied or
skipped with a reason and never failing (strict mode), and, for a sample, the same answer
compiled with those rewrites as eager on gloo."""

import collections
from unittest import mock

import pytest

import allgather_programs as ap
import cp_inductor
from cp_inductor.lowerings import ce_transport
from cp_inductor.passes import engine
from cp_inductor.testing.launch import run_on_ranks
from helpers import aot_graphs, fake_pg, survey_side_by_side, tally_detection

SEEDS = range(40)
# Every all-gather rewrite on (head groups forced to 2: every generated program has 2 | Hkv).
FORCED = dict(head_split=True, head_split_groups=2, gather_overlap=True, owner_grad_return=True)


def survey(cp: int, seeds=SEEDS) -> tuple[collections.Counter, list]:
    stats, misses = collections.Counter(), []
    # The copy engines faked available, so owner_grad_return's rewrite runs too.
    with fake_pg(cp), cp_inductor.config.patch(strict=True, **FORCED), \
            mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None):
        for seed in seeds:
            spec = ap.sample(seed, cp)
            stats[spec.kind if spec.kind != "allgather" else f"{spec.gather}/{spec.mask}"] += 1
            fn, inputs = ap.build(spec, cp)
            graphs = aot_graphs(fn, *inputs)
            rejected, found, applied = [], {}, collections.Counter()
            for kind, gm in graphs.items():
                rows = engine.analyze(gm.graph, kind, rejected)
                found[kind] = len(rows)
                applied.update(a for r in rows for a in r.applied)
                engine.rewrite_graph(gm.graph)  # strict: a failing rewrite raises here
            stats.update(f"applied:{a}" for a in applied)
            tally_detection(stats, misses, spec, spec.regions(), found, rejected)
    return stats, misses


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_recall_precision_and_no_errors(cp):
    stats, misses = survey_side_by_side(survey, [(cp, SEEDS[0::2]), (cp, SEEDS[1::2])])
    print(dict(stats))
    # The sample covers every gather form and masking the generator knows.
    assert {k.split("/")[0] for k in stats if "/" in k} == set(ap.GATHERS), stats
    assert {k.split("/")[1] for k in stats if "/" in k} == {"none", "causal", "balanced", "helper"}, stats
    assert stats["not_cp"] > 0 and stats["applied:head_split"] > 0 and stats["applied:gather_overlap"] > 0, stats
    assert stats["found"] == stats["valid"], misses
    assert stats["false_positive"] == 0, misses


def _check(rank, cp, specs):
    """Each program compiled with cp_inductor (every all-gather rewrite that runs on CPU forced
    on) vs eager on this rank's inputs: max relative error over output and gradients."""
    import torch
    import torch.distributed as dist

    options = {f"cp_inductor.{k}": v for k, v in FORCED.items() if k != "owner_grad_return"}
    out = []
    for spec in specs:
        fn, inputs = ap.build(spec, cp, torch.Generator().manual_seed(spec.seed * 100 + rank))
        grad = torch.randn_like(fn(*[t.detach() for t in inputs]))
        results = []
        for run in (fn, torch.compile(fn, backend="cp_inductor", fullgraph=True, options=options)):
            xs = [t.detach().clone().requires_grad_() for t in inputs]
            y = run(*xs)
            y.backward(grad)
            results.append([y.detach()] + [x.grad for x in xs])
        pairs = list(zip(results[1], results[0]))
        assert all((a is None) == (b is None) for a, b in pairs), spec  # an unused input gets no gradient
        err = max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in pairs if a is not None)
        out.append({"spec": spec, "max_rel_err": err,
                    "applied": sorted({a for r in cp_inductor.report().regions for a in r.applied})})
        torch._dynamo.reset()
        cp_inductor.clear_report()
        dist.barrier()
    return out


def test_same_answer_compiled_on_gloo():
    """A valid program per gather form and per masking, cp=2 on gloo, with the rewrites forced on."""
    picked = {}
    for s in (ap.sample(seed, 2) for seed in range(200)):
        if s.kind == "allgather" and s.gather not in picked:
            picked[s.gather] = s
        if s.kind == "allgather" and s.mask not in picked:
            picked[s.mask] = s
    results = run_on_ranks(_check, 2, list(picked.values()))
    for rank_results in results:
        for r in rank_results:
            assert r["max_rel_err"] < 1e-4, r
    assert any("head_split" in r["applied"] for r in results[0]), [r["applied"] for r in results[0]]
