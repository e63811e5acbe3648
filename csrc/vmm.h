// Device memory shareable as a POSIX fd, outliving its exporter (see vmm.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include "pdkv_cuda.h"

namespace py = pybind11;

namespace pdkv {

// The allocation granularity (bytes) of a VMM allocation on `device`.
uint64_t vmm_granularity(int device);

// A new, uninitialized VMM allocation of at least `nbytes` on `device`, mapped
// read-write here: (capsule of nbytes uint8, fd of its shareable handle (the caller's to
// close), allocation size).
py::tuple vmm_create(uint64_t nbytes, int device);

// Map the allocation whose handle is `fd` (`size` bytes, as vmm_create said; the fd stays the
// caller's) on `device`, read-only if asked: a capsule of its first nbytes.
py::object vmm_import(int fd, uint64_t size, uint64_t nbytes, int device, bool read_only);

}  // namespace pdkv
