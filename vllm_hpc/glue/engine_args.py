"""Hooks on vLLM's `EngineArgs`: the plugin's CLI flags and its engine-config check.

vLLM loads general plugins before it builds its CLI parser (`AsyncEngineArgs.add_cli_args`)
and before it turns `EngineArgs` into a `VllmConfig` (`create_engine_config`), so wrapping
those three methods at plugin load is enough for `vllm serve`, the OpenAI api_server module
and the Python `LLM` API alike:

- `add_cli_args`: adds the plugin's flags in their own help group.
- `from_cli_args`: moves the parsed flags into `additional_config` (see `vllm_hpc.options`).
- `create_engine_config`: validates the options before vLLM builds anything.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vllm_hpc.options import OPTION_SPECS, KVCacheManager, OptionError, PluginOptions

HELP_GROUP = "HybridPrefixCache"
HELP_GROUP_DESCRIPTION = "vllm_hpc: the hybrid prefix cache for Qwen3.5 (Gated DeltaNet) models."

_installed = False


def install_engine_args_hooks() -> None:
    """Wrap the three `EngineArgs` methods once per process."""
    global _installed
    if _installed:
        return
    from vllm.engine.arg_utils import EngineArgs

    original_add: Callable[[Any], Any] = EngineArgs.add_cli_args
    original_from: Callable[..., Any] = EngineArgs.__dict__["from_cli_args"].__func__
    original_create: Callable[..., Any] = EngineArgs.create_engine_config

    def add_cli_args(parser: Any) -> Any:
        parser = original_add(parser)
        add_plugin_flags(parser)
        return parser

    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original_from(cls, args)
        engine_args.additional_config = merge_cli_options(args, engine_args.additional_config)
        return engine_args

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        check_engine_options(self.additional_config)
        return original_create(self, *args, **kwargs)

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
    _installed = True


def add_plugin_flags(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's flags, unless this parser already has them."""
    if any(spec.flag in parser._option_string_actions for spec in OPTION_SPECS):
        return
    group = parser.add_argument_group(HELP_GROUP, description=HELP_GROUP_DESCRIPTION)
    for spec in OPTION_SPECS:
        group.add_argument(
            spec.flag,
            dest=spec.key,
            choices=spec.choices or None,
            default=argparse.SUPPRESS,  # absent unless given, so it never hides additional_config
            help=spec.help,
        )


def merge_cli_options(args: argparse.Namespace, additional_config: Any) -> dict[str, Any]:
    """Return `additional_config` with the values of the plugin's flags added.

    A flag and an `--additional-config` key that disagree are refused rather than letting
    one silently win.
    """
    merged = dict(additional_config or {})
    for spec in OPTION_SPECS:
        value = getattr(args, spec.key, None)
        if value is None:
            continue
        if spec.key in merged and merged[spec.key] != value:
            raise OptionError(
                f"{spec.flag} {value} conflicts with --additional-config "
                f"{spec.key}={merged[spec.key]!r}; give one of them"
            )
        merged[spec.key] = value
    return merged


def check_engine_options(additional_config: Any) -> PluginOptions:
    """Validate the options before vLLM builds its config; refuse what cannot run yet."""
    options = PluginOptions.from_additional_config(additional_config)
    if options.kv_cache_manager is KVCacheManager.HYBRID_PREFIX:
        raise OptionError(
            "--kv-cache-manager hybrid-prefix: the hybrid prefix cache manager is not "
            "available in this version of vllm_hpc yet; use --kv-cache-manager native "
            "(vLLM's own prefix caching)"
        )
    return options
