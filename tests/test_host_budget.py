"""The scheduler's check of --host-cache-mib against the model's sizes, before the index builds
its one slab pool."""

from __future__ import annotations

import pytest

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
