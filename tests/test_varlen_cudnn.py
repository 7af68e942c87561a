"""varlen_cudnn: packed-sequence attention (torch's varlen_attn) moves to cp_inductor's ragged op
on the graph Dynamo hands the backend, where it can, with the reason in the report where it
cannot. CPU: the op's per-sequence reference stands in for cuDNN (``reference_kernels``); the
GPU tier runs cuDNN (tests/test_gpu_one.py)."""

import contextlib
import functools
import operator

import pytest
import torch
from expecttest import TestCase

import cp_inductor
from cp_inductor.testing import varlen_programs as vp
from cp_inductor.config_snapshot import snapshot
from cp_inductor.lowerings.varlen_attention import reference_kernels
from cp_inductor.passes import engine
from cp_inductor.passes.dynamo import varlen_calls, varlen_cudnn
from helpers import pass_replaced

pytestmark = pytest.mark.skipif(not vp.register_cpu_kernels(), reason="this torch has no torch.nn.attention.varlen")


def dynamo_graph(fn, *args):
    """The graph Dynamo hands a backend for ``fn(*args)``."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs[0]


def _call(n) -> str | None:
    """``target(args)`` for a call other than getitem, else None."""
    if n.op not in ("call_function", "call_method") or getattr(n.target, "__name__", n.target) == "getitem":
        return None
    args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args)
    return f"{getattr(n.target, '__name__', n.target)}({args})"


def calls(gm) -> str:
    return "\n".join(line for n in gm.graph.nodes if (line := _call(n)) is not None)


def calls_and_views(gm) -> str:
    """``calls`` with each node's name, and the views taken by indexing (``x[:, 0]``) written out."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[1], tuple):
            index = ", ".join(":" if i == slice(None) else repr(i) for i in n.args[1])
            out.append(f"{n.name} = {n.args[0].name}[{index}]")
        elif (line := _call(n)) is not None:
            out.append(f"{n.name} = {line}")
    return "\n".join(out)


def rewritten(fn, *args, **cfg):
    gm = dynamo_graph(fn, *args)
    with reference_kernels():
        routes = engine.run_dynamo_passes(gm, snapshot(cfg))
    return gm, routes


class TestGraph(TestCase):
    def test_torchtitan_varlen_moves_and_drops_the_head_repeat(self):
        q, k, v, cu, m = vp.pack([3, 7, 1], 4, 2, 16)
        gm, routes = rewritten(vp.torchtitan_style, q, k, v, cu, m)
        # K/V heads were repeated only for varlen_attn: cuDNN takes the 2 K/V heads as they are.
        self.assertExpectedInline(calls(gm), """varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, l_cu_, 7, 7, 0.25, True)""")
        self.assertExpectedInline("\n".join(r.line() for r in routes), """varlen attention _varlen_attn: local, thd, lengths unknown, causal, K/V head repeat dropped: cudnn_ragged: no cost map for cpu: no measurement of thd T11 Hq4 Hkv2 D16 causal float32""")

    def test_a_repeat_read_elsewhere_stays(self):
        from torch.nn.attention.varlen import varlen_attn

        def fn(q, k, v, cu, m):
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            return varlen_attn(q, k, v, cu, cu, m, m) + k.sum()

        gm, routes = rewritten(fn, *vp.pack([4, 4], 4, 2, 16))
        self.assertExpectedInline(calls(gm), """\
repeat_interleave(l_k_, 2)
repeat_interleave(l_v_, 2)
varlen_attention.default(l_q_, k, v, l_cu_, l_cu_, 4, 4, 0.25, False)
sum(k)
add(getitem_3, sum_1)""")
        assert not routes[0].detail.endswith("dropped")


