"""Single-device models for context parallelism the backend inserts (``passes/dynamo/context_parallel``):
a small decoder of our own, its training step on one CP rank, and the single-device reference.

``mask`` says how the decoder spells its attention: ``"causal"`` (SDPA ``is_causal=True``: causal
over the whole row, across documents), ``"documents"`` (a boolean mask of same document and causal,
documents from the position ids' resets as HF transformers finds them), ``"bidirectional"`` (no
mask, not causal), ``"window"`` (the document mask with a sliding window of ``WINDOW``),
``"varlen"`` (torch's ``varlen_attn`` over the rows flattened, causal within the documents the
batch's ``cu_seqlens`` bound: :func:`varlen_batch`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention.flex_attention import create_mask, flex_attention

from ..parallel import batch as cp_batch
from ..parallel.batch import IGNORE_INDEX
from .documents import document_end_block_mask


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x [B, T, H, D]`` rotated by ``positions [B, T]`` (half-split rotary embedding)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angle = positions.float()[..., None, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def document_mask(position_ids: torch.Tensor, window: int = -1) -> torch.Tensor:
    """``[B, 1, T, T]`` same document and causal, documents where the positions do not step by one;
    with ``window >= 0`` a sliding window too: keys from ``q - window`` on."""
    first = position_ids[:, :1] - 1
    ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    tokens = position_ids.shape[1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=position_ids.device).tril()
    if window >= 0:
        causal = causal & torch.ones_like(causal).triu(-window)
    return ((ids[:, :, None] == ids[:, None, :]) & causal)[:, None]


WINDOW = 3  # the "window" decoder's sliding window: shorter than its documents


def varlen_documents(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``[B, T, H, D]`` q, k, v over the rows flattened: torch's ``varlen_attn``, causal within the
    documents ``cu_seqlens`` bounds (GQA as the op takes it: ``enable_gqa``, or K/V heads
    repeated where this torch's op has no such flag); ``[B, T, H, D]``."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    b, t, heads = q.shape[:3]
    params = inspect.signature(varlen_attn).parameters
    options: dict[str, object] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        options["enable_gqa"] = True
    else:
        k, v = (x.repeat_interleave(heads // x.shape[2], dim=2) for x in (k, v))
    out = varlen_attn(*(x.flatten(0, 1) for x in (q, k, v)), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)
    return out.view(b, t, heads, -1)


def flex_documents(q, k, v, position_ids: torch.Tensor) -> torch.Tensor:
    """flex attention, same document and causal, its BlockMask built here from the positions (a
    model that builds it in its own forward; HF and torchtitan build it outside)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ids = (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(same_document_causal, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, mask: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.mask = heads, kv_heads, dim // heads, mask
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.SiLU(), nn.Linear(2 * dim, dim, bias=False))

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor, cu_seqlens=None, max_seqlen=None,
                block_mask=None) -> torch.Tensor:
        b, t, _ = h.shape
        x = self.norm1(h)
        q = self.wq(x).view(b, t, self.heads, self.head_dim)
        k, v = self.wkv(x).view(b, t, 2, self.kv_heads, self.head_dim).unbind(2)
        q, k = rotary(q, position_ids), rotary(k, position_ids)
        if self.mask == "varlen":
            h = h + self.wo(varlen_documents(q, k, v, cu_seqlens, max_seqlen).reshape(b, t, -1))
            return h + self.mlp(self.norm2(h))
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        if self.mask in ("documents", "window"):
            window = WINDOW if self.mask == "window" else -1
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(position_ids, window), enable_gqa=True)
        elif self.mask == "flex":
            out = flex_documents(q, k, v, position_ids)
        elif self.mask == "flex_given":  # the BlockMask the trainer made (torchtitan's attention_masks)
            out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        elif self.mask == "dense_given":  # its single-device twin: the same mask_mod, dense, through SDPA
            dense = create_mask(block_mask.mask_mod, b, 1, t, t, device=q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.mask == "causal", enable_gqa=True)
        h = h + self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return h + self.mlp(self.norm2(h))


