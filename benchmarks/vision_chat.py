"""Multi-turn chats whose first turn carries an image, hybrid-prefix against vLLM's built-in
caching: hit rate and time to first token by turn, on the vision-language class every published
Qwen3.5 checkpoint declares.

`--cpu` runs the tiny vision-language model (real random weights, `VISION_RECIPE`). On a GPU,
`--model` is a vision-language config with dummy weights and a processor. Prompts are token ids
with an image: a conversation's history keeps one `<|image_pad|>` per image, which vLLM's
processor expands to the image's tiles, and each turn echoes the previous answer's token ids
and adds new user tokens (byte ids of the tiny model's byte-level tokenizer).

    python benchmarks/vision_chat.py --cpu --out /tmp/vision
    python benchmarks/vision_chat.py --model .gpu/model27b-vl --out $OUT

On the H200 one engine's first start fills most of a call: `--configs native` in one call and
`--resume vision_chat.json` (the first call's file) in the next run the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import (
    add_eager_option,
    gpu_engine_kwargs,
    model_config,
    publish,
    revision,
    table_head,
)

from vllm_hpc.tiny_model import VISION_RECIPE, llm_kwargs, tiny_model_path

CONFIGS = {"native": {}, "hybrid-prefix": {"kv_cache_manager": "hybrid-prefix"}}
MEASURED = ("model", "cpu", "eager", "sessions", "turns", "system", "words", "answer", "tiles")
"""The arguments both sides of a report must share (--resume checks them)."""
TILE = 32
"""Pixels of one placeholder token's tile (16-pixel patches merged 2x2)."""


def image(seed: int, tiles: tuple[int, int]) -> Any:
    from PIL import Image

    rng = random.Random(seed)
    width, height = tiles[1] * TILE, tiles[0] * TILE
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


def vision_ids(model: str) -> tuple[int, int, int]:
    """<|vision_start|>, <|image_pad|>, <|vision_end|> of the model's config."""
    config = model_config(model)
    return config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]


def engine_args(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    limits = {"limit_mm_per_prompt": {"image": 1, "video": 0}, "skip_tokenizer_init": False}
    if args.cpu:
        return llm_kwargs(Path(args.model), max_model_len=8192, additional_config=config, **limits)
    return gpu_engine_kwargs(
        args.model, args.eager, config, max_model_len=args.max_model_len, **limits
    )


async def chat(engine: Any, args: argparse.Namespace, session: int) -> list[dict[str, Any]]:
    """One conversation; a record per turn."""
    from vllm import SamplingParams

    start, pad, end = vision_ids(args.model)
    rng = random.Random(session)
    picture = image(session, (args.tiles, args.tiles))
    history = [rng.randrange(256) for _ in range(args.system)] + [start, pad, end]
    # Token ids only: a dummy model samples ids beyond the byte-level tokenizer's vocabulary.
    params = SamplingParams(
        max_tokens=args.answer, temperature=0.0, ignore_eos=True, detokenize=False
    )
    records = []
    for turn in range(args.turns):
        history += [rng.randrange(256) for _ in range(args.words)]
        prompt = {"prompt_token_ids": list(history), "multi_modal_data": {"image": picture}}
        sent = time.perf_counter()
        first = final = None
        async for out in engine.generate(prompt, params, f"s{session}t{turn}"):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            final = out
        assert final is not None and first is not None
        records.append(
            {
                "session": session,
                "turn": turn,
                "prompt_tokens": len(final.prompt_token_ids),
                "cached_tokens": final.num_cached_tokens or 0,
                "ttft_s": first - sent,
            }
        )
        history += list(final.outputs[0].token_ids)
    return records


async def measure(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(args, CONFIGS[name])))
    ready = time.perf_counter() - started
    try:
        records = []
        for session in range(args.sessions):  # one conversation at a time: TTFT is the prefill
            records += await chat(engine, args, session)
        config = engine.vllm_config
        mode = "eager" if config.model_config.enforce_eager else "torch.compile and CUDA graphs"
        return {"startup_s": ready, "mode": mode, "records": records}
    finally:
        engine.shutdown()


def by_turn(records: list[dict[str, Any]], turn: int) -> tuple[float, float]:
    """Hit rate and TTFT p50 of one turn over the sessions."""
    rows = [r for r in records if r["turn"] == turn]
    hit = sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)
    return hit, statistics.median(r["ttft_s"] for r in rows)


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> list[str]:
    native, hybrid = results["native"], results["hybrid-prefix"]
    lines = [
        "# Multi-turn chat with an image in the first turn: hybrid-prefix against native",
        "",
        *sorted({f"- Command: `{side['command']}`" for side in (native, hybrid)}),
        f"- Report written at checkout {revision()}.",
        f"- Model: `{args.model}`; {args.sessions} sessions of {args.turns} turns, one at a time; "
        f"first turn: {args.system} tokens, an image of {args.tiles}x{args.tiles} tiles, "
        f"{args.words} tokens; each later turn echoes the answer ({args.answer} tokens) and adds "
        f"{args.words}. Mode: native {native['mode']}, hybrid-prefix {hybrid['mode']}; start-up "
        f"{native['startup_s']:.0f} s and {hybrid['startup_s']:.0f} s.",
        "",
        *table_head(
            "turn | prompt tokens | native hit rate | hybrid-prefix hit rate | "
            "native TTFT p50 (ms) | hybrid-prefix TTFT p50 (ms) | TTFT hybrid / native"
        ),
    ]
    for turn in range(args.turns):
        tokens = statistics.median(
            r["prompt_tokens"] for r in hybrid["records"] if r["turn"] == turn
        )
        n_hit, n_ttft = by_turn(native["records"], turn)
        h_hit, h_ttft = by_turn(hybrid["records"], turn)
        lines.append(
            f"| {turn + 1} | {tokens:.0f} | {n_hit:.3f} | {h_hit:.3f} | {1e3 * n_ttft:.1f} | "
            f"{1e3 * h_ttft:.1f} | {h_ttft / n_ttft:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="vision-language model directory or Hugging Face id (--cpu: the tiny one)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the tiny vision-language model")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=200, help="tokens before the image")
    parser.add_argument("--words", type=int, default=300, help="new user tokens a turn")
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--tiles", type=int, default=8, help="image side, in 32-pixel tiles")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument(
        "--configs",
        type=lambda text: text.split(","),
        default=list(CONFIGS),
        help="comma-separated, of " + ", ".join(CONFIGS),
    )
    parser.add_argument(
        "--resume", type=Path, help="a vision_chat.json of the same arguments: keep its engines"
    )
    add_eager_option(parser)
    args = parser.parse_args()
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    args.argv = sys.argv[1:]
    if args.model is None:
        if not args.cpu:
            parser.error("--model is required without --cpu")
        args.model = str(tiny_model_path(VISION_RECIPE))
    settings = {key: getattr(args, key) for key in MEASURED}
    results = json.loads(args.resume.read_text()) if args.resume else {}
    for name, side in results.items():
        if side.get("settings") != settings:
            parser.error(f"--resume {args.resume}: its {name} engine measured other arguments")
    command = " ".join(["python benchmarks/vision_chat.py", *args.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.configs:
        if name not in results:  # each engine's result is kept as soon as it is measured
            side = asyncio.run(measure(args, name))
            results[name] = {**side, "command": command, "settings": settings}
            (args.out / "vision_chat.json").write_text(json.dumps(results, indent=1))
    if set(CONFIGS) <= set(results):
        publish(report(args, results), args.out / "vision_chat.md")


if __name__ == "__main__":
    main()
