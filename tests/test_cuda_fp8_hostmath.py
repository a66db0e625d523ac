"""The FP8 kernel family's E5M6 encoders, built for the CPU with g++, against the torch reference.

The per-token E5M6 kernels encode through formats.cuh's ``encode_e5m6`` (the exact contract) and a fast
path (``e5m6_top_fast``: Veltkamp rounding to 7 significant bits plus an exponent shift) that applies
when every value of an 8-element unit is 0 or lies in the FP16-normal range. tests/fp8_host/
e5m6_host_harness.cpp compiles that header for the host (IEEE RN SSE arithmetic, like the GPU's __f*_rn
intrinsics), so every CI run checks, over ALL 2^32 FP32 bit patterns, that the fast path equals the
contract where it is taken and that the range test picks exactly that range; and, against
ops/formats.py, the packed bytes of whole units. The GPU tests then check the kernels' indexing.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from fp_recipes import formats

from _host_harness import ROOT, build_harness, ptr

HARNESS = ROOT / "tests" / "fp8_host" / "e5m6_host_harness.cpp"


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    so = build_harness(HARNESS, tmp_path_factory.mktemp("fp8_host"), "e5m6_host", "-O2")
    so.e5m6_exhaustive.restype = ctypes.c_int64
    so.e5m6_exhaustive.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int64)]
    return so


_p = ptr


def test_e5m6_encoders_over_every_fp32_value(lib):
    """encode_e5m6 == the contract for all 2^32 inputs; the fast path == the contract on its whole range
    (+-0 and 2^-14 <= |v| < 65536: 2 * (1 + 0x0F000000) patterns), and the range key selects exactly it."""
    checked = ctypes.c_int64(0)
    bad = lib.e5m6_exhaustive(0, 0xFFFFFFFF, ctypes.byref(checked))
    assert bad == 0
    assert checked.value == 2 * (1 + 0x0F000000)


def _values(n: int, seed: int) -> torch.Tensor:
    """Scaled values as a per-token cast makes them (|v| <= 65024), over many binades, with zeros, signed
    zeros, values in and around the FP16-subnormal range, ties and the top of the range."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 16, (n,), generator=g).float())
    v = v.clamp(-65024.0, 65024.0)
    v[::13] = 0.0
    v[5::29] = -0.0
    v[7::31] = 2.0 ** -14
    v[9::37] = -(2.0 ** -14) * (1 - 2.0 ** -9)
    v[11::41] = 65024.0
    v[3::43] = 1.0 + 2.0 ** -7  # a tie at 7 significant bits (RNE to 1.0)
    v[4::47] = 1.0 + 3 * 2.0 ** -7  # a tie that rounds up
    v[6::53] = float.fromhex("0x1p-130")  # FP32 subnormal
    return v.float()


@pytest.mark.parametrize("seed", [0, 1])
def test_e5m6_unit_bytes_match_reference(lib, seed):
    """The kernels' unit routine (fast path or, for a unit holding an FP16-subnormal value, the exact
    encoder) packs the same bytes as formats.pack_e5m6(formats.e5m6_encode(v))."""
    v = _values(8 * 4096, seed)
    if seed == 1:  # most units fast: subnormal-range values only in a few
        v = torch.where((v.abs() < 2.0 ** -14) & (v != 0), torch.zeros_like(v), v)
        v[8 * 100 + 3] = 1e-9
    words = torch.zeros(v.numel() // 8 * 3, dtype=torch.int32)
    lib.e5m6_units(_p(v), ctypes.c_int64(v.numel()), 1, _p(words))
    want = formats.pack_e5m6(formats.e5m6_encode(v).reshape(1, -1)).reshape(-1)
    assert torch.equal(words.view(torch.uint8), want)


def test_e5m6_unit_nan_block(lib):
    """A block with Inf/NaN has a NaN sf_inv: every value is NaN and every code 0x7FF."""
    v = torch.full((64,), float("nan"))
    words = torch.zeros(24, dtype=torch.int32)
    lib.e5m6_units(_p(v), ctypes.c_int64(64), 0, _p(words))
    want = formats.pack_e5m6(formats.e5m6_encode(v).reshape(1, -1)).reshape(-1)
    assert torch.equal(words.view(torch.uint8), want)


def test_encode_e5m6_matches_formats_everywhere(lib):
    """The exact encoder against ops/formats.py on values of every class (Inf, NaN, >= 65536 included)."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2 ** 31), 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    v = torch.cat([bits.view(torch.float32), _values(50_000, 4),
                   torch.tensor([float("inf"), float("-inf"), float("nan"), 65536.0, -65535.0, 65280.0, 65279.0])])
    codes = torch.zeros(v.numel(), dtype=torch.int16)
    lib.e5m6_codes(_p(v), ctypes.c_int64(v.numel()), _p(codes))
    assert torch.equal(codes, formats.e5m6_encode(v))
