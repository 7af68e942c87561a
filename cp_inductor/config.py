"""cp_inductor configuration.

One switch per rewrite of the catalogue (README, "Rewrites") plus the knobs the rewrites read.
Patch it like Inductor's config::

    with cp_inductor.config.patch(fused_a2a=False):
        ...

or per compile: ``torch.compile(fn, backend="cp_inductor", options={"cp_inductor.fused_a2a": False})``.
"""

import os
import sys

from torch.utils._config_module import install_config_module

# --- rewrite switches (names are the public vocabulary of the report) ---
fused_a2a: bool = True
zero_init: bool = True
first_grad_reuse: bool = True
head_partition: bool = False
uniform_thd: bool = False
owner_grad_return: bool = False
# K/V all-gather: attention that reads nothing gathered (a causal chunk's own block) moved under
# the gather in the forward and after the reduce-scatter's start in the backward
# (passes/rewrites/gather_overlap.py). Off: not measured on GPUs yet.
gather_overlap: bool = False
# On where the copy engines can run and a rotation is at least ce_rotation_min_bytes (measured on
# 2xH200, native CP fwd+bwd: 0.88x / 0.94x of the NCCL rotations at S32K (all-to-all / all-gather
# rotation), 0.93x at S64K; README).
ce_rotation: bool = True
# A ring's last dK/dV rotation (after the last attention backward: exposed) carries the gradients
# already cast to the inputs' dtype when the program casts them only after it: same bits, half
# the bytes in bf16.
narrow_rotation: bool = True
# cp = 2 ring backward: the step-1 contribution to the peer's dK/dV sent home once (in bf16 where
# exact) instead of the accumulator there and back, the step-0 attention backward after the send
# (passes/rewrites/ring_grad_return.py). Off: not measured on GPUs yet.
ring_grad_return: bool = False
# A cat that reassembles consecutive slices of one tensor and is what a collective sends
# (native CP's dK/dV buffer before its rotation home) becomes that tensor (passes/cat_of_slices.py).
# Off by default until measured on GPUs: the GPU profile showed the cat as a copy kernel of its
# own (0.18 ms at S32K), but the pass had not applied there yet.
cat_of_slices: bool = False

# cuDNN attention backward (every call in a compiled graph, CP or not) through the cuDNN
# frontend's op on torch < 2.14, whose aten op caches plans by q/k/v layout only and returns
# wrong gradients when one process passes two dO layouts (passes/cudnn_frontend_backward.py).
# Needs the [cudnn] extra; without it, or off, aten's op gets the program's own dO.
cudnn_frontend_backward: bool = True

# --- knobs ---
# fused_a2a: how attention reads what the one all-to-all received. "views": strided views of the
# buffer (no copy, cuDNN slower on the interleaved rows); "copy": one copy into the layout attention
# had before (exactly default Inductor's attention inputs); "auto": the measured cost model
# (passes/cost_model.py) chooses per region.
fused_a2a_unpack: str = "auto"
# Head groups for `head_partition`; 0 lets the rewrite choose.
head_groups: int = 0
# head_partition also splits forward regions. Off by default: on H200 cuDNN's forward kernel
# takes every SM as soon as its input has arrived, so the next group's all-to-all, queued behind
# the one attention waited for, only runs in the kernel's tail (profiler trace, README); and the
# saved q, k, v and output must be copied back together for the backward.
head_partition_forward: bool = False
# head_partition on all-gather and ring regions with head_groups=0: split only a call whose fused
# backward allocates at least this many GiB beyond its gradients (estimated: fp32 dQ accumulator,
# dK/dV per query head under GQA). Measured on 2xH200: 2 GiB calls (S128K) cost +0.3-0.7% for
# -19..25% peak, 0.5 GiB calls (S32K) +1.9-3.2%. head_groups=G splits any call.
head_partition_min_gib: float = 1.0

# head_partition: how each group's all-to-all travels. "nccl": NCCL's all_to_all_single (its
# kernels need SMs: they starve while cuDNN attention runs, so only the first and last transfers
# are hidden); "copy_engine": pulls by the copy engines from symmetric memory, ordered by stream
# flags (lowerings/ce_transport.py), which move while attention holds every SM; where it cannot
# run (CPU, gloo, no cuda-bindings, ranks on several hosts) NCCL, with the reason in the report.
# "auto": the copy engines where they can run and the region's attention is at least
# transport_min_tflop (their host-side work, about 0.3 ms per transfer, must hide under it:
# measured faster at 4.4 TFLOP per region, B1 S32K H32 D128, and slower at 1.1, B4 S8K H16).
transport: str = "auto"
transport_min_tflop: float = 2.0
# ce_rotation leaves smaller rotations on NCCL: 256 MiB (B1 S32K H32 D128 bf16 K and V per rank)
# is the smallest measured faster; below it the copy engines' host-side launch work per step
# is not known to pay (head_partition's copy-engine all-to-alls lost at B4 S8K, README).
ce_rotation_min_bytes: int = 256 << 20

# AOTAutograd's common-subexpression elimination on graphs with ring rotations. Off: it merges
# collectives wherever two agree, and ring programs trace different graphs per rank (load
# balancing slices by rank). Such graphs go through passes/collective_cse.py instead, which also
# pins each collective to its graph (the partitioner copied collectives into both graphs per
# rank: native CP's all-to-all rotation at cp=4 hung, tests/test_collective_cse.py); True skips
# that pass too.
ring_aot_cse: bool = False
# That pass's merge: computation done twice, and a collective whose inputs come from graph inputs
# through rank-free ops only (views, cat, casts: the same on every rank), so that a backward that
# rotates K/V again reads the forward's copy. Off: the collectives are pinned, nothing merged.
collective_cse: bool = True

# Run region detection and fill the report even when every rewrite is off.
detect: bool = True

# Raise unexpected errors of detection and eligibility instead of leaving the op to Inductor
# with the error in the report (the tests turn it on).
strict: bool = os.environ.get("CP_INDUCTOR_STRICT", "") == "1"

install_config_module(sys.modules[__name__])
