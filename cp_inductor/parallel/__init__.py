"""Context-parallel attention written in plain PyTorch (functional collectives + SDPA).

Eager, it is the OFF baseline; compiled with ``backend="cp_inductor"`` the passes find its regions
and rewrite them. One module per CP style (``ulysses``; all-gather and ring follow), plus the
sequence sharding they share.
"""

from .sharding import gather_sequence, shard_sequence, unshard_sequence
from .ulysses import LAYOUTS, ulysses_attention

__all__ = ["LAYOUTS", "gather_sequence", "shard_sequence", "ulysses_attention", "unshard_sequence"]
