"""Context parallelism without writing it: a single-device model, a CP group, the backend makes
each attention call context-parallel. Run: torchrun --nproc-per-node 2 examples/auto_cp.py"""

import torch
import torch.distributed as dist

import cp_inductor
from cp_inductor.parallel import combine_losses, shard_batch, sum_gradients
from cp_inductor.testing.auto_cp import Decoder, packed_batch

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)
model = Decoder(mask="documents").to(device)  # plain single-device code: SDPA under a document mask
batch = {k: v.to(device) for k, v in packed_batch([40, 7, 17]).items()}  # every rank: the same full batch

compiled = torch.compile(model, backend="cp_inductor", options={"cp_inductor.context_parallel": dist.group.WORLD})
loss = compiled(**shard_batch(batch))     # this rank's tokens; its share of the loss
loss.backward()
sum_gradients(model)                      # the single-device gradients, on every rank
total = combine_losses(loss)              # the single-device loss

grads = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad()
want = model(**batch)                     # the same model on the full batch, one device
want.backward()
torch.testing.assert_close(total, want.detach(), atol=1e-4, rtol=1e-4)
for name, p in model.named_parameters():
    torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
if rank == 0:
    print(cp_inductor.report())
dist.destroy_process_group()
