"""The gloo numerics again on GPUs over NCCL, in bf16 (runs on the lent H200 machine; skipped
where fewer than 2 GPUs exist)."""

import functools

import pytest
import torch

import variants
from cp_inductor.testing.checks import AttentionCase, allgather_fn, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import assert_cp_results, region_rewrites

needs_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
TOL = 2e-2  # bf16 CP attention vs the fp64 reference, relative L2
ALLGATHER_APPLIED = ()  # rewrites the default config applies to all-gather regions


@needs_gpus
@pytest.mark.parametrize("unpack", ["views", "copy"])
def test_ulysses_nccl_bf16(unpack):
    bf16 = torch.bfloat16
    cases = [
        AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=8, head_dim=64, layout="bshd", dtype=bf16),
        AttentionCase(batch=1, seq=1024, heads_q=16, heads_kv=4, head_dim=128, layout="bshd", dtype=bf16),
        AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=4, head_dim=128, layout="bhsd", causal=False, dtype=bf16),
    ]
    options = {"cp_inductor.fused_a2a_unpack": unpack}
    for rank_results in run_on_ranks(check_cp_attention, 2, cases, None, "cp_inductor", "cuda", options, pg_backend="nccl"):
        assert_cp_results(rank_results, TOL, cp=2)


@needs_gpus
def test_auto_fuses_small_regions_nccl_bf16():
    """At these tiny shapes the cost model picks views for the collectives they save
    (tests/test_robustness.py shows its choice): both regions fused, numerics hold."""
    bf16 = torch.bfloat16
    cases = [
        AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=8, head_dim=64, layout="bshd", dtype=bf16),
        AttentionCase(batch=1, seq=1024, heads_q=16, heads_kv=4, head_dim=128, layout="bshd", dtype=bf16),
    ]
    for rank_results in run_on_ranks(check_cp_attention, 2, cases, None, "cp_inductor", "cuda", pg_backend="nccl"):
        assert_cp_results(rank_results, TOL, cp=2)


@needs_gpus
@pytest.mark.parametrize("groups", [0, 2])
def test_head_overlap_nccl_bf16(groups):
    bf16 = torch.bfloat16
    cases = [
        AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=8, head_dim=64, layout="bshd", dtype=bf16),
        AttentionCase(batch=1, seq=1024, heads_q=16, heads_kv=4, head_dim=128, layout="bshd", dtype=bf16),
        AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=4, head_dim=128, layout="bhsd", causal=False, dtype=bf16),
    ]
    options = {
        "cp_inductor.head_overlap": True, "cp_inductor.head_overlap_groups": groups, "cp_inductor.head_overlap_forward": True,
        "cp_inductor.fused_a2a_unpack": "views",
    }
    results = run_on_ranks(check_cp_attention, 2, cases, None, "cp_inductor", "cuda", options, pg_backend="nccl")
    for rank_results in results:
        assert_cp_results(rank_results, TOL, ("fused_a2a", "head_overlap"), cp=2)


@needs_gpus
def test_head_overlap_copy_engine_nccl_bf16():
    """head_overlap over the copy-engine transport, forward and backward, against the fp64
    reference; the report says the copy engines carried every partitioned region."""
    bf16 = torch.bfloat16
    cases = [
        AttentionCase(batch=1, seq=1024, heads_q=16, heads_kv=4, head_dim=128, layout="bshd", dtype=bf16),
        AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=8, head_dim=64, layout="bhsd", causal=False, dtype=bf16),
    ]
    options = {
        "cp_inductor.head_overlap": True, "cp_inductor.head_overlap_groups": 2, "cp_inductor.head_overlap_forward": True,
        "cp_inductor.fused_a2a_unpack": "views", "cp_inductor.head_overlap_transport": "copy_engine",
    }
    results = run_on_ranks(check_cp_attention, 2, cases, None, "cp_inductor", "cuda", options, pg_backend="nccl")
    for rank_results in results:
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, (key, r)
            assert r["applied"] == ["fused_a2a", "head_overlap"] and r["rewritten"]["head_overlap"] == 2, r
            assert all("transport=copy_engine" in d for d in r["details"]), r["details"]


@needs_gpus
def test_do_laid_out_like_o_when_only_the_backward_reads_views():
    """q passes a pointwise op after its all-to-all, so the forward keeps q's old layout (and O's)
    while the backward reads dO as a view: the backward gets a dO it reads right (laid out like O
    on the cuDNN frontend, the program's own on aten's op)."""
    case = AttentionCase(batch=2, seq=1024, heads_q=8, heads_kv=8, head_dim=128, dtype=torch.bfloat16)
    options = {"cp_inductor.fused_a2a_unpack": "views"}
    results = run_on_ranks(check_cp_attention, 2, [case], variants.scaled_query, "cp_inductor", "cuda", options, pg_backend="nccl")
    for rank_results in results:
        assert_cp_results(rank_results, TOL, cp=2)


