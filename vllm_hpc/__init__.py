"""vllm_hpc: a hybrid prefix cache for vLLM's Qwen3.5 (Gated DeltaNet + attention) models.

Layout:
- `vllm_hpc.index`: the model-agnostic cache index (no torch, no vLLM imports).
- `vllm_hpc.options`: the plugin's user-facing options and their validation.
- `vllm_hpc.glue`: everything that depends on the pinned vLLM version.
- `vllm_hpc.plugin`: the `vllm.general_plugins` entry point.
- `vllm_hpc.tiny_model`: the embedded random-weight Qwen3.5 used by tests and examples.
"""

__version__ = "0.1.0"
