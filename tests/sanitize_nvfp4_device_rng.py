"""compute-sanitizer driver (memcheck, racecheck) for the stochastically rounded quantize kernels reading their
Philox seed and counter from device memory (``rng_state``): every SR launch form (rowwise kernel, 1-D tile,
RHT, 2-D, the fused bias gradient), odd shapes, one 16-row group, with the bytes checked against the same launch
given the pair as ints. Not a pytest file; scripts/gpu_session40.sh runs it. Exits non-zero on any difference."""

from __future__ import annotations

import sys

import torch

from fp_recipes.ops import cuda_nvfp4 as K

FORMS = ((True, False, False, False), (True, True, False, False), (True, True, False, True),
         (False, True, False, True), (True, True, True, False))


def _plan(rowwise, columnwise, block_2d, rht):
    return K.QuantizePlan(rowwise=rowwise, columnwise=columnwise, block_2d=block_2d, row_scaled=False,
                          four_over_six=False, e4m3_max=448, err_mode="MAE", err_fast_math=False, rht=rht,
                          stochastic_rounding=True)


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    va = a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.uint8)
    vb = b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.uint8)
    return torch.equal(va, vb)


def main() -> int:
    torch.manual_seed(0)
    bad = runs = 0
    state = torch.tensor([-5, 2**40 + 3], dtype=torch.int64, device="cuda")  # seed 2^64 - 5
    seed, offset = 2**64 - 5, 2**40 + 3
    for m, n in ((16, 16), (48, 80), (112, 1040), (256, 96)):
        x = torch.randn(m, n, device="cuda").bfloat16()
        for form in FORMS:
            want = K.nvfp4_quantize_planned(x, _plan(*form), None, seed, offset, units=(True, form[1]))
            got = K.nvfp4_quantize_planned(x, _plan(*form), None, 0, 0, units=(True, form[1]), rng_state=state)
            runs += 1
            bad += not all(_equal(a, b) for a, b in zip(got, want))
        if m % 64 == 0 or m == 48:
            want = K.nvfp4_quantize_planned_dbias(x, _plan(*FORMS[2]), seed, offset, torch.bfloat16)
            got = K.nvfp4_quantize_planned_dbias(x, _plan(*FORMS[2]), 0, 0, torch.bfloat16, rng_state=state)
            runs += 1
            bad += want is None or got is None or not (all(_equal(a, b) for a, b in zip(got[0], want[0]))
                                                      and _equal(got[1], want[1]))
    torch.cuda.synchronize()
    print(f"sanitize_nvfp4_device_rng: {runs} launches compared, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
