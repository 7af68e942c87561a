"""Attention over packed documents given as a table of document ids: what a document mask
(``passes/dynamo/document_mask.py``) becomes.

    cu_seqlens, meta = document_plan(doc_ids, positions, check, B, T)
    out, lse = document_attention(q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider)

``doc_ids`` is ``[B, T]`` (or ``[T]``): token ``t`` of row ``b`` belongs to document
``doc_ids[b, t]``; a document is a run of equal ids within a row, so the attention computed is
``same_doc(q, kv) [& kv <= q]`` exactly when every id occurs in one run per row (documents are
contiguous). ``q`` is ``[B, H_q, T, D]``, ``k`` and ``v`` ``[B, H_kv, T, D]`` as SDPA takes them
(``H_q % H_kv == 0``: GQA as is), ``out`` ``[B, H_q, T, D]`` over a ``[B, T, H_q, D]`` buffer.

The plan finds the runs on device without a host sync (a cumulative sum and a scatter into a
``B*T + 1`` buffer padded with ``B*T``) and reads three numbers to the host once per graph, not
per layer: the document count, the longest document, and whether the ids are contiguous (checked
on device when ``check``: runs per row against distinct ids per row; skipped where the graph
proves it; with ``positions``, also that they rise within each document, where the mask is
causal over positions rather than tokens). The attention then runs the packed kernel ``provider`` names (``"fa4"``: FA4 varlen,
``"cudnn"``: cuDNN's ragged SDPA) over ``cu_seqlens[:count + 1]``, the ``[B*T, H, D]`` views of
q, k, v (no copy where they are ``[B, T, H, D]`` underneath, as HF's are). Where the ids turn out
not to be contiguous, or a CUDA graph is being captured (the host cannot read the count then),
both ops compute the masked attention densely instead: slower, never a different answer.
``lse`` is ``[H_q, B*T]`` fp32 (zeros on the dense path, whose backward recomputes).
"""

from __future__ import annotations

import torch

from . import fa4_attention, varlen_attention  # noqa: F401 - define the packed ops we call

PROVIDERS = ("fa4", "cudnn")

_lib = torch.library.Library("cp_inductor", "FRAGMENT")
_lib.define("document_plan(Tensor doc_ids, Tensor? positions, bool check, SymInt rows, SymInt tokens) -> (Tensor, Tensor)")
_lib.define(
    "document_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor meta, Tensor doc_ids, "
    "Tensor? positions, float scale, bool is_causal, str provider) -> (Tensor, Tensor)"
)
_lib.define(
    "document_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_seqlens, Tensor meta, Tensor doc_ids, Tensor? positions, float scale, bool is_causal, str provider) "
    "-> (Tensor, Tensor, Tensor)"
)

_COUNT, _LONGEST, _CONTIGUOUS = range(3)


def _rows(table: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
    """A table of ids or positions as ``[rows, tokens]``: the program reads ``table[b, t]`` (or
    ``table[t]``: one row for all) for ``t < tokens``."""
    table = table.reshape(1, -1) if table.dim() == 1 else table
    return table[:, :tokens].expand(rows, tokens)


@torch.library.register_fake("cp_inductor::document_plan", lib=_lib)
def _(doc_ids, positions, check, rows, tokens):
    return doc_ids.new_empty(rows * tokens + 1, dtype=torch.int32), torch.empty(3, dtype=torch.int64, device="cpu")


@torch.library.impl("cp_inductor::document_plan", "CompositeExplicitAutograd", lib=_lib)
def _plan(doc_ids, positions, check, batch, length):
    rows = _rows(doc_ids, batch, length)
    tokens = rows.numel()
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    starts = starts.reshape(-1)
    rank = torch.cumsum(starts, 0) - 1
    slot = torch.where(starts, rank, tokens + 1)  # run starts to their rank, the rest to a spare slot
    buffer = torch.full((tokens + 2,), tokens, dtype=torch.int32, device=rows.device)
    buffer.scatter_(0, slot, torch.arange(tokens, dtype=torch.int32, device=rows.device))
    cu_seqlens = buffer[: tokens + 1]
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        return cu_seqlens, torch.zeros(3, dtype=torch.int64)  # not contiguous as far as we know: dense path
    longest = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    contiguous = torch.ones((), dtype=torch.bool, device=rows.device)
    if check:
        ordered = rows.sort(dim=1).values
        distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(1) + 1
        contiguous = (starts.reshape(rows.shape).sum(1) == distinct).all()
    if positions is not None:  # causal over positions is causal over tokens where they rise within each document
        p = _rows(positions, batch, length)
        contiguous = contiguous & ((p[:, 1:] > p[:, :-1]) | starts.reshape(rows.shape)[:, 1:]).all()
    meta = torch.stack([rank[-1] + 1, longest.to(rank.dtype), contiguous.to(rank.dtype)]).cpu()
    return cu_seqlens, meta


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H, D] (a view where t is [B, T, H, D] underneath)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] over a [B, T, H, D] buffer: the layout the fake kernels promise."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _unflat(t: torch.Tensor, batch: int) -> torch.Tensor:
    return t.reshape(batch, -1, t.shape[1], t.shape[2]).transpose(1, 2)