class Decoder(nn.Module):
    """Embedding, blocks, head; returns the loss HF transformers' way: the summed token losses
    over ``num_items_in_batch`` (the mean where it is not given). ``mask``: every block's, or a
    tuple of one per block (``layers`` then unused). ``loss``: "hf" (that), "mean" (cross
    entropy's own mean, ``num_items_in_batch`` ignored: BERT's masked-LM head, nanoGPT's) or
    "masked" (the token losses times a 0/1 mask, summed, over the mask's sum); "mean_after_break"
    (the mean, after a graph break: in a graph of its own, without attention); "pooled" (a
    sequence classifier: the mean of each row's logits, cross entropy against the row's index)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                 mask: str | tuple[str, ...] = "causal", loss: str = "hf"):
        super().__init__()
        self.loss = loss
        self.embed = nn.Embedding(vocab, dim)
        masks = mask if isinstance(mask, tuple) else (mask,) * layers
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, m) for m in masks)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, position_ids=None, labels=None, shift_labels=None, num_items_in_batch=None,
                cu_seqlens=None, max_seqlen=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, position_ids, cu_seqlens, max_seqlen)
        logits = self.head(self.norm(h)).float()
        targets = shift_labels if shift_labels is not None else cp_batch.shift_labels(labels)
        if self.loss == "pooled":
            pooled = logits.mean(1)
            return F.cross_entropy(pooled, torch.arange(pooled.shape[0], device=pooled.device))
        if self.loss == "mean_after_break":
            torch._dynamo.graph_break()
        if self.loss.startswith("mean"):
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        if self.loss == "masked":
            kept = (targets != IGNORE_INDEX).float()
            per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten().clamp(min=0), reduction="none")
            return (per_token * kept.flatten()).sum() / kept.sum()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        count = num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE_INDEX).sum()
        return loss / count


class TitanNamed(Decoder):
    """The decoder called as torchtitan calls its models: ``model(tokens, attention_masks=None,
    positions=None)`` (positions the index where none are given), the logits out: the trainer
    computes the loss (:func:`titan_loss`)."""

    def forward(self, tokens, attention_masks=None, positions=None):  # type: ignore[override]
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        h = self.embed(tokens)
        if isinstance(attention_masks, VarlenMetadata):  # torchtitan's varlen attention
            for block in self.blocks:
                h = block(h, positions, attention_masks.cu_seq_q, attention_masks.max_q)
            return self.head(self.norm(h)).float()
        for block in self.blocks:
            h = block(h, positions, block_mask=attention_masks["full"] if attention_masks is not None else None)
        return self.head(self.norm(h)).float()


class _IndexBlock(nn.Module):
    """A block that slices the rotary table it is handed to its tokens (torchtitan's
    ``freqs_cis[0:seqlen]``) and attends causally over the row (SDPA ``is_causal``)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.SiLU(), nn.Linear(2 * dim, dim, bias=False))

    def forward(self, h: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        b, t, dim = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, dim // self.heads).unbind(2)
        angle = angles[:t][:, None, :]  # [T, 1, D/2]: the table's first t rows
        cos, sin = angle.cos(), angle.sin()

        def rotate(x):
            a, c = x.chunk(2, dim=-1)
            return torch.cat([a * cos - c * sin, a * sin + c * cos], dim=-1).transpose(1, 2)

        out = F.scaled_dot_product_attention(rotate(q), rotate(k), v.transpose(1, 2), is_causal=True)
        h = h + self.wo(out.transpose(1, 2).reshape(b, t, dim))
        return h + self.mlp(self.norm2(h))


class IndexPositioned(nn.Module):
    """A decoder written for one device that places its tokens by their index, as nanoGPT and
    torchtitan do: a learned table read at ``arange(T)`` added to the embeddings (nanoGPT's
    ``wpe``) and rotary angles from a buffer every block slices to its tokens (inside each
    checkpointed block where ``checkpointing``); called ``model(input_ids, targets)`` with
    targets the next tokens (nanoGPT's loader shifts them), cross entropy's mean out."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, block_size: int = 64,
                 checkpointing: bool = False):
        super().__init__()
        self.checkpointing = checkpointing
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        half = dim // heads // 2
        self.register_buffer("angles", torch.arange(block_size)[:, None] / 100 ** (torch.arange(half) / half))
        self.blocks = nn.ModuleList(_IndexBlock(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, targets):
        h = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            h = (torch.utils.checkpoint.checkpoint(block, h, self.angles, use_reentrant=False) if self.checkpointing
                 else block(h, self.angles))
        logits = self.head(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def index_positioned(checkpointing: bool = False) -> IndexPositioned:
    """An :class:`IndexPositioned` with seed-0 weights."""
    torch.manual_seed(0)
    return IndexPositioned(checkpointing=checkpointing)


def next_token_batch(rows: int, tokens: int, vocab: int = 64) -> dict:
    """``input_ids`` and ``targets`` (the next token; the last one predicts nothing), as nanoGPT's
    loader hands them."""
    ids = torch.randint(vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "targets": cp_batch.shift_labels(ids)}


def index_positioned_loss_of(compiled, local: dict) -> torch.Tensor:
    """nanoGPT's call: the tokens and targets only (no position ids: the model makes its own)."""
    return compiled(local["input_ids"], local["targets"])


def titan_loss(logits: torch.Tensor, targets: torch.Tensor, count) -> torch.Tensor:
    """The summed token losses over ``count`` (the full batch's predicted tokens)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum") / count


def _titan_loss_of(compiled, local: dict) -> torch.Tensor:
    """The model called with ``tokens``, ``positions`` and any ``attention_masks``, the loss
    computed outside it."""
    return titan_loss(compiled(local["tokens"], attention_masks=local.get("attention_masks"), positions=local["positions"]),
                      local["shift_labels"], local["num_items_in_batch"])


def titan_steps(rank: int, cp: int, cases: list) -> list:
    """:func:`cp_step` the torchtitan way for each ``(make_model, batch[, options])`` (``batch``:
    ``tokens``, ``labels``, maybe ``positions``)."""
    return [cp_step(rank, cp, make_model, batch, options[0] if options else None, loss_of=_titan_loss_of)
            for make_model, batch, *options in cases]


def decoder(mask: str | tuple[str, ...] = "causal", kv_heads: int = 2, titan_named: bool = False, dim: int = 32,
            loss: str = "hf") -> Decoder:
    """A :class:`Decoder` (:class:`TitanNamed`) of 4 query heads with seed-0 weights."""
    torch.manual_seed(0)
    return (TitanNamed if titan_named else Decoder)(dim=dim, mask=mask, kv_heads=kv_heads, loss=loss)


def packed_batch(lengths: list[int], rows: int = 1, vocab: int = 64, seed: int = 0) -> dict:
    """``rows`` rows of documents of ``lengths`` back to back (positions restart at 0), labels the
    tokens themselves (the first token of each document not predicted)."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    input_ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).expand(rows, tokens).contiguous()
    labels = input_ids.clone()
    labels[position_ids == 0] = IGNORE_INDEX
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


EOS = 1  # the end-of-document token of titan_block_mask_batch


def titan_block_mask_batch(lengths: list[int], rows: int = 1, window: int = -1, device: str = "cpu",
                           form: str = "ids") -> dict:
    """A batch as torchtitan's trainer hands it to a flex model: ``tokens`` (each document ends in
    :data:`EOS`), ``labels``, no positions, and ``attention_masks`` ({"full": BlockMask}) made
    from the full batch: the documents from the end-of-document tokens, causal, keys from
    q - ``window`` on where it is >= 0, every tensor on ``device``. ``form``: the documents as
    ids compared at the query and the key (``"ids"``), or as torchtitan's fast path for several
    rows writes them, queries up to the key's document's last place (``"ends"``, no window).
    (Its mask_mod is a closure: make it in the process that uses it.)"""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    batch = on_device(packed_batch(lengths, rows), device)
    tokens = batch["input_ids"].clamp(min=EOS + 1)
    ends = torch.tensor(lengths).cumsum(0) - 1
    tokens[:, ends] = EOS
    eos = tokens == EOS
    documents = torch.zeros_like(tokens)
    documents[:, 1:] = eos.long().cumsum(1)[:, :-1]  # a document starts after each end

    def same_document(b, h, q_idx, kv_idx):
        return documents[b, q_idx] == documents[b, kv_idx]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    if form == "ends":
        assert window < 0, "torchtitan's fast path has no window"
        block_mask = document_end_block_mask(batch["position_ids"], device)
    else:
        mods = [causal, same_document] + ([sliding] if window >= 0 else [])
        block_mask = create_block_mask(and_masks(*mods), rows, None, tokens.shape[1], tokens.shape[1], device=device)
    labels = tokens.clone()
    labels[:, 0] = IGNORE_INDEX
    labels[:, (ends + 1)[:-1]] = IGNORE_INDEX  # the first token of each document is not predicted
    return {"tokens": tokens, "labels": labels, "attention_masks": {"full": block_mask}}


class VarlenMetadata(NamedTuple):
    """torchtitan's varlen attention metadata, as its trainer hands it to the model in
    ``attention_masks``: the bounds of the rows' documents flattened, the longest document."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


def titan_varlen_batch(lengths: list[int], rows: int = 1) -> dict:
    """A batch as torchtitan's trainer hands it to a varlen model: ``tokens``, ``labels``,
    ``positions`` that restart at each document, and ``attention_masks``, the
    :class:`VarlenMetadata` of the full batch (made before the model, from the positions)."""
    batch = varlen_batch(lengths, rows)
    metadata = VarlenMetadata(batch["cu_seqlens"], batch["cu_seqlens"], batch["max_seqlen"], batch["max_seqlen"])
    return {"tokens": batch["input_ids"], "labels": batch["labels"], "positions": batch["position_ids"],
            "attention_masks": metadata}


def varlen_batch(lengths: list[int], rows: int = 1) -> dict:
    """:func:`packed_batch` with the varlen bounds of its rows flattened (``cu_seqlens``, int32) and
    the longest document (``max_seqlen``), as a data loader hands them to a varlen model."""
    batch = packed_batch(lengths, rows)
    tokens = sum(lengths)
    starts = [r * tokens + s for r in range(rows) for s in [0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()]]
    batch["cu_seqlens"] = torch.tensor([*starts, rows * tokens], dtype=torch.int32)
    batch["max_seqlen"] = max(lengths)
    return batch


def _tiny_bert_config(**more):
    """A tiny BERT's config (no dropout), the seed set for the model made from it next."""
    from transformers import BertConfig

    torch.manual_seed(0)
    return BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      attn_implementation="sdpa", **more)


