// The few DLPack (v0.8 ABI, "dltensor" capsule) structs torch.from_dlpack consumes, for the
// extension's capsules (ipc_mem.cpp, vmm.cpp).
#pragma once

#include <cstdint>

namespace pdkv {

struct DLDevice {
  int32_t device_type;  // kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLUInt = 1
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

}  // namespace pdkv
