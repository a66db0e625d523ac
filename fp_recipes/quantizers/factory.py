"""Build the quantizer a :class:`QuantizerSpec` describes (the one place that maps spec -> class)."""

from __future__ import annotations

from typing import Optional

from .base import Quantizer
from .roles import QuantizerSpec, ScalingKind


def make_quantizer(spec: QuantizerSpec) -> Optional[Quantizer]:
    """The quantizer for ``spec``; None when the operand stays in high precision."""
    kind = spec.scaling
    if kind is ScalingKind.NONE:
        return None
    if kind is ScalingKind.DELAYED:
        from .float8 import Float8Quantizer

        return Float8Quantizer(spec)
    if kind is ScalingKind.CURRENT:
        from .float8 import Float8CurrentScalingQuantizer

        return Float8CurrentScalingQuantizer(spec)
    if kind is ScalingKind.NVFP4:
        from .nvfp4 import NVFP4Quantizer

        return NVFP4Quantizer(spec)
    if kind is ScalingKind.PER_TOKEN:
        from .per_token import PerTokenQuantizer

        return PerTokenQuantizer(spec)
    raise ValueError(f"make_quantizer: no quantizer for scaling kind {kind!r}")
