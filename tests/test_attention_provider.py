"""The attention provider (FA4, cuDNN or the program's op) on CPU: the choice from a fake cost
map, FA4's ops (opcheck, the reference kernels against autograd), the graphs the lowerings make,
and CP programs whose attention moves to FA4's op keeping their answers (gloo, fp64 reference).
FA4 itself runs in tests/test_gpu_fa4.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import cp_inductor
from cp_inductor.config_snapshot import snapshot
from cp_inductor.lowerings import fa4_attention, varlen_attention  # noqa: F401 - registers the ops
from cp_inductor.passes.analysis import attention_provider as ap
from cp_inductor.testing.checks import AttentionCase, allgather_fn, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import aot_graphs

CPU = torch.device("cpu")


def _row(tokens, ms, layout="thd", heads_kv=8, head_dim=128, causal=True):
    return {"layout": layout, "tokens": tokens, "heads_q": 32, "heads_kv": heads_kv, "head_dim": head_dim,
            "causal": causal, "dtype": "bfloat16", "ms": ms}


@pytest.fixture
def fake_map(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"device": "cpu", "arch": "cpu", "rows": [
        _row(16384, {"program": 6.6, "cudnn": 4.2, "fa4": 3.5}),
        _row(65536, {"program": 96.0, "cudnn": 60.0, "fa4": 61.0}),
        _row(8192, {"program": 9.0, "fa4": 9.6}, layout="dense", head_dim=256),
    ]}))
    return str(path)


def _choose(shape, candidates, fake_map, **cfg):
    with cp_inductor.config.patch(attention_provider_cost_map=fake_map, **cfg):
        return ap.choose(shape, candidates, snapshot(), CPU, unmeasured="cudnn")


def _shape(tokens, layout="thd", head_dim=128, causal=True):
    return ap.Shape(layout, tokens, 32, 8, head_dim, causal, "bfloat16")


def test_auto_takes_the_fastest_provider_at_the_nearest_bucket(fake_map):
    both = {"cudnn": None, "fa4": None}
    choice = _choose(_shape(20000), both, fake_map)  # nearest measured: 16K
    assert (choice.provider, choice.reason) == (
        "fa4", "cost map measured on cpu, thd T16384 Hq32 Hkv8 D128: fa4 3.50 ms < cudnn 4.20 ms < program 6.60 ms")
    assert _choose(_shape(100000), both, fake_map).provider == "cudnn"  # 64K: cuDNN measured faster there


def test_calls_far_under_the_measured_work_are_not_read_off_the_map(fake_map):
    """A 256-token call with 4 heads read as the 16K x 32-head row would be a guess: launch costs,
    not the kernels' rates, decide it. A quarter of the least measured work still reads the map."""
    both = {"cudnn": None, "fa4": None}
    tiny = _choose(ap.Shape("thd", 256, 4, 2, 128, True, "bfloat16"), both, fake_map)
    assert (tiny.provider, tiny.reason) == ("cudnn", (
        "measured on cpu: thd T256 Hq4 Hkv2 D128 causal bfloat16 is under a quarter of the least work measured "
        "(T16384 Hq32): launch costs decide it, not measured"))
    assert _choose(_shape(4096), both, fake_map).provider == "fa4"  # a quarter of T16384 x 32: read
    assert _choose(_shape(4095), both, fake_map).provider == "cudnn"
    # Fewer heads over more tokens is the same work (Ulysses' calls at cp 8: 2 heads a rank)
    assert _choose(ap.Shape("thd", 65536, 8, 2, 128, True, "bfloat16"), both, fake_map).reason.startswith(
        "cost map measured on cpu, thd T65536 Hq32")


def test_providers_that_cannot_take_the_call_are_left_out_with_their_reason(fake_map):
    choice = _choose(_shape(16384), {"cudnn": None, "fa4": "flash-attn-4 is not importable"}, fake_map)
    assert choice.provider == "cudnn"
    assert choice.reason.endswith("cudnn 4.20 ms < program 6.60 ms; fa4: flash-attn-4 is not importable")


