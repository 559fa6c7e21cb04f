"""Replays the CPU replay's mix through the pure-Python cache runtime, with and without a disk
tier under the same host tier, and counts the hits by source.

Question (#50, disk-tier plan step 6): on the CPU, `replay.py --workloads mix --configs
native,hybrid-prefix-host,hybrid-prefix-disk --kv-cache-gib 0.03 --host-cache-mib 4
--disk-cache-gib 1` served fewer prompt tokens from the cache with the disk tier than without
it, with far fewer device hits. The runtime here is the engine's own (`HybridPrefixCache`, built
by `derived.runtime_config` as the glue builds it, with the tiny model's geometry on a 30 MiB
KV cache); what stands in for vLLM is a model of its synchronous scheduler (the CPU's): running
requests first, then the waiting queue from its head; a request whose read from the disk tier
is planned or in flight steps aside (the connector's "not yet"), the first that cannot be
admitted stops the queue and prefetches; a running request that cannot grow preempts the
newest running one. Host writes land within their step (the CPU's copies are inline); write-
behind batches and disk reads end ``--disk-lag`` steps after the step that carried them.

Prompts are the mix's own (`workloads.mix`, the CPU profile); answers are fixed random tokens
of the profile's length (the cache cannot tell), so both configurations see the same requests.
Sessions start at their arrival times with at most four in flight, and a step takes a time
proportional to its tokens times ``--time-scale``: the ratio of step time to the arrivals
decides which sessions overlap, and with it the hit rate (the host tier alone gets 0.07 to
0.40 on one arrival seed), so configurations are compared at equal timing only. ``--grid``
compares them over arrival seeds, time scales and disk lags.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/archive/disk_hits.py --per-request
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/archive/disk_hits.py --grid 20
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Generator
from dataclasses import dataclass, field

from bench_common import ASIDE, admit_head
from workloads import Shape, mix

from vllm_hpc.derived import runtime_config
from vllm_hpc.options import PluginOptions
from vllm_hpc.runtime.cache import HybridPrefixCache, RequestInfo
from vllm_hpc.runtime.lane import Lane
from vllm_hpc.tiny_model import DEFAULT_RECIPE

R = DEFAULT_RECIPE
PAGE_BYTES = 64 * R.num_key_value_heads * R.head_dim * 2 * 2
"""One 64-token page of the tiny model's one attention layer (bf16 K and V)."""
CONV_BYTES = (2 * R.linear_num_key_heads + R.linear_num_value_heads) * R.linear_key_head_dim * 3 * 2
SSM_BYTES = R.linear_num_value_heads * R.linear_value_head_dim * R.linear_key_head_dim * 4
IMAGE_BYTES = 3 * (CONV_BYTES + SSM_BYTES)
"""Three GDN layers' states: a bf16 conv window of 3 columns, a float32 recurrent state."""
ROW_PAGES = -(-IMAGE_BYTES // PAGE_BYTES)
BLOCKS = int(0.03 * 2**30) // PAGE_BYTES
"""vLLM's KV blocks in --kv-cache-gib 0.03 (block 0 is its null block)."""
CHUNK = 2048
ANSWER = 32
CONCURRENCY = 4
STEP_S = 0.02
TOKEN_S = 0.3 / CHUNK


@dataclass
class Request:
    name: str
    tokens: list[int]
    answer: list[int]
    lane: Lane | None = None
    computed: int = 0
    outputs: int = 0
    cached: int | None = None
    """Tokens its admission served from the cache."""
    waits: int = 0
    """Steps it stepped aside for a disk read."""

    @property
    def n(self) -> int:
        return len(self.tokens)

    def all_tokens(self) -> list[int]:
        return self.tokens + self.answer[: self.outputs]

    def info(self) -> RequestInfo:
        return RequestInfo(self.name, self.all_tokens(), self.n, max_output_tokens=ANSWER)


@dataclass
class Engine:
    """vLLM's synchronous scheduler around the cache, as far as the cache sees it."""

    cache: HybridPrefixCache
    disk_lag: int
    time_scale: float
    running: list[Request] = field(default_factory=list)
    waiting: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    disk_ending: list[tuple[int, str, int]] = field(default_factory=list)
    step: int = 0

    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.disk_ending)

    def run_step(self) -> float:
        """One step: schedule, hand the plan out, let it run, process its output."""
        cache = self.cache
        cache.new_step()
        budget = CHUNK
        scheduled: list[tuple[Request, bool]] = []
        for request in list(self.running):
            if budget <= 0 or request not in self.running:
                continue
            size = 1
            if request.computed < request.n:
                size = min(budget, request.n - request.computed)
                size = cache.chunk_limit(request.lane.taps, request.computed, size, request.n)
                if size == 0:
                    continue
            while (
                request in self.running
                and cache.grow(request.lane, request.computed + size) is None
            ):
                self._preempt(self.running[-1], scheduled)
            if request in self.running:
                self._schedule(request, size, scheduled)
                budget -= size
        aside: list[Request] = []
        while self.waiting and budget > 0:
            request = self.waiting[0]
            lookup, lane, size = admit_head(cache, request.info(), budget)
            if size == ASIDE:
                request.waits += 1
                aside.append(self.waiting.pop(0))
                continue
            if lane is None:
                break
            self.waiting.pop(0)
            request.lane, request.computed = lane, lookup.frontier
            if request.cached is None:
                request.cached = lookup.frontier
            self.running.append(request)
            self._schedule(request, size, scheduled)
            budget -= size
        self.waiting[:0] = aside
        plan = cache.take_plan()
        ends = self.step + self.disk_lag
        self.disk_ending += [(ends, "write", batch.batch) for batch in plan.disk_writes]
        self.disk_ending += [(ends, "read", batch.batch) for batch in plan.disk_reads]
        cache.complete_writes([write.batch for write in plan.host_writes])
        for ending in [e for e in self.disk_ending if e[0] <= self.step]:
            self.disk_ending.remove(ending)
            if ending[1] == "write":
                cache.complete_disk_writes(ending[2])
            else:
                cache.complete_disk_read(ending[2])
        self._update(scheduled)
        self.step += 1
        return self.time_scale * (STEP_S + TOKEN_S * (CHUNK - budget))

    def _schedule(self, request: Request, size: int, out: list[tuple[Request, bool]]) -> None:
        tokens = request.all_tokens()
        end = min(request.computed + size, len(tokens))
        if end > request.computed:
            self.cache.on_scheduled(request.lane, tokens, request.computed, end)
        request.computed += size
        out.append((request, request.computed >= len(tokens)))

    def _preempt(self, request: Request, scheduled: list[tuple[Request, bool]]) -> None:
        """vLLM's preemption: its pages go (an endpoint is left) and it waits at the head."""
        self.running.remove(request)
        scheduled[:] = [s for s in scheduled if s[0] is not request]
        self.cache.finish(request.lane, request.all_tokens(), request.computed)
        request.lane, request.computed = None, 0
        self.waiting.insert(0, request)

    def _update(self, scheduled: list[tuple[Request, bool]]) -> None:
        for request, samples in scheduled:
            request.outputs += samples
            tokens = request.all_tokens()
            if request.outputs >= len(request.answer):
                self.running.remove(request)
                self.cache.finish(request.lane, tokens, request.computed)
                self.finished.append(request)
            else:
                self.cache.commit(request.lane, tokens, request.computed)


