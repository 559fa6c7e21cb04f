"""Qwen3.5 model classes for the hybrid prefix cache.

They are vLLM's own Qwen3.5 classes with two changes, registered under their own architecture
names so that `--kv-cache-manager native` keeps serving vLLM's unchanged classes:

- `is_hybrid = False`: vLLM then neither inflates the attention block to the size of a state
  page nor switches on its "align" state caching. Attention KV stays in 64-token pages.
- Every Gated DeltaNet layer becomes a `HybridPrefixGDN`, whose states live in the worker's
  `StatePool`: rows of pages in vLLM's own KV cache buffer, which the index shares between KV
  pages and states at run time. Its KV-cache spec is a one-byte `StateRowSpec`: vLLM still
  builds GDN metadata for it, the "block id" it hands the layer for a request is the request's
  state row, and the spec carries the state's size to the scheduler.
- On CUDA with vLLM's FLA (Triton) prefill kernel, a GDN layer also saves the step's in-pass
  captures (`vllm_hpc.glue.worker.in_pass`), and the spec tells the scheduler it can; and
  its kernels are tuned on a prefill step's shape before vLLM's one-chunk warm-up
  (`vllm_hpc.glue.worker.kernel_tuning`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer import has_kv_transfer_group
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import KVCacheSpec

from vllm_hpc.glue import InstallOnce
from vllm_hpc.glue.state_spec import StateRowSpec
from vllm_hpc.glue.versions import (
    flashinfer_gives_checkpoints,
    has_v1_model_runner,
    qwen3_5_module,
    shares_gdn_block_table,
)
from vllm_hpc.glue.worker.in_pass import (
    capture_layer,
    flashinfer_captures_pending,
    flashinfer_prefill,
    install_fla_hook,
)
from vllm_hpc.glue.worker.kernel_tuning import tune_prefill_kernels
from vllm_hpc.glue.worker.state_pool import StatePool
from vllm_hpc.index import BLOCK_TOKENS, pages_for

logger = logging.getLogger("vllm.vllm_hpc")
_qwen3_5: Any = importlib.import_module(qwen3_5_module())


class StateRowGDNMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN metadata builder, whose state indices are always rows of the `StatePool`.

    In a scheduled step the GDN groups' block table holds each request's state row (handed
    out by `HybridPrefixKVCacheManager`). vLLM's warm-up steps and dummy runs bypass the
    scheduler and disable the KV connector (`kv_connector.set_disabled(True)`): V2's
    `_warmup_kernels` numbers blocks 1, 2, ... across every KV cache group of up to
    max_num_seqs requests, far past the pool's rows. Such steps run on the scratch row 0, as
    vLLM's own dummy block tables do (`BlockTables.get_dummy_block_tables`).
    """

    def __init__(self, kv_cache_spec: Any, layer_names: Any, vllm_config: Any, device: Any):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # vLLM lets later GDN groups re-gather their indices from the first group's metadata
        # only for its own class (to keep KDA's builders out); this one builds the same.
        self.supports_update_block_table = shares_gdn_block_table(vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not has_kv_transfer_group():  # a warm-up or dummy step: no state rows in it
            table = torch.zeros_like(common_attn_metadata.block_table_tensor)
            common_attn_metadata = common_attn_metadata.replace(block_table_tensor=table)
        metadata = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        dense_state_indices(metadata)
        return metadata

    def update_block_table(self, metadata: Any, blk_table: Any, slot_mapping: Any) -> Any:
        if not has_kv_transfer_group():
            blk_table = torch.zeros_like(blk_table)
        return super().update_block_table(metadata, blk_table, slot_mapping)


def dense_state_indices(metadata: Any) -> None:
    """Give the non-speculative rows' state indices stride 1, which vLLM's CPU GDN decode
    kernel requires. With speculative decoding they are column 0 of the (rows, 1 + K) block
    table: for one row (a one-token prefill chunk, the only one of its step: a prompt whose
    last chunk starts at a tap at n - 1) PyTorch calls that column contiguous at stride 1 + K,
    so vLLM's `.contiguous()` keeps it and the kernel stops the engine ("tensor must be
    contiguous at last dimension"; vLLM without the plugin, on a 513-token prompt in chunks of
    512, too)."""
    indices = metadata.non_spec_state_indices_tensor
    if indices is not None and indices.dim() == 1 and indices.stride(0) != 1:
        dense = torch.empty_like(indices, memory_format=torch.contiguous_format)
        metadata.non_spec_state_indices_tensor = dense.copy_(indices)


class StateRowGDNBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return StateRowGDNMetadataBuilder


class HybridPrefixGDN(QwenGatedDeltaNetAttention):
    """A GDN layer reading and writing its states in the worker's `StatePool`."""

    state_pool: StatePool

    @property
    def kv_cache(self) -> tuple[torch.Tensor, ...]:
        """vLLM's kernels read the layer's `(conv, ssm)` here: the pool's views."""
        return self.state_pool.layer(self.prefix)

    @kv_cache.setter
    def kv_cache(self, value: Any) -> None:
        """vLLM binds its own (proxy) views; the pool's stand (`StatePool.bind`)."""

    def get_attn_backend(self) -> type[GDNAttentionBackend]:
        return StateRowGDNBackend

    def get_kv_cache_spec(self, vllm_config: Any) -> KVCacheSpec | None:
        pool = self.state_pool
        speculative = vllm_config.speculative_config
        return StateRowSpec(
            shapes=((1,),),
            dtypes=(torch.int8,),
            block_size=BLOCK_TOKENS,
            mamba_type=self.mamba_type,
            mamba_cache_mode="none",
            # K more "blocks" (rows) per request with K speculative tokens, as vLLM's own spec
            # asks (`MambaBase.get_kv_cache_spec`): its kernel keeps a state per verified token.
            num_speculative_blocks=speculative.num_speculative_tokens if speculative else 0,
            layer_state_bytes=pool.layer_state_bytes,
            image_bytes=pool.image_bytes,
            in_pass_taps=pool.in_pass_taps,
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """The pool binds every layer at once (it needs the attention layers' pages)."""

    def _warmup_prefill_kernels(self, qkv_or_qkvz: torch.Tensor, v_dim: int) -> None:
        """Tune FLA's kernels on a prefill step's shape before vLLM's one-chunk warm-up."""
        if not self._prefill_kernels_warmed_up and self.gdn_prefill_backend == "triton":
            tune_prefill_kernels(self, qkv_or_qkvz, v_dim)
        super()._warmup_prefill_kernels(qkv_or_qkvz, v_dim)

    # vLLM's GDN custom ops (CUDA) call one of these to read and write the states: the first
    # pass after a host restore waits here for this layer's part of it (§6.5).
    def _forward_core(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        core_attn_out: torch.Tensor,
    ) -> Any:
        pool = self.state_pool
        pool.wait_restored(self.prefix)

        def run() -> Any:
            return super(HybridPrefixGDN, self)._forward_core(mixed_qkv, b, a, core_attn_out)

        captures = pool.in_pass
        if captures is None:  # most passes: nothing to save
            return run()
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if metadata is None or not metadata.num_prefills:
            return run()
        conv = self.kv_cache[0]
        conv = conv if is_conv_state_dim_first() else conv.transpose(-1, -2)
        window = self.conv_kernel_size - 1
        return capture_layer(captures, metadata, mixed_qkv, conv, window, self.kv_cache[1], run)

    # FlashInfer's prefill (vLLM 0.34) stores mid-chunk states in vLLM's checkpoint workspace,
    # which vLLM sizes and warms for layers that export checkpoints: these do while the pool
    # takes in-pass taps through it (`vllm_hpc.glue.worker.in_pass.flashinfer_prefill`).
    @property
    def _exports_checkpoints(self) -> bool:
        return self.state_pool.in_pass_taps and self.gdn_prefill_backend == "flashinfer"

    @property
    def _checkpoint_buffer_spec(self) -> tuple[tuple[int, ...], torch.dtype]:
        # At most one state per 64 tokens of a step (offsets are multiples of 64).
        rows = pages_for(self.vllm_config.scheduler_config.max_num_batched_tokens)
        heads = self.num_v_heads // self.tp_size
        return (rows, heads, self.head_v_dim, self.head_k_dim), torch.float32

    def _forward_flashinfer_prefill(self, *args: Any, **kwargs: Any) -> Any:
        forward = super()._forward_flashinfer_prefill
        if not flashinfer_captures_pending():
            return forward(*args, **kwargs)
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
        from vllm.model_executor.layers.mamba.ops.gather_initial_states import (
            gather_initial_states,
        )
        from vllm.v1.worker.workspace import current_workspace_manager

        q, k, v, g, beta, metadata = args
        assert metadata.flashinfer_checkpoint_plan is None, "vLLM's own checkpoints are off"
        initial_state = gather_initial_states(
            kwargs["ssm_state"], metadata.prefill_state_indices, metadata.prefill_has_initial_state
        )
        (workspace,) = current_workspace_manager().get_simultaneous(self._checkpoint_buffer_spec)

        def call(**checkpoints: Any) -> Any:
            return gdn.fi_chunk_gated_delta_rule(
                q=q,
                k=k,
                v=v,
                g=g,
                beta=beta,
                initial_state=initial_state,
                output_final_state=True,
                cu_seqlens=metadata.prefill_query_start_loc,
                use_qk_l2norm_in_kernel=False,
                output=kwargs["output"],
                **checkpoints,
            )

        return flashinfer_prefill(metadata, workspace, call)

    def _forward_core_fused_norm_packed(self, *args: Any, **kwargs: Any) -> Any:
        self.state_pool.wait_restored(self.prefix)
        return super()._forward_core_fused_norm_packed(*args, **kwargs)


@InstallOnce
def install_accepted_tokens_hook() -> None:
    """Let vLLM's V1 model runner count a step's accepted tokens for hybrid-prefix's classes.

    After each speculative step the runner records each request's accepted tokens, from which
    the next step's GDN kernels pick the state to resume from (`_update_states_after_model_
    execute`: the recurrent state of row ``accepted - 1``, the conv window ``accepted - 1``
    columns in). It does so only for models with `is_hybrid`, which these classes clear (module
    docstring); without it every step resumes as if one token had been accepted, from the state
    after the first verified token. The hook runs vLLM's own update for them, with the model
    config answering `is_hybrid` as vLLM's Qwen3.5 does; `mamba_cache_mode` stays "none", so
    it only counts (vLLM's "align" copies are not involved).
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states_after_model_execute

    def update(self: Any, output_token_ids: Any, scheduler_output: Any) -> None:
        config = self.model_config
        if not self.speculative_config or not isinstance(self.get_model(), StatePoolModel):
            return original(self, output_token_ids, scheduler_output)
        self.model_config = _HybridModelConfig(config)
        try:
            return original(self, output_token_ids, scheduler_output)
        finally:
            self.model_config = config

    GPUModelRunner._update_states_after_model_execute = update


class _HybridModelConfig:
    """A model config that reads as hybrid, as vLLM's Qwen3.5's (`install_accepted_tokens_hook`)."""

    is_hybrid = True

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _gdn_layers(model: torch.nn.Module) -> list[QwenGatedDeltaNetAttention]:
    return [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]


def build_state_pool(model: torch.nn.Module, vllm_config: Any) -> StatePool:
    """Adopt the GDN layers into one pool; its memory comes from the KV cache (`bind`)."""
    layers = _gdn_layers(model)
    device = next(model.parameters()).device
    pool = StatePool(device, is_conv_state_dim_first())
    why_not = _in_pass_unavailable(layers, device, vllm_config)
    pool.in_pass_taps = why_not is None
    for layer in layers:
        layer.__class__ = HybridPrefixGDN
        layer.state_pool = pool
        pool.add_layer(layer.prefix, layer.get_state_shape(), layer.get_state_dtype())
    logger.info(
        "hybrid-prefix states: %d GDN layers, %.2f MiB per state, kept in rows of KV pages; "
        "taps inside a pass: %s",
        len(layers),
        pool.image_bytes / 2**20,
        "yes" if why_not is None else f"no ({why_not}; taps split the prefill chunk)",
    )
    return pool


def _in_pass_unavailable(
    layers: list[QwenGatedDeltaNetAttention], device: torch.device, vllm_config: Any
) -> str | None:
    """Why taps cannot be saved inside a prefill pass here, or None when they can. They need
    CUDA and a GDN prefill kernel that hands over mid-chunk states (`in_pass`): FlashInfer's
    where this vLLM asks it for checkpoints, or FLA's (the "triton" backend), whose per-chunk
    states are in the activations' dtype, with a recurrent state cached in that dtype too (else
    a saved state would be coarser than a final one) and the kernel hook."""
    if device.type != "cuda" or torch.version.hip is not None:
        return f"{device.type} device: only CUDA's GDN prefill kernels expose mid-chunk states"
    backends = {layer.gdn_prefill_backend for layer in layers}
    if backends == {"flashinfer"} and flashinfer_gives_checkpoints():
        return None
    if backends != {"triton"}:
        return (
            f"GDN prefill backend {'/'.join(sorted(backends))}; additional_config "
            "gdn_prefill_backend=triton (or flashinfer on vLLM 0.34) allows them"
        )
    dtype = vllm_config.model_config.dtype
    cached = {layer.get_state_dtype()[1] for layer in layers}
    if cached != {dtype}:
        return f"recurrent state cached as {cached.pop()}, the kernel's chunk states are {dtype}"
    if not install_fla_hook():
        return "this vLLM's FLA kernel has no per-chunk states to take"
    return None


class StatePoolModel:
    """What both hybrid-prefix Qwen3.5 classes add to vLLM's: the state pool, and no hybrid
    flag (see the module docstring)."""

    is_hybrid = False

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        build_state_pool(self, vllm_config)
        if has_v1_model_runner():
            install_accepted_tokens_hook()

    def get_model_state_cls(self) -> type:
        """The V2 runner's model state: vLLM's own for hybrid models, as for vLLM's Qwen3.5.
        `is_hybrid = False` would otherwise give the default one, which hands the GDN metadata
        builder an unpadded `is_prefilling` in a FULL graph step whose request count is padded
        up to a captured size (three decodes run in the graph for four), and the builder fails.
        With `mamba_cache_mode` "none" the hybrid state adds no state caching of vLLM's."""
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

        return MambaHybridModelState


class HybridPrefixQwen3_5ForCausalLM(StatePoolModel, _qwen3_5.Qwen3_5ForCausalLM):
    pass


class HybridPrefixQwen3_5MoeForCausalLM(StatePoolModel, _qwen3_5.Qwen3_5MoeForCausalLM):
    pass


class HybridPrefixQwen3_5ForConditionalGeneration(
    StatePoolModel, _qwen3_5.Qwen3_5ForConditionalGeneration
):
    """The vision-language wrapper: its language model's GDN layers join the pool like the text
    class's (the wrapper builds vLLM's `Qwen3_5ForCausalLM` inside itself)."""


class HybridPrefixQwen3_5MoeForConditionalGeneration(
    StatePoolModel, _qwen3_5.Qwen3_5MoeForConditionalGeneration
):
    pass
