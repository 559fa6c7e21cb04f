"""Speed A/B: cold prefill and decode, hybrid-prefix against vLLM's built-in caching.

Engines are started one at a time in ABBA order (native, hybrid-prefix, hybrid-prefix, native;
``--rounds`` repeats the block), each after the previous one is shut down, so a slow drift of the
machine cancels in the pooled comparison. Every engine gets the same work:

- warm-up: one prompt of ``--prefill-len`` tokens and one short decode batch (kernels compiled);
- ``--reps`` cold prefills: one new prompt of ``--prefill-len`` tokens, ``max_tokens=1``, timed
  end to end (tok/s = prompt tokens / seconds). Seeds are disjoint, so neither engine serves any
  of it from its cache (the number of cached tokens is recorded and reported);
- ``--decode-reps`` decode measurements: ``--decode-batch`` new prompts of
  ``--decode-prompt-len`` tokens, driven step by step through ``llm.llm_engine``; tok/s is the
  tokens generated over ``--decode-steps`` engine steps once every request is decoding, before
  any finishes (``--decode-method whole``: instead (time of 1 + steps tokens - time of 1 token)
  over batch x steps tokens, as ``benchmarks/gpu_device_tier.py:timings`` does).

Per engine the median of its reps; per configuration the pooled median of all its reps; the
ratios hybrid-prefix / native, the per-round ratios and the range over all instance pairs. The
JSON and markdown reports (``gpu_speed.json``, ``gpu_speed.md`` in ``--out``) are rewritten after
every engine, so a run cut short keeps what it measured. ``--budget-s`` skips an engine that
would not finish in time, and ``--resume`` runs what a previous call skipped: under vLLM's
defaults an engine's first start on a fresh H200 takes 210-225 s (27B shape), so one ABBA block
needs two device calls (copy the first call's ``gpu_speed.json`` to ``.gpu/`` and carry it).

On an H200 (27B-shaped config, dummy weights), after the staging calls:

    source .gpu/env.sh && bash scripts/gpu_plugin.sh && \\
    python3 benchmarks/gpu_speed.py --model .gpu/model27b --out $OUT

On CPU with the tiny model (``--cpu``: no GDN backend option, smaller defaults):

    .venv/bin/python benchmarks/gpu_speed.py --cpu --out /tmp/speed --prefill-len 1024 --reps 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import (
    add_eager_option,
    gpu_engine_kwargs,
    random_prompt,
    revision,
    source_digest,
    table_head,
    vocab_size,
)

T0 = time.monotonic()
NATIVE, HYBRID = "native", "hybrid-prefix"
LABEL = {NATIVE: "vLLM built-in caching", HYBRID: "hybrid-prefix"}
GOAL = 0.98  # within 2% of native

# Seed bases: every timed prompt is new (disjoint seeds) within an engine; every engine gets the
# same prompts, so the two configurations do identical work.
SEED_WARM_PREFILL = 9_000_000
SEED_WARM_DECODE = 8_000_000
SEED_PREFILL = 1_000_000
SEED_DECODE = 2_000_000
SEED_DECODE_ONE = 3_000_000  # --decode-method whole: the 1-token batch

PROFILES = {
    # The 27B shape on one H200: see the module docstring and the time budget in main().
    "gpu": {
        "prefill_len": 16384,
        "reps": 5,
        "max_model_len": 32768,
        "decode_steps": 48,
        "budget_s": 550.0,
    },
    "cpu": {
        "prefill_len": 2048,
        "reps": 3,
        "max_model_len": 8192,
        "decode_steps": 16,
        "budget_s": 3600.0,
    },
}


def log(msg: str) -> None:
    print(f"[gpu_speed {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)


# --- engines -------------------------------------------------------------------------------


def engine_kwargs(args: Any, config: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"kv_cache_manager": "hybrid-prefix"} if config == HYBRID else {}
    if args.cpu:
        from vllm_hpc.tiny_model import llm_kwargs

        return llm_kwargs(
            Path(args.model), max_model_len=args.max_model_len, additional_config=extra
        )
    return gpu_engine_kwargs(
        args.model,
        args.eager,
        extra,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def engine_facts(llm: Any) -> dict[str, Any]:
    """The engine's settings that bear on speed, as vLLM resolved them."""
    cfg = llm.llm_engine.vllm_config
    facts = {}
    for name, obj, attr in (
        ("enforce_eager", cfg.model_config, "enforce_eager"),
        ("cudagraph_mode", cfg.compilation_config, "cudagraph_mode"),
        ("mamba_ssm_cache_dtype", cfg.cache_config, "mamba_ssm_cache_dtype"),
        ("enable_prefix_caching", cfg.cache_config, "enable_prefix_caching"),
        ("mamba_cache_mode", cfg.cache_config, "mamba_cache_mode"),
        ("block_size", cfg.cache_config, "block_size"),
        ("max_num_batched_tokens", cfg.scheduler_config, "max_num_batched_tokens"),
        ("max_num_seqs", cfg.scheduler_config, "max_num_seqs"),
        ("async_scheduling", cfg.scheduler_config, "async_scheduling"),
        ("chunked_prefill", cfg.scheduler_config, "enable_chunked_prefill"),
        ("tensor_parallel_size", cfg.parallel_config, "tensor_parallel_size"),
    ):
        value = getattr(obj, attr, None)
        facts[name] = value if isinstance(value, bool | int | float | str | None) else str(value)
    return facts


