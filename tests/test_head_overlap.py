"""head_overlap: golden schedules (collectives, waits and attention calls in order), the order
Inductor keeps in its generated code, eligibility reasons, numerics on gloo."""

import functools
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import cp_inductor
import variants
from cp_inductor.testing.checks import AttentionCase, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from cp_inductor.lowerings import ce_transport
from cp_inductor.passes import engine
from cp_inductor.passes.experimental import head_overlap
from helpers import aot_graphs, assert_cp_results, fake_pg, region_rewrites, schedule
from test_fused_a2a import qkv, ulysses


# head_overlap builds on fused_a2a's views; at these tiny shapes the cost model would copy.
VIEWS = {"cp_inductor.fused_a2a_unpack": "views"}


def run_passes(graph):
    engine.rewrite_graph(graph)


def partitioned(cp, fn, *inputs, **cfg) -> str:
    """Each graph's schedule after the post-grad passes, with head_overlap on."""
    cfg = {"fused_a2a_unpack": "views", **cfg}
    with fake_pg(cp), cp_inductor.config.patch(head_overlap=True, **cfg):
        graphs = aot_graphs(fn, *inputs)
        lines = []
        for kind, gm in graphs.items():
            run_passes(gm.graph)
            lines.append(f"{kind}: {schedule(gm)}")
    return "\n".join(lines)


class TestGolden(TestCase):
    def test_backward_in_two_groups_forward_fused_only(self):
        # Default: the forward stays one fused region; the backward sends dO in two collectives
        # at once, then each group's dq/dk/dv right after its attention.
        text = partitioned(2, ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)))
        self.assertExpectedInline(text, """\
forward: a2a#0[2, 8, 2, 8, 16] wait#0 attn(h=4) a2a#1[2, 8, 2, 4, 16] wait#1
backward: a2a#0[2, 8, 2, 2, 16] a2a#1[2, 8, 2, 2, 16] wait#0 attn(h=2) a2a#2[2, 8, 2, 4, 16] wait#1 attn(h=2) a2a#3[2, 8, 2, 4, 16] wait#2 wait#3""")

    def test_forward_too_cp4_four_groups(self):
        text = partitioned(
            4, ulysses(is_causal=True), *qkv((1, 8, 16, 8), (1, 8, 16, 8)), head_overlap_groups=4, head_overlap_forward=True
        )
        self.assertExpectedInline(text, """\
forward: a2a#0[4, 8, 1, 3, 8] a2a#1[4, 8, 1, 3, 8] a2a#2[4, 8, 1, 3, 8] a2a#3[4, 8, 1, 3, 8] wait#0 attn(h=1) a2a#4[4, 8, 1, 1, 8] wait#1 attn(h=1) a2a#5[4, 8, 1, 1, 8] wait#2 attn(h=1) a2a#6[4, 8, 1, 1, 8] wait#3 attn(h=1) a2a#7[4, 8, 1, 1, 8] wait#4 wait#5 wait#6 wait#7
backward: a2a#0[4, 8, 1, 1, 8] a2a#1[4, 8, 1, 1, 8] a2a#2[4, 8, 1, 1, 8] a2a#3[4, 8, 1, 1, 8] wait#0 attn(h=1) a2a#4[4, 8, 1, 3, 8] wait#1 attn(h=1) a2a#5[4, 8, 1, 3, 8] wait#2 attn(h=1) a2a#6[4, 8, 1, 3, 8] wait#3 attn(h=1) a2a#7[4, 8, 1, 3, 8] wait#4 wait#5 wait#6 wait#7""")

    def test_copy_engine_transport(self):
        # Where the copy engines can run, each group's all-to-all is a start/wait pair of the
        # copy-engine ops, in the same order (the CPU has none: availability is faked here).
        with mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None):
            text = partitioned(
                2, ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)),
                head_overlap_transport="copy_engine", head_overlap_forward=True,
            )
        self.assertExpectedInline(text, """\
forward: ce#0[2, 8, 2, 4, 16] ce#1[2, 8, 2, 4, 16] wait#0 attn(h=2) ce#2[2, 8, 2, 2, 16] wait#1 attn(h=2) ce#3[2, 8, 2, 2, 16] wait#2 wait#3
backward: ce#0[2, 8, 2, 2, 16] ce#1[2, 8, 2, 2, 16] wait#0 attn(h=2) ce#2[2, 8, 2, 4, 16] wait#1 attn(h=2) ce#3[2, 8, 2, 4, 16] wait#2 wait#3""")

    def test_bhsd_gqa_cp8(self):
        text = partitioned(8, ulysses(layout="bhsd"), *qkv((1, 32, 16, 8), (1, 16, 16, 8)))
        self.assertExpectedInline(text, """\
forward: a2a#0[8, 16, 1, 8, 8] wait#0 attn(h=4) a2a#1[8, 16, 1, 4, 8] wait#1
backward: a2a#0[8, 16, 1, 2, 8] a2a#1[8, 16, 1, 2, 8] wait#0 attn(h=2) a2a#2[8, 16, 1, 4, 8] wait#1 attn(h=2) a2a#3[8, 16, 1, 4, 8] wait#2 wait#3""")

    def test_hand_written_transpose_then_reshape(self):
        text = partitioned(2, variants.transpose_then_reshape, *qkv((2, 4, 8, 16), (2, 4, 8, 16)))
        self.assertExpectedInline(text, """\
forward: a2a#0[2, 4, 2, 12, 16] wait#0 attn(h=4) a2a#1[2, 4, 2, 4, 16] wait#1
backward: a2a#0[2, 4, 2, 2, 16] a2a#1[2, 4, 2, 2, 16] wait#0 attn(h=2) a2a#2[2, 4, 2, 6, 16] wait#1 attn(h=2) a2a#3[2, 4, 2, 6, 16] wait#2 wait#3""")

    def test_memory_efficient_attention(self):
        # Traced on meta tensors: the CPU has no kernel for the memory-efficient op.
        inputs = [torch.randn(2, 8, 8, 16, device="meta", requires_grad=True) for _ in range(3)]
        text = partitioned(2, efficient_ulysses, *inputs, head_overlap_forward=True)
        self.assertExpectedInline(text, """\
forward: a2a#0[2, 8, 2, 6, 16] a2a#1[2, 8, 2, 6, 16] wait#0 attn(h=2) a2a#2[2, 8, 2, 2, 16] wait#1 attn(h=2) a2a#3[2, 8, 2, 2, 16] wait#2 wait#3
backward: a2a#0[2, 8, 2, 2, 16] a2a#1[2, 8, 2, 2, 16] wait#0 attn(h=2) a2a#2[2, 8, 2, 6, 16] wait#1 attn(h=2) a2a#3[2, 8, 2, 6, 16] wait#2 wait#3""")


