"""The main job on the embedded default: a multi-turn conversation on the tiny Qwen3.5.

    .venv/bin/python -m vllm_hpc.demo [--kv-cache-manager both|native|hybrid-prefix] [--turns 4]

It replays one conversation as token ids (no tokenizer): a shared system preamble, user
turns, each answer appended to the history, then a retry of the last turn and an edit inside an
earlier turn, once with vLLM's built-in caching and once with vllm_hpc's hybrid prefix cache.
For each request it prints the prompt length, the tokens each engine reports as served from its
prefix cache and the time, and checks each engine's greedy tokens against a cold run of the same
prompt (vLLM with no prefix caching): the same, or where they first differ, with the cold run's
top-1 margin there and whether that is a near-tie under the README's rule
(`vllm_hpc.exactness`).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_hpc.exactness import first_parting, top1_margins
from vllm_hpc.options import KVCacheManager
from vllm_hpc.tiny_model import DEFAULT_RECIPE, llm_kwargs

Generate = Callable[[str, list[int]], list[int]]


def play_conversation(generate: Generate, turns: int, seed: int = 0) -> None:
    """Send the conversation's requests through `generate(label, prompt) -> answer tokens`."""
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(DEFAULT_RECIPE.vocab_size) for _ in range(n)]

    history = text(1200)  # system prompt and tools
    prompts = []
    for k in range(turns):
        prompt = history + text(rng.randrange(150, 400))
        prompts.append(prompt)
        history = prompt + generate(f"turn {k + 1}", prompt)
    generate("retry of the last turn", prompts[-1])
    middle = prompts[len(prompts) // 2]
    generate("edit inside an earlier turn", middle[: len(middle) - 100] + text(120))


@dataclass(frozen=True)
class Result:
    label: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    tokens: list[int]
    margins: list[float]
    """The top-1 margin of every generated token (the cold reference's are the ones judged)."""


Request = tuple[str, list[int]]
COLD = "cold reference"


def run(
    name: str,
    engine: dict[str, object],
    turns: int,
    answer_tokens: int,
    replay: list[Request] | None,
) -> tuple[list[Request], list[Result]]:
    """Play the conversation on one engine (or replay another engine's exact requests)."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**llm_kwargs(None, **engine))
    print(f"[{name}] engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    params = SamplingParams(
        max_tokens=answer_tokens, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=2
    )
    requests: list[Request] = []
    results: list[Result] = []

    def generate(label: str, prompt: list[int]) -> list[int]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        answer = out.outputs[0]
        tokens = list(answer.token_ids)
        margins = top1_margins(answer.logprobs or [])
        requests.append((label, prompt))
        results.append(Result(label, len(prompt), out.num_cached_tokens, seconds, tokens, margins))
        return tokens

    if replay is None:
        play_conversation(generate, turns)
    else:
        for label, prompt in replay:
            generate(label, prompt)
    llm.llm_engine.engine_core.shutdown()
    return requests, results


def verdict(result: Result, cold: Result) -> str:
    parting = first_parting(result.tokens, cold.tokens, cold.margins)
    return "same as cold" if parting is None else parting.describe()


def print_table(runs: dict[str, list[Result]]) -> None:
    managers = [name for name in runs if name != COLD]
    header = f"{'request':<29}{'prompt':>7}"
    for m in managers:
        header += f"{'cached ' + m:>21}{'s':>7}"
    print(header + "  greedy tokens against the cold run")
    for k, cold in enumerate(runs[COLD]):
        line = f"{cold.label:<29}{cold.prompt_tokens:>7}"
        for m in managers:
            line += f"{runs[m][k].cached_tokens:>21}{runs[m][k].seconds:>7.3f}"
        verdicts = "; ".join(f"{m}: {verdict(runs[m][k], cold)}" for m in managers)
        print(f"{line}  {verdicts}")
    print(
        "(Every engine gets the same requests; the cold run is the same prompt alone, with no "
        "prefix caching. Where an answer differs from it: the first position and the cold "
        "run's top-1 margin there. A parting is allowed only at a near-tie, a margin under "
        "0.5 nat, where a different computation of the same prefix can round a bf16 logit the "
        "other way; see the README.)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kv-cache-manager",
        choices=["both", *(m.value for m in KVCacheManager)],
        default="both",
        help="run one cache manager, or both side by side (default); a cold run is the reference",
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=96)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the table readable
    chosen = (
        list(KVCacheManager)
        if args.kv_cache_manager == "both"
        else [KVCacheManager(args.kv_cache_manager)]
    )
    engines: dict[str, dict[str, object]] = {
        m.value: {"additional_config": {"kv_cache_manager": m.value}} for m in chosen
    }
    engines[COLD] = {"enable_prefix_caching": False}
    runs: dict[str, list[Result]] = {}
    replay: list[Request] | None = None
    for name, engine in engines.items():  # later engines replay the first one's exact requests
        replay, runs[name] = run(name, engine, args.turns, args.answer_tokens, replay)
    print_table(runs)


if __name__ == "__main__":
    main()
