"""Report of a replay run (`replay.py`): a markdown table and PNG plots from its JSON.

Regenerates everything from the JSON alone, so a run made elsewhere (the GPU) is reported here:

    .venv/bin/python benchmarks/replay_report.py benchmarks/results/replay_cpu.json

Writes `<stem>.md` and `<stem>_{ttft,hit_rate,cached_per_turn}.png` beside the JSON. The plots
need matplotlib (`pip install -e ".[bench]"` or `.venv/bin/pip install matplotlib`); without it
the markdown is still written and says so.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import baseline, publish, ratio, table_head, times

from vllm_hpc.exactness import NEAR_TIE

OURS = ("hybrid-prefix", "hybrid-prefix-host", "hybrid-prefix-disk")
"""Measured against the targets: device only, with the host tier (the plugin's default), and with
a disk tier under it."""
TARGETS = [
    ("token hit rate, mix", "mix", "hit_rate", ">=", 1.5),
    ("token hit rate, branching", "branching", "hit_rate", ">=", 3.0),
    ("TTFT p50, mix", "mix", "ttft_p50", "<=", 0.5),
    ("output throughput, mix", "mix", "throughput", ">=", 0.98),
]
"""The replay's targets: hybrid-prefix / native in the same run."""


@dataclass(frozen=True)
class Stats:
    """One workload on one configuration."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    ttft_p50: float
    ttft_p95: float
    e2e_p50: float
    tpot_p50: float
    """Seconds per generated token after the first."""
    throughput: float
    """Generated tokens per second over the workload's wall time."""
    peak_host_bytes: int
    peak_device_bytes: int | None
    peak_load: float
    acceptance: float | None
    """Speculative decoding: accepted / draft tokens over the workload; None without drafts."""


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: an observed value, which suits a few dozen requests."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def stats(run: dict[str, Any]) -> Stats:
    requests = run["requests"]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    ttft = [r["first_token_s"] - r["sent_s"] for r in requests]
    e2e = [r["done_s"] - r["sent_s"] for r in requests]
    tpot = [
        (r["done_s"] - r["first_token_s"]) / (len(r["answer"]) - 1)
        for r in requests
        if len(r["answer"]) > 1
    ]
    span = max(r["done_s"] for r in requests) - min(r["sent_s"] for r in requests)
    return Stats(
        len(requests),
        prompt,
        cached,
        cached / prompt,
        percentile(ttft, 0.5),
        percentile(ttft, 0.95),
        percentile(e2e, 0.5),
        percentile(tpot, 0.5) if tpot else math.nan,
        sum(len(r["answer"]) for r in requests) / span,
        run["peak_host_bytes"],
        run["peak_device_bytes"],
        run["peak_load"],
        run.get("accepted_tokens", 0) / drafts if (drafts := run.get("draft_tokens", 0)) else None,
    )


def divergences(got: list[dict], base: list[dict]) -> list[str]:
    """Requests whose greedy answer differs from the baseline's: `s<session>.<turn>@<token>
    (<baseline top-1 margin>)`, a margin under NEAR_TIE marking a near-tie; `... prompt` where
    the prompt already differs (an agent loop following an earlier different answer)."""
    found = []
    for a, b in zip(got, base, strict=True):
        where = f"s{a['session']}.{a['turn']}"
        if a["prompt_digest"] != b["prompt_digest"]:
            found.append(f"{where} prompt")
        elif a["answer"] != b["answer"]:
            k = next(
                i for i, (x, y) in enumerate(zip(a["answer"], b["answer"], strict=False)) if x != y
            )
            tie = "" if b["margins"][k] < NEAR_TIE else " NOT a near-tie"
            found.append(f"{where}@{k} ({b['margins'][k]:.3f}{tie})")
    return found


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f}"


Table = dict[str, dict[str, Stats]]
"""Per configuration, per workload: its `Stats`."""


def markdown(data: dict[str, Any], table: Table, stem: str) -> list[str]:
    return [
        *_header(data),
        *_targets(data, table),
        *_per_workload(data, table),
        *_answers(data),
        *_cache_counters(data),
        *_engines(data),
        "",
        f"Plots: `{stem}_ttft.png`, `{stem}_hit_rate.png`, `{stem}_cached_per_turn.png`.",
    ]