def aten_flash_varlen(q, k, v, cu, m, causal=True, dropout=0.0):
    """A direct call of aten's flash forward on a pack (nested-jagged SDPA's route): CUDA only in
    eager, so on CPU only its rewritten graph runs."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, m, m, dropout, causal, False)[0]


def rewritten_while_compiling(fn, *args, **cfg):
    """The passes run inside the backend, which then runs the rewritten graph (the program's own
    op may have no kernel here: unless a call moved, nothing runs and the output is None)."""
    seen = {}

    def backend(gm, example_inputs):
        with reference_kernels():
            seen["routes"] = engine.run_dynamo_passes(gm, snapshot(cfg))
        seen["gm"] = gm
        if all(r.path == varlen_calls.KEPT for r in seen["routes"]):
            return lambda *inputs: [None]
        return gm.forward

    torch._dynamo.reset()
    with reference_kernels():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen["gm"], seen["routes"], out


class TestAtenFlashVarlen(TestCase):
    def test_moves_onto_the_ragged_op(self):
        q, k, v, cu, m = vp.pack([3, 7, 1], 4, 2, 16)
        gm, routes, out = rewritten_while_compiling(aten_flash_varlen, q, k, v, cu, m)
        self.assertExpectedInline(calls(gm), """varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, l_cu_, 7, 7, 0.25, True)""")
        self.assertExpectedInline("\n".join(r.line() for r in routes), """varlen attention _flash_attention_forward: local, thd, lengths unknown, causal: cudnn_ragged: no cost map for cpu: no measurement of thd T11 Hq4 Hkv2 D16 causal float32""")
        assert float((out.double() - vp.sequence_reference(q, k, v, cu, True)).abs().max()) < 1e-5

    def test_dropout_keeps_the_program_op(self):
        _, (route,), _ = rewritten_while_compiling(functools.partial(aten_flash_varlen, dropout=0.1), *vp.pack([4, 4], 2, 2, 16))
        self.assertExpectedInline(route.line(), """varlen attention _flash_attention_forward: local, thd, lengths unknown, causal: kept: varlen: dropout 0.1""")

    def test_the_dense_form_is_not_a_varlen_call(self):
        q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
        _, routes, _ = rewritten_while_compiling(
            lambda q, k, v: torch.ops.aten._flash_attention_forward(q, k, v, None, None, 8, 8, 0.0, True, False)[0], q, k, v)
        assert routes == []


class TestFlashAttn(TestCase):
    """flash-attn's ``flash_attn_varlen_func`` (its ops registered here under flash-attn's
    schemas: CI has no flash-attn) moves onto the ragged op, autograd.Function and all."""

    def setUp(self):
        if vp.flash_attn_like() is None:
            pytest.skip("flash-attn itself defines its ops here")

    def test_the_autograd_function_moves_onto_the_ragged_op(self):
        q, k, v, cu, m = vp.pack([3, 7, 1], 4, 2, 16)
        gm, routes, out = rewritten_while_compiling(vp.flash_attn_style, q.requires_grad_(), k, v, cu, m)
        # Dynamo's autograd_function_apply and the Function's forward / backward subgraphs are gone
        self.assertExpectedInline(calls(gm), """\
clone(l_cu_)
fa4_varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, arg, None, 7, 7, 0.25, True)""")
        self.assertExpectedInline("\n".join(r.line() for r in routes), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: fa4_varlen: no cost map for cpu: no measurement of thd_cross T11 Hq4 Hkv2 D16 causal float32""")
        assert not [name for name, _ in gm.named_children()]
        assert float((out.double() - vp.sequence_reference(q, k, v, cu, True)).abs().max()) < 1e-5

    def test_without_grad_the_op_called_directly_moves(self):
        """No grad: Dynamo inlines the Function's forward, so the op is called directly."""
        q, k, v, cu, m = vp.pack([3, 7, 1], 4, 2, 16)
        gm, (route,), _ = rewritten_while_compiling(vp.flash_attn_style, q, k, v, cu, m)
        self.assertExpectedInline(calls(gm), """\
clone(l_cu_)
fa4_varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, clone, None, 7, 7, 0.25, True)""")
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: fa4_varlen: no cost map for cpu: no measurement of thd_cross T11 Hq4 Hkv2 D16 causal float32""")

    def test_a_later_release_s_namespace_too(self):
        if vp.flash_attn_like("flashattn") is None:  # registered before compiling
            pytest.skip("flash-attn itself defines its ops here")
        q, k, v, cu, m = vp.pack([4, 4], 2, 2, 16)
        _, (route,), _ = rewritten_while_compiling(functools.partial(vp.flash_attn_style, namespace="flashattn"),
                                                   q.requires_grad_(), k, v, cu, m)
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: fa4_varlen: no cost map for cpu: no measurement of thd_cross T8 Hq2 Hkv2 D16 causal float32""")

    def test_the_qkv_packed_function_moves_with_its_views(self):
        """flash_attn_varlen_qkvpacked_func: q, k, v are views of one [T, 3, H, D] input; the
        same views are taken outside the Function, autograd through them packs the gradient."""
        q, k, v, cu, m = vp.pack([3, 7, 1], 2, 2, 16)
        gm, (route,), out = rewritten_while_compiling(vp.flash_attn_packed_style, q.requires_grad_(), k, v, cu, m)
        self.assertExpectedInline(calls_and_views(gm), """\
arg = stack([l_q_, l_k_, l_v_])
getitem_1 = arg[:, 0]
getitem_2 = arg[:, 1]
getitem_3 = arg[:, 2]
varlen_attention_default = varlen_attention.default(getitem_1, getitem_2, getitem_3, l_cu_, l_cu_, 7, 7, 0.25, True)""")
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: cudnn_ragged: no cost map for cpu: no measurement of thd T11 Hq2 Hkv2 D16 causal float32""")
        assert float((out.double() - vp.sequence_reference(q, k, v, cu, True)).abs().max()) < 1e-5

    def test_the_kv_packed_function_moves_gqa_as_is(self):
        q, k, v, cu, m = vp.pack([3, 7, 1], 4, 2, 16)
        gm, (route,), _ = rewritten_while_compiling(vp.flash_attn_packed_style, q.requires_grad_(), k, v, cu, m)
        self.assertExpectedInline(calls_and_views(gm), """\
