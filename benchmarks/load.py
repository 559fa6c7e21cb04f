"""Load benchmark: hybrid-prefix against vLLM's built-in caching under serving load (issue #14).

Each configuration (``native``: vLLM's prefix caching; ``hybrid-prefix``: the plugin) runs in its
own `vllm.LLM` engine, one engine at a time, each shut down and released before the next, on
vLLM's defaults (torch.compile and CUDA graphs) unless ``--eager``. Every request is greedy with
``ignore_eos``; token-id prompts are seeded, so both sides get the same token ids. Workloads:

- ``burst``: N cold prompts (random token ids, distinct per request) of ``--burst-len`` tokens,
  ``--burst-output`` tokens each, submitted together to an engine with ``max_num_seqs`` M
  (``--burst N:M``, repeatable; a different M is another engine). Reported: output tok/s (all
  output tokens / wall time), TTFT p50 / p95, ITL, the most requests running at once (from
  vLLM's per-request timestamps), preemptions, and the KV capacity vLLM reports.
- ``sessions``: S sessions sharing one ``--system-len`` system prompt, ``--turns`` turns each;
  turn t of every session is submitted together; its prompt is the system prompt, the whole
  history (earlier user messages and this side's own answers, echoed as token ids) and
  ``--user-len`` new tokens. Reported per turn: hit rate (cached / prompt tokens), TTFT p50 / p95,
  output tok/s, ITL; ITL over all turns too. Sessions run in the engine of ``--max-num-seqs``,
  after its bursts.
- ``--profile-steps K`` (off by default): after an engine's workloads, the first burst's prompts
  again, stepped by hand: up to four prefill steps timed, then three under vLLM's torch profiler
  (a burst too small for seven full steps times fewer, and its table says how many of the
  profiled steps were prefill ones); once every request decodes, K decode steps are timed, then
  K more are profiled, and from the first finish on, the steps in which the requests finish (up
  to 48). Reported: the mean decode step (ms, unprofiled) and vLLM's kernel tables
  (``profile_<config>_<max_num_seqs>_prefill.txt``, ``profile_<config>_<max_num_seqs>.txt`` and
  ``..._finish.txt`` in ``--out``), so a gap in the burst can be traced to its kernels and
  copies.

Streaming (issue #48): each batch is submitted as `LLM.generate` submits it, but the engine is
stepped here with DELTA outputs, as `vllm serve` streams, so every step hands over each request's
new tokens (one chunk; several tokens under MTP). ITL follows `vllm bench serve`: a request's
gaps between consecutive chunks, timed when `LLMEngine.step()` returns them to the front end
(where the API server would write them to the stream; no HTTP or detokenizing), every request's
gaps pooled, p50 / p99 / max ("longest inter-token gap"). The longest engine-step gap is timed on
the engine core's own clock instead (the timestamp of its outputs, as vLLM's metrics take it):
the longest gap between consecutive steps that gave any request a token, so a pause of the
engine core shows apart from one of the front end. Every other figure means what it did with
`LLM.generate`.

Targets (the report's last table): per burst, output tok/s >= 0.98x native and TTFT p50 / p95
<= 1.0x; sessions: hit rate >= native on every turn and TTFT p50 <= 0.6x native on every turn
after the first. Issue #48's streaming goals follow, per burst and for the sessions' turns
pooled: ITL p50 <= 1.02x native, p99 <= 1.05x, longest inter-token gap <= 1.5x, and no more
engine-step gaps over 200 ms than native. TTFT is vLLM's own
(`RequestOutput.metrics.first_token_latency`: from the request's arrival to the output step of
its first token). Every engine first warms up on prompts of its own. The JSON and Markdown
reports (``load.json``, ``load.md`` in ``--out``) are rewritten after every engine;
``--budget-s`` stops before an engine that would end later, and ``--resume load.json`` runs what
an earlier call left, keeping what it measured (reports from before #48 show "-" for ITL).

CPU, tiny model (a few minutes):

    .venv/bin/python benchmarks/load.py --cpu --out /tmp/load_cpu

H200, 27B shape, dummy weights (this project's lent device; elsewhere see `benchmarks/README.md`):

    source .gpu/env.sh && bash scripts/gpu_plugin.sh && \\
    python3 benchmarks/load.py --model .gpu/model27b --out $OUT

A fresh H200 takes ~4 minutes per engine start under vLLM's defaults, so the default budget
(550 s) fits about one engine per call: copy the call's ``load.json`` to ``.gpu/load.json``,
carry it, and add ``--resume .gpu/load.json`` to the next call.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import itertools
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import (
    NATIVE_BEST,
    add_eager_option,
    add_load_format_option,
    add_native_best_options,
    add_tensor_parallel_option,
    baseline,
    check_native_best,
    cpu_machine,
    gpu_engine_kwargs,
    metric_values,
    native_best_kwargs,
    parallel_kwargs,
    random_prompt,
    ratio,
    revision,
    series,
    source_digest,
    table_head,
    times,
    vocab_size,
)
from gpu_speed import device_name, engine_facts, release_device

from vllm_hpc.glue.worker.call_clock import SLOW_CALL_SECONDS
from vllm_hpc.options import DEFAULT_HOST_CACHE_MIB, OPTION_SPECS
from vllm_hpc.runtime.telemetry import COUNTERS

# The hybrid side's counts come from its workers through `LLM.collective_rpc` with the plugin's
# functions (`bench_engine`); to an engine core in a process of its own, vLLM sends a function
# only with its pickle fallback, else the call fails after the workloads and the engine's
# results are lost (seen on the CPU: "Object of type function is not serializable").
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
T0 = time.monotonic()
NATIVE, HYBRID = "native", "hybrid-prefix"
CONFIGS = (NATIVE, NATIVE_BEST, HYBRID)
"""In the order they run. `native-best` (vLLM 0.34's strongest built-in caching, its CPU
offloading as large as the plugin's host tier) runs only when --configs names it, and the
report then measures hybrid-prefix against it instead of against `native`."""
WORKLOADS = ("burst", "sessions")
PLUGIN_OPTIONS = tuple(s for s in OPTION_SPECS if s.key != "kv_cache_manager")
"""The plugin's options, passed through to the hybrid-prefix engine's `additional_config`."""

# Seed bases: the same prompts on both sides, no prompt shared between workloads.
SEED_WARM = 9_000_000
SEED_BURST = 1_000_000  # + 100_000 x the burst's position in --burst
SEED_SYSTEM = 5_000_000
SEED_USER = 6_000_000  # + 1_000 x session + turn
SEED_PROFILE = 7_000_000

PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {
        "burst_prompts": 256,
        "burst_len": 1024,
        "burst_output": 128,
        "max_num_seqs": 256,
        "sessions": 32,
        "turns": 4,
        "system_len": 4096,
        "user_len": 256,
        "session_output": 128,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.85,
        "budget_s": 550.0,
    },
    "cpu": {
        "burst_prompts": 16,
        "burst_len": 128,
        "burst_output": 16,
        "max_num_seqs": 16,
        "sessions": 4,
        "turns": 3,
        "system_len": 512,
        "user_len": 64,
        "session_output": 16,
        "max_model_len": 8192,
        "gpu_memory_utilization": 0.2,
        "budget_s": 3600.0,
    },
}

GOALS = {
    "tok_s": 0.98,
    "ttft_p50": 1.0,
    "ttft_p95": 1.0,
    "session_ttft_p50": 0.6,
    "itl_p50": 1.02,
    "itl_p99": 1.05,
    "itl_max": 1.5,
}

LONG_STEP_GAP_S = 0.2
"""Engine-step gaps longer than this are counted: #48 wants none that the baseline does not
have."""


def log(msg: str) -> None:
    print(f"[load {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# --- statistics ----------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), for short lists."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = q * (len(data) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def peak_running(records: list[dict[str, Any]]) -> int:
    """The most requests between their first scheduling and their last token at once: under
    load, a cache that runs fewer requests together shows here first."""
    events = []
    for r in records:
        if r["scheduled_ts"] and r["last_token_ts"]:
            events += [(r["scheduled_ts"], 1), (r["last_token_ts"], -1)]
    running = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        running += step
        peak = max(peak, running)
    return peak


@dataclass
class Stream:
    """What streaming showed of one batch or more, in seconds: every request's gaps between
    consecutive chunks (pooled, as `vllm bench serve` pools them) and the gaps between
    consecutive engine steps that gave a token."""

    itl: list[float] = field(default_factory=list)
    step_gaps: list[float] = field(default_factory=list)

    def extend(self, other: Stream) -> None:
        self.itl += other.itl
        self.step_gaps += other.step_gaps

    def figures(self) -> dict[str, Any]:
        """ITL in ms under `vllm bench serve`'s names; the engine's longest step gap and how
        many steps came more than LONG_STEP_GAP_S after the one before."""
        return {
            "itl_p50_ms": quantile(self.itl, 0.5) * 1000,
            "itl_p99_ms": quantile(self.itl, 0.99) * 1000,
            "itl_max_ms": max(self.itl, default=math.nan) * 1000,
            "step_gap_max_ms": max(self.step_gaps, default=math.nan) * 1000,
            "long_step_gaps": sum(g > LONG_STEP_GAP_S for g in self.step_gaps),
        }


def summarize_batch(records: list[dict[str, Any]], wall_s: float, stream: Stream) -> dict[str, Any]:
    """One batch's figures: throughput, TTFT quantiles, hits, concurrency, ITL."""
    ttft = [r["ttft_s"] for r in records]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    output = sum(r["output_tokens"] for r in records)
    return {
        "requests": len(records),
        "wall_s": wall_s,
        "output_tokens": output,
        "output_tok_s": output / wall_s,
        "ttft_p50": quantile(ttft, 0.5),
        "ttft_p95": quantile(ttft, 0.95),
        "ttft_max": max(ttft),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "peak_running": peak_running(records),
        "preemptions": sum(r["preemptions"] for r in records),
        "queued_p50": quantile([r["queued_s"] for r in records], 0.5),
        **stream.figures(),
    }


# --- engines -------------------------------------------------------------------------------


def plugin_config(args: argparse.Namespace, config: str) -> dict[str, Any]:
    """`additional_config` of one side: the plugin and its options given here, on its side."""
    if config != HYBRID:
        return {}
    extra: dict[str, Any] = {"kv_cache_manager": "hybrid-prefix"}
    for spec in PLUGIN_OPTIONS:
        value = getattr(args, spec.key)
        if value is not None:
            extra[spec.key] = value
    return extra


def engine_kwargs(args: argparse.Namespace, config: str, max_num_seqs: int) -> dict[str, Any]:
    """`vllm.LLM` arguments; only the cache settings differ between the sides. Stats on, since
    TTFT comes from vLLM's per-request metrics."""
    limits: dict[str, Any] = {
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": max_num_seqs,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
        **parallel_kwargs(args.tensor_parallel_size),
    }
    if args.max_num_batched_tokens:
        limits["max_num_batched_tokens"] = args.max_num_batched_tokens
    if config == NATIVE_BEST:
        host_mib = DEFAULT_HOST_CACHE_MIB if args.host_cache_mib is None else args.host_cache_mib
        limits.update(native_best_kwargs(args, int(host_mib)))
    if args.profile_steps:
        limits["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": str(profile_dir(config, max_num_seqs)),
            "torch_profiler_with_stack": False,
        }
    extra = plugin_config(args, config)
    if args.cpu:
        from vllm_hpc.tiny_model import llm_kwargs

        return llm_kwargs(Path(args.model), additional_config=extra, **limits)
    return gpu_engine_kwargs(args.model, args.eager, extra, args.load_format, **limits)


def kv_facts(llm: Any) -> dict[str, Any]:
    """The KV capacity vLLM reports for the engine: blocks x block size, and its own figures."""
    cache = llm.llm_engine.vllm_config.cache_config
    blocks = cache.num_gpu_blocks or 0
    return {
        "num_gpu_blocks": blocks,
        "block_size": cache.block_size,
        "kv_capacity_tokens": blocks * cache.block_size,
        "kv_cache_size_tokens": getattr(cache, "kv_cache_size_tokens", None),
        "kv_cache_max_concurrency": getattr(cache, "kv_cache_max_concurrency", None),
    }


def mode(facts: dict[str, Any], cpu: bool) -> str:
    """How the engine ran its model: the report states it for each side."""
    if facts.get("enforce_eager"):
        return "eager (the tiny model's CPU settings)" if cpu else "eager (--eager)"
    return f"vLLM's defaults (torch.compile, CUDA graphs {facts.get('cudagraph_mode')})"


# --- workloads -----------------------------------------------------------------------------


def request_record(out: Any, answer: list[int]) -> dict[str, Any]:
    """What one finished request tells (its final output, and all its streamed tokens): sizes,
    cache hits, vLLM's timings."""
    m = out.metrics
    if m is None:
        raise RuntimeError("RequestOutput.metrics is None: the engine runs without stats")
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens or 0,
        "output_tokens": len(answer),
        "ttft_s": m.first_token_latency,
        "queued_s": max(0.0, m.scheduled_ts - m.queued_ts),
        "scheduled_ts": m.scheduled_ts,
        "last_token_ts": m.last_token_ts,
        "preemptions": m.num_preemptions,
        "answer": hashlib.sha1(json.dumps(answer).encode()).hexdigest()[:12],
    }


