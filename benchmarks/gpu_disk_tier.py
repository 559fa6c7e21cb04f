"""The disk tier on the GPU (#50): a long prefix read back from disk after a restart, against
the disk's own sequential read and against a cold prefill.

On the filesystem of ``--dir`` (where the disk tier goes), in this order:

1. The sequential read bandwidth: `disk_io.py`'s baseline pass on a fresh file of
   ``--baseline-gib`` (written, fsynced, dropped from the page cache, then read in 8 MiB
   O_DIRECT reads, and by ``dd iflag=direct``).
2. `restart.py`'s restart: a first engine runs a ``--length``-token first turn cold and stops,
   its stop writing the disk tier (``--prefix-cache-file``, a disk tier the size of the host
   tier); a second starts from the journal, so every entry is on disk only, and runs the next
   turn (the first, its answer and ``--new-tokens`` tokens), read from the disk, then the same
   turn cold under another ``cache_salt``.

Targets (#50):

- Restore bandwidth disk -> device >= 0.8x the sequential read: the bytes the cache counted read
  from disk for the next turn (`vllm:hpc_disk_bytes{what="read"}`) over the seconds from the
  turn's submission to the end of the engine step that admitted it with its disk hit (the read
  into pinned host memory, then its host -> device restore inside that step, beside the prefill
  of the turn's uncached tokens, which the figure pays too). The read alone, to the end of the
  step after which it had landed, and the restore's copy seconds as the workers time them are
  reported beside it.
- TTFT of the next turn, its prefix found only on disk, <= 0.1x the same turn's cold TTFT.

Writes ``gpu_disk_tier.json`` and ``.md`` to ``--out`` after each part; ``--resume JSON`` keeps the
parts an earlier call of the same arguments measured (its restart, from a call's start to its
end, is one part: the second engine needs the first one's directory).

    CPU, tiny model:  .venv/bin/python benchmarks/gpu_disk_tier.py --cpu --out /tmp/disk_tier
    GPU, 27B shape:   python3 benchmarks/gpu_disk_tier.py --model .gpu/model27b-vl \\
                          --max-num-seqs 256 --dir /tmp/hpc-disk --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import restart
from bench_common import cpu_machine, publish, ratio, table_head, times
from disk_io import GIB, MIB, SEQ_CHUNK, baseline, cold_file, fs_info
from gpu_speed import device_name

PROFILES = {"gpu": {"baseline_gib": 8.0}, "cpu": {"baseline_gib": 0.5}}
"""The baseline's test file: about the size of the 100,000-token prefix's read (6 GiB) on the
27B shape."""
GOALS = {"restore_vs_sequential": 0.8, "ttft_vs_cold": 0.1}
SAME = ("model", "cpu", "length", "host_mib", "max_model_len", "answer", "new_tokens")
"""What `--resume` must share with the call it continues, or its parts measured other work."""


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def sequential_read(directory: Path, gib: float) -> dict[str, Any]:
    """The filesystem under ``directory`` and one baseline pass over a fresh file there."""
    info = fs_info(directory)
    size = max(SEQ_CHUNK, int(gib * GIB) // SEQ_CHUNK * SEQ_CHUNK)
    with cold_file(directory, size) as target:
        rates = baseline(target)
    return {
        "measured": now(),
        "filesystem": asdict(info),
        "file_gib": size / GIB,
        "o_direct_refused": target.refused,
        "fill_mib_s": target.fill_mib_s,
        **rates,
    }


def target_rows(report: dict[str, Any]) -> list[str]:
    """Both targets, each with the figures it comes from, or "not measured"."""
    seq, run = report.get("baseline"), report.get("restart")
    rows = []
    goal = GOALS["restore_vs_sequential"]
    label = "restore bandwidth disk -> device / sequential read"
    if seq and run and run.get("admitted_s") and run.get("read_bytes"):
        mib = run["read_bytes"] / MIB
        to_device = mib / run["admitted_s"]
        r = ratio(to_device, seq["sequential_mib_s"])
        measured = (
            f"{times(r)} ({to_device:,.0f} MiB/s: {mib:,.1f} MiB in {run['admitted_s']:.3f} s, "
            f"vs {seq['sequential_mib_s']:,.0f} MiB/s)"
        )
        rows.append(f"| {label} | >= {goal}x | {measured} | {'yes' if r >= goal else 'NO'} |")
    else:
        rows.append(f"| {label} | >= {goal}x | not measured | - |")
    goal = GOALS["ttft_vs_cold"]
    label = "TTFT, the prefix only on disk / cold prefill"
    if run:
        disk, cold = run["restored_turn"]["ttft_s"], run["cold_next_turn"]["ttft_s"]
        r = ratio(disk, cold)
        measured = f"{times(r)} ({disk:.3f} s vs {cold:.3f} s)"
        rows.append(f"| {label} | <= {goal}x | {measured} | {'yes' if r <= goal else 'NO'} |")
    else:
        rows.append(f"| {label} | <= {goal}x | not measured | - |")
    return rows


def read_rows(report: dict[str, Any]) -> list[str]:
    """The baseline pass, and the restart's read as bandwidths beside it."""
    seq, run = report.get("baseline"), report.get("restart")
    if not seq:
        return ["Not measured.", ""]
    fs = seq["filesystem"]
    dd = seq["dd_mib_s"]
    rows = [
        f"Filesystem of `{fs['directory']}`: {fs['fstype']} on {fs['source']} (mount "
        f"{fs['mount']}, block device {fs['block_device']}, rotational {fs['rotational']}), "
        f"measured {seq['measured']}. O_DIRECT "
        f"{'used' if seq['o_direct_refused'] is None else 'refused: ' + seq['o_direct_refused']}.",
        "",
        *table_head("read | MiB/s"),
        f"| sequential pass, 8 MiB reads, {seq['file_gib']:.2f} GiB file | "
        f"{seq['sequential_mib_s']:,.0f} |",
        f"| dd iflag=direct, the same file | {'not run' if dd is None else f'{dd:,.0f}'} |",
        f"| writing that file (8 MiB writes, then fsync) | {seq['fill_mib_s']:,.0f} |",
    ]
    if run and run.get("read_bytes"):
        mib = run["read_bytes"] / MIB
        for what, key in (
            (
                "the next turn's read, disk -> pinned host, to the step it had landed",
                "read_landed_s",
            ),
            ("the same, disk -> device, to the end of its admission step", "admitted_s"),
        ):
            rate = f"{mib / run[key]:,.0f}" if run.get(key) else "-"
            rows.append(f"| {what} | {rate} |")
        if run.get("restore_s"):
            copied = run["restore_bytes"] / MIB
            rows.append(
                f"| its host -> device restore alone, copy seconds timed by the workers | "
                f"{copied / run['restore_s']:,.0f} |"
            )
    return [*rows, ""]


