"""The report's note on K/V all-gather regions' dK/dV accumulators: Inductor folds the
zero-filled accumulator (the generated backward code shows it), and an accumulator an unfusable
op reads is named."""

from __future__ import annotations

import re

import torch
from expecttest import TestCase
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from cp_inductor.passes.analysis.accumulators import materialized_at
from cp_inductor.passes import engine
from helpers import aot_graphs, allgather_qkv, causal_allgather, fake_pg

aten = torch.ops.aten



class TestAccumulatorReasons(TestCase):
    def test_backward_region_note(self):
        with fake_pg(2):
            rows = [row for kind, gm in aot_graphs(causal_allgather, *allgather_qkv()).items() for row in engine.analyze(gm.graph, kind)]
        notes = sorted({f"{row.graph}: {note}" for row in rows for note in row.notes})
        self.assertExpectedInline("\n".join(notes), """\
backward: backward region proved on its own (no forward op paired with it)
backward: dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the kernel that writes the reduce-scatter input (no fill, no add-into-zero)""")

    def test_accumulator_read_by_an_unfusable_op_is_found(self):
        """A partial dK accumulator that a matmul reads must be materialized: the note names the op."""

        def backward_with_matmul(dout, q, k, v, out, lse, w):
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, False)
            acc = torch.zeros(1, 2, 16, 8).slice_scatter(dk, 2, 0, 8)
            return dq, acc @ w, dv

        q, dout, out = (torch.randn(1, 2, 8, 8) for _ in range(3))
        k, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
        gm = make_fx(backward_with_matmul)(dout, q, k, v, out, torch.randn(1, 2, 8), torch.randn(8, 8))
        attention = next(n for n in gm.graph.nodes if "attention" in str(n.target))
        self.assertIn(str(materialized_at(attention).target), ("aten.mm.default", "aten.bmm.default"))


class TestGeneratedBackwardCode(TestCase):
    def test_no_fill_and_one_kernel_writes_the_reduce_scatter_input(self):
        """Default Inductor's backward code for the helper's load-balanced causal block: the
        reduce-scatter's input is written by one fused kernel straight from the attention
        backward's dK/dV contributions; nothing fills a buffer with zeros or adds into one."""
        with fake_pg(2):
            q, k, v = allgather_qkv()
            fn = torch.compile(causal_allgather, backend="cp_inductor", fullgraph=True)
            _, codes = run_and_get_code(lambda: fn(q, k, v).sum().backward())
        backward = codes[-1]
        body = backward[backward.index("def call("):]
        for zero_fill in (".fill_(", ".zero_(", "torch.zeros", "aten.full", "memset"):
            self.assertNotIn(zero_fill, body)
        rs = re.search(r"reduce_scatter_tensor\.default\((?:reinterpret_tensor\()?(buf\d+)", body).group(1)
        writers = [line.strip() for line in body.splitlines()
                   if re.match(r"\s*\w*fused\w*\(", line) and re.search(rf"\b{rs}\b", line)]
        self.assertEqual(len(writers), 1, writers)
        self.assertGreaterEqual(len(re.findall(r"buf\d+", writers[0])), 3)  # reads several contributions
        kernel = writers[0].split("(")[0]
        self.assertIn("add", kernel)  # it sums the contributions itself ...
        self.assertIn("backward", kernel)  # ... scattered into place (slice/select backward)

    def test_head_groups_each_reduce_scatter_input_written_by_one_kernel(self):
        """The same with head_groups=2: per group, the prefixes' dK/dV are padded to the full
        sequence and summed by the one kernel that writes that group's reduce-scatter input."""
        with fake_pg(2):
            q, k, v = allgather_qkv()
            fn = torch.compile(
                lambda q, k, v: causal_allgather(q, k, v, head_groups=2),
                backend="cp_inductor", fullgraph=True,
            )
            _, codes = run_and_get_code(lambda: fn(q, k, v).sum().backward())
        body = codes[-1][codes[-1].index("def call("):]
        for zero_fill in (".fill_(", ".zero_(", "torch.zeros", "aten.full", "memset"):
            self.assertNotIn(zero_fill, body)
        inputs = re.findall(r"reduce_scatter_tensor\.default\((?:reinterpret_tensor\()?(buf\d+)", body)
        self.assertEqual(len(inputs), 2)
        for rs in inputs:
            writers = [line.strip().split("(")[0] for line in body.splitlines()
                       if re.match(r"\s*\w*fused\w*\(", line) and re.search(rf"\b{rs}\b", line)]
            self.assertEqual(len(writers), 1, writers)
            self.assertIn("add", writers[0])
            self.assertIn("constant_pad_nd", writers[0])


