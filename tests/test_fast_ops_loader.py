"""How fp_recipes finds its torch-linked host path (``_extension.fast_ops``, FP_RECIPES_TORCH_OPS) on any
machine: off by the variable, a bad value refused with the table's message, a missing or mismatched module
reported (never an exception on the hot path), and what doctor prints. The GPU behaviour is in
tests/test_cuda_fast_ops.py."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

import fp_recipes
from fp_recipes import _extension
from fp_recipes.recipes.env import BY_NAME, EnvVarError


@pytest.fixture
def fresh(monkeypatch):
    """A process state in which fast_ops() has not looked yet."""
    monkeypatch.setattr(_extension, "_fast", None)
    monkeypatch.setattr(_extension, "_fast_status", "")
    monkeypatch.setattr(_extension, "_fast_loaded", False)
    return monkeypatch


def test_off_by_the_variable(fresh):
    fresh.setenv("FP_RECIPES_TORCH_OPS", "OFF")
    assert _extension.fast_ops() is None
    assert _extension.fast_ops_status() == "off (FP_RECIPES_TORCH_OPS=off)"


def test_a_bad_value_names_the_variable_and_the_allowed_values(fresh):
    fresh.setenv("FP_RECIPES_TORCH_OPS", "fast")
    with pytest.raises(ValueError) as err:
        _extension.fast_ops()
    with pytest.raises(EnvVarError) as table_err:  # the env table's own check of the same value
        BY_NAME["FP_RECIPES_TORCH_OPS"].parse("fast")
    assert str(err.value) == str(table_err.value)
    assert "FP_RECIPES_TORCH_OPS='fast' is not allowed; allowed: auto | off (any case)" in str(err.value)
    assert BY_NAME["FP_RECIPES_TORCH_OPS"].choices == _extension.FAST_OPS_CHOICES


def test_not_built_is_reported(fresh):
    fresh.delenv("FP_RECIPES_TORCH_OPS", raising=False)
    fresh.setitem(sys.modules, "fp_recipes._torch_ops", None)  # import fails, as where it was not built
    fresh.delattr(fp_recipes, "_torch_ops", raising=False)  # (an earlier import left it on the package)

    class Ext:  # an extension with a kernel table
        @staticmethod
        def kernel_table():
            return object()

    fresh.setattr(_extension, "_ext", Ext())
    fresh.setattr(_extension, "_ext_loaded", True)
    assert _extension.fast_ops() is None
    assert _extension.fast_ops_status().startswith("not built or not loadable")
    assert "--no-build-isolation" in _extension.fast_ops_status()


def test_an_extension_without_a_kernel_table_is_reported(fresh):
    fresh.delenv("FP_RECIPES_TORCH_OPS", raising=False)
    fresh.setattr(_extension, "_ext", object())
    fresh.setattr(_extension, "_ext_loaded", True)
    assert _extension.fast_ops() is None
    assert _extension.fast_ops_status() == "unavailable: fp_recipes._C has no kernel table"


def test_a_stand_in_table_is_refused_by_the_module(fresh):
    """Where the module is built (a GPU machine, or a development machine with --no-build-isolation), init()
    checks what it is given: anything but _C's capsule is reported, not used."""
    pytest.importorskip("fp_recipes._torch_ops")
    fresh.delenv("FP_RECIPES_TORCH_OPS", raising=False)

    class Ext:
        @staticmethod
        def kernel_table():
            return "not a capsule"

    fresh.setattr(_extension, "_ext", Ext())
    fresh.setattr(_extension, "_ext_loaded", True)
    assert _extension.fast_ops() is None
    assert _extension.fast_ops_status().startswith("unavailable: ")


def test_doctor_reports_the_host_path():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "fp_recipes", "doctor"], capture_output=True, text=True,
                         env={**__import__("os").environ, "FP_RECIPES_TORCH_OPS": "off"})
    assert "host path (FP_RECIPES_TORCH_OPS): off (FP_RECIPES_TORCH_OPS=off)" in out.stdout, out.stdout


