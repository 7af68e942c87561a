"""Golden graphs for Ulysses region detection: one process, fake process group, no codegen."""

import torch
from expecttest import TestCase

import variants
from cp_inductor.parallel import ulysses_attention


def ulysses(**kw):
    return lambda q, k, v: ulysses_attention(q, k, v, **kw)


def regions(cp, fn, *inputs):
    """What detection finds in ``fn``'s graphs on a fake process group of size ``cp``."""
    with fake_pg(cp):
        return describe_regions(aot_graphs(fn, *inputs))
from helpers import aot_graphs, describe_regions, fake_pg, report_text


def qkv(shape_q, shape_kv, grad=True):
    g = torch.Generator().manual_seed(0)
    mk = lambda s: torch.randn(s, generator=g).requires_grad_(grad)  # noqa: E731
    return mk(shape_q), mk(shape_kv), mk(shape_kv)


class TestUlyssesHelpers(TestCase):
    def test_bshd_gqa_cp2(self):
        text = regions(2, ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)))
        self.assertExpectedInline(text, """\
forward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=8 Hkv=4 causal
  q        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  k        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  v        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  out      bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=8 Hkv=4 causal
  grad_out bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dq       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dk       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dv       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view""")

    def test_bhsd_cp4(self):
        text = regions(4, ulysses(layout="bhsd"), *qkv((1, 8, 8, 16), (1, 8, 8, 16)))
        self.assertExpectedInline(text, """\
forward: a2a cp=4 layout=bhsd _scaled_dot_product_flash_attention_for_cpu Hq=8 Hkv=8
  q        bhsd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view
  k        bhsd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view
  v        bhsd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view
  out      bhsd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
backward: a2a cp=4 layout=bhsd _scaled_dot_product_flash_attention_for_cpu_backward Hq=8 Hkv=8
  grad_out bhsd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view
  dq       bhsd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  dk       bhsd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  dv       bhsd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view""")

    def test_bshd_gqa_cp8_one_kv_head_per_rank(self):
        text = regions(8, ulysses(is_causal=True), *qkv((1, 4, 16, 8), (1, 4, 8, 8)))
        self.assertExpectedInline(text, """\
forward: a2a cp=8 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=16 Hkv=8 causal
  q        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  k        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  v        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  out      bshd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=8 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=16 Hkv=8 causal
  grad_out bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  dq       bshd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view
  dk       bshd: view -> permute -> ALL_TO_ALL -> permute -> view
  dv       bshd: view -> permute -> ALL_TO_ALL -> permute -> view""")

    def test_inference_graph(self):
        with fake_pg(2), torch.no_grad():
            graphs = aot_graphs(ulysses(), *qkv((1, 8, 4, 16), (1, 8, 4, 16), grad=False))
            text = describe_regions(graphs)
        self.assertExpectedInline(text, """\
inference: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=4
  q        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  k        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  v        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  out      bshd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view""")

    def test_report_rows(self):
        with fake_pg(2):
            text = report_text(aot_graphs(ulysses(), *qkv((1, 8, 4, 16), (1, 8, 4, 16))))
        self.assertExpectedInline(text, """\
forward a2a cp=2 bshd applied=['fused_a2a'] skipped={'head_overlap': 'disabled by config'}
backward a2a cp=2 bshd applied=['fused_a2a'] skipped={'head_overlap': 'disabled by config'}""")