REQUEST_IDS = itertools.count()
"""Request ids unique over the process (`LLM.generate` numbers its own; it is not used here)."""


TIER_WRITES = series(m for m in COUNTERS if m.name in ("host_write_bytes", "disk_write_bytes"))
"""The bytes the plugin's host and disk tiers wrote (`vllm:hpc_host_bytes`, `vllm:hpc_disk_bytes`
with what="written"), read around each batch."""


def tier_writes(llm: Any) -> dict[str, int]:
    """`TIER_WRITES` so far; none on vLLM's own caching."""
    if llm.llm_engine.vllm_config.additional_config.get("kv_cache_manager") != HYBRID:
        return {}
    return metric_values(TIER_WRITES)


def run_batch(
    llm: Any, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[str, Any], list[list[int]], Stream]:
    """Submit ``prompts`` together and step the engine until all finish, as `LLM.generate`
    does, but streamed (DELTA), since it forces final outputs only: the batch's figures and
    records, the answers, and what the stream showed (module docstring: where each is timed).
    The figures include the MiB the plugin's host and disk tiers wrote meanwhile
    (`TIER_WRITES`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    sp = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    ids = [f"load-{next(REQUEST_IDS)}" for _ in prompts]
    written = tier_writes(llm)
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    answers: dict[str, list[int]] = {rid: [] for rid in ids}
    finals: dict[str, Any] = {}
    last_chunk: dict[str, float] = {}
    last_step: float | None = None
    stream = Stream()
    while engine.has_unfinished_requests():
        outs = engine.step()
        arrived = time.perf_counter()
        step_ts = None
        for o in outs:
            rid, new = o.request_id, o.outputs[0].token_ids
            if new:
                answers[rid] += new
                if rid in last_chunk:
                    stream.itl.append(arrived - last_chunk[rid])
                last_chunk[rid] = arrived
                step_ts = o.metrics.last_token_ts  # the engine core's stamp of this step
            if o.finished:
                finals[rid] = o
        if step_ts is not None:
            if last_step is not None:
                stream.step_gaps.append(step_ts - last_step)
            last_step = step_ts
    wall_s = time.perf_counter() - start
    records = [request_record(finals[rid], answers[rid]) for rid in ids]
    summary = summarize_batch(records, wall_s, stream)
    for key, total in tier_writes(llm).items():
        summary[key.replace("_write_bytes", "_written_mib")] = (total - written[key]) / 2**20
    result = {"summary": summary, "records": records}
    return result, [answers[rid] for rid in ids], stream


def warm_up(llm: Any, args: argparse.Namespace, vocab: int, max_num_seqs: int) -> None:
    """Prompts of its own, a batch of burst-sized ones and one over a prefill chunk, so no
    measured TTFT pays the first passes' kernel set-up."""
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    batch = [
        random_prompt(SEED_WARM + i, args.burst_len, vocab) for i in range(min(16, max_num_seqs))
    ]
    run_batch(llm, batch, 4)
    long_len = min(chunk + 64, args.max_model_len - 8)
    run_batch(llm, [random_prompt(SEED_WARM + 999, long_len, vocab)], 2)


