"""Exhaustive proof-by-enumeration behind div_6e in fp_recipes/csrc/nvfp4_device.cuh.

For the 4over6 strict error's divisor c = 6E in {2688, 1536}: with zh = RN(1/c) and zl = RN(1/c - zh),
fma(x, zh, RN(x * zl)) equals RN(x / c) for every FP32 significand (x in [1, 2)); scaling by powers of
two covers all normal x whose quotient and x*zl are normal (the kernel takes the true division
elsewhere). Exact integer arithmetic; about 2 minutes on one core. Expected output: 0 mismatches.
Usage: python scripts/nvfp4_check_div6e.py"""
from fractions import Fraction
import numpy as np

def rn32_frac(fr: Fraction) -> Fraction:
    # round a positive rational to FP32 (normal range) with ties to even
    n, d = fr.numerator, fr.denominator
    e = n.bit_length() - d.bit_length()
    if Fraction(n, d) < Fraction(2) ** e: e -= 1
    # significand scaled: fr / 2^e in [1,2) -> integer with 23 fractional bits
    s = Fraction(n, d) / Fraction(2) ** e * (1 << 23)
    fl = s.numerator // s.denominator
    rem = s - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl & 1): fl += 1
    return Fraction(fl) * Fraction(2) ** (e - 23)

for c in (2688, 1536):
    zh = rn32_frac(Fraction(1, c))
    zl = rn32_frac(Fraction(1, c) - zh) if Fraction(1, c) != zh else Fraction(0)
    # as float64 (exact) for vectorised products
    zh64, zl64 = float(zh), float(zl)
    X = np.arange(1 << 23, 1 << 24, dtype=np.int64)
    x = X.astype(np.float64) / (1 << 23)          # exact
    q1 = (x * zl64).astype(np.float32).astype(np.float64)   # x*zl exact in f64 (48 bits), one rounding to f32
    # exact value of x*zh + q1 as integers: x = X*2^-23, zh = ZH*2^ezh, q1 = Q1*2^eq1
    zhn, zhd = zh.numerator, zh.denominator  # zh = zhn / zhd, zhd power of 2
    m1, e1 = np.frexp(q1)                    # q1 = m1 * 2^e1, m1 in [0.5,1)
    Q1 = (m1 * (1 << 24)).astype(np.int64)    # exact 24-bit integer
    eq1 = e1.astype(np.int64) - 24
    # common denominator 2^D: choose D = 23 + log2(zhd) (x*zh) and check q1's exponent >= -D
    D = 23 + (zhd.bit_length() - 1)
    assert (eq1 >= -D - 40).all()
    # use Python ints on an object array (exact): S = X*zhn*2^K + Q1 * 2^(eq1 + D + K) with K to make shifts >= 0
    K = int(max(0, -(eq1.min() + D)))
    Xo = X.astype(object)
    shift = (eq1 + D + K).astype(object)
    Q1o = Q1.astype(object)
    S = Xo * zhn * (1 << K) + np.array([q << s for q, s in zip(Q1o, shift)], dtype=object)
    den = 1 << (D + K)
    # round S/den to FP32 and compare with RN(x / c) = RN(X / (c * 2^23))
    # both results lie in [1/c, 2/c): same binade except at the top; compute 24-bit significands exactly
    def rn_int(num, den_):  # RN(num/den) as (significand, exponent) with 24-bit significand, vectorised over num
        out = []
        for n in num:
            e = n.bit_length() - den_.bit_length()
            if n < (den_ << e) if e >= 0 else (n << -e) < den_: e -= 1
            # n/den in [2^e, 2^(e+1)); significand = n/den / 2^(e-23)
            sh = 23 - e
            nn, dd = (n << sh, den_) if sh >= 0 else (n, den_ << -sh)
            fl, r = divmod(nn, dd)
            if 2 * r > dd or (2 * r == dd and fl & 1): fl += 1
            out.append((fl, e))
        return out
    got = rn_int(S, den)
    want = rn_int(Xo * 1, c << 23)
    # compare values exactly (fl may be 2^24 after rounding up)
    bad = sum(1 for g, w in zip(got, want) if Fraction(g[0]) * Fraction(2) ** g[1] != Fraction(w[0]) * Fraction(2) ** w[1])
    print(f"c={c}: zh={float(zh)!r} zl={float(zl)!r} significands={len(got)} mismatches={bad}", flush=True)