@dataclass
class Run:
    requests: list[Request]
    cache: HybridPrefixCache
    steps: int
    hung: bool
    """Stopped at ``max_steps`` with requests left (a head that never gets in)."""

    @property
    def hit_rate(self) -> float:
        return sum(r.cached or 0 for r in self.requests) / sum(r.n for r in self.requests)


def replay(disk: bool, disk_lag: int, time_scale: float, arrivals: int, max_steps: int) -> Run:
    """The mix on a 4 MiB host tier, with a 1 GiB disk tier under it when ``disk``."""
    extra: dict[str, object] = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 4}
    if disk:
        extra.update(disk_cache_dir="/nonexistent/disk-hits", disk_cache_gib=1)
    config = runtime_config(
        PluginOptions.from_additional_config(extra),
        device_pages=BLOCKS - 1,
        row_pages=ROW_PAGES,
        page_bytes=PAGE_BYTES,
        image_bytes=IMAGE_BYTES,
        max_seqs=256,
        max_model_len=8192,
        chunk=CHUNK,
        in_pass=False,
    )
    cache = HybridPrefixCache(config)
    engine = Engine(cache, disk_lag, time_scale)
    vocab = R.vocab_size
    sessions = mix(Shape(vocab, 0.5), 1.0, 8, seed=arrivals, branch=Shape(vocab, 1.5))
    answers = [random.Random(i) for i in range(len(sessions))]
    pending = sorted((s.start_s, i) for i, s in enumerate(sessions))
    turns: dict[int, Generator[list[int], list[int], None]] = {}
    count: dict[int, int] = {}
    requests: list[Request] = []

    def send(i: int, prompt: list[int]) -> None:
        answer = [answers[i].randrange(vocab) for _ in range(ANSWER)]
        request = Request(f"{i}.{count.setdefault(i, 0)}", prompt, answer)
        count[i] += 1
        engine.waiting.append(request)
        requests.append(request)

    now = 0.0
    while pending or turns or engine.busy():
        while pending and pending[0][0] <= now and len(turns) < CONCURRENCY:
            _, i = pending.pop(0)
            turns[i] = sessions[i].turns
            send(i, next(turns[i]))
        now += engine.run_step() if engine.busy() else 0.05
        if engine.step > max_steps:
            return Run(requests, cache, engine.step, hung=True)
        for request in engine.finished:
            i = int(request.name.split(".")[0])
            try:
                send(i, turns[i].send(request.answer))
            except StopIteration:
                del turns[i]
        engine.finished.clear()
    return Run(requests, cache, engine.step, hung=False)


