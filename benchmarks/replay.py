"""Replay benchmark: every workload through the real engine, once per cache configuration.

Configurations, back to back in this process at equal memory (the same memory fraction):
`native` (vLLM's prefix caching, default retention), `native-dense` (the same, retention
interval = one of vLLM's blocks, read from the native engine) and `hybrid-prefix`. Workloads
(`workloads.py`, `traces.py`): the four single-session shapes, sent one request at a time; the
mix, sessions of all four kinds at Poisson arrivals with at most `--concurrency` sessions in
flight; and two public traces replayed as sessions the same way. Each engine is vLLM's
`AsyncLLM` with `vllm serve`'s defaults (prefill chunk, batch limits); TTFT and end-to-end
latency are taken at the client, from sending a request to its first and last output. Greedy
answers with top-2 logprobs, so the report can tell a near-tie from a real difference. Writes
`replay_<profile>.json` and its report (`replay_report.py`) to --out after every configuration
(--resume JSON continues a partial run).

CPU, tiny model (a few minutes):

    .venv/bin/python benchmarks/replay.py --out benchmarks/results

GPU, a config.json with dummy weights (`benchmarks/README.md` says how to run it elsewhere):

    python3 benchmarks/replay.py --profile gpu --model .gpu/model27b --traces .gpu/traces --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench_common import (
    NATIVE_BEST,
    add_eager_option,
    add_load_format_option,
    add_native_best_options,
    add_tensor_parallel_option,
    check_native_best,
    cpu_machine,
    gpu_engine_kwargs,
    margin,
    metric_values,
    native_best_kwargs,
    parallel_kwargs,
    revision,
    series,
    source_digest,
    vocab_size,
)
from replay_report import write_report
from traces import MINISWE, MOONCAKE, TRACES, Trace, fixed, trace_sessions
from workloads import WORKLOADS, Session, Shape, arrivals, mix

from vllm_hpc.options import DEFAULT_HOST_CACHE_MIB
from vllm_hpc.runtime.telemetry import COUNTERS, LEVELS
from vllm_hpc.tiny_model import DEFAULT_RECIPE, llm_kwargs

DISK = "hybrid-prefix-disk"
CONFIGS = ("native", "hybrid-prefix", "native-dense", "hybrid-prefix-host", DISK, NATIVE_BEST)
"""In this order: a run cut short still compares hybrid-prefix with native; native-dense
takes its retention interval from the native engine. `hybrid-prefix` is the device tier alone
(`host_cache_mib` 0), `hybrid-prefix-host` adds a host tier of --host-cache-mib, and
`hybrid-prefix-disk` (only when --configs names it) a disk tier of --disk-cache-gib under that
host tier, empty at its start (#50: with a small host tier, its hits beyond it). `native-best`
is vLLM 0.34's strongest built-in hybrid caching: 64-token prefix matches, the retention interval
--native-retention, cache-aware admission over --admission-window waiting requests and its CPU
offloading with the host tier's --host-cache-mib; the report then measures against it. (Runs
recorded before this split, `replay_gpu.md` and `replay_cpu_host_tier.md`, ran `hybrid-prefix`
with the plugin's default host tier; their notes say so.)"""


@dataclass(frozen=True)
class Profile:
    """Workload sizes and engine limits of one kind of run."""

    scale: float
    """Length factor of the synthetic workloads (their documented shapes are at 1)."""
    branch_scale: float
    """The same for the branching workload, alone and in the mix: edits deep in a long history."""
    trace_scale: float
    """Length factor of the traces (1: the recorded lengths)."""
    answer: int
    rate: float
    concurrency: int
    mix_sessions: int
    trace_sessions: int
    trace_turns: int
    max_prompt: int
    max_model_len: int
    memory: float


SHARED_DEVICE_SHARE = 0.05
"""`gpu_memory_utilization` with ``--kv-cache-gib``: vLLM checks only that this share is free."""

PROFILES = {
    "cpu": Profile(0.5, 1.5, 0.25, 32, 1.0, 4, 8, 3, 5, 3000, 8192, 0.2),
    "gpu": Profile(2.0, 6.0, 1.0, 8, 1.0, 8, 8, 3, 5, 100_000, 102_400, 0.85),
}


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the workload's start."""

    kind: str
    session: int
    turn: int
    prompt_tokens: int
    prompt_digest: str
    cached_tokens: int
    answer: list[int]
    margins: list[float]
    sent_s: float
    first_token_s: float
    done_s: float


@dataclass
class WorkloadRun:
    requests: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    peak_host_bytes: int = 0
    peak_device_bytes: int | None = None
    peak_load: float = 0.0
    """Highest 1-minute load average seen: other work on the machine skews the timings."""
    draft_tokens: int = 0
    """Speculative decoding (``--speculative-config``): draft tokens proposed in the workload."""
    accepted_tokens: int = 0
    """Of those, the draft tokens the target model accepted."""
    cache: dict[str, int] = field(default_factory=dict)
    """hybrid-prefix's counters over the workload that moved (`CACHE_COUNTERS`, keyed as
    `vllm_hpc.runtime.telemetry` names them); empty for vLLM's own caching."""
    disk: dict[str, int] = field(default_factory=dict)
    """hybrid-prefix's disk tier at the workload's end (`DISK_LEVELS`); empty without one."""


class Sampler:
    """Samples the peak resident memory of this process and its children (the engine core),
    the machine's load and, where nvidia-smi exists, the device memory in use; querying through
    nvidia-smi keeps CUDA out of this process, which vLLM needs before it starts its engine."""

    def __init__(self, period_s: float = 0.25) -> None:
        import psutil

        self.process = psutil.Process()
        self.smi = shutil.which("nvidia-smi")
        self.period_s = period_s
        self.host = 0
        self.device: int | None = None
        self.load = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        self.host, self.device, self.load = 0, None, 0.0

    def _loop(self) -> None:
        while not self.stop.wait(self.period_s):
            tree = [self.process, *self.process.children(recursive=True)]
            rss = 0
            for proc in tree:
                try:
                    rss += proc.memory_info().rss
                except Exception:  # a child that just exited
                    continue
            self.host = max(self.host, rss)
            self.load = max(self.load, os.getloadavg()[0])
            if self.smi:
                used = subprocess.run(
                    [self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                ).stdout.split()
                mib = sum(int(x) for x in used)
                self.device = max(self.device or 0, mib * 2**20)


def digest(tokens: list[int]) -> str:
    return hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]


async def send(engine: Any, prompt: list[int], params: Any, request_id: str, t0: float) -> dict:
    """One request; returns its timings, cached tokens, answer and top-1 margins."""
    sent = time.perf_counter() - t0
    first = None
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter() - t0
        final = out
    assert final is not None
    done = time.perf_counter() - t0
    completion = final.outputs[0]
    return {
        "cached_tokens": final.num_cached_tokens or 0,
        "answer": list(completion.token_ids),
        "margins": [round(margin(step), 4) for step in completion.logprobs],
        "sent_s": sent,
        "first_token_s": done if first is None else first,
        "done_s": done,
    }


async def replay(
    engine: Any, sessions: list[Session], params: Any, concurrency: int, ids: Any
) -> list[Record]:
    """Start each session at its time (or when fewer than `concurrency` are in flight) and send
    its prompts one after another, feeding each answer back to it."""
    slots = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    records: list[Record] = []

    async def play(index: int, session: Session) -> None:
        await asyncio.sleep(max(0.0, session.start_s - (time.perf_counter() - t0)))
        async with slots:
            prompt = next(session.turns)
            for turn in itertools.count():
                got = await send(engine, prompt, params, f"r{next(ids)}", t0)
                records.append(
                    Record(session.kind, index, turn, len(prompt), digest(prompt), **got)
                )
                try:
                    prompt = session.turns.send(got["answer"])
                except StopIteration:
                    return

    await asyncio.gather(*(play(i, s) for i, s in enumerate(sessions)))
    return sorted(records, key=lambda r: (r.session, r.turn))


def scenarios(profile: Profile, vocab: int, traces: Path) -> dict[str, Callable[[], list[Session]]]:
    """Each workload's sessions, built afresh for every engine (the generators are consumed)."""
    shape = Shape(vocab, profile.scale)
    branch = Shape(vocab, profile.branch_scale)

    def single(name: str) -> Callable[[], list[Session]]:
        size = branch if name == "branching" else shape
        return lambda: [Session(name, 0.0, WORKLOADS[name](size))]

    def trace(which: Trace, seed: int) -> Callable[[], list[Session]]:
        def build() -> list[Session]:
            prompts = trace_sessions(
                which,
                Shape(vocab, profile.trace_scale),
                profile.trace_sessions,
                profile.trace_turns,
                profile.max_prompt,
                traces,
            )
            starts = arrivals(profile.rate, len(prompts), seed)
            return [Session(which.file, t, fixed(p)) for t, p in zip(starts, prompts, strict=True)]

        return build

    built: dict[str, Callable[[], list[Session]]] = {name: single(name) for name in WORKLOADS}
    built["mix"] = lambda: mix(shape, profile.rate, profile.mix_sessions, branch=branch)
    built["mooncake trace"] = trace(MOONCAKE, 6)
    built["agent trace"] = trace(MINISWE, 7)
    return built


def engine_kwargs(
    config: str, profile: Profile, args: argparse.Namespace, block: int
) -> dict[str, Any]:
    """Engine arguments of one configuration; only the cache settings differ between them.
    With ``--speculative-config`` every configuration speculates alike."""
    cache: dict[str, Any] = {"enable_prefix_caching": True}
    if config == "native-dense":
        cache["prefix_cache_retention_interval"] = block
    if config == NATIVE_BEST:
        cache.update(native_best_kwargs(args, args.host_cache_mib))
    extra: dict[str, Any] = {}
    if config.startswith("hybrid-prefix"):
        extra["kv_cache_manager"] = "hybrid-prefix"
        extra["host_cache_mib"] = 0 if config == "hybrid-prefix" else args.host_cache_mib
    if config == DISK:
        extra["disk_cache_dir"] = str(disk_tier_dir(args))
        extra["disk_cache_gib"] = args.disk_cache_gib
    limits: dict[str, Any] = {
        "max_model_len": profile.max_model_len,
        "gpu_memory_utilization": profile.memory,
        **parallel_kwargs(args.tensor_parallel_size),
    }
    if args.speculative_config is not None:
        limits["speculative_config"] = args.speculative_config
    if args.max_num_seqs is not None:
        limits["max_num_seqs"] = args.max_num_seqs
    if args.kv_cache_gib is not None:
        # vLLM then skips its memory profiling; the share is only checked free at start-up.
        limits["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
        limits["gpu_memory_utilization"] = SHARED_DEVICE_SHARE
    if args.profile == "cpu":
        model = Path(args.model) if args.model else None
        return llm_kwargs(model, **limits, **cache, additional_config=extra)
    # The GPU settings that worked on the H200 (benchmarks/results/gpu_device_tier.md).
    return gpu_engine_kwargs(
        args.model, args.eager, extra, args.load_format, disable_log_stats=False, **limits, **cache
    )


def disk_tier_dir(args: argparse.Namespace) -> Path:
    """The disk tier's directory: a folder of its own under --disk-cache-dir, emptied before
    and after its engine (a journal left there would serve hits; its slab file is
    preallocated)."""
    return Path(args.disk_cache_dir) / "replay-disk-tier"


SPEC_COUNTERS = {
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens", None),
    "accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", None),
}
"""vLLM's speculative-decoding counters, read around each workload."""
CACHE_COUNTERS = series(COUNTERS)
"""hybrid-prefix's own counters (`vllm:hpc_*`), read around each workload too: whether a tap the
plan had was skipped for want of a device slot, or a snapshot evicted, shows in the hits only
as a shallower resume (`docs/notes/deep-edit-turn-6.md`)."""
DISK_LEVELS = series(m for m in LEVELS if m.name.startswith("disk_bytes_"))
"""hybrid-prefix's disk tier, read at each workload's end (`vllm:hpc_disk_bytes_{used,free}`):
what the tier, empty at the engine's start, holds of the workloads so far."""


async def run_config(
    kwargs: dict,
    builds: dict[str, Callable[[], list[Session]]],
    profile: Profile,
    memory: Sampler,
) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    sources = source_digest()
    started = time.perf_counter()
    # The server's context, so the prefill chunk and batch limits are `vllm serve`'s defaults.
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**kwargs), usage_context=UsageContext.OPENAI_API_SERVER
    )
    start_s = time.perf_counter() - started
    params = SamplingParams(
        max_tokens=profile.answer, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=2
    )
    config = engine.vllm_config
    result: dict[str, Any] = {
        "engine": {
            "kwargs": kwargs,
            "sources": sources,
            "start_s": start_s,
            "block": config.cache_config.block_size,
            "chunk": config.scheduler_config.max_num_batched_tokens,
            "kv_tokens": config.cache_config.kv_cache_size_tokens,
        },
        "workloads": {},
    }
    ids = itertools.count()
    try:
        # Prompts of their own first, a short one and one over a prefill chunk, so no workload
        # pays the first steps' set-up (kernel compilation on a GPU) in its TTFT.
        chunk = config.scheduler_config.max_num_batched_tokens
        for n in (64, min(chunk + 64, profile.max_model_len - profile.answer)):
            warm = [1000 + i % 2000 for i in range(n)]
            await send(engine, warm, params, f"warm-up-{n}", time.perf_counter())
        for name, build in builds.items():
            sessions = build()
            memory.reset()
            before = metric_values({**SPEC_COUNTERS, **CACHE_COUNTERS})
            began = time.perf_counter()
            records = await replay(engine, sessions, params, profile.concurrency, ids)
            wall_s = time.perf_counter() - began
            after = metric_values({**SPEC_COUNTERS, **CACHE_COUNTERS})
            spec = {k: after[k] - before[k] for k in SPEC_COUNTERS}
            cache = {k: n for k in CACHE_COUNTERS if (n := after[k] - before[k])}
            disk = {k: n for k, n in metric_values(DISK_LEVELS).items() if n}
            run = WorkloadRun(
                records,
                wall_s,
                memory.host,
                memory.device,
                memory.load,
                **spec,
                cache=cache,
                disk=disk,
            )
            result["workloads"][name] = asdict(run)
            cached = sum(r.cached_tokens for r in records)
            prompt = sum(r.prompt_tokens for r in records)
            skipped = cache.get("taps_skipped_no_slot", 0)
            print(
                f"  {name}: {len(records)} requests, cached {cached}/{prompt}, "
                f"taps skipped {skipped}",
                flush=True,
            )
    finally:
        engine.shutdown()
        del engine  # its __del__ shuts down again, which fails once Python is exiting
    return result


