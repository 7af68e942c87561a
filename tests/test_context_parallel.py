"""Context parallelism the model does not write (passes/dynamo/context_parallel.py,
parallel/batch.py): the layout shard_batch makes, the rewrite of each attention call, the calls
it refuses, and training numerics against the single-device model on gloo."""

from __future__ import annotations

import functools
import importlib.util
from unittest import mock

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from expecttest import TestCase
from helpers import assert_within_low_precision, fake_pg

import cp_inductor
from cp_inductor.config_snapshot import snapshot
from cp_inductor.batch_layout import shard_of
from cp_inductor.parallel.batch import document_ids, plan_places, shard_batch
from cp_inductor.passes import engine
from cp_inductor.testing import auto_cp, varlen_programs
from cp_inductor.testing.launch import run_on_ranks

POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])  # documents of 6, 8, 2 tokens


def _cut_as_the_positions(batch: dict, rank: int) -> None:
    """``batch``'s BlockMask cut for ``rank`` of 2: the layout's documents are POSITIONS', and the
    rank's mask is the full mask between the rank's own tokens."""
    from torch.nn.attention.flex_attention import create_mask

    with fake_pg(2, rank=rank) as group:
        local = shard_batch(batch, group)
        shard = shard_of(local["tokens"])
    assert torch.equal(shard.doc_ids, document_ids(POSITIONS))
    places = shard.query_positions[0]
    dense = create_mask(local["attention_masks"].mask_mod, 1, 1, 8, 8)
    full = create_mask(batch["attention_masks"].mask_mod, 1, 1, 16, 16)
    assert torch.equal(dense[0, 0], full[0, 0][places][:, places])


class TestLayout(TestCase):
    def test_head_tail_per_document(self):
        """Each document cut in 2cp pieces, rank r keeps pieces r and 2cp-1-r; leftover tokens go to
        pieces in turn over the row, so both ranks hold 8 of the 16 tokens."""
        places = plan_places(document_ids(POSITIONS), 2)
        self.assertExpectedInline(str(places.tolist()), """[[[0, 1, 5, 6, 7, 12, 13, 15]], [[2, 3, 4, 8, 9, 10, 11, 14]]]""")

    def test_plain_row_is_head_tail(self):
        places = plan_places(document_ids(torch.arange(16)[None]), 2)
        self.assertExpectedInline(str(places.tolist()), """[[[0, 1, 2, 3, 12, 13, 14, 15]], [[4, 5, 6, 7, 8, 9, 10, 11]]]""")

    def test_uneven_split_is_refused(self):
        with pytest.raises(ValueError, match="multiple of 2 \\* cp = 4"):
            plan_places(document_ids(torch.arange(15)[None]), 2)

    def test_shard_batch_cuts_tokens_and_shifts_labels_over_the_full_row(self):
        batch = auto_cp.packed_batch([6, 8, 2])
        with fake_pg(2, rank=1) as group:
            local = shard_batch(batch, group)
            shard = shard_of(local["position_ids"])
        places = shard.query_positions[0]
        assert torch.equal(local["input_ids"][0], batch["input_ids"][0, places])
        assert torch.equal(local["position_ids"][0], POSITIONS[0, places])
        want = torch.cat([batch["labels"][0, 1:], torch.tensor([-100])])[places]  # shifted before the cut
        assert torch.equal(local["shift_labels"][0], want)
        assert int(local["num_items_in_batch"]) == int((batch["labels"][0, 1:] != -100).sum())
        assert torch.equal(shard.key_positions[0].sort().values, torch.arange(16))  # every place once
        assert shard_of(local["position_ids"].clone()) is None  # the layout belongs to that tensor

    def test_mask_with_documents_is_refused(self):
        """HF reads documents from restarting positions only without an attention_mask."""
        batch = {**auto_cp.packed_batch([6, 10]), "attention_mask": torch.ones(1, 16, dtype=torch.long)}
        with fake_pg(2) as group, pytest.raises(ValueError, match="drop attention_mask"):
            shard_batch(batch, group)

    def test_a_block_mask_made_before_the_model_is_cut(self):
        """torchtitan builds its flex BlockMask from the full batch before the model runs (documents
        from end-of-document tokens, and causal): the rank gets a BlockMask over its own tokens,
        whose mask_mod reads its tokens' documents, and the layout's documents are the mask's."""
        batch = auto_cp.titan_block_mask_batch([6, 8, 2])
        block_mask = batch["attention_masks"]["full"]
        assert "positions" not in batch
        with fake_pg(2, rank=1) as group:
            local = shard_batch(batch, group)
            shard = shard_of(local["tokens"])
        places = shard.query_positions[0]
        assert torch.equal(shard.doc_ids, document_ids(POSITIONS))  # from the mask's table
        assert torch.equal(local["positions"][0], places)  # the tokens' places: the model's rotary
        rank_mask = local["attention_masks"]["full"]
        assert rank_mask.seq_lengths == (8, 8)
        dense = torch.nn.attention.flex_attention.create_mask(rank_mask.mask_mod, 1, 1, 8, 8)
        full = torch.nn.attention.flex_attention.create_mask(block_mask.mask_mod, 1, 1, 16, 16)
        # the full mask between the rank's own tokens (held in row order): what the rank's reads
        same = document_ids(POSITIONS)[0, places]
        want = (same[:, None] == same[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
        assert torch.equal(dense[0, 0], want) and torch.equal(full[0, 0][places][:, places], want)

    def test_a_table_over_the_tokens_with_positions_is_cut(self):
        """torchtitan's other document mask_mod: ids ``[T]`` from positions that restart at 0,
        read at the index alone, with the positions in the batch: the same layout as the
        positions', and a BlockMask over the rank's tokens."""
        from torch.nn.attention.flex_attention import and_masks, create_block_mask

        positions = POSITIONS[0]
        ids = torch.cumsum((positions == 0).int(), dim=0) - 1

        def same_document(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        batch = {"tokens": torch.arange(16)[None], "positions": POSITIONS,
                 "attention_masks": create_block_mask(and_masks(causal, same_document), 1, None, 16, 16, device="cpu")}
        _cut_as_the_positions(batch, rank=0)

    def test_keys_from_the_document_start_are_cut(self):
        """torchtitan's interval form: keys from ``starts[ids[q]]`` on (each document's first place,
        read through two tables), with causal: the documents are the runs of the starts; a start
        table that is not the documents' first places is refused."""
        from torch.nn.attention.flex_attention import and_masks, create_block_mask

        positions = POSITIONS[0]
        ids = torch.cumsum((positions == 0).int(), dim=0) - 1
        starts = torch.tensor([0, 6, 14] + [16] * 5)

        def interval(table):
            def from_start(b, h, q_idx, kv_idx):
                return kv_idx >= table[ids[q_idx]]
            return and_masks(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, from_start)

        batch = {"tokens": torch.arange(16)[None], "positions": POSITIONS,
                 "attention_masks": create_block_mask(interval(starts), 1, None, 16, 16, device="cpu")}
        _cut_as_the_positions(batch, rank=1)
        off_by_one = {**batch, "attention_masks": create_block_mask(interval(starts + 1), 1, None, 16, 16, device="cpu")}
        with fake_pg(2) as group, pytest.raises(ValueError, match="not each token's document's first place"):
            shard_batch(off_by_one, group)

    def test_queries_up_to_the_document_end_are_cut(self):
        """torchtitan's fast path for batches of several rows: queries up to ``ends[b, kv]`` (each
        key's document's last place), with causal: the documents are the runs of the ends, row by
        row; an end table that is not the documents' last places is refused."""
        from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask

        positions = torch.cat([POSITIONS, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]])])
        documents = document_ids(positions)
        ends = torch.stack([torch.tensor([int((row == d).nonzero().max()) for d in row]) for row in documents])

        def up_to_end(table):
            def to_end(b, h, q_idx, kv_idx):
                return q_idx <= table[b, kv_idx]
            return and_masks(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, to_end)

        batch = {"tokens": torch.arange(32).view(2, 16), "positions": positions,
                 "attention_masks": create_block_mask(up_to_end(ends), 2, None, 16, 16, device="cpu")}
        with fake_pg(2, rank=1) as group:
            local = shard_batch(batch, group)
            shard = shard_of(local["tokens"])
        assert torch.equal(shard.doc_ids, documents)
        dense = create_mask(local["attention_masks"].mask_mod, 2, 1, 8, 8)
        full = create_mask(batch["attention_masks"].mask_mod, 2, 1, 16, 16)
        for row in range(2):
            places = shard.query_positions[row]
            assert torch.equal(dense[row, 0], full[row, 0][places][:, places])
        off_by_one = {**batch, "attention_masks": create_block_mask(up_to_end(ends - 1), 2, None, 16, 16, device="cpu")}
        with fake_pg(2) as group, pytest.raises(ValueError, match="not each token's document's last place"):
            shard_batch(off_by_one, group)

    def test_block_masks_that_are_not_cut(self):
        """A BlockMask whose mask_mod is not documents / causal / a window, whose documents are
        not runs of tokens, or whose documents are not where the batch's positions restart:
        refused with the reason."""
        from torch.nn.attention.flex_attention import create_block_mask

        batch = auto_cp.titan_block_mask_batch([6, 8, 2])
        ids = document_ids(POSITIONS)
        split = ids.clone()
        split[0, 14:] = 0  # the first document's id again, after the others

        def prefix(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) | (kv_idx < 4)

        def documents_of(table):
            return lambda b, h, q_idx, kv_idx: (table[b, q_idx] == table[b, kv_idx]) & (q_idx >= kv_idx)

        cases = [({"attention_masks": create_block_mask(prefix, 1, None, 16, 16, device="cpu")},
                  "not a document, causal or sliding-window mask"),
                 ({"attention_masks": create_block_mask(documents_of(split), 1, None, 16, 16, device="cpu")},
                  "one id in separate runs"),
                 ({"attention_masks": create_block_mask(documents_of(ids), 1, None, 8, 8, device="cpu")},
                  r"a BlockMask over \(8, 8\) tokens in a batch of 16"),
                 ({"positions": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]])},
                  "not where the batch's positions restart")]
        for change, reason in cases:
            with fake_pg(2) as group, pytest.raises(ValueError, match=reason):
                shard_batch({**batch, **change}, group)

    def test_padding_is_refused(self):
        batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 6 + [0] * 2])}
        with fake_pg(2) as group, pytest.raises(ValueError, match="no padding"):
            shard_batch(batch, group)


# --- the rewrite, on the graph Dynamo hands the backend ---------------------------------------


def _rotated(q, k, v, position_ids):
    """``[B, T, H, D]`` q and k rotated over the positions (as a model reads them), all three
    ``[B, H, T, D]``."""
    q, k = auto_cp.rotary(q, position_ids), auto_cp.rotary(k, position_ids)
    return (x.transpose(1, 2) for x in (q, k, v))


def _attention(q, k, v, position_ids):
    q, k, v = _rotated(q, k, v, position_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=auto_cp.document_mask(position_ids), enable_gqa=True)


def _arg(a, group_name: str) -> str:
    if a == group_name:
        return "cp"
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, list) and len(a) == 7:
        return f"[{len(a)} plan tensors]"
    if isinstance(a, list):
        return f"[{', '.join(_arg(x, group_name) for x in a)}]"
    return repr(a)


def _summary(gm: torch.fx.GraphModule, group_name: str) -> str:
    """The graph's inputs and what the rewrite put in, one per line (tuple reads, sizes and the
    model's own ops left out)."""
    lines = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            lines.append(f"input {n.name}")
        elif n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            if not any(s in name for s in ("contiguous", "all_gather", "document_", "zeros_like", "heads", "repeat",
                                                      "checkpoint", "tokens_at", "argsort", "ids_checked", "cu_seqlens", "ring_in_graph",
                                                      "row_places", "index_select")):
                continue
            args = ", ".join(_arg(a, group_name) for a in n.args
                             if not (isinstance(a, torch.fx.Node) and a.name.startswith(("sym_size", "mul"))))
            if name.startswith("document_"):  # the window, where there is one
                args += "".join(f", {k}={_arg(a, group_name)}" for k, a in n.kwargs.items())
            lines.append(f"{n.name} = {name.split('.')[0]}({args})")
    return "\n".join(lines)