def one(args: argparse.Namespace) -> None:
    runs = {}
    for disk in (False, True):
        run = replay(disk, args.disk_lag, args.time_scale, args.arrivals, args.max_steps)
        runs[disk] = run
        a, s = run.cache.admissions, run.cache.index.stats
        print(
            f"{'host+disk' if disk else 'host'}: {len(run.requests)} requests, {run.steps} steps"
            f"{' (stopped: a head never got in)' if run.hung else ''}, hit rate "
            f"{run.hit_rate:.3f}; hit tokens device {a.hit_tokens_device}, host "
            f"{a.hit_tokens_host}, disk {a.hit_tokens_disk}; taps skipped "
            f"{s.taps_skipped_no_slot}, host writes declined {s.host_writes_declined}, disk "
            f"writes {s.disk_writes}, reads {s.disk_reads}"
        )
    if args.per_request:
        with_disk = {r.name: r for r in runs[True].requests}
        print(f"{'req':>5} {'n':>6} {'host':>6} {'+disk':>6}  waits")
        for r in runs[False].requests:
            d = with_disk.get(r.name)
            got = "-" if d is None or d.cached is None else str(d.cached)
            mark = " <" if d is not None and (d.cached or 0) < (r.cached or 0) else ""
            waits = d.waits if d is not None else 0
            print(f"{r.name:>5} {r.n:6} {r.cached or 0:6} {got:>6}  {waits}{mark}")


def grid(args: argparse.Namespace) -> None:
    """Both configurations at equal timing over arrival seeds, time scales and disk lags."""
    pairs = []
    for arrivals in range(5, 5 + args.grid):
        for scale in (0.3, 0.6, 1.0, 1.5, 2.2, 3.0):
            for lag in (0, 1, 3):
                host = replay(False, lag, scale, arrivals, args.max_steps)
                disk = replay(True, lag, scale, arrivals, args.max_steps)
                pairs.append((host.hit_rate, disk.hit_rate, disk.hung))
    worse = [(h, d) for h, d, _ in pairs if d < h - 1e-9]
    print(
        f"{len(pairs)} timings: mean hit rate host {sum(p[0] for p in pairs) / len(pairs):.4f}, "
        f"host+disk {sum(p[1] for p in pairs) / len(pairs):.4f}; host+disk lower in "
        f"{len(worse)} (by {sum(h - d for h, d in worse):.3f} in all); stopped "
        f"{sum(p[2] for p in pairs)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disk-lag", type=int, default=1, help="steps until a disk batch ends")
    parser.add_argument("--time-scale", type=float, default=1.0, help="factor on a step's time")
    parser.add_argument("--arrivals", type=int, default=5, help="the mix's arrival seed")
    parser.add_argument("--max-steps", type=int, default=5000, help="give up after this many")
    parser.add_argument("--per-request", action="store_true", help="each request's hits")
    parser.add_argument("--grid", type=int, help="compare over this many arrival seeds")
    args = parser.parse_args()
    if args.grid:
        grid(args)
    else:
        one(args)


if __name__ == "__main__":
    sys.exit(main())
