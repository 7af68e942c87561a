"""head_split on K/V all-gather regions: each attention call of a region becomes G calls over
head groups (the gathers and reduce-scatters stay whole). Golden schedules at cp = 2, 4, 8,
eligibility reasons, numerics on gloo against the fp64 reference."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import cp_inductor
from cp_inductor.passes import engine
from cp_inductor.passes.analysis.sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD
from cp_inductor.testing.checks import AttentionCase, allgather_fn, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import aot_graphs, causal_allgather, fake_pg, region_rewrites
from test_detect_allgather import head_stride_loop, llama3_style_masked

c10d = torch.ops._c10d_functional
# The test shapes are tiny: the automatic choice splits any call (head_split_min_gib).
ANY_SIZE = {"head_split_min_gib": 0.0}


def qkv(hq: int, hkv: int, seq: int = 16):
    mk = lambda h: torch.randn(1, seq, h, 8, requires_grad=True)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def noncausal_allgather(q, k, v):
    from cp_inductor.parallel import allgather_attention

    return allgather_attention(q, k, v, is_causal=False)


def calls(gm) -> str:
    """Gathers, attention calls (query heads) and reduce-scatters in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.target is c10d.all_gather_into_tensor.default:
            out.append("gather")
        elif n.target is c10d.reduce_scatter_tensor.default:
            out.append("reduce_scatter")
        elif n.target in SDPA_FORWARD or n.target in SDPA_BACKWARD:
            q = n.args[1] if n.target in SDPA_BACKWARD else n.args[0]
            out.append(f"attn(h={q.meta['val'].shape[1]})")
    return " ".join(out)


def split(cp, fn, *inputs, **cfg) -> str:
    with fake_pg(cp), cp_inductor.config.patch(head_split=True, strict=True, **{**ANY_SIZE, **cfg}):
        lines = []
        for kind, gm in aot_graphs(fn, *inputs).items():
            engine.rewrite_graph(gm.graph)
            lines.append(f"{kind}: {calls(gm)}")
    return "\n".join(lines)


class TestGolden(TestCase):
    def test_backward_calls_over_gathered_keys_in_two_groups(self):
        # Causal load-balanced, Hq4 Hkv2 (auto: G=2). Rank 0's chunk 0 attends over the gathered
        # keys causally and chunk 3 over its prefix: both split, and chunk 3's diagonal block on
        # the rank's own K/V (not a region: it reads the prefix call's queries) with them. The
        # forward stays whole.
        self.assertExpectedInline(split(2, causal_allgather, *qkv(4, 2)), """\
forward: gather attn(h=4) attn(h=4) attn(h=4)
backward: attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) reduce_scatter""")

    def test_forward_too_cp4_four_groups(self):
        self.assertExpectedInline(
            split(4, causal_allgather, *qkv(8, 4, seq=8), head_split_groups=4, head_split_forward=True), """\
forward: gather attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2)
backward: attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) reduce_scatter""")

    def test_two_layers_each_split(self):
        # The second layer's K/V are computed from the first layer's output (which read
        # gathered keys): still the rank's own K/V, so its diagonal blocks are split too.
        def two_layers(q, k, v):
            out = causal_allgather(q, k, v)
            return causal_allgather(out, out[:, :, :2] * 0.5, out[:, :, 2:] + 1.0)

        self.assertExpectedInline(split(2, two_layers, *qkv(4, 2)), """\
forward: gather attn(h=4) attn(h=4) attn(h=4) gather attn(h=4) attn(h=4) attn(h=4)
backward: attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) reduce_scatter attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) attn(h=2) reduce_scatter""")

    def test_not_causal_cp8(self):
        self.assertExpectedInline(split(8, noncausal_allgather, *qkv(8, 8, seq=4), head_split_forward=True), """\
forward: gather attn(h=2) attn(h=2) attn(h=2) attn(h=2)
backward: attn(h=2) attn(h=2) attn(h=2) attn(h=2) reduce_scatter""")

    def test_hand_written_llama3_style_masks_broadcast_over_heads(self):
        # Per-chunk bottom-right masks [S_q, S_k]: every group reads the same mask (Hq = Hkv = 4:
        # auto takes 4 groups). K and V are gathered separately, so each has its reduce-scatter.
        self.assertExpectedInline(split(2, llama3_style_masked, *qkv(4, 4)), """\
forward: gather gather attn(h=4) attn(h=4)
backward: attn(h=1) attn(h=1) attn(h=1) attn(h=1) attn(h=1) attn(h=1) attn(h=1) attn(h=1) reduce_scatter reduce_scatter""")


