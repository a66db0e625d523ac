"""Per-token (per-row, optionally per channel block) E5M6 / E4M3 tensors and their quantizer.

Numerics: ``fp_recipes.ops.per_token_cast`` / ``cast_back`` (reference in ``ops/ref_per_token.py``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .. import ops
from ._tensor_io import (STATE_VERSION, StatePickle, check_state, register_weights_only_types,
                         dtype_from_name, dtype_name, move, resolve_out_dtype)
from .base import QuantizedTensor, Quantizer, check_input
from .float8 import flatten_2d
from .roles import QFormat, QuantizerSpec, ScalingKind


class PerTokenTensor(StatePickle, QuantizedTensor):
    """A per-token cast: ``data`` (E5M6 packed uint8 (T, H*3/2) or float8_e4m3fn (T, H)) and ``scales``
    (FP32 dequant scales or UE8M0 bytes, (T, H/block)). ``shape`` is the original shape; T is the
    product of its leading dims."""

    kind = "per_token"

    def __init__(self, data: torch.Tensor, scales: torch.Tensor, fmt: str, round_sf: bool, scale_format: str,
                 block_size: Optional[int], orig_dtype: torch.dtype, shape) -> None:
        if fmt not in ("e5m6", "e4m3"):
            raise ValueError(f"PerTokenTensor: fmt must be 'e5m6' or 'e4m3', got {fmt!r}")
        if scale_format not in ("fp32", "ue8m0"):
            raise ValueError(f"PerTokenTensor: scale_format must be 'fp32' or 'ue8m0', got {scale_format!r}")
        if scale_format == "ue8m0" and not round_sf:
            raise ValueError("PerTokenTensor: ue8m0 scales only exist with round_sf=True")
        shape = torch.Size(shape)
        hidden = shape[-1]
        tokens = data.shape[0]
        want_cols = hidden * 3 // 2 if fmt == "e5m6" else hidden
        if data.dim() != 2 or data.shape[1] != want_cols or tokens * hidden != shape.numel():
            raise ValueError(f"PerTokenTensor: data shape {tuple(data.shape)} does not fit fmt {fmt} and "
                             f"logical shape {tuple(shape)}")
        nblocks = 1 if block_size is None else hidden // block_size
        if tuple(scales.shape) != (tokens, nblocks):
            raise ValueError(f"PerTokenTensor: scales must have shape {(tokens, nblocks)}, got {tuple(scales.shape)}")
        self.data = data
        self.scales = scales
        self.fmt = fmt
        self.round_sf = bool(round_sf)
        self.scale_format = scale_format
        self.block_size = block_size
        self.orig_dtype = orig_dtype
        self._shape = shape

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        out = ops.cast_back(self.data, self.scales, self.fmt, out_dtype=resolve_out_dtype(dtype, self.orig_dtype),
                            scale_format=self.scale_format, block_size=self.block_size)
        return out.reshape(self._shape)

    def to(self, device) -> "PerTokenTensor":
        return PerTokenTensor(move(self.data, device), move(self.scales, device), self.fmt, self.round_sf,
                              self.scale_format, self.block_size, self.orig_dtype, self._shape)

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "version": STATE_VERSION, "data": self.data, "scales": self.scales,
                "fmt": self.fmt, "round_sf": self.round_sf, "scale_format": self.scale_format,
                "block_size": self.block_size, "orig_dtype": dtype_name(self.orig_dtype),
                "shape": list(self._shape)}

    @classmethod
    def from_state_dict(cls, state: Dict[str, Any]) -> "PerTokenTensor":
        check_state(state, cls.kind, ("data", "scales", "fmt", "round_sf", "scale_format", "block_size",
                                      "orig_dtype", "shape"))
        return cls(state["data"], state["scales"], state["fmt"], state["round_sf"], state["scale_format"],
                   state["block_size"], dtype_from_name(state["orig_dtype"]), state["shape"])

    def __repr__(self) -> str:
        block = "token" if self.block_size is None else self.block_size
        return (f"PerTokenTensor(shape={tuple(self._shape)}, fmt={self.fmt}, block={block}, "
                f"round_sf={self.round_sf}, scales={self.scale_format}, "
                f"orig_dtype={dtype_name(self.orig_dtype)}, device={self.device})")


def per_token_quantize(x: torch.Tensor, fmt: str, *, round_sf: bool = False, scale_format: str = "fp32",
                       block_size: Optional[int] = None) -> PerTokenTensor:
    """Cast ``x`` (..., H) per token (row of the flattened 2-D view) and wrap the result."""
    check_input(x, "per_token_cast")
    x2 = flatten_2d(x, "per_token_cast")
    res = ops.per_token_cast(x2, fmt, round_sf=round_sf, scale_format=scale_format, block_size=block_size)
    return PerTokenTensor(res.data, res.scales, fmt.lower(), round_sf, scale_format, block_size, x.dtype, x.shape)


class PerTokenQuantizer(Quantizer):
    """Per-token E5M6 / E4M3 cast as the spec says (``round_sf``, ``scale_format``). ``block_size``
    (not a spec field) splits each row into blocks of channels with one scale each; None = whole row."""

    def __init__(self, spec: QuantizerSpec, block_size: Optional[int] = None) -> None:
        super().__init__(spec)
        if spec.scaling is not ScalingKind.PER_TOKEN:
            raise ValueError(f"PerTokenQuantizer is for per-token scaling, got a {spec.scaling.value} spec")
        if spec.fmt not in (QFormat.E5M6, QFormat.E4M3):
            raise ValueError(f"PerTokenQuantizer: spec fmt must be e5m6 or e4m3, got {spec.fmt.value}")
        self.fmt = spec.fmt.value
        self.block_size = block_size

    def quantize(self, x: torch.Tensor) -> PerTokenTensor:
        return per_token_quantize(x, self.fmt, round_sf=self.spec.round_sf, scale_format=self.spec.scale_format,
                                  block_size=self.block_size)

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state:
            raise ValueError(f"PerTokenQuantizer has no state; got keys {sorted(state)}")


register_weights_only_types()  # this type and every other quantized tensor type

__all__ = ["PerTokenQuantizer", "PerTokenTensor", "per_token_quantize"]
