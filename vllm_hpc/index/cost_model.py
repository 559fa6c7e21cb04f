"""Prefill and restore time estimates used to rank sources (§6.2) and value snapshots (§9.3).

One model serves both so eviction and admission agree about what a snapshot is worth. It only
ranks choices: capacity and validity never depend on it (§10.10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class CostModel(Protocol):
    """What the index asks of a cost model; a binding may plug in its own calibrated one."""

    def prefill_seconds(self, base: int, tokens: int) -> float: ...

    def restore_seconds(self, host_bytes: int) -> float: ...

    def disk_read_seconds(self, disk_bytes: int) -> float: ...


@dataclass(frozen=True, slots=True)
class CacheCostModel:
    """The default ``CostModel``: linear prefill plus a bandwidth-and-latency transfer model.

    The defaults are generic placeholders of the right order for a large hybrid model on one
    GPU; a deployment replaces them with measured coefficients.
    """

    token_s: float = 1.0e-4
    """Prefill seconds per token (the linear MLP/GDN part)."""
    attention_pair_s: float = 2.0e-10
    """Prefill seconds per (query, key) pair of full attention."""
    chunk_s: float = 0.0
    """Fixed seconds per prefill chunk (one forward pass)."""
    chunk_tokens: int = 8192
    h2d_bytes_per_s: float = 25.0e9
    batch_latency_s: float = 50.0e-6
    """Fixed cost of one host-to-device restore batch."""
    disk_read_bytes_per_s: float = 1.5e9
    """Disk tier reads into the host tier. O_DIRECT reads of whole records from a thread pool
    reached 0.9-1.5 GiB/s on the development VM's disk (docs/notes/disk-io.md), well below a
    pinned copy's bandwidth: a device or host source nearly as deep wins over a read. A local
    NVMe drive reads faster; a deployment replaces it with its own figure."""

    def __post_init__(self) -> None:
        rates = (self.h2d_bytes_per_s, self.disk_read_bytes_per_s)
        if self.chunk_tokens <= 0 or min(rates) <= 0:
            raise ValueError(
                "chunk_tokens, h2d_bytes_per_s and disk_read_bytes_per_s must be positive"
            )

    def prefill_seconds(self, base: int, tokens: int) -> float:
        """Seconds to prefill ``tokens`` new tokens after ``base`` cached ones.

        Attention pairs: each new token at offset i attends to base + i + 1 keys, so
        B·S + S(S+1)/2 pairs in total.
        """
        if tokens <= 0:
            return 0.0
        pairs = base * tokens + tokens * (tokens + 1) // 2
        chunks = -(-tokens // self.chunk_tokens)
        return chunks * self.chunk_s + tokens * self.token_s + pairs * self.attention_pair_s

    def restore_seconds(self, host_bytes: int) -> float:
        """Seconds to copy ``host_bytes`` from the host tier in one batch (0 when nothing moves)."""
        if host_bytes <= 0:
            return 0.0
        return host_bytes / self.h2d_bytes_per_s + self.batch_latency_s

    def disk_read_seconds(self, disk_bytes: int) -> float:
        """Seconds to read ``disk_bytes`` from the disk tier into the host tier (before their
        restore from the host, priced apart)."""
        return disk_bytes / self.disk_read_bytes_per_s
