"""Markers reference ops carry for the dispatcher (kept apart to avoid import cycles)."""

from __future__ import annotations

from typing import Any, Callable


def device_agnostic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a reference op whose torch code is also its CUDA implementation (cheap scalar math:
    no kernel is needed, so the dispatcher neither looks for one nor warns)."""
    fn.device_agnostic = True  # type: ignore[attr-defined]
    return fn
