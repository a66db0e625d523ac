"""compute-sanitizer driver (memcheck, racecheck) for the v7 NVFP4 kernels: tile2_kernel in every mode it
takes (plain row+col, column only, 2-D, SR, RHT, RHT SR; BF16/FP16/FP32) on shapes with more tiles than
resident thread blocks (the persistent loop and its cp.async double buffer), partial tiles and unaligned
columns, and row_scaled_kernel (fused row amax, given amax, 2 and 4 blocks per thread); every tile2 case again with strips of 4
tiles a thread block forced (the walk it takes for large tensors), compared with the default walk. Not a pytest file;
scripts/gpu_nvfp4_v7.sh runs it. Exits non-zero if any result differs from the reference twin
(SANITIZE_REF=0: no reference runs, for a faster racecheck)."""

from __future__ import annotations

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
    ref = os.environ.get("SANITIZE_REF", "1") == "1"
    from fp_recipes import _extension

    ext = _extension.extension()
    bad = runs = 0
    # 4160 columns x 1040 rows of BF16: 65 x 9 = 585 tiles (FP32: 65 x 17), more than one wave of blocks
    # on any GPU here; 48 x 33 / 160 x 130: element copies and partial tiles.
    cases = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in ((1040, 4160), (144, 80), (160, 130)):
            aligned = shape[1] % 16 == 0
            kws = [dict(rowwise=False, columnwise=True)]
            if aligned:
                kws += [dict(columnwise=True), dict(columnwise=True, block_2d=True),
                        dict(rowwise=False, columnwise=True, block_2d=True),
                        dict(columnwise=True, stochastic_rounding=True, seed=3, offset=4),
                        dict(block_2d=True)]
            if dtype == torch.bfloat16:
                kws += [dict(rowwise=aligned, columnwise=True, rht=True),
                        dict(rowwise=aligned, columnwise=True, rht=True, stochastic_rounding=True, seed=9)]
            cases += [(dtype, shape, kw) for kw in kws]
        for shape in ((3, 48), (64, 4096), (5, 16384)):
            cases += [(dtype, shape, dict(row_scaled=True)),
                      (dtype, shape, dict(row_scaled=True, four_over_six=True, err_fast_math=True))]
    xs = {}
    for dtype, shape, kw in cases:
        key = (dtype, shape)
        if key not in xs:
            x = torch.randn(shape, device="cuda").to(dtype)
            x.view(-1)[::97] = float("nan")
            x.view(-1)[5::89] = float("inf")
            xs[key] = x
        x = xs[key]
        got = K.nvfp4_quantize(x, **kw)
        runs += 1
        if ref and x.numel() <= 200_000:  # the big shapes are there for the kernels' loop, not the twin
            want = R.nvfp4_quantize(x, **kw)
            if not all(same(g, w) for g, w in zip(got, want)):
                print("MISMATCH", dtype, shape, kw)
                bad += 1
        if not kw.get("row_scaled"):  # tile2 with strips of 4 tiles a thread block forced: the same bytes
            old = ext.nvfp4_set_tile2_strip_min_waves(0)
            try:
                strips = K.nvfp4_quantize(x, **kw)
            finally:
                ext.nvfp4_set_tile2_strip_min_waves(old)
            runs += 1
            if not all(same(g, w) for g, w in zip(got, strips)):
                print("MISMATCH strips", dtype, shape, kw)
                bad += 1
        if kw.get("row_scaled"):
            got2 = K.nvfp4_quantize(x, amax=K.nvfp4_row_amax(x), **kw)  # the row kernel with a given amax
            runs += 1
            if not all(same(g, w) for g, w in zip(got, got2)):
                print("MISMATCH given amax", dtype, shape, kw)
                bad += 1
    torch.cuda.synchronize()
    print(f"sanitize_nvfp4_v7: {runs} quantizations, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
