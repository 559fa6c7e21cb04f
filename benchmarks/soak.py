"""Soak: random sessions against a real OpenAI server under device and host pressure, then
checks that nothing broke, leaked or changed an answer.

One server (`tests/server_support.py`, the server tests' harness) on the tiny model with a small
device pool and a small host tier; its engine audits the cache's invariants at every step, so a
broken invariant ends the run with 500s. Eight client threads run random sessions until
``--seconds`` or ``--requests``:

- echo: a multi-turn chat whose every turn repeats the previous prompt and answer;
- branch: an earlier recorded prompt cut at one of its turns, then new tokens;
- edit: an earlier recorded prompt cut anywhere (deep edits included), then new tokens;
- retry: an earlier recorded prompt sent again as it is;
- preamble: one of two shared system prefixes, then new tokens;
- cancel: a streamed request whose client disconnects after a few chunks;
- abort: a streamed long prompt whose client disconnects before the first token;
- fresh: a new prompt of any length from 2 tokens to 3,000.

Then, in order:

- the engine is alive (`/health`);
- a sample of the answered requests is sent again with a fresh `cache_salt`, so it misses every
  entry; each answer must equal the cold one up to the near-tie rule (`vllm_hpc.exactness`);
- nothing leaked: one last request needing almost the whole device pool is served (pages held
  by a request that ended would leave no room for it);
- host memory: the server's resident memory grew by no more than the host tier plus
  ``--rss-slack-mib``.

Prints the counts and writes `soak.json` and `soak.md` to ``--out`` when given:

    .venv/bin/python benchmarks/soak.py --seconds 1800 --out benchmarks/results   # 30 min
    .venv/bin/python benchmarks/soak.py --requests 60                             # short
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from vllm_hpc.tiny_model import DEFAULT_RECIPE, tiny_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_support import (
    greedy_body,
    metrics,
    model_id,
    parting_from_cold,
    post,
    running_server,
)

KINDS = ("echo", "branch", "edit", "retry", "preamble", "cancel", "abort", "fresh")
DEVICE_PAGES = 345
"""vLLM blocks of the server (one is its null block): 344 pages of 64 tokens, which hold KV
pages and states alike (a state takes a row of 25, §5.4): 119 KV pages when all eight requests
run, more when fewer do."""
MAX_MODEL_LEN = 7_424
"""The longest request the soak sends last: 116 pages and its state row, which fit only if
nothing leaked."""
LAST_PROMPT = MAX_MODEL_LEN - 64
HOST_MIB = 48
CONCURRENCY = 8


@dataclass(frozen=True)
class Answered:
    prompt: list[int]
    tokens: list[int]
    cached: int


@dataclass
class Tally:
    """What the sessions did, shared by the client threads (under ``lock``)."""

    kinds: Counter[str] = field(default_factory=Counter)
    answered: list[Answered] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, answer: Answered | None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            if answer is not None:
                self.answered.append(answer)
                self.cached_tokens += answer.cached
                self.prompt_tokens += len(answer.prompt)

    def pick(self, rng: random.Random) -> Answered | None:
        with self.lock:
            return rng.choice(self.answered) if self.answered else None


class Client:
    """Greedy completions against one server."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.model = model_id(base)

    def complete(self, prompt: list[int], max_tokens: int, salt: str | None = None) -> Any:
        status, answer = post(self.base, greedy_body(self.model, prompt, max_tokens, salt))
        if status != 200:
            raise RuntimeError(f"status {status}: {json.dumps(answer)[:300]}")
        return answer

    def hang_up(self, prompt: list[int], chunks: int) -> None:
        """Stream a completion and disconnect after ``chunks`` chunks (0: before the first)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        request = urllib.request.Request(
            f"{self.base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            for _ in range(chunks):
                response.readline()


def _tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(DEFAULT_RECIPE.vocab_size) for _ in range(length)]


def _answer(client: Client, prompt: list[int], max_tokens: int) -> Answered:
    reply = client.complete(prompt, max_tokens)
    choice = reply["choices"][0]
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    return Answered(prompt, list(choice["token_ids"]), int(cached))


def session(client: Client, tally: Tally, rng: random.Random, preambles: list[list[int]]) -> None:
    """One random session of one kind; its answered requests go to ``tally``."""
    kind = rng.choice(KINDS)
    answer = rng.randrange(8, 97)
    earlier = tally.pick(rng)
    if kind in ("branch", "edit", "retry") and earlier is None:
        kind = "fresh"
    limit = MAX_MODEL_LEN - 200
    match kind:
        case "echo":
            prompt = _tokens(rng, rng.randrange(50, 800))
            for _ in range(rng.randrange(2, 5)):
                if len(prompt) + answer > limit:
                    break
                served = _answer(client, prompt, answer)
                tally.record(kind, served)
                prompt = prompt + served.tokens + _tokens(rng, rng.randrange(20, 300))
            return
        case "branch" | "edit":
            assert earlier is not None
            cut = rng.randrange(1, len(earlier.prompt) + 1)
            if kind == "branch":
                cut = len(earlier.prompt)  # at the end of that turn, before its answer
            prompt = earlier.prompt[:cut] + _tokens(rng, rng.randrange(2, 300))
        case "retry":
            assert earlier is not None
            prompt = earlier.prompt
        case "preamble":
            prompt = rng.choice(preambles) + _tokens(rng, rng.randrange(50, 300))
        case "cancel":
            client.hang_up(_tokens(rng, rng.randrange(2, 800)), chunks=rng.randrange(1, 6))
            tally.record(kind, None)
            return
        case "abort":
            client.hang_up(_tokens(rng, rng.randrange(1500, 3000)), chunks=0)
            tally.record(kind, None)
            return
        case _:
            prompt = _tokens(rng, rng.randrange(2, 3000))
    tally.record(kind, _answer(client, prompt[:limit], answer))


def run_sessions(client: Client, args: Any) -> Tally:
    tally = Tally()
    rng = random.Random(args.seed)
    preambles = [_tokens(rng, 700) for _ in range(2)]
    deadline = time.monotonic() + args.seconds
    started = 0
    lock = threading.Lock()

    def worker(index: int) -> None:
        nonlocal started
        own = random.Random(args.seed * 1000 + index)
        while time.monotonic() < deadline:
            with lock:
                if started >= args.requests:
                    return
                started += 1
            try:
                session(client, tally, own, preambles)
            except Exception as error:  # a failure is a finding: counted, reported, run goes on
                with tally.lock:
                    tally.failures.append(f"{type(error).__name__}: {error}"[:300])

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(worker, range(CONCURRENCY)))
    return tally


def check_exact(client: Client, tally: Tally, count: int, seed: int) -> list[str]:
    """Resend a sample of answered requests cold; the answers that part beyond a near-tie."""
    rng = random.Random(seed)
    sample_ = rng.sample(tally.answered, min(count, len(tally.answered)))
    partings = []
    for k, served in enumerate(sample_):
        cold = client.complete(served.prompt, len(served.tokens), salt=f"soak-cold-{k}")
        parting = parting_from_cold(served.tokens, cold["choices"][0])
        if parting is not None and not parting.near_tie:
            partings.append(parting.describe())
    return partings


def device_name() -> str:
    """The GPU the server ran on, or "CPU"."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def resident_bytes(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="run time of the sessions")
    ap.add_argument("--requests", type=int, default=10**9, help="sessions at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exact-sample", type=int, default=12, help="answers compared cold")
    ap.add_argument("--rss-slack-mib", type=int, default=512)
    ap.add_argument("--out", type=Path, help="directory for soak.json and soak.md")
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="serve with vLLM's defaults (torch.compile, CUDA graphs) instead of enforce_eager",
    )
    ap.add_argument(
        "--additional-config",
        help='vLLM\'s --additional-config for the server, e.g. {"gdn_prefill_backend": "triton"}',
    )
    args = ap.parse_args(argv)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    log = Path(args.out or "/tmp") / "soak_server.log"
    extra = (
        "--gpu-memory-utilization",
        "0.2",
        "--max-num-seqs",
        str(CONCURRENCY),
        "--max-num-batched-tokens",
        "512",
        "--num-gpu-blocks-override",
        str(DEVICE_PAGES),
        "--host-cache-mib",
        str(HOST_MIB),
        "--device-snapshot-slots",
        "12",
        *(["--additional-config", args.additional_config] if args.additional_config else []),
    )
    t0 = time.monotonic()
    server = running_server(
        tiny_model_path(), log, *extra, max_model_len=MAX_MODEL_LEN, eager=not args.graphs
    )
    with server as (base, pid):
        startup_s = time.monotonic() - t0
        client = Client(base)
        client.complete(_tokens(random.Random(1), 100), 2)  # warm: the baseline after it
        rss_before = resident_bytes(pid)
        t1 = time.monotonic()
        tally = run_sessions(client, args)
        session_s = time.monotonic() - t1
        urllib.request.urlopen(f"{base}/health", timeout=10)
        partings = check_exact(client, tally, args.exact_sample, args.seed)
        last = client.complete(_tokens(random.Random(2), LAST_PROMPT), 2)
        rss_growth = resident_bytes(pid) - rss_before
        counters = plugin_counters(metrics(base))
    result = {
        "command": " ".join(["python", "benchmarks/soak.py", *(argv or sys.argv[1:])]),
        "mode": "torch.compile and CUDA graphs" if args.graphs else "eager",
        "device": device_name(),
        "startup_seconds": round(startup_s, 1),
        "seconds": round(session_s, 1),
        "sessions": dict(tally.kinds),
        "answered": len(tally.answered),
        "hit_rate": round(tally.cached_tokens / max(1, tally.prompt_tokens), 3),
        "failures": tally.failures,
        "compared_cold": min(args.exact_sample, len(tally.answered)),
        "mismatches": partings,
        "last_request_cached": last["usage"]["prompt_tokens_details"]["cached_tokens"],
        "rss_growth_mib": round(rss_growth / 2**20, 1),
        "rss_bound_mib": HOST_MIB + args.rss_slack_mib,
        "counters": counters,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        (args.out / "soak.json").write_text(json.dumps(result, indent=1))
        (args.out / "soak.md").write_text(report(result))
    return result


def plugin_counters(text: str) -> dict[str, float]:
    """The plugin's nonzero Prometheus counters (`vllm:hpc_*_total`, by label set)."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:hpc_") and "_total" in name and float(value):
            name = re.sub(r'(engine|model_name)="[^"]*",?', "", name).replace(",}", "}")
            values[name.replace("{}", "")] = float(value)
    return values


def passed(result: dict[str, Any]) -> bool:
    return not (
        result["failures"]
        or result["mismatches"]
        or result["rss_growth_mib"] > result["rss_bound_mib"]
    )


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Soak: random sessions against one server under pressure",
        "",
        f"- Command: `{result['command']}`",
        f"- Result: {'passed' if passed(result) else 'FAILED'}; sessions ran "
        f"{result['seconds']} s at concurrency {CONCURRENCY} on {result['device']} "
        f"({result['mode']}, server start-up {result['startup_seconds']} s before them); "
        f"device pool {DEVICE_PAGES - 1} "
        f"pages of 64 tokens, host tier {HOST_MIB} MiB; the engine audited the cache at every "
        "step",
        "",
        "| what | count |",
        "|---|---|",
    ]
    lines += [f"| requests: {kind} | {n} |" for kind, n in sorted(result["sessions"].items())]
    lines += [
        f"| answered | {result['answered']} |",
        f"| hit rate (cached / prompt tokens) | {result['hit_rate']} |",
        f"| failures | {len(result['failures'])} |",
        f"| answers compared with a cold run | {result['compared_cold']} |",
        f"| mismatches beyond a near-tie | {len(result['mismatches'])} |",
        f"| last request (almost every page) served | yes, {result['last_request_cached']} "
        "cached |",
        f"| server resident memory growth, MiB | {result['rss_growth_mib']} "
        f"(bound {result['rss_bound_mib']}) |",
    ]
    lines += [f"| `{name}` | {value:g} |" for name, value in sorted(result["counters"].items())]
    lines += [""] + [f"- failure: {f}" for f in result["failures"]]
    lines += [f"- mismatch: {m}" for m in result["mismatches"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(0 if passed(main()) else 1)
