// Block copy kernel: many (src block -> dst block) copies of one size, the ids passed by value.
// Memory-bound: each thread moves kUnroll 16-byte vectors per step, loads before stores so that
// several requests are in flight; the source may be a peer GPU's memory (NVLink reads).
// The ids travel in the launch's parameters (up to kIdsPerLaunch pairs a launch, 3.75 KiB, under
// the 4 KiB every architecture takes): no id buffer to upload, pin or keep alive, so enqueueing
// a pull is one launch per 480 blocks and nothing else.
#include "pdkv_cuda.h"

namespace pdkv {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kStepsPerThread = 4;  // unrolled steps per thread: fewer, longer-lived CTAs

struct IdBatch {
  int32_t src[kIdsPerLaunch];
  int32_t dst[kIdsPerLaunch];
};

template <typename T>
__global__ void copy_blocks_kernel(T* __restrict__ dst, const T* __restrict__ src,
                                   const __grid_constant__ IdBatch ids, int n, int64_t per_block) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int p = blockIdx.y; p < n; p += gridDim.y) {
    const T* s = src + static_cast<int64_t>(ids.src[p]) * per_block;
    T* d = dst + static_cast<int64_t>(ids.dst[p]) * per_block;
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (; i + (kUnroll - 1) * stride < per_block; i += kUnroll * stride) {
      T r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = s[i + u * stride];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * stride] = r[u];
    }
    for (; i < per_block; i += stride) d[i] = s[i];
  }
}

template <typename T>
void launch(void* dst, const void* src, const IdBatch& ids, int n, int64_t per_block,
            cudaStream_t stream) {
  int64_t per_cta = static_cast<int64_t>(kThreads) * kUnroll * kStepsPerThread;
  int64_t x = (per_block + per_cta - 1) / per_cta;
  dim3 grid(static_cast<unsigned>(x < 1 ? 1 : (x > 4096 ? 4096 : x)), static_cast<unsigned>(n));
  copy_blocks_kernel<T><<<grid, kThreads, 0, stream>>>(
      static_cast<T*>(dst), static_cast<const T*>(src), ids, n, per_block);
}

}  // namespace

void launch_copy_blocks(void* dst, const void* src, const int64_t* src_ids, const int64_t* dst_ids,
                        int64_t n, int64_t block_nbytes, cudaStream_t stream) {
  bool vec = block_nbytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(src) % 16 == 0;
  IdBatch ids;
  for (int64_t start = 0; start < n; start += kIdsPerLaunch) {
    int chunk = static_cast<int>(n - start < kIdsPerLaunch ? n - start : kIdsPerLaunch);
    for (int i = 0; i < chunk; ++i) {
      ids.src[i] = static_cast<int32_t>(src_ids[start + i]);
      ids.dst[i] = static_cast<int32_t>(dst_ids[start + i]);
    }
    if (vec) {
      launch<uint4>(dst, src, ids, chunk, block_nbytes / 16, stream);
    } else {
      launch<unsigned char>(dst, src, ids, chunk, block_nbytes, stream);
    }
    check(cudaGetLastError(), "copy_blocks_kernel<<<>>>");
  }
}

}  // namespace pdkv
