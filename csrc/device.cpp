// Devices, interprocess events and the block copy entry of common._cuda.
//
// Events are created here rather than through torch.cuda.Event(interprocess=True): opening an
// event handle needs the importer's device current, and a torch event opened as device 0 and
// waited on by a device-1 stream crashes torch (FINDINGS.md); here the caller names the device.
#include "device.h"

#include <cstdio>
#include <cstring>

namespace pdkv {

int device_count() {
  int n = 0;
  PDKV_CHECK(cudaGetDeviceCount(&n));
  return n;
}

std::string device_uuid(int device) {
  cudaDeviceProp prop{};
  PDKV_CHECK(cudaGetDeviceProperties(&prop, device));
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char out[64];
  std::snprintf(out, sizeof(out),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return out;
}

std::pair<size_t, size_t> mem_get_info(int device) {
  DeviceGuard guard(device);
  size_t free_bytes = 0, total = 0;
  PDKV_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return {free_bytes, total};
}

bool can_access_peer(int device, int peer) {
  int ok = 0;
  PDKV_CHECK(cudaDeviceCanAccessPeer(&ok, device, peer));
  return ok != 0;
}

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  DeviceGuard guard(device);
  cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return;
  }
  PDKV_CHECK(err);
}

uintptr_t event_create(int device) {
  DeviceGuard guard(device);
  cudaEvent_t ev = nullptr;
  PDKV_CHECK(cudaEventCreateWithFlags(&ev, cudaEventInterprocess | cudaEventDisableTiming));
  return reinterpret_cast<uintptr_t>(ev);
}

py::bytes event_handle(uintptr_t event) {
  cudaIpcEventHandle_t handle;
  PDKV_CHECK(cudaIpcGetEventHandle(&handle, reinterpret_cast<cudaEvent_t>(event)));
  return py::bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

uintptr_t event_open(py::bytes handle_bytes, int device) {
  std::string raw = handle_bytes;
  if (raw.size() != sizeof(cudaIpcEventHandle_t)) {
    throw CudaFailure("event_open", 1, "cudaErrorInvalidValue",
                      "event handle has " + std::to_string(raw.size()) + " bytes, expected " +
                          std::to_string(sizeof(cudaIpcEventHandle_t)));
  }
  cudaIpcEventHandle_t handle;
  std::memcpy(&handle, raw.data(), sizeof(handle));
  DeviceGuard guard(device);
  cudaEvent_t ev = nullptr;
  PDKV_CHECK(cudaIpcOpenEventHandle(&ev, handle));
  return reinterpret_cast<uintptr_t>(ev);
}

void event_record(uintptr_t event, uintptr_t stream) {
  PDKV_CHECK(
      cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), reinterpret_cast<cudaStream_t>(stream)));
}

void stream_wait_event(uintptr_t stream, uintptr_t event) {
  PDKV_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                 reinterpret_cast<cudaEvent_t>(event), 0));
}

bool event_query(uintptr_t event) {
  cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  PDKV_CHECK(err);
  return true;
}

void event_synchronize(uintptr_t event) {
  py::gil_scoped_release nogil;
  PDKV_CHECK(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)));
}

void event_destroy(uintptr_t event) {
  PDKV_CHECK(cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)));
}

void copy_blocks(uintptr_t dst, uintptr_t src, IdArray src_ids, IdArray dst_ids,
                 int64_t block_nbytes, uintptr_t stream, int device) {
  const int64_t n = src_ids.size();
  if (dst_ids.size() != n || block_nbytes <= 0 || src_ids.ndim() != 1 || dst_ids.ndim() != 1) {
    throw CudaFailure("copy_blocks", 1, "cudaErrorInvalidValue",
                      "ids must be two 1-D arrays of one length (" + std::to_string(n) + ", " +
                          std::to_string(dst_ids.size()) +
                          "), block_nbytes > 0 (" + std::to_string(block_nbytes) + ")");
  }
  if (n == 0) return;
  const int64_t* s = src_ids.data();
  const int64_t* d = dst_ids.data();
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] < 0 || d[i] < 0 || s[i] > INT32_MAX || d[i] > INT32_MAX) {
      throw CudaFailure("copy_blocks", 1, "cudaErrorInvalidValue",
                        "block id out of [0, 2^31) at position " + std::to_string(i));
    }
  }
  DeviceGuard guard(device);
  launch_copy_blocks(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), s, d, n,
                     block_nbytes, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace pdkv
