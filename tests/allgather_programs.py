"""A seeded generator of hand-written K/V all-gather programs, the ways real projects write them,
and of all-gather programs that are NOT CP attention. Detection must find every attention of the
first kind in the forward and the backward graph, and none in the second; every all-gather
rewrite, forced on, must apply or step aside with a reason, never fail.

A program is a :class:`Spec` (picklable); ``build(spec, cp)`` returns ``(fn, inputs)`` with
``fn(*inputs) -> tensor``: this rank's sequence slice in, this rank's output out. The choices:

* layout of the rank-local tensors (BSHD, BHSD) and where q/k/v come from (tensors, or
  projections of one hidden state viewed with ``view(B, S, -1, D)``);
* the gather: ``funcol.all_gather_tensor_autograd`` on dim 0 (sequence moved there and back) or
  on the sequence dim, ``dist.all_gather_into_tensor`` into a fresh buffer or ``dist.all_gather``
  into a list inside an autograd.Function whose backward is ``dist.reduce_scatter_tensor``; K and
  V gathered apart or stacked into one gather;
* GQA: none, ``enable_gqa``, K/V heads replicated after the gather by ``repeat_interleave`` or
  by expand + reshape (Hugging Face's ``repeat_kv``);
* masking: none (DiT style), causal over contiguous shards (a boolean mask offset by the rank),
  causal over load-balanced shards (rank r holds chunks r and 2cp-1-r: the gathered keys put in
  sequence order by chunk reorders, one mask for both local chunks), or the package's own
  ``allgather_attention`` inside the program (prefix calls merged with local causal calls);
* neighbours: an output projection, a residual, a second layer, activation checkpointing.

Not CP attention (``kind != "allgather"``): a weight gathered for a matmul (FSDP style) with
attention on local data, q gathered too (every rank attends the whole sequence), only K
gathered, the output gathered after local attention, a mask gathered for local attention.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
import torch.utils.checkpoint

NOT_CP = ("weight_gather", "gathered_q", "k_only", "output_gather", "mask_gather")
GATHERS = ("funcol_dim0", "funcol_seq", "inplace", "list")


@dataclass(frozen=True)
class Spec:
    seed: int
    kind: str  # "allgather" or one of NOT_CP
    layout: str = "bshd"
    source: str = "tensors"  # tensors | proj
    gather: str = "funcol_dim0"  # GATHERS
    stacked: bool = False  # k and v through one gather
    gqa: str = "mha"  # mha | sdpa | repeat | expand
    mask: str = "none"  # none | causal | balanced | helper
    tail: str = "none"  # none | o_proj | residual
    layers: int = 1
    checkpoint: bool = False
    batch: int = 1
    seq_local: int = 8
    heads: int = 4
    head_dim: int = 8

    @property
    def kv_heads(self) -> int:
        return self.heads if self.gqa == "mha" else self.heads // 2

    def regions(self) -> int:
        return self.layers if self.kind == "allgather" else 0


def sample(seed: int, cp: int) -> Spec:
    """A random program; one in four is not CP attention."""
    r = random.Random(seed)
    if r.random() < 0.25:
        return Spec(seed, r.choice(NOT_CP), gather=r.choice(GATHERS), batch=r.choice((1, 2)))
    source = r.choice(("tensors", "tensors", "proj"))
    return Spec(
        seed, "allgather", layout="bshd" if source == "proj" else r.choice(("bshd", "bhsd")), source=source,
        gather=r.choice(GATHERS), stacked=r.random() < 0.3, gqa=r.choice(("mha", "sdpa", "repeat", "expand")),
        mask=r.choice(("none", "causal", "balanced", "helper")), tail=r.choice(("none", "o_proj", "residual")) if source == "proj" else "none",
        layers=2 if r.random() < 0.2 else 1, checkpoint=r.random() < 0.2, batch=r.choice((1, 2)),
    )


# --- the gathers users write --------------------------------------------------------------------


def _cp() -> int:
    return dist.get_world_size()


def _reduce_scatter0(grad: torch.Tensor) -> torch.Tensor:
    out = grad.new_empty((grad.shape[0] // _cp(), *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad.contiguous())
    return out


class _IntoTensor(torch.autograd.Function):
    """``dist.all_gather_into_tensor`` on dim 0 into a fresh buffer; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((_cp() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter0(grad)


class _IntoList(torch.autograd.Function):
    """``dist.all_gather`` into a list, concatenated on dim 0; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(_cp())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter0(grad)


def gather_seq(x: torch.Tensor, seq_dim: int, how: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``seq_dim`` in rank order."""
    if how == "funcol_seq":
        return funcol.all_gather_tensor_autograd(x.contiguous(), seq_dim, dist.group.WORLD)
    x0 = x.movedim(seq_dim, 0).contiguous()
    if how == "funcol_dim0":
        g = funcol.all_gather_tensor_autograd(x0, 0, dist.group.WORLD)
    else:
        g = (_IntoTensor if how == "inplace" else _IntoList).apply(x0)
    return g.movedim(0, seq_dim)


# --- attention over gathered keys ------------------------------------------------------------------


def _positions(spec: Spec, cp: int, s_l: int) -> torch.Tensor:
    """Global sequence positions of this rank's queries."""
    rank = dist.get_rank()
    if spec.mask == "balanced":
        half = s_l // 2
        return torch.cat([torch.arange(half) + rank * half, torch.arange(half) + (2 * cp - 1 - rank) * half])
    return torch.arange(s_l) + rank * s_l


def _in_sequence_order(kv: torch.Tensor, spec: Spec, cp: int) -> torch.Tensor:
    """Gathered ``[B, H, cp*S/cp, D]`` in rank order -> keys in sequence order (load balanced:
    rank r's halves are chunks r and 2cp-1-r)."""
    if spec.mask != "balanced":
        return kv
    chunks = kv.chunk(2 * cp, dim=2)  # rank r's halves at 2r, 2r+1
    order = [chunks[2 * c] for c in range(cp)] + [chunks[2 * (2 * cp - 1 - c) + 1] for c in range(cp, 2 * cp)]
    return torch.cat(order, dim=2)


def attention(q, k, v, spec: Spec, cp: int):
    """Rank-local q, k, v in ``spec.layout`` -> attention over every rank's keys, q's layout."""
    if spec.mask == "helper":
        from cp_inductor.parallel import allgather_attention

        return allgather_attention(q, k, v, layout=spec.layout, is_causal=True)
    bhsd = (lambda t: t) if spec.layout == "bhsd" else (lambda t: t.transpose(1, 2))
    seq_dim = 2 if spec.layout == "bhsd" else 1
    if spec.stacked:
        kv = gather_seq(torch.stack([k, v]), seq_dim + 1, spec.gather)
        k, v = kv.unbind(0)
    else:
        k, v = gather_seq(k, seq_dim, spec.gather), gather_seq(v, seq_dim, spec.gather)
    qh, kh, vh = bhsd(q), bhsd(k), bhsd(v)
    kh, vh = _in_sequence_order(kh, spec, cp), _in_sequence_order(vh, spec, cp)
    rep = qh.shape[1] // kh.shape[1]
    if spec.gqa == "repeat":
        kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
    elif spec.gqa == "expand":
        b, h, s, d = kh.shape
        kh, vh = (t[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d) for t in (kh, vh))
    mask = None
    if spec.mask != "none":
        mask = torch.arange(kh.shape[2])[None, :] <= _positions(spec, cp, qh.shape[2])[:, None]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=qh.shape[1] != kh.shape[1])
    return bhsd(o)


def _not_cp(spec: Spec, cp: int, q, k, v, w):
    """Programs with all-gathers that are not K/V of CP attention."""
    bhsd = (lambda t: t) if spec.layout == "bhsd" else (lambda t: t.transpose(1, 2))
    if spec.kind == "weight_gather":  # FSDP: a weight shard gathered for a matmul
        w_full = gather_seq(w, 0, spec.gather)  # [cp * rows, cols]
        q = (q.flatten(-2) @ w_full[: q.shape[-1] * q.shape[-2]]).view_as(q)
        return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v)))
    if spec.kind == "gathered_q":  # every rank attends over the whole sequence
        q, k, v = (gather_seq(t, 1, spec.gather) for t in (q, k, v))
        return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v)))
    if spec.kind == "k_only":  # keys gathered, values tiled locally
        k = gather_seq(k, 1, spec.gather)
        v = torch.cat([v] * cp, dim=1)
        return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v)))
    if spec.kind == "output_gather":  # local attention, output gathered afterwards
        o = bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v)))
        return gather_seq(o, 1, spec.gather)[:, : q.shape[1]] * 2
    # mask_gather: a per-token bias gathered, attention on local keys
    bias = gather_seq(w[: q.shape[1], :1].reshape(1, -1, 1, 1).expand(q.shape[0], -1, 1, 1), 1, spec.gather)
    mask = bias[:, : q.shape[1], 0, 0][:, None, None, :].expand(-1, q.shape[2], q.shape[1], -1)
    return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), attn_mask=mask))


