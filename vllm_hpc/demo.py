"""The main job on the embedded default: a multi-turn conversation on the tiny Qwen3.5.

    .venv/bin/python -m vllm_hpc.demo [--kv-cache-manager both|native|hybrid-prefix] [--turns 4]

It replays one conversation as token ids (no tokenizer): a shared system preamble, user
turns, each answer appended to the history, then a retry of the last turn and an edit inside an
earlier turn, once with vLLM's built-in caching and once with vllm_hpc's hybrid prefix cache.
For each request it prints the prompt length, the tokens each engine reports as served from its
prefix cache, the time, and whether both engines generated the same greedy tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

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


Request = tuple[str, list[int]]


def run(
    manager: KVCacheManager, turns: int, answer_tokens: int, replay: list[Request] | None
) -> tuple[list[Request], list[Result]]:
    """Play the conversation on one engine (or replay another engine's exact requests)."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**llm_kwargs(additional_config={"kv_cache_manager": manager.value}))
    print(f"[{manager.value}] engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    params = SamplingParams(
        max_tokens=answer_tokens, temperature=0.0, detokenize=False, ignore_eos=True
    )
    requests: list[Request] = []
    results: list[Result] = []

    def generate(label: str, prompt: list[int]) -> list[int]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        seconds = time.perf_counter() - t0
        requests.append((label, prompt))
        results.append(Result(label, len(prompt), out.num_cached_tokens, seconds, tokens))
        return tokens

    if replay is None:
        play_conversation(generate, turns)
    else:
        for label, prompt in replay:
            generate(label, prompt)
    llm.llm_engine.engine_core.shutdown()
    return requests, results


def print_table(runs: dict[KVCacheManager, list[Result]]) -> None:
    managers = list(runs)
    header = f"{'request':<30}{'prompt':>7}"
    for m in managers:
        header += f"{'cached ' + m.value:>22}{'seconds':>9}"
    if len(managers) == 2:
        header += "  greedy tokens"
    print(header)
    for row in zip(*runs.values(), strict=True):
        line = f"{row[0].label:<30}{row[0].prompt_tokens:>7}"
        for result in row:
            line += f"{result.cached_tokens:>22}{result.seconds:>9.3f}"
        if len(row) == 2:
            pairs = zip(row[0].tokens, row[1].tokens, strict=True)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            line += "  same" if first is None else f"  differ from token {first}"
        print(line)
    if len(managers) == 2:
        print(
            "(Both engines get the same requests. A request resumed from a state computed while "
            "decoding can part from a cold prefill where two bf16 logits are within an ulp; "
            "see the README.)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kv-cache-manager",
        choices=["both", *(m.value for m in KVCacheManager)],
        default="both",
        help="run one cache manager, or both side by side (default)",
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
    runs: dict[KVCacheManager, list[Result]] = {}
    replay: list[Request] | None = None
    for manager in chosen:  # the second engine replays the first one's exact requests
        replay, runs[manager] = run(manager, args.turns, args.answer_tokens, replay)
    print_table(runs)


if __name__ == "__main__":
    main()
