"""Where a host record's bytes live on the device: the planes of a KV page and of a state row.

A block record is one 64-token page over every attention layer; a snapshot image is one state
row over every GDN layer. Both are packed layer-major in the model's forward order, so a restore
can land layer by layer and the first prefill pass computes early layers while later ones still
arrive (§6.5).

vLLM 0.32 hands each attention layer a 4-D view ``[B, H, N, C]`` over one shared int8 buffer
(`vllm.v1.kv_cache_interface.create_kv_cache_views`), with K and V side by side in C and the
physical order set by the resolved `KVCacheLayout` (the CPU backend: LBHNC; FlashAttention and
FlashInfer: any, LBHNC/BLHNC on Blackwell). A page is one contiguous byte range in every layout
that keeps ``[H, N, C]`` together, and H ranges in the head-outer ones (LHBNC, BHLNC); consecutive
pages of a layer sit one block stride apart. The binding reads all of this from the tensors'
strides rather than from the layout's name, and copies bytes, so any KV dtype (bf16, fp8, ...)
round-trips bit-exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vllm_hpc.glue.worker.kv_views import as_units, forward_position
from vllm_hpc.glue.worker.state_pool import StatePool
from vllm_hpc.index import HostGeometry


@dataclass(frozen=True, slots=True)
class Plane:
    """One contiguous byte range of every page (or row) of a device tensor, ``pitch`` apart."""

    storage: torch.Tensor
    """uint8 over the tensor's whole storage."""
    offset: int
    """Byte offset in ``storage`` of page (row) 0's range."""
    pitch: int
    nbytes: int
    record_offset: int
    """Where the range sits inside its host record (block record or image)."""


@dataclass(frozen=True, slots=True)
class LayerPlanes:
    name: str
    planes: tuple[Plane, ...]
    is_state: bool
    """A GDN layer (planes of a state row) rather than an attention layer (planes of a page)."""


@dataclass(frozen=True)
class DeviceLayout:
    """Every layer's planes, in forward order, and the record sizes they add up to."""

    layers: tuple[LayerPlanes, ...]
    device: torch.device
    num_pages: int
    num_rows: int

    @property
    def block_bytes(self) -> int:
        return sum(p.nbytes for layer in self.layers if not layer.is_state for p in layer.planes)

    @property
    def image_bytes(self) -> int:
        return sum(p.nbytes for layer in self.layers if layer.is_state for p in layer.planes)

    @property
    def geometry(self) -> HostGeometry:
        return HostGeometry(self.block_bytes, self.image_bytes)

    @classmethod
    def bind(
        cls, kv_caches: Mapping[str, torch.Tensor], num_pages: int, state_pool: StatePool
    ) -> DeviceLayout:
        """Lay out the attention layers' KV caches (as `register_kv_caches` receives them) and
        the state pool. Entries of ``kv_caches`` that name a GDN layer are vLLM's one-byte proxy
        views of the state pool and are skipped; the pool holds their states."""
        states = set(state_pool.layer_names)
        tensors: dict[str, tuple[tuple[torch.Tensor, int], ...]] = {
            name: ((cache, num_pages),) for name, cache in kv_caches.items() if name not in states
        }
        tensors |= {
            name: tuple((t, state_pool.num_rows) for t in state_pool.layer(name))
            for name in state_pool.layer_names
        }
        if len(tensors) == len(states):
            raise ValueError("no attention layer among the KV caches to lay out")
        offsets = {False: 0, True: 0}
        layers = []
        for name in sorted(tensors, key=forward_position):
            is_state = name in states
            planes = []
            for tensor, units in tensors[name]:
                for plane in _planes(tensor, units, offsets[is_state]):
                    planes.append(plane)
                    offsets[is_state] += plane.nbytes
            layers.append(LayerPlanes(name, tuple(planes), is_state))
        devices = {p.storage.device for layer in layers for p in layer.planes}
        if len(devices) != 1:
            raise ValueError(f"KV caches and state pool are on several devices: {devices}")
        return cls(tuple(layers), devices.pop(), num_pages, state_pool.num_rows)


def _planes(tensor: torch.Tensor, units: int, record_offset: int) -> list[Plane]:
    """Split one unit (``tensor[i]``, a page or a state row) into its contiguous byte ranges.

    A view whose first dimension counts kernel blocks (vLLM splits a page into equal kernel
    blocks when the backend asks for smaller ones) is regrouped into ``units`` pages first."""
    tensor = as_units(tensor, units)
    item = tensor.element_size()
    dims = sorted(
        ((tensor.stride(d) * item, tensor.shape[d]) for d in range(1, tensor.dim())),
        reverse=True,
    )
    dims = [(stride, size) for stride, size in dims if size > 1]
    run = item
    while dims and dims[-1][0] == run:
        run *= dims.pop()[1]
    starts = [0]
    for stride, size in dims:
        starts = [s + i * stride for s in starts for i in range(size)]
    storage = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    storage.set_(tensor.untyped_storage())
    base = tensor.storage_offset() * item
    pitch = tensor.stride(0) * item
    return [
        Plane(storage, base + start, pitch, run, record_offset + i * run)
        for i, start in enumerate(starts)
    ]
