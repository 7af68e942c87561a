"""The ops our passes put into graphs that ATen has no op for, and how Inductor runs them.

Each is a ``torch.library`` custom op (``cp_inductor::...``) with its fake (shape) function and,
where it takes part in training, its autograd formula; Inductor runs it as an extern kernel
(a fallback, ``cudnn_backward`` registers its own). The passes that insert them live in
``cp_inductor/passes``; nothing here imports a pass.

* ``ce_transport``: an equal-split all-to-all on the copy engines (ce_rotation, head_overlap).
* ``cudnn_graph``, ``cudnn_backward``, ``cudnn_ragged``, ``varlen_attention``: cuDNN attention
  built with the cuDNN frontend (dense backward keyed on dO's layout; packed sequences).
* ``fa4_attention``, ``fa4_functions``: FlashAttention-4, dense and packed.
* ``outside_graph_pool``: work that must not allocate from a CUDA graph's pool.

fused_a2a needs no op here: its pack is an ``aten.cat`` of relaid views and its unpack a view or
a ``clone``, which Inductor lowers into one copy kernel each. A hand-written Triton pack was
measured against it and lost (docs/measurements.md, "Pack kernels"); it was removed.
"""
