"""cudnn_frontend_backward: cuDNN attention backward calls move to the cuDNN frontend's op (plan
cache keyed on every layout) where they can, and keep aten's op and the program's dO where they
cannot, with the reason in the report. The graphs are built by hand (CI has no cuDNN); the GPU
tier runs the calls (tests/test_gpu_one.py)."""

import torch
import torch._inductor.config
import torch.fx
from expecttest import TestCase
from torch._subclasses.fake_tensor import FakeTensorMode

from cp_inductor.config_snapshot import snapshot
from cp_inductor.lowerings.cudnn_backward import aten_cache_key_complete
from cp_inductor.passes import engine
from cp_inductor.passes.post_grad.cudnn_frontend_backward import cudnn_frontend_backward_pass, route

AVAILABLE = ""  # the frontend's state: importable
MISSING = "nvidia-cudnn-frontend is not importable (ModuleNotFoundError: No module named 'cudnn')"


def backward_graph(dtype=torch.bfloat16, dropout_p=0.0, scale=None):
    """dq, dk, dv = cuDNN attention backward of [1, 4, 16, 8] q, k, v; dO read as [B, S, H, D]."""
    g = torch.fx.Graph()
    with FakeTensorMode():
        bhsd = torch.empty(1, 4, 16, 8, dtype=dtype)
        vals = {
            "grad_out": torch.empty(1, 16, 4, 8, dtype=dtype).transpose(1, 2), "query": bhsd, "key": bhsd,
            "value": bhsd, "out": bhsd, "logsumexp": torch.empty(1, 4, 16, 1),
            "philox_seed": torch.empty((), dtype=torch.int64), "philox_offset": torch.empty((), dtype=torch.int64),
        }
    nodes = []
    for name, val in vals.items():
        nodes.append(g.placeholder(name))
        nodes[-1].meta["val"] = val
    op = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    call = g.call_function(op, (*nodes, None, None, None, 16, 16, dropout_p, True), {"scale": scale} if scale else {})
    with FakeTensorMode(allow_non_fake_inputs=True):
        call.meta["val"] = op(*(n.meta["val"] for n in nodes), None, None, None, 16, 16, dropout_p, True)
    g.output(tuple(g.call_function(__import__("operator").getitem, (call, i)) for i in range(3)))
    return g, call


def calls(g) -> str:
    out = []
    for n in g.nodes:
        if n.op == "call_function" and n.target.__name__ != "getitem":
            args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args)
            out.append(f"{n.target}({args})")
    return "\n".join(out)


class TestRoute(TestCase):
    def test_moved_to_the_frontend(self):
        g, _ = backward_graph()
        assert cudnn_frontend_backward_pass(g, snapshot(), AVAILABLE) == 1
        g.lint()
        # scale: 1/sqrt(head_dim) made explicit; O, its log-sum-exp and the program's dO as they were.
        self.assertExpectedInline(calls(g), """cp_inductor.cudnn_attention_backward.default(grad_out, query, key, value, out, logsumexp, 0.3535533905932738, True)""")

    def test_explicit_scale_kept(self):
        g, _ = backward_graph(scale=0.25)
        cudnn_frontend_backward_pass(g, snapshot(), AVAILABLE)
        self.assertExpectedInline(calls(g), """cp_inductor.cudnn_attention_backward.default(grad_out, query, key, value, out, logsumexp, 0.25, True)""")

    def test_gradients_keep_their_layouts(self):
        g, call = backward_graph()
        before = [tuple(t.stride()) for t in call.meta["val"]]
        cudnn_frontend_backward_pass(g, snapshot(), AVAILABLE)
        new = next(n for n in g.nodes if n.op == "call_function" and "cp_inductor" in str(n.target))
        assert [tuple(t.stride()) for t in new.meta["val"]] == before

    def test_stays_on_aten_with_the_reason(self):
        cases = {
            "no frontend": (backward_graph(), snapshot(), MISSING),
            "dropout": (backward_graph(dropout_p=0.1), snapshot(), AVAILABLE),
            "fp32": (backward_graph(dtype=torch.float32), snapshot(), AVAILABLE),
            "off": (backward_graph(), snapshot({"cudnn_frontend_backward": False}), AVAILABLE),
            "cudagraphs": (backward_graph(), snapshot(), AVAILABLE),
        }
        reasons = []
        for name, ((g, call), cfg, state) in cases.items():
            with torch._inductor.config.patch({"triton.cudagraphs": name == "cudagraphs"}):
                reasons.append(f"{name}: {route(call, cfg, state).path}: {route(call, cfg, state).reason}")
                assert cudnn_frontend_backward_pass(g, cfg, state) == 0
            assert call in g.nodes  # untouched: aten's op with the program's dO
            assert call.args[0].name == "grad_out"
        self.assertExpectedInline("\n".join(reasons), """\
no frontend: aten: nvidia-cudnn-frontend is not importable (ModuleNotFoundError: No module named 'cudnn'): aten's op, dO as the program made it (its plan cache is keyed on q/k/v layouts only)
dropout: aten: the cuDNN frontend's backward takes no dropout: aten's op, dO as the program made it
fp32: aten: the cuDNN frontend's backward takes no 4-d torch.float32 inputs: aten's op, dO as the program made it
off: aten: disabled by config: aten's plan cache is keyed on q/k/v layouts only, dO as the program made it
cudagraphs: aten: CUDA graphs (reduce-overhead): aten's op, dO as the program made it (its plan cache is keyed on q/k/v layouts only)""")

    def test_report_lists_every_call(self):
        from cp_inductor.lowerings.cudnn_backward import unavailable

        g, call = backward_graph()
        rows = engine.backward_routes(g, "backward")
        # In CI (no CUDA) the call stays on aten's op; with a GPU and the [cudnn] extra it moves.
        path = "aten" if unavailable() else "cudnn_frontend"
        assert [(r.graph_kind, r.attention, r.path) for r in rows] == [("backward", call.name, path)]
        assert rows[0].reason == route(call, snapshot()).reason

    def test_this_torch_needs_it(self):
        # Supported torch versions (pyproject: < 2.14) all key aten's plan cache on q/k/v only.
        assert not aten_cache_key_complete()


