"""Multi-process numerics on gloo: compiled with backend="cp_inductor" vs eager vs a
single-device fp64 reference, for the output and the q, k, v gradients."""

import functools
import os
import re
import subprocess
import sys

import pytest
import torch

import variants
from cp_inductor.testing.checks import AttentionCase, check_cp_attention, full_inputs, run_cp, ulysses_fn
from cp_inductor.testing.launch import run_on_ranks
from helpers import assert_cp_results

TOL = 1e-5  # fp32 CP attention vs the fp64 reference, relative L2


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_ulysses_helpers(cp):
    cases = [
        AttentionCase(layout="bshd", causal=True, heads_q=8, heads_kv=4),
        AttentionCase(layout="bhsd", causal=cp == 4, heads_q=8, heads_kv=8 if cp == 2 else 4),
    ]
    results = run_on_ranks(check_cp_attention, cp, cases)
    for rank_results in results:
        assert_cp_results(rank_results, TOL, cp=cp, check_layout=True)


def test_hand_written_variants_cp2():
    cases = [AttentionCase(layout="bshd", causal=True, heads_q=4, heads_kv=4)]
    fn = functools.partial(variants.transpose_then_reshape, is_causal=True)
    assert_cp_results(run_on_ranks(check_cp_attention, 2, cases, fn)[0], TOL, cp=2, check_layout=True)
    cases = [AttentionCase(layout="bhsd", causal=True, heads_q=4, heads_kv=4)]
    fn = functools.partial(variants.flattened_buffer, is_causal=True)
    assert_cp_results(run_on_ranks(check_cp_attention, 2, cases, fn)[0], TOL, cp=2, check_layout=True)


def _self_attention(rank, cp):
    from torch._dynamo.utils import counters

    from cp_inductor.parallel import shard_sequence, ulysses_attention

    g = torch.Generator().manual_seed(0)
    x_full, dy_full = torch.randn(2, 32, 4, 16, generator=g), torch.randn(2, 32, 4, 16, generator=g)
    fn = lambda x: ulysses_attention(x, x, x, is_causal=True)  # noqa: E731
    results = []
    for f in (fn, torch.compile(fn, backend="cp_inductor", fullgraph=True)):
        x = shard_sequence(x_full, 1, rank, cp).requires_grad_()
        y = f(x)
        y.backward(shard_sequence(dy_full, 1, rank, cp))
        results.append((y.detach(), x.grad))
    (ye, ge), (yc, gc) = results
    return float((ye - yc).abs().max()), float((ge - gc).abs().max()), dict(counters["cp_inductor"])


@pytest.mark.wide  # the recall generator's gloo sample runs q = k = v in CI
def test_self_attention_on_one_tensor_cp2():
    # Forward: q, k, v share one all-to-all (skipped); backward: dq, dk, dv fused, then summed.
    for out_diff, grad_diff, rewritten in run_on_ranks(_self_attention, 2):
        assert out_diff < 1e-6 and grad_diff < 1e-6, (out_diff, grad_diff)
        assert rewritten == {"fused_a2a": 1}


def _cold_then_warm(rank, cp, case):
    import cp_inductor
    from torch._dynamo.utils import counters

    full = full_inputs(case)
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(ulysses_fn(case), backend="cp_inductor", fullgraph=True)
        got = run_cp(compiled, case, full, rank, cp)
        runs.append((got, counters["aot_autograd"]["autograd_cache_hit"], str(cp_inductor.report())))
    return runs


