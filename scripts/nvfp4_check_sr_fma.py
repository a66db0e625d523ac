"""Exhaustive check behind encode16_sr_fma (fp_recipes/csrc/nvfp4_device.cuh, NVFP4_SR_FMA_PIPE=1).

For every FP32 a in [0, 7] (a = min(|y|, 7); |y| >= 6 and NaN give a in [6, 7]) and five random bytes r per a
(a's low byte, its next byte, 0, 127, 255), the code the FMA-pipe form assembles -- the low byte of
min(bits(RZ(T + 2^32 + 1024)) + 2e + up, 0x4F800107), T = a * 2^(137 - e), e = exponent of max(a, 1),
up = sign bit of (0x4B000001 + 2r - bits(RU(F + 2^23))), F = T - 512 floor(T / 512) -- equals e2m1_encode_sr's
magnitude index (formats.cuh: t = a * {2, 1, 0.5}, k = trunc(t), up iff 2r + 1 < frac * 512, 7 from 6 on), and
the rest of that byte is zero (pack8 gathers it as is). The directed-rounding adds are evaluated exactly from
their definitions (the sum's ulp is 512 at 2^32 and 1 at 2^23); every other step is FP32 round-to-nearest, as
numpy does it. About a minute on one core. Expected output: 0 mismatches.
Usage: python scripts/nvfp4_check_sr_fma.py"""
import numpy as np

from _sr_contract import SrContract

LAST = int(np.float32(7.0).view(np.uint32))
CHUNK = 1 << 24
M32 = np.uint64(0xFFFFFFFF)
bad = checked = 0
for lo in range(0, LAST + 1, CHUNK):
    bits = np.arange(lo, min(lo + CHUNK, LAST + 1), dtype=np.uint32)
    a = bits.view(np.float32)
    contract = SrContract(a)  # e2m1_encode_sr (the float form): magnitude index before the sign
    # encode16_sr_fma
    e = np.maximum(a, np.float32(1)).view(np.uint32) >> np.uint32(23)
    scale = ((np.uint32(264) - e) << np.uint32(23)).view(np.float32)
    t512 = a * scale
    fl = np.floor(t512 / np.float32(512))                       # exact: a power-of-two division
    kf_bits = np.uint32(0x4F800002) + fl.astype(np.uint32)      # RZ(T + 2^32 + 1024)
    f512 = t512 - (fl * np.float32(512)).astype(np.float32)     # exact
    g = np.uint32(0x4B000000) + np.ceil(f512).astype(np.uint32)  # RU(F + 2^23)
    for r in (bits & np.uint32(255), (bits >> np.uint32(8)) & np.uint32(255), np.uint32(0), np.uint32(127),
              np.uint32(255)):
        r = np.broadcast_to(np.asarray(r, dtype=np.uint32), bits.shape)
        idx_old = contract.index(r).astype(np.uint32)
        v = (g.astype(np.uint64) * M32 + r.astype(np.uint64) * 2 + 0x4B000001) & M32
        up = (v >> np.uint64(31)).astype(np.uint32)
        s = np.minimum((kf_bits.astype(np.uint64) + e.astype(np.uint64) * 2 + up) & M32, 0x4F800000 + 263)
        s = s.astype(np.uint32)
        ok = ((s & np.uint32(0xFF)) == idx_old) & ((s >> np.uint32(8)) == np.uint32(0x4F8001))
        bad += int((~ok).sum())
        checked += bits.size
print(f"{checked} (a, r) pairs checked, {bad} mismatches")
raise SystemExit(1 if bad else 0)