def machine(model: str | None) -> str:
    """The GPUs (nvidia-smi's names, no CUDA context in this process) and the CPU cores of a
    run on a model directory; the CPU on the tiny model or without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if model and smi:
        names = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
        return f"{names} ({os.cpu_count()} CPU cores)"
    return cpu_machine()


def speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config``: a JSON object with a "method"."""
    value = json.loads(text)
    if not isinstance(value, dict) or "method" not in value:
        raise argparse.ArgumentTypeError(f"not a JSON object with a method: {text}")
    return value


def parse_args() -> tuple[argparse.Namespace, Profile]:
    """The options, and the profile they pick with its fields overridden by theirs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=PROFILES, default="cpu")
    parser.add_argument(
        "--model",
        help="GPU: a model directory or Hugging Face id (dummy weights unless --load-format "
        "auto); CPU: a model with real weights instead of the tiny one "
        "(e.g. vllm_hpc.tiny_model.tiny_mtp_path())",
    )
    parser.add_argument(
        "--speculative-config",
        type=speculative_config,
        help="vLLM's --speculative-config (JSON), for every configuration alike",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        help="a fixed KV cache for every configuration (vLLM's kv_cache_memory_bytes) instead of "
        "the profile's memory share: the same bytes on every side, and other processes may share "
        "the device (no memory profiling)",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for JSON and report")
    parser.add_argument("--name", default=None, help="file stem (default: replay_<profile>)")
    parser.add_argument(
        "--configs",
        default=",".join(c for c in CONFIGS if c not in (DISK, NATIVE_BEST)),
        help=f"comma-separated; {DISK} and native-best (vLLM 0.34's flags) only when asked for",
    )
    parser.add_argument(
        "--host-cache-mib",
        type=int,
        default=DEFAULT_HOST_CACHE_MIB,
        help="host tier of hybrid-prefix-host, and native-best's CPU offloading",
    )
    add_native_best_options(parser)
    parser.add_argument(
        "--disk-cache-dir",
        type=Path,
        help=f"{DISK}: where its disk tier's folder goes (default: a temporary directory)",
    )
    parser.add_argument(
        "--disk-cache-gib", type=int, help=f"{DISK}: its disk tier (needed when it runs)"
    )
    parser.add_argument("--workloads", help="comma-separated subset, by name")
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument(
        "--resume", type=Path, help="JSON of an earlier run: keep its configurations"
    )
    parser.add_argument("--plan", action="store_true", help="print workload sizes, no engine")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="vLLM's max_num_seqs on every side (default: vLLM's); an H100 holds fewer state "
        "rows of the 27B shape than vLLM 0.34's default asks for",
    )
    add_eager_option(parser, scope="GPU: ")
    add_load_format_option(parser)
    add_tensor_parallel_option(parser)
    for knob in Profile.__dataclass_fields__:
        parser.add_argument("--" + knob.replace("_", "-"), type=float, dest=knob)
    args = parser.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}")
    check_native_best(parser, args.configs.split(","))
    if DISK in args.configs.split(","):
        if args.disk_cache_gib is None:
            parser.error(f"{DISK} needs --disk-cache-gib")
        args.disk_cache_dir = args.disk_cache_dir or Path(tempfile.mkdtemp(prefix="hpc-replay-"))
    base = PROFILES[args.profile]
    profile = Profile(
        **{
            k: type(getattr(base, k))(
                v if (v := getattr(args, k)) is not None else getattr(base, k)
            )
            for k in Profile.__dataclass_fields__
        }
    )
    return args, profile


RUN_SETTINGS: dict[str, Any] = {
    "speculative_config": None,
    "kv_cache_gib": None,
    "tensor_parallel_size": 1,
    "host_cache_mib": DEFAULT_HOST_CACHE_MIB,
    "disk_cache_gib": None,
}
"""The options every configuration of a run shares, which --resume must match, each with the
value a JSON written before the option existed ran with."""


def new_data(args: argparse.Namespace, profile: Profile) -> dict[str, Any]:
    """The run's JSON before this call's engines: --resume's, with this call recorded."""
    import vllm

    data: dict[str, Any] = json.loads(args.resume.read_text()) if args.resume else {}
    command = " ".join(["python benchmarks/replay.py", *sys.argv[1:]])
    data.setdefault("runs", []).append({"command": command, "checkout": revision()})
    if data.get("profile", asdict(profile)) != asdict(profile):
        raise SystemExit(f"--resume: {args.resume} ran another profile: {data['profile']}")
    settings = {key: getattr(args, key) for key in RUN_SETTINGS}
    for key, before in RUN_SETTINGS.items():
        ran = data.get(key, before)
        if args.resume and ran != settings[key]:
            raise SystemExit(f"--resume: {args.resume} ran --{key.replace('_', '-')} {ran}")
    data.update(
        vllm=vllm.__version__,
        machine=machine(args.model),
        model=args.model or "embedded tiny Qwen3.5 (vllm_hpc.tiny_model)",
        profile=asdict(profile),
        **settings,
    )
    data.setdefault("date", time.strftime("%Y-%m-%d %H:%M %Z"))
    data.setdefault("configs", {})
    return data


