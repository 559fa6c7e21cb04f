"""HybridPrefixKVCacheManager: vLLM's `KVCacheManager` surface over `HybridPrefixCache`.

`Scheduler` builds and calls its KV cache manager directly; `vllm_hpc.glue.scheduler.scheduler`
puts this class in its place. It translates vLLM's requests and block lists to the runtime's terms:

- KV cache group "attention" (every full-attention layer): the request's 64-token pages.
- KV cache groups of `StateRowSpec` (the GDN layers): one "block" per request, its state row.

KV cache events (`--kv-events-config`) come from the index's journal, translated to vLLM's
types by `glue/scheduler/kv_events.py`. Everything else vLLM asks of a manager that the cache
has no use for (boundary state offloads, external-load bookkeeping) answers "nothing".
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, KVCacheBlockCopy
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.metrics.stats import PrefixCacheStats

from vllm_hpc.derived import disk_tier_spec, runtime_config
from vllm_hpc.glue.row_layout import RowLayout, plan_rows, spans_of
from vllm_hpc.glue.sampling import parse_breakpoints
from vllm_hpc.glue.scheduler.cache_audit import Resumed
from vllm_hpc.glue.scheduler.cache_key import media_items, tenant_key
from vllm_hpc.glue.scheduler.chat_format import chat_markers, prompt_hints
from vllm_hpc.glue.scheduler.disk_tier import DiskTier, journal_header
from vllm_hpc.glue.scheduler.fingerprint import engine_fingerprint
from vllm_hpc.glue.scheduler.kv_events import KVEventTranslator
from vllm_hpc.glue.state_spec import StateRowSpec
from vllm_hpc.glue.versions import read_limit
from vllm_hpc.glue.worker.disk_store import disk_journal_path
from vllm_hpc.index import MediaItem, TapHint
from vllm_hpc.options import OptionError, PluginOptions
from vllm_hpc.runtime.cache import (
    HybridPrefixCache,
    InfeasibleRequest,
    InFlight,
    Lookup,
    RequestInfo,
)
from vllm_hpc.runtime.lane import Lane
from vllm_hpc.runtime.plan import StepPlan

logger = logging.getLogger("vllm.vllm_hpc")

AUDIT_ENV = "VLLM_HPC_AUDIT_EVERY_STEP"
"""Test-only: "1" checks the cache's invariants and accounting at the start of every step, so
that tests of a whole server (whose cache they cannot reach) see a broken invariant as a dead
engine. Off, it costs one test per step."""


def prefill_chunk_tokens(scheduler_config: Any) -> int:
    """The most tokens one request's prefill chunk can get in a step: the scheduler's budget, or
    vLLM's long-prefill threshold when one is set (vLLM raises that only to a fair share)."""
    budget = scheduler_config.max_num_scheduled_tokens or scheduler_config.max_num_batched_tokens
    threshold = scheduler_config.long_prefill_token_threshold
    return min(budget, threshold) if threshold > 0 else budget


@dataclass
class _NoCoordinator:
    """vLLM reads `coordinator.single_type_managers` for per-group block sizes; none apply."""

    single_type_managers: list[Any] = field(default_factory=list)


