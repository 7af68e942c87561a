"""The main job: a CP attention block, forward and backward, through ``backend="cp_inductor"``.

    python -m cp_inductor.demo                     # CPU, gloo, 2 processes
    python -m cp_inductor.demo --cp 4
    torchrun --nproc-per-node 2 -m cp_inductor.demo --device cuda

Each rank holds a slice of the sequence; the block (QKV projection, Ulysses attention, output
projection) runs compiled, then the report and the largest relative error of the output and of
every gradient against a single-device fp64 reference are printed.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import parallel


class AttentionBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, causal: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.causal = causal
        self.wqkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * self.head_dim, dim, bias=False)

    def split_qkv(self, x):
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        return qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)

    def forward(self, x):  # x: [B, S/cp, dim], this rank's sequence slice
        q, k, v = self.split_qkv(x)
        o = parallel.ulysses_attention(q, k, v, is_causal=self.causal)
        return self.wo(o.flatten(2))

    def reference(self, x):  # x: [B, S, dim], the whole sequence on one device
        q, k, v = (t.transpose(1, 2) for t in self.split_qkv(x))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        return self.wo(o.transpose(1, 2).flatten(2))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(rank: int, cp: int, args: argparse.Namespace) -> dict:
    import cp_inductor

    device = torch.device(args.device, rank % max(torch.cuda.device_count(), 1)) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    block = AttentionBlock(args.dim, args.heads, args.kv_heads)
    x_full = torch.randn(args.batch, args.seq, args.dim, dtype=torch.float64)
    dy_full = torch.randn(args.batch, args.seq, args.dim, dtype=torch.float64)

    ref_block = block.to(torch.float64)
    x_ref = x_full.clone().requires_grad_()
    ref_block.reference(x_ref).backward(dy_full)
    want = {"out": ref_block.reference(x_full).detach(), "dx": x_ref.grad}
    want.update({f"d{n}": p.grad.clone() for n, p in ref_block.named_parameters()})
    ref_block.zero_grad()

    cp_block = block.to(device=device, dtype=dtype)
    x = parallel.shard_sequence(x_full, 1, rank, cp).to(device, dtype).requires_grad_()
    dy = parallel.shard_sequence(dy_full, 1, rank, cp).to(device, dtype)
    compiled = torch.compile(cp_block, backend="cp_inductor", fullgraph=True)
    y = compiled(x)
    y.backward(dy)
    got = {"out": parallel.gather_sequence(y.detach(), 1), "dx": parallel.gather_sequence(x.grad, 1)}
    for n, p in cp_block.named_parameters():
        dist.all_reduce(p.grad)  # weight gradients are partial sums over the sequence slices
        got[f"d{n}"] = p.grad
    errs = {n: _rel(got[n].cpu(), want[n]) for n in want}
    return {"errors": errs, "report": str(cp_inductor.report())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="CP processes to spawn (CPU; ignored under torchrun)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    tol = 1e-4 if args.dtype in ("float32", "float64") else 3e-2

    if "LOCAL_RANK" in os.environ:  # under torchrun
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        rank, cp = dist.get_rank(), dist.get_world_size()
        result = run(rank, cp, args)
        torch._dynamo.reset()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        from .testing.launch import run_on_ranks

        cp = args.cp
        result = run_on_ranks(run, cp, args)[0]

    print(f"cp_inductor demo: Ulysses attention block, cp={cp}, device={args.device}, dtype={args.dtype}")
    print(result["report"])
    print("relative error vs single-device fp64 reference:")
    worst = max(result["errors"].values())
    for name, err in result["errors"].items():
        print(f"  {name:10s} {err:.2e}")
    ok = worst < tol
    print(f"max error {worst:.2e} ({'PASS' if ok else 'FAIL'}, tolerance {tol:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
