"""tile2_kernel's two walks for the GPU tests: its default on small shapes (one 64-column tile a thread block) and
strips of 4 tiles a thread block, which the launcher takes from 16 waves of tiles on (large tensors) and which
``strips_forced()`` turns on for every shape (``nvfp4_set_tile2_strip_min_waves(0)``)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

WALKS = ["tiles", "strips"]


@contextlib.contextmanager
def walk(name: str) -> Iterator[None]:
    """Run the body with tile2's walk ``name`` ("tiles": the default; "strips": strips of 4 tiles forced)."""
    if name == "tiles":
        yield
        return
    from fp_recipes import _extension

    ext = _extension.extension()
    if ext is None or not hasattr(ext, "nvfp4_set_tile2_strip_min_waves"):
        pytest.fail("the extension has no nvfp4_set_tile2_strip_min_waves: rebuild it")
    old = ext.nvfp4_set_tile2_strip_min_waves(0)
    try:
        yield
    finally:
        ext.nvfp4_set_tile2_strip_min_waves(old)
