"""FP8 per-tensor recipes: delayed scaling (scale from the amax history) and current scaling."""

from __future__ import annotations

import math
from typing import ClassVar, Optional, Tuple

import torch
from pydantic import Field, field_validator

from fp_recipes.quantizers.roles import (
    BackwardOverride,
    QuantizerRole,
    QuantizerSpec,
    ScalingKind,
    TensorKind,
    high_precision_spec,
)

from .base import CaseInsensitiveEnum, Format, Recipe, none_from_string
from .env import GEMMS, parse_subset


#: The longest amax history: TransformerEngine's default is 1024 steps and users go up to a few
#: thousand; 65536 steps is more history than any schedule reacts to, and every step scans the whole
#: history of every delayed-scaling quantizer (4 bytes a step each). A longer one is a typo (10**9 steps
#: would allocate 4 GB per quantizer).
MAX_AMAX_HISTORY_LEN = 65536

# (largest finite value, smallest normal value) of the FP8 formats
_FP8_RANGE = {"E4M3": (448.0, 2.0 ** -6), "E5M2": (57344.0, 2.0 ** -14)}


def max_margin(fmt: Format) -> int:
    """The largest margin for which ``scale = fmt_max / amax / 2**margin`` still maps a tensor's amax to
    at least the smallest normal value of every format the recipe uses (E4M3: 14, E5M2: 29, HYBRID:
    14): a larger margin pushes the largest values into the subnormals (few or no significant bits)
    or to zero, whatever the data."""
    names = ("E4M3", "E5M2") if fmt is Format.HYBRID else (fmt.value,)
    return min(int(math.floor(math.log2(_FP8_RANGE[n][0] / _FP8_RANGE[n][1]))) for n in names)


class AmaxComputeAlgo(CaseInsensitiveEnum):
    MAX = "max"
    MOST_RECENT = "most_recent"


class _Float8Recipe(Recipe):
    """Shared by the FP8 per-tensor recipes: the format and the backward override."""

    fp8_format: Format = Field(Format.HYBRID, description="E4M3 | E5M2 | HYBRID (E4M3 forward, "
                               "E5M2 gradients)")
    backward_override: Optional[BackwardOverride] = Field(
        None, description="None | high_precision | dequantized: run dgrad/wgrad in high precision")
    fast_accumulation: Tuple[str, ...] = Field(
        ("fprop",), description="the GEMMs (fprop, dgrad, wgrad; 'all', 'none') that accumulate in the "
        "tensor cores' fast mode: faster on Hopper, fewer accumulator bits (default fprop, as TE and torchao)")

    _scaling: ClassVar[ScalingKind]

    @field_validator("backward_override", mode="before")
    @classmethod
    def _none_string(cls, value):
        return none_from_string(value)

    @field_validator("fast_accumulation", mode="before")
    @classmethod
    def _gemm_names(cls, value):
        """A comma-separated string ("fprop,dgrad", "all", "none") or names, kept as fprop/dgrad/wgrad in order."""
        if isinstance(value, str):
            text = value
        elif isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
            text = ",".join(value) if value else "none"
        else:
            raise ValueError(f"fast_accumulation={value!r} is not a list of GEMM names; allowed: a subset of "
                             f"{', '.join(GEMMS)} (a comma-separated string or a sequence), or 'all' / 'none'")
        gemms = parse_subset(text, GEMMS)
        if gemms is None:
            raise ValueError(f"fast_accumulation={value!r} names an unknown or repeated GEMM; allowed: a subset "
                             f"of {', '.join(GEMMS)}, or 'all' / 'none' (TransformerEngine's "
                             "use_split_accumulator=False is fast accumulation)")
        return gemms

    def _extra_spec_fields(self) -> dict:
        return {}

    def _plan_operand(self, role: QuantizerRole) -> QuantizerSpec:
        override = self.backward_override
        if override is not None and role.tensor is TensorKind.GRAD_OUTPUT:
            return high_precision_spec(role).replace(backward_override=override)
        return QuantizerSpec(
            role=role,
            fmt=self.fp8_format.for_tensor(role.tensor),
            scaling=self._scaling,
            rowwise=True,
            # The columnwise copy feeds dgrad (weight) and wgrad (activation, grad_output); a
            # high-precision backward needs none.
            columnwise=override is None,
            backward_override=override,
            **self._extra_spec_fields(),
        )


