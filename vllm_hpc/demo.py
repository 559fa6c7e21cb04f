"""The main job on the embedded default: a multi-turn conversation on the tiny Qwen3.5.

    .venv/bin/python -m vllm_hpc.demo [--kv-cache-manager native] [--turns 4]

It replays one conversation as token ids (no tokenizer): a shared system preamble, user
turns, each answer appended to the history, then a branch (a retry of an earlier turn) and an
edit deep in the history. For each request it prints the prompt length, the tokens vLLM
reports as served from the prefix cache, the time, and the first generated tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable

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


def run(manager: KVCacheManager, turns: int, answer_tokens: int) -> None:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**llm_kwargs(additional_config={"kv_cache_manager": manager.value}))
    print(f"[{manager.value}] engine ready in {time.perf_counter() - started:.1f} s")
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, detokenize=False)
    print(f"{'request':<30}{'prompt':>8}{'cached':>8}{'seconds':>9}  first tokens")

    def generate(label: str, prompt: list[int]) -> list[int]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        tokens = list(out.outputs[0].token_ids)
        print(f"{label:<30}{len(prompt):>8}{out.num_cached_tokens:>8}{seconds:>9.3f}  {tokens[:6]}")
        return tokens

    play_conversation(generate, turns)
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kv-cache-manager",
        choices=[m.value for m in KVCacheManager],
        default=KVCacheManager.NATIVE.value,
    )
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the table readable
    run(KVCacheManager(args.kv_cache_manager), args.turns, args.answer_tokens)


if __name__ == "__main__":
    main()
