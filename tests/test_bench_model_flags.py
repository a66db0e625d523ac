"""benchmarks/bench_model.py's ``--gemm-workspace``: the cuBLASLt workspace of fp_recipes' dense GEMMs for an A/B of
the per-GEMM memsets (NOTES_fp8.md, session 33). The flag takes effect before anything runs: on a CPU the script
stops at its GPU check right after it."""

from __future__ import annotations

import sys

import pytest
import torch

sys.path.insert(0, "benchmarks")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() would run the whole benchmark")
def test_gemm_workspace_flag_sets_the_workspace(monkeypatch):
    import bench_model
    from fp_recipes.gemm import cublaslt

    monkeypatch.setattr(cublaslt, "WORKSPACE_BYTES", cublaslt.WORKSPACE_BYTES)  # restored after the test
    assert cublaslt.WORKSPACE_BYTES == 0  # the default: no workspace, no memset launch per GEMM
    assert bench_model.main(["--linear", "--gemm-workspace", str(32 * 2**20)]) == 1  # needs a CUDA GPU: stops there
    assert cublaslt.WORKSPACE_BYTES == 32 * 2**20

