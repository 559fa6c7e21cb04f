"""The in-pass capture's bookkeeping (`vllm_hpc.glue.worker.in_pass`) on CPU tensors, without a
kernel.

The CUDA kernels are stood in for by functions that return known states (FLA's ``h``, FlashInfer's
checkpoints): each capture must land the right state of the right batch row in its snapshot
slot, and the three conv inputs just before its offset, in a batch with decode tokens first and
several prefill rows, as vLLM's GDN metadata lays them out.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from vllm_hpc.glue.worker.in_pass import (
    FLA_CHUNK_MODULE,
    StepCaptures,
    capture_layer,
    flashinfer_prefill,
    install_fla_hook,
)
from vllm_hpc.runtime.plan import InPassCapture

DIM, WIDTH, HEADS, V, K = 8, 3, 2, 4, 4


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch):
    """The FLA module's ``chunk_gated_delta_rule_fwd_h``, replaced by one whose ``h`` chunk c
    is filled with c, then wrapped by the hook; vLLM's own function is restored afterwards."""
    module = importlib.import_module(FLA_CHUNK_MODULE)

    def fake(num_chunks: int):
        h = torch.arange(num_chunks, dtype=torch.float32)[:, None, None, None]
        return h.expand(num_chunks, HEADS, V, K)[None].clone(), None, None

    monkeypatch.setattr(module, "chunk_gated_delta_rule_fwd_h", fake)
    assert install_fla_hook()
    return module


def _batch(chunk_offsets: torch.Tensor | None) -> tuple[SimpleNamespace, StepCaptures]:
    """Two decode tokens, then prefill rows of 300 and 200 tokens (FLA chunks 0-4 and 5-8);
    captures at offset 128 of the second row (slot 3) and 256 of the first (slot 7)."""
    metadata = SimpleNamespace(
        num_decode_tokens=2,
        num_prefill_tokens=500,
        prefill_state_indices=torch.tensor([7, 3]),
        prefill_query_start_loc=torch.tensor([0, 300, 500]),
        chunk_offsets=chunk_offsets,
    )
    captures = StepCaptures.build(
        [InPassCapture(row=3, offset=128, dst=8), InPassCapture(row=7, offset=256, dst=9)],
        torch.device("cpu"),
    )
    return metadata, captures


MIXED_QKV = torch.arange(502, dtype=torch.float32)[:, None].expand(502, DIM).clone()


@pytest.mark.parametrize("spec_columns", [0, 2], ids=["plain", "mtp"])
def test_captures_land_the_right_chunk_and_conv_inputs(kernel, spec_columns: int) -> None:
    """With speculative decoding the conv state has ``spec_columns`` more columns; a prefill
    reads the first WIDTH, which hold the inputs just before the offset, the rest zeros."""
    metadata, captures = _batch(torch.tensor([0, 5, 9]))
    conv = torch.full((10, DIM, WIDTH + spec_columns), -1.0)
    ssm = torch.zeros(10, HEADS, V, K)

    capture_layer(
        captures,
        metadata,
        MIXED_QKV,
        conv,
        WIDTH,
        ssm,
        lambda: kernel.chunk_gated_delta_rule_fwd_h(9),
    )

    zeros = [0.0] * spec_columns
    # Slot 3 is the second prefill row: its tokens start at 2 + 300; offset 128 is chunk 5 + 2.
    assert conv[8, 0].tolist() == [427.0, 428.0, 429.0, *zeros]
    assert bool((ssm[8] == 7).all())
    # Slot 7 is the first row: tokens from 2; offset 256 is its chunk 4.
    assert conv[9, 0].tolist() == [255.0, 256.0, 257.0, *zeros]
    assert bool((ssm[9] == 4).all())
    assert bool((conv[:8] == -1).all()) and not ssm[:8].any()


def test_flashinfer_checkpoints_land_the_entries_the_captures_name() -> None:
    """FlashInfer stores row i's state after its first (j + 1) * N tokens at entry
    cu_starts[i] + j, N the gcd of the offsets (128 here): rows of 300 and 200 tokens hold 2
    and 1 entries, so offset 128 of row 1 is entry 2 and offset 256 of row 0 is entry 1."""
    metadata, captures = _batch(None)
    conv, ssm = torch.zeros(10, DIM, WIDTH), torch.zeros(10, HEADS, V, K)
    workspace = torch.zeros(8, HEADS, V, K)
    asked: dict[str, object] = {}

    def call(**checkpoints: torch.Tensor) -> str:
        asked.update(checkpoints)
        states = checkpoints["state_checkpoints"]
        count = int(checkpoints["checkpoint_cu_starts"][-1])
        states[:count] = torch.arange(count, dtype=torch.float32)[:, None, None, None]
        return "result"

    def run() -> str:
        return flashinfer_prefill(metadata, workspace, call)

    assert capture_layer(captures, metadata, MIXED_QKV, conv, WIDTH, ssm, run) == "result"
    assert asked["checkpoint_every_n_tokens"] == 128
    assert asked["checkpoint_cu_starts"].tolist() == [0, 2, 3]  # type: ignore[attr-defined]
    assert bool((ssm[8] == 2).all()) and bool((ssm[9] == 1).all())
    assert conv[8, 0].tolist() == [427.0, 428.0, 429.0]


def test_a_layer_whose_kernel_never_ran_says_so(kernel) -> None:
    metadata = SimpleNamespace(
        num_decode_tokens=0,
        prefill_state_indices=torch.tensor([1]),
        prefill_query_start_loc=torch.tensor([0, 128]),
        chunk_offsets=torch.tensor([0, 2]),
    )
    captures = StepCaptures.build([InPassCapture(1, 64, 2)], torch.device("cpu"))
    conv, ssm = torch.zeros(3, DIM, WIDTH), torch.zeros(3, HEADS, V, K)
    with pytest.raises(RuntimeError, match="never ran"):
        capture_layer(captures, metadata, torch.zeros(128, DIM), conv, WIDTH, ssm, lambda: None)
    # The pending capture does not leak into the next kernel call.
    h, _, _ = kernel.chunk_gated_delta_rule_fwd_h(2)
    assert h.shape[1] == 2 and not ssm.any()
