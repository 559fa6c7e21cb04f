"""Lookup results, source choice and the capacity arithmetic of admission (§6.1-§6.3).

No search: at most three sources (root, the deepest snapshot s*, the deepest fully
device-resident snapshot s_dev), each priced by the cost model, then one page-count check per
source in fallback order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from itertools import accumulate

from vllm_hpc.index.block_tree import BlockNode, BlockTree
from vllm_hpc.index.cost_model import CostModel
from vllm_hpc.index.device_lru import DeviceLRU
from vllm_hpc.index.host_pool import HostGeometry
from vllm_hpc.index.lease import Lease
from vllm_hpc.index.prompt import PreparedPrompt
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.transfers import Restore
from vllm_hpc.index.types import BLOCK_TOKENS, Residency, Tick

GrowthPages = Callable[[int], int]
"""``growth_pages(F)``: pages the sequence itself needs when it resumes at frontier F.

Supplied by the caller's entitlement rule (remaining prompt, output window, cushion); it does not
include the path blocks and tail the index restores or copies.
"""


class Readiness(Enum):
    READY = "ready"
    TEMPORARILY_BLOCKED = "temporarily_blocked"
    """Active sequences hold the pages the request needs; retry when they release."""
    PERMANENTLY_INFEASIBLE = "permanently_infeasible"
    """The request does not fit even in an empty cache."""


@dataclass(frozen=True, slots=True, eq=False)
class MatchResult:
    """The matched path N_0..N_{k-1} and every valid snapshot on it with F <= n - 1."""

    prompt: PreparedPrompt
    root: BlockNode | None
    path: list[BlockNode]
    candidates: list[Snapshot]
    """Ascending frontier; none lies strictly inside a media span."""

    @property
    def matched_tokens(self) -> int:
        return len(self.path) * BLOCK_TOKENS

    @property
    def frontiers(self) -> list[int]:
        return [s.frontier for s in self.candidates]


@dataclass(frozen=True, slots=True)
class SourceOption:
    """One admission source with what it would cost to materialise."""

    snapshot: Snapshot | None
    """None for the root (prefill from token 0)."""
    frontier: int
    host_bytes: int
    """Bytes restored from the host: path blocks, image and tail not on the device."""
    restore_pages: int
    """Cache-owned device pages the restore fills: host-only path blocks and tail."""
    cow_pages: int
    """The sequence's private copy of a partial tail page."""
    own_evictable: int
    """Pages counted as available that this admission pins itself (its path's and tail's LRU
    entries, its image's row): not available to it."""
    seconds: float


@dataclass(frozen=True, slots=True, eq=False)
class AdmissionQuote:
    readiness: Readiness
    source: SourceOption | None
    """The feasible source (READY only)."""
    need_pages: int
    """Pages the source needs (READY), or that the root needs (otherwise)."""
    match: MatchResult
    epoch: Tick
    """The cache's clock when quoted: ``acquire`` refuses a quote the cache has moved past."""


@dataclass(frozen=True, slots=True, eq=False)
class AdmissionGrant:
    """What `PrefixIndex.acquire` grants a quote: the lease, the source and its restore."""

    lease: Lease
    source: Snapshot | None
    frontier: int
    """Reuse frontier: the sequence prefills tokens [frontier, n)."""
    restore: Restore | None
    """Copies to run, then ``complete_restore``; None when admitted from the root."""