arg = stack([l_k_, l_v_])
arg_1 = clone(l_cu_)
getitem_1 = arg[:, 0]
getitem_2 = arg[:, 1]
fa4_varlen_attention_default = fa4_varlen_attention.default(l_q_, getitem_1, getitem_2, l_cu_, arg_1, None, 7, 7, 0.25, True)""")
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: fa4_varlen: no cost map for cpu: no measurement of thd_cross T11 Hq4 Hkv2 D16 causal float32""")

    def test_a_packed_function_that_stays_leaves_no_views_behind(self):
        q, k, v, cu, m = vp.pack([3, 7, 1], 2, 2, 16)
        gm, (route,), _ = rewritten_while_compiling(vp.flash_attn_packed_style, q.requires_grad_(), k, v, cu, m,
                                                    varlen_cudnn=False)
        self.assertExpectedInline(calls_and_views(gm), """\
arg = stack([l_q_, l_k_, l_v_])
autograd_function_apply = autograd_function_apply(fwd_body_0, bwd_body_0, arg, l_cu_)""")
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: kept: uniform_thd: lengths unknown (cu_seqlens not built from arange, not marked equal_lengths, no uniform_thd="promised"); varlen_cudnn: disabled by config""")

    def test_a_function_taking_part_of_its_input_is_kept(self):
        """A view that is not a whole slice of the input (here half its heads) is not read as an
        operand: the Function is kept, with the reason."""
        ops = torch.ops.flash_attn

        class HalfHeads(torch.autograd.Function):
            @staticmethod
            def forward(ctx, qkv, cu_q, cu_k, m):
                half = qkv.shape[2] // 2
                return ops._flash_attn_varlen_forward(qkv[:, 0, :half], qkv[:, 1, :half], qkv[:, 2, :half], cu_q, cu_k,
                                                      m, m, 0.0, 0.25, True)[0]

            @staticmethod
            def backward(ctx, grad):
                ops._flash_attn_varlen_backward(grad, grad, grad, grad, grad, grad, None, None, None, None, None, 1, 1,
                                                0.0, 1.0, True, -1, -1, 0.0, None, False)
                return None, None, None, None

        q, k, v, cu, m = vp.pack([4, 4], 4, 4, 16)
        qkv = torch.stack([q, k, v], dim=1).requires_grad_()
        gm = dynamo_graph(lambda qkv: HalfHeads.apply(qkv, cu, cu.clone(), m), qkv)
        (route,) = engine.run_dynamo_passes(gm, snapshot())
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: kept: varlen: the autograd.Function's forward also runs getitem (a view that is not a whole slice of an input)""")

    def test_head_dim_padding_keeps_the_function(self):
        q, k, v, cu, m = vp.pack([4, 4], 2, 2, 12)
        _, (route,), _ = rewritten_while_compiling(vp.flash_attn_style, q.requires_grad_(), k, v, cu, m)
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: kept: varlen: the autograd.Function's forward also runs pad (flash-attn pads a head_dim off 8)""")

    def test_softcap_keeps_the_function(self):
        def softcapped(q, k, v, cu, m):
            return flash_attn_varlen_func(q, k, v, cu, cu.clone(), m, m, causal=True, softcap=30.0)

        flash_attn_varlen_func = vp.flash_attn_like()

        q, k, v, cu, m = vp.pack([4, 4], 2, 2, 16)
        _, (route,), _ = rewritten_while_compiling(softcapped, q.requires_grad_(), k, v, cu, m)
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: kept: varlen: softcap 30.0""")

    def test_a_function_with_another_backward_is_kept(self):
        """A Function whose forward is flash-attn's but whose backward is its own (a straight-
        through trick, say) is not attention's gradient: ours cannot stand in for it."""
        ops = torch.ops.flash_attn

        class StraightThrough(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, cu_q, cu_k, m):
                return ops._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, m, m, 0.0, 0.25, True)[0]

            @staticmethod
            def backward(ctx, grad):
                return grad, None, None, None, None, None

        q, k, v, cu, m = vp.pack([4, 4], 2, 2, 16)
        gm = dynamo_graph(lambda q, k, v: StraightThrough.apply(q, k, v, cu, cu.clone(), m), q.requires_grad_(), k, v)
        (route,) = engine.run_dynamo_passes(gm, snapshot())
        self.assertExpectedInline(route.line(), """varlen attention _flash_attn_varlen_forward: local, thd, lengths unknown, causal: kept: varlen: the autograd.Function's backward does not call flash_attn::_flash_attn_varlen_backward""")


