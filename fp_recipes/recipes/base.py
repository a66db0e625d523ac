"""The recipe base class: validation, env resolution, provenance, and the per-role plan.

A recipe is a frozen Pydantic model. Every value is resolved once, when the recipe is constructed:
an explicit argument wins, else the environment variable from :mod:`fp_recipes.recipes.env`, else
the field's default. ``recipe.provenance()`` says which of the three each field came from.

Unknown keyword arguments are errors that name the closest field (TransformerEngine silently drops
them), and string enums accept any case (``"mse"`` and ``"MSE"`` are the same error mode).
"""

from __future__ import annotations

import difflib
from enum import Enum
from typing import Any, ClassVar, Dict, Optional, Tuple

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from fp_recipes import _trace_ids

from fp_recipes.quantizers.roles import (
    QFormat,
    QuantizerRole,
    QuantizerSpec,
    TensorKind,
    high_precision_spec,
)


def none_from_string(value: Any) -> Any:
    """The string "none" (any case, surrounding spaces ignored) as None, for optional fields set from text (env, CLI)."""
    return None if isinstance(value, str) and value.strip().lower() == "none" else value


class CaseInsensitiveEnum(str, Enum):
    """A string enum that accepts its values in any case; ``str()`` gives the value."""

    @classmethod
    def _missing_(cls, value: object):
        if isinstance(value, str):
            folded = value.strip().lower()
            for member in cls:
                if member.value.lower() == folded or member.name.lower() == folded:
                    return member
        return None

    def __str__(self) -> str:
        return self.value