def release_device(cuda: bool) -> None:
    """After the engine is shut down and its last reference dropped: collect, and on CUDA give
    cached memory back and wait for the engine process's memory to be released."""
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()  # a no-op unless this process touched CUDA
        wait_device_free()


def wait_device_free(timeout_s: float = 30.0) -> None:
    """Wait until the engine process has given its GPU memory back (NVML; no CUDA context)."""
    try:
        from vllm.utils.import_utils import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception as e:  # no NVML: nothing to wait for
        log(f"NVML unavailable ({e}); not waiting for device memory")
        return
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        deadline = time.monotonic() + timeout_s
        while True:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            if mem.used < 0.10 * mem.total or time.monotonic() > deadline:
                log(f"device memory in use after shutdown: {mem.used / 2**30:.1f} GiB")
                return
            time.sleep(0.5)
    finally:
        nvml.nvmlShutdown()


# --- measurements --------------------------------------------------------------------------


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    sp = params(max_tokens)
    batch = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    return time.perf_counter() - start, outs


def prefill_rep(llm: Any, vocab: int, length: int, seed: int) -> dict[str, float]:
    seconds, outs = generate(llm, [random_prompt(seed, length, vocab)], 1)
    return {
        "tok_s": length / seconds,
        "seconds": seconds,
        "cached_tokens": outs[0].num_cached_tokens or 0,
    }


