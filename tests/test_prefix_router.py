"""The reference scorer `examples/prefix_router.py` on two tiny-model OpenAI servers (issue
#19): sessions routed by their deepest resumable point keep one server's hit rate; round-robin,
which sends a session's turns to both servers in turn, loses it. Hit rates are the responses'
cached tokens over their prompt tokens, each scheme on its own sessions."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
from server_support import free_port, greedy_body, model_id, post, running_server

from examples.prefix_router import PrefixRouter
from vllm_hpc.tiny_model import DEFAULT_RECIPE

pytestmark = pytest.mark.engine

SESSIONS = 3
"""Odd, so that round-robin over two servers moves every session at each turn."""
TURNS = 3


@pytest.fixture(scope="module")
def servers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[str, str]]]:
    """Two servers started side by side, each with its event stream: name -> (base URL, ZMQ
    endpoint)."""
    logs = tmp_path_factory.mktemp("router")
    ports = {name: free_port() for name in ("A", "B")}
    starting = {
        name: running_server(
            tiny_model_dir,
            logs / f"{name}.log",
            "--gpu-memory-utilization",
            "0.1",
            "--host-cache-mib",
            "64",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "1024",
            "--kv-events-config",
            json.dumps(
                {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
            ),
            max_model_len=2048,
        )
        for name, port in ports.items()
    }
    with ExitStack() as stack, ThreadPoolExecutor(len(starting)) as pool:
        started = {name: pool.submit(server.__enter__) for name, server in starting.items()}
        bases = {}
        for name, future in started.items():
            if future.exception() is None:  # waits; a server that started is stopped at the end
                stack.push(starting[name].__exit__)
                bases[name] = future.result()[0]
        for future in started.values():
            future.result()  # the first start-up error, if any
        yield {name: (bases[name], f"tcp://127.0.0.1:{port}") for name, port in ports.items()}


def _hit_rate(
    servers: dict[str, tuple[str, str]], seed: int, pick: Callable[[list[int]], str]
) -> float:
    """Sessions of ``TURNS`` turns, the turns of all sessions interleaved; each turn sends the
    whole history plus a new message to the server ``pick`` names."""
    rng = random.Random(seed)
    vocab = DEFAULT_RECIPE.vocab_size
    histories = [[rng.randrange(vocab) for _ in range(300)] for _ in range(SESSIONS)]
    model = model_id(next(iter(servers.values()))[0])
    cached = total = 0
    for _ in range(TURNS):
        for history in histories:
            prompt = history + [rng.randrange(vocab) for _ in range(60)]
            status, body = post(servers[pick(prompt)][0], greedy_body(model, prompt, 8))
            assert status == 200, body
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            total += body["usage"]["prompt_tokens"]
            history[:] = prompt + body["choices"][0]["token_ids"]
    return cached / total


def test_routing_by_resumable_point_keeps_one_servers_hit_rate(
    servers: dict[str, tuple[str, str]],
) -> None:
    one = _hit_rate(servers, 1, lambda _: "A")
    turns = iter(range(10**6))
    round_robin = _hit_rate(servers, 2, lambda _: "AB"[next(turns) % 2])
    router = PrefixRouter({name: endpoint for name, (_, endpoint) in servers.items()})
    try:
        routed = _hit_rate(servers, 3, lambda prompt: router.route(prompt)[0])
        seen = {name: len(r.blocks) for name, r in router.replicas.items()}
    finally:
        router.close()
    print(f"hit rate: one server {one:.3f}, round-robin {round_robin:.3f}, scorer {routed:.3f}")
    assert all(seen.values()), f"a replica's stream gave nothing: {seen}"
    assert routed >= 0.95 * one
    assert round_robin < 0.8 * one
