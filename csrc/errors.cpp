// Error type, device guard and driver entry points of common._cuda.
#include <cuda.h>

#include <mutex>

#include "pdkv_cuda.h"

namespace pdkv {

void check(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  std::string name(call);
  name = name.substr(0, name.find('('));  // "cudaIpcOpenMemHandle", not its arguments
  throw CudaFailure(name, static_cast<int>(err), cudaGetErrorName(err), cudaGetErrorString(err));
}

void check_driver(int result, const char* call) {
  if (result == CUDA_SUCCESS) return;
  using ErrorText = CUresult (*)(CUresult, const char**);
  const char* name = "CUDA_ERROR";
  const char* text = "driver API error";
  void* fn = nullptr;
  if (cudaGetDriverEntryPointByVersion("cuGetErrorName", &fn, 12000, cudaEnableDefault, nullptr) ==
          cudaSuccess &&
      fn != nullptr) {
    reinterpret_cast<ErrorText>(fn)(static_cast<CUresult>(result), &name);
  }
  if (cudaGetDriverEntryPointByVersion("cuGetErrorString", &fn, 12000, cudaEnableDefault,
                                       nullptr) == cudaSuccess &&
      fn != nullptr) {
    reinterpret_cast<ErrorText>(fn)(static_cast<CUresult>(result), &text);
  }
  throw CudaFailure(call, result, name ? name : "CUDA_ERROR", text ? text : "driver API error");
}

DeviceGuard::DeviceGuard(int device) {
  PDKV_CHECK(cudaGetDevice(&previous_));
  // Always set: on a thread that has made no CUDA runtime call yet, cudaGetDevice already says 0
  // but no context is current, and driver calls (cuMemGetAddressRange) then fail with
  // CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice binds the device's primary context to this thread.
  PDKV_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
}

namespace {
using MemGetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

MemGetAddressRange address_range_fn() {
  static std::once_flag once;
  static MemGetAddressRange fn = nullptr;
  static cudaError_t err = cudaSuccess;
  static cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSuccess;
  std::call_once(once, [] {
    void* p = nullptr;
    err = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                           &status);
    fn = reinterpret_cast<MemGetAddressRange>(p);
  });
  check(err, "cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)");
  if (status != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw CudaFailure("cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)", 34,
                      "cudaErrorSymbolNotFound", "the driver does not provide cuMemGetAddressRange");
  }
  return fn;
}
}  // namespace

void allocation_range(const void* ptr, uintptr_t* base, size_t* size) {
  CUdeviceptr b = 0;
  size_t s = 0;
  check_driver(address_range_fn()(&b, &s, reinterpret_cast<CUdeviceptr>(ptr)),
               "cuMemGetAddressRange");
  *base = static_cast<uintptr_t>(b);
  *size = s;
}

}  // namespace pdkv
