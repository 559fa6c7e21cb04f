"""Restart to first token with ``--prefix-cache-file`` (issue #16, spec §5.5), on the real engine.

Two engines of one configuration (hybrid-prefix, a host tier, and the disk tier of the same size
that ``--prefix-cache-file DIR`` is an alias of), one after the other:

1. The first runs a long conversation's first turn cold (``--length`` prompt tokens, then
   ``--answer`` tokens) and stops; its stop writes the tier's queue behind and syncs the
   journal.
2. The second starts from the directory (the journal's replay runs inside its start-up, before
   any request; the entries come back disk-only) and runs the conversation's next turn: the
   first turn, its answer and ``--new-tokens`` tokens, read from the disk. Then the same next
   turn again under another ``cache_salt``, so that it runs cold and its greedy answer can be
   set beside the restored one. Its start-up read (design §5.5), which would bring the entries
   into the host tier during the warm-up's steps, is stopped before them, so that the next turn
   reads from the disk, which this measures; with ``--start-up-read`` it runs instead, stepped
   to its end (timed) as an idle engine core's busy loop steps it, and the next turn restores
   from the host.

Reported: the first turn's TTFT (cold), the stop's writes (their log line), the journal's
replay (its log line), the next turn's TTFT after the restart, its cached tokens, the bytes
read from the disk and when (below), the same turn's cold TTFT (the reference), and the
restored answer against the cold one by the near-tie rule (`vllm_hpc.exactness`). The start-up
read begins after vLLM's compile, not during it (vLLM builds the scheduler, which replays the
journal, after the compile). Each engine first warms up on a short prompt
of its own. Each engine runs in a process of its own, as a restarted server does, with its
engine core in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the cache's counters can be
read.

Timed here, from a request's submission: its TTFT, to the engine step that returns its first
token; for the next turn also its read, to the end of the engine step after which the cache had
counted the bytes read (`vllm:hpc_disk_bytes{what="read"}`: every worker read and checked
them), and its admission, to the end of the step that counted its disk hit
(`vllm:hpc_hit_tokens{source="disk"}`), in which the read bytes go host -> device layer by
layer while the turn's uncached tokens are prefilled. The workers time that restore's copies
too (`TransferMeter`).

    CPU, tiny model:  .venv/bin/python benchmarks/restart.py --cpu --out /tmp/restart
    H200, 27B shape:  python3 benchmarks/restart.py --model .gpu/model27b --out $OUT
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench_common import (
    add_eager_option,
    cpu_machine,
    gpu_engine_kwargs,
    random_prompt,
    revision,
    source_digest,
    vocab_size,
)
from gpu_host_tier import cache_of, restore_totals
from gpu_speed import device_name, engine_facts, wait_device_free

from vllm_hpc.exactness import first_parting, top1_margins

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {"length": 100_000, "host_mib": 8192, "max_model_len": 102_400},
    "cpu": {"length": 6_000, "host_mib": 64, "max_model_len": 8_192},
}
SAVED = re.compile(
    r"prefix cache saved to .*?: (\d+) journaled entries, ([\d.]+) MiB written at the stop in "
    r"([\d.]+) s"
)
REPLAYED = re.compile(r"disk tier: (\d+) of (\d+) journaled entries back")


class _Lines(logging.Filter):
    """The plugin's log messages, kept to read the stop's and the replay's lines back. A filter
    on the plugin's logger, not a handler: vLLM's logging set-up at an engine's start drops the
    handlers of the loggers under "vllm" (`logging.config.dictConfig`), and with them the replay's
    line, logged during that start."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.messages.append(record.getMessage())
        return True


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    extra = {
        "kv_cache_manager": "hybrid-prefix",
        "host_cache_mib": args.host_mib,
        "prefix_cache_file": str(args.cache_dir),
    }
    limits = {"max_model_len": args.max_model_len, "disable_log_stats": False}
    if args.max_num_seqs is not None:
        limits["max_num_seqs"] = args.max_num_seqs
    if args.cpu:  # the tiny model's memory fraction, sized for the development machines
        from vllm_hpc.tiny_model import llm_kwargs

        return llm_kwargs(Path(args.model), additional_config=extra, **limits)
    return gpu_engine_kwargs(
        args.model, args.eager, extra, gpu_memory_utilization=args.gpu_memory_utilization, **limits
    )


