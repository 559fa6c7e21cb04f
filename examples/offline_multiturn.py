"""A multi-turn conversation through vLLM's Python API with the hybrid prefix cache.

    .venv/bin/python examples/offline_multiturn.py [MODEL_DIR]

Without MODEL_DIR it uses the embedded tiny Qwen3.5 (token-id prompts, no tokenizer). Each turn
sends the whole history again; the cache serves the previous turn's prefix, and the plugin's
metrics say how.
"""

from __future__ import annotations

import random
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_hpc.tiny_model import llm_kwargs, tiny_model_path

    model = sys.argv[1] if len(sys.argv) > 1 else str(tiny_model_path())
    llm = LLM(**llm_kwargs(model, additional_config={"kv_cache_manager": "hybrid-prefix"}))
    params = SamplingParams(max_tokens=96, temperature=0.0, detokenize=False, ignore_eos=True)
    rng = random.Random(0)
    history = [rng.randrange(4096) for _ in range(1500)]  # a system prompt, as token ids
    for turn in range(4):
        prompt = history + [rng.randrange(4096) for _ in range(200)]  # the user's next message
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        print(f"turn {turn + 1}: {len(prompt)} prompt tokens, {out.num_cached_tokens} cached")
        history = prompt + list(out.outputs[0].token_ids)
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:hpc_") and getattr(metric, "value", None):
            print(f"{metric.name} {dict(metric.labels)}: {metric.value}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
