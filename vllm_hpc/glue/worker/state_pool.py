"""The device pool of Gated DeltaNet states: active slots and snapshot slots, per worker.

vLLM keeps a hybrid model's recurrent states in its unified KV block pool, one page per state,
which forces the attention block up to the size of a state page (hundreds of tokens). The
hybrid prefix cache keeps them here instead, in tensors of their own, so attention KV can stay
in 64-token pages. Every GDN layer binds its `(conv, ssm)` views to this pool; a slot index is
the same in every layer and on every tensor-parallel rank.

Slots: 0 is scratch (vLLM pads unused block-table rows with block id 0), 1..C are the running
requests' active states, C+1..C+D hold snapshot images.

The pool is allocated when the model is built, before vLLM measures its memory, so vLLM counts
it as model memory and sizes the KV cache from what is left: KV pages and state slots share
one budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from vllm_hpc.faults import InjectedFault, armed
from vllm_hpc.glue.worker.in_pass import StepCaptures
from vllm_hpc.runtime.plan import StateCopy


class LayerRestore(Protocol):
    def wait_layer(self, name: str) -> None: ...


class StatePool:
    """Per-layer `(conv, ssm)` tensors of 1 + C + D rows each."""

    def __init__(self, active_slots: int, snapshot_slots: int, device: torch.device) -> None:
        self.active_slots = active_slots
        self.snapshot_slots = snapshot_slots
        self.num_slots = 1 + active_slots + snapshot_slots
        self.device = device
        self._layers: dict[str, tuple[torch.Tensor, ...]] = {}
        self.restores: Sequence[LayerRestore] = ()
        """This step's host restores (set by the connector): a layer waits for its part."""
        self.in_pass_taps = False
        """The GDN layers can save states inside a prefill pass (set when the model is built)."""
        self.in_pass: StepCaptures | None = None
        """This step's in-pass captures (set by the connector), or None."""

    def wait_restored(self, name: str) -> None:
        """Layer ``name`` is about to read its states: wait for this step's restores of them."""
        for restore in self.restores:
            restore.wait_layer(name)

    def add_layer(
        self, name: str, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]
    ) -> None:
        """Allocate (zeroed) one layer's state tensors."""
        if name in self._layers:
            raise ValueError(f"state pool already has layer {name}")
        self._layers[name] = tuple(
            torch.zeros((self.num_slots, *shape), dtype=dtype, device=self.device)
            for shape, dtype in zip(shapes, dtypes, strict=True)
        )

    def layer(self, name: str) -> tuple[torch.Tensor, ...]:
        return self._layers[name]

    @property
    def layer_names(self) -> list[str]:
        return list(self._layers)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot over all layers: the size of one snapshot image."""
        return sum(t[0].numel() * t.element_size() for ts in self._layers.values() for t in ts)

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def copy(self, copies: Iterable[StateCopy]) -> None:
        """Apply slot-to-slot copies one after the other, in order (a later copy sees the
        result of an earlier one), each over every layer."""
        if armed("state_copy"):
            raise InjectedFault("injected state copy failure")
        corrupt = armed("snapshot_corrupt")
        for copy in copies:
            for tensors in self._layers.values():
                for tensor in tensors:
                    if corrupt and copy.dst > self.active_slots:  # a snapshot slot
                        tensor[copy.dst].fill_(1.0)
                    else:
                        tensor[copy.dst].copy_(tensor[copy.src])
