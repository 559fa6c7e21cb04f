"""Token-id workloads for the prefix-cache benchmarks (`hit_rate.py`, `replay.py`).

A workload is a generator: it yields one prompt at a time and receives that prompt's greedy
answer before yielding the next, so a workload whose next prompt depends on the model's output
(the agent loop) follows each engine's own answers. Contents are random token ids from fixed
seeds: only the shape of the reuse matters, not the text. A `Shape` gives the model's vocabulary
and a factor on every length (not on the number of requests), so the same workloads serve the
tiny CPU model and a full-size GPU model. A scenario is a list of `Session`s, each a workload
with a start time; `mix` starts sessions of every kind at Poisson arrival times.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator
from dataclasses import dataclass

from vllm_hpc.tiny_model import DEFAULT_RECIPE

Workload = Generator[list[int], list[int], None]
"""Yields prompts; is sent each prompt's generated tokens."""


@dataclass(frozen=True)
class Shape:
    """What a workload needs to know about the model and the run's size."""

    vocab: int = DEFAULT_RECIPE.vocab_size
    scale: float = 1.0
    """Factor on every length; the documented shapes are at 1."""

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.vocab) for _ in range(n)]

    def scaled(self, n: int) -> int:
        return max(1, int(n * self.scale))


@dataclass
class Session:
    """One client's requests, sent one after another from `start_s` on."""

    kind: str
    start_s: float
    turns: Workload


def _user(rng: random.Random, shape: Shape) -> list[int]:
    return shape.tokens(rng, shape.scaled(rng.randint(150, 300)))


def rerendered_chat(shape: Shape, seed: int = 1, turns: int = 5) -> Workload:
    """Multi-turn chat whose client re-renders the history, as chat templates that strip the
    thinking do: the reply in the next prompt is different tokens of about the reply's length
    (+-8), so only the previous prompt itself can be reused.

    Shape: 1200-token system prompt, then per turn a 150-300-token user message; 5 turns.
    """
    rng = random.Random(seed)
    prompt = shape.tokens(rng, shape.scaled(1200)) + _user(rng, shape)
    for _ in range(turns - 1):
        answer = yield prompt
        reply = shape.tokens(rng, max(1, len(answer) + rng.randint(-8, 8)))
        prompt = prompt + reply + _user(rng, shape)
    yield prompt


def agent_loop(shape: Shape, seed: int = 2, turns: int = 6) -> Workload:
    """An agent loop: the next prompt echoes the generated answer token for token and appends
    a tool result, so everything the engine computed (prompt and answer) can be reused.

    Shape: 1500-token system+tools preamble and a 200-token task, then per turn the answer and
    a 150-600-token tool result; 6 turns.
    """
    rng = random.Random(seed)
    prompt = shape.tokens(rng, shape.scaled(1700))
    for _ in range(turns - 1):
        answer = yield prompt
        prompt = prompt + answer + shape.tokens(rng, shape.scaled(rng.randint(150, 600)))
    yield prompt


def branching(shape: Shape, seed: int = 3, branches: int = 8) -> Workload:
    """Retries and edits deep in the history: after one long conversation, each request keeps
    the long prompt up to a random depth and continues with new tokens (an edited message, or
    a retry from an earlier turn). Branches share only the long prompt's prefixes, so reuse
    depends on how deep into an earlier prompt the cache can resume.

    Shape: a 4000-token prompt, then 8 branches cut uniformly at 10-100 % of it, each followed
    by 100-300 new tokens.
    """
    rng = random.Random(seed)
    length = shape.scaled(4000)
    history = shape.tokens(rng, length)
    yield history
    for _ in range(branches):
        cut = rng.randint(length // 10, length)
        yield history[:cut] + shape.tokens(rng, shape.scaled(rng.randint(100, 300)))


def shared_preamble(
    shape: Shape, seed: int = 4, sessions: int = 8, user_seed: int | None = None
) -> Workload:
    """Many sessions that share one long system+tools preamble and nothing else, arriving one
    after another: every session after the first can reuse exactly the preamble. `user_seed`
    draws the messages apart from the preamble, so sessions of a mix share the preamble only.

    Shape: 1500-token preamble; 8 sessions, each the preamble plus a 100-300-token user message.
    """
    rng = random.Random(seed)
    preamble = shape.tokens(rng, shape.scaled(1500))
    users = rng if user_seed is None else random.Random(user_seed)
    for _ in range(sessions):
        yield preamble + shape.tokens(users, shape.scaled(users.randint(100, 300)))


WORKLOADS: dict[str, Callable[[Shape], Workload]] = {
    "rerendered chat": rerendered_chat,
    "agent loop": agent_loop,
    "branching": branching,
    "shared preamble": shared_preamble,
}


def mix(
    shape: Shape, rate: float, sessions: int = 12, seed: int = 5, branch: Shape | None = None
) -> list[Session]:
    """Sessions of the four kinds above, in turn, starting at Poisson arrival times of `rate`
    sessions per second; every kind keeps its own reuse, and the preamble sessions share one
    preamble among themselves, so the cache serves several clients at once. `branch` sizes the
    branching sessions apart (a long history is what makes a deep edit costly).

    Shape per session, smaller than alone: chat 3 turns, agent loop 3 turns, branching a
    history and 3 branches, preamble 2 requests; 12 sessions.
    """
    kinds: list[tuple[str, Callable[[int], Workload]]] = [
        ("rerendered chat", lambda s: rerendered_chat(shape, s, turns=3)),
        ("agent loop", lambda s: agent_loop(shape, s, turns=3)),
        ("branching", lambda s: branching(branch or shape, s, branches=3)),
        ("shared preamble", lambda s: shared_preamble(shape, seed, sessions=2, user_seed=s)),
    ]
    out = []
    for i, start in enumerate(arrivals(rate, sessions, seed)):
        kind, make = kinds[i % len(kinds)]
        out.append(Session(kind, start, make(100 + i)))
    return out


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Start times of `n` sessions: a Poisson process of `rate` per second, the first at 0."""
    rng = random.Random(seed)
    starts = [0.0]
    while len(starts) < n:
        starts.append(starts[-1] + rng.expovariate(rate))
    return starts[:n]
