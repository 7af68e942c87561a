"""Packed sequences through K/V all-gather CP (``cp_inductor.parallel.thd_allgather``): the plan of
pieces, its work balance, and eager numerics on gloo against the single-device fp64 reference
for the output and every gradient."""

from __future__ import annotations

import random

import pytest
import torch
from expecttest import TestCase

from cp_inductor.parallel import thd_allgather as tag
from cp_inductor.testing.launch import run_on_ranks
from helpers import aot_graphs, describe_matches, fake_pg

TOL = 1e-5  # fp32 against fp64, relative L2


def _random_lengths(tokens: int, docs: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, tokens), docs - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, tokens])]


@pytest.mark.parametrize("balance", tag.BALANCES)
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_token_is_held_once_in_pieces_of_its_document(balance, cp):
    lengths = [1, 1, 3, 2 * cp - 1, 2 * cp + 1, 1000, 7, 1]
    pieces = tag.plan_pack(lengths, cp, balance)
    held = sorted(t for p in pieces for t in range(p.start, p.end))
    assert held == list(range(sum(lengths)))
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for p in pieces:
        assert p.start < p.end and p.doc_start in starts and p.doc_start <= p.start and p.end <= p.doc_end
    shards = [tag.make_shard(lengths, r, cp, balance) for r in range(cp)]
    assert sum(s.local_tokens for s in shards) == sum(lengths)
    for shard in shards:  # at most two rounds, no document twice in one (one FA4 call each)
        assert 1 <= len(shard.rounds) <= 2
        at = 0
        for rnd in shard.rounds:
            docs = rnd.cu_seqlens_k[:-1].tolist()
            assert len(set(docs)) == len(docs) and docs == sorted(docs) and rnd.row_start == at
            at = rnd.row_end
        assert at == shard.local_tokens
    # the gather's rows: every pack position has one, each rank's inside its own padded share
    rows = sorted(shards[0].pack_index.tolist())
    assert len(set(rows)) == sum(lengths) and all(r < cp * shards[0].padded_tokens for r in rows)


class TestBalance(TestCase):
    def test_document_balance_evens_causal_work_where_pack_balance_does_not(self):
        """max / mean of the causal attention work over ranks, 64K-token packs: 8 random
        documents, one long among many short, 4000 documents of 1-40 tokens."""
        rng = random.Random(0)
        packs = {
            "random": _random_lengths(65536, 8, 1),
            "one long": [32768] + [512] * 64,
            "short": [rng.randint(1, 40) for _ in range(4000)],
        }
        lines = []
        for name, lengths in packs.items():
            for cp in (2, 4, 8):
                ratios = []
                for balance in tag.BALANCES:
                    work = tag.attention_work(tag.plan_pack(lengths, cp, balance), cp)
                    ratios.append(max(work) / (sum(work) / cp))
                assert ratios[0] <= 1.02, (name, cp, ratios)
                lines.append(f"{name} cp={cp}: document {ratios[0]:.3f}, pack {ratios[1]:.3f}")
        self.assertExpectedInline("\n".join(lines), """\
random cp=2: document 1.000, pack 1.418
random cp=4: document 1.000, pack 1.870
random cp=8: document 1.000, pack 2.620
one long cp=2: document 1.000, pack 1.492
one long cp=4: document 1.000, pack 1.738
one long cp=8: document 1.000, pack 1.861
short cp=2: document 1.000, pack 1.008
short cp=4: document 1.001, pack 1.011
short cp=8: document 1.002, pack 1.011""")


def _reference(q, k, v, lengths, causal):
    """Every document alone in fp64: out and its gradients for output gradient ``dout``."""
    from cp_inductor.testing import varlen_programs as vp

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return vp.sequence_reference(q, k, v, cu, causal)


