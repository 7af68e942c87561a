"""Every cp_inductor pass, in the order it runs: the one place to read the pipeline.

``passes/engine.py`` runs this table (switches, error fence, checked apply, counters, report,
logs); ``passes/record.py`` says what a pass record holds. Stages, in the order torch.compile
reaches them:

    DYNAMO      the graph Dynamo hands the backend: each packed-sequence (THD) call goes to the
                first call pass that applies (the ops they put in bring their own autograd)
    CANONICAL   every graph detection reads, first: the forms the detectors rely on
    JOINT, JOINT_POST   the joint forward+backward graph, before / after AOTAutograd's passes
    POST_GRAD   forward, backward and inference graphs: the detectors find the CP regions, the
                region passes are decided per region in the order below (a pass's why_not sees
                the verdicts of those before it) and applied, then the graph passes run

Adding a CP style: a detector module in ``detect/`` and one line in DETECTORS. Adding a pass: a
module in the folder of its stage (``experimental/`` until it has a measured win) defining
``PASS``, and one line here. How region passes relate (whose verdict one reads, which one it
performs itself, which cannot share a region with it) is said here too (``related``): no pass
module names another.
"""

from __future__ import annotations

from . import canonicalize
from .detect import a2a, allgather, ring
from .dynamo import context_parallel, document_mask, uniform_thd, varlen_cudnn
from .experimental import cat_of_slices, gather_overlap, head_overlap, owner_grad_return, ring_grad_return
from .joint import collective_cse, fa4_dense
from .post_grad import ce_rotation, cudnn_frontend_backward, fused_a2a, head_split, narrow_rotation
from .record import related

DETECTORS = (a2a, allgather, ring)  # Ulysses, K/V all-gather, ring (K/V rotated)

PASSES = (
    # DYNAMO, first: context parallelism the model does not write (only where a CP mesh is given):
    # every attention call over this rank's tokens and every rank's keys, the layout as new inputs
    context_parallel.PASS,
    # DYNAMO: SDPA under a document mask to packed attention (its own calls); packed calls:
    # equal lengths to dense SDPA, then any lengths to cuDNN's ragged SDPA (or FA4)
    document_mask.PASS,
    uniform_thd.PASS,
    varlen_cudnn.PASS,
    # CANONICAL
    canonicalize.PASS,
    # JOINT: a ring program's joint graph (compiled without AOTAutograd's CSE) gets the merges
    # every rank makes alike and its collectives pinned to their graph
    collective_cse.PASS,
    # JOINT_POST: dense attention onto FA4 where the cost map says it is faster
    fa4_dense.PASS,
    # POST_GRAD, region passes in decision order
    fused_a2a.PASS,
    # experimental; builds on fused_a2a's buffers (reads its verdict) and performs it itself
    related(head_overlap.PASS, after=fused_a2a.PASS, replaces=fused_a2a.PASS),
    head_split.PASS,
    # experimental. Neither shares a region with head_split: the backward's regions are found
    # through the reduce-scatters they replace, so the graph's other regions, found again after
    # them, would lose their split. gather_overlap gives owner_grad_return's pulls attention to
    # hide under (owner_grad_return reads its verdict)
    related(gather_overlap.PASS, excludes=head_split.PASS),
    related(owner_grad_return.PASS, after=gather_overlap.PASS, excludes=head_split.PASS),
    # experimental; where it applies it sends the home dK/dV itself, so narrow_rotation stands down
    ring_grad_return.PASS,
    related(narrow_rotation.PASS, after=ring_grad_return.PASS),
    related(ce_rotation.PASS, after=narrow_rotation.PASS),  # it moves the rotation narrow_rotation narrowed
    # POST_GRAD, graph passes after the rewrites: a cat that reassembles slices of one tensor is
    # that tensor; cuDNN's attention backward where its plan cache keys on dO's layout (it sees
    # the calls the rewrites made); a generator input canonicalize unwrapped is read by one RNG
    # wrapper again, as Inductor needs
    cat_of_slices.PASS,  # experimental
    cudnn_frontend_backward.PASS,
    canonicalize.REWRAP_RNG,
)
