"""Count SASS instructions per 16-element NVFP4 block, per mode and 4over6 path (no GPU needed).

Compiles a micro kernel (one bf16 block per thread through fp_recipes/csrc/nvfp4_device.cuh, as the
rowwise kernel runs it) with setup.py's nvcc flags, disassembles it with cuobjdump (CUDA toolkit, or the
nvidia-cuda-cuobjdump + nvidia-cuda-nvdisasm wheels: set CUOBJDUMP and NVDISASM_PATH), and prints the hot
path of each instantiation: entry .. EXIT minus the division / reciprocal slow paths (code skipped by a
forward conditional branch that contains a CALL). Each count includes ~30 instructions of harness
(parameter loads, make_tensor_scale, stores). ALU = the half-rate pipe (compares, selects, min/max,
logic, permutes, shifts). Usage: python scripts/nvfp4_sass_count.py [--arch 90a]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MICRO = r'''
#include <cuda_bf16.h>
#include "nvfp4_device.cuh"
using namespace fp_recipes::nvfp4;
// kPath: 0 = quantize_block_1d (per-warp vote, both paths present), 1 = short path, 2 = general path.
template <int kFos, int kPath>
__global__ void one_block(const __nv_bfloat16* __restrict__ in, float amax, float e4m3_max, const float2* tab,
                          uint2* __restrict__ q, uint8_t* __restrict__ sf) {
  const int i = threadIdx.x;
  float x[16];
  load16(in + 16 * i, x);
  const TensorScale t = make_tensor_scale(amax, e4m3_max);
  __builtin_assume(tab != nullptr);  // the rowwise kernel's per-tensor case: the {sf, enc} table
  __shared__ float vtab[16 * kValStride];  // the strict short path's value tables
  float* vt = vtab + threadIdx.x;
  uint2 qq;
  uint32_t s;
  if (kPath == 0 || kFos == 0) {
    quantize_block_1d<kFos>(x, t, false, 0, 0, 0, qq, s, kFos ? tab : nullptr, vt);
  } else {
    const float bamax = block_absmax16(x);
    const FosCandidates c = fos_candidates(bamax, t, tab);
    uint2 q4, q6;
    float e4, e6;
    fos_encode16<kFos, kPath == 1, kPath == 1 && (kFos == 1 || kFos == 3)>(x, c, t, q4, q6, e4, e6, vt);
    const bool use4 = fos_pick4(e4, e6);
    qq = use4 ? q4 : q6;
    s = use4 ? c.sf4 : c.sf6;
  }
  q[i] = qq;
  sf[i] = static_cast<uint8_t>(s);
}
#define INST(F, P) template __global__ void one_block<F, P>(const __nv_bfloat16*, float, float, const float2*, uint2*, uint8_t*);
INST(0, 0) INST(1, 1) INST(1, 2) INST(2, 1) INST(2, 2) INST(3, 1) INST(3, 2) INST(4, 1) INST(4, 2)
'''
NAMES = {0: "plain", 1: "strict MAE", 2: "fast MAE", 3: "strict MSE", 4: "fast MSE"}
ALU = {"FMNMX", "FSETP", "FSEL", "LOP3", "PRMT", "SHF", "IADD3", "ISETP", "SEL", "F2FP", "FCHK", "VIADD",
       "PLOP3", "LEA", "IMNMX", "VIMNMX", "MOV", "I2FP", "F2I", "FRND", "P2R", "R2P", "VOTE"}


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur:
            out[cur].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def hot(instrs: list[tuple[int, str]]) -> tuple[int, int]:
    body = []
    for addr, ins in instrs:
        body.append((addr, ins))
        if opcode(ins) == "EXIT" and not ins.startswith("@"):
            break
    cold = set()
    for a, ins in body:
        m = re.match(r"@!?P\d\s+BRA\s+.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) > a:
            rng = [i for i, (aa, _) in enumerate(body) if a < aa < int(m.group(1), 16)]
            if any("CALL" in body[i][1] for i in rng):
                cold.update(rng)
    kept = [opcode(ins) for i, (_, ins) in enumerate(body) if i not in cold]
    c = collections.Counter(kept)
    return len(kept), sum(v for k, v in c.items() if k in ALU)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90a")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = Path(tmp) / "micro.cu", Path(tmp) / "micro.o"
        src.write_text(MICRO)
        subprocess.run([nvcc, "-c", str(src), "-o", str(obj), "-fmad=false", "-O3", "-std=c++17",
                        "--expt-relaxed-constexpr", f"-I{ROOT / 'fp_recipes' / 'csrc'}",
                        f"-gencode=arch=compute_{args.arch},code=sm_{args.arch}"], check=True)
        sass = subprocess.run([cuobjdump, "--dump-sass", str(obj)], check=True, capture_output=True,
                              text=True).stdout
    print(f"{'mode':<12} {'path':<8} {'instr':>6} {'ALU':>5}")
    for name, ins in sorted(functions(sass).items()):
        m = re.search(r"one_blockILi(\d)ELi(\d)E", name)
        if m:
            n, alu = hot(ins)
            fos, path = int(m.group(1)), int(m.group(2))
            print(f"{NAMES[fos]:<12} {['', 'short', 'general'][path] or '-':<8} {n:>6} {alu:>5}")


if __name__ == "__main__":
    main()