def _packed(meta: torch.Tensor) -> bool:
    return bool(meta[_CONTIGUOUS])


def _dense_mask(doc_ids, positions, q, is_causal):
    rows = _rows(doc_ids, q.shape[0], q.shape[2])
    mask = rows[:, None, :, None] == rows[:, None, None, :]
    if is_causal and positions is not None:
        p = _rows(positions, q.shape[0], q.shape[2])
        mask = mask & (p[:, None, None, :] <= p[:, None, :, None])
    elif is_causal:
        p = torch.arange(rows.shape[1], device=rows.device)
        mask = mask & (p[None, :] <= p[:, None])
    return mask


def _dense(q, k, v, doc_ids, positions, scale, is_causal):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_dense_mask(doc_ids, positions, q, is_causal), scale=scale)


def _lengths(cu_seqlens, meta):
    count = int(meta[_COUNT])
    return cu_seqlens[: count + 1], int(meta[_LONGEST])


@torch.library.register_fake("cp_inductor::document_attention", lib=_lib)
def _(q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider):
    batch, heads, tokens = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty((batch, tokens, heads, v.shape[3])).transpose(1, 2)
    return out, q.new_empty((heads, batch * tokens), dtype=torch.float32)


@torch.library.impl("cp_inductor::document_attention", "CompositeExplicitAutograd", lib=_lib)
def _forward(q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider):
    batch, heads, tokens = q.shape[0], q.shape[1], q.shape[2]
    if not _packed(meta):
        out = _bshd(_dense(q, k, v, doc_ids, positions, scale, is_causal))
        return out, q.new_zeros((heads, batch * tokens), dtype=torch.float32)
    cu, longest = _lengths(cu_seqlens, meta)
    qt, kt, vt = _flat(q), _flat(k), _flat(v)
    if provider == "fa4":
        out, lse = torch.ops.cp_inductor.fa4_varlen_attention(qt, kt, vt, cu, cu, None, longest, longest, scale, is_causal)
    else:
        out, lse = torch.ops.cp_inductor.varlen_attention(qt, kt, vt, cu, cu, longest, longest, scale, is_causal)
        lse = lse.t()  # cuDNN's is [tokens, heads]
    return _unflat(out, batch), lse


@torch.library.register_fake("cp_inductor::document_attention_backward", lib=_lib)
def _(grad_out, q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider):
    return tuple(t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).transpose(1, 2) for t in (q, k, v))


@torch.library.impl("cp_inductor::document_attention_backward", "CompositeExplicitAutograd", lib=_lib)
def _backward(grad_out, q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider):
    batch = q.shape[0]
    if not _packed(meta):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            grads = torch.autograd.grad(_dense(*inputs, doc_ids, positions, scale, is_causal), inputs, grad_out)
        return tuple(_bshd(g) for g in grads)
    cu, longest = _lengths(cu_seqlens, meta)
    qt, kt, vt, ot, dot = (_flat(t) for t in (q, k, v, out, grad_out))
    if provider == "fa4":
        grads = torch.ops.cp_inductor.fa4_varlen_attention_backward(
            dot, None, qt, kt, vt, ot, lse, cu, cu, None, longest, longest, scale, is_causal)
    else:
        grads = torch.ops.cp_inductor.varlen_attention_backward(
            dot, qt, kt, vt, ot, lse.t(), cu, cu, longest, longest, scale, is_causal)
    return tuple(_unflat(g, batch) for g in grads)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens, meta, doc_ids, positions)
    ctx.args = (scale, is_causal, provider)


def _autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions = ctx.saved_tensors
    dq, dk, dv = torch.ops.cp_inductor.document_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("cp_inductor::document_attention", _autograd_backward, setup_context=_setup, lib=_lib)
