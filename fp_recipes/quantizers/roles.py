"""Quantizer roles and specs: *what* a GEMM operand is, and *exactly how* it is quantized.

A module asks its recipe ``recipe.plan(role)`` for each operand it quantizes and gets back a frozen
:class:`QuantizerSpec`. Quantizers are built from specs (``fp_recipes.quantizers.make_quantizer``);
nothing anywhere decides by slot position (``idx % 3``): the role says which tensor this is.

Operand table (TransformerEngine's, which we follow):

=======  ==============================  ==============================
GEMM     A (rows of output)              B (columns of output)
=======  ==============================  ==============================
fprop    activation, rowwise             weight, rowwise
dgrad    grad_output, rowwise            weight, columnwise
wgrad    grad_output, columnwise         activation, columnwise
=======  ==============================  ==============================
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Optional


class _StrEnum(str, Enum):
    """String enum whose lookup is case-insensitive (``TensorKind("Weight")`` works)."""

    @classmethod
    def _missing_(cls, value: object):
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        allowed = ", ".join(repr(m.value) for m in cls)
        hint = ""
        if isinstance(value, str):
            import difflib

            close = difflib.get_close_matches(value.lower(), [m.value for m in cls], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; allowed (any case): {allowed}{hint}")

    def __str__(self) -> str:
        return self.value


class ModuleKind(_StrEnum):
    LINEAR = "linear"
    LAYERNORM_LINEAR = "layernorm_linear"
    GROUPED_LINEAR = "grouped_linear"


class TensorKind(_StrEnum):
    ACTIVATION = "activation"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"
    OUTPUT = "output"
    GRAD_INPUT = "grad_input"


class ScalingKind(_StrEnum):
    NONE = "none"  # kept in high precision (no quantization)
    DELAYED = "delayed"  # FP8 per-tensor, scale from amax history
    CURRENT = "current"  # FP8 per-tensor, scale from this tensor's amax
    NVFP4 = "nvfp4"  # E2M1 with E4M3 block scales and an FP32 global amax
    PER_TOKEN = "per_token"  # E5M6 / E4M3 with one scale per token (row)


class QFormat(_StrEnum):
    """Element format of the quantized data."""

    HIGH_PRECISION = "high_precision"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    NVFP4 = "nvfp4"  # E2M1 data, E4M3 block scales, FP32 global amax
    E5M6 = "e5m6"


class BackwardOverride(_StrEnum):
    """How the backward GEMMs treat their operands (TransformerEngine's ``NVTE_BACKWARD_OVERRIDE``).

    ``high_precision``: dgrad/wgrad run on the unquantized tensors (the forward saves them).
    ``dequantized``: dgrad/wgrad run in high precision on the *dequantized* forward operands, so
    the backward sees exactly the values the forward used.
    """

    HIGH_PRECISION = "high_precision"
    DEQUANTIZED = "dequantized"


@dataclass(frozen=True)
class QuantizerRole:
    """Which tensor of which GEMM of which module. ``gemm`` numbers GEMMs inside one module."""

    module: ModuleKind
    tensor: TensorKind
    gemm: int = 0
    name: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "module", ModuleKind(self.module))
        object.__setattr__(self, "tensor", TensorKind(self.tensor))
        if not isinstance(self.gemm, int) or self.gemm < 0:
            raise ValueError(f"QuantizerRole.gemm must be an int >= 0, got {self.gemm!r}")

    def __str__(self) -> str:
        tail = f":{self.name}" if self.name else ""
        return f"{self.module.value}[{self.gemm}].{self.tensor.value}{tail}"


@dataclass(frozen=True)
class QuantizerSpec:
    """A complete, frozen description of how one operand is quantized.

    Everything a quantizer needs is here; quantizers never look at the recipe. Fields that do not
    apply to ``scaling`` keep their defaults (and are ignored).
    """

    role: QuantizerRole
    fmt: QFormat
    scaling: ScalingKind
    # Which copies to produce: rowwise = the tensor as is (contraction dim last);
    # columnwise = the quantization of its transpose (for the wgrad / dgrad GEMM).
    rowwise: bool = True
    columnwise: bool = False
    # FP8 formats of the two copies may differ only by role (HYBRID: E5M2 for gradients).
    # --- delayed scaling ---
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # "max" | "most_recent"
    reduce_amax: bool = True
    # --- current scaling ---
    use_power_2_scales: bool = False
    amax_epsilon: float = 0.0
    # --- NVFP4 ---
    block_2d: bool = False  # 16x16 tiles (weights) instead of 1x16 blocks
    row_scaled: bool = False  # per-row (per-token) global amax on the rowwise copy
    four_over_six: bool = False  # pick map-to-4 or map-to-6 per block
    e4m3_max: int = 448  # E4M3 bound E used for the block scales: 448 or 256
    err_mode: str = "MAE"  # 4over6 selection metric: "MAE" | "MSE"
    err_fast_math: bool = False  # 4over6 error in the FP16 product domain (seed 004 contract)
    rht_columnwise: bool = False  # random Hadamard transform on the columnwise copy
    stochastic_rounding: bool = False
    # --- per-token casts ---
    round_sf: bool = False
    scale_format: str = "fp32"  # "fp32" | "ue8m0" (ue8m0 requires round_sf)
    # --- backward ---
    backward_override: Optional[BackwardOverride] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fmt", QFormat(self.fmt))
        object.__setattr__(self, "scaling", ScalingKind(self.scaling))
        if self.backward_override is not None:
            object.__setattr__(self, "backward_override", BackwardOverride(self.backward_override))
        if self.e4m3_max not in (448, 256):
            raise ValueError(f"QuantizerSpec.e4m3_max must be 448 or 256, got {self.e4m3_max!r}")
        if self.err_mode not in ("MAE", "MSE"):
            raise ValueError(f"QuantizerSpec.err_mode must be 'MAE' or 'MSE', got {self.err_mode!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                "QuantizerSpec.amax_compute_algo must be 'max' or 'most_recent', "
                f"got {self.amax_compute_algo!r}"
            )
        if self.scale_format not in ("fp32", "ue8m0"):
            raise ValueError(
                f"QuantizerSpec.scale_format must be 'fp32' or 'ue8m0', got {self.scale_format!r}"
            )
        if self.scale_format == "ue8m0" and not self.round_sf:
            raise ValueError("QuantizerSpec: scale_format='ue8m0' needs round_sf=True")

    @property
    def quantized(self) -> bool:
        return self.scaling is not ScalingKind.NONE

    def replace(self, **changes) -> "QuantizerSpec":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """One readable line, for logs and reprs."""
        if not self.quantized:
            return f"{self.role}: high precision"
        parts = [f"{self.role}: {self.fmt.value}/{self.scaling.value}"]
        parts.append("+".join(u for u, on in (("row", self.rowwise), ("col", self.columnwise)) if on))
        if self.scaling is ScalingKind.NVFP4:
            parts.append("2d" if self.block_2d else "1d")
            if self.row_scaled:
                parts.append("row_scaled")
            if self.four_over_six:
                fm = ",fast" if self.err_fast_math else ""
                parts.append(f"4over6({self.err_mode}{fm},E={self.e4m3_max})")
            if self.rht_columnwise:
                parts.append("rht(col)")
            if self.stochastic_rounding:
                parts.append("sr")
        return " ".join(parts)


def high_precision_spec(role: QuantizerRole) -> QuantizerSpec:
    """The spec of an operand that is not quantized."""
    return QuantizerSpec(role=role, fmt=QFormat.HIGH_PRECISION, scaling=ScalingKind.NONE,
                         rowwise=True, columnwise=False)


__all__ = [
    "BackwardOverride",
    "ModuleKind",
    "QFormat",
    "QuantizerRole",
    "QuantizerSpec",
    "ScalingKind",
    "TensorKind",
    "high_precision_spec",
]
