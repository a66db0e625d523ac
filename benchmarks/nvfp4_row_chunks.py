"""How a row-scaled NVFP4 GEMM (the emulation on Hopper) should be cut into row chunks: GPU time per fprop GEMM
of the model benchmark's layers, against the same GEMM with per-tensor scaling (no epilogue) and BF16 ``torch.mm``.

A row-scaled product is an FP32 GEMM output (the unit alpha applied) followed by one epilogue kernel that
multiplies each row by its amax product and casts (``gemm/nvfp4_emulated.py``). The FP32 scratch is written by
the GEMM and read back by the epilogue: 8 bytes an element more than a BF16 output. When a chunk's scratch fits
in L2 (H200: 60 MiB), the epilogue reads it from L2 and the scratch lines may be overwritten by the next chunk
before they reach DRAM; smaller chunks cost GEMM efficiency (fewer output tiles per launch) and launches. This
measures that trade at the real shapes::

    python benchmarks/nvfp4_row_chunks.py [--rows 2048,1024,512,256] [--json out.json]

Each row-scaled column sets ``ROW_CHUNK_MIN_ROWS`` = R and ``ROW_CHUNK_MAX_CHUNKS`` = m // R (chunks of ~R
rows); ``lib`` is the library's default; ``l2:MiB`` sets ``ROW_CHUNK_SCRATCH_BYTES`` (R per shape so that a chunk's
FP32 scratch is at most that many MiB, a multiple of 128 rows). Every column's output is checked bit for bit
against the library default's. GPU time: CUDA events around each call, median of 30, after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fp_recipes.gemm import nvfp4_emulated as E
from fp_recipes.gemm.operands import Nvfp4Operand
from fp_recipes.ops import cuda_nvfp4

# (name, m tokens, k, n): the fprop GEMMs of bench_model.py's blocks (qkv, proj, fc1, fc2) and one Linear 4096^3
SHAPES = [
    ("h2048 qkv", 8192, 2048, 6144), ("h2048 proj", 8192, 2048, 2048), ("h2048 fc1", 8192, 2048, 8192),
    ("h2048 fc2", 8192, 8192, 2048),
    ("h4096 qkv", 4096, 4096, 12288), ("h4096 proj", 4096, 4096, 4096), ("h4096 fc1", 4096, 4096, 14336),
    ("h4096 fc2", 4096, 14336, 4096),
    ("linear 4096^3", 4096, 4096, 4096),
]


def timed(fn, iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3  # us


def operand(x: torch.Tensor, row_scaled: bool) -> Nvfp4Operand:
    q = cuda_nvfp4.nvfp4_quantize(x, rowwise=True, row_scaled=row_scaled)
    return Nvfp4Operand(q.data, q.scale, q.amax, row_scaled, 448, False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="lib,2048,1024,512,256,l2:16,l2:24")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    specs = [s for s in args.rows.split(",") if s]
    lib = (E.ROW_CHUNK_MIN_ROWS, E.ROW_CHUNK_MAX_CHUNKS)
    torch.manual_seed(0)
    results = []
    head = f"{'shape (m x k -> n)':28s} {'bf16':>8s} {'nvfp4':>8s}" + "".join(f" {s:>9s}" for s in specs)
    print(f"{torch.cuda.get_device_name()}: fprop GEMM GPU us (row-scaled columns: chunks of ~R rows)")
    print(head)
    for name, m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.rand(m, 1, device="cuda").bfloat16() * 4
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a_pt, a_rs, b = operand(x, False), operand(x, True), operand(w, False)
        row = {"shape": name, "m": m, "k": k, "n": n,
               "bf16": timed(lambda: torch.mm(x, w.t())),
               "nvfp4": timed(lambda: E.emulated_cuda_eager(a_pt, b, torch.bfloat16, None))}
        ref = E.emulated_cuda_eager(a_rs, b, torch.bfloat16, None)
        for s in specs:
            E.ROW_CHUNK_MIN_ROWS, E.ROW_CHUNK_MAX_CHUNKS = lib
            E.ROW_CHUNK_SCRATCH_BYTES = None
            if s.startswith("l2:"):  # the library's scratch-budget policy
                E.ROW_CHUNK_SCRATCH_BYTES = int(float(s[3:]) * 2**20)
            elif s != "lib":
                r = int(s)
                E.ROW_CHUNK_MIN_ROWS, E.ROW_CHUNK_MAX_CHUNKS = r, max(1, m // r)
            out = E.emulated_cuda_eager(a_rs, b, torch.bfloat16, None)
            if not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
                raise SystemExit(f"{name} rows={s}: the chunked output differs from the library's")
            row[s] = timed(lambda: E.emulated_cuda_eager(a_rs, b, torch.bfloat16, None))
            row[s + ":rows"] = E.row_chunk(m, n)
        E.ROW_CHUNK_MIN_ROWS, E.ROW_CHUNK_MAX_CHUNKS = lib
        E.ROW_CHUNK_SCRATCH_BYTES = None
        results.append(row)
        print(f"{name + f' ({m}x{k}->{n})':28s} {row['bf16']:8.1f} {row['nvfp4']:8.1f}"
              + "".join(f" {row[s]:9.1f}" for s in specs))
    tot = {c: sum(r[c] for r in results[:4]) for c in ["bf16", "nvfp4", *specs]}
    print(f"{'h2048 block fprop sum':28s} {tot['bf16']:8.1f} {tot['nvfp4']:8.1f}" +
          "".join(f" {tot[s]:9.1f}" for s in specs))
    tot4 = {c: sum(r[c] for r in results[4:8]) for c in ["bf16", "nvfp4", *specs]}
    print(f"{'h4096 block fprop sum':28s} {tot4['bf16']:8.1f} {tot4['nvfp4']:8.1f}" +
          "".join(f" {tot4[s]:9.1f}" for s in specs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