_LAST: dict = {}  # the graph module the last _rewritten made


def _rewritten(fn, *args, cp: int = 2, rank: int = 0, batch=None, bodies: bool = False, **options):
    seen = _LAST

    def backend(gm, example_inputs):
        gm, example_inputs, supply = engine.run_input_passes(gm, example_inputs,
                                                             snapshot({"context_parallel": name, **options}))
        seen["gm"] = gm
        return supply(gm.forward)

    with fake_pg(cp, rank) as group:
        name = group.group_name
        local = shard_batch(batch or {"input_ids": torch.zeros(POSITIONS.shape, dtype=torch.long),
                                      "position_ids": POSITIONS}, group)
        torch.compile(fn, backend=backend)(*args, local["position_ids"])
    if bodies:  # the outer graph, its one checkpointed body, and the outer graph's code
        body = next(m for n, m in seen["gm"].named_children() if isinstance(m, torch.fx.GraphModule))
        return _summary(seen["gm"], name), _summary(body, name), seen["gm"].code
    return _summary(seen["gm"], name)


class TestRewrite(TestCase):
    def test_document_mask_becomes_gathered_shard_attention(self):
        """HF's packed form (documents from the position ids' resets, causal): K and V gathered
        (GQA as is), the plan over the layout inputs, the shard op; the mask is no longer built."""
        q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
        self.assertExpectedInline(_rewritten(_attention, q, k, v), """\
input l_q_
input l_position_ids_
input l_k_
input l_v_
input cp_doc_ids
input cp_query_positions
input cp_key_positions
document_shard_plan_default = document_shard_plan(cp_doc_ids, cp_query_positions, cp_key_positions, False, True)
contiguous = contiguous(k_1)
all_gather_tensor_autograd = all_gather_tensor_autograd(contiguous, 2, cp)
contiguous_1 = contiguous(v)
all_gather_tensor_autograd_1 = all_gather_tensor_autograd(contiguous_1, 2, cp)
document_shard_attention_default = document_shard_attention(q_1, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_18, cp_doc_ids, cp_query_positions, cp_key_positions, 0.3535533905932738, True)""")

    def test_is_causal_attends_across_documents(self):
        """SDPA ``is_causal`` on a pack attends across documents, and so does its CP form: one
        document per row (the ids zeroed), causal over the places."""
        def causal(q, k, v, position_ids):
            return F.scaled_dot_product_attention(*_rotated(q, k, v, position_ids), is_causal=True)

        q = torch.randn(1, 8, 2, 8)
        summary = _rewritten(causal, q, q.clone(), q.clone())
        self.assertExpectedInline("\n".join(line for line in summary.splitlines() if "document" in line or "zeros" in line), """\
zeros_like = zeros_like(cp_doc_ids)
document_shard_plan_default = document_shard_plan(zeros_like, cp_query_positions, cp_key_positions, False, True)
document_shard_attention_default = document_shard_attention(transpose, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_12, zeros_like, cp_query_positions, cp_key_positions, 0.3535533905932738, True)""")


    def test_ring_on_rows_of_one_document(self):
        """The ring, forced, on a plain batch (each rank holds its two pieces of the row): this
        rank's q and every rank's K/V in turn inside one call, the layout checked in it (the ids
        too where the mask is over documents), no shard plan; marked as rotating for the CSE
        choice made before AOTAutograd."""
        from cp_inductor.passes.joint import collective_cse

        def causal(q, k, v, position_ids):
            return F.scaled_dot_product_attention(*_rotated(q, k, v, position_ids), is_causal=True, enable_gqa=True)

        plain = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "position_ids": torch.arange(16)[None]}
        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        ring = {"context_parallel_style": "ring"}
        self.assertExpectedInline(_rewritten(causal, q, k, k.clone(), batch=plain, **ring), """\
input l_q_
input l_position_ids_
input l_k_
input l_v_
input cp_doc_ids
input cp_query_positions
input cp_key_positions
ring_in_graph = ring_in_graph(transpose, transpose_1, transpose_2, cp_query_positions, None, True, 0, 2, cp, 0.3535533905932738)""")
        assert collective_cse.wanted(_LAST["gm"], [], snapshot({}))
        self.assertExpectedInline(_rewritten(_attention, q, k, k.clone(), batch=plain, **ring).splitlines()[-1], """\
ring_in_graph = ring_in_graph(q_1, k_1, v, cp_query_positions, cp_doc_ids, True, 0, 2, cp, 0.3535533905932738)""")

    def test_a_style_per_call(self):
        """``context_parallel_style`` as a list: the first call by the ring, the second (and any
        later) by the all-gather, in one graph; the first call's output, the second's query, is
        read from the ring's op (the pass crashed on an attention that reads another's output)."""
        def two_calls(q, k, v, position_ids):
            q, k, v = _rotated(q, k, v, position_ids)
            first = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(first, k, v, is_causal=True, enable_gqa=True)

        plain = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "position_ids": torch.arange(16)[None]}
        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        summary = _rewritten(two_calls, q, k, k.clone(), batch=plain, context_parallel_style="ring, allgather")
        self.assertExpectedInline("\n".join(line for line in summary.splitlines() if not line.startswith("input")), """\
ring_in_graph = ring_in_graph(q_1, k_1, v, cp_query_positions, None, True, 0, 2, cp, 0.3535533905932738)
zeros_like = zeros_like(cp_doc_ids)
document_shard_plan_default = document_shard_plan(zeros_like, cp_query_positions, cp_key_positions, False, True)
contiguous = contiguous(k_1)
all_gather_tensor_autograd = all_gather_tensor_autograd(contiguous, 2, cp)
contiguous_1 = contiguous(v)
all_gather_tensor_autograd_1 = all_gather_tensor_autograd(contiguous_1, 2, cp)
document_shard_attention_default = document_shard_attention(ring_in_graph, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_12, zeros_like, cp_query_positions, cp_key_positions, 0.3535533905932738, True)""")

    def test_ring_on_a_pack_goes_to_the_allgather(self):
        """On a pack a row is cut per document, not in the ring's two pieces: the forced ring is
        not taken, and the report says why."""
        cp_inductor.clear_report()
        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        summary = _rewritten(_attention, q, k, k.clone(), context_parallel_style="ring")
        assert "all_gather_tensor_autograd" in summary and "ring_in_graph" not in summary, summary
        line = cp_inductor.report().varlen[-1].line()
        assert "allgather" in line and "ring: this batch's rows hold several documents" in line, line

    def test_sliding_window_rides_along(self):
        """A sliding window over the documents (keys from q - 3 on, Mistral's over a pack): the same
        plan, the window handed to the shard op, counted over each token's place in the full row."""
        def windowed(q, k, v, position_ids):
            q, k, v = _rotated(q, k, v, position_ids)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=auto_cp.document_mask(position_ids, 3), enable_gqa=True)

        q = torch.randn(1, 8, 2, 8)
        summary = _rewritten(windowed, q, q.clone(), q.clone())
        self.assertExpectedInline("\n".join(line for line in summary.splitlines() if "document" in line), """\
document_shard_plan_default = document_shard_plan(cp_doc_ids, cp_query_positions, cp_key_positions, False, True)
document_shard_attention_default = document_shard_attention(q_1, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_18, cp_doc_ids, cp_query_positions, cp_key_positions, 0.3535533905932738, True, window_left=3)""")

    def test_varlen_call_reads_its_bounds_checked(self):
        """torch's ``varlen_attn`` over the rows flattened, its ``cu_seqlens`` an input (the full
        pack's, made before the model ran): the plan reads the documents those bounds make,
        checked on device against the full rows (``cu_seqlens_ids``) once, one plan for both calls
        reading them; q, k and v go to ``[B, H, T, D]`` and the output back; K and V gathered
        with their own heads (GQA)."""
        def varlen(q, k, v, cu_seqlens, position_ids):
            q, k = auto_cp.rotary(q, position_ids), auto_cp.rotary(k, position_ids)
            first = auto_cp.varlen_documents(q, k, v, cu_seqlens, 8)
            return auto_cp.varlen_documents(first, k, v, cu_seqlens, 8)

        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        cu_seqlens = torch.tensor([0, 6, 14, 16], dtype=torch.int32)  # POSITIONS' documents
        summary = _rewritten(varlen, q, k, k.clone(), cu_seqlens)
        self.assertExpectedInline("\n".join(line for line in summary.splitlines() if not line.startswith("input")), """\
cu_seqlens_ids_default = cu_seqlens_ids(l_cu_seqlens_, cp_key_positions)
document_shard_plan_default = document_shard_plan(cu_seqlens_ids_default, cp_query_positions, cp_key_positions, False, True)
contiguous = contiguous(transpose_1)
all_gather_tensor_autograd = all_gather_tensor_autograd(contiguous, 2, cp)
contiguous_1 = contiguous(transpose_2)
all_gather_tensor_autograd_1 = all_gather_tensor_autograd(contiguous_1, 2, cp)
document_shard_attention_default = document_shard_attention(transpose, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_12, cu_seqlens_ids_default, cp_query_positions, cp_key_positions, 0.3535533905932738, True)
contiguous_2 = contiguous(transpose_5)
all_gather_tensor_autograd_2 = all_gather_tensor_autograd(contiguous_2, 2, cp)
contiguous_3 = contiguous(transpose_6)
all_gather_tensor_autograd_3 = all_gather_tensor_autograd(contiguous_3, 2, cp)
document_shard_attention_default_1 = document_shard_attention(transpose_4, all_gather_tensor_autograd_2, all_gather_tensor_autograd_3, [7 plan tensors], getitem_12, cu_seqlens_ids_default, cp_query_positions, cp_key_positions, 0.3535533905932738, True)""")

    def test_ulysses_repeats_key_value_heads_up_to_cp(self):
        """Ulysses at cp 4 with 2 K/V heads: each K/V head repeated twice (query head h then reads
        repeated head h, the one its group had), q, k, v scattered by heads over every rank's
        tokens, which arrive rank after rank and are put in row order (``argsort`` of their
        places), so that each document is one segment of one FA4 call; the output goes back to
        rank order and to this rank's tokens."""
        q, k = torch.randn(1, 4, 4, 16), torch.randn(1, 4, 2, 16)
        summary = _rewritten(_attention, q, k, k.clone(), cp=4, context_parallel_style="ulysses")
        self.assertExpectedInline("\n".join(line for line in summary.splitlines() if not line.startswith("input")), """\
argsort = argsort(cp_key_positions)
document_shard_plan_default = document_shard_plan(cp_doc_ids, None, None, False, True)
repeat_interleave = repeat_interleave(k_1, 2)
repeat_interleave_1 = repeat_interleave(v, 2)
scatter_heads = scatter_heads(q_1, 'bhsd', 4, cp)
tokens_at = tokens_at(scatter_heads, argsort)
scatter_heads_1 = scatter_heads(repeat_interleave, 'bhsd', 4, cp)
tokens_at_1 = tokens_at(scatter_heads_1, argsort)
scatter_heads_2 = scatter_heads(repeat_interleave_1, 'bhsd', 4, cp)
tokens_at_2 = tokens_at(scatter_heads_2, argsort)
document_shard_attention_default = document_shard_attention(tokens_at, tokens_at_1, tokens_at_2, [7 plan tensors], getitem_18, cp_doc_ids, None, None, 0.25, True)
tokens_at_3 = tokens_at(getitem_19, cp_key_positions)
gather_heads = gather_heads(tokens_at_3, 'bhsd', 4, cp)""")


    def test_checkpointed_body_is_rewritten_inside(self):
        """Attention inside an activation-checkpointed body (``torch.utils.checkpoint``, as HF's
        gradient checkpointing calls it): the plan is made once outside, its tensors and the
        layout become inputs of the body (recomputed with it in the backward, the all-gathers
        too), and the mask, no longer read, is no longer passed in or built."""
        def checkpointed(q, k, v, position_ids):
            def body(q, k, v, mask):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            q, k, v = _rotated(q, k, v, position_ids)
            return torch.utils.checkpoint.checkpoint(body, q, k, v, auto_cp.document_mask(position_ids), use_reentrant=False)

        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        outer, body, code = _rewritten(checkpointed, q, k, k.clone(), bodies=True)
        self.assertNotIn("tril", code)  # the mask is not built
        self.assertExpectedInline("\n".join(line for line in outer.splitlines() if "checkpoint" in line), """\
tag_activation_checkpoint = tag_activation_checkpoint(wrap_body_0_cp, q_1, k_1, v, cp_doc_ids, getitem_12, getitem_13, getitem_14, getitem_15, getitem_16, getitem_17, getitem_18, getitem_19, cp_query_positions, cp_key_positions)""")
        self.assertExpectedInline(body, """\
input q_1
input k_1
input v
input cp_doc_ids
input cp_plan_0
input cp_plan_1
input cp_plan_2
input cp_plan_3
input cp_plan_4
input cp_plan_5
input cp_plan_6
input cp_plan_meta
input cp_query_positions
input cp_key_positions
contiguous = contiguous(k_1)
all_gather_tensor_autograd = all_gather_tensor_autograd(contiguous, 2, cp)
contiguous_1 = contiguous(v)
all_gather_tensor_autograd_1 = all_gather_tensor_autograd(contiguous_1, 2, cp)
document_shard_attention_default = document_shard_attention(q_1, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], cp_plan_meta, cp_doc_ids, cp_query_positions, cp_key_positions, 0.3535533905932738, True)""")


    def test_arange_as_a_row_index_is_taken(self):
        """``x[arange(T), labels]`` picks each token's own entry, the same on any layout: taken."""
        def picked(q, k, v, position_ids):
            out = _attention(q, k, v, position_ids)  # [B, H, T, D]
            return out[0, 0][torch.arange(q.shape[1]), position_ids[0] % out.shape[-1]]

        q = torch.randn(1, 8, 2, 8)
        self.assertIn("document_shard_attention", _rewritten(picked, q, q.clone(), q.clone()))

    def test_flex_block_mask_built_in_the_graph(self):
        """flex attention whose BlockMask the compiled code builds from the position ids (same
        document, causal): the same gathered shard attention as SDPA's document mask; nothing
        reads the BlockMask any more (its construction is dead code for AOTAutograd to drop)."""
        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)

        def flex(q, k, v, position_ids):
            return auto_cp.flex_documents(*_rotated(q, k, v, position_ids), position_ids)

        with torch.no_grad():  # (torch has no flex backward on CPU)
            summary = _rewritten(flex, q, k, k.clone())
        code = _LAST["gm"].code
        self.assertNotIn("flex_attention", code)
        self.assertExpectedInline("\n".join(line for line in summary.splitlines() if "document" in line), """\
document_shard_plan_default = document_shard_plan(cp_doc_ids, cp_query_positions, cp_key_positions, False, True)
document_shard_attention_default = document_shard_attention(query, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_17, cp_doc_ids, cp_query_positions, cp_key_positions, 0.35355339059327373, True)""")

    def test_a_block_mask_cut_by_shard_batch(self):
        """torchtitan's BlockMask made before the model, as shard_batch hands it over: its mask_mod
        reads the rank's documents, which the graph takes in as the layout's own (no device
        check): the same gathered shard attention; nothing reads the BlockMask any more."""
        from torch.nn.attention.flex_attention import flex_attention

        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        batch = auto_cp.titan_block_mask_batch([6, 8, 2])

        def titan(q, k, v, positions, attention_masks):
            return flex_attention(*_rotated(q, k, v, positions), block_mask=attention_masks["full"], enable_gqa=True)

        def backend(gm, example_inputs):
            gm, example_inputs, supply = engine.run_input_passes(gm, example_inputs, snapshot({"context_parallel": name}))
            _LAST["gm"] = gm
            return supply(gm.forward)

        with fake_pg(2, 0) as group, torch.no_grad():  # (torch has no flex backward on CPU)
            name = group.group_name
            local = shard_batch(batch, group)
            torch.compile(titan, backend=backend)(q, k, k.clone(), local["positions"], local["attention_masks"])
        code = _LAST["gm"].code
        self.assertNotIn("flex_attention", code)
        self.assertNotIn("ids_checked", code)
        self.assertExpectedInline("\n".join(line for line in _summary(_LAST["gm"], name).splitlines() if "document" in line), """\
document_shard_plan_default = document_shard_plan(cp_doc_ids, cp_query_positions, cp_key_positions, False, True)
document_shard_attention_default = document_shard_attention(query, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_12, cp_doc_ids, cp_query_positions, cp_key_positions, 0.35355339059327373, True)""")


