"""THE table of environment variables: every variable fp_recipes reads, in one place.

Recipes consult it when they are constructed (never at import), the CLI (``python -m fp_recipes
env``) prints it, and ``docs/envvars.md`` is generated from it (:func:`render_markdown`). Rules:

* precedence: explicit argument > environment variable > field default;
* booleans accept 1/0, true/false, yes/no, on/off in any case; an empty value counts as unset;
* a bad value raises :class:`EnvVarError` naming the variable, the value and what is allowed;
* ``NVTE_NVFP4_PER_TOKEN_ACTIVATION`` is the deprecated name of ``NVTE_NVFP4_ROW_SCALED_ACTIVATION``;
* a set variable named like ours or TE's (``NVTE_*``, ``FP_RECIPE*``) that is neither in the table nor
  a known TransformerEngine variable we do not use (:data:`TE_NOT_USED`, each with why) draws a warning
  that names the closest known variable (a typo in a launch script should never go unnoticed).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

PREFIXES: Tuple[str, ...] = ("NVTE_NVFP4_", "NVTE_FP8_", "FP_RECIPES_")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

NVFP4 = ("NVFP4BlockScaling",)
DELAYED = ("DelayedScaling",)
CURRENT = ("Float8CurrentScaling",)
FP8 = ("DelayedScaling", "Float8CurrentScaling")
PER_TOKEN = ("PerTokenScaling",)
ALL_RECIPES = FP8 + NVFP4 + PER_TOKEN


class EnvVarError(ValueError):
    """An environment variable holds a value fp_recipes cannot use."""


class EnvVarDeprecationWarning(FutureWarning):
    """A deprecated variable name is set (FutureWarning: shown to end users by default)."""


class UnknownEnvVarWarning(UserWarning):
    """A variable with an fp_recipes/TransformerEngine prefix is set but means nothing to us."""


@dataclass(frozen=True)
class EnvVar:
    """One row of the table.

    ``kind``: bool | choice | subset (a comma-separated subset of ``choices``, or all / none) | int | float |
    archs | text. ``use``: recipe (sets ``field`` of ``recipes``),
    select (picks the recipe ``autocast()`` uses), backend (picks an implementation at run time: read
    where that implementation is chosen, never at import) or build (read by setup.py when compiling).
    ``alias_of``: this name is a deprecated spelling of that variable.
    """

    name: str
    kind: str
    doc: str
    field: Optional[str] = None
    recipes: Tuple[str, ...] = ()
    choices: Tuple[str, ...] = ()
    minimum: Optional[float] = None
    use: str = "recipe"
    alias_of: Optional[str] = None
    te_name: bool = False  # same name and meaning as in TransformerEngine
    hint: str = "text"  # what a "text" variable holds

    @property
    def allowed(self) -> str:
        if self.kind == "bool":
            return "1/0, true/false, yes/no, on/off (any case)"
        if self.kind == "choice":
            return " | ".join(self.choices) + " (any case)"
        if self.kind == "subset":
            return f"comma-separated subset of {', '.join(self.choices)}; or all | none (any case)"
        if self.kind == "int":
            return f"integer >= {int(self.minimum)}" if self.minimum is not None else "integer"
        if self.kind == "float":
            return f"number >= {self.minimum:g}" if self.minimum is not None else "number"
        return self.hint

    @property
    def sets(self) -> str:
        if self.use == "build":
            return "build (setup.py)"
        if self.use == "select":
            return "autocast() default recipe"
        if self.use == "backend":
            return {"FP_RECIPES_NVFP4_GEMM": "NVFP4 GEMM implementation (read at each NVFP4 GEMM)",
                    "FP_RECIPES_TORCH_OPS": "host path of the FP8 and NVFP4 casts and GEMMs (eager and the "
                                            "compiled FP8 ops) and the delayed-scaling updates (read once, at the "
                                            "first one)"}.get(self.name, "implementation (read at run time)")
        if self.alias_of:
            return f"deprecated alias of {self.alias_of}"
        if self.recipes == ALL_RECIPES:
            return f"{self.field} of every recipe"
        if len(self.recipes) > 1:
            return f"{self.field} of {', '.join(self.recipes)}"
        return f"{self.recipes[0]}.{self.field}"

    def parse(self, raw: str) -> Any:
        """The typed value of ``raw``; :class:`EnvVarError` when it is not allowed."""
        text = raw.strip()
        folded = text.lower()
        if self.kind == "bool":
            if folded in _TRUE:
                return True
            if folded in _FALSE:
                return False
        elif self.kind == "choice":
            for choice in self.choices:
                if folded == choice.lower():
                    return None if choice == "none" and self.field == "backward_override" else choice
        elif self.kind == "subset":
            subset = parse_subset(text, self.choices)
            if subset is not None:
                return subset
        elif self.kind == "int":
            try:
                value = int(text, 10)
            except ValueError:
                value = None
            if value is not None and (self.minimum is None or value >= self.minimum):
                return value
        elif self.kind == "float":
            try:
                fvalue = float(text)
            except ValueError:
                fvalue = None
            if fvalue is not None and math.isfinite(fvalue) and (
                    self.minimum is None or fvalue >= self.minimum):
                return fvalue
        elif self.kind == "archs":  # setup.py's rule: digits, optionally ending in a/f
            archs = [a.strip() for a in text.split(";") if a.strip()]
            if archs and all(a.rstrip("af").isdigit() for a in archs):
                return text
        elif self.kind == "text":
            return text
        raise EnvVarError(f"environment variable {self.name}={raw!r} is not allowed; "
                          f"allowed: {self.allowed}")


def parse_subset(text: str, choices: Tuple[str, ...]) -> Optional[Tuple[str, ...]]:
    """``"dgrad, FPROP"`` -> ``("fprop", "dgrad")`` (in the order of ``choices``); ``all`` -> every choice,
    ``none`` or an empty list -> ``()``; None when a name is not one of ``choices`` (or is given twice)."""
    folded = text.strip().lower()
    if folded == "all":
        return tuple(choices)
    if folded in ("none", ""):
        return ()
    names = [n.strip() for n in folded.split(",")]
    lower = [c.lower() for c in choices]
    if any(n not in lower for n in names) or len(set(names)) != len(names):
        return None
    return tuple(c for c in choices if c.lower() in names)


_SCOPES = ("none", "weights", "activations", "all")
#: the GEMMs of a linear layer (FP8 recipes' fast_accumulation)
GEMMS = ("fprop", "dgrad", "wgrad")

TABLE: Tuple[EnvVar, ...] = (
    # --- NVFP4 (TransformerEngine names) -----------------------------------------------------
    EnvVar("NVTE_NVFP4_DISABLE_RHT", "bool", "Turn off the random Hadamard transform on the "
           "columnwise (wgrad) copies of activations and output gradients.",
           field="disable_rht", recipes=NVFP4, te_name=True),
    EnvVar("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "bool", "Round output gradients to nearest "
           "instead of stochastically.", field="disable_stochastic_rounding", recipes=NVFP4,
           te_name=True),
    EnvVar("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "bool", "Quantize weights in 1x16 blocks instead "
           "of 16x16 tiles.", field="disable_2d_quantization", recipes=NVFP4, te_name=True),
    EnvVar("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "bool", "Give the activation's rowwise (fprop) copy "
           "one global amax per row (token) instead of one per tensor. As in TransformerEngine, "
           "it needs NVTE_NVFP4_DISABLE_RHT, NVTE_NVFP4_DISABLE_2D_QUANTIZATION and "
           "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING set to 1.",
           field="row_scaled_activation", recipes=NVFP4, te_name=True),
    EnvVar("NVTE_NVFP4_PER_TOKEN_ACTIVATION", "bool", "Older name of "
           "NVTE_NVFP4_ROW_SCALED_ACTIVATION: accepted with a deprecation warning; setting both to "
           "different values is an error.", field="row_scaled_activation", recipes=NVFP4,
           alias_of="NVTE_NVFP4_ROW_SCALED_ACTIVATION", te_name=True),
    EnvVar("NVTE_NVFP4_4OVER6", "choice", "Tensors that choose per block between scaling the "
           "block max to 6 or to 4 (never gradients).", field="nvfp4_4over6", recipes=NVFP4,
           choices=_SCOPES, te_name=True),
    EnvVar("NVTE_NVFP4_4OVER6_E4M3_USE_256", "choice", "4over6 tensors that use 256 instead of 448 "
           "as the E4M3 bound of their global scale.", field="nvfp4_4over6_e4m3_use_256",
           recipes=NVFP4, choices=_SCOPES, te_name=True),
    EnvVar("NVTE_NVFP4_4OVER6_ERR_MODE", "choice", "Error metric that picks the 4over6 candidate.",
           field="nvfp4_4over6_err_mode", recipes=NVFP4, choices=("MAE", "MSE"), te_name=True),
    EnvVar("NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH", "bool", "Compute the 4over6 error in the FP16 "
           "product domain (a different, documented numeric contract).",
           field="nvfp4_4over6_err_use_fast_math", recipes=NVFP4, te_name=True),
    # --- all recipes ---------------------------------------------------------------------------
    EnvVar("NVTE_BACKWARD_OVERRIDE", "choice", "Run dgrad/wgrad in high precision: on the original "
           "operands (high_precision) or on the dequantized forward operands (dequantized).",
           field="backward_override", recipes=ALL_RECIPES,
           choices=("none", "high_precision", "dequantized"), te_name=True),
    # --- FP8 ---------------------------------------------------------------------------------
    EnvVar("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "bool", "Round current-scaling FP8 scales "
           "down to a power of two.", field="use_power_2_scales", recipes=CURRENT, te_name=True),
    EnvVar("FP_RECIPES_FP8_FORMAT", "choice", "FP8 formats: E4M3 everywhere, E5M2 everywhere, or "
           "HYBRID (E4M3 forward, E5M2 gradients).", field="fp8_format", recipes=FP8,
           choices=("E4M3", "E5M2", "HYBRID")),
    EnvVar("FP_RECIPES_FP8_FAST_ACCUMULATION", "subset", "FP8 GEMMs that accumulate in the tensor cores' fast "
           "mode (cuBLASLt FAST_ACCUM, TransformerEngine's use_split_accumulator=False): faster on Hopper, "
           "with fewer accumulator bits. The default, fprop, is TransformerEngine's and torchao's.",
           field="fast_accumulation", recipes=FP8, choices=GEMMS),
    EnvVar("FP_RECIPES_DELAYED_MARGIN", "int", "Delayed scaling: scale = fp8_max / amax / 2**margin.",
           field="margin", recipes=DELAYED, minimum=0),
    EnvVar("FP_RECIPES_DELAYED_AMAX_HISTORY_LEN", "int", "Delayed scaling: steps of amax history.",
           field="amax_history_len", recipes=DELAYED, minimum=1),
    EnvVar("FP_RECIPES_DELAYED_AMAX_COMPUTE_ALGO", "choice", "Delayed scaling: the amax a scale is "
           "computed from (max of the history, or the most recent entry).",
           field="amax_compute_algo", recipes=DELAYED, choices=("max", "most_recent")),
    EnvVar("FP_RECIPES_DELAYED_REDUCE_AMAX", "bool", "Delayed scaling: MAX-reduce amaxes over the "
           "autocast's amax_reduction_group.", field="reduce_amax", recipes=DELAYED),
    EnvVar("FP_RECIPES_CURRENT_AMAX_EPSILON", "float", "Current scaling: floor of the amax a scale "
           "is computed from.", field="amax_epsilon", recipes=CURRENT, minimum=0.0),
    # --- per-token -----------------------------------------------------------------------------
    EnvVar("FP_RECIPES_PER_TOKEN_FORMAT", "choice", "Per-token cast format.", field="fmt",
           recipes=PER_TOKEN, choices=("e5m6", "e4m3")),
    EnvVar("FP_RECIPES_PER_TOKEN_ROUND_SF", "bool", "Per-token: round each scale up to a power of "
           "two.", field="round_sf", recipes=PER_TOKEN),
    EnvVar("FP_RECIPES_PER_TOKEN_SCALE_FORMAT", "choice", "Per-token: store scales as FP32 or as "
           "UE8M0 exponent bytes (needs round_sf).", field="scale_format", recipes=PER_TOKEN,
           choices=("fp32", "ue8m0")),
    # --- selection and build -------------------------------------------------------------------
    EnvVar("FP_RECIPES_RECIPE", "choice", "The recipe autocast() uses when given none "
           "(recipe_from_env); none turns quantization off.", use="select",
           choices=("none", "delayed", "current", "nvfp4", "per_token")),
    EnvVar("FP_RECIPES_NVFP4_GEMM", "choice", "Which NVFP4 x NVFP4 GEMM runs. auto: native FP4 "
           "tensor cores (torch._scaled_mm) on sm_100+/sm_120 once a first-use self-check against the exact "
           "emulation passes (else one warning and the emulation), the exact emulation on every other "
           "device; native: the native GEMM wherever the device has FP4 tensor cores, without the "
           "self-check, errors raise; emulated: the exact emulation everywhere. The native path has not "
           "run on Blackwell hardware in this project.", use="backend",
           choices=("auto", "native", "emulated")),
    EnvVar("FP_RECIPES_TORCH_OPS", "choice", "The host path of the eager FP8 casts and GEMMs, the NVFP4 "
           "quantize launches and emulated GEMMs, the delayed-scaling updates and the FP8 casts and GEMMs a "
           "torch.compile graph calls, on CUDA. auto: one torch-linked C++ call each (fp_recipes._torch_ops; the "
           "graph's ops as C++ CUDA kernels) where it was built (pip install --no-build-isolation), else the Python "
           "path; off: the Python path. Both make the same launches with the same arguments.", use="backend",
           choices=("auto", "off")),
    EnvVar("FP_RECIPES_CUDA_ARCHS", "archs", "Build: ';'-separated CUDA archs for fp_recipes._C "
           "(default 90a;100a).", use="build", hint="';'-separated archs, e.g. 90a;100a"),
    EnvVar("FP_RECIPES_NO_CUDA", "bool", "Build: skip the CUDA extension on purpose.", use="build"),
    EnvVar("FP_RECIPES_NVCC_THREADS", "int", "Build: parallel nvcc jobs (default: CPU count).",
           use="build", minimum=1),
)

# TransformerEngine variables that mean nothing here, each with why. They are known names (no
# typo warning, `env --strict` passes), listed by `python -m fp_recipes env` as ignored.
TE_NOT_USED: Dict[str, str] = {
    "NVTE_FLASH_ATTN": "attention backend selection: fp_recipes has no attention module",
    "NVTE_FUSED_ATTN": "attention backend selection: fp_recipes has no attention module",
    "NVTE_UNFUSED_ATTN": "attention backend selection: fp_recipes has no attention module",
    "NVTE_FUSED_ATTN_BACKEND": "attention backend selection: fp_recipes has no attention module",
    "NVTE_FP8_DPA_BWD": "FP8 dot-product attention: fp_recipes has no attention module",
    "NVTE_APPLY_QK_LAYER_SCALING": "attention scaling: fp_recipes has no attention module",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "fused-attention algorithm choice: no attention module here",
    "NVTE_BIAS_GELU_NVFUSION": "TE's fused bias+GELU in its MLP module: fp_recipes has no MLP module",
    "NVTE_BIAS_DROPOUT_FUSION": "TE's fused bias+dropout in its transformer layer: none here",
    "NVTE_TORCH_COMPILE": "TE's torch.compile of small fusions: fp_recipes fuses nothing with compile",
    "NVTE_USE_FAST_MATH": "TE's fast-math kernel flag: here fast math is per recipe field "
                          "(NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH)",
    "NVTE_DEBUG": "TE's debug logging: fp_recipes reports through warnings and `python -m fp_recipes doctor`",
    "NVTE_DEBUG_LEVEL": "TE's debug logging: fp_recipes reports through warnings and `python -m fp_recipes doctor`",
    "NVTE_FWD_LAYERNORM_SM_MARGIN": "SMs left free by TE's fused LayerNorm kernels: norms here are torch's",
    "NVTE_BWD_LAYERNORM_SM_MARGIN": "SMs left free by TE's fused LayerNorm kernels: norms here are torch's",
    "NVTE_NORM_FWD_USE_CUDNN": "cuDNN normalization in TE: norms here are torch's",
    "NVTE_NORM_BWD_USE_CUDNN": "cuDNN normalization in TE: norms here are torch's",
    "NVTE_UB_WITH_MPI": "TE's userbuffers comm-GEMM overlap: not implemented here",
    "NVTE_FRAMEWORK": "TE's build: fp_recipes builds with FP_RECIPES_CUDA_ARCHS / FP_RECIPES_NO_CUDA",
    "NVTE_CUDA_ARCHS": "TE's build: fp_recipes reads FP_RECIPES_CUDA_ARCHS",
    "NVTE_BUILD_THREADS_PER_JOB": "TE's build: fp_recipes reads FP_RECIPES_NVCC_THREADS",
    "NVTE_RELEASE_BUILD": "TE's build: not used by fp_recipes' setup.py",
    "NVTE_CUDA_INCLUDE_PATH": "TE's runtime compilation (NVRTC): fp_recipes compiles nothing at run time",
    "NVTE_DISABLE_NVRTC": "TE's runtime compilation (NVRTC): fp_recipes compiles nothing at run time",
}

BY_NAME: Dict[str, EnvVar] = {v.name: v for v in TABLE}
_ALIASES: Dict[str, Tuple[EnvVar, ...]] = {
    v.name: tuple(a for a in TABLE if a.alias_of == v.name) for v in TABLE}


def user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by the CALLER of this function that points at
    the first frame outside fp_recipes and pydantic (the user's line that built the recipe)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../fp_recipes
    level, frame = 1, sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not (filename.startswith(package) or f"{os.sep}pydantic" in filename):
            return level
        frame, level = frame.f_back, level + 1
    return level


def lookup(name: str) -> EnvVar:
    return BY_NAME[name]


def _raw(name: str, environ: Mapping[str, str]) -> Optional[str]:
    """The variable's value, or None when unset or empty."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw


