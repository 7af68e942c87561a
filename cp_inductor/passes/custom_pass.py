"""One Inductor ``CustomGraphPass`` per hook key: our passes in order, then the user's.

torch 2.11 accepts exactly one pass per key, so we chain instead of replacing whatever the user
set. ``uuid()`` covers our source and the config snapshot, so the FX graph cache neither misses
needlessly nor serves code compiled under another config.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import config

_PACKAGE = Path(__file__).resolve().parent.parent


@functools.cache
def source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(_PACKAGE)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(repr(sorted(cfg.items())).encode()).hexdigest()


class CPGraphPass(CustomGraphPass):
    def __init__(self, hook: str, passes: list, cfg: dict, user_pass=None):
        self.hook = hook
        self.passes = list(passes)
        self.cfg = dict(cfg)
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        with config.patch(self.cfg):
            for p in self.passes:
                p(graph)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> str:
        user = None
        if self.user_pass is not None:
            user = self.user_pass.uuid() if hasattr(self.user_pass, "uuid") else None
            if user is None:
                # A pass without a uuid makes the graph uncacheable; keep Inductor's behaviour.
                return None  # type: ignore[return-value]
        parts = [self.hook, source_hash(), config_hash(self.cfg), repr(user)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
