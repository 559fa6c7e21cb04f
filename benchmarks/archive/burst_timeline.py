"""The timeline of a burst from `benchmarks/load.py`'s records: when first tokens come, how long
the decode tail is, and how the finishing waves are spaced.

A burst's throughput gap can sit in the prefill steps (first tokens come in groups, one group a
saturated step), in the decode tail, or in the finishing steps (requests end in waves, one wave
a step). The summary's figures mix the three; this splits them, per engine of each report.
It also cuts the requests' first-scheduled times into step starts. A step that starts no new
request is not seen, so these mark every step only where each step starts prompts whole, as
hybrid-prefix's do; native's align mode spreads a prompt over steps, and its intervals may pair
up (about 2.0 and 0.7 s) with no pause. A late start followed by a short interval is either a
pause of the engine core that the GPU did not wait for (under async scheduling a step is
scheduled while the one before it runs) or a step that started no prompt.

    python3 benchmarks/archive/burst_timeline.py benchmarks/archive/results/gpu_load_run11_*.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GROUP_GAP_S = 0.3
"""First tokens, or first-scheduled times, further apart than this belong to different prefill
steps (a step is ~1.4 s)."""

WAVE_GAP_S = 0.010
"""Last tokens further apart than this belong to different finishing steps (each over 10 ms)."""

LONG_GAP_S = 0.060
"""A gap between finishing waves longer than this is listed one by one."""

LATE_START = 1.25
"""An interval between step starts over this many times their median is listed as late (from
the second step on: the first interval holds the burst's admission and is longer anyway)."""


@dataclass(frozen=True)
class Timeline:
    """One burst's phases, in seconds after its first request arrived."""

    groups: int
    group_interval_s: float
    step_starts: int
    step_interval_s: float
    late_starts: list[tuple[float, float]]
    """(when the late step started, the interval before it), seconds."""
    last_first_token_s: float
    decode_tail_s: float
    waves: int
    waves_span_s: float
    wave_gaps_s: list[float]


def clusters(times: list[float], gap: float) -> list[list[float]]:
    """``times`` sorted and cut wherever two neighbours are more than ``gap`` apart."""
    out: list[list[float]] = []
    for t in sorted(times):
        if out and t - out[-1][-1] <= gap:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def timeline(records: list[dict[str, Any]]) -> Timeline:
    arrivals = [r["scheduled_ts"] - r["queued_s"] for r in records]
    origin = min(arrivals)
    first = [a + r["ttft_s"] - origin for a, r in zip(arrivals, records, strict=True)]
    last = [r["last_token_ts"] - origin for r in records]
    last_first = max(first)
    groups = clusters(first, GROUP_GAP_S)
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(groups)]
    starts = [c[0] for c in clusters([r["scheduled_ts"] - origin for r in records], GROUP_GAP_S)]
    step_intervals = [b - a for a, b in itertools.pairwise(starts)]
    step_interval = statistics.median(step_intervals) if step_intervals else 0.0
    # The finishing waves: requests ending after the last first token, one wave a step.
    waves = clusters([t for t in last if t > last_first], WAVE_GAP_S)
    return Timeline(
        groups=len(groups),
        group_interval_s=statistics.median(intervals) if intervals else 0.0,
        step_starts=len(starts),
        step_interval_s=step_interval,
        late_starts=[
            (b, b - a)
            for a, b in itertools.pairwise(starts[1:])
            if b - a > LATE_START * step_interval
        ],
        last_first_token_s=last_first,
        decode_tail_s=max(last) - last_first,
        waves=len(waves),
        waves_span_s=waves[-1][-1] - waves[0][0] if waves else 0.0,
        wave_gaps_s=[b[0] - a[-1] for a, b in itertools.pairwise(waves)],
    )


def describe(name: str, t: Timeline) -> list[str]:
    long_gaps = [
        f"after wave {i + 1}: {g * 1e3:.0f} ms"
        for i, g in enumerate(t.wave_gaps_s)
        if g > LONG_GAP_S
    ]
    short = [g for g in t.wave_gaps_s if g <= LONG_GAP_S]
    late = [f"at {when:.2f} s after {gap:.3f} s" for when, gap in t.late_starts]
    return [
        name,
        f"  first-token groups {t.groups}, median interval {t.group_interval_s:.3f} s,"
        f" last first token {t.last_first_token_s:.2f} s after the arrival",
        f"  scheduler's step starts {t.step_starts}, median interval {t.step_interval_s:.3f} s;"
        f" late: {'; '.join(late) or 'none'}",
        f"  decode tail (last first token to last token) {t.decode_tail_s:.3f} s",
        f"  finishing waves {t.waves} over {t.waves_span_s:.3f} s;"
        + (f" other gaps {min(short) * 1e3:.0f}-{max(short) * 1e3:.0f} ms" if short else ""),
        f"  gaps over {LONG_GAP_S * 1e3:.0f} ms: " + ("; ".join(long_gaps) or "none"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path, help="load.json files of benchmarks/load.py")
    args = ap.parse_args()
    for path in args.reports:
        report = json.loads(path.read_text())
        for e in report["engines"]:
            workloads = (e.get("result") or {}).get("workloads", {})
            for wname, w in workloads.items():
                if not wname.startswith("burst"):
                    continue
                budget = e["facts"]["max_num_batched_tokens"]
                name = f"{path.name}: {e['config']} ({wname}, budget {budget})"
                print("\n".join(describe(name, timeline(w["records"]))))


if __name__ == "__main__":
    main()
