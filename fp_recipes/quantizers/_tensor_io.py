"""Shared plumbing for quantized tensor types: dtype names, state checks, pickling through state_dict.

Quantized tensors pickle as their ``state_dict()`` (tensors + str/int/bool/list), so ``torch.save`` /
``torch.load`` work, including ``torch.load(weights_only=True)`` once the class is allowlisted (done
here for every registered type).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable

import torch

STATE_VERSION = 1

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(d: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == d:
            return name
    raise ValueError(f"unsupported original dtype {d}; allowed: {', '.join(_DTYPES)}")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r} in a quantized tensor state; allowed: "
                         f"{', '.join(_DTYPES)}") from None


def check_state(state: Dict[str, Any], kind: str, keys: Iterable[str]) -> None:
    """A consumer given a state it cannot handle fails here, loudly, naming what is wrong."""
    if not isinstance(state, dict):
        raise TypeError(f"{kind} state must be a dict, got {type(state).__name__}")
    got_kind = state.get("kind")
    if got_kind != kind:
        raise ValueError(f"state is for a {got_kind!r} tensor, not {kind!r}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise ValueError(f"{kind} state has version {version!r}; this fp_recipes reads version "
                         f"{STATE_VERSION}")
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{kind} state is missing {missing}")


def resolve_out_dtype(dtype, orig: torch.dtype) -> torch.dtype:
    d = orig if dtype is None else dtype
    if d not in _DTYPES.values():
        raise TypeError(f"dequantize: dtype must be float32, float16 or bfloat16, got {d}")
    return d


def move(t, device):
    return None if t is None else t.to(device)


class StatePickle:
    """Mixin: pickle through ``state_dict`` / ``from_state_dict`` (no private attributes leak)."""

    def __getstate__(self) -> Dict[str, Any]:
        return self.state_dict()  # type: ignore[attr-defined]

    def __setstate__(self, state: Dict[str, Any]) -> None:
        other = type(self).from_state_dict(state)  # type: ignore[attr-defined]
        self.__dict__.update(other.__dict__)


def allow_in_weights_only_load(*classes: type) -> None:
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(list(classes))
