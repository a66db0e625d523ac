"""An independent, element-by-element NVFP4 model written from NUMERICS.md / docs/nvfp4.md for the tests.

It shares no code with fp_recipes: FP32 arithmetic is numpy float32 scalars (each op IEEE RN), E4M3 and
E2M1 encodes are nearest-value searches over the code tables (ties to the even code), BF16 rounding is
done on the bits. Slow on purpose (plain loops); use it on small tensors only.
"""

from __future__ import annotations

import math

import numpy as np

F = np.float32
FLT_MAX = F(np.finfo(np.float32).max)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 0xF and m == 7:
        return math.nan
    return sign * (m * 2.0**-9 if e == 0 else (8 + m) * 2.0 ** (e - 10))


_E4M3_POS = [(c, e4m3_value(c)) for c in range(0x7F)]


def e4m3_code(v) -> int:
    """Saturating RN encode of a non-negative, non-NaN value (scales are never negative here)."""
    v = float(v)
    assert not math.isnan(v) and v >= 0
    v = min(v, 448.0)
    best = min(_E4M3_POS, key=lambda cv: (abs(cv[1] - v), cv[0] & 1))
    return best[0]


def e2m1_code(y, sign_src) -> int:
    """RN ties-to-even E2M1 code of y, sign bit taken from sign_src (NaN -> 7)."""
    sign = 8 if math.copysign(1.0, float(sign_src)) < 0 else 0
    a = abs(float(y))
    if math.isnan(a):
        return 7 | sign
    a = min(a, 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1_GRID[i] - a), i & 1))
    return best | sign


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_GRID[code & 7]


def fmin(a, b):
    """CUDA fminf: a NaN operand yields the other."""
    a, b = F(a), F(b)
    if np.isnan(a):
        return b
    if np.isnan(b):
        return a
    return a if a < b else b


def div(a, b):
    with np.errstate(all="ignore"):
        return F(F(a) / F(b))


def mul(a, b):
    with np.errstate(all="ignore"):
        return F(F(a) * F(b))


def add(a, b):
    with np.errstate(all="ignore"):
        return F(F(a) + F(b))


def sub(a, b):
    with np.errstate(all="ignore"):
        return F(F(a) - F(b))


def nanmax_abs(vals) -> F:
    out = F(0)
    for v in vals:
        a = F(abs(float(v)))
        if np.isnan(a):
            return F(np.nan)
        out = max(out, a)
    return out


def global_scale(amax, e):
    s = fmin(div(6 * e, amax), FLT_MAX)
    if F(amax) == 0 or s == 0:
        return F(1)
    return s


def plain_scale_code(bamax, s):
    mult = mul(s, div(1, 6))
    return e4m3_code(fmin(mul(bamax, mult), FLT_MAX))


def enc_of(sf_code, s):
    return fmin(div(1, mul(e4m3_value(sf_code), div(1, s))), FLT_MAX)


def candidate_row_errors(xs, sf_code, s, amax, e, mode, fast):
    """Per-element errors of one candidate for the elements xs (FP32), list of FP32."""
    sf = F(e4m3_value(sf_code))
    enc = enc_of(sf_code, s)
    out = []
    for x in xs:
        q = F(e2m1_value(e2m1_code(mul(x, enc), x)))
        if fast:
            cand = F(np.float16(q) * np.float16(sf))  # numpy rounds the FP16 product once
            d = sub(cand, mul(x, s))
        else:
            d = sub(div(mul(mul(q, sf), amax), F(6 * e)), x)
        out.append(F(abs(d)) if mode == "MAE" else mul(d, d))
    return out


def seq_sum(es):
    acc = F(0)
    for v in es:
        acc = add(acc, v)
    return acc


def tree16(r):
    """((((r0+r8)+(r4+r12))+((r2+r10)+(r6+r14))) + (((r1+r9)+(r5+r13))+((r3+r11)+(r7+r15))))"""
    a = add(add(add(r[0], r[8]), add(r[4], r[12])), add(add(r[2], r[10]), add(r[6], r[14])))
    b = add(add(add(r[1], r[9]), add(r[5], r[13])), add(add(r[3], r[11]), add(r[7], r[15])))
    return add(a, b)


def four_over_six_code(bamax, s, amax, e, mode, fast, rows_of_elements, combine):
    """The chosen scale code; rows_of_elements: list of element lists whose errors are summed
    per row in element order, then combined by ``combine`` (a 1-D block is one row)."""
    base = mul(div(bamax, 6), s)
    c6 = e4m3_code(fmin(base, 448))
    c4 = e4m3_code(fmin(mul(base, 1.5), 448))
    errs = []
    for c in (c6, c4):
        row_sums = [seq_sum(candidate_row_errors(r, c, s, amax, e, mode, fast)) for r in rows_of_elements]
        errs.append(combine(row_sums))
    return c4 if errs[1] < errs[0] else c6