# CUDA's fp32 kernel; its backward names dO ``grad_out_`` and also returns a bias gradient.
efficient_ulysses = variants.around(
    lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, is_causal=True)[0]
)
# Dropout: each group would draw its own random mask.
dropout_ulysses = variants.around(
    lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.1, True)[0]
)
# An explicit boolean mask: the rewrite does not split masks by heads.
masked_ulysses = variants.around(
    lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    )
)


def skip_reasons(cp, fn, *inputs, **cfg) -> str:
    cfg = {"fused_a2a_unpack": "views", **cfg}
    with fake_pg(cp), cp_inductor.config.patch(head_overlap=True, **cfg):
        graphs = aot_graphs(fn, *inputs)
        lines = []
        for kind, gm in graphs.items():
            for r in engine.analyze(gm.graph, kind):
                lines.append(f"{kind}: {r.skipped.get('head_overlap', 'applied')}")
    return "\n".join(lines)


class TestEligibility(TestCase):
    def test_reasons(self):
        gqa = qkv((2, 8, 8, 16), (2, 8, 4, 16))
        cases = {
            "default (forward off)": skip_reasons(2, ulysses(is_causal=True), *gqa),
            "head_overlap_groups=3": skip_reasons(2, ulysses(is_causal=True), *gqa, head_overlap_groups=3),
            "one kv head per rank": skip_reasons(4, ulysses(), *qkv((1, 8, 8, 16), (1, 8, 4, 16))),
            "fused_a2a off": skip_reasons(2, ulysses(), *gqa, fused_a2a=False),
            "unpack copies": skip_reasons(2, ulysses(), *gqa, fused_a2a_unpack="copy"),
            "mask": skip_reasons(2, masked_ulysses, *qkv((1, 8, 4, 16), (1, 8, 4, 16)), head_overlap_forward=True),
            "GQA by expand": skip_reasons(
                2, variants.expanded_kv_heads, *qkv((1, 8, 8, 16), (1, 8, 4, 16)), head_overlap_forward=True
            ),
            "dropout (meta tensors)": skip_reasons(
                2, dropout_ulysses, *[torch.randn(1, 8, 4, 16, device="meta", requires_grad=True) for _ in range(3)],
                head_overlap_forward=True,
            ),
        }
        text = "\n".join(f"# {name}\n{reasons}" for name, reasons in cases.items())
        self.assertExpectedInline(text, """\
# default (forward off)
forward: forward region (head_overlap_forward=False)
backward: applied
# head_overlap_groups=3
forward: forward region (head_overlap_forward=False)
backward: head_overlap_groups=3 does not divide the local heads (Hq/cp=4, Hkv/cp=2)
# one kv head per rank
forward: forward region (head_overlap_forward=False)
backward: local heads Hq/cp=2, Hkv/cp=1 have no common divisor in 2..2
# fused_a2a off
forward: needs fused_a2a (disabled by config)
backward: needs fused_a2a (disabled by config)
# unpack copies
forward: forward region (head_overlap_forward=False)
backward: needs fused_a2a's views; fused_a2a copies (set by config)
# mask
forward: attention mask or bias (not split by heads)
backward: attention mask or bias (not split by heads)
# GQA by expand
forward: attention does not read the received buffer as a view
backward: a gradient is summed over replicated heads before its all_to_all
# dropout (meta tensors)
forward: dropout (each group would draw its own mask)
backward: dropout (each group would draw its own mask)""")


