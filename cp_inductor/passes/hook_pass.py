"""One Inductor ``CustomGraphPass`` per hook key: our pipeline's work on that key, then the user's
pass.

torch 2.11 accepts exactly one pass per key, so we chain instead of replacing whatever the user
set. ``uuid()`` covers our source and the compile's config snapshot (the very object the pipeline
reads), so the FX graph cache neither misses needlessly nor serves code compiled under another
config.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

_PACKAGE = Path(__file__).resolve().parent.parent


@functools.cache
def source_hash() -> str:
    h = hashlib.sha256()
    # the measured maps the passes choose from count as source
    for path in sorted([*_PACKAGE.rglob("*.py"), *_PACKAGE.rglob("cost_data/*.json")]):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class CPGraphPass(CustomGraphPass):
    """``run(hook, graph, cfg)`` on every graph Inductor hands to ``hook``, then ``user_pass``."""

    def __init__(self, hook: str, run, cfg, user_pass=None):
        self.hook = hook
        self.run = run
        self.cfg = cfg
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(self.hook, graph, self.cfg)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> str:
        user = None
        if self.user_pass is not None:
            user = self.user_pass.uuid() if hasattr(self.user_pass, "uuid") else None
            if user is None:
                # A pass without a uuid makes the graph uncacheable; keep Inductor's behaviour.
                return None  # type: ignore[return-value]
        from ..lowerings.cudnn_backward import unavailable
        from ..lowerings.fa4_attention import installed as fa4_installed

        # Whether the cuDNN frontend can run changes the backward graph (cudnn_frontend_backward);
        # whether FA4 is installed, which ops the attention provider puts in (a graph cached with
        # FA4's ops must not be served where FA4 is gone).
        parts = [self.hook, source_hash(), self.cfg.digest(), repr(user), repr(unavailable() is None),
                 repr(fa4_installed())]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
