"""Golden detection of K/V all-gather CP regions (fake process group, no codegen): our helper at
cp = 2, 4, 8, hand-written variants, and all-gathers that are not CP attention."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from expecttest import TestCase

from cp_inductor.parallel import allgather_attention
from helpers import aot_graphs, describe_matches, fake_pg


def _qkv(b, s_l, hq, hkv, d):
    mk = lambda h: torch.randn(b, s_l, h, d, requires_grad=True)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _gather(x):
    """[B, S/cp, H, D] -> every rank's [B, S, H, D] (gathered on dim 0, then put in sequence order)."""
    cp = dist.get_world_size()
    b, s_l, h, d = x.shape
    g = funcol.all_gather_tensor_autograd(x.contiguous(), 0, dist.group.WORLD).view(cp, b, s_l, h, d)
    return g.permute(1, 0, 2, 3, 4).reshape(b, cp * s_l, h, d)


def vision_style(q, k, v):
    """DiT / vision style: local queries over every rank's keys, not causal."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), _gather(k).transpose(1, 2), _gather(v).transpose(1, 2))
    return out.transpose(1, 2)


def llama3_style_masked(q, k, v):
    """Load-balanced causal as Llama3-style code writes it by hand: gather K/V, put the chunks in
    sequence order with index_select, and give each local chunk its bottom-right causal mask."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    b, s_l, h, d = k.shape
    chunk = s_l // 2
    order = torch.tensor([r * 2 + half for c in range(2 * cp) for r in range(cp) for half in (0, 1)
                          if (c == r and half == 0) or (c == 2 * cp - 1 - r and half == 1)])
    kv = [funcol.all_gather_tensor_autograd(t.contiguous(), 0, dist.group.WORLD).view(cp, b, 2, chunk, h, d)
          for t in (k, v)]
    k_all, v_all = (t.permute(0, 2, 1, 3, 4, 5).reshape(cp * 2, b, chunk, h, d).index_select(0, order)
                    .permute(1, 0, 2, 3, 4).reshape(b, 2 * cp * chunk, h, d).transpose(1, 2) for t in kv)
    outs = []
    for i, c in enumerate((rank, 2 * cp - 1 - rank)):
        end = (c + 1) * chunk
        mask = torch.ones(chunk, end, dtype=torch.bool).tril(end - chunk)
        qc = q[:, i * chunk:(i + 1) * chunk].transpose(1, 2)
        outs.append(F.scaled_dot_product_attention(qc, k_all[:, :, :end], v_all[:, :, :end], attn_mask=mask))
    return torch.cat(outs, dim=2).transpose(1, 2)


def head_stride_loop(q, k, v):
    """K/V heads gathered a few at a time (to bound the gathered buffer), then concatenated."""
    parts = [(_gather(k[:, :, h:h + 1]), _gather(v[:, :, h:h + 1])) for h in range(k.shape[2])]
    k_all, v_all = (torch.cat(x, dim=2) for x in zip(*parts))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2)).transpose(1, 2)


def gathered_weight(x, w_shard):
    """FSDP-style weight all-gather feeding the k/v projection: not CP attention."""
    w = funcol.all_gather_tensor_autograd(w_shard, 0, dist.group.WORLD)
    b, s, e = x.shape
    qkv = (x @ w.t()).view(b, s, 3, 2, e // 2)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def gathered_query_too(q, k, v):
    """Every rank attends over the whole sequence: a gather of q as well is not CP."""
    out = F.scaled_dot_product_attention(_gather(q).transpose(1, 2), _gather(k).transpose(1, 2), _gather(v).transpose(1, 2))
    return out.transpose(1, 2)


def gathered_key_only(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), _gather(k).transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def dtensor_ulysses(q, k, v):
    """Ulysses written with DTensor redistributes (Shard(seq) -> Shard(heads) and back), which
    trace to all-gathers and a constant slice of this rank's heads. ``MESH``: set by the test."""
    from torch.distributed.tensor import DTensor, Shard

    def scatter(x):  # [B, S/cp, H, D] -> [B, H/cp, S, D]
        return DTensor.from_local(x, MESH[0], [Shard(1)], run_check=False).redistribute(MESH[0], [Shard(2)]).to_local().transpose(1, 2)

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), is_causal=True).transpose(1, 2)
    return DTensor.from_local(o, MESH[0], [Shard(2)], run_check=False).redistribute(MESH[0], [Shard(1)]).to_local()