def reasons(cp, fn, *inputs, **cfg) -> str:
    with fake_pg(cp), cp_inductor.config.patch(head_split=True, strict=True, **{**ANY_SIZE, **cfg}):
        return "\n".join(sorted({
            f"{kind}: {row.skipped.get('head_split', 'applied: ' + row.detail.split(' G=')[-1])}"
            for kind, gm in aot_graphs(fn, *inputs).items() for row in engine.analyze(gm.graph, kind)
        }))


def head_masked(q, k, v):
    """Non-causal all-gather with a mask per query head: not split."""
    from test_detect_allgather import _gather

    k_all, v_all = (_gather(t).transpose(1, 2) for t in (k, v))
    mask = torch.ones(q.shape[2], q.shape[1], k_all.shape[2], dtype=torch.bool).tril().unsqueeze(0)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask).transpose(1, 2)


class TestEligibility(TestCase):
    def test_reasons(self):
        cases = {
            "default": reasons(2, causal_allgather, *qkv(4, 2)),
            "head_split_groups=3": reasons(2, noncausal_allgather, *qkv(6, 2), head_split_groups=3),
            "one K/V head": reasons(2, noncausal_allgather, *qkv(4, 1)),
            "a mask per head": reasons(2, head_masked, *qkv(2, 2), head_split_forward=True),
            "K/V heads gathered one at a time": reasons(2, head_stride_loop, *qkv(2, 2)),
            "auto, calls of the default size": reasons(2, causal_allgather, *qkv(4, 2), head_split_min_gib=1.0),
        }
        with fake_pg(2), cp_inductor.config.patch(head_split=True, owner_grad_return=True, **ANY_SIZE):
            rows = [row for kind, gm in aot_graphs(causal_allgather, *qkv(4, 2)).items()
                    for row in engine.analyze(gm.graph, kind) if kind == "backward"]
        cases["owner_grad_return on too"] = "\n".join(sorted({
            f"{r.skipped.get('head_split', 'head_split applied')}; "
            f"owner_grad_return: {r.skipped.get('owner_grad_return', 'applied')}" for r in rows
        }))
        text = "\n".join(f"# {name}\n{why}" for name, why in cases.items())
        self.assertExpectedInline(text, """\
# default
backward: applied: 2: attention call and 1 call(s) on local K/V reading its queries split by head groups (gathers, reduce-scatters whole)
backward: applied: 2: attention call split by head groups (gathers, reduce-scatters whole)
forward: forward region (head_split_forward=False; its kernel's workspace is small)
# head_split_groups=3
backward: head_split_groups=3 does not divide the heads (Hq=6, Hkv=2)
forward: forward region (head_split_forward=False; its kernel's workspace is small)
# one K/V head
backward: heads Hq=4, Hkv=1 have no common divisor in 2..4
forward: forward region (head_split_forward=False; its kernel's workspace is small)
# a mask per head
backward: attn_mask has a head dim (not split by heads)
forward: attn_mask has a head dim (not split by heads)
# K/V heads gathered one at a time
backward: applied: 2: attention call split by head groups (gathers, reduce-scatters whole)
forward: forward region (head_split_forward=False; its kernel's workspace is small)
# auto, calls of the default size
backward: its backward allocates ~3 KiB beyond its gradients (< head_split_min_gib 1: smaller calls pay 2-3% time for the split); head_split_groups=G forces it
backward: its backward allocates ~7 KiB beyond its gradients (< head_split_min_gib 1: smaller calls pay 2-3% time for the split); head_split_groups=G forces it
forward: forward region (head_split_forward=False; its kernel's workspace is small)
# owner_grad_return on too
head_split applied; owner_grad_return: head_split applies to this region (the two exclude each other)""")


HP = {"cp_inductor.head_split": True, "cp_inductor.head_split_forward": True,
      **{f"cp_inductor.{k}": v for k, v in ANY_SIZE.items()}}
TOL = 1e-5  # fp32 vs fp64, relative L2


def _check(rank, cp, cases, hand_written):
    out = [r for case in cases for r in check_cp_attention(rank, cp, [case], allgather_fn(case), options=HP)]
    if hand_written:
        shape = dict(batch=1, seq=16, heads_q=4, heads_kv=4, head_dim=8)
        out += check_cp_attention(rank, cp, [AttentionCase(**shape, causal=True, load_balanced=True)], llama3_style_masked, options=HP)
        out += check_cp_attention(rank, cp, [AttentionCase(**shape, causal=False)], head_stride_loop, options=HP)
    return out


