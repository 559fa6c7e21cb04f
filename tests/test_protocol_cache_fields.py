"""The protocols' cache fields on vLLM's OpenAI and Anthropic servers with hybrid-prefix: an
Anthropic `cache_control` block becomes an exact tap, malformed or excess marks are 400s naming
the field, and `cache_read_input_tokens` (Anthropic) and `prompt_tokens_details.cached_tokens`
(OpenAI) equal the tokens the cache served (its `vllm:hpc_hit_tokens` counters), streamed or
not. One server, on the tiny model's chat template."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai_server import metrics, model_id, post, running_server

from vllm_hpc.tiny_model import DEFAULT_RECIPE

pytestmark = pytest.mark.engine

MARK = {"type": "ephemeral"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("protocol") / "server.log"
    with running_server(tiny_model_dir, log, "--gpu-memory-utilization", "0.2") as (base, _):
        yield base


def _words(seed: int, count: int) -> str:
    """Words of the tiny model's tokenizer, one token each."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(DEFAULT_RECIPE.vocab_size - 16)}" for _ in range(count))


def _hit_tokens(base: str) -> float:
    """Prompt tokens the hybrid prefix cache has served so far, from either tier."""
    lines = metrics(base).splitlines()
    return sum(
        float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:hpc_hit_tokens_total")
    )


def _messages_body(base: str, system: list[dict[str, Any]], user: list[dict[str, Any]]) -> dict:
    return {
        "model": model_id(base),
        "max_tokens": 2,
        "temperature": 0,
        "system": system,
        "messages": [{"role": "user", "content": user}],
    }


def _text(words: str, marked: bool = False) -> dict[str, Any]:
    return {"type": "text", "text": words, **({"cache_control": MARK} if marked else {})}


def _prompt_ids(base: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as vLLM renders the same conversation for the chat API."""
    system = "".join(block["text"] for block in body["system"])
    user = "\n".join(block["text"] for block in body["messages"][0]["content"])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    request = urllib.request.Request(
        f"{base}/tokenize",
        data=json.dumps({"model": body["model"], "messages": messages}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return list(json.loads(response.read())["tokens"])


def _stream(base: str, endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer."""
    request = urllib.request.Request(
        f"{base}/v1/{endpoint}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        lines = response.read().decode().splitlines()
    data = [x.removeprefix("data:").strip() for x in lines if x.startswith("data:")]
    return [json.loads(x) for x in data if x != "[DONE]"]


def _parting(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


@pytest.mark.parametrize("marked", [True, False])
def test_a_cache_control_block_is_an_exact_tap(server: str, marked: bool) -> None:
    """Two requests share a system prompt and a user block, which the first follows with another
    block. With the shared block marked, the second is served from the cache up to exactly
    where the prompts part (the block's end, inside a 64-token block and past the template's
    system-end tap); unmarked, it is not."""
    seed = 100 if marked else 200
    system = [_text(_words(seed, 90))]
    shared = _text(_words(seed + 1, 70), marked)
    first = _messages_body(server, system, [shared, _text(_words(seed + 2, 30))])
    second = _messages_body(server, system, [shared])
    parting = _parting(_prompt_ids(server, first), _prompt_ids(server, second))
    assert parting % 64 and parting > 100
    for body in (first, second):
        status, answer = post(server, body, endpoint="messages")
        assert status == 200, answer
    cached = answer["usage"]["cache_read_input_tokens"]
    assert (cached == parting) is marked, (cached, parting)


def test_malformed_and_excess_cache_control_are_client_errors(server: str) -> None:
    system = [_text(_words(300, 20))]
    cases = {
        "messages.0.content.0.cache_control.type": {"type": "persistent"},
        "messages.0.content.0.cache_control.ttl": {"type": "ephemeral", "ttl": "2h"},
        "messages.0.content.0.cache_control.scope": {"type": "ephemeral", "scope": "all"},
        "messages.0.content.0.cache_control": "ephemeral",
    }
    for field, mark in cases.items():
        body = _messages_body(server, system, [{**_text("w1 w2"), "cache_control": mark}])
        status, answer = post(server, body, endpoint="messages")
        assert status == 400 and field in answer["error"]["message"], (field, answer)
    bad_system = [{**system[0], "cache_control": {"type": "persistent"}}]
    status, answer = post(server, _messages_body(server, bad_system, [_text("w1")]), "messages")
    assert status == 400 and "system.0.cache_control.type" in answer["error"]["message"], answer
    # A client's own malformed breakpoints beside a mark are still refused, naming them.
    body = {**_messages_body(server, system, [_text("w1 w2", marked=True)])}
    body["vllm_xargs"] = {"cache_breakpoints": ["soon"]}
    status, answer = post(server, body, endpoint="messages")
    assert status == 400 and "cache_breakpoints" in answer["error"]["message"], answer
    five = [_text(f"w{i}", marked=True) for i in range(5)]
    status, answer = post(server, _messages_body(server, system, five), endpoint="messages")
    assert status == 400 and "cache_control" in answer["error"]["message"], answer
    status, answer = post(server, _messages_body(server, system, five[:4]), endpoint="messages")
    assert status == 200, answer


def test_cached_tokens_are_the_tokens_served_from_the_cache(server: str) -> None:
    """Each API's cache field, streamed and not, equals what the cache's counters say it served
    for that request; the first request of the conversation is served nothing."""
    system = [_text(_words(400, 100))]
    body = _messages_body(server, system, [_text(_words(401, 40))])
    chat = {
        "model": body["model"],
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": system[0]["text"]},
            {"role": "user", "content": body["messages"][0]["content"][0]["text"]},
        ],
    }

    def served(send: Any) -> tuple[int, float]:
        before = _hit_tokens(server)
        reported = send()
        return reported, _hit_tokens(server) - before

    def anthropic() -> int:
        status, answer = post(server, body, endpoint="messages")
        assert status == 200, answer
        return int(answer["usage"]["cache_read_input_tokens"])

    def anthropic_stream() -> int:
        events = _stream(server, "messages", body)
        start = events[0]["message"]["usage"]
        end = next(e for e in events if e["type"] == "message_delta")["usage"]
        assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"]
        assert start["input_tokens"] == end["input_tokens"]
        return int(start["cache_read_input_tokens"])

    def openai() -> int:
        status, answer = post(server, chat, endpoint="chat/completions")
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    def openai_stream() -> int:
        events = _stream(
            server, "chat/completions", {**chat, "stream_options": {"include_usage": True}}
        )
        return int(events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert served(anthropic) == (0, 0)
    for send in (anthropic, anthropic_stream, openai, openai_stream):
        reported, counted = served(send)
        assert reported == counted > 0, send.__name__