def _loss_lines(gm: torch.fx.GraphModule, group_name: str) -> str:
    """The graph's nodes after its last attention call, one per line (the loss, as rewritten)."""
    nodes = list(gm.graph.nodes)
    last = max(i for i, n in enumerate(nodes) if "document_shard_attention" in str(n.target))
    lines = []
    for n in nodes[last + 1:]:
        if n.op in ("call_function", "call_method") and not n.name.startswith(("getitem", "transpose", "flatten")):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
            args = ", ".join("cp" if "all_reduce" in name and k == 2 else _arg(a, group_name) for k, a in enumerate(n.args))
            kwargs = "".join(f", {k}={_arg(a, group_name)}" for k, a in n.kwargs.items() if k in ("reduction", "dtype"))
            lines.append(f"{n.name} = {name}({args}{kwargs})")
    return "\n".join(lines)


def _loss_over(loss_of):
    """A program of one attention call whose output, read out by a fixed matrix, ``loss_of``
    turns into a loss with the per-token ``labels``."""
    w = torch.randn(32, 5)

    def program(q, k, v, labels, position_ids):
        out = _attention(q, k, v, position_ids).transpose(1, 2).flatten(2) @ w
        return loss_of(out.flatten(0, 1), labels.flatten())

    return program


def _loss_rewritten(loss_of) -> str:
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    _rewritten(_loss_over(loss_of), q, k, v, torch.tensor([[1, 2, -100, 3, 4, 0, 1, 2]]))
    return _loss_lines(_LAST["gm"], "")