MESH = [None]


class TestAllGatherGolden(TestCase):
    def test_dtensor_ulysses_reported(self):
        from torch.distributed.device_mesh import init_device_mesh

        with fake_pg(2):
            MESH[0] = init_device_mesh("cpu", (2,))
            text = describe_matches(aot_graphs(dtensor_ulysses, *_qkv(1, 8, 4, 4, 8)))
        self.assertExpectedInline(text, """\
forward: not a region: _scaled_dot_product_flash_attention_for_cpu: q, k, v gathered whole, then this rank's block of heads taken: Ulysses done with all-gathers (as DTensor's Shard(seq) -> Shard(heads) redistribute traces); not rewritten: an all_to_all would move 1/cp of the bytes, but which block a rank takes is a constant of its own graph, and every rank must make the same choice
backward: not a region: _scaled_dot_product_flash_attention_for_cpu_backward: no all_to_all or all_gather feeds q, k or v (attention on local data)""")

    def test_helper_causal_load_balanced_gqa(self):
        # Each rank's two chunks: chunk r (prefix + diagonal calls, or one causal call for chunk 0)
        # and chunk 2cp-1-r. Rank 0 of cp=2 holds chunks 0 and 3: 1 + 2 calls, and their backwards;
        # chunk 3's diagonal call reads local K/V (not a region). GQA reaches attention as is.
        with fake_pg(2):
            graphs = aot_graphs(lambda q, k, v: allgather_attention(q, k, v, is_causal=True), *_qkv(1, 8, 4, 2, 8))
            text = describe_matches(graphs)
        self.assertExpectedInline(text, """\
forward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=2 causal
forward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=4 Hkv=2
forward: not a region: _scaled_dot_product_flash_attention_for_cpu: no all_to_all or all_gather feeds q, k or v (attention on local data)
backward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=2
backward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=4 Hkv=2 causal
backward: not a region: _scaled_dot_product_flash_attention_for_cpu_backward: no all_to_all or all_gather feeds q, k or v (attention on local data)""")

    def test_helper_cp4_and_cp8_rank0(self):
        lines = []
        for cp in (4, 8):
            with fake_pg(cp):
                graphs = aot_graphs(
                    lambda q, k, v: allgather_attention(q, k, v, layout="bhsd", is_causal=True),
                    *(t.transpose(1, 2).detach().requires_grad_() for t in _qkv(1, 4, 2, 2, 8)),
                )
                lines.append(describe_matches(graphs))
        self.assertExpectedInline("\n".join(lines), """\
forward: allgather cp=4 bhsd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 causal
forward: allgather cp=4 bhsd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2
forward: not a region: _scaled_dot_product_flash_attention_for_cpu: no all_to_all or all_gather feeds q, k or v (attention on local data)
backward: allgather cp=4 bhsd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2
backward: allgather cp=4 bhsd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2 causal
backward: not a region: _scaled_dot_product_flash_attention_for_cpu_backward: no all_to_all or all_gather feeds q, k or v (attention on local data)
forward: allgather cp=8 bhsd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2 causal
forward: allgather cp=8 bhsd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2
forward: not a region: _scaled_dot_product_flash_attention_for_cpu: no all_to_all or all_gather feeds q, k or v (attention on local data)
backward: allgather cp=8 bhsd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2
backward: allgather cp=8 bhsd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2 causal
backward: not a region: _scaled_dot_product_flash_attention_for_cpu_backward: no all_to_all or all_gather feeds q, k or v (attention on local data)""")

    def test_vision_style_not_causal(self):
        with fake_pg(2):
            text = describe_matches(aot_graphs(vision_style, *_qkv(1, 4, 2, 2, 8)))
        self.assertExpectedInline(text, """\
forward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2
backward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2""")

    def test_hand_written_masked_chunks_and_head_stride_loop(self):
        with fake_pg(2):
            lines = [describe_matches(aot_graphs(llama3_style_masked, *_qkv(1, 4, 2, 2, 8)))]
            lines.append(describe_matches(aot_graphs(head_stride_loop, *_qkv(1, 4, 2, 2, 8))))
        self.assertExpectedInline("\n".join(lines), """\
forward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2
forward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2
backward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2
backward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2
forward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu Hq=2 Hkv=2
backward: allgather cp=2 bshd _scaled_dot_product_flash_attention_for_cpu_backward Hq=2 Hkv=2""")

    def test_not_cp_attention(self):
        with fake_pg(2):
            x = torch.randn(1, 4, 8, requires_grad=True)
            w = torch.randn(12, 8, requires_grad=True)
            lines = [describe_matches(aot_graphs(gathered_weight, x, w))]
            lines.append(describe_matches(aot_graphs(gathered_query_too, *_qkv(1, 4, 2, 2, 8))))
            lines.append(describe_matches(aot_graphs(gathered_key_only, *_qkv(1, 4, 2, 2, 8))))
        self.assertExpectedInline("\n".join(lines), """\
forward: not a region: _scaled_dot_product_flash_attention_for_cpu: no all_to_all or all_gather feeds q, k or v (attention on local data)
backward: not a region: _scaled_dot_product_flash_attention_for_cpu_backward: no all_to_all or all_gather feeds q, k or v (attention on local data)
forward: not a region: _scaled_dot_product_flash_attention_for_cpu: query is gathered too: every rank attends over the whole sequence
backward: not a region: _scaled_dot_product_flash_attention_for_cpu_backward: dQ is reduce-scattered too
forward: not a region: _scaled_dot_product_flash_attention_for_cpu: only one of key and value comes from an all_gather
backward: not a region: _scaled_dot_product_flash_attention_for_cpu_backward: only one of dK and dV reaches a reduce_scatter""")