class TestGeneratedRingBackwardCode(TestCase):
    def test_no_fill_in_ring_backwards(self):
        """Native CP's ring backward (dK/dV accumulators from ``zeros_like``, all-to-all rotation,
        load balanced) and a hand-written one: default Inductor's backward code fills nothing;
        native's zeros live only inside the fused kernels that write the rotations' inputs."""
        from ring_programs import native_options, native_ring, ring_by_hand

        bodies = {}
        for name, fn in (("native", native_ring), ("hand", ring_by_hand)):
            with fake_pg(2), native_options("alltoall", load_balance=True):
                q, k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(3))
                compiled = torch.compile(lambda q, k, v: fn(q, k, v, causal=True), backend="cp_inductor", fullgraph=True)
                _, codes = run_and_get_code(lambda: compiled(q, k, v).sum().backward())
            bodies[name] = codes[-1][codes[-1].index("def call("):]
        for name, body in bodies.items():
            for zero_fill in (".fill_(", ".zero_(", "torch.zeros", "aten.full", "aten.zeros", "memset"):
                self.assertNotIn(zero_fill, body, name)
            self.assertGreaterEqual(body.count("all_to_all_single.default("), 2, name)  # K/V and dK/dV rotate
        inlined = [line.strip().split("(")[0] for line in bodies["native"].splitlines()
                   if "zeros_like" in line and not line.strip().startswith("#")]
        self.assertTrue(inlined and all("fused" in k for k in inlined), inlined)
    def test_native_forward_merge_is_one_kernel(self):
        """Native CP's forward (all-to-all rotation, load balanced, cp = 2) upcasts each step's
        output and log-sum-exp to fp32, merges them with sigmoid / log-sigmoid and writes the
        load-balanced half back with ``cat``: default Inductor turns all of it into ONE kernel
        after the last attention call, the cat included (no copy kernel of its own). Issue 13's
        "merges fused into one kernel" and "cat copies turned into writes" are already done
        here; the report has nothing to add."""
        from ring_programs import native_options, native_ring

        with fake_pg(2), native_options("alltoall", load_balance=True):
            q, k, v = (torch.randn(1, 2, 32, 8, requires_grad=True) for _ in range(3))
            compiled = torch.compile(lambda q, k, v: native_ring(q, k, v, causal=True), backend="cp_inductor", fullgraph=True)
            _, codes = run_and_get_code(lambda: compiled(q, k, v).sum().backward())
        body = codes[0][codes[0].index("def call("):]
        kernels = [line.strip().split("(")[0] for line in body.splitlines() if re.match(r"\s*cpp_fused\w*\(", line)]
        merges = [k for k in kernels if "sigmoid" in k]
        self.assertEqual(len(merges), 1, kernels)
        self.assertIn("cat", merges[0])
        last_attention = max(i for i, line in enumerate(body.splitlines()) if "flash_attention_for_cpu.default(" in line)
        merge_line = next(i for i, line in enumerate(body.splitlines()) if line.strip().startswith(merges[0] + "("))
        self.assertGreater(merge_line, last_attention)


def _thd_backward_code(form: str) -> str:
    """cp_inductor's backward code for rank 0 of cp = 2 over a pack (fake group): Llama 3's form by
    hand, or the helper (FA4 rounds on the CPU reference)."""
    from cp_inductor.testing import varlen_programs as vp
    from cp_inductor.lowerings import varlen_attention
    from cp_inductor.parallel import thd_allgather as tag

    vp.register_cpu_kernels()
    lengths = [1, 3, 1, 61, 2, 1, 9, 5, 13]
    q, k, v, _, _ = vp.pack(lengths, 4, 2, 16)
    with fake_pg(2), varlen_attention.reference_kernels():
        if form == "handwritten":
            plan, chunk = vp.chunk_plan(lengths, 0, 2), q.shape[0] // 4
            local = [torch.cat([t[:chunk], t[-chunk:]]).requires_grad_() for t in (q, k, v)]
            fn = torch.compile(lambda a, b, c: vp.allgather_thd(a, b, c, plan), backend="cp_inductor", fullgraph=True)
        else:
            _, shard = tag.shard_pack(q, lengths, 0, 2)
            local = [t.index_select(0, shard.local_index).requires_grad_() for t in (q, k, v)]
            fn = torch.compile(lambda a, b, c: tag.thd_allgather_attention(a, b, c, shard, kernel="fa4"),
                               backend="cp_inductor", fullgraph=True)
        _, codes = run_and_get_code(lambda: fn(*local).sum().backward())
    return codes[-1][codes[-1].index("def call("):]


class TestGeneratedBackwardCodeTHD(TestCase):
    def test_packed_reduce_scatter_input_written_by_one_kernel(self):
        """Packed sequences (THD) through K/V all-gather, both forms: the dK/dV of the calls reach
        the reduce-scatter through one fused kernel per reduce-scatter, no zero fill in the code."""
        for form in ("handwritten", "helper"):
            body = _thd_backward_code(form)
            for zero_fill in (".fill_(", ".zero_(", "torch.zeros", "aten.full", "memset"):
                self.assertNotIn(zero_fill, body, form)
            inputs = re.findall(r"reduce_scatter_tensor\.default\((?:reinterpret_tensor\()?(buf\d+)", body)
            self.assertTrue(inputs, form)
            for rs in inputs:
                writers = [line.strip() for line in body.splitlines()
                           if re.match(r"\s*\w*fused\w*\(", line) and re.search(rf"\b{rs}\b", line)]
                self.assertEqual(len(writers), 1, (form, writers))