class TestTokenMeans(TestCase):
    """A mean over this rank's tokens (a loss that ignores ``num_items_in_batch``) becomes the
    rank's share of the full batch's mean (``passes/dynamo/token_means.py``)."""

    def test_cross_entropy_mean_divides_by_the_full_batch_count(self):
        """Cross entropy's default mean: the sum over the full batch's labelled tokens, their
        count all-reduced over the ranks."""
        self.assertExpectedInline(_loss_rewritten(F.cross_entropy), """\
out = matmul(flatten, l_w_)
ne_1 = ne(flatten_2, -100)
sum_1 = sum(ne_1)
all_reduce = all_reduce(sum_1, 'sum', cp)
cross_entropy_1 = cross_entropy(flatten_1, flatten_2, reduction='sum')
truediv_3 = truediv(cross_entropy_1, all_reduce)""")

    def test_mean_of_every_element_divides_by_cp_times_the_count(self):
        """A ``mean()`` over every element: summed in fp32, over cp times this rank's count
        (every rank holds as many tokens)."""
        self.assertExpectedInline(_loss_rewritten(lambda logits, labels: (logits.float() ** 2).mean()), """\
out = matmul(flatten, l_w_)
float_3 = float(flatten_1)
pow_3 = pow(float_3, 2)
sum_1 = sum(pow_3, dtype=torch.float32)
truediv_3 = truediv(sum_1, 80)
to = to(truediv_3, torch.float32)""")

    def test_masked_mean_all_reduces_its_denominator(self):
        """A sum over tokens divided by another (the mask's sum, clamped): the denominator's sum
        all-reduced before the clamp, as the single device clamps the full batch's."""
        def masked(logits, labels):
            kept = (labels != -100).float()
            per_token = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
            return (per_token * kept).sum() / kept.sum().clamp(min=1)

        self.assertExpectedInline(_loss_rewritten(masked), """\
out = matmul(flatten, l_w_)
ne_1 = ne(flatten_2, -100)
kept = float(ne_1)
clamp = clamp(flatten_2)
per_token = cross_entropy(flatten_1, clamp, reduction='none')
mul_10 = mul(per_token, kept)
sum_1 = sum(mul_10)
sum_2 = sum(kept)
all_reduce = all_reduce(sum_2, 'sum', cp)
clamp_1 = clamp(all_reduce)
truediv_4 = truediv(sum_1, clamp_1)""")

    def test_summed_loss_over_a_count_of_its_labels(self):
        """A summed loss over the count of labelled tokens the graph computes (written by hand,
        or HF's loss where ``num_items_in_batch`` is not passed through): the count all-reduced."""
        def summed(logits, labels):
            return F.cross_entropy(logits, labels, reduction="sum") / (labels != -100).sum()

        self.assertExpectedInline(_loss_rewritten(summed), """\
out = matmul(flatten, l_w_)
cross_entropy = cross_entropy(flatten_1, flatten_2, reduction='sum')
ne_1 = ne(flatten_2, -100)
sum_1 = sum(ne_1)
all_reduce = all_reduce(sum_1, 'sum', cp)
truediv_4 = truediv(cross_entropy, all_reduce)""")

    def test_counts_of_samples_and_elements(self):
        """Cross entropy over class probabilities averages over the samples (8 here, 16 over the
        ranks); an element-wise loss over its elements (40, 80)."""
        def probabilities_and_squares(logits, labels):
            return F.cross_entropy(logits, logits.softmax(-1).detach()) + F.mse_loss(logits, torch.zeros_like(logits))

        self.assertExpectedInline(_loss_rewritten(probabilities_and_squares), """\
out = matmul(flatten, l_w_)
softmax = softmax(flatten_1, -1)
detach = detach(softmax)
cross_entropy_1 = cross_entropy(flatten_1, detach, reduction='sum')
truediv_3 = truediv(cross_entropy_1, 16)
zeros_like = zeros_like(flatten_1)
mse_loss_1 = mse_loss(flatten_1, zeros_like, reduction='sum')
truediv_4 = truediv(mse_loss_1, 80)
add_2 = add(truediv_3, truediv_4)""")

    def test_kl_divergence_over_the_batch_divides_by_cp_times_its_rows(self):
        """``kl_div(..., reduction="batchmean")`` (distillation) over flattened tokens divides by
        its dim 0, this rank's 8 tokens: by 16 instead."""
        def distilled(logits, labels):
            return F.kl_div(logits.log_softmax(-1), logits.softmax(-1).detach().flip(-1), reduction="batchmean")

        self.assertExpectedInline(_loss_rewritten(distilled), """\
out = matmul(flatten, l_w_)
log_softmax = log_softmax(flatten_1, -1)
softmax = softmax(flatten_1, -1)
detach = detach(softmax)
flip = flip(detach, -1)
kl_div_1 = kl_div(log_softmax, flip, reduction='sum')
truediv_3 = truediv(kl_div_1, 16)""")

    def test_a_statistic_read_by_a_product_becomes_the_full_batchs(self):
        """A mean over the tokens that keeps other dims (the mean probability per class), squared:
        all-reduced to the full batch's (its gradient this rank's own: ``sub`` of itself
        detached), and the term of the loss made from it divided by cp (``token_statistics``)."""
        def balanced(logits, labels):
            balance = (logits.softmax(-1).mean(0) ** 2).sum()
            return F.cross_entropy(logits, labels, reduction="sum") / 16 + 0.01 * balance

        self.assertExpectedInline(_loss_rewritten(balanced), """\
out = matmul(flatten, l_w_)
softmax = softmax(flatten_1, -1)
mean = mean(softmax, 0)
detach = detach(mean)
all_reduce = all_reduce(detach, 'sum', cp)
truediv_6 = truediv(all_reduce, 2)
sub_2 = sub(mean, detach)
add_3 = add(sub_2, truediv_6)
pow_3 = pow(add_3, 2)
balance = sum(pow_3)
cross_entropy = cross_entropy(flatten_1, flatten_2, reduction='sum')
truediv_4 = truediv(cross_entropy, 16)
mul_10 = mul(0.01, balance)
truediv_5 = truediv(mul_10, 2)
add_2 = add(truediv_4, truediv_5)""")

    def test_counts_over_a_count_taken_from_the_shapes(self):
        """Counts of tokens per class (``histc``, as HF's MoE balancing loss counts tokens per
        expert) and a sum over the tokens, each divided by the token count the program read from
        its shapes (8 here): the sums all-reduced, the counts cp times theirs (16)."""
        def counted(logits, labels):
            chosen = logits.argmax(-1).float()
            load = torch.histc(chosen, bins=5, min=0, max=5) / chosen.shape[0]
            return (load * logits.softmax(-1).sum(0) / chosen.shape[0]).sum()

        self.assertExpectedInline(_loss_rewritten(counted), """\
out = matmul(flatten, l_w_)
argmax = argmax(flatten_1, -1)
chosen = float(argmax)
histc = histc(chosen)
detach = detach(histc)
all_reduce = all_reduce(detach, 'sum', cp)
mul = mul(histc, 2)
mul_11 = mul(detach, 2)
sub_2 = sub(mul, mul_11)
add_2 = add(sub_2, all_reduce)
load = truediv(add_2, 16)
softmax = softmax(flatten_1, -1)
sum_1 = sum(softmax, 0)
detach_1 = detach(sum_1)
all_reduce_1 = all_reduce(detach_1, 'sum', cp)
mul_12 = mul(sum_1, 2)
mul_13 = mul(detach_1, 2)
sub_3 = sub(mul_12, mul_13)
add_3 = add(sub_3, all_reduce_1)
mul_10 = mul(load, add_3)
truediv_5 = truediv(mul_10, 16)
sum_2 = sum(truediv_5)
truediv_6 = truediv(sum_2, 2)""")

    def test_a_picked_token_comes_from_the_rank_holding_it(self):
        """One token of each row read by a loss (``x[arange(B), -1]``, HF's sequence classifiers
        without a pad token: the last of the full row, place 15 of 16): this rank's tokens at that
        place summed (only the rank holding it has one), all-reduced; the loss made from it
        divided by cp. (BERT's ``x[:, 0]``: the numerics test below.)"""
        def last_token(logits, labels):
            rows = logits.unflatten(0, (1, 8))
            return F.cross_entropy(rows[torch.arange(rows.shape[0]), -1], torch.tensor([3]))

        self.assertExpectedInline(_loss_rewritten(last_token), """\
out = matmul(flatten, l_w_)
rows = unflatten(flatten_1, 0, (1, 8))
eq_1 = eq(cp_query_positions, 15)
where = where(getitem_21, rows, 0)
sum_1 = sum(where, 1)
detach = detach(sum_1)
all_reduce = all_reduce(detach, 'sum', cp)
mul = mul(sum_1, 2)
mul_10 = mul(detach, 2)
sub_2 = sub(mul, mul_10)
add_2 = add(sub_2, all_reduce)
tensor = tensor([3])
cross_entropy = cross_entropy(add_2, tensor)
truediv_3 = truediv(cross_entropy, 2)""")

    def test_statistics_handed_out_of_the_graph(self):
        """A mean over the tokens handed out as a tensor (pooled logits beside the loss) is the
        full batch's, as the single device returns it (not divided: only scalars are shares);
        counts written into a buffer (tokens per expert, which a trainer all-reduces itself) stay
        this rank's, also where the loss reads them."""
        load = torch.zeros(5)

        def with_outputs(logits, labels):
            counts = torch.histc(logits.argmax(-1).float(), bins=5, min=0, max=5)
            load.add_(counts)
            return F.cross_entropy(logits, labels, reduction="sum") / 16 + counts.amax() / 100, logits.mean(0)

        self.assertExpectedInline(_loss_rewritten(with_outputs), """\
out = matmul(flatten, l_w_)
argmax = argmax(flatten_1, -1)
float_3 = float(argmax)
counts = histc(float_3)
add_ = add_(l_loss_of_closure_0_cell_contents, counts)
cross_entropy = cross_entropy(flatten_1, flatten_2, reduction='sum')
truediv_4 = truediv(cross_entropy, 16)
amax = amax(counts)
truediv_5 = truediv(amax, 100)
add_2 = add(truediv_4, truediv_5)
mean = mean(flatten_1, 0)
detach = detach(mean)
all_reduce = all_reduce(detach, 'sum', cp)
truediv_6 = truediv(all_reduce, 2)
sub_2 = sub(mean, detach)
add_3 = add(sub_2, truediv_6)""")

    def test_switched_off_the_mean_stays_this_ranks(self):
        cp_inductor.clear_report()
        q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
        _rewritten(_loss_over(F.cross_entropy), q, k, v, torch.zeros(1, 8, dtype=torch.long),
                   context_parallel_global_means=False)
        assert "cross_entropy" in _loss_lines(_LAST["gm"], "") and "all_reduce" not in _loss_lines(_LAST["gm"], "")
        assert [m.line() for m in cp_inductor.report().token_means] == [
            "context-parallel mean cross_entropy: cross_entropy averaged over this rank's labelled tokens: kept, this "
            "rank's mean (context_parallel_global_means=False)"]


@pytest.mark.filterwarnings("error:Raw Sym")
def test_element_counts_are_read_in_the_graph_under_dynamic_shapes():
    """Under ``dynamic=True`` a mean's element count is a symbol: it is read from the tensor's
    size in the graph (torch.fx warns of a raw SymInt among a node's arguments, an error here),
    and the program is the same as the static one."""
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    program = _loss_over(lambda logits, labels: (logits ** 2).mean() + F.mse_loss(logits, torch.zeros_like(logits)))
    got = []
    try:
        for dynamic in (False, True):
            cp_inductor.clear_report()
            with fake_pg(2, 0) as group, torch.no_grad():
                local = shard_batch({"input_ids": torch.zeros(POSITIONS.shape, dtype=torch.long),
                                     "position_ids": POSITIONS}, group)["position_ids"]
                compiled = torch.compile(program, backend="cp_inductor", dynamic=dynamic,
                                         options={"cp_inductor.context_parallel": group.group_name})
                got.append(compiled(q, k, v, torch.zeros(1, 8, dtype=torch.long), local))
                lines = [m.line() for m in cp_inductor.report().token_means]
            torch._dynamo.reset()
            assert {line.split(": ")[0] for line in lines} == {"context-parallel mean mean",
                                                               "context-parallel mean mse_loss"}, (dynamic, lines)
    finally:
        torch._dynamo.reset()
        cp_inductor.clear_report()
    assert torch.equal(*got), got


@pytest.mark.parametrize("loss_of, match", [
    (lambda logits, labels: F.cross_entropy(logits, labels).exp(), r"is read by exp"),
    (lambda logits, labels: (logits - logits.mean()).square().sum(), r"read back at every token \(sub"),
    (lambda logits, labels: F.cross_entropy(logits, labels, weight=torch.ones(5)), r"class weights"),
    (lambda logits, labels: F.poisson_nll_loss(logits, logits.detach().exp()), r"poisson_nll_loss with reduction='mean'"),
    (lambda logits, labels: F.cross_entropy(logits, labels, reduction="sum") ** logits.softmax(-1).mean(0).sum(),
     r"is read by pow \(pow\w*\) with this rank's share"),
    (lambda logits, labels: F.cross_entropy(logits, labels, reduction="sum") * logits.softmax(-1).mean(0).square().sum(),
     r"is read by mul \(mul\w*\) with this rank's share"),
    (lambda logits, labels: torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                                         logits.softmax(-1).mean(0).square().sum()]).sum(),
     r"made the full batch's, is read by stack"),
], ids=["perplexity", "centred_by_the_mean", "class_weights", "other_losses", "statistic_read_by_a_share",
    "statistic_scaling_a_share", "statistic_beside_own_values"])
def test_means_that_cannot_be_shares_fail_the_compile(loss_of, match):
    """Read otherwise than by sums and scalings, the ranks' outputs would not sum to the
    single-device one: the compile fails naming the op (it was a silent wrong answer)."""
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    with pytest.raises(Exception, match=match):
        _rewritten(_loss_over(loss_of), q, k, v, torch.zeros(1, 8, dtype=torch.long))


def _flex_over(mask_mod, q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device="cpu")
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def _hf_flex_form(q, k, v, ids, positions, position_ids):
    """HF transformers' packed flex mask as its decoder graph sees it: the document ids (the
    runs of the position ids) and the positions its causal compares come in as inputs."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (positions[b, kv_idx] <= positions[b, q_idx]) & (ids[b, q_idx] == ids[b, kv_idx])
    return _flex_over(mask_mod, *_rotated(q, k, v, position_ids))


class TestTablesTakenIn(TestCase):
    """A flex mask_mod whose tables the graph takes in, HF's packed form: read as the documents of
    the position ids and causal over them, once checked on device."""

    def _local(self):
        with fake_pg(2, 0) as group:
            return shard_batch({"input_ids": torch.zeros(POSITIONS.shape, dtype=torch.long), "position_ids": POSITIONS},
                               group)["position_ids"]

    def test_rewritten_after_a_device_check(self):
        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        local = self._local()
        ids = (torch.diff(local, prepend=local[:, :1] - 1) != 1).cumsum(-1)
        with torch.no_grad():
            summary = _rewritten(_hf_flex_form, q, k, k.clone(), ids, local.clone())
        self.assertExpectedInline("\n".join(line for line in summary.splitlines() if "check" in line or "plan" in line), """\
