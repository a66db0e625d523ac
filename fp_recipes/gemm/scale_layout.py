"""The block-scale layout cuBLAS's block-scaled GEMMs read (NVFP4: one E4M3 scale per 16 elements).

A quantized tensor stores its scales unpadded, (rows, K/16) row-major (docs/nvfp4.md: every stored byte
is defined). cuBLAS (``CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3``, behind ``torch._scaled_mm``) wants
them tiled: the (rows, K/16) matrix zero-padded to (round_up(rows, 128), round_up(K/16, 4)), cut into
128 x 4 tiles stored one after the other, row-tile major; inside a tile the 512 bytes are ordered
[32][4][4]: scale (r, c) of the tile sits at ``(r % 32) * 16 + (r // 32) * 4 + c``. So

    offset(r, c) = ((r // 128) * (cols_p // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

with cols_p = round_up(K/16, 4) ("1D block scaling factors layout" in the cuBLAS documentation). The
padding is zeros: a zero scale multiplies padded (zero) codes, so padded rows and K blocks add nothing.
Tested on CPU against torchao's ``to_blocked`` and an element-by-element implementation of the formula
(tests/test_nvfp4_native_gemm.py).
"""

from __future__ import annotations

import torch

__all__ = ["blocked_shape", "blocked_numel", "to_blocked"]

TILE_ROWS = 128
TILE_COLS = 4


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def blocked_shape(rows: int, cols: int) -> tuple:
    """(padded rows, padded cols) of the swizzled layout of a (rows, cols) scale matrix."""
    return _round_up(rows, TILE_ROWS), _round_up(cols, TILE_COLS)


def blocked_numel(rows: int, cols: int) -> int:
    """Bytes of the swizzled layout (what ``torch._scaled_mm`` checks the scale's numel against)."""
    r, c = blocked_shape(rows, cols)
    return r * c


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """The swizzled, zero-padded 1-D copy of a (rows, cols) scale matrix (any 1-byte dtype; the dtype
    is kept). The values are moved, never changed."""
    if scale.dim() != 2:
        raise ValueError(f"to_blocked: expected a 2-D (rows, K/16) scale matrix, got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    rp, cp = blocked_shape(rows, cols)
    if (rp, cp) != (rows, cols):
        padded = scale.new_zeros((rp, cp))
        padded[:rows, :cols] = scale
    else:
        padded = scale
    # (row tile, 32-row group g, row i in group, col tile, col j) -> (row tile, col tile, i, g, j)
    tiles = padded.reshape(rp // TILE_ROWS, 4, 32, cp // TILE_COLS, TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)
