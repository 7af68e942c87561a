"""Numeric checks of CP attention against a single-device fp64 reference.

Every rank builds the same full-sequence inputs from one seed, takes its shard, runs the CP code,
and gathers outputs and gradients back to the full sequence, which is compared with plain SDPA in
fp64 on the full tensors. Used by the demo, the tests and the GPU benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

from .. import parallel


@dataclass(frozen=True)
class AttentionCase:
    batch: int = 2
    seq: int = 64
    heads_q: int = 8
    heads_kv: int = 8
    head_dim: int = 16
    layout: str = "bshd"
    causal: bool = True
    dtype: torch.dtype = torch.float32
    load_balanced: bool = False  # shard as chunks r and 2cp-1-r (parallel.shard_sequence)

    @property
    def seq_dim(self) -> int:
        return 1 if self.layout == "bshd" else 2

    def shape(self, heads: int) -> tuple:
        if self.layout == "bshd":
            return (self.batch, self.seq, heads, self.head_dim)
        return (self.batch, heads, self.seq, self.head_dim)


def full_inputs(case: AttentionCase, seed: int = 0) -> dict:
    """q, k, v and the output gradient on the full sequence, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(case.shape(h), generator=g, dtype=torch.float64)  # noqa: E731
    return {"q": mk(case.heads_q), "k": mk(case.heads_kv), "v": mk(case.heads_kv), "dout": mk(case.heads_q)}


def reference(case: AttentionCase, full: dict) -> dict:
    """Plain SDPA in fp64 on one device: output and q/k/v gradients, in the case's layout."""
    q, k, v = (full[n].clone().requires_grad_() for n in "qkv")
    to_bhsd = (lambda t: t.transpose(1, 2)) if case.layout == "bshd" else (lambda t: t)
    out = F.scaled_dot_product_attention(
        to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=case.causal,
        enable_gqa=case.heads_q != case.heads_kv,
    )
    out = to_bhsd(out)
    out.backward(full["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_cp(fn, case: AttentionCase, full: dict, rank: int, cp: int, device="cpu", dynamic_seq=False) -> dict:
    """Run ``fn(q, k, v)`` on this rank's shard, backward with the sharded dout, gather all.
    ``dynamic_seq`` marks the sequence dim dynamic for torch.compile."""
    sd = case.seq_dim
    local = {
        n: parallel.shard_sequence(full[n], sd, rank, cp, load_balanced=case.load_balanced).to(
            device=device, dtype=case.dtype
        )
        for n in ("q", "k", "v", "dout")
    }
    q, k, v = (local[n].requires_grad_() for n in "qkv")
    if dynamic_seq:
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, sd)
    out = fn(q, k, v)
    out.backward(local["dout"])
    results = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {
        n: parallel.gather_sequence(t, sd, load_balanced=case.load_balanced).double().cpu()
        for n, t in results.items()
    }


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def errors(got: dict, want: dict) -> dict:
    return {n: rel_error(got[n], want[n]) for n in want}


def ulysses_fn(case: AttentionCase):
    return lambda q, k, v: parallel.ulysses_attention(q, k, v, layout=case.layout, is_causal=case.causal)


def allgather_fn(case: AttentionCase, kernel: str = "auto", head_groups: int | None = None):
    return lambda q, k, v: parallel.allgather_attention(
        q, k, v, layout=case.layout, is_causal=case.causal, load_balanced=case.load_balanced, kernel=kernel,
        head_groups=head_groups,
    )


def check_cp_attention(
    rank: int, cp: int, cases, fn=None, backend: str = "cp_inductor", device="cpu", options: dict | None = None
) -> list:
    """For each case: relative errors of eager and compiled CP attention vs the fp64 reference,
    and compiled vs eager, plus the report rows seen on this rank. ``fn(q, k, v)`` defaults to
    :func:`parallel.ulysses_attention` in the case's layout; ``options`` go to torch.compile
    (``{"cp_inductor.head_overlap": True}``, say)."""
    import cp_inductor

    out = []
    for case in cases:
        attn = fn if fn is not None else ulysses_fn(case)
        full = full_inputs(case)
        want = reference(case, full)
        eager = run_cp(attn, case, full, rank, cp, device)
        torch._dynamo.reset()
        cp_inductor.clear_report()
        counters.clear()
        compiled_fn = torch.compile(attn, backend=backend, fullgraph=True, options=options)
        compiled = run_cp(compiled_fn, case, full, rank, cp, device)
        out.append({
            "case": case,
            "eager_vs_ref": errors(eager, want),
            "compiled_vs_ref": errors(compiled, want),
            "compiled_vs_eager": errors(compiled, eager),
            "report": [(r.graph_kind, r.style, r.cp_size, r.layout) for r in cp_inductor.report().regions],
            "applied": sorted({a for r in cp_inductor.report().regions for a in r.applied}),
            "details": [r.detail for r in cp_inductor.report().regions],
            "rewritten": dict(counters["cp_inductor"]),  # what the post-grad passes actually did
        })
        dist.barrier()
    return out
