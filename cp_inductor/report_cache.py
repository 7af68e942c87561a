"""The report of a compile AOTAutograd's cache serves.

A restarted job loads its compiled graphs from AOTAutograd's cache (on disk, under Inductor's
cache dir) without running AOTAutograd or Inductor, so our graph passes and analysis do not run
and would record nothing. What a compile records while it runs is stored beside that cache,
under a key of what decides it (the graph Dynamo hands the backend after our Dynamo passes, its
inputs' metadata, our config and source, the backend's arguments, the kernels the machine has),
and replayed when the compile is served:

    cold:   backend -> AOTAutograd -> our joint passes -> forward inner compile   -> store(key, "forward")
            first backward          -> backward inner compile                     -> store(key, "backward")
    warm:   backend -> AOTAutograd cache hit (no inner compile)                   -> replay(load(key))

A hit with nothing stored (a cache dir filled elsewhere, or by a version that stored nothing)
says so in the report.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle

import torch

log = logging.getLogger(__name__)

PARTS = ("forward", "backward")


def key(gm: torch.fx.GraphModule, example_inputs, cfg, mode, options) -> str:
    from .lowerings.cudnn_backward import frontend_fingerprint
    from .lowerings.fa4_attention import installed as fa4_installed
    from .passes.hook_pass import source_hash

    inputs: list[tuple | str] = []  # a tensor's shape, strides, dtype, device and grad flag, else its repr
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            inputs.append((tuple(map(str, t.shape)), tuple(map(str, t.stride())), str(t.dtype), str(t.device),
                           t.requires_grad))
        else:
            inputs.append(repr(t))
    # every subgraph's code too (autograd.Function bodies, a flex mask_mod's graphs): the top
    # graph only names them
    code = "\x01".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))
    parts = [code, repr(inputs), cfg.digest(), source_hash(), torch.__version__, repr(mode),
             repr(sorted((k, repr(v)) for k, v in (options or {}).items())), frontend_fingerprint(),
             repr(fa4_installed())]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _path(key: str, part: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "cp_inductor_reports", f"{key}.{part}.pkl")


def store(key: str, part: str, recorded: list[list]) -> None:
    path = _path(key, part)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(recorded, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir: the compile is fine, a later hit says so
        log.warning("cp_inductor: could not store the report of a compile (%s)", e)


def load(key: str) -> list[list] | None:
    """The stored forward and backward entries, merged; None where neither was stored."""
    merged = None
    for part in PARTS:
        try:
            with open(_path(key, part), "rb") as f:
                recorded = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
            continue
        merged = recorded if merged is None else [a + b for a, b in zip(merged, recorded)]
    return merged