def _pack_and_reference(lengths, heads_kv, causal, seed):
    """q, k, v and an output gradient over a pack (Hq 4, D 16), and the fp64 reference's out, dq,
    dk and dv for them."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    full = [torch.randn(total, h, 16, generator=g) for h in (4, heads_kv, heads_kv)]
    dout = torch.randn(total, 4, 16, generator=g)
    ref_in = [t.double().requires_grad_() for t in full]
    ref_out = _reference(*ref_in, lengths, causal)
    return full, dout, (ref_out.detach(), *torch.autograd.grad(ref_out, ref_in, dout.double()))


def _errors(got, want, rows, keep=None) -> dict:
    """Relative L2 error of out, dq, dk, dv (``got``: this rank's, ``keep`` its rows that hold
    tokens) against the reference's pack rows ``rows``."""
    def rel(a, b):
        a = a.detach().double() if keep is None else a[keep].detach().double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    return {name: rel(a, b[rows]) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def _check(rank, cp, lengths, heads_kv, causal, balance, kernel, head_groups=None):
    from cp_inductor.lowerings import varlen_attention

    (q_full, k_full, v_full), dout_full, want = _pack_and_reference(lengths, heads_kv, causal, seed=0)
    q, shard = tag.shard_pack(q_full, lengths, rank, cp, balance)
    k, v = (t.index_select(0, shard.local_index) for t in (k_full, v_full))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    with varlen_attention.reference_kernels():  # kernel="fa4": FA4's op on its CPU reference
        out = tag.thd_allgather_attention(*ins, shard, is_causal=causal, kernel=kernel, head_groups=head_groups)
    grads = torch.autograd.grad(out, ins, dout_full.index_select(0, shard.local_index))
    whole = tag.unshard_pack(out.detach(), shard)
    errors = _errors((out, *grads), want, shard.local_index)
    errors["out_unsharded"] = _errors((whole,), want, slice(None))["out"]
    return errors


# 1-token documents, documents shorter than 2cp, one document over every rank, T not a multiple of 2cp
LENGTHS = [1, 3, 1, 61, 2, 1, 9, 5]


def _check_each(rank, cp, cases):
    """:func:`_check` of each ``(lengths, heads_kv, causal, balance, kernel[, head_groups])`` in
    one launch (a launch costs more than these eager calls)."""
    return [_check(rank, cp, *case) for case in cases]


def _assert_cases(cp, cases) -> None:
    for rank_errors in run_on_ranks(_check_each, cp, cases):
        for case, errors in zip(cases, rank_errors):
            assert max(errors.values()) < TOL, (case, errors)


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.wide)])
@pytest.mark.parametrize("balance", tag.BALANCES)
@pytest.mark.parametrize("causal", [True, False])
def test_numerics_gloo(cp, balance, causal):
    _assert_cases(cp, [(LENGTHS, heads_kv, causal, balance, kernel)
                       for kernel, heads_kv in (("sdpa", 2), ("sdpa", 4), ("fa4", 2))])


def test_numerics_gloo_head_groups():
    """Two head groups, each with its own gather and calls: the answer of one."""
    _assert_cases(2, [(LENGTHS, 2, True, "document", "fa4", 2)])


def test_numerics_gloo_cp4_both_balances_causal_gqa():
    """cp = 4 in CI once: the pieces of a 61-token document spread over 8 chunks."""
    _assert_cases(4, [(LENGTHS, 2, True, balance, "sdpa") for balance in tag.BALANCES])


def _compiled_matches_eager(rank, cp):
    g = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    q_full = torch.randn(total, 4, 16, generator=g)
    k_full, v_full = (torch.randn(total, 2, 16, generator=g) for _ in range(2))
    q, shard = tag.shard_pack(q_full, LENGTHS, rank, cp)
    k, v = (t.index_select(0, shard.local_index) for t in (k_full, v_full))

    def attention(a, b, c):
        return tag.thd_allgather_attention(a, b, c, shard, is_causal=True)

    results = []
    for fn in (attention, torch.compile(attention, backend="cp_inductor", fullgraph=True)):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        results.append([out.detach(), *torch.autograd.grad(out.sum(), ins)])
    torch._dynamo.reset()
    return [float((a - b).abs().max()) for a, b in zip(*results)]


def test_compiles_in_one_graph_with_the_answer_of_eager():
    """fullgraph under cp_inductor (the helper is plain PyTorch: one gather, an index_select,
    attention per piece): the output and every gradient as eager's."""
    for diffs in run_on_ranks(_compiled_matches_eager, 2):
        assert max(diffs) < 1e-5, diffs


# The hand-written form pads the pack to a multiple of 2*cp: a last document of 13 (96 tokens)
HAND_LENGTHS = [*LENGTHS, 13]


