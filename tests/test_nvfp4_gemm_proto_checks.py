"""The CPU checks of the decode-in-mainloop NVFP4 GEMM prototype (benchmarks/nvfp4_gemm_proto/), run as scripts the
way its README runs them: the decodes' exactness proof and the randomized model of v5's mbarrier protocol. Each also
shows it can fail, so a passing run means something."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import torch

PROTO = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "nvfp4_gemm_proto"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROTO / script), *args], capture_output=True, text=True, timeout=300)


def test_decodes_are_exact_for_every_code_and_scale():
    res = _run("check_decode.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("4096 (code, scale) pairs: 0 inexact products, 32 NaN") == 2, res.stdout


def test_decode_check_catches_an_overflowing_scale_factor():
    """The integer decode's scale times 2^8 instead of 2^7 overflows FP16 for the largest scales: the check fails."""
    spec = importlib.util.spec_from_file_location("check_decode", PROTO / "check_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    codes = torch.arange(16)
    value = (((codes & 8) << 12) | ((codes & 7) << 9)).to(torch.int16).view(torch.float16)
    exact = torch.tensor(mod.E2M1, dtype=torch.float64)
    assert mod.check("integer decode", value, exact, 128.0, 2.0 ** -7)
    try:
        ok = mod.check("mutant", value, exact, 256.0, 2.0 ** -6)
    except AssertionError:  # the infinities from the overflow are not the reference's NaN positions
        ok = False
    assert not ok


def test_protocol_model_finds_no_deadlock_or_race():
    res = _run("check_protocol.py", "--seeds", "15")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no deadlock, no slot or stage race" in res.stdout


def test_protocol_model_catches_a_refill_before_the_readers():
    """Copies 4 steps ahead with 7 slots and without the wait on the slot's readers overwrite a slot still read."""
    res = _run("check_protocol.py", "--ahead", "4", "--skip-freed-wait", "--seeds", "15")
    assert res.returncode != 0
    assert "slot overwrite while read" in res.stdout + res.stderr
