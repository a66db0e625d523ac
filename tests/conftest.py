"""Test configuration: ``@pytest.mark.cuda`` tests skip cleanly where there is no GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch):
    """Tests never see the caller's NVTE_*/FP_RECIPES_* variables unless they set them."""
    import os

    for name in list(os.environ):
        if name.startswith(("NVTE_", "FP_RECIPES_")) and name not in ("FP_RECIPES_CUDA_ARCHS",):
            monkeypatch.delenv(name, raising=False)
    yield
