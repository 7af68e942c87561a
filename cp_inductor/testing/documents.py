"""Programs with packed documents the tests and benchmarks share: torchtitan's flex form."""

from __future__ import annotations

import torch


def document_causal_block_mask(doc: torch.Tensor, seq_len: int, device):
    """A flex BlockMask of ``and_masks(causal, same document)`` over ``doc`` (``[B, T]`` ids),
    as torchtitan builds it for packed documents."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    return create_block_mask(and_masks(causal, same_document), doc.shape[0], None, seq_len, seq_len, device=device)
