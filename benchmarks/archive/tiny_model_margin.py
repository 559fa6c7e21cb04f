"""Measure the embedded tiny model's top-1 margin and its greedy agreement across prefill chunkings.

For each recipe (the shipped one, and the same model with the output head unscaled) and each
prefill chunk size, greedy-decode the same random token-id prompts with vLLM (no prefix cache)
and record every step's top-1 margin (logprob gap to the runner-up). Then compare the chunkings
token by token, and a repeat in a fresh engine. Writes benchmarks/results/tiny_model_margin.md
(or tiny_model_margin_batched.md with --batched).

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/archive/tiny_model_margin.py \\
      [--prompts 32] [--tokens 64] [--batched]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import statistics
import time
from typing import Any

from bench_common import RESULTS, margin, publish, table_head, vllm_cpu

from vllm_hpc.tiny_model import DEFAULT_RECIPE, TinyQwen35Recipe, llm_kwargs, tiny_model_path

CHUNKS = (2048, 128)


def decode(
    recipe: TinyQwen35Recipe, chunk: int, prompts: list[list[int]], tokens: int, batched: bool
) -> list:
    """Greedy tokens and per-step top-1 margins of every prompt, for one chunk size."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        **llm_kwargs(
            tiny_model_path(recipe), enable_prefix_caching=False, max_num_batched_tokens=chunk
        )
    )
    params = SamplingParams(max_tokens=tokens, temperature=0.0, detokenize=False, logprobs=2)
    requests = [{"prompt_token_ids": p} for p in prompts]
    if batched:  # all in flight: how they share steps depends on when each reaches the engine
        outs = llm.generate(requests, params, use_tqdm=False)
    else:
        outs = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
    llm.llm_engine.engine_core.shutdown()
    return [
        (list(out.outputs[0].token_ids), [margin(step) for step in out.outputs[0].logprobs])
        for out in outs
    ]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def row(name: str, recipe: TinyQwen35Recipe, prompts: list[list[int]], args: Any) -> str:
    """One recipe's report row: its margins at the first chunking, how many prompts keep their
    greedy tokens under the second, and how many a fresh engine repeats."""
    runs = {chunk: decode(recipe, chunk, prompts, args.tokens, args.batched) for chunk in CHUNKS}
    restart = decode(recipe, CHUNKS[0], prompts, args.tokens, args.batched)
    restart_identical = sum(a == b for (a, _), (b, _) in zip(runs[CHUNKS[0]], restart, strict=True))
    margins = sorted(m for _, ms in runs[CHUNKS[0]] for m in ms)
    divergences = [
        first_divergence(a, b)
        for (a, _), (b, _) in zip(runs[CHUNKS[0]], runs[CHUNKS[1]], strict=True)
    ]
    diverged = [d for d in divergences if d < args.tokens]
    return (
        f"| {name} | {statistics.median(margins):.3f} | "
        f"{margins[len(margins) // 20]:.4f} | {margins[len(margins) // 100]:.4f} | "
        f"{len(prompts) - len(diverged)} / {len(prompts)} | {sorted(diverged)} | "
        f"{restart_identical} / {len(prompts)} |"
    )


def report(args: Any, rows: list[str], seconds: float) -> list[str]:
    mode = "all prompts submitted at once" if args.batched else "one request at a time"
    flag = " --batched" if args.batched else ""
    return [
        f"# Tiny model: top-1 margin and greedy agreement across prefill chunkings ({mode})",
        "",
        "Command: `PYTHONPATH=benchmarks .venv/bin/python benchmarks/archive/tiny_model_margin.py "
        f"--prompts {args.prompts} "
        f"--tokens {args.tokens}{flag}`  ",
        f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, {vllm_cpu()}, "
        f"bf16, eager; {seconds:.0f} s.  ",
        f"Prompts: {args.prompts} random token-id prompts of 300-1800 tokens (seed 1); "
        f"{args.tokens} greedy tokens each, {mode}; prefill chunk (max_num_batched_tokens) "
        f"{CHUNKS[0]} vs {CHUNKS[1]}; no prefix caching.",
        "",
        *table_head(
            "recipe | median margin (nat) | p5 margin | p1 margin | prompts identical over all "
            "tokens | first differing token of the others | same chunking, fresh engine: identical"
        ),
        *rows,
        "",
        "Margin: logprob of the greedy token minus that of the runner-up, at the "
        f"{CHUNKS[0]}-token chunking. Last column: the {CHUNKS[0]}-token run repeated in a new "
        "engine.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--batched", action="store_true", help="submit all prompts at once instead of one by one"
    )
    args = parser.parse_args()

    rng = random.Random(1)
    vocab = DEFAULT_RECIPE.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randrange(300, 1800))] for _ in range(args.prompts)
    ]
    recipes = {
        "shipped (lm_head x16)": DEFAULT_RECIPE,
        "unscaled (lm_head x1)": dataclasses.replace(DEFAULT_RECIPE, lm_head_scale=1.0),
    }
    started = time.time()
    rows = [row(name, recipe, prompts, args) for name, recipe in recipes.items()]
    out = RESULTS / f"tiny_model_margin{'_batched' if args.batched else ''}.md"
    publish(report(args, rows, time.time() - started), out)


if __name__ == "__main__":
    main()
