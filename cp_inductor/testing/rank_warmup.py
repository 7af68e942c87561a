"""What every rank's first compile would set up, done once in the fork server the ranks start from.

Imported by the server (``launch._PRELOAD``). On its first compile a process probes which vector
instructions this CPU runs (a compiled test program loaded by a fresh Python), builds
Inductor's pattern-matcher passes (the fused-attention patterns most of all) for the device of
its inputs, and hashes Triton's sources (every cache key holds the hash): seconds per rank per
launch on a 2-core machine (docs/measurements.md). A rank forked from the server inherits all
three, and our backend, which every rank imports next.

The fork must find no thread but the main one (a thread holding a lock, or in malloc, at the
fork leaves the child broken): building the patterns starts tqdm's monitor thread, so the
monitor is switched off first (it only tunes progress bars), and
``tests/test_backend.py`` checks that the warm-up leaves the thread count as it was.
"""

from __future__ import annotations


def warm() -> None:
    import torch
    import tqdm
    from torch._inductor import codecache, cpu_vec_isa
    from torch._inductor.fx_passes import joint_graph, post_grad

    tqdm.tqdm.monitor_interval = 0
    cpu_vec_isa.valid_vec_isa_list()
    joint_graph.lazy_init(torch.device("cpu"))  # as the joint graph's passes call it on CPU inputs
    post_grad.lazy_init()
    codecache.triton_key()  # a hash of Triton's sources, in every cache key (0.3 s)
    # Every rank compiles with our backend: its import (0.2-0.4 s a rank on 2 cores) is paid
    # here once. (Not HF transformers', 2-3 s a rank where a launch builds an HF model: it loads
    # scipy's OpenBLAS, which starts a thread.)
    import cp_inductor.backend  # noqa: F401


warm()