def test_the_program_keeps_its_kernel_where_it_measured_fastest(fake_map):
    choice = _choose(_shape(8192, layout="dense", head_dim=256), {"fa4": None}, fake_map)
    assert (choice.provider, choice.reason) == (
        "program", "cost map measured on cpu, dense T8192 Hq32 Hkv8 D256: program 9.00 ms < fa4 9.60 ms")


def test_unmeasured_buckets_and_symbolic_sizes_take_the_lowerings_default(fake_map):
    no_row = _choose(_shape(16384, causal=False), {"cudnn": None, "fa4": None}, fake_map)
    assert (no_row.provider, no_row.reason) == (
        "cudnn", "measured on cpu: no measurement of thd T16384 Hq32 Hkv8 D128 full bfloat16")
    assert _choose(None, {"cudnn": None, "fa4": None}, fake_map).provider == "cudnn"


def test_a_forced_provider_runs_where_it_can_else_auto_with_the_reason(fake_map):
    assert _choose(_shape(65536), {"cudnn": None, "fa4": None}, fake_map, attention_provider="fa4").provider == "fa4"
    fallback = _choose(_shape(16384), {"cudnn": None, "fa4": "dtype torch.float32"}, fake_map, attention_provider="fa4")
    assert fallback.provider == "cudnn" and "attention_provider=fa4 cannot take it; fa4: dtype torch.float32" in fallback.reason
    assert _choose(_shape(16384), {"cudnn": None}, fake_map, attention_provider="program").provider == "program"
    assert _choose(_shape(16384), {"cudnn": None}, fake_map, attention_provider="fast").provider == "program"


def test_fa4_says_why_it_cannot_take_a_call():
    un = fa4_attention.unavailable
    assert un(CPU, torch.float32, 128) == "cpu: FA4 runs on CUDA only"
    with varlen_attention.reference_kernels():
        assert un(CPU, torch.float32, 128) is None
        assert un(CPU, torch.float32, 12) == "head_dim 12 (FA4 takes multiples of 8 from 8 to 256)"
        assert un(CPU, torch.float32, 512) == "head_dim 512 (FA4 takes multiples of 8 from 8 to 256)"
        assert un(CPU, torch.float32, 128, 64) == "head_dim 128 of q/k differs from v's 64"



