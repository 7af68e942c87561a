"""collective_cse: graphs with ring rotations compile without AOTAutograd's CSE; the joint-graph
pass merges a collective computed twice from rank-free inputs and keeps every collective in
the graph (forward or backward) it was written in, so that every rank issues the same ones."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.fx
from expecttest import TestCase
from torch.utils.checkpoint import checkpoint

from cp_inductor.passes.joint import collective_cse
from cp_inductor.passes.joint.collective_cse import merge_repeated
from cp_inductor.testing.checks import AttentionCase, check_cp_attention
from cp_inductor.testing.launch import run_on_ranks
from helpers import aot_graphs, assert_cp_results, fake_pg, rotations, ring_graphs
from ring_programs import native_options, native_ring, ring_by_hand

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _qkv():
    mk = lambda h: torch.randn(1, 8, h, 8, requires_grad=True)  # noqa: E731
    return mk(4), mk(2), mk(2)


def _graphs(cp, fn, rank=0, **cfg):
    """Forward and backward graphs as the backend partitions a ring program's joint graph."""
    return ring_graphs(cp, fn, _qkv(), rank=rank, post_grad=False, **cfg)[1]


def _schedule(graphs) -> str:
    return "\n".join(f"{kind}: {rotations(gm)}" for kind, gm in graphs.items())


class TestGolden(TestCase):
    def test_backward_reads_the_forwards_rotated_kv(self):
        # The ring helper's backward rotates K/V again (nccl#0 below, then dK/dV twice). Without
        # the merge that rotation runs again in the backward, as in eager; with it the backward
        # reads the forward's rotated K/V (saved).
        ring = lambda q, k, v: ring_by_hand(q, k, v, causal=True)  # noqa: E731
        self.assertExpectedInline(_schedule(_graphs(2, ring, ring_cse="pin")), """\
forward: attn nccl#0 wait#0 attn
backward: attn nccl#0 wait#0 nccl#1 wait#1 attn nccl#2 wait#2""")
        self.assertExpectedInline(_schedule(_graphs(2, ring)), """\
forward: attn nccl#0 wait#0 attn
backward: attn nccl#0 wait#0 attn nccl#1 wait#1""")

    def test_sliced_inputs_are_not_merged(self):
        # A slice's bounds are where ring programs differ per rank: the same collective of the
        # same slice twice stays twice (the slices themselves merge: computation, not
        # communication); of a cat of views it is merged.
        def graph(piece):
            g = torch.fx.Graph()
            x = g.placeholder("x")
            outs = []
            for _ in range(2):
                send = piece(g, x)
                a2a = g.call_function(c10d.all_to_all_single.default, (send, [4, 0], [0, 4], "0"))
                outs.append(g.call_function(c10d.wait_tensor.default, (a2a,)))
            g.output(tuple(outs))
            return g

        sliced = graph(lambda g, x: g.call_function(aten.slice.Tensor, (x, 0, 0, 4)))
        catted = graph(lambda g, x: g.call_function(aten.cat.default, ([g.call_function(aten.view.default, (x, [-1]))] * 2,)))
        self.assertEqual((merge_repeated(sliced), merge_repeated(catted)), (0, 1))
        self.assertExpectedInline(str(sliced).strip(), """\
graph():
    %x : [num_users=1] = placeholder[target=x]
    %slice_tensor : [num_users=2] = call_function[target=torch.ops.aten.slice.Tensor](args = (%x, 0, 0, 4), kwargs = {})
    %all_to_all_single_default : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_to_all_single.default](args = (%slice_tensor, [4, 0], [0, 4], 0), kwargs = {})
    %wait_tensor_default : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_to_all_single_default,), kwargs = {})
    %all_to_all_single_default_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_to_all_single.default](args = (%slice_tensor, [4, 0], [0, 4], 0), kwargs = {})
    %wait_tensor_default_1 : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_to_all_single_default_1,), kwargs = {})
    return (wait_tensor_default, wait_tensor_default_1)""")
        self.assertExpectedInline(str(catted).strip(), """\
graph():
    %x : [num_users=1] = placeholder[target=x]
    %view_default : [num_users=1] = call_function[target=torch.ops.aten.view.default](args = (%x, [-1]), kwargs = {})
    %cat_default : [num_users=1] = call_function[target=torch.ops.aten.cat.default](args = ([%view_default, %view_default],), kwargs = {})
    %all_to_all_single_default : [num_users=1] = call_function[target=torch.ops._c10d_functional.all_to_all_single.default](args = (%cat_default, [4, 0], [0, 4], 0), kwargs = {})
    %wait_tensor_default : [num_users=1] = call_function[target=torch.ops._c10d_functional.wait_tensor.default](args = (%all_to_all_single_default,), kwargs = {})
    return (wait_tensor_default, wait_tensor_default)""")

    def test_a_written_input_is_not_merged(self):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        first = g.call_function(c10d.all_to_all_single.default, (x, [4, 0], [0, 4], "0"))
        g.call_function(aten.add_.Tensor, (x, 1.0))
        second = g.call_function(c10d.all_to_all_single.default, (x, [4, 0], [0, 4], "0"))
        g.output((g.call_function(c10d.wait_tensor.default, (first,)), g.call_function(c10d.wait_tensor.default, (second,))))
        self.assertEqual(merge_repeated(g), 0)


