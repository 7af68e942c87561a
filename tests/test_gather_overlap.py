"""gather_overlap: in K/V all-gather regions, attention that reads nothing gathered runs while the
gather (forward) or the reduce-scatter (backward) travels. Golden schedules per rank, the reasons
where it does not apply, the order Inductor's generated code keeps, the same bits as without it
on gloo, and owner_grad_return's pulls started ahead of the moved attention."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from expecttest import TestCase

import cp_inductor
from cp_inductor.lowerings import ce_transport
from cp_inductor.passes import engine
from cp_inductor.passes.analysis.sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD, bound_args
from cp_inductor.testing.checks import AttentionCase, allgather_fn
from cp_inductor.testing.launch import run_on_ranks
from helpers import aot_graphs, allgather_qkv, causal_allgather, fake_pg, gather_schedule_in_code

c10d = torch.ops._c10d_functional
ON = {"gather_overlap": True}


def _gathered(node) -> bool:
    """Whether attention ``node`` needs the collective: its K comes from an all-gather's wait
    (forward), or its dK reaches a reduce-scatter (backward)."""
    from cp_inductor.passes.analysis.graph_walk import ancestors, descendants

    if node.target in SDPA_BACKWARD:
        return any(n.target is c10d.reduce_scatter_tensor.default or "ce_all_to_all_start" in str(n.target)
                   for n in descendants([node]))
    key = bound_args(node)["key"]
    return any(n.target is c10d.all_gather_into_tensor.default for n in ancestors([key]) | {key})


def schedule(gm) -> str:
    """Collectives, waits and attention calls in graph order: ``attn(gathered)`` reads the gathered
    K/V (backward: returns dK/dV through the reduce-scatter or its pulls), ``attn(local)`` only the rank's own;
    ``rs``/``ce_*`` the reduce-scatter or its pulls."""
    names = {c10d.all_gather_into_tensor.default: "gather", c10d.reduce_scatter_tensor.default: "rs",
             c10d.wait_tensor.default: "wait"}
    out = []
    for n in gm.graph.nodes:
        if n.target in names:
            out.append(names[n.target])
        elif n.target in SDPA_FORWARD or n.target in SDPA_BACKWARD:
            out.append(f"attn({'gathered' if _gathered(n) else 'local'})")
        elif "ce_all_to_all" in str(n.target):
            out.append("ce_start" if "start" in str(n.target) else "ce_wait")
    return " ".join(out)


def _graphs(cp: int, rank: int, fn=causal_allgather, **cfg):
    """{kind: (schedule before, schedule after, report rows)} of ``fn`` on ``rank`` of ``cp``."""
    out = {}
    with fake_pg(cp, rank), cp_inductor.config.patch(**cfg):
        for kind, gm in aot_graphs(fn, *allgather_qkv()).items():
            before = schedule(gm)
            rows = engine.analyze(gm.graph, kind)
            engine.rewrite_graph(gm.graph)
            out[kind] = (before, schedule(gm), rows)
    return out


def _text(graphs) -> str:
    return "\n".join(f"{kind}:\n  {b}\n  {a}" for kind, (b, a, _) in graphs.items())


class TestGolden(TestCase):
    def test_rank_with_one_stretch_cp2(self):
        # Rank 1 holds chunks 1 and 2: one prefix call (gathered) and one square causal call
        # (local). The local call goes ahead of the gather's wait, and its backward after the
        # reduce-scatter's start.
        self.assertExpectedInline(_text(_graphs(2, 1, **ON)), """\
forward:
  gather wait attn(gathered) attn(local)
  gather attn(local) wait attn(gathered)
backward:
  attn(gathered) attn(local) rs wait
  attn(gathered) rs attn(local) wait""")

    def test_rank_with_two_chunks_cp2(self):
        # Rank 0 holds chunks 0 and 3: chunk 0's causal call reads the gathered copy (so every
        # rank uses the gather), chunk 3 has a prefix and a local call.
        self.assertExpectedInline(_text(_graphs(2, 0, **ON)), """\
forward:
  gather wait attn(gathered) attn(gathered) attn(local)
  gather attn(local) wait attn(gathered) attn(gathered)
backward:
  attn(gathered) attn(local) attn(gathered) rs wait
  attn(gathered) attn(gathered) rs attn(local) wait""")

    def test_cp4_every_rank_moves_its_local_calls(self):
        text = "\n".join(f"rank {r}: {_graphs(4, r, **ON)['backward'][1]}" for r in range(4))
        self.assertExpectedInline(text, """\