def main() -> None:
    args, profile = parse_args()
    vocab = vocab_size(args.model) if args.model else DEFAULT_RECIPE.vocab_size
    builds = scenarios(profile, vocab, args.traces)
    if args.workloads:
        builds = {k: builds[k] for k in args.workloads.split(",")}
    lengths = prompt_lengths(builds, profile.answer)
    if args.plan:
        for name, sizes in lengths.items():
            longest = max(sizes, default=0)
            print(f"{name}: {len(sizes)} requests, {sum(sizes)} prompt tokens, max {longest}")
        return
    check_fits(lengths, profile)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"replay_{args.profile}"
    path = args.out / f"{stem}.json"
    data = new_data(args, profile)
    memory = Sampler()
    for config in args.configs.split(","):
        if config in data["configs"]:
            continue
        block = data["configs"].get("native", {}).get("engine", {}).get("block", 0)
        if config == "native-dense" and not block:
            raise SystemExit("native-dense takes its retention interval from native: run it first")
        kwargs = engine_kwargs(config, profile, args, block)
        print(f"[{config}] starting", flush=True)
        if config == DISK:
            shutil.rmtree(disk_tier_dir(args), ignore_errors=True)
        try:
            data["configs"][config] = asyncio.run(run_config(kwargs, builds, profile, memory))
        finally:
            if config == DISK:
                shutil.rmtree(disk_tier_dir(args), ignore_errors=True)
        graphs = "torch.compile and CUDA graphs (vLLM's defaults)"
        data["configs"][config]["mode"] = "eager" if kwargs["enforce_eager"] else graphs
        path.write_text(json.dumps(data))
        write_report(path)  # so far: a run cut short keeps its report too
    memory.stop.set()
    path.write_text(json.dumps(data))  # also when --resume left nothing to run
    write_report(path)