ids_checked_default = ids_checked(cp_doc_ids, l_position_ids_, [l_ids_], [l_positions_])
document_shard_plan_default = document_shard_plan(ids_checked_default, cp_query_positions, cp_key_positions, False, True)
document_shard_attention_default = document_shard_attention(query, all_gather_tensor_autograd, all_gather_tensor_autograd_1, [7 plan tensors], getitem_16, ids_checked_default, cp_query_positions, cp_key_positions, 0.35355339059327373, True)""")

    def test_tables_that_are_not_the_positions_fail_on_device(self):
        """One document table over the whole row while the positions restart: a device error,
        never the attention of other documents."""
        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        local = self._local()
        with torch.no_grad(), self.assertRaisesRegex(Exception, "not the runs of the position ids"):
            _rewritten(_hf_flex_form, q, k, k.clone(), torch.zeros_like(local), local.clone())
        ids = (torch.diff(local, prepend=local[:, :1] - 1) != 1).cumsum(-1)
        with torch.no_grad(), self.assertRaisesRegex(Exception, "position table is not the position ids"):
            _rewritten(_hf_flex_form, q, k, k.clone(), ids, torch.arange(8)[None])


def test_wrong_tables_fail_in_the_compiled_step():
    """Through the backend and Inductor's code (not the graph run as it is): the check is an op of
    its own, which Inductor cannot compile away."""
    import cp_inductor

    q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
    with fake_pg(2, 0) as group, torch.no_grad():
        local = shard_batch({"input_ids": torch.zeros(POSITIONS.shape, dtype=torch.long), "position_ids": POSITIONS},
                            group)["position_ids"]
        compiled = torch.compile(_hf_flex_form, backend="cp_inductor",
                                 options={"cp_inductor.context_parallel": group.group_name})
        with pytest.raises(Exception, match="not the runs of the position ids"):
            compiled(q, k, k.clone(), torch.zeros_like(local), local.clone(), local)
    torch._dynamo.reset()
    cp_inductor.clear_report()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.filterwarnings("error:Raw Sym")
def test_the_layout_inputs_bring_no_symbol_of_their_own(dynamic):
    """The inputs the pass adds (where each token sits) reach AOTAutograd sized by the batch
    input. Given as real tensors, AOTAutograd made symbols of their sizes that Dynamo cannot
    name in a guard: the first guard on one (Inductor's 32-bit index check, at T64K on a GPU)
    failed the compile in Dynamo's guard building. Nor does a symbol reach the graph as a value:
    the softmax scale of a symbolic head dim is read from the query's size in the graph (torch.fx
    warns of a raw SymFloat among a node's arguments, an error here)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    made = []
    create_symbol = ShapeEnv.create_symbol

    def recording(self, val, source, *args, **kwargs):
        name = source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", "")
        made.append(str(name))
        return create_symbol(self, val, source, *args, **kwargs)

    q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
    try:
        with fake_pg(2, 0) as group, torch.no_grad(), mock.patch.object(ShapeEnv, "create_symbol", recording):
            local = shard_batch({"input_ids": torch.zeros(POSITIONS.shape, dtype=torch.long),
                                 "position_ids": POSITIONS}, group)["position_ids"]
            compiled = torch.compile(_attention, backend="cp_inductor", dynamic=dynamic,
                                     options={"cp_inductor.context_parallel": group.group_name})
            compiled(q, k, k.clone(), local)
            lines = [r.line() for r in cp_inductor.report().varlen]
    finally:
        torch._dynamo.reset()
        cp_inductor.clear_report()
    assert lines and all("context-parallel attention" in line for line in lines), lines
    assert made and not [name for name in made if "unknown_tensor" in name], made


@pytest.mark.parametrize("style", ["allgather", "ulysses", "ring"])
def test_rewritten_graphs_are_served_by_the_caches(style):
    """AOTAutograd's cache serves no graph calling a Python function it does not know, and each
    style puts some into the Dynamo graph (the all-to-alls of heads, torch's differentiable
    all-gather, the ring's call): without the patches the engine adds, a restarted job would
    compile every CP graph again. Every call in the rewritten graph passes the cache's check
    with them, and one does not without; every emitted name is a function."""
    import importlib

    import torch._inductor.config as inductor_config
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_node_safe

    from cp_inductor.passes.dynamo import context_parallel

    def causal(q, k, v, position_ids):
        return F.scaled_dot_product_attention(*_rotated(q, k, v, position_ids), is_causal=True, enable_gqa=True)

    plain = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "position_ids": torch.arange(16)[None]}
    q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
    options = {} if style == "allgather" else {"context_parallel_style": style}
    lines = _rewritten(causal, q, k, k.clone(), batch=plain, **options)
    gm = _LAST["gm"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    refused = []
    for node in calls:
        try:
            check_node_safe(node)
        except BypassAOTAutogradCache:
            refused.append(node.name)
    assert refused, lines  # the check this test is about still refuses such graphs
    with inductor_config.patch(engine.cache_patches(gm, {})):
        for node in calls:
            check_node_safe(node)
    for name in context_parallel.EMITS:
        module, _, attr = name.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_ulysses_call_is_one_round_per_document():
    """The op Ulysses' rewrite calls: every token in row order, positions the index (None): one
    segment and one round per document, and the packed path (reference kernels standing in for
    FA4) gives the dense mask's output and gradients."""
    from cp_inductor.lowerings import document_attention
    from cp_inductor.lowerings.varlen_attention import reference_kernels

    ids = document_ids(POSITIONS)
    tokens = ids.shape[1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, tokens, 8, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, tokens, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    with reference_kernels():
        plan, meta = torch.ops.cp_inductor.document_shard_plan(ids, None, None, False, True, 1, tokens, tokens)
        out = torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, ids, None, None, 0.25, True)[0]
    # segments, rounds, packable: the three documents, one round, the packed path (not the dense one)
    assert (int(meta[0]), int(meta[1]), int(meta[4])) == (3, 1, 1), meta
    want = document_attention._shard_dense(q, k, v, ids, None, None, 0.25, True)
    grad = torch.randn_like(out)
    for got_t, want_t in zip((out, *torch.autograd.grad(out, (q, k, v), grad)),
                             (want, *torch.autograd.grad(want, (q, k, v), grad))):
        torch.testing.assert_close(got_t, want_t, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_ulysses_call_matches_fp32():
    """The same op on FA4 (bf16, one GPU): output and every gradient against fp32 dense attention
    under the documents' causal mask, within 2x the error of the dense bf16 computation."""
    from cp_inductor.lowerings import document_attention, fa4_attention

    missing = fa4_attention.unavailable(torch.device("cuda"), torch.bfloat16, 128)
    if missing:
        pytest.skip(missing)
    tokens, d = 4096, 128
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([1000, 77, 2000, 1019]))[None].cuda()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, tokens, d, generator=g).cuda()
    k, v = (torch.randn(1, 2, tokens, d, generator=g).cuda() for _ in range(2))
    grad = torch.randn(1, 8, tokens, d, generator=g).cuda()

    def run(fn, dtype):
        ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*ins)
        return [out, *torch.autograd.grad(out, ins, grad.to(dtype))]

    def dense(q, k, v):
        return document_attention._shard_dense(q, k, v, ids, None, None, d ** -0.5, True)

    def ours(q, k, v):
        plan, meta = torch.ops.cp_inductor.document_shard_plan(ids, None, None, False, True, 1, tokens, tokens)
        return torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, ids, None, None, d ** -0.5, True)[0]

    want, base, got = run(dense, torch.float32), run(dense, torch.bfloat16), run(ours, torch.bfloat16)
    for name, x, ref, b in zip(("out", "dq", "dk", "dv"), got, want, base):
        err, err_base = (float((y.float() - ref).norm() / ref.norm()) for y in (x, b))
        assert err < max(2 * err_base, 5e-3), (name, err, err_base)


class TestTokenPlaces(TestCase):
    """Positions the model makes from the token index become the tokens' places in the row."""

    def test_arange_becomes_the_rows_places(self):
        """nanoGPT's positions (an arange over the tokens the model sees): under CP those are this
        rank's tokens, whose places in the row are not their indices; the arange becomes one row
        of the layout's places (the rows' being cut alike checked on device)."""
        def arange_positions(q, k, v, position_ids):
            return _attention(q + torch.arange(q.shape[1])[None, :, None, None], k, v, position_ids)

        q = torch.randn(1, 8, 2, 8)
        self.assertExpectedInline(_lines(_rewritten(arange_positions, q, q.clone(), q.clone()), "row_places"), """\
row_places_default = row_places(cp_query_positions, 0, 1, torch.int64)""")

    def test_float_arange_keeps_its_type(self):
        """A rotary embedding's ``t = arange(seqlen, dtype=float32)``: the places in its type."""
        def rotary_t(q, k, v, position_ids):
            t = torch.arange(q.shape[1], dtype=torch.float32)
            return _attention(q * t.cos()[None, :, None, None], k, v, position_ids)

        q = torch.randn(1, 8, 2, 8)
        self.assertExpectedInline(_lines(_rewritten(rotary_t, q, q.clone(), q.clone()), "row_places"), """\
row_places_default = row_places(cp_query_positions, 0, 1, torch.float32)""")

    def test_a_table_sliced_to_the_tokens_is_read_at_the_places(self):
        """torchtitan's rotary table sliced to the sequence length (``freqs_cis[:seqlen]``),
        narrowed to it, and sliced with new dims around the cut: read at the tokens' places."""
        class Rotated(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("angles", torch.randn(64, 8))

            def forward(self, q, k, v, position_ids):
                sliced, narrowed = self.angles[: q.shape[1]], self.angles.narrow(0, 0, q.shape[1])
                unsqueezed = self.angles[None, : q.shape[1], None]  # nanoGPT-like wpe.weight[None, :T]
                return _attention(q * sliced[None, :, None, :].cos() + unsqueezed, k * narrowed[None, :, None, :].sin(), v,
                                  position_ids)

        q = torch.randn(1, 8, 2, 8)
        self.assertExpectedInline(_lines(_rewritten(Rotated(), q, q.clone(), q.clone()), "row_places", "index_select"), """\
row_places_default = row_places(cp_query_positions, 0, 1, torch.int64)
index_select = index_select(l_self_buffers_angles_, 0, row_places_default)
row_places_default_1 = row_places(cp_query_positions, 0, 1, torch.int64)
index_select_1 = index_select(l_self_buffers_angles_, 0, row_places_default_1)
row_places_default_2 = row_places(cp_query_positions, 0, 1, torch.int64)
index_select_2 = index_select(l_self_buffers_angles_, 0, row_places_default_2)""")

    def test_an_arange_across_the_features_is_not_a_position(self):
        """A rotary embedding computing its frequencies from ``arange(head_dim // 2)`` in the model,
        with head_dim / 2 equal to the rank's token count: that arange meets the tokens along
        their features, not their places, and stays; the angles' ``t = arange(T)`` becomes the
        places."""
        def rotary(q, k, v, position_ids):
            half = q.shape[-1] // 2
            angle = torch.arange(q.shape[1])[:, None] / 100 ** (torch.arange(half)[None, :] / half)  # [T, D/2]
            cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
            a, b = q.chunk(2, dim=-1)
            return _attention(torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1), k, v, position_ids)

        q = torch.randn(1, 8, 2, 16)
        self.assertExpectedInline(_lines(_rewritten(rotary, q, q.clone(), q.clone()), "row_places"), """\
row_places_default = row_places(cp_query_positions, 0, 1, torch.int64)""")

    def test_an_arange_read_by_no_token_fails_the_compile(self):
        """An arange over the tokens handed out beside the output: nothing says whether it is a
        position, so the compile fails naming it."""
        def handed_out(q, k, v, position_ids):
            return _attention(q, k, v, position_ids), torch.arange(q.shape[1])

        q = torch.randn(1, 8, 2, 8)
        _refused(handed_out, q, q.clone(), q.clone(), match=r"arange_\d+: an arange over this rank.s tokens .* meets no "
                 r"per-token value")

    def test_an_arange_the_row_length_would_change_fails_the_compile(self):
        """Positions counted from the end (``arange(T, 0, -1)``) or scaled by the count
        (``arange(T) / T``): under CP the count is this rank's, not the row's."""
        def from_the_end(q, k, v, position_ids):
            return _attention(q + torch.arange(q.shape[1], 0, -1)[None, :, None, None], k, v, position_ids)

        def scaled(q, k, v, position_ids):
            return _attention(q + (torch.arange(q.shape[1]) / q.shape[1])[None, :, None, None], k, v, position_ids)

        q = torch.randn(1, 8, 2, 8)
        _refused(from_the_end, q, q.clone(), q.clone(), match=r"from 8 by -1, not from 0 by 1")
        _refused(scaled, q, q.clone(), q.clone(), match=r"combined with this rank's token count \(truediv")

    def test_rows_cut_differently_fail_the_step(self):
        """One arange for every row, but a pack whose rows were balanced each on its own: the
        step fails on device rather than place one row's tokens by another's places."""
        def arange_positions(q, k, v, position_ids):
            return _attention(q + torch.arange(q.shape[1])[None, :, None, None], k, v, position_ids)

        rows = auto_cp.packed_batch([4, 12], rows=2)
        rows["position_ids"][1] = torch.cat([torch.arange(12), torch.arange(4)])
        q = torch.randn(2, 8, 2, 8)
        with pytest.raises(Exception, match="shard_batch cut the rows differently"):
            _rewritten(arange_positions, q, q.clone(), q.clone(), batch=rows)


def _lines(summary: str, *names: str) -> str:
    """The lines of a :func:`_summary` that call one of ``names``."""
    return "\n".join(line for line in summary.splitlines() if any(f"= {name}(" in line for name in names))


