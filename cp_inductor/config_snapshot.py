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


def snapshot(overrides: Mapping | None = None) -> ConfigSnapshot:
    """The global config as it is now, with ``overrides`` (config names, no prefix) on top."""
    from . import config

    # (install_config_module adds get_config_copy at import)
    return ConfigSnapshot({**config.get_config_copy(), **dict(overrides or {})})  # type: ignore[attr-defined]
