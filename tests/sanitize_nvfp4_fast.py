"""Small driver for compute-sanitizer (memcheck, racecheck) over the fast NVFP4 GEMM's kernels: the
unit decode (1-4 copies per launch, odd row counts, one row, tails of a CTA), the alpha it writes, the
row-scaled epilogue (odd shapes, bias dtypes), the cuBLASLt BF16 GEMM with a device alpha, the quantize
kernels writing the BF16 unit operands (rowwise and tile kernels, every mode family, odd shapes, one row),
the memset-free amax kernels (plain, RHT, row; repeated on one workspace) and the bias gradient fused into
the tile kernel. Not a
pytest file; scripts/gpu_nvfp4_fast.sh runs it. Exits non-zero if any result differs from its twin."""

from __future__ import annotations

import sys

import torch

from fp_recipes.gemm import nvfp4_emulated as E
from fp_recipes.gemm._common import finish
from fp_recipes.gemm.operands import Nvfp4Operand
from fp_recipes.ops import cuda_nvfp4 as C
from fp_recipes.ops import ref_nvfp4 as R


def main() -> int:
    torch.manual_seed(0)
    bad = runs = 0
    copies = []
    for rows, k in ((1, 16), (3, 48), (17, 160), (257, 64)):
        data = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, device="cuda")
        scale = torch.randint(0, 126, (rows, k // 16), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        copies.append((data, scale))
    for n in (1, 2, 4):
        outs, ab = C.nvfp4_unit_operands(copies[:n], torch.tensor(3.0, device="cuda"),
                                         torch.tensor(0.5, device="cuda"), 448, 256)
        runs += 1
        for (d, s), o in zip(copies, outs):
            bad += not torch.equal(o.view(torch.int16), E.decode_nvfp4_unit(d, s, torch.bfloat16).view(torch.int16))
        bad += not torch.equal(ab[:1].cpu(), R.nvfp4_gemm_alpha(torch.tensor(3.0), torch.tensor(0.5), 448, 256)
                               .reshape(1))
    # scalar kernel (N % 4 != 0), then the 4-column kernel (a partial second column block; FP32 output)
    for m, n, bias_dtype in ((1, 1, None), (3, 37, torch.bfloat16), (129, 67, torch.float32), (2, 8, None),
                             (5, 1028, torch.bfloat16), (67, 68, torch.float32)):
        d = torch.randn(m, n, device="cuda")
        amax_a = torch.rand(m, device="cuda")
        amax_b = torch.rand((), device="cuda")
        bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(bias_dtype)
        out = C.nvfp4_row_scale_epilogue(d, amax_a, True, amax_b, False, bias, torch.bfloat16)
        runs += 1
        bad += not torch.equal(out, finish(d * (amax_a * amax_b).unsqueeze(1), bias, torch.bfloat16))
    for m, k, n, row in ((16, 32, 16, False), (48, 96, 40, True), (2100, 32, 24, True)):  # 2100: two row chunks
        a = R.nvfp4_quantize(torch.randn(m, k, device="cuda"), row_scaled=row)
        b = R.nvfp4_quantize(torch.randn(n, k, device="cuda"))
        oa = Nvfp4Operand(a.data, a.scale, a.amax, row, 448, False)
        ob = Nvfp4Operand(b.data, b.scale, b.amax, False, 448, False)
        fast = E.gemm_nvfp4_emulated_cuda(oa, ob, torch.float32, None)
        slow = E.gemm_nvfp4_emulated(oa, ob, torch.float32, None)
        runs += 1
        bad += fast is None or not torch.allclose(fast, slow, rtol=1e-5, atol=1e-5)
    x_all = torch.randn(272, 1040, device="cuda").bfloat16()
    x_all.view(-1)[::97] = float("nan")
    cases = [((1, 48), dict()), ((3, 1040), dict(row_scaled=True)), ((272, 1040), dict(columnwise=True)),
             ((32, 48), dict(columnwise=True, rht=True, stochastic_rounding=True, seed=3)),
             ((48, 80), dict(columnwise=True, block_2d=True)), ((16, 160), dict(four_over_six=True)),
             ((64, 64), dict(columnwise=True, block_2d=True, four_over_six=True, err_fast_math=True)),
             ((272, 1040), dict(columnwise=True, row_scaled=True))]
    for (m, n), kw in cases:
        x = x_all[:m, :n].contiguous()
        got, u, ut = C.nvfp4_quantize_with_units(x, unit_rowwise=True, unit_columnwise=True, **kw)
        want = R.nvfp4_quantize(x, **kw)
        runs += 1
        for f in ("data", "scale", "data_t", "scale_t"):
            a, b = getattr(got, f), getattr(want, f)
            bad += (a is None) != (b is None) or (a is not None and not torch.equal(a.view(torch.uint8),
                                                                                    b.view(torch.uint8)))
        for f in ("amax", "amax_t"):
            a, b = getattr(got, f), getattr(want, f)
            bad += (a is None) != (b is None) or (a is not None and not torch.equal(a.nan_to_num(-1.0),
                                                                                    b.nan_to_num(-1.0)))
        for unit, d, sc in ((u, got.data, got.scale), (ut, got.data_t, got.scale_t)):
            if d is not None:
                e = E.decode_nvfp4_unit(d, sc, torch.bfloat16)
                bad += unit is None or not torch.equal(unit.nan_to_num(7.0).view(torch.int16),
                                                       e.nan_to_num(7.0).view(torch.int16))
    for x in (x_all, x_all[:1, :16].contiguous(), torch.randn(4096, 1024, device="cuda").bfloat16()):
        for _ in range(2):
            runs += 1
            bad += not torch.equal(C.nvfp4_amax(x).nan_to_num(-1.0), R.nvfp4_amax(x).nan_to_num(-1.0))
            bad += not torch.equal(C.nvfp4_row_amax(x).nan_to_num(-1.0), R.nvfp4_row_amax(x).nan_to_num(-1.0))
    # the bias gradient fused into the tile kernel (RHT + SR, plain FP32, 4over6 fast), tiles cut by M and N
    from fp_recipes.ops import ref_fp8

    for (m, n), dtype, kw in (((48, 80), torch.bfloat16, dict(rht=True, stochastic_rounding=True)),
                              ((80, 1040), torch.float32, dict()),
                              ((208, 160), torch.bfloat16, dict(four_over_six=True, err_fast_math=True))):
        opts = dict(rowwise=True, columnwise=True, block_2d=False, row_scaled=False, four_over_six=False,
                    e4m3_max=448, err_mode="MAE", err_fast_math=False, rht=False, stochastic_rounding=False)
        opts.update(kw)
        x = (torch.randn(m, n, device="cuda") * 5).to(dtype)
        fused = C.nvfp4_quantize_planned_dbias(x, C.QuantizePlan(**opts), 3, 4, torch.bfloat16)
        runs += 1
        bad += fused is None or not torch.equal(fused[1].view(torch.int16),
                                                ref_fp8.bias_grad(x, torch.bfloat16).view(torch.int16))
    # the quantizers' resolved launches (with the torch-linked host path: one C++ call each), every amax mode
    names = ("data", "scale", "amax", "data_t", "scale_t", "amax_t")
    for (m, n), kw in (((32, 48), dict(columnwise=True)), ((48, 80), dict(columnwise=True, block_2d=True)),
                       ((32, 48), dict(columnwise=True, rht=True, stochastic_rounding=True, seed=5, offset=2)),
                       ((16, 160), dict(rowwise=False, columnwise=True, rht=True)),
                       ((272, 1040), dict(row_scaled=True, four_over_six=True, err_fast_math=True)),
                       ((48, 64), dict(columnwise=True, row_scaled=True))):
        opts = dict(rowwise=True, columnwise=False, block_2d=False, row_scaled=False, four_over_six=False,
                    e4m3_max=448, err_mode="MAE", err_fast_math=False, rht=False, stochastic_rounding=False)
        seed, offset = kw.pop("seed", 0), kw.pop("offset", 0)
        opts.update(kw)
        x = (torch.randn(m, n, device="cuda") * 3).bfloat16()
        plan = C.QuantizePlan(**opts)
        want = R.nvfp4_quantize(x, seed=seed, offset=offset, **opts)
        for _ in range(2):  # the second call takes the resolved launch
            got = C.nvfp4_quantize_planned(x, plan, None, seed, offset)
            runs += 1
            for f, a in zip(names, got[:6]):
                b = getattr(want, f)
                if f == "amax" and a is not None and b is not None and a.numel() != b.numel():
                    bad += 1
                    continue
                bad += (a is None) != (b is None) or (a is not None and not torch.equal(
                    a.view(torch.uint8) if a.element_size() == 1 else a.nan_to_num(-1.0),
                    b.view(torch.uint8) if b.element_size() == 1 else b.nan_to_num(-1.0)))
    torch.cuda.synchronize()
    print(f"sanitize_nvfp4_fast: {runs} kernel runs, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
