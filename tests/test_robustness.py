"""What real user code brings: `-1` in views, chained layers, third-party collectives, a rewrite
that goes wrong, and the cost model's choices."""

import re

import torch
import torch.fx
import torch.nn.functional as F
from expecttest import TestCase
from torch._subclasses.fake_tensor import FakeTensorMode

import cp_inductor
import variants
from cp_inductor.parallel import ulysses_attention
from cp_inductor.passes.analysis import cost_model
from cp_inductor.passes.post_grad import fused_a2a
from cp_inductor.reporting import clear_report, report
from cp_inductor.passes.canonicalize import canonicalize, rewrap_rng_attention
from helpers import (
    aot_graphs, describe_matches, describe_regions, fake_pg, fused_a2a_pass, pass_replaced, report_text, rewrite_summary,
)
from test_fused_a2a import qkv


def hf_style(q_proj, k_proj, v_proj, head_dim=16):
    """HF-style: q/k/v built with ``view(B, S, -1, D)`` from projections, fed to our helper."""
    b, s, _ = q_proj.shape
    q, k, v = (t.view(b, s, -1, head_dim) for t in (q_proj, k_proj, v_proj))
    return ulysses_attention(q, k, v, is_causal=True)


class TestInferredSizes(TestCase):
    def test_view_minus_one_feeds_the_helper(self):
        g = torch.Generator().manual_seed(0)
        x = [torch.randn(s, generator=g, requires_grad=True) for s in ((2, 8, 128), (2, 8, 64), (2, 8, 64))]
        with fake_pg(2):
            text = describe_regions(aot_graphs(hf_style, *x))
        self.assertExpectedInline(text, """\
forward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu Hq=8 Hkv=4 causal
  q        bshd: view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  k        bshd: view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  v        bshd: view -> view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  out      bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
backward: a2a cp=2 layout=bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=8 Hkv=4 causal
  grad_out bshd: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view
  dq       ?: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> view
  dk       ?: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> view
  dv       ?: view -> permute -> clone -> ALL_TO_ALL -> permute -> clone -> view -> view""")


class TestChainedLayers(TestCase):
    def test_second_layer_scatters_the_first_layers_output(self):
        # Both layers' regions are found in both graphs and fused; before, fused_a2a erased the
        # first layer's wait while the second region still read it (a cycle, compile crash).
        with fake_pg(2), cp_inductor.config.patch(strict=True):
            graphs = aot_graphs(variants.chained_layers, *qkv((1, 4, 4, 8), (1, 4, 4, 8)))
            found = report_text(graphs)
            text = rewrite_summary(graphs, fused_a2a_pass)
        assert found.count("applied=['fused_a2a']") == 4, found
        self.assertExpectedInline(text, """\
forward before: a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8] (all_to_all=8 clone=8)
forward after:  a2a[2, 4, 1, 6, 8], a2a[2, 4, 1, 2, 8], a2a[2, 4, 1, 6, 8], a2a[2, 4, 1, 2, 8] (all_to_all=4 clone=4)
backward before: a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8], a2a[2, 1, 4, 2, 8] (all_to_all=8 clone=9)
backward after:  a2a[2, 4, 1, 2, 8], a2a[2, 4, 1, 6, 8], a2a[2, 4, 1, 2, 8], a2a[2, 4, 1, 6, 8] (all_to_all=4 clone=13)""")


