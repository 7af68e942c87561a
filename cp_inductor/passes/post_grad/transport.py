"""How the rewrites emit a collective exchange: NCCL's all-to-all, or the copy-engine ops of
``lowerings/ce_transport.py`` (start/wait pairs whose NVLink crossing needs no SM), and whether
the copy engines can run for a region (the reason when not)."""

from __future__ import annotations

import torch
import torch.fx

from ..editing.fx_emit import Emitter
from ..analysis.sdpa_ops import bound_args
from ..analysis.sym_sizes import exact_div, hint, size_of

c10d = torch.ops._c10d_functional


def copy_engine_unavailable(region) -> str | None:
    """Why the copy-engine transport cannot run for ``region`` (its group and device), or None."""
    from ...lowerings import ce_transport

    device = region.attention.args[0].meta["val"].device.type
    return ce_transport.why_unavailable(region.group_name, device)


def transport_choice(region, cfg) -> tuple[str, str]:
    """(transport, why) for the all-to-alls head_overlap emits: ``cfg.head_overlap_transport``, or
    "nccl" where the copy engines cannot run (the reason says why); "auto": the copy engines where
    the region's attention is long enough to hide their host-side work
    (``head_overlap_transport_min_tflop``)."""
    transport, min_tflop = cfg.head_overlap_transport, cfg.head_overlap_transport_min_tflop
    if transport not in ("copy_engine", "nccl", "auto"):
        return "nccl", f"unknown transport {transport!r}"
    if transport == "nccl":
        return "nccl", "config"
    reason = copy_engine_unavailable(region)
    if reason:
        return "nccl", reason
    if transport == "auto":
        work = attention_tflop(region)
        verdict = ">=" if work >= min_tflop else "<"
        why = f"attention {work:.2g} TFLOP {verdict} head_overlap_transport_min_tflop {min_tflop:g}"
        return ("copy_engine" if verdict == ">=" else "nccl"), why
    return "copy_engine", "copy engines and symmetric memory available"


def attention_tflop(region) -> float:
    """The region's attention on this rank, forward FLOPs (4 B H Sq Sk D, half where causal)."""
    args = bound_args(region.attention)
    q, k = args["query"].meta["val"], args["key"].meta["val"]
    b, h, sq, d = (hint(size_of(x)) for x in q.shape)  # symbolic: at the traced sizes
    flop = 4 * b * h * sq * hint(size_of(k.shape[2])) * d * (0.5 if region.is_causal else 1.0)
    return flop / 1e12


def only_wait(collective: torch.fx.Node) -> torch.fx.Node | None:
    """The one ``wait_tensor`` that is ``collective``'s only user, else None (a rewrite that
    moves the collective must see every reader of its result)."""
    users = list(collective.users)
    if len(users) == 1 and users[0].target is c10d.wait_tensor.default:
        return users[0]
    return None


def retire(graph: torch.fx.Graph, emit: Emitter, collective: torch.fx.Node, wait: torch.fx.Node, value) -> list:
    """``wait``'s readers read ``value`` instead; the NCCL collective and its wait leave the
    graph. Returns what ``emit`` replaced (for the check)."""
    emit.replace(wait, value)
    graph.erase_node(wait)
    graph.erase_node(collective)
    return emit.replaced


def all_to_all(emit: Emitter, buf, cp: int, group: str) -> torch.fx.Node:
    """Equal-split all_to_all_single of ``buf`` along dim 0 (the caller waits on it)."""
    splits = [exact_div(size_of(buf.meta["val"].shape[0]), cp)] * cp
    return emit(c10d.all_to_all_single.default, buf, splits, splits, group)


class Sender:
    """Emits the all-to-alls of one rewrite as start/wait pairs on one transport: NCCL's
    ``all_to_all_single`` + ``wait_tensor``, or the copy-engine ops, each start with a slot no
    other transfer of the graph has (they may all be in flight together)."""

    def __init__(self, graph: torch.fx.Graph, transport: str, cp: int, group: str):
        self.transport, self.cp, self.group = transport, cp, group
        self.slots = 0
        if transport == "copy_engine":
            starts = (_ce_op("ce_all_to_all_start"), _ce_op("ce_rotate_start"))
            self.slots = sum(len(graph.find_nodes(op="call_function", target=t)) for t in starts)

    def start(self, emit: Emitter, buf) -> tuple:
        if self.transport == "nccl":
            return (all_to_all(emit, buf, self.cp, self.group),)
        self.slots += 1
        slot = self.slots - 1
        return (emit(_ce_op("ce_all_to_all_start"), buf, slot, self.group), buf, slot)

    def start_rotation(self, emit: Emitter, buf, dst: int, src: int) -> tuple:
        """A ring rotation (all of ``buf`` to rank ``dst``, ``src``'s back) on the copy engines."""
        self.slots += 1
        return (emit(_ce_op("ce_rotate_start"), buf, dst, src, self.slots - 1, self.group), buf, self.slots - 1)

    def wait(self, emit: Emitter, started: tuple) -> torch.fx.Node:
        if self.transport == "nccl":
            return emit(c10d.wait_tensor.default, started[0])
        token, buf, slot = started
        return emit(_ce_op("ce_all_to_all_wait"), token, buf, slot, self.group)


def _ce_op(name: str):
    from ...lowerings import ce_transport  # noqa: F401 - defines the ops

    return getattr(torch.ops.cp_inductor, name).default
