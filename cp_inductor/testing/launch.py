"""Run a function on ``cp`` local processes joined in one process group (gloo on CPU).

Used by the demo and the multi-process tests; under ``torchrun`` use the group torchrun made.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, cp, port, fn, args, queue, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=cp)
        result = fn(rank, cp, *args)
        # Plain pickle: tensors travel by value, not as shared memory the exiting worker owns.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            import sys

            import torch._dynamo

            transport = sys.modules.get("cp_inductor.lowerings.ce_transport")
            if transport is not None:  # its symmetric memory goes before the group
                transport.release()

            # Compiled collectives keep references to the group; drop them before destroying it.
            torch._dynamo.reset()
            dist.destroy_process_group()


def run_on_ranks(fn, cp: int, *args, pg_backend: str = "gloo", timeout: float = 1800.0) -> list:
    """``fn(rank, cp, *args)`` on each of ``cp`` processes; returns every rank's result in order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, cp, port, fn, args, queue, pg_backend), daemon=False)
        for r in range(cp)
    ]
    for p in procs:
        p.start()
    results, errors = [None] * cp, []
    try:
        for _ in range(cp):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results

