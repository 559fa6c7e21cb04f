"""In-pass taps: snapshots saved inside a prefill pass, from states the GDN kernel computes anyway.

A tap at a 64-token offset of a prefill chunk needs no pass of its own when the GDN prefill
kernel can hand over the recurrent state at that offset: each GDN layer copies it into the
snapshot slot, and the conv state there is the conv inputs just before the offset. The scheduler
plans such taps only where the workers said they can (`StateRowSpec.in_pass_taps`); elsewhere
(CPU, kernels without mid-chunk states) a tap splits the chunk. Two kernels can:

- FLA (the "triton" GDN prefill backend) computes the state at the start of every 64-token
  chunk of every sequence (its ``h`` tensor, in the activations' dtype), uses it for the output
  and drops it. Its entry point returns only the final state, so `install_fla_hook` wraps the
  one function inside it that returns ``h`` (`chunk_gated_delta_rule_fwd_h`): while a layer has
  captures pending, the wrapper saves the entries they name; otherwise it only passes through.
- FlashInfer's (vLLM 0.34's choice on Hopper) stores float32 states every N tokens of each
  sequence's chunk when asked (``state_checkpoints``; vLLM asks for its own align-mode
  checkpoints, which hybrid-prefix turns off). `flashinfer_prefill` makes vLLM's call with
  checkpoints every N tokens, N the gcd of the step's offsets, into vLLM's own checkpoint
  workspace, and copies out the entries the captures name. Passes without captures make
  vLLM's call unchanged.
"""

from __future__ import annotations

import importlib
import math
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

    state_rows: torch.Tensor
    """The capturing requests' state rows: they name the requests in the batch."""
    offsets: torch.Tensor
    """Tokens into each request's chunk (multiples of 64)."""
    dsts: torch.Tensor
    every: int
    """The gcd of the offsets: FlashInfer stores a state every ``every`` tokens of each chunk."""

    @classmethod
    def build(cls, captures: Sequence[InPassCapture], device: torch.device) -> StepCaptures:
        return cls(
            device_index([c.row for c in captures], device),
            device_index([c.offset for c in captures], device),
            device_index([c.dst for c in captures], device),
            math.gcd(*(c.offset for c in captures)),
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
    """The ssm-state half of a layer's captures, for the kernel hook to take."""

    rows: torch.Tensor
    """Each capture's prefill row in the batch."""
    captures: StepCaptures
    ssm: torch.Tensor
    fla_chunks: torch.Tensor | None
    """Index into FLA's ``h`` of each capture; None on FlashInfer."""


_pending: _Pending | None = None


def capture_layer(
    captures: StepCaptures,
    metadata: Any,
    mixed_qkv: torch.Tensor,
    conv_state: torch.Tensor,
    window: int,
    ssm_state: torch.Tensor,
    run: Callable[[], Any],
) -> Any:
    """Run one GDN layer's core (``run``) while saving this step's captures of it.

    ``conv_state`` is the layer's conv cache viewed as (slots, dim, columns), oldest input
    first. A prefill reads its first ``window`` columns (the conv kernel's width - 1; with
    speculative decoding there are more), which get the inputs just before the offset and the
    rest zeros. ``mixed_qkv`` is the layer's conv inputs, decode tokens first, then each prefill
    row's.
    """
    global _pending
    rows = (metadata.prefill_state_indices[None, :] == captures.state_rows[:, None]).int().argmax(1)
    first = metadata.num_decode_tokens + metadata.prefill_query_start_loc[rows] + captures.offsets
    inputs = first[:, None] - window + torch.arange(window, device=first.device)[None, :]
    saved = torch.zeros_like(conv_state[captures.dsts])
    saved[..., :window] = mixed_qkv[inputs].transpose(1, 2)
    conv_state[captures.dsts] = saved
    chunks = None
    if metadata.chunk_offsets is not None:  # FLA's chunk metadata: the triton backend
        chunks = metadata.chunk_offsets[rows] + captures.offsets // BLOCK_TOKENS
    _pending = _Pending(rows, captures, ssm_state, chunks)
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
            assert pending.fla_chunks is not None, "FLA's kernel ran without its chunk metadata"
            h = result[0]  # (1, chunks, heads, v_dim, k_dim): the state before each chunk
            pending.ssm[pending.captures.dsts] = h[0, pending.fla_chunks].to(pending.ssm.dtype)
        return result

    setattr(chunk_gated_delta_rule_fwd_h, _HOOKED, True)
    module.chunk_gated_delta_rule_fwd_h = chunk_gated_delta_rule_fwd_h  # type: ignore[attr-defined]
    return True


def flashinfer_captures_pending() -> bool:
    """Whether the FlashInfer prefill about to run has captures to save (`flashinfer_prefill`)."""
    return _pending is not None


def flashinfer_prefill(
    metadata: Any, workspace: torch.Tensor, call: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make vLLM's FlashInfer prefill ``call`` with checkpoints in ``workspace`` (float32
    states, (rows, heads, v_dim, k_dim), at least ``cdiv(prefill tokens, 64)`` rows), and save
    the pending captures' entries. ``call`` takes the three checkpoint arguments of vLLM's
    `fi_chunk_gated_delta_rule`.

    Entry ``cu_starts[i] + j`` is row i's state after the first (j + 1) * N tokens of its chunk;
    a capture at offset o of row i reads entry ``cu_starts[i] + o / N - 1``.
    """
    global _pending
    pending, _pending = _pending, None
    assert pending is not None, "no captures pending (flashinfer_captures_pending)"
    every = pending.captures.every
    lengths = torch.diff(metadata.prefill_query_start_loc)
    cu_starts = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    cu_starts[1:] = torch.cumsum(lengths // every, 0)
    checkpoints = workspace[: metadata.num_prefill_tokens // every]
    result = call(
        state_checkpoints=checkpoints,
        checkpoint_cu_starts=cu_starts,
        checkpoint_every_n_tokens=every,
    )
    entries = cu_starts[pending.rows] + pending.captures.offsets // every - 1
    pending.ssm[pending.captures.dsts] = checkpoints[entries].to(pending.ssm.dtype)
    return result
