"""Measurement discipline shared by the benchmark scripts (docs/architecture.md, "Measuring")."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


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


def kernel_trace(fn, steps: int) -> tuple[float, float, list]:
    """Per step of ``steps`` back to back: kernels' total ms, span ms, and (ms, launches, name)
    per kernel name, largest first."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1000 / steps
    table: dict[str, list] = {}
    for e in kernels:
        row = table.setdefault(e.name, [0.0, 0])
        row[0] += e.device_time / 1000 / steps
        row[1] += 1
    rows = sorted(((ms, n // steps, name) for name, (ms, n) in table.items()), reverse=True)
    return sum(r[0] for r in rows), span, rows


@contextlib.contextmanager
def gpu_clocks(into: dict, every_s: float = 0.01):
    """While the block runs, a thread reads this GPU's SM clock, power draw and clock-event
    reasons through NVML (``pynvml``, the ``nvidia-ml-py`` wheel) every ``every_s``; ``into`` gets
    the medians ``sm_mhz`` and ``power_w`` and ``power_capped``, the share of samples in which the
    driver held the clock down to stay under the board's power limit (nothing without pynvml).
    Why: the H200 holds its 700 W cap by lowering the SM clock, so a kernel's time depends on
    the load around it, and an arm's clock says how much of a difference is power, not work."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(torch.cuda.current_device())
        gpu = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # no pynvml, no NVML: nothing sampled
        yield into
        return
    samples: list = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(gpu)
            samples.append((pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(gpu) / 1000,
                            bool(reasons & pynvml.nvmlClocksThrottleReasonSwPowerCap)))
            stop.wait(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield into
    finally:
        stop.set()
        sampler.join()
        if samples:
            into["sm_mhz"] = statistics.median(s[0] for s in samples)
            into["power_w"] = statistics.median(s[1] for s in samples)
            into["power_capped"] = sum(s[2] for s in samples) / len(samples)


def init_group(fake_rank: str | None) -> None:
    """The CP process group: NCCL under torchrun, or with ``fake_rank`` "R/CP" one process on one
    GPU playing rank R of CP with PyTorch's fake group, whose collectives move nothing: every
    arm runs rank R's kernels without communication (timings are that rank's compute; outputs
    are not checked)."""
    if fake_rank is None:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank, cp = (int(x) for x in fake_rank.split("/"))
    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)


def fill_free_memory(fraction: float = 0.8) -> float:
    """Fill most of the GPU's free memory with N(0, 1) bf16 values and give it back to the caching
    allocator, which hands it out again: tensors nothing writes (what the fake group's collectives
    return) then hold random values, not the zeros of fresh device memory, on which cuDNN attention
    runs 14-16% faster (one H200, S32K H16: 24.6 ms with zero K/V, 28.5-29.1 ms random, results/attention_data_dependence_run66.log).
    Returns the GiB filled."""
    free, _ = torch.cuda.mem_get_info()
    n = int(free * fraction) // 2
    block = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    block.normal_()
    del block
    return 2 * n / 2**30


def write_rows(path: str | None, args, rows: list) -> None:
    """A table script's JSON: its arguments and rows (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def alternating_rounds(arms: list, rounds: int, time_arm) -> dict:
    """Per arm, the median of each round; the arm order reverses every other round.
    ``time_arm(name)`` returns the per-iteration times (slowest rank) of one round."""
    medians = {n: [] for n in arms}
    for rnd in range(rounds):
        for name in arms if rnd % 2 == 0 else arms[::-1]:
            medians[name].append(statistics.median(time_arm(name)))
    return medians


def slowest_rank_ms(fn, iters: int, warmup: int = 2, back_to_back: bool = False) -> list[float]:
    """Per iteration, the time of the slowest rank: iterations start together (a barrier), so
    the slowest rank is the iteration's time. ``back_to_back``: as a training loop runs, the
    host queuing step after step ahead of the GPU; one time per call (the mean of ``iters``)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if back_to_back:
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    else:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            dist.barrier()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], device="cuda")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def largest_rank(gib: float) -> float:
    """The largest of the ranks' values (peak memory in GiB)."""
    peak = torch.tensor([gib], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def measure_arms(arms: dict, rounds: int, time_one, peak_of=float, clocks: dict | None = None) -> tuple[dict, dict]:
    """Per arm (name -> fn): the median over :func:`alternating_rounds` of ``time_one(fn)``, and
    its peak memory in GiB beyond what was allocated before it ran (``peak_of`` combines ranks:
    :func:`largest_rank`). ``clocks``, if given, gets per arm the median over rounds of the SM
    clock it ran at (:func:`gpu_clocks`)."""
    peaks, mhz = {}, {n: [] for n in arms}

    def time_arm(name):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        sampled: dict = {}
        with gpu_clocks(sampled):
            ms = time_one(arms[name])
        if "sm_mhz" in sampled:
            mhz[name].append(sampled["sm_mhz"])
        peaks[name] = peak_of((torch.cuda.max_memory_allocated() - base) / 2**30)
        return [ms]

    per_round = alternating_rounds(list(arms), rounds, time_arm)
    if clocks is not None:
        clocks.update({n: statistics.median(m) for n, m in mhz.items() if m})
    return {n: statistics.median(t) for n, t in per_round.items()}, peaks


def paired_ratio(medians: dict, arm: str, base: str) -> float:
    """Median over rounds of arm/base measured in the same round."""
    return statistics.median(a / b for a, b in zip(medians[arm], medians[base]))


def teardown() -> None:
    """Compiled collectives hold the group: reset dynamo (and cudagraph trees) before destroying it;
    the copy-engine transport's symmetric memory goes first."""
    dist.barrier()
    transport = sys.modules.get("cp_inductor.lowerings.ce_transport")
    if transport is not None:
        transport.release()
    torch._dynamo.reset()
    dist.destroy_process_group()


def _label(frames) -> str:
    """Where a block was allocated: the line of Inductor's generated code that allocates it, else
    the innermost frame outside torch's own Python."""
    import linecache

    for f in frames:
        if "torchinductor" in f["filename"]:
            return "generated: " + linecache.getline(f["filename"], f["line"]).strip()[:110]
    for f in frames:
        if "/torch/" not in f["filename"]:
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    return f"{frames[0]['name']}" if frames else "?"


def peak_composition(step, top: int = 12) -> dict:
    """The blocks alive at the peak of one call of ``step`` (above what was allocated before it),
    largest first, labelled by where they were allocated: what dominates the peak."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    by_label: dict = {}
    for size, frames in at_peak.values():
        label = _label(frames)
        count, nbytes = by_label.get(label, (0, 0))
        by_label[label] = (count + 1, nbytes + size)
    rows = sorted(by_label.items(), key=lambda kv: -kv[1][1])
    return {
        "peak_gib": peak / 2**30,
        "blocks": [{"where": w, "count": c, "gib": b / 2**30} for w, (c, b) in rows[:top]],
        "rest_gib": sum(b for _, (_, b) in rows[top:]) / 2**30,
    }


def add_attention_args(parser, iters: int = 10) -> None:
    """The attention shape and run options the packed-attention benchmarks share (GQA Hq32
    Hkv8 D128 by default), ``--iters`` and ``--json``."""
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--json", default="")


def print_kernels(label: str, fn, steps: int = 3, top: int = 10) -> dict:
    """``kernel_trace`` of ``fn`` printed: kernels' ms per step, the GPU's idle ms inside the
    traced steps, and the ``top`` kernels by time; returned as a JSON-able dict."""
    kernels_ms, span_ms, rows = kernel_trace(fn, steps)
    print(f"{label}: kernels {kernels_ms:.3f} ms, span {span_ms:.3f} ms, idle {span_ms - kernels_ms:.3f} ms per step",
          flush=True)
    for ms, n, name in rows[:top]:
        print(f"  {ms:8.3f} ms  x{n:<3} {name[:100]}")
    return {"kernels_ms": kernels_ms, "span_ms": span_ms, "kernels": [{"ms": ms, "launches": n, "name": k} for ms, n, k in rows]}


def arm_ratios(row: dict) -> None:
    """``row["ms"]`` per arm -> cp_inductor's speedup over default Inductor and its ratio to the
    floor (NaN where an arm was not run)."""
    ms, nan = row["ms"], float("nan")
    row["speedup_vs_inductor"] = ms.get("inductor", nan) / ms.get("cp_inductor", nan)
    row["vs_floor"] = ms.get("cp_inductor", nan) / ms.get("floor", nan)


def print_arm_table(rows: list, arms: list, lead: dict, extra: dict | None = None) -> None:
    """A markdown table: the ``lead`` columns (header -> row key), each arm's ms, the two
    ratios, then ``extra`` columns (header -> (row key, format))."""
    extra = extra or {}
    heads = [*lead, *(a + " ms" for a in arms), "cp / inductor", "cp vs floor", *extra]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        cells = [str(r[k]) for k in lead.values()] + [f"{r['ms'].get(a, float('nan')):.2f}" for a in arms]
        cells += [f"{r['speedup_vs_inductor']:.2f}x", f"{r['vs_floor']:.3f}"]
        cells += [format(r[k], spec) for k, spec in extra.values()]
        print("| " + " | ".join(cells) + " |")


def write_device_rows(path: str | None, rows: list) -> None:
    """A one-GPU script's JSON: the device, torch's version and the rows (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
