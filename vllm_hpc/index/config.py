"""Sizes and policies of one index, fixed at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_hpc.index.cost_model import CacheCostModel, CostModel
from vllm_hpc.index.host_pool import HostGeometry
from vllm_hpc.index.prompt import BlockHasher, xxh3_block_hash


@dataclass(frozen=True, slots=True)
class IndexConfig:
    device_pages: int
    """KV pages the index accounts for (active and cached together)."""
    geometry: HostGeometry
    first_page_id: int = 0
    """Lowest page id; the vLLM binding passes 1 because id 0 is its null block."""
    snapshot_slots: int = 2
    """D device snapshot slots (§5.4: C + 1 with a host tier, C + 2 without); a cap where
    states share the page space."""
    row_pages: int = 0
    """Pages per state row where Gated DeltaNet states share the page space with KV pages
    (`DevicePagePool`); 0 keeps states out of it (the index's unit tests)."""
    host_budget_bytes: int = 0
    """Host slab pool size; 0 disables the host tier."""
    disk_budget_bytes: int = 0
    """Disk slab pool size, under the host tier (`DiskSlabPool`); 0 disables the disk tier."""
    cost: CostModel = field(default_factory=CacheCostModel)
    hasher: BlockHasher = xxh3_block_hash
    record_events: bool = False
    """Journal every residency change for KV cache events (`index/journal.py`)."""

    def __post_init__(self) -> None:
        if self.disk_budget_bytes and not self.host_budget_bytes:
            raise ValueError(
                "IndexConfig.disk_budget_bytes needs a host tier: the disk tier is written from "
                "host slabs and read back into them (set host_budget_bytes, or disk to 0)"
            )
