"""narrow_rotation: a ring's last dK/dV rotation travels cast to the inputs' dtype. Goldens of the
rotations' payload dtypes (bf16 inputs, fake process group), every rank deciding alike, the
reason where it does not apply, and on gloo the compiled gradients bit for bit equal with the
rewrite on and off (it moves a cast across a pure data move)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from expecttest import TestCase

from cp_inductor.testing.launch import run_on_ranks
from helpers import ring_graphs
from ring_programs import causal_native_ring, native_options, native_ring, ring_by_hand, same_bits_on_and_off

c10d = torch.ops._c10d_functional
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _rewritten(cp, fn, rank=0, dtype=torch.bfloat16, **cfg):
    """(report rows, graphs) as the backend compiles them (joint passes, then post-grad)."""
    qkv = [torch.randn(1, 8, h, 8, dtype=dtype, requires_grad=True) for h in (4, 2, 2)]
    return ring_graphs(cp, fn, qkv, rank=rank, **cfg)


def _payloads(graphs) -> str:
    """Each graph's rotations in order, by the dtype they send."""
    return "\n".join(
        f"{kind}: " + " ".join(_SHORT[n.args[0].meta["val"].dtype] for n in gm.graph.nodes
                               if n.target is c10d.all_to_all_single.default)
        for kind, gm in graphs.items()
    )


_HAND = functools.partial(ring_by_hand, causal=True)


_native = causal_native_ring


class TestGolden(TestCase):
    def test_hand_written_ring_cp2(self):
        # Forward: K/V in bf16. Backward: the dK/dV accumulator goes on in fp32, comes home in bf16.
        _, graphs = _rewritten(2, _HAND, ce_rotation=False)
        self.assertExpectedInline(_payloads(graphs), """\
forward: bf16
backward: fp32 bf16""")

    def test_native_context_parallel_cp4(self):
        # The backward rotates K/V again (bf16) between its dK/dV rotations; the last one, home,
        # was fp32 (off) and is bf16 (on).
        for on in (False, True):
            with native_options("alltoall", load_balance=True):
                _, graphs = _rewritten(4, _native, ce_rotation=False, narrow_rotation=on)
            self.assertExpectedInline(_payloads(graphs).split("\n")[1], [
                """backward: fp32 bf16 fp32 bf16 fp32 fp32""",
                """backward: fp32 bf16 fp32 bf16 fp32 bf16""",
            ][on])

    def test_off(self):
        _, graphs = _rewritten(2, _HAND, ce_rotation=False, narrow_rotation=False)
        self.assertExpectedInline(_payloads(graphs), """\
forward: bf16
backward: fp32 fp32""")

    def test_reasons(self):
        # fp32 inputs: the program never casts its gradients, nothing to narrow.
        rows, _ = _rewritten(2, _HAND, dtype=torch.float32, ce_rotation=False)
        text = "\n".join(f"{r.graph_kind} {r.detail}: {r.skipped.get('narrow_rotation', 'applied')}" for r in rows)
        self.assertExpectedInline(text, """\
forward Hq=4 Hkv=2 step=0 causal: a forward region: attention reads its rotated K/V as they are
forward Hq=4 Hkv=2 step=1: a forward region: attention reads its rotated K/V as they are
backward Hq=4 Hkv=2 causal: no rotation of its dK/dV is read only through a cast to a narrower dtype (running accumulators travel on; an fp32 program casts nothing)
backward Hq=4 Hkv=2: no rotation of its dK/dV is read only through a cast to a narrower dtype (running accumulators travel on; an fp32 program casts nothing)""")


# program -> (function, native CP's rotation and load balance; None: hand-written)
PROGRAMS = {
    "hand": (_HAND, None),
    "alltoall": (functools.partial(native_ring, causal=True), ("alltoall", True)),
    "allgather": (functools.partial(native_ring, causal=False), ("allgather", False)),
    # causal without load balance: rank 0 has no attention at its last step (the peer's block is
    # its future), so no backward region carries its home rotation
    "alltoall_causal_unbalanced": (functools.partial(native_ring, causal=True), ("alltoall", False)),
}


@pytest.mark.parametrize("cp,program", [(2, "hand"), pytest.param(4, "hand", marks=pytest.mark.wide), (2, "alltoall"),
                                        pytest.param(4, "alltoall", marks=pytest.mark.wide), (4, "allgather"),
                                        (2, "alltoall_causal_unbalanced"),
                                        pytest.param(4, "alltoall_causal_unbalanced", marks=pytest.mark.wide)])
def test_every_rank_decides_alike(cp, program):
    fn, native = PROGRAMS[program]
    payloads = []
    for rank in range(cp):
        with contextlib.nullcontext() if native is None else native_options(*native):
            payloads.append(_payloads(_rewritten(cp, fn, rank=rank, ce_rotation=False)[1]))
    assert all(p == payloads[0] for p in payloads), payloads
    assert "bf16" in payloads[0].split("backward:")[1], payloads[0]


@pytest.mark.parametrize("program", [pytest.param("hand", marks=pytest.mark.wide), "native"])
def test_same_bits_on_and_off(program):
    for r in run_on_ranks(same_bits_on_and_off, 2, program, "narrow_rotation", 2):
        assert r["applied"] == {False: 0, True: 1} and all(r["same"].values()), r
