"""Lookup results, source choice and the capacity arithmetic of admission (§6.1-§6.3).

No search: at most four sources (root, the deepest snapshot s*, the deepest one needing no disk
read s_host, the deepest fully device-resident snapshot s_dev), each priced by the cost model,
then one page-count check per source in fallback order.
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
from vllm_hpc.index.types import BLOCK_TOKENS, Medium, Residency, Tick

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
    """Bytes restored from the host: path blocks, image and tail not on the device (those
    only the disk holds included: they are read into the host first)."""
    restore_pages: int
    """Cache-owned device pages the restore fills: host-only path blocks and tail."""
    cow_pages: int
    """The sequence's private copy of a partial tail page."""
    own_evictable: int
    """Pages counted as available that this admission pins itself (its path's and tail's LRU
    entries, its image's row): not available to it."""
    seconds: float
    disk_bytes: int = 0
    """Bytes read from the disk tier into the host first (`DiskRead`): path blocks and the
    snapshot's image and tail that only the disk holds."""


@dataclass(frozen=True, slots=True, eq=False)
class AdmissionQuote:
    readiness: Readiness
    source: SourceOption | None
    """The feasible source (READY only)."""
    preferred: SourceOption
    """The source cost alone chooses (`choose`), whether it fits now or not: what a blocked
    request's read from disk prepares while it waits (§6.6)."""
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
    disk: bool = True,
    host_slabs: int | None = None,
) -> list[SourceOption]:
    """[s*, s_host, s_dev, root] without repeats, in fallback order (§6.2, §6.3): the deepest
    usable candidate, the deepest that needs no disk read, the deepest with nothing off the
    device, the root.

    Candidates whose path, image or tail another transfer is still filling are skipped. Parts
    only the disk holds are read into the host first (`PrefixIndex.plan_disk_read`, a snapshot's
    image and tail as the one record the journal checks), then restored like host parts: their
    bytes cost the disk's read time on top. ``disk=False`` skips candidates that need a read,
    and so does a read of more slabs than ``host_slabs`` (the host tier's, None: no bound): it
    could never land, and a shallower candidate may serve instead.
    ``row_pages(s)``: pages the available count holds for snapshot s's row, which admitting
    from s pins (`CacheStore.row_pages_given_way`).
    """
    n = match.prompt.num_tokens
    # Prefix counts over the path, as deep as the deepest candidate's anchor.
    path = match.path[: match.candidates[-1].anchor.depth + 1] if match.candidates else []
    restored_before = [0, *accumulate(node.device is Residency.ABSENT for node in path)]
    read_before = [0, *accumulate(_disk_only(node) for node in path)]
    lru_before = [0, *accumulate(node in lru for node in path)]
    usable_depth = next(
        (depth for depth, node in enumerate(path) if not _restorable(node, disk)),
        len(path),
    )

    def option(snapshot: Snapshot) -> SourceOption | None:
        blocks = snapshot.anchor.depth + 1
        record = record_read(snapshot, disk)
        if blocks > usable_depth or record is None:
            return None
        read_slabs = read_before[blocks]
        if record:
            read_slabs += geometry.snapshot_slabs(bool(snapshot.tail))
        if host_slabs is not None and read_slabs > host_slabs:
            return None
        tail_restored = bool(snapshot.tail) and snapshot.tail_device is Residency.ABSENT
        host_bytes = (restored_before[blocks] + tail_restored) * geometry.block_bytes
        if snapshot.slot is None:
            host_bytes += geometry.image_bytes
        disk_bytes = read_before[blocks] * geometry.block_bytes
        if record:
            disk_bytes += geometry.image_bytes + (geometry.block_bytes if snapshot.tail else 0)
        frontier = snapshot.frontier
        seconds = cost.disk_read_seconds(disk_bytes) + cost.restore_seconds(host_bytes)
        return SourceOption(
            snapshot=snapshot,
            frontier=frontier,
            host_bytes=host_bytes,
            restore_pages=restored_before[blocks] + tail_restored,
            cow_pages=1 if snapshot.tail else 0,
            own_evictable=lru_before[blocks] + (snapshot in lru) + row_pages(snapshot),
            seconds=seconds + cost.prefill_seconds(frontier, n - frontier),
            disk_bytes=disk_bytes,
        )

    usable = [o for o in map(option, reversed(match.candidates)) if o is not None]
    options = usable[:1]
    for shallower in (
        next((o for o in usable if o.disk_bytes == 0), None),
        next((o for o in usable if o.host_bytes == 0), None),
    ):
        if shallower is not None and shallower not in options:
            options.append(shallower)
    options.append(SourceOption(None, 0, 0, 0, 0, 0, cost.prefill_seconds(0, n)))
    return options


def _restorable(node: BlockNode, disk: bool) -> bool:
    """A copy an admission can use now: on the device, or else to restore from the host, or
    (``disk``) else to read from the disk first."""
    if node.device is not Residency.ABSENT:
        return node.device is Residency.RESIDENT
    return node.host is Residency.RESIDENT or (disk and _disk_only(node))


def _disk_only(node: BlockNode) -> bool:
    return node.media == {Medium.DISK} and Residency.FILLING not in (node.device, node.host)


def record_read(snapshot: Snapshot, disk: bool) -> bool | None:
    """Whether admitting from ``snapshot`` reads its image-and-tail record from disk first;
    None when the snapshot cannot serve now. The slab tiers hold the image and the tail
    together, so the host serves both or the disk does (its CRC covers both)."""
    tail_wanted = bool(snapshot.tail) and snapshot.tail_device is not Residency.RESIDENT
    if snapshot.tail_device is Residency.FILLING:
        return None
    if snapshot.slot is not None and not tail_wanted:
        return False
    image_on_host = snapshot.slot is not None or snapshot.image_host is Residency.RESIDENT
    if image_on_host and (not tail_wanted or snapshot.tail_host is Residency.RESIDENT):
        return False
    if disk and not snapshot.holds_host and Medium.DISK in snapshot.media:
        return True
    return None


def choose(options: list[SourceOption]) -> SourceOption:
    """Minimum estimated seconds; ties favour fewer bytes read, then restored, then fallback
    order."""
    return min(options, key=lambda o: (o.seconds, o.disk_bytes, o.host_bytes))


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
