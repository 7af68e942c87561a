"""cat_of_slices: a cat of consecutive slices of one tensor that a collective sends becomes the
tensor (or its slice).
Goldens on small graphs and on native CP's backward (fake process group), and on gloo the
compiled native ring with the pass on and off: the same bits (it removes a pure copy)."""

from __future__ import annotations

import torch
import torch.fx
from expecttest import TestCase
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

from cp_inductor.passes.experimental.cat_of_slices import cat_of_slices_pass
from cp_inductor.testing.checks import AttentionCase, full_inputs, run_cp
from cp_inductor.testing.launch import run_on_ranks
from helpers import ring_graphs
from ring_programs import native_options, native_ring

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _cat_graph(pieces, returned=False) -> torch.fx.Graph:
    """``x`` [8, 4] (and ``y``) placeholders, a collective (the pass runs on CP graphs), and
    ``cat`` of ``pieces``: (tensor name, start, end) slices along dim 0."""
    g = torch.fx.Graph()
    with FakeTensorMode():
        vals = {"x": torch.empty(8, 4), "y": torch.empty(8, 4)}
    nodes = {}
    for name, val in vals.items():
        nodes[name] = g.placeholder(name)
        nodes[name].meta["val"] = val
    a2a = g.call_function(c10d.all_to_all_single.default, (nodes["x"], [4, 4], [4, 4], "0"))
    a2a.meta["val"] = vals["x"]
    parts = []
    for name, start, end in pieces:
        s = g.call_function(aten.slice.Tensor, (nodes[name], 0, start, end))
        s.meta["val"] = vals[name][start:end]
        parts.append(s)
    cat = g.call_function(aten.cat.default, (parts,))
    cat.meta["val"] = torch.cat([p.meta["val"] for p in parts])
    sent = g.call_function(c10d.all_to_all_single.default, (cat, [4, 4], [4, 4], "0"))  # what the pass looks for
    g.output((cat if returned else sent, a2a))
    return g


def _result(g: torch.fx.Graph) -> str:
    out = next(n for n in g.nodes if n.op == "output").args[0][0]
    src = out.args[0] if out.target is c10d.all_to_all_single.default else out
    if src.op == "placeholder":
        return src.name
    return f"{src.target.__name__.split('.')[0]}{tuple(a.name if isinstance(a, torch.fx.Node) else a for a in src.args)}"