class TestReasons(TestCase):
    def reason(self, fn, *args, **cfg):
        gm, routes = rewritten(fn, *args, **cfg)
        (route,) = routes
        assert route.path == varlen_calls.KEPT and "varlen_attn" in calls(gm), calls(gm)
        return route.reason

    def test_switch_off(self):
        self.assertExpectedInline(self.reason(vp.torchtitan_style, *vp.pack([4, 4], 2, 2, 16), varlen_cudnn=False),
                                  """uniform_thd: lengths unknown (cu_seqlens not built from arange, not marked equal_lengths, no uniform_thd="promised"); varlen_cudnn: disabled by config""")

    def test_sliding_window(self):
        from torch.nn.attention.varlen import varlen_attn

        def fn(q, k, v, cu, m):
            return varlen_attn(q, k, v, cu, cu, m, m, window_size=(8, 0))

        self.assertExpectedInline(self.reason(fn, *vp.pack([4, 4], 2, 2, 16)), """varlen: sliding window [8, 0] (only none or causal)""")

    def test_program_reads_the_log_sum_exp(self):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        def fn(q, k, v, cu, m):
            out, lse = varlen_attn(q, k, v, cu, cu, m, m, return_aux=AuxRequest(lse=True))
            return out, lse

        self.assertExpectedInline(self.reason(fn, *vp.pack([4, 4], 2, 2, 16)), """varlen: the program reads the log-sum-exp or the RNG state""")

    def test_head_dim_cudnn_cannot_take(self):
        self.assertExpectedInline(self.reason(vp.torchtitan_style, *vp.pack([4, 4], 2, 2, 12)),
                                  """uniform_thd: lengths unknown (cu_seqlens not built from arange, not marked equal_lengths, no uniform_thd="promised"); varlen_cudnn: only the program's op takes it; cudnn: head_dim 12 (cuDNN takes multiples of 8 up to 256); fa4: head_dim 12 (FA4 takes multiples of 8 from 8 to 256)""")

    def test_cpu_without_the_reference(self):
        gm = dynamo_graph(vp.torchtitan_style, *vp.pack([4, 4], 2, 2, 16))
        (route,) = engine.run_dynamo_passes(gm, snapshot())
        self.assertExpectedInline(route.reason, """uniform_thd: lengths unknown (cu_seqlens not built from arange, not marked equal_lengths, no uniform_thd="promised"); varlen_cudnn: only the program's op takes it; cudnn: cpu: only CUDA runs cuDNN's ragged attention; fa4: cpu: FA4 runs on CUDA only""")


PROGRAMS = {"torchtitan": vp.torchtitan_style, "aten_flash": aten_flash_varlen, "flash_attn": vp.flash_attn_style,
            "flash_attn_packed": vp.flash_attn_packed_style}


