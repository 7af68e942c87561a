"""Per-rank checks of the copy-engine all-to-all (``lowerings/ce_transport.py``), run by the tests
through ``run_on_ranks``: the result against ``all_to_all_single``, back-to-back transfers with
ranks delayed at random, CUDA-graph replays. Each returns numbers the test asserts on."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from ..lowerings import ce_transport

ops = torch.ops.cp_inductor


def _device(backend_device: str) -> torch.device:
    if backend_device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def against_collective(rank: int, cp: int, device: str) -> dict:
    """Several tensors (dtypes, a non-contiguous one), two slots in flight at once: every
    result bitwise equal to ``all_to_all_single``'s."""
    dev = _device(device)
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)
    inputs = [
        torch.randn(cp * 4, 7, 3, generator=gen).to(dev),
        torch.randn(cp * 256, 96, generator=gen).to(dev, torch.bfloat16),
        torch.randn(24, cp * 8, 5, generator=gen).to(dev).transpose(0, 1),  # non-contiguous
    ]
    equal = []
    tokens = [ops.ce_all_to_all_start(x, slot, group) for slot, x in enumerate(inputs[:2])]
    results = [ops.ce_all_to_all_wait(t, x, slot, group) for slot, (t, x) in enumerate(zip(tokens, inputs[:2]))]
    results.append(ops.ce_all_to_all_wait(ops.ce_all_to_all_start(inputs[2], 0, group), inputs[2], 0, group))
    for x, got in zip(inputs, results):
        want = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(want, x.contiguous())
        equal.append(bool(torch.equal(got, want)))
    reason = ce_transport.why_unavailable(group, dev.type)
    ce_transport.release()
    return {"equal": equal, "why_unavailable": reason}


def _pattern(rank: int, step: int, cp: int, n: int, device) -> torch.Tensor:
    """What ``rank`` sends at ``step``: block j holds rank * 1_000_003 + step * 7 + j (int32)."""
    blocks = torch.arange(cp, device=device, dtype=torch.int32) + (rank * 1_000_003 + step * 7)
    return blocks[:, None].expand(cp, n).contiguous()


def back_to_back(rank: int, cp: int, steps: int, n: int, seed: int) -> dict:
    """``steps`` transfers on two slots (sometimes both in flight), rank 0 delayed at random by
    sleep kernels before sending, and the others at random after receiving: counts the elements
    that were not what their sender wrote at that step (a stale or early read)."""
    dev = _device("cuda")
    group = dist.group.WORLD.group_name
    shared = random.Random(seed)  # what every rank sends when: the same sequence on all ranks
    rng = random.Random(seed + 1 + rank)  # the delays: each rank its own
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    expected_src = torch.arange(cp, device=dev, dtype=torch.int32)[:, None] * 1_000_003 + rank
    step = 0
    while step < steps:
        pair = shared.random() < 0.5 and step + 1 < steps
        if rank == 0 and rng.random() < 0.3:
            torch.cuda._sleep(rng.randrange(1, 200_000))
        sent = [_pattern(rank, step + i, cp, n, dev) for i in range(2 if pair else 1)]
        tokens = [ops.ce_all_to_all_start(x, i, group) for i, x in enumerate(sent)]
        for i, (token, x) in enumerate(zip(tokens, sent)):
            got = ops.ce_all_to_all_wait(token, x, i, group)
            if rank != 0 and rng.random() < 0.3:
                torch.cuda._sleep(rng.randrange(1, 200_000))
            wrong += (got != expected_src + (step + i) * 7).sum()
        step += len(sent)
    torch.cuda.synchronize()
    ce_transport.release()
    return {"wrong": int(wrong.item()), "steps": steps}


