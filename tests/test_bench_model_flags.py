"""benchmarks/bench_model.py's A/B flags: ``--gemm-workspace`` (the cuBLASLt workspace of fp_recipes' dense GEMMs, for
an A/B of the per-GEMM memsets: NOTES_fp8.md, session 33) and ``--nvfp4-row-scratch-ab`` (row-scaled NVFP4 GEMMs
chunked by an FP32 scratch budget: NOTES_nvfp4.md, session 35), the NVFP4 unit-operand flags and --compiled-nvfp4
(session 36). The flags take effect before anything runs: on a CPU
the script stops at its GPU check right after them."""

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



@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() would run the whole benchmark")
def test_gemm_workspace_ab_rows_set_and_restore_the_workspace(monkeypatch):
    """--gemm-workspace-ab BYTES runs each eager quantized row again inside gemm_workspace(BYTES): the rows see BYTES,
    and the default comes back after each (also when a row raises)."""
    import bench_model
    from fp_recipes.gemm import cublaslt

    monkeypatch.setattr(cublaslt, "WORKSPACE_BYTES", cublaslt.WORKSPACE_BYTES)
    assert bench_model.main(["--gemm-workspace-ab", "4096"]) == 1  # parses; stops at the GPU check
    with bench_model.gemm_workspace(4096):
        assert cublaslt.WORKSPACE_BYTES == 4096
    assert cublaslt.WORKSPACE_BYTES == 0
    with pytest.raises(RuntimeError), bench_model.gemm_workspace(8192):
        raise RuntimeError("a failing row")
    assert cublaslt.WORKSPACE_BYTES == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() would run the whole benchmark")
def test_nvfp4_row_scratch_ab_rows_set_and_restore_the_budget():
    """--nvfp4-row-scratch-ab BYTES runs each row-scaled NVFP4 row again inside nvfp4_row_scratch(BYTES): those rows
    chunk their row-scaled GEMMs by that FP32 scratch budget, and the default (None: the row-count chunks) comes back
    after each (also when a row raises)."""
    import bench_model
    from fp_recipes.gemm import nvfp4_emulated as E

    assert E.ROW_CHUNK_SCRATCH_BYTES is None
    assert bench_model.main(["--nvfp4-row-scratch-ab", str(16 * 2**20)]) == 1  # parses; stops at the GPU check
    with bench_model.nvfp4_row_scratch(16 * 2**20):
        assert E.ROW_CHUNK_SCRATCH_BYTES == 16 * 2**20
        assert E.row_chunk(8192, 8192) == 512  # 16 MiB / (4 bytes x 8192 columns)
    assert E.ROW_CHUNK_SCRATCH_BYTES is None and E.row_chunk(8192, 8192) == 2048  # 4 chunks of >= 1024 rows
    with pytest.raises(RuntimeError), bench_model.nvfp4_row_scratch(4096):
        raise RuntimeError("a failing row")
    assert E.ROW_CHUNK_SCRATCH_BYTES is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() would run the whole benchmark")
def test_nvfp4_unit_flags(monkeypatch):
    """--nvfp4-units-ab MODE runs each NVFP4 row again inside nvfp4_module_units(MODE): the modules' activation and
    gradient quantizers made there write MODE's unit operands, and "rowwise" (the default) comes back after each.
    --nvfp4-gemm-units MODE sets every NVFP4 quantizer's, modules' included; --compiled-nvfp4 adds compiled NVFP4 rows."""
    import bench_model
    from fp_recipes.quantizers.nvfp4 import NVFP4Quantizer

    monkeypatch.setattr(NVFP4Quantizer, "default_gemm_units", NVFP4Quantizer.default_gemm_units)
    monkeypatch.setattr(NVFP4Quantizer, "module_gemm_units", NVFP4Quantizer.module_gemm_units)
    monkeypatch.setattr(bench_model, "COMPILED_NVFP4", [False, False])
    assert NVFP4Quantizer.module_gemm_units == "rowwise" and NVFP4Quantizer.default_gemm_units == "none"
    assert bench_model.main(["--nvfp4-units-ab", "none", "--compiled-nvfp4", "--nvfp4-traced-ops-ab"]) == 1
    assert bench_model.COMPILED_NVFP4 == [True, True]  # (parsed; main stopped at its GPU check)
    from fp_recipes.gemm import nvfp4_emulated

    assert nvfp4_emulated.TRACED_AS_OP and NVFP4Quantizer.traced_sr_as_op  # the defaults: one op each
    with bench_model.nvfp4_traced_torch_ops():
        assert not nvfp4_emulated.TRACED_AS_OP and not NVFP4Quantizer.traced_sr_as_op
    assert nvfp4_emulated.TRACED_AS_OP and NVFP4Quantizer.traced_sr_as_op
    with bench_model.nvfp4_module_units("none"):
        assert NVFP4Quantizer.module_gemm_units == "none"
    assert NVFP4Quantizer.module_gemm_units == "rowwise"
    with pytest.raises(RuntimeError), bench_model.nvfp4_module_units("auto"):
        raise RuntimeError("a failing row")
    assert NVFP4Quantizer.module_gemm_units == "rowwise"
    assert bench_model.main(["--nvfp4-gemm-units", "all"]) == 1
    assert NVFP4Quantizer.module_gemm_units == "all" and NVFP4Quantizer.default_gemm_units == "all"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU main() would run the whole benchmark")