@pytest.mark.parametrize("program", list(PROGRAMS))
@pytest.mark.parametrize("causal,heads_kv,lengths", [(True, 2, [1, 9, 130, 5]), (False, 4, [64, 1, 31])])
def test_compiled_numerics_match_the_fp64_reference(causal, heads_kv, lengths, program):
    """cp_inductor on the reference kernels, against per-sequence fp64 SDPA: the output and
    every gradient (GQA, with torchtitan's repeat dropped; a 1-token document; lengths off 128),
    for varlen_attn, aten's flash forward called on the pack, flash-attn's Function and its
    packed forms (q, k, v in one tensor with MHA, k and v in one with GQA)."""
    attention = PROGRAMS[program]
    if program.startswith("flash_attn") and vp.flash_attn_like() is None:  # its ops, registered before compiling
        pytest.skip("flash-attn itself defines its ops here")
    q, k, v, cu, m = vp.pack(lengths, 4, heads_kv, 16, dtype=torch.float32, seed=len(lengths))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    cp_inductor.clear_report()
    with reference_kernels():
        fn = torch.compile(lambda q, k, v: attention(q, k, v, cu, m, causal), backend="cp_inductor", fullgraph=True)
        out = fn(*inputs)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, grad)
    # flash-attn's calls pass cu_seqlens_k apart from cu_seqlens_q (not its qkv-packed form, MHA):
    # causal, FA4's (cuDNN would mask bottom-right)
    cross = causal and (program == "flash_attn" or (program == "flash_attn_packed" and heads_kv != 4))
    expected = varlen_cudnn.FA4_VARLEN if cross else varlen_cudnn.CUDNN_RAGGED
    assert [r.path for r in cp_inductor.report().varlen] == [expected]
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = vp.sequence_reference(*ref_inputs, cu, causal)
    want_grads = torch.autograd.grad(want, ref_inputs, grad.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), (want, *want_grads)):
        err = float((a.detach().double() - b).norm() / b.norm())
        assert err < 1e-5, (name, err)
    torch._dynamo.reset()


@pytest.mark.parametrize("capture_scalars", [False, True])
def test_pack_from_position_ids_moves(capture_scalars):
    """Hugging Face's packed batch: the boundaries found from position ids (``nonzero``) and the
    longest document read back with ``.item()``, a graph break by default and an unbacked int with
    ``capture_scalar_outputs``: either way the call moves, and the output and every gradient match
    the fp64 reference."""
    lengths = [5, 1, 17, 9]
    q, k, v, cu, _ = vp.pack(lengths, 4, 2, 16, dtype=torch.float32, seed=2)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    cp_inductor.clear_report()
    with reference_kernels(), torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars,
                                                         capture_dynamic_output_shape_ops=capture_scalars):
        out = torch.compile(vp.positions_style, backend="cp_inductor")(*inputs, vp.positions_of(lengths))
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, grad)
    assert [r.path for r in cp_inductor.report().varlen] == [varlen_cudnn.CUDNN_RAGGED], cp_inductor.report().varlen
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = vp.sequence_reference(*ref_inputs, cu, True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), (want, *torch.autograd.grad(want, ref_inputs, grad.double()))):
        assert float((a.detach().double() - b).norm() / b.norm()) < 1e-5, name
    torch._dynamo.reset()


def test_inference_graph_moves_too():
    """No grad: one forward graph, the same op."""
    q, k, v, cu, m = vp.pack([5, 3], 2, 2, 16)
    torch._dynamo.reset()
    cp_inductor.clear_report()
    with reference_kernels(), torch.no_grad():
        out = torch.compile(lambda q, k, v: vp.torchtitan_style(q, k, v, cu, m), backend="cp_inductor")(q, k, v)
    assert [r.path for r in cp_inductor.report().varlen] == [varlen_cudnn.CUDNN_RAGGED]
    assert float((out.double() - vp.sequence_reference(q, k, v, cu, True)).abs().max()) < 1e-5
    torch._dynamo.reset()



def arange_pack(q, k, v, length):
    """cu_seqlens built in the graph from arange: equal lengths the graph proves."""
    cu = torch.arange(0, q.shape[0] + 1, length, dtype=torch.int32, device=q.device)
    return vp.torchtitan_style(q, k, v, cu, length)