def test_warm_cache_hit_matches_cold(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    case = AttentionCase(layout="bshd", causal=True, heads_q=8, heads_kv=4)
    for (cold, cold_hits, cold_report), (warm, warm_hits, warm_report) in run_on_ranks(_cold_then_warm, 2, case):
        assert cold_hits == 0 and warm_hits == 1  # forward and backward served from AOTAutograd's cache
        for name in cold:
            assert torch.equal(cold[name], warm[name]), name
        assert warm_report == cold_report and "a2a" in warm_report  # the cold compile's report, replayed


def test_demo_main_job():
    proc = subprocess.run(
        [sys.executable, "-m", "cp_inductor.demo", "--cp", "2"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    assert re.search(r"^forward\s+a2a\s+2\s+bshd", proc.stdout, re.M), proc.stdout
    assert re.search(r"^backward\s+a2a\s+2\s+bshd", proc.stdout, re.M), proc.stdout


@pytest.mark.wide
def test_cp8_fused_and_head_overlap():
    """cp = 8 on 8 gloo processes (the GPU machines with 8 GPUs are not always lent): GQA with one
    KV head per rank (fused_a2a only; head_overlap says why not) and MHA in two head groups."""
    cases = [
        AttentionCase(layout="bshd", causal=True, heads_q=16, heads_kv=8),
        AttentionCase(layout="bhsd", causal=False, heads_q=16, heads_kv=16),
    ]
    options = {"cp_inductor.head_overlap": True, "cp_inductor.head_overlap_forward": True, "cp_inductor.fused_a2a_unpack": "views"}
    gqa, mha = run_on_ranks(check_cp_attention, 8, cases, None, "cp_inductor", "cpu", options)[0]
    assert_cp_results([gqa], TOL)
    assert_cp_results([mha], TOL, ("fused_a2a", "head_overlap"))


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_gqa_by_expand(cp):
    """K/V heads replicated by expand after the all-to-all: the forward is fused with unpack
    copies, the backward packs dk/dv from the sums over the replicas."""
    case = AttentionCase(layout="bshd", causal=True, heads_q=8, heads_kv=4)
    assert_cp_results(run_on_ranks(check_cp_attention, cp, [case], variants.expanded_kv_heads)[0], TOL)


def _inplace_styles(rank, cp):
    """check_cp_attention on the in-place-collective styles (autograd.Functions around
    dist.all_to_all_single / all_gather_into_tensor / all_gather into a list /
    reduce_scatter_tensor)."""
    ulysses = [AttentionCase(layout="bshd", causal=True, heads_q=4, heads_kv=4, seq=32),
               AttentionCase(layout="bhsd", causal=False, heads_q=4, heads_kv=4, seq=32)]
    gather = [AttentionCase(layout="bshd", causal=False, heads_q=4, heads_kv=2, seq=32)]
    return {
        "inplace_bshd": check_cp_attention(rank, cp, ulysses[:1], variants.inplace_bshd),
        "inplace_seq_first": check_cp_attention(
            rank, cp, ulysses[1:], functools.partial(variants.inplace_seq_first, is_causal=False)),
        "inplace_allgather": check_cp_attention(rank, cp, gather, variants.inplace_allgather),
        "list_allgather": check_cp_attention(rank, cp, gather, variants.list_allgather),
    }


@pytest.mark.wide  # the recall generator's gloo sample runs in-place collectives in CI
def test_inplace_collective_styles_cp2():
    for rank_results in run_on_ranks(_inplace_styles, 2):
        assert_cp_results(rank_results["inplace_bshd"], TOL, cp=2, check_layout=True)
        assert_cp_results(rank_results["inplace_seq_first"], TOL, cp=2, check_layout=True)
        # No all-gather rewrite is on by default: found, reported, the same answer.
        for name in ("inplace_allgather", "list_allgather"):
            assert_cp_results(rank_results[name], TOL, applied=())
            assert [row[:2] for row in rank_results[name][0]["report"]] == [("forward", "allgather"), ("backward", "allgather")]


def _checkpointed(rank, cp):
    """check_cp_attention on Ulysses and all-gather attention under activation checkpointing."""
    from cp_inductor.parallel import allgather_attention, ulysses_attention

    ulysses = AttentionCase(layout="bshd", causal=True, heads_q=4, heads_kv=4, seq=32)
    gather = AttentionCase(layout="bshd", causal=True, heads_q=4, heads_kv=2, seq=32, load_balanced=True)
    return (
        check_cp_attention(rank, cp, [ulysses], variants.checkpointed(
            lambda q, k, v: ulysses_attention(q, k, v, is_causal=True))),
        check_cp_attention(rank, cp, [gather], variants.checkpointed(
            lambda q, k, v: allgather_attention(q, k, v, is_causal=True))),
    )


def test_activation_checkpointing_cp2():
    """AOTAutograd wraps the recomputed attention in RNG-state operators; canonicalize unwraps
    them (no dropout), so the forward regions are found and rewritten as without checkpointing."""
    for ulysses, gather in run_on_ranks(_checkpointed, 2):
        assert_cp_results(ulysses, TOL, cp=2)
        assert_cp_results(gather, TOL, applied=())
        kinds = [row[:2] for row in gather[0]["report"]]
        assert ("forward", "allgather") in kinds and ("backward", "allgather") in kinds, kinds


def _bf16_attention(q, k, v):
    """fp32 model, attention in bf16: q, k, v cast down before the Ulysses helper, its output
    cast back up (the pack makes the first cast; the second stays after the return)."""
    from cp_inductor.parallel import ulysses_attention

    return ulysses_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True).float()


def _casts(rank, cp):
    from test_fused_a2a import compressed_wire

    case = AttentionCase(layout="bshd", causal=True, heads_q=4, heads_kv=4, seq=32)
    not_causal = AttentionCase(layout="bshd", causal=False, heads_q=4, heads_kv=4, seq=32)
    bf16_wire = functools.partial(compressed_wire, wire=(torch.bfloat16,) * 3)  # not causal
    return check_cp_attention(rank, cp, [case], _bf16_attention), check_cp_attention(rank, cp, [not_causal], bf16_wire)


@pytest.mark.wide  # the recall generator's gloo sample runs casts around the send in CI
def test_casts_around_the_collective_cp2():
    for cast_around, wire in run_on_ranks(_casts, 2):
        # bf16 inside: the reference tolerance is bf16's; compiled vs eager much closer.
        assert_cp_results(cast_around, 3e-2, cp=2)
        assert max(cast_around[0]["compiled_vs_eager"].values()) < 1e-2, cast_around
        for r in wire:
            assert r["applied"] == ["fused_a2a"] and r["rewritten"].get("fused_a2a") == 1, r  # the backward
            assert max(r["compiled_vs_ref"].values()) < 3e-2 and max(r["compiled_vs_eager"].values()) < 1e-2, r
