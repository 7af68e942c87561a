"""The cp_inductor config of one compile, frozen when the compile starts.

The backend takes one snapshot per ``torch.compile`` (global config + ``options=``) and hands the
same object to the report's analysis, to every detector and rewrite, and to the hook passes'
``uuid()``: what the FX graph cache keys on is exactly what the passes read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping


class ConfigSnapshot(Mapping):
    """Read-only ``cp_inductor.config`` values: ``cfg.fused_a2a``, ``cfg["head_split_groups"]``."""

    def __init__(self, values: Mapping):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"cp_inductor config has no {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("a config snapshot is read-only")

    def __getitem__(self, name: str):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self._values!r})"

    def digest(self) -> str:
        return hashlib.sha256(repr(sorted(self._values.items())).encode()).hexdigest()


def _both(*names):
    return lambda value: {n: value for n in names}


_NO_OP = "it does nothing: Inductor already folds what it would remove (the report says so per region)"
# Old name -> (what it sets now, the message). Accepted for one release.
DEPRECATED = {
    "head_partition": (_both("head_overlap", "head_split"), "head_partition is two rewrites now: head_overlap (Ulysses) and head_split (all-gather, ring)"),
    "head_groups": (_both("head_overlap_groups", "head_split_groups"), "use head_overlap_groups / head_split_groups"),
    "head_partition_forward": (_both("head_overlap_forward", "head_split_forward"), "use head_overlap_forward / head_split_forward"),
    "head_partition_min_gib": (_both("head_split_min_gib"), "use head_split_min_gib"),
    "transport": (_both("head_overlap_transport"), "use head_overlap_transport"),
    "transport_min_tflop": (_both("head_overlap_transport_min_tflop"), "use head_overlap_transport_min_tflop"),
    "ring_aot_cse": (lambda v: {"ring_cse": "aot"} if v else {}, "use ring_cse='aot'"),
    "collective_cse": (lambda v: {} if v else {"ring_cse": "pin"}, "use ring_cse='pin' (or 'collective')"),
    "zero_init": (lambda v: {}, _NO_OP),
    "first_grad_reuse": (lambda v: {}, _NO_OP),
}


def snapshot(overrides: Mapping | None = None) -> ConfigSnapshot:
    """The global config as it is now, with ``overrides`` (config names, no prefix) on top;
    deprecated names set are translated, with a warning."""
    import warnings

    from . import config

    values = {}
    # Global settings, then this compile's options: the options win, whichever name they use.
    for source in (config.get_config_copy(), dict(overrides or {})):
        values.update({k: v for k, v in source.items() if k not in DEPRECATED})
        for old, (new, message) in DEPRECATED.items():
            if source.get(old) is not None:
                warnings.warn(f"cp_inductor config {old!r} is deprecated: {message}", FutureWarning, stacklevel=3)
                values.update(new(source[old]))
    return ConfigSnapshot(values)