def _checkpointed_bf16(rank, cp):
    from cp_inductor.parallel import ulysses_attention

    case = AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=8, head_dim=64, layout="bshd", dtype=torch.bfloat16)
    # CUDA generators: AOTAutograd wraps the recomputed attention in graphsafe_run_with_rng_state.
    fn = variants.checkpointed(lambda q, k, v: ulysses_attention(q, k, v, is_causal=True))
    return check_cp_attention(rank, cp, [case], fn, "cp_inductor", "cuda")


@needs_gpus
def test_checkpointed_nccl_bf16():
    """The in-place collective styles (tests/variants.py) are not run here: torch 2.11 traces an
    autograd.Function whose forward fills ``empty_like`` through ``dist.all_to_all_single`` with
    no gradient path (zero dQ/dK/dV under every backend, plain Inductor included, run log inplace_collectives_torch211_run53.log (git history)); torch
    2.13 traces them right, which the gloo numerics check."""
    for results in run_on_ranks(_checkpointed_bf16, 2, pg_backend="nccl"):
        assert_cp_results(results, TOL, cp=2)


@needs_gpus
def test_hand_written_nccl_bf16():
    case = AttentionCase(batch=2, seq=512, heads_q=8, heads_kv=8, head_dim=64, dtype=torch.bfloat16)
    fn = functools.partial(variants.transpose_then_reshape, is_causal=True)
    options = {"cp_inductor.fused_a2a_unpack": "views"}  # rewritten whatever the cost model says
    for rank_results in run_on_ranks(check_cp_attention, 2, [case], fn, "cp_inductor", "cuda", options, pg_backend="nccl"):
        assert_cp_results(rank_results, TOL, cp=2)


@needs_gpus
@pytest.mark.parametrize(
    "dtype, kv_heads, head_overlap, transport",
    [
        # fp32 needs MHA here: CUDA's fp32 fused attention (memory-efficient) has no GQA, and
        # SDPA's math fallback leaves no attention op for the passes to find.
        (torch.float32, 8, False, "nccl"),
        (torch.bfloat16, 4, True, "nccl"),  # cuDNN / flash with GQA
        (torch.bfloat16, 4, True, "copy_engine"),  # the copy-engine ops captured and replayed
    ],
)
def test_cuda_graph_training_step(dtype, kv_heads, head_overlap, transport):
    """reduce-overhead: every partition captured (no cudagraph skips), replays match eager,
    and the process group tears down (run_on_ranks resets dynamo, hence cudagraph trees, first)."""
    from cp_inductor.testing.train_step import StepConfig, compare_with_eager

    cfg = StepConfig(batch=2, seq=1024, dim=256, heads=8, kv_heads=kv_heads, lr=0.01)
    options = {"cp_inductor.head_overlap": head_overlap, "cp_inductor.head_overlap_forward": head_overlap,
               "cp_inductor.fused_a2a_unpack": "views",  # rewritten whatever the cost model says
               "cp_inductor.head_overlap_transport": transport}
    results = run_on_ranks(
        compare_with_eager, 2, cfg, 6, "cuda", "cp_inductor", "reduce-overhead", options, dtype, pg_backend="nccl"
    )
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    for r in results:
        assert r["cudagraph_skips"] == 0 and r["cudagraphs_recorded"] > 0, r
        # Both attention regions of the one step graph (forward and backward ops) were rewritten.
        grouped = {"fused_a2a": 2, "head_overlap": 2}
        assert region_rewrites(r) == (grouped if head_overlap else {"fused_a2a": 2}), r
        for e, c in zip(r["eager"], r["compiled"]):
            assert abs(e - c) <= tol * abs(e), (r["eager"], r["compiled"])
        assert r["max_param_diff"] < tol, r["max_param_diff"]


def _allgather_bf16(rank, cp, kernel, head_groups=None):
    bf16 = torch.bfloat16
    cases = [
        AttentionCase(batch=1, seq=2048, heads_q=16, heads_kv=4, head_dim=128, dtype=bf16, load_balanced=True),
        AttentionCase(batch=2, seq=1024, heads_q=8, heads_kv=8, head_dim=64, layout="bhsd", dtype=bf16),
        AttentionCase(batch=1, seq=1024, heads_q=8, heads_kv=2, head_dim=128, causal=False, dtype=bf16),
    ]
    fn = lambda c: allgather_fn(c, kernel, head_groups)  # noqa: E731
    return [r for c in cases for r in check_cp_attention(rank, cp, [c], fn(c), device="cuda")]