def _header(data: dict[str, Any]) -> list[str]:
    """The model, the commands, the machine, the profile, the mode and how it was measured."""
    configs = list(data["configs"])
    profile = data["profile"]
    runs = len(data["runs"])
    return [
        f"# Replay benchmark: {data['model']}",
        "",
        *(
            f"Command: `{r['command']}` (checkout {r['checkout'] or 'unknown'})  "
            for r in data["runs"]
        ),
        f"Started: {data['date']}  ",
        f"vLLM {data['vllm']}; machine: {data['machine']}  ",
        f"Profile: {', '.join(f'{k}={v}' for k, v in profile.items())}  ",
        *(
            [f"Speculative decoding on every side: `{json.dumps(spec)}`  "]
            if (spec := data.get("speculative_config"))
            else []
        ),
        *(
            [f"KV cache: {gib} GiB on every side (`--kv-cache-gib`; no memory profiling)  "]
            if (gib := data.get("kv_cache_gib"))
            else []
        ),
        *(
            [f"Tensor parallel: {tp} workers on every side (`--tensor-parallel-size`)  "]
            if (tp := data.get("tensor_parallel_size", 1)) > 1
            else []
        ),
        "Mode: "
        + "; ".join(f"{c} {data['configs'][c].get('mode', 'eager (unrecorded)')}" for c in configs)
        + "  ",
        "Each configuration is one engine (vLLM `AsyncLLM`, `vllm serve`'s defaults), started "
        "back to back in one "
        "process; every workload runs on it in the order below. Single-session workloads send "
        "one request at a time; `mix` and the traces start sessions at Poisson arrivals "
        f"({profile['rate']}/s) with at most {profile['concurrency']} sessions in flight. "
        "TTFT and end-to-end latency are measured at the client (send to first / last output); "
        "hit rate = cached prompt tokens (`num_cached_tokens`) / prompt tokens, first requests "
        "included; throughput = generated tokens / the workload's wall time; memory = peaks "
        "sampled every 0.25 s (host: resident memory of the benchmark and engine processes; "
        "device: nvidia-smi's memory in use, n/a on CPU); peak load = the highest 1-minute "
        "load average during the workload (other work on the machine slows it).",
        "",
        *(
            [
                f"This report merges {runs} invocations (`--resume`): each configuration ran in "
                "one of them, on the same profile and seeds, not in one process.",
                "",
            ]
            if runs > 1
            else []
        ),
    ]


def _targets(data: dict[str, Any], table: Table) -> list[str]:
    """Each target's ratio against the baseline per configuration of ours, and the answers that
    differ from the baseline's."""
    runs = len(data["runs"])
    same = "same run" if runs == 1 else f"configurations from {runs} runs: the commands above"
    baseline_name = baseline(table)
    lines = [f"## Targets (hybrid-prefix / {baseline_name}, {same})", ""]
    ours = [c for c in OURS if c in table]
    if baseline_name not in table or not ours:
        return lines
    lines += [
        *table_head("target | goal | " + " | ".join(f"{c} | met" for c in ours)),
    ]
    for label, workload, key, sense, goal in TARGETS:
        cells = []
        for c in ours:
            if workload not in table[c]:
                cells.append("- | -")
                continue
            value = ratio(
                getattr(table[c][workload], key), getattr(table[baseline_name][workload], key)
            )
            met = value >= goal if sense == ">=" else value <= goal
            cells.append(f"{times(value)} | {'yes' if met else 'no'}")
        lines.append(f"| {label} | {sense} {goal}x | {' | '.join(cells)} |")
    cells = []
    for c in ours:
        differ = sum(
            len(
                divergences(
                    run["requests"], data["configs"][baseline_name]["workloads"][w]["requests"]
                )
            )
            for w, run in data["configs"][c]["workloads"].items()
        )
        cells.append(f"{differ} | {'yes' if differ == 0 else 'no (see below)'}")
    lines.append(
        f"| requests whose greedy answer differs from {baseline_name}'s | 0 | {' | '.join(cells)} |"
    )
    return lines


