"""CUDA availability, device UUID <-> local ordinal, and CUDA errors that tell the fix.

The extension `common._cuda` is imported lazily (the CPU path never needs it); every call into it
goes through `cuda_errors()`, which turns its `Error(code, name, message)` into
`common.errors.CudaError` with a hint chosen by the CUDA error code.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from common.errors import CudaError

# cudaError_t code -> what to change. Codes from driver_types.h.
HINTS: dict[int, str] = {
    1: "invalid value; for IPC export, memory from expandable segments or cudaMallocAsync pools "
    "cannot be shared: unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments or use the cuda-torch backend",
    2: "GPU out of memory; lower --num-blocks or free the GPU",
    3: "CUDA failed to initialize; check the driver with nvidia-smi",
    35: "no NVIDIA driver (or one older than this build's CUDA); use --device cpu",
    46: "the GPU is in exclusive-process mode or busy; free it or use another GPU",
    100: "no CUDA device is visible; check CUDA_VISIBLE_DEVICES or use --device cpu",
    101: "invalid device ordinal; check CUDA_VISIBLE_DEVICES and --device",
    201: "invalid context; cudaIpcOpenMemHandle cannot open memory exported by the same process",
    209: "no kernel image for this GPU; rebuild the extension with CMAKE_CUDA_ARCHITECTURES for it",
    217: "these GPUs cannot access each other's memory; run both daemons on one GPU or on "
    "peer-capable GPUs",
    400: "invalid resource handle; the stream or event belongs to another device or was destroyed",
    999: "unknown CUDA error; the GPU may be in a bad state, check nvidia-smi and dmesg",
}
NOT_BUILT_HINT = (
    "the CUDA extension common._cuda is not built; reinstall pdkv with nvcc on PATH "
    "(pip install -e .) or use --device cpu / --ipc-backend cuda-torch"
)


@functools.cache
def _load() -> ModuleType | None:
    try:
        import common._cuda as ext
    except ImportError:
        return None
    return ext


def has_extension() -> bool:
    """True when common._cuda was built and imports (says nothing about a driver or a GPU)."""
    return _load() is not None


def ext() -> ModuleType:
    """The extension module; CudaError with the rebuild hint when it was not built."""
    mod = _load()
    if mod is None:
        raise CudaError(NOT_BUILT_HINT)
    return mod


def to_cuda_error(exc: BaseException) -> CudaError:
    """CudaError for an extension Error(code, name, message), with the hint for its code."""
    code, _name, message = exc.args if len(exc.args) == 3 else (-1, "", str(exc))
    hint = HINTS.get(int(code))
    return CudaError(f"{message}; hint: {hint}" if hint else str(message))


@contextmanager
def cuda_errors() -> Iterator[None]:
    """Run extension calls inside this: their Error becomes common.errors.CudaError."""
    mod = ext()
    try:
        yield
    except mod.Error as exc:
        raise to_cuda_error(exc) from None


@functools.cache
def cuda_available() -> bool:
    """True when a CUDA device can be used: through the extension when it is built, else torch.

    Never raises; False on a machine without a driver or a GPU.
    """
    mod = _load()
    if mod is None:
        return torch.cuda.is_available()
    try:
        return mod.device_count() > 0
    except mod.Error:
        return False


def device_count() -> int:
    """Number of visible CUDA devices; CudaError (with hint) when CUDA cannot start."""
    with cuda_errors():
        return ext().device_count()


def device_uuid(device: int) -> str:
    """The UUID of local ordinal `device`, as nvidia-smi prints it ("GPU-…")."""
    if not has_extension():
        return f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    with cuda_errors():
        return ext().device_uuid(device)


def ordinal_for_uuid(uuid: str) -> int:
    """The local ordinal of the GPU with `uuid` in this process (ordinals differ between
    processes with different CUDA_VISIBLE_DEVICES); CudaError naming the visible ones otherwise."""
    count = device_count() if has_extension() else torch.cuda.device_count()
    visible = [device_uuid(i) for i in range(count)]
    if uuid in visible:
        return visible.index(uuid)
    raise CudaError(
        f"GPU {uuid} is not visible in this process (visible: {visible}); hint: give both "
        "daemons a CUDA_VISIBLE_DEVICES that includes the exporter's GPU"
    )


def mem_get_info(device: int) -> tuple[int, int]:
    """(free, total) bytes of `device` as cudaMemGetInfo reports them."""
    with cuda_errors():
        free, total = ext().mem_get_info(device)
    return int(free), int(total)


def stream_ptr(stream: torch.cuda.Stream | int | None, device: int) -> int:
    """The cudaStream_t of `stream` as an int; None means the current stream of `device`."""
    if stream is None:
        return int(torch.cuda.current_stream(device).cuda_stream)
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)


def device_index(device: torch.device | int | str) -> int:
    """Local ordinal of a CUDA device given as torch.device, "cuda:N" or N."""
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise CudaError(f"expected a CUDA device, got {dev}; hint: use the CPU path for {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()