def resolve_env(recipe: str, given: Set[str] = frozenset(),
                environ: Optional[Mapping[str, str]] = None) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Values and sources of the fields of ``recipe`` (a class name) that the environment sets.

    Fields in ``given`` (explicit arguments) are skipped: arguments beat the environment.
    Returns (field -> typed value, field -> ``"env NAME=value"``).
    """
    environ = os.environ if environ is None else environ
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for var in TABLE:
        if var.use != "recipe" or recipe not in var.recipes or var.field in given:
            continue
        if var.alias_of is not None:
            continue  # handled together with the variable it aliases
        raw = _raw(var.name, environ)
        value = var.parse(raw) if raw is not None else None
        for alias in _ALIASES.get(var.name, ()):
            alias_raw = _raw(alias.name, environ)
            if alias_raw is None:
                continue
            alias_value = alias.parse(alias_raw)
            warnings.warn(
                f"{alias.name} is deprecated; set {var.name}={alias_raw.strip()} instead",
                EnvVarDeprecationWarning, stacklevel=user_stacklevel())
            if raw is None:
                raw, value, var_used = alias_raw, alias_value, alias
                values[var.field] = value
                sources[var.field] = f"env {var_used.name}={raw}"
            elif alias_value != value:
                raise EnvVarError(
                    f"{var.name}={raw!r} and its deprecated alias {alias.name}={alias_raw!r} "
                    f"disagree; unset {alias.name} (or set both to the same value)")
        if raw is not None and var.field not in sources:
            values[var.field] = value
            sources[var.field] = f"env {var.name}={raw}"
    return values, sources


_OURS = re.compile(r"^(NVTE_|NVET_|NTVE_|FP_?RECIPES?_)")  # every name that looks like ours or TE's


def looks_like_ours(name: str) -> bool:
    """A name fp_recipes should know: any ``NVTE_*`` (and its common misspellings) or ``FP_RECIPE*``."""
    return bool(_OURS.match(name))


def is_known(name: str) -> bool:
    return name in BY_NAME or name in TE_NOT_USED


def unknown_env(environ: Optional[Mapping[str, str]] = None) -> List[Tuple[str, Optional[str]]]:
    """Set variables that look like ours or TE's but are in neither table, with the closest known name."""
    environ = os.environ if environ is None else environ
    out = []
    for name in sorted(n for n in environ if looks_like_ours(n) and not is_known(n)):
        out.append((name, closest_name(name)))
    return out


