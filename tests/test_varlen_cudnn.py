"""varlen_cudnn: packed-sequence attention (torch's varlen_attn) moves to cp_inductor's ragged op
on the graph Dynamo hands the backend, where it can, with the reason in the report where it
cannot. CPU: the op's per-sequence reference stands in for cuDNN (``reference_kernels``); the
GPU tier runs cuDNN (tests/test_gpu_one.py)."""

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import cp_inductor
import varlen_programs as vp
from cp_inductor.config_snapshot import snapshot
from cp_inductor.lowerings.varlen_attention import reference_kernels
from cp_inductor.passes import varlen_cudnn

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


def calls(gm) -> str:
    out = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and getattr(n.target, "__name__", n.target) != "getitem":
            args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args)
            out.append(f"{getattr(n.target, '__name__', n.target)}({args})")
    return "\n".join(out)


def rewritten(fn, *args, **cfg):
    gm = dynamo_graph(fn, *args)
    with reference_kernels():
        routes = varlen_cudnn.run(gm, snapshot(cfg))
    return gm, routes


def sequence_reference(q, k, v, cu, causal):
    """Per-sequence SDPA in fp64: the single-device reference."""
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        o = F.scaled_dot_product_attention(*(t[a:b].double().transpose(0, 1) for t in (q, k, v)),
                                           is_causal=causal, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


class TestGraph(TestCase):
    def test_torchtitan_varlen_moves_and_drops_the_head_repeat(self):
        q, k, v, cu, m = vp.pack([3, 7, 1], 4, 2, 16)
        gm, routes = rewritten(vp.torchtitan_style, q, k, v, cu, m)
        # K/V heads were repeated only for varlen_attn: cuDNN takes the 2 K/V heads as they are.
        self.assertExpectedInline(calls(gm), """varlen_attention.default(l_q_, l_k_, l_v_, l_cu_, l_cu_, 7, 7, 0.25, True)""")
        self.assertExpectedInline("\n".join(r.line() for r in routes), """\
varlen attention _varlen_attn: local, thd, lengths unknown, causal, K/V head repeat dropped: cudnn_ragged""")

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
add(out, sum_1)""")
        assert not routes[0].detail.endswith("dropped")


class TestReasons(TestCase):
    def reason(self, fn, *args, **cfg):
        gm, routes = rewritten(fn, *args, **cfg)
        (route,) = routes
        assert route.path == varlen_cudnn.KEPT and "varlen_attn" in calls(gm), calls(gm)
        return route.reason

    def test_switch_off(self):
        self.assertExpectedInline(self.reason(vp.torchtitan_style, *vp.pack([4, 4], 2, 2, 16), varlen_cudnn=False),
                                  """switch varlen_cudnn is off""")

    def test_sliding_window(self):
        from torch.nn.attention.varlen import varlen_attn

        def fn(q, k, v, cu, m):
            return varlen_attn(q, k, v, cu, cu, m, m, window_size=(8, 0))

        self.assertExpectedInline(self.reason(fn, *vp.pack([4, 4], 2, 2, 16)), """sliding window [8, 0] (only none or causal)""")

    def test_program_reads_the_log_sum_exp(self):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        def fn(q, k, v, cu, m):
            out, lse = varlen_attn(q, k, v, cu, cu, m, m, return_aux=AuxRequest(lse=True))
            return out, lse

        self.assertExpectedInline(self.reason(fn, *vp.pack([4, 4], 2, 2, 16)), """the program reads the log-sum-exp or the RNG state""")

    def test_head_dim_cudnn_cannot_take(self):
        self.assertExpectedInline(self.reason(vp.torchtitan_style, *vp.pack([4, 4], 2, 2, 12)),
                                  """head_dim 12 (cuDNN takes multiples of 8 up to 256)""")

    def test_cpu_without_the_reference(self):
        gm = dynamo_graph(vp.torchtitan_style, *vp.pack([4, 4], 2, 2, 16))
        (route,) = varlen_cudnn.run(gm, snapshot())
        self.assertExpectedInline(route.reason, """cpu: only CUDA runs cuDNN's ragged attention""")


@pytest.mark.parametrize("causal,heads_kv,lengths", [(True, 2, [1, 9, 130, 5]), (False, 4, [64, 1, 31])])
def test_compiled_numerics_match_the_fp64_reference(causal, heads_kv, lengths):
    """cp_inductor on the reference kernels, against per-sequence fp64 SDPA: the output and
    every gradient (GQA with the repeat dropped; a 1-token document; lengths off 128)."""
    q, k, v, cu, m = vp.pack(lengths, 4, heads_kv, 16, dtype=torch.float32, seed=len(lengths))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    torch._dynamo.reset()
    cp_inductor.clear_report()
    with reference_kernels():
        fn = torch.compile(lambda q, k, v: vp.torchtitan_style(q, k, v, cu, m, causal), backend="cp_inductor", fullgraph=True)
        out = fn(*inputs)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, grad)
    assert [r.path for r in cp_inductor.report().varlen] == [varlen_cudnn.CUDNN_RAGGED]
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = sequence_reference(*ref_inputs, cu, causal)
    want_grads = torch.autograd.grad(want, ref_inputs, grad.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), (want, *want_grads)):
        err = float((a.detach().double() - b).norm() / b.norm())
        assert err < 1e-5, (name, err)
    torch._dynamo.reset()


def test_inference_graph_moves_too():
    """No grad: one forward graph, the same op."""
    q, k, v, cu, m = vp.pack([5, 3], 2, 2, 16)
    torch._dynamo.reset()
    cp_inductor.clear_report()
    with reference_kernels(), torch.no_grad():
        out = torch.compile(lambda q, k, v: vp.torchtitan_style(q, k, v, cu, m), backend="cp_inductor")(q, k, v)
    assert [r.path for r in cp_inductor.report().varlen] == [varlen_cudnn.CUDNN_RAGGED]
    assert float((out.double() - sequence_reference(q, k, v, cu, True)).abs().max()) < 1e-5
    torch._dynamo.reset()

