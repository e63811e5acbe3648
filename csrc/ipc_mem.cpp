// Device memory IPC: export a pointer as (handle of its allocation, offset, size, device) and
// import it through a process-wide registry that opens each allocation once and hands mappings
// to Python as DLPack capsules whose deleters drop the registry's reference count.
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "dlpack.h"
#include "ipc_mem.h"

namespace pdkv {
namespace {

struct Mapping {
  void* base = nullptr;
  size_t size = 0;
  int device = -1;
  int64_t refs = 0;
};

// One per capsule: owns the shape/stride storage and names its registry entry.
struct Context {
  std::string key;
  int64_t shape[1];
  int64_t strides[1];
};

// Leaked on purpose: deleters may run during interpreter shutdown, after static destructors.
std::mutex& registry_mutex() {
  static auto* m = new std::mutex();
  return *m;
}
std::unordered_map<std::string, Mapping>& registry() {
  static auto* r = new std::unordered_map<std::string, Mapping>();
  return *r;
}
std::vector<std::string>& close_errors() {
  static auto* e = new std::vector<std::string>();
  return *e;
}

// Drops one reference; closes the mapping on the last. Never throws: failures are kept for
// take_close_errors().
void release(const std::string& key) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(key);
  if (it == registry().end()) return;
  if (--it->second.refs > 0) return;
  Mapping m = it->second;
  registry().erase(it);
  int previous = -1;
  cudaGetDevice(&previous);
  cudaError_t err = cudaSetDevice(m.device);
  if (err == cudaSuccess) err = cudaIpcCloseMemHandle(m.base);
  if (previous >= 0) cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();
    close_errors().push_back(std::string("cudaIpcCloseMemHandle failed: ") +
                             cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
}

void dl_deleter(DLManagedTensor* self) {
  auto* ctx = static_cast<Context*>(self->manager_ctx);
  release(ctx->key);
  delete ctx;
  delete self;
}

void capsule_destructor(PyObject* capsule) {
  // Still named "dltensor": nobody consumed it, so its deleter is ours to call.
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

}  // namespace

py::tuple export_mem(uintptr_t ptr) {
  cudaPointerAttributes attr{};
  PDKV_CHECK(cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(ptr)));
  if (attr.type != cudaMemoryTypeDevice) {
    throw CudaFailure("export_mem", 1, "cudaErrorInvalidValue",
                      "pointer is not device memory from cudaMalloc");
  }
  DeviceGuard guard(attr.device);
  uintptr_t base = 0;
  size_t size = 0;
  allocation_range(reinterpret_cast<void*>(ptr), &base, &size);
  cudaIpcMemHandle_t handle;
  PDKV_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)));
  return py::make_tuple(py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle)),
                        static_cast<uint64_t>(ptr - base), static_cast<uint64_t>(size),
                        attr.device);
}

py::object import_mem(py::bytes handle_bytes, uint64_t offset, uint64_t nbytes, int device) {
  std::string key = handle_bytes;
  if (key.size() != sizeof(cudaIpcMemHandle_t)) {
    throw CudaFailure("import_mem", 1, "cudaErrorInvalidValue",
                      "handle has " + std::to_string(key.size()) + " bytes, expected " +
                          std::to_string(sizeof(cudaIpcMemHandle_t)));
  }
  void* base = nullptr;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(key);
    if (it == registry().end()) {
      DeviceGuard guard(device);
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, key.data(), sizeof(handle));
      Mapping m;
      m.device = device;
      PDKV_CHECK(cudaIpcOpenMemHandle(&m.base, handle, cudaIpcMemLazyEnablePeerAccess));
      uintptr_t b = 0;
      try {
        allocation_range(m.base, &b, &m.size);
      } catch (...) {
        cudaIpcCloseMemHandle(m.base);
        throw;
      }
      it = registry().emplace(key, m).first;
    }
    Mapping& m = it->second;
    if (m.device != device) {
      throw CudaFailure("import_mem", 101, "cudaErrorInvalidDevice",
                        "allocation already opened on device " + std::to_string(m.device) +
                            ", asked for device " + std::to_string(device));
    }
    if (offset + nbytes > m.size) {
      throw CudaFailure("import_mem", 1, "cudaErrorInvalidValue",
                        "offset " + std::to_string(offset) + " + nbytes " +
                            std::to_string(nbytes) + " exceeds the allocation of " +
                            std::to_string(m.size) + " bytes");
    }
    m.refs += 1;
    base = m.base;
  }
  auto* ctx = new Context{key, {static_cast<int64_t>(nbytes)}, {1}};
  auto* managed = new DLManagedTensor{};
  managed->dl_tensor.data = static_cast<char*>(base) + offset;
  managed->dl_tensor.device = DLDevice{2, device};
  managed->dl_tensor.ndim = 1;
  managed->dl_tensor.dtype = DLDataType{1, 8, 1};
  managed->dl_tensor.shape = ctx->shape;
  managed->dl_tensor.strides = ctx->strides;
  managed->dl_tensor.byte_offset = 0;
  managed->manager_ctx = ctx;
  managed->deleter = dl_deleter;
  PyObject* capsule = PyCapsule_New(managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    dl_deleter(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

int64_t open_count(py::bytes handle_bytes) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(std::string(handle_bytes));
  return it == registry().end() ? 0 : it->second.refs;
}

size_t open_allocations() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return registry().size();
}

std::vector<std::string> take_close_errors() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> out;
  out.swap(close_errors());
  return out;
}

}  // namespace pdkv
