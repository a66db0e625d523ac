"""The decode-in-mainloop NVFP4 GEMM prototype's variants against the library's emulated GEMM, on a GPU.

Builds each variant (VARIANTS below) with nvcc (sm_90a) into a shared library, loads it with ctypes, and per shape:
- correctness: random NVFP4 operands (every E2M1 code, E4M3 scales over 2^-9..2^8 and a few NaN scales in one
  check) against the exact product in float64 (the unit values are exact, so the reference is the true sum times
  alpha) and against the library's path (unit decode + cuBLASLt BF16 GEMM): ||out - ref|| / ||ref||, the largest
  difference from the library's BF16 result in value-ordered BF16 ulps (0 for v4: the same K order) and relative to
  the largest |ref| (the measure for variants that reorder K), NaN positions equal, every output written (poisoned);
- speed: CUDA-event medians of the prototype, of the library's path (the decode launch + the BF16 GEMM, what a
  GEMM of the NVFP4 Linear costs today) and of the BF16 GEMM alone (cuBLASLt on the decoded units: BF16 training's
  cost), in one process. Table printed last; JSON to --json.

    python benchmarks/nvfp4_gemm_proto/run.py [--json PATH] [--shapes 4096x4096x4096,...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

ITERS = [0]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


#: variant name -> (source file, extra nvcc flags); each defines the same C entry point
#: (v0 and v2, measured in session 31, are in git history at commit b1a6d45; v3, decode_gemm_tma.cu, at 2bea6e4)
VARIANTS = {"v4": ("decode_gemm.cu", []), "rs": ("decode_gemm_rs.cu", []),
            "rs5": ("decode_gemm_rs.cu", ["-DRS_STAGES=5"]), "rs_prmt": ("decode_gemm_rs.cu", ["-DRS_DECODE=0"]), "rs_int": ("decode_gemm_rs.cu", ["-DRS_DECODE=2"]),
            "rs_coupled": ("decode_gemm_rs.cu", ["-DRS_COUPLED=1"]),
            "rs_bsplit": ("decode_gemm_rs.cu", ["-DRS_BSPLIT=1"]),
            "rs_int_bsplit": ("decode_gemm_rs.cu", ["-DRS_DECODE=2", "-DRS_BSPLIT=1"]),
            "rs_persist": ("decode_gemm_rs.cu", ["-DRS_PERSIST=1"]),
            "rs_int_persist": ("decode_gemm_rs.cu", ["-DRS_DECODE=2", "-DRS_PERSIST=1"]),
            # timing experiments, wrong results: B's / A's decode, the proxy fence left out
            "rs_noB": ("decode_gemm_rs.cu", ["-DRS_ABLATE=1"]), "rs_noA": ("decode_gemm_rs.cu", ["-DRS_ABLATE=2"]),
            "rs_nofence": ("decode_gemm_rs.cu", ["-DRS_ABLATE=3"]),
            # neither operand decoded: the skeleton's own speed (TMA, barriers, RS wgmma, epilogue) against cuBLAS
            "rs_noAB": ("decode_gemm_rs.cu", ["-DRS_ABLATE=4"]),
            "rs_persist_noAB": ("decode_gemm_rs.cu", ["-DRS_ABLATE=4", "-DRS_PERSIST=1"])}


def build(out_dir: str, variant: str) -> ctypes.CDLL:
    so = os.path.join(out_dir, f"libdecode_gemm_{variant}.so")
    nvcc = os.environ.get("NVCC", "nvcc")
    cmd = [nvcc, "-shared", "-O3", "-lineinfo", "-std=c++17", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a",
           "-Xptxas", "-v", *VARIANTS[variant][1], os.path.join(HERE, VARIANTS[variant][0]), "-o", so]
    res = subprocess.run(cmd, capture_output=True, text=True)
    print(variant + ": " + " ".join(l.strip() for l in res.stderr.splitlines()
                                   if "registers" in l or "spill" in l or "error" in l.lower() or "C751" in l))
    if res.returncode != 0:
        print(res.stderr)
        raise SystemExit("nvcc failed")
    lib = ctypes.CDLL(so)
    lib.nvfp4_decode_gemm.restype = ctypes.c_int
    lib.nvfp4_decode_gemm.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    return lib


def operand(rows: int, k: int, gen: torch.Generator, nan_scales: bool = False):
    data = torch.randint(0, 256, (rows, k // 2), generator=gen, dtype=torch.uint8)
    exps = torch.randint(-9, 9, (rows, k // 16), generator=gen).float()
    mant = torch.randint(8, 16, (rows, k // 16), generator=gen).float() / 8
    scale = (mant * torch.exp2(exps)).clamp(max=448).to(torch.float8_e4m3fn)
    if nan_scales:
        scale.view(torch.uint8)[::97, 1] = 0x7F
    return data.cuda(), scale.cuda()


def units(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1, dtype=torch.float64, device=data.device)
    codes = torch.stack([data & 15, data >> 4], -1).reshape(data.shape[0], -1).long()
    return table[codes] * scale.double().repeat_interleave(16, 1)


def median_ms(fn, iters: int = 30) -> float:
    iters = ITERS[0] or iters
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", default="4096x4096x4096,8192x6144x2048,8192x2048x8192,6144x2048x8192,8192x8192x2048")
    p.add_argument("--variants", default="v4", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--iters", type=int, default=0, help="timed repetitions (0: 30)")
    args = p.parse_args()
    ITERS[0] = args.iters
    from fp_recipes.gemm import cublaslt
    from fp_recipes.ops import cuda_nvfp4

    # (the libraries go to a scratch folder, not $OUT: on the device machine only the reports should come back)
    out_dir = os.environ.get("PROTO_BUILD", "/tmp/nvfp4_gemm_proto_build")
    os.makedirs(out_dir, exist_ok=True)
    names = args.variants.split(",")
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(names))) as pool:  # nvcc runs in parallel
        built = list(pool.map(lambda v: build(out_dir, v), names))
    libs = dict(zip(names, built))
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuBLASLt: {cublaslt.available()}")
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for shape in args.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        gen = torch.Generator().manual_seed(M + N + K)
        results = {"shape": shape}
        for check, nan in (("random", False), ("nan scales", True)):
            ad, as_ = operand(M, K, gen, nan)
            bd, bs = operand(N, K, gen)
            amax_a = torch.tensor(3.5, device=dev)
            amax_b = torch.tensor(0.75, device=dev)
            (ua, ub), ab = cuda_nvfp4.nvfp4_unit_operands([(ad, as_), (bd, bs)], amax_a, amax_b)
            lib_out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            assert cublaslt.bf16_gemm_device_alpha(ua, ub, lib_out, ab)
            ref = (units(ad, as_) @ units(bd, bs).T) * float(ab[0])
            fin = torch.isfinite(ref)
            lo = lib_out.double()
            rel_lib = float(((lo - ref)[fin]).norm() / ref[fin].norm())
            for name, lib in libs.items():
                out = torch.empty((M, N), dtype=torch.bfloat16, device=dev)
                out.view(torch.int16).fill_(0x7F81)  # poison: a NaN bit pattern no GEMM writes
                rc = lib.nvfp4_decode_gemm(ad.data_ptr(), as_.data_ptr(), bd.data_ptr(), bs.data_ptr(),
                                           ab.data_ptr(), out.data_ptr(), M, N, K, stream)
                torch.cuda.synchronize()
                if rc != 0:
                    raise SystemExit(f"{shape} {name}: nvfp4_decode_gemm returned {rc}")
                unwritten = int((out.view(torch.int16) == 0x7F81).sum())
                o = out.double()
                rel = float(((o - ref)[fin]).norm() / ref[fin].norm())
                nan_same = bool(torch.equal(torch.isnan(out), torch.isnan(lib_out)))
                # BF16 bits as integers in value order (-0 and +0 both 0), so a sign change near zero counts its ulps
                ob, lb = (torch.where(x < 0, -(x & 0x7FFF), x) for x in (out.view(torch.int16).int(),
                                                                       lib_out.view(torch.int16).int()))
                both = fin & torch.isfinite(lib_out.float())
                ulps = int(((ob - lb).abs())[both].max()) if both.any() else 0
                # a reordered FP32 sum moves outputs that cancel to near zero by many ulps: the largest difference
                # relative to the largest |reference| is the measure that suits a GEMM tolerance
                diff = float((o - lo)[both].abs().max() / ref[fin].abs().max()) if both.any() else 0.0
                results[f"{check} {name}"] = dict(rel_err=rel, rel_err_library=rel_lib, max_ulps_vs_library=ulps,
                                                  max_diff_vs_library=diff, nan_same=nan_same, unwritten=unwritten)
                print(f"{shape} {check:10s} {name}: rel err {rel:.2e} (library {rel_lib:.2e}), max |BF16 ulps| vs "
                      f"library {ulps}, max |diff| vs library / max |ref| {diff:.1e}, NaN positions equal {nan_same}, "
                      f"unwritten {unwritten}", flush=True)
                del out
            del ua, ub, lib_out, ref
        # speed (the random operands of the last check's shapes, fresh)
        ad, as_ = operand(M, K, gen)
        bd, bs = operand(N, K, gen)
        amax_a, amax_b = torch.tensor(3.5, device=dev), torch.tensor(0.75, device=dev)
        (ua, ub), ab = cuda_nvfp4.nvfp4_unit_operands([(ad, as_), (bd, bs)], amax_a, amax_b)
        out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)

        def proto(lib):
            return lambda: lib.nvfp4_decode_gemm(ad.data_ptr(), as_.data_ptr(), bd.data_ptr(), bs.data_ptr(),
                                                 ab.data_ptr(), out.data_ptr(), M, N, K, stream)

        def library():
            (xa, xb), al = cuda_nvfp4.nvfp4_unit_operands([(ad, as_), (bd, bs)], amax_a, amax_b)
            cublaslt.bf16_gemm_device_alpha(xa, xb, out, al)

        def bf16():
            cublaslt.bf16_gemm_device_alpha(ua, ub, out, ab)

        cases = [(name, proto(lib)) for name, lib in libs.items()] + [("library", library), ("bf16", bf16)]
        t = {name: median_ms(fn) for name, fn in cases}
        tflops = {k: 2.0 * M * N * K / (v * 1e-3) / 1e12 for k, v in t.items()}
        results.update(ms=t, tflops=tflops)
        rows.append(results)
        print(f"{shape}: " + ", ".join(f"{k} {v * 1e3:.1f} us ({tflops[k]:.0f} TFLOP/s)" for k, v in t.items()),
              flush=True)
        del ad, as_, bd, bs, ua, ub, out
        torch.cuda.empty_cache()
    print(f"\n{'shape':18s} " + " ".join(f"{k + ' us':>10s}" for k in rows[0]["ms"]) + "   (x library: "
          + ", ".join(names) + ")")
    for r in rows:
        t = r["ms"]
        print(f"{r['shape']:18s} " + " ".join(f"{v * 1e3:10.1f}" for v in t.values()) + "   "
              + ", ".join(f"{t[n] / t['library']:.2f}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
