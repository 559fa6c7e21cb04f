"""vLLM's OpenAI and Anthropic servers with `--kv-cache-manager hybrid-prefix`: token-id
prompts, cached-token reporting, the plugin's Prometheus metrics (every series the Grafana
dashboard reads), malformed requests that must not hurt it, chat requests whose template marks
the generation opener and the system block's end (§7.1), and the protocols' cache fields: an
Anthropic `cache_control` block becomes an exact tap, malformed or excess marks are 400s naming
the field, and `cache_read_input_tokens` (Anthropic) and `prompt_tokens_details.cached_tokens`
(OpenAI) equal the tokens the cache served (its `vllm:hpc_hit_tokens` counters), streamed or
not. One server for all (each start costs about a minute); it checks the cache's invariants at
each engine step."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import random_prompt
from prometheus_client.parser import text_string_to_metric_families
from server_support import (
    greedy_body,
    metrics,
    model_id,
    parting_from_cold,
    post,
    post_raw,
    running_server,
    sample,
)
from test_dashboard import dashboard_series

from vllm_hpc.tiny_model import DEFAULT_RECIPE

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(tiny_model_dir, log, "--gpu-memory-utilization", "0.2") as (base, _):
        yield base


def _complete(base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    status, body = post(base, greedy_body(model_id(base), prompt, max_tokens))
    assert status == 200, body
    return body


def test_next_turn_reports_its_endpoint_as_cached(server: str) -> None:
    prompt = random_prompt(seed=1, length=1200)
    first = _complete(server, prompt, 80)
    answer = first["choices"][0]["token_ids"]
    assert len(answer) == 80
    second = _complete(server, prompt + answer + random_prompt(seed=2, length=100), 8)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(prompt) + 80 - 1


def test_plugin_metrics_are_exported(server: str) -> None:
    text = metrics(server)
    assert sample(text, "vllm:hpc_hit_tokens_total") > 0
    assert "vllm:hpc_snapshots_published_total" in text
    assert "vllm:hpc_snapshots{" in text
    # The first turn's blocks and endpoint were written through to the host tier, timed by the
    # worker: the bytes and seconds give the bandwidth, also reported as a gauge.
    assert sample(text, "vllm:hpc_host_bytes_total{", 'what="written"') > 0
    assert sample(text, "vllm:hpc_host_transfer_seconds_total{", 'what="written"') > 0
    assert sample(text, "vllm:hpc_host_write_bytes_per_second{") > 0
    # The engine thread's own time in the host tier's calls (issuing, checking) is reported.
    assert sample(text, "vllm:hpc_engine_thread_host_seconds_total{") > 0


def test_every_series_the_dashboard_reads_is_exported_with_its_labels(server: str) -> None:
    """The Grafana dashboard's queries (`examples/observability/`), against this server's
    `/metrics` after cache hits and host-tier writes: each metric they read has a sample with
    every label they select or group it by."""
    samples: dict[str, list[set[str]]] = {}
    for family in text_string_to_metric_families(metrics(server)):
        for s in family.samples:
            samples.setdefault(s.name, []).append(set(s.labels))
    for name, labels in dashboard_series().items():
        assert name in samples, name
        assert any(labels <= present for present in samples[name]), (name, labels)


def test_malformed_cache_hint_is_a_client_error(server: str) -> None:
    status, body = post(
        server,
        {
            "model": model_id(server),
            "prompt": random_prompt(seed=3, length=100),
            "max_tokens": 4,
            "vllm_xargs": {"cache_breakpoints": ["soon"]},
        },
    )
    assert status == 400, body
    assert "cache_breakpoints" in json.dumps(body)
    assert _complete(server, random_prompt(seed=4, length=100), 4)["choices"]  # still serving


def test_a_breakpoint_beyond_the_prompt_is_a_client_error(server: str) -> None:
    """A position past the prompt's last token is a 400 naming the field and the prompt's
    length; one at the last token is served."""
    prompt = random_prompt(seed=5, length=200)
    for beyond in (201, 10_000_000):
        body = {
            "model": model_id(server),
            "prompt": prompt,
            "max_tokens": 4,
            "vllm_xargs": {"cache_breakpoints": [64, beyond]},
        }
        status, answer = post(server, body)
        assert status == 400, answer
        message = answer["error"]["message"]
        assert "cache_breakpoints" in message and "200 tokens" in message, message
    body["vllm_xargs"] = {"cache_breakpoints": [64, 200]}
    status, answer = post(server, body)
    assert status == 200, answer


def _text(seed: int, words: int) -> str:
    """Words of the tiny model's tokenizer (``w0``, ``w1``, ...), one token each."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(DEFAULT_RECIPE.vocab_size - 16)}" for _ in range(words))


