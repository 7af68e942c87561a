"""Ring CP attention (K/V rotated cp steps, partial outputs merged by log-sum-exp), compiled
with cp_inductor.

    torchrun --nproc-per-node 2 examples/ring.py           # gloo on CPU, NCCL where CUDA is
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp_inductor
from cp_inductor.parallel import ring_attention, shard_sequence

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)  # every rank builds the same full-sequence q, k, v: [B, S, H, D]
q_full, k_full, v_full = (torch.randn(1, 64, 4, 16, device=device) for _ in range(3))

q, k, v = (shard_sequence(t, 1, rank, cp, load_balanced=True).requires_grad_() for t in (q_full, k_full, v_full))
attn = torch.compile(lambda q, k, v: ring_attention(q, k, v, is_causal=True), backend="cp_inductor", fullgraph=True)
out = attn(q, k, v)
out.sum().backward()

full = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q_full, k_full, v_full)), is_causal=True)
torch.testing.assert_close(out, shard_sequence(full.transpose(1, 2), 1, rank, cp, load_balanced=True), atol=1e-4, rtol=1e-4)
if rank == 0:
    print(cp_inductor.report())
dist.destroy_process_group()
