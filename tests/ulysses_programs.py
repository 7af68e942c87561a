"""A seeded generator of hand-written Ulysses programs, the ways real projects write them, and of
all-to-all programs that are NOT CP attention. Detection must find every region of the first
kind in the forward and the backward graph, and none in the second.

A program is a :class:`Spec` (picklable, so ranks of a gloo run can rebuild it); ``build(spec, cp)``
returns ``(fn, inputs)`` with ``fn(*inputs) -> tensor``: this rank's sequence slice in, this
rank's output out. The choices each spec draws:

* layout of the rank-local tensors (BSHD, BHSD, SBHD);
* where q/k/v come from: plain tensors, per-tensor projections viewed with ``view(B, S, -1, D)``,
  one fused projection split into q, k, v, one packed q/k/v sent through ONE all-to-all and
  unbound, or one tensor used as q = k = v;
* GQA: none, ``enable_gqa``, K/V heads replicated by expand after the collective (HF's
  ``repeat_kv``), or replicated by ``repeat_interleave`` before it (Hkv < cp);
* how heads are scattered (5-D helper style, yunchang's transpose, a flattened 1-D buffer,
  sequence and heads merged then split again with heads and head_dim merged in the buffer, or
  heads dealt round-robin) and gathered back, with or without ``-1`` in the views;
* q = k = v through one all-to-all or three; Megatron-style fused q|k|v heads through one
  all-to-all, cut per rank; K/V replicated by ``expand`` before the collective; a cast to
  float64 around the send;
* the collective: functional (``all_to_all_single_autograd``) or ``dist.all_to_all_single`` into
  ``torch.empty_like`` inside an autograd.Function (DeepSpeed's and yunchang's way);
* activation checkpointing around each layer;
* neighbours: a pointwise op on q after its collective, one on the output before its return, a
  residual, an output projection, a second stacked layer fed by the first's output.

Not CP attention (``kind != "ulysses"``): an MoE token dispatch around an MLP with attention on
local data, an all-to-all of a weight, a batch exchange, heads dealt round-robin, a sequence block
sent as the "head" of a one-head tensor, a head_dim block of a multi-head tensor, heads returned
in the wrong order, k/v heads dealt round-robin against q's blocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch
import torch.utils.checkpoint
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

NOT_CP = ("moe", "weight_a2a", "batch_exchange", "round_robin_heads", "seq_block_one_head",
          "head_dim_block", "wrong_return_order", "kv_round_robin", "moe_combine")


@dataclass(frozen=True)
class Spec:
    seed: int
    kind: str  # "ulysses" or one of NOT_CP
    layout: str = "bshd"
    source: str = "tensors"  # tensors | proj | fused_proj | packed | self
    gqa: str = "mha"  # mha | sdpa | expand | replicate_before
    scatter: str = "five_d"  # five_d | transpose | flat
    gather: str = "five_d"
    infer: bool = False  # -1 in the views
    q_pointwise: bool = False
    out_pointwise: bool = False
    tail: str = "none"  # none | residual | o_proj
    layers: int = 1
    causal: bool = True
    heads: int = 4  # per rank block count: Hq = heads_per_rank * cp
    batch: int = 2
    seq_local: int = 4
    head_dim: int = 8
    collective: str = "funcol"  # funcol | inplace (dist.all_to_all_single into empty_like)
    checkpoint: bool = False  # each layer under activation checkpointing
    heads_order: str = "blocks"  # blocks | round_robin (rank r holds heads r, r + cp, ...)
    send_cast: bool = False  # each scatter's send cast to float64 and back after the collective

    def regions(self) -> int:
        return self.layers if self.kind == "ulysses" else 0


def sample(seed: int, cp: int) -> Spec:
    """A random program; one in four is not CP attention."""
    r = random.Random(seed)
    if r.random() < 0.25:
        spec = Spec(seed, r.choice(NOT_CP), batch=r.choice((1, 2)), heads=r.choice((1, 2)))
        return replace(spec, collective=r.choice(("funcol", "funcol", "inplace")))
    source = r.choice(("tensors", "tensors", "proj", "fused_proj", "packed", "self"))
    gqa = "mha" if source in ("packed", "self") else r.choice(("mha", "sdpa", "expand", "replicate_before"))
    layers = 2 if source in ("tensors", "proj") and gqa == "mha" and r.random() < 0.25 else 1
    layout = "bshd" if source in ("packed", "proj", "fused_proj") else r.choice(("bshd", "bhsd", "sbhd"))
    tail = r.choice(("none", "none", "residual", "o_proj")) if source != "self" else "none"
    spec = Spec(
        seed, "ulysses", layout=layout,
        source=source, gqa=gqa, scatter=r.choice(("five_d", "transpose", "flat")),
        gather=r.choice(("five_d", "transpose", "flat")), infer=r.random() < 0.6,
        q_pointwise=r.random() < 0.2, out_pointwise=r.random() < 0.2,
        tail="none" if tail == "o_proj" and layout != "bshd" else tail,
        layers=layers, causal=r.random() < 0.7, heads=r.choice((1, 2)), batch=r.choice((1, 2)),
    )
    # Drawn last, so the fields above stay what each seed drew before these existed.
    spec = replace(spec, collective=r.choice(("funcol", "funcol", "inplace")), checkpoint=r.random() < 0.2)
    return _later_forms(r, spec)


def _later_forms(r: random.Random, spec: Spec) -> Spec:
    """Forms added after the first generator (drawn after its fields, so earlier seeds keep
    their programs' other choices): q = k = v through ONE all-to-all, Megatron-style fused q|k|v
    heads through one all-to-all and sliced per rank, heads dealt round-robin, GQA K/V replicated
    by expand before the collective, the send cast around the collective."""
    form = r.choice(("same", "same", "self_once", "fused_heads", "round_robin", "expand_before"))
    cast = r.random() < 0.25
    if r.random() < 0.2 and spec.scatter == "five_d" and spec.heads_order == "blocks":
        spec = replace(spec, scatter="resplit")
    if form == "self_once":
        spec = replace(spec, source="self_once", gqa="mha", tail="none", layers=1)
    elif form == "fused_heads":
        gqa = r.choice(("mha", "sdpa"))
        spec = replace(spec, source="fused_heads", gqa=gqa, layout="bshd", heads=2 if gqa == "sdpa" else spec.heads,
                       layers=1, tail="none" if spec.tail == "residual" else spec.tail)
    elif form == "round_robin" and spec.source in ("tensors", "proj", "self", "self_once") and spec.gqa == "mha":
        spec = replace(spec, heads_order="round_robin", scatter="five_d", gather="five_d", layout="bshd",
                       tail="none" if spec.tail == "o_proj" else spec.tail)
    elif form == "expand_before" and spec.source in ("tensors", "proj"):
        spec = replace(spec, gqa="expand_before")
    return replace(spec, send_cast=cast and spec.source not in ("packed",))


# --- the pieces users write -----------------------------------------------------------------


class _InplaceAllToAll(torch.autograd.Function):
    """DeepSpeed/yunchang style: ``dist.all_to_all_single`` into ``torch.empty_like``."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=dist.group.WORLD)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _InplaceAllToAll.apply(grad.contiguous())


def _a2a(spec, x):
    if spec.collective == "inplace":
        return _InplaceAllToAll.apply(x.contiguous())
    return funcol.all_to_all_single_autograd(x, None, None, dist.group.WORLD)


def _to_bshd(x, layout):
    return {"bshd": x, "bhsd": x.transpose(1, 2), "sbhd": x.transpose(0, 1)}[layout]


def _from_bshd(x, layout):
    return {"bshd": x, "bhsd": x.transpose(1, 2), "sbhd": x.transpose(0, 1)}[layout]


def _send(spec, x):
    """The collective, with the send cast to float64 and back if the spec says so."""
    if spec.send_cast:
        return _a2a(spec, x.to(torch.float64)).to(x.dtype)
    return _a2a(spec, x)


def scatter(x, spec: Spec, cp: int, layout: str):
    """Rank-local ``x`` in ``layout`` -> [B, H/cp, S, D] for attention."""
    if spec.heads_order == "round_robin":  # rank r gets heads r, r + cp, ...; sequence rank-major
        b, s_l, h, d = _to_bshd(x, layout).shape
        send = _to_bshd(x, layout).reshape(b, s_l, h // cp, cp, d).permute(3, 0, 1, 2, 4).contiguous()
        return _send(spec, send).permute(1, 3, 0, 2, 4).reshape(b, h // cp, cp * s_l, d)
    if spec.send_cast:
        spec = replace(spec, send_cast=False)
        x = x.to(torch.float64)
        return scatter(x, spec, cp, layout).to(torch.float32)
    if spec.scatter == "five_d" and layout == "bhsd":
        b, h, s_l, d = x.shape
        send = x.reshape(b, cp, -1 if spec.infer else h // cp, s_l, d).transpose(0, 1).contiguous()
        return _a2a(spec, send).permute(1, 2, 0, 3, 4).reshape(b, -1 if spec.infer else h // cp, cp * s_l, d)
    if spec.scatter == "five_d" and layout == "sbhd":
        s_l, b, h, d = x.shape
        send = x.reshape(s_l, b, cp, -1 if spec.infer else h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
        return _a2a(spec, send).reshape(cp * s_l, b, h // cp, d).permute(1, 2, 0, 3)
    x = _to_bshd(x, layout)
    b, s_l, h, d = x.shape
    hl = -1 if spec.infer else h // cp
    if spec.scatter == "transpose":
        send = x.reshape(b, s_l, cp, hl, d).transpose(0, 2).contiguous()  # [cp, S/cp, B, H/cp, D]
        recv = _a2a(spec, send).reshape(-1 if spec.infer else cp * s_l, b, h // cp, d)
        return recv.transpose(0, 1).contiguous().transpose(1, 2)
    if spec.scatter == "resplit":  # sequence and heads merged, then split again around the rank
        send = x.reshape(b, s_l * h, d).reshape(b, s_l, cp, hl, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = _a2a(spec, send.reshape(cp, b, s_l, -1))  # heads and head_dim merged in the buffer
        return recv.reshape(cp, b, s_l, h // cp, d).permute(1, 3, 0, 2, 4).reshape(b, hl, cp * s_l, d)
    send = x.reshape(b, s_l, cp, hl, d).permute(2, 0, 1, 3, 4).contiguous()
    if spec.scatter == "flat":
        recv = _a2a(spec, send.view(-1)).view(cp, b, s_l, h // cp, d)
    else:
        recv = _a2a(spec, send)
    return recv.permute(1, 3, 0, 2, 4).reshape(b, hl, cp * s_l, d)


def gather(o, spec: Spec, cp: int, layout: str):
    """[B, H/cp, S, D] -> this rank's slice with all heads, in ``layout``."""
    b, hl, s, d = o.shape
    s_l = s // cp
    if spec.heads_order == "round_robin":  # back as head i * cp + r
        send = o.reshape(b, hl, cp, s_l, d).permute(2, 0, 3, 1, 4).contiguous()
        return _from_bshd(_a2a(spec, send).permute(1, 2, 3, 0, 4).reshape(b, s_l, hl * cp, d), layout)
    if spec.gather == "transpose":  # yunchang: heads to dim 0, back as [H, S/cp, B, D]
        send = o.transpose(1, 2).reshape(b, cp, s_l, hl, d).transpose(0, 3).transpose(0, 1).contiguous()
        out = _a2a(spec, send).reshape(-1, s_l, b, d).transpose(0, 2).contiguous().reshape(b, s_l, -1 if spec.infer else cp * hl, d)
    else:
        send = o.reshape(b, hl, cp, s_l, d).permute(2, 0, 3, 1, 4).contiguous()
        if spec.gather == "flat":
            recv = _a2a(spec, send.view(-1)).view(cp, b, s_l, hl, d)
        else:
            recv = _a2a(spec, send)
        out = recv.permute(1, 2, 0, 3, 4).reshape(b, s_l, -1 if spec.infer else cp * hl, d)
    return _from_bshd(out, layout)


def _replicate_heads(x, rep):  # HF's repeat_kv: [B, Hkv, S, D] -> [B, Hkv * rep, S, D]
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)


def ulysses_layer(q, k, v, spec: Spec, cp: int):
    layout = spec.layout
    h_dim = {"bshd": 2, "bhsd": 1, "sbhd": 2}[layout]
    if spec.gqa == "replicate_before":
        k, v = (t.repeat_interleave(cp // t.shape[h_dim], dim=h_dim) for t in (k, v))
    if spec.gqa == "expand_before":  # HF's repeat_kv on the rank-local tensors, then the scatter
        rep = q.shape[h_dim] // k.shape[h_dim]
        k, v = (t.unsqueeze(h_dim + 1).expand(*t.shape[:h_dim + 1], rep, *t.shape[h_dim + 1:]).flatten(h_dim, h_dim + 1)
                for t in (k, v))
    if spec.source == "self_once":  # q = k = v: one all-to-all
        qh = scatter(q, spec, cp, layout)
        o = F.scaled_dot_product_attention(qh, qh, qh, is_causal=spec.causal)
        return gather(o * 1.5 if spec.out_pointwise else o, spec, cp, layout)
    qh, kh, vh = (scatter(t, spec, cp, layout) for t in (q, k, v))
    if spec.gqa == "expand":
        kh, vh = (_replicate_heads(t, qh.shape[1] // t.shape[1]) for t in (kh, vh))
    scale = 1.0 / qh.shape[-1] ** 0.5
    if spec.q_pointwise:
        qh, scale = qh * 0.5, 2 * scale
    o = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=spec.causal, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1]
    )
    if spec.out_pointwise:
        o = o * 1.5
    return gather(o, spec, cp, layout)


def packed_layer(qkv, spec: Spec, cp: int):
    """q, k, v packed [B, S/cp, 3, H, D] and sent through ONE all-to-all (yunchang's packed path)."""
    b, s_l, _, h, d = qkv.shape
    send = qkv.reshape(b, s_l, 3, cp, h // cp, d).permute(3, 1, 2, 0, 4, 5).contiguous()  # [cp, S/cp, 3, B, H/cp, D]
    recv = _a2a(spec, send).reshape(cp * s_l, 3, b, h // cp, d).permute(1, 2, 3, 0, 4)  # [3, B, H/cp, S, D]
    q, k, v = recv.unbind(0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal)
    return gather(o * 1.5 if spec.out_pointwise else o, spec, cp, "bshd")


def fused_heads_layer(qkv, spec: Spec, cp: int, hq: int, hkv: int):
    """Megatron-style: one projection's heads ``[B, S/cp, cp x (q | k | v heads of a rank), D]``
    through ONE all-to-all, then each rank cuts its q, k and v heads out of its block."""
    hq_l, hkv_l = hq // cp, hkv // cp
    heads = scatter(qkv, replace(spec, heads_order="blocks"), cp, "bshd")  # [B, hq_l + 2 hkv_l, S, D]
    q, k, v = heads.split([hq_l, hkv_l, hkv_l], dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=spec.causal, enable_gqa=hq_l != hkv_l)
    return gather(o * 1.5 if spec.out_pointwise else o, replace(spec, heads_order="blocks"), cp, "bshd")


# --- programs ---------------------------------------------------------------------------------


def build(spec: Spec, cp: int, generator: torch.Generator | None = None):
    g = generator or torch.Generator().manual_seed(spec.seed)
    mk = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if spec.kind != "ulysses":
        return _not_cp(spec, cp, mk)
    b, s_l, d = spec.batch, spec.seq_local, spec.head_dim
    hq = spec.heads * cp
    hkv = {"mha": hq, "sdpa": hq // 2 if hq % (2 * cp) == 0 else hq, "expand": hq // 2 if hq % (2 * cp) == 0 else hq,
           "expand_before": hq // 2 if hq % 2 == 0 else hq, "replicate_before": 1}[spec.gqa]
    if spec.gqa == "replicate_before" and cp == 1:
        hkv = hq

    def shaped(h):
        return {"bshd": (b, s_l, h, d), "bhsd": (b, h, s_l, d), "sbhd": (s_l, b, h, d)}[spec.layout]

    if spec.source == "packed":
        inputs = [mk(b, s_l, 3, hq, d)]
        layer = lambda qkv: packed_layer(qkv, spec, cp)  # noqa: E731
        fn = layer
    elif spec.source in ("self", "self_once"):
        inputs = [mk(*shaped(hq))]
        fn = lambda x: ulysses_layer(x, x, x, spec, cp)  # noqa: E731
    elif spec.source == "fused_heads":
        e = hq * d
        inputs = [mk(b, s_l, e), mk(e, (hq + 2 * hkv) * d) / e**0.5]

        def fn(x, w):
            out = fused_heads_layer((x @ w).view(b, s_l, -1, d), spec, cp, hq, hkv)
            return out + x.view(b, s_l, hq, d) if spec.tail == "residual" else out
    elif spec.source in ("proj", "fused_proj"):
        e = hq * d
        x = mk(b, s_l, e)
        if spec.source == "proj":
            inputs = [x, mk(e, hq * d) / e**0.5, mk(e, hkv * d) / e**0.5, mk(e, hkv * d) / e**0.5]

            def fn(x, wq, wk, wv):
                q, k, v = ((x @ w).view(b, s_l, -1, d) for w in (wq, wk, wv))
                return _layers(q, k, v, spec, cp, x)
        else:
            inputs = [x, mk(e, (hq + 2 * hkv) * d) / e**0.5]

            def fn(x, w):
                q, k, v = (x @ w).view(b, s_l, -1, d).split([hq, hkv, hkv], dim=2)
                return _layers(q, k, v, spec, cp, x)
    else:
        inputs = [mk(*shaped(hq)), mk(*shaped(hkv)), mk(*shaped(hkv))]
        fn = lambda q, k, v: _layers(q, k, v, spec, cp, None)  # noqa: E731
    if spec.tail == "o_proj":  # BSHD output flattened into an output projection
        inputs.append(mk(hq * d, hq * d) / (hq * d) ** 0.5)
        inner = fn

        def fn(*args):
            return inner(*args[:-1]).flatten(-2) @ args[-1]
    return fn, [t.requires_grad_() for t in inputs]


def _layers(q, k, v, spec, cp, x):
    def layer(q, k, v):
        if spec.checkpoint:
            return torch.utils.checkpoint.checkpoint(ulysses_layer, q, k, v, spec, cp, use_reentrant=False)
        return ulysses_layer(q, k, v, spec, cp)

    out = layer(q, k, v)
    if spec.layers == 2:
        out = layer(out, out * 0.5, torch.tanh(out))
    if spec.tail == "residual" and out.shape == q.shape:
        out = out + q
    return out


def _not_cp(spec: Spec, cp: int, mk):
    b, s_l, d, h = spec.batch, 8, 8, spec.heads * cp

    def attend(q, k, v, causal=True):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    if spec.kind == "moe":  # tokens to experts and back around an MLP; attention on local data
        def fn(x, w):
            routed = _a2a(spec, x.reshape(b * s_l, -1))
            y = _a2a(spec, torch.relu(routed @ w)).reshape(b, s_l, -1, d).transpose(1, 2)
            return attend(y, y, y)
        return fn, [mk(b, s_l, h * d).requires_grad_(), mk(h * d, h * d).requires_grad_()]
    if spec.kind == "moe_combine":  # token dispatch, an expert MLP, then the expert output's
        # heads split by a second all-to-all, as a Ulysses scatter would: its rows are tokens
        # the dispatch brought from other ranks, not this rank's sequence
        def fn(x, w):
            routed = _a2a(spec, x.reshape(b * s_l, -1))
            y = torch.relu(routed @ w).view(b, s_l, -1, d).permute(2, 1, 0, 3).contiguous()  # [H, S, B, D]
            recv = _a2a(spec, y)
            hl = recv.shape[0] // cp
            q = recv.view(cp, hl, s_l, b, d).permute(3, 1, 0, 2, 4).reshape(b, hl, cp * s_l, d)
            return gather(attend(q, q, q), replace(spec, kind="ulysses"), cp, "bshd")
        return fn, [mk(b, s_l, h * d).requires_grad_(), mk(h * d, h * d).requires_grad_()]
    if spec.kind == "weight_a2a":
        def fn(x, w):
            w = _a2a(spec, w)
            y = (x @ w).reshape(b, s_l, -1, d).transpose(1, 2)
            return attend(y, y, y)
        return fn, [mk(b, s_l, h * d).requires_grad_(), mk(h * d, h * d).requires_grad_()]
    if spec.kind == "batch_exchange":
        def fn(q, k, v):
            q, k, v = (_a2a(spec, t.contiguous()) for t in (q, k, v))
            return _a2a(spec, attend(q, k, v).contiguous())
        return fn, [mk(b * cp, h, s_l, d).requires_grad_() for _ in range(3)]
    if spec.kind == "round_robin_heads":  # rank r gets heads r, r+cp, ...; sequence inner-major
        def sc(x):
            send = x.reshape(b, s_l, h // cp, cp, d).permute(3, 0, 1, 2, 4).contiguous()
            return _a2a(spec, send).permute(1, 3, 2, 0, 4).reshape(b, h // cp, s_l * cp, d)

        def fn(q, k, v):
            o = attend(sc(q), sc(k), sc(v))
            send = o.reshape(b, h // cp, s_l, cp, d).permute(3, 0, 2, 1, 4).contiguous()
            return _a2a(spec, send).permute(1, 2, 3, 0, 4).reshape(b, s_l, h, d)
        return fn, [mk(b, s_l, h, d).requires_grad_() for _ in range(3)]
    if spec.kind == "seq_block_one_head":  # one head; a block of the sequence goes to each rank
        def sc(x):
            send = x.reshape(b, cp, s_l // cp, 1, d).permute(1, 0, 2, 3, 4).contiguous()
            return _a2a(spec, send).permute(1, 3, 0, 2, 4).reshape(b, 1, s_l, d)

        def fn(q, k, v):
            o = attend(sc(q), sc(k), sc(v))
            return _a2a(spec, o.reshape(b, 1, cp, s_l // cp, d).permute(2, 0, 1, 3, 4).contiguous())
        return fn, [mk(b, s_l, 1, d).requires_grad_() for _ in range(3)]
    if spec.kind == "head_dim_block":  # each rank gets a block of head_dim of every head
        hh = max(h, 2)

        def sc(x):
            send = x.reshape(b, s_l, hh, cp, d // cp).permute(3, 0, 1, 2, 4).contiguous()
            return _a2a(spec, send).permute(1, 3, 0, 2, 4).reshape(b, hh, cp * s_l, d // cp)

        def fn(q, k, v):
            o = attend(sc(q), sc(k), sc(v))
            send = o.reshape(b, hh, cp, s_l, d // cp).permute(2, 0, 3, 1, 4).contiguous()
            return _a2a(spec, send).permute(1, 2, 3, 0, 4).reshape(b, s_l, hh, d)
        return fn, [mk(b, s_l, hh, d).requires_grad_() for _ in range(3)]
    hh = max(spec.heads, 2) * cp
    spec_ok = Spec(spec.seed, "ulysses", heads=hh // cp)
    if spec.kind == "wrong_return_order":  # heads merged as (H/cp, cp) on the way back
        def fn(q, k, v):
            o = attend(*(scatter(t, spec_ok, cp, "bshd") for t in (q, k, v)))
            hl = o.shape[1]
            send = o.reshape(b, hl, cp, s_l, d).permute(2, 0, 3, 1, 4).contiguous()
            return _a2a(spec, send).permute(1, 2, 3, 0, 4).reshape(b, s_l, hl * cp, d)
        return fn, [mk(b, s_l, hh, d).requires_grad_() for _ in range(3)]
    assert spec.kind == "kv_round_robin"  # q by blocks, k/v heads dealt round-robin

    def sc_rr(x):
        send = x.reshape(b, s_l, hh // cp, cp, d).permute(3, 0, 1, 2, 4).contiguous()
        return _a2a(spec, send).permute(1, 3, 0, 2, 4).reshape(b, hh // cp, cp * s_l, d)

    def fn(q, k, v):
        o = attend(scatter(q, spec_ok, cp, "bshd"), sc_rr(k), sc_rr(v))
        return gather(o, spec_ok, cp, "bshd")
    return fn, [mk(b, s_l, hh, d).requires_grad_() for _ in range(3)]


def check_programs(rank: int, cp: int, specs: list, options: dict | None = None) -> list:
    """On a gloo rank: each program compiled with cp_inductor vs eager on this rank's inputs
    (outputs and every gradient, max relative error), and what the passes rewrote."""
    from torch._dynamo.utils import counters

    out = []
    for spec in specs:
        fn, inputs = build(spec, cp, torch.Generator().manual_seed(spec.seed * 100 + rank))
        grad = torch.randn_like(fn(*[t.detach() for t in inputs]), dtype=torch.float32)
        results = []
        for run in (fn, torch.compile(fn, backend="cp_inductor", fullgraph=True, options=options)):
            xs = [t.detach().clone().requires_grad_() for t in inputs]
            y = run(*xs)
            y.backward(grad.to(y.dtype))
            results.append([y.detach()] + [x.grad for x in xs])
        err = max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(results[1], results[0]))
        out.append({"spec": spec, "max_rel_err": err, "rewritten": dict(counters["cp_inductor"])})
        torch._dynamo.reset()
        counters.clear()
        dist.barrier()
    return out
