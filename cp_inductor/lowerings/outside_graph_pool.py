"""Work that must not allocate from a CUDA graph's memory pool, run on a helper thread.

cudagraph trees' warm-up run sends every allocation of the calling thread to the graphs' memory
pool (``torch._C._cuda_beginAllocateCurrentThreadToPool``). What a warm-up call sets up for good
- a transport's send areas, a cuDNN graph being built - would be reported there as leaked, or
would break the pool's accounting of the outputs, and later be overwritten by a replay. A
helper thread's allocations are not routed to the pool.
"""

from __future__ import annotations

import concurrent.futures

import torch


def outside_graph_pool(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a helper thread with this thread's current CUDA device."""
    device = torch.cuda.current_device()

    def run():
        torch.cuda.set_device(device)
        return fn(*args, **kwargs)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()