def markdown(report: dict[str, Any], args: argparse.Namespace) -> str:
    machine = cpu_machine() if args.cpu else f"{device_name(False)} ({cpu_machine()})"
    lines = [
        "# The disk tier: a restart's prefix read back from disk (#50)",
        "",
        *(f"- Command: `{c}`" for c in report["commands"]),
        f"- Machine: {machine}; vLLM {report['vllm']}; model `{args.model}`",
        "",
        "## Targets",
        "",
        *table_head("target | goal | measured | met"),
        *target_rows(report),
        "",
        "## Sequential read against the restart's read",
        "",
        *read_rows(report),
        "## The restart",
        "",
    ]
    run = report.get("restart")
    if run:
        lines.append(restart.markdown(run, args, report["commands"][-1]))
    else:
        lines.append(report.get("error", "Not measured."))
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The JSON and the report so far: a run cut short keeps what it measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_disk_tier.json").write_text(json.dumps(report, indent=1, default=str))
    publish(markdown(report, args).splitlines(), args.out / "gpu_disk_tier.md", flush=True)


def resumed(args: argparse.Namespace) -> dict[str, Any]:
    """--resume's report with this call recorded, refused if it measured other work."""
    report: dict[str, Any] = json.loads(args.resume.read_text())
    differ = [k for k in SAME if str(report["args"].get(k)) != str(getattr(args, k))]
    if differ:
        raise SystemExit(f"--resume {args.resume}: other arguments: {differ}")
    report.pop("error", None)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for gpu_disk_tier.*")
    restart.add_options(ap)
    ap.add_argument("--baseline-gib", type=float, help="the sequential read's file (8; CPU 0.5)")
    ap.add_argument("--resume", type=Path, help="a gpu_disk_tier.json cut short: keep its parts")
    args = ap.parse_args()
    if args.baseline_gib is None:
        args.baseline_gib = PROFILES["cpu" if args.cpu else "gpu"]["baseline_gib"]
    restart.resolve(ap, args)
    command = "python benchmarks/gpu_disk_tier.py " + " ".join(sys.argv[1:])
    report = resumed(args) if args.resume else {"args": {k: str(v) for k, v in vars(args).items()}}
    report.setdefault("commands", []).append(command)
    report["vllm"] = metadata.version("vllm")
    if "baseline" not in report:
        report["baseline"] = sequential_read(args.dir, args.baseline_gib)
        write(report, args)
    if "restart" not in report:
        try:
            report["restart"] = {"measured": now(), **restart.run(args)}
        except Exception as exc:  # recorded with what the baseline measured
            report["error"] = f"the restart failed: {type(exc).__name__}: {exc}"
            write(report, args)
            raise
    write(report, args)


if __name__ == "__main__":
    main()
