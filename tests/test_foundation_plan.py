"""recipe.plan(role) for every recipe x role x option combination, against an oracle written
from the rules in INTERFACES.md (operand table, HYBRID, NVFP4 2-D/SR/RHT/row-scaled/4over6 scopes,
backward_override), plus hand-written specs of the common configurations."""

from __future__ import annotations

import itertools

import pytest

from fp_recipes import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling
from fp_recipes.quantizers.roles import (
    BackwardOverride,
    ModuleKind,
    QFormat,
    QuantizerRole,
    QuantizerSpec,
    ScalingKind,
    TensorKind,
    high_precision_spec,
)

MODULES = list(ModuleKind)
TENSORS = list(TensorKind)
ROLES = [QuantizerRole(m, t, gemm=g, name=n) for m in MODULES for t in TENSORS
         for g, n in ((0, None), (3, "fc2"))]
OVERRIDES = [None, "high_precision", "dequantized"]
SCOPES = ["none", "weights", "activations", "all"]
HP_TENSORS = (TensorKind.OUTPUT, TensorKind.GRAD_INPUT)


def _hp(role, override=None):
    spec = high_precision_spec(role)
    return spec if override is None else spec.replace(backward_override=BackwardOverride(override))


# ------------------------------------------------------------------ FP8
FP8_FORMAT_OF = {  # recipe format -> {tensor: element format}
    "HYBRID": {"activation": "e4m3", "weight": "e4m3", "grad_output": "e5m2"},
    "E4M3": {"activation": "e4m3", "weight": "e4m3", "grad_output": "e4m3"},
    "E5M2": {"activation": "e5m2", "weight": "e5m2", "grad_output": "e5m2"},
}


def fp8_oracle(recipe, role):
    tensor = role.tensor.value
    override = recipe.backward_override
    if role.tensor in HP_TENSORS:  # outputs stay in high precision and carry the override too
        return _hp(role, override)
    if override is not None and tensor == "grad_output":
        return _hp(role, override)
    extra = {}
    if isinstance(recipe, DelayedScaling):
        scaling = ScalingKind.DELAYED
        extra = dict(margin=recipe.margin, amax_history_len=recipe.amax_history_len,
                     amax_compute_algo=recipe.amax_compute_algo.value, reduce_amax=recipe.reduce_amax)
    else:
        scaling = ScalingKind.CURRENT
        extra = dict(use_power_2_scales=recipe.use_power_2_scales, amax_epsilon=recipe.amax_epsilon)
    return QuantizerSpec(role=role, fmt=QFormat(FP8_FORMAT_OF[recipe.fp8_format.value][tensor]),
                         scaling=scaling, rowwise=True, columnwise=override is None,
                         backward_override=override, **extra)


FP8_RECIPES = (
    [DelayedScaling(fp8_format=f, margin=m, amax_history_len=h, amax_compute_algo=a, reduce_amax=r,
                    backward_override=o)
     for f, m, h, a, r, o in itertools.product(["HYBRID", "E4M3", "E5M2"], [0, 2], [1, 1024],
                                               ["max", "most_recent"], [True, False], OVERRIDES)]
    + [Float8CurrentScaling(fp8_format=f, use_power_2_scales=p, amax_epsilon=e, backward_override=o)
       for f, p, e, o in itertools.product(["HYBRID", "E4M3", "E5M2"], [False, True], [0.0, 1e-4],
                                           OVERRIDES)]
)


@pytest.mark.parametrize("module", MODULES, ids=str)
@pytest.mark.parametrize("tensor", TENSORS, ids=str)
def test_fp8_plan_every_combination(module, tensor):
    for recipe in FP8_RECIPES:
        for gemm, name in ((0, None), (2, "qkv")):
            role = QuantizerRole(module, tensor, gemm=gemm, name=name)
            assert recipe.plan(role) == fp8_oracle(recipe, role), (recipe, role)


def test_fp8_default_hybrid_specs_by_hand():
    r = DelayedScaling()
    act = r.plan(QuantizerRole("linear", "activation"))
    w = r.plan(QuantizerRole("linear", "weight"))
    g = r.plan(QuantizerRole("linear", "grad_output"))
    assert (act.fmt, w.fmt, g.fmt) == (QFormat.E4M3, QFormat.E4M3, QFormat.E5M2)
    for spec in (act, w, g):
        assert spec.scaling is ScalingKind.DELAYED
        assert spec.rowwise and spec.columnwise  # fprop rowwise; dgrad/wgrad columnwise
        assert spec.amax_history_len == 1024 and spec.amax_compute_algo == "max"
        assert spec.reduce_amax and spec.margin == 0 and spec.backward_override is None
    cur = Float8CurrentScaling(use_power_2_scales=True).plan(QuantizerRole("grouped_linear", "weight"))
    assert cur.scaling is ScalingKind.CURRENT and cur.use_power_2_scales and cur.fmt is QFormat.E4M3


