"""A `StatePool` bound to a buffer of its own, for tests of the host tier's data mover.

In an engine the pool lays its rows over vLLM's KV cache buffer (`StatePool.bind`). The data
mover's tests fill the KV pages and the states with random bytes separately, so they give the
pool one fake attention layer over a buffer of its own, laid out as vLLM's CPU backend does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_hpc.glue.row_layout import Span, plan_rows
from vllm_hpc.glue.worker.state_pool import StatePool

PAGE_BYTES = 4096


def bound_pool(
    device: torch.device,
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    rows: int,
    seed: int = 100,
    attention_layers: int = 1,
    uneven: bool = False,
) -> StatePool:
    """A pool of ``rows`` rows (row 0 the scratch) for GDN layers ``names``, random bytes in
    every state, over ``attention_layers`` fake attention layers laid out layer after layer
    (vLLM's layer-outer layouts: a span each); ``uneven`` puts a gap of one page after the
    first layer, so the spans do not lie equally far apart."""
    pool = StatePool(device)
    for name in names:
        pool.add_layer(name, shapes, dtypes)
    spans = [Span(0, PAGE_BYTES)] * attention_layers
    row_pages = plan_rows(spans, pool.layer_state_bytes, len(names), 1).row_pages
    pages = 1 + rows * row_pages
    bases = [layer * pages * PAGE_BYTES for layer in range(attention_layers)]
    if uneven:
        bases = [bases[0], *(base + PAGE_BYTES for base in bases[1:])]
    raw = torch.zeros(bases[-1] + pages * PAGE_BYTES, dtype=torch.int8, device=device)
    views = {
        f"model.layers.{90 + layer}.self_attn.attn": torch.as_strided(
            raw, (pages, 1, 1, PAGE_BYTES), (PAGE_BYTES, PAGE_BYTES, PAGE_BYTES, 1), base
        )
        for layer, base in enumerate(bases)
    }
    layout = pool.bind(views, pages)
    assert layout.num_rows == rows
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        for tensor in pool.layer(name):
            data = torch.randint(0, 256, tensor.view(torch.uint8).shape, generator=generator)
            tensor.view(torch.uint8).copy_(data.to(device))
    return pool