class TestGolden(TestCase):
    def test_small_graphs(self):
        cases = {
            "whole, in order": [("x", 0, 4), ("x", 4, 8)],
            "three pieces": [("x", 0, 2), ("x", 2, 5), ("x", 5, 8)],
            "a run of it": [("x", 2, 4), ("x", 4, 6)],
            "a gap": [("x", 0, 2), ("x", 4, 8)],
            "out of order": [("x", 4, 8), ("x", 0, 4)],
            "two tensors": [("x", 0, 4), ("y", 4, 8)],
        }
        lines = []
        for name, pieces in cases.items():
            g = _cat_graph(pieces)
            n = cat_of_slices_pass(g)
            g.lint()
            lines.append(f"{name}: {n} -> {_result(g)}")
        g = _cat_graph([("x", 0, 4), ("x", 4, 8)], returned=True)
        lines.append(f"returned: {cat_of_slices_pass(g)} -> {_result(g)}")
        self.assertExpectedInline("\n".join(lines), """\
whole, in order: 1 -> x
three pieces: 1 -> x
a run of it: 1 -> slice('x', 0, 2, 6)
a gap: 0 -> cat([slice_tensor, slice_tensor_1],)
out of order: 0 -> cat([slice_tensor, slice_tensor_1],)
two tensors: 0 -> cat([slice_tensor, slice_tensor_1],)
returned: 0 -> cat([slice_tensor, slice_tensor_1],)""")

    def test_native_backward_cp2(self):
        # Native CP's backward reassembles its dK/dV buffer before rotating it home (rank 1 from
        # per-half cats of split pieces): it goes on every rank; dQ's cat of its halves, which
        # no collective sends, stays (Inductor fuses it into the cast that reads it).
        qkv = [torch.randn(1, 8, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        lines = []
        for rank in (0, 1):
            with native_options("alltoall", load_balance=True):
                _, graphs = ring_graphs(2, lambda q, k, v: native_ring(q, k, v, causal=True), qkv, rank=rank,
                                        ce_rotation=False, post_grad=False)
            gm = graphs["backward"]
            feeds = lambda: [n.args[0].target.__name__.split(".")[0] for n in gm.graph.nodes  # noqa: E731
                             if n.target is c10d.all_to_all_single.default]
            before = feeds()
            n = cat_of_slices_pass(gm.graph)
            lines.append(f"rank {rank}: rotations fed by {before} -> {feeds()}, {n} cats removed")
        self.assertExpectedInline("\n".join(lines), """\
rank 0: rotations fed by ['cat', 'cat'] -> ['cat', 'slice_scatter'], 1 cats removed
rank 1: rotations fed by ['cat', 'cat'] -> ['cat', 'slice_scatter'], 3 cats removed""")


    def test_after_ce_rotation(self):
        # On GPUs ce_rotation has replaced the NCCL rotations by the copy-engine ops before this
        # pass runs (the whole post-grad hook here, the transport's availability faked).
        from unittest import mock

        from cp_inductor.lowerings import ce_transport

        qkv = [torch.randn(1, 8, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        with mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None), \
                native_options("alltoall", load_balance=True):
            _, graphs = ring_graphs(2, lambda q, k, v: native_ring(q, k, v, causal=True), qkv,
                                    ce_rotation=True, ce_rotation_min_bytes=0, cat_of_slices=True)
        gm = graphs["backward"]
        starts = [n for n in gm.graph.nodes if n.target is torch.ops.cp_inductor.ce_rotate_start.default]
        self.assertExpectedInline(" ".join(_producer(n.args[0]) for n in starts), """cat convert(slice_scatter)""")


def _producer(node) -> str:
    """The op that computes a rotation's payload, through the narrowing cast."""
    if node.target is torch.ops.prims.convert_element_type.default:
        return f"convert({_producer(node.args[0])})"
    return node.target.__name__.split(".")[0]


def _grads(rank, cp):
    case = AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=4, head_dim=8, causal=True, load_balanced=True,
                         dtype=torch.bfloat16)
    full = full_inputs(case)
    out, applied = {}, {}
    for on in (False, True):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(lambda q, k, v: native_ring(q, k, v, causal=True), backend="cp_inductor",
                                 fullgraph=True, options={"cp_inductor.cat_of_slices": on})
        with native_options("alltoall", load_balance=True):
            out[on] = run_cp(compiled, case, full, rank, cp)
        applied[on] = counters["cp_inductor"]["cat_of_slices"]
    return {"applied": applied, "same": {name: torch.equal(out[False][name], out[True][name]) for name in out[False]}}


def test_same_bits_on_and_off_gloo():
    for r in run_on_ranks(_grads, 2):
        assert r["applied"][False] == 0 and r["applied"][True] >= 1 and all(r["same"].values()), r


def _backward_kernels(on: bool) -> list:
    """The C++ kernels of native CP's compiled backward (cp = 2, fake process group)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from helpers import fake_pg

    with fake_pg(2), native_options("alltoall", load_balance=True):
        q, k, v = (torch.randn(1, 8, 2, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        compiled = torch.compile(lambda q, k, v: native_ring(q, k, v, causal=True), backend="cp_inductor",
                                 fullgraph=True, options={"cp_inductor.cat_of_slices": on})
        _, codes = run_and_get_code(lambda: compiled(q, k, v).sum().backward())
    body = codes[-1][codes[-1].index("def call("):]
    return [line.strip().split("(")[0] for line in body.splitlines() if re.match(r"\s*cpp_fused\w*\(", line)]


class TestGeneratedCode(TestCase):
    def test_native_backward_kernels(self):
        # On CPU Inductor already fuses the cat into the kernel that updates the dK/dV buffer:
        # on and off give the same number of kernels; with the pass that kernel writes the
        # buffer the home rotation sends (no cat in it). On GPUs the cat was a kernel of its own
        # (run log native_cat_of_slices_s32k_profile_run55.log (git history): ..._cat_slice_3, 0.18 ms).
        off, on = _backward_kernels(False), _backward_kernels(True)
        self.assertEqual(len(off), len(on), (off, on))
        self.assertExpectedInline(" -> ".join([" ".join(sorted(set(off) - set(on))), " ".join(sorted(set(on) - set(off)))]), """cpp_fused_add_cat_slice_view_2 -> cpp_fused_add_slice_view_2""")
