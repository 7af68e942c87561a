"""Custom ops, their Inductor lowerings and Triton kernels used by the passes.

Each rewrite in ``cp_inductor/passes`` that needs code Inductor cannot generate from ATen gets
its op and kernel here, apart from the pass that inserts it. fused_a2a and head_partition need
none: their pack is an ``aten.cat`` of relaid views and their unpack a view or a ``clone`` of a
slice, which Inductor lowers into one copy kernel each (``test_generated_code_collectives_and_copy_kernels``).

``a2a_pack`` (op + reference) and ``a2a_pack_triton`` (kernel + launcher) are the hand-written
pack that Inductor's generated one is measured against (``benchmarks/bench_pack.py``).
"""