def _per_workload(data: dict[str, Any], table: Table) -> list[str]:
    """One row per workload and configuration: tokens, hit rate, latencies, memory."""
    baseline_name = baseline(table)
    lines = [
        "",
        "## Per workload",
        "",
        *table_head(
            "workload | configuration | requests | prompt tokens | cached | computed | hit rate | "
            f"vs {baseline_name} | TTFT p50 (s) | TTFT p95 (s) | e2e p50 (s) | "
            "decode ms/token p50 | "
            "output tok/s | draft acceptance | peak host GiB | peak device GiB | peak load"
        ),
    ]
    for w in _workloads(data):
        for c in data["configs"]:
            if w not in table[c]:
                continue
            s = table[c][w]
            base = table.get(baseline_name, {}).get(w)
            vs = times(ratio(s.hit_rate, base.hit_rate)) if base else "-"
            lines.append(
                f"| {w} | {c} | {s.requests} | {s.prompt_tokens} | {s.cached_tokens} | "
                f"{s.prompt_tokens - s.cached_tokens} | "
                f"{s.hit_rate:.3f} | {vs} | {s.ttft_p50:.3f} | {s.ttft_p95:.3f} | "
                f"{s.e2e_p50:.3f} | {s.tpot_p50 * 1000:.1f} | {s.throughput:.1f} | "
                f"{'-' if s.acceptance is None else f'{s.acceptance:.3f}'} | "
                f"{gib(s.peak_host_bytes)} | {gib(s.peak_device_bytes)} | {s.peak_load:.1f} |"
            )
    return lines


def _answers(data: dict[str, Any]) -> list[str]:
    """Per workload and configuration: the requests whose greedy answer differs from the
    baseline's."""
    configs = list(data["configs"])
    baseline_name = baseline(configs)
    lines = [
        "",
        f"## Greedy answers against {baseline_name}",
        "",
        f"Requests whose greedy answer differs from {baseline_name}'s, each as `s<session>.<turn>@"
        f"<first differing token> ({baseline_name}'s top-1 margin there, nats)`; below "
        f"{NEAR_TIE} nat the two logits are a few bf16 ulps apart, where batching alone can "
        "flip the choice (`benchmarks/results/tiny_model_margin*.md`). `prompt`: the prompt "
        "already differs, following an earlier different answer.",
        "",
        f"| workload | {' | '.join(c for c in configs if c != baseline_name)} |",
        f"|---|{'---|' * (len(configs) - 1)}",
    ]
    for w in _workloads(data) if baseline_name in configs else []:
        base = data["configs"][baseline_name]["workloads"][w]["requests"]
        cells = []
        for c in configs:
            if c == baseline_name or w not in data["configs"][c]["workloads"]:
                continue
            found = divergences(data["configs"][c]["workloads"][w]["requests"], base)
            cells.append(f"{len(found)}: {', '.join(found)}" if found else "0")
        lines.append(f"| {w} | {' | '.join(cells)} |")
    return lines


def _cache_counters(data: dict[str, Any]) -> list[str]:
    """hybrid-prefix's own counters per workload, where the run recorded them
    (`replay.CACHE_COUNTERS`): a tap skipped for want of a device slot, or a snapshot evicted,
    shows in the hits only as a shallower resume. Beside them its disk tier at the workload's
    end, where there was one (`replay.DISK_LEVELS`)."""
    rows = [
        (w, config, c, run)
        for c, config in data["configs"].items()
        for w, run in config["workloads"].items()
        if run.get("cache")
    ]
    if not rows:
        return []
    lines = [
        "",
        "## The cache's counters",
        "",
        "Increments over each workload of the `vllm:hpc_*` counters that moved, by their names "
        "in `vllm_hpc/runtime/telemetry.py` (`taps_skipped_no_slot`: taps and endpoints skipped "
        "for want of a device snapshot slot; `hit_tokens_disk`: hits read back from the disk "
        "tier). The disk tier at the end: its bytes in use and free "
        "(`vllm:hpc_disk_bytes_{used,free}`), empty at the engine's start; with room left free, "
        "what it holds is every entry the cache wrote behind and kept, the working set as the "
        "cache keeps it, here against the host tier.",
        "",
        *table_head("workload | configuration | counters | disk tier at the end"),
    ]
    for w, config, c, run in rows:
        counters = ", ".join(f"{k} {v:,}" for k, v in run["cache"].items())
        lines.append(f"| {w} | {c} | {counters} | {_disk_at_end(config, run)} |")
    return lines