def _check_handwritten(rank, cp, heads_kv, causal, gather, keys="slice", attention="varlen_attn", on_reference_op=True):
    """``allgather_thd`` (Llama 3-style, by hand) compiled with cp_inductor on gloo, against the
    fp64 reference for the output and every gradient; the varlen calls lowered onto our op's
    CPU reference (``on_reference_op``) or kept on torch's varlen op (the tests' CPU kernels)."""
    import contextlib

    import cp_inductor
    from cp_inductor.testing import varlen_programs as vp
    from cp_inductor.lowerings import varlen_attention

    vp.register_cpu_kernels()
    if attention == "flash_attn":
        vp.flash_attn_like()  # its ops, registered before compiling
    (q_full, k_full, v_full), dout_full, want = _pack_and_reference(HAND_LENGTHS, heads_kv, causal, seed=2)
    chunk = sum(HAND_LENGTHS) // (2 * cp)
    rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])
    plan = vp.chunk_plan(HAND_LENGTHS, rank, cp, causal)
    torch._dynamo.reset()
    cp_inductor.clear_report()
    compiled = torch.compile(lambda a, b, c: vp.allgather_thd(a, b, c, plan, causal, gather=gather, keys=keys,
                                                              attention=attention),
                             backend="cp_inductor", fullgraph=True)
    ins = [t.index_select(0, rows).clone().requires_grad_() for t in (q_full, k_full, v_full)]
    with varlen_attention.reference_kernels() if on_reference_op else contextlib.nullcontext():
        out = compiled(*ins)
        grads = torch.autograd.grad(out, ins, dout_full.index_select(0, rows))
    report = cp_inductor.report()
    torch._dynamo.reset()
    errors = _errors((out, *grads), want, rows)
    regions = sorted({(r.graph_kind, r.style, r.layout) for r in report.regions})
    return errors, regions, [r.line() for r in report.varlen]


@pytest.mark.parametrize("cp,heads_kv,causal,gather,keys,attention", [
    (2, 2, True, "funcol_dim0", "slice", "varlen_attn"),
    (2, 4, False, "inplace", "slice", "varlen_attn"),
    (2, 2, True, "funcol_dim0", "index_select", "flash_attn"),  # K/V copied per chunk; flash-attn's Function
    pytest.param(4, 2, True, "list", "slice", "varlen_attn", marks=pytest.mark.wide),
])
def test_handwritten_form_compiled_on_gloo(cp, heads_kv, causal, gather, keys, attention):
    """Llama 3's form by hand, compiled with cp_inductor: every call found as a K/V all-gather
    region (forward and backward), lowered off the program's op, and the answer of the fp64
    reference."""
    for errors, regions, lines in run_on_ranks(_check_handwritten, cp, heads_kv, causal, gather, keys, attention):
        assert max(errors.values()) < TOL, errors
        assert regions == [("backward", "allgather", "thd"), ("forward", "allgather", "thd")], regions
        assert len(lines) == 2 and all(": allgather," in line for line in lines), lines


def _golden(cp: int, form: str, heads_kv: int = 2, balance: str = "document", **variant) -> str:
    """What detection finds in rank 0's graphs (fake group, 96-token pack, Hq 4), each region's
    accumulator note once per graph kind."""
    from cp_inductor.testing import varlen_programs as vp
    from cp_inductor.lowerings import varlen_attention
    from cp_inductor.passes import engine

    vp.register_cpu_kernels()
    q, k, v, _, _ = vp.pack(HAND_LENGTHS, 4, heads_kv, 16)
    with fake_pg(cp):
        if form == "helper":
            _, shard = tag.shard_pack(q, HAND_LENGTHS, 0, cp, balance)
            local = [t.index_select(0, shard.local_index).requires_grad_() for t in (q, k, v)]
            with varlen_attention.reference_kernels():  # FA4's op, as on GPUs
                graphs = aot_graphs(lambda a, b, c: tag.thd_allgather_attention(a, b, c, shard), *local)
        else:
            plan, chunk = vp.chunk_plan(HAND_LENGTHS, 0, cp), q.shape[0] // (2 * cp)
            local = [torch.cat([t[:chunk], t[-chunk:]]).requires_grad_() for t in (q, k, v)]
            graphs = aot_graphs(lambda a, b, c: vp.allgather_thd(a, b, c, plan, **variant), *local)
        notes = {n for kind, gm in graphs.items() for r in engine.analyze(gm.graph, kind) for n in r.notes}
        return "\n".join([describe_matches(graphs), *sorted(notes)])