class HybridPrefixKVCacheManager:
    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        *,
        vllm_config: Any,
        log_stats: bool = False,
        **_unused: Any,
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        self._num_groups = len(groups)
        self._state_groups = [
            i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
        ]
        attention = [g for g in groups if not isinstance(g.kv_cache_spec, MambaSpec)]
        state_spec = groups[self._state_groups[0]].kv_cache_spec
        assert isinstance(state_spec, StateRowSpec), "model must be vllm_hpc's Qwen3.5 class"
        assert len(attention) == 1, "one full-attention KV cache group expected"
        layer_page = attention[0].kv_cache_spec.page_size_bytes
        page_bytes = layer_page * len(attention[0].layer_names)
        num_states = sum(len(groups[i].layer_names) for i in self._state_groups)
        rows = state_rows(
            kv_cache_config, attention[0].layer_names, layer_page, state_spec, num_states
        )
        options = PluginOptions.from_additional_config(vllm_config.additional_config)
        config = runtime_config(
            options,
            device_pages=kv_cache_config.num_blocks - 1,  # block 0 is vLLM's null block
            row_pages=rows.row_pages,
            page_bytes=page_bytes,
            image_bytes=state_spec.image_bytes,
            max_seqs=vllm_config.scheduler_config.max_num_seqs,
            max_model_len=max_model_len,
            chunk=prefill_chunk_tokens(vllm_config.scheduler_config),
            in_pass=state_spec.in_pass_taps,
            lane_rows=1 + state_spec.num_speculative_blocks,
        )
        events = vllm_config.kv_events_config
        self.kv_events = (
            KVEventTranslator(vllm_config, groups.index(attention[0]))
            if events is not None and events.enable_kv_cache_events
            else None
        )
        """Translates the index's journal for vLLM's publisher; None: events are off."""
        if self.kv_events is not None:
            config = dataclasses.replace(
                config, index=dataclasses.replace(config.index, record_events=True)
            )
        self.cache = HybridPrefixCache(config)
        self.disk_tier = disk_tier(options, vllm_config, self.cache)
        """The disk tier's journal (None without one); the connector steps it."""
        self.active_cap = config.active_cap
        self.max_model_len = max_model_len
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.coordinator = _NoCoordinator()
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in groups))
        self.lanes: dict[str, Lane] = {}
        self._lookups: dict[str, Lookup] = {}
        self._steps_in_flight: dict[str, dict[int, int]] = {}
        """Per admitted request, the steps scheduled with it whose output vLLM has not handed
        back yet (by the id of vLLM's `SchedulerOutput`), with the tokens each holds for it,
        drafts included: under async scheduling a request can end with one."""
        self.unservable: dict[str, str] = {}
        """Requests the cache can never serve (too long for the pool, resumable), with the reason:
        the scheduler fails them."""
        self._worker_plan = StepPlan()
        self._chat_markers = chat_markers(vllm_config.model_config)
        self._audit_every_step = os.environ.get(AUDIT_ENV) == "1"
        self.audit_resumed: list[Resumed] | None = [] if options.cache_audit_rate else None
        """Requests admitted with a prefix since the scheduler last took them, for the cache
        audit (`glue/scheduler/cache_audit.py`); None when the audit is off."""
        self._prompt_keys: dict[str, PromptKeys] = {}
        """Each request's hints and keys, computed once (they scan the prompt and hash its
        embeddings) and dropped in `free`."""
        logger.info(
            "hybrid-prefix cache: %d device pages of 64 tokens (%.1f KiB each) shared at run "
            "time by KV and states: a state (%.2f MiB) takes a row of %d pages, %d rows, row 0 "
            "scratch; up to %d running requests, up to %d device snapshots; taps per request "
            "%d, ladder %d, min gap %d, flexible taps every %d tokens: %s, taps inside a pass: "
            "%s, host tier: %s%s",
            config.index.device_pages,
            page_bytes / 1024,
            state_spec.image_bytes / 2**20,
            rows.row_pages,
            rows.num_rows,
            config.active_cap,
            config.index.snapshot_slots,
            config.tap_policy.max_new_taps,
            config.tap_policy.ladder_tokens,
            config.tap_policy.min_gap_tokens,
            config.tap_policy.chunk_tokens,
            "yes" if config.tap_policy.dense_flexible else "no",
            "yes" if config.in_pass_taps else "no (taps split the prefill chunk)",
            f"{options.host_tier_mib} MiB" if options.host_tier_mib else "off",
            ", prefix reuse off" if options.no_prefix_reuse else "",
        )

    # -- per step ---------------------------------------------------------------------------

    def new_step_starts(self) -> None:
        if self._audit_every_step:
            self.cache.audit()
        self.cache.new_step()

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Hand out this step's plan: page copies to vLLM, the rest to the connector."""
        plan = self.cache.take_plan()
        self._worker_plan = plan
        return [KVCacheBlockCopy(c.src, c.dst) for c in plan.page_copies], []

    def take_worker_plan(self) -> StepPlan:
        """The state copies and host transfers of this step, for the connector."""
        plan, self._worker_plan = self._worker_plan, StepPlan()
        return plan

    def take_new_block_ids(self) -> list[int]:
        return list(self.cache.take_new_pages())

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def take_events(self) -> list[Any]:
        """vLLM's block events since the last call, for its publisher; the snapshot events
        wait in the translator for the batch (`SnapshotEventPublisher`)."""
        if self.kv_events is None:
            return []
        return self.kv_events.translate(self.cache.drain_events())

    # -- admission --------------------------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """Tokens the cache serves for a waiting request, at most ``max_cache_hit_length``
        (its pages come in `get_blocks`). While its read from the disk tier is in flight, the
        lookup that planned it stands: the request steps aside until the read lands
        (`disk_wait`), so matching it again every step would find nothing new."""
        rid = request.request_id
        info = request_info(request, self._keys(request), max_cache_hit_length)
        lookup = self._lookups.get(rid)
        if (
            lookup is None
            or lookup.read_limit != info.read_limit
            or not self.cache.reading_for(rid)
        ):
            lookup = self._lookup(info)
            if lookup is None:
                return self.empty_kv_cache_blocks, 0, 0
        return self.empty_kv_cache_blocks, lookup.frontier, 0

    def _lookup(self, info: RequestInfo) -> Lookup | None:
        """The cache's lookup, kept for the request; None: it can never be served."""
        try:
            lookup = self.cache.lookup(info)
        except InfeasibleRequest as error:
            self.unservable[info.request_id] = str(error)
            return None
        self._lookups[info.request_id] = lookup
        return lookup

    def read_ahead(self, waiting: Iterable[Any]) -> None:
        """With a disk tier: the queue's first requests (``waiting``, in order) that vLLM has
        not looked up get the reads their sources need planned now (`Admission.read_ahead`),
        once each; a request vLLM looked up reads at its lookup (`disk_wait`)."""
        if self.disk_tier is None:
            return
        for request in waiting:
            rid = request.request_id
            if rid in self._lookups or rid in self.unservable or rid in self.lanes:
                continue
            if request.num_computed_tokens:  # resumable: vLLM never looks it up (`allocate_slots`)
                continue
            lookup = self._lookup(request_info(request, self._keys(request)))
            if lookup is not None:
                self.cache.read_ahead(rid, lookup)

    def disk_wait(self, request_id: str) -> bool:
        """Whether the waiting request steps aside this step for a read from the disk tier
        that its lookup, just made, needs (`Admission.disk_wait`)."""
        lookup = self._lookups.get(request_id)
        return lookup is not None and self.cache.disk_wait(request_id, lookup)

    def get_num_cached_tokens(self, request: Any) -> int:
        """Tokens the cache would serve the request now, without admitting it (vLLM 0.34's
        cache-aware admission asks; it is off with hybrid-prefix, which turns vLLM's prefix
        caching off, so this only keeps the manager's surface whole)."""
        return self.cache.cached_tokens(request_info(request, self._keys(request)))

    def _keys(self, request: Any) -> PromptKeys:
        """The request's template hints and cache keys, computed on its first lookup."""
        rid = request.request_id
        keys = self._prompt_keys.get(rid)
        if keys is None:
            keys = PromptKeys(
                prompt_hints(self._chat_markers, request), tenant_key(request), media_items(request)
            )
            self._prompt_keys[rid] = keys
        return keys

    def chunk_limit(self, request: Any, start: int, num_new_tokens: int) -> int:
        """The chunk [start, start + n) shortened to end at the request's next exact tap (or
        on a block boundary: `HybridPrefixCache.chunk_limit`); 0: it waits for the next step."""
        lane = self.lanes.get(request.request_id)
        lookup = self._lookups.get(request.request_id)
        taps = lane.taps if lane is not None else lookup.taps if lookup is not None else []
        return self.cache.chunk_limit(taps, start, num_new_tokens, request.num_prompt_tokens)

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        **_unused: Any,
    ) -> KVCacheBlocks | None:
        """Pages (and, for a new request, the source and a state row) for the next chunk;
        None when there is no room now. Returns the newly allocated pages only."""
        rid = request.request_id
        lane = self.lanes.get(rid)
        if lane is None:
            if rid in self.unservable:
                return None
            lookup = self._lookups.pop(rid, None)
            if lookup is None:
                # vLLM skips the lookup only for requests that come back with computed tokens
                # (resumable streaming input); the cache kept no pages for them.
                self.unservable[rid] = (
                    f"request {rid}: resumable (streaming input) requests are not supported by "
                    "--kv-cache-manager hybrid-prefix"
                )
                return None
            assert lookup.frontier == num_new_computed_tokens, "vLLM changed the cached tokens"
            lane = self.cache.admit(
                request_info(request, self._keys(request)),
                lookup,
                num_new_tokens,
                num_lookahead_tokens,
            )
            if lane is None:
                self.cache.prefetch(lookup)  # vLLM keeps the head waiting: use the wait
                return None
            self.lanes[rid] = lane
            if lane.base and self.audit_resumed is not None:
                self.audit_resumed.append(Resumed(request, lane.base, lane.from_host))
            self._schedule(lane, request, lane.base, num_new_tokens)
            return self.get_blocks(rid)
        start = request.num_computed_tokens
        end = min(start + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        pages = self.cache.grow(lane, end)
        if pages is None:
            return None
        self._schedule(lane, request, start, num_new_tokens)
        return self._blocks(pages)

    def _schedule(self, lane: Lane, request: Any, start: int, num_new_tokens: int) -> None:
        # A running request's new tokens include its draft tokens (speculative decoding):
        # positions past its known tokens are no content a tap could name.
        end = min(start + num_new_tokens, request.num_tokens)
        if end > start:
            self.cache.on_scheduled(lane, request.all_token_ids, start, end)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's pages and state row; none for a request never admitted (vLLM asks
        for them when it aborts a waiting request, too)."""
        lane = self.lanes.get(request_id)
        if lane is None:
            return self.empty_kv_cache_blocks
        return self._blocks(lane.pages, lane.rows)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        return self.get_block_ids(request_id)

    def _blocks(self, pages: Iterable[int], rows: Iterable[int] = ()) -> KVCacheBlocks:
        """Pages for the attention group; the state rows (if given) for every GDN group."""
        state = tuple(KVCacheBlock(row) for row in rows)
        attention = tuple(KVCacheBlock(page) for page in pages)
        return KVCacheBlocks(
            tuple(state if i in self._state_groups else attention for i in range(self._num_groups))
        )

    # -- after steps ------------------------------------------------------------------------

    def steps_scheduled(self, scheduler_output: Any) -> None:
        """vLLM scheduled a step: its admitted requests have it in flight until `steps_done`."""
        step = id(scheduler_output)
        for rid, tokens in scheduler_output.num_scheduled_tokens.items():
            if rid in self.lanes:
                self._steps_in_flight.setdefault(rid, {})[step] = tokens

    def steps_done(self, scheduler_output: Any, model_runner_output: Any) -> None:
        """A step's output, before vLLM acts on it (it may finish a request): the step is no
        longer in flight, and how many tokens each request's step committed (its endpoint then
        copies the state after them: `Lane.accepted`)."""
        step = id(scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            self._steps_in_flight.get(rid, {}).pop(step, None)
        if self.cache.config.lane_rows == 1:  # no speculative decoding
            return
        sampled = model_runner_output.sampled_token_ids
        for index, rid in enumerate(model_runner_output.req_ids):
            lane = self.lanes.get(rid)
            if lane is not None:
                lane.accepted = max(1, len(sampled[index]))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Tokens [0, n) of the request are in KV and state: commit blocks, publish taps."""
        lane = self.lanes.get(request.request_id)
        if lane is not None:
            self.cache.commit(lane, request.all_token_ids, num_computed_tokens)

    def free(self, request: Any) -> None:
        """The request finished, was aborted or preempted: endpoint snapshot and release."""
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._prompt_keys.pop(rid, None)
        self.unservable.pop(rid, None)
        self.cache.forget(rid)
        steps = self._steps_in_flight.pop(rid, {})
        lane = self.lanes.pop(rid, None)
        if lane is not None:
            self.cache.finish(
                lane,
                request.all_token_ids,
                request.num_computed_tokens,
                in_flight_steps(request.num_computed_tokens, list(steps.values())),
            )

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        return []

    def remove_skipped_blocks(self, *args: Any, **kwargs: Any) -> None:
        return None

    # -- reporting --------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.cache.usage

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if self.prefix_cache_stats is None or read_limit(request) == 0:
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def estimate_cached_tokens(self, request: Any) -> int:
        return 0

    def reset_prefix_cache(self) -> bool:
        return self.cache.reset()