def quantize_1d(x: np.ndarray, *, e=448, row_scaled=False, four_over_six=False, mode="MAE", fast=False,
                amax=None):
    """Returns (codes (M, N) ints, scale codes (M, N/16) ints, amax (scalar or per-row list))."""
    m, n = x.shape
    x = x.astype(np.float32)
    if amax is None:
        amax = [nanmax_abs(x[r]) for r in range(m)] if row_scaled else nanmax_abs(x.ravel())
    codes = np.zeros((m, n), dtype=np.int64)
    scales = np.zeros((m, n // 16), dtype=np.int64)
    for r in range(m):
        a = F(amax[r]) if row_scaled else F(amax)
        s = global_scale(a, e)
        for b in range(n // 16):
            blk = x[r, 16 * b:16 * b + 16]
            bamax = nanmax_abs(blk)
            if four_over_six:
                c = four_over_six_code(bamax, s, a, e, mode, fast, [list(blk)], lambda rs: rs[0])
            else:
                c = plain_scale_code(bamax, s)
            enc = enc_of(c, s)
            scales[r, b] = c
            for j in range(16):
                codes[r, 16 * b + j] = e2m1_code(mul(blk[j], enc), blk[j])
    return codes, scales, amax


def quantize_2d(x: np.ndarray, *, e=448, four_over_six=False, mode="MAE", fast=False, amax=None,
                combine=tree16):
    """2-D 16x16 tiles: (codes, scale codes (M, N/16) repeated per row, amax)."""
    m, n = x.shape
    x = x.astype(np.float32)
    if amax is None:
        amax = nanmax_abs(x.ravel())
    a = F(amax)
    s = global_scale(a, e)
    codes = np.zeros((m, n), dtype=np.int64)
    scales = np.zeros((m, n // 16), dtype=np.int64)
    for ti in range(m // 16):
        for tj in range(n // 16):
            tile = x[16 * ti:16 * ti + 16, 16 * tj:16 * tj + 16]
            tamax = nanmax_abs(tile.ravel())
            if four_over_six:
                c = four_over_six_code(tamax, s, a, e, mode, fast, [list(tile[r]) for r in range(16)], combine)
            else:
                c = plain_scale_code(tamax, s)
            enc = enc_of(c, s)
            scales[16 * ti:16 * ti + 16, tj] = c
            for r in range(16):
                for j in range(16):
                    v = tile[r, j]
                    codes[16 * ti + r, 16 * tj + j] = e2m1_code(mul(v, enc), v)
    return codes, scales, amax


def pack(codes: np.ndarray) -> np.ndarray:
    m, n = codes.shape
    out = np.zeros((m, n // 2), dtype=np.uint8)
    for r in range(m):
        for k in range(n // 2):
            out[r, k] = (int(codes[r, 2 * k]) & 0xF) | ((int(codes[r, 2 * k + 1]) & 0xF) << 4)
    return out


def bf16_round_bits(v) -> int:
    """RN-even BF16 bits of an FP32 value (non-NaN)."""
    bits = int(np.array([v], dtype=np.float32).view(np.uint32)[0])
    lsb = (bits >> 16) & 1
    return ((bits + 0x7FFF + lsb) >> 16) & 0xFFFF


def rht16_bf16_bits(xs) -> list:
    """The fixed butterfly: signs, stages h = 1, 2, 4, 8 of (a+b, a-b), then *0.25, then BF16 bits."""
    u = [mul(F(x), F(sgn)) for x, sgn in zip(xs, RHT_SIGNS)]
    h = 1
    while h < 16:
        for i in range(16):
            if i & h == 0:
                a, b = u[i], u[i + h]
                u[i], u[i + h] = add(a, b), sub(a, b)
        h *= 2
    return [bf16_round_bits(mul(v, 0.25)) for v in u]


# ---- Philox4x32-10 in plain Python integers (independent of the torch int64 version) ----

def philox4x32_10(ctr, key):
    m0, m1, w0, w1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
    c = list(ctr)
    k0, k1 = key
    for rnd in range(10):
        if rnd:
            k0, k1 = (k0 + w0) & 0xFFFFFFFF, (k1 + w1) & 0xFFFFFFFF
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & 0xFFFFFFFF, p1 & 0xFFFFFFFF,
             ((p0 >> 32) ^ c[3] ^ k1) & 0xFFFFFFFF, p0 & 0xFFFFFFFF]
    return c
