"""What every rank's first compile would set up, done once in the fork server the ranks start from.

Imported by the server (``launch._PRELOAD``). On its first compile a process probes this CPU's
vector instructions (a compiled test program loaded by a fresh Python: a torch import) and builds
Inductor's pattern-matcher passes (the fused-attention patterns most of all): about 3 s per rank
on a 2-core machine, paid by every rank of every gloo launch. A rank forked from the server
inherits both. Nothing here starts a thread, which forking would not survive.
"""

from __future__ import annotations


def _warm() -> None:
    from torch._inductor import cpu_vec_isa
    from torch._inductor.fx_passes import joint_graph, post_grad

    cpu_vec_isa.valid_vec_isa_list()
    joint_graph.lazy_init()
    post_grad.lazy_init()


_warm()