def te_not_used_env(environ: Optional[Mapping[str, str]] = None) -> List[Tuple[str, str]]:
    """Set TransformerEngine variables that fp_recipes ignores, with why."""
    environ = os.environ if environ is None else environ
    return [(n, TE_NOT_USED[n]) for n in sorted(environ) if n in TE_NOT_USED]


# the prefix a name is read under; a misspelt prefix counts as the one it resembles
_PREFIX_FORMS: Tuple[Tuple[str, "re.Pattern[str]"], ...] = (
    ("NVTE_NVFP4_", re.compile(r"^NVTE_NVFP4_")),
    ("NVTE_FP8_", re.compile(r"^NVTE_FP8_")),
    ("FP_RECIPES_", re.compile(r"^FP_?RECIPES?_")),
    ("NVTE_", re.compile(r"^(NVTE|NVET|NTVE)_")),
)


def _strip_prefix(name: str) -> Tuple[str, str]:
    for prefix, pattern in _PREFIX_FORMS:
        m = pattern.match(name)
        if m:
            return prefix, name[m.end():]
    return "", name


def closest_name(name: str, cutoff: float = 0.7) -> Optional[str]:
    """The variable fp_recipes reads that is most like ``name``; a shared prefix alone does not count."""
    prefix, rest = _strip_prefix(name)
    best, best_score = None, cutoff
    for known in BY_NAME:
        known_prefix, known_rest = _strip_prefix(known)
        score = difflib.SequenceMatcher(None, rest, known_rest).ratio()
        if len(rest) >= 6 and known_rest.startswith(rest[:-2]):  # a truncated name
            score = max(score, 0.75)
        if known_prefix != prefix:  # the right name under another (or a misspelt) prefix
            score = max(score, difflib.SequenceMatcher(None, name, known).ratio()) * 0.9
        if score >= best_score:
            best, best_score = known, score
    return best


