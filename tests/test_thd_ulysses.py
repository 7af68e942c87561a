"""Ulysses over packed sequences (THD, DeepSpeed ALST's form): each rank holds T/cp tokens of the
pack, an all-to-all per tensor gives it all T tokens of its heads, and varlen attention runs over
the whole pack with the global cu_seqlens. Goldens of what detection finds and what fused_a2a
makes of it (fake process group, cp = 2, 4, 8), the report's line for the call, and gloo numerics
against per-sequence fp64 SDPA for the output and every gradient."""

import pytest
import torch
from expecttest import TestCase

from cp_inductor.testing import varlen_programs as vp
from cp_inductor.testing.launch import run_on_ranks
from helpers import aot_graphs, describe_regions, fake_pg, fused_a2a_pass, rewrite_summary

pytestmark = pytest.mark.skipif(not vp.register_cpu_kernels(), reason="this torch has no torch.nn.attention.varlen")

LENGTHS = [5, 11, 8, 8]  # 32 tokens: a document of 5, one of 11 crossing a rank boundary


def _graphs(cp, heads_q=8, heads_kv=8):
    q, k, v, cu, max_len = vp.pack(LENGTHS, heads_q, heads_kv, 16)
    tokens = q.shape[0] // cp
    local = [t[:tokens].clone().requires_grad_() for t in (q, k, v)]
    return aot_graphs(lambda a, b, c: vp.ulysses_thd(a, b, c, cu, max_len), *local)


class TestDetection(TestCase):
    def test_cp2_forward_and_backward(self):
        with fake_pg(2):
            text = describe_regions(_graphs(2))
        self.assertExpectedInline(text, """\
forward: a2a cp=2 layout=thd _varlen_attn Hq=8 Hkv=8 causal
  q        thd: view -> permute -> clone -> ALL_TO_ALL -> view
  k        thd: view -> permute -> clone -> ALL_TO_ALL -> view
  v        thd: view -> permute -> clone -> ALL_TO_ALL -> view
  out      thd: view -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=2 layout=thd _varlen_attn_backward Hq=8 Hkv=8 causal
  grad_out thd: view -> permute -> clone -> ALL_TO_ALL -> view
  dq       thd: view -> ALL_TO_ALL -> permute -> clone -> view
  dk       thd: view -> ALL_TO_ALL -> permute -> clone -> view
  dv       thd: view -> ALL_TO_ALL -> permute -> clone -> view""")

    def test_cp4_gqa_heads_repeated_after_the_all_to_all(self):
        with fake_pg(4):
            text = describe_regions(_graphs(4, heads_q=8, heads_kv=4))
        self.assertExpectedInline(text, """\
forward: a2a cp=4 layout=thd _varlen_attn Hq=8 Hkv=8 causal
  q        thd: view -> permute -> clone -> ALL_TO_ALL -> view
  k        thd: view -> permute -> clone -> ALL_TO_ALL -> view -> unsqueeze -> expand -> clone -> view
  v        thd: view -> permute -> clone -> ALL_TO_ALL -> view -> unsqueeze -> expand -> clone -> view
  out      thd: view -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=4 layout=thd _varlen_attn_backward Hq=8 Hkv=8 causal
  grad_out thd: view -> permute -> clone -> ALL_TO_ALL -> view
  dq       thd: view -> ALL_TO_ALL -> permute -> clone -> view
  dk       thd: squeeze -> view -> ALL_TO_ALL -> permute -> view
  dv       thd: squeeze -> view -> ALL_TO_ALL -> permute -> view""")

    def test_cp8_one_head_per_rank(self):
        with fake_pg(8):
            text = describe_regions(_graphs(8))
        self.assertExpectedInline(text, """\
forward: a2a cp=8 layout=thd _varlen_attn Hq=8 Hkv=8 causal
  q        thd: view -> permute -> clone -> ALL_TO_ALL -> view
  k        thd: view -> permute -> clone -> ALL_TO_ALL -> view
  v        thd: view -> permute -> clone -> ALL_TO_ALL -> view
  out      thd: view -> ALL_TO_ALL -> permute -> view
backward: a2a cp=8 layout=thd _varlen_attn_backward Hq=8 Hkv=8 causal
  grad_out thd: view -> permute -> ALL_TO_ALL -> view
  dq       thd: view -> ALL_TO_ALL -> permute -> view
  dk       thd: view -> ALL_TO_ALL -> permute -> view
  dv       thd: view -> ALL_TO_ALL -> permute -> view""")


