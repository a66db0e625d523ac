// Device-side number-format encoders and decoders: the one CUDA source of truth for formats.
// Every kernel includes this header; fp_recipes/formats.py is its Python twin. Each encoder is
// round-to-nearest-even and documents its NaN/Inf/saturation behaviour.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace fp_recipes {

// ---- section: FP8 (E4M3, E5M2), E5M6, UE8M0 — owned by the FP8 kernel family -----------------

// ---- section: E2M1 (NVFP4) — owned by the NVFP4 kernel family ---------------------------------

}  // namespace fp_recipes