@needs_gpus
@pytest.mark.parametrize("kernel,head_groups", [("flash", None), ("cudnn", None), ("flash", 2), ("cudnn", 2)])
def test_allgather_nccl_bf16(kernel, head_groups):
    """K/V all-gather on NCCL in bf16, with each log-sum-exp kernel the causal chunks can use,
    whole or in head groups (K/V gathered again in the backward)."""
    for rank_results in run_on_ranks(_allgather_bf16, 2, kernel, head_groups, pg_backend="nccl"):
        assert_cp_results(rank_results, TOL, applied=ALLGATHER_APPLIED)
        for r in rank_results:
            assert {row[:3] for row in r["report"]} == {("forward", "allgather", 2), ("backward", "allgather", 2)}, r


# head_split on all-gather (and ring) regions: every attention call split in 2 or 4
# head groups, forward and backward.
HEAD_SPLIT = {"cp_inductor.head_split": True, "cp_inductor.head_split_forward": True}


def _allgather_split_bf16(rank, cp, kernel, groups):
    options = {**HEAD_SPLIT, "cp_inductor.head_split_groups": groups}
    bf16 = torch.bfloat16
    cases = [
        AttentionCase(batch=1, seq=2048, heads_q=16, heads_kv=4, head_dim=128, dtype=bf16, load_balanced=True),
        AttentionCase(batch=2, seq=1024, heads_q=8, heads_kv=8, head_dim=64, layout="bhsd", dtype=bf16),
        AttentionCase(batch=1, seq=1024, heads_q=8, heads_kv=4, head_dim=128, causal=False, dtype=bf16),
    ]
    return [r for c in cases for r in check_cp_attention(rank, cp, [c], allgather_fn(c, kernel), device="cuda", options=options)]


@needs_gpus
@pytest.mark.parametrize("kernel,groups", [("flash", 2), ("cudnn", 4)])
def test_allgather_head_split_nccl_bf16(kernel, groups):
    for rank_results in run_on_ranks(_allgather_split_bf16, 2, kernel, groups, pg_backend="nccl"):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, (r["case"], key, r[key])
            assert r["applied"] == ["head_split"], r
            # every region split (cuDNN's backward calls also get dO laid out like O)
            assert r["rewritten"]["head_split"] == len(r["report"]), r


@needs_gpus
@pytest.mark.parametrize("head_groups,split", [(None, False), (2, False), (None, True)])
def test_allgather_cuda_graph_training_step(head_groups, split):
    from cp_inductor.testing.train_step import StepConfig, compare_with_eager

    cfg = StepConfig(style="allgather", batch=2, seq=1024, dim=256, heads=8, kv_heads=4, lr=0.01, head_groups=head_groups)
    options = {**HEAD_SPLIT, "cp_inductor.head_split_groups": 4} if split else None
    results = run_on_ranks(
        compare_with_eager, 2, cfg, 6, "cuda", "cp_inductor", "reduce-overhead", options, torch.bfloat16, pg_backend="nccl"
    )
    for r in results:
        assert r["cudagraph_skips"] == 0 and r["cudagraphs_recorded"] > 0, r
        if split:
            assert r["rewritten"].get("head_split", 0) > 0, r
        for e, c in zip(r["eager"], r["compiled"]):
            assert abs(e - c) <= 2e-2 * abs(e), (r["eager"], r["compiled"])
        assert r["max_param_diff"] < 2e-2, r["max_param_diff"]


# ce_rotation at any size (the test shapes are far below ce_rotation_min_bytes).
CE_ROTATION = {"cp_inductor.ce_rotation": True, "cp_inductor.ce_rotation_min_bytes": 0}


def _ring_bf16(rank, cp, kernel, options):
    from cp_inductor.parallel import ring_attention

    bf16 = torch.bfloat16
    cases = [
        AttentionCase(batch=1, seq=2048, heads_q=16, heads_kv=4, head_dim=128, dtype=bf16, load_balanced=True),
        AttentionCase(batch=2, seq=1024, heads_q=8, heads_kv=8, head_dim=64, causal=False, dtype=bf16),
    ]
    return [
        r for c in cases for r in check_cp_attention(
            rank, cp, [c], lambda q, k, v, c=c: ring_attention(q, k, v, is_causal=c.causal, kernel=kernel),
            device="cuda", options=options,
        )
    ]