# ------------------------------------------------------------------ NVFP4
NVFP4_OPTIONS = list(itertools.product(
    [False, True],  # disable_rht
    [False, True],  # disable_stochastic_rounding
    [False, True],  # disable_2d_quantization
    [False, True],  # row_scaled_activation
    SCOPES,  # nvfp4_4over6
    SCOPES,  # nvfp4_4over6_e4m3_use_256
    ["MAE", "MSE"],
    [False, True],  # err_use_fast_math
    OVERRIDES,
))
NVFP4_KEYS = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization",
              "row_scaled_activation", "nvfp4_4over6", "nvfp4_4over6_e4m3_use_256",
              "nvfp4_4over6_err_mode", "nvfp4_4over6_err_use_fast_math", "backward_override")


def _covers(scope, tensor):
    return {"none": (), "weights": ("weight",), "activations": ("activation",),
            "all": ("weight", "activation")}[scope].__contains__(tensor)


def nvfp4_valid(o):
    # RHT lands on the activation's wgrad copy unless disabled or the backward is high precision;
    # row scaling and 4over6 on activations cannot share a tensor with it.
    quantized_backward = o["backward_override"] is None
    rht_on_activation = not o["disable_rht"] and quantized_backward
    if rht_on_activation and (o["row_scaled_activation"]
                              or _covers(o["nvfp4_4over6"], "activation")):
        return False
    # Row scaling also needs 2-D quantization off, and stochastic rounding off whenever gradients
    # are quantized (TransformerEngine's rule).
    if o["row_scaled_activation"] and (not o["disable_2d_quantization"]
                                       or (quantized_backward
                                           and not o["disable_stochastic_rounding"])):
        return False
    return True


def nvfp4_oracle(o, role):
    tensor = role.tensor.value
    override = o["backward_override"]
    if role.tensor in HP_TENSORS:
        return _hp(role, override)
    if override is not None and tensor == "grad_output":
        return _hp(role, override)
    backward_copies = override is None
    fos = _covers(o["nvfp4_4over6"], tensor)
    row_scaled = tensor == "activation" and o["row_scaled_activation"]
    return QuantizerSpec(
        role=role, fmt=QFormat.NVFP4, scaling=ScalingKind.NVFP4,
        rowwise=True, columnwise=backward_copies,
        block_2d=tensor == "weight" and not o["disable_2d_quantization"],
        row_scaled=row_scaled,
        reduce_amax=not row_scaled,
        four_over_six=fos,
        e4m3_max=256 if fos and _covers(o["nvfp4_4over6_e4m3_use_256"], tensor) else 448,
        err_mode=o["nvfp4_4over6_err_mode"] if fos else "MAE",
        err_fast_math=o["nvfp4_4over6_err_use_fast_math"] if fos else False,
        rht_columnwise=(tensor in ("activation", "grad_output") and not o["disable_rht"]
                        and backward_copies),
        stochastic_rounding=tensor == "grad_output" and not o["disable_stochastic_rounding"],
        backward_override=override,
    )


@pytest.fixture(scope="module")
def nvfp4_recipes():
    built = []
    for values in NVFP4_OPTIONS:
        o = dict(zip(NVFP4_KEYS, values))
        if nvfp4_valid(o):
            built.append((o, NVFP4BlockScaling(**o)))
        else:
            with pytest.raises(ValueError):
                NVFP4BlockScaling(**o)
    assert 1000 < len(built) < len(NVFP4_OPTIONS)
    # row-scaled recipes stay covered: with RHT/2D/SR off, and with SR on under a backward override
    row_scaled = [o for o, _ in built if o["row_scaled_activation"]]
    assert any(o["disable_stochastic_rounding"] for o in row_scaled)
    assert any(not o["disable_stochastic_rounding"] and o["backward_override"] for o in row_scaled)
    return built


@pytest.mark.parametrize("module", MODULES, ids=str)
@pytest.mark.parametrize("tensor", TENSORS, ids=str)
def test_nvfp4_plan_every_combination(nvfp4_recipes, module, tensor):
    role = QuantizerRole(module, tensor, gemm=1, name="x")
    for o, recipe in nvfp4_recipes:
        spec = recipe.plan(role)
        assert spec == nvfp4_oracle(o, role), (o, role)
        # invariants that hold whatever the options
        if spec.quantized:
            assert not (spec.four_over_six and (spec.rht_columnwise or spec.stochastic_rounding))
            assert not (spec.row_scaled and (spec.rht_columnwise or spec.block_2d
                                             or spec.stochastic_rounding))
            assert not (tensor == "grad_output" and spec.four_over_six)


