"""HybridPrefixScheduler: vLLM's scheduler with vllm_hpc's KV cache manager.

`--scheduler-cls` is vLLM's supported way to change what `Scheduler.__init__` builds. The
subclasses here change seven things and leave the scheduling policy (FCFS, chunked prefill,
preemption) to vLLM:

- the KV cache manager is a `HybridPrefixKVCacheManager`, and no more requests run at once than
  there are active state slots;
- a prefill chunk ends at the request's next exact tap (vLLM's hook for its own state
  alignment, `_mamba_block_aligned_split`, is reused for this);
- after each step, the tokens a request has computed commit their blocks and publish its taps;
- a request that can never fit in the device pool is failed with an error;
- while the disk tier's start-up read runs, the engine core keeps stepping without requests
  (`has_requests`), as vLLM's busy loop does for a connector's pending work, so that the
  workers' reads are handed out and reported;
- after each schedule, the waiting queue's first requests that vLLM did not reach get their
  reads from the disk tier planned ahead of their turn (`read_ahead`);
- with `--cache-audit-rate`, the cache audit's runs are queued and their outputs kept from the
  front end (`cache_audit.py`).

`HybridPrefixScheduler` extends vLLM's `Scheduler` (CPU, and whenever async scheduling is off);
`HybridPrefixAsyncScheduler` extends `AsyncScheduler`, vLLM's default on CUDA.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from itertools import islice
from typing import Any

import vllm.v1.core.sched.scheduler as vllm_scheduler
from vllm.distributed.kv_events import EventPublisher, KVEventBatch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.request import RequestStatus

from vllm_hpc.derived import DISK_READ_AHEAD_REQUESTS
from vllm_hpc.glue.scheduler.cache_audit import CacheAudit
from vllm_hpc.glue.scheduler.kv_events import SnapshotEventPublisher
from vllm_hpc.glue.scheduler.kv_manager import HybridPrefixKVCacheManager
from vllm_hpc.options import PluginOptions

logger = logging.getLogger("vllm.vllm_hpc")


class _HybridPrefixMixin:
    """What both scheduler variants add to vLLM's."""

    kv_cache_manager: HybridPrefixKVCacheManager
    kv_event_publisher: EventPublisher
    _audit: CacheAudit | None
    requests: dict[str, Any]
    waiting: Any
    max_num_running_reqs: int
    max_num_active_reqs: int
    need_mamba_block_aligned_split: bool

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        # `Scheduler.__init__` builds `KVCacheManager(...)` by its module-level name: build ours.
        original = vllm_scheduler.KVCacheManager
        vllm_scheduler.KVCacheManager = partial(HybridPrefixKVCacheManager, vllm_config=vllm_config)
        try:
            super().__init__(vllm_config, *args, **kwargs)  # type: ignore[call-arg]
        finally:
            vllm_scheduler.KVCacheManager = original
        translator = self.kv_cache_manager.kv_events
        if translator is not None:
            self.kv_event_publisher = SnapshotEventPublisher(self.kv_event_publisher, translator)
        slots = self.kv_cache_manager.active_cap
        self.max_num_running_reqs = min(self.max_num_running_reqs, slots)
        self.max_num_active_reqs = min(self.max_num_active_reqs, slots)
        self.need_mamba_block_aligned_split = True
        self.stop_requested: Callable[[], bool] = _never
        """Whether the engine core running this scheduler was asked to stop: an engine-core
        process's hook answers (`glue/scheduler/engine_core.py`)."""
        options = PluginOptions.from_additional_config(vllm_config.additional_config)
        self._audit = (
            CacheAudit(
                options.cache_audit_rate,
                options.cache_audit_tokens,
                self.kv_cache_manager.cache.audits,
            )
            if options.cache_audit_rate
            else None
        )

    def _mamba_block_aligned_split(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        """End the chunk at the request's next exact tap (§7.1), or on a block boundary; 0 when
        the budget left reaches neither, and vLLM leaves the request for the next step (a
        running one is skipped; the waiting queue's head stops the queue, never overtaken)."""
        start = request.num_computed_tokens or (
            num_new_local_computed_tokens + num_external_computed_tokens
        )
        return self.kv_cache_manager.chunk_limit(request, start, num_new_tokens)

    def _free_cow_retained_blocks(self, blocks: list[Any], fence_seq: int) -> None:
        """The cache retains no vLLM blocks for its page copies: nothing to release."""

    def has_requests(self) -> bool:
        """vLLM's answer, or the cache's start-up read still running: its reads go to the
        workers in step plans and come back in step outputs, so an idle engine core must step
        (empty steps, as after requests finish) until it is done (§5.5), unless it is asked to
        stop (`stop_requested`): a stop does not wait for the read."""
        if super().has_requests():  # type: ignore[misc]
            return True
        return self.kv_cache_manager.cache.preloading and not self.stop_requested()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step, recorded as in flight for its requests until its output (§7.7)."""
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.kv_cache_manager.steps_scheduled(output)
        self.kv_cache_manager.read_ahead(islice(self.waiting, DISK_READ_AHEAD_REQUESTS))
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self.kv_cache_manager.steps_done(scheduler_output, model_runner_output)
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        manager = self.kv_cache_manager
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished():
                manager.cache_blocks(request, self._committed_tokens(request))
        if manager.unservable:
            self._fail_unservable(outputs)
        if self._audit is not None:
            self._run_audit(outputs)
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """Publish what the cache did since vLLM's own publication in this step (the commits
        and taps above), or since the last step (a reset, a load at start-up)."""
        translator = self.kv_cache_manager.kv_events
        if translator is None:
            return
        events = self.kv_cache_manager.take_events()
        if events or translator.snapshot_events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        done = bool(super().reset_prefix_cache(*args, **kwargs))  # type: ignore[misc]
        self.publish_kv_events()
        return done

    def _run_audit(self, outputs: dict[int, Any]) -> None:
        """Hide the audit's runs from the front end; queue runs for the newly resumed."""
        assert self._audit is not None
        self._audit.observe(outputs)
        resumed = self.kv_cache_manager.audit_resumed
        assert resumed is not None
        for entry in resumed:
            try:
                runs = self._audit.runs_for(entry)
            except Exception:  # an optional check must never stop the engine
                logger.exception("hybrid-prefix cache audit: cannot audit a request; skipped")
                continue
            for run in runs:
                self.add_request(run)  # type: ignore[attr-defined]
        resumed.clear()

    def _committed_tokens(self, request: Any) -> int:
        """Tokens whose KV and state the executed steps have written."""
        return int(request.num_computed_tokens)

    def _fail_unservable(self, outputs: dict[int, Any]) -> None:
        reasons = dict(self.kv_cache_manager.unservable)
        for request in self.finish_requests(  # type: ignore[attr-defined]
            list(reasons), RequestStatus.FINISHED_ERROR
        ):
            logger.error("request failed: %s", reasons[request.request_id])
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            outputs.setdefault(request.client_index, _engine_core_outputs()).outputs.append(output)


def _never() -> bool:
    return False


def _engine_core_outputs() -> Any:
    from vllm.v1.engine import EngineCoreOutputs

    return EngineCoreOutputs()


class HybridPrefixScheduler(_HybridPrefixMixin, Scheduler):
    pass


class HybridPrefixAsyncScheduler(_HybridPrefixMixin, AsyncScheduler):
    def _committed_tokens(self, request: Any) -> int:
        # Output placeholders are tokens of steps still in flight.
        return int(request.num_computed_tokens - request.num_output_placeholders)
