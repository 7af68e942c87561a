"""torch's flex CP (torchtitan's only CP path for packed documents): each rank's queries over the
all-gathered K/V under a BlockMask whose mask_mod maps the local query index (and, under a load
balancer, every index) to its place in the pack; and the same written by hand as a masked SDPA.
document_mask reads those positions and lowers the call to FA4 varlen over the shard's document
segments (``document_shard_attention``).
CPU: the reference kernels stand in for FA4; torch 2.13's CPU flex has no backward, so the
compiled programs run forward here and the op's gradients are checked against dense attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase

import cp_inductor
from cp_inductor.lowerings import document_attention
from cp_inductor.lowerings.varlen_attention import reference_kernels
from cp_inductor.testing.documents import compile_masked, cp_document_block_mask, flex_cp_attention
from cp_inductor.testing.launch import run_on_ranks

T, CP, HQ, HKV, D = 512, 2, 4, 2, 16
LENGTHS = [100, 250, 162]


def _doc():
    return torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]


def _full_qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, T, D, generator=g) for h in (HQ, HKV, HKV))


def _reference(q, k, v, doc, causal=True):
    """Single-device attention over the whole pack under the document(-causal) mask."""
    mask = doc[0][:, None] == doc[0][None, :]
    if causal:
        mask = mask & torch.ones(T, T, dtype=torch.bool).tril()
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)


def _local(t, order, rank):
    """This rank's rows of a pack-ordered tensor ([B, H, T, D]) after the balancer's rearrangement."""
    return t[:, :, order][:, :, rank * (T // CP):(rank + 1) * (T // CP)]


def flex_shard(q, k_all, v_all, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k_all, v_all, block_mask=block_mask, enable_gqa=True)


_compiled = compile_masked


def _shard_inputs(balance, rank):
    doc = _doc()
    block_mask, order = cp_document_block_mask(doc, CP, rank, balance, "cpu")
    q, k, v = _full_qkv()
    return doc, block_mask, order, (q, k, v), (_local(q, order, rank), k[:, :, order], v[:, :, order])


class TestCPMasks(TestCase):
    def test_what_the_report_says_per_balance(self):
        """Without a balancer the mask maps the local query index to its place; with one, every
        index goes through the balancer's permutation (keys too)."""
        got = []
        for balance in ("none", "headtail", "ptrr"):
            *_, local = _shard_inputs(balance, rank=1)
            _, lines = _compiled(flex_shard, *local, _shard_inputs(balance, 1)[1])
            got.append(f"{balance}: {lines[0].split(': ', 1)[1]}")
        self.assertExpectedInline("\n".join(got), """\
none: documents from arg4_1 (checked on device), causal, queries at positions the mask_mod computes (add_1): fa4_varlen: queries of a shard over every key: FA4 varlen per document segment, keys in place
headtail: documents from arg5_1 (checked on device), causal, queries at positions the mask_mod computes (index), keys at positions the mask_mod computes (index_1): fa4_varlen: queries of a shard over every key: FA4 varlen per document segment, keys in place
ptrr: documents from arg5_1 (checked on device), causal, queries at positions the mask_mod computes (index), keys at positions the mask_mod computes (index_1): fa4_varlen: queries of a shard over every key: FA4 varlen per document segment, keys in place""")

    @pytest.mark.vectorized_cpu  # the kept flex call is compiled by Inductor on the CPU
    def test_causal_over_local_indices_is_kept(self):
        """Documents read at the shard's place but causal over the LOCAL query index: not a
        document-causal mask over the pack (a CP mask written wrong), kept with the reason."""
        from torch.nn.attention.flex_attention import create_block_mask

        doc = _doc()

        def wrong(b, h, q_idx, kv_idx):
            place = (q_idx // 128 + 2) * 128 + q_idx % 128
            return (doc[b, place] == doc[b, kv_idx]) & (q_idx >= kv_idx)

        block_mask = create_block_mask(wrong, 1, None, T // CP, T, device="cpu")
        q, k, v = _full_qkv()
        _, lines = _compiled(flex_shard, q[:, :, : T // CP], k, v, block_mask)
        self.assertExpectedInline(lines[0].split(": ", 1)[1], """mask not read: kept: document_mask: causal over the local indices where the documents are read at mapped positions""")


@pytest.mark.parametrize("balance", ["none", "headtail", "ptrr"])
@pytest.mark.parametrize("rank", [0, 1])
def test_shard_forward_matches_eager_flex_and_the_single_device_pack(balance, rank):
    doc, block_mask, order, full, local = _shard_inputs(balance, rank)
    got, lines = _compiled(flex_shard, *local, block_mask)
    assert "fa4_varlen" in lines[0], lines
    torch.testing.assert_close(got, flex_shard(*local, block_mask), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, _local(_reference(*full, doc), order, rank), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("balance", ["none", "headtail", "ptrr"])
@pytest.mark.parametrize("form", ["starts", "ends"])
def test_shard_of_a_bounded_mask_matches_eager_flex(form, balance):
    """torchtitan's packed-document fast path (a table of document starts or ends) under torch's
    flex CP: lowered onto the shard's segments; the answer is eager flex's and the pack's."""
    doc = _doc()
    block_mask, order = cp_document_block_mask(doc, CP, 1, balance, "cpu", form=form)
    q, k, v = _full_qkv()
    local = (_local(q, order, 1), k[:, :, order], v[:, :, order])
    got, lines = _compiled(flex_shard, *local, block_mask)
    assert "fa4_varlen" in lines[0] and f"document {form}" in lines[0], lines
    torch.testing.assert_close(got, flex_shard(*local, block_mask), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, _local(_reference(q, k, v, doc), order, 1), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bounds", ["start", "end"])
def test_shard_op_with_bounds_packs_documents_and_computes_others_densely(bounds):
    """The shard ops over a table of document bounds: a true one runs packed, one that is off by
    a token computes the mask as written; output and every gradient against that mask, densely."""
    doc = _doc()[0]
    index = torch.arange(T)
    first = torch.ones(T, dtype=torch.bool)
    first[1:] = doc[1:] != doc[:-1]
    last = torch.ones(T, dtype=torch.bool)
    last[:-1] = first[1:]
    table = torch.where(first, index, 0).cummax(0).values if bounds == "start" else \
        torch.where(last, index, T).flip(0).cummin(0).values.flip(0)
    code = document_attention.BOUNDS[bounds]
    query_positions = torch.cat([torch.arange(64, 192), torch.arange(320, 448)])[None]
    for name, ids in (("documents", table), ("off by one", (table - 1).clamp(min=0))):
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, HQ, query_positions.shape[1], D, dtype=torch.float64, generator=g).requires_grad_()
        k, v = (torch.randn(1, HKV, T, D, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
        with reference_kernels():
            plan, meta = torch.ops.cp_inductor.document_shard_plan(ids[None], query_positions, None, True, True, 1,
                                                                   query_positions.shape[1], T, bounds=code)
            out = torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, ids[None], query_positions, None,
                                                                 0.25, True)[0]
        assert int(meta[4]) == (name == "documents"), (name, meta)
        want = document_attention._shard_dense(q, k, v, ids[None], query_positions, None, 0.25, True, code)
        grad = torch.randn_like(out)
        for got_t, want_t in zip((out, *torch.autograd.grad(out, (q, k, v), grad)),
                                 (want, *torch.autograd.grad(want, (q, k, v), grad))):
            torch.testing.assert_close(got_t, want_t, atol=1e-6, rtol=1e-6)
        if name == "documents":  # the true table's mask is the documents' mask
            torch.testing.assert_close(out, document_attention._shard_dense(q, k, v, doc[None], query_positions, None,
                                                                            0.25, True), atol=1e-6, rtol=1e-6)


@pytest.mark.vectorized_cpu  # the kept flex call is compiled by Inductor on the CPU
def test_bounds_read_at_the_local_index_as_well_are_kept():
    """A table of bounds read at the query's place AND at its local index: the pass would
    evaluate it at the place over the pack, which is not what the program reads: kept."""
    from torch.nn.attention.flex_attention import create_block_mask

    half = T // 2
    starts = torch.randint(0, T, (T, T), generator=torch.Generator().manual_seed(4))
    places = torch.arange(half, T)

    def shard(b, h, q_idx, kv_idx):
        place = places[q_idx]
        return (kv_idx <= place) & (starts[place, q_idx] <= kv_idx)

    block_mask = create_block_mask(shard, 1, None, half, T, device="cpu")
    q, k, v = _full_qkv()
    got, lines = _compiled(flex_shard, q[:, :, half:], k, v, block_mask)
    assert "read at the index other than through its place" in lines[0], lines
    torch.testing.assert_close(got, flex_shard(q[:, :, half:], k, v, block_mask), atol=2e-5, rtol=2e-5)


def test_keys_at_positions_that_are_not_a_permutation_compute_densely():
    """A key map the plan cannot read in place (two keys at one position) is found on device:
    the op computes the mask densely, the answer the program's."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = _doc()

    def halves(b, h, q_idx, kv_idx):
        key = kv_idx // 2 * 2
        return (doc[b, q_idx] == doc[b, key]) & (q_idx >= key)

    block_mask = create_block_mask(halves, 1, None, T, T, device="cpu")
    q, k, v = _full_qkv()
    got, lines = _compiled(flex_shard, q, k, v, block_mask)
    assert "keys at positions the mask_mod computes" in lines[0], lines
    torch.testing.assert_close(got, flex_shard(q, k, v, block_mask), atol=2e-5, rtol=2e-5)


def test_positions_past_the_keys_compute_densely_on_the_whole_table():
    """A mask_mod over a local shard of the KEYS (positions kv + 32 past the 32 keys given): the
    plan cannot read them in place; the dense path reads the whole table at those positions."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = _doc()

    def later_keys(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx + 256]) & (q_idx >= kv_idx + 256)

    block_mask = create_block_mask(later_keys, 1, None, T, T // 2, device="cpu")
    q, k, v = _full_qkv()
    got, lines = _compiled(flex_shard, q, k[:, :, T // 2:], v[:, :, T // 2:], block_mask)
    assert "keys at positions the mask_mod computes" in lines[0], lines
    torch.testing.assert_close(got, flex_shard(q, k[:, :, T // 2:], v[:, :, T // 2:], block_mask), atol=2e-5, rtol=2e-5)


def _layouts():
    """(query positions, key positions) of shards as the balancers cut them, and odd ones."""
    n = T // (2 * CP)
    head_tail = torch.cat([torch.arange(n, 2 * n), torch.arange(2 * n, 3 * n)])  # rank 1 of cp 2
    gathered = torch.cat([torch.arange(0, n), torch.arange(3 * n, 4 * n), torch.arange(n, 3 * n)])
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(T // 16, generator=g)[: T // 32].sort().values
    ptrr = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
    return {
        "one device": (None, None),
        "no balancer, rank 1": (torch.arange(T // 2, T)[None], None),
        "head-tail": (head_tail[None], gathered[None]),
        "blocks, keys permuted": (ptrr[None], torch.randperm(T, generator=g)[None]),
        "per-row shards": (torch.stack([head_tail, ptrr]), None),
        "blocks out of order": ((torch.randperm(T // 32, generator=g)[: T // 64, None] * 32 + torch.arange(32)).reshape(1, -1),
                                None),
    }


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", list(_layouts()))
def test_shard_op_output_and_gradients_match_dense_attention(layout, causal):
    """The op's FA4 path (reference kernels on CPU: one call per round, segments of one document
    in different rounds) against dense attention under the same mask, output and every gradient."""
    query_positions, key_positions = _layouts()[layout]
    doc = torch.cat([_doc(), torch.repeat_interleave(torch.arange(3), torch.tensor([10, 400, 102]))[None]])
    tq = T if query_positions is None else query_positions.shape[-1]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, HQ, tq, D, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (torch.randn(2, HKV, T, D, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    with reference_kernels():
        plan, meta = torch.ops.cp_inductor.document_shard_plan(doc, query_positions, key_positions, True, causal, 2, tq, T)
        out = torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, doc, query_positions, key_positions,
                                                             0.25, causal)[0]
    assert int(meta[4]) == 1, meta  # packable: the FA4 path ran
    want = document_attention._shard_dense(q, k, v, doc, query_positions, key_positions, 0.25, causal)
    grad = torch.randn_like(out)
    for got_t, want_t in zip((out, *torch.autograd.grad(out, (q, k, v), grad)),
                             (want, *torch.autograd.grad(want, (q, k, v), grad))):
        torch.testing.assert_close(got_t, want_t, atol=1e-6, rtol=1e-6)  # FA4's log-sum-exp is fp32


@pytest.mark.parametrize("layout", ["one device", "head-tail", "blocks, keys permuted"])
@pytest.mark.parametrize("window", [0, 37])
def test_shard_op_with_a_window_matches_attention_under_the_window_mask(layout, window):
    """A sliding window (keys from q - window on, over the places in the row), the op's FA4 path
    (reference kernels) and its dense path, against SDPA under that mask written out here."""
    query_positions, key_positions = _layouts()[layout]
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 400, 102]))[None]
    tq = T if query_positions is None else query_positions.shape[-1]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, HQ, tq, D, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (torch.randn(1, HKV, T, D, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    qpos = torch.arange(tq) if query_positions is None else query_positions[0]
    kpos = torch.arange(T) if key_positions is None else key_positions[0]
    qp, kp = qpos[:, None], kpos[None, :]
    mask = (doc[0, qp] == doc[0, kp]) & (kp <= qp) & (kp >= qp - window)
    groups = HQ // HKV
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask, scale=0.25)
    grad = torch.randn_like(want)
    wanted = (want, *torch.autograd.grad(want, (q, k, v), grad))
    with reference_kernels():
        plan, meta = torch.ops.cp_inductor.document_shard_plan(doc, query_positions, key_positions, True, True, 1, tq, T)
        out = torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, doc, query_positions, key_positions,
                                                             0.25, True, window_left=window)[0]
    assert int(meta[4]) == 1, meta  # packable: the FA4 path ran
    dense = document_attention._shard_dense(q, k, v, doc, query_positions, key_positions, 0.25, True, 0, window)
    for got in (out, dense):
        for got_t, want_t in zip((got, *torch.autograd.grad(got, (q, k, v), grad)), wanted):
            torch.testing.assert_close(got_t, want_t, atol=1e-6, rtol=1e-6)


def test_shard_plan_numbers_are_read_after_a_speculative_launch(monkeypatch):
    """A shape's first shard plan reads its numbers at once; later ones launch at the segments
    and rounds learned before reading them, and keep that only where the numbers prove it exact."""
    monkeypatch.setattr(document_attention, "_LEARNED", {})
    launches = []
    packed = document_attention._shard_packed
    monkeypatch.setattr(document_attention, "_shard_packed", lambda *a: launches.append(a[4][:2]) or packed(*a))
    layouts = _layouts()
    doc = torch.cat([_doc(), torch.repeat_interleave(torch.arange(3), torch.tensor([10, 400, 102]))[None]])
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(2, HKV, T, D, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))

    def step(layout):
        query_positions, key_positions = layouts[layout]
        q = torch.randn(2, HQ, query_positions.shape[-1], D, dtype=torch.float64, generator=g).requires_grad_()
        launches.clear()
        with reference_kernels():
            plan, meta = torch.ops.cp_inductor.document_shard_plan(doc, query_positions, key_positions, True, True, 2,
                                                                   q.shape[2], T)
            out = torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, doc, query_positions,
                                                                 key_positions, 0.25, True)[0]
        want = document_attention._shard_dense(q, k, v, doc, query_positions, key_positions, 0.25, True)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
        for got_t, want_t in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(got_t, want_t, atol=1e-6, rtol=1e-6)
        return (int(meta[0]), int(meta[1])), list(launches)

    exact, seen = step("no balancer, rank 1")
    assert seen == [exact] and exact[1] == 1  # the shape's first plan: its own numbers
    assert step("no balancer, rank 1")[1] == [(16, 1)]  # launched at the room learned, kept
    many, seen = step("blocks out of order")
    assert many[0] > 16 and seen == [(16, 1), many]  # more segments than that: launched again exactly
    assert step("blocks out of order")[1] == [(document_attention._room(many[0], 16, 2 * T), many[1])]


def _gloo_rank(rank, cp, balance):
    """torchtitan's flex CP on a real group: torch shards the BlockMask (``_context_parallel_shard``),
    the attention all-gathers K/V through ``cplib::flex_cp_allgather``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (cp,))
    doc = _doc()
    block_mask, order = cp_document_block_mask(doc, cp, rank, balance, "cpu", mesh=mesh)
    q, k, v = _full_qkv()
    local = [_local(t, order, rank) for t in (q, k, v)]
    group = dist.distributed_c10d._get_process_group_name(mesh.get_group())
    got, lines = _compiled(flex_cp_attention, *local, block_mask, group)
    return got, _local(_reference(q, k, v, doc), order, rank), lines


@pytest.mark.parametrize("balance", ["none", "headtail"])
def test_flex_cp_allgather_on_gloo(balance):
    for got, want, lines in run_on_ranks(_gloo_rank, CP, balance):
        assert "fa4_varlen" in lines[0], lines
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# --- a masked SDPA over all-gathered K/V, written by hand ----------------------------------------


def _head_tail(rank, cp, tokens):
    n = tokens // (2 * cp)
    return torch.cat([torch.arange(rank * n, (rank + 1) * n), torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n)])


def sdpa_cp_by_hand(q, k_all, v_all, doc, rank: int, cp: int):
    """Each rank holds the pack's chunks r and 2cp-1-r (Llama 3's head-tail); K/V gathered in
    rank order; the mask over the places of the local queries and of the gathered keys."""
    places = _head_tail(rank, cp, doc.shape[1])
    keys = torch.cat([_head_tail(r, cp, doc.shape[1]) for r in range(cp)])
    same = doc[:, places][:, :, None] == doc[:, keys][:, None, :]
    mask = same & (keys[None, None, :] <= places[None, :, None])
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask[:, None], enable_gqa=True)


def sdpa_shard_by_offset(q, k_all, v_all, doc):
    """No balancer: rank 1's queries are the pack's second half, ``arange + offset``."""
    places = torch.arange(q.shape[2]) + q.shape[2]
    mask = (doc[0][places][:, None] == doc[0][None, :]) & (torch.arange(k_all.shape[2])[None, :] <= places[:, None])
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask[None, None], enable_gqa=True)


def _compiled_grads(fn, q, k, v, *rest):
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lines = _compiled(lambda *a: fn(*a, *rest), *ins)
    return [out, *torch.autograd.grad(out, ins, out.detach() + 1)], lines


def test_sdpa_cp_mask_by_hand_output_and_gradients():
    """The hand-written forms against their own eager SDPA (output and every gradient) and the
    single-device pack; the report names the positions read."""
    doc = _doc()
    q, k, v = _full_qkv()
    local = T // CP
    cases = [(sdpa_cp_by_hand, _head_tail(1, CP, T), torch.cat([_head_tail(r, CP, T) for r in range(CP)]), (1, CP)),
             (sdpa_shard_by_offset, torch.arange(local, T), torch.arange(T), ())]
    got_lines = []
    for fn, places, keys, rest in cases:
        args = (q[:, :, places], k[:, :, keys], v[:, :, keys], doc)
        got, lines = _compiled_grads(fn, *args, *rest)
        ins = [t.detach().clone().requires_grad_() for t in args[:3]]
        want = fn(*ins, doc, *rest)
        for g, w in zip(got, [want, *torch.autograd.grad(want, ins, want.detach() + 1)]):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got[0], _reference(q, k, v, doc)[:, :, places], atol=2e-5, rtol=2e-5)
        got_lines.append(f"{fn.__name__}: {lines[0].split(': ', 1)[1]}")
    TestCase().assertExpectedInline("\n".join(got_lines), """\
sdpa_cp_by_hand: documents from arg0_1 (checked on device), causal, queries at positions cat[index], keys at positions cat_3[index]: fa4_varlen: queries of a shard over every key: FA4 varlen per document segment, keys in place
sdpa_shard_by_offset: documents from arg0_1 (checked on device), causal, queries at positions index+256: fa4_varlen: queries of a shard over every key: FA4 varlen per document segment, keys in place""")


def _gloo_by_hand(rank, cp):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    doc = _doc()
    q, k, v = _full_qkv()
    places = _head_tail(rank, cp, T)
    local = [t[:, :, places] for t in (q, k, v)]

    def program(q, k, v, doc):
        k_all, v_all = (funcol.all_gather_tensor(t.contiguous(), 2, dist.group.WORLD) for t in (k, v))
        return sdpa_cp_by_hand(q, k_all, v_all, doc, rank, cp)

    got, lines = _compiled(program, *local, doc)
    return got, _reference(q, k, v, doc)[:, :, places], lines


def test_sdpa_cp_mask_by_hand_on_gloo():
    for got, want, lines in run_on_ranks(_gloo_by_hand, CP):
        assert "fa4_varlen" in lines[0], lines
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


# --- one GPU -----------------------------------------------------------------------------------


def _fa4_missing() -> str | None:
    from cp_inductor.lowerings import fa4_attention

    if not torch.cuda.is_available():
        return "needs a GPU"
    return fa4_attention.unavailable(torch.device("cuda"), torch.bfloat16, 128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("balance,rank,form", [(b, r, "ids") for b in ("none", "headtail", "ptrr") for r in (0, 1)]
                         + [("headtail", 1, "starts"), ("ptrr", 0, "ends")])
def test_gpu_flex_cp_training_matches_fp32(balance, rank, form):
    """One rank of torch's flex CP trained on the GPU (bf16): output and every gradient of the
    rewritten call against fp32 dense attention under the shard's mask, within 2x the error of
    default Inductor's compiled flex (the mask written with document ids, or with a table of
    document starts or ends as torchtitan's fast path writes it)."""
    if _fa4_missing():
        pytest.skip(_fa4_missing())
    t, hq, hkv, d = 4096, 8, 2, 128
    lengths = [1000, 77, 2000, 1019]
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None].cuda()
    block_mask, order = cp_document_block_mask(doc, CP, rank, balance, "cuda", form=form)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, t // CP, d, generator=g).cuda()
    k, v = (torch.randn(1, hkv, t, d, generator=g).cuda() for _ in range(2))
    grad = torch.randn(1, hq, t // CP, d, generator=g).cuda()
    query_positions = order[rank * (t // CP):(rank + 1) * (t // CP)][None]

    def run(fn, dtype):
        ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*ins)
        return [out, *torch.autograd.grad(out, ins, grad.to(dtype))]

    want = run(lambda q, k, v: document_attention._shard_dense(q, k, v, doc, query_positions, order[None], d ** -0.5, True),
               torch.float32)
    torch._dynamo.reset()
    flex = run(torch.compile(lambda q, k, v: flex_shard(q, k, v, block_mask)), torch.bfloat16)
    torch._dynamo.reset()
    cp_inductor.clear_report()
    ours = run(torch.compile(lambda q, k, v: flex_shard(q, k, v, block_mask), backend="cp_inductor"), torch.bfloat16)
    assert "fa4_varlen" in str(cp_inductor.report())
    for name, got, ref, base in zip(("out", "dq", "dk", "dv"), ours, want, flex):
        err, err_flex = (float((x.float() - ref).norm() / ref.norm()) for x in (got, base))
        assert err < max(2 * err_flex, 5e-3), (name, err, err_flex)


@pytest.mark.parametrize("window", [1, 100, 1500])  # 0: dq is 0 (one key per query)
def test_gpu_shard_op_window_matches_fp32(window):
    """FA4's window over each segment's keys on the GPU (bf16): rank 1's head-tail shard at cp 2,
    keys gathered rank after rank, a window shorter and longer than some documents; output and
    every gradient against fp32 attention under the window mask written out here, within 2x the
    error of bf16 SDPA under that mask."""
    if _fa4_missing():
        pytest.skip(_fa4_missing())
    from cp_inductor.parallel.batch import plan_places

    t, hq, hkv, d = 4096, 8, 2, 128
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([1000, 77, 2000, 1019]))[None]
    places = plan_places(doc, 2)
    query_positions, key_positions = places[1].cuda(), places.transpose(0, 1).reshape(1, -1).cuda()
    doc = doc.cuda()
    qp, kp = query_positions[0][:, None], key_positions[0][None, :]
    mask = (doc[0, qp] == doc[0, kp]) & (kp <= qp) & (kp >= qp - window)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, t // 2, d, generator=g).cuda()
    k, v = (torch.randn(1, hkv, t, d, generator=g).cuda() for _ in range(2))
    grad = torch.randn(1, hq, t // 2, d, generator=g).cuda()

    def run(fn, dtype):
        ins = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*ins)
        return [out, *torch.autograd.grad(out, ins, grad.to(dtype))]

    def sdpa(q, k, v):
        k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5)

    def ours(q, k, v):
        plan, meta = torch.ops.cp_inductor.document_shard_plan(doc, query_positions, key_positions, True, True, 1, t // 2, t)
        return torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, doc, query_positions, key_positions,
                                                              d ** -0.5, True, window_left=window)[0]

    want, base, got = run(sdpa, torch.float32), run(sdpa, torch.bfloat16), run(ours, torch.bfloat16)
    for name, x, ref, b in zip(("out", "dq", "dk", "dv"), got, want, base):
        err, err_base = (float((y.float() - ref).norm() / ref.norm()) for y in (x, b))
        assert err < max(2 * err_base, 5e-3), (name, err, err_base)
