"""ce_rotation: a ring's rotations on the copy-engine ops. The CPU has no copy engines: the
report gives the transport's reason, and the golden schedules and the gloo numerics fake its
availability (the ops then rotate through torch.distributed, so the rewritten graphs run
against the fp64 reference)."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from expecttest import TestCase

from cp_inductor.lowerings import ce_transport
from cp_inductor.passes.post_grad import ce_rotation
from cp_inductor.testing.checks import AttentionCase, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import rotations, ring_graphs
from ring_programs import native_options, native_ring, ring_by_hand



def _qkv(hq=4, hkv=2):
    mk = lambda h: torch.randn(1, 8, h, 8, requires_grad=True)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _rewritten(cp, fn, available=True, rank=0, **cfg):
    """(report rows, graphs) after the post-grad passes with ce_rotation on; the joint graph as
    the backend compiles ring graphs: AOTAutograd's CSE off, the pipeline's joint-graph passes."""
    patch = mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None) if available else mock.MagicMock()
    cfg = {"ce_rotation": True, "ce_rotation_min_bytes": 0, **cfg}  # the test shapes are tiny
    with patch:
        return ring_graphs(cp, fn, _qkv(), rank=rank, **cfg)


class TestGolden(TestCase):
    def test_hand_written_ring_cp2(self):
        # Each rotation starts as soon as its buffer exists and is waited where the rotated data
        # is first read: the forward's K/V travel under step 0's attention (the program itself
        # rotated after it), the backward's dK/dV under the next step's attention.
        _, graphs = _rewritten(2, lambda q, k, v: ring_by_hand(q, k, v, causal=True))
        self.assertExpectedInline("\n".join(f"{k}: {rotations(gm)}" for k, gm in graphs.items()), """\
forward: ce#0(to 1, from 1) attn wait#0 attn
backward: attn ce#0(to 1, from 1) attn wait#0 ce#1(to 1, from 1) wait#1""")

    def test_hand_written_ring_cp4(self):
        _, graphs = _rewritten(4, lambda q, k, v: ring_by_hand(q, k, v, causal=False))
        # Rank 0 sends to rank 1 and receives from rank 3; rotation i+1 starts right after i lands.
        self.assertExpectedInline(rotations(graphs["forward"]), """\
ce#0(to 1, from 3) attn wait#0 ce#1(to 1, from 3) attn wait#1 ce#2(to 1, from 3) attn wait#2 attn""")

    def test_native_context_parallel_all_to_all_rotation(self):
        # Native CP waits for the rotated K/V before step 0's attention; here the wait moves after it.
        with native_options("alltoall", load_balance=True):
            _, graphs = _rewritten(2, lambda q, k, v: native_ring(q, k, v, causal=True))
        self.assertExpectedInline("\n".join(f"{k}: {rotations(gm)}" for k, gm in graphs.items()), """\
forward: ce#0(to 1, from 1) attn wait#0 attn
backward: attn ce#0(to 1, from 1) attn wait#0 ce#1(to 1, from 1) wait#1""")


def _collective_kinds(graphs) -> dict:
    """Per graph, its collectives in order, by transport: what every rank must issue alike."""
    return {k: [t.split("#")[0] for t in rotations(gm).split() if t.startswith(("ce#", "nccl#"))] for k, gm in graphs.items()}


@pytest.mark.parametrize("cp,program", [(2, "hand"), pytest.param(4, "hand", marks=pytest.mark.wide), (2, "native_alltoall"),
                                        pytest.param(4, "native_alltoall", marks=pytest.mark.wide),
                                        (4, "native_allgather"), (2, "native_causal_unbalanced"),
                                        pytest.param(4, "native_causal_unbalanced", marks=pytest.mark.wide)])
