"""Hand-written ring attention (``ring_programs.ring_by_hand``) on gloo: output and every
gradient against a single-device fp64 reference, eager and compiled with cp_inductor, which
finds the ring regions in both graphs, rewrites nothing on CPU (ce_rotation needs the copy
engines: ``tests/test_ce_rotation.py``) and keeps the answer."""

from __future__ import annotations

import pytest
import torch

from cp_inductor.testing.checks import AttentionCase, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import assert_cp_results
from ring_programs import native_options, native_ring, ring_by_hand

TOL = 1e-5  # fp32 vs fp64, relative L2

CASES = {
    2: [
        # causal, zigzag (rank r holds chunks r and 2cp-1-r), GQA
        AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True),
        AttentionCase(batch=2, seq=16, heads_q=2, heads_kv=2, head_dim=8, causal=False),
    ],
    4: [AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True)],
}


def _check(rank, cp):
    return [
        r for case in CASES[cp]
        for r in check_cp_attention(rank, cp, [case], lambda q, k, v, c=case.causal: ring_by_hand(q, k, v, causal=c))
    ]


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_hand_written_ring_matches_single_device(cp):
    for rank_results in run_on_ranks(_check, cp):
        assert_cp_results(rank_results, TOL, applied=())
        for r in rank_results:
            assert {row[:3] for row in r["report"]} == {("forward", "ring", cp), ("backward", "ring", cp)}, r


def _check_native(rank, cp, rotate):
    causal = rotate == "alltoall"  # the all-gather rotation without load balance, not causal
    case = AttentionCase(batch=1, seq=32, heads_q=2, heads_kv=2, head_dim=8, causal=causal, load_balanced=causal)
    with native_options(rotate, load_balance=causal):
        return check_cp_attention(rank, cp, [case], lambda q, k, v: native_ring(q, k, v, causal=causal))


@pytest.mark.parametrize("cp,rotate", [(2, "alltoall"), (2, "allgather"), pytest.param(4, "allgather", marks=pytest.mark.wide),
                                       pytest.param(4, "alltoall", marks=pytest.mark.wide)])
def test_native_context_parallel_ring_matches_single_device(cp, rotate):
    """Native CP's own ring code (CPU kernel) eager and compiled with cp_inductor: the answer
    is unchanged and its regions are found (all-gather forward regions with that rotation). The
    all-to-all rotation at cp=4 hangs with AOTAutograd's CSE on (config.ring_cse="aot")."""
    forward = "ring" if rotate == "alltoall" else "allgather"
    for rank_results in run_on_ranks(_check_native, cp, rotate):
        assert_cp_results(rank_results, TOL, applied=())
        for r in rank_results:
            assert {row[:3] for row in r["report"]} == {("forward", forward, cp), ("backward", "ring", cp)}, r


_GROUPS = {}


def _usp_groups(cp: int, ulysses: int):
    """(Ulysses group, ring group) of this rank; every rank creates every group, in one order."""
    if (cp, ulysses) not in _GROUPS:
        import torch.distributed as dist

        rank = dist.get_rank()
        mine = {}
        for r in range(cp // ulysses):  # Ulysses groups: consecutive ranks
            g = dist.new_group(list(range(r * ulysses, (r + 1) * ulysses)))
            if rank // ulysses == r:
                mine["ulysses"] = g
        for u in range(ulysses):  # ring groups: one Ulysses rank of every Ulysses group
            g = dist.new_group(list(range(u, cp, ulysses)))
            if rank % ulysses == u:
                mine["ring"] = g
        _GROUPS[(cp, ulysses)] = (mine["ulysses"], mine["ring"])
    return _GROUPS[(cp, ulysses)]


def _check_usp(rank, cp):
    from ring_programs import usp_by_hand

    ulysses_group, ring_group = _usp_groups(cp, 2)
    case = AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=4, head_dim=8, causal=False)
    return check_cp_attention(
        rank, cp, [case], lambda q, k, v: usp_by_hand(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group)
    )


def test_usp_ulysses_then_ring_keeps_the_answer():
    """yunchang-style USP (Ulysses over pairs of ranks, a ring across the pairs) at cp = 4:
    eager and compiled match the reference, and the ring (over 2 ranks) is found in both graphs."""
    for rank_results in run_on_ranks(_check_usp, 4):
        for r in rank_results:
            for key in ("eager_vs_ref", "compiled_vs_ref"):
                assert max(r[key].values()) < TOL, r
            assert {row[:3] for row in r["report"]} == {("forward", "ring", 2), ("backward", "ring", 2)}, r


def _p2p_ring(q, k, v):
    """ring-flash-attention's way: K/V passed on by batch_isend_irecv while each step's attention
    runs, steps merged by log-sum-exp in fp32 (not causal, BHSD)."""
    import torch.distributed as dist

    rank, cp = dist.get_rank(), dist.get_world_size()
    out = lse = None
    for step in range(cp):
        if step + 1 < cp:
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            reqs = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, k, (rank + 1) % cp), dist.P2POp(dist.irecv, nk, (rank - 1) % cp),
                dist.P2POp(dist.isend, v, (rank + 1) % cp), dist.P2POp(dist.irecv, nv, (rank - 1) % cp),
            ])
        o, l_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2]
        o, l_ = o.float(), l_.float().unsqueeze(-1)
        if out is None:
            out, lse = o, l_
        else:
            new = torch.logaddexp(lse, l_)
            out, lse = out * (lse - new).exp() + o * (l_ - new).exp(), new
        if step + 1 < cp:
            for r in reqs:
                r.wait()
            k, v = nk, nv
    return out.to(q.dtype)


def _check_p2p(rank, cp):
    """The P2P ring compiled with cp_inductor (graph breaks at the P2P ops, or traced with
    Dynamo's P2P compilation) vs eager: max abs difference per mode."""
    import cp_inductor

    torch.manual_seed(rank)
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    want = _p2p_ring(q, k, v)
    diffs = {}
    for traced in (False, True):
        torch._dynamo.reset()
        cp_inductor.clear_report()
        with torch._dynamo.config.patch(enable_p2p_compilation=traced):
            got = torch.compile(_p2p_ring, backend="cp_inductor")(q, k, v)
        diffs[traced] = float((got - want).abs().max())
    return diffs


def test_point_to_point_ring_keeps_the_answer():
    """Not a region (the report says why), and never a different answer or a failed compile."""
    for diffs in run_on_ranks(_check_p2p, 2):
        assert max(diffs.values()) < 1e-5, diffs