class Format(CaseInsensitiveEnum):
    """FP8 element formats of a recipe (TransformerEngine's ``Format`` names).

    HYBRID: E4M3 for the forward operands (activation, weight), E5M2 for gradients.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def for_tensor(self, tensor: TensorKind) -> QFormat:
        """The element format this recipe format gives ``tensor``."""
        if self is Format.E4M3:
            return QFormat.E4M3
        if self is Format.E5M2:
            return QFormat.E5M2
        return QFormat.E5M2 if TensorKind(tensor) is TensorKind.GRAD_OUTPUT else QFormat.E4M3


# A few TransformerEngine arguments have no fp_recipes counterpart; say so instead of "unknown".
_TE_ONLY_ARGUMENTS: Dict[str, str] = {
    "fp8_dpa": "fp_recipes does not quantize attention; drop the argument",
    "fp8_mha": "fp_recipes does not quantize attention; drop the argument",
    "scaling_factor_compute_algo": "custom scale functions are not supported; the scale is "
    "fp8_max / amax / 2**margin (see docs/recipes.md)",
    "fp4_format": "NVFP4 data is always E2M1; drop the argument",
    "interval": "TransformerEngine removed it too; drop the argument",
    "override_linear_precision": "use backward_override='high_precision' for a high-precision backward",
    **{f"fp8_quant_{t}": "per-tensor-kind QParams are not supported: Float8CurrentScaling's use_power_2_scales and "
                         "amax_epsilon apply to every tensor (NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES sets the first)"
       for t in ("fwd_inp", "fwd_weight", "bwd_grad")},
    **{f"fp8_gemm_{g}": f"use fast_accumulation (a subset of fprop, dgrad, wgrad): MMParams("
                        f"use_split_accumulator=False) for {g} is fast_accumulation including '{g}'"
       for g in ("fprop", "dgrad", "wgrad")},
}


def _value_repr(value: Any) -> str:
    if isinstance(value, Format):
        return f"Format.{value.name}"
    if isinstance(value, Enum):
        return repr(value.value)
    return repr(value)


class Recipe(BaseModel):
    """Base of all recipes. Subclasses declare fields and implement :meth:`_plan_operand`."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def model_post_init(self, context: Any) -> None:
        _trace_ids.register(self)  # (torch < 2.13: a compiled module's recipe is looked up by id)

    def __copy__(self) -> "Recipe":
        new = super().__copy__()
        _trace_ids.register(new)
        return new

    def __deepcopy__(self, memo: Optional[Dict[int, Any]] = None) -> "Recipe":
        new = super().__deepcopy__(memo)
        _trace_ids.register(new)
        return new

    #: Name used by ``FP_RECIPES_RECIPE`` (delayed | current | nvfp4 | per_token).
    recipe_name: ClassVar[str] = ""

    # Plain defaults, not default_factory: Pydantic inspects factories on every construction.
    _provenance: Optional[Dict[str, str]] = PrivateAttr(default=None)
    _plans: Optional[Dict[QuantizerRole, QuantizerSpec]] = PrivateAttr(default=None)

    # ------------------------------------------------------------------ construction
    @model_validator(mode="wrap")
    @classmethod
    def _resolve_and_validate(cls, data: Any, handler: Any) -> "Recipe":
        if cls is Recipe:
            raise TypeError("Recipe is the abstract base; build DelayedScaling, Float8CurrentScaling, "
                            "NVFP4BlockScaling or PerTokenScaling")
        if not isinstance(data, dict):  # e.g. model_validate(an instance): nothing to resolve
            return handler(data)
        cls._reject_unknown_keywords(data)
        from .env import resolve_env, warn_unknown_env

        warn_unknown_env()
        env_values, env_sources = resolve_env(cls.__name__, given=set(data))
        instance = handler({**env_values, **data})
        instance._provenance = {
            name: "argument" if name in data else env_sources.get(name, "default")
            for name in cls.model_fields
        }
        instance._check_combinations()
        return instance

    @classmethod
    def _reject_unknown_keywords(cls, data: Dict[str, Any]) -> None:
        fields = list(cls.model_fields)
        for key in data:
            if key in cls.model_fields:
                continue
            msg = f"{cls.__name__}() got an unknown keyword argument {key!r}"
            if key in _TE_ONLY_ARGUMENTS:
                msg += f" (a TransformerEngine argument: {_TE_ONLY_ARGUMENTS[key]})"
            close = [] if key in _TE_ONLY_ARGUMENTS else difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
            if close:
                msg += f"; did you mean {close[0]!r}?"
            msg += f" Fields of {cls.__name__}: {', '.join(fields)}"
            raise ValueError(msg)

    def _check_combinations(self) -> None:
        """Reject option combinations that cannot work together (subclasses extend)."""

    def _origin(self, field: str) -> str:
        """``field=value`` plus where it came from, for error messages."""
        source = (self._provenance or {}).get(field, "argument")
        where = "" if source == "argument" else f" (from {source})"
        return f"{field}={_value_repr(getattr(self, field))}{where}"

    # ------------------------------------------------------------------ identity
    def _key(self) -> Tuple[Any, ...]:
        return (type(self),) + tuple(getattr(self, f) for f in type(self).model_fields)

    def __eq__(self, other: object) -> bool:
        """Equal when the type and every field agree (provenance is not part of the value)."""
        if not isinstance(other, Recipe):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        args = ", ".join(f"{f}={_value_repr(getattr(self, f))}" for f in type(self).model_fields)
        return f"{type(self).__name__}({args})"

    __str__ = __repr__

    # ------------------------------------------------------------------ provenance and copies
    def provenance(self) -> Dict[str, str]:
        """field -> ``"default"`` | ``"env NAME=value"`` | ``"argument"``."""
        return dict(self._provenance or {})

    def describe(self) -> str:
        """One line per field: value and where it came from (for logs)."""
        lines = [type(self).__name__]
        width = max(len(f) for f in type(self).model_fields)
        for f in type(self).model_fields:
            lines.append(f"  {f:<{width}} = {_value_repr(getattr(self, f)):<16} "
                         f"[{(self._provenance or {}).get(f, 'argument')}]")
        return "\n".join(lines)

    def model_copy(self, *, update: Optional[Dict[str, Any]] = None,
                   deep: bool = False) -> "Recipe":
        """A copy with ``update`` applied and VALIDATED (Pydantic's own copy skips validation)."""
        if not update:
            return super().model_copy(deep=deep)
        values = {f: getattr(self, f) for f in type(self).model_fields}
        values.update(update)
        new = type(self)(**values)
        new._provenance = {
            f: "argument" if f in update else (self._provenance or {}).get(f, "argument")
            for f in type(self).model_fields
        }
        return new

    def replace(self, **changes: Any) -> "Recipe":
        """``recipe.replace(margin=1)``: a validated copy with some fields changed."""
        return self.model_copy(update=changes)

    # ------------------------------------------------------------------ type-tagged configs
    def to_config(self) -> Dict[str, Any]:
        """JSON-ready dict that names the recipe: ``{"recipe": "nvfp4", <fields>}``."""
        return {"recipe": self.recipe_name, **self.model_dump(mode="json")}

    @staticmethod
    def from_config(config: Dict[str, Any]) -> "Recipe":
        """Inverse of :meth:`to_config` (for checkpoints and run configs of any recipe kind)."""
        from . import RECIPES

        fields = dict(config)
        name = str(fields.pop("recipe", "")).lower()
        if name not in RECIPES:
            raise ValueError(f"Recipe.from_config: 'recipe' must be one of {', '.join(RECIPES)}, "
                             f"got {config.get('recipe')!r}")
        return RECIPES[name](**fields)

    # ------------------------------------------------------------------ the plan
    def plan(self, role: QuantizerRole) -> QuantizerSpec:
        """Exactly how the operand ``role`` is quantized under this recipe.

        Outputs and input-gradients (``output``, ``grad_input``) stay in high precision.
        """
        if not isinstance(role, QuantizerRole):
            raise TypeError(f"{type(self).__name__}.plan() needs a QuantizerRole, got {role!r}")
        if self._plans is None:
            self._plans = {}
        spec = self._plans.get(role)
        if spec is None:  # specs are frozen and recipes immutable: plan each role once
            if role.tensor in (TensorKind.OUTPUT, TensorKind.GRAD_INPUT):
                spec = high_precision_spec(role).replace(
                    backward_override=getattr(self, "backward_override", None))  # every spec carries it
            else:
                spec = self._plan_operand(role)
            self._plans[role] = spec
        return spec

    def _plan_operand(self, role: QuantizerRole) -> QuantizerSpec:  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------ TE-style kind queries
    def delayed(self) -> bool:
        return False

    def float8_current_scaling(self) -> bool:
        return False

    def float8_per_tensor_scaling(self) -> bool:
        return self.delayed() or self.float8_current_scaling()

    def float8_block_scaling(self) -> bool:
        return False

    def mxfp8(self) -> bool:
        return False

    def nvfp4(self) -> bool:
        return False

    def per_token(self) -> bool:
        return False


__all__ = ["CaseInsensitiveEnum", "Format", "Recipe"]
