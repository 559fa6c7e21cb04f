"""Derived configuration: what the plugin computes from its options and the engine's sizes.

Free of torch and vLLM, so the scheduler process, the workers and the options' help text
(`vllm_hpc.options`) share one copy of every default: the state pool's sizing, the tap density,
the host budget check.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from vllm_hpc.index import HostGeometry, IndexConfig, TapPolicy, pages_for
from vllm_hpc.index.tap_planner import (
    SPEC_LADDER_TOKENS,
    SPEC_MIN_GAP_TOKENS,
    SPEC_TAPS,
    SPEC_TAPS_HOST,
)
from vllm_hpc.options import OptionError
from vllm_hpc.runtime.records import RuntimeConfig

if TYPE_CHECKING:
    from vllm_hpc.options import PluginOptions

ACTIVE_SHARE = 0.05
"""The running requests a cache of R state rows is sized for, as a share of R: where the
snapshot cap starts, and what the tap density compares it with. Not a cap on running requests:
they take rows at run time, up to --max-num-seqs."""
SNAPSHOT_SHARE = 0.10
"""Default cap on device snapshots: this share of the KV cache's rows, at least the sized-for
running requests plus these spares:"""
SPARE_SLOTS = 2
SPARE_SLOTS_WITH_HOST = 1

DENSE_SLOTS_PER_ACTIVE = 2
"""Snapshot slots per active slot from which taps get denser (beyond the spec)."""
DENSE_TAPS = 8
"""Taps a prompt may leave when they are dense (beyond the spec)."""
IN_PASS_TAP_GRAIN = 2048
"""Tokens between dense flexible taps when taps are captured inside a pass (the spec's chunk)."""
IN_PASS_DENSE_TAPS = 16
"""Taps a prompt may leave when they are dense and captured inside a pass."""

HELP_DEFAULTS = {
    "active_share": f"{ACTIVE_SHARE:.0%}%",  # argparse formats help with %: "5%%" shows "5%"
    "snapshot_share": f"{SNAPSHOT_SHARE:.0%}%",
    "spare_slots": SPARE_SLOTS,
    "spare_slots_host": SPARE_SLOTS_WITH_HOST,
    "spec_taps": SPEC_TAPS,
    "dense_taps": max(DENSE_TAPS, SPEC_TAPS_HOST),
    "in_pass_taps": IN_PASS_DENSE_TAPS,
    "dense_slots": DENSE_SLOTS_PER_ACTIVE,
    "ladder": SPEC_LADDER_TOKENS,
    "min_gap": SPEC_MIN_GAP_TOKENS,
    "in_pass_grain": IN_PASS_TAP_GRAIN,
}
"""The defaults the options' help text states (`OptionSpec.help` fields)."""


def tap_policy(
    options: PluginOptions, chunk: int, active: int, snapshot_slots: int, in_pass: bool = False
) -> TapPolicy:
    """The §14.2 defaults, denser when memory allows, with the user's tap options on top.

    Beyond the spec: with a host tier, or with at least two snapshot slots per running request,
    flexible taps are also taken at every prefill chunk boundary and a prompt may leave 8 of
    them: a flexible tap costs one state copy and no forward pass, and supersession and eviction
    prune what no request comes back to. (Without them, a 24,000-token prompt on an engine with
    8192-token chunks keeps no state below its last block: the ladder's first rung, n - 16384,
    lies within the minimum gap of the prompt's start.)

    Where the workers capture taps inside a pass (``in_pass``), a flexible tap costs the same
    anywhere on a block boundary, not only at a chunk's end: the ladder and the dense taps then
    follow the spec's 2048-token chunk whatever the engine's chunk, and a prompt may leave 16.
    """
    host_tier = options.host_tier_mib > 0
    grain = min(chunk, IN_PASS_TAP_GRAIN) if in_pass else chunk
    policy = TapPolicy.for_engine(chunk_tokens=grain, host_tier=host_tier)
    if host_tier or snapshot_slots >= DENSE_SLOTS_PER_ACTIVE * active:
        most = IN_PASS_DENSE_TAPS if in_pass else DENSE_TAPS
        policy = replace(policy, dense_flexible=True, max_new_taps=max(policy.max_new_taps, most))
    taps, ladder, gap = (
        options.cache_taps_per_request,
        options.cache_tap_ladder,
        options.cache_tap_min_gap,
    )
    return replace(
        policy,
        max_new_taps=policy.max_new_taps if taps is None else taps,
        ladder_tokens=policy.ladder_tokens if ladder is None else ladder,
        min_gap_tokens=policy.min_gap_tokens if gap is None else gap,
    )


@dataclass(frozen=True, slots=True)
class StateCaps:
    """How the rows of the KV cache may be shared among states (§5.4)."""

    active: int
    """Most requests running at once: --active-state-slots, else max_num_seqs."""
    snapshots: int
    """Most snapshots on the device: --device-snapshot-slots, else a share of the rows."""
    sized_for: int
    """The running requests the snapshot default and the tap density assume."""


def state_caps(options: PluginOptions, rows: int, max_seqs: int, prompt_taps: int = 0) -> StateCaps:
    """The caps from the options where given, else from the ``rows`` the KV cache holds (each
    one state's worth of pages), with a clear error naming the option that cannot fit.

    ``prompt_taps``: snapshots one prompt's prefill may hold at once, for which the default
    snapshot cap makes room beside the running requests it is sized for (`runtime_config`)."""
    if rows < 2:
        raise OptionError(
            f"the KV cache holds {rows} state row(s), not even one beside the scratch row: give "
            "vLLM more memory (--gpu-memory-utilization, --kv-cache-memory-bytes or "
            "--num-gpu-blocks-override)"
        )
    active = options.active_state_slots
    if active is None:
        active = max_seqs
    elif active > max_seqs:
        raise OptionError(
            f"--active-state-slots {active} is more than --max-num-seqs {max_seqs}: no more "
            "than that many requests ever run at once"
        )
    sized_for = max(1, min(active, int(ACTIVE_SHARE * rows)))
    snapshots = options.device_snapshot_slots
    if snapshots is None:
        spare = SPARE_SLOTS if options.host_tier_mib == 0 else SPARE_SLOTS_WITH_HOST
        snapshots = max(sized_for + spare + prompt_taps, int(SNAPSHOT_SHARE * rows))
    elif snapshots > rows - 1:
        raise OptionError(
            f"--device-snapshot-slots {snapshots} is more than the {rows - 1} state rows the KV "
            "cache holds beside its scratch row"
        )
    return StateCaps(active, min(snapshots, rows - 1), sized_for)


def check_one_request_fits(
    max_model_len: int, device_pages: int, row_pages: int, lane_rows: int = 1
) -> None:
    """Refuse a KV cache that cannot hold one request of --max-model-len tokens with its state
    rows (``lane_rows``: `RuntimeConfig.lane_rows`) beside the scratch row (vLLM's own check
    counts the KV pages alone)."""
    need = pages_for(max_model_len) + row_pages * lane_rows
    usable = device_pages - row_pages
    if need > usable:
        raise OptionError(
            f"--max-model-len {max_model_len}: one request that long needs {need} device pages "
            f"(its KV and {lane_rows} state row(s) of {row_pages}), and the KV cache has "
            f"{usable} beside its scratch row; lower --max-model-len or give vLLM more memory "
            "(--gpu-memory-utilization, --kv-cache-memory-bytes, --num-gpu-blocks-override)"
        )


SAVE_GRACE_SECONDS = 30.0
SAVE_RATE_MIB_S = 256.0
"""A stop's grace: this long, plus a full host tier written at this rate (a slow disk's)."""


def save_grace_seconds(host_cache_mib: int) -> float:
    """How long a stop waits for the engine core to write the disk tier's queue behind and
    sync its journal before it kills it (`glue/frontend/save_grace.py`,
    `glue/scheduler/stop_flush.py`): 62 s for the default 8 GiB host tier, which bounds
    what the queue can hold."""
    return SAVE_GRACE_SECONDS + host_cache_mib / SAVE_RATE_MIB_S


@dataclass(frozen=True)
class DiskTierSpec:
    """The disk tier in effect: ``--disk-cache-dir``/``--disk-cache-gib``, or
    ``--prefix-cache-file PATH``, its alias, a tier in the directory PATH sized to the host
    tier (what the stop's write-behind can hold), so a restart finds all of it."""

    directory: str
    budget_bytes: int
    """Per worker: each rank's slab file."""


def disk_tier_spec(options: PluginOptions) -> DiskTierSpec | None:
    """The disk tier these options ask for, or None (also with --no-prefix-reuse)."""
    if not options.host_tier_mib:
        return None
    if options.disk_cache_dir is not None and options.disk_cache_gib is not None:
        return DiskTierSpec(options.disk_cache_dir, options.disk_cache_gib << 30)
    if options.prefix_cache_file is not None:
        return DiskTierSpec(options.prefix_cache_file, options.host_tier_mib << 20)
    return None


DISK_WRITE_BYTES_PER_STEP = 128 << 20
"""Write-behind planned per engine step, at most. disk-io.md measured O_DIRECT writes at about
2-3 GiB/s: 128 MiB is 40-60 ms of them, about one busy step, so the workers' stores keep up
while the planned writes pin only that much of the host tier beyond what is landing."""


DISK_READ_AHEAD_REQUESTS = 4
"""The waiting queue's first requests whose reads from the disk tier are planned before vLLM
reaches them (`Admission.read_ahead`). A few: a slot that frees admits the head at once, so a
read started before its turn is what hides the disk; each read ahead holds its host slabs until
its request is admitted, and the queue's later requests would only hold them longer."""


def disk_write_bound(geometry: HostGeometry, max_model_len: int) -> int:
    """The byte bound of a step's `PrefixIndex.plan_disk_writes`: `DISK_WRITE_BYTES_PER_STEP`,
    or more where one snapshot with a --max-model-len path needs more. A snapshot goes to disk
    whole with the path blocks not there yet, so a smaller bound would never write the
    deepest."""
    deepest = pages_for(max_model_len) + geometry.snapshot_slabs(has_tail=True)
    return max(DISK_WRITE_BYTES_PER_STEP, deepest * geometry.slab_bytes)


def check_host_budget(host_cache_mib: int, geometry: HostGeometry) -> None:
    """Refuse a host tier smaller than one snapshot with its tail plus one block, naming the
    option (0, no host tier, passes). Checked once the model's block and state sizes are known."""
    slab = geometry.slab_bytes
    minimum = geometry.min_budget_slabs
    if host_cache_mib and (host_cache_mib << 20) // slab < minimum:
        need_mib = -(-minimum * slab // (1 << 20))
        raise OptionError(
            f"--host-cache-mib {host_cache_mib} is smaller than one snapshot with its tail plus "
            f"one block ({minimum} slabs of {slab} bytes: at least {need_mib} MiB); use 0 to "
            "disable the host tier"
        )


def runtime_config(
    options: PluginOptions,
    *,
    device_pages: int,
    row_pages: int,
    page_bytes: int,
    image_bytes: int,
    max_seqs: int,
    max_model_len: int,
    chunk: int,
    in_pass: bool,
    lane_rows: int = 1,
) -> RuntimeConfig:
    """The scheduler's cache configuration, from the options and what vLLM sized: device
    pages (ids from 1: vLLM's block 0 is its null block) of ``page_bytes`` over every attention
    layer, grouped in state rows of ``row_pages``; states of ``image_bytes``; the prefill
    chunk; ``lane_rows`` state rows per running request (`RuntimeConfig.lane_rows`)."""
    geometry = HostGeometry(page_bytes, image_bytes)
    check_host_budget(options.host_tier_mib, geometry)  # the slab pool would refuse it unnamed
    rows = device_pages // row_pages
    caps = state_caps(options, rows, max_seqs)
    taps = tap_policy(options, chunk, caps.sized_for, caps.snapshots, in_pass)
    if in_pass:
        # Saved inside the pass, a chunk's taps take their slots in one step, and under async
        # scheduling they hold them until their host writes land a few steps on: a prompt of a
        # few chunks holds all its taps at once. Without room for them its final chunk (its
        # deepest taps) finds no slot (docs/notes/deep-edit-turn-6.md).
        caps = state_caps(options, rows, max_seqs, prompt_taps=taps.max_new_taps)
    disk = disk_tier_spec(options)
    check_one_request_fits(max_model_len, device_pages, row_pages, lane_rows)
    return RuntimeConfig(
        index=IndexConfig(
            device_pages=device_pages,
            first_page_id=1,
            snapshot_slots=caps.snapshots,
            row_pages=row_pages,
            geometry=geometry,
            host_budget_bytes=options.host_tier_mib << 20,
            disk_budget_bytes=disk.budget_bytes if disk is not None else 0,
        ),
        disk_write_bytes=disk_write_bound(geometry, max_model_len),
        active_cap=caps.active,
        tap_policy=taps,
        chunk_tokens=chunk,
        prefix_reuse=not options.no_prefix_reuse,
        in_pass_taps=in_pass,
        lane_rows=lane_rows,
    )
