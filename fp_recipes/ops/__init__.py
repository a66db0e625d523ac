"""Op dispatch: a CUDA tensor runs the kernel from ``fp_recipes._C``, anything else the reference twin.

Every op is defined first as a pure-torch reference in :mod:`fp_recipes.ops.reference` (the contract);
a CUDA kernel registers under the same name and signature (:func:`backend.register_cuda_impl`).
``fp_recipes.ops.<name>(...)`` dispatches on the device of the first tensor argument. A reference
marked with :func:`device_agnostic` (cheap scalar math) runs as is on every device.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from . import backend, reference
from ._marks import device_agnostic  # noqa: F401  (re-exported)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0]
    return None


def dispatch(name: str) -> Callable[..., Any]:
    """The dispatching callable for reference op ``name``."""
    ref = getattr(reference, name, None)
    if ref is None or name not in reference.__all__:
        raise AttributeError(f"fp_recipes.ops has no op {name!r}; known: {sorted(reference.__all__)}")

    if getattr(ref, "device_agnostic", False):
        # Cheap scalar math whose torch code *is* the implementation on every device.
        return ref

    @functools.wraps(ref)
    def run(*args: Any, **kwargs: Any) -> Any:
        t = _first_tensor(args, kwargs)
        if t is not None and t.is_cuda:
            impl = backend.cuda_impl(name)
            if impl is not None:
                return impl(*args, **kwargs)
        return ref(*args, **kwargs)

    return run


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    fn = dispatch(name)
    globals()[name] = fn
    return fn


backend.bind_package(sys.modules[__name__])
