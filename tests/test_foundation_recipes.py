"""Recipes: fields, validation, case-insensitive enums, unknown keywords, identity, JSON, provenance."""

from __future__ import annotations

import json
import pickle

import pytest
from pydantic import ValidationError

import fp_recipes
from fp_recipes import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    NVFP4BlockScaling,
    PerTokenScaling,
    Recipe,
)
from fp_recipes.quantizers.roles import BackwardOverride
from fp_recipes.recipes import AmaxComputeAlgo, ErrMode, FourOverSixScope, PerTokenFormat, ScaleFormat

ALL = [DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling]

# Every field of every recipe: (default, a non-default value that is valid on its own).
FIELDS = {
    DelayedScaling: {
        "fp8_format": (Format.HYBRID, Format.E4M3),
        "margin": (0, 3),
        "amax_history_len": (1024, 16),
        "amax_compute_algo": (AmaxComputeAlgo.MAX, AmaxComputeAlgo.MOST_RECENT),
        "reduce_amax": (True, False),
        "backward_override": (None, BackwardOverride.DEQUANTIZED),
        "fast_accumulation": (("fprop",), ("fprop", "dgrad", "wgrad")),
    },
    Float8CurrentScaling: {
        "fp8_format": (Format.HYBRID, Format.E5M2),
        "use_power_2_scales": (False, True),
        "amax_epsilon": (0.0, 1e-6),
        "backward_override": (None, BackwardOverride.HIGH_PRECISION),
        "fast_accumulation": (("fprop",), ()),
    },
    NVFP4BlockScaling: {
        "disable_rht": (False, True),
        "disable_stochastic_rounding": (False, True),
        "disable_2d_quantization": (False, True),
        "row_scaled_activation": (False, None),  # needs RHT/2D/SR off: tested separately
        "nvfp4_4over6": (FourOverSixScope.NONE, FourOverSixScope.WEIGHTS),
        "nvfp4_4over6_e4m3_use_256": (FourOverSixScope.ALL, FourOverSixScope.NONE),
        "nvfp4_4over6_err_mode": (ErrMode.MAE, ErrMode.MSE),
        "nvfp4_4over6_err_use_fast_math": (False, True),
        "backward_override": (None, BackwardOverride.DEQUANTIZED),
    },
    PerTokenScaling: {
        "fmt": (PerTokenFormat.E5M6, PerTokenFormat.E4M3),
        "round_sf": (False, True),
        "scale_format": (ScaleFormat.FP32, None),  # ue8m0 needs round_sf: tested separately
        "backward_override": (BackwardOverride.DEQUANTIZED, BackwardOverride.HIGH_PRECISION),
    },
}


def test_field_table_is_complete():
    for cls in ALL:
        assert set(FIELDS[cls]) == set(cls.model_fields), cls


@pytest.mark.parametrize("cls,field", [(c, f) for c in ALL for f in FIELDS[c]])
def test_every_field_default_and_explicit_value(cls, field):
    default, other = FIELDS[cls][field]
    r = cls()
    assert getattr(r, field) == default
    assert r.provenance()[field] == "default"
    if other is not None:
        r2 = cls(**{field: other})
        assert getattr(r2, field) == other
        assert r2.provenance()[field] == "argument"
        assert r2 != r


def test_public_exports():
    for name in ["Recipe", "Format", "DelayedScaling", "Float8CurrentScaling", "NVFP4BlockScaling",
                 "PerTokenScaling", "recipe_from_env"]:
        assert getattr(fp_recipes, name) is getattr(fp_recipes.recipes, name)
    for cls in ALL:
        assert issubclass(cls, Recipe)


@pytest.mark.parametrize("value", ["hybrid", "HYBRID", "Hybrid", Format.HYBRID])
def test_format_case_insensitive(value):
    assert DelayedScaling(fp8_format=value).fp8_format is Format.HYBRID


