// Which way of handing a tensor map to a kernel lets cp.async.bulk.tensor run here? One variant per process
// (an illegal-instruction error poisons the context). Usage: tma_probe <variant 0..3>
//   0: __grid_constant__ CUtensorMap kernel parameter, .shared::cluster destination
//   1: the same, .shared::cta destination
//   2: the map in device memory (host copy) + tensormap acquire fence, .shared::cluster
//   3: variant 0 with the encoder from cudaGetDriverEntryPointByVersion(12000)
//   4: variant 0 with a box whose first column is not 16-byte aligned (x = 68)
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>

constexpr int kRows = 128, kBoxCols = 32, kCols = 2048;

__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

template <bool kCta>
__device__ void copy_box(const CUtensorMap* map, uint8_t* out, int x, int y) {
  __shared__ alignas(1024) uint8_t buf[kRows * kBoxCols];
  __shared__ alignas(8) uint64_t bar;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&bar)), "r"(kRows * kBoxCols) : "memory");
    if (kCta)
      asm volatile("cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                   ::"r"(sa(buf)), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(sa(&bar)) : "memory");
    else
      asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                   ::"r"(sa(buf)), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(sa(&bar)) : "memory");
  }
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(sa(&bar)) : "memory");
  }
  for (int i = threadIdx.x; i < kRows * kBoxCols; i += blockDim.x) out[i] = buf[i];
}

__global__ void k_param(const __grid_constant__ CUtensorMap map, uint8_t* out, int x, int y) { copy_box<false>(&map, out, x, y); }
__global__ void k_param_cta(const __grid_constant__ CUtensorMap map, uint8_t* out, int x, int y) { copy_box<true>(&map, out, x, y); }
__global__ void k_global(const CUtensorMap* map, uint8_t* out, int x, int y) {
  if (threadIdx.x == 0)
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
  copy_box<false>(map, out, x, y);
}

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("variant %d: %s -> %s\n", v, #x, cudaGetErrorString(e_)); return 1; } } while (0)

int main(int argc, char** argv) {
  const int v = argc > 1 ? atoi(argv[1]) : 0;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (v == 3) {
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  } else {
    CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q));
  }
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) { printf("variant %d: no encoder\n", v); return 1; }
  auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  std::vector<uint8_t> h(kRows * 2 * kCols);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>(i * 7 + i / kCols);
  uint8_t *src, *out;
  CK(cudaMalloc(&src, h.size()));
  CK(cudaMalloc(&out, kRows * kBoxCols));
  CK(cudaMemcpy(src, h.data(), h.size(), cudaMemcpyHostToDevice));
  alignas(64) CUtensorMap map;
  const cuuint64_t dims[2] = {kCols, kRows * 2};
  const cuuint64_t strides[1] = {kCols};
  const cuuint32_t box[2] = {kBoxCols, kRows};
  const cuuint32_t es[2] = {1, 1};
  CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, src, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("variant %d: encode -> %d\n", v, int(r)); return 1; }
  const int x = v == 4 ? 68 : 64, y = 128;
  if (v == 0 || v == 3 || v == 4) k_param<<<1, 128>>>(map, out, x, y);
  if (v == 1) k_param_cta<<<1, 128>>>(map, out, x, y);
  if (v == 2) {
    CUtensorMap* dm;
    CK(cudaMalloc(&dm, sizeof(CUtensorMap)));
    CK(cudaMemcpy(dm, &map, sizeof(map), cudaMemcpyHostToDevice));
    k_global<<<1, 128>>>(dm, out, x, y);
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(kRows * kBoxCols);
  CK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int r2 = 0; r2 < kRows; ++r2)
    for (int c = 0; c < kBoxCols; ++c)
      bad += got[r2 * kBoxCols + c] != h[(y + r2) * kCols + x + c];
  printf("variant %d: ran, %d wrong bytes of %d\n", v, bad, kRows * kBoxCols);
  return bad != 0;
}