def hf_bert_masked_lm() -> nn.Module:
    """A tiny HF transformers ``BertForMaskedLM`` (bidirectional, learned positions read at the
    position ids, no dropout; seed 0). Its loss is cross entropy's own mean over the labelled
    tokens: it ignores ``num_items_in_batch``."""
    from transformers import BertForMaskedLM

    return BertForMaskedLM(_tiny_bert_config())


def hf_bert_classifier() -> nn.Module:
    """A tiny HF transformers ``BertForSequenceClassification`` (3 classes, its pooler reading
    each row's first token, no dropout; seed 0)."""
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_tiny_bert_config(num_labels=3))


def hf_mixtral(router_aux_loss: bool = True) -> nn.Module:
    """A tiny HF transformers ``MixtralForCausalLM`` (4 experts, top 2, seed 0), its
    load-balancing loss over the router's logits added to the loss where ``router_aux_loss``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attn_implementation="sdpa",
                           use_cache=False, output_router_logits=router_aux_loss, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    return MixtralForCausalLM(config)


def hf_llama(attn: str = "sdpa", kv_heads: int = 2, checkpointing: bool = False, head_dim: int = 8) -> nn.Module:
    """A tiny HF transformers ``LlamaForCausalLM`` (4 query heads of ``head_dim``, random weights,
    seed 0), each decoder layer activation-checkpointed where ``checkpointing`` (HF's own switch)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim, attn_implementation=attn,
                         use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


HF_ARCHITECTURES = ("qwen2", "qwen3", "mistral", "phi3", "olmo2", "gpt2", "gemma", "gemma3", "granite", "starcoder2",
                    "gpt_neox", "cohere", "smollm3", "olmo3")


def hf_causal_lm(arch: str, sliding_window: int | None = None, attn: str = "sdpa") -> nn.Module:
    """A tiny HF transformers causal LM of architecture ``arch`` (random weights, seed 0, ``attn``,
    GQA 4:2 where the architecture has it, no dropout), for surveys beyond Llama; Mistral with
    ``sliding_window`` where given (Gemma 3 and OLMo 3 slide over 5 keys in some layers)."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, attn_implementation=attn, use_cache=False)
    tokens = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary
    configs = {
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=8)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=sliding_window)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, pad_token_id=0)),
        "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**common)),
        # learned positions, read at the position ids
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, attn_implementation="sdpa",
                                                         use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=8)),
        # a sliding-window layer, then a global one
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=5,
                                                                   layer_types=["sliding_attention", "full_attention"])),
        "granite": lambda: tf.GraniteForCausalLM(tf.GraniteConfig(**common)),  # scaled embeddings, residuals, logits
        "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**common, **tokens, sliding_window=None)),
        # fused QKV, rotary over a quarter of each head, parallel residual; no GQA
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"})),
        "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**common, **tokens)),  # attention and MLP in parallel
        "smollm3": lambda: tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**common, **tokens, no_rope_layer_interval=2)),  # a layer without rotary
        "olmo3": lambda: tf.Olmo3ForCausalLM(tf.Olmo3Config(**common, **tokens, sliding_window=5)),
    }
    return configs[arch]()


def _loss(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out  # an HF model's output, or the loss itself


def _autocast(loss_of, device: str, dtype: torch.dtype):
    """``loss_of`` with the model's forward under autocast (the backward outside it, as advised)."""
    def under_autocast(model, batch):
        with torch.autocast(device, dtype=dtype):
            return loss_of(model, batch)
    return under_autocast


def reference_step(model: nn.Module, batch: dict, autocast: torch.dtype | None = None) -> tuple[float, dict]:
    """The single-device loss and every parameter's gradient on the full batch (the forward
    under ``autocast`` where given)."""
    model.zero_grad(set_to_none=True)
    forward = _hf_loss_of if autocast is None else _autocast(_hf_loss_of, next(model.parameters()).device.type, autocast)
    loss = forward(model, batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def titan_reference_step(model: nn.Module, batch: dict) -> tuple[float, dict]:
    """:func:`reference_step` the torchtitan way: the model called with ``tokens`` and any
    ``attention_masks`` and ``positions``, the loss computed outside it."""
    model.zero_grad(set_to_none=True)
    targets = cp_batch.shift_labels(batch["labels"])
    logits = model(batch["tokens"], attention_masks=batch.get("attention_masks"), positions=batch.get("positions"))
    loss = titan_loss(logits, targets, (targets != IGNORE_INDEX).sum())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def cp_steps(rank: int, cp: int, cases: list) -> list:
    """:func:`cp_step` for each ``(make_model, batch[, options[, dynamo[, how]]])`` of ``cases``, in
    one process per rank (``how``: cp_step's keyword arguments, ``dynamic`` or ``autocast``)."""
    return [cp_step(rank, cp, *case[:4], **(case[4] if len(case) > 4 else {})) for case in cases]


@contextlib.contextmanager
def flex_backward_on_cpu():
    """torch refuses to trace flex with gradients on the CPU (it has no CPU flex backward); the
    context-parallel pass replaces every flex call before AOTAutograd traces the backward, so
    the refusal is lifted here. A call the pass could not take fails the compile (local attention
    is another answer), never reaches a CPU flex backward."""
    from unittest import mock

    import torch.nn.attention.flex_attention as flex

    with mock.patch.object(flex, "_validate_device", lambda *tensors: None):
        yield


def cp_flex_steps(rank: int, cp: int, cases: list) -> list:
    """:func:`cp_steps` for flex attention programs on the CPU (:func:`flex_backward_on_cpu`)."""
    with flex_backward_on_cpu():
        return cp_steps(rank, cp, cases)


def on_device(batch: dict, device) -> dict:
    """``batch`` with its tensors on ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def model_on(make_model, device, dtype=None) -> nn.Module:
    """``make_model()`` on ``device`` in ``dtype``."""
    return make_model().to(device, dtype)


def gpu_cp_steps(rank: int, cp: int, cases: list) -> list:
    """One training step per ``(make_model, make_batch, options, caller)`` on this rank's share
    (``caller``: "hf" or "titan", how the model is called and its loss computed), the ranks
    sharing one GPU (``shared_device``: the collectives through the host); the gradients
    returned in fp32 on the CPU."""
    from .shared_device import collectives_through_host

    loss_of = {"hf": _hf_loss_of, "titan": _titan_loss_of}
    out = []
    with collectives_through_host():
        for make_model, make_batch, options, caller in cases:
            got = cp_step(rank, cp, make_model, make_batch(), options, loss_of=loss_of[caller])
            out.append({**got, "grads": {n: g.float().cpu() for n, g in got["grads"].items()}})
    return out


def titan_flex_steps(rank: int, cp: int, cases: list) -> list:
    """:func:`titan_steps` under :func:`flex_backward_on_cpu`; each case's batch made here by calling it (a BlockMask's closure does not pickle)."""
    with flex_backward_on_cpu():
        return titan_steps(rank, cp, [(make, make_batch(), *options) for make, make_batch, *options in cases])


def _compiled(make_model, options: dict | None = None, dynamic: bool | None = None):
    """A fresh ``make_model()`` and its compile under cp_inductor with the world as the CP group."""
    import torch.distributed as dist

    torch._dynamo.reset()
    model = make_model()
    return model, torch.compile(model, backend="cp_inductor", dynamic=dynamic,
                                options={"cp_inductor.context_parallel": dist.group.WORLD, **(options or {})})


def _report_lines() -> list[str]:
    import cp_inductor

    report = cp_inductor.report()
    return [r.line() for r in (*report.varlen, *report.token_means)]


def _hf_loss_of(compiled, local: dict) -> torch.Tensor:
    """The model called with the batch's keys, its loss (HF transformers' way)."""
    return _loss(compiled(**local))


def _train_step(model, compiled, batch: dict, loss_of=_hf_loss_of) -> tuple[float, dict]:
    """One step on this rank's share of ``batch``: the loss combined over the ranks and the
    parameter gradients summed over them."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(compiled, cp_batch.shard_batch(batch))
    loss.backward()
    cp_batch.sum_gradients(model)
    return cp_batch.combine_losses(loss).item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def cp_step(rank: int, cp: int, make_model, batch: dict, options: dict | None = None,
            dynamo: dict | None = None, loss_of=_hf_loss_of, dynamic: bool | None = None,
            autocast: torch.dtype | None = None) -> dict:
    """One training step of ``make_model()`` on this rank's share, compiled with the CP group
    (``dynamo``: Dynamo's config patched while it traces; ``loss_of(compiled, local)``: how the
    model is called and its loss computed; ``dynamic``: torch.compile's; ``autocast``: the step
    under autocast to that dtype): the loss and gradients combined over the ranks, and the
    report's lines."""
    import cp_inductor

    cp_inductor.clear_report()
    model, compiled = _compiled(make_model, options, dynamic)
    if autocast is not None:
        loss_of = _autocast(loss_of, next(model.parameters()).device.type, autocast)
    with torch._dynamo.config.patch(dynamo or {}):
        loss, grads = _train_step(model, compiled, batch, loss_of)
    return {"loss": loss, "grads": grads, "lines": _report_lines()}