def _generated_order(codes) -> list[str]:
    """all_to_all / wait / attention calls in the order Inductor's wrapper code makes them."""
    order = []
    for code in codes:
        calls = re.findall(r"(all_to_all_single|wait_tensor|_scaled_dot_product\w+)\.default\(", code)
        names = {"all_to_all_single": "a2a", "wait_tensor": "wait"}
        order.append(" ".join(names.get(c, "attn") for c in calls))
    return order


def test_inductor_keeps_the_overlapping_order():
    """Inductor's CPU code issues collectives in the order the pass emitted (its peak-memory
    reordering, which would sink each collective to its wait, is off for these graphs)."""
    from torch._inductor.utils import run_and_get_code

    with fake_pg(2), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        q, k, v = qkv((2, 8, 8, 16), (2, 8, 4, 16))
        f = torch.compile(
            ulysses(is_causal=True), backend="cp_inductor", fullgraph=True,
            options={"cp_inductor.head_overlap": True, "cp_inductor.head_overlap_forward": True, **VIEWS},
        )
        _, codes = run_and_get_code(lambda: f(q, k, v).sum().backward())
    assert _generated_order(codes) == [
        "a2a a2a wait attn a2a wait attn a2a wait wait",
        "a2a a2a wait attn a2a wait attn a2a wait wait",
    ]


class TestTransportReport(TestCase):
    def test_copy_engine_falls_back_with_the_reason(self):
        with fake_pg(2), cp_inductor.config.patch(head_overlap=True, fused_a2a_unpack="views", head_overlap_transport="copy_engine"):
            graphs = aot_graphs(ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)))
            details = [r.detail for r in engine.analyze(graphs["backward"].graph, "backward")]
            for gm in graphs.values():
                run_passes(gm.graph)
            text = "\n".join(details) + "\n" + "\n".join(f"{k}: {schedule(gm)}" for k, gm in graphs.items())
        self.assertExpectedInline(text, """\
Hq=8 Hkv=4 causal unpack=views (set by config) G=2, transport=nccl (copy-engine transport needs CUDA tensors (got cpu))
forward: a2a#0[2, 8, 2, 8, 16] wait#0 attn(h=4) a2a#1[2, 8, 2, 4, 16] wait#1
backward: a2a#0[2, 8, 2, 2, 16] a2a#1[2, 8, 2, 2, 16] wait#0 attn(h=2) a2a#2[2, 8, 2, 4, 16] wait#1 attn(h=2) a2a#3[2, 8, 2, 4, 16] wait#2 wait#3""")

    def test_auto_weighs_the_attention(self):
        # Copy engines available (faked): "auto" takes them only for attention long enough to
        # hide their host-side work; this region is far below the measured threshold.
        with mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None):
            details = []
            for threshold in (2.0, 0.0):
                with fake_pg(2), cp_inductor.config.patch(head_overlap=True, fused_a2a_unpack="views",
                                                          head_overlap_transport="auto", head_overlap_transport_min_tflop=threshold):
                    graphs = aot_graphs(ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)))
                    details += [r.detail.split("G=")[1] for r in engine.analyze(graphs["backward"].graph, "backward")]
        self.assertExpectedInline("\n".join(details), """\
2, transport=nccl (attention 6.6e-08 TFLOP < head_overlap_transport_min_tflop 2)
2, transport=copy_engine (attention 6.6e-08 TFLOP >= head_overlap_transport_min_tflop 0)""")