def parse_burst(spec: str) -> tuple[int, int]:
    """``N:MAXSEQS`` -> (N, MAXSEQS)."""
    n, _, m = spec.partition(":")
    return int(n), int(m)


def burst(llm: Any, args: argparse.Namespace, vocab: int, spec: str) -> dict[str, Any]:
    """N cold prompts, distinct per request, all submitted at once."""
    n, _ = parse_burst(spec)
    base = SEED_BURST + 100_000 * args.burst.index(spec)
    prompts = [random_prompt(base + i, args.burst_len, vocab) for i in range(n)]
    result, _, _ = run_batch(llm, prompts, args.burst_output)
    s = result["summary"]
    log(
        f"  burst {spec}: {s['output_tok_s']:,.1f} out tok/s, TTFT p50 {s['ttft_p50']:.3f} s "
        f"p95 {s['ttft_p95']:.3f} s, peak running {s['peak_running']}, cached {s['cached_tokens']}"
        f"; {itl_text(s)}"
    )
    return result


def itl_text(s: dict[str, Any]) -> str:
    """The streaming figures of a summary, for the log."""
    return (
        f"ITL p50 {s['itl_p50_ms']:.1f} ms p99 {s['itl_p99_ms']:.1f} ms max "
        f"{s['itl_max_ms']:.1f} ms, longest step gap {s['step_gap_max_ms']:.1f} ms"
    )


