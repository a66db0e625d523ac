"""Objects a torch.compile trace refers to by ``id()``: Dynamo before torch 2.13 passes only constants to
a function marked constant (``modules/base.py``: ``_prepare_for_trace_by_id``), so the module and the recipe
it prepares are registered here when they are made (weakly: the registry keeps nothing alive)."""

from __future__ import annotations

import weakref
from typing import Any

_OBJECTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register(obj: Any) -> None:
    key = id(obj)
    if _OBJECTS.get(key) is not obj:  # (every autocast entry registers its recipe: usually a lookup only)
        _OBJECTS[key] = obj


def lookup(key: int) -> Any:
    obj = _OBJECTS.get(key)
    if obj is None:
        raise RuntimeError("fp_recipes: an object traced by torch.compile was not registered (make recipes and "
                           "modules before compiling)")
    return obj
