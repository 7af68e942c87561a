"""One Inductor ``CustomGraphPass`` per hook key: our pipeline's work on that key, then the user's
passes.

torch 2.11 accepts exactly one pass per key (2.13 also a list), so we chain instead of replacing
whatever the user set. ``uuid()`` covers our source and the compile's config snapshot (the very object the pipeline
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


def user_passes(user_pass) -> tuple:
    """The user's passes on a hook key, in order: none, one, or a list (torch 2.13 takes lists)."""
    if user_pass is None:
        return ()
    return tuple(p for p in user_pass if p is not None) if isinstance(user_pass, (list, tuple)) else (user_pass,)


class CPGraphPass(CustomGraphPass):
    """``run(hook, graph, cfg)`` on every graph Inductor hands to ``hook``, then the user's
    passes on that key in their order (``user_pass``: one pass, a list of them, or None)."""

    def __init__(self, hook: str, run, cfg, user_pass=None):
        self.hook = hook
        self.run = run
        self.cfg = cfg
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(self.hook, graph, self.cfg)
        for user_pass in user_passes(self.user_pass):
            user_pass(graph)

    def uuid(self) -> str:
        user = [p.uuid() if hasattr(p, "uuid") else None for p in user_passes(self.user_pass)]
        if None in user:
            # A pass without a uuid makes the graph uncacheable; keep Inductor's behaviour.
            return None  # type: ignore[return-value]
        from ..lowerings.cudnn_backward import frontend_fingerprint
        from ..lowerings.fa4_attention import installed as fa4_installed

        # Whether the cuDNN frontend can run changes the backward graph (cudnn_frontend_backward;
        # its version, read without its import); whether FA4 is installed, which ops the attention
        # provider puts in (a graph cached with FA4's ops must not be served where FA4 is gone).
        parts = [self.hook, source_hash(), self.cfg.digest(), repr(user), frontend_fingerprint(),
                 repr(fa4_installed())]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
