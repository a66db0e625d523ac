"""Exhaustive CPU proof of the prototype's two decodes: for every E2M1 code (16) and every E4M3 scale code (256), the
FP16 product the kernel forms equals code value x scale exactly (or both are NaN), times the power of two the
decode works at.

The kernels' steps, reproduced with torch's CPU FP8/FP16 conversions and FP16 multiply (round to nearest even, as
HMUL2; FP16 subnormals kept, as HMUL2 keeps them):
- conversion decode (proto_common.cuh decode8, decode8_pairs, scale2): the code c = s e1 e0 m placed as the E4M3
  byte s 0 e1 e0 m 0 0 (its value x 2^-6), converted to FP16; the scale code converted to FP16 and multiplied by 2^6
  in FP16; the two FP16 values multiplied in FP16: the unit value itself.
- integer decode (decode8_int, scale2 with 2^7): c placed as the FP16 bits s 000 e1 e0 m 000000000 (its value x
  2^-14; 0.5 becomes the subnormal 2^-15) with no conversion instruction; the scale as FP16 times 2^7 (at most
  448 x 128 = 57344, below FP16's 65504); the product: the unit value x 2^-7, exact while its lowest set bit is at
  least 2^-24 (FP16's smallest subnormal): the smallest unit values' lowest bit is 2^-10, so 2^-17 here.

    python benchmarks/nvfp4_gemm_proto/check_decode.py
"""

from __future__ import annotations

import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e4m3_to_f16(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)


def check(name: str, value_f16: torch.Tensor, exact: torch.Tensor, scale_mul: float, unit_scale: float) -> bool:
    """value_f16: each code's FP16 value as the kernel forms it; the product with scale x scale_mul (FP16) must be
    the exact unit value x unit_scale."""
    scales = torch.arange(256)
    scale_f16 = e4m3_to_f16(scales) * torch.tensor(scale_mul, dtype=torch.float16)  # scale2: one FP16 multiply
    got = value_f16[:, None] * scale_f16[None, :]  # the HMUL2, in FP16
    want = exact[:, None] * scales.to(torch.uint8).view(torch.float8_e4m3fn).double()[None, :] * unit_scale
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{name}: NaN positions differ"
    mismatch = (got.double() != want) & ~nan
    # -0.0 == 0.0 in the comparison above; the sign of a zero product does not change a sum
    print(f"{name}: {16 * 256} (code, scale) pairs: {int(mismatch.sum())} inexact products, {int(nan.sum())} NaN "
          f"(the NaN scale codes 0x7F, 0xFF)")
    return not mismatch.any()


def main() -> int:
    codes = torch.arange(16)
    embedded = ((codes & 8) << 4) | ((codes & 7) << 2)  # the E4M3 byte of each code (decode8's bit moves)
    value_f16 = e4m3_to_f16(embedded)  # code value x 2^-6
    exact = torch.tensor(E2M1, dtype=torch.float64)
    assert torch.equal(value_f16.double(), exact * 2.0 ** -6), "the embedding is not value x 2^-6"
    ok = check("conversion decode", value_f16, exact, 64.0, 1.0)
    bits = ((codes & 8) << 12) | ((codes & 7) << 9)  # decode8_int's bit moves: sign to bit 15, e1 e0 m to bits 11..9
    value_int = bits.to(torch.int16).view(torch.float16)
    assert torch.equal(value_int.double(), exact * 2.0 ** -14), "the FP16 placement is not value x 2^-14"
    ok &= check("integer decode", value_int, exact, 128.0, 2.0 ** -7)
    return 0 if ok else 1

if __name__ == "__main__":
    raise SystemExit(main())