@needs_gpus
@pytest.mark.parametrize("kernel,ce", [("flash", False), ("cudnn", False), ("cudnn", True)])
def test_ring_nccl_bf16(kernel, ce):
    """The ring helper on NCCL in bf16 with each log-sum-exp kernel, its rotations on NCCL (the
    default at these sizes) or on the copy engines."""
    for rank_results in run_on_ranks(_ring_bf16, 2, kernel, CE_ROTATION if ce else None, pg_backend="nccl"):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, (key, r)
            assert {row[:3] for row in r["report"]} == {("forward", "ring", 2), ("backward", "ring", 2)}, r
            # ce: a forward and a backward region rewritten (the backward's rotations go with one);
            # the last dK/dV rotation travels in bf16 either way (narrow_rotation).
            assert sorted(r["applied"]) == (["ce_rotation", "narrow_rotation"] if ce else ["narrow_rotation"]), r
            assert r["rewritten"].get("narrow_rotation", 0) >= 1, r
            assert (r["rewritten"].get("ce_rotation", 0) >= 2) if ce else ("ce_rotation" not in r["rewritten"]), r


@needs_gpus
@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_ring_head_split_nccl_bf16(kernel):
    """Every ring region's calls split in head groups, forward and backward, with the rotations
    on the copy engines and the last one narrowed: the rewrites after head_split still apply."""
    options = {**HEAD_SPLIT, **CE_ROTATION, "cp_inductor.head_split_groups": 2}
    for rank_results in run_on_ranks(_ring_bf16, 2, kernel, options, pg_backend="nccl"):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, (key, r)
            assert sorted(r["applied"]) == ["ce_rotation", "head_split", "narrow_rotation"], r
            assert r["rewritten"]["head_split"] == len(r["report"]) and r["rewritten"]["ce_rotation"] >= 2, r


@needs_gpus
def test_ring_cuda_graph_training_step_copy_engines():
    """reduce-overhead over the ring step with its rotations on the copy engines: captured with
    no skips, replays match eager."""
    from cp_inductor.testing.train_step import StepConfig, compare_with_eager

    cfg = StepConfig(style="ring", batch=2, seq=1024, dim=256, heads=8, kv_heads=4, lr=0.01)
    results = run_on_ranks(
        compare_with_eager, 2, cfg, 6, "cuda", "cp_inductor", "reduce-overhead", CE_ROTATION, torch.bfloat16,
        pg_backend="nccl",
    )
    for r in results:
        assert r["cudagraph_skips"] == 0 and r["cudagraphs_recorded"] > 0, r
        assert r["rewritten"].get("ce_rotation", 0) >= 2, r
        for e, c in zip(r["eager"], r["compiled"]):
            assert abs(e - c) <= 2e-2 * abs(e), (r["eager"], r["compiled"])
        assert r["max_param_diff"] < 2e-2, r["max_param_diff"]


def _native_context_parallel(rank, cp, rotate, options=None):
    """PyTorch's native context_parallel on NCCL: eager, then its SDPA call compiled with
    cp_inductor and ``options`` (the same sharded buffers). Relative errors compiled vs eager,
    the report's regions and the rewrites applied."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    import cp_inductor

    set_rotate_method(rotate)
    torch.manual_seed(0)
    mesh = init_device_mesh("cuda", (cp,))
    full = [torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]  # BHSD
    got = {}
    for backend in (None, "cp_inductor"):
        bufs = [t.clone() for t in full]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
            q, k, v = (t.detach().clone().requires_grad_() for t in bufs[:3])
            attn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            if backend is not None:
                torch._dynamo.reset()
                cp_inductor.clear_report()
                attn = torch.compile(attn, backend=backend, fullgraph=True, options=options)
            out = attn(q, k, v)
            out.backward(bufs[3])
            got[backend] = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(got["cp_inductor"], got[None])]
    rows = sorted({(r.graph_kind, r.style) for r in cp_inductor.report().regions})
    applied = sorted({a for r in cp_inductor.report().regions for a in r.applied})
    return {"errs": errs, "rows": rows, "applied": applied}


@needs_gpus
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_native_context_parallel_under_cp_inductor(rotate):
    """Native CP (causal, load balanced, both rotations) compiled with cp_inductor keeps native
    eager's answer, and its regions are found: the all-to-all rotation's forward steps and every
    backward as ring regions, the all-gather rotation's forward as all-gather regions."""
    forward = "ring" if rotate == "alltoall" else "allgather"
    for r in run_on_ranks(_native_context_parallel, 2, rotate, pg_backend="nccl"):
        assert max(r["errs"]) < 1e-2, r
        assert r["rows"] == sorted({("forward", forward), ("backward", "ring")}), r