def _refused(fn, *args, match: str):
    with pytest.raises(Exception, match=match):
        _rewritten(fn, *args)


class TestRefused:
    """What it cannot prove fails the compile, naming the call: the program computing this
    rank's tokens alone would give another answer."""

    def test_varlen_bounds_computed_in_the_graph(self):
        """Bounds the model computes from the tokens it sees (chunks of 4 here) bound this rank's
        tokens, not the full rows'."""
        def chunked(q, k, v, position_ids):
            q, k = auto_cp.rotary(q, position_ids), auto_cp.rotary(k, position_ids)
            cu_seqlens = torch.arange(0, q.shape[1] + 1, 4, dtype=torch.int32)
            return auto_cp.varlen_documents(q, k, v, cu_seqlens, 4)

        q = torch.randn(1, 8, 4, 8)
        _refused(chunked, q, q.clone(), q.clone(), match=r"cu_seqlens are computed in the graph")

    def test_varlen_inside_a_checkpointed_body(self):
        """A varlen call in an activation-checkpointed body is not taken yet (an SDPA there is)."""
        if not varlen_programs.register_cpu_kernels():
            pytest.skip("this torch has no varlen_attn")

        def checkpointed(q, k, v, cu_seqlens, position_ids):
            q, k = auto_cp.rotary(q, position_ids), auto_cp.rotary(k, position_ids)
            return torch.utils.checkpoint.checkpoint(auto_cp.varlen_documents, q, k, v, cu_seqlens, 8, use_reentrant=False)

        q = torch.randn(1, 8, 2, 8)
        _refused(checkpointed, q, q.clone(), q.clone(), torch.tensor([0, 6, 14, 16], dtype=torch.int32),
                 match=r"a packed-sequence \(varlen\) call inside the subgraph")

    def test_cross_attention(self):
        def cross(q, k, v, position_ids):
            q = auto_cp.rotary(q, position_ids).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))

        q = torch.randn(1, 8, 2, 8)
        _refused(cross, q, torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), match="not self-attention over this rank's 8 tokens")

    def test_padding_mask(self):
        def padded(q, k, v, position_ids):
            keep = (position_ids < 6)[:, None, None, :]  # a per-key table: padding
            return F.scaled_dot_product_attention(*_rotated(q, k, v, position_ids), attn_mask=keep)

        q = torch.randn(1, 8, 2, 8)
        _refused(padded, q, q.clone(), q.clone(), match="mask is not one it can shard")

    def test_documents_not_from_the_sharded_positions(self):
        def other_ids(q, k, v, position_ids):
            ids = torch.arange(8)[None] // 4  # documents of its own, not the batch's
            mask = (ids[:, :, None] == ids[:, None, :])[:, None]
            return F.scaled_dot_product_attention(*_rotated(q, k, v, position_ids), attn_mask=mask)

        q = torch.randn(1, 8, 2, 8)
        _refused(other_ids, q, q.clone(), q.clone(), match="not the resets of the position ids")

    def test_flex_tables_not_shaped_as_the_positions(self):
        """A flex mask_mod reading a document table the graph takes in (HF transformers builds
        flex's BlockMask before a graph break) that is not a [B, T] table beside the position
        ids: what it holds cannot be checked against them."""
        def flex(q, k, v, table, position_ids):
            def mask_mod(b, h, q_idx, kv_idx):
                return (table[q_idx] == table[kv_idx]) & (q_idx >= kv_idx)
            return _flex_over(mask_mod, *_rotated(q, k, v, position_ids))

        q = torch.randn(1, 8, 2, 8)
        with torch.no_grad():
            _refused(flex, q, q.clone(), q.clone(), torch.zeros(8, dtype=torch.long),
                     match="come in as inputs of this graph")

    def test_dropout(self):
        def dropped(q, k, v, position_ids):
            return F.scaled_dot_product_attention(*_rotated(q, k, v, position_ids), dropout_p=0.1, is_causal=True)

        q = torch.randn(1, 8, 2, 8)
        _refused(dropped, q, q.clone(), q.clone(), match="has dropout")

    def test_attention_written_out(self):
        def eager(q, k, v, position_ids):
            q, k, v = _rotated(q, k, v, position_ids)
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v

        q = torch.randn(1, 8, 2, 8)
        _refused(eager, q, q.clone(), q.clone(), match="attention written out")

    def test_a_convolution_over_the_tokens(self):
        """A short convolution over the sequence before attention (a hybrid model's): over this
        rank's tokens it would read the wrong neighbours. A 1-wide kernel reads each token alone
        and is taken (``token_mixing`` follows the token dim; tests/test_token_mixing.py)."""
        w = torch.randn(16, 1, 4)

        def hybrid(q, k, v, position_ids, width=4):
            mixed = F.conv1d(q.flatten(2).transpose(1, 2), w[..., :width], groups=16, padding=width - 1)
            return _attention(mixed[..., :q.shape[1]].transpose(1, 2).reshape(q.shape), k, v, position_ids)

        q = torch.randn(1, 8, 2, 8)
        _refused(hybrid, q, q.clone(), q.clone(), match=r"conv1d over the token dim, kernel 4")
        _rewritten(functools.partial(hybrid, width=1), q, q.clone(), q.clone())

    def test_a_convolution_inside_a_checkpointed_block(self):
        """The same convolution inside an activation-checkpointed block beside its attention: the
        token dim is followed into the body the rewrite changes. Before, the check read the
        body Dynamo made, not the copy rewritten, and the compile went through."""
        w = torch.randn(16, 1, 4)

        def block(q, k, v, position_ids):
            mixed = F.conv1d(q.flatten(2).transpose(1, 2), w, groups=16, padding=3)
            return _attention(mixed[..., :q.shape[1]].transpose(1, 2).reshape(q.shape), k, v, position_ids)

        def checkpointed(q, k, v, position_ids):
            return torch.utils.checkpoint.checkpoint(block, q, k, v, position_ids, use_reentrant=False)

        q = torch.randn(1, 8, 2, 8)
        _refused(checkpointed, q, q.clone(), q.clone(), match=r"conv1d over the token dim, kernel 4")

    def test_a_reduction_over_the_tokens_no_pass_makes_the_full_rows(self):
        """A max over this rank's tokens (max pooling), and HF's sequence classifiers with a pad
        token (the last non-pad token found by an argmax over ``arange(T) * not_pad``, then picked):
        over this rank's tokens alone each is another value, and no pass makes it the full row's.
        Before, the argmax's arange was refused; once aranges became places, the pick went
        through silently (HF Llama's classifier: loss 2.15 against 1.10 at cp 2)."""
        def max_pooled(q, k, v, position_ids):
            return _attention(q, k, v, position_ids).amax(dim=2)

        def last_not_padded(q, k, v, position_ids):
            out = _attention(q, k, v, position_ids)
            last = (torch.arange(q.shape[1]) * (q[..., 0, 0] != 0)).argmax(-1)
            return out.transpose(1, 2)[torch.arange(q.shape[0]), last]

        q = torch.randn(1, 8, 2, 8)
        _refused(max_pooled, q, q.clone(), q.clone(), match=r"amax over the token dim")
        _refused(last_not_padded, q, q.clone(), q.clone(), match=r"argmax over the token dim")

    def test_positions_not_from_shard_batch(self):
        seen = {}

        def backend(gm, example_inputs):
            engine.run_input_passes(gm, example_inputs, snapshot({"context_parallel": seen["name"]}))
            return gm.forward

        with fake_pg(2) as group, pytest.raises(Exception, match="was made by cp_inductor.parallel.shard_batch"):
            seen["name"] = group.group_name
            q = torch.randn(1, 8, 2, 8)
            torch.compile(_attention, backend=backend)(q, q, q, POSITIONS[:, :8].clone())

    @pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
    def test_hf_model_called_without_the_position_ids(self):
        """HF Llama called with the tokens shard_batch cut but not its position ids: the model
        makes positions of its own (an arange over this rank's tokens) and its packed-sequence
        mask reads them; the error says to pass the batch's keys."""
        with fake_pg(2) as group, pytest.raises(Exception, match=r"not handed the position_ids shard_batch made"):
            local = shard_batch(auto_cp.packed_batch([16, 16]), group)
            compiled = torch.compile(auto_cp.hf_llama("sdpa"), backend="cp_inductor",
                                     options={"cp_inductor.context_parallel": group})
            compiled(input_ids=local["input_ids"], labels=local["labels"])


# --- training numerics on gloo ------------------------------------------------------------------


def _assert_matches(got: dict, want_loss: float, want: dict) -> None:
    """A CP step's combined loss and summed gradients against the single-device step's: relative
    error below 1e-4."""
    assert abs(got["loss"] - want_loss) <= 1e-4 * abs(want_loss), (got["loss"], want_loss, got["lines"])
    largest = max(grad.abs().max().item() for grad in want.values())
    for name, grad in want.items():
        if grad.abs().max() < 1e-9 * largest:  # zero but for rounding (a key bias: softmax ignores it)
            continue
        err = ((got["grads"][name] - grad).abs().max() / grad.abs().max()).item()
        assert err < 1e-4, (name, err, got["lines"])


def _assert_steps(results, cases, references: dict | None = None):
    """Each case's combined loss and summed gradients against the single-device step on the full
    batch (fp32; ``references[i]`` makes case i's single-device model where it is not the case's
    own): relative error below 1e-4."""
    for i, ((make, batch, *_), got) in enumerate(zip(cases, results[0])):
        _assert_matches(got, *auto_cp.reference_step((references or {}).get(i, make)(), batch))
        assert got["lines"] and all("context-parallel" in line for line in got["lines"]), got["lines"]
    for other in results[1:]:  # every rank combined the same loss
        assert [r["loss"] for r in other] == [r["loss"] for r in results[0]]


ULYSSES = {"cp_inductor.context_parallel_style": "ulysses"}


def _per_call(*styles: str) -> dict:
    """Options forcing the i-th attention call's style (one model, a layer per style: docs/testing.md)."""
    return {"cp_inductor.context_parallel_style": ",".join(styles)}


def _style(line: str) -> str:
    """The style a report line of the pass names ("...: <style>, ...")."""
    return line.split(": ")[1].split(",")[0]


def _batches(rows: int) -> tuple[dict, dict]:
    pack = auto_cp.packed_batch([6, 10, 8, 8], rows=rows)
    plain = {k: v for k, v in auto_cp.packed_batch([32], rows=rows).items() if k != "position_ids"}
    return pack, plain


def test_decoder_training_matches_single_device_cp2():
    """Our decoder (rotary over the positions), two rows: on a pack (GQA 4:2), a layer of each
    attention form (the document mask, ``is_causal`` across documents, bidirectional, the
    document mask with a sliding window shorter than the documents) through the all-gather, then
    the document and window forms through Ulysses (heads divide by cp); on a plain batch (GQA
    4:1), causal layers through the all-gather, Ulysses (its one key/value head repeated to one
    per rank) and the ring. (A layer per form and style in one model, not a model per form:
    docs/testing.md.)"""
    pack, plain = _batches(rows=2)
    decoder = functools.partial(functools.partial, auto_cp.decoder)
    cases = [(decoder(("documents", "causal", "bidirectional", "window", "documents", "window")), pack,
              _per_call("allgather", "allgather", "allgather", "allgather", "ulysses")),
             (decoder(("causal",) * 3, kv_heads=1), plain, _per_call("allgather", "ulysses", "ring"))]
    results = run_on_ranks(auto_cp.cp_steps, 2, cases)
    _assert_steps(results, cases)
    styles = [[_style(line) for line in case["lines"]] for case in results[0]]
    assert styles == [["allgather"] * 4 + ["ulysses"] * 2, ["allgather", "ulysses", "ring"]], styles
    windowed = [f"keys from q-{auto_cp.WINDOW}" in line for line in results[0][0]["lines"]]
    assert windowed == [False, False, False, True, False, True], results[0][0]["lines"]
    assert "key/value heads repeated to 2" in results[0][1]["lines"][1], results[0][1]["lines"]


