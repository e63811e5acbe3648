// Shared declarations of the private extension common._cuda: error type, device guard,
// driver entry points, and the block copy launcher (implemented in blockcopy.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pdkv {

// A failed CUDA call. The module turns it into common._cuda.Error(code, name, message); the
// Python layer (common/cuda.py) maps that to common.errors.CudaError with a hint.
class CudaFailure : public std::runtime_error {
 public:
  CudaFailure(const std::string& call, int code, const std::string& name, const std::string& text)
      : std::runtime_error(call + " failed: " + name + " (" + std::to_string(code) + "): " + text),
        code(code),
        name(name) {}
  int code;
  std::string name;
};

// Throws CudaFailure naming `call` unless err == cudaSuccess.
void check(cudaError_t err, const char* call);

// Throws CudaFailure for a driver API result (CUresult passed as int).
void check_driver(int result, const char* call);

#define PDKV_CHECK(expr) ::pdkv::check((expr), #expr)

// Makes `device` current for its lifetime and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// cuMemGetAddressRange through cudaGetDriverEntryPointByVersion (no link to libcuda):
// base and size of the allocation that holds `ptr`, in the current context.
void allocation_range(const void* ptr, uintptr_t* base, size_t* size);

// Block id pairs passed by value in one launch's parameters (2 x 480 x 4 bytes).
constexpr int kIdsPerLaunch = 480;

// Enqueue on `stream`: for i < n, copy block src_ids[i] of `src` to block dst_ids[i] of `dst`,
// each `block_nbytes` long. The ids are host memory, read before this returns (they go to the
// GPU as launch parameters, one launch per kIdsPerLaunch ids) and must be in [0, 2^31).
// 16-byte vector loads when pointers and block size allow, bytes otherwise.
void launch_copy_blocks(void* dst, const void* src, const int64_t* src_ids, const int64_t* dst_ids,
                        int64_t n, int64_t block_nbytes, cudaStream_t stream);

}  // namespace pdkv
