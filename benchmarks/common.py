"""Measurement discipline shared by the benchmark scripts (docs/architecture.md, "Measuring")."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def device_ms(fn, iters: int, calls: int = 1, warmup: int = 2) -> float:
    """Median time per call of ``fn`` over ``iters`` measurements of ``calls`` back-to-back calls
    each, between two CUDA events (for short kernels ``calls`` > 1 hides host launch overhead,
    since the host queues faster than they run). On a CPU-only machine: wall-clock time."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


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