def fsdp_cp_steps(rank: int, cp: int, cases: list) -> list:
    """:func:`cp_step` for each case with FSDP2 sharding every block and the model over the CP
    ranks (as torchtitan shards over its data-parallel x CP mesh). Each rank's loss is its share
    of the full batch's (divided by the full count), so the CP ranks' gradients must add up;
    FSDP averages them, so the loss goes backward times cp (``set_gradient_divide_factor`` does
    the same on NCCL; gloo has no pre-multiplied sum). The gradients are the full parameters'."""
    import cp_inductor
    from torch.distributed.fsdp import fully_shard

    out = []
    for make_model, batch, *options in cases:
        cp_inductor.clear_report()

        def sharded():
            model = make_model()
            for module in [*model.blocks, model]:
                fully_shard(module)
            return model

        model, compiled = _compiled(sharded, *options)
        model.zero_grad(set_to_none=True)
        loss = _loss(compiled(**cp_batch.shard_batch(batch)))
        (loss * cp).backward()
        out.append({"loss": cp_batch.combine_losses(loss).item(),
                    "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
                    "lines": _report_lines()})
    return out


def titan_flex_varying_steps(rank: int, cp: int, packs: list) -> list:
    """Training steps of one compiled torchtitan-style flex decoder over batches whose BlockMask
    the trainer makes anew each step (:func:`titan_block_mask_batch`, documents of the given
    lengths): per step, the combined loss, the single-device loss (the dense twin), the largest
    relative error of the summed gradients, and how many graphs Dynamo had compiled by then."""
    model, compiled = _compiled(functools.partial(decoder, "flex_given", titan_named=True))
    twin = decoder("dense_given", titan_named=True)
    torch._dynamo.utils.counters.clear()
    out = []
    with flex_backward_on_cpu():
        for lengths in packs:
            batch = titan_block_mask_batch(lengths)
            loss, got = _train_step(model, compiled, batch, loss_of=_titan_loss_of)
            want_loss, want = titan_reference_step(twin, batch)
            err = max(((got[n] - g).abs().max() / g.abs().max()).item() for n, g in want.items())
            out.append((loss, want_loss, err, torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return out


def cp_varying_steps(rank: int, cp: int, make_model, packs: list) -> list:
    """Training steps of one compiled model over packs of the given document lengths (new lengths
    and sizes each step): per step, the combined loss, the single-device loss, the largest
    relative error of the summed gradients, and how many graphs Dynamo had compiled by then."""
    model, compiled = _compiled(make_model)
    torch._dynamo.utils.counters.clear()
    out = []
    for lengths in packs:
        batch = packed_batch(lengths)
        loss, got = _train_step(model, compiled, batch)
        want_loss, want = reference_step(model, batch)
        err = max(((got[n] - g).abs().max() / g.abs().max()).item() for n, g in want.items())
        out.append((loss, want_loss, err, torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return out
