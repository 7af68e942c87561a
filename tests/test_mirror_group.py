"""The mirrored process group (``cp_inductor.testing.mirror_group``): one process plays every
rank of a world whose ranks hold the same data, so one rank's compiled compute has an eager
reference (the GPU tier uses it for fused_a2a's views on cuDNN)."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import cp_inductor
from cp_inductor.parallel import ulysses_attention
from cp_inductor.testing.mirror_group import mirrored_world


def test_collectives_give_what_every_rank_sent():
    with mirrored_world(4, rank=1):
        x, group = torch.arange(8.0), dist.group.WORLD
        # every rank sent its chunk 1 (= ours) to rank 1
        assert funcol.all_to_all_single(x, None, None, group).tolist() == [2.0, 3.0] * 4
        assert funcol.all_gather_tensor(x[:2], 0, group).tolist() == [0.0, 1.0] * 4
        assert funcol.reduce_scatter_tensor(x, "sum", 0, group).tolist() == [8.0, 12.0]
    with mirrored_world(2):  # the kernels are given back at exit and taken again
        assert funcol.all_gather_tensor(torch.arange(2.0), 0, dist.group.WORLD).tolist() == [0.0, 1.0] * 2


def _grads(backend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 32, 4, 16, requires_grad=True) for _ in range(3))
    fn = lambda q, k, v: ulysses_attention(q, k, v, is_causal=True)  # noqa: E731
    if backend != "eager":
        fn = torch.compile(fn, backend=backend, fullgraph=True)
    out = fn(q, k, v)
    out.pow(2).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def test_compiled_ulysses_matches_eager_on_the_mirrored_world():
    with mirrored_world(2):
        want = _grads("eager")
        cp_inductor.clear_report()
        got = _grads("cp_inductor")
        assert [(r.graph_kind, r.applied) for r in cp_inductor.report().regions] == [
            ("forward", ["fused_a2a"]), ("backward", ["fused_a2a"])]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
