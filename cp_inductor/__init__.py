"""cp_inductor: a torch.compile backend for context-parallel attention.

``torch.compile(model, backend="cp_inductor")`` finds scaled-dot-product attention inside
context-parallel regions and rewrites it into fused CP lowerings. ``cp_inductor.report()`` says
what it found and did.
"""

from . import config
from .reporting import Region, Rejected, Report, clear_report, report

__all__ = ["config", "report", "clear_report", "Report", "Region", "Rejected", "backend", "equal_lengths",
           "trace_fa4_functions"]


def __getattr__(name):
    # The backend module imports Inductor; load it only when asked for.
    if name == "backend":  # (``from . import backend`` would ask this hook again: a recursion)
        import importlib

        return importlib.import_module(".backend", __name__)
    if name == "equal_lengths":  # uniform_thd's per-call promise
        from .lowerings.varlen_attention import equal_lengths

        return equal_lengths
    if name == "trace_fa4_functions":  # FA4's functions traced as our ops (lowerings/fa4_functions.py)
        from .lowerings.fa4_functions import register

        return register
    raise AttributeError(name)
