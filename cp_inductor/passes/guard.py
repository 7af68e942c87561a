"""Unexpected errors in detection and eligibility: the op is left to Inductor with the error as
its reason, unless the compile's config is ``strict`` (the tests set it through
``CP_INDUCTOR_STRICT=1``) and wants them raised. A compiler bug in our analysis must cost a
rewrite, never the user's compile."""

from __future__ import annotations


def internal_error(e: Exception, cfg) -> str:
    if cfg.strict:
        raise e
    return f"internal error, left to Inductor: {type(e).__name__}: {e}"


def reason_or_error(ineligible, *args, cfg) -> str | None:
    """``ineligible(*args)`` (a reason or None), with an unexpected error turned into the reason."""
    try:
        return ineligible(*args)
    except Exception as e:  # noqa: BLE001 - any bug here must not fail the compile
        return internal_error(e, cfg)