def _disk_at_end(config: dict[str, Any], run: dict[str, Any]) -> str:
    """The disk tier's bytes in use (against the host tier) and free at a workload's end."""
    disk = run.get("disk")
    if not disk:
        return "-"
    used, free = disk.get("disk_bytes_used", 0), disk.get("disk_bytes_free", 0)
    host = config["engine"]["kwargs"]["additional_config"]["host_cache_mib"] << 20
    return (
        f"{used / 2**20:,.0f} MiB in use ({used / host:.1f}x the host tier), "
        f"{free / 2**20:,.0f} MiB free"
    )


def _engines(data: dict[str, Any]) -> list[str]:
    """Each configuration's engine as it started, with its arguments."""
    lines = [
        "",
        "## Engines",
        "",
        *table_head(
            "configuration | vllm_hpc sources | block | prefill chunk | KV capacity (tokens) | "
            "start-up (s) | engine arguments"
        ),
    ]
    for c in data["configs"]:
        e = data["configs"][c]["engine"]
        args = ", ".join(f"{k}={v}" for k, v in e["kwargs"].items() if k != "model")
        lines.append(
            f"| {c} | {e['sources']} | {e['block']} | {e['chunk']} | {e['kv_tokens']:,} | "
            f"{e['start_s']:.0f} | {args} |"
        )
    return lines


def _workloads(data: dict[str, Any]) -> list[str]:
    """The workloads in the order they ran (those of the first configuration)."""
    return list(next(iter(data["configs"].values()))["workloads"])


def plots(data: dict[str, Any], table: Table, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    configs = list(data["configs"])
    workloads = _workloads(data)
    cols = 4
    rows = math.ceil(len(workloads) / cols)

    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, w in zip(axes.flat, workloads, strict=False):
        for c in configs:
            reqs = data["configs"][c]["workloads"].get(w, {}).get("requests", [])
            ttft = sorted(r["first_token_s"] - r["sent_s"] for r in reqs)
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=c)
        ax.set(title=w, xlabel="TTFT (s)", ylabel="fraction of requests", xscale="log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    axes.flat[0].legend(fontsize="small")
    _save(fig, axes, len(workloads), out.with_name(out.name + "_ttft.png"))

    fig, ax = plt.subplots(figsize=(2 + 1.3 * len(workloads), 3.5))
    width = 0.8 / len(configs)
    for i, c in enumerate(configs):
        rates = [table[c][w].hit_rate if w in table[c] else 0 for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], rates, width, label=c)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads, rotation=20)
    ax.set(ylabel="token hit rate", ylim=(0, 1))
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out.with_name(out.name + "_hit_rate.png"), dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, w in zip(axes.flat, workloads, strict=False):
        for c, style in zip(configs, itertools.cycle(["-", "--", ":", "-."])):
            reqs = data["configs"][c]["workloads"].get(w, {}).get("requests", [])
            # Line styles apart, so configurations that cached the same stay visible.
            ax.plot([r["cached_tokens"] for r in reqs], style, marker=".", label=c)
        ax.set(title=w, xlabel="request (by session, then turn)", ylabel="cached tokens")
    axes.flat[0].legend(fontsize="small")
    _save(fig, axes, len(workloads), out.with_name(out.name + "_cached_per_turn.png"))


def _save(fig: Any, axes: Any, used: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    for ax in axes.flat[used:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(path: Path) -> None:
    data = json.loads(path.read_text())
    table = {
        c: {w: stats(run) for w, run in cfg["workloads"].items()}
        for c, cfg in data["configs"].items()
    }
    stem = path.with_suffix("")
    lines = markdown(data, table, stem.name)
    try:
        plots(data, table, stem)
    except ImportError:
        lines += [
            "",
            '**No plots**: matplotlib is not installed (`pip install -e ".[bench]"`, or '
            "`.venv/bin/pip install matplotlib`), then run `python benchmarks/replay_report.py "
            f"{path.name}` again.",
        ]
        print("matplotlib is missing: no plots (pip install -e '.[bench]')", file=sys.stderr)
    publish(lines, stem.with_suffix(".md"))


if __name__ == "__main__":
    write_report(Path(sys.argv[1]))
