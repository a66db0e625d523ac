"""4over6 stress inputs shared by the host-harness tests and the GPU kernel tests."""

from __future__ import annotations

import torch

# E2M1 midpoints and short-path bounds (4.5 for map-to-4, 7 for map-to-6) relative to a block's max / 6.
_MIDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 4.5, 4.25, 1.875, 3.75, 6.5, 6.9, 0.5, 1.0]


def fos_stress(seed: int, m: int = 64, n: int = 64) -> torch.Tensor:
    """Blocks that straddle the 4over6 short-path bounds: per-block ranges over 2^-30..2^4 of the largest
    block (subnormal E4M3 scales included), and a third of the blocks holding E2M1 midpoints and
    near-tied candidates relative to their maximum."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g)
    blocks = x.view(m, n // 16, 16)
    blocks.mul_(torch.exp2(torch.randint(-30, 5, (m, n // 16, 1), generator=g).float()))
    mids = torch.tensor(_MIDS)
    pick = torch.rand(m, n // 16, generator=g) < 0.33
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 6
    perm = mids[torch.argsort(torch.rand(m, n // 16, 16, generator=g), dim=-1)]
    sign = torch.sign(torch.randn(m, n // 16, 16, generator=g))
    blocks.copy_(torch.where(pick.unsqueeze(-1), perm * scale * sign, blocks))
    return x
