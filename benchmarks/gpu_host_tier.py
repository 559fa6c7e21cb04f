"""The host tier on the GPU, through the real engine (27B-shaped config, dummy weights).

Measures, in one engine (hybrid-prefix with a host tier, a device KV budget small enough that
two long prompts push a third off the device):

- time to first token of a host-resident 100,000-token prefix plus 100 new tokens, against a
  cold prefill of a prompt of the same length and against the same prefix resumed from the
  device;
- the engine step time of 8 decoding requests alone, while a ninth request is admitted with
  the 100k prefix on the device, and while one is admitted restoring it from the host.

Run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the cache's counters and the worker's
copy timings (`TransferMeter.totals`) can be read: the host restore's bandwidth is compared with
one contiguous pinned host-to-device copy of 1 GiB timed in the same process (the peak).
`benchmarks/host_arena_bench.py` measures the copy patterns alone.

    python benchmarks/gpu_host_tier.py --model .gpu/model27b --out results/
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from bench_common import (
    add_eager_option,
    add_tensor_parallel_option,
    gpu_engine_kwargs,
    gpu_parser,
    parallel_kwargs,
    random_prompt,
    vocab_size,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    """Token ids drawn from the whole vocabulary."""
    return random_prompt(seed, length, vocab, low=0)


def timed(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outs


def decode_steps(llm: Any, vocab: int, seed: int, joining: list[int] | None) -> list[float]:
    """Milliseconds of 24 engine steps while 8 requests decode (after their prefill), with
    ``joining`` added as the window opens; the requests are aborted afterwards."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
    ids = [f"decode-{seed}-{i}" for i in range(8)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, {"prompt_token_ids": prompt(seed + i, 256, vocab)}, params)
    for _ in range(4):  # their prefill, then decode
        engine.step()
    if joining is not None:
        once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        engine.add_request(f"joining-{seed}", {"prompt_token_ids": joining}, once)
    steps = []
    for _ in range(24):
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start) * 1000)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return steps


def cache_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.cache


def restore_totals() -> tuple[int, float]:
    """Bytes and seconds of the host restores the (in-process) worker has timed so far."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker.meter.totals["restore"]


def pinned_peak_gbps(nbytes: int = 2**30) -> float:
    """Host-to-device GB/s of one contiguous pinned copy, best of 5."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def host_ttft(llm: Any, vocab: int, n: int, long: list[list[int]], report: dict) -> None:
    """TTFT of the prefix ``long[0]`` resumed from the host, against a cold prompt of the same
    length and the same prefix resumed from the device; the host restore's bandwidth."""
    cache = cache_of(llm)
    long_a, long_b, long_c = long
    # Cold: a prompt of the same length nothing is cached for.
    report["cold_ttft_s"], _ = timed(llm, [[*prompt(13, n, vocab), *prompt(13, 100, vocab)]], 1)
    timed(llm, [long_a], 1)  # the conversation so far: its tail tap is at floor64(n - 1)
    for other in (long_b, long_c):  # push long_a off the device (written through to the host)
        timed(llm, [other], 1)
    host_before = cache.admissions.hit_tokens_host, cache.host.restore_bytes
    timed_before = restore_totals()
    report["host_ttft_s"], host = timed(llm, [[*long_a, *prompt(14, 100, vocab)]], 1)
    report["host_cached_tokens"] = host[0].num_cached_tokens
    report["host_hit_tokens"] = cache.admissions.hit_tokens_host - host_before[0]
    report["host_restore_bytes"] = cache.host.restore_bytes - host_before[1]
    timed_after = restore_totals()
    timed_bytes = timed_after[0] - timed_before[0]
    timed_seconds = timed_after[1] - timed_before[1]
    report["host_restore_timed_bytes"] = timed_bytes
    report["host_restore_seconds"] = timed_seconds
    report["host_restore_gbps"] = timed_bytes / timed_seconds / 1e9 if timed_seconds else None
    report["pinned_peak_gbps"] = pinned_peak_gbps()
    if report["host_restore_gbps"]:
        report["restore_vs_peak"] = report["host_restore_gbps"] / report["pinned_peak_gbps"]
    report["device_ttft_s"], device = timed(llm, [[*long_a, *prompt(15, 100, vocab)]], 1)
    report["device_cached_tokens"] = device[0].num_cached_tokens
    report["speedup_host_vs_cold"] = report["cold_ttft_s"] / report["host_ttft_s"]


def decode_under_admission(llm: Any, vocab: int, n: int, prefix: list[int], report: dict) -> None:
    """Decode of 8 running requests, step by step: alone, then while a ninth request is
    admitted with ``prefix`` from the device, then from the host (pushed off again)."""
    cache = cache_of(llm)
    report["decode_step_ms_alone"] = decode_steps(llm, vocab, 300, None)
    report["decode_step_ms_device_admission"] = decode_steps(
        llm, vocab, 400, [*prefix, *prompt(16, 100, vocab)]
    )
    for seed in (20, 21):  # new prompts: the cached long_b and long_c would not push
        timed(llm, [prompt(seed, n, vocab)], 1)
    # Their write-through (2 x ~6 GB) is issued in the steps after them: let it land before the
    # window, so the window sees the restore's copies and not those writes (the run recorded in
    # results/gpu_host_tier_run4.json did not).
    timed(llm, [prompt(22, 64, vocab)], 16)
    host_before = cache.admissions.hit_tokens_host
    report["decode_step_ms_host_restore"] = decode_steps(
        llm, vocab, 500, [*prefix, *prompt(17, 100, vocab)]
    )
    report["decode_host_restore_hit_tokens"] = cache.admissions.hit_tokens_host - host_before


def main() -> None:
    ap = gpu_parser()
    ap.add_argument("--length", type=int, default=100_000)
    ap.add_argument("--host-mib", type=int, default=24_576)
    ap.add_argument("--kv-gib", type=float, default=14.0)
    add_eager_option(ap)
    add_tensor_parallel_option(ap)
    args = ap.parse_args()
    from vllm import LLM

    vocab = vocab_size(args.model)
    extra = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": args.host_mib}
    llm = LLM(
        **gpu_engine_kwargs(
            args.model,
            args.eager,
            extra,
            max_model_len=args.length + 512,
            kv_cache_memory_bytes=int(args.kv_gib * 2**30),
            max_num_seqs=16,
            **parallel_kwargs(args.tensor_parallel_size),
        )
    )
    report: dict[str, Any] = {"args": vars(args)}
    timed(llm, [prompt(1, 4096, vocab)], 1)  # kernels warm
    n = args.length
    long = [prompt(seed, n, vocab) for seed in (10, 11, 12)]
    host_ttft(llm, vocab, n, long, report)
    print(json.dumps(report, indent=1), flush=True)
    decode_under_admission(llm, vocab, n, long[0], report)
    report["telemetry"] = cache_of(llm).telemetry()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_host_tier.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()
