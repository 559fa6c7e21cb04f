"""The CUDA runtime calls the host tier needs and PyTorch does not expose.

- `cudaMemcpyBatchAsync` (CUDA 12.8+): a batch's thousands of byte ranges in one call, taken
  straight from the planner's arrays, because one Python call a range holds the engine's one
  thread for milliseconds a step when many requests write through at once.
- `cudaMemcpyAsync`: the fallback, one call a range. PyTorch's `copy_` between a strided host
  view and a strided device view stages through unpinned temporaries and blocks the CPU, so it
  cannot overlap a restore with compute.
- `cudaHostRegister` / `cudaHostUnregister`: PyTorch's pinned allocator rounds every allocation
  up to a power of two, which would cost up to twice a chunk's size; registering ordinary memory
  pins exactly the bytes asked for.

The calls go through the libcudart that PyTorch itself loaded (found by its soname), so streams,
the current device and the primary context are PyTorch's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
_SRC_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources read in stream order
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # cudaMemLocationType
_PREFER_OVERLAP = 1  # cudaMemcpyFlagPreferOverlapWithCompute
_BATCH_SINCE = 12080  # cudaMemcpyBatchAsync's first runtime version
_BATCH_WITHOUT_FAIL_INDEX = 13000  # CUDA 13 dropped its failIdx argument


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location", _MemLocation),
        ("dst_location", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class CudaRuntime:
    """ctypes bindings over the process's libcudart."""

    def __init__(self) -> None:
        torch.cuda.init()
        major = str(torch.version.cuda).split(".")[0]
        self._lib = ctypes.CDLL(f"libcudart.so.{major}")
        lib = self._lib
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.cudaMemcpyAsync.argtypes += [ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        version = ctypes.c_int()
        self._check(lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = int(version.value)
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None)
        if self.version < _BATCH_SINCE:
            self._batch = None
        if self._batch is not None:
            self._batch.restype = ctypes.c_int

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            message = self._lib.cudaGetErrorString(err).decode()
            raise RuntimeError(f"{what} failed: CUDA error {err} ({message})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._lib.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream)
        self._check(err, "cudaMemcpyAsync")

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch_async(
        self,
        dsts: Sequence[int] | np.ndarray,
        srcs: Sequence[int] | np.ndarray,
        sizes: Sequence[int] | np.ndarray,
        to_host: bool,
        device: int,
        stream: int,
    ) -> None:
        """One call for many byte ranges between the device and pinned host memory, in stream
        order, in any order among themselves (they never overlap). The addresses and sizes are
        handed over as int64 arrays, the width of the call's pointer and size_t arrays."""
        if self._batch is None:
            raise RuntimeError(f"cudaMemcpyBatchAsync needs CUDA 12.8+, not {self.version}")
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (dsts, srcs, sizes)]
        count = len(arrays[2])
        if any(len(a) != count for a in arrays) or (count and arrays[2].min() <= 0):
            raise ValueError("a copy batch needs as many addresses as positive sizes")
        device_side = _MemLocation(_LOCATION_DEVICE, device)
        host_side = _MemLocation(_LOCATION_HOST, 0)
        src, dst = (device_side, host_side) if to_host else (host_side, device_side)
        attributes = _MemcpyAttributes(_SRC_ORDER_STREAM, src, dst, _PREFER_OVERLAP)
        first = (ctypes.c_size_t * 1)(0)
        args: list[object] = [
            *(a.ctypes.data_as(ctypes.c_void_p) for a in arrays),
            ctypes.c_size_t(count),
            ctypes.byref(attributes),
            first,
            ctypes.c_size_t(1),
        ]
        if self.version < _BATCH_WITHOUT_FAIL_INDEX:
            args.append(ctypes.byref(ctypes.c_size_t(0)))  # the failing copy's index
        args.append(ctypes.c_void_p(stream))
        err = self._batch(*args)
        self._check(err, f"cudaMemcpyBatchAsync of {count} ranges")

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._check(self._lib.cudaHostRegister(ptr, nbytes, 0), "cudaHostRegister")

    def host_unregister(self, ptr: int) -> None:
        self._check(self._lib.cudaHostUnregister(ptr), "cudaHostUnregister")