class DelayedScaling(_Float8Recipe):
    """FP8 with per-tensor scales computed from the amax history of earlier steps.

    scale = fp8_max / amax_ref / 2**margin, with amax_ref the max of the last
    ``amax_history_len`` amaxes ("max") or the latest one ("most_recent"). With ``reduce_amax``
    (the default) the amaxes are MAX-reduced first over the autocast's ``amax_reduction_group``, or,
    when none is given and torch.distributed is initialised with more than one rank, over the default
    world group (as TransformerEngine does), so every rank keeps the same scales;
    ``reduce_amax=False`` keeps each rank's own. A NaN/Inf amax counts as 0 (it never freezes the scale)
    and draws one warning per tensor.
    """

    recipe_name: ClassVar[str] = "delayed"
    _scaling: ClassVar[ScalingKind] = ScalingKind.DELAYED

    margin: int = Field(0, ge=0, description="scale = fp8_max / amax / 2**margin")
    amax_history_len: int = Field(1024, ge=1, description="steps of amax history kept")
    amax_compute_algo: AmaxComputeAlgo = Field(AmaxComputeAlgo.MAX,
                                               description="max | most_recent")
    reduce_amax: bool = Field(True, description="MAX-reduce amaxes across the reduction group (default: "
                              "the world group when torch.distributed is initialised)")

    @field_validator("amax_history_len")
    @classmethod
    def _history_bound(cls, value: int) -> int:
        if value > MAX_AMAX_HISTORY_LEN:
            raise ValueError(
                f"amax_history_len={value} is too long: allowed 1 <= amax_history_len <= "
                f"{MAX_AMAX_HISTORY_LEN}. Each delayed-scaling quantizer keeps and scans that many FP32 "
                f"amaxes every step ({value * 4 / 2 ** 20:.0f} MiB each here); TransformerEngine's "
                "default is 1024")
        return value

    def _check_combinations(self) -> None:
        super()._check_combinations()
        limit = max_margin(self.fp8_format)
        if self.margin > limit:
            names = ("E4M3", "E5M2") if self.fp8_format is Format.HYBRID else (self.fp8_format.value,)
            worst = min(names, key=lambda n: math.log2(_FP8_RANGE[n][0] / _FP8_RANGE[n][1]))
            fmax, fmin = _FP8_RANGE[worst]
            raise ValueError(
                f"DelayedScaling: {self._origin('margin')} is too large for "
                f"{self._origin('fp8_format')}: the scale fp8_max / amax / 2**margin maps a tensor's amax to "
                f"{fmax:g} * 2**-{self.margin} = {fmax * 2.0 ** -self.margin:.3g}, below {worst}'s smallest "
                f"normal value {fmin:g}, so the largest values lose their precision or round to zero (and past "
                f"margin 127 the scale is not a finite FP32). Allowed: 0 <= margin <= {limit} for this format "
                "(a margin is headroom of a few binades; TransformerEngine's default is 0)")

    @field_validator("amax_compute_algo", mode="before")
    @classmethod
    def _no_callables(cls, value):
        if callable(value) and not isinstance(value, str):
            raise ValueError("amax_compute_algo must be 'max' or 'most_recent'; custom callables "
                             "(allowed by TransformerEngine) are not supported")
        return value

    def _extra_spec_fields(self) -> dict:
        return {
            "margin": self.margin,
            "amax_history_len": self.amax_history_len,
            "amax_compute_algo": self.amax_compute_algo.value,
            "reduce_amax": self.reduce_amax,
        }

    def delayed(self) -> bool:
        return True


class Float8CurrentScaling(_Float8Recipe):
    """FP8 with a per-tensor scale computed from the tensor's own amax at each cast."""

    recipe_name: ClassVar[str] = "current"
    _scaling: ClassVar[ScalingKind] = ScalingKind.CURRENT

    use_power_2_scales: bool = Field(False, description="round scales down to a power of two")
    amax_epsilon: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                                description="floor of the amax a scale is computed from")

    @field_validator("amax_epsilon")
    @classmethod
    def _epsilon_is_fp32(cls, value: float) -> float:
        # the floor is applied as an FP32 value: past FLT_MAX it would be +Inf (and every scale 0)
        if value > torch.finfo(torch.float32).max:
            raise ValueError(
                f"amax_epsilon={value!r} is not representable in FP32 (the amax and the scale are FP32): "
                f"allowed 0 <= amax_epsilon <= {torch.finfo(torch.float32).max:.7g}; it is a floor for tiny "
                "amaxes, typically 0 or around 1e-12")
        return value

    def _extra_spec_fields(self) -> dict:
        return {"use_power_2_scales": self.use_power_2_scales, "amax_epsilon": self.amax_epsilon}

    def float8_current_scaling(self) -> bool:
        return True


__all__ = ["AmaxComputeAlgo", "DelayedScaling", "Float8CurrentScaling", "MAX_AMAX_HISTORY_LEN", "max_margin"]