class TestDetection(TestCase):
    """The helper (FA4 rounds reading the gathered K/V in place) and Llama 3's hand-written form
    (a varlen_attn per chunk over a slice of the gathered K/V) are K/V all-gather regions, forward
    and backward, at cp = 2, 4, 8."""

    def test_helper_cp2(self):
        self.assertExpectedInline(_golden(2, "helper"), """\
forward: allgather cp=2 thd fa4_varlen_attention Hq=4 Hkv=2 causal
forward: allgather cp=2 thd fa4_varlen_attention Hq=4 Hkv=2 causal
backward: allgather cp=2 thd fa4_varlen_attention_backward Hq=4 Hkv=2 causal
backward: allgather cp=2 thd fa4_varlen_attention_backward Hq=4 Hkv=2 causal
dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the kernel that writes the reduce-scatter input (no fill, no add-into-zero); this call reads keys in place (seqused_k): its dK/dV span the gathered K/V and the op zero-fills the rows it does not read""")

    def test_helper_cp4_mha_pack_balance(self):
        self.assertExpectedInline(_golden(4, "helper", heads_kv=4, balance="pack"), """\
forward: allgather cp=4 thd fa4_varlen_attention Hq=4 Hkv=4 causal
backward: allgather cp=4 thd fa4_varlen_attention_backward Hq=4 Hkv=4 causal
dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the kernel that writes the reduce-scatter input (no fill, no add-into-zero); this call reads keys in place (seqused_k): its dK/dV span the gathered K/V and the op zero-fills the rows it does not read""")

    def test_helper_cp8_a_rank_of_short_pieces(self):
        self.assertExpectedInline(_golden(8, "helper"), """\
forward: allgather cp=8 thd fa4_varlen_attention Hq=4 Hkv=2 causal
forward: allgather cp=8 thd fa4_varlen_attention Hq=4 Hkv=2 causal
backward: allgather cp=8 thd fa4_varlen_attention_backward Hq=4 Hkv=2 causal
backward: allgather cp=8 thd fa4_varlen_attention_backward Hq=4 Hkv=2 causal
dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the kernel that writes the reduce-scatter input (no fill, no add-into-zero); this call reads keys in place (seqused_k): its dK/dV span the gathered K/V and the op zero-fills the rows it does not read""")

    def test_handwritten_cp2_gqa_heads_repeated(self):
        self.assertExpectedInline(_golden(2, "handwritten"), """\
forward: allgather cp=2 thd _varlen_attn Hq=4 Hkv=4 causal
forward: allgather cp=2 thd _varlen_attn Hq=4 Hkv=4 causal
backward: allgather cp=2 thd _varlen_attn_backward Hq=4 Hkv=4 causal
backward: allgather cp=2 thd _varlen_attn_backward Hq=4 Hkv=4 causal
dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the kernel that writes the reduce-scatter input (no fill, no add-into-zero)""")

    def test_handwritten_cp4_mha(self):
        self.assertExpectedInline(_golden(4, "handwritten", heads_kv=4), """\
forward: allgather cp=4 thd _varlen_attn Hq=4 Hkv=4 causal
forward: allgather cp=4 thd _varlen_attn Hq=4 Hkv=4 causal
backward: allgather cp=4 thd _varlen_attn_backward Hq=4 Hkv=4 causal
backward: allgather cp=4 thd _varlen_attn_backward Hq=4 Hkv=4 causal
dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the kernel that writes the reduce-scatter input (no fill, no add-into-zero)""")

    def test_handwritten_keys_by_index_select_gathered_in_place(self):
        """Each chunk's K/V copied out by index_select; K/V gathered in place inside an
        autograd.Function (Megatron's form)."""
        self.assertExpectedInline(_golden(2, "handwritten", keys="index_select", gather="inplace"), """\
forward: allgather cp=2 thd _varlen_attn Hq=4 Hkv=4 causal
forward: allgather cp=2 thd _varlen_attn Hq=4 Hkv=4 causal
backward: allgather cp=2 thd _varlen_attn_backward Hq=4 Hkv=4 causal
backward: allgather cp=2 thd _varlen_attn_backward Hq=4 Hkv=4 causal
dK/dV accumulators: a partial one is materialized before aten.index_put.default: its zero fill and add stay""")

    def test_handwritten_cp8(self):
        self.assertExpectedInline(_golden(8, "handwritten"), """\
forward: allgather cp=8 thd _varlen_attn Hq=4 Hkv=4 causal
forward: allgather cp=8 thd _varlen_attn Hq=4 Hkv=4 causal
backward: allgather cp=8 thd _varlen_attn_backward Hq=4 Hkv=4 causal
backward: allgather cp=8 thd _varlen_attn_backward Hq=4 Hkv=4 causal
dK/dV accumulators: Inductor inlines the zero fill and reads each contribution once in the kernel that writes the reduce-scatter input (no fill, no add-into-zero)""")

    def test_handwritten_cp2_calls_read_the_gathered_slices(self):
        """Each chunk's call moves to our op on the slice of the gathered K/V (a view: no copy),
        the K/V repeat dropped; a chunk whose keys outnumber its queries is a prefix call, which
        the self-attention cost map does not cover (FA4 unless measured otherwise)."""
        from cp_inductor.testing import varlen_programs as vp
        from test_varlen_cudnn import calls, rewritten

        q, k, v, _, _ = vp.pack(HAND_LENGTHS, 4, 2, 16)
        plan, chunk = vp.chunk_plan(HAND_LENGTHS, 0, 2), q.shape[0] // 4
        local = [torch.cat([t[:chunk], t[-chunk:]]) for t in (q, k, v)]
        with fake_pg(2):
            gm, routes = rewritten(lambda a, b, c: vp.allgather_thd(a, b, c, plan), *local)
        attention = [line for line in calls(gm).splitlines() if "attention" in line]
        self.assertExpectedInline("\n".join(attention), """\
fa4_varlen_attention.default(qc, kc, vc, cu_q, cu_k, None, 19, 19, 0.25, True)
fa4_varlen_attention.default(qc_1, kc_2, vc_2, cu_q_1, cu_k_1, None, 13, 13, 0.25, True)""")
        self.assertExpectedInline("\n".join(r.line() for r in routes), """\
varlen attention _varlen_attn: allgather, thd, lengths unknown, causal, K/V head repeat dropped: fa4_varlen: no cost map for cpu: no measurement of thd_cross T24 Hq4 Hkv2 D16 causal float32
varlen attention _varlen_attn_1: allgather, thd, lengths unknown, causal, K/V head repeat dropped: fa4_varlen: no cost map for cpu: no measurement of thd_cross T24 Hq4 Hkv2 D16 causal float32""")

    def test_handwritten_on_aten_flash_op_is_lowered_too(self):
        """The same chunks through aten's flash forward (its varlen form, GQA as is): each call
        moves to our op on the slice, named an all-gather call."""
        from cp_inductor.testing import varlen_programs as vp
        from test_varlen_cudnn import rewritten_while_compiling

        q, k, v, _, _ = vp.pack(HAND_LENGTHS, 4, 2, 16)
        plan, chunk = vp.chunk_plan(HAND_LENGTHS, 0, 2), q.shape[0] // 4
        local = [torch.cat([t[:chunk], t[-chunk:]]) for t in (q, k, v)]
        with fake_pg(2):  # aten's op has no CPU kernel: the program runs only as rewritten
            _, routes, _ = rewritten_while_compiling(
                lambda a, b, c: vp.allgather_thd(a, b, c, plan, attention="aten_flash"), *local)
        self.assertExpectedInline("\n".join(r.line() for r in routes), """\
varlen attention _flash_attention_forward: allgather, thd, lengths unknown, causal: fa4_varlen: no cost map for cpu: no measurement of thd_cross T24 Hq4 Hkv2 D16 causal float32
varlen attention _flash_attention_forward_1: allgather, thd, lengths unknown, causal: fa4_varlen: no cost map for cpu: no measurement of thd_cross T24 Hq4 Hkv2 D16 causal float32""")

    def test_dense_only_rewrites_step_aside_with_their_reason(self):
        """Every switch on, strict (an internal error would raise): the all-gather rewrites built
        for dense attention say why they leave a packed region alone."""
        from cp_inductor.testing import varlen_programs as vp
        from cp_inductor.config_snapshot import snapshot
        from cp_inductor.passes import engine

        vp.register_cpu_kernels()
        q, k, v, _, _ = vp.pack(HAND_LENGTHS, 4, 2, 16)
        plan, chunk = vp.chunk_plan(HAND_LENGTHS, 0, 2), q.shape[0] // 4
        local = [torch.cat([t[:chunk], t[-chunk:]]).requires_grad_() for t in (q, k, v)]
        cfg = snapshot({"head_split": True, "gather_overlap": True, "owner_grad_return": True, "strict": True})
        with fake_pg(2):
            graphs = aot_graphs(lambda a, b, c: vp.allgather_thd(a, b, c, plan), *local)
            skipped = {(kind, name, why) for kind, gm in graphs.items()
                       for r in engine.analyze(gm.graph, kind, cfg=cfg) for name, why in r.skipped.items()}
        self.assertExpectedInline("\n".join(f"{k} {n}: {w}" for k, n, w in sorted(skipped)), """\
backward gather_overlap: packed (THD) region: this rewrite works on dense [B, S, H, D] attention
backward head_split: packed (THD) region: this rewrite works on dense [B, S, H, D] attention
backward owner_grad_return: packed (THD) region: this rewrite works on dense [B, S, H, D] attention
forward gather_overlap: packed (THD) region: this rewrite works on dense [B, S, H, D] attention
forward head_split: packed (THD) region: this rewrite works on dense [B, S, H, D] attention
forward owner_grad_return: packed (THD) region: this rewrite works on dense [B, S, H, D] attention""")


