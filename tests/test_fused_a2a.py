"""fused_a2a: golden graphs (collectives and copies before/after), eligibility, kernels."""

import re

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from expecttest import TestCase

import variants
import cp_inductor
from cp_inductor.parallel import ulysses_attention
from helpers import aot_graphs, fake_pg, fused_a2a_pass, report_text, rewrite_summary


def qkv(shape_q, shape_kv, dtypes=(torch.float32,) * 3):
    g = torch.Generator().manual_seed(0)
    shapes = (shape_q, shape_kv, shape_kv)
    return [torch.randn(s, generator=g).to(dt).requires_grad_() for s, dt in zip(shapes, dtypes)]


def ulysses(**kw):
    return lambda q, k, v: ulysses_attention(q, k, v, **kw)


def fused(cp, fn, *inputs, unpack="views"):
    """Collectives and copies of ``fn``'s graphs before and after fused_a2a, on a fake group
    (attention reads views of the received buffer unless ``unpack`` says otherwise)."""
    with fake_pg(cp), cp_inductor.config.patch(fused_a2a_unpack=unpack):
        return rewrite_summary(aot_graphs(fn, *inputs), fused_a2a_pass)


class TestGolden(TestCase):
    def test_bshd_gqa_cp2(self):
        text = fused(2, ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)))
        self.assertExpectedInline(text, """\
forward before: a2a[2, 2, 8, 4, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 4, 16] (all_to_all=4 clone=8)
forward after:  a2a[2, 8, 2, 8, 16], a2a[2, 8, 2, 4, 16] (all_to_all=2 clone=2)
backward before: a2a[2, 2, 8, 4, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 4, 16] (all_to_all=4 clone=8)
backward after:  a2a[2, 8, 2, 4, 16], a2a[2, 8, 2, 8, 16] (all_to_all=2 clone=7)""")

    def test_bhsd_cp4(self):
        text = fused(4, ulysses(layout="bhsd"), *qkv((1, 8, 8, 16), (1, 8, 8, 16)))
        self.assertExpectedInline(text, """\
forward before: a2a[4, 1, 2, 8, 16], a2a[4, 1, 2, 8, 16], a2a[4, 1, 2, 8, 16], a2a[4, 1, 2, 8, 16] (all_to_all=4 clone=4)
forward after:  a2a[4, 8, 1, 6, 16], a2a[4, 8, 1, 2, 16] (all_to_all=2 clone=1)
backward before: a2a[4, 1, 2, 8, 16], a2a[4, 1, 2, 8, 16], a2a[4, 1, 2, 8, 16], a2a[4, 1, 2, 8, 16] (all_to_all=4 clone=4)
backward after:  a2a[4, 8, 1, 2, 16], a2a[4, 8, 1, 6, 16] (all_to_all=2 clone=4)""")

    def test_one_kv_head_per_rank_cp8(self):
        text = fused(8, ulysses(is_causal=True), *qkv((1, 4, 16, 8), (1, 4, 8, 8)))
        self.assertExpectedInline(text, """\
forward before: a2a[8, 1, 4, 2, 8], a2a[8, 1, 4, 1, 8], a2a[8, 1, 4, 1, 8], a2a[8, 1, 4, 2, 8] (all_to_all=4 clone=4)
forward after:  a2a[8, 4, 1, 4, 8], a2a[8, 4, 1, 2, 8] (all_to_all=2 clone=2)
backward before: a2a[8, 1, 4, 2, 8], a2a[8, 1, 4, 1, 8], a2a[8, 1, 4, 1, 8], a2a[8, 1, 4, 2, 8] (all_to_all=4 clone=2)
backward after:  a2a[8, 4, 1, 2, 8], a2a[8, 4, 1, 4, 8] (all_to_all=2 clone=4)""")

    def test_hand_written_transpose_then_reshape_cp4(self):
        text = fused(4, variants.transpose_then_reshape, *qkv((2, 4, 8, 16), (2, 4, 8, 16)))
        self.assertExpectedInline(text, """\
forward before: a2a[4, 4, 2, 2, 16], a2a[4, 4, 2, 2, 16], a2a[4, 4, 2, 2, 16], a2a[4, 2, 2, 4, 16] (all_to_all=4 clone=5)
forward after:  a2a[4, 4, 2, 6, 16], a2a[4, 4, 2, 2, 16] (all_to_all=2 clone=2)
backward before: a2a[4, 2, 2, 4, 16], a2a[4, 4, 2, 2, 16], a2a[4, 4, 2, 2, 16], a2a[4, 4, 2, 2, 16] (all_to_all=4 clone=8)
backward after:  a2a[4, 4, 2, 2, 16], a2a[4, 4, 2, 6, 16] (all_to_all=2 clone=6)""")

    def test_hand_written_flattened_buffer_cp2(self):
        text = fused(2, variants.flattened_buffer, *qkv((1, 4, 8, 16), (1, 4, 8, 16)))
        self.assertExpectedInline(text, """\
forward before: a2a[512], a2a[512], a2a[512], a2a[512] (all_to_all=4 clone=4)
forward after:  a2a[2, 8, 1, 6, 16], a2a[2, 8, 1, 2, 16] (all_to_all=2 clone=1)
backward before: a2a[512], a2a[512], a2a[512], a2a[512] (all_to_all=4 clone=4)
backward after:  a2a[2, 8, 1, 2, 16], a2a[2, 8, 1, 6, 16] (all_to_all=2 clone=4)""")

    def test_expanded_kv_heads_cp4(self):
        # Backward: dk/dv are packed from the sums over the replicas (4 all-to-alls -> 2).
        text = fused(4, variants.expanded_kv_heads, *qkv((1, 8, 8, 16), (1, 8, 4, 16)))
        self.assertExpectedInline(text, """\
forward before: a2a[4, 1, 8, 2, 16], a2a[4, 1, 8, 1, 16], a2a[4, 1, 8, 1, 16], a2a[4, 1, 8, 2, 16] (all_to_all=4 clone=4)
forward after:  a2a[4, 8, 1, 4, 16], a2a[4, 8, 1, 2, 16] (all_to_all=2 clone=4)
backward before: a2a[4, 1, 8, 2, 16], a2a[4, 1, 8, 1, 16], a2a[4, 1, 8, 1, 16], a2a[4, 1, 8, 2, 16] (all_to_all=4 clone=2)
backward after:  a2a[4, 8, 1, 2, 16], a2a[4, 8, 1, 4, 16] (all_to_all=2 clone=4)""")

    def test_copy_unpack(self):
        # unpack=copy: one buffer with each tensor's rows together per destination ([cp, q | k | v]),
        # one copy per tensor into attention's old layout; dO and out keep their own crossings.
        text = fused(2, ulysses(is_causal=True), *qkv((2, 8, 8, 16), (2, 8, 4, 16)), unpack="copy")
        self.assertExpectedInline(text, """\
forward before: a2a[2, 2, 8, 4, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 4, 16] (all_to_all=4 clone=8)
forward after:  a2a[2, 2048], a2a[2, 2, 8, 4, 16] (all_to_all=2 clone=5)
backward before: a2a[2, 2, 8, 4, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 2, 16], a2a[2, 2, 8, 4, 16] (all_to_all=4 clone=8)
backward after:  a2a[2, 2, 8, 4, 16], a2a[2, 2048] (all_to_all=2 clone=8)""")

    def test_disabled_by_config_changes_nothing(self):
        with cp_inductor.config.patch(fused_a2a=False):
            text = fused(2, ulysses(), *qkv((1, 8, 4, 16), (1, 8, 4, 16)))
        self.assertExpectedInline(text, """\
forward before: a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16] (all_to_all=4 clone=4)
forward after:  a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16] (all_to_all=4 clone=4)
backward before: a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16] (all_to_all=4 clone=4)
backward after:  a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16], a2a[2, 1, 8, 2, 16] (all_to_all=4 clone=4)""")


