"""The OpenAI server with `--kv-cache-manager hybrid-prefix`: token-id prompts, cached-token
reporting, the plugin's Prometheus metrics, and a malformed request that must not hurt it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_support import random_prompt

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--max-model-len",
        "4096",
        "--gpu-memory-utilization",
        "0.2",
        "--enable-prompt-tokens-details",
        "--kv-cache-manager",
        "hybrid-prefix",
    ]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if process.poll() is not None:
                pytest.fail(f"server exited:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"server did not start:\n{log.read_text()[-3000:]}")
        yield base
    finally:
        process.terminate()
        process.wait(timeout=60)


def _post(base: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def _complete(base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    status, body = _post(
        base,
        {
            "model": _model(base),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    return body


def _model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def test_next_turn_reports_its_endpoint_as_cached(server: str) -> None:
    prompt = random_prompt(seed=1, length=1200)
    first = _complete(server, prompt, 80)
    answer = first["choices"][0]["token_ids"]
    assert len(answer) == 80
    second = _complete(server, prompt + answer + random_prompt(seed=2, length=100), 8)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(prompt) + 80 - 1


def test_plugin_metrics_are_exported(server: str) -> None:
    with urllib.request.urlopen(f"{server}/metrics", timeout=10) as response:
        text = response.read().decode()
    hits = [line for line in text.splitlines() if line.startswith("vllm:hpc_hit_tokens_total")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) > 0
    assert "vllm:hpc_snapshots_published_total" in text
    assert "vllm:hpc_snapshots{" in text


def test_malformed_cache_hint_is_a_client_error(server: str) -> None:
    status, body = _post(
        server,
        {
            "model": _model(server),
            "prompt": random_prompt(seed=3, length=100),
            "max_tokens": 4,
            "vllm_xargs": {"cache_breakpoints": ["soon"]},
        },
    )
    assert status == 400, body
    assert "cache_breakpoints" in json.dumps(body)
    assert _complete(server, random_prompt(seed=4, length=100), 4)["choices"]  # still serving