class TestUndoneRewrite(TestCase):
    def _broken(self, monkeypatch_target):
        """fused_a2a with its copy back into the delivered layout returning a wrong shape."""
        real = fused_a2a.as_delivered

        def wrong(emit, part, lay, c, cp):
            out = real(emit, part, lay, c, cp)
            return emit(torch.ops.aten.slice.Tensor, out, 0, 0, 1)

        monkeypatch_target.setattr(fused_a2a, "as_delivered", wrong)

    def test_a_failing_check_keeps_the_graph_and_says_why(self):
        import pytest

        with pytest.MonkeyPatch.context() as mp:
            self._broken(mp)
            with fake_pg(2), cp_inductor.config.patch(strict=False):
                graphs = aot_graphs(ulysses_attention, *qkv((1, 8, 4, 16), (1, 8, 4, 16)))
                before = graphs["backward"].code
                clear_report()
                fused_a2a_pass(graphs["backward"].graph)
                graphs["backward"].recompile()
                assert graphs["backward"].code == before
                undone = report().undone
        assert len(undone) == 1 and undone[0].rewrite == "fused_a2a", undone
        self.assertExpectedInline(
            undone[0].reason.split(":")[0] + ": " + undone[0].reason.split("became")[-1].strip(),
            """RewriteCheckError: (1, 1, 8, 2, 16) torch.float32""",
        )

    def test_one_failing_region_costs_that_region_only(self):
        """Every region is tried on one copy together; where that trial fails, each rewrite is
        tried alone: the sound region is still rewritten, the broken one undone."""
        from torch._dynamo.utils import counters

        real = fused_a2a.PASS.apply
        with fake_pg(2), cp_inductor.config.patch(strict=False):
            graphs = aot_graphs(variants.chained_layers, *qkv((1, 4, 4, 8), (1, 4, 4, 8)))
            forward = graphs["forward"].graph
            second = [n for n in forward.nodes if "attention" in str(n.target)][-1].name

            def broken_on_second(graph, region, cfg):
                replaced = real(graph, region, cfg)
                if region.attention.name != second:
                    return replaced
                old, new, strides = replaced[0]
                return [(old, graph.call_function(torch.ops.aten.slice.Tensor, (new, 0, 0, 1)), strides)] + replaced[1:]

            with pass_replaced(fused_a2a.PASS, apply=broken_on_second):
                clear_report()
                counters.clear()
                fused_a2a_pass(forward)
            forward.lint()
        assert [u.attention for u in report().undone] == [second], (report().undone, dict(counters["cp_inductor"]), second)
        assert counters["cp_inductor"]["fused_a2a"] == 1, dict(counters["cp_inductor"])

    def test_strict_mode_raises(self):
        import pytest

        from cp_inductor.passes.checked_rewrite import RewriteCheckError

        with pytest.MonkeyPatch.context() as mp:
            self._broken(mp)
            with fake_pg(2), cp_inductor.config.patch(strict=True):
                graphs = aot_graphs(ulysses_attention, *qkv((1, 8, 4, 16), (1, 8, 4, 16)))
                with pytest.raises(RewriteCheckError):
                    fused_a2a_pass(graphs["backward"].graph)


def _op(node) -> str:
    return _op_name(node.target)


def _op_name(target) -> str:
    return getattr(target, "__name__", str(target)).split(".")[0]


def _register_deepspeed_like_op():
    """An op under DeepSpeed's schema (``deepspeed::dim_zero_all_to_all``), without DeepSpeed."""
    if hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "dim_zero_all_to_all"):
        return torch.ops.deepspeed.dim_zero_all_to_all
    lib = torch.library.Library("deepspeed", "FRAGMENT")  # noqa: TOR901
    lib.define("dim_zero_all_to_all(Tensor input, str group_name) -> Tensor")
    lib.impl("dim_zero_all_to_all", lambda x, g: x.clone(), "CompositeExplicitAutograd")
    torch.library.register_fake("deepspeed::dim_zero_all_to_all", lambda x, g: torch.empty_like(x), lib=lib)
    torch.library.register_autograd(
        "deepspeed::dim_zero_all_to_all",
        lambda ctx, grad: (torch.ops.deepspeed.dim_zero_all_to_all(grad, ctx.group_name), None),
        setup_context=lambda ctx, inputs, output: setattr(ctx, "group_name", inputs[1]),
        lib=lib,
    )
    _register_deepspeed_like_op.lib = lib
    return torch.ops.deepspeed.dim_zero_all_to_all


