"""The per-layer KV cache views vLLM hands the workers (`register_kv_caches`), read the same way
by the state pool (which lays its rows over them) and the host layout (which copies their
bytes): the layers' forward order, from their names, and a view's pages, which vLLM may have
split into smaller kernel blocks.
"""

from __future__ import annotations

import torch


def forward_position(name: str) -> int:
    """The layer index in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise ValueError(f"no layer index in layer name {name!r}")


def as_units(tensor: torch.Tensor, units: int) -> torch.Tensor:
    """``tensor`` with ``units`` (pages or state rows) as its first dimension: vLLM splits a page
    into equal kernel blocks when the backend asks for smaller ones."""
    if tensor.shape[0] == units:
        return tensor
    if tensor.shape[0] % units:
        raise ValueError(f"tensor of shape {tuple(tensor.shape)} is not {units} pages")
    return tensor.unflatten(0, (units, -1))