def build(spec: Spec, cp: int, gen: torch.Generator | None = None):
    """``(fn, inputs)`` for this rank (inputs drawn from ``gen``)."""
    gen = gen or torch.Generator().manual_seed(spec.seed)
    b, s_l, h, hkv, d = spec.batch, spec.seq_local, spec.heads, spec.kv_heads, spec.head_dim
    mk = lambda *shape: torch.randn(*shape, generator=gen, requires_grad=True)  # noqa: E731
    if spec.kind != "allgather":
        q, k, v = mk(b, s_l, h, d), mk(b, s_l, h, d), mk(b, s_l, h, d)
        w = mk(h * d // cp + (h * d) % cp, h * d)
        return (lambda q, k, v, w: _not_cp(spec, cp, q, k, v, w)), [q, k, v, w]

    def layer(q, k, v):
        return attention(q, k, v, spec, cp)

    run = (lambda *a: torch.utils.checkpoint.checkpoint(layer, *a, use_reentrant=False)) if spec.checkpoint else layer
    if spec.source == "tensors":
        shape = (b, s_l, h, d) if spec.layout == "bshd" else (b, h, s_l, d)
        kv_shape = (b, s_l, hkv, d) if spec.layout == "bshd" else (b, hkv, s_l, d)
        q, k, v = mk(*shape), mk(*kv_shape), mk(*kv_shape)

        def fn(q, k, v):
            out = run(q, k, v)
            for _ in range(spec.layers - 1):
                out = run(out, k, v)
            return out

        return fn, [q, k, v]
    x = mk(b, s_l, h * d)
    wq, wk, wv, wo = mk(h * d, h * d), mk(h * d, hkv * d), mk(h * d, hkv * d), mk(h * d, h * d)

    def proj_fn(x, wq, wk, wv, wo):
        for _ in range(spec.layers):
            q, k, v = ((x @ w).view(b, s_l, -1, d) for w in (wq, wk, wv))
            o = run(q, k, v).reshape(b, s_l, h * d)
            if spec.tail == "o_proj":
                o = o @ wo
            x = x + o if spec.tail == "residual" else o
        return x

    return proj_fn, [x, wq, wk, wv, wo]
