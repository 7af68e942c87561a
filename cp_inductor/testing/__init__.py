"""Tools to check and exercise cp_inductor: processes per rank (``launch``), numerics against a
single-device reference (``checks``), a CP transformer training step (``train_step``).

The compiler never imports this package; tests, benchmarks and the demo do.
"""
