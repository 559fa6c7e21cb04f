"""Public request traces (`../shared/traces/`, README there) as replayable sessions of token ids.

A trace row gives its prompt as chained block hash ids (equal ids mean equal whole prefixes)
and its length. Each id becomes a deterministic block of random token ids seeded by the trace
and the id, so equal ids give equal prefixes and the cache sees the trace's sharing exactly;
the last block is cut to the row's length. The trace's own answers are not replayed: the next
prompt is the next row, whatever the engine generated (as a client that re-renders history).

Sessions: the LMCache agent traces name them (`session_id`). The Mooncake conversation trace
does not; a row joins the session of the earlier row it shares its deepest block with, beyond
block 0 (the prefix every row shares), and starts a new session otherwise. Rows are kept in
trace order within a session; sessions start at the caller's arrival times, not the trace's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workloads import Shape, Workload

TRACES = Path(__file__).parents[2] / "shared" / "traces"
"""Default location: the steering repository's `shared/traces`, beside this checkout."""


@dataclass(frozen=True)
class Trace:
    """One trace file and the block size of its hash ids."""

    file: str
    block: int


MOONCAKE = Trace("mooncake_fast25_conversation_trace.jsonl", 512)
MINISWE = Trace("lmcache_agent_miniswe_blk64.jsonl", 64)


@dataclass(frozen=True)
class Row:
    hash_ids: tuple[int, ...]
    length: int


def _rows(path: Path) -> Iterator[dict]:
    with path.open() as lines:
        for line in lines:
            yield json.loads(line)


def _sessions(trace: Trace, directory: Path) -> Iterator[list[Row]]:
    """Every session of the trace, in order of its first row; a session is complete only when
    the file has been read, so this reads the whole file first (a few MB)."""
    sessions: list[list[Row]] = []
    by_name: dict[str, int] = {}
    owner: dict[int, int] = {}
    for raw in _rows(directory / trace.file):
        row = Row(tuple(raw["hash_ids"]), raw["input_length"])
        if "session_id" in raw:
            index = by_name.setdefault(raw["session_id"], len(sessions))
        else:
            shared = (owner[i] for i in reversed(row.hash_ids[1:]) if i in owner)
            index = next(shared, len(sessions))
            for i in row.hash_ids:
                owner.setdefault(i, index)
        if index == len(sessions):
            sessions.append([])
        sessions[index].append(row)
    yield from sessions


class Expander:
    """Token ids of hash-id blocks: one fixed random block per (trace, id), scaled."""

    def __init__(self, trace: Trace, shape: Shape) -> None:
        self.trace, self.shape = trace, shape
        self.block = shape.scaled(trace.block)
        self.blocks: dict[int, list[int]] = {}

    def prompt(self, row: Row) -> list[int]:
        tokens: list[int] = []
        for i in row.hash_ids:
            if i not in self.blocks:
                rng = random.Random(f"{self.trace.file}:{i}")
                self.blocks[i] = self.shape.tokens(rng, self.block)
            tokens += self.blocks[i]
        return tokens[: self.length(row)]

    def length(self, row: Row) -> int:
        """The row's length at this scale; a multiple of the scaled block for its full blocks."""
        partial = row.length - self.trace.block * (len(row.hash_ids) - 1)
        return self.block * (len(row.hash_ids) - 1) + self.shape.scaled(partial)


def trace_sessions(
    trace: Trace, shape: Shape, sessions: int, turns: int, max_prompt: int, directory: Path
) -> list[list[list[int]]]:
    """The first `sessions` sessions with at least two rows that fit `max_prompt` tokens at this
    scale, each cut to its first `turns` such rows: prompts as token ids."""
    expand = Expander(trace, shape)
    chosen = []
    for rows in _sessions(trace, directory):
        fitting = [r for r in rows if expand.length(r) <= max_prompt][:turns]
        if len(fitting) >= 2:
            chosen.append([expand.prompt(r) for r in fitting])
        if len(chosen) == sessions:
            break
    return chosen


def fixed(prompts: list[list[int]]) -> Workload:
    """A workload whose prompts do not depend on the answers."""
    # Not `yield from prompts`: the driver send()s each answer, which a list iterator refuses.
    for prompt in prompts:  # noqa: UP028
        yield prompt