def compressed_wire(q, k, v, wire=(torch.float32, torch.bfloat16, torch.bfloat16)):
    """q, k, v cross the all-to-all in the ``wire`` dtypes and are upcast after it."""
    group = torch.distributed.group.WORLD
    cp = torch.distributed.get_world_size()

    def scatter(x, dtype):
        b, s_l, h, d = x.shape
        send = x.to(dtype).reshape(b, s_l, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = funcol.all_to_all_single_autograd(send, None, None, group)
        return recv.permute(1, 3, 0, 2, 4).reshape(b, h // cp, cp * s_l, d).float()

    o = F.scaled_dot_product_attention(*(scatter(x, dt) for x, dt in zip((q, k, v), wire)))
    b, hl, s, d = o.shape
    send = o.reshape(b, hl, cp, s // cp, d).permute(2, 0, 3, 1, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * hl, d)


def uneven_splits(q, k, v):
    """The sequence split 3:1 between two ranks: the all-to-alls carry explicit uneven sizes
    (only the way in: enough to be rejected)."""
    group = torch.distributed.group.WORLD

    def scatter(x):
        b, s_l, h, d = x.shape
        send = x.reshape(b, s_l, 2, h // 2, d).permute(2, 0, 1, 3, 4).reshape(2 * b * s_l, h // 2, d)
        rows = b * s_l
        recv = funcol.all_to_all_single_autograd(send, [3 * rows // 2, rows // 2], [rows, rows], group)
        return recv.reshape(b, -1, h // 2, d).transpose(1, 2)

    return F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=True)


class TestEligibility(TestCase):
    def test_uneven_splits_are_not_a_region(self):
        with fake_pg(2):
            text = report_text(aot_graphs(uneven_splits, *qkv((1, 8, 4, 16), (1, 8, 4, 16))))
        self.assertExpectedInline(text, """\
rejected forward _scaled_dot_product_flash_attention_for_cpu: uneven all_to_all splits [12, 4]
rejected backward _scaled_dot_product_flash_attention_for_cpu_backward: no all_to_all or all_gather feeds q, k or v (attention on local data)""")

    def test_different_wire_dtypes_are_skipped_with_a_reason(self):
        with fake_pg(2):
            text = report_text(aot_graphs(compressed_wire, *qkv((1, 8, 4, 16), (1, 8, 4, 16))))
        self.assertExpectedInline(text, """\
forward a2a cp=2 bshd applied=[] skipped={'fused_a2a': 'q/k/v (or their gradients) have different dtypes', 'head_overlap': 'disabled by config'}
backward a2a cp=2 bshd applied=[] skipped={'fused_a2a': 'q/k/v (or their gradients) have different dtypes', 'head_overlap': 'disabled by config'}""")

    def test_expanded_kv_heads_still_fuse(self):
        # The replication happens after the collectives: the forward keeps it (unpack copies);
        # the backward sums the replicas' dk/dv, and the reduced tensors are what crosses.
        with fake_pg(2):
            text = report_text(aot_graphs(variants.expanded_kv_heads, *qkv((1, 8, 4, 16), (1, 8, 2, 16))))
        self.assertExpectedInline(text, """\
forward a2a cp=2 bshd applied=['fused_a2a'] skipped={'head_overlap': 'disabled by config'}
backward a2a cp=2 bshd applied=['fused_a2a'] skipped={'head_overlap': 'disabled by config'}""")

    def test_self_attention_on_one_tensor_is_skipped(self):
        # q = k = v: AOTAutograd's CSE leaves one all-to-all feeding all three inputs.
        x = torch.randn(1, 8, 4, 16, requires_grad=True)
        with fake_pg(2):
            text = report_text(aot_graphs(lambda x: ulysses_attention(x, x, x), x))
        self.assertExpectedInline(text, """\
forward a2a cp=2 bshd applied=[] skipped={'fused_a2a': 'q/k/v (or their gradients) already share one all_to_all', 'head_overlap': 'disabled by config'}
backward a2a cp=2 bshd applied=['fused_a2a'] skipped={'head_overlap': 'disabled by config'}""")

    def test_cast_after_the_collective_is_skipped_before_it_packed(self):
        # All three cross in bf16 and are upcast before attention: letting attention read the
        # bf16 buffer would drop that cast (forward skipped). The backward's dq/dk/dv are cast
        # down before the collective, which the pack does, and up after it, which stays where
        # the program returns them (backward fused).
        def bf16_wire(q, k, v):
            return compressed_wire(q, k, v, wire=(torch.bfloat16,) * 3)

        with fake_pg(2):
            text = report_text(aot_graphs(bf16_wire, *qkv((1, 8, 4, 16), (1, 8, 4, 16))))
        self.assertExpectedInline(text, """\
forward a2a cp=2 bshd applied=[] skipped={'fused_a2a': 'dtype cast between the all_to_all and attention', 'head_overlap': 'disabled by config'}
backward a2a cp=2 bshd applied=['fused_a2a'] skipped={'head_overlap': 'disabled by config'}""")


def _generated_code(fused: bool, unpack: str = "views") -> list[str]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q, k, v = qkv((2, 8, 8, 16), (2, 8, 4, 16))
    cfg = dict(fused_a2a=fused, fused_a2a_unpack=unpack)
    with cp_inductor.config.patch(**cfg), torch._inductor.config.patch(fx_graph_cache=False):
        f = torch.compile(ulysses(is_causal=True), backend="cp_inductor", fullgraph=True)
        _, codes = run_and_get_code(lambda: f(q, k, v).sum().backward())
    return codes


def test_generated_code_collectives_and_copy_kernels():
    """Inductor's CPU code for a GQA Ulysses forward and backward, fused_a2a off vs on."""
    count = lambda code, pat: len(re.findall(pat, code, re.M))  # noqa: E731
    with fake_pg(2):
        counts = {
            arm: [(count(c, r"all_to_all_single\.default\("), count(c, r"^cpp_fused\w+ = ")) for c in _generated_code(*arm)]
            for arm in ((False, "views"), (True, "views"), (True, "copy"))
        }
    # (all_to_alls, copy kernels) per graph, forward then backward.
    assert counts[False, "views"] == [(4, 6), (4, 6)]
    assert counts[True, "views"] == [(2, 2), (2, 4)]
    # copy: attention's inputs are unpacked as before (the user's own copies, fused into fewer
    # kernels); the lone out / dO crossings are left as they were.
    assert counts[True, "copy"] == [(2, 4), (2, 4)]
