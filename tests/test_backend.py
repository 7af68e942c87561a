"""The backend as torch.compile sees it: entry point, mode/options, config, chained passes,
cache key."""

import functools
import json
import subprocess
import sys

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import cp_inductor
from cp_inductor.backend import graph_passes
from cp_inductor.parallel import ulysses_attention
from helpers import fake_pg


def test_in_a_fresh_process_found_by_name_apart_from_the_helpers_and_forkable():
    """In one fresh process: torch finds the backend by name without an import and compiles
    with it; the backend and its passes loaded none of the helpers users and tests run
    (``cp_inductor.testing``, ``cp_inductor.parallel``) nor torch's varlen module, whose ops it
    knows once the program imports it. Then the gloo fork server's warm-up
    (``testing.rank_warmup``) builds Inductor's patterns and starts no thread: one alive at the
    fork (tqdm's monitor, which building the patterns starts) would leave the ranks broken."""
    code = (
        "import os, sys, threading, torch\n"
        "assert 'cp_inductor' in torch._dynamo.list_backends()\n"
        "assert 'cp_inductor' not in sys.modules\n"
        "f = torch.compile(lambda x: x.sin() * 2, backend='cp_inductor')\n"
        "x = torch.randn(8)\n"
        "torch.testing.assert_close(f(x), x.sin() * 2)\n"
        "import cp_inductor.backend, cp_inductor.passes.engine\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cp_inductor.testing', 'cp_inductor.parallel'))))\n"
        # torch's varlen ops are looked up, not imported (a cost of every restart's import), and
        # are known once the program imports them, after the backend has compiled
        "print('torch.nn.attention.varlen' in sys.modules)\n"
        "import torch.nn.attention.varlen\n"
        "from cp_inductor.passes.analysis import sdpa_ops\n"
        "print(torch.ops.torch_attn._varlen_attn.default in sdpa_ops.ATTENTION,\n"
        "      torch.ops.torch_attn._varlen_attn_backward.default in sdpa_ops.VARLEN_BACKWARD)\n"
        "torch._dynamo.reset()\n"
        "from torch._inductor.fx_passes import joint_graph\n"
        "joint_graph.lazy_init.cache_clear()\n"
        "import tqdm\n"
        "if tqdm.tqdm.monitor is not None:\n"  # the compile above started it: stop it, as in a fresh server
        "    tqdm.tqdm.monitor.exit(); tqdm.tqdm.monitor.join(); tqdm.tqdm.monitor = None\n"
        "tqdm.tqdm.monitor_interval = 10\n"
        # A native thread of the compile above may still be winding down: count once the count
        # holds still (a thread that ends is harmless at a fork; one the warm-up starts is not).
        "def settled():\n"
        "    import time\n"
        "    seen = []\n"
        "    while len(seen) < 5 or len(set(seen[-5:])) > 1:\n"
        "        seen.append((len(os.listdir('/proc/self/task')), threading.active_count())); time.sleep(0.05)\n"
        "    return seen[-1]\n"
        "before = settled()\n"
        "import cp_inductor.testing.rank_warmup\n"
        "after = settled()\n"
        "print(all(a <= b for a, b in zip(after, before)), joint_graph.lazy_init.cache_info().currsize)\n"
        "print(before, after, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.stdout.splitlines() == ["[]", "False", "True True", "True 1"], proc.stdout + proc.stderr


def test_a_config_snapshot_is_read_only():
    from cp_inductor.config_snapshot import snapshot

    cfg = snapshot({"head_overlap_groups": 4})
    assert cfg.head_overlap_groups == 4 and cfg["fused_a2a"] is cp_inductor.config.fused_a2a
    with pytest.raises(AttributeError):
        cfg.head_overlap_groups = 2
    with cp_inductor.config.patch(head_overlap_groups=8):
        assert cfg.head_overlap_groups == 4  # frozen when taken


def test_uuid_follows_config_and_source():
    cfg = cp_inductor.config.get_config_copy()
    base = graph_passes(cfg, {})["post_grad_custom_pre_pass"].uuid()
    assert base == graph_passes(dict(cfg), {})["post_grad_custom_pre_pass"].uuid()
    for key, value in (("fused_a2a", False), ("head_overlap_groups", 4)):
        changed = graph_passes({**cfg, key: value}, {})["post_grad_custom_pre_pass"].uuid()
        assert changed != base, key
    with cp_inductor.config.patch(fused_a2a=False):
        patched = graph_passes(cp_inductor.config.get_config_copy(), {})["post_grad_custom_pre_pass"].uuid()
    assert patched != base


class CountingPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "counting-pass-v1"


def test_user_pass_on_the_same_key_still_runs():
    user = CountingPass()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user, fx_graph_cache=False):
        f = torch.compile(lambda x: (x @ x).relu(), backend="cp_inductor")
        f(torch.randn(4, 4))
    assert user.calls == 1
    ours = graph_passes(cp_inductor.config.get_config_copy(), {"post_grad_custom_post_pass": user})
    assert ours["post_grad_custom_post_pass"].user_pass is user
    other = CountingPass()
    other.uuid = lambda: "counting-pass-v2"
    theirs = graph_passes(cp_inductor.config.get_config_copy(), {"post_grad_custom_post_pass": other})
    assert ours["post_grad_custom_post_pass"].uuid() != theirs["post_grad_custom_post_pass"].uuid()