def warn_unknown_env(environ: Optional[Mapping[str, str]] = None) -> None:
    for name, suggestion in unknown_env(environ):
        hint = (f"did you mean {suggestion}?" if suggestion
                else "`python -m fp_recipes env` lists the known variables")
        warnings.warn(f"unknown environment variable {name} is set and ignored by fp_recipes; {hint}",
                      UnknownEnvVarWarning, stacklevel=user_stacklevel())


# ----------------------------------------------------------------------------------------------
# reports: the CLI table and the generated docs


def _defaults() -> Dict[Tuple[str, str], Any]:
    from . import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling

    out = {}
    for cls in (DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling, PerTokenScaling):
        for name, info in cls.model_fields.items():
            out[(cls.__name__, name)] = info.default
    return out


def _fmt_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(value) if value else "none"
    return str(getattr(value, "value", value))


def default_of(var: EnvVar) -> str:
    """The value a recipe field takes when the variable is unset ("" when not a recipe field)."""
    if var.use == "select":
        return "delayed"
    if var.use == "backend":
        return {"FP_RECIPES_NVFP4_GEMM": "auto", "FP_RECIPES_TORCH_OPS": "auto"}.get(var.name, "")
    if var.use == "build":
        return {"FP_RECIPES_CUDA_ARCHS": "90a;100a", "FP_RECIPES_NO_CUDA": "0",
                "FP_RECIPES_NVCC_THREADS": "CPU count"}.get(var.name, "")
    defaults = _defaults()
    by_recipe = {r: _fmt_default(defaults[(r, var.field)]) for r in var.recipes
                 if (r, var.field) in defaults}
    values = list(by_recipe.values())
    common = max(set(values), key=values.count) if values else ""
    exceptions = [f"{r}: {v}" for r, v in by_recipe.items() if v != common]
    return common + (f" ({'; '.join(exceptions)})" if exceptions else "")