def test_nvfp4_default_specs_by_hand():
    r = NVFP4BlockScaling()
    act = r.plan(QuantizerRole("layernorm_linear", "activation"))
    w = r.plan(QuantizerRole("layernorm_linear", "weight"))
    g = r.plan(QuantizerRole("layernorm_linear", "grad_output"))
    out = r.plan(QuantizerRole("layernorm_linear", "output"))
    assert act.describe() == "layernorm_linear[0].activation: nvfp4/nvfp4 row+col 1d rht(col)"
    assert w.describe() == "layernorm_linear[0].weight: nvfp4/nvfp4 row+col 2d"
    assert g.describe() == "layernorm_linear[0].grad_output: nvfp4/nvfp4 row+col 1d rht(col) sr"
    assert not out.quantized
    assert act.e4m3_max == w.e4m3_max == g.e4m3_max == 448


def test_nvfp4_rl_config_by_hand():
    """The RL launch-script configuration: row-scaled, 4over6 everywhere (E=256), MSE, dequantized
    backward, no RHT/SR/2D."""
    r = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                          disable_2d_quantization=True, row_scaled_activation=True,
                          nvfp4_4over6="all", nvfp4_4over6_err_mode="mse",
                          backward_override="dequantized")
    act = r.plan(QuantizerRole("linear", "activation"))
    w = r.plan(QuantizerRole("linear", "weight"))
    g = r.plan(QuantizerRole("linear", "grad_output"))
    assert act.row_scaled and act.four_over_six and act.e4m3_max == 256 and act.err_mode == "MSE"
    assert not act.columnwise and not act.rht_columnwise and not act.reduce_amax
    assert w.four_over_six and w.e4m3_max == 256 and not w.block_2d and not w.row_scaled
    assert not g.quantized and g.backward_override is BackwardOverride.DEQUANTIZED
    assert act.backward_override is BackwardOverride.DEQUANTIZED


def test_nvfp4_use_256_scope_only_where_4over6_applies():
    r = NVFP4BlockScaling(nvfp4_4over6="weights", nvfp4_4over6_e4m3_use_256="all")
    assert r.plan(QuantizerRole("linear", "weight")).e4m3_max == 256
    assert r.plan(QuantizerRole("linear", "activation")).e4m3_max == 448
    r = NVFP4BlockScaling(nvfp4_4over6="weights", nvfp4_4over6_e4m3_use_256="activations")
    w = r.plan(QuantizerRole("linear", "weight"))
    assert w.four_over_six and w.e4m3_max == 448


# ------------------------------------------------------------------ per-token
PER_TOKEN_RECIPES = [
    PerTokenScaling(fmt=f, round_sf=rs, scale_format=sf, backward_override=o)
    for f, rs, sf, o in itertools.product(["e5m6", "e4m3"], [False, True], ["fp32", "ue8m0"],
                                          ["dequantized", "high_precision"])
    if not (sf == "ue8m0" and not rs)
]


@pytest.mark.parametrize("role", ROLES, ids=str)
def test_per_token_plan_every_combination(role):
    for r in PER_TOKEN_RECIPES:
        spec = r.plan(role)
        if role.tensor in HP_TENSORS:
            assert spec == _hp(role, r.backward_override.value)
        elif role.tensor is TensorKind.GRAD_OUTPUT:
            assert spec == _hp(role, r.backward_override.value)
        else:
            assert spec == QuantizerSpec(
                role=role, fmt=QFormat(r.fmt.value), scaling=ScalingKind.PER_TOKEN, rowwise=True,
                columnwise=False, round_sf=r.round_sf, scale_format=r.scale_format.value,
                backward_override=r.backward_override)


# ------------------------------------------------------------------ across recipes
ALL_DEFAULTS = [DelayedScaling(), Float8CurrentScaling(), NVFP4BlockScaling(), PerTokenScaling()]


@pytest.mark.parametrize("recipe", ALL_DEFAULTS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("role", ROLES, ids=str)
def test_plan_keeps_role_and_hp_outputs(recipe, role):
    spec = recipe.plan(role)
    assert spec.role == role
    if role.tensor in HP_TENSORS:
        assert spec == _hp(role, recipe.backward_override)
    # the module kind, GEMM index and name never change how an operand is quantized
    base = recipe.plan(QuantizerRole("linear", role.tensor))
    assert spec.replace(role=base.role) == base


@pytest.mark.parametrize("recipe", ALL_DEFAULTS, ids=lambda r: type(r).__name__)
def test_plan_rejects_non_roles(recipe):
    with pytest.raises(TypeError, match="QuantizerRole"):
        recipe.plan("activation")


def test_plan_is_deterministic_and_hashable():
    r = NVFP4BlockScaling(nvfp4_4over6="weights")
    role = QuantizerRole("grouped_linear", "weight")
    assert r.plan(role) == r.plan(role) and hash(r.plan(role)) == hash(r.plan(role))