def test_fa4_keeps_its_kernels_beside_inductors_cache(monkeypatch, tmp_path):
    """FA4 reads its disk-cache switch at import: it is set before, to a dir in Inductor's cache
    dir; a switch the program set, or an FA4 imported first, stands."""
    import os
    import sys

    import torch._inductor.config as inductor_config

    on, where = fa4_attention.KERNEL_CACHE_ENV, fa4_attention.KERNEL_CACHE_DIR_ENV
    monkeypatch.delitem(sys.modules, "flash_attn.cute.cache_utils", raising=False)
    # os.environ stood in for by a dict: what the call sets is all there is
    monkeypatch.setattr(os, "environ", {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert fa4_attention.persistent_kernel_cache() == str(tmp_path / "flash_attention_cute")
    assert os.environ[on] == "1" and os.environ[where] == str(tmp_path / "flash_attention_cute")
    monkeypatch.setattr(os, "environ", {where: "/mine"})  # the program's dir kept
    assert fa4_attention.persistent_kernel_cache() == "/mine" and os.environ == {where: "/mine", on: "1"}
    monkeypatch.setattr(os, "environ", {on: "0"})
    assert fa4_attention.persistent_kernel_cache() is None and os.environ == {on: "0"}
    monkeypatch.setattr(os, "environ", {})
    with inductor_config.patch(force_disable_caches=True):  # caches off: FA4's too
        assert fa4_attention.persistent_kernel_cache() is None and os.environ == {}
    monkeypatch.setitem(sys.modules, "flash_attn.cute.cache_utils", object())
    assert fa4_attention.persistent_kernel_cache() is None and os.environ == {}


def test_a_cached_compile_does_not_import_fa4(monkeypatch):
    """Whether the dense FA4 pass hooks in is asked on every compile, before Inductor's cache
    is read: an installed FA4 is enough there; its import (about a second, most of a GPU
    restart's gap to default Inductor) waits for a call the pass considers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cp_inductor.passes.joint import fa4_dense

    def imported():
        raise AssertionError("FA4 imported")

    with FakeTensorMode():
        x = torch.empty(2, 3, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa4_attention, "installed", lambda: True)
    monkeypatch.setattr(fa4_attention, "_import_error", imported)
    assert fa4_dense.wanted(None, [x], snapshot())
    monkeypatch.setattr(fa4_attention, "installed", lambda: False)
    assert not fa4_dense.wanted(None, [x], snapshot())
    with pytest.raises(AssertionError, match="FA4 imported"):  # a call considered imports it
        fa4_attention.device_unavailable(x.device)

# ---- the ops -------------------------------------------------------------------------------------

def _dense_reference(q, k, v, scale, causal):
    """[B, H, S, D] attention in fp64 with bottom-right causal: out and log-sum-exp."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s_q, s_k = q.shape[2], k.shape[2]
        s = s.masked_fill(~torch.ones(s_q, s_k, dtype=torch.bool).tril(s_k - s_q), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _grads_of(fn, tensors, go, gl):
    out, lse = fn(*tensors)
    return [out, lse, *torch.autograd.grad((out * go).sum() + (lse * gl).sum(), tensors)]


@pytest.mark.parametrize("causal", [True, False])
def test_dense_op_matches_fp64_with_the_lse_gradient(causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    go, gl = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    with varlen_attention.reference_kernels():
        got = _grads_of(lambda *t: torch.ops.cp_inductor.fa4_sdpa(*t, 0.3, causal), (q, k, v), go, gl)
    want = _grads_of(lambda *t: _dense_reference(*t, 0.3, causal), (q, k, v), go, gl)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-6, rtol=1e-6)  # the reference's lse is fp32


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_op_reads_key_prefixes_in_place_with_seqused_k(causal):
    """Two documents' key buffers, each query piece reading a prefix of its own (seqused_k):
    output, lse and gradients as two dense calls on the prefixes; unread keys get zero gradient."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(6, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(10, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    used = torch.tensor([3, 5], dtype=torch.int32)
    go, gl = torch.randn(6, 4, 8, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    with varlen_attention.reference_kernels():
        got = _grads_of(lambda *t: torch.ops.cp_inductor.fa4_varlen_attention(*t, cu_q, cu_k, used, 4, 5, 0.3, causal),
                        (q, k, v), go, gl)

    def two_calls(q, k, v):
        parts = [_dense_reference(q[None, a:b].transpose(1, 2), k[None, c:d].transpose(1, 2), v[None, c:d].transpose(1, 2), 0.3, causal)
                 for a, b, c, d in ((0, 2, 0, 3), (2, 6, 4, 9))]
        return torch.cat([o[0].transpose(0, 1) for o, _ in parts]), torch.cat([l[0] for _, l in parts], 1)

    want = _grads_of(two_calls, (q, k, v), go, gl)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-6, rtol=1e-6)
    assert got[3][3].abs().max() == 0 and got[4][9].abs().max() == 0  # keys 3 and 9: read by no query


def test_opcheck():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 5, 8, generator=g, requires_grad=True) for _ in range(2))
    qv = torch.randn(6, 4, 8, generator=g, requires_grad=True)
    kv, vv = (torch.randn(10, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)
    with varlen_attention.reference_kernels():
        torch.library.opcheck(torch.ops.cp_inductor.fa4_sdpa.default, (q, k, v, 0.3, True))
        torch.library.opcheck(torch.ops.cp_inductor.fa4_varlen_attention.default, (qv, kv, vv, cu_q, cu_k, None, 4, 6, 0.3, True))
        torch.library.opcheck(torch.ops.cp_inductor.fa4_varlen_attention.default,
                              (qv, kv, vv, cu_q, cu_k, torch.tensor([3, 5], dtype=torch.int32), 4, 6, 0.3, False))


# ---- the graphs ----------------------------------------------------------------------------------

def _ops(gm) -> str:
    """The graph's calls, counted by op name."""
    from collections import Counter

    names = Counter(getattr(n.target, "__name__", str(n.target)).removesuffix(".default")
                    for n in gm.graph.nodes if n.op == "call_function")
    return ", ".join(f"{name} x{count}" for name, count in sorted(names.items()))


def _fa4_joint_pass(graph):
    from cp_inductor.passes import engine

    engine.run_hook("joint_custom_post_pass", graph, snapshot())


class TestGraphs(TestCase):
    def test_dense_sdpa_forward_and_backward_on_fa4(self):
        """One causal SDPA: forward and backward ops swapped together in the joint graph."""
        q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
        with varlen_attention.reference_kernels(), cp_inductor.config.patch(attention_provider="fa4", strict=True):
            cp_inductor.clear_report()
            graphs = aot_graphs(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v,
                                joint_pass=_fa4_joint_pass)
        self.assertExpectedInline("\n".join(f"{kind}: {_ops(gm)}" for kind, gm in graphs.items()), """\
forward: alias x2, fa4_sdpa x1, getitem x2
backward: fa4_sdpa_backward x1, getitem x3""")
        self.assertExpectedInline("\n".join(d.line() for d in cp_inductor.report().dense), """\
dense attention _scaled_dot_product_flash_attention_for_cpu: fa4: attention_provider=fa4""")

    def test_dense_sdpa_with_a_mask_stays_with_the_reason(self):
        q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
        mask = torch.ones(8, 8, dtype=torch.bool).tril()
        with varlen_attention.reference_kernels(), cp_inductor.config.patch(attention_provider="fa4", strict=True):
            cp_inductor.clear_report()
            aot_graphs(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v, joint_pass=_fa4_joint_pass)
        self.assertExpectedInline("\n".join(d.line() for d in cp_inductor.report().dense), """\
dense attention _scaled_dot_product_flash_attention_for_cpu: program: an attention mask is given""")

    def test_packed_attention_on_fa4_keeps_gqa_as_is(self):
        """torchtitan's varlen call (K/V repeated for GQA; also with one split asked for, as it
        does before Hopper) lowered to FA4's packed op on the unrepeated K/V; the report line says
        which provider and why."""
        from cp_inductor.testing import varlen_programs as vp

        vp.register_cpu_kernels()
        q, k, v, cu, m = vp.pack([3, 5, 4], 4, 2, 16, seed=0)
        lines = []
        for options in ({}, {"num_splits": 1}):
            with varlen_attention.reference_kernels():
                cp_inductor.clear_report()
                torch._dynamo.reset()
                fn = torch.compile(lambda q, k, v: vp.torchtitan_style(q, k, v, cu, m, **options), backend="cp_inductor",
                                   fullgraph=True,
                                   options={"cp_inductor.attention_provider": "fa4", "cp_inductor.strict": True})
                out = fn(q, k, v)
            torch.testing.assert_close(out, vp.sequence_reference(q.double(), k.double(), v.double(), cu, True).float())
            lines += [f"{options}: {r.line()}" for r in cp_inductor.report().varlen]
        self.assertExpectedInline("\n".join(lines), """\
{}: varlen attention _varlen_attn: local, thd, lengths unknown, causal, K/V head repeat dropped: fa4_varlen: attention_provider=fa4
{'num_splits': 1}: varlen attention _varlen_attn: local, thd, lengths unknown, causal, K/V head repeat dropped: fa4_varlen: attention_provider=fa4""")
        torch._dynamo.reset()


# ---- CP programs on FA4's op keep their answers (gloo, reference kernels) --------------------------

def _on_fa4(rank, cp, style):
    from ring_programs import ring_by_hand

    case = AttentionCase(layout="bshd", causal=True, heads_q=4, heads_kv=2, load_balanced=style != "a2a")
    fn = {"a2a": None, "allgather": allgather_fn(case),
          "ring": lambda q, k, v: ring_by_hand(q, k, v, causal=True)}[style]
    with varlen_attention.reference_kernels():
        results = check_cp_attention(rank, cp, [case], fn, options={"cp_inductor.attention_provider": "fa4"})
    return results, [d.provider for d in cp_inductor.report().dense]


@pytest.mark.parametrize("style", ["a2a", "allgather", "ring"])
def test_cp_styles_on_fa4_match_the_fp64_reference(style):
    for results, providers in run_on_ranks(_on_fa4, 2, style):
        for r in results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < 1e-5, (key, r[key])
            assert r["applied"] == (["fused_a2a"] if style == "a2a" else []), r  # the CP rewrites still find their regions
            assert {row[1] for row in r["report"]} == {style}, r["report"]
            assert r["rewritten"]["fa4_dense"] >= 2, r["rewritten"]  # forward and backward ops swapped
        assert providers and set(providers) == {"fa4"}, providers


# ---- a program that already calls FA4 ----------------------------------------------------------

def _fa4_stand_in_module():
    """A module shaped like ``flash_attn.cute.interface``: functions with FA4's argument names
    that Dynamo cannot trace (as FA4's cannot), computing what FA4 computes."""
    import types

    from cp_inductor.testing import varlen_programs as vp

    @torch._dynamo.disable
    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, seqused_k=None, softmax_scale=None, causal=False,
                               window_size=(None, None), softcap=0.0, return_lse=False):
        return vp.sequence_reference(q, k, v, cu_seqlens_q, causal).to(q.dtype), None

    @torch._dynamo.disable
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), return_lse=False):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                             enable_gqa=True)
        return out.transpose(1, 2), None

    module = types.ModuleType("fa4_stand_in")
    module.flash_attn_varlen_func, module.flash_attn_func = flash_attn_varlen_func, flash_attn_func
    return module