def test_enums_case_insensitive():
    r = NVFP4BlockScaling(nvfp4_4over6="WEIGHTS", nvfp4_4over6_err_mode="mse",
                          nvfp4_4over6_e4m3_use_256="Activations", backward_override="Dequantized")
    assert r.nvfp4_4over6 is FourOverSixScope.WEIGHTS
    assert r.nvfp4_4over6_err_mode is ErrMode.MSE  # TE's constructor rejects lower case
    assert r.nvfp4_4over6_e4m3_use_256 is FourOverSixScope.ACTIVATIONS
    assert r.backward_override is BackwardOverride.DEQUANTIZED
    assert DelayedScaling(amax_compute_algo="MOST_RECENT").amax_compute_algo is AmaxComputeAlgo.MOST_RECENT
    assert PerTokenScaling(fmt="E4M3").fmt is PerTokenFormat.E4M3
    assert NVFP4BlockScaling(nvfp4_4over6=None).nvfp4_4over6 is FourOverSixScope.NONE
    assert NVFP4BlockScaling(backward_override="none").backward_override is None


@pytest.mark.parametrize("cls,kwargs", [
    (DelayedScaling, {"fp8_format": "E3M4"}),
    (DelayedScaling, {"margin": -1}),
    (DelayedScaling, {"margin": "two"}),
    (DelayedScaling, {"amax_history_len": 0}),
    (DelayedScaling, {"amax_compute_algo": "mean"}),
    (DelayedScaling, {"amax_compute_algo": max}),
    (Float8CurrentScaling, {"amax_epsilon": -1.0}),
    (Float8CurrentScaling, {"amax_epsilon": float("nan")}),
    (Float8CurrentScaling, {"amax_epsilon": float("inf")}),
    (NVFP4BlockScaling, {"nvfp4_4over6": "gradients"}),
    (NVFP4BlockScaling, {"nvfp4_4over6_e4m3_use_256": "some"}),
    (NVFP4BlockScaling, {"nvfp4_4over6_err_mode": "MAX"}),
    (NVFP4BlockScaling, {"backward_override": "fp32"}),
    (PerTokenScaling, {"fmt": "e2m1"}),
    (PerTokenScaling, {"scale_format": "e8m0"}),
    (PerTokenScaling, {"backward_override": None}),
])
def test_bad_values_rejected(cls, kwargs):
    with pytest.raises(ValidationError) as info:
        cls(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


@pytest.mark.parametrize("cls,typo,expected", [
    (DelayedScaling, "margn", "margin"),
    (DelayedScaling, "amax_history_length", "amax_history_len"),
    (Float8CurrentScaling, "use_power2_scales", "use_power_2_scales"),
    (NVFP4BlockScaling, "disable_rht_", "disable_rht"),
    (NVFP4BlockScaling, "nvfp4_4over6_err_mod", "nvfp4_4over6_err_mode"),
    (PerTokenScaling, "round_scale", "round_sf"),
])
def test_unknown_keyword_suggests_closest_field(cls, typo, expected):
    with pytest.raises(ValueError) as info:
        cls(**{typo: 1})
    msg = str(info.value)
    assert f"unknown keyword argument {typo!r}" in msg
    assert f"did you mean {expected!r}" in msg


def test_te_only_argument_is_explained():
    with pytest.raises(ValueError, match="does not quantize attention"):
        DelayedScaling(fp8_dpa=False)


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
@pytest.mark.parametrize("name,points_to", [("fp8_gemm_fprop", "fast_accumulation"),
                                            ("fp8_gemm_dgrad", "fast_accumulation including 'dgrad'"),
                                            ("fp8_gemm_wgrad", "fast_accumulation including 'wgrad'"),
                                            ("fp8_quant_fwd_inp", "use_power_2_scales and amax_epsilon"),
                                            ("fp8_quant_bwd_grad", "use_power_2_scales and amax_epsilon")])
def test_te_gemm_and_qparams_arguments_point_to_our_fields(cls, name, points_to):
    """TE's MMParams / QParams arguments: an error that names the field to use, and no misleading close match."""
    with pytest.raises(ValueError) as info:
        cls(**{name: object()})
    msg = str(info.value)
    assert "a TransformerEngine argument" in msg and points_to in msg
    assert "did you mean" not in msg


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_fast_accumulation_forms(cls):
    """A sequence, a comma-separated string, 'all' and 'none' (any case, any order) give the same normalised tuple;
    a typo, a repeat or a non-string is an error that says what is allowed."""
    assert cls(fast_accumulation=["wgrad", "fprop"]).fast_accumulation == ("fprop", "wgrad")
    assert cls(fast_accumulation=" WGRAD , fprop ").fast_accumulation == ("fprop", "wgrad")
    assert cls(fast_accumulation="ALL").fast_accumulation == ("fprop", "dgrad", "wgrad")
    assert cls(fast_accumulation="none").fast_accumulation == cls(fast_accumulation=[]).fast_accumulation == ()
    r = cls(fast_accumulation="dgrad")
    assert Recipe.from_config(json.loads(json.dumps(r.to_config()))) == r
    for bad in ("fprop,dgard", "fprop,fprop", "fprop;dgrad", 3, ["fprop", 1]):
        with pytest.raises(ValidationError, match="allowed: a subset of fprop, dgrad, wgrad"):
            cls(fast_accumulation=bad)


def test_frozen():
    r = DelayedScaling()
    with pytest.raises(ValidationError):
        r.margin = 2


@pytest.mark.parametrize("cls", ALL)
def test_hash_eq_repr(cls):
    a, b = cls(), cls()
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert repr(a).startswith(cls.__name__ + "(")
    for field in cls.model_fields:
        assert f"{field}=" in repr(a)
    assert str(a) == repr(a)


def test_equality_ignores_provenance(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_DELAYED_MARGIN", "2")
    from_env = DelayedScaling()
    explicit = DelayedScaling(margin=2)
    assert from_env.provenance()["margin"] != explicit.provenance()["margin"]
    assert from_env == explicit and hash(from_env) == hash(explicit)
    assert DelayedScaling() != Float8CurrentScaling()


def test_repr_is_evaluable():
    r = NVFP4BlockScaling(nvfp4_4over6="weights", nvfp4_4over6_err_mode="MSE", disable_rht=True)
    ns = {"NVFP4BlockScaling": NVFP4BlockScaling, "Format": Format}
    assert eval(repr(r), ns) == r
    d = DelayedScaling(fp8_format="e4m3", margin=1)
    assert eval(repr(d), {"DelayedScaling": DelayedScaling, "Format": Format}) == d


VARIANTS = [
    DelayedScaling(fp8_format="E5M2", margin=2, amax_history_len=7, amax_compute_algo="most_recent",
                   reduce_amax=False, backward_override="high_precision"),
    Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1e-3),
    NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True,
                      disable_stochastic_rounding=True, row_scaled_activation=True, nvfp4_4over6="all",
                      nvfp4_4over6_e4m3_use_256="weights", nvfp4_4over6_err_mode="MSE",
                      nvfp4_4over6_err_use_fast_math=True),
    PerTokenScaling(fmt="e4m3", round_sf=True, scale_format="ue8m0"),
] + [cls() for cls in ALL]


