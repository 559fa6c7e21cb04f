"""The plugin's user-facing options, validated in one place.

Options travel inside vLLM's `additional_config` dict, because that is the one free-form
field that reaches every vLLM process (front end, engine core, workers) and enters vLLM's
config hash. The CLI flags that `vllm_hpc.glue.frontend.engine_args` adds to `vllm serve` are only
another way to fill the same keys, so the Python `LLM` API and the server accept exactly the
same options with exactly the same checks:

    LLM(model, additional_config={"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 0})
    vllm serve MODEL --kv-cache-manager hybrid-prefix --host-cache-mib 0
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any


class OptionError(ValueError):
    """A plugin option has an impossible value; the message names the option."""


class KVCacheManager(StrEnum):
    """Which prefix cache serves the model."""

    NATIVE = "native"  # vLLM's own block manager and (for hybrids) its "align" state cache
    HYBRID_PREFIX = "hybrid-prefix"  # this plugin's cache


@dataclass(frozen=True)
class OptionSpec:
    """One option: its `additional_config` key, CLI flag, parser and help text."""

    key: str
    flag: str
    help: str
    """Help text; its ``{name}`` fields are defaults the plugin derives
    (`vllm_hpc.derived.HELP_DEFAULTS`), filled in where the flags are added
    (`vllm_hpc.glue.frontend.engine_args.add_plugin_flags`)."""
    parse: Callable[[str, Any], Any]
    """(flag, raw value) -> value; raises OptionError naming the flag."""
    choices: tuple[str, ...] = ()
    is_flag: bool = False
    """A boolean switch on the command line (no value)."""


def _choice(flag: str, value: Any) -> KVCacheManager:
    choices = [m.value for m in KVCacheManager]
    if value not in choices:
        raise OptionError(f"{flag}: {value!r} is not one of {', '.join(choices)}")
    return KVCacheManager(value)


def _count(minimum: int) -> Callable[[str, Any], int | None]:
    def parse(flag: str, value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise OptionError(f"{flag}: expected an integer, got {value!r}")
        try:
            number = int(value)
        except ValueError:
            raise OptionError(f"{flag}: expected an integer, got {value!r}") from None
        if number < minimum:
            raise OptionError(f"{flag}: must be at least {minimum}, got {number}")
        return number

    return parse


def _share(flag: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise OptionError(f"{flag}: expected a number from 0 to 1, got {value!r}")
    try:
        share = float(value)
    except ValueError:
        raise OptionError(f"{flag}: expected a number from 0 to 1, got {value!r}") from None
    if not 0.0 <= share <= 1.0:
        raise OptionError(f"{flag}: must be from 0 to 1, got {share}")
    return share


def _path(flag: str, value: Any) -> str:
    """An absolute path (``~`` expanded, relative to the working directory at start-up), so
    every process of the engine names the same file whatever its own working directory."""
    if not isinstance(value, str | os.PathLike) or not str(value).strip():
        raise OptionError(f"{flag}: expected a file path, got {value!r}")
    return os.path.abspath(os.path.expanduser(os.fspath(value)))


def _switch(flag: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(f"{flag}: expected true or false, got {value!r}")
    return value


_HYBRID_ONLY = "Requires --kv-cache-manager hybrid-prefix."
DEFAULT_HOST_CACHE_MIB = 8192

OPTION_SPECS: tuple[OptionSpec, ...] = (
    OptionSpec(
        key="kv_cache_manager",
        flag="--kv-cache-manager",
        help=(
            "Prefix cache for hybrid (Gated DeltaNet + attention) models. 'native' keeps "
            "vLLM's own caching; 'hybrid-prefix' uses vllm_hpc's cache of 64-token KV blocks "
            "and recurrent-state snapshots. Python API: additional_config={{'kv_cache_manager': "
            "...}}. (default: native)"
        ),
        parse=_choice,
        choices=tuple(m.value for m in KVCacheManager),
    ),
    OptionSpec(
        key="active_state_slots",
        flag="--active-state-slots",
        help=(
            "Cap on requests running at once, each holding a state in rows of KV pages taken "
            "at run time (at most --max-num-seqs). Default: --max-num-seqs, so memory alone "
            "bounds concurrency, as with vLLM's own caching. " + _HYBRID_ONLY
        ),
        parse=_count(1),
    ),
    OptionSpec(
        key="device_snapshot_slots",
        flag="--device-snapshot-slots",
        help=(
            "Cap on snapshots (taps and endpoints) kept on the device, each in a row of KV "
            "pages that running requests and KV take back under load. Default: "
            "{snapshot_share} of the KV cache's rows, at least {spare_slots} "
            "({spare_slots_host} with a host tier) more than {active_share} of them, and where "
            "taps are saved inside the pass that many plus the taps a prompt may leave; "
            "reported at start-up. " + _HYBRID_ONLY
        ),
        parse=_count(1),
    ),
    OptionSpec(
        key="cache_taps_per_request",
        flag="--cache-taps-per-request",
        help=(
            "At most this many new snapshots are planned per prompt (default: {dense_taps} with "
            "a host tier or with {dense_slots} snapshot slots per active slot, else "
            "{spec_taps}; {in_pass_taps} where taps are saved inside the prefill pass). "
            + _HYBRID_ONLY
        ),
        parse=_count(0),
    ),
    OptionSpec(
        key="cache_tap_ladder",
        flag="--cache-tap-ladder",
        help=(
            "Tokens G of the geometric tap ladder n - G*2^k (default: max({ladder}, 2 x the tap "
            "grain: the prefill chunk, or {in_pass_grain} where taps are saved inside the "
            "pass)). " + _HYBRID_ONLY
        ),
        parse=_count(64),
    ),
    OptionSpec(
        key="cache_tap_min_gap",
        flag="--cache-tap-min-gap",
        help=(
            "Minimum tokens between a ladder tap and any other snapshot (default: max("
            "{min_gap}, the tap grain)). " + _HYBRID_ONLY
        ),
        parse=_count(0),
    ),
    OptionSpec(
        key="host_cache_mib",
        flag="--host-cache-mib",
        help=(
            "Host memory (MiB) for the cache's host tier, pinned on CUDA, per worker (default "
            f"{DEFAULT_HOST_CACHE_MIB}); 0 keeps the cache on the device only. " + _HYBRID_ONLY
        ),
        parse=_count(0),
    ),
    OptionSpec(
        key="cache_audit_rate",
        flag="--cache-audit-rate",
        help=(
            "Share of resumed prompts (0 to 1, default 0: off) that the cache audit recomputes "
            "from the root at the back of the queue, comparing the first "
            "--cache-audit-tokens greedy tokens with those of the same prompt served from the "
            "cache (vllm:hpc_audit_checked, vllm:hpc_audit_diverged). " + _HYBRID_ONLY
        ),
        parse=_share,
    ),
    OptionSpec(
        key="cache_audit_tokens",
        flag="--cache-audit-tokens",
        help="Greedy tokens an audited prompt compares (default 8). " + _HYBRID_ONLY,
        parse=_count(1),
    ),
    OptionSpec(
        key="prefix_cache_file",
        flag="--prefix-cache-file",
        help=(
            "Keep the cache across restarts in this directory: an alias of --disk-cache-dir "
            "PATH with a disk tier the size of the host tier (--host-cache-mib). An orderly "
            "stop (SIGTERM, SIGINT, engine shutdown) writes what the disk tier lacks and syncs "
            "its journal; a start finds the entries again when they were written by the same "
            "model, dtypes and versions, and logs why not otherwise. Not with "
            "--disk-cache-dir; a regular file (the cache file of earlier versions) is "
            "refused. " + _HYBRID_ONLY
        ),
        parse=_path,
    ),
    OptionSpec(
        key="disk_cache_dir",
        flag="--disk-cache-dir",
        help=(
            "Directory of the cache's disk tier, under the host tier: snapshots and their "
            "blocks are written behind from host slabs to a slab file per worker "
            "(DIR/engine<k>/rank<r>.slabs) and journaled (DIR/engine<k>/journal); a restart "
            "finds them there, and a hit reads them back (a damaged record is recomputed). "
            "Needs --disk-cache-gib and a host tier (--host-cache-mib). " + _HYBRID_ONLY
        ),
        parse=_path,
    ),
    OptionSpec(
        key="disk_cache_gib",
        flag="--disk-cache-gib",
        help=(
            "Size (GiB) of the disk tier's slab file per worker, preallocated at start-up "
            "(refused when the filesystem lacks the room). Needs --disk-cache-dir. " + _HYBRID_ONLY
        ),
        parse=_count(1),
    ),
    OptionSpec(
        key="no_prefix_reuse",
        flag="--no-prefix-reuse",
        help="Serve without any prefix reuse: nothing is cached or looked up. " + _HYBRID_ONLY,
        parse=_switch,
        is_flag=True,
    ),
)

_SPECS = {spec.key: spec for spec in OPTION_SPECS}


def _host_memory_mib() -> int:
    import psutil

    return int(psutil.virtual_memory().total >> 20)


@dataclass(frozen=True)
class PluginOptions:
    """The resolved options of one engine (None: derive the default at start-up)."""

    kv_cache_manager: KVCacheManager = KVCacheManager.NATIVE
    active_state_slots: int | None = None
    device_snapshot_slots: int | None = None
    cache_taps_per_request: int | None = None
    cache_tap_ladder: int | None = None
    cache_tap_min_gap: int | None = None
    host_cache_mib: int = DEFAULT_HOST_CACHE_MIB
    cache_audit_rate: float = 0.0
    cache_audit_tokens: int = 8
    no_prefix_reuse: bool = False
    prefix_cache_file: str | None = None
    """Absolute (`_path`)."""
    disk_cache_dir: str | None = None
    """Absolute (`_path`); set exactly when ``disk_cache_gib`` is."""
    disk_cache_gib: int | None = None

    @property
    def hybrid_prefix(self) -> bool:
        return self.kv_cache_manager is KVCacheManager.HYBRID_PREFIX

    @property
    def host_tier_mib(self) -> int:
        """The host tier in effect: none with --no-prefix-reuse, which caches nothing."""
        return 0 if self.no_prefix_reuse else self.host_cache_mib

    @classmethod
    def from_additional_config(cls, additional_config: object) -> PluginOptions:
        """Read and validate the plugin's keys; other keys belong to vLLM and are ignored."""
        if not isinstance(additional_config, Mapping):
            return cls()
        values: dict[str, Any] = {}
        for spec in OPTION_SPECS:
            if spec.key in additional_config:
                values[spec.key] = spec.parse(spec.flag, additional_config[spec.key])
        options = cls(**{k: v for k, v in values.items() if v is not None})
        options._check(set(values))
        return options

    def _check(self, given: set[str]) -> None:
        if not self.hybrid_prefix:
            misplaced = sorted(given - {"kv_cache_manager"})
            if misplaced:
                raise OptionError(
                    f"{_SPECS[misplaced[0]].flag} requires --kv-cache-manager hybrid-prefix"
                )
            return
        total_mib = _host_memory_mib()
        if self.host_cache_mib > total_mib:
            raise OptionError(
                f"--host-cache-mib {self.host_cache_mib} is more than this machine's "
                f"{total_mib} MiB of memory"
            )
        if self.no_prefix_reuse:
            tap_options = sorted(
                given
                & {
                    "device_snapshot_slots",
                    "cache_taps_per_request",
                    "cache_tap_ladder",
                    "cache_tap_min_gap",
                    "cache_audit_rate",
                    "cache_audit_tokens",
                    "prefix_cache_file",
                    "disk_cache_dir",
                    "disk_cache_gib",
                }
            )
            if tap_options:
                raise OptionError(
                    f"{_SPECS[tap_options[0]].flag} has no effect with --no-prefix-reuse"
                )
        if self.prefix_cache_file is not None:
            _check_cache_file(self.prefix_cache_file, self)
        if self.disk_cache_dir is not None or self.disk_cache_gib is not None:
            _check_disk_tier(self.disk_cache_dir, self.disk_cache_gib, self.host_cache_mib)


