"""What keys a request's cache entries beyond its token ids, read from a vLLM `Request`.

A cached block or state may serve another request only if every input that shaped its KV and
recurrent state was the same. Token ids alone miss three of them:

- media items (images, videos): their placeholder tokens are the same for every image. Each item
  becomes a `MediaItem` keyed by vLLM's own multimodal identifier, the hash vLLM keys its
  encoder cache by. It covers the item's pixels, the processor options that expand it, and
  the LoRA adapter where one applies. The index keys every block the item touches by it, and
  later blocks through their parents.
- the LoRA adapter: different weights give different KV and states for the same tokens.
- prompt embeddings (`prompt_embeds`): their token ids are placeholders.

The adapter and an embeddings digest go into the tenant key beside `cache_salt`, so such
requests share entries only with requests that have the same adapter and the same embeddings.
The index keeps one tree root for each tenant key.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from vllm_hpc.index import MediaItem


def tenant_key(request: Any) -> str | None:
    """`cache_salt`, extended by the LoRA adapter and the prompt embeddings' digest when the
    request has them; exactly `cache_salt` otherwise."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}")
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        parts.append(f"embeds={_tensor_digest(embeds)}")
    salt = request.cache_salt
    if not parts:
        return salt
    return "\0".join([f"salt={salt}" if salt is not None else "no-salt", *parts])


def media_items(request: Any) -> tuple[MediaItem, ...]:
    """The request's media items, each with its placeholder span in the prompt."""
    return tuple(
        MediaItem(
            begin=feature.mm_position.offset,
            length=feature.mm_position.length,
            digest=feature.identifier.encode(),
            modality=feature.modality,
        )
        for feature in getattr(request, "mm_features", None) or ()
    )


def _tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes (on the CPU, where vLLM keeps them)."""
    digest = xxhash.xxh3_128()
    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