@pytest.mark.parametrize("recipe", VARIANTS, ids=repr)
def test_json_round_trip(recipe):
    text = recipe.model_dump_json()
    back = type(recipe).model_validate_json(text)
    assert back == recipe
    data = recipe.model_dump()
    assert type(recipe)(**data) == recipe
    assert json.loads(text) == recipe.model_dump(mode="json")
    assert all(v == "argument" for v in back.provenance().values())


@pytest.mark.parametrize("recipe", VARIANTS, ids=repr)
def test_pickle_round_trip(recipe):
    back = pickle.loads(pickle.dumps(recipe))
    assert back == recipe and back.provenance() == recipe.provenance()


def test_model_copy_validates_and_keeps_provenance(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_DELAYED_MARGIN", "3")
    r = DelayedScaling()
    r2 = r.model_copy(update={"amax_history_len": 8})
    assert r2.margin == 3 and r2.amax_history_len == 8
    assert r2.provenance()["margin"] == "env FP_RECIPES_DELAYED_MARGIN=3"
    assert r2.provenance()["amax_history_len"] == "argument"
    assert r.replace(margin=1).margin == 1
    with pytest.raises(ValidationError):
        r.replace(margin=-1)
    with pytest.raises(ValidationError, match="disable_rht"):
        NVFP4BlockScaling().replace(row_scaled_activation=True)


def test_kind_queries():
    assert DelayedScaling().delayed() and DelayedScaling().float8_per_tensor_scaling()
    assert Float8CurrentScaling().float8_current_scaling()
    assert NVFP4BlockScaling().nvfp4() and not NVFP4BlockScaling().delayed()
    assert PerTokenScaling().per_token()
    assert not any(c().mxfp8() or c().float8_block_scaling() for c in ALL)


# ------------------------------------------------------------------ incompatible combinations
ROW_SCALED_OK = dict(row_scaled_activation=True, disable_rht=True, disable_2d_quantization=True,
                     disable_stochastic_rounding=True)  # what a TE user porting a script sets


def test_row_scaled_valid_only_with_rht_2d_sr_off():
    r = NVFP4BlockScaling(**ROW_SCALED_OK)
    assert r.row_scaled_activation
    # Each of the three disable flags alone is required.
    for flag in ("disable_rht", "disable_2d_quantization", "disable_stochastic_rounding"):
        with pytest.raises(ValueError, match=f"{flag}=False"):
            NVFP4BlockScaling(**{**ROW_SCALED_OK, flag: False})
    # Turning row scaling off makes every default valid again.
    assert NVFP4BlockScaling(**{**ROW_SCALED_OK, "row_scaled_activation": False})


def test_row_scaled_needs_rht_off():
    kw = dict(ROW_SCALED_OK, disable_rht=False)
    with pytest.raises(ValueError) as info:
        NVFP4BlockScaling(**kw)
    msg = str(info.value)
    assert "row_scaled_activation=True" in msg and "disable_rht=False" in msg
    assert "Fix" in msg and "NVTE_NVFP4_DISABLE_RHT=1" in msg and "row_scaled_activation=False" in msg
    # With a high-precision backward there is no wgrad copy, hence no RHT to clash with.
    for override in ("dequantized", "high_precision"):
        assert NVFP4BlockScaling(**kw, backward_override=override).row_scaled_activation


def test_row_scaled_needs_2d_off():
    kw = dict(ROW_SCALED_OK, disable_2d_quantization=False)
    with pytest.raises(ValueError) as info:
        NVFP4BlockScaling(**kw)
    msg = str(info.value)
    assert "row_scaled_activation=True" in msg and "disable_2d_quantization=False" in msg
    assert "Fix" in msg and "disable_2d_quantization=True" in msg
    assert "NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1" in msg and "row_scaled_activation=False" in msg
    # A high-precision backward does not help: the fprop weight would still be in 16x16 tiles.
    for override in ("dequantized", "high_precision"):
        with pytest.raises(ValueError, match="disable_2d_quantization=False"):
            NVFP4BlockScaling(**kw, backward_override=override)


def test_row_scaled_needs_sr_off_unless_backward_override():
    kw = dict(ROW_SCALED_OK, disable_stochastic_rounding=False)
    with pytest.raises(ValueError) as info:
        NVFP4BlockScaling(**kw)
    msg = str(info.value)
    assert "row_scaled_activation=True" in msg and "disable_stochastic_rounding=False" in msg
    assert "Fix" in msg and "disable_stochastic_rounding=True" in msg
    assert "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1" in msg and "row_scaled_activation=False" in msg
    assert "backward_override" in msg
    # No quantized gradients with a high-precision backward, hence no stochastic rounding.
    for override in ("dequantized", "high_precision"):
        r = NVFP4BlockScaling(**kw, backward_override=override)
        assert r.row_scaled_activation and not r.disable_stochastic_rounding


def test_row_scaled_rules_checked_in_order_rht_2d_sr():
    """With several conflicts the first error is RHT, then 2-D, then SR; each message says all
    three must be off so one fix round is enough."""
    for kw, first in [(dict(row_scaled_activation=True), "disable_rht=False"),
                      (dict(row_scaled_activation=True, disable_rht=True),
                       "disable_2d_quantization=False"),
                      (dict(row_scaled_activation=True, disable_rht=True,
                            disable_2d_quantization=True), "disable_stochastic_rounding=False")]:
        with pytest.raises(ValueError) as info:
            NVFP4BlockScaling(**kw)
        msg = str(info.value)
        assert first in msg
        assert "RHT, 2-D quantization and stochastic rounding all off" in msg


@pytest.mark.parametrize("scope", ["activations", "all"])
def test_4over6_on_activations_needs_rht_off(scope):
    with pytest.raises(ValueError) as info:
        NVFP4BlockScaling(nvfp4_4over6=scope)
    msg = str(info.value)
    assert f"nvfp4_4over6={scope!r}" in msg and "disable_rht=False" in msg and "Fix" in msg
    assert NVFP4BlockScaling(nvfp4_4over6=scope, disable_rht=True)
    assert NVFP4BlockScaling(nvfp4_4over6=scope, backward_override="dequantized")


def test_4over6_on_weights_combines_with_rht_sr_2d():
    r = NVFP4BlockScaling(nvfp4_4over6="weights")
    assert not r.disable_rht and not r.disable_stochastic_rounding and not r.disable_2d_quantization


def test_combination_error_names_env_source(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1")
    with pytest.raises(ValueError, match=r"from env NVTE_NVFP4_ROW_SCALED_ACTIVATION=1"):
        NVFP4BlockScaling()


@pytest.mark.parametrize("var,field", [
    ("NVTE_NVFP4_DISABLE_RHT", "disable_rht"),
    ("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "disable_2d_quantization"),
    ("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "disable_stochastic_rounding"),
])
def test_row_scaled_errors_name_env_sources(monkeypatch, var, field):
    """All four options from the environment, one disable flag set to 0: the error says where both
    clashing values came from."""
    monkeypatch.setenv("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1")
    for other in ("NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
                  "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"):
        monkeypatch.setenv(other, "0" if other == var else "1")
    with pytest.raises(ValueError) as info:
        NVFP4BlockScaling()
    msg = str(info.value)
    assert "row_scaled_activation=True (from env NVTE_NVFP4_ROW_SCALED_ACTIVATION=1)" in msg
    assert f"{field}=False (from env {var}=0)" in msg
    monkeypatch.setenv(var, "1")
    r = NVFP4BlockScaling()
    assert r.row_scaled_activation and r.provenance()[field] == f"env {var}=1"


def test_per_token_ue8m0_needs_round_sf():
    with pytest.raises(ValueError) as info:
        PerTokenScaling(scale_format="ue8m0")
    msg = str(info.value)
    assert "scale_format='ue8m0'" in msg and "round_sf=False" in msg and "Fix" in msg
    assert PerTokenScaling(scale_format="ue8m0", round_sf=True).scale_format is ScaleFormat.UE8M0


def test_describe_lists_sources(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "yes")
    text = NVFP4BlockScaling(nvfp4_4over6="weights").describe()
    assert "[env NVTE_NVFP4_DISABLE_RHT=yes]" in text
    assert "[argument]" in text and "[default]" in text


def test_base_recipe_is_abstract():
    with pytest.raises(TypeError, match="abstract"):
        Recipe()


def test_plan_is_cached_per_role():
    from fp_recipes import QuantizerRole

    r = NVFP4BlockScaling()
    role = QuantizerRole("linear", "weight")
    assert r.plan(role) is r.plan(role)
    assert r.plan(QuantizerRole("linear", "weight", gemm=1)).role.gemm == 1
    # a copy with other options never reuses the cached specs
    assert not r.replace(disable_2d_quantization=True).plan(role).block_2d
    assert pickle.loads(pickle.dumps(r)).plan(role) == r.plan(role)


def test_recipe_from_env_bad_default():
    with pytest.raises(ValueError, match="default='fp8'"):
        fp_recipes.recipe_from_env(default="fp8")


@pytest.mark.parametrize("recipe", VARIANTS, ids=repr)
def test_type_tagged_config_round_trip(recipe):
    config = json.loads(json.dumps(recipe.to_config()))
    assert config["recipe"] == type(recipe).recipe_name
    back = Recipe.from_config(config)
    assert type(back) is type(recipe) and back == recipe


def test_from_config_rejects_unknown_kind():
    with pytest.raises(ValueError, match="'recipe' must be one of"):
        Recipe.from_config({"recipe": "mxfp8"})
