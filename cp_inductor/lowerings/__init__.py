"""Custom ops, their Inductor lowerings and Triton kernels used by the passes.

Each rewrite in ``cp_inductor/passes`` that needs code Inductor cannot generate from ATen gets
its op and kernel here, apart from the pass that inserts it. fused_a2a and head_overlap need
none: their pack is an ``aten.cat`` of relaid views and their unpack a view or a ``clone`` of a
slice, which Inductor lowers into one copy kernel each (``test_generated_code_collectives_and_copy_kernels``).

Per op: its layout contract (``<op>_layout.py``: input checks and the ATen reference), its
definition and fake (``<op>.py``), its Triton kernel and launcher (``<op>_triton.py``); the op
and the kernel import the contract, never each other (the op loads the kernel only when CUDA
runs it). ``a2a_pack`` is the hand-written pack that Inductor's generated one is measured
against (``benchmarks/bench_pack.py``).
"""