class TestUniform(TestCase):
    def test_proven_lengths_go_to_dense_sdpa(self):
        q, k, v, _, _ = vp.pack([4, 4, 4], 4, 2, 16)
        gm, routes = rewritten(arange_pack, q, k, v, 4)
        # 3 sequences of 4 tokens: a [3, 4, H, D] batch, GQA as is, no check (the graph proves it).
        self.assertExpectedInline(calls(gm), """\
arange(0, 13, 4)
view(l_q_, 3, 4, -1, 16)
transpose(view, 1, 2)
view(l_k_, 3, 4, -1, 16)
transpose(view_1, 1, 2)
view(l_v_, 3, 4, -1, 16)
transpose(view_2, 1, 2)
scaled_dot_product_attention(transpose, transpose_1, transpose_2)
transpose(scaled_dot_product_attention, 1, 2)
reshape(transpose_3, 12, 4, -1)""")
        self.assertExpectedInline(routes[0].line(), """varlen attention _varlen_attn: local, thd, lengths proven, causal, K/V head repeat dropped: dense_sdpa: no cost map for cpu: no measurement of dense T12 Hq4 Hkv2 D16 causal float32""")

    def test_proven_through_a_dtype_conversion(self):
        def fn(q, k, v):
            cu = (torch.arange(3) * 4).to(torch.int32)
            return vp.torchtitan_style(q, k, v, cu, 4)

        _, routes = rewritten(fn, *vp.pack([4, 4], 2, 2, 16)[:3])
        assert (routes[0].lengths, routes[0].path) == ("proven", "dense_sdpa"), routes

    def test_promised_lengths_are_checked_on_device(self):
        q, k, v, cu, m = vp.pack([4, 4], 2, 2, 16)
        gm, routes = rewritten(vp.torchtitan_style, q, k, v, cu, m, uniform_thd="promised")
        self.assertExpectedInline(calls(gm).split("\nview")[0], """\
arange(0, 9, 4)
eq(l_cu_, arange)
all(eq)
_assert_async(all_1, 'uniform_thd: the sequences of this pack are not of equal length')""")
        assert routes[0].lengths == "promised" and routes[0].path == "dense_sdpa"

    def test_unequal_pack_under_a_promise_stays_ragged(self):
        q, k, v, cu, m = vp.pack([3, 6], 2, 2, 16)
        gm, routes = rewritten(vp.torchtitan_style, q, k, v, cu, m, uniform_thd="promised")
        self.assertExpectedInline(routes[0].line(), """varlen attention _varlen_attn: local, thd, lengths unknown, causal: cudnn_ragged: no cost map for cpu: no measurement of thd T9 Hq2 Hkv2 D16 causal float32""")


@pytest.mark.parametrize("causal", [True, False])
def test_dense_numerics_match_the_fp64_reference(causal):
    """Proven equal lengths on dense SDPA (no reference kernels: CPU SDPA runs), against
    per-sequence fp64 attention, for the output and every gradient."""
    q, k, v, cu, m = vp.pack([8, 8, 8], 4, 2, 16, dtype=torch.float32, seed=3)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    cp_inductor.clear_report()
    fn = torch.compile(lambda q, k, v: vp.torchtitan_style(q, k, v, torch.arange(0, 25, 8, dtype=torch.int32), 8, causal),
                       backend="cp_inductor", fullgraph=True)
    out = fn(*inputs)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    assert [(r.lengths, r.path) for r in cp_inductor.report().varlen] == [("proven", "dense_sdpa")]
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = vp.sequence_reference(*ref_inputs, cu, causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), (want, *torch.autograd.grad(want, ref_inputs, grad.double()))):
        err = float((a.detach().double() - b).norm() / b.norm())
        assert err < 1e-5, (name, err)
    torch._dynamo.reset()


def test_broken_promise_is_an_error_not_an_answer():
    """uniform_thd="promised" on a pack whose lengths differ from the promise (same count, same
    tokens): the compiled step raises instead of attending across documents."""
    q, k, v, cu, m = vp.pack([4, 4], 2, 2, 16)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, cu: vp.torchtitan_style(q, k, v, cu, 4), backend="cp_inductor",
                       options={"cp_inductor.uniform_thd": "promised"})
    fn(q, k, v, cu)
    with pytest.raises(Exception, match="equal length|assert"):
        fn(q, k, v, torch.tensor([0, 3, 8], dtype=torch.int32))
    torch._dynamo.reset()


def test_buckets_waste_at_most_an_eighth_and_stay_few():
    """The ragged op's graph buckets: never below the value, at most 1/4 above, 4 per doubling."""
    from cp_inductor.lowerings.varlen_attention import bucket, _bucketed

    values = range(1, 70000)
    buckets = [bucket(n) for n in values]
    assert all(n <= b <= n * 5 / 4 for n, b in zip(values, buckets))
    assert len(set(bucket(n) for n in range(4097, 8193))) == 4
    cu_q, cu_k, max_q, max_k = _bucketed("test", torch.tensor([0, 3, 10] + [10 + i for i in range(1, 16)]), None, 70, 70)
    # 17 sequences -> 20: three empty sequences at the end; the bound 70 -> 80
    assert cu_q.tolist()[-5:] == [24, 25, 25, 25, 25] and len(cu_q) == 21 and cu_k is cu_q and (max_q, max_k) == (80, 80)


