"""Context-parallel attention written in plain PyTorch (functional collectives + SDPA).

Eager, it is the OFF baseline; compiled with ``backend="cp_inductor"`` the passes find its regions
and rewrite them. One module per CP style (``ulysses``, ``allgather``, ``ring``), plus the
sequence sharding they share; ``thd_allgather`` is packed sequences (THD) through the all-gather.
"""

from .allgather import allgather_attention
from .batch import BatchShard, combine_losses, shard_batch, sum_gradients
from .ring import ring_attention
from .sharding import gather_sequence, load_balanced_chunks, shard_sequence, unshard_sequence
from .thd_allgather import PackShard, shard_pack, thd_allgather_attention, unshard_pack
from .ulysses import LAYOUTS, ulysses_attention

__all__ = [
    "LAYOUTS", "allgather_attention", "gather_sequence", "load_balanced_chunks", "ring_attention", "shard_sequence",
    "ulysses_attention", "unshard_sequence", "PackShard", "BatchShard", "combine_losses", "shard_batch", "sum_gradients", "shard_pack", "thd_allgather_attention", "unshard_pack",
]
