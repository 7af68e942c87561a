"""The all-to-alls detection understands: PyTorch's functional collective and third-party custom
ops with known semantics, from one small table.

``_c10d_functional.all_to_all_single`` is the one our rewrites can replace (it has a separate
``wait_tensor`` Inductor schedules). A third-party op that is an equal-split all-to-all on dim 0
(DeepSpeed's ``deepspeed::dim_zero_all_to_all``, the op DeepSpeed's HF Ulysses integration
hides its exchange in) is recognized as what it is, so its regions are found and reported; it is
opaque to Inductor (it waits inside), so the rewrites leave it alone and say so.

To teach detection another op, add one :class:`KnownAllToAll` row: the op's qualified name,
which argument is the tensor and which names the process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .op_schema import qualname

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class KnownAllToAll:
    """A custom op that is ``all_to_all_single`` with equal splits along dim 0."""

    qualname: str  # "namespace::name"
    input_arg: int
    group_arg: int  # an argument holding the c10d group name


KNOWN_ALL_TO_ALLS = (
    KnownAllToAll("deepspeed::dim_zero_all_to_all", input_arg=0, group_arg=1),
)
# keyed by str | None: looked up with qualname(target), which is None for a target that is no op
_BY_NAME: dict[str | None, KnownAllToAll] = {k.qualname: k for k in KNOWN_ALL_TO_ALLS}


@dataclass(frozen=True)
class Collective:
    """One all-to-all in a graph, whichever op spells it."""

    node: torch.fx.Node  # the op
    wait: torch.fx.Node  # where the received tensor is ready (the op itself when it waits inside)
    input: torch.fx.Node
    group_name: str
    splits: tuple  # (output_split_sizes, input_split_sizes); None for equal splits
    opaque: str | None  # why our rewrites cannot replace it, or None


def collective_at(node) -> Collective | None:
    """The all-to-all whose received tensor ``node`` is (a wait, or a known op), or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is c10d.wait_tensor.default:
        src = node.args[0]
        if isinstance(src, torch.fx.Node) and src.target is c10d.all_to_all_single.default:
            inp, out_splits, in_splits, group = src.args[:4]
            return Collective(src, node, inp, group, (out_splits, in_splits), None)
        return None
    known = _BY_NAME.get(qualname(node.target))
    if known is None:
        return None
    return Collective(
        node, node, node.args[known.input_arg], node.args[known.group_arg], (None, None),
        f"the all_to_all is the opaque custom op {known.qualname}",
    )


def collective_of(node) -> Collective | None:
    """The all-to-all that ``node`` is the op of (its input side), or None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is c10d.all_to_all_single.default:
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        return collective_at(waits[0]) if len(waits) == 1 else None
    if qualname(node.target) in _BY_NAME:
        return collective_at(node)
    return None