def sessions(llm: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """S sessions over one system prompt, turn by turn, each turn of all sessions together;
    each next prompt echoes the whole history with this side's own answers."""
    system = random_prompt(SEED_SYSTEM, args.system_len, vocab)
    history = [list(system) for _ in range(args.sessions)]
    turns = []
    pooled = Stream()
    for t in range(args.turns):
        prompts = [
            h + random_prompt(SEED_USER + 1_000 * s + t, args.user_len, vocab)
            for s, h in enumerate(history)
        ]
        result, answers, stream = run_batch(llm, prompts, args.session_output)
        history = [p + a for p, a in zip(prompts, answers, strict=True)]
        turns.append(result)
        pooled.extend(stream)
        s = result["summary"]
        log(
            f"  sessions turn {t + 1}: hit rate {s['hit_rate']:.1%}, TTFT p50 "
            f"{s['ttft_p50']:.3f} s p95 {s['ttft_p95']:.3f} s, {s['output_tok_s']:,.1f} out tok/s"
            f"; {itl_text(s)}"
        )
    summary = pooled.figures()
    log(f"  sessions, all turns: {itl_text(summary)}")
    return {"turns": turns, "summary": summary}


def profile_dir(config: str, max_num_seqs: int) -> Path:
    """Where vLLM's profiler writes an engine's trace (large; only its table is kept)."""
    return Path("/tmp/vllm_hpc_load_profile") / f"{config}_{max_num_seqs}"


PREFILL_TIMED_STEPS = 4
"""Prefill steps timed, without the profiler, when ``--profile-steps`` starts (fewer when the
burst's prompts fill fewer than these and the profiled ones: those must be prefill steps)."""
PREFILL_PROFILE_STEPS = 3
"""Prefill steps profiled next (full-budget chunks of the burst)."""
FINISH_PROFILE_STEPS = 48
"""At most this many steps profiled while the requests finish."""


def profiled(
    llm: Any, e: dict[str, Any], out: Path, name: str, head: str, steps: int | None = None
) -> int:
    """Run ``steps`` engine steps under vLLM's profiler (None: until no request is left, at
    most FINISH_PROFILE_STEPS); its kernel table goes to ``name``. The steps run."""
    engine = llm.llm_engine
    table_dir = profile_dir(e["config"], e["max_num_seqs"])
    limit = FINISH_PROFILE_STEPS if steps is None else steps
    done = 0
    llm.start_profile()
    while done < limit and (steps is not None or engine.has_unfinished_requests()):
        engine.step()
        done += 1
    llm.stop_profile()
    tables = sorted(table_dir.glob("*profiler_out*.txt"), key=lambda t: t.stat().st_mtime)
    table = tables[-1].read_text() if tables else "(vLLM wrote no profiler table)"
    for stale in tables:  # the next session's table must not be mistaken for this one
        stale.unlink()
    (out / name).write_text(f"{head}\n\n{table}")
    return done


def step_profile(
    llm: Any, args: argparse.Namespace, vocab: int, e: dict[str, Any], out: Path
) -> dict[str, Any]:
    """The first burst's size of cold prompts, stepped by hand: the first prefill steps timed,
    the next under the profiler; then, once every request decodes, K timed decode steps and K
    more under the profiler; then, from the first finish on, the steps in which they finish
    (their write-through at release) under the profiler too."""
    from vllm import SamplingParams

    n = parse_burst(args.burst[0])[0]
    k = args.profile_steps
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=args.burst_output, temperature=0.0, ignore_eos=True)
    ids = [f"profile-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        prompt = random_prompt(SEED_PROFILE + i, args.burst_len, vocab)
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    tag = f"{e['config']}_{e['max_num_seqs']}"
    full_steps = -(-n * args.burst_len // e["facts"]["max_num_batched_tokens"])
    timed = max(0, min(PREFILL_TIMED_STEPS, full_steps - PREFILL_PROFILE_STEPS))
    held = min(PREFILL_PROFILE_STEPS, full_steps - timed)
    prefill_ms = []
    for _ in range(timed):
        start = time.perf_counter()
        engine.step()
        prefill_ms.append((time.perf_counter() - start) * 1000)
    start = time.perf_counter()
    profiled(
        llm,
        e,
        out,
        f"profile_{tag}_prefill.txt",
        f"the {PREFILL_PROFILE_STEPS} steps after the first {timed} once {n} prompts arrived "
        f"together (about {held} of them prefill)",
        PREFILL_PROFILE_STEPS,
    )
    prefill_s = time.perf_counter() - start
    decoding: set[str] = set()
    while len(decoding) < n:
        decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    for _ in range(3):  # the steps already in flight when the last prefill finished
        engine.step()
    start = time.perf_counter()
    for _ in range(k):
        engine.step()
    step_ms = (time.perf_counter() - start) / k * 1000
    head = f"decode step {step_ms:.2f} ms at {n} requests"
    profiled(llm, e, out, f"profile_{tag}.txt", head, k)
    while engine.has_unfinished_requests() and not any(o.finished for o in engine.step()):
        pass  # decode on to the first finish
    finish_steps = profiled(
        llm,
        e,
        out,
        f"profile_{tag}_finish.txt",
        f"the steps after the first of {n} requests finished: they finish in waves, one per "
        "prefill step, each written through to the host tier at its release",
    )
    engine.abort_request(ids)  # any left after FINISH_PROFILE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    log(
        f"  profile: prefill steps {', '.join(f'{t:.0f}' for t in prefill_ms) or '(none)'} ms "
        f"timed; {step_ms:.2f} ms per decode step at {n} requests; {finish_steps} finishing steps "
        f"profiled; tables profile_{tag}*.txt"
    )
    return {
        "requests": n,
        "steps": k,
        "decode_step_ms": step_ms,
        "prefill_step_ms": prefill_ms,
        "prefill_profiled_s": prefill_s,
        "finish_steps": finish_steps,
        "tables": [f"profile_{tag}_prefill.txt", f"profile_{tag}.txt", f"profile_{tag}_finish.txt"],
    }


def bench_engine(
    llm: Any, e: dict[str, Any], args: argparse.Namespace, vocab: int, out: Path
) -> dict[str, Any]:
    """Warm up, then the engine's workloads in order (bursts, then sessions)."""
    t = time.monotonic()
    warm_up(llm, args, vocab, e["max_num_seqs"])
    log(f"  warm-up {time.monotonic() - t:.1f} s")
    results: dict[str, Any] = {}
    for name in e["workloads"]:
        if name == "sessions":
            results[name] = sessions(llm, args, vocab)
        else:
            results[name] = burst(llm, args, vocab, name.removeprefix("burst "))
    measured = {"workloads": results, "bench_s": time.monotonic() - t}
    if e["config"] == HYBRID:  # calls that held the engine thread (each one is logged too)
        from vllm_hpc.glue.worker.connector_worker import slow_host_calls, slow_write_issues

        measured["slow_host_calls"] = max(llm.collective_rpc(slow_host_calls))
        measured["slow_write_issues"] = max(llm.collective_rpc(slow_write_issues))
    if args.profile_steps and e["max_num_seqs"] == parse_burst(args.burst[0])[1]:
        measured["profile"] = step_profile(llm, args, vocab, e, out)
    return measured


def run_engine(e: dict[str, Any], args: argparse.Namespace, vocab: int, out: Path) -> None:
    """Start engine ``e``, measure it, shut it down and release it, also when it fails."""
    from vllm import LLM

    e.update(started=now(), commit=revision(), sources=source_digest())
    log(f"engine {e['index']} ({e['config']}, max_num_seqs {e['max_num_seqs']}): starting")
    t = time.monotonic()
    llm = LLM(**engine_kwargs(args, e["config"], e["max_num_seqs"]))
    e["startup_s"] = time.monotonic() - t
    e["facts"] = {**engine_facts(llm), **kv_facts(llm)}
    e["mode"] = mode(e["facts"], args.cpu)
    log(f"engine {e['index']} ready in {e['startup_s']:.0f} s; {e['facts']}")
    e["load_avg_start"] = os.getloadavg()[0]  # other work on the machine skews the timings
    try:
        e["result"] = bench_engine(llm, e, args, vocab, out)
        e["load_avg_end"] = os.getloadavg()[0]
    finally:  # main() records a failure; the device is given back either way
        t = time.monotonic()
        llm.llm_engine.engine_core.shutdown()
        del llm
        release_device(cuda=not args.cpu)
        e.update(shutdown_s=time.monotonic() - t, finished=now())


# --- plan, budget, resume ------------------------------------------------------------------


def work_tokens(args: argparse.Namespace, workloads: list[str]) -> int:
    """Prompt plus output tokens of an engine's workloads: the budget scales time by it."""
    total = 0
    for name in workloads:
        if name == "sessions":
            step = args.user_len + args.session_output
            per = sum(args.system_len + t * step + step for t in range(args.turns))
            total += args.sessions * per
        else:
            n, _ = parse_burst(name.removeprefix("burst "))
            total += n * (args.burst_len + args.burst_output)
    return total


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The engines: one per configuration and max_num_seqs, bursts of that max_num_seqs
    first, the sessions in the engine of --max-num-seqs."""
    groups: dict[int, list[str]] = {}
    if "burst" in args.workloads:
        for spec in args.burst:
            groups.setdefault(parse_burst(spec)[1], []).append(f"burst {spec}")
    if "sessions" in args.workloads:
        groups.setdefault(args.max_num_seqs, []).append("sessions")
    engines: list[dict[str, Any]] = []
    for max_num_seqs, names in groups.items():
        for config in args.configs:
            engines.append(
                {
                    "index": len(engines) + 1,
                    "config": config,
                    "max_num_seqs": max_num_seqs,
                    "workloads": names,
                    "work_tokens": work_tokens(args, names),
                }
            )
    return engines


def over_budget(e: dict[str, Any], engines: list[dict[str, Any]], budget_s: float) -> str | None:
    """Why engine ``e`` is not started, or None. The estimate: the slowest start-up seen plus
    a margin, plus the measured time per work token of the engines like it (else of all)."""
    done = [d for d in engines if "result" in d]
    if not done:
        return None
    alike = [d for d in done if d["workloads"] == e["workloads"]] or done
    per_token = max((d["result"]["bench_s"] + d["shutdown_s"]) / d["work_tokens"] for d in alike)
    estimate = max(d["startup_s"] for d in done) + 20 + per_token * e["work_tokens"]
    elapsed = time.monotonic() - T0
    if elapsed + estimate <= budget_s:
        return None
    return f"not started: budget ({elapsed:.0f} + ~{estimate:.0f} s > {budget_s:.0f} s)"


MEASUREMENT_ARGS = (
    "model",
    "cpu",
    "eager",
    "load_format",
    "burst",
    "burst_len",
    "burst_output",
    "sessions",
    "turns",
    "system_len",
    "user_len",
    "session_output",
    "max_model_len",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "tensor_parallel_size",
    "native_retention",
    "admission_window",
    *(s.key for s in PLUGIN_OPTIONS),
)
"""What calls merged by --resume must share, or their engines measured different work."""


def engine_key(e: dict[str, Any]) -> tuple[str, int, tuple[str, ...]]:
    """What makes two calls' engines the same measurement, so --resume may keep one."""
    return e["config"], e["max_num_seqs"], tuple(e["workloads"])


def resumed(report: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """This call's report with the engines --resume's report measured kept, and both
    calls' commands recorded."""
    previous = json.loads(Path(args.resume).read_text())
    # An option added after the earlier call ran is missing from its arguments: its default ran.
    defaults = build_parser()
    differ = [
        k
        for k in MEASUREMENT_ARGS
        if previous["args"].get(k, defaults.get_default(k)) != getattr(args, k, None)
    ]
    if differ:
        raise SystemExit(f"--resume {args.resume}: other measurement arguments: {differ}")
    measured = {engine_key(e): e for e in previous["engines"] if "result" in e}
    report["engines"] = [
        {**measured[engine_key(e)], "index": e["index"]} if engine_key(e) in measured else e
        for e in report["engines"]
    ]
    commands = previous["meta"].get("commands", [previous["meta"]["command"]])
    report["meta"]["commands"] = [*commands, report["meta"]["command"]]
    report["meta"]["resumed"] = report["meta"]["started"]
    report["meta"]["started"] = previous["meta"]["started"]
    return report


def new_report(args: argparse.Namespace) -> dict[str, Any]:
    """The report before any engine ran: what runs, where, and in which order."""
    import torch
    import vllm

    return {
        "meta": {
            "command": shlex.join(["python", "benchmarks/load.py", *sys.argv[1:]]),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": cpu_machine() if args.cpu else f"{device_name(False)} ({cpu_machine()})",
            "host": platform.node(),
            "commit": revision(),
            "sources": source_digest(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
            "started": now(),
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engines": plan(args),
    }


# --- report --------------------------------------------------------------------------------


def side_results(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """config -> workload name -> result, from the engines that measured it."""
    ran = report["args"]["configs"]
    out: dict[str, dict[str, Any]] = {c: {} for c in CONFIGS if c in ran}
    for e in report["engines"]:
        for name, result in e.get("result", {}).get("workloads", {}).items():
            out[e["config"]][name] = result
    return out


def cell(value: float | None, fmt: str) -> str:
    """A figure, or "-" where the side did not measure it."""
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else fmt.format(value)
    )


def ratio_cell(h: float | None, n: float | None) -> str:
    return "-" if h is None or n is None or math.isnan(h) or math.isnan(n) else times(ratio(h, n))


def pair_cells(got: dict[str, dict[str, Any]], key: str, fmt: str) -> list[str]:
    """One figure of every side that ran (config -> its figures, in CONFIGS order) and
    hybrid / the baseline; "-" where a side, or an older report, lacks it."""
    sides = [c for c in CONFIGS if c in got]
    h, b = (got.get(c, {}).get(key) for c in (HYBRID, baseline(got)))
    return [*(cell(got[c].get(key), fmt) for c in sides), ratio_cell(h, b)]


def side_head(sides: Any) -> str:
    """The columns of `pair_cells`: the sides that ran, then hybrid / the baseline."""
    return " | ".join([*(c for c in CONFIGS if c in sides), f"hybrid / {baseline(sides)}"])


BURST_ROWS = (
    ("output tok/s", "output_tok_s", "{:,.1f}"),
    ("TTFT p50 (s)", "ttft_p50", "{:.3f}"),
    ("TTFT p95 (s)", "ttft_p95", "{:.3f}"),
    ("TTFT max (s)", "ttft_max", "{:.3f}"),
    ("queued p50 (s)", "queued_p50", "{:.3f}"),
    ("wall (s)", "wall_s", "{:.2f}"),
    ("most requests running at once", "peak_running", "{:d}"),
    ("preemptions", "preemptions", "{:d}"),
    ("cached prompt tokens", "cached_tokens", "{:,d}"),
    ("host tier written (MiB)", "host_written_mib", "{:,.0f}"),
    ("disk tier written (MiB)", "disk_written_mib", "{:,.0f}"),
)


STREAM_ROWS = (
    ("ITL p50 (ms)", "itl_p50_ms", "{:.2f}"),
    ("ITL p99 (ms)", "itl_p99_ms", "{:.2f}"),
    ("longest inter-token gap (ms)", "itl_max_ms", "{:.2f}"),
    ("longest engine-step gap (ms)", "step_gap_max_ms", "{:.2f}"),
    (f"engine-step gaps over {LONG_STEP_GAP_S * 1000:.0f} ms", "long_step_gaps", "{:d}"),
)
"""The streaming figures (`Stream.figures`), in the burst tables and the sessions' second one."""


KV_ROWS = (
    ("KV capacity, vLLM's figure (tokens)", "kv_cache_size_tokens", "{:,d}"),
    ("KV blocks x block size (tokens)", "kv_capacity_tokens", "{:,d}"),
    ("max concurrency at max_model_len, vLLM's figure", "kv_cache_max_concurrency", "{:,.1f}"),
)
"""The engine's KV capacity as vLLM reports it (`engine_facts` of the burst's engine)."""


def burst_table(name: str, sides: dict[str, dict[str, Any]], kv: dict[str, Any]) -> list[str]:
    """One burst: each figure for every side and hybrid / the baseline."""
    got = {c: sides[c][name]["summary"] for c in sides if name in sides[c]}
    lines = [f"### {name}", "", *table_head(f"metric | {side_head(got)}")]
    for label, key, fmt in (*BURST_ROWS, *STREAM_ROWS):
        lines.append(f"| {label} | {' | '.join(pair_cells(got, key, fmt))} |")
    for label, key, fmt in KV_ROWS:
        lines.append(f"| {label} | {' | '.join(pair_cells(kv, key, fmt))} |")
    return [*lines, ""]


SESSION_ROWS = (
    ("hit rate", "hit_rate", "{:.1%}"),
    ("TTFT p50 s", "ttft_p50", "{:.3f}"),
    ("TTFT p95 s", "ttft_p95", "{:.3f}"),
    ("out tok/s", "output_tok_s", "{:,.1f}"),
)


def session_table(
    sides: dict[str, dict[str, Any]], metrics: tuple[tuple[str, str, str], ...]
) -> list[str]:
    """Per turn: ``metrics``, both sides and their ratio. The streaming figures get a last row
    with all turns' gaps pooled (from ``sessions``' own summary)."""
    runs = {c: sides[c]["sessions"] for c in sides if "sessions" in sides[c]}
    head = " | ".join(
        " | ".join([*(f"{m} {c}" for c in runs), f"{m} hybrid / {baseline(runs)}"])
        for m, _, _ in metrics
    )
    lines = [*table_head(f"turn | prompt tokens | {head} | same answers")]
    for t in range(max((len(v["turns"]) for v in runs.values()), default=0)):
        got = {c: runs[c]["turns"][t] for c in runs if t < len(runs[c]["turns"])}
        summaries = {c: got[c]["summary"] for c in got}
        cells = [x for _, key, fmt in metrics for x in pair_cells(summaries, key, fmt)]
        prompt = next(iter(got.values()))["summary"]["prompt_tokens"]
        lines.append(f"| {t + 1} | {prompt:,} | {' | '.join(cells)} | {same_answers(got)} |")
    if metrics == STREAM_ROWS:
        pooled = {c: runs[c].get("summary", {}) for c in runs}
        cells = [x for _, key, fmt in metrics for x in pair_cells(pooled, key, fmt)]
        lines.append(f"| all turns | - | {' | '.join(cells)} | - |")
    return [*lines, ""]


def same_answers(got: dict[str, dict[str, Any]]) -> str:
    """How many of a turn's answers hybrid-prefix shares with the baseline, by digest."""
    base = baseline(got)
    if HYBRID not in got or base not in got:
        return "-"
    pairs = zip(got[base]["records"], got[HYBRID]["records"], strict=True)
    same = sum(a["answer"] == b["answer"] for a, b in pairs)
    return f"{same}/{len(got[base]['records'])}"


BURST_TARGETS = (
    ("output tok/s", "output_tok_s", ">= 0.98x {base}", GOALS["tok_s"], "{:,.1f}", True),
    ("TTFT p50", "ttft_p50", "<= 1.0x {base}", GOALS["ttft_p50"], "{:.3f} s", False),
    ("TTFT p95", "ttft_p95", "<= 1.0x {base}", GOALS["ttft_p95"], "{:.3f} s", False),
)
"""(label, summary key, goal with the baseline's name as {base}, bound of hybrid / the baseline,
format, higher is better)."""

STREAM_TARGETS = (
    ("ITL p50", "itl_p50_ms", "<= 1.02x {base} (#48)", GOALS["itl_p50"], "{:.2f} ms", False),
    ("ITL p99", "itl_p99_ms", "<= 1.05x {base} (#48)", GOALS["itl_p99"], "{:.2f} ms", False),
    (
        "longest inter-token gap",
        "itl_max_ms",
        "<= 1.5x {base} (#48)",
        GOALS["itl_max"],
        "{:.1f} ms",
        False,
    ),
)
"""Issue #48's streaming goals, as BURST_TARGETS; for bursts and the sessions' pooled turns."""


def target_row(
    target: str,
    goal: str,
    pair: tuple[float | None, float | None],
    bound: float,
    fmt: str,
    higher: bool,
) -> str:
    """One target: the measured ratio with both figures (hybrid, baseline), met when the ratio
    is on the goal's side of ``bound``."""
    h, n = pair
    if h is None or n is None:
        return f"| {target} | {goal} | not measured | - |"
    r = ratio(h, n)
    met = r >= bound if higher else r <= bound
    measured = f"{times(r)} ({fmt.format(h)} vs {fmt.format(n)})"
    return f"| {target} | {goal} | {measured} | {'yes' if met else 'NO'} |"


def workload_targets(
    sides: dict[str, dict[str, Any]], names: list[str], targets: tuple[tuple[Any, ...], ...]
) -> list[str]:
    """Per workload (a burst, or the sessions' turns pooled): ``targets`` against the
    baseline, then #48's engine-step gaps."""
    rows = []
    base = baseline(sides)
    for name in names:
        n, h = (sides.get(c, {}).get(name, {}).get("summary", {}) for c in (base, HYBRID))
        for label, key, goal, bound, fmt, higher in targets:
            pair = (h.get(key), n.get(key))
            goal = goal.format(base=base)
            rows.append(target_row(f"{name}: {label}", goal, pair, bound, fmt, higher))
        rows.append(step_gap_row(name, n, h, base))
    return rows


def step_gap_row(name: str, n: dict[str, Any], h: dict[str, Any], base: str) -> str:
    """#48's "no engine-step gap over 200 ms that native does not have", read as no more of
    them than the baseline's; the longest gap of each side beside."""
    target = f"{name}: engine-step gaps over {LONG_STEP_GAP_S * 1000:.0f} ms"
    goal = f"no more than {base} (#48)"
    hc, nc = h.get("long_step_gaps"), n.get("long_step_gaps")
    if hc is None or nc is None:
        return f"| {target} | {goal} | not measured | - |"
    longest = f"longest {h['step_gap_max_ms']:.1f} vs {n['step_gap_max_ms']:.1f} ms"
    return f"| {target} | {goal} | {hc} vs {nc} ({longest}) | {'yes' if hc <= nc else 'NO'} |"


def session_targets(sides: dict[str, dict[str, Any]]) -> list[str]:
    """Hit rate on every turn; TTFT p50 on every turn after the first (each turn's own p50:
    pooling turns would mix their distributions)."""
    base = baseline(sides)
    if not all("sessions" in sides.get(c, {}) for c in (base, HYBRID)):
        return [
            f"| sessions | hit rate >= {base}; TTFT p50 after turn 1 <= 0.6x | not measured | - |"
        ]
    turns = {c: sides[c]["sessions"]["turns"] for c in (base, HYBRID)}
    pairs = list(zip(turns[base], turns[HYBRID], strict=False))
    rows = []
    for t, (n, h) in enumerate(pairs):
        hn, hh = n["summary"]["hit_rate"], h["summary"]["hit_rate"]
        met = "yes" if hh >= hn else "NO"
        rows.append(
            f"| sessions turn {t + 1}: hit rate | >= {base} | {hh:.1%} vs {hn:.1%} | {met} |"
        )
    goal, bound = f"<= 0.6x {base}", GOALS["session_ttft_p50"]
    for t, (n, h) in enumerate(pairs[1:], start=2):
        pair = (h["summary"]["ttft_p50"], n["summary"]["ttft_p50"])
        rows.append(
            target_row(f"sessions turn {t}: TTFT p50", goal, pair, bound, "{:.3f} s", False)
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The whole report: header, a table per workload, the targets, the engines."""
    sides = side_results(report)
    bursts = [n for e in report["engines"] for n in e["workloads"] if n != "sessions"]
    bursts = list(dict.fromkeys(bursts))
    lines = [*header(report)]
    if bursts:
        lines += ["## burst", "", *burst_intro(report["args"])]
    for name in bursts:
        kv = {
            e["config"]: e["facts"]
            for e in report["engines"]
            if e.get("facts") and name in e["workloads"]
        }
        lines += burst_table(name, sides, kv)
    has_sessions = any("sessions" in e["workloads"] for e in report["engines"])
    if has_sessions:
        lines += ["## sessions", "", *session_intro(report["args"])]
        lines += [*session_table(sides, SESSION_ROWS), *session_table(sides, STREAM_ROWS)]
    lines += ["## Targets", "", *table_head("target | goal | measured | met")]
    lines += workload_targets(sides, bursts, (*BURST_TARGETS, *STREAM_TARGETS))
    if has_sessions:
        lines += [*session_targets(sides), *workload_targets(sides, ["sessions"], STREAM_TARGETS)]
    lines += [""]
    lines += engine_lines(report["engines"])
    return "\n".join(lines) + "\n"


def burst_intro(args: dict[str, Any]) -> list[str]:
    return [
        f"`burst N:M`: N cold prompts of {args['burst_len']:,} random tokens, distinct per "
        f"request, {args['burst_output']} output tokens each, submitted together to an engine "
        "with max_num_seqs M. Output tok/s: all output tokens / wall time of the burst; most "
        "running at once: from vLLM's per-request scheduled and last-token timestamps.",
        "",
    ]


STREAM_NOTE = (
    "ITL as `vllm bench serve` reports it: per request, the gaps between consecutive streamed "
    "chunks (DELTA outputs, one a step; several tokens each under MTP), timed when "
    "`LLMEngine.step()` hands them to the front end, every request's gaps pooled; the longest "
    "is the longest inter-token gap. Engine-step gaps: between consecutive engine steps that "
    "gave a request a token, on the engine core's own timestamps."
)


def session_intro(args: dict[str, Any]) -> list[str]:
    return [
        f"{args['sessions']} sessions sharing a {args['system_len']:,}-token system prompt, "
        f"{args['turns']} turns each, all sessions' turn t submitted together; each prompt is "
        f"the system prompt + the history (user messages and this side's own answers) + "
        f"{args['user_len']} new tokens; {args['session_output']} output tokens. Hit rate: "
        "cached / prompt tokens of the turn; same answers: answers equal to the baseline's "
        f"({baseline(args['configs'])}). The "
        "second table: the streaming figures per turn, and all turns' gaps pooled.",
        "",
    ]


def header(report: dict[str, Any]) -> list[str]:
    """Title, commands, machine, model and each side's mode and sources."""
    meta, args = report["meta"], report["args"]
    resumed_note = f", resumed {meta['resumed']}" if meta.get("resumed") else ""
    weights = "tiny model, CPU" if args["cpu"] else f"{args['load_format']} weights"
    lines = [
        "# Load: hybrid-prefix against vLLM's built-in caching under serving load",
        "",
        *(f"- Command: `{c}`" for c in meta.get("commands", [meta["command"]])),
        f"- Machine: {meta['device']}; vLLM {meta['vllm']}; torch "
        f"{meta['torch']}; Python {meta['python']}",
        f"- Started {meta['started']}{resumed_note}, finished {meta.get('finished', '(running)')}",
        f"- Model: `{args['model']}` ({weights}), "
        f"max_model_len {args['max_model_len']}, memory fraction {args['gpu_memory_utilization']}",
        "- Greedy, ignore_eos, token-id prompts seeded alike on both sides; TTFT is vLLM's "
        "(`RequestOutput.metrics.first_token_latency`: arrival to the first token's output)",
        f"- {STREAM_NOTE}",
        "",
        *table_head(
            "side | engine | max_num_seqs | mode | commit | vllm_hpc sources | start-up s "
            "| KV capacity (blocks x size)"
        ),
    ]
    for e in report["engines"]:
        f = e.get("facts", {})
        kv = f"{f['num_gpu_blocks']:,} x {f['block_size']}" if f else "-"
        start = f"{e['startup_s']:.0f}" if "startup_s" in e else "-"
        lines.append(
            f"| {e['config']} | {e['index']} | {e['max_num_seqs']} | {e.get('mode', '-')} "
            f"| {e.get('commit') or '-'} | {e.get('sources', '-')} | {start} | {kv} |"
        )
    return [*lines, ""]


def engine_lines(engines: list[dict[str, Any]]) -> list[str]:
    """Engines not measured and why; the settings vLLM resolved for each."""
    lines = ["## Engines", ""]
    for e in engines:
        state = e.get("error") or e.get("skipped") or ("measured" if "result" in e else "not run")
        lines.append(
            f"- {e['index']}. {e['config']}, max_num_seqs {e['max_num_seqs']}, "
            f"{', '.join(e['workloads'])}: {state}"
        )
        if "load_avg_end" in e:
            load = f"{e['load_avg_start']:.2f} / {e['load_avg_end']:.2f}"
            lines.append(f"  - load average (1 min) before / after the workloads: {load}")
        slow = e.get("result", {}).get("slow_host_calls")
        if slow is not None:
            lines.append(
                f"  - host-tier calls that held the engine thread {SLOW_CALL_SECONDS * 1000:.0f} "
                f"ms or more (the engine log names each): {slow}"
            )
        issues = e.get("result", {}).get("slow_write_issues")
        if issues is not None:
            lines.append(
                f"  - write batches whose issue took {SLOW_CALL_SECONDS * 1000:.0f} ms or more "
                f"on the write issuer's thread, beside the engine thread: {issues}"
            )
        if e.get("facts"):
            lines.append(f"  - settings: `{json.dumps(e['facts'])}`")
    return lines


def write(report: dict[str, Any], out: Path) -> None:
    """Both reports, after every engine: a run cut short keeps what it measured."""
    report["meta"]["total_s"] = time.monotonic() - T0
    (out / "load.json").write_text(json.dumps(report, indent=1))
    (out / "load.md").write_text(markdown(report))


# --- command line --------------------------------------------------------------------------


def burst_spec(text: str) -> str:
    """argparse type of --burst: ``N:MAXSEQS``, both positive."""
    try:
        n, m = parse_burst(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N:MAXSEQS") from None
    if n < 1 or m < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: N and MAXSEQS must be positive")
    return f"{n}:{m}"


def add_plugin_options(ap: argparse.ArgumentParser) -> None:
    """The plugin's own flags, for the hybrid-prefix side (unset: the plugin's defaults)."""
    group = ap.add_argument_group("hybrid-prefix options (passed in additional_config)")
    for spec in PLUGIN_OPTIONS:
        if spec.is_flag:
            group.add_argument(spec.flag, dest=spec.key, action="store_true", default=None)
        else:
            group.add_argument(spec.flag, dest=spec.key, default=None, help="see the README")


def build_parser() -> argparse.ArgumentParser:
    """The options; sizes default to None so the profile (GPU or --cpu) fills them in."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", help="model directory or Hugging Face id (default with --cpu: the tiny model)"
    )
    ap.add_argument("--out", required=True, help="directory for load.json and load.md")
    ap.add_argument("--cpu", action="store_true", help="CPU profile: tiny model, small defaults")
    ap.add_argument(
        "--configs",
        default=f"{NATIVE},{HYBRID}",
        help=f"comma-separated sides of {CONFIGS}; {NATIVE_BEST} (vLLM 0.34) only when named",
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="burst,sessions")
    ap.add_argument("--burst", action="append", type=burst_spec, help="N:MAXSEQS, repeatable")
    sizes = ap.add_argument_group("sizes (defaults: GPU profile; CPU profile with --cpu)")
    for key, value in PROFILES["gpu"].items():
        kind = float if isinstance(value, float) else int
        cpu = PROFILES["cpu"][key]
        sizes.add_argument("--" + key.replace("_", "-"), type=kind, help=f"{value}; CPU {cpu}")
    ap.add_argument("--max-num-batched-tokens", type=int, help="default: vLLM's")
    add_load_format_option(ap)
    add_eager_option(ap, scope="GPU: ")
    add_tensor_parallel_option(ap)
    ap.add_argument("--resume", type=Path, help="a load.json cut short: run what it did not")
    ap.add_argument(
        "--profile-steps", type=int, default=0, help="decode steps to time and profile (0: off)"
    )
    add_native_best_options(ap)
    add_plugin_options(ap)
    return ap


def parse_args() -> argparse.Namespace:
    """The options with the profile's defaults, checked before any engine starts."""
    ap = build_parser()
    args = ap.parse_args()
    for key, value in PROFILES["cpu" if args.cpu else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.configs = args.configs.split(",")
    args.workloads = args.workloads.split(",")
    bad = sorted(set(args.configs) - set(CONFIGS)) + sorted(set(args.workloads) - set(WORKLOADS))
    if bad:
        ap.error(f"unknown configurations or workloads: {bad}")
    check_native_best(ap, args.configs)
    args.burst = args.burst or [f"{args.burst_prompts}:{args.max_num_seqs}"]
    if len(set(args.burst)) < len(args.burst):
        ap.error("--burst: the same N:MAXSEQS twice")
    longest = args.system_len + args.turns * (args.user_len + args.session_output)
    if max(longest, args.burst_len + args.burst_output) > args.max_model_len:
        ap.error(f"--max-model-len {args.max_model_len} is below the longest request")
    if args.model is None:
        if not args.cpu:
            ap.error("--model is required without --cpu")
        from vllm_hpc.tiny_model import tiny_model_path

        args.model = str(tiny_model_path())
    return args


def main() -> None:
    """Run the planned engines in order; a failed one is recorded and the next still runs."""
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"importing vLLM (args: {vars(args)})")
    vocab = vocab_size(args.model)
    report = new_report(args)
    if args.resume:
        report = resumed(report, args)
    write(report, out)
    failed = False
    for i, e in enumerate(report["engines"]):
        if "result" in e:  # measured by the call --resume continues
            continue
        skipped = over_budget(e, report["engines"], args.budget_s)
        if skipped:
            for later in report["engines"][i:]:
                if "result" not in later:
                    later["skipped"] = skipped
            log(f"engine {e['index']} and later {skipped}; --resume {out / 'load.json'} runs them")
            break
        try:
            run_engine(e, args, vocab, out)
        except Exception as exc:  # recorded; the next side still runs
            e["error"] = f"{type(exc).__name__}: {exc}"
            log(f"engine {e['index']} ({e['config']}) failed: {e['error']}")
            failed = True
        write(report, out)
    report["meta"]["finished"] = now()
    write(report, out)
    print(markdown(report), flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
