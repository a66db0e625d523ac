"""Exhaustive CPU proof of the prototype's decode (proto_common.cuh decode8 / scale2): for every E2M1 code (16) and
every E4M3 scale code (256), the FP16 product the kernel forms equals code value x scale exactly (or both are NaN).

The kernel's steps, reproduced with torch's CPU FP8/FP16 conversions and FP16 multiply (round to nearest even, as
HMUL2): the code c = s e1 e0 m placed as the E4M3 byte s 0 e1 e0 m 0 0 (its value x 2^-6), converted to FP16; the
scale code converted to FP16 and multiplied by 2^6 in FP16; the two FP16 values multiplied in FP16.

    python benchmarks/nvfp4_gemm_proto/check_decode.py
"""

from __future__ import annotations

import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e4m3_to_f16(codes: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)


def main() -> int:
    codes = torch.arange(16)
    embedded = ((codes & 8) << 4) | ((codes & 7) << 2)  # the E4M3 byte of each code (decode8's bit moves)
    value_f16 = e4m3_to_f16(embedded)  # code value x 2^-6
    exact = torch.tensor(E2M1, dtype=torch.float64)
    assert torch.equal(value_f16.double(), exact * 2.0 ** -6), "the embedding is not value x 2^-6"
    scales = torch.arange(256)
    scale_f16 = e4m3_to_f16(scales) * torch.tensor(64.0, dtype=torch.float16)  # scale2: FP16 multiply by 2^6
    got = value_f16[:, None] * scale_f16[None, :]  # the HMUL2, in FP16
    want = exact[:, None] * scales.to(torch.uint8).view(torch.float8_e4m3fn).double()[None, :]
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    mismatch = (got.double() != want) & ~nan
    # -0.0 == 0.0 in the comparison above; the sign of a zero product does not change a sum
    print(f"{16 * 256} (code, scale) pairs: {int(mismatch.sum())} inexact products, {int(nan.sum())} NaN "
          f"(the NaN scale codes 0x7F, 0xFF)")
    return 1 if mismatch.any() else 0


if __name__ == "__main__":
    raise SystemExit(main())
