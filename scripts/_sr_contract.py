"""e2m1_encode_sr's magnitude index (formats.cuh, NUMERICS.md "Stochastic rounding"), vectorised over FP32 magnitudes:
the contract side of the exhaustive SR-encode checks (nvfp4_check_sr_fma.py, nvfp4_check_sr_ceil.py)."""
import numpy as np


class SrContract:
    """For magnitudes a >= 0 (FP32): t = a * {2, 1, 0.5} by binade, k = trunc(t), index = k + 2b + up with
    up iff 2r + 1 < frac(t) * 512, and 7 from 6 on."""

    def __init__(self, a: np.ndarray) -> None:
        p2, p4 = a >= np.float32(2), a >= np.float32(4)
        t = a * np.where(p4, np.float32(0.5), np.where(p2, np.float32(1), np.float32(2)))
        self.k = np.trunc(t)
        self.frac512 = (t - self.k) * np.float32(512)
        self.off = np.where(p4, 4, np.where(p2, 2, 0)).astype(np.int64)
        self.saturated = a >= np.float32(6)

    def index(self, r: np.ndarray) -> np.ndarray:
        """The index for random bytes r (int array broadcastable to a), as int64."""
        up = ((2 * r + 1).astype(np.float32) < self.frac512).astype(np.int64)
        return np.where(self.saturated, 7, self.k.astype(np.int64) + self.off + up)