@needs_gpus
def test_native_context_parallel_with_ce_rotation():
    """Native CP with the all-to-all rotation compiled with ce_rotation: its rotations on the
    copy engines keep native eager's answer."""
    for r in run_on_ranks(_native_context_parallel, 2, "alltoall", CE_ROTATION, pg_backend="nccl"):
        assert max(r["errs"]) < 1e-2, r
        assert sorted(r["applied"]) == ["ce_rotation", "narrow_rotation"], r


@needs_gpus
@pytest.mark.parametrize("ce", [False, True])
def test_native_context_parallel_ring_grad_return(ce):
    """Native CP (all-to-all rotation, cp = 2) with ring_grad_return, its one transfer on NCCL or
    on the copy engines: native eager's answer."""
    options = {"cp_inductor.ring_grad_return": True, **(CE_ROTATION if ce else {"cp_inductor.ce_rotation": False})}
    for r in run_on_ranks(_native_context_parallel, 2, "alltoall", options, pg_backend="nccl"):
        assert max(r["errs"]) < 1e-2, r
        assert "ring_grad_return" in r["applied"] and "narrow_rotation" not in r["applied"], r


@needs_gpus
def test_ring_grad_return_nccl_bf16():
    """The ring helper (cuDNN, copy-engine rotations) with ring_grad_return vs fp64."""
    options = {**CE_ROTATION, "cp_inductor.ring_grad_return": True}
    for rank_results in run_on_ranks(_ring_bf16, 2, "cudnn", options, pg_backend="nccl"):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, (key, r)
            assert r["rewritten"].get("ring_grad_return", 0) >= 1, r


@needs_gpus
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_thd_ulysses_nccl_bf16(mode):
    """Ulysses over a pack (DeepSpeed ALST's form) at cp = 2 on NCCL, bf16, causal, GQA (Hq16
    Hkv4): compiled with cp_inductor against the fp64 per-sequence reference and no worse than
    eager (flash-2 varlen), for the output and every gradient, over three packs of 4096 tokens
    whose lengths change every step through one compiled program. Regions in both graphs, whose
    all-to-alls stay the program's (fused_a2a's measured skip for packs on GPUs). With a mode
    (torch.compile takes no options then) the cost model keeps these small packs on flash-2."""
    from cp_inductor.testing import varlen_programs as vp

    packs = [[1000, 3000, 96], [1, 2047, 2048], [512] * 8]
    results = run_on_ranks(vp.check_ulysses_thd, 2, packs[0], 16, 4, True, False, "cuda", torch.bfloat16, packs[1:],
                           mode, pg_backend="nccl")
    for per_pack, regions, lines in results:
        for ours, eager in per_pack:
            assert all(ours[n] < max(2 * eager[n], TOL) for n in ours), (ours, eager)
        assert regions == [("backward", "thd", ()), ("forward", "thd", ())], regions
        assert lines and all(": a2a, thd," in line for line in lines), lines
        assert all((": cudnn_ragged" in line or ": fa4_varlen" in line) == (mode is None) for line in lines), lines


@needs_gpus
@pytest.mark.parametrize("balance", ["document", "pack"])
def test_thd_allgather_nccl_bf16_new_lengths_under_cuda_graphs(balance):
    """Packed sequences through the K/V all-gather helper at cp = 2 on NCCL, bf16, causal, GQA
    (Hq4 Hkv2), static shards under ``mode="reduce-overhead"``: four packs of new lengths (1-token
    documents, one over every rank, fewer documents than max_docs) through one compiled graph;
    the output (padding rows zero) and every gradient against fp64, no worse than eager's; packed
    regions in both graphs. (Written for issue 43; the 2-GPU kind was not lent when it landed: its
    CPU twin is tests/test_thd_allgather.py::test_static_shards_new_lengths_every_step_one_graph.)"""
    from test_thd_allgather import HAND_LENGTHS, _static_steps

    packs = [HAND_LENGTHS, [40, 1, 1, 30, 24], [96], [3] * 32]
    for errors, graphs, layouts in run_on_ranks(_static_steps, 2, packs, 60, 32, "cuda", torch.bfloat16,
                                                "reduce-overhead", balance, pg_backend="nccl"):
        assert graphs == 1, graphs
        for step in errors:
            assert all(step[n] < max(2 * step["eager_" + n], TOL) for n in ("out", "dq", "dk", "dv")), errors
            assert step["padding"] == 0.0, errors
        assert ("forward", "thd") in layouts and ("backward", "thd") in layouts, layouts
