"""Per-token recipe: one scale per token (row) in E5M6 or E4M3, as DeepSeek's TileKernels cast.

The forward operands (activations, and weights with one scale per output channel) are cast per
token; the GEMM runs emulated (dequantize + matmul), and the backward runs in high precision on the
dequantized forward operands (``backward_override='dequantized'``, the default) or on the original
ones (``'high_precision'``). Output gradients are never quantized.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from pydantic import Field, field_validator

from fp_recipes.quantizers.roles import (
    BackwardOverride,
    QFormat,
    QuantizerRole,
    QuantizerSpec,
    ScalingKind,
    TensorKind,
    high_precision_spec,
)

from .base import CaseInsensitiveEnum, Recipe


class PerTokenFormat(CaseInsensitiveEnum):
    E5M6 = "e5m6"
    E4M3 = "e4m3"


class ScaleFormat(CaseInsensitiveEnum):
    FP32 = "fp32"
    UE8M0 = "ue8m0"


class PerTokenScaling(Recipe):
    """Per-token casts for the forward GEMM operands; high-precision backward."""

    recipe_name: ClassVar[str] = "per_token"

    fmt: PerTokenFormat = Field(PerTokenFormat.E5M6, description="e5m6 | e4m3")
    round_sf: bool = Field(False, description="round each scale up to a power of two")
    scale_format: ScaleFormat = Field(ScaleFormat.FP32, description="fp32 | ue8m0 (needs round_sf)")
    # Optional only so that None reaches _check_combinations, which names where it came from
    backward_override: Optional[BackwardOverride] = Field(
        BackwardOverride.DEQUANTIZED, description="dequantized | high_precision")

    @field_validator("backward_override", mode="before")
    @classmethod
    def _none_string(cls, value):
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        return value

    def _check_combinations(self) -> None:
        if self.backward_override is None:
            raise ValueError(
                f"PerTokenScaling has no quantized backward, but {self._origin('backward_override')}. "
                "Fix: backward_override='dequantized' (the default) or 'high_precision' "
                "(NVTE_BACKWARD_OVERRIDE=dequantized|high_precision, or unset it)")
        if self.scale_format is ScaleFormat.UE8M0 and not self.round_sf:
            raise ValueError(
                f"{self._origin('scale_format')} needs power-of-two scales but "
                f"{self._origin('round_sf')}. Fix: set round_sf=True "
                "(FP_RECIPES_PER_TOKEN_ROUND_SF=1) or scale_format='fp32'")

    def _plan_operand(self, role: QuantizerRole) -> QuantizerSpec:
        if role.tensor is TensorKind.GRAD_OUTPUT:
            return high_precision_spec(role).replace(backward_override=self.backward_override)
        return QuantizerSpec(
            role=role,
            fmt=QFormat.E5M6 if self.fmt is PerTokenFormat.E5M6 else QFormat.E4M3,
            scaling=ScalingKind.PER_TOKEN,
            rowwise=True,
            columnwise=False,
            round_sf=self.round_sf,
            scale_format=self.scale_format.value,
            backward_override=self.backward_override,
        )

    def per_token(self) -> bool:
        return True


__all__ = ["PerTokenFormat", "PerTokenScaling", "ScaleFormat"]
