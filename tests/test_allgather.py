"""K/V all-gather CP attention (``cp_inductor.parallel.allgather_attention``) on gloo: output and
every gradient against a single-device fp64 reference, eager and compiled with cp_inductor.

The compiled run finds the all-gather regions in both graphs (no all-gather rewrite exists yet),
keeps the answer and rewrites nothing."""

from __future__ import annotations

import pytest
import torch

from cp_inductor.testing.checks import AttentionCase, allgather_fn, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import assert_cp_results

TOL = 1e-5  # fp32 vs fp64, relative L2


def _check(rank, cp, cases):
    return [r for case in cases for r in check_cp_attention(rank, cp, [case], allgather_fn(case))]


CASES = {
    2: [
        # causal, load balanced (chunks r and 2cp-1-r), GQA, BSHD
        AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True),
        # causal, contiguous shards, BHSD
        AttentionCase(batch=2, seq=16, heads_q=2, heads_kv=2, head_dim=8, layout="bhsd", causal=True),
        # not causal, GQA (keys in gathered order, one call)
        AttentionCase(batch=1, seq=16, heads_q=4, heads_kv=1, head_dim=8, causal=False),
    ],
    4: [
        AttentionCase(batch=1, seq=32, heads_q=2, heads_kv=1, head_dim=8, layout="bhsd", causal=True, load_balanced=True),
    ],
}


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_allgather_attention_matches_single_device(cp):
    for rank_results in run_on_ranks(_check, cp, CASES[cp]):
        assert_cp_results(rank_results, TOL, applied=())
        for r in rank_results:
            assert {row[:3] for row in r["report"]} == {("forward", "allgather", cp), ("backward", "allgather", cp)}, r


def test_load_balanced_chunks_cover_the_sequence_once():
    from cp_inductor.parallel import load_balanced_chunks

    for cp in (1, 2, 3, 8):
        held = sorted(c for r in range(cp) for c in load_balanced_chunks(r, cp))
        assert held == list(range(2 * cp))


def test_consecutive_chunks_are_one_stretch():
    """Rank cp-1 of the load-balanced layout holds chunks cp-1 and cp: one stretch of the
    sequence (one prefix call and one square causal call); every other rank two."""
    from cp_inductor.parallel import load_balanced_chunks
    from cp_inductor.parallel.sharding import chunk_runs

    length = 4
    for cp in (2, 4):
        stretches = [chunk_runs(load_balanced_chunks(r, cp), length) for r in range(cp)]
        assert [len(s) for s in stretches] == [2] * (cp - 1) + [1]
        assert stretches[cp - 1] == [((cp - 1) * length, slice(0, 2 * length))]
        assert stretches[0] == [(0, slice(0, length)), ((2 * cp - 1) * length, slice(length, 2 * length))]
    assert chunk_runs((3,), length) == [(3 * length, slice(0, length))]  # contiguous shards


def test_causal_needs_an_even_local_sequence_when_load_balanced():
    import torch.distributed as dist
    from helpers import fake_pg

    from cp_inductor.parallel import allgather_attention

    with fake_pg(2):
        x = torch.randn(1, 3, 2, 8)
        with pytest.raises(ValueError, match="even local sequence"):
            allgather_attention(x, x, x, is_causal=True, group=dist.group.WORLD)


def _check_hand_written(rank, cp):
    from test_detect_allgather import head_stride_loop, llama3_style_masked

    shape = dict(batch=1, seq=16, heads_q=2, heads_kv=2, head_dim=8)
    masked = AttentionCase(**shape, causal=True, load_balanced=True)
    strided = AttentionCase(**shape, causal=False)
    return check_cp_attention(rank, cp, [masked], llama3_style_masked) + check_cp_attention(
        rank, cp, [strided], head_stride_loop
    )


def test_hand_written_allgather_matches_single_device():
    """Llama3-style hand-written code (index reorder, per-chunk bottom-right masks) and a head-stride
    gather loop: found in both graphs, answer unchanged."""
    for rank_results in run_on_ranks(_check_hand_written, 2):
        assert_cp_results(rank_results, TOL, applied=())
        for r in rank_results:
            assert {row[:2] for row in r["report"]} == {("forward", "allgather"), ("backward", "allgather")}, r


GROUPED = {  # cp -> [(case, head groups)]
    2: [
        (AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True), 2),
        (AttentionCase(batch=2, seq=16, heads_q=4, heads_kv=4, head_dim=8, layout="bhsd", causal=True), 4),
        (AttentionCase(batch=1, seq=16, heads_q=4, heads_kv=2, head_dim=8, causal=False), 2),
    ],
    4: [(AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, layout="bhsd", causal=True, load_balanced=True), 2)],
}


def _check_grouped(rank, cp):
    return [r for case, g in GROUPED[cp] for r in check_cp_attention(rank, cp, [case], allgather_fn(case, head_groups=g))]


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_head_groups_match_single_device(cp):
    """head_groups=G: per-group gathers, attention and reduce-scatters give the same output and
    gradients (causal load-balanced and contiguous, not causal, GQA); both graphs are still
    found as all-gather regions, one per attention call."""
    for rank_results in run_on_ranks(_check_grouped, cp):
        assert_cp_results(rank_results, TOL, applied=())
        for r in rank_results:
            assert {row[:3] for row in r["report"]} == {("forward", "allgather", cp), ("backward", "allgather", cp)}, r


def test_head_groups_must_divide_the_heads():
    import torch.distributed as dist
    from helpers import fake_pg

    from cp_inductor.parallel import allgather_attention

    with fake_pg(2):
        q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 2, 8)
        with pytest.raises(ValueError, match="head_groups=4 must divide"):
            allgather_attention(q, kv, kv, is_causal=True, head_groups=4, group=dist.group.WORLD)