class DirectCallTest(TestCase):
    """Inductor's generated code names the op's CUDA kernel itself (no trip through the
    dispatcher) on CUDA and keeps the dispatcher elsewhere. CI has no CUDA: the op gets a CPU
    kernel here, standing in for the CUDA one in the namespace the generated code imports."""

    def lines_calling_the_op(self, direct: bool):
        import cp_inductor.lowerings.cudnn_backward as cb
        from torch._inductor.select_algorithm import extern_kernels
        from torch._inductor.utils import run_and_get_code

        def stand_in(grad_out, query, key, value, out, logsumexp, scale, is_causal):
            return grad_out * scale, query * 2, value * 3

        lib = torch.library.Library("cp_inductor", "IMPL")
        lib.impl("cudnn_attention_backward", stand_in, "CPU")
        cuda_kernel, applies = getattr(extern_kernels, cb.DIRECT_CALL_NAME), cb._direct_call_applies
        setattr(extern_kernels, cb.DIRECT_CALL_NAME, stand_in)
        cb._direct_call_applies = lambda device: direct
        try:
            def f(*args):
                return sum(torch.ops.cp_inductor.cudnn_attention_backward(*args, 0.5, True))

            args = [torch.randn(1, 2, 4, 8) for _ in range(5)] + [torch.randn(1, 2, 4)]
            torch._dynamo.reset()
            with torch._inductor.config.patch(fx_graph_cache=False):  # the other test's code is cached
                got, codes = run_and_get_code(torch.compile(f, backend="inductor", fullgraph=True), *args)
            torch.testing.assert_close(got, f(*args), rtol=0, atol=0)
        finally:
            setattr(extern_kernels, cb.DIRECT_CALL_NAME, cuda_kernel)
            cb._direct_call_applies = applies
            lib._destroy()
            torch._dynamo.reset()
        return [line.strip().split("(")[0] for line in codes[0].splitlines() if " = " in line and "cudnn_attention" in line]

    def test_cuda_calls_name_the_kernel(self):
        self.assertExpectedInline(str(self.lines_calling_the_op(direct=True)),
                                  """['buf0 = extern_kernels.cp_inductor_cudnn_attention_backward']""")

    def test_other_devices_keep_the_dispatcher(self):
        self.assertExpectedInline(str(self.lines_calling_the_op(direct=False)),
                                  """['buf0 = torch.ops.cp_inductor.cudnn_attention_backward.default']""")


def test_the_cache_keys_do_not_import_the_frontend(tmp_path, monkeypatch):
    """Inductor's cache key (our hooks' uuid) and the report's are computed on every compile,
    before a restarted job's cache hit: they read the frontend's version, not the frontend (its
    import loads cuDNN's libraries, a cost default Inductor does not pay on a restart)."""
    import importlib.metadata
    import sys

    from cp_inductor import report_cache
    from cp_inductor.lowerings import cudnn_backward
    from cp_inductor.passes.hook_pass import CPGraphPass

    def asked():  # the import's way in (cached per process, so replaced rather than cleared)
        raise AssertionError("cudnn_backward.unavailable() asked")

    def no_distribution(name):
        raise importlib.metadata.PackageNotFoundError(name)

    package = tmp_path / "cudnn"
    package.mkdir()
    imported = tmp_path / "imported"
    (package / "__init__.py").write_text(f"open({str(imported)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cudnn", raising=False)  # a machine with the frontend imported
    monkeypatch.setattr(importlib.metadata, "version", no_distribution)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cudnn_backward, "unavailable", asked)
    cudnn_backward.frontend_fingerprint.cache_clear()
    try:
        assert cudnn_backward.frontend_fingerprint() == f"cudnn at {package / '__init__.py'}"
        CPGraphPass("post_grad", lambda *a: None, snapshot()).uuid()
        gm = torch.fx.symbolic_trace(lambda x: x + 1)
        report_cache.key(gm, [torch.zeros(2)], snapshot(), "default", {})
        assert not imported.exists()
    finally:
        cudnn_backward.frontend_fingerprint.cache_clear()