def _static_steps(rank, cp, packs, capacity, max_docs, device="cpu", dtype=torch.float32, mode=None,
                  balance="document"):
    """Static shards (``capacity``, ``max_docs``): packs of new lengths each step through one
    compiled helper (on CPU: FA4's op on its CPU reference; on CUDA: FA4 where it runs); per step
    the errors against fp64 (and, on CUDA, eager's), then the number of graphs compiled and the
    report's (graph, layout) pairs."""
    import contextlib

    from torch._dynamo.utils import counters

    import cp_inductor
    from cp_inductor.lowerings import varlen_attention

    torch._dynamo.reset()
    counters.clear()
    cp_inductor.clear_report()
    kernel = "fa4" if device == "cpu" else "auto"

    def attention(a, b, c, shard):
        return tag.thd_allgather_attention(a, b, c, shard, kernel=kernel)

    compiled = torch.compile(attention, backend="cp_inductor", fullgraph=True, mode=mode)
    def on_cpu():  # FA4's op on its CPU reference
        return varlen_attention.reference_kernels() if device == "cpu" else contextlib.nullcontext()

    errors = []
    for step, lengths in enumerate(packs):
        full, dout, want = _pack_and_reference(lengths, 2, True, seed=step)
        shard = tag.make_shard(lengths, rank, cp, balance, device=device, capacity=capacity, max_docs=max_docs)
        rows, valid = shard.local_index.cpu(), shard.valid.cpu()
        local_dout = torch.where(valid.view(-1, 1, 1), dout.index_select(0, rows), 0).to(device, dtype)
        step_errors = {}
        for name, fn in (("compiled", compiled), ("eager", attention)) if device != "cpu" else (("compiled", compiled),):
            ins = [t.index_select(0, rows).to(device, dtype).requires_grad_() for t in full]
            with on_cpu():
                out = fn(*ins, shard)
                grads = torch.autograd.grad(out, ins, local_dout)
            got = [t.cpu() for t in (out, *grads)]
            prefix = "" if name == "compiled" else "eager_"
            step_errors.update({prefix + k: v for k, v in _errors(got, want, rows[valid], keep=valid).items()})
            if name == "compiled":
                step_errors["padding"] = float(got[0][~valid].abs().max()) if (~valid).any() else 0.0
        errors.append(step_errors)
    graphs = counters["stats"]["unique_graphs"]
    layouts = sorted({(r.graph_kind, r.layout) for r in cp_inductor.report().regions})
    torch._dynamo.reset()
    return errors, graphs, layouts


def test_static_shards_new_lengths_every_step_one_graph():
    """What CUDA graphs need (``mode="reduce-overhead"``): every rank's rows, the calls' sequence
    counts and bounds fixed by ``capacity`` and ``max_docs``, so packs of new lengths (1-token
    documents, one over every rank, fewer documents than max_docs) reuse one compiled graph; the
    output (padding rows zero) and every gradient match fp64 at each step."""
    packs = [HAND_LENGTHS, [40, 1, 1, 30, 24], [96], [3] * 32]
    for errors, graphs, layouts in run_on_ranks(_static_steps, 2, packs, 60, 32):
        assert graphs == 1, graphs
        for step in errors:
            assert max(step.values()) < TOL, errors
        assert ("forward", "thd") in layouts and ("backward", "thd") in layouts, layouts
