"""Shared plumbing for quantized tensor types: dtype names, state checks, pickling through state_dict.

Quantized tensors pickle as their ``state_dict()`` (tensors + str/int/bool/list), so ``pickle``,
``copy.deepcopy``, ``torch.save`` and ``torch.load`` work, including ``torch.load(weights_only=True)``:
:func:`register_weights_only_types` allow-lists every quantized tensor type. torch (2.13) cannot pickle
float8 storages with plain ``pickle``, so float8 tensors travel as uint8 views of the same bytes plus
their dtype name, and come back bit-identical.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Iterable, List

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


# dtypes whose storages plain pickle cannot write (torch 2.13): saved as uint8 views of the same bytes
_BYTE_VIEW_DTYPES = {str(d).replace("torch.", ""): d for d in (
    getattr(torch, name, None) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                            "float8_e8m0fnu")) if d is not None}
FLOAT8_FIELDS = "float8_fields"  # state key: {field name: float8 dtype name} of the fields stored as uint8


def encode_float8(state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` with every float8 tensor replaced by its uint8 view (same bytes, no copy) and the
    dtype names under ``float8_fields``: picklable by plain ``pickle`` and by ``weights_only`` loads."""
    out = dict(state)
    names: Dict[str, str] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dtype in _BYTE_VIEW_DTYPES.values():
            names[key] = str(value.dtype).replace("torch.", "")
            out[key] = value.view(torch.uint8)
    out[FLOAT8_FIELDS] = names
    return out


def decode_float8(state: Dict[str, Any]) -> Dict[str, Any]:
    """Inverse of :func:`encode_float8` (bit-exact)."""
    out = dict(state)
    names = out.pop(FLOAT8_FIELDS, {})
    if not isinstance(names, dict):
        raise ValueError(f"quantized tensor state: {FLOAT8_FIELDS} must be a dict, got {type(names).__name__}")
    for key, name in names.items():
        dtype = _BYTE_VIEW_DTYPES.get(name)
        if dtype is None:
            raise ValueError(f"quantized tensor state: field {key!r} has float8 dtype {name!r}; allowed: "
                             f"{', '.join(sorted(_BYTE_VIEW_DTYPES))}")
        value = out.get(key)
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
            raise ValueError(f"quantized tensor state: field {key!r} is listed in {FLOAT8_FIELDS} but is not a "
                             "uint8 tensor")
        out[key] = value.view(dtype)
    return out


class StatePickle:
    """Mixin: pickle (and deepcopy) through ``state_dict`` / ``from_state_dict`` (no private attributes
    leak), float8 tensors as uint8 views (:func:`encode_float8`)."""

    def __getstate__(self) -> Dict[str, Any]:
        return encode_float8(self.state_dict())  # type: ignore[attr-defined]

    def __setstate__(self, state: Dict[str, Any]) -> None:
        other = type(self).from_state_dict(decode_float8(state))  # type: ignore[attr-defined]
        self.__dict__.update(other.__dict__)


def allow_in_weights_only_load(*classes: type) -> None:
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add(list(classes))


# every quantized tensor type: (module, class name); registered together so that a checkpoint holding
# any of them loads with weights_only=True once any quantized tensor module has been imported
QUANTIZED_TENSOR_TYPES = (
    ("fp_recipes.quantizers.float8", "Float8Tensor"),
    ("fp_recipes.quantizers.nvfp4", "NVFP4Tensor"),
    ("fp_recipes.quantizers.per_token", "PerTokenTensor"),
    ("fp_recipes.quantizers.grouped", "GroupedTensor"),
)


def register_weights_only_types() -> List[type]:
    """Allow-list every quantized tensor type for ``torch.load(weights_only=True)``; returns them.
    Imports their modules (call it after the modules' own top-level definitions, never from them
    mid-import)."""
    classes = [getattr(importlib.import_module(mod), name) for mod, name in QUANTIZED_TENSOR_TYPES]
    allow_in_weights_only_load(*classes)
    return classes