HP_ALL = {"cp_inductor.head_overlap": True, "cp_inductor.head_overlap_forward": True, **VIEWS}


def _assert_partitioned(results):
    assert_cp_results(results, 1e-5, ("fused_a2a", "head_overlap"))


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_numerics_gloo(cp):
    cases = [
        AttentionCase(layout="bshd", causal=True, heads_q=16, heads_kv=8),
        AttentionCase(layout="bhsd", causal=False, heads_q=8, heads_kv=8),
    ]
    for rank_results in run_on_ranks(check_cp_attention, cp, cases, None, "cp_inductor", "cpu", HP_ALL):
        _assert_partitioned(rank_results)


def _check_with_copy_engine_ops(rank, cp, *args):
    """check_cp_attention with the copy-engine ops emitted on gloo (where they fall back to
    torch.distributed's all-to-all): the rewritten graph's plumbing (slots, waits, reassembly)
    checked against the fp64 reference. No FX graph cache: the faked choice is not in its key."""
    torch._inductor.config.fx_graph_cache = False
    head_overlap.transport_choice = lambda region, cfg: ("copy_engine", "faked on CPU")
    return check_cp_attention(rank, cp, *args)


def test_numerics_gloo_copy_engine_ops():
    cases = [AttentionCase(layout="bshd", causal=True, heads_q=8, heads_kv=4)]
    options = {**HP_ALL, "cp_inductor.head_overlap_transport": "copy_engine"}
    _assert_partitioned(run_on_ranks(_check_with_copy_engine_ops, 2, cases, None, "cp_inductor", "cpu", options)[0])


@pytest.mark.wide
def test_numerics_gloo_hand_written_and_backward_only():
    case = AttentionCase(layout="bshd", causal=True, heads_q=4, heads_kv=4)
    fn = functools.partial(variants.transpose_then_reshape, is_causal=True)
    _assert_partitioned(run_on_ranks(check_cp_attention, 2, [case], fn, "cp_inductor", "cpu", HP_ALL)[0])
    bhsd = AttentionCase(layout="bhsd", causal=True, heads_q=4, heads_kv=4)
    fn = functools.partial(variants.flattened_buffer, is_causal=True)
    _assert_partitioned(run_on_ranks(check_cp_attention, 2, [bhsd], fn, "cp_inductor", "cpu", HP_ALL)[0])
    # Default: only the backward region is partitioned.
    options = {"cp_inductor.head_overlap": True, **VIEWS}
    for r in run_on_ranks(check_cp_attention, 2, [case], None, "cp_inductor", "cpu", options)[0]:
        assert max(r["compiled_vs_ref"].values()) < 1e-5
        assert region_rewrites(r) == {"fused_a2a": 2, "head_overlap": 1}, r


def test_inductor_config_follows_what_was_kept():
    """head_overlap needs Inductor's reorder_for_peak_memory off: set when the rewrite is kept on
    a graph, for that graph's compile only (the backend's patch restores it), and not where the
    check undid the rewrite."""
    from torch._inductor import config as inductor_config

    from helpers import pass_replaced

    def broken(graph, region, cfg):
        replaced = head_overlap.apply(graph, region, cfg)
        old, new, strides = replaced[0]
        return [(old, graph.call_function(torch.ops.aten.slice.Tensor, (new, 0, 0, 1)), strides)] + replaced[1:]

    seen = {}
    for name, fields in (("kept", {}), ("undone", {"apply": broken})):
        with fake_pg(2), cp_inductor.config.patch(head_overlap=True, fused_a2a_unpack="views", strict=False), \
                inductor_config.patch(reorder_for_peak_memory=True):
            graphs = aot_graphs(ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)))
            with inductor_config.patch(engine.inductor_patch_keys()), pass_replaced(head_overlap.PASS, **fields):
                run_passes(graphs["backward"].graph)
                seen[name] = inductor_config.reorder_for_peak_memory
            assert inductor_config.reorder_for_peak_memory, "the graph's patch outlived its compile"
    assert seen == {"kept": False, "undone": True}, seen
