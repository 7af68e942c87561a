"""Programs with packed documents the tests and benchmarks share: torchtitan's flex form."""

from __future__ import annotations

import torch


def document_causal_block_mask(doc: torch.Tensor, seq_len: int, device):
    """A flex BlockMask of ``and_masks(causal, same document)`` over ``doc`` (``[B, T]`` ids),
    as torchtitan builds it for packed documents."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return create_block_mask(and_masks(_causal, same_document), doc.shape[0], None, seq_len, seq_len, device=device)


class _MeshOf:
    """What torch's CP block-mask builder reads of a DeviceMesh: one rank's place in a CP group
    (a single process builds any rank's mask)."""

    def __init__(self, cp: int, rank: int, device_type: str):
        self.cp, self.rank, self.device_type = cp, rank, device_type

    def size(self) -> int:
        return self.cp

    def get_local_rank(self) -> int:
        return self.rank


BALANCES = ("none", "headtail", "ptrr")


def cp_document_block_mask(doc: torch.Tensor, cp: int, rank: int, balance: str, device, mesh=None,
                           compile_builder: bool = False, form: str = "ids"):
    """Rank ``rank``'s BlockMask of torch's flex CP (what torchtitan's ``cp_shard`` hands each
    rank): the document-causal mask over ``doc`` (``[B, T]``) with its queries sharded, tokens
    rearranged first by ``balance`` (``"none"``, ``"headtail"``, ``"ptrr"``). Returns the mask
    and the rearrangement (``[T]``: the pack position of each rearranged token). torch compiles
    the mask's builder; ``compile_builder=False`` builds the same mask eagerly (tests on CPU).
    ``form``: the document-causal mask written with ids, or with a table of document ``"starts"``
    or ``"ends"`` (from positions restarting at 0 per document)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )
    from torch.nn.attention.flex_attention import create_block_mask

    batch, tokens = doc.shape
    index = torch.arange(tokens, device=doc.device).expand(batch, tokens)
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    positions = index - torch.where(first, index, 0).cummax(1).values  # each token's place in its document
    full = {"ids": lambda: document_causal_block_mask(doc, tokens, device),
            "starts": lambda: document_start_block_mask(positions, device),
            "ends": lambda: document_end_block_mask(positions, device)}[form]()
    balancer = {"none": None, "headtail": lambda: _HeadTailLoadBalancer(tokens, cp, device),
                "ptrr": lambda: _PTRRLoadBalancer(full, cp)}[balance]
    balancer = balancer() if balancer is not None else None
    saved = (_attention._compiled_create_block_mask, _attention._cp_options.enable_load_balance)
    try:
        if not compile_builder:
            _attention._compiled_create_block_mask = create_block_mask
        _attention._cp_options.enable_load_balance = balancer is not None
        mesh = mesh if mesh is not None else _MeshOf(cp, rank, torch.device(device).type)
        block_mask = _attention._create_cp_block_mask(full.mask_mod, batch, 1, tokens, tokens, mesh, balancer)
    finally:
        _attention._compiled_create_block_mask, _attention._cp_options.enable_load_balance = saved
    order = balancer._generate_indices()[0] if balancer is not None else torch.arange(tokens, device=device)
    return block_mask, order.to(device)


def flex_cp_attention(q, k, v, block_mask, group_name: str):
    """torch's flex CP attention as torchtitan runs it: this rank's K/V all-gathered by
    ``cplib::flex_cp_allgather`` along the sequence, flex_attention of the local queries over them."""
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather
    from torch.nn.attention.flex_attention import flex_attention

    k_all, v_all = flex_cp_allgather(k.contiguous(), v.contiguous(), 2, group_name)
    return flex_attention(q, k_all, v_all, block_mask=block_mask, enable_gqa=True)


def document_start_block_mask(positions: torch.Tensor, device):
    """A BlockMask over one packed row, ``positions`` ``[1, T]`` restarting at 0 per document:
    causal, and keys from the query's document's first token on (a table of each document's
    start read at the query's document: a packed-document fast path as torchtitan writes one)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    length = positions.shape[1]
    begins = positions[0] == 0
    doc = torch.cumsum(begins.int(), 0) - 1
    first = torch.full((length,), length, dtype=torch.int64, device=positions.device)
    first[doc[begins].long()] = torch.arange(length, device=positions.device)[begins]

    def from_document_start(b, h, q_idx, kv_idx):
        return kv_idx >= first[doc[q_idx]]

    return create_block_mask(and_masks(_causal, from_document_start), 1, None, length, length, device=device)


def document_end_block_mask(positions: torch.Tensor, device):
    """A BlockMask over packed rows, ``positions`` ``[B, T]``: causal, and queries up to the
    key's document's last token (each token's document end, a reversed running minimum of the
    ends)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    batch, length = positions.shape
    last = torch.ones_like(positions, dtype=torch.bool)
    last[:, :-1] = positions[:, 1:] == 0
    index = torch.arange(length, device=positions.device).expand(batch, length)
    ends = torch.where(last, index, length).flip(1).cummin(1).values.flip(1)

    def to_document_end(b, h, q_idx, kv_idx):
        return q_idx <= ends[b, kv_idx]

    return create_block_mask(and_masks(_causal, to_document_end), batch, None, length, length, device=device)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def compile_masked(fn, *args):
    """``fn(*args)`` compiled under cp_inductor (strict, CPU reference kernels standing in for
    FA4 and cuDNN) and the report's lines about masked attention calls."""
    import cp_inductor
    from cp_inductor.lowerings.varlen_attention import reference_kernels

    cp_inductor.clear_report()
    torch._dynamo.reset()
    with reference_kernels(), cp_inductor.config.patch(strict=True):
        out = torch.compile(fn, backend="cp_inductor", fullgraph=True)(*args)
    return out, [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
