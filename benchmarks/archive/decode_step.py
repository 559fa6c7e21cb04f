"""Decode step time with and without the hybrid prefix cache (tiny CPU model, engine in-process).

Eight 300-token requests decode together; the step time is (time for 132 tokens - time for 4
tokens) / 128, so prefill and start-up cancel out. One engine per configuration, back to back:
`native` (vLLM's prefix caching), `hybrid-device` (`--host-cache-mib 0`), `hybrid-host` (the
default host tier). What it isolates is the cache's own per-step work (scheduling hooks,
commits, the connector), which the model's forward pass would hide on a large model.

    .venv/bin/python benchmarks/archive/decode_step.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "native": {},
    "hybrid-device": {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 0},
    "hybrid-host": {"kv_cache_manager": "hybrid-prefix"},
}


def prompts(seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(4000) for _ in range(300)]} for _ in range(8)]


def seconds(llm: Any, seed: int, tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts(seed), params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from vllm_hpc.tiny_model import llm_kwargs

    results = {}
    for name, config in CONFIGS.items():
        llm = LLM(**llm_kwargs(additional_config=config, max_num_batched_tokens=2048))
        seconds(llm, 0, 8)  # warm
        steps = []
        for rep in range(args.repeats):
            short = seconds(llm, 100 + rep, 4)
            long = seconds(llm, 200 + rep, 132)
            steps.append((long - short) / 128 * 1000)
        results[name] = steps
        llm.llm_engine.engine_core.shutdown()
        del llm
    print("| configuration | decode step, 8 requests (ms), per repeat | median |")
    print("|---|---|---|")
    for name, steps in results.items():
        runs = ", ".join(f"{s:.2f}" for s in steps)
        print(f"| {name} | {runs} | {statistics.median(steps):.2f} |")


if __name__ == "__main__":
    main()
