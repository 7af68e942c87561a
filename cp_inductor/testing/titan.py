"""A decoder written the way torchtitan's users get one (no torchtitan import): documents from
the EOS tokens of the batch, a BlockMask of causal and same-document built once per step by a
compiled ``create_block_mask``, ``flex_attention`` behind a class-level ``torch.compile`` (nested
in the block's own compile, as torchtitan's wrapper is), each block compiled on its own.

    model = Decoder(vocab, dim, layers, heads, kv_heads)
    compile_blocks(model, backend="cp_inductor")
    logits = model(tokens, block_mask=document_causal_mask(tokens, eos_id))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

_compiled_flex = torch.compile(flex_attention)
_compiled_create_block_mask = torch.compile(create_block_mask)


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[B, T]`` int32: a token's document is the number of EOS tokens before it."""
    ends = tokens == eos_id
    ends[:, -1] = True
    before = torch.cumsum(ends.int(), dim=1)
    ids = torch.zeros_like(before, dtype=torch.int32)
    ids[:, 1:] = before[:, :-1]
    return ids


def document_causal_mask(tokens: torch.Tensor, eos_id: int):
    ids = document_ids(tokens, eos_id)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def same_document(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    batch, length = tokens.shape
    return _compiled_create_block_mask(and_masks(causal, same_document), batch, None, length, length,
                                       device=tokens.device)


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form (``angles``: ``[T, 1, D]`` cos and sin, concatenated)."""
    cos, sin = angles.chunk(2, dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


def flex_attend(q, k, v, block_mask):
    """``[B, H, T, D]`` attention under the step's BlockMask (GQA as is)."""
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


class Attention(nn.Module):
    attend = staticmethod(flex_attend)  # a benchmark's floor swaps in another kernel

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, angles, block_mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim)
        q, k = _rotate(q, angles), _rotate(k, angles)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        hidden = 4 * dim
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x, angles, block_mask):
        x = x + self.attention(self.attention_norm(x), angles, block_mask)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, max_len: int = 1 << 17):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, kv_heads) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        freqs = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        phase = torch.outer(torch.arange(max_len).float(), freqs).repeat(1, 2)
        self.register_buffer("angles", torch.cat([phase.cos(), phase.sin()], dim=-1), persistent=False)

    def forward(self, tokens, block_mask):
        x = self.embeddings(tokens)
        angles = self.angles[: tokens.shape[1], None, :]
        for block in self.layers.values():
            x = block(x, angles, block_mask)
        return self.output(self.norm(x))


def compile_blocks(model: Decoder, **compile_options) -> None:
    """Each block compiled on its own, as torchtitan's ``apply_compile`` does."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=True, **compile_options))
