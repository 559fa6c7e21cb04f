"""Token hit rate of hybrid-prefix against vLLM's built-in prefix caching, on the tiny model.

Replays every workload of `benchmarks/workloads.py` on three engines at equal memory (the same
`gpu_memory_utilization`, from `llm_kwargs`): vLLM's caching with its default retention, vLLM's
caching with dense retention (a recurrent-state checkpoint kept every block), and
`kv_cache_manager=hybrid-prefix`. The hit rate is what vLLM reports: the sum of
`RequestOutput.num_cached_tokens` over the sum of prompt tokens, first requests included.
Requests are sent one at a time with greedy decoding, so every engine decodes each request
alone, and a fourth engine without prefix caching gives the reference answers: a cache that
changes an answer shows up in the report, with the reference's top-1 margin where it changed.
The agent loop's prompts echo the answers, so they match across engines exactly when the
answers do. All workloads of one configuration run in one engine, one after another; their
random tokens share nothing. Prints the report and writes it to --out (default:
benchmarks/results/hit_rate_cpu.md; nowhere with --quick).

    .venv/bin/python benchmarks/hit_rate.py [--quick] [--chunk TOKENS] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import (
    RESULTS,
    cpu_machine,
    margin,
    publish,
    ratio,
    revision,
    source_digest,
    table_head,
    times,
    vllm_cpu,
)
from workloads import WORKLOADS, Shape, Workload

from vllm_hpc.tiny_model import llm_kwargs

ANSWER = 48
NATIVE_BLOCK = 640
"""vLLM's hybrid block for the tiny model on CPU (engine log: "Setting attention block size to
640 tokens"); one block is the densest retention interval vLLM accepts. Checked at start-up."""

CONFIGS: dict[str, dict[str, Any]] = {
    "native": {"enable_prefix_caching": True},
    "native dense": {
        "enable_prefix_caching": True,
        "prefix_cache_retention_interval": NATIVE_BLOCK,
    },
    "hybrid-prefix": {"additional_config": {"kv_cache_manager": "hybrid-prefix"}},
}
REFERENCE = ("no cache", {"enable_prefix_caching": False})
"""vLLM without prefix caching: the answers every configuration is compared with."""


@dataclass(frozen=True)
class Served:
    """One request as the engine reported it."""

    prompt: list[int]
    cached_tokens: int
    answer: list[int]
    margins: list[float]
    """Per generated token: logprob of the greedy token minus the runner-up's (nats)."""


@dataclass(frozen=True)
class Run:
    """One configuration: its requests per workload and where the time went."""

    served: dict[str, list[Served]]
    sources: str
    """Digest of vllm_hpc's sources as the engine started (they may change between engines)."""
    block_size: int
    chunk: int
    kv_tokens: int
    start_s: float
    workload_s: dict[str, float]


def replay(llm: Any, workload: Workload, params: Any) -> list[Served]:
    """Send the workload's prompts one at a time, feeding each answer back to it."""
    served = []
    prompt = next(workload)
    while True:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        answer = list(out.outputs[0].token_ids)
        margins = [margin(step) for step in out.outputs[0].logprobs]
        served.append(Served(prompt, out.num_cached_tokens or 0, answer, margins))
        try:
            prompt = workload.send(answer)
        except StopIteration:
            return served


def run_config(overrides: dict[str, Any], scale: float) -> Run:
    from vllm import LLM, SamplingParams

    sources = source_digest()
    started = time.perf_counter()
    llm = LLM(**llm_kwargs(**overrides))
    start_s = time.perf_counter() - started
    config = llm.llm_engine.vllm_config
    block_size = config.cache_config.block_size
    if "prefix_cache_retention_interval" in overrides and block_size != NATIVE_BLOCK:
        raise RuntimeError(f"vLLM's block is {block_size} tokens, NATIVE_BLOCK assumes 640")
    params = SamplingParams(
        max_tokens=ANSWER, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=2
    )
    served, seconds = {}, {}
    try:
        for name, workload in WORKLOADS.items():
            began = time.perf_counter()
            served[name] = replay(llm, workload(Shape(scale=scale)), params)
            seconds[name] = time.perf_counter() - began
    finally:
        llm.llm_engine.engine_core.shutdown()
    return Run(
        served,
        sources,
        block_size,
        config.scheduler_config.max_num_batched_tokens,
        config.cache_config.kv_cache_size_tokens,
        start_s,
        seconds,
    )


