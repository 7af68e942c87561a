"""The copy-engine all-to-all ops (lowerings/ce_transport.py) where the transport cannot run:
on gloo they fall back to torch.distributed's all-to-all, bitwise equal, and say why."""

from cp_inductor.testing.launch import run_on_ranks
from cp_inductor.testing.transport_checks import against_collective


def test_fallback_on_gloo_matches_all_to_all():
    for result in run_on_ranks(against_collective, 2, "cpu"):
        assert result["equal"] == [True, True, True]
        assert result["why_unavailable"] == "copy-engine transport needs CUDA tensors (got cpu)"