def turn(
    llm: Any,
    prompt: list[int],
    answer: int,
    salt: str | None = None,
    on_step: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """One greedy request, stepped here so its TTFT is timed at the client (from its submission
    to the step that returns its first token): that, its cached tokens, its answer and the top-1
    margins of its tokens (for the near-tie rule). ``on_step`` gets the seconds from the
    submission to the end of each engine step."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True, logprobs=2)
    request: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    engine = llm.llm_engine
    request_id = f"restart-{time.monotonic_ns()}"
    begun = time.perf_counter()
    engine.add_request(request_id, request, params)
    ttft, last = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                last = out
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - begun
        if on_step is not None:
            on_step(time.perf_counter() - begun)
    assert last is not None and ttft is not None
    return {
        "prompt_tokens": len(prompt),
        "cached_tokens": last.num_cached_tokens or 0,
        "ttft_s": ttft,
        "answer": list(last.outputs[0].token_ids),
        "margins": top1_margins(last.outputs[0].logprobs),
    }


def started(args: argparse.Namespace, vocab: int, seed: int) -> tuple[Any, float]:
    """An engine, warmed up on a short prompt of its own, and its start-up seconds. Its
    start-up read is stopped before the warm-up's steps unless ``--start-up-read``."""
    from vllm import LLM

    begun = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    seconds = time.perf_counter() - begun
    if not args.start_up_read:
        cache_of(llm).preload.stop()
    turn(llm, random_prompt(seed, 512, vocab), 2)
    return llm, seconds


def start_up_read(llm: Any) -> dict[str, float]:
    """Step the engine until its start-up read has ended: the MiB it read (the warm-up's steps
    carried its first reads) and the seconds stepped after the warm-up."""
    cache = cache_of(llm)
    begun = time.perf_counter()
    while cache.preloading:
        llm.llm_engine.step()
    return {
        "start_up_read_mib": cache.disk.read_bytes / 2**20,
        "start_up_read_s": time.perf_counter() - begun,
    }


def stopped(llm: Any) -> float:
    """Shut the engine down (the stop's writes run in its shutdown); the seconds it took. Its device
    memory goes back when the phase's process exits (`in_own_process`): waiting for it here,
    in the process that still holds it, would only run out a timeout."""
    begun = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    return time.perf_counter() - begun


def save_line(messages: list[str]) -> dict[str, float] | None:
    for message in messages:
        found = SAVED.search(message)
        if found:
            entries, mib, seconds = found.groups()
            return {"entries": int(entries), "mib": float(mib), "seconds": float(seconds)}
    return None


def replay_line(messages: list[str]) -> dict[str, int] | None:
    for message in messages:
        found = REPLAYED.search(message)
        if found:
            back, journaled = found.groups()
            return {"back": int(back), "journaled": int(journaled)}
    return None


def first_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The first server's life: start, the cold first turn, the stop that writes to disk."""
    vocab = vocab_size(args.model)
    llm, start_s = started(args, vocab, seed=100)
    lines = _Lines()
    logging.getLogger("vllm.vllm_hpc").addFilter(lines)
    facts = engine_facts(llm)
    cold = turn(llm, random_prompt(1, args.length, vocab), args.answer)
    shutdown_s = stopped(llm)
    return {
        "first_start_s": start_s,
        "facts": facts,
        "cold": cold,
        "shutdown_s": shutdown_s,
        "save": save_line(lines.messages),
    }


def disk_read(llm: Any, next_turn: list[int], answer: int) -> dict[str, Any]:
    """The next turn, resumed from the disk: the turn, the bytes read for it, when they had
    landed and when it was admitted with its disk hit (seconds from its submission to the end
    of those engine steps), and the workers' seconds for its host -> device restore."""
    cache = cache_of(llm)
    read_before, hits_before = cache.disk.read_bytes, cache.admissions.hit_tokens_disk
    copied_before = restore_totals()
    seen: dict[str, float] = {}

    def on_step(elapsed: float) -> None:
        if cache.disk.read_bytes > read_before + seen.get("bytes", 0):
            seen.update(bytes=cache.disk.read_bytes - read_before, read_landed_s=elapsed)
        if cache.admissions.hit_tokens_disk > hits_before:
            seen.setdefault("admitted_s", elapsed)

    restored = turn(llm, next_turn, answer, on_step=on_step)
    copied = [now - before for now, before in zip(restore_totals(), copied_before, strict=True)]
    return {
        "restored_turn": restored,
        "read_bytes": cache.disk.read_bytes - read_before,
        "hit_tokens_disk": cache.admissions.hit_tokens_disk - hits_before,
        "read_landed_s": seen.get("read_landed_s"),
        "admitted_s": seen.get("admitted_s"),
        "restore_bytes": copied[0],
        "restore_s": copied[1],
    }


def second_engine(args: argparse.Namespace, next_turn: list[int]) -> dict[str, Any]:
    """The restarted server: start from the directory, the next turn, then the same turn
    cold."""
    lines = _Lines()
    logging.getLogger("vllm.vllm_hpc").addFilter(lines)
    llm, start_s = started(args, vocab_size(args.model), seed=101)
    preloaded = start_up_read(llm) if args.start_up_read else {}
    read = disk_read(llm, next_turn, args.answer)
    cold_next = turn(llm, next_turn, args.answer, salt="restart-benchmark-cold")
    stopped(llm)
    return {
        "second_start_s": start_s,
        "replay": replay_line(lines.messages),
        **preloaded,
        **read,
        "cold_next_turn": cold_next,
    }


def in_own_process(function: Any, *arguments: Any) -> Any:
    """Run one engine's phase in a fresh process, as a restarted server is: a process keeps
    device memory an in-process engine held, so a second engine would not fit beside it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *arguments).result()


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    report.update(in_own_process(first_engine, args))
    if not args.cpu:  # this process holds no CUDA context: it sees the device as it frees
        wait_device_free()
    cold = report["cold"]
    vocab = vocab_size(args.model)
    next_turn = random_prompt(1, args.length, vocab) + cold["answer"]
    next_turn += random_prompt(2, args.new_tokens, vocab)
    report.update(in_own_process(second_engine, args, next_turn))
    restored, cold_next = report["restored_turn"], report["cold_next_turn"]
    parting = first_parting(restored["answer"], cold_next["answer"], cold_next["margins"])
    report.update(
        cold=_facts(cold),
        restored_turn=_facts(restored),
        cold_next_turn=_facts(cold_next),
        speedup=cold_next["ttft_s"] / restored["ttft_s"],
        answer="same" if parting is None else parting.describe(),
        within_near_tie_rule=parting is None or parting.near_tie,
    )
    return report


def _facts(measured: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in measured.items() if k not in ("answer", "margins")}


def seconds(value: float | None) -> str:
    """A time of the report, or "-" where it was not seen (a read or a disk hit that did not
    happen)."""
    return "-" if value is None else f"{value:.3f} s"


def markdown(report: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    save = report["save"] or {}
    replay = report["replay"] or {}
    after = report["restored_turn"]
    rows = [
        (
            "first turn, cold: prompt tokens / TTFT",
            f"{report['cold']['prompt_tokens']:,} / {report['cold']['ttft_s']:.3f} s",
        ),
        (
            "the stop's writes: journaled entries, MiB written at the stop, seconds",
            f"{save.get('entries')}, {save.get('mib', 0):,.1f}, {save.get('seconds', 0):.2f} s",
        ),
        (
            "the first engine's shutdown, the stop's writes included",
            f"{report['shutdown_s']:.2f} s",
        ),
        (
            "second start-up, the journal's replay included",
            f"{report['second_start_s']:.1f} s (first start-up {report['first_start_s']:.1f} s)",
        ),
        ("journaled entries back", f"{replay.get('back')} of {replay.get('journaled')}"),
        (
            "start-up read into the host tier: MiB / seconds stepped after the warm-up",
            f"{report['start_up_read_mib']:,.1f} / {seconds(report['start_up_read_s'])}"
            if "start_up_read_s" in report
            else "stopped before the first step (the next turn reads from the disk)",
        ),
        (
            "next turn after the restart: prompt / cached tokens / TTFT",
            f"{after['prompt_tokens']:,} / {after['cached_tokens']:,} / {after['ttft_s']:.3f} s",
        ),
        ("read from the disk for it", f"{report['read_bytes'] / 2**20:,.1f} MiB"),
        (
            "its read landed / it was admitted with its disk hit, after its submission",
            f"{seconds(report['read_landed_s'])} / {seconds(report['admitted_s'])}",
        ),
        (
            "its host -> device restore, timed by the workers",
            f"{report['restore_bytes'] / 2**20:,.1f} MiB in {seconds(report['restore_s'])}",
        ),
        (
            "next turn cold (another cache_salt): cached tokens / TTFT",
            f"{report['cold_next_turn']['cached_tokens']:,} / "
            f"{report['cold_next_turn']['ttft_s']:.3f} s",
        ),
        ("cold TTFT of the next turn / TTFT after the restart", f"{report['speedup']:.1f}x"),
        ("restored answer against the cold one (greedy)", report["answer"]),
    ]
    device = cpu_machine() if args.cpu else f"{device_name(False)} ({cpu_machine()})"
    lines = [
        f"Command: `{command}`",
        "",
        f"Checkout {revision()}, vllm_hpc sources {source_digest()}; {device}; mode "
        f"{'eager' if report['facts'].get('enforce_eager') else 'torch.compile and CUDA graphs'}"
        f" ({report['facts'].get('cudagraph_mode')}); host and disk tier {args.host_mib} MiB each; "
        f"the disk tier in {args.cache_dir}.",
        "",
        "| what | measured |",
        "|---|---|",
        *(f"| {what} | {value} |" for what, value in rows),
    ]
    return "\n".join(lines) + "\n"


def add_options(ap: argparse.ArgumentParser) -> None:
    """The engines' and the conversation's options (`gpu_disk_tier.py` runs the same restart)."""
    ap.add_argument(
        "--model", help="model directory or Hugging Face id (default with --cpu: the tiny model)"
    )
    ap.add_argument("--cpu", action="store_true", help="CPU profile: tiny model, small sizes")
    ap.add_argument(
        "--dir", type=Path, help="where the disk tier's directory goes (default: a temp dir)"
    )
    ap.add_argument("--length", type=int, help="first turn's prompt tokens (100,000; CPU 6,000)")
    ap.add_argument("--host-mib", type=int, help="host tier (8192; CPU 64)")
    ap.add_argument("--max-model-len", type=int, help="102,400; CPU 8,192")
    ap.add_argument("--answer", type=int, default=96, help="output tokens of each turn")
    ap.add_argument("--new-tokens", type=int, default=256, help="the next turn's new tokens")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        help="vLLM's max_num_seqs (default: vLLM's); an H100 holds fewer state rows of the 27B "
        "shape's float32 state than vLLM 0.34's default asks for",
    )
    ap.add_argument(
        "--start-up-read",
        action="store_true",
        help="let the restarted engine's start-up read run to its end before the next turn "
        "(which then restores from the host tier); by default it is stopped, and the next turn "
        "reads from the disk",
    )
    add_eager_option(ap)


def resolve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the profile's sizes and the tiny model, and empty the disk tier's directory
    (`args.cache_dir`) so that the first engine starts with nothing on disk."""
    for key, value in PROFILES["cpu" if args.cpu else "gpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model is None:
        if not args.cpu:
            ap.error("--model is required without --cpu")
        from vllm_hpc.tiny_model import tiny_model_path

        args.model = str(tiny_model_path())
    args.dir = args.dir or Path(tempfile.mkdtemp(prefix="hpc-restart-"))
    args.dir.mkdir(parents=True, exist_ok=True)
    args.cache_dir = args.dir / "prefix-cache"
    shutil.rmtree(args.cache_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for restart.json and .md")
    add_options(ap)
    args = ap.parse_args()
    resolve(ap, args)
    command = "python benchmarks/restart.py " + " ".join(sys.argv[1:])
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "restart.json").write_text(json.dumps(report, indent=1))
    text = markdown(report, args, command)
    (args.out / "restart.md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