def lookup(tree: BlockTree, prompt: PreparedPrompt, limit: int | None = None) -> MatchResult:
    """§6.1: the matched path, then every snapshot on it whose tail tokens equal the prompt's,
    with F <= n - 1 (at least one token is always prefilled) and F a resumable point of the
    prompt's media (`resume_floor`). ``limit`` caps F and the path further: the request may read
    only its first ``limit`` tokens from the cache (None: no cap).

    O(k + snapshots on the path); read-only.
    """
    n = prompt.num_tokens
    cap = max(n - 1 if limit is None else min(n - 1, limit), 0)
    root, path = tree.match_path(prompt, cap // BLOCK_TOKENS)
    candidates: list[Snapshot] = []
    if root is not None:
        for node in (root, *path):
            for snapshot in node.snapshots or ():
                frontier = snapshot.frontier
                if (
                    frontier <= cap
                    and prompt.token_range(node.end, frontier) == snapshot.tail
                    and prompt.resumable_at(frontier)
                ):
                    candidates.append(snapshot)
    candidates.sort(key=lambda s: s.frontier)
    return MatchResult(prompt, root, path, candidates)


def source_options(
    match: MatchResult,
    lru: DeviceLRU,
    cost: CostModel,
    geometry: HostGeometry,
    row_pages: Callable[[Snapshot], int] = lambda snapshot: 0,
) -> list[SourceOption]:
    """[s*, s_dev, root] without repeats, in fallback order (§6.2, §6.3).

    Candidates whose path, image or tail another admission is still filling, or that only the
    disk holds (a disk read must bring it to the host first), are skipped.
    ``row_pages(s)``: pages the available count holds for snapshot s's row, which admitting
    from s pins (`CacheStore.row_pages_given_way`).
    """
    n = match.prompt.num_tokens
    # Prefix counts over the path, as deep as the deepest candidate's anchor.
    path = match.path[: match.candidates[-1].anchor.depth + 1] if match.candidates else []
    states = [node.device for node in path]
    host_before = [0, *accumulate(state is Residency.ABSENT for state in states)]
    lru_before = [0, *accumulate(node in lru for node in path)]
    usable_depth = next(
        (depth for depth, node in enumerate(path) if not _restorable(node.device, node.host)),
        len(path),
    )

    def option(snapshot: Snapshot) -> SourceOption | None:
        blocks = snapshot.anchor.depth + 1
        if blocks > usable_depth:
            return None
        if snapshot.tail and not _restorable(snapshot.tail_device, snapshot.tail_host):
            return None
        if snapshot.slot is None and snapshot.image_host is not Residency.RESIDENT:
            return None
        tail_on_host = bool(snapshot.tail) and snapshot.tail_device is Residency.ABSENT
        host_bytes = (host_before[blocks] + tail_on_host) * geometry.block_bytes
        if snapshot.slot is None:
            host_bytes += geometry.image_bytes
        frontier = snapshot.frontier
        return SourceOption(
            snapshot=snapshot,
            frontier=frontier,
            host_bytes=host_bytes,
            restore_pages=host_before[blocks] + tail_on_host,
            cow_pages=1 if snapshot.tail else 0,
            own_evictable=lru_before[blocks] + (snapshot in lru) + row_pages(snapshot),
            seconds=cost.restore_seconds(host_bytes) + cost.prefill_seconds(frontier, n - frontier),
        )

    usable = [o for o in map(option, reversed(match.candidates)) if o is not None]
    options = usable[:1]
    device = next((o for o in usable if o.host_bytes == 0), None)
    if device is not None and device is not usable[0]:
        options.append(device)
    options.append(SourceOption(None, 0, 0, 0, 0, 0, cost.prefill_seconds(0, n)))
    return options


def _restorable(device: Residency, host: Residency) -> bool:
    """A copy an admission can use now: on the device, or else to restore from the host."""
    return device is Residency.RESIDENT or (
        device is Residency.ABSENT and host is Residency.RESIDENT
    )


def choose(options: list[SourceOption]) -> SourceOption:
    """Minimum estimated seconds; ties favour fewer transferred bytes, then fallback order."""
    return min(options, key=lambda o: (o.seconds, o.host_bytes))


def classify(
    options: list[SourceOption],
    growth_pages: GrowthPages,
    available_pages: int,
    capacity_pages: int,
) -> tuple[Readiness, SourceOption | None, int]:
    """The chosen source if it fits, else the next cheaper to materialise (§6.3).

    ``available_pages`` = free + evictable; each source excludes what it would pin itself.
    """
    chosen = choose(options)
    for source in options[options.index(chosen) :]:
        need = source.restore_pages + source.cow_pages + _growth(growth_pages, source.frontier)
        if need <= available_pages - source.own_evictable:
            return Readiness.READY, source, need
    root_need = _growth(growth_pages, 0)
    if root_need > capacity_pages:
        return Readiness.PERMANENTLY_INFEASIBLE, None, root_need
    return Readiness.TEMPORARILY_BLOCKED, None, root_need


def _growth(growth_pages: GrowthPages, frontier: int) -> int:
    pages = growth_pages(frontier)
    if pages < 0:
        raise ValueError(f"growth_pages({frontier}) returned a negative count: {pages}")
    return pages