@dataclass(frozen=True)
class PromptKeys:
    """What a request's prompt gives the cache beyond its tokens, fixed for its lifetime."""

    template_hints: tuple[TapHint, ...]
    tenant: str | None
    """`cache_salt` plus the LoRA adapter and prompt embeddings (`glue.scheduler.cache_key`)."""
    media: tuple[MediaItem, ...]


def disk_tier(
    options: PluginOptions, vllm_config: Any, cache: HybridPrefixCache
) -> DiskTier | None:
    """This engine core's disk tier journal, replayed into ``cache``; None without one."""
    spec = disk_tier_spec(options)
    if spec is None or not cache.config.index.disk_budget_bytes:
        return None
    parallel = vllm_config.parallel_config
    header = journal_header(
        engine_fingerprint(vllm_config),
        cache.config.index.geometry,
        parallel.tensor_parallel_size,
    )
    path = disk_journal_path(spec.directory, parallel.data_parallel_index)
    return DiskTier(path, header, cache)


def state_rows(
    kv_cache_config: Any,
    attention_layers: list[str],
    layer_page: int,
    state_spec: StateRowSpec,
    num_states: int,
) -> RowLayout:
    """The state rows of this KV cache, as the workers lay them out (`StatePool.bind`)."""
    tensor = next(t for t in kv_cache_config.kv_cache_tensors if t.layers[0] in attention_layers)
    bases = [tensor.offset + i * tensor.layer_stride for i in range(len(tensor.layers))]
    try:
        spans = spans_of(bases, tensor.block_stride, layer_page)
    except ValueError as error:
        raise OptionError(f"--kv-cache-manager hybrid-prefix: {error}") from error
    pages = kv_cache_config.num_blocks - 1
    return plan_rows(spans, state_spec.layer_state_bytes, num_states, pages)