CASES = {
    2: [
        AttentionCase(batch=1, seq=32, heads_q=8, heads_kv=2, head_dim=8, causal=True, load_balanced=True),
        AttentionCase(batch=2, seq=16, heads_q=4, heads_kv=4, head_dim=8, layout="bhsd", causal=True),
        AttentionCase(batch=1, seq=16, heads_q=4, heads_kv=2, head_dim=8, causal=False),
    ],
    4: [AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, layout="bhsd", causal=True, load_balanced=True)],
}


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_numerics_gloo(cp):
    """Output and every gradient within fp32 tolerance of the fp64 reference with every all-gather
    region's calls split, forward and backward (GQA causal load-balanced, BHSD, not causal;
    hand-written Llama3-style masks and a head-stride gather loop at cp=2)."""
    for rank_results in run_on_ranks(_check, cp, CASES[cp], cp == 2):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, (r["case"], key, r[key])
            # Every region (several per graph: one per attention call over gathered keys) split.
            assert r["applied"] == ["head_split"] and region_rewrites(r) == {"head_split": len(r["report"])}, r
            assert {row[:3] for row in r["report"]} == {("forward", "allgather", cp), ("backward", "allgather", cp)}, r


# --- ring regions: the same split of each step's call; the rotations stay whole, and the
# rewrites after it (ce_rotation, narrow_rotation) still find the region through its first call.


def ring_split(cp, fn, copy_engines=False, **cfg) -> str:
    from unittest import mock

    from cp_inductor.lowerings import ce_transport
    from helpers import ring_graphs, rotations

    cfg = {"head_split": True, "strict": True, "ce_rotation_min_bytes": 0, **ANY_SIZE, **cfg}
    available = mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None)
    with available if copy_engines else contextlib.nullcontext():
        rows, graphs = ring_graphs(cp, fn, qkv(4, 2, seq=8), **cfg)
    lines = [f"{kind}: {rotations(gm, heads=True)}" for kind, gm in graphs.items()]
    applied = sorted({f"{r.graph_kind}: {' '.join(r.applied)}" for r in rows})
    return "\n".join(lines + applied)


def hand_ring(q, k, v):
    from ring_programs import ring_by_hand

    return ring_by_hand(q, k, v, causal=True)


class TestRing(TestCase):
    def test_hand_written_ring_cp2_with_copy_engine_rotations(self):
        # Every step's call in two groups; ce_rotation still moves the rotations (it finds each
        # split region again through its first call). One line per region kind in the report.
        self.assertExpectedInline(ring_split(2, hand_ring, copy_engines=True, head_split_forward=True), """\
forward: ce#0(to 1, from 1) attn(h=2) attn(h=2) wait#0 attn(h=2) attn(h=2)
backward: attn(h=2) attn(h=2) ce#0(to 1, from 1) attn(h=2) attn(h=2) wait#0 ce#1(to 1, from 1) wait#1
backward: head_split ce_rotation
forward: head_split
forward: head_split ce_rotation""")

    def test_native_context_parallel_cp4(self):
        from ring_programs import native_options, native_ring

        # Native CP's all-to-all rotation, load-balanced; the backward's calls split (forward off).
        with native_options("alltoall", load_balance=True):
            text = ring_split(4, lambda q, k, v: native_ring(q, k, v, causal=True))
        self.assertExpectedInline(text, """\
forward: nccl#0 wait#0 attn(h=4) nccl#1 wait#1 attn(h=4) nccl#2 wait#2 attn(h=4) attn(h=4)
backward: attn(h=2) attn(h=2) nccl#0 wait#0 nccl#1 wait#1 attn(h=2) attn(h=2) nccl#2 wait#2 nccl#3 wait#3 attn(h=2) attn(h=2) nccl#4 wait#4 attn(h=2) attn(h=2) nccl#5 wait#5
backward: head_split
forward: """)


def _check_ring(rank, cp):
    from ring_programs import native_options, native_ring, ring_by_hand

    case = AttentionCase(batch=2, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True)
    out = check_cp_attention(rank, cp, [case], lambda q, k, v: ring_by_hand(q, k, v, causal=True), options=HP)
    mha = AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=4, head_dim=8, causal=True, load_balanced=True)
    with native_options("alltoall", load_balance=True):
        out += check_cp_attention(rank, cp, [mha], lambda q, k, v: native_ring(q, k, v, causal=True), options=HP)
    return out


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_ring_numerics_gloo(cp):
    """The hand-written ring (GQA, batch 2) and native CP's ring code (all-to-all rotation),
    every region's calls split forward and backward: within fp32 tolerance of the fp64 reference."""
    for rank_results in run_on_ranks(_check_ring, cp):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, (r["case"], key, r[key])
            assert r["applied"] == ["head_split"], r
            assert region_rewrites(r) == {"head_split": len(r["report"])}, r
