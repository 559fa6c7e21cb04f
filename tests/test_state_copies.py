"""Slot-to-slot state copies (`StatePool.copy`): the waves that move together, and the pool's
copies (CPU; CUDA where there is one), both against the copies applied one after the other."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pool_support import bound_pool

from vllm_hpc.glue.worker.state_pool import copy_waves
from vllm_hpc.runtime.plan import StateCopy

SLOTS = 6
COPIES = st.lists(
    st.builds(StateCopy, st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1)), max_size=12
)


def _in_order(values: list[int], copies: list[StateCopy]) -> list[int]:
    values = list(values)
    for copy in copies:
        values[copy.dst] = values[copy.src]
    return values


@given(COPIES)
def test_each_wave_lands_alike_in_any_order(copies: list[StateCopy]) -> None:
    """Within a wave every copy reads what the wave found (as if all landed at once), and the
    waves in order give what the copies in order give."""
    start = list(range(SLOTS))
    values = list(start)
    waves = list(copy_waves(copies))
    for wave in waves:
        assert wave, "an empty wave"
        before = list(values)
        for copy in wave:
            values[copy.dst] = before[copy.src]
        assert values == _in_order(before, wave)
        assert values == _in_order(before, wave[::-1])
    assert values == _in_order(start, copies)
    assert [c for wave in waves for c in wave] == [c for c in copies if c.src != c.dst]


def test_a_chain_splits_where_a_copy_reads_what_the_wave_wrote() -> None:
    chain = [StateCopy(1, 2), StateCopy(3, 4), StateCopy(2, 5), StateCopy(5, 5)]
    assert list(copy_waves(chain)) == [chain[:2], chain[2:3]]


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """Bytes per row: random bytes read as floats hold NaNs, which never compare equal."""
    return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_pool_applies_chained_copies_in_order(device: str) -> None:
    """Two waves of two copies, the second reading what the first wrote (CUDA is skipped on
    machines without one)."""
    names = ["model.layers.0.linear_attn", "model.layers.1.linear_attn"]
    pool = bound_pool(
        torch.device(device), names, [(3, 8), (2, 4, 4)], [torch.bfloat16, torch.float32], rows=7
    )
    rows = {n: [_raw(t).clone() for t in pool.layer(n)] for n in names}
    copies = [StateCopy(1, 2), StateCopy(4, 5), StateCopy(2, 3), StateCopy(5, 1)]
    assert [len(wave) for wave in copy_waves(copies)] == [2, 2]
    pool.copy(copies)
    expected = {1: 4, 2: 1, 3: 1, 4: 4, 5: 4, 6: 6}  # row -> the row whose bytes it holds
    for name in names:
        for tensor, before in zip(map(_raw, pool.layer(name)), rows[name], strict=True):
            for row, source in expected.items():
                assert torch.equal(tensor[row], before[source]), (name, row)
