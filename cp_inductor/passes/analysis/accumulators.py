"""What becomes of a backward region's dK/dV accumulators: an analysis note of the report, not a
rewrite (dropping the zero fill, or reusing the first contribution as the accumulator, would
remove what Inductor already removes).

A backward region's dK/dV contributions (one per attention call that read gathered keys) reach
the reduce-scatter through scatters into a zero full-sequence gradient, adds and the reorder
back to the gathered layout::

    full(0) -> slice_scatter(., dK_prefix_a, [0, a)) -+
    full(0) -> slice_scatter(., dK_prefix_b, [0, b)) -+-> add -> reorder -> reduce_scatter

Inductor inlines the zero ``full`` into its consumers and fuses the scatters, adds and reorder
into the kernel that writes the reduce-scatter's input: the generated code has no fill and no
add-into-zero, and reads each contribution once (``tests/test_accumulators.py`` checks the
generated code). Nothing is left to remove, and the report's note says so.

A ring's backward is the same at each step: the step's dK/dV are added into the accumulator
that arrived with the K/V block (native CP starts it from ``zeros_like``), concatenated and
rotated on; Inductor writes each rotation's input with one kernel, the zeros inlined.

Where a partial accumulator is materialized (read by an op Inductor cannot fuse into that
kernel) the note names the op: that fill and that add stay.
"""

from __future__ import annotations

import torch
import torch.fx

from .graph_walk import Walk, node_order
from .layout_algebra import is_layout_op
from .op_schema import bind
from .sdpa_ops import tuple_outputs

aten = torch.ops.aten
# Where a dK/dV accumulator leaves: the all-gather's reduce-scatter, a ring's rotation.
_COLLECTIVES = (
    torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_to_all_single.default,
)
_SCATTERS = (aten.slice_scatter.default, aten.select_scatter.default)
# Ops Inductor fuses with the gradient on its way to the collective's input kernel, besides
# layout ops and pointwise ops.
_FUSED = _SCATTERS + (
    aten.cat.default, aten.sum.dim_IntList, aten.flip.default, torch.ops.prims.rev.default, aten.constant_pad_nd.default,
    aten.index_select.default, aten.index.Tensor,  # rows gathered (indirect loads in the same kernel)
)

def _fused(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return is_layout_op(node) or node.target in _FUSED or torch.Tag.pointwise in getattr(node.target, "tags", ())


def materialized_at(attention: torch.fx.Node) -> torch.fx.Node | None:
    """The first op (graph order) that reads a partial dK/dV accumulator or a zero fill of this
    backward attention op's gradients without being fusable into the kernel that writes the
    input of the collective it leaves by; None when everything from dK/dV to it fuses."""
    outs = tuple_outputs(attention)
    blockers = []
    fused_readers = Walk([outs[i] for i in (1, 2) if i in outs],
                         lambda n: [u for u in n.users if u.target not in _COLLECTIVES and _fused(u)], limit=float("inf"))
    for node in fused_readers:
        if node.target in _SCATTERS:  # the zero (or partial) gradient a contribution is scattered into
            blockers += [u for u in node.args[0].users if not _fused(u) and u.target not in _COLLECTIVES]
        blockers += [u for u in node.users if u.target not in _COLLECTIVES and not _fused(u)]
    if not blockers:
        return None
    order = node_order(attention.graph)
    return min(blockers, key=order.__getitem__)


def _in_place_reads(attention: torch.fx.Node) -> str:
    """What a call reading the gathered keys in place (FA4 with ``seqused_k``) adds: its dK/dV
    cover the whole gathered buffer, the rows it does not read zeroed inside the op."""
    fa4 = getattr(torch.ops.cp_inductor, "fa4_varlen_attention_backward", None)
    if fa4 is None or attention.target is not fa4.default or bind(attention).get("seqused_k") is None:
        return ""
    return "; this call reads keys in place (seqused_k): its dK/dV span the gathered K/V and the op zero-fills the rows it does not read"


def note(match) -> str | None:
    """The report's note on a K/V all-gather or ring backward region's dK/dV accumulators."""
    if match.direction != "backward" or match.style not in ("allgather", "ring"):
        return None
    into = "reduce-scatter" if match.style == "allgather" else "rotation"
    blocker = materialized_at(match.attention)
    if blocker is None:
        return (f"dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the "
                f"kernel that writes the {into} input (no fill, no add-into-zero){_in_place_reads(match.attention)}")
    return f"dK/dV accumulators: a partial one is materialized before {blocker.target}: its zero fill and add stay"
