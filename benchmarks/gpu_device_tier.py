"""Device-tier exactness scenarios and speed on a GPU (run through the device tool on an H200).

Runs the same token-id scenarios on vLLM's built-in caching (its checked requests skip reading
the cache: the cold reference) and on `--kv-cache-manager hybrid-prefix`, compares greedy
tokens, and times cold prefill, decode and one state-snapshot copy. Writes a markdown report
(and JSON) to --out.

    python benchmarks/gpu_device_tier.py --model ../shared/gpu/models/qwen3_5-27b-shape --out DIR

Dummy weights (`load_format="dummy"`) are identical in both engines, so greedy tokens compare;
but a dummy-weight model emits one constant token, so only `--load-format auto` on a model with
real weights (the embedded tiny model, `vllm_hpc.tiny_model.tiny_model_path()`) checks that the
restored states are right. `--scenarios-only` skips the speed part (meaningless on that model).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import (
    add_eager_option,
    add_load_format_option,
    add_tensor_parallel_option,
    gpu_engine_kwargs,
    gpu_parser,
    model_config,
    parallel_kwargs,
    publish,
    random_prompt,
    table_head,
    vocab_size,
)

from vllm_hpc.exactness import first_parting

ANSWER = 16


def params(
    max_tokens: int,
    breakpoints: list[int] | None = None,
    logprobs: int | None = None,
    cold: bool = False,
) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        detokenize=False,
        ignore_eos=True,
        logprobs=logprobs,
        skip_reading_prefix_cache=cold or None,
        extra_args={"cache_breakpoints": breakpoints} if breakpoints else None,
    )


def run(llm: Any, prompts: list[list[int]], sp: Any) -> list[Any]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def scenarios(length: int, vocab: int) -> list[dict[str, Any]]:
    """Each scenario: warm-up requests (run first), then the checked request(s)."""
    a = random_prompt(1, length, vocab)
    tap = length // 2 + 17
    edit_base = random_prompt(4, length, vocab)
    pre = random_prompt(5, length // 2, vocab)
    return [
        {
            "name": "resume from a breakpoint tap (with a tail)",
            "warm": [(a, [tap], ANSWER)],
            "check": [a[: length // 2 + 100] + random_prompt(2, 200, vocab)],
            "expect_cached": [tap],
        },
        {
            "name": "multi-turn: resume from the endpoint",
            "warm": [(random_prompt(3, length, vocab), None, 80)],
            "check_turn": True,
        },
        {
            "name": "edit deep in the history",
            "warm": [(edit_base, None, ANSWER)],
            "check": [edit_base[: length // 3] + random_prompt(6, 300, vocab)],
        },
        {
            "name": "4 sessions sharing a preamble, batched",
            "warm": [(pre + random_prompt(7, 100, vocab), [len(pre)], ANSWER)],
            "check": [pre + random_prompt(8 + i, 200 + 10 * i, vocab) for i in range(4)],
            "batched": True,
            "expect_cached": [len(pre)] * 4,
        },
    ]


def top2(logprobs: Any) -> list[float]:
    return sorted((x.logprob for x in logprobs.values()), reverse=True)[:2]


def play(llm: Any, length: int, vocab: int, cold: bool) -> dict:
    """Run every scenario; ``cold``: the checked requests skip reading the prefix cache."""
    results = {}
    for sc in scenarios(length, vocab):
        outs: list[Any] = []
        checks = list(sc.get("check", []))
        for warm, bps, n in sc["warm"]:
            out = run(llm, [warm], params(n, bps))[0]
            if sc.get("check_turn"):
                checks = [warm + list(out.outputs[0].token_ids) + random_prompt(9, 300, vocab)]
                sc["expect_cached"] = [len(warm) + n - 1]
        check_params = params(ANSWER, logprobs=2, cold=cold)
        if sc.get("batched"):
            outs = run(llm, checks, check_params)
        else:
            outs = [run(llm, [c], check_params)[0] for c in checks]
        results[sc["name"]] = {
            "prompts": checks,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "margins": [[top2(lp) for lp in o.outputs[0].logprobs] for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "expect_cached": sc.get("expect_cached"),
        }
    return results


def timings(llm: Any, vocab: int, prefill_len: int) -> dict[str, float]:
    """Cold prefill tokens/s of one long prompt (after a warm-up prompt of the same length) and
    decode tokens/s of 8 requests: (time of 257 tokens - time of 1 token) over 8 x 256 tokens.
    Every timed prompt is new, so neither engine can serve any of it from its cache."""
    run(llm, [random_prompt(1000, prefill_len, vocab)], params(1))  # kernels compiled and warm
    rates = {}
    # With prefill_len a multiple of the chunk, prefill_len + 1 tokens put the tail tap on a
    # chunk boundary: no extra pass; prefill_len tokens pay one (the split at floor64(n - 1)).
    for length in (prefill_len, prefill_len + 1):
        best = 0.0
        for rep in range(2):
            timed = random_prompt(5000 + 100 * rep + length - prefill_len, length, vocab)
            t = time.perf_counter()
            run(llm, [timed], params(1))
            best = max(best, length / (time.perf_counter() - t))
        rates[length] = best
    seconds = {}
    for tokens in (1, 257):
        batch = [random_prompt(2000 + 10 * tokens + i, 64, vocab) for i in range(8)]
        t = time.perf_counter()
        run(llm, batch, params(tokens))
        seconds[tokens] = time.perf_counter() - t
    return {
        "prefill_tok_s": rates[prefill_len],
        "prefill_aligned_tok_s": rates[prefill_len + 1],
        "decode_tok_s": 8 * 256 / (seconds[257] - seconds[1]),
    }


def engine(
    model: str, max_len: int, hybrid: bool, load_format: str, eager: bool, tensor_parallel: int
) -> Any:
    from vllm import LLM

    config = {"kv_cache_manager": "hybrid-prefix"} if hybrid else {}
    kwargs = gpu_engine_kwargs(
        model,
        eager,
        config,
        load_format=load_format,
        max_model_len=max_len,
        gpu_memory_utilization=0.85,
        **parallel_kwargs(tensor_parallel),
    )
    return LLM(**kwargs)


def tap_copy_ms(model: str) -> float:
    """One state-slot copy (the whole cost of a flexible tap), timed with the model's shapes on
    a pool over a buffer of its own (the tests' `pool_support.bound_pool`)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from pool_support import bound_pool  # type: ignore[import-not-found]

    from vllm_hpc.runtime.plan import StateCopy

    config = model_config(model)
    cfg = config.get("text_config", config)  # a vision-language config keeps the text model's
    layers = sum(t == "linear_attention" for t in cfg["layer_types"])
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv = (2 * hk * dk + hv * dv, cfg["linear_conv_kernel_dim"] - 1)
    names = [f"model.layers.{i}.linear_attn" for i in range(layers)]
    full = sum(t == "full_attention" for t in cfg["layer_types"])
    pool = bound_pool(
        torch.device("cuda"),
        names,
        [conv, (hv, dv, dk)],
        [torch.bfloat16, torch.float32],
        rows=3,
        attention_layers=full,
    )
    copies = [StateCopy(1, 2)]
    pool.copy(copies)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        pool.copy(copies)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 50 * 1000
    print(f"state image {pool.image_bytes / 2**20:.1f} MiB: one copy {ms:.3f} ms", flush=True)
    return ms


def main() -> None:
    ap = gpu_parser()
    ap.add_argument("--length", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--prefill-len", type=int, default=16000)
    ap.add_argument("--reuse", help="JSON of an earlier run whose cold engine results to keep")
    add_load_format_option(ap)
    ap.add_argument("--scenarios-only", action="store_true", help="no speed measurements")
    add_eager_option(ap)
    add_tensor_parallel_option(ap)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size(args.model)
    report: dict[str, Any] = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    # A report written before --tensor-parallel-size existed ran at 1.
    ran = report.get("tensor_parallel_size", 1) if args.reuse else args.tensor_parallel_size
    if ran != args.tensor_parallel_size:
        raise SystemExit(f"--reuse {args.reuse}: it ran --tensor-parallel-size {ran}")
    report["tensor_parallel_size"] = ran
    if not args.scenarios_only:
        report.setdefault("tap_copy_ms", tap_copy_ms(args.model))
    for name, hybrid in (("cold", False), ("hybrid", True)):
        if name in report:
            continue
        t = time.time()
        llm = engine(
            args.model,
            args.max_model_len,
            hybrid,
            args.load_format,
            args.eager,
            args.tensor_parallel_size,
        )
        print(f"[{name}] engine ready in {time.time() - t:.0f} s", flush=True)
        report[name] = {
            "startup_s": time.time() - t,
            "mode": execution_mode(llm),
            "timing": None if args.scenarios_only else timings(llm, vocab, args.prefill_len),
        }
        print(f"[{name}] timing {report[name]['timing']}", flush=True)
        report[name]["scenarios"] = play(llm, args.length, vocab, cold=not hybrid)
        for sc, res in report[name]["scenarios"].items():
            print(f"[{name}] {sc}: cached {res['cached']}", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        (out / "gpu_device_tier.json").write_text(json.dumps(report))
    lines = compare(report, args)
    publish(lines, out / "gpu_device_tier.md", flush=True)


def execution_mode(llm: Any) -> str:
    """How vLLM runs the model: eager, or torch.compile with its CUDA graph mode."""
    config = llm.llm_engine.vllm_config
    if config.model_config.enforce_eager:
        return "eager"
    return f"torch.compile, cudagraph_mode {config.compilation_config.cudagraph_mode.name}"


def compare(report: dict[str, Any], args: Any) -> list[str]:
    modes = {name: report[name].get("mode", "eager (not recorded)") for name in ("cold", "hybrid")}
    lines = [
        f"Mode: cold engine {modes['cold']}; hybrid engine {modes['hybrid']}.",
        "",
        *table_head("scenario | cached (hybrid) | expected | greedy tokens vs cold"),
    ]
    cold, hyb = report["cold"]["scenarios"], report["hybrid"]["scenarios"]
    for name, res in hyb.items():
        verdicts = []
        refs = zip(res["tokens"], cold[name]["tokens"], cold[name]["margins"], strict=True)
        for got, ref, margins in refs:
            parting = first_parting(got, ref, [best[0] - best[1] for best in margins])
            verdicts.append("identical" if parting is None else parting.describe())
        lines.append(
            f"| {name} | {res['cached']} | {res['expect_cached'] or '-'} | {'; '.join(verdicts)} |"
        )
    c, h = report["cold"]["timing"], report["hybrid"]["timing"]
    if c is None or h is None:
        return lines
    lines += [
        "",
        *table_head(
            f"engine | cold prefill tok/s, {args.prefill_len} tokens | same, "
            f"{args.prefill_len + 1} tokens | decode tok/s (8 x 256) | start-up s"
        ),
        f"| vLLM built-in caching | {c['prefill_tok_s']:.0f} | {c['prefill_aligned_tok_s']:.0f} "
        f"| {c['decode_tok_s']:.0f} | {report['cold']['startup_s']:.0f} |",
        f"| hybrid-prefix | {h['prefill_tok_s']:.0f} | {h['prefill_aligned_tok_s']:.0f} | "
        f"{h['decode_tok_s']:.0f} | {report['hybrid']['startup_s']:.0f} |",
        "",
        f"One state-snapshot copy (a flexible tap): {report['tap_copy_ms']:.3f} ms; an 8192-token "
        f"chunk at hybrid's prefill rate takes {8192 / h['prefill_tok_s'] * 1000:.0f} ms.",
    ]
    return lines


if __name__ == "__main__":
    main()
