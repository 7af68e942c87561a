"""What every rank's first compile would set up, done once in the fork server the ranks start from.

Imported by the server (``launch._PRELOAD``). On its first compile a process probes which vector
instructions this CPU runs (a compiled test program loaded by a fresh Python) and builds
Inductor's pattern-matcher passes (the fused-attention patterns most of all): about 1.5 s per
rank per launch on a 2-core machine. A rank forked from the server inherits both, and our
backend, which every rank imports next.

The fork must find no thread but the main one (a thread holding a lock, or in malloc, at the
fork leaves the child broken): building the patterns starts tqdm's monitor thread, so the
monitor is switched off first (it only tunes progress bars), and
``tests/test_backend.py`` checks that the warm-up leaves the thread count as it was.
"""

from __future__ import annotations


def warm() -> None:
    import tqdm
    from torch._inductor import cpu_vec_isa
    from torch._inductor.fx_passes import joint_graph, post_grad

    tqdm.tqdm.monitor_interval = 0
    cpu_vec_isa.valid_vec_isa_list()
    joint_graph.lazy_init()
    post_grad.lazy_init()
    # Every rank compiles with our backend: its import (0.2-0.4 s a rank on 2 cores) is paid
    # here once. (Not HF transformers', 2-3 s a rank where a launch builds an HF model: it loads
    # scipy's OpenBLAS, which starts a thread.)
    import cp_inductor.backend  # noqa: F401


warm()
