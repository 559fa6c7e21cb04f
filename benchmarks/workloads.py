"""Token-id workloads for the prefix-cache hit-rate benchmark (`benchmarks/hit_rate.py`).

A workload is a generator: it yields one prompt at a time and receives that prompt's greedy
answer before yielding the next, so a workload whose next prompt depends on the model's output
(the agent loop) follows each engine's own answers. Contents are random token ids from fixed
seeds: only the shape of the reuse matters, not the text. `scale` shrinks every length (not the
number of requests) for quick development runs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator

from vllm_hpc.tiny_model import DEFAULT_RECIPE

Workload = Generator[list[int], list[int], None]
"""Yields prompts; is sent each prompt's generated tokens."""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(DEFAULT_RECIPE.vocab_size) for _ in range(n)]


def _user(rng: random.Random, scale: float) -> list[int]:
    return _tokens(rng, int(rng.randint(150, 300) * scale))


def rerendered_chat(scale: float = 1.0, seed: int = 1, turns: int = 5) -> Workload:
    """Multi-turn chat whose client re-renders the history, as chat templates that strip the
    thinking do: the reply in the next prompt is different tokens of about the reply's length
    (+-8), so only the previous prompt itself can be reused.

    Shape: 1200-token system prompt, then per turn a 150-300-token user message; 5 turns.
    """
    rng = random.Random(seed)
    prompt = _tokens(rng, int(1200 * scale)) + _user(rng, scale)
    for _ in range(turns - 1):
        answer = yield prompt
        reply = _tokens(rng, max(1, len(answer) + rng.randint(-8, 8)))
        prompt = prompt + reply + _user(rng, scale)
    yield prompt


def agent_loop(scale: float = 1.0, seed: int = 2, turns: int = 6) -> Workload:
    """An agent loop: the next prompt echoes the generated answer token for token and appends
    a tool result, so everything the engine computed (prompt and answer) can be reused.

    Shape: 1500-token system+tools preamble and a 200-token task, then per turn the answer and
    a 150-600-token tool result; 6 turns.
    """
    rng = random.Random(seed)
    prompt = _tokens(rng, int(1700 * scale))
    for _ in range(turns - 1):
        answer = yield prompt
        prompt = prompt + answer + _tokens(rng, int(rng.randint(150, 600) * scale))
    yield prompt


def branching(scale: float = 1.0, seed: int = 3, branches: int = 8) -> Workload:
    """Retries and edits deep in the history: after one long conversation, each request keeps
    the long prompt up to a random depth and continues with new tokens (an edited message, or
    a retry from an earlier turn). Branches share only the long prompt's prefixes, so reuse
    depends on how deep into an earlier prompt the cache can resume.

    Shape: a 4000-token prompt, then 8 branches cut uniformly at 10-100 % of it, each followed
    by 100-300 new tokens.
    """
    rng = random.Random(seed)
    length = int(4000 * scale)
    history = _tokens(rng, length)
    yield history
    for _ in range(branches):
        cut = rng.randint(length // 10, length)
        yield history[:cut] + _tokens(rng, int(rng.randint(100, 300) * scale))


def shared_preamble(scale: float = 1.0, seed: int = 4, sessions: int = 8) -> Workload:
    """Many sessions that share one long system+tools preamble and nothing else, arriving one
    after another: every session after the first can reuse exactly the preamble.

    Shape: 1500-token preamble; 8 sessions, each the preamble plus a 100-300-token user message.
    """
    rng = random.Random(seed)
    preamble = _tokens(rng, int(1500 * scale))
    for _ in range(sessions):
        yield preamble + _tokens(rng, int(rng.randint(100, 300) * scale))


WORKLOADS: dict[str, Callable[[float], Workload]] = {
    "rerendered chat": rerendered_chat,
    "agent loop": agent_loop,
    "branching": branching,
    "shared preamble": shared_preamble,
}