def test_ragged_offsets_and_lengths_are_computed_on_device_once_per_stride():
    """What the ragged graphs read per sequence: int32 lengths, and per tensor the int64 element
    offset of the sequence's first token (cu_seqlens times the token stride), each product once."""
    from cp_inductor.lowerings import cudnn_ragged as cr

    cu_q, cu_k = torch.tensor([0, 3, 3, 10], dtype=torch.int32), torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    meta = cr._metadata(cu_q, cu_k, {"q": ("q", 64), "o": ("q", 64), "k": ("k", 16), "stats": ("q", 4)})
    assert meta[cr._LEN_Q].flatten().tolist() == [3, 0, 7] and meta[cr._LEN_K].flatten().tolist() == [5, 1, 6]
    assert meta[cr._LEN_Q].dtype == torch.int32 and meta[cr._OFF["q"]].dtype == torch.int64
    assert meta[cr._OFF["q"]].flatten().tolist() == [0, 192, 192, 640] and meta[cr._OFF["o"]] is meta[cr._OFF["q"]]
    assert meta[cr._OFF["k"]].flatten().tolist() == [0, 80, 96, 192]
    assert meta[cr._OFF["stats"]].flatten().tolist() == [0, 12, 12, 40]
    assert all(t.shape[1:] == (1, 1, 1) for t in meta.values())
    shared = cr._metadata(cu_q, cu_q, {"q": ("q", 64), "k": ("k", 64)})
    assert shared[cr._LEN_K] is shared[cr._LEN_Q] and shared[cr._OFF["k"]] is shared[cr._OFF["q"]]


def test_the_log_sum_exp_is_re_padded_per_sequence_position():
    """[T, H] per token -> [count, H, bound, 1]: token t of sequence i at row t - cu[i]; rows past
    a sequence's length and the bucket's empty sequences are zero."""
    from cp_inductor.lowerings.cudnn_ragged import padded_stats

    lse = torch.arange(14.0).view(7, 2)  # 7 tokens, 2 heads
    cu = torch.tensor([0, 3, 3, 7, 7])  # lengths 3, 0, 4, and an empty bucket sequence
    padded = padded_stats(lse, cu, 4, 5)
    assert padded.shape == (4, 2, 5, 1)
    assert padded[0, :, :3, 0].tolist() == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
    assert padded[2, 0, :, 0].tolist() == [6.0, 8.0, 10.0, 12.0, 0.0]
    assert padded[1].abs().sum() == 0 and padded[3].abs().sum() == 0 and padded[0, :, 3:].abs().sum() == 0


