"""The Gated DeltaNet states of one worker: views into vLLM's KV cache buffer (§5.4).

vLLM keeps a hybrid model's recurrent states in its unified KV block pool, one page per state,
which forces the attention block up to the size of a state page (hundreds of tokens). The
hybrid prefix cache keeps attention KV in 64-token pages and puts each state in a *row* of
consecutive pages of the same buffer (`vllm_hpc.glue.row_layout`): the scheduler's index decides
at run time which rows hold states (running requests', snapshots') and which hold KV pages.

Every GDN layer reads its `(conv, ssm)` tensors here: strided views, one element per row, with
the row index the "block id" vLLM's GDN metadata hands the layer. Row 0 is scratch (vLLM pads
unused block-table rows with block id 0). The views exist once vLLM has allocated the KV cache
(`bind`, from the connector's `register_kv_caches`), before any pass that reads a state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import torch

from vllm_hpc.faults import InjectedFault, armed
from vllm_hpc.glue.row_layout import RowLayout, aligned_state_bytes, plan_rows, spans_of
from vllm_hpc.glue.worker.in_pass import StepCaptures, device_index
from vllm_hpc.glue.worker.kv_views import as_units, forward_position
from vllm_hpc.runtime.plan import StateCopy


class LayerRestore(Protocol):
    def wait_layer(self, name: str) -> None: ...


class StatePool:
    """Per-layer `(conv, ssm)` views over the state rows of vLLM's KV cache buffer."""

    def __init__(self, device: torch.device, conv_dim_first: bool = True) -> None:
        self.device = device
        self.conv_dim_first = conv_dim_first
        """vLLM's conv state layout: (channels, columns) in a row, else (columns, channels)."""
        self._specs: dict[str, tuple[tuple[tuple[int, ...], torch.dtype], ...]] = {}
        self._layers: dict[str, tuple[torch.Tensor, ...]] = {}
        self._unbound: dict[str, tuple[torch.Tensor, ...]] = {}
        """Stand-in scratch rows until `bind` (see `layer`)."""
        self.layout: RowLayout | None = None
        self._rows: tuple[torch.Tensor, ...] = ()
        """The state rows as whole byte ranges (`row_views`): what a copy or a zero moves."""
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
        """Register one GDN layer's state tensors (their memory comes with `bind`)."""
        if name in self._specs:
            raise ValueError(f"state pool already has layer {name}")
        self._specs[name] = tuple(zip((tuple(s) for s in shapes), dtypes, strict=True))

    @property
    def layer_names(self) -> list[str]:
        return list(self._specs)

    @property
    def image_bytes(self) -> int:
        """Bytes of one state over all layers: the size of one snapshot image."""
        return sum(_nbytes(spec) for specs in self._specs.values() for spec in specs)

    @property
    def layer_state_bytes(self) -> int:
        """Bytes one layer's state takes in a row (the largest layer's, aligned)."""
        return max(
            aligned_state_bytes([_nbytes(s) for s in specs]) for specs in self._specs.values()
        )

    @property
    def num_rows(self) -> int:
        """State indices 0..num_rows-1 are valid."""
        assert self.layout is not None, "the state pool is not bound to the KV cache yet"
        return self.layout.num_rows

    def bind(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> RowLayout:
        """Lay the states over the attention layers' pages (`register_kv_caches` hands over
        vLLM's views) and zero the scratch row. Idempotent for the same buffer."""
        attention = [t for name, t in kv_caches.items() if name not in self._specs]
        if not attention:
            raise ValueError("no attention layer among the KV caches to put states in")
        pages = [_page_geometry(as_units(t, num_blocks)) for t in attention]
        strides = {(stride, page) for _, stride, page in pages}
        if len(strides) != 1:
            raise ValueError(f"attention layers differ in page geometry: {sorted(strides)}")
        ((block_stride, page_bytes),) = strides
        spans = spans_of([base for base, _, _ in pages], block_stride, page_bytes)
        names = sorted(self._specs, key=forward_position)
        layout = plan_rows(spans, self.layer_state_bytes, len(names), num_blocks - 1)
        storage = attention[0].untyped_storage()
        for index, name in enumerate(names):
            stride = layout.row_stride(layout.places[index].span)
            offset = layout.address(index)
            views = []
            for shape, dtype in self._specs[name]:
                views.append(_strided(storage, dtype, offset, layout.num_rows, stride, shape))
                offset += aligned_state_bytes([_nbytes((shape, dtype))])
            self._layers[name] = tuple(views)
        self.layout = layout
        self._rows = row_views(storage, layout)
        self._unbound.clear()
        for tensors in self._layers.values():
            for tensor in tensors:
                tensor[0].zero_()
        return layout

    def layer(self, name: str) -> tuple[torch.Tensor, ...]:
        """The layer's views. Before `bind` (vLLM profiles memory and may capture CUDA graphs
        on a temporary KV cache first), one zeroed scratch row of each state: dummy passes use
        state index 0 (`StateRowGDNMetadataBuilder`)."""
        views = self._layers.get(name) or self._unbound.get(name)
        if views is None:
            views = tuple(
                torch.zeros((1, *shape), dtype=dtype, device=self.device)
                for shape, dtype in self._specs[name]
            )
            self._unbound[name] = views
        return views

    def zero(self, rows: Sequence[int]) -> None:
        """Zero the states of rows that held KV pages until now: a cold prefill reads parts of
        its initial state (vLLM zeroes new Mamba blocks for the same reason), and KV bytes read
        as float could be NaN. The whole rows, one kernel over every span (`_rows`)."""
        index = device_index(rows, self.device)
        for planes in self._rows:
            planes.index_fill_(-2, index, 0)

    def copy(self, copies: Iterable[StateCopy]) -> None:
        """Apply row-to-row copies one after the other, in order (a later copy sees the
        result of an earlier one). A plain copy moves the source row's bytes whole, one kernel
        over every span (`_rows`), because a step that finishes many requests copies an
        endpoint for each, and one kernel per layer and state tensor (96 on Qwen3.5-27B) would
        make each of those copies that many launches."""
        if armed("state_copy"):
            raise InjectedFault("injected state copy failure")
        corrupt = armed("snapshot_corrupt")
        for copy in copies:
            if copy.reads == (copy.dst,):
                continue  # nothing to move
            if corrupt:
                for tensors in self._layers.values():
                    for tensor in tensors:
                        tensor[copy.dst].fill_(1.0)
            elif copy.recurrent_src is None:
                for rows in self._rows:
                    rows[..., copy.dst, :].copy_(rows[..., copy.src, :])
            else:
                self._gather(copy)

    def _gather(self, copy: StateCopy) -> None:
        """A speculative copy (`StateCopy.recurrent_src`) gathers the state after the last
        accepted token: its recurrent state, and its conv window moved to the front (the
        columns after it zeroed), as a prefill leaves them."""
        for conv, recurrent in self._layers.values():
            columns = conv if self.conv_dim_first else conv.transpose(-1, -2)
            kept = columns.shape[-1] - copy.conv_offset
            columns[copy.dst, :, :kept].copy_(columns[copy.src, :, copy.conv_offset :])
            columns[copy.dst, :, kept:].zero_()
            recurrent[copy.dst].copy_(recurrent[copy.recurrent_src])


def row_views(storage: torch.UntypedStorage, layout: RowLayout) -> tuple[torch.Tensor, ...]:
    """Every row's bytes in each span, as one ``(spans, rows, words)`` tensor when the spans
    lie equally far apart (vLLM's layouts: a span per attention layer at a fixed layer stride,
    or a single span), else a ``(rows, words)`` tensor per span. A word is the widest integer
    dividing every offset and length, so a copy moves up to 8 bytes an element."""
    spans = range(len(layout.spans))
    starts = sorted(layout.row_start(i) for i in spans)
    strides = sorted({layout.row_stride(i) for i in spans})
    gaps = sorted({b - a for a, b in itertools.pairwise(starts)})
    dtype = next(
        d
        for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
        if all(n % d.itemsize == 0 for n in (*starts, *strides, *gaps))
    )
    item = dtype.itemsize
    if len(strides) == 1 and len(gaps) <= 1:
        words = strides[0] // item
        gap = gaps[0] // item if gaps else words * layout.num_rows
        shape = (len(starts), layout.num_rows, words)
        return (_view(storage, dtype, starts[0], shape, (gap, words, 1)),)
    views = []
    for index in spans:
        words = layout.row_stride(index) // item
        start = layout.row_start(index)
        views.append(_view(storage, dtype, start, (layout.num_rows, words), (words, 1)))
    return tuple(views)


def _view(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    tensor = torch.empty(0, dtype=dtype, device=storage.device)
    tensor.set_(storage, offset // dtype.itemsize, shape, stride)
    return tensor


def _nbytes(spec: tuple[tuple[int, ...], torch.dtype]) -> int:
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def _page_geometry(view: torch.Tensor) -> tuple[int, int, int]:
    """(byte offset of block 0, block stride, page bytes) of an attention layer's view, one
    page per element of its first dimension, whose page must be one dense byte range (the
    layouts that keep [H, N, C] together)."""
    item = view.element_size()
    page = view[0]
    extent = 1 + sum((n - 1) * st for n, st in zip(page.shape, page.stride(), strict=True))
    if extent != page.numel():
        raise ValueError(f"an attention page of shape {tuple(page.shape)} is not one byte range")
    return view.storage_offset() * item, view.stride(0) * item, page.numel() * item


def _strided(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    rows: int,
    row_stride: int,
    shape: tuple[int, ...],
) -> torch.Tensor:
    """A ``(rows, *shape)`` tensor at byte ``offset`` of ``storage``, rows ``row_stride`` apart."""
    item = dtype.itemsize
    if offset % item or row_stride % item:
        raise ValueError(f"state offset {offset} / row stride {row_stride} not {dtype}-aligned")
    inner = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        inner[d] = inner[d + 1] * shape[d + 1]
    return _view(storage, dtype, offset, (rows, *shape), (row_stride // item, *inner))
