// Device memory that outlives its exporter: a VMM allocation (cuMemCreate) shareable as a POSIX
// file descriptor. The physical memory lives while any process holds a handle or a mapping of it,
// so an importer keeps reading it after the exporter exits, and the fd, like a memfd, may be
// passed on by whoever holds it. Used for the weights arena (common/ipc/vmm.py); the driver API
// is reached through cudaGetDriverEntryPointByVersion, as in errors.cpp.
#include <cuda.h>
#include <unistd.h>

#include <mutex>
#include <string>

#include "dlpack.h"
#include "vmm.h"

namespace pdkv {
namespace {

struct Driver {
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                      unsigned long long);
  CUresult (*mem_unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long);
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
};

template <typename F>
void load(F* out, const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSuccess;
  check(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status), name);
  if (status != cudaDriverEntryPointSuccess || p == nullptr) {
    throw CudaFailure(name, 34, "cudaErrorSymbolNotFound",
                      std::string("the driver does not provide ") + name);
  }
  *out = reinterpret_cast<F>(p);
}

const Driver& driver() {
  static std::once_flag once;
  static Driver d{};
  std::call_once(once, [] {
    load(&d.mem_create, "cuMemCreate");
    load(&d.mem_release, "cuMemRelease");
    load(&d.address_reserve, "cuMemAddressReserve");
    load(&d.address_free, "cuMemAddressFree");
    load(&d.mem_map, "cuMemMap");
    load(&d.mem_unmap, "cuMemUnmap");
    load(&d.set_access, "cuMemSetAccess");
    load(&d.export_handle, "cuMemExportToShareableHandle");
    load(&d.import_handle, "cuMemImportFromShareableHandle");
    load(&d.granularity, "cuMemGetAllocationGranularity");
  });
  return d;
}

CUmemAllocationProp props(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// One mapping handed to torch: unmapped, its address range freed and its handle released by the
// capsule's deleter (errors go nowhere: a deleter cannot raise, and the process is the owner).
struct Context {
  CUdeviceptr ptr = 0;
  size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  int64_t shape[1];
  int64_t strides[1];
};

void unmap(Context* ctx) {
  const Driver& d = driver();
  if (ctx->ptr) {
    d.mem_unmap(ctx->ptr, ctx->size);
    d.address_free(ctx->ptr, ctx->size);
  }
  if (ctx->handle) d.mem_release(ctx->handle);
}

void dl_deleter(DLManagedTensor* self) {
  auto* ctx = static_cast<Context*>(self->manager_ctx);
  unmap(ctx);
  delete ctx;
  delete self;
}

void capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
}

// Reserve, map and open `ctx->handle` (ctx->size bytes) for `device`; read-only when asked.
void map(Context* ctx, int device, bool read_only) {
  const Driver& d = driver();
  check_driver(d.address_reserve(&ctx->ptr, ctx->size, 0, 0, 0), "cuMemAddressReserve");
  CUresult r = d.mem_map(ctx->ptr, ctx->size, 0, ctx->handle, 0);
  if (r != CUDA_SUCCESS) {
    d.address_free(ctx->ptr, ctx->size);
    ctx->ptr = 0;
    check_driver(r, "cuMemMap");
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check_driver(d.set_access(ctx->ptr, ctx->size, &access, 1), "cuMemSetAccess");
}

py::object capsule(Context* ctx, uint64_t nbytes, int device) {
  ctx->shape[0] = static_cast<int64_t>(nbytes);
  ctx->strides[0] = 1;
  auto* managed = new DLManagedTensor{};
  managed->dl_tensor.data = reinterpret_cast<void*>(ctx->ptr);
  managed->dl_tensor.device = DLDevice{2, device};
  managed->dl_tensor.ndim = 1;
  managed->dl_tensor.dtype = DLDataType{1, 8, 1};
  managed->dl_tensor.shape = ctx->shape;
  managed->dl_tensor.strides = ctx->strides;
  managed->dl_tensor.byte_offset = 0;
  managed->manager_ctx = ctx;
  managed->deleter = dl_deleter;
  PyObject* cap = PyCapsule_New(managed, "dltensor", capsule_destructor);
  if (cap == nullptr) {
    dl_deleter(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

}  // namespace

uint64_t vmm_granularity(int device) {
  DeviceGuard guard(device);
  CUmemAllocationProp prop = props(device);
  size_t g = 0;
  check_driver(driver().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity");
  return g;
}

py::tuple vmm_create(uint64_t nbytes, int device) {
  DeviceGuard guard(device);
  const Driver& d = driver();
  uint64_t g = vmm_granularity(device);
  auto* ctx = new Context{};
  ctx->size = (nbytes + g - 1) / g * g;
  int fd = -1;
  try {
    CUmemAllocationProp prop = props(device);
    check_driver(d.mem_create(&ctx->handle, ctx->size, &prop, 0), "cuMemCreate");
    map(ctx, device, false);
    check_driver(d.export_handle(&fd, ctx->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                 "cuMemExportToShareableHandle");
  } catch (...) {
    if (fd >= 0) close(fd);
    unmap(ctx);
    delete ctx;
    throw;
  }
  uint64_t size = ctx->size;
  py::object cap = capsule(ctx, nbytes, device);
  return py::make_tuple(cap, fd, size);
}

py::object vmm_import(int fd, uint64_t size, uint64_t nbytes, int device, bool read_only) {
  if (nbytes > size) {
    throw CudaFailure("vmm_import", 1, "cudaErrorInvalidValue",
                      "nbytes " + std::to_string(nbytes) + " exceeds the allocation of " +
                          std::to_string(size) + " bytes");
  }
  DeviceGuard guard(device);
  const Driver& d = driver();
  auto* ctx = new Context{};
  ctx->size = size;
  try {
    check_driver(d.import_handle(&ctx->handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                 "cuMemImportFromShareableHandle");
    map(ctx, device, read_only);
  } catch (...) {
    unmap(ctx);
    delete ctx;
    throw;
  }
  return capsule(ctx, nbytes, device);
}

}  // namespace pdkv