class TestHandWrittenVariants(TestCase):
    def test_transpose_then_reshape_cp4(self):
        text = regions(4, variants.transpose_then_reshape, *qkv((2, 4, 8, 16), (2, 4, 8, 16)))
        self.assertExpectedInline(text, """\
forward: a2a cp=4 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=8 Hkv=8 causal
  q        bshd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute
  k        bshd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute
  v        bshd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute
  out      bshd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute -> clone
backward: a2a cp=4 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=8 Hkv=8 causal
  grad_out bshd: permute -> view -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dq       bshd: permute -> view -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dk       bshd: permute -> view -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dv       bshd: permute -> view -> clone -> ALL_TO_ALL -> permute -> clone -> view""")

    def test_flattened_buffer_cp2(self):
        text = regions(2, variants.flattened_buffer, *qkv((1, 4, 8, 16), (1, 4, 8, 16)))
        self.assertExpectedInline(text, """\
forward: a2a cp=2 layout=bhsd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=4 causal
  q        bhsd: view -> permute -> view -> ALL_TO_ALL -> view -> permute -> clone -> view
  k        bhsd: view -> permute -> view -> ALL_TO_ALL -> view -> permute -> clone -> view
  v        bhsd: view -> permute -> view -> ALL_TO_ALL -> view -> permute -> clone -> view
  out      bhsd: view -> permute -> clone -> view -> ALL_TO_ALL -> view -> permute -> view
backward: a2a cp=2 layout=bhsd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=4 causal
  grad_out bhsd: view -> permute -> view -> ALL_TO_ALL -> view -> permute -> clone -> view
  dq       bhsd: view -> permute -> clone -> view -> ALL_TO_ALL -> view -> permute -> view
  dk       bhsd: view -> permute -> clone -> view -> ALL_TO_ALL -> view -> permute -> view
  dv       bhsd: view -> permute -> clone -> view -> ALL_TO_ALL -> view -> permute -> view""")

    def test_seq_first_5d_cp2(self):
        text = regions(2, variants.seq_first, *qkv((8, 2, 4, 16), (8, 2, 4, 16)))
        self.assertExpectedInline(text, """\
forward: a2a cp=2 layout=sbhd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=4 causal
  q        sbhd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute
  k        sbhd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute
  v        sbhd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute
  out      sbhd: permute -> view -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=2 layout=sbhd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=4 causal
  grad_out sbhd: view -> permute -> clone -> ALL_TO_ALL -> view -> permute
  dq       sbhd: permute -> view -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dk       sbhd: permute -> view -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dv       sbhd: permute -> view -> clone -> ALL_TO_ALL -> permute -> clone -> view""")


class TestNotARegion(TestCase):
    def test_moe_dispatch(self):
        with fake_pg(2):
            tokens = torch.randn(16, 32, requires_grad=True)
            text = describe_regions(aot_graphs(variants.moe_dispatch, tokens, torch.randn(32, 32)))
        self.assertExpectedInline(text, """no regions""")

    def test_batch_exchange(self):
        text = regions(2, variants.batch_exchange, *qkv((4, 2, 8, 16), (4, 2, 8, 16)))
        self.assertExpectedInline(text, """no regions""")

    def test_interleaved_heads(self):
        text = regions(2, variants.interleaved_heads, *qkv((1, 8, 4, 16), (1, 8, 4, 16)))
        self.assertExpectedInline(text, """no regions""")


class TestRejectedReasons(TestCase):
    def test_interleaved_heads_say_why(self):
        with fake_pg(2):
            text = report_text(aot_graphs(variants.interleaved_heads, *qkv((1, 8, 4, 16), (1, 8, 4, 16))))
        self.assertExpectedInline(text, """\
rejected forward _scaled_dot_product_flash_attention_for_cpu: sequence dim is not (source rank, local position)
rejected backward _scaled_dot_product_flash_attention_for_cpu_backward: sequence dim is not (source rank, local position)""")

    def test_batch_exchange_says_why(self):
        with fake_pg(2):
            text = report_text(aot_graphs(variants.batch_exchange, *qkv((4, 2, 8, 16), (4, 2, 8, 16))))
        self.assertExpectedInline(text, """\
rejected forward _scaled_dot_product_flash_attention_for_cpu: sequence dim is not (source rank, local position)
rejected backward _scaled_dot_product_flash_attention_for_cpu_backward: sequence dim is not (source rank, local position)""")
