"""Golden graphs for Ulysses region detection: one process, fake process group, no codegen."""

import torch
from expecttest import TestCase

import variants
from cp_inductor.parallel import ulysses_attention
from helpers import aot_graphs, describe_regions, fake_pg, report_text


def ulysses(**kw):
    return lambda q, k, v: ulysses_attention(q, k, v, **kw)


def regions(cp, fn, *inputs):
    """What detection finds in ``fn``'s graphs on a fake process group of size ``cp``."""
    with fake_pg(cp):
        return describe_regions(aot_graphs(fn, *inputs))


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


def program(cp, **fields):
    """A generator program (tests/ulysses_programs.py) with these fields, and its graphs' regions."""
    import ulysses_programs as up

    fn, inputs = up.build(up.Spec(0, fields.pop("kind", "ulysses"), **fields), cp)
    with fake_pg(cp):
        graphs = aot_graphs(fn, *inputs)
        return describe_regions(graphs), report_text(graphs)


class TestHeadPartitions(TestCase):
    """Which heads a rank holds is the program's choice; q's and k/v's must pair as on one device."""

    def test_round_robin_heads_cp4(self):
        text, _ = program(4, heads_order="round_robin", heads=2)
        self.assertExpectedInline(text, """\
forward: a2a cp=4 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=8 Hkv=8 causal
  q        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  k        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  v        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  out      bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=4 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=8 Hkv=8 causal
  grad_out bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dq       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dk       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dv       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view""")

    def test_fused_qkv_heads_cut_per_rank_gqa_cp2(self):
        # Megatron-style: [B, S/cp, cp x (q | k | v heads of a rank), D] through ONE all-to-all
        text, _ = program(2, source="fused_heads", gqa="sdpa", heads=2)
        self.assertExpectedInline(text, """\
forward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=2 causal
  q        bshd: view -> view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> split_with_sizes -> getitem
  k        bshd: view -> view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> split_with_sizes -> getitem
  v        bshd: view -> view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> split_with_sizes -> getitem
  out      bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=2 causal
  grad_out bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dq       ?: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> view -> view
  dk       ?: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> view -> view
  dv       ?: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> view -> view""")

    def test_kv_replicated_before_the_collective_fewer_heads_than_ranks_cp4(self):
        text, _ = program(4, gqa="expand_before", heads=1)
        self.assertExpectedInline(text, """\
forward: a2a cp=4 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=4 causal
  q        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  k        bshd: unsqueeze -> expand -> clone -> view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  v        bshd: unsqueeze -> expand -> clone -> view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  out      bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
backward: a2a cp=4 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=4 causal
  grad_out bshd: view -> permute -> ALL_TO_ALL -> permute -> clone -> view
  dq       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view
  dk       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view -> view -> sum -> squeeze
  dv       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> view -> view -> sum -> squeeze""")

    def test_q_k_v_one_tensor_one_all_to_all_cp2(self):
        text, _ = program(2, source="self_once", heads=2)
        self.assertExpectedInline(text, """\
forward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=4 causal
  q        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  k        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  v        bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  out      bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=4 causal
  grad_out bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dq       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dk       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dv       bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view""")

    def test_kv_dealt_otherwise_than_q_say_why(self):
        _, report = program(2, kind="kv_round_robin", heads=2)
        self.assertExpectedInline(report, """\
rejected forward _scaled_dot_product_flash_attention_for_cpu: query and key/value heads pair otherwise than on one device (the ranks' head blocks of q and of k/v differ)
rejected backward _scaled_dot_product_flash_attention_for_cpu_backward: query and key/value heads pair otherwise than on one device (the ranks' head blocks of q and of k/v differ)""")


class TestTokenDispatch(TestCase):
    def test_moe_combine_feeding_attention_says_why(self):
        # the expert output's heads split as a Ulysses scatter would, its rows tokens from elsewhere
        _, report = program(2, kind="moe_combine", heads=2, batch=1)
        self.assertExpectedInline(report, """\
rejected forward _scaled_dot_product_flash_attention_for_cpu: the all_to_all sends rows another all_to_all brought here (a token dispatch and combine), not this rank's sequence
rejected backward _scaled_dot_product_flash_attention_for_cpu_backward: the rows that come back are sent on by rows by another all_to_all (a token dispatch's way back), not this rank's sequence""")

    def test_moe_combine_dispatch_chunks_across_batch_and_tokens_cp4(self):
        # 2 x 8 token rows in 4 chunks: the dispatch's split cuts across batch and sequence
        _, report = program(4, kind="moe_combine", heads=1, batch=2)
        self.assertExpectedInline(report, """\
rejected forward _scaled_dot_product_flash_attention_for_cpu: the all_to_all sends rows another all_to_all brought here (a token dispatch and combine), not this rank's sequence
rejected backward _scaled_dot_product_flash_attention_for_cpu_backward: the rows that come back are sent on by rows by another all_to_all (a token dispatch's way back), not this rank's sequence""")