def test_every_rank_decides_alike(cp, program):
    """Ring programs trace different graphs per rank (load balancing slices by rank; without it a
    causal rank 0 has no attention at its last step, so no region of its own carries its home
    rotation); a rotation moved to the copy engines on one rank and left to NCCL on another
    would hang both. Every rank must end with the same collectives, in the same order, on the
    same transport."""
    rotate = "alltoall" if program == "native_causal_unbalanced" else program.split("_")[-1]
    causal = program == "hand" or rotate == "alltoall"
    balanced = causal and program != "native_causal_unbalanced"
    fn = (lambda q, k, v: ring_by_hand(q, k, v, causal=True)) if program == "hand" else (
        lambda q, k, v: native_ring(q, k, v, causal=causal))
    kinds = []
    for rank in range(cp):
        with native_options(rotate, load_balance=balanced) if program != "hand" else contextlib.nullcontext():
            kinds.append(_collective_kinds(_rewritten(cp, fn, rank=rank)[1]))
    assert all(k == kinds[0] for k in kinds), kinds
    assert "ce" in kinds[0]["backward"], kinds[0]


class TestEligibility(TestCase):
    def test_reasons(self):
        rows, graphs = _rewritten(2, lambda q, k, v: ring_by_hand(q, k, v, causal=True), available=False)
        text = "\n".join(f"{r.graph_kind} {r.detail.split()[-1]}: {r.skipped.get('ce_rotation', 'applied')}" for r in rows)
        self.assertExpectedInline(text, """\
forward causal: no rotation moves this op's K/V (step 0: the next step's region carries it)
forward step=1: copy-engine transport needs CUDA tensors (got cpu)
backward causal: copy-engine transport needs CUDA tensors (got cpu)
backward Hkv=2: copy-engine transport needs CUDA tensors (got cpu)""")
        self.assertNotIn("ce#", rotations(graphs["forward"]))

    def test_small_rotations_stay_on_nccl(self):
        # The K/V buffer here is 1 x 8 x (2 + 2) x 8 fp32 = 1 KiB; 2 KiB is the threshold.
        rows, graphs = _rewritten(2, lambda q, k, v: ring_by_hand(q, k, v, causal=True), ce_rotation_min_bytes=2048)
        self.assertExpectedInline(rows[1].skipped["ce_rotation"], """a rotation of 1 KiB is below ce_rotation_min_bytes (2 KiB, the smallest measured faster than NCCL)""")
        self.assertEqual(rotations(graphs["forward"]), "attn nccl#0 wait#0 attn")


def _check_with_copy_engine_ops(rank, cp, kind):
    """check_cp_attention with ce_rotation applied on gloo (its ops rotate through
    torch.distributed). No FX graph cache: the faked availability is not in its key."""
    torch._inductor.config.fx_graph_cache = False
    ce_rotation.copy_engine_unavailable = lambda region: None
    options = {"cp_inductor.ce_rotation": True, "cp_inductor.ce_rotation_min_bytes": 0}  # tiny shapes
    if kind == "native":
        case = AttentionCase(batch=1, seq=32, heads_q=2, heads_kv=2, head_dim=8, causal=True, load_balanced=True)
        with native_options("alltoall", load_balance=True):
            return check_cp_attention(rank, cp, [case], lambda q, k, v: native_ring(q, k, v, causal=True),
                                      "cp_inductor", "cpu", options)
    cases = [
        AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True),
        AttentionCase(batch=2, seq=16, heads_q=2, heads_kv=2, head_dim=8, causal=False),
    ]
    return [
        r for case in cases
        for r in check_cp_attention(rank, cp, [case], lambda q, k, v, c=case.causal: ring_by_hand(q, k, v, causal=c),
                                    "cp_inductor", "cpu", options)
    ]


@pytest.mark.parametrize("cp,kind", [pytest.param(2, "hand", marks=pytest.mark.wide), pytest.param(4, "hand", marks=pytest.mark.wide),
                                     (2, "native")])
def test_numerics_gloo(cp, kind):
    for rank_results in run_on_ranks(_check_with_copy_engine_ops, cp, kind):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < 1e-5, (key, r)
            assert "ce_rotation" in r["applied"] and r["rewritten"].get("ce_rotation", 0) >= 2, r
