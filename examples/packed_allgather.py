"""Packed sequences (THD: documents back to back, no padding) through K/V all-gather CP,
compiled with cp_inductor.

    torchrun --nproc-per-node 2 examples/packed_allgather.py   # gloo on CPU, NCCL where CUDA is
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp_inductor
from cp_inductor.parallel import shard_pack, thd_allgather_attention, unshard_pack

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, cp = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)  # every rank builds the same pack: [T, H, D], documents of these lengths
lengths = [40, 7, 17]
q_pack, k_pack, v_pack = (torch.randn(sum(lengths), 4, 16, device=device) for _ in range(3))

# each document cut into 2cp pieces, rank r holding pieces r and 2cp-1-r
q, shard = shard_pack(q_pack, lengths, rank, cp, balance="document")
k, v = (t.index_select(0, shard.local_index) for t in (k_pack, v_pack))
q, k, v = (t.requires_grad_() for t in (q, k, v))
attn = torch.compile(lambda q, k, v: thd_allgather_attention(q, k, v, shard, is_causal=True), backend="cp_inductor")
out = attn(q, k, v)
out.sum().backward()

full = torch.cat([  # each document on its own, causal
    F.scaled_dot_product_attention(*(t[s:s + n].transpose(0, 1) for t in (q_pack, k_pack, v_pack)), is_causal=True).transpose(0, 1)
    for s, n in zip([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()], lengths)
])
torch.testing.assert_close(unshard_pack(out.detach(), shard), full, atol=1e-4, rtol=1e-4)
if rank == 0:
    print(cp_inductor.report())
dist.destroy_process_group()
