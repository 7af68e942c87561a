"""Golden detection of ring CP regions (fake process group, no codegen): a hand-written ring at
cp = 2, 4, 8, causal (zigzag) and not, and rotations that are not ring attention."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from expecttest import TestCase

from helpers import aot_graphs, describe_matches, fake_pg, report_text
from ring_programs import native_options, native_ring, ring_by_hand


def _qkv(s_l=8, hq=4, hkv=2, d=8):
    mk = lambda h: torch.randn(1, s_l, h, d, requires_grad=True)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _next_rank(x):
    """permute_tensor to the next rank (not differentiable: forward graphs only)."""
    cp = dist.get_world_size()
    return funcol.permute_tensor(x, [(r + 1) % cp for r in range(cp)], dist.group.WORLD)


def separate_rotations(q, k, v):
    """Inference ring with K and V rotated separately (two permute_tensor calls per step) and a
    running log-sum-exp merge."""
    cp = dist.get_world_size()
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = lse = None
    for step in range(cp):
        if step:
            k, v = (_next_rank(t.flatten()).view_as(t) for t in (k, v))
        o, l_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[:2]
        if out is None:
            out, lse = o, l_
        else:
            new = torch.logaddexp(lse, l_)
            out = out * (lse - new).exp().unsqueeze(-1) + o * (l_ - new).exp().unsqueeze(-1)
            lse = new
    return out.transpose(1, 2)


def rotated_query(q, k, v):
    """Queries rotating with K/V: not supported, reported."""
    q, k, v = (_next_rank(x.flatten()).view_as(x).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v)


def p2p_ring(q, k, v):
    """ring-flash-attention's way: K/V passed on with ``batch_isend_irecv`` while attention runs
    on the current block (BHSD here, two steps, merge omitted: detection is what is checked)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    nk, nv = torch.empty_like(k), torch.empty_like(v)
    reqs = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, k, (rank + 1) % cp), dist.P2POp(dist.irecv, nk, (rank - 1) % cp),
        dist.P2POp(dist.isend, v, (rank + 1) % cp), dist.P2POp(dist.irecv, nv, (rank - 1) % cp),
    ])
    out = F.scaled_dot_product_attention(q, k, v)
    for r in reqs:
        r.wait()
    return out + F.scaled_dot_product_attention(q, nk, nv)


def rotated_activation(x, w):
    """A rotation feeding a matmul, not attention: no region."""
    return _next_rank(x.flatten()).view_as(x) @ w


