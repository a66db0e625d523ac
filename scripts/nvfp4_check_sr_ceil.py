"""Exhaustive check behind encode16_sr_ceil (fp_recipes/csrc/nvfp4_device.cuh, NVFP4_SR_CEIL=1, the default).

For every FP32 a in [2^-12, 6] (a = min(|y|, 6); |y| >= 6 and NaN give a = 6) and five random bytes r per a (a's
low byte, its next byte, 0, 127, 255), the sum the kernel forms -- RU(RU(a - (2r + 1) 2^(e - 137)) + M_e), e the
exponent of max(a, 1), M_e = bits e * 0x800002 + 0x4A800100 - 127 * 0x800002 -- is evaluated exactly in integer
units of 2^-36 (every operand is a multiple of it; the directed roundings to FP32 from their definitions), and its
FP32 bits must be bits(M_e) + index with the low byte equal to e2m1_encode_sr's magnitude index (formats.cuh:
t = a * {2, 1, 0.5}, k = trunc(t), up iff 2r + 1 < frac * 512, 7 from 6 on) and bits 8.. those of M_e (pack8<0>
gathers low bytes). Below 2^-12, a < (2r + 1) 2^-10 makes d negative and index 0 for every r: checked at the
binade edges with Python's exact fractions. A few minutes on one core. Expected output: 0 mismatches.
Usage: python scripts/nvfp4_check_sr_ceil.py"""
from fractions import Fraction
import math

import numpy as np

from _sr_contract import SrContract

U = 36  # the unit 2^-36
FIRST = int(np.float32(2.0 ** -12).view(np.uint32))
LAST = int(np.float32(6.0).view(np.uint32))
CHUNK = 1 << 22


def ru32_units(v: np.ndarray) -> np.ndarray:
    """RU to FP32 of an exact value in units (int64, |v| < 2^62): the smallest float >= v, in units."""
    mag = np.abs(v)
    # ulp of |v| in units: 2^(floor(log2 |v|) - 23), at least 1 (below 2^24 units every integer is a float)
    lg = np.floor(np.log2(np.maximum(mag, 1).astype(np.float64))).astype(np.int64)
    # guard the float log2 at exact powers of two
    lg = np.where((np.int64(1) << np.clip(lg, 0, 62)) > mag, lg - 1, lg)
    lg = np.where((np.int64(1) << np.clip(lg + 1, 0, 62)) <= mag, lg + 1, lg)
    ulp = np.int64(1) << np.clip(lg - 23, 0, 62)
    up = (v + ulp - 1) // ulp * ulp  # ceil for v >= 0 (and for v < 0: toward zero in magnitude)
    down = -(mag // ulp * ulp)
    return np.where(v >= 0, up, down)


bad = checked = 0
for lo in range(FIRST, LAST + 1, CHUNK):
    bits = np.arange(lo, min(lo + CHUNK, LAST + 1), dtype=np.uint32)
    a = bits.view(np.float32)
    contract = SrContract(a)  # e2m1_encode_sr's magnitude index
    # the kernel
    e = (np.maximum(a, np.float32(1)).view(np.uint32) >> np.uint32(23)).astype(np.int64)
    m_bits = (e * 0x800002 + (0x4A800100 - 127 * 0x800002)).astype(np.int64)
    step_u = np.int64(1) << (e - 128 + U)                       # the magic's ulp, in units
    base_u = np.int64(1) << (e - 127 + 22 + U)                  # 2^(22 + b): the magic's binade start
    magic_u = base_u + (m_bits - ((e - 127 + 22 + 127) << 23)) * step_u
    a_u = (a.astype(np.float64) * 2.0 ** U).astype(np.int64)    # exact: a >= 2^-12 has its lsb >= 2^-35
    for r in (bits & np.uint32(255), (bits >> np.uint32(8)) & np.uint32(255), np.uint32(0), np.uint32(127),
              np.uint32(255)):
        r = np.broadcast_to(np.asarray(r, dtype=np.uint32), bits.shape).astype(np.int64)
        want = contract.index(r)
        d = ru32_units(a_u - (2 * r + 1) * (np.int64(1) << (e - 137 + U)))
        s = d + magic_u
        s = (s + step_u - 1) // step_u * step_u                 # RU(d + M): the binade's floats are multiples of step
        index = (s - base_u) // step_u
        ok = (s >= base_u) & (index < (np.int64(1) << 23)) & ((index & 0xFF) == want) & ((index >> 8) == 1)
        bad += int((~ok).sum())
        checked += bits.size

# below 2^-12: exact fractions at the edges of every binade down to the smallest subnormal
tiny = [2.0 ** -149, 2.0 ** -126, 1e-30, 2.0 ** -20, math.nextafter(2.0 ** -12, 0.0)]
for av in tiny:
    for r in (0, 1, 127, 255):
        v = Fraction(np.float32(av).item()) - Fraction(2 * r + 1, 2 ** 10)
        checked += 1
        bad += int(not (v < 0 and v > -Fraction(1, 2)))  # d in (-0.5, 0): RU(M + d) = M, index 0 (of 256)
print(f"{checked} (a, r) pairs checked, {bad} mismatches")
raise SystemExit(1 if bad else 0)
