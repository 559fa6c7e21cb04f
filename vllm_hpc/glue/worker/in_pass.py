"""In-pass taps: snapshots saved inside a prefill pass, from states the GDN kernel computes anyway.

vLLM's chunked delta-rule prefill kernel (FLA, the "triton" GDN prefill backend) computes the
recurrent state at the start of every 64-token chunk of every sequence (its ``h`` tensor, in
the activations' dtype), uses it for the output and drops it. A tap at a 64-token offset of a
prefill chunk therefore needs no pass of its own: each GDN layer copies that entry of ``h`` into
the snapshot slot, and the conv state there is the conv inputs just before the offset. The
scheduler plans such taps only where the workers said they can (`StateSlotSpec.in_pass_taps`);
elsewhere (CPU, FlashInfer's kernel) a tap splits the chunk as before.

vLLM 0.32's FLA entry point returns only the final state, so `install_fla_hook` wraps the one
function inside it that returns ``h`` (`chunk_gated_delta_rule_fwd_h`): while a layer has
captures pending, the wrapper saves the entries they name; otherwise it only passes through.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hpc.index import BLOCK_TOKENS
from vllm_hpc.runtime.plan import InPassCapture

FLA_CHUNK_MODULE = "vllm.third_party.flash_linear_attention.ops.chunk"
_HOOKED = "_vllm_hpc_in_pass"


@dataclass(frozen=True)
class StepCaptures:
    """One step's in-pass captures as device tensors, built once and read by every GDN layer."""

    slots: torch.Tensor
    """The capturing requests' active slots: their rows in the batch."""
    offsets: torch.Tensor
    """Tokens into each request's chunk (multiples of 64)."""
    dsts: torch.Tensor

    @classmethod
    def build(cls, captures: Sequence[InPassCapture], device: torch.device) -> StepCaptures:
        return cls(
            device_index([c.slot for c in captures], device),
            device_index([c.offset for c in captures], device),
            device_index([c.dst for c in captures], device),
        )


def device_index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device`` without a host sync: a copy from pageable memory
    waits for the stream, so under async scheduling the worker would stall on the step before;
    from pinned memory it is queued like a kernel."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class _Pending:
    """The ssm-state half of a layer's captures, for the kernel hook to take from ``h``."""

    chunks: torch.Tensor
    """Index into ``h``'s chunk dimension of each capture."""
    dsts: torch.Tensor
    ssm: torch.Tensor


_pending: _Pending | None = None


def capture_layer(
    captures: StepCaptures,
    metadata: Any,
    mixed_qkv: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    run: Callable[[], Any],
) -> Any:
    """Run one GDN layer's core (``run``) while saving this step's captures of it.

    ``conv_state`` is the layer's conv cache viewed as (slots, dim, width - 1), oldest input
    first; ``mixed_qkv`` the layer's conv inputs, decode tokens first, then each prefill row's.
    """
    global _pending
    rows = (metadata.prefill_state_indices[None, :] == captures.slots[:, None]).int().argmax(1)
    first = metadata.num_decode_tokens + metadata.prefill_query_start_loc[rows] + captures.offsets
    width = conv_state.size(-1)
    inputs = first[:, None] - width + torch.arange(width, device=first.device)[None, :]
    conv_state[captures.dsts] = mixed_qkv[inputs].transpose(1, 2).to(conv_state.dtype)
    assert metadata.chunk_offsets is not None, "FLA chunk metadata (the triton GDN backend)"
    chunks = metadata.chunk_offsets[rows] + captures.offsets // BLOCK_TOKENS
    _pending = _Pending(chunks, captures.dsts, ssm_state)
    try:
        result = run()
    finally:
        missed, _pending = _pending, None
    if missed is not None:
        raise RuntimeError("the GDN prefill kernel never ran: in-pass captures not saved")
    return result


def install_fla_hook() -> bool:
    """Wrap vLLM's FLA ``chunk_gated_delta_rule_fwd_h`` once; False when this vLLM has none
    of the shape expected (the caller then plans no in-pass taps)."""
    try:
        module = importlib.import_module(FLA_CHUNK_MODULE)
        from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE
    except ImportError:
        return False
    original = getattr(module, "chunk_gated_delta_rule_fwd_h", None)
    if original is None or FLA_CHUNK_SIZE != BLOCK_TOKENS:
        return False
    if getattr(original, _HOOKED, False):
        return True

    def chunk_gated_delta_rule_fwd_h(*args: Any, **kwargs: Any) -> Any:
        global _pending
        result = original(*args, **kwargs)
        pending, _pending = _pending, None
        if pending is not None:
            h = result[0]  # (1, chunks, heads, v_dim, k_dim): the state before each chunk
            pending.ssm[pending.dsts] = h[0, pending.chunks].to(pending.ssm.dtype)
        return result

    setattr(chunk_gated_delta_rule_fwd_h, _HOOKED, True)
    module.chunk_gated_delta_rule_fwd_h = chunk_gated_delta_rule_fwd_h  # type: ignore[attr-defined]
    return True
