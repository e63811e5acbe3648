// Devices, interprocess events and block copy of common._cuda (see device.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>

#include "pdkv_cuda.h"

namespace py = pybind11;

namespace pdkv {

int device_count();
std::string device_uuid(int device);  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi
std::pair<size_t, size_t> mem_get_info(int device);  // (free, total) bytes
bool can_access_peer(int device, int peer);
void enable_peer_access(int device, int peer);  // idempotent

uintptr_t event_create(int device);  // interprocess, timing disabled
py::bytes event_handle(uintptr_t event);
uintptr_t event_open(py::bytes handle, int device);  // opened with `device` current
void event_record(uintptr_t event, uintptr_t stream);
void stream_wait_event(uintptr_t stream, uintptr_t event);
bool event_query(uintptr_t event);
void event_synchronize(uintptr_t event);
void event_destroy(uintptr_t event);

// Block ids from Python: int64, C-contiguous (a list or another dtype is converted).
using IdArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Enqueue the copy of blocks src_ids[i] of `src` to dst_ids[i] of `dst` on `stream` (see
// launch_copy_blocks); the ids are host arrays, consumed before this returns.
void copy_blocks(uintptr_t dst, uintptr_t src, IdArray src_ids, IdArray dst_ids,
                 int64_t block_nbytes, uintptr_t stream, int device);

}  // namespace pdkv