def test_activation_checkpointing_keeps_its_recomputation():
    """Collectives in a checkpointed region are the user's to recompute in the backward: they
    are not pinned (pinning one to the forward left the partitioner without it: "was invalid,
    but is output"), and the schedule is plain AOTAutograd's."""
    def fn(q, k, v):
        return checkpoint(lambda q, k, v: ring_by_hand(q, k, v, causal=True) * 2, q, k, v, use_reentrant=False)

    with fake_pg(2):
        plain = _schedule(aot_graphs(fn, *_qkv()))
    assert _schedule(_graphs(2, fn)) == plain, plain
    assert "nccl" in plain.split("backward:")[1], plain  # the K/V rotation is recomputed


def _checkpointed_ring(rank, cp):
    case = AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=2, head_dim=8, causal=True, load_balanced=True)
    fn = lambda q, k, v: checkpoint(  # noqa: E731
        lambda q, k, v: ring_by_hand(q, k, v, causal=True), q, k, v, use_reentrant=False)
    return check_cp_attention(rank, cp, [case], fn)


def test_checkpointed_ring_compiles_and_matches_single_device():
    for rank_results in run_on_ranks(_checkpointed_ring, 2):
        assert_cp_results(rank_results, 1e-5, applied=())


def _collectives(graphs) -> dict:
    return {kind: rotations(gm).count("nccl#") for kind, gm in graphs.items()}


@pytest.mark.parametrize("cp,rotate", [(2, "alltoall"), pytest.param(4, "alltoall", marks=pytest.mark.wide), (4, "allgather")])
def test_every_rank_issues_the_same_collectives(cp, rotate):
    """Native CP's rotations at cp=4: with AOTAutograd's CSE, or with collectives left for the
    partitioner to place, rank 0's backward held one rotation fewer than the others' (the
    partitioner copies a collective into each graph that has its inputs, and what the backward
    has is this rank's min-cut). Here every rank has the joint graph's collectives once each."""
    causal = rotate == "alltoall"
    counts = []
    for rank in range(cp):
        with native_options(rotate, load_balance=causal):
            counts.append(_collectives(_graphs(cp, lambda q, k, v: native_ring(q, k, v, causal=causal), rank=rank)))
    assert all(c == counts[0] for c in counts), counts


def test_unpinned_collectives_differ_per_rank():
    """What the pinning prevents (the check above can fail): without it, native CP's all-to-all
    rotation at cp=4 gives rank 0 a backward with fewer rotations than rank 1's."""
    counts = []
    with mock.patch.object(collective_cse, "pin_collectives", lambda graph: 0):
        for rank in (0, 1):
            with native_options("alltoall", load_balance=True):
                counts.append(_collectives(_graphs(4, lambda q, k, v: native_ring(q, k, v, causal=True), rank=rank)))
    assert counts[0]["backward"] < counts[1]["backward"], counts
