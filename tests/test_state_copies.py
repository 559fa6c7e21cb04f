"""Slot-to-slot state copies and zeroes (`StatePool.copy`, `StatePool.zero`): whole rows moved
at once over every span of vLLM's buffer, against the copies applied one state at a time in
order (CPU; CUDA where there is one)."""

from __future__ import annotations

import random

import pytest
import torch
from pool_support import bound_pool

from vllm_hpc.glue.worker.state_pool import StatePool
from vllm_hpc.runtime.plan import StateCopy

ROWS = 6
"""Rows 0..5, row 0 the scratch."""

NAMES = [f"model.layers.{i}.linear_attn" for i in range(5)]
LAYOUTS = {"one span": (1, False), "even spans": (3, False), "uneven spans": (3, True)}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def _pool(device: str, layout: str) -> StatePool:
    spans, uneven = LAYOUTS[layout]
    return bound_pool(
        torch.device(device),
        NAMES,
        [(3, 8), (2, 4, 4)],
        [torch.bfloat16, torch.float32],
        rows=ROWS,
        attention_layers=spans,
        uneven=uneven,
    )


def _rows(pool: StatePool) -> list[torch.Tensor]:
    """Every state tensor's bytes per row (random bytes read as floats hold NaNs, which never
    compare equal), copied to the CPU."""
    return [
        tensor.view(torch.uint8).reshape(tensor.shape[0], -1).to("cpu", copy=True)
        for name in NAMES
        for tensor in pool.layer(name)
    ]


def _in_order(before: list[torch.Tensor], copies: list[StateCopy]) -> list[torch.Tensor]:
    after = [tensor.clone() for tensor in before]
    for copy in copies:
        for tensor in after:
            tensor[copy.dst] = tensor[copy.src]
    return after


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_copies_land_as_one_state_at_a_time_in_order(device: str, layout: str) -> None:
    """Seeded random lists of copies (self-copies, chains and overwrites among them; plain
    seeds rather than hypothesis, which the staged GPU environment lacks)."""
    pool = _pool(device, layout)
    rng = random.Random(7)
    for _ in range(30):
        copies = [
            StateCopy(rng.randint(1, ROWS - 1), rng.randint(1, ROWS - 1))
            for _ in range(rng.randint(0, 10))
        ]
        before = _rows(pool)
        pool.copy(copies)
        for got, want in zip(_rows(pool), _in_order(before, copies), strict=True):
            assert torch.equal(got, want), f"{layout}: {copies}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_chain_reads_what_the_copy_before_wrote(device: str, layout: str) -> None:
    pool = _pool(device, layout)
    before = _rows(pool)
    copies = [StateCopy(1, 2), StateCopy(4, 5), StateCopy(2, 3), StateCopy(5, 1)]
    pool.copy(copies)
    expected = {1: 4, 2: 1, 3: 1, 4: 4, 5: 4}  # row -> the row whose bytes it holds
    for got, was in zip(_rows(pool), before, strict=True):
        for row, source in expected.items():
            assert torch.equal(got[row], was[source]), f"{layout}: row {row}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_clears_the_rows_and_nothing_else(device: str, layout: str) -> None:
    pool = _pool(device, layout)
    before = _rows(pool)
    pool.zero([2, 5])
    for got, was in zip(_rows(pool), before, strict=True):
        for row in range(ROWS):
            want = torch.zeros_like(was[row]) if row in (2, 5) else was[row]
            assert torch.equal(got[row], want), f"{layout}: row {row}"
