"""The scheduler's check of --host-cache-mib against the model's sizes, before the index builds
its one slab pool; and an engine whose host tier cannot be allocated."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_hpc import faults
from vllm_hpc.derived import check_host_budget
from vllm_hpc.index import HostGeometry, HostSlabPool
from vllm_hpc.options import OptionError

MIB = 1 << 20


def test_a_budget_too_small_is_refused_naming_the_option() -> None:
    geometry = HostGeometry(block_bytes=4 * MIB, image_bytes=40 * MIB)  # 10 + 1 + 1 slabs
    with pytest.raises(OptionError, match=r"--host-cache-mib 40 .* at least 48 MiB.* use 0"):
        check_host_budget(40, geometry)
    check_host_budget(48, geometry)
    check_host_budget(0, geometry)  # no host tier


@pytest.mark.parametrize(
    ("block_bytes", "image_bytes"), [(4096, 3 * MIB), (5000, 2 * MIB + 7), (3 * MIB + 1, 21 * MIB)]
)
def test_the_check_agrees_with_the_slab_pool(block_bytes: int, image_bytes: int) -> None:
    geometry = HostGeometry(block_bytes, image_bytes)
    need_mib = -(-geometry.min_budget_slabs * geometry.slab_bytes // MIB)
    assert need_mib > 1
    for mib in (need_mib - 1, need_mib):
        try:
            HostSlabPool(mib * MIB, geometry)
        except ValueError:
            with pytest.raises(OptionError):
                check_host_budget(mib, geometry)
        else:
            check_host_budget(mib, geometry)
    with pytest.raises(OptionError):
        check_host_budget(need_mib - 1, geometry)


@pytest.mark.engine
def test_an_engine_whose_host_tier_cannot_be_allocated_fails_naming_the_option(
    tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected (`VLLM_HPC_FAULTS=host_alloc:0`, in-process so the worker sees it): start-up
    fails with the chunk's size and --host-cache-mib in the error, not somewhere later."""
    from engine_support import running_llm

    monkeypatch.setattr(faults, "_ARMED", frozenset({"host_alloc:0"}))
    config = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 64}
    engine = running_llm(in_process=True, additional_config=config, max_model_len=2048)
    with pytest.raises(Exception) as caught, engine:
        pass
    chain = []
    error: BaseException | None = caught.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("host tier chunk 0" in m and "--host-cache-mib" in m for m in chain), chain