def test_small_packs_stay_on_flash_by_the_measured_cost_model():
    """On CUDA, a pack below varlen_cudnn_min_size (tokens x query heads x head_dim) is not a
    cuDNN candidate, with the measured reason; at the size, and with the knob lowered, it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        small, large = (torch.empty(t, 32, 128, device="cuda", dtype=torch.bfloat16) for t in (8192, 16384))
    reasons = [varlen_cudnn._cudnn_why_not(varlen_calls.VarlenCall(None, "x", {"query": q}, True), snapshot(cfg))
               for q, cfg in ((small, {}), (large, {}), (small, {"varlen_cudnn_min_size": 0}))]
    assert reasons[0].startswith("cost model: 33554432 tokens x query heads x head_dim is below varlen_cudnn_min_size")
    assert [r is None or not r.startswith("cost model") for r in reasons] == [False, True, True], reasons


def test_a_new_bucket_runs_on_a_covering_graph_until_it_has_come_often(monkeypatch):
    """Lengths that change every step: a bucket with no graph runs on the smallest built one
    within twice its count and bounds, and gets its own graph on its ``_BUILD_AFTER``-th run;
    beyond twice, for another signature, or under deterministic algorithms, its own is built at
    once."""
    from cp_inductor.lowerings import varlen_attention as va

    monkeypatch.setattr(va, "_built", {})
    monkeypatch.setattr(va, "_covered_runs", {})
    monkeypatch.setattr(va, "_BUILD_AFTER", 3)
    run = va._shape_for
    assert run("sig", (8, 4096, 4096)) == (8, 4096, 4096)  # nothing covers it: built
    assert [run("sig", (6, 3072, 3072)) for _ in range(4)] == [(8, 4096, 4096)] * 2 + [(6, 3072, 3072)] * 2
    assert run("sig", (2, 1024, 1024)) == (2, 1024, 1024)  # beyond twice
    assert run("other", (6, 3072, 3072)) == (6, 3072, 3072)
    assert run("sig", (5, 2048, 2048)) == (6, 3072, 3072)  # the smaller of the two covering
    with torch_deterministic():
        assert run("sig", (5, 1536, 1536)) == (5, 1536, 1536)


@contextlib.contextmanager
def torch_deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_lowering_that_raises_leaves_the_program_as_it_was():
    """Not strict: the failed lowering's nodes are erased, the call keeps its op, the report
    says why (strict, as in these tests otherwise, it would raise)."""
    from cp_inductor.passes.dynamo import uniform_thd

    def broken(gm, call):
        gm.graph.call_function(torch.zeros, (1,))
        raise RuntimeError("boom")

    gm = dynamo_graph(arange_pack, *vp.pack([4, 4], 2, 2, 16)[:3], 4)
    before = calls(gm)
    with pass_replaced(uniform_thd.PASS, apply=broken):
        (route,) = engine.run_dynamo_passes(gm, snapshot({"strict": False}))
    assert calls(gm) == before and route.path == varlen_calls.KEPT
    assert "uniform_thd: internal error, left to Inductor: RuntimeError: boom" in route.reason, route.reason


def test_a_per_call_promise_goes_dense_and_checks_itself():
    """``cp_inductor.equal_lengths(cu)``: that one call goes to dense SDPA under the default
    uniform_thd="proven", with the on-device check (the marker's own output is no longer read);
    a pack of unequal lengths is rejected, eager and compiled."""
    q, k, v, cu, m = vp.pack([4, 4, 4], 2, 2, 16, dtype=torch.float64)

    def fn(q, k, v, cu):
        return vp.torchtitan_style(q, k, v, cp_inductor.equal_lengths(cu), 4)

    gm, routes = rewritten(fn, q, k, v, cu)
    assert (routes[0].lengths, routes[0].path) == ("promised", "dense_sdpa"), routes
    assert "_assert_async" in calls(gm) and "equal_lengths" in calls(gm)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="cp_inductor")
    assert float((compiled(q, k, v, cu) - vp.sequence_reference(q, k, v, cu, True)).abs().max()) < 1e-10
    unequal = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    for run in (fn, compiled):
        with pytest.raises(RuntimeError):
            run(q, k, v, unequal)
    torch._dynamo.reset()


def test_ragged_plans_are_built_once_per_bucket_and_counted(monkeypatch):
    """cudnn_ragged's plumbing without cuDNN: forward and backward build one plan per bucket on
    the device's handle, counted per direction (what the benchmarks report)."""
    from cp_inductor.lowerings import cudnn_ragged

    built = []

    class FakePlan:
        uids = ()

        def run(self, buffers, device, h):
            assert h == "handle"

    def builder(direction):
        def build(h, *args):
            built.append((direction, h, args))
            return FakePlan()
        return build

    monkeypatch.setattr(cudnn_ragged, "_build_forward", builder("forward"))
    monkeypatch.setattr(cudnn_ragged, "_build_backward", builder("backward"))
    monkeypatch.setattr(cudnn_ragged, "handle", lambda device: "handle")
    monkeypatch.setattr(cudnn_ragged, "outside_graph_pool", lambda fn, *args: fn(*args))
    for name in ("_forward_plans", "_backward_plans"):
        monkeypatch.setattr(cudnn_ragged, name, {})
    monkeypatch.setattr(cudnn_ragged, "builds", {"forward": 0, "backward": 0})
    q, k, v, cu, m = vp.pack([3, 5], 4, 2, 16, dtype=torch.bfloat16)
    for bound in (64, 64, 128):
        out, lse = cudnn_ragged.forward(q, k, v, cu, cu, 2, bound, bound, 0.25, True, False)
        cudnn_ragged.backward(out, q, k, v, out, lse, cu, cu, 2, bound, bound, 64, 64, 0.25, True, False)
    assert [(d, h, args[3:6] if d == "forward" else args[1:4]) for d, h, args in built] == [
        ("forward", "handle", (2, 64, 64)), ("backward", "handle", (2, 64, 64)),
        ("forward", "handle", (2, 128, 128)), ("backward", "handle", (2, 128, 128))]
    assert cudnn_ragged.builds == {"forward": 2, "backward": 2}
