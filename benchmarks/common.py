"""Measurement discipline shared by the benchmark scripts (docs/architecture.md, "Measuring")."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def alternating_rounds(arms: list, rounds: int, time_arm) -> dict:
    """Per arm, the median of each round; the arm order reverses every other round.
    ``time_arm(name)`` returns the per-iteration times (slowest rank) of one round."""
    medians = {n: [] for n in arms}
    for rnd in range(rounds):
        for name in arms if rnd % 2 == 0 else arms[::-1]:
            medians[name].append(statistics.median(time_arm(name)))
    return medians


def paired_ratio(medians: dict, arm: str, base: str) -> float:
    """Median over rounds of arm/base measured in the same round."""
    return statistics.median(a / b for a, b in zip(medians[arm], medians[base]))


def teardown() -> None:
    """Compiled collectives hold the group: reset dynamo (and cudagraph trees) before destroying it."""
    dist.barrier()
    torch._dynamo.reset()
    dist.destroy_process_group()