def _check_cache_file(path: str, options: PluginOptions) -> None:
    """Refuse, at start-up, what the alias cannot be: a second disk tier beside
    --disk-cache-dir, a tier with no host tier above it, or a path that holds a cache file of
    the old format, which is never read and must not be overwritten or deleted unasked."""
    flag, dir_flag = _SPECS["prefix_cache_file"].flag, _SPECS["disk_cache_dir"].flag
    if options.disk_cache_dir is not None or options.disk_cache_gib is not None:
        other = dir_flag if options.disk_cache_dir is not None else _SPECS["disk_cache_gib"].flag
        raise OptionError(
            f"{flag} is an alias of {dir_flag} (a disk tier the size of the host tier): give "
            f"one of them, not {flag} and {other}"
        )
    if options.host_cache_mib == 0:
        raise OptionError(f"{flag} keeps the host tier on disk, and --host-cache-mib 0 has none")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise OptionError(
            f"{flag} {path} is a file: {flag} now names a directory (the disk tier's), and "
            "cache files of earlier versions are no longer read; move or delete the file, or "
            "name another path (the cache starts empty once)"
        )
    _check_creatable(flag, path)


def _check_disk_tier(directory: str | None, gib: int | None, host_cache_mib: int) -> None:
    """Refuse, at start-up, a disk tier given half, with no host tier above it, or in a
    directory the server cannot create or write (the workers' slab files refuse a size the
    filesystem cannot hold, naming --disk-cache-gib)."""
    flag, size_flag = _SPECS["disk_cache_dir"].flag, _SPECS["disk_cache_gib"].flag
    if directory is None:
        raise OptionError(f"{size_flag} needs {flag}: the directory of the disk tier")
    if gib is None:
        raise OptionError(f"{flag} needs {size_flag}: the size of the disk tier")
    if host_cache_mib == 0:
        raise OptionError(
            f"{flag} puts a disk tier under the host tier, and --host-cache-mib 0 has none"
        )
    _check_creatable(flag, directory)


def _check_creatable(flag: str, directory: str) -> None:
    """Refuse a directory the server cannot create or write files in."""
    target = Path(directory)
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise OptionError(f"{flag} {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OptionError(f"{flag} {directory}: this server cannot create files in {existing}")
