"""The cache audit (`--cache-audit-rate`): silent corruption of a cached state, seen in serving.

A sampled share of the requests the cache resumes is audited. Their prompt is run twice more,
behind the requests already queued: once the way any request runs, served from the cache, and
once from the root, reading nothing cached. Each run makes the first `--cache-audit-tokens`
greedy tokens. The two answers are compared under the near-tie rule (`vllm_hpc.exactness`:
the root run asks for its top-2 logprobs). A parting beyond it is logged with the request's
resume depth and source, and counted (`vllm:hpc_audit_diverged{source}`).

The audit runs pairs of its own rather than comparing with the user's answer, because that
answer is sampled with the user's parameters. Both runs are engine-internal requests: their
outputs are taken out before vLLM's front end sees them. Prompts with images or videos are not
audited, since their media may no longer be in vLLM's processor cache when the runs start.
Which requests are audited is a hash of their id, so a replay audits the same ones.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import xxhash

from vllm_hpc.exactness import first_parting
from vllm_hpc.runtime.telemetry import AuditCounters

logger = logging.getLogger("vllm.vllm_hpc")

AUDIT_PREFIX = "hpc-audit-"
"""Names the audit's own runs (they are told apart by id, `CacheAudit._runs`)."""


@dataclass(frozen=True)
class Resumed:
    """A request the cache admitted with a prefix, as the audit samples it."""

    request: Any
    frontier: int
    from_host: bool


@dataclass
class _Run:
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    done: bool = False


@dataclass
class _Pair:
    resumed: Resumed
    cached: _Run = field(default_factory=_Run)
    root: _Run = field(default_factory=_Run)


class CacheAudit:
    def __init__(self, rate: float, tokens: int, counters: AuditCounters) -> None:
        self.rate = rate
        self.tokens = tokens
        self.counters = counters
        self._numbers = itertools.count()
        self._runs: dict[str, tuple[_Pair, bool]] = {}
        """Run id -> its pair, and whether it is the root run."""

    def samples(self, request_id: str) -> bool:
        return xxhash.xxh3_64_intdigest(request_id.encode()) < self.rate * 2**64

    def runs_for(self, resumed: Resumed) -> list[Any]:
        """The two runs that audit ``resumed`` (none if it is not sampled or not auditable)."""
        request = resumed.request
        if (
            request.request_id in self._runs
            or request.mm_features
            or not self.samples(request.request_id)
        ):
            return []
        pair = _Pair(resumed)
        number = next(self._numbers)
        runs = []
        for root in (False, True):
            run_id = f"{AUDIT_PREFIX}{number}-{'root' if root else 'cached'}"
            runs.append(self._request(run_id, request, root))
            self._runs[run_id] = (pair, root)
        return runs

    def _request(self, run_id: str, request: Any, root: bool) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(
            max_tokens=self.tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=2 if root else None,
            skip_reading_prefix_cache=root,
        )
        ids = request.prompt_token_ids
        return Request(
            request_id=run_id,
            prompt_token_ids=None if ids is None else list(ids),
            sampling_params=params,
            pooling_params=None,
            client_index=request.client_index,
            prompt_embeds=request.prompt_embeds,
            lora_request=request.lora_request,
            cache_salt=request.cache_salt,
        )

    def observe(self, outputs: dict[int, Any]) -> None:
        """Take the audit runs' outputs out of a step's outputs; compare finished pairs."""
        for engine_outputs in outputs.values():
            kept, ours = [], set()
            for output in engine_outputs.outputs:
                entry = self._runs.get(output.request_id)
                if entry is None:
                    kept.append(output)
                    continue
                ours.add(output.request_id)
                self._record(output, *entry)
            engine_outputs.outputs = kept
            finished = engine_outputs.finished_requests
            if finished and ours:
                engine_outputs.finished_requests = finished - ours

    def _record(self, output: Any, pair: _Pair, root: bool) -> None:
        run = pair.root if root else pair.cached
        run.tokens.extend(output.new_token_ids)
        if root and output.new_logprobs is not None:
            # Columns: the sampled token, then the top 2; greedy samples the top one.
            for row in output.new_logprobs.logprobs:
                run.margins.append(float(row[1] - row[2]))
        if output.finish_reason is not None:
            run.done = True
            del self._runs[output.request_id]
            if pair.cached.done and pair.root.done:
                self._compare(pair)

    def _compare(self, pair: _Pair) -> None:
        self.counters.audit_checked += 1
        parting = first_parting(pair.cached.tokens, pair.root.tokens, pair.root.margins)
        if parting is None or parting.near_tie:
            return
        resumed = pair.resumed
        if resumed.from_host:
            self.counters.audit_diverged_host += 1
        else:
            self.counters.audit_diverged_device += 1
        logger.warning(
            "hybrid-prefix cache audit: request %s, resumed at token %d from the %s, parted "
            "from its recomputation from the root: %s",
            resumed.request.request_id,
            resumed.frontier,
            "host tier" if resumed.from_host else "device",
            parting.describe(),
        )
