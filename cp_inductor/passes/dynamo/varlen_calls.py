"""Packed-sequence (THD) attention calls on the graph Dynamo hands the backend: found, their
arguments read by the op's schema names (which differ between torch versions: 2.11 has no
``enable_gqa`` and no paged-inference arguments), the checks every lowering of them shares, and
the K/V head repeat a program makes only to feed them.

The calls: ``torch_attn::_varlen_attn``, aten's flash forward given ``cum_seq_q``, and
flash-attn's varlen op inside its autograd.Function (``flash_attn_calls``), all read under
``torch_attn::_varlen_attn``'s argument names.
Used by the rewrites that lower them, in pipeline order: ``uniform_thd`` (equal lengths to dense
SDPA), then ``varlen_cudnn`` (any lengths to cuDNN's ragged SDPA).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ...lowerings import fa4_attention, varlen_attention  # noqa: F401 - define the ops read here
from ...reporting import VarlenRoute
from . import flash_attn_calls
from ..analysis.collectives import KNOWN_ALL_TO_ALLS
from ..analysis.graph_walk import Walk
from ..analysis.op_schema import bind, qualname, value
from ..analysis.sdpa_ops import registered

KEPT = "kept"

# aten's flash-attention forward, called directly: varlen when cum_seq_q is given; its dense form
# is left to the dense passes.
ATEN_FLASH = "aten::_flash_attention_forward"


def _varlen_ops() -> tuple:
    ops = (torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_forward.default)
    varlen = registered("torch_attn::_varlen_attn")  # in a graph only where the program imported it
    return ops if varlen is None else (*ops, varlen.overloadpacket, varlen)


def _normalized(node: torch.fx.Node) -> dict | None:
    """The call's arguments under ``torch_attn::_varlen_attn``'s schema names (aten's flash op
    renamed; its dropout, ALiBi and debug-mask arguments kept for the checks), or None for a
    dense call of aten's op."""
    args = _bind(node)
    if qualname(node.target) != ATEN_FLASH:
        return args
    if args.get("cum_seq_q") is None:
        return None
    left, right = args.get("window_size_left"), args.get("window_size_right")
    window = None if left in (None, -1) and right in (None, -1) else [-1 if left is None else left, -1 if right is None else right]
    cu_k = args.get("cum_seq_k")
    return {
        "query": args["query"], "key": args["key"], "value": args["value"], "cu_seq_q": args["cum_seq_q"],
        "cu_seq_k": args["cum_seq_q"] if cu_k is None else cu_k, "max_q": args["max_q"], "max_k": args["max_k"],
        "is_causal": args["is_causal"], "scale": args.get("scale"), "window_size": window,
        **{name: args.get(name) for name in ("seqused_k", "block_table", "num_splits", "alibi_slopes")},
        "dropout_p": args.get("dropout_p", 0.0), "return_debug_mask": args.get("return_debug_mask", False),
    }


@dataclass
class VarlenCall:
    """One varlen attention call and where it went."""

    node: torch.fx.Node
    name: str  # the program's node, for the report
    args: dict  # schema name -> argument (defaults filled in)
    is_causal: bool
    lengths: str = "unknown"  # "proven" | "promised" | "unknown"
    path: str = KEPT
    reasons: dict = field(default_factory=dict)  # rewrite -> why it did not take the call
    repeat_dropped: bool = False  # K/V heads were repeated only to feed the call
    style: str = "local"  # "a2a": an all-to-all delivers its tokens (Ulysses over the pack)
    inserted: tuple = ()  # nodes reading the call put in (a packed Function's q, k, v views)
    provider: str = "program"  # the kernel a lowering chose (attention_provider), and why
    provider_reason: str = ""

    @property
    def query(self):
        return value(self.args["query"])

    def route(self) -> VarlenRoute:
        detail = "causal" if self.is_causal else "full"
        if self.repeat_dropped:
            detail += ", K/V head repeat dropped"
        reason = "; ".join(f"{k}: {v}" for k, v in self.reasons.items()) if self.path == KEPT else self.provider_reason
        return VarlenRoute(self.name, self.style, self.lengths, detail, self.path, reason)


