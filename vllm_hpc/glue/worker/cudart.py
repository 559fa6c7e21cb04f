"""The CUDA runtime calls the host tier needs and PyTorch does not expose.

- `cudaMemcpy2DAsync` (`cudaMemcpyAsync` for one range): a run of consecutive pages moves as
  one strided copy per plane. PyTorch's `copy_` between a strided host view and a strided
  device view stages through unpinned temporaries and blocks the CPU, so it cannot overlap a
  restore with compute.
- `cudaHostRegister` / `cudaHostUnregister`: PyTorch's pinned allocator rounds every allocation
  up to a power of two, which would cost up to twice a chunk's size; registering ordinary memory
  pins exactly the bytes asked for.

The calls go through the libcudart that PyTorch itself loaded (found by its soname), so streams,
the current device and the primary context are PyTorch's.
"""

from __future__ import annotations

import ctypes

import torch

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the (unified) addresses
_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch


class CudaRuntime:
    """ctypes bindings over the process's libcudart."""

    def __init__(self) -> None:
        torch.cuda.init()
        major = str(torch.version.cuda).split(".")[0]
        self._lib = ctypes.CDLL(f"libcudart.so.{major}")
        lib = self._lib
        lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.cudaMemcpy2DAsync.argtypes += [ctypes.c_size_t] * 3 + [ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpy2DAsync.restype = ctypes.c_int
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.cudaMemcpyAsync.argtypes += [ctypes.c_int, ctypes.c_void_p]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaDeviceGetAttribute.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.cudaDeviceGetAttribute.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            message = self._lib.cudaGetErrorString(err).decode()
            raise RuntimeError(f"{what} failed: CUDA error {err} ({message})")

    def memcpy_2d_async(
        self,
        dst: int,
        dst_pitch: int,
        src: int,
        src_pitch: int,
        width: int,
        height: int,
        stream: int,
    ) -> None:
        err = self._lib.cudaMemcpy2DAsync(
            dst, dst_pitch, src, src_pitch, width, height, _MEMCPY_DEFAULT, stream
        )
        self._check(err, "cudaMemcpy2DAsync")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._lib.cudaMemcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream)
        self._check(err, "cudaMemcpyAsync")

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._check(self._lib.cudaHostRegister(ptr, nbytes, 0), "cudaHostRegister")

    def host_unregister(self, ptr: int) -> None:
        self._check(self._lib.cudaHostUnregister(ptr), "cudaHostUnregister")

    def max_pitch(self, device: torch.device) -> int:
        """The largest pitch a 2D copy accepts on this device."""
        value = ctypes.c_int()
        index = device.index if device.index is not None else torch.cuda.current_device()
        err = self._lib.cudaDeviceGetAttribute(ctypes.byref(value), _ATTR_MAX_PITCH, index)
        self._check(err, "cudaDeviceGetAttribute(cudaDevAttrMaxPitch)")
        return int(value.value)