rank 0: attn(gathered) attn(gathered) rs attn(local) wait
rank 1: attn(gathered) attn(gathered) rs attn(local) attn(local) wait
rank 2: attn(gathered) attn(gathered) rs attn(local) attn(local) wait
rank 3: attn(gathered) rs attn(local) wait""")

    def test_reasons(self):
        def reasons(graphs):
            return sorted({r.skipped.get("gather_overlap", "applied") for _, _, rows in graphs.values() for r in rows})

        not_causal = lambda q, k, v: cp_inductor.parallel.allgather_attention(q, k, v)  # noqa: E731
        text = "\n".join([
            "# default config", *reasons(_graphs(2, 1)),
            "# not causal: one call over the gathered keys", *reasons(_graphs(2, 1, fn=not_causal, **ON)),
            "# head_split", *reasons(_graphs(2, 1, head_split=True, head_split_groups=2, **ON)),
        ])
        self.assertExpectedInline(text, """\
# default config
disabled by config
# not causal: one call over the gathered keys
no attention call of this region's queries that the gather does not concern is ordered where it would wait for it (one call per chunk, or already ahead)
no attention call of this region's queries that the reduce-scatter does not concern is ordered where it would wait for it (one call per chunk, or already ahead)
# head_split
applied
head_split applies to this region (the two exclude each other)""")

    def test_owner_grad_return_pulls_travel_under_the_moved_attention(self):
        with mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None):
            graphs = _graphs(2, 1, owner_grad_return=True, **ON)
        before, after, rows = graphs["backward"]
        applied = sorted({a for r in rows for a in r.applied})
        self.assertExpectedInline(f"{applied}\n{after}", """\
['gather_overlap', 'owner_grad_return']
attn(gathered) ce_start attn(local) ce_wait""")


def test_inductor_keeps_the_order():
    """Inductor's CPU code runs the local attention while the collective is in flight (its
    peak-memory reordering, which would move the collectives back next to their waits, is off
    for these graphs)."""
    from torch._inductor.utils import run_and_get_code

    with fake_pg(2, 1), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        f = torch.compile(causal_allgather, backend="cp_inductor", fullgraph=True, options={"cp_inductor.gather_overlap": True})
        _, codes = run_and_get_code(lambda: f(*allgather_qkv()).sum().backward())
    assert gather_schedule_in_code(codes) == ["gather attn wait attn", "attn rs attn wait"], gather_schedule_in_code(codes)


def _same_bits(rank, cp, case):
    """Output and gradients compiled with gather_overlap (each vs the fp64 reference) and whether
    they are bit-equal to the same compile without it (the same ops, reordered)."""
    from cp_inductor.testing.checks import full_inputs, reference, run_cp

    full, got = full_inputs(case), {}
    for on in (False, True):
        torch._dynamo.reset()
        cp_inductor.clear_report()
        fn = torch.compile(allgather_fn(case), backend="cp_inductor", fullgraph=True,
                           options={"cp_inductor.gather_overlap": on})
        got[on] = run_cp(fn, case, full, rank, cp)
    want = reference(case, full)
    return {
        "errors": {n: float((got[True][n].double() - want[n]).norm() / want[n].norm()) for n in want},
        "same_bits": all(torch.equal(got[True][n], got[False][n]) for n in want),
        "applied": sorted({a for r in cp_inductor.report().regions for a in r.applied}),
    }


CASES = {
    2: AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True),
    4: AttentionCase(batch=1, seq=32, heads_q=2, heads_kv=1, head_dim=8, layout="bhsd", causal=True, load_balanced=True),
}


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_numerics_gloo(cp):
    for r in run_on_ranks(_same_bits, cp, CASES[cp]):
        assert max(r["errors"].values()) < 1e-5 and r["same_bits"], r
        assert r["applied"] == ["gather_overlap"], r


def test_inductor_keeps_the_pulls_under_the_attention():
    """With owner_grad_return (copy engines faked available; on CPU the ops fall back to
    torch.distributed), Inductor's backward code starts the pulls before the moved attention and
    waits after it."""
    import re

    from torch._inductor.utils import run_and_get_code

    from cp_inductor.passes.experimental import owner_grad_return

    with fake_pg(2, 1), torch._inductor.config.patch(fx_graph_cache=False), \
            mock.patch.object(owner_grad_return, "copy_engine_unavailable", lambda region: None):
        torch._dynamo.reset()
        f = torch.compile(causal_allgather, backend="cp_inductor", fullgraph=True,
                          options={"cp_inductor.gather_overlap": True, "cp_inductor.owner_grad_return": True})
        _, codes = run_and_get_code(lambda: f(*allgather_qkv()).sum().backward())
    calls = re.findall(r"(ce_all_to_all_start|ce_all_to_all_wait|_scaled_dot_product\w+)\.default\(", codes[-1])
    assert [c if c.startswith("ce_") else "attn" for c in calls] == [
        "attn", "ce_all_to_all_start", "attn", "ce_all_to_all_wait"], calls