def _bind(node: torch.fx.Node) -> dict:
    bound = bind(node)
    if "cu_seq_q" in bound and bound.get("cu_seq_k") is None:
        bound["cu_seq_k"] = bound["cu_seq_q"]
    return bound


_ALL_TO_ALLS = {"_c10d_functional::all_to_all_single"} | {k.qualname for k in KNOWN_ALL_TO_ALLS}
# The forms an all-gather takes on the graph Dynamo hands the backend (functional, autograd
# functional, the in-place ops torch.distributed.nn traces to).
_ALL_GATHERS = {
    "_c10d_functional::all_gather_into_tensor", "_c10d_functional_autograd::all_gather_into_tensor",
    "c10d::allgather_", "c10d::_allgather_base_",
}
_NEAR = 64  # nodes: a Ulysses all-to-all or the K/V all-gather sits a few relabelling ops above attention


def _calls(node: torch.fx.Node, names: set) -> bool:
    """Whether ``node`` is one of the ops ``names``, or a higher-order op (an autograd.Function
    the program gathers in: Megatron's form) whose subgraphs call one."""
    if node.op != "call_function":
        return False
    if qualname(node.target) in names:
        return True
    module = node.graph.owning_module
    bodies = [getattr(module, a.target, None) for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    return any(isinstance(b, torch.fx.GraphModule) and any(_calls(n, names) for n in b.graph.nodes) for b in bodies)


def _collective_above(start: torch.fx.Node, names: set) -> bool:
    above = Walk([start], lambda n: () if _calls(n, names) else n.all_input_nodes, limit=_NEAR)
    return any(_calls(n, names) for n in above)


def _style(query: torch.fx.Node, key) -> str:
    """"a2a" when an all-to-all delivers the query within a few ops, "allgather" when an
    all-gather delivers the keys (the post-grad detectors then prove the region, or say why
    not), else "local": the report's first word on the call."""
    if _collective_above(query, _ALL_TO_ALLS):
        return "a2a"
    if isinstance(key, torch.fx.Node) and _collective_above(key, _ALL_GATHERS):
        return "allgather"
    return "local"


def find(gm: torch.fx.GraphModule) -> list[VarlenCall]:
    """The varlen calls of ``gm``: ``torch_attn::_varlen_attn``, aten's flash forward with
    ``cum_seq_q``, and flash-attn's varlen op (in its autograd.Function or called directly;
    one the lowerings cannot take is kept with its reason)."""
    ops = _varlen_ops()
    calls = []
    for node in gm.graph.nodes:
        name, reasons, inserted = node.name, {}, ()
        if node.op == "call_function" and node.target in ops:
            args = _normalized(node)
        elif (flash := flash_attn_calls.read_function(gm, node)) is not None:
            name, args, inserted = flash.name, flash.args, flash.inserted
            if args is None:
                args, reasons = {"is_causal": flash.is_causal}, {"varlen": flash.why_kept}
        else:
            continue
        if args is None:
            continue
        causal = bool(args.get("is_causal", False)) or list(args.get("window_size") or []) == [-1, 0]
        style = _style(args["query"], args.get("key")) if isinstance(args.get("query"), torch.fx.Node) else "local"
        calls.append(VarlenCall(node, name, args, causal, reasons=reasons, style=style, inserted=inserted))
    return calls


def fa4_calls(gm: torch.fx.GraphModule) -> list[VarlenRoute]:
    """The program's own FA4 calls (``flash_attn.cute``, traced as our ops by
    ``lowerings/fa4_functions.py``): they stay on the program's kernel (FA4 measured fastest on
    47 of 48 packed buckets, ``cost_data/``); one report line each, packed or dense."""
    routes = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _FA4_OPS:
            packed = node.target in _FA4_OPS[:2]
            causal = "causal" if node.args[-1] else "full"
            reason = "the program calls FA4 (flash_attn.cute), in the graph as our op; kept on it"
            routes.append(VarlenRoute(node.name, "local", "unknown" if packed else "-", f"{causal}, FA4 as written", "fa4",
                                      reason, layout="thd" if packed else "bshd"))
    return routes


_FA4_OPS = (torch.ops.cp_inductor.fa4_varlen_attention, torch.ops.cp_inductor.fa4_varlen_attention.default,
            torch.ops.cp_inductor.fa4_sdpa, torch.ops.cp_inductor.fa4_sdpa.default)


def shared_reason(call: VarlenCall) -> str | None:
    """What keeps a call on the program's op whatever the lowering."""
    a = call.args
    window = list(a.get("window_size") or [-1, -1])
    if window not in ([-1, -1], [-1, 0]):
        return f"sliding window {window} (only none or causal)"
    for name in ("seqused_k", "block_table", "num_splits", "leftpad_k"):
        if a.get(name) is not None and not (name == "num_splits" and a[name] == 1):  # one split: the plain kernel
            return f"{name} is given (paged or split-KV inference)"
    if a.get("softcap"):
        return f"softcap {a['softcap']}"
    if a.get("dropout_p"):
        return f"dropout {a['dropout_p']}"
    if a.get("alibi_slopes") is not None:
        return "ALiBi slopes are given"
    if a.get("return_debug_mask"):
        return "the program asks for the debug attention mask"
    users = {u.args[1] for u in call.node.users if u.target is operator.getitem}
    if users - {0} or len(users) != len(call.node.users):
        return "the program reads the log-sum-exp or the RNG state"
    q, k, v = (value(a[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return "q, k and v are not [tokens, heads, head_dim]"
    if isinstance(q.shape[1], int) and isinstance(k.shape[1], int) and q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads"
    return None


def head_repeat(node, groups: int):
    """The input of ``x.repeat_interleave(groups, dim=1)`` when that is all ``node`` is, else None."""
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
        return None
    is_method = node.op == "call_method" and node.target == "repeat_interleave"
    is_function = node.op == "call_function" and node.target in (torch.repeat_interleave, torch.Tensor.repeat_interleave)
    if not (is_method or is_function) or len(node.args) < 2:
        return None
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
    if node.args[1] != groups or dim not in (1, -2) or node.kwargs.get("output_size") is not None:
        return None
    return node.args[0]


def unrepeated_kv(call: VarlenCall):
    """(k, v) before a K/V head repeat made only to feed the call (GQA), or the call's own."""
    k, v = call.args["key"], call.args["value"]
    q_heads = call.query.shape[1]
    if value(k) is not None and value(k).shape[1] == q_heads:
        for groups in range(2, q_heads + 1):
            if q_heads % groups:
                continue
            k0, v0 = head_repeat(k, groups), head_repeat(v, groups)
            if k0 is not None and v0 is not None and value(k0).shape[1] * groups == q_heads:
                return k0, v0
    return k, v


def replace(gm: torch.fx.GraphModule, call: VarlenCall, build, path: str) -> None:
    """Put ``build(k, v) -> out node`` (inserted before the call) where the call's output was;
    drop the call and a K/V head repeat only it read."""
    k, v = unrepeated_kv(call)
    with gm.graph.inserting_before(call.node):
        out = build(k, v)
    for user in list(call.node.users):  # getitem 0: the output
        user.replace_all_uses_with(out)
        gm.graph.erase_node(user)
    bodies = [a for a in call.node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    gm.graph.erase_node(call.node)
    for body in bodies:  # an autograd.Function's forward and backward subgraphs
        if not body.users:
            gm.graph.erase_node(body)
    call.repeat_dropped = k is not call.args["key"]
    for dead in ((call.args["key"], call.args["value"]) if call.repeat_dropped else ()):
        if not dead.users:
            gm.graph.erase_node(dead)
    call.path = path


def scale(call: VarlenCall) -> float:
    s = call.args.get("scale")
    return float(s) if s is not None else call.query.shape[-1] ** -0.5