def _chat(base: str, messages: list[dict[str, str]], max_tokens: int = 16) -> dict[str, Any]:
    status, body = post(
        base,
        {
            "model": model_id(base),
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        endpoint="chat/completions",
    )
    assert status == 200, body
    return body


def _assert_matches_cold(base: str, reply: dict[str, Any]) -> None:
    """The greedy tokens equal a cold run of the same prompt ids (a fresh cache salt misses
    every entry), except at a near-tie of the cold run (`vllm_hpc.exactness`)."""
    answer = reply["choices"][0]["token_ids"]
    salt = f"cold-{random.random()}"
    status, cold = post(
        base, greedy_body(model_id(base), reply["prompt_token_ids"], len(answer), salt)
    )
    assert status == 200, cold
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    parting = parting_from_cold(answer, cold["choices"][0])
    assert parting is None or parting.near_tie, parting.describe()


def _cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


MESSAGE_START = DEFAULT_RECIPE.vocab_size - 2  # <|im_start|> in the tiny model's tokenizer


def test_rerendered_chat_turn_resumes_at_the_generation_opener(server: str) -> None:
    """Turn 2 re-renders turn 1's answer differently (as a template stripping the thinking does):
    the opener tap of turn 1, at its final message start, is the deepest reusable point, deeper
    than the 64-token block boundary below it."""
    system = {"role": "system", "content": _text(10, 100)}
    user = {"role": "user", "content": _text(11, 120)}
    first = _chat(server, [system, user])
    opener = len(first["prompt_token_ids"]) - 3  # <|im_start|> assistant \n
    assert first["prompt_token_ids"][opener] == MESSAGE_START
    assert opener % 64 > 0
    rewritten = {"role": "assistant", "content": _text(12, 20)}
    second = _chat(server, [system, user, rewritten, {"role": "user", "content": _text(13, 30)}])
    assert second["prompt_token_ids"][: opener + 3] == first["prompt_token_ids"]
    assert _cached(second) == opener
    _assert_matches_cold(server, second)


def test_new_conversation_resumes_at_the_end_of_the_shared_system_block(server: str) -> None:
    system = {"role": "system", "content": _text(20, 100)}
    first = _chat(server, [system, {"role": "user", "content": _text(21, 120)}])
    system_end = first["prompt_token_ids"].index(MESSAGE_START, 1)
    assert system_end % 64 > 0
    other = _chat(server, [system, {"role": "user", "content": _text(22, 80)}])
    shared = system_end + 1
    assert other["prompt_token_ids"][:shared] == first["prompt_token_ids"][:shared]
    assert _cached(other) == system_end
    _assert_matches_cold(server, other)


def test_a_token_id_outside_the_vocabulary_is_a_400_without_a_tokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """vLLM checks token ids only against a tokenizer; without one, an id beyond the
    vocabulary killed the engine core. The plugin refuses it, and the server keeps serving."""
    extra = ("--gpu-memory-utilization", "0.1", "--skip-tokenizer-init")
    with running_server(tiny_model_dir, tmp_path / "server.log", *extra) as (base, _):
        for bad in (1_000_000_000, DEFAULT_RECIPE.vocab_size, -1):
            status, body = post(base, {"model": model_id(base), "prompt": [1, bad, 3]})
            assert status == 400, body
            # A negative id is already refused by vLLM's request schema, naming the field.
            expected = "body.prompt" if bad < 0 else f"token id {bad} is out of the model's"
            assert expected in json.dumps(body)
        assert len(_complete(base, random_prompt(seed=5, length=100), 4)["choices"]) == 1


EXPECTED = {
    "prompt": ("prompt", "token id"),
    "max_model_len": ("context length",),
    "max_tokens": ("max_tokens",),
    "n": ("n must",),
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "logprobs": ("logprobs",),
    "vllm_xargs": ("vllm_xargs",),
    "cache_breakpoints": ("cache_breakpoints",),
    "json": ("body",),
}
"""What the answer to a malformed request of each kind must name (vLLM's messages, and the
plugin's for its own fields)."""


def _hostile_bodies(model: str, seed: int) -> list[tuple[str, bytes]]:
    """Malformed completion requests in a seeded order, each with the kind of its fault."""
    rng = random.Random(seed)
    vocab = DEFAULT_RECIPE.vocab_size

    def ok_prompt() -> list[int]:
        return random_prompt(seed=rng.randrange(10**6), length=rng.randrange(2, 200))

    def body(kind: str, **changes: Any) -> tuple[str, bytes]:
        request = {"model": model, "prompt": ok_prompt(), "max_tokens": 4, **changes}
        return kind, json.dumps(request).encode()

    cases = [
        body("prompt", prompt=[]),
        body("prompt", prompt=[1, -rng.randrange(1, 10**9), 3]),
        body("prompt", prompt=[1, vocab + rng.randrange(10**9), 3]),
        body("prompt", prompt=[1, 2.5, 3]),
        body("prompt", prompt=[1, "x", 3]),
        body("prompt", prompt={"ids": [1, 2]}),
        body("prompt", prompt=[[1, 2], [3, -4]]),
        body("prompt", prompt=None),
        body("max_model_len", prompt=random_prompt(seed=7, length=5000)),
        body("max_tokens", max_tokens=10**12),
        body("max_tokens", max_tokens=-3),
        body("max_tokens", max_tokens="many"),
        body("n", n=10**6),
        body("n", n=0),
        body("n", n=-1),
        body("temperature", temperature=-1),
        body("top_p", top_p=7),
        body("logprobs", logprobs=10**6),
        body("vllm_xargs", vllm_xargs="cache_breakpoints"),
        body("vllm_xargs", vllm_xargs=[1, 2]),
        body("vllm_xargs", vllm_xargs=17),
    ]
    if not torch.cuda.is_available():  # vLLM's CPU kernel: see vllm_hpc/glue/frontend/token_ids.py
        cases.append(body("prompt", prompt=[rng.randrange(vocab)]))
    for wrong in ("soon", 5, [1.5], [-1], [0], [[64]], {"at": 64}, [64] * 100, None, [10**7]):
        cases.append(body("cache_breakpoints", vllm_xargs={"cache_breakpoints": wrong}))
    cases += [
        ("json", b'{"model": "x", "prompt": [1, 2'),
        ("json", b"\xff\xfe\x00garbage"),
        ("json", b""),
        ("json", b"[]"),
    ]
    rng.shuffle(cases)
    return cases


def test_hostile_requests_are_client_errors_and_the_cache_stays_exact(server: str) -> None:
    """Malformed bodies, each answered 400 naming what is wrong, between the turns of a
    conversation whose next turn still resumes from its endpoint exactly. The server's engine
    checks the cache's invariants at every step (`VLLM_HPC_AUDIT_EVERY_STEP`)."""
    model = model_id(server)
    prompt = random_prompt(seed=8, length=900)
    first = _complete(server, prompt, 80)
    for kind, data in _hostile_bodies(model, seed=1):
        status, text = post_raw(server, data)
        assert status == 400, (kind, status, text[:500])
        assert any(word in text.lower() for word in EXPECTED[kind]), (kind, text[:500])
    # A breakpoint at position 1 is served (ignored: it would save one token).
    edge = post(
        server,
        {
            "model": model,
            "prompt": prompt[:50],
            "max_tokens": 2,
            "vllm_xargs": {"cache_breakpoints": [1]},
        },
    )
    assert edge[0] == 200, edge
    turn = prompt + first["choices"][0]["token_ids"] + random_prompt(seed=9, length=60)
    second = _complete(server, turn, 8)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 80 - 1
    _assert_matches_cold(server, {**second, "prompt_token_ids": turn})


CACHE_MARK = {"type": "ephemeral"}


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


def _text_block(words: str, marked: bool = False) -> dict[str, Any]:
    return {"type": "text", "text": words, **({"cache_control": CACHE_MARK} if marked else {})}


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
    system = [_text_block(_text(seed, 90))]
    shared = _text_block(_text(seed + 1, 70), marked)
    first = _messages_body(server, system, [shared, _text_block(_text(seed + 2, 30))])
    second = _messages_body(server, system, [shared])
    parting = _parting(_prompt_ids(server, first), _prompt_ids(server, second))
    assert parting % 64 and parting > 100
    for body in (first, second):
        status, answer = post(server, body, endpoint="messages")
        assert status == 200, answer
    cached = answer["usage"]["cache_read_input_tokens"]
    assert (cached == parting) is marked, (cached, parting)


def test_malformed_and_excess_cache_control_are_client_errors(server: str) -> None:
    system = [_text_block(_text(300, 20))]
    cases = {
        "messages.0.content.0.cache_control.type": {"type": "persistent"},
        "messages.0.content.0.cache_control.ttl": {"type": "ephemeral", "ttl": "2h"},
        "messages.0.content.0.cache_control.scope": {"type": "ephemeral", "scope": "all"},
        "messages.0.content.0.cache_control": "ephemeral",
    }
    for field, mark in cases.items():
        body = _messages_body(server, system, [{**_text_block("w1 w2"), "cache_control": mark}])
        status, answer = post(server, body, endpoint="messages")
        assert status == 400 and field in answer["error"]["message"], (field, answer)
    bad_system = [{**system[0], "cache_control": {"type": "persistent"}}]
    status, answer = post(
        server, _messages_body(server, bad_system, [_text_block("w1")]), "messages"
    )
    assert status == 400 and "system.0.cache_control.type" in answer["error"]["message"], answer
    # A client's own malformed breakpoints beside a mark are still refused, naming them.
    body = {**_messages_body(server, system, [_text_block("w1 w2", marked=True)])}
    body["vllm_xargs"] = {"cache_breakpoints": ["soon"]}
    status, answer = post(server, body, endpoint="messages")
    assert status == 400 and "cache_breakpoints" in answer["error"]["message"], answer
    five = [_text_block(f"w{i}", marked=True) for i in range(5)]
    status, answer = post(server, _messages_body(server, system, five), endpoint="messages")
    assert status == 400 and "cache_control" in answer["error"]["message"], answer
    status, answer = post(server, _messages_body(server, system, five[:4]), endpoint="messages")
    assert status == 200, answer


def test_cached_tokens_are_the_tokens_served_from_the_cache(server: str) -> None:
    """Each API's cache field, streamed and not, equals what the cache's counters say it served
    for that request; the first request of the conversation is served nothing."""
    system = [_text_block(_text(400, 100))]
    body = _messages_body(server, system, [_text_block(_text(401, 40))])
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