def decode_steps_rep(llm: Any, vocab: int, args: Any, seed: int, tag: str) -> dict[str, Any]:
    """Drive one batch of new requests step by step; tok/s over a window of steady decode.

    The window opens once every request has ``settle`` tokens (its prefill and first decode
    steps are behind it) and closes at the last step before any request reaches its last token,
    so neither prefill nor request finishing is in it. Tokens are counted from the outputs, so a
    step whose outputs arrive late (async scheduling) still counts right over the window.
    """
    settle = 3
    max_tokens = settle + args.decode_steps + 2
    engine = llm.llm_engine
    ids = [f"{tag}-{seed}-{i}" for i in range(args.decode_batch)]
    prompts = [
        random_prompt(seed + i, args.decode_prompt_len, vocab) for i in range(args.decode_batch)
    ]
    sp = params(max_tokens)
    counts = dict.fromkeys(ids, 0)
    cached = dict.fromkeys(ids, 0)
    marks: list[tuple[float, int, int, int]] = []  # (time, total tokens, min, max)
    start = time.perf_counter()
    for request_id, p in zip(ids, prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": p}, sp)
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            if out.request_id in counts:
                counts[out.request_id] = len(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens or 0
        values = list(counts.values())
        marks.append((t, sum(values), min(values), max(values)))
    total_s = time.perf_counter() - start
    opens = next((i for i, m in enumerate(marks) if m[2] >= settle), len(marks))
    closes = max((i for i, m in enumerate(marks) if m[3] < max_tokens), default=-1)
    if closes <= opens:
        raise RuntimeError(f"no steady decode window (marks {marks})")
    t0, n0 = marks[opens][:2]
    t1, n1 = marks[closes][:2]
    step_ms = [
        (b[0] - a[0]) * 1000
        for a, b in zip(marks[opens:closes], marks[opens + 1 : closes + 1], strict=True)
        if b[1] > a[1]
    ]
    return {
        "tok_s": (n1 - n0) / (t1 - t0),
        "window_tokens": n1 - n0,
        "window_s": t1 - t0,
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "total_s": total_s,
        "cached_tokens": max(cached.values()),
    }


def decode_whole_rep(llm: Any, vocab: int, args: Any, seed: int) -> dict[str, Any]:
    """(time of a batch generating 1 + steps tokens - time of one generating 1) / tokens."""
    n, plen = args.decode_batch, args.decode_prompt_len
    one_s, one = generate(
        llm, [random_prompt(SEED_DECODE_ONE + seed + i, plen, vocab) for i in range(n)], 1
    )
    full_s, full = generate(
        llm, [random_prompt(seed + i, plen, vocab) for i in range(n)], 1 + args.decode_steps
    )
    return {
        "tok_s": n * args.decode_steps / (full_s - one_s),
        "one_token_s": one_s,
        "full_s": full_s,
        "step_ms_median": (full_s - one_s) / args.decode_steps * 1000,
        "cached_tokens": max(o.num_cached_tokens or 0 for o in [*one, *full]),
    }


def decode_rep(llm: Any, vocab: int, args: Any, seed: int, tag: str) -> dict[str, Any]:
    if args.decode_method == "whole":
        return decode_whole_rep(llm, vocab, args, seed)
    return decode_steps_rep(llm, vocab, args, seed, tag)


def spread(values: list[float]) -> dict[str, float]:
    med = statistics.median(values)
    return {
        "min": min(values),
        "median": med,
        "max": max(values),
        "spread": (max(values) - min(values)) / med if med else 0.0,
    }


def bench_engine(llm: Any, vocab: int, args: Any, index: int) -> dict[str, Any]:
    t = time.monotonic()
    warm = prefill_rep(llm, vocab, args.prefill_len, SEED_WARM_PREFILL)
    log(f"  warm-up prefill {warm['tok_s']:.0f} tok/s ({warm['seconds']:.2f} s)")
    warm_args = argparse.Namespace(**{**vars(args), "decode_steps": min(8, args.decode_steps)})
    wd = decode_rep(llm, vocab, warm_args, SEED_WARM_DECODE, f"warm{index}")
    log(f"  warm-up decode {wd['tok_s']:.1f} tok/s")
    prefills = []
    for rep in range(args.reps):
        r = prefill_rep(llm, vocab, args.prefill_len, SEED_PREFILL + rep)
        prefills.append(r)
        log(
            f"  prefill rep {rep + 1}/{args.reps}: {r['tok_s']:.0f} tok/s "
            f"({r['seconds']:.3f} s, cached {r['cached_tokens']})"
        )
    decodes = []
    for rep in range(args.decode_reps):
        r = decode_rep(llm, vocab, args, SEED_DECODE + 1000 * rep, f"dec{index}")
        decodes.append(r)
        log(
            f"  decode rep {rep + 1}/{args.decode_reps}: {r['tok_s']:.1f} tok/s "
            f"(step {r['step_ms_median']:.1f} ms, cached {r['cached_tokens']})"
        )
    return {
        "warmup": {"prefill": warm, "decode": wd},
        "prefill": prefills,
        "decode": decodes,
        "prefill_tok_s": spread([r["tok_s"] for r in prefills]),
        "decode_tok_s": spread([r["tok_s"] for r in decodes]),
        "decode_step_ms": spread([r["step_ms_median"] for r in decodes]),
        "max_cached_tokens": max(r["cached_tokens"] for r in [*prefills, *decodes]),
        "bench_s": time.monotonic() - t,
    }


# --- summary and report --------------------------------------------------------------------


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    engines = [e for e in report["engines"] if "result" in e]
    summary: dict[str, Any] = {}
    for metric in ("prefill_tok_s", "decode_tok_s"):
        kind = metric.split("_")[0]
        per: dict[str, Any] = {}
        for config in (NATIVE, HYBRID):
            mine = [e for e in engines if e["config"] == config]
            if not mine:
                continue
            pooled = [r["tok_s"] for e in mine for r in e["result"][kind]]
            medians = [e["result"][metric]["median"] for e in mine]
            per[config] = {
                "pooled": spread(pooled),
                "instance_medians": medians,
                "instance_spread": spread(medians)["spread"],
            }
        entry: dict[str, Any] = {"per_config": per}
        if NATIVE in per and HYBRID in per:
            n, h = per[NATIVE], per[HYBRID]
            entry["ratio"] = h["pooled"]["median"] / n["pooled"]["median"]
            pairs = [a / b for a in h["instance_medians"] for b in n["instance_medians"]]
            entry["pair_ratio_min"], entry["pair_ratio_max"] = min(pairs), max(pairs)
            rounds = []
            for rnd in sorted({e["round"] for e in engines}):
                by = {
                    c: [
                        e["result"][metric]["median"]
                        for e in engines
                        if e["round"] == rnd and e["config"] == c
                    ]
                    for c in (NATIVE, HYBRID)
                }
                if by[NATIVE] and by[HYBRID]:
                    rounds.append(statistics.fmean(by[HYBRID]) / statistics.fmean(by[NATIVE]))
            entry["round_ratios"] = rounds
            entry["meets_goal"] = entry["ratio"] >= GOAL
        summary[metric] = entry
    return summary


def pct(x: float) -> str:
    """A ratio as a signed change in percent: 1.01 is `+1.0%`."""
    return f"{(x - 1) * 100:+.1f}%"


def fmt_spread(s: dict[str, float], digits: int = 0) -> str:
    f = f"{{:,.{digits}f}}"
    return f"{f.format(s['min'])} / **{f.format(s['median'])}** / {f.format(s['max'])}"


METRICS = (("prefill_tok_s", "cold prefill tok/s"), ("decode_tok_s", "decode tok/s"))


def markdown(report: dict[str, Any]) -> str:
    summary = report.get("summary", {})
    lines = [
        *_header(report),
        *_result(summary),
        *_spread(summary),
        *_engine_instances(report["engines"]),
        *_engine_notes(report["engines"]),
    ]
    return "\n".join(lines) + "\n"


def _header(report: dict[str, Any]) -> list[str]:
    """The title, the commands, the machine and what every engine measured."""
    meta, args = report["meta"], report["args"]
    resumed_note = (
        f" in the last call, resumed {meta['resumed']}: the engines ran in more than one "
        "process, one call after the other"
        if meta.get("resumed")
        else ""
    )
    return [
        "# Speed A/B: hybrid-prefix against vLLM's built-in caching",
        "",
        *(f"- Command: `{c}`" for c in meta.get("commands", [meta["command"]])),
        f"- Device: {meta['device']}; vLLM {meta['vllm']}; torch {meta['torch']}; "
        f"Python {meta['python']}; commit {meta['commit'] or 'unknown'}, vllm_hpc sources "
        f"{meta.get('sources', 'unknown')}",
        f"- Started {meta['started']}, finished {meta.get('finished', '(running)')} "
        f"({meta.get('total_s', 0):.0f} s{resumed_note})",
        f"- Model: `{args['model']}` ({'tiny model, CPU' if args['cpu'] else 'dummy weights'}), "
        f"max_model_len {args['max_model_len']}; engine order {' '.join(report['order'])}",
        f"- Per engine: warm-up (one {args['prefill_len']}-token prompt, one decode batch), then "
        f"{args['reps']} cold prefills of one new {args['prefill_len']}-token prompt "
        f"(max_tokens=1, end-to-end time) and {args['decode_reps']} decode measurements of "
        f"{args['decode_batch']} new {args['decode_prompt_len']}-token prompts "
        + (
            f"over a window of {args['decode_steps']} steady engine steps (tokens counted)"
            if args["decode_method"] == "steps"
            else f"((t(1 + {args['decode_steps']} tokens) - t(1 token)) / tokens)"
        ),
        "",
    ]


def _result(summary: dict[str, Any]) -> list[str]:
    """The pooled medians and their ratio against the goal, per metric."""
    lines = [
        "## Result",
        "",
        *table_head(
            "metric | built-in (pooled median) | hybrid-prefix (pooled median) "
            "| hybrid / built-in | per round | all instance pairs | goal >= 0.98"
        ),
    ]
    for metric, name in METRICS:
        entry = summary.get(metric, {})
        per = entry.get("per_config", {})
        cells = [
            f"{per[c]['pooled']['median']:,.1f}" if c in per else "-" for c in (NATIVE, HYBRID)
        ]
        if "ratio" in entry:
            rounds = ", ".join(f"{r:.3f}" for r in entry["round_ratios"]) or "-"
            lines.append(
                f"| {name} | {cells[0]} | {cells[1]} | **{entry['ratio']:.3f}** "
                f"({pct(entry['ratio'])}) | {rounds} | {entry['pair_ratio_min']:.3f} - "
                f"{entry['pair_ratio_max']:.3f} | {'met' if entry['meets_goal'] else 'NOT met'} |"
            )
        else:
            lines.append(f"| {name} | {cells[0]} | {cells[1]} | - | - | - | - |")
    return [
        *lines,
        "",
        "Per round: mean of the hybrid-prefix instance medians over the mean of the built-in "
        "ones in that ABBA block. All instance pairs: every hybrid-prefix instance median over "
        "every built-in one; when this range straddles 0.98 the run does not decide the goal.",
        "",
    ]


def _spread(summary: dict[str, Any]) -> list[str]:
    """Per metric and configuration: how far the reps and the instance medians spread."""
    lines = [
        "## Spread",
        "",
        *table_head(
            "metric | configuration | pooled min / median / max | pooled spread "
            "| spread of instance medians"
        ),
    ]
    for metric, name in METRICS:
        for config, per in summary.get(metric, {}).get("per_config", {}).items():
            lines.append(
                f"| {name} | {LABEL[config]} | {fmt_spread(per['pooled'], 1)} "
                f"| {per['pooled']['spread'] * 100:.1f}% | {per['instance_spread'] * 100:.1f}% |"
            )
    return [*lines, "", "Spread: (max - min) / median.", ""]


def _engine_instances(engines: list[dict[str, Any]]) -> list[str]:
    """One row per engine, in the order they ran; a skipped or failed one says why."""
    lines = [
        "## Engine instances",
        "",
        *table_head(
            "# | round | configuration | start-up s | prefill tok/s min / median / max "
            "| decode tok/s min / median / max | decode step ms (median) | cached tokens (max) "
            "| started"
        ),
    ]
    for e in engines:
        if "result" not in e:
            why = e.get("skipped") or e.get("error") or "not finished"
            lines.append(
                f"| {e['index']} | {e['round']} | {LABEL[e['config']]} | - | {why} | | | | |"
            )
            continue
        r = e["result"]
        lines.append(
            f"| {e['index']} | {e['round']} | {LABEL[e['config']]} | {e['startup_s']:.0f} "
            f"| {fmt_spread(r['prefill_tok_s'])} | {fmt_spread(r['decode_tok_s'], 1)} "
            f"| {r['decode_step_ms']['median']:.1f} | {r['max_cached_tokens']} "
            f"| {e['started']} |"
        )
    return lines


def _engine_notes(engines: list[dict[str, Any]]) -> list[str]:
    """The engine settings as vLLM resolved them, and a warning if any timed request hit."""
    lines = []
    facts = {e["config"]: e.get("facts") for e in engines if e.get("facts")}
    if facts:
        lines += ["", "Engine settings as vLLM resolved them:", ""]
        lines += [f"- {LABEL[c]}: `{json.dumps(f)}`" for c, f in facts.items()]
    if any(e.get("result", {}).get("max_cached_tokens") for e in engines):
        lines += ["", "**Warning: some timed request was served partly from a cache.**"]
    return lines


def write(report: dict[str, Any], out: Path) -> None:
    report["meta"]["total_s"] = time.monotonic() - T0
    report["summary"] = summarize(report)
    (out / "gpu_speed.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_speed.md").write_text(markdown(report))


def device_name(cpu: bool) -> str:
    if cpu:
        return "cpu"
    from vllm.platforms import current_platform  # NVML on CUDA: no CUDA context here

    try:
        return str(current_platform.get_device_name(0))
    except Exception:
        return str(current_platform.device_name)


def parse_args() -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", help="model directory or Hugging Face id (default with --cpu: the tiny model)"
    )
    ap.add_argument("--out", required=True, help="directory for gpu_speed.json and .md")
    ap.add_argument("--cpu", action="store_true", help="CPU profile: tiny model, small defaults")
    ap.add_argument("--prefill-len", type=int, help="tokens of each cold prompt (16384; CPU 2048)")
    ap.add_argument("--reps", type=int, help="timed cold prefills per engine (5; CPU 3)")
    ap.add_argument("--decode-reps", type=int, help="decode measurements per engine (= --reps)")
    ap.add_argument("--decode-steps", type=int, help="decode steps per measurement (48; CPU 16)")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--decode-method", choices=("steps", "whole"), default="steps")
    ap.add_argument("--rounds", type=int, default=1, help="ABBA blocks (native, hybrid x2, native)")
    ap.add_argument("--max-model-len", type=int, help="32768; CPU 8192")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    add_eager_option(ap)
    ap.add_argument(
        "--budget-s", type=float, help="skip engines that would end later (550 s; CPU 3600)"
    )
    ap.add_argument(
        "--resume",
        type=Path,
        help="a gpu_speed.json that --budget-s cut short: run the engines it skipped, keep the "
        "rest (the measurement arguments must be the same)",
    )
    args = ap.parse_args()
    profile = PROFILES["cpu" if args.cpu else "gpu"]
    for key, value in profile.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.decode_reps is None:
        args.decode_reps = args.reps
    if args.model is None:
        if not args.cpu:
            ap.error("--model is required without --cpu")
        from vllm_hpc.tiny_model import tiny_model_path

        args.model = str(tiny_model_path())
    return args


MEASUREMENT_ARGS = (
    "model",
    "prefill_len",
    "reps",
    "decode_reps",
    "decode_steps",
    "decode_batch",
    "decode_prompt_len",
    "decode_method",
    "rounds",
    "max_model_len",
    "gpu_memory_utilization",
    "eager",
    "cpu",
)
"""What two invocations merged by --resume must share, or their engines measured different work."""


def resumed(report: dict[str, Any], args: Any) -> dict[str, Any]:
    """The --resume report: its measured engines kept, the rest to run now, both commands
    recorded (each engine says when it started, so the report tells which call ran it)."""
    previous = json.loads(args.resume.read_text())
    differ = [k for k in MEASUREMENT_ARGS if previous["args"].get(k) != getattr(args, k, None)]
    if differ:
        raise SystemExit(f"--resume {args.resume}: other measurement arguments: {differ}")
    for e in previous["engines"]:
        if "result" not in e:
            e.pop("skipped", None)
            e.pop("error", None)
    commands = previous["meta"].get("commands", [previous["meta"]["command"]])
    previous["meta"]["commands"] = [*commands, report["meta"]["command"]]
    previous["meta"]["resumed"] = report["meta"]["started"]
    previous["args"] = {**vars(args), "resume": str(args.resume)}
    return previous


def new_report(args: Any, order: list[str]) -> dict[str, Any]:
    """The report before any engine ran: what runs, where, and in which order."""
    import torch
    import vllm

    return {
        "meta": {
            "command": shlex.join(["python", *sys.argv]),
            "python_executable": sys.executable,
            "cwd": os.getcwd(),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": device_name(args.cpu),
            "host": platform.node(),
            "commit": revision(),
            "sources": source_digest(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
            "started": now(),
        },
        "args": vars(args),
        "order": order,
        "engines": [
            {"index": i + 1, "round": i // 4 + 1, "config": c} for i, c in enumerate(order)
        ],
    }


def over_budget(engines: list[dict[str, Any]], budget_s: float) -> str | None:
    """Why the next engine is skipped, or None: it would end after ``budget_s``."""
    done = [d for d in engines if "result" in d]
    if not done:
        return None
    # Start-up varies (JIT caches), so: the quickest start-up seen, plus a margin, plus the
    # longest measurement and shutdown so far.
    estimate = (
        min(d["startup_s"] for d in done)
        + 20
        + max(d["result"]["bench_s"] + d["shutdown_s"] for d in done)
    )
    elapsed = time.monotonic() - T0
    if elapsed + estimate <= budget_s:
        return None
    return f"skipped: budget ({elapsed:.0f} + ~{estimate:.0f} s > {budget_s:.0f} s)"


def run_engine(e: dict[str, Any], report: dict[str, Any], args: Any, vocab: int, out: Path) -> None:
    """Start engine ``e``, measure it into ``e["result"]``, shut it down; the report is
    rewritten after it, also when it fails."""
    from vllm import LLM

    e["started"] = now()
    log(f"engine {e['index']}/{len(report['order'])} ({e['config']}, round {e['round']}): starting")
    t = time.monotonic()
    llm = LLM(**engine_kwargs(args, e["config"]))
    e["startup_s"] = time.monotonic() - t
    e["facts"] = engine_facts(llm)
    log(f"engine {e['index']} ready in {e['startup_s']:.0f} s; {e['facts']}")
    try:
        e["result"] = bench_engine(llm, vocab, args, e["index"])
    except Exception as exc:  # keep what the other engines measured
        e["error"] = f"{type(exc).__name__}: {exc}"
        log(f"engine {e['index']} failed: {e['error']}")
        raise
    finally:
        t = time.monotonic()
        llm.llm_engine.engine_core.shutdown()
        del llm
        release_device(cuda=not args.cpu)
        e["shutdown_s"] = time.monotonic() - t
        e["finished"] = now()
        write(report, out)
    r = e["result"]
    log(
        f"engine {e['index']} ({e['config']}) prefill median {r['prefill_tok_s']['median']:.0f}"
        f" tok/s, decode median {r['decode_tok_s']['median']:.1f} tok/s "
        f"(measured {r['bench_s']:.0f} s, shutdown {e['shutdown_s']:.0f} s)"
    )
    for metric in ("prefill_tok_s", "decode_tok_s"):
        s = summarize(report)[metric]
        if "ratio" in s:
            log(f"  so far {metric} hybrid/native {s['ratio']:.3f} ({pct(s['ratio'])})")


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"importing vLLM (args: {vars(args)})")
    import vllm

    vocab = vocab_size(args.model)
    report = new_report(args, [NATIVE, HYBRID, HYBRID, NATIVE] * args.rounds)
    if args.resume:
        report = resumed(report, args)
    order = report["order"]
    log(f"device {report['meta']['device']}, vLLM {vllm.__version__}, order {' '.join(order)}")
    write(report, out)
    for e in report["engines"]:
        if "result" in e:  # measured by the call --resume continues
            continue
        skipped = over_budget(report["engines"], args.budget_s)
        if skipped:
            e["skipped"] = skipped
            log(f"engine {e['index']} ({e['config']}) {e['skipped']}")
            write(report, out)
            continue
        run_engine(e, report, args, vocab, out)
    report["meta"]["finished"] = now()
    write(report, out)
    print(markdown(report), flush=True)


if __name__ == "__main__":
    main()
