"""Custom ops, their Inductor lowerings and Triton kernels used by the passes.

Each rewrite in ``cp_inductor/passes`` that needs code Inductor cannot generate from ATen gets
its op and kernel here, apart from the pass that inserts it. ``fused_a2a`` needs none: its pack is
an ``aten.cat`` of relaid views and its unpack a view or a ``clone`` of a slice, which Inductor
lowers and fuses into one copy kernel each (``test_generated_code_collectives_and_copy_kernels``). The
first entries here will be head_partition's and uniform_thd's device-side checks.
"""
