"""KV cache events (`--kv-events-config`) with hybrid-prefix (issue #19): a subscriber using
vLLM's own decoder reads the tree's blocks stored, removed and cleared, hashed as vLLM hashes
the same tokens; the snapshot events ride in a trailing field that only the extended decoder
reads. One small in-process engine with a host tier, its events over ZMQ."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from engine_support import (
    RESUME_PATHS,
    greedy,
    greedy_params,
    random_prompt,
    small_pool_llm,
    tokens,
)
from server_support import free_port

pytestmark = pytest.mark.engine

TOPIC = "kv"


class Stream:
    """A ZMQ subscriber to the engine's event publisher, keeping every payload it got."""

    def __init__(self, port: int) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.payloads: list[bytes] = []

    def collect(self, quiet_s: float = 0.5) -> list[bytes]:
        """The payloads published since the last call (until none came for ``quiet_s``)."""
        new: list[bytes] = []
        while self._socket.poll(int(quiet_s * 1000)):
            _, _, payload = self._socket.recv_multipart()
            new.append(payload)
        self.payloads += new
        return new

    def close(self) -> None:
        self._socket.close(linger=0)


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[Any, Stream]]:
    from vllm.config import KVEventsConfig

    port = free_port()
    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", topic=TOPIC
    )
    with small_pool_llm(RESUME_PATHS, kv_events_config=events) as llm:
        stream = Stream(port)
        time.sleep(0.5)  # a SUB socket sees only what is published after it joined
        yield llm, stream
        stream.close()


def _stock(payloads: list[bytes]) -> list[Any]:
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    return [event for p in payloads for event in decoder.decode(p).events]


def _snapshots(payloads: list[bytes]) -> list[Any]:
    from vllm_hpc.glue.scheduler.kv_events import HybridKVEventBatch

    decoder = msgspec.msgpack.Decoder(type=HybridKVEventBatch)
    return [event for p in payloads for event in decoder.decode(p).snapshot_events]