def _register_with(monkeypatch, fast, gemm_path):
    """register_traced_kernels() in a process where fast_ops() returns ``fast`` and the FP8 GEMM's C++ path is
    ``gemm_path`` (None: cuBLASLt's single GEMM is not there), looking for the first time."""
    from fp_recipes.gemm import fp8 as gemm_fp8

    monkeypatch.setattr(_extension, "_fast", fast)
    monkeypatch.setattr(_extension, "_fast_loaded", True)
    monkeypatch.setattr(gemm_fp8, "_FAST_GEMM", [gemm_path])
    monkeypatch.setattr(gemm_fp8, "_TRACED_KERNELS", [])
    return gemm_fp8.register_traced_kernels()


class _RecordingOps:
    """A torch-linked module that records what it was asked to register (the real one needs torch's headers)."""

    def __init__(self):
        self.calls = []

    def register_traced_ops(self, impls, workspace_bytes):
        self.calls.append((dict(impls), workspace_bytes))
        return list(impls)


def test_traced_kernels_are_registered_once_with_the_ops_python_implementations(monkeypatch):
    """The traced FP8 ops get their C++ CUDA kernels once per process, each with the op's own Python implementation
    to run where the C++ call declines; the GEMM op only where the C++ GEMM path exists (cuBLASLt's single GEMM)."""
    from fp_recipes.gemm import cublaslt
    from fp_recipes.gemm import fp8 as gemm_fp8
    from fp_recipes.ops import cuda_fp8

    fast = _RecordingOps()
    names = _register_with(monkeypatch, fast, gemm_path=fast)
    assert sorted(names) == sorted(["fp8_delayed_cast", "fp8_delayed_cast_dbias", "fp8_delayed_rowwise_cast",
                                    "fp8_current_scaling_quantize", "fp8_current_cast_dbias", "fp8_mm"])
    (impls, workspace), = fast.calls
    assert workspace == cublaslt.WORKSPACE_BYTES
    assert impls["fp8_mm"] is gemm_fp8._fp8_mm
    assert impls["fp8_delayed_cast"] is cuda_fp8._fp8_delayed_cast_impl
    assert impls["fp8_current_scaling_quantize"] is cuda_fp8._fp8_current_impl
    for name, impl in impls.items():  # the C++ kernel calls it with the op's arguments, in the schema's order
        schema = getattr(torch.ops.fp_recipes, name).default._schema
        assert [a.name for a in schema.arguments] == list(inspect.signature(impl).parameters), name
    assert gemm_fp8.register_traced_kernels() == names and len(fast.calls) == 1  # once

    fast = _RecordingOps()
    assert "fp8_mm" not in _register_with(monkeypatch, fast, gemm_path=None)  # no C++ GEMM path: Python's op
    assert _register_with(monkeypatch, None, gemm_path=None) == []  # FP_RECIPES_TORCH_OPS=off or not built


def test_a_module_with_the_activation_casts_registers_their_ops_too(monkeypatch):
    """A module built with the activation casts (``fp8_cast_acts``, kernel table v3) also gets the fused GELU casts'
    ops (``ops/cuda_fp8_act.py``), each with its Python implementation, arguments in the schema's order; the
    module built here has them."""
    from fp_recipes.ops import cuda_fp8_act

    fast = _RecordingOps()
    fast.fp8_cast_acts = True
    names = _register_with(monkeypatch, fast, gemm_path=fast)
    assert {"fp8_delayed_act_cast", "fp8_current_act_cast"} <= set(names)
    (impls, _), = fast.calls
    assert impls["fp8_delayed_act_cast"] is cuda_fp8_act._delayed_act_cast_impl
    assert impls["fp8_current_act_cast"] is cuda_fp8_act._current_act_cast_impl
    for name in ("fp8_delayed_act_cast", "fp8_current_act_cast"):
        schema = getattr(torch.ops.fp_recipes, name).default._schema
        assert [a.name for a in schema.arguments] == list(inspect.signature(impls[name]).parameters), name


def test_the_built_module_has_the_activation_casts():
    """Where the torch-linked module is built, it is version 3's: fp8_cast takes ``act`` and says so."""
    mod = pytest.importorskip("fp_recipes._torch_ops")
    assert mod.fp8_cast_acts is True
    assert "act" in mod.fp8_cast.__doc__