def rate(requests: list[Served]) -> tuple[int, int, float]:
    prompt = sum(len(r.prompt) for r in requests)
    cached = sum(r.cached_tokens for r in requests)
    return prompt, cached, cached / prompt


def divergences(run: list[Served], reference: list[Served]) -> str:
    """Requests whose greedy answer differs from the reference's, each as `#request@token
    (margin)`: the first differing answer token and the reference's top-1 margin there, which
    tells a near-tie (a few bf16 ulps, < 0.5 nat) from a real difference. A request whose prompt
    already differs (an agent loop after an earlier divergence) is marked `#request prompt`."""
    found = []
    for i, (got, ref) in enumerate(zip(run, reference, strict=True)):
        if got.prompt != ref.prompt:
            found.append(f"#{i} prompt")
        elif got.answer != ref.answer:
            k = next(
                k for k, (a, b) in enumerate(zip(got.answer, ref.answer, strict=True)) if a != b
            )
            found.append(f"#{i}@{k} ({ref.margins[k]:.3f})")
    return f"{len(found)}: " + ", ".join(found) if found else "0"


def report(
    runs: dict[str, Run], command: str, checkout: str, scale: float, total_s: float
) -> list[str]:
    native, dense, hybrid = (runs[name] for name in CONFIGS)
    return [
        *_header(command, checkout, scale, total_s),
        *_hit_rates(native, dense, hybrid),
        *_answers(native, dense, hybrid, runs[REFERENCE[0]]),
        *_engines(runs),
        *_per_request(native, dense, hybrid),
    ]


def _header(command: str, checkout: str, scale: float, total_s: float) -> list[str]:
    return [
        "# Token hit rate: hybrid-prefix vs vLLM's prefix caching (CPU, tiny Qwen3.5)",
        "",
        f"Command: `{command}` (checkout {checkout} at the start)  ",
        f"Machine: {cpu_machine()}, {vllm_cpu()}, bf16, eager, "
        f"embedded tiny Qwen3.5 (3 GDN + 1 attention layer); {total_s:.0f} s in all.  ",
        f"Engines: `llm_kwargs` defaults, so the same gpu_memory_utilization "
        f"({llm_kwargs()['gpu_memory_utilization']}) for all; answers of {ANSWER} greedy "
        f"tokens (temperature 0, ignore_eos), one request at a time; workload lengths x{scale}.  ",
        "Configurations: **native** = vLLM's prefix caching, default retention; **native "
        f"dense** = the same with `prefix_cache_retention_interval={NATIVE_BLOCK}` (one block); "
        "**hybrid-prefix** = `additional_config={'kv_cache_manager': 'hybrid-prefix'}`, "
        "default tap options.",
        "",
    ]


def _hit_rates(native: Run, dense: Run, hybrid: Run) -> list[str]:
    lines = [
        "Hit rate = cached prompt tokens (`RequestOutput.num_cached_tokens`) / prompt tokens, "
        "over all requests of the workload, first request included.",
        "",
        *table_head(
            "workload | requests | prompt tokens | native: cached (rate) | native dense: cached "
            "(rate) | hybrid-prefix: cached (rate) | hybrid / native | hybrid / native dense"
        ),
    ]
    for name in WORKLOADS:
        stats = [rate(run.served[name]) for run in (native, dense, hybrid)]
        prompts = "/".join(sorted({str(p) for p, _, _ in stats}))
        cells = [f"{c} ({r:.3f})" for _, c, r in stats]
        vs_native, vs_dense = (times(ratio(stats[2][2], stats[i][2]), unit="") for i in (0, 1))
        lines.append(
            f"| {name} | {len(hybrid.served[name])} | {prompts} | {' | '.join(cells)} | "
            f"{vs_native} | {vs_dense} |"
        )
    return lines


