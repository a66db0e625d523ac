"""Exhaustive check behind the integer form of e2m1_encode_sr (fp_recipes/csrc/formats.cuh).

For every FP32 a in [0, 7] (a = min(|y|, 7); the sign and the |y| >= 6 / NaN override are shared by both
forms), the float form's floor(t) and F = frac * 512 (t = a * {2, 1, 0.5}, exact power-of-two
scalings, frac = t - trunc(t)) are compared with the integer form's fl >> 9, fl mod 512 and sticky bit;
and the round-up decision ``2r + 1 < F`` with ``2r + 1 < (fl mod 512) + sticky`` for the random byte
r = a's low 8 bits and for r = 0, 127, 255. numpy float32 arithmetic rounds to nearest even, as the
kernel's __fmul_rn/__fsub_rn. About a minute on one core. Expected output: 0 mismatches.
Usage: python scripts/nvfp4_check_sr_int.py"""
import numpy as np

LAST = int(np.float32(7.0).view(np.uint32))
CHUNK = 1 << 24
bad = checked = 0
for lo in range(0, LAST + 1, CHUNK):
    bits = np.arange(lo, min(lo + CHUNK, LAST + 1), dtype=np.uint32)
    a = bits.view(np.float32)
    # the float form
    p2, p4 = a >= np.float32(2), a >= np.float32(4)
    t = a * np.where(p4, np.float32(0.5), np.where(p2, np.float32(1), np.float32(2)))
    k = np.trunc(t)
    big_f = (t - k) * np.float32(512)
    # the integer form
    e = bits >> np.uint32(23)
    m = (bits & np.uint32(0x7FFFFF)) | np.where(e != 0, np.uint32(0x800000), np.uint32(0))
    sh = np.minimum(np.uint32(140) - np.minimum(np.maximum(e, np.uint32(1)), np.uint32(127)), np.uint32(31))
    fl = m >> sh
    sticky = ((m & ((np.uint32(1) << sh) - np.uint32(1))) != 0).astype(np.uint32)
    binade = np.minimum(np.maximum(e, np.uint32(127)), np.uint32(129)) - np.uint32(127)
    off = np.where(p4, 4, np.where(p2, 2, 0)).astype(np.uint32)
    ok = (k.astype(np.uint32) == fl >> np.uint32(9)) & (2 * binade == off)
    ok &= np.floor(big_f).astype(np.uint32) == (fl & np.uint32(511))
    ok &= (big_f != np.floor(big_f)).astype(np.uint32) == sticky
    for r in (bits & np.uint32(255), np.uint32(0), np.uint32(127), np.uint32(255)):
        odd = 2 * r + np.uint32(1)
        ok &= (odd.astype(np.float32) < big_f) == (odd < (fl & np.uint32(511)) + sticky)
    bad += int((~ok).sum())
    checked += bits.size
print(f"{checked} values of a checked, {bad} mismatches")
raise SystemExit(1 if bad else 0)
