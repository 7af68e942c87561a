"""Run a function on ``cp`` local processes joined in one process group (gloo on CPU), or on
processes joined in none (work split over the cores).

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
        if backend is not None:
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


# Ranks start as forks of a server that imported torch, Dynamo and Inductor once per launching
# process, not once per rank and launch (seconds each on a small machine). Those modules read
# environment variables when imported, so the server serves only launches whose environment is
# the one it started with; any other launch spawns its ranks afresh. The imports start no thread;
# the last sets up what every rank's first compile would (``rank_warmup``: a 2-rank launch of two
# tiny compiles measured 3.9 s without it, 1.5 s with it; docs/measurements.md has the rest).
# NCCL launches (GPU machines, where the imports are cheap next to the run) always spawn: no
# forked rank inherits anything a CUDA-aware import might have set up.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "cp_inductor",
            "cp_inductor.testing.rank_warmup"]
_server_environ: dict | None = None  # the environment the fork server started with


def _relevant(environ) -> dict:
    return {k: v for k, v in environ.items() if not k.startswith("PYTEST_")}  # pytest's per-test names


def _context(environ, backend: str | None):
    global _server_environ
    if backend in ("gloo", None) and "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        if _server_environ is None and getattr(forkserver._forkserver, "_forkserver_pid", None) is None:
            _server_environ = _relevant(environ)  # this launch starts the server
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            return ctx
        if _server_environ is not None and _relevant(environ) == _server_environ:
            return mp.get_context("forkserver")
    return mp.get_context("spawn")


def run_on_ranks(fn, cp: int, *args, pg_backend: str | None = "gloo", timeout: float = 1800.0,
                 spawn: bool = False) -> list:
    """``fn(rank, cp, *args)`` on each of ``cp`` processes; returns every rank's result in order.
    ``pg_backend=None``: the processes join no group (each its own share of independent work).
    ``spawn``: every rank a fresh interpreter (ranks that use CUDA under gloo: CUDA cannot start
    in a fork of a process that has started it)."""
    ctx = mp.get_context("spawn") if spawn else _context(os.environ, pg_backend)
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

