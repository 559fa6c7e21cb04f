"""`--prefix-cache-file` through the OpenAI server: SIGTERM saves, a restart resumes from the
file with the cold run's tokens; a second SIGTERM during a (slowed) save, or a kill, leaves the
previous file as it was (§5.5). Every server checks the cache's invariants at each step."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_support import random_prompt
from openai_server import (
    greedy_body,
    metrics,
    model_id,
    parting_from_cold,
    post,
    running_server,
    sample,
)

from vllm_hpc.faults import FAULTS_ENV

pytestmark = pytest.mark.engine

ANSWER = 96  # 64+ tokens past the prompt-tail tap: the endpoint is kept (§7.7)
STOP_TIMEOUT_S = 60


@contextmanager
def server(model: Path, log: Path, cache_file: Path) -> Iterator[tuple[str, int]]:
    extra = ("--host-cache-mib", "64", "--prefix-cache-file", str(cache_file))
    with running_server(model, log, "--gpu-memory-utilization", "0.2", *extra) as started:
        yield started


def complete(base: str, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
    status, body = post(base, greedy_body(model_id(base), prompt, ANSWER, cold_salt=salt))
    assert status == 200, body
    return body


def engine_core(pid: int) -> psutil.Process:
    """The server's engine-core process (vLLM names it EngineCore)."""
    children = psutil.Process(pid).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()]))


def wait_for(log: Path, text: str, timeout: float = STOP_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while text not in log.read_text():
        assert time.time() < deadline, f"{text!r} never logged:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def stop(pid: int) -> None:
    """SIGTERM, as an orchestrator stops the server, and wait for it to exit."""
    os.kill(pid, signal.SIGTERM)
    psutil.Process(pid).wait(STOP_TIMEOUT_S)


def test_sigterm_saves_and_a_restart_resumes_from_the_file(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_file = tmp_path / "cache.bin"
    prompt = random_prompt(seed=1, length=1200)
    log = tmp_path / "first.log"
    with server(tiny_model_dir, log, cache_file) as (base, pid):
        assert "prefix cache not restored: no file at" in log.read_text()
        answer = complete(base, prompt)["choices"][0]["token_ids"]
        stop(pid)
    text = log.read_text()
    assert "prefix cache saved to" in text, text[-3000:]
    saved = cache_file.read_bytes()

    turn = prompt + answer + random_prompt(seed=2, length=100)
    monkeypatch.setenv(FAULTS_ENV, "save_slow")
    log = tmp_path / "second.log"
    with server(tiny_model_dir, log, cache_file) as (base, pid):
        assert "prefix cache restored from" in log.read_text()
        body = complete(base, turn)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + ANSWER - 1
        cold = complete(base, turn, salt="cold")["choices"][0]
        parting = parting_from_cold(body["choices"][0]["token_ids"], cold)
        assert parting is None or parting.near_tie, parting.describe()
        text = metrics(base)
        assert sample(text, "vllm:hpc_file_restored_snapshots_total") > 0
        assert sample(text, "vllm:hpc_file_restored_bytes_total") > 0
        core = engine_core(pid)
        os.kill(pid, signal.SIGTERM)
        wait_for(log, "prefix cache file: saving")
        time.sleep(0.3)  # into the slowed slabs
        core.send_signal(signal.SIGTERM)  # the second stop signal, where the save runs
        psutil.Process(pid).wait(STOP_TIMEOUT_S)
    text = log.read_text()
    assert "abandoning it, the previous file stays" in text, text[-3000:]
    assert "prefix cache saved to" not in text
    assert cache_file.read_bytes() == saved
    assert sorted(os.listdir(tmp_path)) == ["cache.bin", "first.log", "second.log"]


def test_a_kill_during_the_save_leaves_the_previous_file_and_a_temporary(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_file = tmp_path / "cache.bin"
    log = tmp_path / "first.log"
    with server(tiny_model_dir, log, cache_file) as (base, pid):
        complete(base, random_prompt(seed=3, length=1200))
        stop(pid)
    saved = cache_file.read_bytes()
    monkeypatch.setenv(FAULTS_ENV, "save_slow")
    log = tmp_path / "second.log"
    with server(tiny_model_dir, log, cache_file) as (base, pid):
        assert "prefix cache restored from" in log.read_text()
        complete(base, random_prompt(seed=4, length=1200))
        processes = psutil.Process(pid).children(recursive=True)  # engine core and worker
        os.kill(pid, signal.SIGTERM)
        wait_for(log, "prefix cache file: saving")
        time.sleep(0.3)
        for process in processes:  # kill -9 of the writer (the worker) and its engine core
            process.kill()
        psutil.wait_procs(processes, timeout=STOP_TIMEOUT_S)
        psutil.Process(pid).wait(STOP_TIMEOUT_S)
    assert "prefix cache saved to" not in log.read_text()
    assert cache_file.read_bytes() == saved
    temporaries = [n for n in os.listdir(tmp_path) if n.startswith(".cache.bin.")]
    assert len(temporaries) == 1  # what the next start removes (`remove_temporaries`)