def test_decoder_training_matches_single_device_cp4():
    """cp 4 (every rank holds pieces of every document). Our decoder on a plain batch: a layer
    through Ulysses with 2 key/value heads, each repeated to one per rank (the repeat to lcm(2, 4),
    which no cp 2 world makes), and a layer through the ring (four steps). HF transformers' Llama
    (4 / 2 heads) on a pack: a layer through Ulysses (its K/V heads repeated to 4), one through
    the all-gather's document shards (our decoder's document mask on the same pack at cp 4 moved
    to the wide tier, ``test_decoder_document_mask_cp4``). The one cp 4 training step CI keeps:
    CP the model does not write is promised at cp 2 and 4."""
    pack, plain = _batches(rows=1)
    cases = [(functools.partial(auto_cp.decoder, "causal"), plain, _per_call("ulysses", "ring"))]
    if importlib.util.find_spec("transformers") is not None:
        cases.append((functools.partial(auto_cp.hf_llama, "sdpa"), pack, _per_call("ulysses", "allgather")))
    else:  # the same pack through our decoder's document mask
        cases.append((functools.partial(auto_cp.decoder, "documents"), pack))
    results = run_on_ranks(auto_cp.cp_steps, 4, cases)
    _assert_steps(results, cases)
    ulysses, ring = results[0][0]["lines"]
    assert _style(ulysses) == "ulysses" and "key/value heads repeated to 4" in ulysses, ulysses
    assert _style(ring) == "ring", ring
    packed = results[0][1]["lines"]
    assert packed and all("documents, causal" in line for line in packed), packed
    if cases[1][0].func is auto_cp.hf_llama:
        assert [_style(line) for line in packed] == ["ulysses", "allgather"], packed
        assert "key/value heads repeated to 4" in packed[0], packed


def test_losses_averaged_over_the_ranks_tokens_match_single_device():
    """Losses that ignore ``num_items_in_batch`` are made each rank's share of the full batch's
    mean (``token_means``), so the sum ``combine_losses`` takes and the summed gradients are the
    single-device ones: cross entropy's own mean (nanoGPT's) computed after a graph break (a graph
    without attention that reads the labels shard_batch cut) on a pack whose ranks hold different
    label counts, a masked mean through Ulysses, and HF transformers' BERT masked-LM (its mean in
    the attention graph). Before, the combined loss was about cp times the loss; switched off it
    still is (``test_switched_off_the_mean_stays_this_ranks``)."""
    pack, plain = _batches(rows=2)
    pack = {**pack, "labels": pack["labels"].masked_fill(torch.arange(32) % 3 == 0, -100)}
    masked, after_break = (functools.partial(auto_cp.decoder, "documents", loss=loss) for loss in ("masked", "mean_after_break"))
    cases = [(after_break, pack), (masked, plain, ULYSSES)]
    if importlib.util.find_spec("transformers") is not None:
        masked_lm = {"input_ids": plain["input_ids"], "labels": plain["labels"].masked_fill(torch.arange(32) % 4 != 1, -100)}
        cases.append((auto_cp.hf_bert_masked_lm, masked_lm))
    results = run_on_ranks(auto_cp.cp_steps, 2, cases)
    _assert_steps(results, cases)
    means = [[line for line in case["lines"] if "context-parallel mean" in line] for case in results[0]]
    assert means == [
        ["context-parallel mean cross_entropy: cross_entropy averaged over this rank's labelled tokens: divided by "
         "the full batch's count"],
        ["context-parallel mean truediv_8: a sum over this rank's tokens divided by another (sum_2): the denominator "
         "all-reduced over the ranks"],
        ["context-parallel mean masked_lm_loss: cross_entropy averaged over this rank's labelled tokens: divided by "
         "the full batch's count"]][:len(cases)], means


def test_statistics_over_the_ranks_tokens_match_single_device():
    """Means, counts and picked tokens that a loss reads otherwise than by sums are made the full
    batch's (``token_statistics``): a sequence classifier on the mean of each row's logits, HF
    transformers' Mixtral with its load-balancing loss (counts of tokens per expert and the
    router's summed probabilities over the router logits handed across HF's graph break,
    multiplied), and HF's BERT sequence classifier (its pooler reads each row's first token; the
    labels one per row, every rank its copy). Before, each combined a different loss (Mixtral 6.18
    against 5.17) with wrong gradients, silently, and the classifier's labels were refused."""
    pack, plain = _batches(rows=2)
    cases = [(functools.partial(auto_cp.decoder, "causal", loss="pooled"), plain, ULYSSES)]
    if importlib.util.find_spec("transformers") is not None:
        classes = {"input_ids": plain["input_ids"], "labels": torch.tensor([0, 2])}
        cases += [(auto_cp.hf_mixtral, pack), (auto_cp.hf_bert_classifier, classes)]
    results = run_on_ranks(auto_cp.cp_steps, 2, cases)
    _assert_steps(results, cases)
    statistics = [sorted(line.split(": ")[1] for line in case["lines"] if "context-parallel mean" in line)
                  for case in results[0]]
    assert statistics == [["mean over this rank's tokens (dim 1)"],
                          [*["a sum over the tokens divided by this rank's count (64.0)"] * 2,
                           *["histc over this rank's tokens (dim 0)"] * 2,
                           *["sum over this rank's tokens (dim 0)"] * 2],
                          ["the token at index 0 of each row (dim 1)"]][:len(cases)], statistics


def test_positions_from_the_token_index_match_single_device():
    """A decoder written for one device that places its tokens by their index (nanoGPT's learned
    table read at ``arange(T)``, torchtitan's rotary table sliced to the tokens in each block,
    nanoGPT's call ``model(input_ids, targets)`` with no position ids): the positions become the
    tokens' places in the row, K/V all-gathered, inside checkpointed blocks through Ulysses, and
    under dynamic shapes (the count symbolic). Before, the compile failed ("gives each token a
    value by its index on this rank")."""
    batch = auto_cp.next_token_batch(rows=2, tokens=32)
    how = {"loss_of": auto_cp.index_positioned_loss_of}
    cases = [(auto_cp.index_positioned, batch, None, None, how),
             (functools.partial(auto_cp.index_positioned, checkpointing=True), batch, ULYSSES, None, how),
             (auto_cp.index_positioned, batch, None, None, {**how, "dynamic": True})]
    results = run_on_ranks(auto_cp.cp_steps, 2, cases)
    _assert_steps(results, cases)
    placed = [sorted(line.split(": ")[0] for line in case["lines"] if "context-parallel positions" in line)
              for case in results[0]]
    # the arange and each block's slice (dynamic shapes: Dynamo compiles twice, each line twice)
    assert [len(p) for p in placed] == [3, 3, 6], placed


@pytest.mark.wide
def test_decoder_document_mask_cp4():
    """Our decoder's document mask on a pack at cp 4 (CI runs the same pack through HF Llama's at
    cp 4, and this decoder's at cp 2)."""
    pack, _ = _batches(rows=1)
    cases = [(functools.partial(auto_cp.decoder, "documents"), pack)]
    _assert_steps(run_on_ranks(auto_cp.cp_steps, 4, cases), cases)


def test_fsdp2_over_the_cp_ranks_matches_single_device():
    """FSDP2 sharding the decoder's blocks over the same ranks as CP (torchtitan's mesh folds CP
    into the data-parallel shard dim), the loss scaled by cp against FSDP's mean: the document mask through
    the all-gather and causal attention on a plain batch through Ulysses, the single-device step
    (the full parameters' gradients)."""
    pack, plain = _batches(rows=2)
    cases = [(functools.partial(auto_cp.decoder, "documents"), pack),
             (functools.partial(auto_cp.decoder, "causal"), plain, ULYSSES)]
    results = run_on_ranks(auto_cp.fsdp_cp_steps, 2, cases)
    _assert_steps(results, cases)
    assert [{_style(line) for line in case["lines"]} for case in results[0]] == [{"allgather"}, {"ulysses"}]


def test_torchtitan_names_match_single_device():
    """A batch named as torchtitan names it (``tokens``, ``positions`` where the pack has them),
    the model called ``model(tokens, positions=...)`` and the loss computed outside it: the
    document mask on a pack (all-gather) and causal attention on a plain batch, whose positions
    shard_batch makes under torchtitan's name (Ulysses); and torchtitan's varlen attention, its
    ``VarlenMetadata`` of the full pack made by the trainer and handed to the model as
    ``attention_masks`` (all-gather): the single-device step."""
    def titan(batch):
        named = {"tokens": batch["input_ids"], "labels": batch["labels"]}
        return {**named, "positions": batch["position_ids"]} if "position_ids" in batch else named

    pack, plain = (titan(b) for b in _batches(rows=2))
    cases = [(functools.partial(auto_cp.decoder, "documents", titan_named=True), pack),
             (functools.partial(auto_cp.decoder, "causal", titan_named=True), plain, ULYSSES)]
    if varlen_programs.register_cpu_kernels():  # (a torch with varlen_attn)
        cases.append((functools.partial(auto_cp.decoder, "varlen", titan_named=True),
                      auto_cp.titan_varlen_batch([6, 10, 8, 8], rows=2)))
    results = run_on_ranks(auto_cp.titan_steps, 2, cases)
    for (make, batch, *_), got in zip(cases, results[0]):
        _assert_matches(got, *auto_cp.titan_reference_step(make(), batch))
    styles = [{_style(line) for line in case["lines"]} for case in results[0]]
    assert styles == [{"allgather"}, {"ulysses"}, {"allgather"}][:len(cases)], styles
    if len(cases) == 3:
        assert all("documents of its cu_seqlens" in line for line in results[0][2]["lines"]), results[0][2]["lines"]


def test_torchtitan_block_mask_training_matches_single_device():
    """torchtitan's flex training batch: a BlockMask made by the trainer from the full batch
    (documents from end-of-document tokens, causal; with a sliding window shorter than the
    documents; and as torchtitan's fast path for several rows, queries up to each key's document
    end), no positions, the model called ``model(tokens, attention_masks=...,
    positions=...)`` with what shard_batch returns: a layer through the all-gather and one through
    Ulysses at cp 2 (the window: the all-gather), each the single-device step (the same
    BlockMask's mask_mod made dense, through SDPA: torch has no CPU flex backward)."""
    cases = [(functools.partial(auto_cp.decoder, "flex_given", titan_named=True),
              functools.partial(auto_cp.titan_block_mask_batch, [6, 10, 8, 8], rows=2, window=window, form=form), options)
             for window, form, options in ((-1, "ids", _per_call("allgather", "ulysses")), (3, "ids", None),
                                           (-1, "ends", None))]
    results = run_on_ranks(auto_cp.titan_flex_steps, 2, cases)
    for (make, make_batch, _), got in zip(cases, results[0]):
        _assert_matches(got, *auto_cp.titan_reference_step(auto_cp.decoder("dense_given", titan_named=True), make_batch()))
        assert got["lines"] and all("documents, causal" in line for line in got["lines"]), got["lines"]
    assert [_style(line) for line in results[0][0]["lines"]] == ["allgather", "ulysses"], results[0][0]["lines"]
    assert all("keys from q-3" in line for line in results[0][1]["lines"]), results[0][1]["lines"]


