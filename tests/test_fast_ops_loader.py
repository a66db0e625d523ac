"""How fp_recipes finds its torch-linked host path (``_extension.fast_ops``, FP_RECIPES_TORCH_OPS) on any
machine: off by the variable, a bad value refused with the table's message, a missing or mismatched module
reported (never an exception on the hot path), and what doctor prints. The GPU behaviour is in
tests/test_cuda_fast_ops.py."""

from __future__ import annotations

import sys

import pytest

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
