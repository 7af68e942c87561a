"""ring_grad_return: at cp = 2 a ring's backward sends the step-1 contribution to the peer's
dK/dV home once (bf16 where exact) instead of the fp32 accumulator there and back, and runs the
step-0 attention backward while it travels. Goldens of the backward's rotations and order on both
ranks (fake process group), the reasons, and on gloo the compiled gradients against the same
compile with the rewrite off: the same bits."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from expecttest import TestCase

from cp_inductor.passes.analysis.sdpa_ops import SDPA_BACKWARD
from cp_inductor.testing.checks import AttentionCase
from cp_inductor.testing.launch import run_on_ranks
from helpers import ring_graphs, rotations
from ring_programs import causal_native_ring, native_options, native_ring, ring_by_hand, same_bits_on_and_off

c10d = torch.ops._c10d_functional
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_HAND = functools.partial(ring_by_hand, causal=True)


_native = causal_native_ring


def _rewritten(cp, fn, rank=0, **cfg):
    qkv = [torch.randn(1, 8, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    ctx = contextlib.nullcontext() if fn is _HAND else native_options("alltoall", load_balance=True)
    with ctx:
        return ring_graphs(cp, fn, qkv, rank=rank, ce_rotation=False, **cfg)


def _backward_order(gm) -> str:
    """The backward's attention calls and rotations in graph order, rotations by payload dtype."""
    out = []
    for n in gm.graph.nodes:
        if n.target in SDPA_BACKWARD:
            out.append("attn_bwd")
        elif n.target is c10d.all_to_all_single.default:
            out.append(f"rotate({_SHORT[n.args[0].meta['val'].dtype]})")
    return " ".join(out)


class TestGolden(TestCase):
    def test_native_and_hand_written_cp2_both_ranks(self):
        lines = []
        for name, fn in (("native", _native), ("hand", _HAND)):
            for rank in (0, 1):
                off = _backward_order(_rewritten(2, fn, rank)[1]["backward"])
                on = _backward_order(_rewritten(2, fn, rank, ring_grad_return=True)[1]["backward"])
                lines.append(f"{name} rank {rank}: {off}  ->  {on}")
        self.assertExpectedInline("\n".join(lines), """\
native rank 0: attn_bwd rotate(fp32) attn_bwd rotate(bf16)  ->  attn_bwd rotate(fp32) attn_bwd
native rank 1: attn_bwd rotate(fp32) attn_bwd rotate(bf16)  ->  attn_bwd rotate(fp32) attn_bwd
hand rank 0: attn_bwd rotate(fp32) attn_bwd rotate(bf16)  ->  attn_bwd rotate(fp32) attn_bwd
hand rank 1: attn_bwd rotate(fp32) attn_bwd rotate(bf16)  ->  attn_bwd rotate(fp32) attn_bwd""")

    def test_with_copy_engine_rotations(self):
        # On GPUs ce_rotation then moves the one rotation to the copy engines: started as soon
        # as the contribution exists, waited after the step-0 attention backward it hides under
        # (the transport's availability faked on CPU).
        from unittest import mock

        from cp_inductor.lowerings import ce_transport

        qkv = [torch.randn(1, 8, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        with mock.patch.object(ce_transport, "why_unavailable", lambda group, device: None), \
                native_options("alltoall", load_balance=True):
            _, graphs = ring_graphs(2, _native, qkv, ce_rotation=True, ce_rotation_min_bytes=0, ring_grad_return=True)
        self.assertExpectedInline(rotations(graphs["backward"]), """attn ce#0(to 1, from 1) attn wait#0""")

    def test_reasons(self):
        rows, _ = _rewritten(4, _native, ring_grad_return=True)
        rows2, _ = _rewritten(2, _native, ring_grad_return=True)
        text = sorted({f"{r.graph} {r.skipped.get('ring_grad_return', 'applied')}" for r in rows + rows2 if r.style == "ring"})
        self.assertExpectedInline("\n".join(text), """\
backward applied
backward cp=4: only at cp = 2 is the home rotation the peer's only contribution
forward a forward region: the rewrite returns dK/dV""")


@pytest.mark.parametrize("program", [pytest.param("hand", marks=pytest.mark.wide), "native"])
def test_same_bits_on_and_off_gloo(program):
    for r in run_on_ranks(same_bits_on_and_off, 2, program, "ring_grad_return", 4):
        assert r["applied"][False] == 0 and r["applied"][True] >= 1 and all(r["same"].values()), r


def _causal_unbalanced(rank, cp):
    """Native CP causal without load balance, bf16: rank 0 has no attention at its last step
    (the peer's block is its future). With the defaults (narrow_rotation) and with
    ring_grad_return both ranks must still send alike through every rotation."""
    from cp_inductor.testing.checks import check_cp_attention

    case = AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=4, head_dim=8, causal=True, dtype=torch.bfloat16)
    fn = functools.partial(native_ring, causal=True)
    with native_options("alltoall", load_balance=False):
        return [check_cp_attention(rank, cp, [case], fn, options=options)[0]
                for options in ({}, {"cp_inductor.ring_grad_return": True})]


def test_native_causal_unbalanced_bf16_gloo():
    for defaults, grad_return in run_on_ranks(_causal_unbalanced, 2):
        for r in (defaults, grad_return):
            assert max(r["compiled_vs_ref"].values()) < 3e-2 and max(r["compiled_vs_eager"].values()) < 1e-2, r
        assert "narrow_rotation" in defaults["applied"] or defaults["rewritten"].get("narrow_rotation"), defaults
        assert grad_return["rewritten"].get("ring_grad_return", 0) >= 1, grad_return