def rotations_back_to_back(rank: int, cp: int, steps: int, n: int, seed: int) -> dict:
    """``steps`` transfers mixing ring rotations in both directions with all-to-alls through the
    same pooled areas (two in flight at times), ranks delayed at random: counts wrong elements."""
    dev = _device("cuda")
    group = dist.group.WORLD.group_name
    shared, rng = random.Random(seed), random.Random(seed + 1 + rank)
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    started = []  # (token, sent, slot, expected)
    for step in range(steps):
        if rng.random() < 0.3:
            torch.cuda._sleep(rng.randrange(1, 200_000))
        kind = shared.choice(("next", "previous", "all"))
        sent = _pattern(rank, step, cp, n, dev)
        slot = step % 2
        if kind == "all":
            token = ops.ce_all_to_all_start(sent, slot, group)
            expected = torch.arange(cp, device=dev, dtype=torch.int32)[:, None] * 1_000_003 + rank + step * 7
        else:
            shift = 1 if kind == "next" else -1
            dst, src = (rank + shift) % cp, (rank - shift) % cp
            token = ops.ce_rotate_start(sent, dst, src, slot, group)
            expected = _pattern(src, step, cp, n, dev)
        started.append((token, sent, slot, expected))
        if len(started) == 2 or shared.random() < 0.5:
            for token, x, slot_, want in started:
                wrong += (ops.ce_all_to_all_wait(token, x, slot_, group) != want).sum()
            started = []
    for token, x, slot_, want in started:
        wrong += (ops.ce_all_to_all_wait(token, x, slot_, group) != want).sum()
    torch.cuda.synchronize()
    ce_transport.release()
    return {"wrong": int(wrong.item()), "steps": steps}


def graph_replays(rank: int, cp: int, replays: int, n: int) -> dict:
    """Two transfers and a consumer captured in one CUDA graph, replayed with new inputs each
    time: counts wrong elements over all replays."""
    dev = _device("cuda")
    group = dist.group.WORLD.group_name
    x = _pattern(rank, 0, cp, n, dev)
    expected_src = torch.arange(cp, device=dev, dtype=torch.int32)[:, None] * 1_000_003 + rank

    def step():
        t0 = ops.ce_all_to_all_start(x, 0, group)
        t1 = ops.ce_all_to_all_start(x * 2, 1, group)
        a = ops.ce_all_to_all_wait(t0, x, 0, group)
        b = ops.ce_all_to_all_wait(t1, x, 1, group)
        return a + 1, b

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # allocates the receive areas before capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[torch.cuda.current_device()])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, b = step()
    wrong = torch.zeros((), dtype=torch.int64, device=dev)
    for i in range(replays):
        x.copy_(_pattern(rank, i, cp, n, dev))
        graph.replay()
        want = expected_src + i * 7
        wrong += (a != want + 1).sum() + (b != want * 2).sum()
    torch.cuda.synchronize()
    del graph
    ce_transport.release()
    return {"wrong": int(wrong.item()), "replays": replays}


def owner_grad_return_runs(rank: int, cp: int, head_groups) -> dict:
    """The all-gather helper (causal, load-balanced, GQA, bf16) compiled with owner_grad_return:
    errors vs the fp64 reference, whether the rewrite ran, and whether two runs gave the same
    dK/dV bits (the owners sum in rank order whatever order the transfers arrive in)."""
    import cp_inductor
    from torch._dynamo.utils import counters

    from .checks import AttentionCase, allgather_fn, errors, full_inputs, reference, run_cp

    case = AttentionCase(batch=1, seq=2048, heads_q=16, heads_kv=4, head_dim=128, causal=True,
                         load_balanced=True, dtype=torch.bfloat16)
    full = full_inputs(case)
    want = reference(case, full)
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(allgather_fn(case, head_groups=head_groups), backend="cp_inductor", fullgraph=True,
                       options={"cp_inductor.owner_grad_return": True})
    first = run_cp(fn, case, full, rank, cp, "cuda")
    second = run_cp(fn, case, full, rank, cp, "cuda")
    result = {
        "errors": errors(first, want),
        "same_bits": all(torch.equal(first[n], second[n]) for n in ("dk", "dv")),
        "rewritten": counters["cp_inductor"].get("owner_grad_return", 0),
        "details": [r.detail for r in cp_inductor.report().regions if "owner_grad_return" in r.applied],
    }
    ce_transport.release()
    return result