def test_flex_training_matches_single_device():
    """flex attention at cp 2, one training step: our decoder with its BlockMask built in the
    model (same document, causal), a layer through the all-gather and one through Ulysses; HF transformers' Llama with
    ``flex_attention``, packed and plain (its BlockMask built in the step's graph, read from the
    position ids), and packed with the BlockMask before a graph break (torch's behaviour at
    HF's warning: its tables come in and are checked on device); HF Mistral with
    ``flex_attention`` and a sliding window on a pack. Each against its single-device ``sdpa``
    twin (the same weights and mask; torch has no CPU flex backward, and its CPU flex is off on
    HF's sliding BlockMask): the combined loss and every summed gradient."""
    pack, _ = _batches(rows=2)
    cases = [(functools.partial(auto_cp.decoder, "flex"), pack, _per_call("allgather", "ulysses"))]
    references = {0: functools.partial(auto_cp.decoder, "documents")}
    hf = importlib.util.find_spec("transformers") is not None
    if hf:
        hf_pack = auto_cp.packed_batch([6, 10, 8, 8])
        hf_plain = {k: v for k, v in auto_cp.packed_batch([32]).items() if k != "position_ids"}
        warnings_break = {"ignore_logging_functions": set()}
        for batch, dynamo in ((hf_pack, None), (hf_plain, None), (hf_pack, warnings_break)):
            references[len(cases)] = functools.partial(auto_cp.hf_llama, "sdpa")
            cases.append((functools.partial(auto_cp.hf_llama, "flex_attention"), batch, None, dynamo))
        references[len(cases)] = functools.partial(auto_cp.hf_causal_lm, "mistral", sliding_window=5)
        cases.append((functools.partial(auto_cp.hf_causal_lm, "mistral", sliding_window=5, attn="flex_attention"), hf_pack))
    results = run_on_ranks(auto_cp.cp_flex_steps, 2, cases)
    _assert_steps(results, cases, references)
    for got in results[0]:
        assert all("documents, causal" in line for line in got["lines"]), got["lines"]
    assert [_style(line) for line in results[0][0]["lines"]] == ["allgather", "ulysses"], results[0][0]["lines"]
    if hf:
        import warnings

        import cp_inductor.backend  # noqa: F401 - its import decides, as in the ranks

        checked = ["checked on device" in line for got in results[0][1:] for line in got["lines"]]
        one_graph = warnings.warn in torch._dynamo.config.ignore_logging_functions
        assert checked == [not one_graph] * 4 + [True] * 2 + [not one_graph] * 2, results[0][1:]  # two calls a step
        assert all("keys from q-4" in line for line in results[0][-1]["lines"]), results[0][-1]["lines"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_flex_training_matches_single_device():
    """The flex forms' training step on the GPU kernels (bf16): two CP ranks sharing one GPU
    (joined by gloo, their collectives through the host): HF transformers' Llama with
    ``flex_attention`` (head_dim 64), packed and plain, its BlockMask built in the step's graph;
    and torchtitan's batch, its BlockMask made by the trainer from the full batch and cut by
    shard_batch (a layer through the all-gather, one through Ulysses; then with a sliding
    window). Against the same model on the full batch on one GPU in fp32 (eager flex): the
    combined loss and every summed gradient within twice the error of the model's own bf16
    step (eager), or 1%. (The shard op runs FA4 where it is installed.)"""
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    lengths = [700, 300, 600, 448]
    titan = functools.partial(auto_cp.decoder, "flex_given", titan_named=True, dim=256)
    cases = [(functools.partial(auto_cp.titan_block_mask_batch, lengths, window=window, device="cuda"),
              titan, options, "titan") for window, options in ((-1, _per_call("allgather", "ulysses")), (100, None))]
    if importlib.util.find_spec("transformers") is not None:
        llama = functools.partial(auto_cp.hf_llama, "flex_attention", head_dim=64)
        plain = {k: v for k, v in auto_cp.packed_batch([sum(lengths)]).items() if k != "position_ids"}
        for batch in (auto_cp.packed_batch(lengths), plain):
            cases.append((functools.partial(auto_cp.on_device, batch, gpu), llama, None, "hf"))
    results = run_on_ranks(auto_cp.gpu_cp_steps, 2, [(functools.partial(auto_cp.model_on, make, gpu, bf16), make_batch,
                                                      options, caller) for make_batch, make, options, caller in cases],
                           spawn=True)
    for (make_batch, make, _, caller), got in zip(cases, results[0]):
        step = auto_cp.titan_reference_step if caller == "titan" else auto_cp.reference_step
        assert_within_low_precision(got["loss"], got["grads"], *(step(auto_cp.model_on(make, gpu, dtype), make_batch())
                                                                 for dtype in (torch.float32, bf16)), note=got["lines"])
        assert got["lines"] and all("documents, causal" in line for line in got["lines"]), got["lines"]
    assert [_style(line) for line in results[0][0]["lines"]] == ["allgather", "ulysses"], results[0][0]["lines"]
    assert all("keys from q-100" in line for line in results[0][1]["lines"]), results[0][1]["lines"]


def test_varlen_decoder_training_matches_single_device():
    """Our decoder with torch's ``varlen_attn`` over its two rows flattened (GQA 4:2), the bounds
    of the full pack handed in with the batch as a data loader makes them: a layer through the
    all-gather and one through Ulysses at cp 2, the single-device step."""
    if not varlen_programs.register_cpu_kernels():
        pytest.skip("this torch has no varlen_attn")
    batch = auto_cp.varlen_batch([6, 10, 8, 8], rows=2)
    cases = [(functools.partial(auto_cp.decoder, "varlen"), batch, _per_call("allgather", "ulysses"))]
    results = run_on_ranks(auto_cp.cp_steps, 2, cases)
    _assert_steps(results, cases)
    assert [_style(line) for line in results[0][0]["lines"]] == ["allgather", "ulysses"], results[0]
    assert all("documents of its cu_seqlens" in line for case in results[0] for line in case["lines"]), results[0]


def test_varlen_bounds_are_checked_on_device():
    """Bounds that are not the full rows' fail the step: short of the tokens, or a document
    across the end of a row."""
    like = torch.zeros(2, 8, dtype=torch.long)
    ids = torch.ops.cp_inductor.cu_seqlens_ids(torch.tensor([0, 3, 8, 10, 16], dtype=torch.int32), like)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 3, 3, 3, 3, 3, 3]]
    with pytest.raises(RuntimeError, match="not bounds of the full batch"):
        torch.ops.cp_inductor.cu_seqlens_ids(torch.tensor([0, 3, 8], dtype=torch.int32), like)
    with pytest.raises(RuntimeError, match="crosses the end of a row"):
        torch.ops.cp_inductor.cu_seqlens_ids(torch.tensor([0, 3, 9, 16], dtype=torch.int32), like)


def test_packs_change_between_steps():
    """One compiled model over packs of new document lengths and sizes (32, 24, 40, 40, 48 tokens):
    the layout comes in as inputs, so new lengths need no recompile and new sizes share the one
    graph Dynamo's automatic dynamic shapes make at the second size; every step is the
    single-device step."""
    packs = [[6, 10, 8, 8], [4, 12, 8], [20, 4, 8, 8], [16, 16, 8], [8, 8, 16, 16]]
    steps = run_on_ranks(auto_cp.cp_varying_steps, 2, functools.partial(auto_cp.decoder, "documents"), packs)[0]
    for got, want, err, _ in steps:
        assert abs(got - want) <= 1e-4 * abs(want) and err < 1e-4, steps
    assert [graphs for *_, graphs in steps] == [1, 2, 2, 2, 2], steps


def test_block_masks_made_anew_each_step_share_one_graph():
    """The trainer makes a new BlockMask every step (a new closure over a new table), for packs of
    new document lengths of one size: one graph serves them all, and every step is the
    single-device step."""
    packs = [[6, 10, 8, 8], [4, 12, 8, 8], [16, 16]]
    steps = run_on_ranks(auto_cp.titan_flex_varying_steps, 2, packs)[0]
    for got, want, err, _ in steps:
        assert abs(got - want) <= 1e-4 * abs(want) and err < 1e-4, steps
    assert [graphs for *_, graphs in steps] == [1, 1, 1], steps


@pytest.mark.wide
def test_hf_architectures_training_matches_single_device():
    """A survey beyond Llama (CP_INDUCTOR_TESTS=all): HF transformers' Qwen2, Qwen3, Mistral, Phi-3,
    OLMo 2, GPT-2 (learned positions), Gemma, Gemma 3 (a sliding layer and a global one), Granite,
    StarCoder2, GPT-NeoX (fused QKV, partial rotary), Cohere (parallel blocks), SmolLM3 (a layer
    without rotary) and OLMo 3 with ``sdpa``, packed and plain, one training step at cp 2: the
    combined loss and every summed gradient are the single-device step's, every attention call
    rewritten."""
    pytest.importorskip("transformers")
    pack = auto_cp.packed_batch([6, 10, 8, 8])
    plain = {k: v for k, v in pack.items() if k != "position_ids"}
    cases = [(functools.partial(auto_cp.hf_causal_lm, arch), batch) for arch in auto_cp.HF_ARCHITECTURES for batch in (pack, plain)]
    results = run_on_ranks(auto_cp.cp_steps, 2, cases)
    _assert_steps(results, cases)
    for (make, _), got in zip(cases, results[0]):
        assert len(got["lines"]) == 2 and all("documents, causal" in line for line in got["lines"]), (make.args, got["lines"])


def test_hf_llama_sdpa_training_matches_single_device():
    """HF transformers' Llama with ``sdpa``, packed (position ids restarting per document) and
    plain, GQA, and packed with HF's gradient checkpointing (each layer's attention inside a
    checkpointed body); Mistral's sliding window (5 tokens, shorter than the documents) over the
    pack. Every style and ``auto`` on Llama, a layer each: on the pack, Ulysses then the all-gather;
    on the plain batch, ``auto`` then the ring; checkpointed, ``auto`` then Ulysses (inside the
    checkpointed body). The pack compiled with ``dynamic=True`` (HF's dropout and scale then come
    in as graph inputs, read with a guard), and under bf16 autocast. No line of CP code in the
    model."""
    pytest.importorskip("transformers")
    pack = auto_cp.packed_batch([6, 10, 8, 8])
    plain = {k: v for k, v in auto_cp.packed_batch([32]).items() if k != "position_ids"}
    cases = [(functools.partial(auto_cp.hf_llama, "sdpa"), pack, _per_call("ulysses", "allgather")),
             (functools.partial(auto_cp.hf_llama, "sdpa"), plain, _per_call("auto", "ring"))]
    cases.append((functools.partial(auto_cp.hf_llama, "sdpa", checkpointing=True), pack, _per_call("auto", "ulysses")))
    cases.append((functools.partial(auto_cp.hf_causal_lm, "mistral", sliding_window=5), pack))
    cases.append((functools.partial(auto_cp.hf_llama, "sdpa"), pack, None, None, {"dynamic": True}))
    autocast = (functools.partial(auto_cp.hf_llama, "sdpa"), pack, None, None, {"autocast": torch.bfloat16})
    results = run_on_ranks(auto_cp.cp_steps, 2, [*cases, autocast])
    _assert_steps([r[:-1] for r in results], cases)
    # bf16 autocast: SDPA computes in bf16 though HF's rotary gives fp32 q and k (autocast casts
    # them); our op, not on autocast's list, gets the casts made explicit
    got = results[0][-1]
    assert_within_low_precision(got["loss"], got["grads"], auto_cp.reference_step(autocast[0](), pack),
                                auto_cp.reference_step(autocast[0](), pack, autocast=torch.bfloat16), note=got["lines"])
    assert len(results[0][-1]["lines"]) == 2, results[0][-1]["lines"]
    assert all("documents, causal" in line for line in results[0][0]["lines"]), results[0][0]["lines"]
    checkpointed = results[0][2]["lines"]
    assert len(checkpointed) == 2 and all("tag_activation_checkpoint" in line for line in checkpointed), checkpointed
    windowed = results[0][3]["lines"]
    assert len(windowed) == 2 and all("documents, causal, keys from q-" in line for line in windowed), windowed
    assert [[_style(line) for line in results[0][i]["lines"]] for i in range(3)] == [
        ["ulysses", "allgather"], ["allgather", "ring"], ["allgather", "ulysses"]], [r["lines"] for r in results[0]]