def _answers(native: Run, dense: Run, hybrid: Run, cold: Run) -> list[str]:
    lines = [
        "",
        f"Greedy answers compared request by request with those of vLLM without prefix caching "
        f"(**{REFERENCE[0]}**, a fourth engine): the number of requests whose answer differs, "
        "each as `#request@first differing token (the reference's top-1 margin there, nats)`; "
        "`#request prompt`: the prompt already differs (agent loop after a divergence). Last "
        "column: requests whose answers differ between hybrid-prefix and native.",
        "",
        *table_head(
            f"workload | native vs {REFERENCE[0]} | native dense vs {REFERENCE[0]} | "
            f"hybrid-prefix vs {REFERENCE[0]} | hybrid-prefix vs native"
        ),
    ]
    for name in WORKLOADS:
        cells = [
            divergences(run.served[name], cold.served[name]) for run in (native, dense, hybrid)
        ]
        differ = sum(
            a.answer != b.answer
            for a, b in zip(hybrid.served[name], native.served[name], strict=True)
        )
        lines.append(f"| {name} | {' | '.join(cells)} | {differ} |")
    return lines


def _engines(runs: dict[str, Run]) -> list[str]:
    lines = [
        "",
        "Engines as they started (vllm_hpc sources: sha1 of `vllm_hpc/**/*.py` when the engine "
        "started; block and prefill chunk as resolved by vLLM; KV capacity as vLLM logs it) and "
        "wall time in seconds:",
        "",
        *table_head(
            "configuration | vllm_hpc sources | block | prefill chunk | KV capacity (tokens) | "
            f"engine start | {' | '.join(WORKLOADS)} | total"
        ),
    ]
    for config, run in runs.items():
        seconds = " | ".join(f"{s:.1f}" for s in run.workload_s.values())
        total = run.start_s + sum(run.workload_s.values())
        lines.append(
            f"| {config} | {run.sources} | {run.block_size} | {run.chunk} | {run.kv_tokens:,} | "
            f"{run.start_s:.1f} | {seconds} | {total:.1f} |"
        )
    return lines


def _per_request(native: Run, dense: Run, hybrid: Run) -> list[str]:
    lines = [
        "",
        "Per request: prompt tokens: cached tokens native / native dense / hybrid-prefix.",
        "",
    ]
    for name in WORKLOADS:
        rows = zip(native.served[name], dense.served[name], hybrid.served[name], strict=True)
        cells = [
            f"{len(a.prompt)}: {a.cached_tokens} / {b.cached_tokens} / {c.cached_tokens}"
            for a, b, c in rows
        ]
        lines.append(f"- {name}: " + "; ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half-length workloads")
    parser.add_argument(
        "--chunk", type=int, help="prefill chunk (max_num_batched_tokens) of every engine"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: benchmarks/results/hit_rate_cpu.md; with --quick: none)",
    )
    args = parser.parse_args()
    scale = 0.5 if args.quick else 1.0
    chunk = {"max_num_batched_tokens": args.chunk} if args.chunk else {}
    checkout = revision()
    started = time.perf_counter()
    runs = {
        name: run_config({**overrides, **chunk}, scale)
        for name, overrides in [REFERENCE, *CONFIGS.items()]
    }
    command = " ".join([".venv/bin/python benchmarks/hit_rate.py", *sys.argv[1:]])
    lines = report(runs, command, checkout, scale, time.perf_counter() - started)
    publish(lines, args.out or (None if args.quick else RESULTS / "hit_rate_cpu.md"))


if __name__ == "__main__":
    main()