def _vllm_hashes(llm: Any, token_ids: list[int], salt: str | None = None) -> list[Any]:
    """vLLM's block hashes of ``token_ids`` at the 64-token block, by vLLM's own functions,
    as its events carry them (``salt``: the first block's extra key, as vLLM puts it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    hash_fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - 63, 64):
        parent = hashes[-1] if hashes else None
        keys = (("cache_salt", salt),) if salt is not None and not hashes else None
        hashes.append(hash_block_tokens(hash_fn, parent, token_ids[start : start + 64], keys))
    return [maybe_convert_block_hash(h) for h in hashes]


def test_blocks_and_snapshots_with_vllms_hashes(engine: tuple[Any, Stream]) -> None:
    from vllm.distributed.kv_events import BlockStored

    llm, stream = engine
    prompt = random_prompt(seed=1, length=3 * 64 + 10)
    answer = tokens(greedy(llm, [prompt], max_tokens=4)[0])
    greedy(llm, [random_prompt(seed=2, length=70)], max_tokens=2)  # the host writes land
    payloads = stream.collect()
    expected = _vllm_hashes(llm, prompt)
    stored = [e for e in _stock(payloads) if isinstance(e, BlockStored)]
    for medium in ("GPU", "CPU"):
        mine = [e for e in stored if e.medium == medium and e.block_hashes[0] in expected]
        assert [e.block_hashes[0] for e in mine] == expected, medium
        assert [e.parent_block_hash for e in mine] == [None, *expected[:-1]]
        assert [e.token_ids for e in mine] == [prompt[i : i + 64] for i in range(0, 192, 64)]
        assert {e.block_size for e in mine} == {64}
    # Where a state resumes: the anchor's chain and the tail are the request's own tokens.
    full = prompt + answer
    resumable = [s for s in _snapshots(payloads) if s.anchor_block_hash in expected]
    assert resumable
    for snapshot in resumable:
        anchor_end = 64 * (expected.index(snapshot.anchor_block_hash) + 1)
        assert snapshot.tail_token_ids == full[anchor_end : snapshot.frontier]
    assert {s.medium for s in resumable} == {"GPU", "CPU"}


def test_a_salted_prompt_is_hashed_with_its_salt(engine: tuple[Any, Stream]) -> None:
    from vllm.distributed.kv_events import BlockStored

    llm, stream = engine
    prompt = random_prompt(seed=3, length=2 * 64 + 5)
    llm.generate(
        [{"prompt_token_ids": prompt, "cache_salt": "tenant-1"}], greedy_params(2), use_tqdm=False
    )
    stored = [e for e in _stock(stream.collect()) if isinstance(e, BlockStored)]
    hashes = {e.block_hashes[0] for e in stored if e.medium == "GPU"}
    assert set(_vllm_hashes(llm, prompt, salt="tenant-1")) <= hashes
    assert not set(_vllm_hashes(llm, prompt)) & hashes


def test_stock_decoder_ignores_the_snapshot_field(engine: tuple[Any, Stream]) -> None:
    from vllm.distributed.kv_events import KVEventBatch

    payloads = engine[1].payloads
    raw = [msgspec.msgpack.decode(p) for p in payloads]
    assert any(len(batch) == 4 and batch[3] for batch in raw), "no batch carried snapshots"
    tags = {event["type"] for batch in raw for event in batch[1]}
    assert tags <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    for payload in payloads:
        batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
        assert type(batch) is KVEventBatch


def test_pressure_removes_and_a_reset_clears(engine: tuple[Any, Stream]) -> None:
    """Five 900-token prompts overflow the 59 KV pages: device copies go, each one stored
    before; a reset is one AllBlocksCleared."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    llm, stream = engine
    for seed in range(10, 15):
        greedy(llm, [random_prompt(seed=seed, length=900)], max_tokens=2)
    stream.collect()
    held: set[tuple[Any, str | None]] = set()
    removed = 0
    for event in _stock(stream.payloads):
        key = (event.block_hashes[0], event.medium) if hasattr(event, "block_hashes") else None
        if isinstance(event, BlockStored):
            assert key not in held, "stored twice"
            held.add(key)
        elif isinstance(event, BlockRemoved):
            held.remove(key)  # only what was stored is removed
            removed += event.medium == "GPU"
    assert removed > 0
    assert llm.reset_prefix_cache()
    assert any(isinstance(e, AllBlocksCleared) for e in _stock(stream.collect()))


def test_a_snapshot_dropped_with_its_anchors_last_copy_names_the_anchor() -> None:
    """§9.4 deletes the snapshots on a block after the block's last copy went, in the same
    batch: the translator still names the anchor by the hash it published it under."""
    from types import SimpleNamespace

    from tests.index.harness import BLOCK, Harness, make_index, toks
    from vllm_hpc.glue.scheduler.kv_events import KVEventTranslator, SnapshotDropped
    from vllm_hpc.index.journal import BlockRemoved, BlockStored, SnapshotPublished, SnapshotRemoved

    index = make_index(record_events=True)
    Harness(index).run(toks(1, 2 * BLOCK + 10), taps=[2 * BLOCK])
    events = index.drain_events()
    config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"))
    translator = KVEventTranslator(config, group_idx=0)
    translated = translator.translate(events)
    hashes = {
        e.node: t.block_hashes[0]
        for e, t in zip([e for e in events if isinstance(e, BlockStored)], translated, strict=True)
    }
    published = next(e for e in events if isinstance(e, SnapshotPublished))
    anchor, medium = published.anchor, published.medium
    where = (published.snapshot, anchor, published.tail, published.frontier, medium)
    translator.translate([BlockRemoved(anchor, medium), SnapshotRemoved(*where)])
    dropped = translator.snapshot_events[-1]
    assert isinstance(dropped, SnapshotDropped)
    assert dropped.anchor_block_hash == hashes[anchor]