def prompt_lengths(
    builds: dict[str, Callable[[], list[Session]]], answer: int
) -> dict[str, list[int]]:
    """Every request's prompt length, per workload. The replay's answers are exactly `answer`
    tokens (greedy, ``ignore_eos``) and the workloads use only their length, so answering
    with zeros gives the lengths the engines will see."""
    lengths: dict[str, list[int]] = {}
    for name, build in builds.items():
        sizes = lengths.setdefault(name, [])
        for session in build():
            prompt = next(session.turns)
            while True:
                sizes.append(len(prompt))
                try:
                    prompt = session.turns.send([0] * answer)
                except StopIteration:
                    break
    return lengths


def check_fits(lengths: dict[str, list[int]], profile: Profile) -> None:
    """Refuse, before any engine starts, a workload whose prompt and answer do not fit
    --max-model-len: vLLM rejects a prompt that long mid-run (a GPU call lost its engines'
    start-up to one) and cuts an answer short, which changes every later prompt of a session
    (`--max-prompt` bounds only the traces)."""
    for name, sizes in lengths.items():
        if not sizes:
            raise SystemExit(f"workload {name!r} has no request at these sizes (--max-prompt?)")
        need = max(sizes) + profile.answer
        if need > profile.max_model_len:
            raise SystemExit(
                f"--max-model-len {profile.max_model_len}: workload {name!r} needs {need} tokens "
                f"(a {max(sizes)}-token prompt and {profile.answer} answer tokens); raise "
                "--max-model-len, or lower --scale / --branch-scale / --trace-scale, or leave the "
                "workload out (--workloads)"
            )


if __name__ == "__main__":
    main()
