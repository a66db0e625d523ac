"""The unit decode's arithmetic (``unit_f32_bits`` in fp_recipes/csrc/nvfp4_device.cuh): the three magnitude bits of
an E2M1 code placed at FP32 bits 22-24 are ``mag * 2**-126`` exactly (a subnormal for exponent 0), times ``2**126``
is ``mag``, times the decoded E4M3 scale is the exact unit value, and XORing the code's sign bit gives
``e2m1(code) * sf`` bit for bit. Checked here for every (code, scale code) pair with FP32 arithmetic as the kernel
does it (numpy keeps subnormals, as the kernel's FMUL does without fast math); the GPU tests compare the kernel's
bytes with the reference twin."""

from __future__ import annotations

import numpy as np
import torch

from fp_recipes import formats

F32 = np.float32


def _kernel_form(codes: np.ndarray, k: int, sf: np.ndarray) -> np.ndarray:
    """unit_f32_bits(codes, k, sf) of the CUDA header, transcribed (uint32 in, FP32 bits out)."""
    mag = ((codes << np.uint32(22 - 4 * k)) if k <= 5 else (codes >> np.uint32(4 * k - 22))) & np.uint32(7 << 22)
    sign = (codes << np.uint32(28 - 4 * k)) & np.uint32(0x80000000)
    v = (mag.view(F32) * F32(2.0**126)).astype(F32) * sf
    return v.astype(F32).view(np.uint32) ^ sign


def test_unit_bits_equal_e2m1_times_scale_for_every_code_and_scale():
    scale_codes = np.arange(256, dtype=np.uint8)
    sf = torch.from_numpy(scale_codes).view(torch.float8_e4m3fn).float().numpy().astype(F32)
    finite = (scale_codes & 0x7F) != 0x7F  # the NaN scale codes take the kernel's select, not this arithmetic
    values = np.array([float(v) for v in formats.E2M1_VALUES], dtype=F32)  # the 8 magnitudes, code order
    assert values.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    checked = 0
    for k in range(8):  # every nibble position of a 4-byte code word
        for nibble in range(16):
            codes = np.full(256, nibble << (4 * k), dtype=np.uint32)
            got = _kernel_form(codes, k, sf)
            mag = values[nibble & 7]
            want = ((-mag if nibble & 8 else mag) * sf).astype(F32).view(np.uint32)
            assert np.array_equal(got[finite], want[finite]), (k, nibble)
            # the BF16 unit is the top half: exact, since the product has at most 6 significant bits
            assert np.all(want[finite] & 0xFFFF == 0), (k, nibble)
            checked += int(finite.sum())
    assert checked == 8 * 16 * 254
