"""cp_inductor configuration.

One switch per rewrite (its name in the report), and each rewrite's knobs named
``<rewrite>_<knob>``. Patch it like Inductor's config::

    with cp_inductor.config.patch(fused_a2a=False):
        ...

or per compile: ``torch.compile(fn, backend="cp_inductor", options={"cp_inductor.fused_a2a": False})``.
What each rewrite does and what it was measured to give: ``docs/passes/<name>.md``.
"""

import os
import sys

from torch.utils._config_module import install_config_module

# --- rewrite switches ---
# Ulysses: one all-to-all for q, k, v (and dq, dk, dv); docs/passes/fused_a2a.md.
fused_a2a: bool = True
# Ulysses: head groups whose all-to-alls travel under another group's attention;
# docs/passes/head_overlap.md. Off: within +-2.5% of fused_a2a alone where measured.
head_overlap: bool = False
# K/V all-gather and ring: attention calls split by head groups to bound their workspace;
# docs/passes/head_split.md. Off: costs time, pays only where memory is short.
head_split: bool = False
# K/V all-gather backward: reduce-scatters as copy-engine pulls; docs/passes/owner_grad_return.md.
owner_grad_return: bool = False
# K/V all-gather: attention on local K/V while the gather travels; docs/passes/gather_overlap.md.
gather_overlap: bool = False
# Ring: rotations on the copy engines; docs/passes/ce_rotation.md.
ce_rotation: bool = True
# Ring: the last dK/dV rotation sent in the inputs' dtype (same bits); docs/passes/narrow_rotation.md.
narrow_rotation: bool = True
# Ring, cp = 2: each dK/dV contribution sent home once; docs/passes/ring_grad_return.md.
ring_grad_return: bool = False
# A cat a collective sends that reassembles one tensor -> that tensor; docs/passes/cat_of_slices.md.
cat_of_slices: bool = False
# Every cuDNN attention backward on the cuDNN frontend's op (torch < 2.14: aten's plan cache
# ignores dO's layout); docs/passes/cudnn_frontend_backward.md. Needs the [cudnn] extra.
cudnn_frontend_backward: bool = True
# Packed-sequence (THD) attention (torch's varlen_attn) on cuDNN's ragged SDPA, GQA without
# repeated K/V; docs/passes/varlen_cudnn.md. Needs the [cudnn] extra on CUDA.
varlen_cudnn: bool = True
# ... only for packs of at least this many tokens x query heads x head_dim: below it cuDNN's
# ragged attention measured slower than flash-2 (docs/passes/varlen_cudnn.md).
varlen_cudnn_min_size: int = 2**26
# SDPA under a document / causal mask (HF transformers' packed and plain batches under compile,
# masks built by hand) onto packed attention (FA4 varlen or cuDNN ragged) or causal SDPA, the
# mask no longer built; docs/passes/document_mask.md.
document_mask: bool = True
# ... document ids the graph does not prove contiguous: "check" on device each step (a
# non-contiguous table runs the masked attention densely), or "promised" (no check).
document_mask_ids: str = "check"
# ... a plan's numbers read after FA4 is launched at a capacity learned from earlier steps, not
# before (lowerings/document_attention.py): off, every step waits for them with the GPU idle.
document_mask_speculate: bool = os.environ.get("CP_INDUCTOR_DOCUMENT_SPECULATE", "1") != "0"
# ... at most this many documents in a step's pack, all rows together (0: no bound): FA4 runs over that many (trailing ones
# empty) and the host reads nothing, so the step can be captured in a CUDA graph
# (mode="reduce-overhead"); a pack with more documents, or ids that are not contiguous, is a
# device error, never a different answer. Without it a plan's numbers are read on the host: its
# graph is not CUDA-graphed, and under a capture of one's own the masked attention runs densely.
document_mask_capacity: int = 0
# Packed sequences of equal length to dense SDPA; docs/passes/uniform_thd.md. "proven": where
# cu_seqlens is built from arange; "promised": every pack (checked on device); "off".
uniform_thd: str = "proven"

