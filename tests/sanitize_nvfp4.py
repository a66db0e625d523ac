"""Small driver for compute-sanitizer (memcheck, racecheck): every NVFP4 kernel variant once, on small
shapes with partial tiles. Not a pytest file (no test_ prefix); scripts/gpu_nvfp4.sh runs it.
Exits non-zero if any result differs from the reference, so a sanitizer run also checks bytes.
SANITIZE_QUICK=1: one shape per dtype and no reference runs (racecheck instruments every shared-memory
access of every kernel, the reference's torch kernels included, which is slow)."""

from __future__ import annotations

import itertools
import os
import sys

import torch

from fp_recipes.ops import cuda_nvfp4 as K
from fp_recipes.ops import ref_nvfp4 as R


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype == torch.float32:
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
            torch.nan_to_num(a).view(torch.int32), torch.nan_to_num(b).view(torch.int32))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def main() -> int:
    torch.manual_seed(0)
    quick = os.environ.get("SANITIZE_QUICK") == "1"
    bad = 0
    runs = 0
    shapes = ((80, 96),) if quick else ((80, 96), (16, 1040), (128, 48))
    for dtype, shape in itertools.product((torch.bfloat16, torch.float32), shapes):
        x = torch.randn(shape, device="cuda").to(dtype)
        x.view(-1)[::37] = float("nan") if shape[0] == 16 else x.view(-1)[::37]
        variants = [dict(), dict(columnwise=True), dict(rowwise=False, columnwise=True),
                    dict(block_2d=True, columnwise=True), dict(row_scaled=True, columnwise=True),
                    dict(stochastic_rounding=True, seed=3, offset=4, columnwise=True),
                    dict(block_2d=True, stochastic_rounding=True, columnwise=True)]
        for err, fast in itertools.product(("MAE", "MSE"), (False, True)):
            variants.append(dict(four_over_six=True, err_mode=err, err_fast_math=fast, columnwise=True))
            variants.append(dict(four_over_six=True, err_mode=err, err_fast_math=fast, block_2d=True,
                                 columnwise=True, e4m3_max=256))
            variants.append(dict(four_over_six=True, err_mode=err, err_fast_math=fast, row_scaled=True))
        if dtype == torch.bfloat16:
            variants += [dict(rht=True, columnwise=True), dict(rht=True, rowwise=False, columnwise=True,
                                                               stochastic_rounding=True, seed=9)]
        for kw in variants:
            got = K.nvfp4_quantize(x, **kw)
            want = got if quick else R.nvfp4_quantize(x, **kw)
            runs += 1
            if not all(same(g, w) for g, w in zip(got, want)):
                print("MISMATCH", dtype, shape, kw)
                bad += 1
            if got.data is not None:
                for od in (torch.float32, torch.bfloat16):
                    rs = kw.get("row_scaled", False)
                    e = kw.get("e4m3_max", 448)
                    d = K.nvfp4_dequantize(got.data, got.scale, got.amax, row_scaled=rs, e4m3_max=e, out_dtype=od)
                    runs += 1
                    if not quick and not same(d.float(), R.nvfp4_dequantize(got.data, got.scale, got.amax, row_scaled=rs,
                                                              e4m3_max=e, out_dtype=od).float()):
                        print("MISMATCH dequantize", dtype, shape, kw)
                        bad += 1
        for fn, ref in ((K.nvfp4_amax, R.nvfp4_amax), (K.nvfp4_row_amax, R.nvfp4_row_amax)):
            runs += 1
            if not same(fn(x), fn(x) if quick else ref(x)):
                print("MISMATCH", fn.__name__, dtype, shape)
                bad += 1
    torch.cuda.synchronize()
    print(f"sanitize_nvfp4: {runs} kernel runs, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