def test_fast_accum_ab_adds_an_all_fast_twin_of_each_fp8_row(monkeypatch):
    """--fast-accum-ab: each FP8 recipe's row again with fast_accumulation='all' (the only field changed); NVFP4 rows
    (BF16 GEMMs on Hopper) get none."""
    import bench_model

    monkeypatch.setattr(bench_model, "FAST_ACCUM_AB", [False])
    assert bench_model.main(["--fast-accum-ab"]) == 1  # parses; stops at the GPU check
    assert bench_model.FAST_ACCUM_AB == [True]
    for name, recipe in bench_model.recipes().items():
        rows = bench_model.fast_accum_variants(name, recipe)
        assert rows[0] == (name, recipe)
        if name.startswith("FP8"):
            label, twin = rows[1]
            assert label == f"{name} [fast accum all]" and twin.fast_accumulation == ("fprop", "dgrad", "wgrad")
            assert twin.replace(fast_accumulation="fprop") == recipe
        else:
            assert len(rows) == 1


def test_llama_block_matches_its_bf16_twin_outside_autocast(monkeypatch):
    """The llama_* sizes' LlamaBlock: the fp_recipes block (RMSNorm in LayerNormLinear, GQA, SwiGLU) computes what the
    torch block computes, bit for bit outside autocast (the same weights), so its rows compare like with like; under
    FP8 autocast it runs forward and backward on the CPU reference casts within FP8's error of BF16."""
    import bench_model
    import fp_recipes

    monkeypatch.setattr(bench_model, "SEQ", 16)
    assert set(bench_model.SIZES) >= {"llama_h2048_t8192", "llama_h4096_t4096"}
    ref = bench_model.build(256, 384, 1, False, device="cpu", llama=True)
    q = bench_model.build(256, 384, 1, True, device="cpu", llama=True)
    (rb,), (qb,) = ref, q
    assert (rb.heads, rb.kv_heads) == (2, 1) and rb.qkv.out_features == (2 + 2 * 1) * bench_model.HEAD_DIM
    assert qb.fc1.normalization == "RMSNorm" and qb.fc1.out_features == 2 * 384 and qb.fc2.bias is None
    with torch.no_grad():
        for name_q, name_r in (("qkv.layer_norm_weight", "norm1.weight"), ("fc1.layer_norm_weight", "norm2.weight"),
                               ("qkv.weight", "qkv.weight"), ("proj.weight", "proj.weight"),
                               ("fc1.weight", "fc1.weight"), ("fc2.weight", "fc2.weight")):
            qb.get_parameter(name_q).copy_(rb.get_parameter(name_r))
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    assert torch.equal(q(x), ref(x))
    xg = x.clone().requires_grad_()
    with fp_recipes.autocast(recipe=fp_recipes.Float8CurrentScaling()):  # (delayed's first step casts at scale 1)
        y = q(xg)
    y.float().square().mean().backward()
    assert torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0
    delta = ref(x).float() - x.float()  # what the block adds to its input (the residual is exact)
    rel = (y.detach().float() - x.float() - delta).norm() / delta.norm()
    assert 0 < rel < 0.15, rel  # (E4M3 casts of x and W through two GEMMs each side of attention: ~6 % here)