def deepspeed_style(q, k, v):
    """DeepSpeed's HF Ulysses: [B, S/cp, H, D] -> heads to dim 0 -> its own all-to-all op."""
    import torch.distributed as dist

    op = torch.ops.deepspeed.dim_zero_all_to_all  # registered before tracing
    group = dist.group.WORLD.group_name
    cp = dist.get_world_size()

    def scatter(x):
        b, s_l, h, d = x.shape
        send = x.reshape(b, s_l, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        return op(send, group).permute(1, 3, 0, 2, 4).reshape(b, h // cp, cp * s_l, d)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=True)
    b, hl, s, d = o.shape
    send = o.reshape(b, hl, cp, s // cp, d).permute(2, 0, 3, 1, 4).contiguous()
    return op(send, group).permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * hl, d)


class TestKnownCollectives(TestCase):
    def test_deepspeed_dim_zero_all_to_all_is_found_and_reported(self):
        _register_deepspeed_like_op()
        with fake_pg(2):
            text = report_text(aot_graphs(deepspeed_style, *qkv((1, 8, 4, 16), (1, 8, 4, 16))))
        self.assertExpectedInline(text, """\
forward a2a cp=2 bshd applied=[] skipped={'fused_a2a': 'the all_to_all is the opaque custom op deepspeed::dim_zero_all_to_all', 'head_overlap': 'disabled by config'}
backward a2a cp=2 bshd applied=[] skipped={'fused_a2a': 'the all_to_all is the opaque custom op deepspeed::dim_zero_all_to_all', 'head_overlap': 'disabled by config'}""")


class TestCanonicalForms(TestCase):
    """``dist.all_to_all_single(out, x)`` / ``dist.all_gather_into_tensor(out, x)`` into fresh
    buffers (DeepSpeed, yunchang, hand-written all-gathers) trace as ``copy(empty, wait)``:
    canonicalize makes that a clone, which detection follows. Activation checkpointing wraps the
    attention in RNG-state operators: canonicalize unwraps them (no dropout)."""

    def test_checkpointed_attention_is_unwrapped(self):
        def attention_calls(gm) -> str:
            out = []
            for n in gm.graph.nodes:
                if n.op == "call_function" and (_op(n).startswith("run_") or "attention" in _op(n)):
                    inner = [_op_name(a) for a in n.args if isinstance(a, torch._ops.OpOverload)]
                    out.append(_op(n) + (f"({inner[0]})" if inner else ""))
            return ", ".join(out)

        fn = variants.checkpointed(lambda q, k, v: ulysses_attention(q, k, v, is_causal=True))
        with fake_pg(2):
            graphs = aot_graphs(fn, *qkv((1, 4, 2, 8), (1, 4, 2, 8)))
        lines = []
        for kind, gm in graphs.items():
            lines.append(f"{kind} before: {attention_calls(gm)}")
            self.assertEqual(canonicalize(gm.graph), 1)
            lines.append(f"{kind} after:  {attention_calls(gm)}")
        self.assertExpectedInline("\n".join(lines), """\
forward before: run_and_save_rng_state(_scaled_dot_product_flash_attention_for_cpu)
forward after:  _scaled_dot_product_flash_attention_for_cpu, run_and_save_rng_state(new_empty)
backward before: run_with_rng_state(_scaled_dot_product_flash_attention_for_cpu), _scaled_dot_product_flash_attention_for_cpu_backward
backward after:  _scaled_dot_product_flash_attention_for_cpu, _scaled_dot_product_flash_attention_for_cpu_backward""")
        with fake_pg(2):
            text = report_text(graphs)
        self.assertIn("forward a2a cp=2", text)
        self.assertIn("backward a2a cp=2", text)
        # The forward recomputed in the backward graph is not a region of its own, and says why:
        # torch 2.13 recomputes it from the exchanged q, k, v; 2.11 from saved local ones.
        why = re.search(r"rejected backward _scaled_dot_product_flash_attention_for_cpu: (.*)", text).group(1)
        assert why.startswith(("output read only by the attention backward (a forward recomputed for it: "
                               "activation checkpointing", "no all_to_all or all_gather feeds q, k or v")), why

    def test_cuda_generator_input_keeps_one_wrapper(self):
        """CUDA's graphsafe wrapper reads a generator input, which Inductor requires to be read by
        exactly one such wrapper: unwrapped for the passes, wrapped again after them."""
        import operator

        g = torch.fx.Graph()
        with FakeTensorMode() as mode:
            vals = [torch.empty(1, 2, 8, 4) for _ in range(3)]
        q, k, v = (g.placeholder(n) for n in "qkv")
        for node, val in zip((q, k, v), vals):
            node.meta["val"] = val
        gen = g.placeholder("fwd_rng_state_0")
        gen.meta["val"] = torch.Generator()
        attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        hop = g.call_function(torch.ops.higher_order.graphsafe_run_with_rng_state,
                              (attention, q, k, v, 0.0, True), {"rng_state": gen})
        out = g.call_function(operator.getitem, (hop, 0))
        with mode:
            out.meta["val"] = attention(*vals, 0.0, True)[0]
        g.output(out)
        readers = lambda: [_op(n) + (f"({_op_name(n.args[0])})" if _op(n).startswith("graphsafe") else "") for n in gen.users]  # noqa: E731
        self.assertEqual(readers(), ["graphsafe_run_with_rng_state(_scaled_dot_product_flash_attention_for_cpu)"])
        self.assertEqual(canonicalize(g), 1)
        self.assertEqual(readers(), [])
        self.assertEqual(rewrap_rng_attention(g), 1)
        self.assertEqual(readers(), ["graphsafe_run_with_rng_state(_scaled_dot_product_flash_attention_for_cpu)"])
        self.assertEqual(rewrap_rng_attention(g), 0)
        g.lint()

    def test_dropout_keeps_the_wrapper(self):
        fn = variants.checkpointed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5))
        with fake_pg(2):
            graphs = aot_graphs(fn, *qkv((1, 2, 4, 8), (1, 2, 4, 8)))
        wrappers = lambda: sorted(_op(n) for gm in graphs.values() for n in gm.graph.nodes if _op(n).startswith("run_"))  # noqa: E731
        self.assertEqual(wrappers(), ["run_and_save_rng_state", "run_with_rng_state"])
        self.assertEqual(sum(canonicalize(gm.graph) for gm in graphs.values()), 0)
        self.assertEqual(wrappers(), ["run_and_save_rng_state", "run_with_rng_state"])

    def test_fresh_copy_becomes_a_clone(self):
        with fake_pg(2):
            gm = aot_graphs(variants.inplace_bshd, *qkv((1, 4, 2, 8), (1, 4, 2, 8)))["forward"]
        ops = lambda: " ".join(sorted({_op(n) for n in gm.graph.nodes if n.op == "call_function"}))  # noqa: E731
        self.assertIn("copy", ops().split())
        self.assertEqual(canonicalize(gm.graph), 4)  # q, k, v and the output
        self.assertEqual(canonicalize(gm.graph), 0)
        self.assertExpectedInline(ops(), """_scaled_dot_product_flash_attention_for_cpu alias all_to_all_single clone getitem permute view wait_tensor""")

    def test_an_error_leaves_the_graph_and_the_compile_alone(self):
        from unittest import mock

        from cp_inductor.passes import canonicalize as canon

        with fake_pg(2):
            gm = aot_graphs(variants.inplace_bshd, *qkv((1, 4, 2, 8), (1, 4, 2, 8)))["forward"]
        before = str(gm.graph)

        def broken_call(graph, target, *args, **kwargs):  # fails after making its node
            graph.call_function(target, args, kwargs)
            raise RuntimeError("bug")

        with mock.patch.object(canon, "_call", broken_call):
            self.assertEqual(canonicalize(gm.graph), 0)
            self.assertEqual(str(gm.graph), before)  # nothing half-made left behind
            with self.assertRaises(RuntimeError):
                canonicalize(gm.graph, strict=True)

    def test_copy_that_casts_or_broadcasts_is_kept(self):
        g = torch.fx.Graph()
        with FakeTensorMode():
            vals = {"f32": torch.empty(2, 3), "bf16": torch.empty(2, 3, dtype=torch.bfloat16), "row": torch.empty(3)}
        nodes = {}
        for name, val in vals.items():
            nodes[name] = g.placeholder(name)
            nodes[name].meta["val"] = val
        for dst, src in (("bf16", "f32"), ("f32", "row")):
            c = g.call_function(torch.ops.aten.copy.default, (nodes[dst], nodes[src]))
            c.meta["val"] = vals[dst]
            g.output(c) if dst == "f32" else None
        self.assertEqual(canonicalize(g), 0)

    def test_third_party_styles_are_found_forward_and_backward(self):
        texts = []
        with fake_pg(2):
            for fn, shapes in ((variants.inplace_bshd, ((1, 4, 2, 8),) * 2),
                               (variants.inplace_seq_first, ((1, 2, 4, 8),) * 2),
                               (variants.inplace_allgather, ((1, 4, 4, 8), (1, 4, 2, 8)))):
                texts.append(f"{fn.__name__}:\n" + describe_matches(aot_graphs(fn, *qkv(*shapes))))
        self.assertExpectedInline("\n".join(texts), """\
inplace_bshd:
forward: a2a cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 causal
backward: a2a cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2 causal
inplace_seq_first:
forward: a2a cp=2 bhsd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 causal
backward: a2a cp=2 bhsd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2 causal
inplace_allgather:
forward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=2
backward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=2""")