# Context parallelism the model does not write: the name of the CP process group, or "" (off). Pass
# the mesh itself as the compile option (options={"cp_inductor.context_parallel": mesh}: a 1-d
# DeviceMesh or a ProcessGroup); the batch comes from cp_inductor.parallel.shard_batch over the same
# mesh, and every self-attention call attends over every rank's tokens (docs/passes/context_parallel.md).
context_parallel: str = ""
# ... how each attention call goes over the ranks: "auto" (the style of least predicted compute +
# communication, passes/analysis/context_parallel_cost.py; the all-gather where the device has no
# measured costs), "allgather" (K/V all-gathered: any heads, GQA as is) or "ulysses" (all-to-all of
# heads: query heads divisible by cp, K/V heads repeated up to a multiple of cp where fewer) or
# "ring" (K/V rotated rank to rank: rows of one document, no window; auto takes it where
# predicted cheapest, short rows at cp 2 on the measured tables); or a comma-separated list of
# these, one per attention call of a graph in the report's order (calls past its end take its
# last: "allgather,ulysses" pins the first layer to the all-gather). A call the forced style
# cannot take goes to the all-gather, the report says why.
context_parallel_style: str = "auto"
# ... price the styles with the tables measured on this device (its name, e.g. "NVIDIA H200")
# rather than the compile's: planning for another machine, and the CPU tests.
context_parallel_cost_device: str = ""
# ... a mean over a rank's tokens (a loss that ignores num_items_in_batch: BERT's masked-LM head,
# cross_entropy's default reduction, a masked mean) divided by the full batch's count, so that the
# ranks' losses sum to the single-device loss (passes/dynamo/token_means.py); False keeps each
# rank's own mean (for a program that weighs the ranks' means itself).
context_parallel_global_means: bool = True

# Which kernel runs each attention call the backend lowers (packed calls, equal-length packs'
# dense call, the dense calls of CP regions): "auto" (the fastest in the measured cost map,
# passes/analysis/attention_provider.py), or "fa4", "cudnn", "program" (the program's own op).
# FA4 needs the [fa4] extra; a forced provider that cannot take a call falls back to "auto".
attention_provider: str = "auto"
# A cost map (JSON, as benchmarks/bench_providers.py writes) read before the packaged ones.
attention_provider_cost_map: str = ""

# --- knobs, by rewrite ---
# fused_a2a: "auto" (the measured cost model, passes/analysis/cost_model.py), "views" or "copy".
fused_a2a_unpack: str = "auto"
# head_overlap: head groups (0: the rewrite chooses), forward regions too, and how each group's
# all-to-all travels: "nccl", "copy_engine", or "auto" (the copy engines where they run and the
# region's attention has at least head_overlap_transport_min_tflop TFLOP to hide their host work).
head_overlap_groups: int = 0
head_overlap_forward: bool = False
head_overlap_transport: str = "auto"
head_overlap_transport_min_tflop: float = 2.0
# head_split: head groups (0: the rewrite chooses, and then only calls whose backward allocates
# at least head_split_min_gib GiB beyond its gradients), forward regions too.
head_split_groups: int = 0
head_split_forward: bool = False
head_split_min_gib: float = 1.0
# ce_rotation: smaller rotations stay on NCCL.
ce_rotation_min_bytes: int = 256 << 20

# --- whole-graph ---
# Common-subexpression elimination of graphs with ring rotations (ranks trace different graphs
# there, so merging must be decided alike on every rank; docs/architecture.md):
# "collective": our joint-graph pass (passes/joint/collective_cse.py) merges what every rank merges
# alike and pins each collective to its graph; "pin": only pins; "aot": AOTAutograd's own CSE.
ring_cse: str = "collective"
# Run region detection and fill the report even when every rewrite is off.
detect: bool = True
# Raise unexpected errors of detection and eligibility instead of leaving the op to Inductor
# with the error in the report (the tests turn it on).
strict: bool = os.environ.get("CP_INDUCTOR_STRICT", "") == "1"

install_config_module(sys.modules[__name__])
