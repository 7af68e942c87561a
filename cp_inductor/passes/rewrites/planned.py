"""Rewrites of the catalogue that are config switches and report columns but not code yet: the
report says "not implemented yet" for them on every region of their styles."""

from __future__ import annotations

from . import Rewrite

UNIFORM_THD = Rewrite("uniform_thd", ("a2a", "allgather", "ring"))