class TestCostModel(TestCase):
    def test_choices_on_the_benchmark_shapes(self):
        # This rank's attention after the all-to-all (cp=2), bf16, causal: deterministic.
        shapes = {
            "B1 S32K H32 D128": (1, 32768, 16, 16, 128), "B1 S64K H32 D128": (1, 65536, 16, 16, 128),
            "B1 S128K H32 D128": (1, 131072, 16, 16, 128), "B2 S16K H32 D256": (2, 16384, 16, 16, 256),
            "B4 S8K H16 D128": (4, 8192, 8, 8, 128), "B8 S4K H32 D128": (8, 4096, 16, 16, 128),
            "B1 S32K Hq32 Hkv8 D128": (1, 32768, 16, 4, 128),
        }
        text = "\n".join(
            f"{name}: {cost_model.choose_unpack(b, s, hq, hkv, d, True, 2).choice}"
            for name, (b, s, hq, hkv, d) in shapes.items()
        )
        self.assertExpectedInline(text, """\
B1 S32K H32 D128: skip
B1 S64K H32 D128: skip
B1 S128K H32 D128: skip
B2 S16K H32 D256: skip
B4 S8K H16 D128: views
B8 S4K H32 D128: views
B1 S32K Hq32 Hkv8 D128: skip""")

    def test_small_regions_are_fused_for_the_collectives_saved(self):
        # The GPU tests' shapes (tests/test_gpu_nccl.py, cp=2) and the training step's B1 S8K:
        # copies and attention penalty are negligible, four collectives fewer are not.
        for b, s, hq, hkv, d in ((2, 512, 4, 4, 64), (1, 1024, 8, 2, 128), (1, 8192, 4, 2, 128)):
            choice = cost_model.choose_unpack(b, s, hq, hkv, d, True, 2)
            assert choice.choice == "views" and "4 collectives 0.16 ms" in choice.reason, choice

    def test_the_choice_is_reported(self):
        with fake_pg(2):
            graphs = aot_graphs(ulysses_attention, *qkv((1, 8, 4, 16), (1, 8, 4, 16)))
            from cp_inductor.passes import engine

            details = [r.detail for r in engine.analyze(graphs["forward"].graph, "forward")]
        self.assertExpectedInline(" | ".join(details), """Hq=4 Hkv=4 unpack=views (no cost map for cpu)""")
