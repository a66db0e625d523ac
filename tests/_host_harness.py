"""Build a tests/*_host harness (CUDA device headers compiled for the CPU with g++) into a ctypes library.

The kernels' per-element arithmetic lives in headers (formats.cuh, nvfp4_device.cuh) that also compile as
host code; CPU CI checks them against the torch references through these harnesses.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    for base in ("/usr/local/cuda", nvcc and str(Path(nvcc).resolve().parent.parent)):
        if base and (Path(base) / "include" / "cuda_fp8.h").is_file():
            return Path(base) / "include"
    return None


def build_harness(source: Path, out_dir: Path, name: str, opt: str = "-O2") -> ctypes.CDLL:
    """Compile ``source`` with the CUDA headers on the include path; skip (with the reason) where the
    machine has no C++ compiler or no CUDA headers."""
    cxx = shutil.which("g++") or shutil.which("c++")
    inc = cuda_include()
    if cxx is None or inc is None:
        pytest.skip("needs a C++ compiler and the CUDA headers (cuda_fp8.h)")
    out = out_dir / f"lib{name}.so"
    cmd = [cxx, opt, "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared", "-w",
           f"-I{ROOT / 'fp_recipes' / 'csrc'}", f"-I{inc}", str(source), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return ctypes.CDLL(str(out))


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