class TestFusedA2A(TestCase):
    def test_cp2_one_all_to_all_each_way(self):
        # Forward: q, k, v in one all-to-all; out alone (views). Backward: dO alone; dq, dk, dv in one.
        with fake_pg(2):
            text = rewrite_summary(_graphs(2), fused_a2a_pass)
        self.assertExpectedInline(text, """\
forward before: a2a[2, 16, 4, 16], a2a[2, 16, 4, 16], a2a[2, 16, 4, 16], a2a[2, 16, 4, 16] (all_to_all=4 clone=4)
forward after:  a2a[2, 16, 1, 12, 16], a2a[2, 16, 1, 4, 16] (all_to_all=2 clone=2)
backward before: a2a[2, 16, 4, 16], a2a[2, 16, 4, 16], a2a[2, 16, 4, 16], a2a[2, 16, 4, 16] (all_to_all=4 clone=4)
backward after:  a2a[2, 16, 1, 4, 16], a2a[2, 16, 1, 12, 16] (all_to_all=2 clone=6)""")


def test_report_names_the_call_a2a():
    from test_varlen_cudnn import rewritten

    q, k, v, cu, max_len = vp.pack(LENGTHS, 8, 8, 16)
    with fake_pg(2):
        _, routes = rewritten(lambda a, b, c: vp.ulysses_thd(a, b, c, cu, max_len), q[:16], k[:16], v[:16])
    assert [r.line().split(":")[1].strip().split(",")[0] for r in routes] == ["a2a"], [r.line() for r in routes]


@pytest.mark.parametrize("cp,heads_kv,causal,on_reference_op,attention", [
    (2, 4, True, False, "varlen_attn"),  # torch's varlen op on the tests' CPU kernels
    (2, 4, False, True, "varlen_attn"),  # lowered to cp_inductor's op (its CPU reference), K/V repeat dropped
    pytest.param(4, 8, False, True, "varlen_attn", marks=pytest.mark.wide),
    (2, 4, True, True, "flash_attn"),  # ALST's own call: flash-attn's Function, lowered
])
def test_numerics_gloo(cp, heads_kv, causal, on_reference_op, attention):
    # A second pack of the same size with other lengths runs through the same compiled program.
    more = [[16, 2, 1, 13]]
    for packs, regions, lines in run_on_ranks(vp.check_ulysses_thd, cp, LENGTHS, 8, heads_kv, causal, on_reference_op,
                                              "cpu", torch.float32, more, None, attention):
        for errors, _ in packs:
            assert max(errors.values()) < 1e-5, errors
        assert regions == [("backward", "thd", ("fused_a2a",)), ("forward", "thd", ("fused_a2a",))], regions
        assert len(set(lines)) == 1 and ": a2a, thd," in lines[0], lines
        # flash-attn's call passes cu_seqlens_k apart from cu_seqlens_q: FA4's (cuDNN masks bottom-right then)
        path = ": fa4_varlen" if attention == "flash_attn" and causal else ": cudnn_ragged"
        assert (path in lines[0]) == on_reference_op, lines


def test_on_gpus_a_pack_keeps_its_all_to_alls_by_the_measured_cost():
    """fused_a2a's unpack choice for a pack whose attention runs on CUDA: skipped with the
    measured reason (one rank's compute was slower than the program's own unpack by more than
    the collectives saved); forced by config, it applies."""
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from cp_inductor.config_snapshot import snapshot
    from cp_inductor.lowerings import varlen_attention  # noqa: F401 - defines the op
    from cp_inductor.passes.post_grad.ulysses_buffers import PACKED_SKIP, unpack_choice

    graph = torch.fx.Graph()
    with FakeTensorMode():
        vals = [torch.empty(4096, 8, 128, device="cuda", dtype=torch.bfloat16),
                *(torch.empty(4096, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)),
                torch.empty(5, device="cuda", dtype=torch.int32)]
    nodes = []
    for name, val in zip(("q", "k", "v", "cu"), vals):
        nodes.append(graph.placeholder(name))
        nodes[-1].meta["val"] = val
    q, k, v, cu = nodes
    attention = graph.call_function(torch.ops.cp_inductor.varlen_attention.default, (q, k, v, cu, cu, 2048, 2048, 0.1, True))
    region = SimpleNamespace(attention=attention, is_causal=True)
    assert (unpack_choice(region, snapshot()).choice, unpack_choice(region, snapshot()).reason) == ("skip", PACKED_SKIP)
    assert unpack_choice(region, snapshot({"fused_a2a_unpack": "copy"})).choice == "copy"
