"""The plugin's user-facing options, validated in one place.

Options travel inside vLLM's `additional_config` dict, because that is the one free-form
field that reaches every vLLM process (front end, engine core, workers) and enters vLLM's
config hash. The CLI flags that `vllm_hpc.glue.engine_args` adds to `vllm serve` are only
another way to fill the same keys, so the Python `LLM` API and the server accept exactly the
same options with exactly the same checks:

    LLM(model, additional_config={"kv_cache_manager": "hybrid-prefix"})
    vllm serve MODEL --kv-cache-manager hybrid-prefix
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class OptionError(ValueError):
    """A plugin option has an impossible value; the message names the option."""


class KVCacheManager(StrEnum):
    """Which prefix cache serves the model."""

    NATIVE = "native"  # vLLM's own block manager and (for hybrids) its "align" state cache
    HYBRID_PREFIX = "hybrid-prefix"  # this plugin's cache


@dataclass(frozen=True)
class OptionSpec:
    """One option: its `additional_config` key, its CLI flag and its help text."""

    key: str
    flag: str
    help: str
    choices: tuple[str, ...] = ()


KV_CACHE_MANAGER_OPTION = OptionSpec(
    key="kv_cache_manager",
    flag="--kv-cache-manager",
    help=(
        "Prefix cache for hybrid (Gated DeltaNet + attention) models. 'native' keeps vLLM's "
        "own caching; 'hybrid-prefix' uses vllm_hpc's cache of 64-token KV blocks and "
        "recurrent-state snapshots. Python API: additional_config={'kv_cache_manager': ...}. "
        "(default: native)"
    ),
    choices=tuple(m.value for m in KVCacheManager),
)

OPTION_SPECS: tuple[OptionSpec, ...] = (KV_CACHE_MANAGER_OPTION,)


@dataclass(frozen=True)
class PluginOptions:
    """The resolved options of one engine."""

    kv_cache_manager: KVCacheManager = KVCacheManager.NATIVE

    @classmethod
    def from_additional_config(cls, additional_config: object) -> PluginOptions:
        """Read and validate the plugin's keys; other keys belong to vLLM and are ignored."""
        if not isinstance(additional_config, Mapping):
            return cls()
        return cls(kv_cache_manager=_parse_choice(KV_CACHE_MANAGER_OPTION, additional_config))


def _parse_choice(spec: OptionSpec, config: Mapping[str, Any]) -> KVCacheManager:
    value = config.get(spec.key, KVCacheManager.NATIVE.value)
    if value not in spec.choices:
        raise OptionError(
            f"{spec.flag} (additional_config[{spec.key!r}]): {value!r} is not one of "
            f"{', '.join(spec.choices)}"
        )
    return KVCacheManager(value)