def _ulysses(q, k, v):
    return ulysses_attention(q, k, v, is_causal=True)


def _qkv():
    return [torch.randn(1, 8, 4, 16, requires_grad=True) for _ in range(3)]


class ConfigSpy(CustomGraphPass):
    """Records an Inductor config value as the passes see it."""

    def __init__(self):
        self.cudagraphs = []

    def __call__(self, graph):
        self.cudagraphs.append(torch._inductor.config.triton.cudagraphs)

    def uuid(self):
        return "config-spy"


@pytest.mark.parametrize("mode, expected", [("reduce-overhead", True), ("default", False)])
def test_mode_reaches_inductor(mode, expected):
    spy = ConfigSpy()
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=spy, fx_graph_cache=False):
        f = torch.compile(lambda x: x.cos() + 1, backend="cp_inductor", mode=mode)
        f(torch.randn(4))
    assert spy.cudagraphs == [expected]


def test_options_reach_our_config():
    with fake_pg(2):
        cp_inductor.clear_report()
        f = torch.compile(
            _ulysses, backend="cp_inductor", fullgraph=True,
            options={"cp_inductor.fused_a2a": False, "cp_inductor.head_overlap": True},
        )
        f(*_qkv()).sum().backward()
        rows = cp_inductor.report().regions
        assert [r.graph for r in rows] == ["forward", "backward"]
        for r in rows:
            assert r.skipped["fused_a2a"] == "disabled by config"
            assert r.skipped["head_overlap"] == "needs fused_a2a (disabled by config)"
        assert "head_overlap: needs fused_a2a (disabled by config)" in str(cp_inductor.report())
        torch._dynamo.reset()  # calls the backend's reset, which clears the report
        assert len(cp_inductor.report()) == 0


def test_each_graph_is_analysed_once_and_the_report_is_what_ran(monkeypatch):
    """The hook applies the regions and decisions the report's analysis found (the graph
    unchanged in between): each detector reads each graph once, and what the report says
    applies is what the counters saw kept."""
    from torch._dynamo.utils import counters

    from cp_inductor.passes import engine

    finds = []
    for detector in engine.DETECTORS:
        def counting(graph, graph_kind, cfg, log=None, _find=detector.find, _style=detector.STYLE):
            finds.append((_style, graph_kind))
            return _find(graph, graph_kind, cfg, log)
        monkeypatch.setattr(detector, "find", counting)
    with fake_pg(2):
        torch._dynamo.reset()
        cp_inductor.clear_report()
        counters.clear()
        torch.compile(_ulysses, backend="cp_inductor", fullgraph=True)(*_qkv()).sum().backward()
        rows = cp_inductor.report().regions
    assert [r.graph for r in rows] == ["forward", "backward"]
    assert [kind for _, kind in finds] == ["forward"] * 3 + ["backward"] * 3  # no "post_grad" pass of its own
    assert counters["cp_inductor"]["fused_a2a"] == sum("fused_a2a" in r.applied for r in rows) == 2


