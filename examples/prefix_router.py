"""A reference prefix-aware scorer over hybrid-prefix KV cache events (issue #19).

    python examples/prefix_router.py A=tcp://host-a:5557 B=tcp://host-b:5557 < prompts.jsonl

Each server runs with ``--kv-cache-manager hybrid-prefix --kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'``. The
scorer subscribes to every server's event stream and keeps, per replica, the blocks it holds
(`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, vLLM's events) and the points where a
recurrent state can be resumed (the snapshot events in the batch's trailing field, see
`docs/kv-events.md`). For a prompt's token ids it names the replica with the deepest
resumable point: the deepest snapshot whose anchor chain and tail are the prompt's own tokens,
else the deepest matching block (attention KV alone cannot resume a hybrid model, so a block
match ranks below any snapshot). Ties go to the replicas in turn.

It needs only the standard library, pyzmq and msgspec (both dependencies of vLLM itself). It
matches blocks by their tokens under their parent's hash, as the events give them, so it does
not have to reproduce the server's hash function. Each stdin line is a JSON list of token ids;
each output line names the replica and its score.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import msgspec
import zmq

BLOCK = 64
"""Tokens per block of a hybrid-prefix server (its events' block_size)."""

BlockKey = tuple[Any, tuple[int, ...]]
"""A block as a prompt finds it: its parent's hash (None at the start) and its tokens."""


@dataclass
class Snapshot:
    frontier: int
    anchor: Any
    """The anchor block's hash; None for a state after fewer than 64 tokens."""
    tail: tuple[int, ...]
    media: set[str] = field(default_factory=set)


@dataclass
class Replica:
    """What one server's event stream says it holds."""

    name: str
    blocks: dict[Any, BlockKey] = field(default_factory=dict)
    media: dict[Any, set[str]] = field(default_factory=dict)
    by_key: dict[BlockKey, Any] = field(default_factory=dict)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)

    def apply(self, batch: list[Any]) -> None:
        """One decoded `KVEventBatch` (+ the hybrid-prefix snapshot field, when present)."""
        for event in batch[1]:
            kind = event["type"]
            if kind == "BlockStored":
                parent = event["parent_block_hash"]
                tokens = event["token_ids"]
                for i, block_hash in enumerate(event["block_hashes"]):
                    key = (parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
                    self.blocks[block_hash], self.by_key[key] = key, block_hash
                    self.media.setdefault(block_hash, set()).add(event["medium"])
                    parent = block_hash
            elif kind == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    held = self.media.get(block_hash, set())
                    held.discard(event["medium"])
                    if not held and block_hash in self.blocks:
                        del self.media[block_hash]
                        self.by_key.pop(self.blocks.pop(block_hash), None)
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
                self.media.clear()
                self.by_key.clear()
                self.snapshots.clear()
        for event in batch[3] if len(batch) > 3 else ():
            sid = event["snapshot_id"]
            if event["type"] == "SnapshotStored":
                snapshot = self.snapshots.setdefault(
                    sid,
                    Snapshot(
                        event["frontier"],
                        event["anchor_block_hash"],
                        tuple(event["tail_token_ids"]),
                    ),
                )
                snapshot.media.add(event["medium"])
            elif event["type"] == "SnapshotDropped" and sid in self.snapshots:
                self.snapshots[sid].media.discard(event["medium"])
                if not self.snapshots[sid].media:
                    del self.snapshots[sid]

    def score(self, token_ids: list[int]) -> tuple[int, int]:
        """(deepest resumable snapshot frontier, tokens of the deepest matching block)."""
        chain: list[Any] = []  # chain[k]: the hash of the prompt's block k, while they match
        parent = None
        for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
            block_hash = self.by_key.get((parent, tuple(token_ids[start : start + BLOCK])))
            if block_hash is None:
                break
            chain.append(block_hash)
            parent = block_hash
        depth = {block_hash: k + 1 for k, block_hash in enumerate(chain)}
        best = 0
        for snapshot in self.snapshots.values():
            blocks = 0 if snapshot.anchor is None else depth.get(snapshot.anchor)
            if blocks is None or snapshot.frontier >= len(token_ids):
                continue  # another path, or nothing left to compute from it
            start = blocks * BLOCK
            if tuple(token_ids[start : snapshot.frontier]) == snapshot.tail:
                best = max(best, snapshot.frontier)
        return best, len(chain) * BLOCK


class PrefixRouter:
    """Subscribes to each replica's event stream and scores prompts against them."""

    def __init__(self, endpoints: dict[str, str], topic: str = "") -> None:
        self.replicas = {name: Replica(name) for name in endpoints}
        self._lock = threading.Lock()
        self._turn = count()
        self._context = zmq.Context.instance()
        self._sockets: dict[Any, Replica] = {}
        for name, endpoint in endpoints.items():
            sub = self._context.socket(zmq.SUB)
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self._sockets[sub] = self.replicas[name]
        self._running = True
        self._thread = threading.Thread(target=self._listen, daemon=True, name="prefix-router")
        self._thread.start()

    def _listen(self) -> None:
        poller = zmq.Poller()
        for sub in self._sockets:
            poller.register(sub, zmq.POLLIN)
        while self._running:
            for sub, _ in poller.poll(100):
                _, _, payload = sub.recv_multipart()
                batch = msgspec.msgpack.decode(payload)
                with self._lock:
                    self._sockets[sub].apply(batch)

    def route(self, token_ids: list[int]) -> tuple[str, tuple[int, int]]:
        """The replica with the deepest resumable point for ``token_ids``, and its score."""
        with self._lock:
            scores = {name: r.score(token_ids) for name, r in self.replicas.items()}
        best = max(scores.values())
        tied = [name for name, s in scores.items() if s == best]
        name = tied[next(self._turn) % len(tied)]
        return name, scores[name]

    def close(self) -> None:
        self._running = False
        self._thread.join()
        for sub in self._sockets:
            sub.close(linger=0)


def main() -> None:
    endpoints = dict(arg.split("=", 1) for arg in sys.argv[1:])
    if not endpoints:
        sys.exit(__doc__)
    router = PrefixRouter(endpoints)
    try:
        for line in sys.stdin:
            if line.strip():
                name, (frontier, blocks) = router.route(json.loads(line))
                print(f"{name} resumable={frontier} blocks={blocks}", flush=True)
    finally:
        router.close()


if __name__ == "__main__":
    main()
