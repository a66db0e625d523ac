// Shared host-side helpers for the fp_recipes CUDA extension: dtype codes, error checking.
// Framework-agnostic: kernels take raw device pointers, sizes, dtype codes and a cudaStream_t.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

namespace fp_recipes {

// Element dtype codes passed from Python (fp_recipes/ops/cuda.py keeps the same table).
enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,
  kFloat8E5M2 = 4,
  kUInt8 = 5,
};

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

// Throws a std::runtime_error (a Python RuntimeError through pybind11) for any CUDA error.
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fp_recipes CUDA error in ") + what + ": " +
                             cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// Call after every launch: surfaces bad launch configurations at the call site.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("fp_recipes: " + msg);
}

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

template <typename T>
inline T* as_ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace fp_recipes