def test_config_patch_applies_at_compile_time():
    with fake_pg(2), cp_inductor.config.patch(detect=False):
        cp_inductor.clear_report()
        torch.compile(_ulysses, backend="cp_inductor", fullgraph=True)(*_qkv())
        assert len(cp_inductor.report()) == 0


def test_unknown_option_is_an_error():
    with pytest.raises(Exception, match="unknown cp_inductor option"):
        torch._dynamo.reset()
        torch.compile(lambda x: x + 1, backend="cp_inductor", options={"cp_inductor.nope": 1})(torch.ones(2))


def test_torch_logs_artifact():
    code = (
        "import cp_inductor.reporting as r\n"
        "r.record(r.Region('a2a', 2, 'bshd', 'forward', applied=['fused_a2a']))\n"
        "r.record_rejected(r.Rejected('backward', 'sdpa_backward', 'dynamic shapes'))\n"
    )
    env = {**__import__("os").environ, "TORCH_LOGS": "cp_inductor"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "forward region: style=a2a cp=2 layout=bshd" in proc.stderr, proc.stderr
    assert "sdpa_backward is not a CP region: dynamic shapes" in proc.stderr
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "region" not in quiet.stderr


def test_a_bug_in_our_analysis_costs_the_rewrite_not_the_compile(monkeypatch):
    """An unexpected error in detection or eligibility leaves the op to Inductor with the error
    as its reason; strict mode (what the tests run with) raises it instead."""
    from cp_inductor.passes.detect import a2a as detect_a2a
    from cp_inductor.passes.post_grad import fused_a2a

    def broken(*args, **kwargs):
        raise KeyError("grad_out")

    monkeypatch.setattr(detect_a2a, "_backward_region", broken)
    monkeypatch.setattr(fused_a2a, "_group_ineligible", broken)
    with fake_pg(2), cp_inductor.config.patch(strict=False):
        cp_inductor.clear_report()
        q, k, v = _qkv()
        f = torch.compile(_ulysses, backend="cp_inductor", fullgraph=True)
        out = f(q, k, v)
        out.sum().backward()
        # The compile and its backward complete (a fake group's collectives return no data to
        # compare values with: the fallback's numerics are the gloo tests' to check).
        assert out.shape == q.shape and q.grad is not None and q.grad.shape == q.shape
        report = cp_inductor.report()
        (fwd,) = report.regions
        assert fwd.skipped["fused_a2a"] == "internal error, left to Inductor: KeyError: 'grad_out'"
        assert [r.reason for r in report.rejected] == ["internal error, left to Inductor: KeyError: 'grad_out'"]
    with fake_pg(2), pytest.raises(Exception, match="grad_out"):
        assert cp_inductor.config.strict
        torch.compile(_ulysses, backend="cp_inductor", fullgraph=True)(*_qkv())


def test_a_list_of_user_passes_runs_after_ours_in_order():
    """A list on a hook key (torch 2.13 takes one): each pass runs, in order, and the cache key
    covers each one's uuid; one without a uuid makes the graph uncacheable, as in Inductor."""
    order = []

    class Named(CountingPass):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __call__(self, graph):
            order.append(self.name)

        def uuid(self):
            return f"named-{self.name}"

    first, second = Named("first"), Named("second")
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=[first, second], fx_graph_cache=False):
        f = torch.compile(lambda x: (x @ x).relu(), backend="cp_inductor")
        f(torch.randn(4, 4))
    assert order == ["first", "second"]
    cfg = cp_inductor.config.get_config_copy()
    both = graph_passes(cfg, {"post_grad_custom_post_pass": [first, second]})["post_grad_custom_post_pass"]
    swapped = graph_passes(cfg, {"post_grad_custom_post_pass": [second, first]})["post_grad_custom_post_pass"]
    assert both.uuid() is not None and both.uuid() != swapped.uuid()
    bare = graph_passes(cfg, {"post_grad_custom_post_pass": [first, lambda graph: None]})["post_grad_custom_post_pass"]
    assert bare.uuid() is None