def _group_name():
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_process_group_name(dist.group.WORLD)


def flex_cp(q, k, v):
    """What PyTorch's flex-attention CP traces to: one custom op gathers K and V (waiting inside)."""
    from torch.distributed.tensor.experimental._context_parallel import flex_cp_allgather
    from torch.nn.attention.flex_attention import flex_attention

    k_full, v_full = flex_cp_allgather(k, v, 2, _group_name())
    return flex_attention(q, k_full, v_full)


class TestFlexCP(TestCase):
    """PyTorch's flex CP ops are opaque (collectives and waits inside one custom op each): the
    attention they feed is reported with that reason, never rewritten. FlexAttention has no CPU
    backward, so the backward side is checked on the op's own backward graph shape."""

    def test_forward_reported(self):
        with fake_pg(2):
            text = describe_matches(aot_graphs(flex_cp, *(torch.randn(1, 2, 16, 8) for _ in range(3))))
        self.assertExpectedInline(text, """inference: not a region: flex_attention: the K/V all-gather (or its backward) is PyTorch's flex CP op cplib::flex_cp_allgather: its collectives run and wait inside one opaque custom op, so Inductor can neither overlap, fuse nor re-route them: reported, not rewritten""")

    def test_backward_reported(self):
        from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather_backward
        from torch.fx.experimental.proxy_tensor import make_fx

        from cp_inductor.passes import engine

        def backward(dout, q, k_full, v_full, out, lse):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k_full, v_full, out, lse, 0.0, False)
            return (dq, *flex_cp_allgather_backward(dk, dv, 2, _group_name()))

        with fake_pg(2):
            t = [torch.randn(1, 2, n, 8) for n in (8, 8, 16, 16, 8)]
            gm = make_fx(backward)(*t, torch.randn(1, 2, 8))
            rejected = []
            engine.analyze(gm.graph, "backward", rejected)
        self.assertExpectedInline("\n".join(f"{r.attention}: {r.reason}" for r in rejected), """_scaled_dot_product_flash_attention_for_cpu_backward: the K/V all-gather (or its backward) is PyTorch's flex CP op cplib::flex_cp_allgather_backward: its collectives run and wait inside one opaque custom op, so Inductor can neither overlap, fuse nor re-route them: reported, not rewritten""")
