"""The records the runtime exchanges with its caller: its configuration, what it needs of a
request, a waiting request's lookup, and the steps still in flight when a request ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hpc.index import (
    AdmissionQuote,
    IndexConfig,
    MediaItem,
    PlannedTap,
    PreparedPrompt,
    TapHint,
    TapPolicy,
)
from vllm_hpc.runtime.lane import Lane


@dataclass(frozen=True)
class InFlight:
    """Decode steps vLLM scheduled for a request whose output it had not seen when the
    request ended (async scheduling: the next step is scheduled before the last one's output)."""

    steps: int
    """1, or 2 for two or more."""
    first_position: int
    """Where the earliest of them begins: the position of the first token it computes."""


class InfeasibleRequest(ValueError):
    """The request can never fit in the device KV pool, even with an empty cache."""


@dataclass(frozen=True)
class RuntimeConfig:
    index: IndexConfig
    active_cap: int
    """Most requests running at once (--active-state-slots, else max_num_seqs). Each holds a
    state row of the device page space while it runs; row 0 is the workers' scratch."""
    tap_policy: TapPolicy
    chunk_tokens: int
    """The most tokens one request's prefill chunk gets in a step (the scheduler's budget, or
    vLLM's long-prefill threshold): a new request's first chunk is at most this."""
    prefix_reuse: bool = True
    """False (--no-prefix-reuse): nothing is looked up, inserted or captured."""
    in_pass_taps: bool = False
    """The workers capture states inside a prefill pass, at 64-token offsets (CUDA's GDN kernel
    computes them anyway): taps there need no chunk split."""
    lane_rows: int = 1
    """State rows each running request holds: 1, or 1 + K with K speculative tokens (MTP), whose
    verification pass keeps the recurrent state after each of its K + 1 tokens (`Lane.rows`)."""
    disk_write_bytes: int = 0
    """Write-behind to the disk tier planned per step at most (`derived.disk_write_bound`);
    unused without a disk tier."""
    decode_reserve_tokens: int = 256
    """Output tokens of each running request whose pages a new admission leaves free. Pages are
    taken 64 tokens at a time, so without a reserve a full pool admits requests that then run
    out mid-decode and are preempted (native's 400-token blocks reserve about 200 tokens a
    request on average; preemptions under load: `docs/results.md`)."""


@dataclass(frozen=True)
class RequestInfo:
    """What the runtime needs of a request."""

    request_id: str
    token_ids: Sequence[int]
    """All tokens so far: the prompt, then generated tokens."""
    num_prompt_tokens: int
    cache_salt: str | None = None
    breakpoints: tuple[int, ...] = ()
    """Client-named reuse points (token positions): exact Boundary taps (§7.1)."""
    template_hints: tuple[TapHint, ...] = ()
    """Semantic positions the chat template marks: the generation opener, structural ends."""
    read_limit: int | None = None
    """Leading tokens it may read from the cache: None, any; 0, none (it still writes)."""
    media: tuple[MediaItem, ...] = ()
    """The prompt's media items (images, videos): their identity keys the blocks they touch."""
    max_output_tokens: int = 0
    """The most tokens it may generate (vLLM's max_tokens): bounds its decode reserve."""


@dataclass(frozen=True)
class Lookup:
    """A waiting request's admission source and tap plan; valid until the cache changes."""

    quote: AdmissionQuote | None
    frontier: int
    """Tokens served from the cache: the request prefills [frontier, n)."""
    taps: list[PlannedTap]
    prompt: PreparedPrompt | None = None
    sibling: Lane | None = None
    """A running request that is prefilling more of this prompt than the cache serves now: the
    request waits for its snapshot instead of prefilling the same tokens (§12.2)."""
    read_limit: int | None = None
    """The request's `RequestInfo.read_limit`, which its match kept to."""
