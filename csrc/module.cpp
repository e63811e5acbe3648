// pybind11 module common._cuda: CUDA IPC of memory and events, devices, block copy.
// Private: Python code reaches it through common/cuda.py, which maps Error to
// common.errors.CudaError with a hint. No torch C++ here: tensors cross as DLPack capsules.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "device.h"
#include "ipc_mem.h"
#include "vmm.h"

namespace py = pybind11;

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "pdkv CUDA extension (private; use common.cuda and common.ipc)";
  static py::exception<pdkv::CudaFailure> error(m, "Error");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pdkv::CudaFailure& e) {
      // args = (code, name, message): common/cuda.py reads the code to choose a hint.
      py::tuple args = py::make_tuple(e.code, e.name, e.what());
      PyErr_SetObject(error.ptr(), args.ptr());
    }
  });

  m.def("device_count", &pdkv::device_count);
  m.def("device_uuid", &pdkv::device_uuid, py::arg("device"));
  m.def("mem_get_info", &pdkv::mem_get_info, py::arg("device"));
  m.def("can_access_peer", &pdkv::can_access_peer, py::arg("device"), py::arg("peer"));
  m.def("enable_peer_access", &pdkv::enable_peer_access, py::arg("device"), py::arg("peer"));

  m.def("export_mem", &pdkv::export_mem, py::arg("ptr"));
  m.def("import_mem", &pdkv::import_mem, py::arg("handle"), py::arg("offset"), py::arg("nbytes"),
        py::arg("device"));
  m.def("open_count", &pdkv::open_count, py::arg("handle"));
  m.def("open_allocations", &pdkv::open_allocations);
  m.def("take_close_errors", &pdkv::take_close_errors);

  m.def("vmm_granularity", &pdkv::vmm_granularity, py::arg("device"));
  m.def("vmm_create", &pdkv::vmm_create, py::arg("nbytes"), py::arg("device"));
  m.def("vmm_import", &pdkv::vmm_import, py::arg("fd"), py::arg("size"), py::arg("nbytes"),
        py::arg("device"), py::arg("read_only"));

  m.def("event_create", &pdkv::event_create, py::arg("device"));
  m.def("event_handle", &pdkv::event_handle, py::arg("event"));
  m.def("event_open", &pdkv::event_open, py::arg("handle"), py::arg("device"));
  m.def("event_record", &pdkv::event_record, py::arg("event"), py::arg("stream"));
  m.def("stream_wait_event", &pdkv::stream_wait_event, py::arg("stream"), py::arg("event"));
  m.def("event_query", &pdkv::event_query, py::arg("event"));
  m.def("event_synchronize", &pdkv::event_synchronize, py::arg("event"));
  m.def("event_destroy", &pdkv::event_destroy, py::arg("event"));

  m.def("copy_blocks", &pdkv::copy_blocks, py::arg("dst"), py::arg("src"), py::arg("src_ids"),
        py::arg("dst_ids"), py::arg("block_nbytes"), py::arg("stream"),
        py::arg("device"));
}
