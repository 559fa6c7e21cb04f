"""Which model classes serve `hybrid-prefix`, chosen through vLLM's `hf_overrides`.

The classes live in `vllm_hpc.glue.worker.model`; this module stays light (no torch, no model
imports) because every vLLM process loads it with the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hpc.options import OptionError

ARCHITECTURES = {
    "Qwen3_5ForCausalLM": "HybridPrefixQwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "HybridPrefixQwen3_5MoeForCausalLM",
    # What every published Qwen3.5 checkpoint declares: the text model inside a vision-language
    # wrapper (a vision tower that vLLM leaves unloaded with --language-model-only).
    "Qwen3_5ForConditionalGeneration": "HybridPrefixQwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": "HybridPrefixQwen3_5MoeForConditionalGeneration",
}
MTP_DRAFTERS = ("Qwen3_5MTP", "Qwen3_5MoeMTP")
"""vLLM's drafters for `--speculative-config` method "mtp": vLLM builds the draft model's
config from the target's checkpoint with the same `hf_overrides`. They are kept as they are
(one full-attention layer, no GDN state; its KV joins the target's attention pages)."""


@dataclass(frozen=True)
class ArchitectureOverride:
    """`hf_overrides` for hybrid-prefix: serve a Qwen3.5 checkpoint with vllm_hpc's classes.

    Applies the user's own `hf_overrides` first: a callable as vLLM would, a dict by setting
    attributes (a nested dict updates the attributes of the sub-config it names).
    """

    user_overrides: Any = None

    def __call__(self, hf_config: Any) -> Any:
        user = self.user_overrides
        if callable(user):
            hf_config = user(hf_config)
        elif user:
            for key, value in user.items():
                target = getattr(hf_config, key, None)
                if isinstance(value, dict) and target is not None and not isinstance(target, dict):
                    for sub_key, sub_value in value.items():
                        setattr(target, sub_key, sub_value)
                else:
                    setattr(hf_config, key, value)
        # vLLM may call this more than once, and first on a config still without architectures.
        architectures = [a for a in getattr(hf_config, "architectures", None) or [] if a]
        ours = set(ARCHITECTURES.values()) | set(MTP_DRAFTERS)
        unsupported = [a for a in architectures if a not in ARCHITECTURES and a not in ours]
        if unsupported:
            raise OptionError(
                f"--kv-cache-manager hybrid-prefix serves {', '.join(ARCHITECTURES)}; this "
                f"model's architectures are {architectures}"
            )
        if architectures:
            hf_config.architectures = [ARCHITECTURES.get(a, a) for a in architectures]
        return hf_config


def register_models() -> None:
    """Register vllm_hpc's classes under their own names (imported lazily by vLLM), with the
    configuration updates vLLM makes for the classes they stand in for.

    vLLM looks those updates up by architecture name (`MODELS_CONFIG_MAP`). For Qwen3.5 they
    keep the recurrent state in the checkpoint's `mamba_ssm_dtype` (float32 in the released
    checkpoints) and give text-only models one-dimensional positions. Without them our classes
    would keep the state in the activations' dtype, coarser than vLLM's own engine keeps it, so
    their answers could part from vLLM's. The CUDA-graph mode vLLM picks by name follows too
    (`versions.share_graph_mode`).
    """
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from vllm_hpc.glue.versions import share_graph_mode

    for theirs, ours in ARCHITECTURES.items():
        ModelRegistry.register_model(ours, f"vllm_hpc.glue.worker.model:{ours}")
        MODELS_CONFIG_MAP.setdefault(ours, MODELS_CONFIG_MAP[theirs])
    share_graph_mode(ARCHITECTURES)
