"""CP4 and CP8 on NCCL: the 2-GPU checks of test_gpu_nccl.py at the sizes of the 4- and 8-GPU
H200 machines (skipped where fewer GPUs exist; heads scaled so every cp divides them)."""

import pytest
import torch

from cp_inductor.testing.checks import AttentionCase, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import assert_cp_results, region_rewrites
from test_gpu_nccl import TOL


def on(cp):
    return pytest.param(cp, marks=pytest.mark.skipif(torch.cuda.device_count() < cp, reason=f"needs {cp} GPUs"), id=f"cp{cp}")


def cases():
    bf16 = torch.bfloat16
    return [
        AttentionCase(batch=2, seq=1024, heads_q=16, heads_kv=16, head_dim=64, layout="bshd", dtype=bf16),
        AttentionCase(batch=1, seq=2048, heads_q=32, heads_kv=16, head_dim=128, layout="bshd", dtype=bf16),
        AttentionCase(batch=2, seq=1024, heads_q=16, heads_kv=16, head_dim=128, layout="bhsd", causal=False, dtype=bf16),
    ]


@pytest.mark.parametrize("cp", [on(4), on(8)])
@pytest.mark.parametrize("head_overlap", [False, True])
def test_ulysses_nccl_bf16(cp, head_overlap):
    options = {"cp_inductor.head_overlap": head_overlap, "cp_inductor.head_overlap_forward": head_overlap,
               "cp_inductor.fused_a2a_unpack": "views"}
    results = run_on_ranks(check_cp_attention, cp, cases(), None, "cp_inductor", "cuda", options, pg_backend="nccl")
    applied = ("fused_a2a", "head_overlap") if head_overlap else ("fused_a2a",)
    for rank_results in results:
        assert_cp_results(rank_results, TOL, applied, cp=cp)


@pytest.mark.parametrize("cp", [on(4)])
def test_cuda_graph_training_step(cp):
    from cp_inductor.testing.train_step import StepConfig, compare_with_eager

    cfg = StepConfig(batch=2, seq=2048, dim=512, heads=16, kv_heads=8, lr=0.01)
    options = {"cp_inductor.head_overlap": True, "cp_inductor.head_overlap_forward": True, "cp_inductor.fused_a2a_unpack": "views"}
    results = run_on_ranks(
        compare_with_eager, cp, cfg, 6, "cuda", "cp_inductor", "reduce-overhead", options, torch.bfloat16,
        pg_backend="nccl",
    )
    for r in results:
        assert r["cudagraph_skips"] == 0 and r["cudagraphs_recorded"] > 0, r
        assert region_rewrites(r) == {"fused_a2a": 2, "head_overlap": 2}, r
        for e, c in zip(r["eager"], r["compiled"]):
            assert abs(e - c) <= TOL * abs(e), (r["eager"], r["compiled"])
        assert r["max_param_diff"] < TOL, r["max_param_diff"]
