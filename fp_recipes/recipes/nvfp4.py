"""NVFP4 (E2M1 data, E4M3 per-16 block scales, FP32 global amax) training recipe.

The plan follows TransformerEngine's NVFP4 recipe: weights in 16x16 tiles, activations and output
gradients in 1x16 blocks; stochastic rounding on output gradients; the random Hadamard transform
on the columnwise (wgrad) copies of activations and output gradients; optional row-scaled
activations (which, as in TE, need RHT, 2-D quantization and stochastic rounding off) and
4over6 block scale selection. Runs everywhere: natively on sm_100+, exactly emulated elsewhere
(Hopper included).
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

from .base import CaseInsensitiveEnum, Recipe, none_from_string


class FourOverSixScope(CaseInsensitiveEnum):
    """Which tensors a 4over6 option covers. Gradients are never covered."""

    NONE = "none"
    WEIGHTS = "weights"
    ACTIVATIONS = "activations"
    ALL = "all"

    def covers(self, tensor: TensorKind) -> bool:
        tensor = TensorKind(tensor)
        if tensor is TensorKind.WEIGHT:
            return self in (FourOverSixScope.WEIGHTS, FourOverSixScope.ALL)
        if tensor is TensorKind.ACTIVATION:
            return self in (FourOverSixScope.ACTIVATIONS, FourOverSixScope.ALL)
        return False


class ErrMode(CaseInsensitiveEnum):
    MAE = "MAE"
    MSE = "MSE"


class NVFP4BlockScaling(Recipe):
    """NVFP4 training (TransformerEngine's ``NVFP4BlockScaling``, same field names)."""

    recipe_name: ClassVar[str] = "nvfp4"

    disable_rht: bool = Field(False, description="no random Hadamard transform on wgrad copies")
    disable_stochastic_rounding: bool = Field(False, description="round gradients to nearest")
    disable_2d_quantization: bool = Field(False, description="weights in 1x16 blocks, not 16x16")
    row_scaled_activation: bool = Field(False, description="per-row global amax on the "
                                        "activation's rowwise copy")
    nvfp4_4over6: FourOverSixScope = Field(FourOverSixScope.NONE,
                                           description="none | weights | activations | all")
    nvfp4_4over6_e4m3_use_256: FourOverSixScope = Field(
        FourOverSixScope.ALL, description="4over6 tensors whose E4M3 bound is 256 instead of 448")
    nvfp4_4over6_err_mode: ErrMode = Field(ErrMode.MAE, description="MAE | MSE")
    nvfp4_4over6_err_use_fast_math: bool = Field(False, description="4over6 error in the FP16 "
                                                 "product domain")
    backward_override: Optional[BackwardOverride] = Field(
        None, description="None | high_precision | dequantized: run dgrad/wgrad in high precision")

    @field_validator("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256", mode="before")
    @classmethod
    def _scope_none(cls, value):
        return FourOverSixScope.NONE if value is None else value

    @field_validator("backward_override", mode="before")
    @classmethod
    def _none_string(cls, value):
        return none_from_string(value)

    # ------------------------------------------------------------------ effective per-tensor options
    @property
    def _has_backward_copies(self) -> bool:
        return self.backward_override is None

    def _four_over_six(self, tensor: TensorKind) -> bool:
        return self.nvfp4_4over6.covers(tensor)

    def _rht_columnwise(self, tensor: TensorKind) -> bool:
        return (not self.disable_rht and self._has_backward_copies
                and tensor in (TensorKind.ACTIVATION, TensorKind.GRAD_OUTPUT))

    def _check_combinations(self) -> None:
        # The activation is the only row-scaled and (besides weights) the only 4over6 tensor that
        # can meet RHT: on its columnwise copy, which exists unless backward_override is set.
        act = TensorKind.ACTIVATION
        fix_rht = ("set disable_rht=True (NVTE_NVFP4_DISABLE_RHT=1) or backward_override="
                   "'dequantized'/'high_precision' (NVTE_BACKWARD_OVERRIDE)")
        needs = ("row-scaled activations need RHT, 2-D quantization and stochastic rounding all "
                 "off, as in TransformerEngine")
        if self.row_scaled_activation and self._rht_columnwise(act):
            raise ValueError(
                f"{self._origin('row_scaled_activation')} cannot be combined with "
                f"{self._origin('disable_rht')}: the random Hadamard transform on the activation's "
                f"wgrad copy needs a per-tensor amax ({needs}). Fix: {fix_rht}, or "
                f"row_scaled_activation=False")
        # 2-D tiles land only on weights and stochastic rounding only on output gradients, so
        # neither shares a tensor with the row-scaled activation. The recipe still rejects both,
        # for TransformerEngine parity (a ported TE script sets all three disable flags) and
        # because row-scaled mode is an fprop-only mode whose GEMMs are tested against plain 1x16,
        # round-to-nearest operands. Without quantized gradients (backward_override) there is no
        # stochastic rounding to reject.
        if self.row_scaled_activation and not self.disable_2d_quantization:
            raise ValueError(
                f"{self._origin('row_scaled_activation')} cannot be combined with "
                f"{self._origin('disable_2d_quantization')}: 16x16 weight tiles are not supported "
                f"with row-scaled activations ({needs}). Fix: set disable_2d_quantization=True "
                f"(NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1), or row_scaled_activation=False")
        if (self.row_scaled_activation and not self.disable_stochastic_rounding
                and self._has_backward_copies):
            raise ValueError(
                f"{self._origin('row_scaled_activation')} cannot be combined with "
                f"{self._origin('disable_stochastic_rounding')}: stochastic rounding of the output "
                f"gradients is not supported with row-scaled activations ({needs}). Fix: set "
                f"disable_stochastic_rounding=True (NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1) or "
                f"backward_override='dequantized'/'high_precision' (NVTE_BACKWARD_OVERRIDE), or "
                f"row_scaled_activation=False")
        if self._four_over_six(act) and self._rht_columnwise(act):
            raise ValueError(
                f"{self._origin('nvfp4_4over6')} applies 4over6 to activations, which cannot be "
                f"combined with the random Hadamard transform on their wgrad copy "
                f"({self._origin('disable_rht')}). Fix: {fix_rht}, or nvfp4_4over6='weights'")

    # ------------------------------------------------------------------ plan
    def _plan_operand(self, role: QuantizerRole) -> QuantizerSpec:
        tensor = role.tensor
        override = self.backward_override
        if tensor is TensorKind.GRAD_OUTPUT and override is not None:
            return high_precision_spec(role).replace(backward_override=override)
        four_over_six = self._four_over_six(tensor)
        use_256 = four_over_six and self.nvfp4_4over6_e4m3_use_256.covers(tensor)
        row_scaled = tensor is TensorKind.ACTIVATION and self.row_scaled_activation
        return QuantizerSpec(
            role=role,
            fmt=QFormat.NVFP4,
            scaling=ScalingKind.NVFP4,
            rowwise=True,
            columnwise=self._has_backward_copies,
            block_2d=tensor is TensorKind.WEIGHT and not self.disable_2d_quantization,
            row_scaled=row_scaled,
            # A row-scaled amax is per token: it must not be MAX-reduced across ranks.
            reduce_amax=not row_scaled,
            four_over_six=four_over_six,
            e4m3_max=256 if use_256 else 448,
            err_mode=self.nvfp4_4over6_err_mode.value if four_over_six else "MAE",
            err_fast_math=self.nvfp4_4over6_err_use_fast_math if four_over_six else False,
            rht_columnwise=self._rht_columnwise(tensor),
            stochastic_rounding=(tensor is TensorKind.GRAD_OUTPUT
                                 and not self.disable_stochastic_rounding),
            backward_override=override,
        )

    def nvfp4(self) -> bool:
        return True


__all__ = ["ErrMode", "FourOverSixScope", "NVFP4BlockScaling"]
