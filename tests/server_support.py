"""A vLLM OpenAI server with hybrid-prefix in a child process, and plain-HTTP calls to it.

Used by the server tests (`tests/test_server.py` and others) and by the soak
(`benchmarks/soak.py`, which imports it from here). The server audits the cache's invariants at
every engine step (`VLLM_HPC_AUDIT_EVERY_STEP`), so a broken invariant shows as a dead engine:
every later request answers 500.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_hpc.exactness import Parting, first_parting
from vllm_hpc.glue.scheduler.kv_manager import AUDIT_ENV

START_TIMEOUT_S = 300


class ServerError(RuntimeError):
    """The server exited or did not start; the message ends with its log's tail."""


def log_tail(log: Path, lines: int = 100, width: int = 300) -> str:
    """The last ``lines`` lines of a server's log for a failure's message, each cut to
    ``width`` characters: a metrics line alone can fill a tail by characters, hiding the stop's
    lines before it. The route table is left out."""
    kept = [line[:width] for line in log.read_text().splitlines() if "Route: " not in line]
    return "\n".join(kept[-lines:])


def free_port() -> int:
    """A TCP port free on this machine now (for a server or an event stream)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SERVER_PAGES = 4096
"""Device pages of a server whose options do not size the pool: 262,144 tokens of the tiny
model's KV when no request runs (a running request's state takes a row of 25 of them)."""
SERVER_HOST_MIB = 256
"""Host tier of a server whose options do not size it: 8,192 slabs of the tiny model's blocks."""
SHARED_GPU_ENV = "VLLM_HPC_TEST_KV_CACHE_GIB"
"""Set on a CUDA machine to run several test processes on one GPU at once: every test engine and
server then gets that fixed KV budget (``kv_cache_memory_bytes``, no memory profiling that a
neighbour could skew) and asks vLLM for only 5% of the device at start-up."""


def shared_gpu_kv_bytes() -> int | None:
    """The fixed KV budget of each engine under `SHARED_GPU_ENV`, or None when unset."""
    gib = os.environ.get(SHARED_GPU_ENV)
    return int(float(gib) * 2**30) if gib else None


@contextmanager
def running_server(
    model: Path, log: Path, *extra: str, max_model_len: int = 4096, eager: bool = True
) -> Iterator[tuple[str, int]]:
    """An OpenAI server with hybrid-prefix on ``model`` (eager, or vLLM's default torch.compile
    and CUDA graphs when ``eager`` is false), with vLLM's options ``extra``; yields its base URL
    and process id, which is also its process group's id. It audits the cache at every engine
    step, which costs time in proportion to the device pages and host slabs: unless ``extra``
    sizes them, the server gets `SERVER_PAGES` and `SERVER_HOST_MIB` (with a 0.2 memory share
    of a 24 GiB machine and the default 8 GiB host tier, the audit took 0.4 s a step: 32 s for
    80 tokens, against 2.4 s with these)."""
    port = free_port()
    if "--num-gpu-blocks-override" not in extra:
        extra = (*extra, "--num-gpu-blocks-override", str(SERVER_PAGES))
    if "--host-cache-mib" not in extra:
        extra = (*extra, "--host-cache-mib", str(SERVER_HOST_MIB))
    shared = shared_gpu_kv_bytes()
    if shared is not None:  # last, so that they win over a test's own memory share
        extra = (*extra, "--kv-cache-memory-bytes", str(shared), "--gpu-memory-utilization", "0.05")
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(["--enforce-eager"] if eager else []),
        "--max-model-len",
        str(max_model_len),
        "--enable-prompt-tokens-details",
        "--kv-cache-manager",
        "hybrid-prefix",
        *extra,
    ]
    env = {**os.environ, AUDIT_ENV: "1"}
    with log.open("w") as out:  # a process group of its own, as a terminal or systemd gives it
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if process.poll() is not None:
                raise ServerError(f"server exited:\n{log_tail(log)}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            raise ServerError(f"server did not start:\n{log_tail(log)}")
        yield base, process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


def post_raw(
    base: str, data: bytes, endpoint: str = "completions", headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """POST ``data`` as it is (with ``headers``, e.g. vLLM's ``X-data-parallel-rank``); the
    status and the body's text."""
    request = urllib.request.Request(
        f"{base}/v1/{endpoint}",
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def post(
    base: str,
    body: dict[str, Any],
    endpoint: str = "completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """POST ``body`` as JSON; the status and the decoded answer."""
    status, text = post_raw(base, json.dumps(body).encode(), endpoint, headers)
    return status, json.loads(text or "{}")


def greedy_body(
    model: str, prompt: list[int], max_tokens: int, cold_salt: str | None = None
) -> dict[str, Any]:
    """A greedy completion of token ids that returns its token ids. With ``cold_salt``, a cold
    reference: the salt misses every cache entry, and the top-2 logprobs give each token's
    margin (`parting_from_cold`)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if cold_salt is not None:
        body.update(cache_salt=cold_salt, logprobs=2)
    return body


def parting_from_cold(tokens: list[int], cold_choice: dict[str, Any]) -> Parting | None:
    """Where ``tokens`` first part from a cold reference's choice (`greedy_body` with a salt),
    with the cold run's top-1 margin there; None when they are the same."""
    margins = []
    for top in cold_choice["logprobs"]["top_logprobs"]:
        best = sorted(top.values(), reverse=True)
        margins.append(best[0] - best[1])
    return first_parting(tokens, cold_choice["token_ids"], margins)


def model_id(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def metrics(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        return str(response.read().decode())


def sample(text: str, prefix: str, label: str = "") -> float:
    """The value of the first Prometheus sample whose line starts with ``prefix`` and names
    ``label``."""
    line = next(x for x in text.splitlines() if x.startswith(prefix) and label in x)
    return float(line.rsplit(" ", 1)[1])