def in_flight_steps(num_computed: int, step_tokens: list[int]) -> InFlight | None:
    """The steps still in flight for an ending request, from the tokens each holds for it.

    vLLM has already moved ``num_computed_tokens`` past them (and back over the drafts its
    outputs rejected), so the earliest begins where their tokens end. Not vLLM's output
    placeholders: they also count tokens a last speculative step computed past max_tokens,
    which ran, with no step in flight."""
    if not step_tokens:
        return None
    return InFlight(steps=len(step_tokens), first_position=num_computed - sum(step_tokens))


def request_info(request: Any, keys: PromptKeys, bound: int | None = None) -> RequestInfo:
    """What the runtime needs of a vLLM `Request`; ``bound`` caps what it may read."""
    params = request.sampling_params
    try:
        breakpoints = parse_breakpoints(params.extra_args if params is not None else None)
    except ValueError:  # validated in the front end; a request must never stop the engine
        breakpoints = ()
    return RequestInfo(
        request_id=request.request_id,
        token_ids=request.all_token_ids,
        num_prompt_tokens=request.num_prompt_tokens,
        cache_salt=keys.tenant,
        media=keys.media,
        breakpoints=breakpoints,
        template_hints=keys.template_hints,
        read_limit=read_limit(request, bound),
        max_output_tokens=request.max_tokens,
    )