FA4_STAND_IN = _fa4_stand_in_module()


def test_a_program_calling_fa4_compiles_in_one_graph_onto_our_ops():
    """fullgraph=True over FA4's functions (which Dynamo cannot trace): each call whose arguments
    our ops cover is traced as our op, same answer; one with softcap runs FA4's function (here:
    a graph break, so fullgraph fails as it did before)."""
    from cp_inductor.testing import varlen_programs as vp

    from cp_inductor.lowerings import fa4_functions

    fa4_functions.register(FA4_STAND_IN)
    q, k, v, cu, m = vp.pack([3, 5, 4], 4, 2, 16, seed=0)
    qd, kd, vd = (torch.randn(2, 6, h, 16) for h in (4, 2, 2))

    def program(q, k, v, qd, kd, vd):
        packed, _ = FA4_STAND_IN.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                                        max_seqlen_k=m, causal=True)
        dense, _ = FA4_STAND_IN.flash_attn_func(qd, kd, vd, causal=True)
        return packed, dense

    with varlen_attention.reference_kernels():
        torch._dynamo.reset()
        cp_inductor.clear_report()
        got = torch.compile(program, backend="cp_inductor", fullgraph=True)(q, k, v, qd, kd, vd)
        want = program(q, k, v, qd, kd, vd)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert [r.path for r in cp_inductor.report().varlen] == ["fa4", "fa4"], cp_inductor.report().varlen

        def with_softcap(q, k, v):
            return FA4_STAND_IN.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, softcap=30.0)[0]

        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(with_softcap, backend="cp_inductor", fullgraph=True)(q, k, v)
    torch._dynamo.reset()


def test_a_program_fa4_dense_call_is_reported_as_dense():
    """The report line of a program's own flash_attn_func call names its layout, not THD."""
    from cp_inductor.lowerings import fa4_functions

    fa4_functions.register(FA4_STAND_IN)
    qd, kd, vd = (torch.randn(2, 6, h, 16) for h in (4, 2, 2))
    with varlen_attention.reference_kernels():
        torch._dynamo.reset()
        cp_inductor.clear_report()
        torch.compile(lambda q, k, v: FA4_STAND_IN.flash_attn_func(q, k, v, causal=True)[0], backend="cp_inductor",
                      fullgraph=True)(qd, kd, vd)
    lines = [r.line() for r in cp_inductor.report().varlen]
    torch._dynamo.reset()
    assert lines == ["attention fa4_sdpa: local, bshd, causal, FA4 as written: fa4: the program calls FA4 "
                     "(flash_attn.cute), in the graph as our op; kept on it"]
