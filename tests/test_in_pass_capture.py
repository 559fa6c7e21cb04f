"""The in-pass capture's bookkeeping (`vllm_hpc.glue.worker.in_pass`) on CPU tensors, without a
kernel.

The CUDA kernel is stood in for by a function of the same name that returns a known ``h``: each
capture must land the right chunk of the right batch row in its snapshot slot, and the three
conv inputs just before its offset, in a batch with decode tokens first and several prefill
rows, as vLLM's GDN metadata lays them out.
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


def test_captures_land_the_right_chunk_and_conv_inputs(kernel) -> None:
    # Two decode tokens, then prefill rows of 300 and 200 tokens (chunks 0-4 and 5-8).
    metadata = SimpleNamespace(
        num_decode_tokens=2,
        prefill_state_indices=torch.tensor([7, 3]),
        prefill_query_start_loc=torch.tensor([0, 300, 500]),
        chunk_offsets=torch.tensor([0, 5, 9]),
    )
    mixed_qkv = torch.arange(502, dtype=torch.float32)[:, None].expand(502, DIM).clone()
    conv = torch.zeros(10, DIM, WIDTH)
    ssm = torch.zeros(10, HEADS, V, K)
    captures = StepCaptures.build(
        [InPassCapture(slot=3, offset=128, dst=8), InPassCapture(slot=7, offset=256, dst=9)],
        torch.device("cpu"),
    )

    capture_layer(
        captures, metadata, mixed_qkv, conv, ssm, lambda: kernel.chunk_gated_delta_rule_fwd_h(9)
    )

    # Slot 3 is the second prefill row: its tokens start at 2 + 300; offset 128 is chunk 5 + 2.
    assert torch.equal(conv[8, 0], torch.tensor([427.0, 428.0, 429.0]))
    assert bool((ssm[8] == 7).all())
    # Slot 7 is the first row: tokens from 2; offset 256 is its chunk 4.
    assert torch.equal(conv[9, 0], torch.tensor([255.0, 256.0, 257.0]))
    assert bool((ssm[9] == 4).all())
    assert not conv[:8].any() and not ssm[:8].any()


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
        capture_layer(captures, metadata, torch.zeros(128, DIM), conv, ssm, lambda: None)
    # The pending capture does not leak into the next kernel call.
    h, _, _ = kernel.chunk_gated_delta_rule_fwd_h(2)
    assert h.shape[1] == 2 and not ssm.any()
