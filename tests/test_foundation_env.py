"""Environment variables: every variable, good and bad values, precedence, set-after-import,
the deprecated alias, unknown names, recipe_from_env."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from pydantic import ValidationError

from fp_recipes import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    NVFP4BlockScaling,
    PerTokenScaling,
    recipe_from_env,
)
from fp_recipes.quantizers.roles import BackwardOverride
from fp_recipes.recipes import RECIPES
from fp_recipes.recipes.env import (
    BY_NAME,
    TABLE,
    EnvVarDeprecationWarning,
    EnvVarError,
    UnknownEnvVarWarning,
    resolve_env,
    unknown_env,
)

CLASSES = {c.__name__: c for c in RECIPES.values()}

# name -> [(raw value, expected field value)] covering every allowed spelling class.
GOOD = {
    "NVTE_NVFP4_DISABLE_RHT": [("1", True), ("0", False), ("TRUE", True), ("off", False)],
    "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": [("yes", True), ("No", False)],
    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": [("On", True), ("false", False)],
    "NVTE_NVFP4_4OVER6": [("weights", "weights"), ("NONE", "none"), ("Weights", "weights")],
    "NVTE_NVFP4_4OVER6_E4M3_USE_256": [("none", "none"), ("weights", "weights"),
                                       ("activations", "activations"), ("ALL", "all")],
    "NVTE_NVFP4_4OVER6_ERR_MODE": [("mse", "MSE"), ("MAE", "MAE"), ("Mse", "MSE")],
    "NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH": [("1", True), ("0", False)],
    "NVTE_BACKWARD_OVERRIDE": [("high_precision", "high_precision"),
                               ("DEQUANTIZED", "dequantized")],
    "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": [("1", True), ("no", False)],
    "FP_RECIPES_FP8_FORMAT": [("e4m3", "E4M3"), ("E5M2", "E5M2"), ("hybrid", "HYBRID")],
    "FP_RECIPES_FP8_FAST_ACCUMULATION": [("all", ("fprop", "dgrad", "wgrad")), ("NONE", ()),
                                         ("wgrad, FPROP", ("fprop", "wgrad")), ("dgrad", ("dgrad",))],
    "FP_RECIPES_DELAYED_MARGIN": [("0", 0), ("4", 4)],
    "FP_RECIPES_DELAYED_AMAX_HISTORY_LEN": [("1", 1), ("16", 16)],
    "FP_RECIPES_DELAYED_AMAX_COMPUTE_ALGO": [("most_recent", "most_recent"), ("MAX", "max")],
    "FP_RECIPES_DELAYED_REDUCE_AMAX": [("0", False), ("true", True)],
    "FP_RECIPES_CURRENT_AMAX_EPSILON": [("1e-6", 1e-6), ("0", 0.0)],
    "FP_RECIPES_PER_TOKEN_FORMAT": [("E4M3", "e4m3"), ("e5m6", "e5m6")],
    "FP_RECIPES_PER_TOKEN_ROUND_SF": [("1", True), ("off", False)],
    "FP_RECIPES_PER_TOKEN_SCALE_FORMAT": [("fp32", "fp32")],
}
BAD = {
    "NVTE_NVFP4_DISABLE_RHT": ["2", "maybe", "enabled"],
    "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": ["y"],
    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": ["10"],
    "NVTE_NVFP4_ROW_SCALED_ACTIVATION": ["sure"],
    "NVTE_NVFP4_PER_TOKEN_ACTIVATION": ["two"],
    "NVTE_NVFP4_4OVER6": ["gradients", "1"],
    "NVTE_NVFP4_4OVER6_E4M3_USE_256": ["yes"],
    "NVTE_NVFP4_4OVER6_ERR_MODE": ["L1"],
    "NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH": ["fast"],
    "NVTE_BACKWARD_OVERRIDE": ["fp32", "1"],
    "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": ["pow2"],
    "FP_RECIPES_FP8_FORMAT": ["E3M4"],
    "FP_RECIPES_FP8_FAST_ACCUMULATION": ["fprop,dgard", "fprop,fprop", "1", "fprop;dgrad"],
    "FP_RECIPES_DELAYED_MARGIN": ["-1", "1.5", "x"],
    "FP_RECIPES_DELAYED_AMAX_HISTORY_LEN": ["0"],
    "FP_RECIPES_DELAYED_AMAX_COMPUTE_ALGO": ["mean"],
    "FP_RECIPES_DELAYED_REDUCE_AMAX": ["always"],
    "FP_RECIPES_CURRENT_AMAX_EPSILON": ["-1", "nan", "inf", "tiny"],
    "FP_RECIPES_PER_TOKEN_FORMAT": ["e2m1"],
    "FP_RECIPES_PER_TOKEN_ROUND_SF": ["maybe"],
    "FP_RECIPES_PER_TOKEN_SCALE_FORMAT": ["e8m0"],
}
RECIPE_VARS = [v for v in TABLE if v.use == "recipe"]


def _value(x):
    return getattr(x, "value", x)


def test_every_recipe_variable_is_covered():
    names = {v.name for v in RECIPE_VARS}
    assert set(BAD) == names
    assert set(GOOD) | {"NVTE_NVFP4_ROW_SCALED_ACTIVATION", "NVTE_NVFP4_PER_TOKEN_ACTIVATION"} == names


def test_table_fields_exist():
    for var in RECIPE_VARS:
        for r in var.recipes:
            assert var.field in CLASSES[r].model_fields, (var.name, r)
    # every recipe field except the per-token fmt/backward is reachable from the environment
    reachable = {(r, v.field) for v in RECIPE_VARS for r in v.recipes}
    for cls in CLASSES.values():
        for field in cls.model_fields:
            assert (cls.__name__, field) in reachable, (cls.__name__, field)


def _needs(name):
    """Extra variables that make a value valid on its own (4over6 on activations needs RHT off)."""
    return {"NVTE_NVFP4_DISABLE_RHT": "1"} if name.startswith("NVTE_NVFP4_4OVER6") else {}


@pytest.mark.parametrize("name,raw,expected",
                         [(n, raw, exp) for n, cases in GOOD.items() for raw, exp in cases])
def test_good_values(monkeypatch, name, raw, expected):
    var = BY_NAME[name]
    for k, v in _needs(name).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(name, raw)
    for recipe in var.recipes:
        r = CLASSES[recipe]()
        assert _value(getattr(r, var.field)) == expected
        assert r.provenance()[var.field] == f"env {name}={raw}"


@pytest.mark.parametrize("name,raw", [(n, raw) for n, vals in BAD.items() for raw in vals])
def test_bad_values_name_variable_value_and_allowed(monkeypatch, name, raw):
    var = BY_NAME[name]
    monkeypatch.setenv(name, raw)
    with pytest.raises(EnvVarError) as direct:
        var.parse(raw)
    for text in (name, repr(raw), "allowed:"):
        assert text in str(direct.value)
    for recipe in var.recipes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EnvVarDeprecationWarning)
            with pytest.raises(ValueError) as info:
                CLASSES[recipe]()
        assert name in str(info.value) and repr(raw) in str(info.value)
        assert var.allowed in str(info.value)


def test_backward_override_none_value(monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "None")
    assert NVFP4BlockScaling().backward_override is None
    with pytest.raises(ValidationError, match="backward_override"):
        PerTokenScaling()  # has no quantized backward


def test_per_token_scale_format_ue8m0_from_env(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_PER_TOKEN_SCALE_FORMAT", "UE8M0")
    with pytest.raises(ValueError, match="round_sf"):
        PerTokenScaling()
    monkeypatch.setenv("FP_RECIPES_PER_TOKEN_ROUND_SF", "1")
    r = PerTokenScaling()
    assert r.scale_format.value == "ue8m0" and r.round_sf


def _row_scaled_disables(monkeypatch):
    """What a TE launch script with row-scaled activations sets: RHT, 2-D and SR off."""
    for var in ("NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
                "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"):
        monkeypatch.setenv(var, "1")


def test_row_scaled_from_env(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1")
    _row_scaled_disables(monkeypatch)
    r = NVFP4BlockScaling()
    assert r.row_scaled_activation
    assert r.provenance()["row_scaled_activation"] == "env NVTE_NVFP4_ROW_SCALED_ACTIVATION=1"


def test_empty_value_counts_as_unset(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_DELAYED_MARGIN", "")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "  ")
    assert DelayedScaling().provenance()["margin"] == "default"
    assert NVFP4BlockScaling().provenance()["disable_rht"] == "default"


def test_precedence_argument_env_default(monkeypatch):
    assert DelayedScaling().margin == 0
    monkeypatch.setenv("FP_RECIPES_DELAYED_MARGIN", "2")
    assert DelayedScaling().margin == 2
    r = DelayedScaling(margin=5)
    assert r.margin == 5 and r.provenance()["margin"] == "argument"
    # An explicit argument equal to the default still beats the environment.
    assert DelayedScaling(margin=0).margin == 0
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert NVFP4BlockScaling(backward_override=None).backward_override is None
    assert NVFP4BlockScaling().backward_override is BackwardOverride.DEQUANTIZED


def test_explicit_argument_skips_bad_env(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_DELAYED_MARGIN", "oops")
    assert DelayedScaling(margin=1).margin == 1
    with pytest.raises(ValueError, match="FP_RECIPES_DELAYED_MARGIN"):
        DelayedScaling()


def test_env_applies_to_each_recipe_that_has_the_field(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_FP8_FORMAT", "E4M3")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    assert DelayedScaling().fp8_format is Format.E4M3
    assert Float8CurrentScaling().fp8_format is Format.E4M3
    for cls in CLASSES.values():
        assert cls().backward_override is BackwardOverride.HIGH_PRECISION


def test_set_after_import_takes_effect():
    """A fresh interpreter: import, then set the variable, then construct (TE freezes at import)."""
    code = (
        "import os, fp_recipes\n"
        "from fp_recipes import NVFP4BlockScaling, DelayedScaling\n"
        "a = NVFP4BlockScaling()\n"
        "os.environ['NVTE_NVFP4_DISABLE_RHT'] = '1'\n"
        "os.environ['FP_RECIPES_DELAYED_MARGIN'] = '3'\n"
        "b = NVFP4BlockScaling(); d = DelayedScaling()\n"
        "del os.environ['NVTE_NVFP4_DISABLE_RHT']\n"
        "c = NVFP4BlockScaling()\n"
        "print(a.disable_rht, b.disable_rht, c.disable_rht, d.margin)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("NVTE_", "FP_RECIPES_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.split() == ["False", "True", "False", "3"]


def test_set_after_import_in_process(monkeypatch):
    before = NVFP4BlockScaling()
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "1")
    after = NVFP4BlockScaling()
    assert not before.disable_2d_quantization and after.disable_2d_quantization


# ------------------------------------------------------------------ deprecated alias
def test_alias_alone_warns_and_applies(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_PER_TOKEN_ACTIVATION", "1")
    _row_scaled_disables(monkeypatch)
    with pytest.warns(EnvVarDeprecationWarning, match="NVTE_NVFP4_ROW_SCALED_ACTIVATION") as rec:
        r = NVFP4BlockScaling()
    assert r.row_scaled_activation
    assert r.provenance()["row_scaled_activation"] == "env NVTE_NVFP4_PER_TOKEN_ACTIVATION=1"
    assert issubclass(EnvVarDeprecationWarning, FutureWarning)  # visible to end users by default
    assert rec[0].filename == __file__  # points at the line that built the recipe


def test_alias_agreeing_warns_only(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_PER_TOKEN_ACTIVATION", "true")
    monkeypatch.setenv("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1")
    _row_scaled_disables(monkeypatch)
    with pytest.warns(EnvVarDeprecationWarning):
        r = NVFP4BlockScaling()
    assert r.row_scaled_activation
    assert r.provenance()["row_scaled_activation"] == "env NVTE_NVFP4_ROW_SCALED_ACTIVATION=1"


def test_alias_disagreeing_is_an_error(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_PER_TOKEN_ACTIVATION", "0")
    monkeypatch.setenv("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EnvVarDeprecationWarning)
        with pytest.raises(ValueError) as info:
            NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True,
                              disable_stochastic_rounding=True)
        with pytest.raises(EnvVarError):
            resolve_env("NVFP4BlockScaling")
    msg = str(info.value)
    assert "NVTE_NVFP4_PER_TOKEN_ACTIVATION" in msg and "NVTE_NVFP4_ROW_SCALED_ACTIVATION" in msg
    assert "disagree" in msg


def test_alias_ignored_when_argument_given(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_PER_TOKEN_ACTIVATION", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not NVFP4BlockScaling(row_scaled_activation=False).row_scaled_activation


# ------------------------------------------------------------------ unknown names
@pytest.mark.parametrize("typo,suggestion", [
    ("NVTE_NVFP4_DISABLE_RTH", "NVTE_NVFP4_DISABLE_RHT"),
    ("NVTE_NVFP4_4OVER6_ERRMODE", "NVTE_NVFP4_4OVER6_ERR_MODE"),
    ("NVTE_FP8_CURRENT_SCALING_POWER2_SCALES", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"),
    ("FP_RECIPES_RECIPES", "FP_RECIPES_RECIPE"),
    ("FP_RECIPES_DELAYED_MARGINE", "FP_RECIPES_DELAYED_MARGIN"),
])
def test_unknown_variable_warns_with_suggestion(monkeypatch, typo, suggestion):
    monkeypatch.setenv(typo, "1")
    with pytest.warns(UnknownEnvVarWarning) as rec:
        DelayedScaling()
    msgs = [str(w.message) for w in rec if issubclass(w.category, UnknownEnvVarWarning)]
    assert any(typo in m and f"did you mean {suggestion}?" in m for m in msgs), msgs
    assert unknown_env() == [(typo, suggestion)]


def test_unknown_variable_without_close_match(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_ZZZ", "1")
    with pytest.warns(UnknownEnvVarWarning, match="python -m fp_recipes env"):
        NVFP4BlockScaling()


def test_other_prefixes_and_known_build_variables_are_quiet(monkeypatch):
    for name in ("NVTE_DEBUG", "NVTE_USE_FAST_MATH", "FP_RECIPES_CUDA_ARCHS", "FP_RECIPES_NO_CUDA",
                 "FP_RECIPES_NVCC_THREADS", "FP_RECIPES_RECIPE", "TORCH_FOO"):
        monkeypatch.setenv(name, "1" if name != "FP_RECIPES_RECIPE" else "nvfp4")
    monkeypatch.setenv("FP_RECIPES_CUDA_ARCHS", "90a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DelayedScaling()
        NVFP4BlockScaling()
    assert unknown_env() == []


# ------------------------------------------------------------------ recipe_from_env
@pytest.mark.parametrize("raw,cls", [("delayed", DelayedScaling), ("CURRENT", Float8CurrentScaling),
                                     ("nvfp4", NVFP4BlockScaling), ("Per_Token", PerTokenScaling)])
def test_recipe_from_env(monkeypatch, raw, cls):
    monkeypatch.setenv("FP_RECIPES_RECIPE", raw)
    assert type(recipe_from_env()) is cls


def test_recipe_from_env_none_default_and_bad(monkeypatch):
    assert type(recipe_from_env()) is DelayedScaling
    assert type(recipe_from_env(default="nvfp4")) is NVFP4BlockScaling
    monkeypatch.setenv("FP_RECIPES_RECIPE", "none")
    assert recipe_from_env() is None
    monkeypatch.setenv("FP_RECIPES_RECIPE", "mxfp8")
    with pytest.raises(EnvVarError) as info:
        recipe_from_env()
    assert "FP_RECIPES_RECIPE" in str(info.value) and "'mxfp8'" in str(info.value)
    assert "per_token" in str(info.value)


def test_recipe_from_env_resolves_fields(monkeypatch):
    monkeypatch.setenv("FP_RECIPES_RECIPE", "nvfp4")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "1")
    r = recipe_from_env()
    assert r.disable_stochastic_rounding
    assert r.provenance()["disable_stochastic_rounding"].startswith("env ")


def test_build_variables_parse():
    assert BY_NAME["FP_RECIPES_NO_CUDA"].parse("yes") is True
    assert BY_NAME["FP_RECIPES_NVCC_THREADS"].parse("4") == 4
    with pytest.raises(EnvVarError):
        BY_NAME["FP_RECIPES_NVCC_THREADS"].parse("0")
    assert BY_NAME["FP_RECIPES_CUDA_ARCHS"].parse("90a;100a") == "90a;100a"
    assert BY_NAME["FP_RECIPES_CUDA_ARCHS"].parse("90") == "90"
    for bad in ("sm_90", "90a;hopper", ";"):
        with pytest.raises(EnvVarError, match="FP_RECIPES_CUDA_ARCHS"):
            BY_NAME["FP_RECIPES_CUDA_ARCHS"].parse(bad)


def test_import_never_reads_the_environment():
    """Bad values and unknown names surface when a recipe is built, not at import."""
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import fp_recipes\n"
        "from fp_recipes import NVFP4BlockScaling, autocast, get_autocast_state\n"
        "import fp_recipes.recipes.env, fp_recipes.autocast\n"
        "try:\n"
        "    NVFP4BlockScaling(disable_rht=True)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("NVTE_", "FP_RECIPES_"))}
    env.update(NVTE_NVFP4_DISABLE_2D_QUANTIZATION="maybe", FP_RECIPES_TYPO="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    # the first thing to complain is the recipe construction (the unknown-name warning, raised
    # as an error by the filter above)
    assert out.stdout.strip() == "UnknownEnvVarWarning"


# ------------------------------------------------------------------ precedence, as a property
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# field -> (env variable, [(raw env value, typed value)], [argument values])
_PROPERTY_FIELDS = {
    DelayedScaling: {
        "margin": ("FP_RECIPES_DELAYED_MARGIN", [("1", 1), ("5", 5)], [0, 2]),
        "amax_history_len": ("FP_RECIPES_DELAYED_AMAX_HISTORY_LEN", [("4", 4)], [1, 1024, 8]),
        "amax_compute_algo": ("FP_RECIPES_DELAYED_AMAX_COMPUTE_ALGO",
                              [("MOST_RECENT", "most_recent"), ("max", "max")],
                              ["max", "most_recent"]),
        "reduce_amax": ("FP_RECIPES_DELAYED_REDUCE_AMAX", [("off", False), ("1", True)],
                        [True, False]),
        "fp8_format": ("FP_RECIPES_FP8_FORMAT", [("e4m3", "E4M3")], ["HYBRID", "E5M2"]),
        "backward_override": ("NVTE_BACKWARD_OVERRIDE", [("dequantized", "dequantized")],
                              [None, "high_precision"]),
    },
    NVFP4BlockScaling: {
        # disable_rht stays on (an argument) so 4over6 on activations is always valid; row scaling
        # with 2-D or SR left on is invalid, and the test then checks the error instead
        "disable_stochastic_rounding": ("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
                                        [("yes", True), ("0", False)], [False, True]),
        "disable_2d_quantization": ("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", [("TRUE", True)],
                                    [False, True]),
        "row_scaled_activation": ("NVTE_NVFP4_ROW_SCALED_ACTIVATION", [("1", True)],
                                  [False, True]),
        "nvfp4_4over6": ("NVTE_NVFP4_4OVER6", [("all", "all"), ("Weights", "weights")],
                         ["none", "activations"]),
        "nvfp4_4over6_e4m3_use_256": ("NVTE_NVFP4_4OVER6_E4M3_USE_256", [("none", "none")],
                                      ["weights", "all"]),
        "nvfp4_4over6_err_mode": ("NVTE_NVFP4_4OVER6_ERR_MODE", [("mse", "MSE")], ["MAE", "mse"]),
        "nvfp4_4over6_err_use_fast_math": ("NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH", [("on", True)],
                                           [False]),
    },
}


def _row_scaled_clash(values):
    """The option a row-scaled recipe rejects first (RHT is off in the property test), or None."""
    if not values["row_scaled_activation"]:
        return None
    if not values["disable_2d_quantization"]:
        return "disable_2d_quantization"
    if not values["disable_stochastic_rounding"]:
        return "disable_stochastic_rounding"
    return None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("cls", list(_PROPERTY_FIELDS), ids=lambda c: c.__name__)
def test_precedence_property(monkeypatch, cls, data):
    """Each field: argument if given, else the env value if set, else the default; provenance
    says which. Combination checks see the resolved values: a row-scaled NVFP4 recipe with 2-D or
    SR left on (by any source) is rejected, and the error names that source."""
    fields = _PROPERTY_FIELDS[cls]
    for var, _, _ in fields.values():
        monkeypatch.delenv(var, raising=False)
    kwargs, expected, sources = {}, {}, {}
    if cls is NVFP4BlockScaling:
        kwargs["disable_rht"] = True
    for field, (var, env_values, arg_values) in fields.items():
        env_choice = data.draw(st.sampled_from([None] + env_values), label=f"env {var}")
        arg_choice = data.draw(st.sampled_from(["<unset>"] + arg_values), label=f"arg {field}")
        if env_choice is not None:
            monkeypatch.setenv(var, env_choice[0])
        if arg_choice != "<unset>":
            kwargs[field] = arg_choice
            expected[field], sources[field] = arg_choice, "argument"
        elif env_choice is not None:
            expected[field], sources[field] = env_choice[1], f"env {var}={env_choice[0]}"
        else:
            expected[field] = cls.model_fields[field].default
            sources[field] = "default"
    clash = _row_scaled_clash(expected) if cls is NVFP4BlockScaling else None
    if clash is not None:
        with pytest.raises(ValueError) as info:
            cls(**kwargs)
        msg = str(info.value)
        for field in ("row_scaled_activation", clash):
            where = "" if sources[field] == "argument" else f" (from {sources[field]})"
            assert f"{field}={expected[field]}{where}" in msg, (field, msg)
        return
    r = cls(**kwargs)
    for field in fields:
        got = _value(getattr(r, field))
        want = _value(expected[field])
        assert (got.upper() if isinstance(got, str) else got) == (
            want.upper() if isinstance(want, str) else want), field
        assert r.provenance()[field] == sources[field]
