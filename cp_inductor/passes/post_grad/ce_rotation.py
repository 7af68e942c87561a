"""ce_rotation: a ring's rotations travel by the copy engines, so the rotation for the next step
moves while this step's attention holds every SM (NCCL's kernels starve there).

Before (each rotation of a region's K/V or dK/dV)::

    all_to_all_single(buf, out_splits = one-hot at src, in_splits = one-hot at dst) -> wait -> recv

After::

    ce_rotate_start(buf, dst, src, slot) -> ... -> ce_all_to_all_wait(token, buf, slot) -> recv

started as soon as the buffer exists and waited where the rotated data is first read, so the
step's attention in between runs while the rotation travels (the traced programs start it after
that attention, as a hand-written ring does, or wait before it, as native CP's does). ``dst``/``src`` are this rank's
neighbours, read from the split sizes the program traced. The forward's rotations are those that
carry K and V (both, where they rotate separately), the backward's those that carry dK/dV.

Needs the copy-engine transport (the report says why not where it cannot run) and rotations of
at least ``ce_rotation_min_bytes``. On by default: what it was measured to give is in
``docs/passes/ce_rotation.md``.
"""

from __future__ import annotations

import torch
import torch.fx

from ..editing.fx_emit import Emitter
from ..analysis.graph_walk import node_order
from ..detect.ring import RingMatch, chained_rotations
from ..record import POST_GRAD, RegionPass, size_text
from .transport import Sender, copy_engine_unavailable, only_wait, retire

NAME = "ce_rotation"


def _pending(region: RingMatch) -> list:
    """The region's rotations still on NCCL, and those that send their data on (every rank must
    move the same collectives: ``chained_rotations``), each with its one wait (None: read
    otherwise)."""
    return [(rot, only_wait(rot)) for rot in chained_rotations(region)]


def why_not(region: RingMatch, cfg, verdicts) -> str | None:
    pending = _pending(region)
    if not pending:
        return "no rotation moves this op's K/V (step 0: the next step's region carries it)"
    if any(wait is None for _, wait in pending):
        return "rotation result used other than through one wait"
    unavailable = copy_engine_unavailable(region)
    if unavailable:
        return unavailable
    smallest = min(_nbytes(rot.args[0]) for rot, _ in pending)
    if smallest < cfg.ce_rotation_min_bytes:
        return (f"a rotation of {size_text(smallest)} is below ce_rotation_min_bytes "
                f"({size_text(cfg.ce_rotation_min_bytes)}, the smallest measured faster than NCCL)")
    return None


def _nbytes(buf: torch.fx.Node) -> int:
    val = buf.meta["val"]
    return val.numel() * val.element_size()


def apply(graph: torch.fx.Graph, region: RingMatch, cfg) -> list:
    sender = Sender(graph, "copy_engine", region.cp, region.group_name)
    replaced = []
    for rot, wait in _pending(region):
        buf, out_splits, in_splits = rot.args[:3]
        src = next(i for i, n in enumerate(out_splits) if n)
        dst = next(i for i, n in enumerate(in_splits) if n)
        order = node_order(graph)
        # Start as soon as the buffer exists, wait where the rotated data is first read: the
        # attention in between is what the transfer hides under.
        start_at = buf.next
        while start_at.op == "placeholder":
            start_at = start_at.next
        started = sender.start_rotation(Emitter(graph, start_at), buf, dst, src)
        # (A rank may receive data nothing reads, native CP causal without load balance at
        # cp > 2: it still takes part in the transfer, waited where the old wait was.)
        emit = Emitter(graph, min(wait.users, key=order.__getitem__) if wait.users else wait)
        replaced += retire(graph, emit, rot, wait, sender.wait(emit, started))
    return replaced


def detail(region: RingMatch, cfg) -> str:
    return f"{len(_pending(region))} rotation(s) -> copy engines"


# The emitted order is the overlap; Inductor's peak-memory reordering would move the ops.
PASS = RegionPass(
    NAME, stage=POST_GRAD, styles=("ring",), why_not=why_not, apply=apply, detail=detail,
    inductor_patches={"reorder_for_peak_memory": False},
)