def report(environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Every variable with its current value and status, plus the unknown ones (for the CLI)."""
    environ = os.environ if environ is None else environ
    rows = []
    for var in TABLE:
        raw = environ.get(var.name)
        status = "unset"
        if raw is not None and raw.strip() == "":
            status = "empty (unset)"
        elif raw is not None:
            try:
                var.parse(raw)
                status = "deprecated" if var.alias_of else "ok"
            except EnvVarError as exc:
                status = f"error: {exc}"
        rows.append({"name": var.name, "value": raw, "sets": var.sets, "allowed": var.allowed,
                     "default": default_of(var), "use": var.use, "status": status,
                     "doc": var.doc})
    unknown = [{"name": n, "value": environ[n], "suggestion": s} for n, s in unknown_env(environ)]
    ignored = [{"name": n, "value": environ[n], "why": why} for n, why in te_not_used_env(environ)]
    return {"variables": rows, "unknown": unknown, "te_not_used": ignored}


def render_text(environ: Optional[Mapping[str, str]] = None) -> str:
    rep = report(environ)
    cols = ("name", "value", "sets", "allowed", "status")
    table = [[r["name"], "-" if r["value"] is None else r["value"], r["sets"], r["allowed"],
              r["status"]] for r in rep["variables"]]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    for u in rep["unknown"]:
        hint = f"did you mean {u['suggestion']}?" if u["suggestion"] else "no close match"
        lines.append(f"UNKNOWN {u['name']}={u['value']}: ignored; {hint}")
    for t in rep["te_not_used"]:
        lines.append(f"TE ONLY {t['name']}={t['value']}: ignored by fp_recipes ({t['why']})")
    return "\n".join(lines)


def render_json(environ: Optional[Mapping[str, str]] = None) -> str:
    return json.dumps(report(environ), indent=2)


def render_markdown() -> str:
    """docs/envvars.md (generated: edit the table in fp_recipes/recipes/env.py, not the doc)."""
    out = [
        "# Environment variables",
        "",
        "<!-- GENERATED from fp_recipes/recipes/env.py by `python -m fp_recipes env --markdown`; "
        "do not edit by hand (tests/test_foundation_docs.py fails when this file is stale). -->",
        "",
        "Every variable fp_recipes reads. Recipes read them **when they are constructed**, never at "
        "import, so a variable set after `import fp_recipes` applies to every recipe built "
        "afterwards. Precedence: explicit argument > environment variable > default; "
        "`recipe.provenance()` tells which one each field came from.",
        "",
        "- Booleans accept `1/0`, `true/false`, `yes/no`, `on/off` in any case; choices are "
        "case-insensitive. An empty value counts as unset.",
        "- A value that is not allowed raises an error naming the variable, the value and the "
        "allowed values.",
        "- Every set variable named `NVTE_*` or `FP_RECIPE*` (misspellings of the prefix included, "
        "e.g. `FP_RECIPE_RECIPE`) that is in neither table below draws a warning naming the closest "
        "known variable; `python -m fp_recipes env --strict` exits 1 in that case, and also when a "
        "value is not allowed or a recipe the environment touches cannot be built (for launch scripts).",
        "- Variables marked TE have the same name and meaning as in TransformerEngine.",
        "",
        "| Variable | Sets | Allowed values | Default | TE | Description |",
        "|---|---|---|---|---|---|",
    ]
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    for var in TABLE:
        out.append(f"| `{var.name}` | {cell(var.sets)} | {cell(var.allowed)} | "
                   f"{cell(default_of(var))} | {'yes' if var.te_name else ''} | {cell(var.doc)} |")
    out += [
        "",
        "`FP_RECIPES_RECIPE` picks the recipe that `fp_recipes.autocast()` uses when called without "
        "one (`recipe_from_env()`): `delayed` (the default), `current`, `nvfp4`, `per_token`, or "
        "`none` (quantization off, e.g. for a BF16 baseline of the same script).",
        "",
        "`NVTE_NVFP4_PER_TOKEN_ACTIVATION` is the older name of "
        "`NVTE_NVFP4_ROW_SCALED_ACTIVATION`: it still works, with a deprecation warning; if both are "
        "set to different values, constructing an NVFP4 recipe fails.",
        "",
        "`FP_RECIPES_NVFP4_GEMM` is not a recipe field: the GEMM reads only the tensors it multiplies, "
        "so this variable is read where the NVFP4 GEMM implementation is chosen (at each NVFP4 GEMM; the "
        "first-use self-check runs once per device and value). `python -m fp_recipes doctor` says which "
        "path runs. See docs/nvfp4.md, \"Native GEMMs on Blackwell\".",
        "",
        "Build variables are read by `setup.py` when `pip install` compiles the CUDA extension; "
        "they are listed so that the unknown-variable check knows them.",
        "",
        "## TransformerEngine variables fp_recipes does not use",
        "",
        "Known names, so they draw no typo warning (a launch script shared with TransformerEngine "
        "may set them); `python -m fp_recipes env` lists the ones that are set as ignored.",
        "",
        "| Variable | Why it means nothing here |",
        "|---|---|",
    ]
    out += [f"| `{name}` | {cell(why)} |" for name, why in TE_NOT_USED.items()]
    out.append("")
    return "\n".join(out)


__all__ = [
    "BY_NAME",
    "EnvVar",
    "EnvVarDeprecationWarning",
    "EnvVarError",
    "PREFIXES",
    "TABLE",
    "TE_NOT_USED",
    "UnknownEnvVarWarning",
    "closest_name",
    "is_known",
    "looks_like_ours",
    "render_json",
    "render_markdown",
    "render_text",
    "report",
    "resolve_env",
    "te_not_used_env",
    "unknown_env",
    "warn_unknown_env",
]