def test_torch_logs_and_trace_artifacts_show_each_pass():
    """``TORCH_LOGS=cp_inductor`` (here ``set_logs``) says per pass what it did and how long it
    took; a structured trace (``TORCH_TRACE``, tlparse's input) gets each applied rewrite's
    graph before and after, as Inductor's own pass graphs are."""
    import json
    import logging
    import re
    import unittest

    from torch._logging._internal import trace_log

    from cp_inductor.parallel import ulysses_attention
    from cp_inductor.passes import engine
    from helpers import aot_graphs, fake_pg

    class Artifacts(logging.Handler):
        def __init__(self):
            super().__init__()
            self.names = []

        def emit(self, record):
            meta = record.metadata if hasattr(record, "metadata") else json.loads(record.getMessage().split("\n")[0])
            if "artifact" in meta:
                self.names.append(meta["artifact"]["name"])

    qkv = [torch.randn(1, 8, 4, 16, requires_grad=True) for _ in range(3)]
    artifacts = Artifacts()
    torch._logging.set_logs(modules={"cp_inductor": logging.INFO})
    try:
        with fake_pg(2):
            graphs = aot_graphs(lambda q, k, v: ulysses_attention(q, k, v), *qkv)
            trace_log.addHandler(artifacts)
            with unittest.TestCase().assertLogs("cp_inductor", logging.INFO) as logs:
                engine.rewrite_graph(graphs["forward"].graph)
    finally:
        trace_log.removeHandler(artifacts)
        torch._logging.set_logs()
    passes = [re.sub(r"\(\d+\.\d ms\)", "(ms)", r.getMessage()) for r in logs.records if " pass " in r.getMessage()]
    assert passes[:2] == ["cp_inductor pass canonicalize on the graph detection reads: 0 changes (ms)",
                          "cp_inductor pass detect on post_grad_custom_pre_pass: 1 regions (ms)"], passes
    assert any(p.startswith("cp_inductor pass fused_a2a on post_grad_custom_pre_pass, a2a forward ")
               and p.endswith(": applied (ms)") for p in passes), passes
    assert artifacts.names == ["cp_inductor_fused_a2a_before", "cp_inductor_fused_a2a_after"], artifacts.names


def test_a_backward_is_a_region_only_where_its_forward_is(monkeypatch):
    """A region is one thing: where detection refuses a forward attention op (forced here; in
    the wild, a check only the forward's chains show), its backward op is refused too with that
    reason, and nothing is rewritten in either graph. A backward whose forward was never
    analysed is proved on its own, and the report says so."""
    from cp_inductor.passes import engine
    from cp_inductor.passes.analysis.layout_algebra import LayoutError
    from cp_inductor.passes.detect import a2a as detect_a2a
    from helpers import aot_graphs

    with fake_pg(2):
        graphs = aot_graphs(_ulysses, *_qkv())
        alone = engine.analyze(graphs["backward"].graph, "backward")  # its forward not analysed
        assert [r.notes for r in alone] == [["backward region proved on its own (no forward op paired with it)"]]

        def refused(node, graph_kind):
            raise LayoutError("q's heads dealt to ranks otherwise than k/v's")

        monkeypatch.setattr(detect_a2a, "_forward_region", refused)
        graphs = aot_graphs(_ulysses, *_qkv())
        rejected = []
        rows = [r for kind in ("forward", "backward") for r in engine.analyze(graphs[kind].graph, kind, rejected)]
        assert rows == []
        assert [(r.graph_kind, r.reason) for r in rejected] == [
            ("forward", "q's heads dealt to ranks otherwise than k/v's"),
            ("backward", "its forward is not a region: q's heads dealt to ranks otherwise than k/v's"),
        ]


def test_attention_decomposed_before_our_passes_is_reported():
    """SDPA's math backend (chosen here by the user's sdpa_kernel; Dynamo keeps the choice)
    reaches our passes as matmul and softmax: the report says so instead of staying empty."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cp_inductor.backend import DECOMPOSED

    with fake_pg(2), sdpa_kernel(SDPBackend.MATH):
        cp_inductor.clear_report()
        torch.compile(_ulysses, backend="cp_inductor", fullgraph=True)(*_qkv())
        report = cp_inductor.report()
    assert not report.regions and [(r.graph_kind, r.reason) for r in report.rejected] == [("forward", DECOMPOSED)]


def _attention_step(x, w):
    q = (x @ w).view(1, 64, 4, 16).transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


def _compile_twice(tmp_path, monkeypatch, between=lambda: None) -> list:
    """The report and AOTAutograd's cache counters of a cold compile and of the same compile
    after a reset (served from the on-disk cache, as a restarted job is)."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    runs = []
    with inductor_config.patch(fx_graph_cache=True):
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            torch.compile(_attention_step, backend="cp_inductor")(x, w).backward()
            runs.append((str(cp_inductor.report()), dict(counters["aot_autograd"])))
            if len(runs) == 1:
                between()
    return runs


