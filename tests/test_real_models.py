"""A real model: Hugging Face transformers' Llama (tiny config, GQA) with Ulysses (or K/V
all-gather) registered as its attention function, the way users plug CP into HF models. Its
q/k/v reach attention through HF's own projections, `view(B, S, -1, D)`, RoPE and transposes."""

import pytest
import torch
import transformers
from expecttest import TestCase

import cp_inductor
from cp_inductor.testing.launch import run_on_ranks
from cp_inductor.parallel import allgather_attention, ulysses_attention
from helpers import aot_graphs, fake_pg, report_text


def ulysses_for_hf(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF's attention-function signature: q/k/v [B, H, S/cp, D] in, ([B, S/cp, H, D], None) out."""
    out = ulysses_attention(query, key, value, layout="bhsd", is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def allgather_for_hf(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The same with K/V all-gather, contiguous shards (HF numbers positions per rank's slice)."""
    out = allgather_attention(query, key, value, layout="bhsd", is_causal=True, load_balanced=False, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def ring_for_hf(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A hand-written ring (``tests/ring_programs.py``), zigzag shards: rank r holds chunks r and
    2cp-1-r, and HF is given those positions."""
    from ring_programs import ring_by_hand

    out = ring_by_hand(*(t.transpose(1, 2) for t in (query, key, value)), causal=True)
    return out.contiguous(), None


def tiny_llama(seed: int = 0, attention: str = "cp_ulysses"):
    transformers.AttentionInterface.register("cp_ulysses", ulysses_for_hf)
    transformers.AttentionInterface.register("cp_allgather", allgather_for_hf)
    transformers.AttentionInterface.register("cp_ring", ring_for_hf)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
    )
    cfg._attn_implementation = attention
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


class TestHFLlama(TestCase):
    def test_every_layer_found_forward_and_backward(self):
        for cp in (2, 4):
            with fake_pg(cp), cp_inductor.config.patch(strict=True):
                model = tiny_llama()
                ids = torch.randint(0, 64, (2, 8))
                text = report_text(aot_graphs(lambda ids: model(input_ids=ids, labels=ids).loss, ids))
            rows = [line.split(" applied=")[0] + " " + line.split(" applied=")[1].split(" skipped")[0] for line in text.splitlines()]
            assert rows == [f"forward a2a cp={cp} bhsd ['fused_a2a']"] * 2 + [f"backward a2a cp={cp} bshd ['fused_a2a']"] * 2, text


def _train_step_on_rank(rank: int, cp: int, attention: str = "cp_ulysses") -> dict:
    """One loss + backward of the tiny Llama on this rank's 8 of 16 tokens: eager vs cp_inductor."""
    from torch._dynamo.utils import counters

    model = tiny_llama(attention=attention)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    pos = torch.arange(8).unsqueeze(0) + rank * 8
    if attention == "cp_ring":  # zigzag: chunks r and 2cp-1-r of 4 tokens
        pos = torch.cat([torch.arange(4) + 4 * rank, torch.arange(4) + 4 * (2 * cp - 1 - rank)]).unsqueeze(0)

    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, labels=ids).loss

    results = []
    for fn in (step, torch.compile(step, backend="cp_inductor")):
        model.zero_grad()
        loss = fn(ids, pos)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    err = max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(results[1], results[0]))
    return {
        "max_rel_err": err, "rewritten": dict(counters["cp_inductor"]),
        "regions": sorted({(r.graph_kind, r.style) for r in cp_inductor.report().regions}),
    }


def test_training_step_matches_eager_on_gloo():
    for r in run_on_ranks(_train_step_on_rank, 2):
        assert r["max_rel_err"] < 1e-5, r
        assert r["rewritten"].get("fused_a2a") == 4, r  # 2 layers x (forward + backward)


def test_allgather_llama_every_layer_found_and_training_step_matches_eager():
    """K/V all-gather registered in HF Llama: every layer's attention is an all-gather region in
    both graphs (fake process group, cp = 2 and 4), and a training step on gloo compiled with
    cp_inductor matches eager."""
    for cp in (2, 4):
        with fake_pg(cp), cp_inductor.config.patch(strict=True):
            model = tiny_llama(attention="cp_allgather")
            ids = torch.randint(0, 64, (2, 8))
            text = report_text(aot_graphs(lambda ids: model(input_ids=ids, labels=ids).loss, ids))
        rows = [line.split(" applied=")[0] for line in text.splitlines() if not line.startswith("rejected")]
        # rank 0 holds chunk 0: one causal call over the gathered first block per layer
        assert rows == [f"forward allgather cp={cp} bhsd"] * 2 + [f"backward allgather cp={cp} bshd"] * 2, text
    for r in run_on_ranks(_train_step_on_rank, 2, "cp_allgather"):
        assert r["max_rel_err"] < 1e-5, r
        assert r["regions"] == [("backward", "allgather"), ("forward", "allgather")], r


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
def test_ring_llama_every_step_of_every_layer_found(cp):
    """A hand-written ring registered in HF Llama, zigzag positions, fake process group: one ring
    region per step of every layer's ring, in both graphs (strict: no error)."""
    import collections

    with fake_pg(cp), cp_inductor.config.patch(strict=True):
        model = tiny_llama(attention="cp_ring")
        ids = torch.randint(0, 64, (2, 8))
        pos = torch.cat([torch.arange(4), torch.arange(4) + 4 * (2 * cp - 1)]).unsqueeze(0)  # rank 0's chunks
        text = report_text(aot_graphs(lambda ids, pos: model(input_ids=ids, position_ids=pos, labels=ids).loss, ids, pos))
    rows = collections.Counter(line.split(" applied=")[0] for line in text.splitlines())
    assert rows == {f"forward ring cp={cp} bhsd": 2 * cp, f"backward ring cp={cp} bshd": 2 * cp}, text


@pytest.mark.wide  # the ring's gloo numerics run in CI (test_ring.py), its Llama graphs above
def test_ring_llama_training_step_matches_eager():
    """A hand-written ring registered in HF Llama (zigzag positions): a training step on gloo
    compiled with cp_inductor matches eager, and the ring is found in both graphs."""
    for r in run_on_ranks(_train_step_on_rank, 2, "cp_ring"):
        assert r["max_rel_err"] < 1e-5, r
        assert r["regions"] == [("backward", "ring"), ("forward", "ring")], r
