// Device memory IPC of common._cuda (see ipc_mem.cpp).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "pdkv_cuda.h"

namespace py = pybind11;

namespace pdkv {

// (handle bytes of the allocation holding ptr, byte offset of ptr from its base, allocation
// size, device ordinal).
py::tuple export_mem(uintptr_t ptr);

// A "dltensor" capsule: uint8, 1-D, nbytes long, starting offset bytes into the allocation the
// handle names, opened once per process on `device` and closed when the last capsule's deleter runs.
py::object import_mem(py::bytes handle, uint64_t offset, uint64_t nbytes, int device);

// Live capsules/tensors over the allocation `handle` names (0 when it is not open).
int64_t open_count(py::bytes handle);

// Number of allocations this process has open through the registry.
size_t open_allocations();

// Close failures seen by deleters since the last call (deleters cannot raise).
std::vector<std::string> take_close_errors();

}  // namespace pdkv