def test_a_warm_cache_serves_the_compile_and_its_report(tmp_path, monkeypatch):
    (cold, cold_counts), (warm, warm_counts) = _compile_twice(tmp_path, monkeypatch)
    assert cold_counts.get("autograd_cache_saved") == 1 and warm_counts.get("autograd_cache_hit") == 1, warm_counts
    assert warm == cold and "not a CP region (backward)" in warm  # the backward's entries too


def test_a_warm_cache_without_the_stored_report_says_so(tmp_path, monkeypatch):
    import shutil

    runs = _compile_twice(tmp_path, monkeypatch, lambda: shutil.rmtree(tmp_path / "cp_inductor_reports"))
    (cold, _), (warm, warm_counts) = runs
    assert warm_counts.get("autograd_cache_hit") == 1
    assert "not a CP region (forward)" in cold and "not a CP region (forward): _scaled" not in warm
    assert "served from AOTAutograd's cache, with no report stored for it" in warm, warm


def test_a_warning_in_the_program_does_not_break_the_graph(monkeypatch):
    """HF's flex BlockMask warns on every trace (backend.trace_over_warnings): the program stays one
    graph, the warning is not issued from compiled code, and CP_INDUCTOR_TRACE_OVER_WARNINGS=0
    leaves torch's behaviour (a break at the warning). A compile-metrics logger that cannot write
    the setting out (torch 2.11) reads the settings without it."""
    import warnings

    from torch._dynamo.utils import counters

    from cp_inductor.backend import TRACE_OVER_WARNINGS_ENV, trace_over_warnings

    def program(x):
        y = x.sin()
        warnings.warn("built every step", DeprecationWarning)
        return y.cos()

    def graphs_and_warnings():
        torch._dynamo.reset()
        counters.clear()
        x = torch.randn(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.testing.assert_close(torch.compile(program, backend="cp_inductor")(x), x.sin().cos())
        return counters["stats"]["unique_graphs"], len(caught)

    monkeypatch.setenv(TRACE_OVER_WARNINGS_ENV, "1")
    assert trace_over_warnings() and warnings.warn in torch._dynamo.config.ignore_logging_functions
    assert graphs_and_warnings() == (1, 0)
    monkeypatch.setattr(torch._dynamo.config, "ignore_logging_functions", set())
    monkeypatch.setenv(TRACE_OVER_WARNINGS_ENV, "0")
    assert not trace_over_warnings() and not torch._dynamo.config.ignore_logging_functions
    assert graphs_and_warnings() == (2, 1)
    # torch 2.11's compile-metrics logger writes every setting as JSON: it is handed the settings
    # without our entry, and writes them; one that fails on something else leaves it off
    monkeypatch.delenv(TRACE_OVER_WARNINGS_ENV)

    def as_json(also_unwritable=False):
        settings = {"ignore_logging_functions": sorted(torch._dynamo.config.ignore_logging_functions, key=id),
                    "another": [len] if also_unwritable else []}
        return json.dumps(settings)

    monkeypatch.setattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", as_json)
    assert trace_over_warnings() and warnings.warn in torch._dynamo.config.ignore_logging_functions
    assert json.loads(torch._dynamo.utils._get_dynamo_config_for_logging())["ignore_logging_functions"] == []
    assert warnings.warn in torch._dynamo.config.ignore_logging_functions
    assert graphs_and_warnings() == (1, 0)
    monkeypatch.setattr(torch._dynamo.config, "ignore_logging_functions", set())
    monkeypatch.setattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", functools.partial(as_json, True))
    assert not trace_over_warnings() and not torch._dynamo.config.ignore_logging_functions
    monkeypatch.setenv(TRACE_OVER_WARNINGS_ENV, "1")
    assert trace_over_warnings() and warnings.warn in torch._dynamo.config.ignore_logging_functions
