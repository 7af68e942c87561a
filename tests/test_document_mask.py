"""document_mask: SDPA under a document / causal mask becomes packed attention (or causal SDPA),
where the mask analysis proves what the mask computes, and is kept with the reason where not.
CPU: the packed ops' per-sequence references stand in for FA4 and cuDNN (``reference_kernels``);
the GPU tests at the end run the kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import cp_inductor
from cp_inductor.lowerings import document_attention, fa4_attention
from cp_inductor.lowerings.varlen_attention import reference_kernels
from cp_inductor.testing.documents import compile_masked, document_causal_block_mask
from helpers import assert_within_low_precision

B, T, HQ, HKV, D = 2, 24, 4, 2, 16
LENGTHS = [5, 9, 10]  # documents of each row


def _positions(lengths=LENGTHS, batch=B):
    return torch.cat([torch.arange(n) for n in lengths])[None].expand(batch, -1).contiguous()


def _doc_ids(lengths=LENGTHS, batch=B):
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(batch, -1).contiguous()


def _resets(positions):
    """Document ids as the cumulative count of position resets (HF's packed-sequence detection)."""
    return (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)


def _qkv(seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g).to(device, dtype).transpose(1, 2) for h in (HQ, HKV, HKV))
    return q, k, v


def _attend(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    k, v = (x[:, :, None].expand(B, k.shape[1], g, T, D).reshape(B, q.shape[1], T, D) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# --- the mask forms: each builds its mask from (positions or doc ids) and attends --------------


def hf_packed(q, k, v, positions):
    """HF masking_utils' index form on the packed path: positions reset per document."""
    ids = _resets(positions)
    b = torch.arange(B)[:, None, None, None]
    qi, ki = torch.arange(T)[None, None, :, None], torch.arange(T)[None, None, None, :]
    mask = q.new_ones((), dtype=torch.bool) & (positions[b, ki] <= positions[b, qi]) & (ids[b, qi] == ids[b, ki])
    return _attend(q, k, v, mask.expand(B, -1, T, T))


def hand_tril(q, k, v, doc):
    """``doc[:, None] == doc[None, :]`` with ``tril``, ids from the caller."""
    same = doc[:, :, None] == doc[:, None, :]
    return _attend(q, k, v, (same & torch.ones(T, T, dtype=torch.bool).tril())[:, None])


def additive_where(q, k, v, positions):
    ids = _resets(positions)
    keep = (ids[:, :, None] == ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    return _attend(q, k, v, torch.where(keep, 0.0, -math.inf)[:, None].to(q.dtype))


def additive_masked_fill(q, k, v, positions):
    ids = _resets(positions)
    keep = (ids[:, None, :, None] == ids[:, None, None, :]) & (torch.arange(T)[None, :] <= torch.arange(T)[:, None])
    return _attend(q, k, v, torch.zeros(B, 1, T, T, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min))


def bidirectional(q, k, v, positions):
    ids = _resets(positions)
    return _attend(q, k, v, (ids[:, :, None] == ids[:, None, :])[:, None])


def positions_checked(q, k, v, doc, pos=None):
    """Causal over positions, with document ids that do not come from those positions (HF's
    flex form: both tables come into the graph): whether they rise within each document is
    checked on device."""
    pos = torch.arange(T)[None].expand(B, -1) * 2 if pos is None else pos
    qi, ki = torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
    b = torch.arange(B)[:, None, None]
    mask = (pos[b, ki] <= pos[b, qi]) & (doc[b, qi] == doc[b, ki])
    return _attend(q, k, v, mask[:, None])


def hf_sliding(q, k, v, positions):
    """HF's packed index form with its sliding-window overlay (``kv > q - window``, Mistral's)."""
    ids = _resets(positions)
    b = torch.arange(B)[:, None, None, None]
    qi, ki = torch.arange(T)[None, None, :, None], torch.arange(T)[None, None, None, :]
    mask = (positions[b, ki] <= positions[b, qi]) & (ids[b, qi] == ids[b, ki]) & (ki > qi - 4)
    return _attend(q, k, v, mask.expand(B, -1, T, T))


def causal_only(q, k, v, positions):
    return _attend(q, k, v, torch.ones(T, T, dtype=torch.bool).tril())


def window(q, k, v, positions):
    """A causal sliding window over rows of one document (torchtitan's sliding-window mask_mod,
    made dense): the packed kernels over one document a row."""
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return _attend(q, k, v, (ki <= qi) & (ki > qi - 4))


# near misses: each must be kept, with its reason


def window_at_other_positions(q, k, v, positions):
    """A window over the positions read two tokens late: not the window over the tokens."""
    ids = _resets(positions)
    i = torch.arange(T)
    late = positions[:, (i + 2) % T]
    keep = (ids[:, :, None] == ids[:, None, :]) & (positions[:, None, :] <= positions[:, :, None])
    return _attend(q, k, v, (keep & (late[:, None, :] > positions[:, :, None] - 4))[:, None])


def ids_through_a_stack(q, k, v, doc):
    """The ids read through ``stack([doc, doc], -1)[:, i][..., 0]`` (an index with a skipped
    leading dim and a trailing one): the same ids."""
    ids = torch.stack([doc, doc], -1)[:, torch.arange(T)][..., 0]
    return _attend(q, k, v, ((ids[:, :, None] == ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None])


def padding(q, k, v, positions):
    pad = positions > 0  # a per-key table
    return _attend(q, k, v, torch.ones(T, T, dtype=torch.bool).tril() & pad[:, None, None, :])


def padding_table(q, k, v, keep):
    """HF's form: a boolean ``[B, T]`` attention_mask read at the key (no comparison)."""
    return _attend(q, k, v, torch.ones(T, T, dtype=torch.bool).tril() & keep[:, None, None, :])


def or_masks(q, k, v, positions):
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return _attend(q, k, v, (ki <= qi) | (ki == 0))


def mask_from_outside(q, k, v, mask):
    return _attend(q, k, v, mask)


def real_bias(q, k, v, positions):
    qi, ki = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return _attend(q, k, v, -(qi - ki).abs().to(q.dtype))




def first_row_for_every_row(q, k, v, doc):
    """A ``[T, T]`` mask from row 0 of the id table: every row of the batch attends by row 0's
    documents, which the packed kernels (row b over row b's ids) do not compute."""
    first = doc[0]
    return _attend(q, k, v, (first[:, None] == first[None, :]) & torch.ones(T, T, dtype=torch.bool).tril())


def shifted(q, k, v, doc):
    """The key's document read one token late: not a document mask."""
    shifted_doc = torch.cat([doc[:, :1], doc[:, :-1]], dim=1)
    return _attend(q, k, v, (doc[:, :, None] == shifted_doc[:, None, :])[:, None])


_routes = compile_masked


def _describe(fn, table):
    q, k, v = _qkv()
    _, lines = _routes(fn, q, k, v, table)
    return "\n".join(line.split(": ", 1)[1] for line in lines)


class TestAnalysis(TestCase):
    """The report's line per form: what the mask is, or why it is kept."""

    def test_accepted_forms(self):
        pos, doc = _positions(), _doc_ids()
        got = "\n".join(f"{fn.__name__}: {_describe(fn, table)}" for fn, table in (
            (hf_packed, pos), (hand_tril, doc), (additive_where, pos), (additive_masked_fill, pos),
            (bidirectional, pos), (positions_checked, doc), (causal_only, pos), (hf_sliding, pos), (window, pos)))
        self.assertExpectedInline(got, """\
hf_packed: documents from cumsum (proven (cumulative sum of non-negatives)), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32
hand_tril: documents from arg0_1 (checked on device), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32
additive_where: documents from cumsum (proven (cumulative sum of non-negatives)), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32
additive_masked_fill: documents from cumsum (proven (cumulative sum of non-negatives)), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32
bidirectional: documents from cumsum (proven (cumulative sum of non-negatives)), bidirectional: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 full float32
positions_checked: documents from arg0_1 (checked on device), causal over positions mul (rising within documents: checked on device): fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32
causal_only: causal: sdpa_is_causal: one document per row: dense causal SDPA, K/V heads as they are
hf_sliding: documents from cumsum (proven (cumulative sum of non-negatives)), causal, keys from q-3: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32; cudnn: a sliding window (cuDNN's ragged SDPA here takes none)
window: causal, keys from q-3: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32; cudnn: a sliding window (cuDNN's ragged SDPA here takes none)""")

    def test_near_misses_keep_their_op(self):
        pos, doc = _positions(), _doc_ids()
        outside = torch.ones(T, T, dtype=torch.bool).tril()
        got = "\n".join(f"{fn.__name__}: {_describe(fn, table)}" for fn, table in (
            (padding, pos), (padding_table, pos > 0), (or_masks, pos), (mask_from_outside, outside), (real_bias, pos),
            (shifted, doc), (window_at_other_positions, pos), (ids_through_a_stack, doc),
            (first_row_for_every_row, torch.stack([doc[0], _doc_ids([3, 21], 1)[0]]))))
        self.assertExpectedInline(got, """\
padding: mask not read: kept: document_mask: keys masked by a per-token table (padding holes)
padding_table: mask not read: kept: document_mask: keys masked by a per-token table (padding holes)
or_masks: mask not read: kept: document_mask: a disjunction of masks (or_masks, |): not a document mask
mask_from_outside: mask not read: kept: document_mask: the mask comes in from outside the graph (its values are not known to the compiler)
real_bias: mask not read: kept: document_mask: a real-valued bias (aten.neg.default is not where(mask, 0, -inf) or masked_fill(-inf))
shifted: mask not read: kept: document_mask: a table read in the mask at positions other than (batch, query) and (batch, key)
window_at_other_positions: mask not read: kept: document_mask: a shifted table compared other than as positions[b, q] and positions[b, kv]
ids_through_a_stack: mask not read: kept: document_mask: a table read in the mask at positions other than (batch, query) and (batch, key)
first_row_for_every_row: mask not read: kept: document_mask: row 0 of a table of several rows read for every row of the batch (not each row's own documents)""")

    def test_switch_off_keeps_the_call(self):
        q, k, v = _qkv()
        with cp_inductor.config.patch(document_mask=False):
            _, lines = _routes(hf_packed, q, k, v, _positions())
        self.assertExpectedInline(lines[0].split(": ", 1)[1], """\
documents from cumsum (proven (cumulative sum of non-negatives)), causal: kept: document_mask: disabled by config""")


def _dynamo_graphs(fn, *args) -> list:
    """The graphs Dynamo hands the backend for ``fn(*args)``, after cp_inductor's Dynamo-graph
    passes (CPU reference kernels standing in for FA4)."""
    from cp_inductor.config_snapshot import snapshot
    from cp_inductor.passes import engine

    graphs = []

    def capture(gm, example_inputs):
        engine.run_dynamo_passes(gm, snapshot({}))
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with reference_kernels():
        torch.compile(fn, backend=capture, fullgraph=True)(*args)
    return graphs


class TestRewrittenGraph(TestCase):
    def test_hand_built_mask_is_dead(self):
        """The graph Inductor receives for ``hand_tril``: the plan and our op over the ids as they
        came in, K/V un-repeated; the T x T comparison, tril and SDPA are gone."""
        graphs = _dynamo_graphs(hand_tril, *_qkv(), _doc_ids())
        lines = []
        for n in graphs[0].graph.nodes:
            if n.op in ("call_function", "call_method"):
                args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args)
                lines.append(f"{n.name} = {getattr(n.target, '__name__', n.target)}({args})")
        self.assertExpectedInline("\n".join(lines), """\
sym_size_int = sym_size.int(l_q_, 0)
sym_size_int_1 = sym_size.int(l_q_, 2)
document_plan_default = document_plan.default(l_doc_, None, True, sym_size_int, sym_size_int_1)
getitem_5 = getitem(document_plan_default, 0)
getitem_6 = getitem(document_plan_default, 1)
document_attention_default = document_attention.default(l_q_, l_k_, l_v_, getitem_5, getitem_6, l_doc_, None, 0.25, True, 'fa4')
getitem_7 = getitem(document_attention_default, 0)""")


    def test_checkpointed_region_takes_the_plan(self):
        """``torch.utils.checkpoint`` around the attention (HF's gradient checkpointing): the plan
        is built outside the region, which takes its outputs instead of the T x T mask."""
        def checkpointed(q, k, v, doc):
            mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
            return torch.utils.checkpoint.checkpoint(_attend, q, k, v, mask[:, None], use_reentrant=False)

        gm = _dynamo_graphs(checkpointed, *_qkv(), _doc_ids())[0]
        lines = []
        for graph, where in ((gm.graph, "outer"), (gm.wrap_body_0.graph, "body")):
            for n in graph.nodes:
                if n.op in ("placeholder", "call_function") and (where == "outer" or "attention" in str(n.target)
                                                                  or n.op == "placeholder"):
                    args = ", ".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in n.args)
                    lines.append(f"{where}: {n.name} = {getattr(n.target, '__name__', n.target)}({args})")
        self.assertExpectedInline("\n".join(lines), """\
outer: l_doc_ = L_doc_()
outer: l_q_ = L_q_()
outer: l_k_ = L_k_()
outer: l_v_ = L_v_()
outer: document_plan_default = document_plan.default(l_doc_, None, True, 2, 24)
outer: getitem_4 = getitem(document_plan_default, 0)
outer: getitem_5 = getitem(document_plan_default, 1)
outer: tag_activation_checkpoint = tag_activation_checkpoint(wrap_body_0, l_k_, l_v_, l_q_, l_doc_, getitem_4, getitem_5)
outer: getitem_3 = getitem(tag_activation_checkpoint, 0)
body: l_k_ = l_k_()
body: l_v_ = l_v_()
body: l_q_ = l_q_()
body: cp_l_doc_ = cp_l_doc_()
body: cp_getitem_4 = cp_getitem_4()
body: cp_getitem_5 = cp_getitem_5()
body: document_attention_default = document_attention.default(l_q_, l_k_, l_v_, cp_getitem_4, cp_getitem_5, cp_l_doc_, None, 0.25, True, 'fa4')""")


def checkpointed_then_plain(q, k, v, doc):
    """Some layers checkpointed, a later one not, one mask: the plan must come before the first
    (checkpointed) one, though the plain call is found first."""
    mask = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[:, None]
    h = torch.utils.checkpoint.checkpoint(_attend, q, k, v, mask, use_reentrant=False)
    return _attend(h, k, v, mask)


def test_checkpointed_and_plain_layers_share_one_plan():
    q, k, v = _qkv()
    doc = _doc_ids()
    for got, want in zip(_grads(checkpointed_then_plain, q, k, v, doc, True),
                         _grads(checkpointed_then_plain, q, k, v, doc, False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    _, lines = _routes(checkpointed_then_plain, q, k, v, doc)
    assert len(lines) == 2 and all("fa4_varlen" in line for line in lines), lines


def _grads(fn, q, k, v, table, compiled):
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if compiled:
        torch._dynamo.reset()
        with reference_kernels(), cp_inductor.config.patch(strict=True):
            out = torch.compile(fn, backend="cp_inductor")(*ins, table)
            grads = torch.autograd.grad(out, ins, torch.ones_like(out) + out.detach())
    else:
        out = fn(*ins, table)
        grads = torch.autograd.grad(out, ins, torch.ones_like(out) + out.detach())
    return [out, *grads]


@pytest.mark.parametrize("fn", [hf_packed, hand_tril, additive_where, additive_masked_fill, bidirectional,
                                positions_checked, causal_only, hf_sliding, window], ids=lambda f: f.__name__)
def test_numerics_match_the_program(fn):
    """Output and every gradient against the program's own masked SDPA (eager)."""
    table = _doc_ids() if fn in (hand_tril, positions_checked) else _positions([7, 1, 16])
    q, k, v = _qkv()
    for got, want in zip(_grads(fn, q, k, v, table, True), _grads(fn, q, k, v, table, False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("reached_by", ["provider", "value_head_dim"])
def test_cudnn_route_trains_compiled(reached_by):
    """The cuDNN ragged route of a document mask, forced by the provider switch or taken because
    FA4 refuses a value head dim other than the query's (MLA's): compiled training gives the
    program's output and every gradient (the op's log-sum-exp is laid out as its fake says)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, HQ, T, 24 if reached_by == "value_head_dim" else D, generator=g) for _ in range(2))
    v = torch.randn(B, HQ, T, D, generator=g)
    provider = "cudnn" if reached_by == "provider" else "auto"

    def program(q, k, v, doc):
        same = doc[:, :, None] == doc[:, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(same & torch.ones(T, T, dtype=torch.bool).tril())[:, None])

    with cp_inductor.config.patch(attention_provider=provider):
        got = _grads(program, q, k, v, _doc_ids(), True)
        _, lines = _routes(program, q, k, v, _doc_ids())
    for a, b in zip(got, _grads(program, q, k, v, _doc_ids(), False)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert "cudnn_ragged" in lines[0], lines


def one_table_for_every_row(q, k, v, doc):
    """``doc[q] == doc[kv]`` over a 1-D table: every batch entry has the same documents."""
    same = doc[:, None] == doc[None, :]
    return _attend(q, k, v, same & torch.ones(T, T, dtype=torch.bool).tril())


def test_one_table_for_every_row():
    q, k, v = _qkv()
    doc = _doc_ids([3, 20, 1], batch=1)[0]
    for got, want in zip(_grads(one_table_for_every_row, q, k, v, doc, True),
                         _grads(one_table_for_every_row, q, k, v, doc, False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    _, lines = _routes(one_table_for_every_row, q, k, v, doc)
    assert "fa4_varlen" in lines[0], lines


def test_ids_that_are_not_contiguous_run_densely():
    """Document 0 again after document 1 in a row: the device check sends the call to the dense
    path, whose answer is the mask's (packed kernels would split document 0 in two)."""
    doc = torch.tensor([[0] * 6 + [1] * 6 + [0] * 12, [2] * 12 + [1] * 12])
    q, k, v = _qkv()
    for got, want in zip(_grads(hand_tril, q, k, v, doc, True), _grads(hand_tril, q, k, v, doc, False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_positions_that_fall_run_densely():
    """Positions that fall within a document: causal over them is not causal over tokens, and
    the device check sends the call to the dense path."""
    pos = torch.arange(T).flip(0)[None].expand(B, -1).contiguous()

    def falling(q, k, v, doc):
        return positions_checked(q, k, v, doc, pos)

    q, k, v = _qkv()
    for got, want in zip(_grads(falling, q, k, v, _doc_ids(), True), _grads(falling, q, k, v, _doc_ids(), False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _window_over_positions(pos):
    """HF's flex sliding window as its tables come into a graph: same document, causal and
    ``kv > q - 3``, both over a table of positions the graph does not prove to step by one."""
    def windowed(q, k, v, doc):
        qi, ki = torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
        b = torch.arange(B)[:, None, None]
        mask = (pos[b, ki] <= pos[b, qi]) & (pos[b, ki] > pos[b, qi] - 3) & (doc[b, qi] == doc[b, ki])
        return _attend(q, k, v, mask[:, None])

    return windowed


@pytest.mark.parametrize("step", [1, 2], ids=["stepping", "rising by two"])
def test_window_over_positions_is_checked_to_step_by_one(step):
    """Positions that step by one within each document: the window over them is FA4's over the
    tokens; positions that rise by two make it a window of two tokens, and the device check sends
    the call to the dense path (the mask as written). Both the program's answer."""
    doc = _doc_ids()
    fn = _window_over_positions(_positions() * step)  # positions restarting per document
    q, k, v = _qkv()
    for got, want in zip(_grads(fn, q, k, v, doc, True), _grads(fn, q, k, v, doc, False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    _, lines = _routes(fn, q, k, v, doc)
    assert "fa4_varlen" in lines[0] and "stepping by one within documents: checked on device" in lines[0], lines


def test_window_over_positions_causal_over_the_index_is_kept():
    """A window over a positions table the graph takes in, but causal over the token index: a
    failed step-by-one check would leave the dense path reading causal over the positions, not
    the program's mask, so the call is kept."""
    doc = _doc_ids()
    pos = torch.arange(T).expand(B, T).flip(1).contiguous()

    def index_causal(q, k, v, doc):
        qi, ki = torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
        b = torch.arange(B)[:, None, None]
        mask = (ki <= qi) & (pos[b, ki] > pos[b, qi] - 3) & (doc[b, qi] == doc[b, ki])
        return _attend(q, k, v, mask[:, None])

    q, k, v = _qkv()
    _, lines = _routes(index_causal, q, k, v, doc)
    assert "kept" in lines[0] and "causal over something else" in lines[0], lines


def test_plan_counts_runs_and_checks_contiguity():
    doc = torch.tensor([[3, 3, 5, 5, 5, 9], [0, 0, 0, 0, 1, 1]])
    cu, meta = torch.ops.cp_inductor.document_plan(doc, None, True, *doc.shape)
    assert meta.tolist() == [5, 4, 1, 0]  # runs 2, 3, 1, 4, 2
    assert cu.tolist() == [0, 2, 5, 6, 10, 12, 12, 12, 12, 12, 12, 12, 12]
    _, meta = torch.ops.cp_inductor.document_plan(torch.tensor([[0, 1, 0]]), None, True, 1, 3)
    assert meta.tolist()[2] == 0


def test_plan_numbers_are_read_after_a_speculative_launch(monkeypatch):
    """A shape's first plan reads its numbers at once; later ones launch FA4 at the capacity
    learned before reading them, and keep that result only where the numbers prove it exact."""
    monkeypatch.setattr(document_attention, "_LEARNED", {})
    launches = []
    packed = document_attention._fa4_packed
    monkeypatch.setattr(document_attention, "_fa4_packed", lambda q, k, v, cu, *a: launches.append(len(cu) - 1) or
                        packed(q, k, v, cu, *a))
    t = 64
    q, k, v = (torch.randn(1, h, t, D, requires_grad=True) for h in (HQ, HKV, HKV))

    def step(doc):
        doc = doc[None]
        launches.clear()
        cu, meta = torch.ops.cp_inductor.document_plan(doc, None, True, 1, t)
        out = torch.ops.cp_inductor.document_attention(q, k, v, cu, meta, doc, None, D ** -0.5, True, "fa4")[0]
        got = [out, *torch.autograd.grad(out.sum(), (q, k, v))]
        ref = document_attention._dense(q, k, v, doc, None, D ** -0.5, True)
        for a, b in zip(got, [ref, *torch.autograd.grad(ref.sum(), (q, k, v))]):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
        return list(launches)

    runs = lambda n: torch.arange(t) * n // t  # noqa: E731 - n contiguous documents
    assert step(runs(5)) == [5]  # the first plan of the shape: exact (learns room for 16)
    assert step(runs(3)) == [16]  # speculative at the capacity, kept: 3 <= 16
    assert step(runs(40)) == [16, 40]  # speculative, 40 > 16: computed again exactly (room for 64 now)
    assert step(runs(40)) == [64]
    assert step(torch.arange(t) % 2) == [64]  # not contiguous: the launch wasted, dense, no more guessing
    assert step(runs(7)) == [7]
    assert step(runs(7)) == [16]
    with cp_inductor.config.patch(document_mask_speculate=False):
        assert step(runs(7)) == [7]


def test_capacity_runs_without_reading_the_plan(monkeypatch):
    """``document_mask_capacity``: FA4 over that many documents (trailing ones empty), nothing
    read on the host (what a CUDA-graph capture needs); the answer is the mask's for any pack that
    fits, the capacity itself included."""
    launches = []
    packed = document_attention._fa4_packed
    monkeypatch.setattr(document_attention, "_fa4_packed", lambda q, k, v, cu, *a: launches.append(len(cu) - 1) or
                        packed(q, k, v, cu, *a))
    for host_read in ("_to_host", "_settle", "_resolve", "_lengths"):
        monkeypatch.setattr(document_attention, host_read, lambda *a: pytest.fail(f"{host_read} under a capacity"))
    t, capacity = 64, 16
    q, k, v = (torch.randn(1, h, t, D, requires_grad=True) for h in (HQ, HKV, HKV))
    for count in (1, 5, capacity):
        doc = (torch.arange(t) * count // t)[None]
        launches.clear()
        cu, meta = torch.ops.cp_inductor.document_plan(doc, None, True, 1, t, capacity)
        out = torch.ops.cp_inductor.document_attention(q, k, v, cu, meta, doc, None, D ** -0.5, True, "fa4", -1,
                                                       capacity)[0]
        got = [out, *torch.autograd.grad(out.sum(), (q, k, v))]
        ref = document_attention._dense(q, k, v, doc, None, D ** -0.5, True)
        for a, b in zip(got, [ref, *torch.autograd.grad(ref.sum(), (q, k, v))]):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
        assert launches == [capacity], launches


@pytest.mark.parametrize("doc", [torch.arange(64) * 17 // 64, torch.arange(64) % 2], ids=["past_capacity", "not_contiguous"])
def test_capacity_refuses_what_it_cannot_compute(doc):
    """A pack past the capacity, or ids that are not contiguous runs: an error from the device
    check (on CPU at once), never a different answer."""
    with pytest.raises(RuntimeError, match="document_mask_capacity"):
        torch.ops.cp_inductor.document_plan(doc[None], None, True, 1, 64, 16)


def test_capacity_compiled_matches_the_program():
    """The config reaches the ops through the pass: the report says so, and output and every
    gradient are the program's."""
    q, k, v = _qkv()
    table = _positions([7, 1, 16])
    cp_inductor.clear_report()
    with cp_inductor.config.patch(document_mask_capacity=8):
        for got, want in zip(_grads(hf_packed, q, k, v, table, True), _grads(hf_packed, q, k, v, table, False)):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    self_check = TestCase()
    self_check.assertExpectedInline(lines[0].split(": ", 1)[1], """documents from cumsum (proven (cumulative sum of non-negatives)), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32; cudnn: document_mask_capacity (cuDNN's ragged graphs are built per document count); at most 8 documents a pack (document_mask_capacity, asserted on device): no host read, CUDA-graph safe""")


# --- masks bounded by a table of document starts or ends (torchtitan's fast path) -----------


def keys_from_table(q, k, v, starts):
    """Causal, keys from ``starts[b, q]`` on: a table the program hands in (document starts, or
    anything else)."""
    index = torch.arange(T)
    mask = (index[None, :] <= index[:, None]) & (index[None, None, :] >= starts[:, :, None])
    return _attend(q, k, v, mask[:, None])


def queries_up_to_table(q, k, v, ends):
    """Causal, queries up to ``ends[b, kv]``."""
    index = torch.arange(T)
    mask = (index[None, :] <= index[:, None]) & (index[None, :, None] <= ends[:, None, :])
    return _attend(q, k, v, mask[:, None])


def _starts_and_ends(lengths=LENGTHS):
    first = torch.cat([torch.full((n,), sum(lengths[:i])) for i, n in enumerate(lengths)])
    last = torch.cat([torch.full((n,), sum(lengths[: i + 1]) - 1) for i, n in enumerate(lengths)])
    return first[None].expand(B, T).contiguous(), last[None].expand(B, T).contiguous()


def _packed_ran(fn, table) -> bool:
    """Whether the plan of ``fn``'s mask over ``table`` found documents (else the dense path)."""
    bounds = document_attention.BOUNDS["start" if fn is keys_from_table else "end"]
    _, meta = torch.ops.cp_inductor.document_plan(table, None, True, B, T, bounds=bounds)
    return bool(meta[2])


def test_bounded_masks_read_as_documents():
    """The report's line: the table is the documents, checked on device."""
    starts, ends = _starts_and_ends()
    got = "\n".join(f"{fn.__name__}: {_describe(fn, table)}" for fn, table in
                     ((keys_from_table, starts), (queries_up_to_table, ends)))
    TestCase().assertExpectedInline(got, """\
keys_from_table: documents from the queries' document starts arg0_1[b, index] (checked on device), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32
queries_up_to_table: documents from the keys' document ends arg0_1[b, index] (checked on device), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32""")


@pytest.mark.parametrize("fn", [keys_from_table, queries_up_to_table], ids=lambda f: f.__name__)
@pytest.mark.parametrize("table", ["documents", "window", "off_by_one"])
def test_bounded_masks_match_the_program(fn, table):
    """Output and every gradient against the program's masked SDPA: a table of document starts
    (ends) runs packed; a table that is not one (a window: start[q] = q - 3; the documents' bounds
    one token off) computes the mask as written, densely."""
    starts, ends = _starts_and_ends()
    bound = starts if fn is keys_from_table else ends
    index = torch.arange(T).expand(B, T)
    bound = {"documents": bound, "window": (index - 3).clamp(min=0) if fn is keys_from_table else (index + 3).clamp(max=T - 1),
             "off_by_one": torch.where(bound > 0, bound - 1, bound)}[table].contiguous()
    assert _packed_ran(fn, bound) == (table == "documents")
    q, k, v = _qkv()
    for got, want in zip(_grads(fn, q, k, v, bound, True), _grads(fn, q, k, v, bound, False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


@pytest.mark.parametrize("form", ["starts", "ends"])
def test_flex_bounded_masks_lowered(form):
    """torchtitan's packed-document fast path, both of its forms (one row: keys from the query's
    document start; rows: queries up to the key's document end), built from positions that
    restart at 0: lowered, the answer eager flex's."""
    from cp_inductor.testing.documents import document_end_block_mask, document_start_block_mask

    positions = _positions()
    block_mask = document_start_block_mask(positions[:1], "cpu") if form == "starts" else document_end_block_mask(positions, "cpu")
    q, k, v = (t[: block_mask.shape[0]] for t in _qkv())
    got, lines = _routes(_flex, q, k, v, block_mask)
    assert "fa4_varlen" in lines[0] and f"document {form}" in lines[0], lines
    torch.testing.assert_close(got, _flex(q, k, v, block_mask), atol=2e-5, rtol=2e-5)


def test_flex_sliding_window_lowered():
    """torchtitan's sliding-window mask_mod over rows of one document (no document ids): the
    packed kernels over one document a row with the window, the answer eager flex's."""
    from torch.nn.attention.flex_attention import create_block_mask

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 5)

    block_mask = create_block_mask(sliding, B, None, T, T, device="cpu")
    q, k, v = _qkv()
    got, lines = _routes(_flex, q, k, v, block_mask)
    assert "fa4_varlen" in lines[0] and "causal, keys from q-4" in lines[0], lines
    torch.testing.assert_close(got, _flex(q, k, v, block_mask), atol=2e-5, rtol=2e-5)


def _two_checkpointed_layers(weight, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    def layer(x):
        q = (x @ weight).view(1, -1, 4, 16).transpose(1, 2)
        return flex_attention(q, q, q, block_mask=block_mask).transpose(1, 2).reshape(1, -1, 64)

    def program(x):
        h = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)

    return program


@pytest.mark.parametrize("form", ["ids", "starts", "ends"])
def test_flex_in_checkpointed_regions_lowered(form):
    """Flex in activation-checkpointed layers (torchtitan's activation checkpointing of compiled
    blocks): one plan in the outer graph for both regions, no flex call left in them, the answer
    of fp64 attention under the documents' mask."""
    from cp_inductor.testing.documents import document_end_block_mask, document_start_block_mask

    lengths, t = [50, 78], 128
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    block_mask = {"ids": lambda: document_causal_block_mask(doc, t, "cpu"),
                  "starts": lambda: document_start_block_mask(positions, "cpu"),
                  "ends": lambda: document_end_block_mask(positions, "cpu")}[form]()
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 64, generator=g) * 0.1, torch.randn(1, t, 64, generator=g)
    program = _two_checkpointed_layers(weight, block_mask)
    graphs = _dynamo_graphs(program, x)
    calls = [str(n.target) for m in (graphs[0], *graphs[0].children()) for n in m.graph.nodes if n.op == "call_function"]
    assert sum("document_plan" in c for c in calls) == 1 and sum("document_attention.default" in c for c in calls) == 2
    assert not any("flex_attention" in c for c in calls), calls
    got, lines = _routes(program, x)
    assert len(lines) == 2 and all("fa4_varlen" in line for line in lines), lines
    mask = (doc[0][:, None] == doc[0][None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    h = x.double()
    for _ in range(2):
        q = (h @ weight.double()).view(1, t, 4, 16).transpose(1, 2)
        h = F.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).reshape(1, t, 64)
    torch.testing.assert_close(got.double(), h, atol=2e-5, rtol=2e-5)


# --- HF transformers' Llama, compiled end to end ---------------------------------------------


def _llama(impl):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, attn_implementation=impl)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _train_step(model, run, inputs, autocast=None):
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = run(**inputs, labels=inputs["input_ids"], use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_hf_llama_sdpa_compiled(packed):
    pytest.importorskip("transformers")
    lines = _compiled_training_matches_eager(_llama("sdpa"), packed)
    assert len(lines) == 2 and all("fa4_varlen" in line and "proven" in line for line in lines), lines


def test_hf_llama_sdpa_under_autocast_compiled():
    """Under bf16 autocast HF's rotary gives SDPA fp32 query and key beside a bf16 value, which
    autocast casts to bf16; our op, not on autocast's list, gets those casts made explicit: both
    calls lowered in bf16 (read as bf16 calls by the provider), the step within bf16's error."""
    pytest.importorskip("transformers")
    lines = _compiled_training_matches_eager(_llama("sdpa"), packed=True, autocast=torch.bfloat16)
    assert len(lines) == 2 and all("fa4_varlen" in line for line in lines), lines


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_hf_llama_sdpa_gradient_checkpointing_compiled(packed):
    """HF's gradient checkpointing puts each layer's SDPA in an activation-checkpointed region
    whose body takes the mask as an input: the plan is built once outside, the body takes it
    instead of the mask (which is no longer built), and the step is eager HF's."""
    pytest.importorskip("transformers")
    model = _llama("sdpa")
    model.gradient_checkpointing_enable()
    lines = _compiled_training_matches_eager(model, packed)
    assert len(lines) == 2 and all("fa4_varlen" in line and "proven" in line for line in lines), lines


def _compiled_training_matches_eager(model, packed: bool, autocast=None) -> list:
    """One training step of an HF model compiled under cp_inductor against eager HF: loss and
    every parameter's gradient (under ``autocast``: against eager HF in fp32, within twice the
    error of eager HF's own autocast step). Returns the report's masked-attention lines."""
    inputs = {"input_ids": torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))}
    if packed:
        inputs["position_ids"] = _positions()
    want = _train_step(model, model, inputs)
    cp_inductor.clear_report()
    torch._dynamo.reset()
    with reference_kernels(), cp_inductor.config.patch(strict=True):
        got = _train_step(model, torch.compile(model, backend="cp_inductor"), inputs, autocast)
    lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    if autocast is not None:
        assert_within_low_precision(*got, want, _train_step(model, model, inputs, autocast), note=lines)
        return lines
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], atol=1e-5, rtol=1e-4, msg=name)
    return lines


def test_a_mask_offset_by_a_size_the_graph_computes_is_read():
    """Decoding from a cache under dynamic shapes (HF's generate once lengths vary): the queries'
    positions are offset by the cache length, a scalar the graph computes from a size (a node whose
    value is a SymInt, not a tensor). The mask is kept with that reason: its symbol belongs to the
    trace's own shape env, so a term decided by its value would guard nothing (a gate that holds
    at one cache length and not at another, second program, must not be dropped). The reader failed
    on such nodes before (strict raised it; otherwise "the mask analysis failed")."""

    def offset(q, k, v, cache):
        rows = torch.arange(q.shape[2]) + cache.shape[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=rows[:, None] >= torch.arange(k.shape[2])[None, :])

    def gated(q, k, v, cache):
        n = q.shape[2]
        mask = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask & ((torch.arange(n) * 0 + cache.shape[0])[:, None] >= 3))

    for step, shapes in ((offset, ((3, 5), (4, 7))), (gated, ((6, 5), (6, 2), (6, 7)))):
        torch._dynamo.reset()
        cp_inductor.clear_report()
        compiled = torch.compile(step, backend="cp_inductor", dynamic=True)
        for new, cached in shapes:
            q = torch.randn(1, 2, new, 8)
            k, v = (torch.randn(1, 2, new + cached if step is offset else new, 8) for _ in range(2))
            with cp_inductor.config.patch(strict=True):
                got = compiled(q, k, v, torch.empty(cached))
            torch.testing.assert_close(got, step(q, k, v, torch.empty(cached)), equal_nan=True)
        lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
        assert lines and all("symbolic" in line and "failed" not in line for line in lines), lines


def test_a_causal_mask_under_dynamic_shapes():
    """A causal mask built by hand, every size symbolic (``dynamic=True`` on q, k and v): SDPA
    ``is_causal`` over the un-repeated K/V, where ``enable_gqa`` was a SymBool (the compile failed)."""

    def causal(q, k, v):
        n = q.shape[2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril(), enable_gqa=True)

    torch._dynamo.reset()
    cp_inductor.clear_report()
    compiled = torch.compile(causal, backend="cp_inductor", dynamic=True)
    for heads_kv, tokens in ((2, 12), (4, 20)):
        q, k, v = (torch.randn(2, h, tokens, 8) for h in (4, heads_kv, heads_kv))
        with cp_inductor.config.patch(strict=True):
            torch.testing.assert_close(compiled(q, k, v), causal(q, k, v), atol=2e-5, rtol=2e-5)
    lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    assert lines and all("causal" in line and "kept" not in line for line in lines), lines


class _FloatAttributes(torch.nn.Module):
    """HF's attention: projections, then its dropout and scale kept as module attributes."""

    def __init__(self, dropout: float):
        super().__init__()
        self.attention_dropout, self.scaling, self.head_dim = dropout, D ** -0.5, D
        self.q, self.kv = torch.nn.Linear(HQ * D, HQ * D), torch.nn.Linear(HQ * D, 2 * HKV * D)

    def forward(self, x, doc):
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (self.q(x), *self.kv(x).chunk(2, -1)))
        tokens = doc.shape[1]
        causal = torch.arange(tokens)[:, None] >= torch.arange(tokens)[None, :]
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.attention_dropout,
                                              scale=self.scaling, enable_gqa=True)


def test_float_attributes_lifted_by_dynamic_shapes_are_read_with_a_guard():
    """Under ``dynamic=True`` Dynamo makes a module's float attributes inputs of the graph (HF's
    ``attention_dropout`` and ``scaling``): read at their values with a guard, the call is
    lowered; a dropout of 0.1 compiles again and keeps the program's op."""
    torch.manual_seed(0)
    x, doc, model = torch.randn(B, T, HQ * D), _doc_ids(), _FloatAttributes(0.0)
    torch._dynamo.reset()
    cp_inductor.clear_report()
    compiled = torch.compile(model, backend="cp_inductor", dynamic=True)
    with reference_kernels(), cp_inductor.config.patch(strict=True):
        got = compiled(x, doc)
    torch.testing.assert_close(got, model(x, doc), atol=2e-5, rtol=2e-5)
    lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    assert lines and all("fa4_varlen" in line for line in lines), lines
    cp_inductor.clear_report()
    model.attention_dropout = 0.1
    with reference_kernels(), cp_inductor.config.patch(strict=True):
        compiled(x, doc)
    lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    assert lines and all("kept: document_mask: dropout 0.1" in line for line in lines), lines


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_hf_mistral_sliding_window_compiled(packed):
    """Mistral's sliding window (HF's overlay, over the positions it remaps a packed batch to):
    lowered with FA4's window; loss and every gradient as under eager HF."""
    pytest.importorskip("transformers")
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, sliding_window=6, attn_implementation="sdpa")
    torch.manual_seed(0)
    lines = _compiled_training_matches_eager(MistralForCausalLM(config), packed)
    assert len(lines) == 2 and all("keys from q-5: fa4_varlen" in line for line in lines), lines


# HF transformers architectures beyond Llama and Mistral, each the way its config spells what
# makes it different (a window on some layers, experts, partial rotary, one K/V head, MLA, score
# multipliers): (config class, model class, its layers with a window, fields beyond the common ones).
_SURVEY = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", 1, dict(sliding_window=6,
                                                                layer_types=["sliding_attention", "full_attention"])),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", 1, dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 0, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", 2, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "phi3_window": ("Phi3Config", "Phi3ForCausalLM", 2, dict(sliding_window=6, pad_token_id=0, head_dim=None)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", 0, dict(rotary_pct=0.25, head_dim=None, num_key_value_heads=None)),
    "falcon_multi_query": ("FalconConfig", "FalconForCausalLM", 0, dict(multi_query=True, parallel_attn=True, alibi=False,
                                                                        head_dim=None, num_key_value_heads=None)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", 2, dict(sliding_window=6, head_dim=None)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", 1, dict(sliding_window=6, head_dim=None,
                                                               layer_types=["sliding_attention", "full_attention"])),
    "granite": ("GraniteConfig", "GraniteForCausalLM", 0, dict(attention_multiplier=0.3, embedding_multiplier=2.0,
                                                               residual_multiplier=0.5, logits_scaling=4.0)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", 1, dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 0, dict(
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        num_key_value_heads=4, head_dim=4)),
    # MLA's head dims as DeepSeek-V3 ships them in proportion (q/k 24 = 16 + 8 rotary, v 16): FA4
    # refuses a value head dim other than the query's, the cuDNN ragged route takes it
    "deepseek_v3_mla": ("DeepseekV3Config", "DeepseekV3ForCausalLM", 0, dict(
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, num_key_value_heads=4, head_dim=8)),
}


@pytest.mark.wide
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("arch", list(_SURVEY))
def test_hf_architectures_training_match_eager(arch, packed):
    """A survey (CP_INDUCTOR_TESTS=all): one training step of each architecture compiled under
    cp_inductor, loss and every gradient as under eager HF, every attention call lowered (FA4's
    reference kernels on the CPU), windowed layers with their window."""
    _survey_step(arch, packed)


def test_hf_deepseek_v3_packed_training_on_the_cudnn_route():
    """DeepSeek-V3's MLA head dims on a packed batch: the documents go to cuDNN's ragged
    attention, whose outputs and gradients are laid out as the op's fakes promise (Inductor's
    stride checks failed there), and one training step matches eager HF."""
    _survey_step("deepseek_v3_mla", True)


def _survey_step(arch, packed):
    transformers = pytest.importorskip("transformers")
    config_name, model_name, windowed, fields = _SURVEY[arch]
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, use_cache=False, attn_implementation="sdpa")
    kwargs = {k: v for k, v in {**common, **fields}.items() if v is not None}
    if arch.startswith("falcon"):
        kwargs["ffn_hidden_size"] = kwargs.pop("intermediate_size")
    config = getattr(transformers, config_name)(**kwargs)
    for name in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "residual_dropout",
                 "embedding_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    lines = _compiled_training_matches_eager(getattr(transformers, model_name)(config), packed)
    route = "cudnn_ragged" if arch == "deepseek_v3_mla" else "fa4_varlen"
    assert len(lines) == 2 and all(route in line for line in lines), lines
    assert sum("keys from q-5" in line for line in lines) == windowed, lines


# --- one GPU -----------------------------------------------------------------------------------


def _gpu_missing():
    if not torch.cuda.is_available():
        return "needs a GPU"
    return None


@pytest.mark.skipif(_gpu_missing() is not None, reason="needs a GPU")
@pytest.mark.parametrize("provider", document_attention.PROVIDERS)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_document_attention_matches_fp32(provider, causal, window=-1):
    from cp_inductor.lowerings import varlen_attention

    why = (fa4_attention.unavailable(torch.device("cuda"), torch.bfloat16, 128) if provider == "fa4"
           else varlen_attention.cudnn_unavailable(torch.device("cuda"), torch.bfloat16, 128))
    if why:
        pytest.skip(why)
    extra = [window] if window >= 0 else []
    g = torch.Generator().manual_seed(0)
    b, t, hq, hkv, d = 2, 2048, 8, 2, 128
    q, k, v = (torch.randn(b, t, h, d, generator=g).cuda().bfloat16().transpose(1, 2) for h in (hq, hkv, hkv))
    grad = torch.randn(b, hq, t, d, generator=g).cuda().bfloat16()
    # the shape's first pack (its plan read at once), fewer documents than the capacity learned
    # (FA4 launched at it before the numbers are read), more (launched again exactly)
    for lengths in ([1, 300, 77, 1000, 129, 541], [2000, 40, 8], [51] * 40 + [8]):
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(b, -1).cuda()

        def ours(q, k, v):
            cu, meta = torch.ops.cp_inductor.document_plan(doc, None, True, *doc.shape)
            return torch.ops.cp_inductor.document_attention(q, k, v, cu, meta, doc, None, d ** -0.5, causal, provider,
                                                            *extra)[0]

        def dense(q, k, v):
            return document_attention._dense(q, k, v, doc, None, d ** -0.5, causal, window)

        def run(fn, dtype):
            ins = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
            out = fn(*ins)
            return [out, *torch.autograd.grad(out, ins, grad.to(dtype))]

        want = run(dense, torch.float32)
        program = run(dense, torch.bfloat16)
        for name, got, ref, bf16 in zip(("out", "dq", "dk", "dv"), run(ours, torch.bfloat16), want, program):
            err = float((got.float() - ref).norm() / ref.norm())
            err_program = float((bf16.float() - ref).norm() / ref.norm())
            assert err < max(2 * err_program, 5e-3), (len(lengths), name, err, err_program)


@pytest.mark.skipif(_gpu_missing() is not None, reason="needs a GPU")
@pytest.mark.parametrize("step", [1, 2])
def test_gpu_plan_checks_positions_step_by_one(step):
    """The plan's ``stepping`` check on the GPU (the aten plan: the kernel checks rising only):
    the same numbers as on the CPU; positions rising by two are not packable."""
    lengths = [1000, 77, 2000, 1019]
    doc, positions = _doc_ids(lengths, 1), _positions(lengths, 1) * step
    plans = [torch.ops.cp_inductor.document_plan(doc.to(device), positions.to(device), True, 1, doc.shape[1],
                                                 stepping=True) for device in ("cpu", "cuda")]
    (cu_cpu, meta_cpu), (cu_gpu, meta_gpu) = plans
    assert torch.equal(cu_gpu.cpu(), cu_cpu) and meta_gpu.tolist() == meta_cpu.tolist(), (meta_cpu, meta_gpu)
    assert int(meta_cpu[2]) == (step == 1), meta_cpu


@pytest.mark.skipif(_gpu_missing() is not None, reason="needs a GPU")
@pytest.mark.parametrize("window", [0, 100, 4000])
def test_gpu_document_attention_sliding_window_matches_fp32(window):
    """FA4's window over the documents (Mistral's sliding window on a pack)."""
    test_gpu_document_attention_matches_fp32("fa4", True, window)


@pytest.mark.skipif(_gpu_missing() is not None, reason="needs a GPU")
def test_gpu_capacity_step_is_cuda_graphed():
    """``document_mask_capacity`` under ``mode="reduce-overhead"``: HF's packed mask compiled,
    Inductor's CUDA graphs record the step (none skipped: nothing is read on the host), and every
    replay, over packs of other document counts, gives the mask's output and gradients."""
    from torch._dynamo.utils import counters

    why = fa4_attention.unavailable(torch.device("cuda"), torch.bfloat16, 128)
    if why:
        pytest.skip(why)
    b, t, hq, hkv, d = 2, 2048, 8, 2, 128

    def program(q, k, v, positions):
        ids = _resets(positions)
        keep = (ids[:, None, :, None] == ids[:, None, None, :]) & (positions[:, None, None, :] <= positions[:, None, :, None])
        k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, generator=g).cuda().bfloat16().transpose(1, 2) for h in (hq, hkv, hkv))
    grad = torch.randn(b, hq, t, d, generator=g).cuda().bfloat16()

    def run(fn, dtype, positions):
        ins = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*ins, positions)
        return [x.detach().clone() for x in (out, *torch.autograd.grad(out, ins, grad.to(dtype)))]

    torch._dynamo.reset()
    counters.clear()
    with cp_inductor.config.patch(document_mask_capacity=32):
        compiled = torch.compile(program, backend="cp_inductor", mode="reduce-overhead")
        packs = ([1000, 1048], [300, 77, 1000, 129, 541, 1], [128] * 16, [2048], [1000, 1048])  # 32 documents at most
        for lengths in packs:  # warm-up, record, then replays
            positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(b, -1).cuda()
            got = run(compiled, torch.bfloat16, positions)
            want = run(program, torch.float32, positions)
            base = run(program, torch.bfloat16, positions)
            for name, x, ref, bf16 in zip(("out", "dq", "dk", "dv"), got, want, base):
                err, err_program = (float((y.float() - ref).norm() / ref.norm()) for y in (x, bf16))
                assert err < max(2 * err_program, 5e-3), (len(lengths), name, err, err_program)
    assert "at most 32 documents" in str(cp_inductor.report())
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._inductor.cudagraph_trees.reset_cudagraph_trees()


# --- flex_attention ------------------------------------------------------------------------------


def _flex_doc_causal(doc):
    return document_causal_block_mask(doc, T, "cpu")


def flex_program(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


def test_flex_document_mask_lowered():
    """A flex document-causal BlockMask (and_masks of causal and same document, torchtitan's
    document-id form): the call becomes packed attention; its answer is eager flex's. (torch
    2.13's CPU flex has no backward: flex training numerics run on the GPU.)"""
    doc = _doc_ids()
    block_mask = _flex_doc_causal(doc)
    q, k, v = _qkv()
    want = flex_program(q, k, v, block_mask)
    got, lines = _routes(flex_program, q, k, v, block_mask)
    self_check = TestCase()
    self_check.assertExpectedInline(lines[0].split(": ", 1)[1], """documents from arg4_1 (checked on device), causal: fa4_varlen: no cost map for cpu: no measurement of thd T48 Hq4 Hkv2 D16 causal float32""")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _flex_with_lse(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    out, aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse.to(v.dtype)  # HF's flex path on CUDA: the lse in the dtype, as attention weights


def hf_layer_drops_lse(q, k, v, block_mask):
    out, _ = _flex_with_lse(q, k, v, block_mask)
    return out


def program_returns_lse(q, k, v, block_mask):
    out, lse = _flex_with_lse(q, k, v, block_mask)
    return out, lse


def program_writes_lse(q, k, v, block_mask, stats):
    out, lse = _flex_with_lse(q, k, v, block_mask)
    stats.copy_(lse)  # a write: the lse is read
    return out


def test_flex_lse_asked_for_and_dropped_is_lowered_read_is_kept():
    """HF asks flex for the log-sum-exp on CUDA (flex scales it by ln 2, HF casts it) and its
    decoder layer drops it: lowered. A program that returns it keeps its op."""
    doc = _doc_ids()
    block_mask = _flex_doc_causal(doc)
    q, k, v = _qkv()
    got, lines = _routes(hf_layer_drops_lse, q, k, v, block_mask)
    assert "fa4_varlen" in lines[0], lines
    torch.testing.assert_close(got, flex_program(q, k, v, block_mask), atol=2e-5, rtol=2e-5)
    from cp_inductor.passes.dynamo import document_mask

    reasons = []

    def read_only(gm, inputs):  # Inductor's CPU flex has no lse: the pass's verdict alone
        reasons.extend(document_mask.why_not(call, cp_inductor.config) for call in document_mask.find(gm, cp_inductor.config))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(program_returns_lse, backend=read_only, fullgraph=True)(q, k, v, block_mask)
    assert reasons == ["the program reads the log-sum-exp"], reasons
    reasons.clear()
    torch._dynamo.reset()
    stats = torch.zeros(B, HQ, T)
    torch.compile(program_writes_lse, backend=read_only, fullgraph=True)(q, k, v, block_mask, stats)
    assert reasons == ["the program reads the log-sum-exp"], reasons


def test_flex_sliding_window_documents_lowered():
    """torchtitan's sliding-window flex mask (and_masks of causal, same document, window)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    doc = _doc_ids()

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 4

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    block_mask = create_block_mask(and_masks(causal, same_document, window), B, None, T, T, device="cpu")
    q, k, v = _qkv()
    got, lines = _routes(flex_program, q, k, v, block_mask)
    assert "causal, keys from q-3: fa4_varlen" in lines[0], lines
    torch.testing.assert_close(got, flex_program(q, k, v, block_mask), atol=2e-5, rtol=2e-5)


def test_hf_llama_flex_compiled_forward():
    """Against the same weights under HF's eager ``sdpa``: on CPU (torch 2.13) HF's own flex
    path, compiled flex inside, differs from it by 0.14 in the logits, and default Inductor's
    compiled flex gives NaN at times (docs/passes/document_mask.md). HF's BlockMask is built in
    the step's one graph (its warning no longer breaks it), where the lowering leaves it dead."""
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    import warnings

    import cp_inductor.backend  # noqa: F401 - its import decides on tracing over warnings

    model = _llama("flex_attention").eval()
    inputs = {"input_ids": torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1)),
              "position_ids": _positions()}
    kept = []
    with torch.no_grad():
        want = _llama("sdpa").eval()(**inputs, use_cache=False).logits
        cp_inductor.clear_report()
        torch._dynamo.reset()
        counters.clear()
        with reference_kernels(), cp_inductor.config.patch(strict=True):
            options = {"post_grad_custom_post_pass": lambda g: kept.extend(n.target for n in g.nodes)}
            got = torch.compile(model, backend="cp_inductor", options=options)(**inputs, use_cache=False).logits
    lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    assert len(lines) == 2 and all("fa4_varlen" in line for line in lines), lines
    if warnings.warn in torch._dynamo.config.ignore_logging_functions:  # (backend.trace_over_warnings)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        # the mask over T x T compares positions: nothing compares once the BlockMask is dead
        assert not {torch.ops.aten.eq.Tensor, torch.ops.aten.le.Tensor, torch.ops.aten.ge.Tensor} & set(kept), kept
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_hf_mistral_flex_sliding_window_compiled_forward():
    """Mistral's sliding window under HF's ``flex_attention``: the window is read over a table
    of positions the graph cannot prove to step by one; they are checked on device (the plan's
    ``stepping``) and the call lowered with FA4's window. Against the same weights under HF's eager ``sdpa`` (torch's CPU flex is off
    on this mask, docs/passes/document_mask.md)."""
    pytest.importorskip("transformers")
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(impl):
        config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=6,
                               attn_implementation=impl)
        torch.manual_seed(0)
        return MistralForCausalLM(config).eval()

    inputs = {"input_ids": torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1)),
              "position_ids": _positions()}
    with torch.no_grad():
        want = mistral("sdpa")(**inputs, use_cache=False).logits
        cp_inductor.clear_report()
        torch._dynamo.reset()
        with reference_kernels(), cp_inductor.config.patch(strict=True):
            got = torch.compile(mistral("flex_attention"), backend="cp_inductor")(**inputs, use_cache=False).logits
    lines = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    assert len(lines) == 2 and all("fa4_varlen" in line and "stepping by one within documents" in line
                                   for line in lines), lines
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(_gpu_missing() is not None, reason="needs a GPU")
@pytest.mark.parametrize("form", ["ids", "starts", "ends", "window"])
def test_gpu_flex_document_training_matches_fp32(form):
    """Flex's document-causal BlockMask (written with document ids, or with a table of document
    starts or ends), or a causal sliding window over two rows without documents, trained on the
    GPU: output and every gradient of the rewritten call against fp32 SDPA under the same mask,
    within 2x the error of compiled flex."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from cp_inductor.testing.documents import document_end_block_mask, document_start_block_mask

    if fa4_attention.unavailable(torch.device("cuda"), torch.bfloat16, 128):
        pytest.skip("needs FA4")
    b, t, hq, hkv, d = 1, 4096, 8, 2, 128
    lengths = [1000, 77, 2000, 1019]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].cuda()
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    window = 300  # a key at most window - 1 places before its query

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    if form == "window":  # each row one document; the reference masks it the same way
        b, doc = 2, torch.zeros(2, t, dtype=torch.long, device="cuda")
    block_mask = {"ids": lambda: document_causal_block_mask(doc, t, "cuda"),
                  "starts": lambda: document_start_block_mask(positions, "cuda"),
                  "ends": lambda: document_end_block_mask(positions, "cuda"),
                  "window": lambda: create_block_mask(sliding, b, None, t, t, device="cuda")}[form]()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).cuda() for h in (hq, hkv, hkv))
    grad = torch.randn(b, hq, t, d, generator=g).cuda()

    def program(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

    def run(fn, dtype):
        ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*ins)
        return [out, *torch.autograd.grad(out, ins, grad.to(dtype))]

    left = window - 1 if form == "window" else -1
    want = run(lambda q, k, v: document_attention._dense(q, k, v, doc, None, d ** -0.5, True, left), torch.float32)
    torch._dynamo.reset()
    flex = run(torch.compile(program), torch.bfloat16)
    torch._dynamo.reset()
    cp_inductor.clear_report()
    ours = run(torch.compile(program, backend="cp_inductor"), torch.bfloat16)
    assert "fa4_varlen" in str(cp_inductor.report())
    for name, got, ref, base in zip(("out", "dq", "dk", "dv"), ours, want, flex):
        err, err_flex = (float((x.float() - ref).norm() / ref.norm()) for x in (got, base))
        assert err < max(2 * err_flex, 5e-3), (name, err, err_flex)


@pytest.mark.vectorized_cpu  # the kept flex call is compiled by Inductor on the CPU
def test_torchtitan_style_decoder_lowered_per_block(monkeypatch):
    """Documents from EOS tokens, a compiled create_block_mask outside the model, flex behind a
    nested compile, each block compiled on its own (``cp_inductor.testing.titan``): the blocks'
    one graph is lowered, each block's attention runs packed, and the logits are default
    Inductor's."""
    from cp_inductor.lowerings.varlen_attention import reference_kernels
    from cp_inductor.testing import titan

    packed_calls = []
    packed = document_attention._fa4_packed
    monkeypatch.setattr(document_attention, "_fa4_packed", lambda *a: packed_calls.append(len(a[3]) - 1) or packed(*a))
    monkeypatch.setattr(document_attention, "_LEARNED", {})  # no capacity learned by an earlier test of 128 tokens

    torch.manual_seed(0)
    tokens = torch.randint(1, 50, (2, 64))
    tokens[0, [9, 30, 31]] = tokens[1, [40]] = 0  # EOS: documents of 10, 21, 1, 33 tokens; 41, 23
    block_mask = titan.document_causal_mask(tokens, eos_id=0)
    results = {}
    for backend in ("inductor", "cp_inductor"):
        torch.manual_seed(1)
        model = titan.Decoder(vocab=50, dim=64, layers=2, heads=4, kv_heads=2)
        titan.compile_blocks(model, backend=backend)
        torch._dynamo.reset()
        cp_inductor.clear_report()
        with torch.no_grad(), reference_kernels(), cp_inductor.config.patch(strict=True):
            results[backend] = model(tokens, block_mask)
    lowered = [line for line in str(cp_inductor.report()).splitlines() if "masked attention" in line]
    self_check = TestCase()
    self_check.assertExpectedInline("\n".join(lowered), """masked attention flex_attention: documents from arg4_1 (checked on device), causal: fa4_varlen: no cost map for cpu: no measurement of thd T128 Hq4 Hkv2 D16 causal float32""")
    # a plan per block (a graph each): the first reads its numbers (FA4 over the 6 documents),
    # the second launches at the capacity the first learned before reading them
    assert packed_calls == [6, 16], packed_calls
    torch.testing.assert_close(results["cp_inductor"], results["inductor"], atol=2e-4, rtol=2e-4)