class TestRingGolden(TestCase):
    def test_causal_zigzag_cp2(self):
        # Forward: step 0 attends over the local K/V it sends around; step 1 reads K/V rotated
        # once (rank 0 holds chunks 0 and 3: rank 1's block is later, so only the second local
        # chunk reads it). Backward: every step's dK/dV, the local step's too, join the accumulator
        # that travels with its block, so both are regions.
        with fake_pg(2):
            text = describe_matches(aot_graphs(lambda q, k, v: ring_by_hand(q, k, v, causal=True), *_qkv()))
        self.assertExpectedInline(text, """\
forward: ring cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=2 step=0 causal
forward: ring cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=2 step=1
backward: ring cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=2 causal
backward: ring cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=2""")

    def test_cp4_and_cp8_every_rotated_step(self):
        lines = []
        for cp, causal in ((4, False), (8, True)):
            with fake_pg(cp):
                graphs = aot_graphs(lambda q, k, v: ring_by_hand(q, k, v, causal=causal), *_qkv(hq=2))
                lines.append("\n".join(
                    line for line in describe_matches(graphs).splitlines() if line.startswith("forward")
                ))
        self.assertExpectedInline("\n".join(lines), """\
forward: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=0
forward: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=1
forward: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=2
forward: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=3
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=0 causal
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=1
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=2
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=3
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=4
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=5
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=6
forward: ring cp=8 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=7""")

    def test_native_context_parallel_ring(self):
        """PyTorch native CP's own ring code (CPU kernel): with the all-to-all rotation every
        rotated step is a ring region; with the all-gather rotation (native's default) the
        forward reads one gathered buffer (all-gather regions) while the backward still
        rotates the dK/dV accumulators (ring regions). Load balance on for causal, off else."""
        lines = []
        for rotate, cp, causal in (("alltoall", 2, True), ("allgather", 2, True), ("alltoall", 4, False),
                                   ("allgather", 8, False)):
            with fake_pg(cp), native_options(rotate, load_balance=causal):
                graphs = aot_graphs(lambda q, k, v: native_ring(q, k, v, causal=causal), *_qkv(hq=2))
                regions = [line for line in describe_matches(graphs).splitlines() if "not a region" not in line]
            counts = {}
            for line in regions:
                kind, style = line.split(":")[0], line.split()[1]
                counts[(kind, style)] = counts.get((kind, style), 0) + 1
            lines.append(f"{rotate} cp={cp} {'causal' if causal else 'full'}: " + ", ".join(
                f"{kind} {style} x{n}" for (kind, style), n in counts.items()))
        self.assertExpectedInline("\n".join(lines), """\
alltoall cp=2 causal: forward ring x2, backward ring x2
allgather cp=2 causal: forward allgather x1, backward ring x2
alltoall cp=4 full: forward ring x4, backward ring x4
allgather cp=8 full: forward allgather x7, backward ring x8""")

    def test_report_lists_the_ring_rewrites(self):
        with fake_pg(2):
            text = report_text(aot_graphs(lambda q, k, v: ring_by_hand(q, k, v, causal=True), *_qkv()))
        self.assertExpectedInline(text, """\
forward ring cp=2 bshd applied=[] skipped={'head_split': 'disabled by config', 'ring_grad_return': 'disabled by config', 'narrow_rotation': 'a forward region: attention reads its rotated K/V as they are', 'ce_rotation': "no rotation moves this op's K/V (step 0: the next step's region carries it)"}
forward ring cp=2 bshd applied=[] skipped={'head_split': 'disabled by config', 'ring_grad_return': 'disabled by config', 'narrow_rotation': 'a forward region: attention reads its rotated K/V as they are', 'ce_rotation': 'copy-engine transport needs CUDA tensors (got cpu)'}
backward ring cp=2 bshd applied=[] skipped={'head_split': 'disabled by config', 'ring_grad_return': 'disabled by config', 'narrow_rotation': 'no rotation of its dK/dV is read only through a cast to a narrower dtype (running accumulators travel on; an fp32 program casts nothing)', 'ce_rotation': 'copy-engine transport needs CUDA tensors (got cpu)'}
backward ring cp=2 bshd applied=[] skipped={'head_split': 'disabled by config', 'ring_grad_return': 'disabled by config', 'narrow_rotation': 'no rotation of its dK/dV is read only through a cast to a narrower dtype (running accumulators travel on; an fp32 program casts nothing)', 'ce_rotation': 'copy-engine transport needs CUDA tensors (got cpu)'}""")

    def test_k_and_v_rotated_separately(self):
        with fake_pg(4), torch.no_grad():
            text = describe_matches(aot_graphs(separate_rotations, *_qkv(hq=2)))
        self.assertExpectedInline(text, """\
inference: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=0
inference: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=1
inference: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=2
inference: ring cp=4 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 step=3""")

    def test_point_to_point_ring_is_reported(self):
        # Traced only with Dynamo's P2P compilation (TORCHDYNAMO_ENABLE_P2P_COMPILATION=1).
        with fake_pg(2), torch.no_grad(), torch._dynamo.config.patch(enable_p2p_compilation=True):
            text = describe_matches(aot_graphs(p2p_ring, *(torch.randn(1, 2, 8, 8) for _ in range(3))))
        self.assertExpectedInline(text, """\
inference: not a region: _scaled_dot_product_flash_attention_for_cpu: no all_to_all or all_gather feeds q, k or v (attention on local data)
inference: not a region: _scaled_dot_product_flash_attention_for_cpu: K/V arrive by point-to-point send/recv (batch_isend_irecv, traced with TORCHDYNAMO_ENABLE_P2P_COMPILATION=1): ring detection follows all_to_all rotations only; reported, not rewritten""")

    def test_not_ring_attention(self):
        with fake_pg(2):
            with torch.no_grad():
                lines = [describe_matches(aot_graphs(rotated_query, *_qkv(hkv=4)))]
                lines.append(describe_matches(aot_graphs(rotated_activation, torch.randn(4, 8), torch.randn(8, 8))))
        self.assertExpectedInline("\n".join(lines), """\
inference: not a region: _scaled_dot_product_flash_attention_for_cpu: uneven all_to_all splits [0, 256]; the query rotates (query-rotating rings are not supported)
no regions""")
