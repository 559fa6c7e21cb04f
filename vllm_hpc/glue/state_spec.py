"""The GDN layers' KV-cache spec: how the workers' state pool reaches the scheduler.

vLLM asks every layer for its spec in the workers and hands the specs to the scheduler's KV
cache manager, so this record is what both sides read: the workers build it
(`HybridPrefixGDN.get_kv_cache_spec`), `HybridPrefixKVCacheManager` sizes the cache from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_cache_interface import MambaSpec


@dataclass(frozen=True, kw_only=True)
class StateRowSpec(MambaSpec):
    """The GDN layers' proxy spec: one byte per "block", plus the states' sizes."""

    layer_state_bytes: int
    """Bytes one layer's state takes in a state row (`vllm_hpc.glue.row_layout`)."""
    image_bytes: int
    """Bytes of one state over every GDN layer: a snapshot image on the host."""
    in_pass_taps: bool
    """The layers save states inside a prefill pass (`vllm_hpc.glue.worker.in_pass`)."""

    @property
    def uses_slot_mapping(self) -> bool:
        # One "block" per request whatever its length: a per-token slot mapping (which V2
        # computes for specs that ask for one) would index past the one-wide block table.
        return False
