"""Tune the GDN prefill kernels on a prefill step's shape before vLLM's one-chunk warm-up.

vLLM's `_warmup_prefill_kernels` runs FLA's chunked GDN kernels once on 64 tokens, so that
their Triton autotuners pick a configuration while device memory is still free. The pick is
keyed on head counts and dims only and then serves every step of the process. On one chunk most
configurations time within launch noise, so the pick is a draw, while on a saturated prefill
step, where the kernels' time matters, they differ well beyond that noise. Timing the candidates
on several prompts' worth of tokens first makes the pick the one that is fast there; vLLM's
warm-up then finds them tuned.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.third_party.flash_linear_attention.ops import fused_post_conv_prep

logger = logging.getLogger("vllm.vllm_hpc")

# Four 1,024-token prompts: long enough that every kernel's time is its work, not its launch
# (a saturated step holds sixteen). Their tensors come to about 0.5 GB on the 27B shape, by
# their sizes, beside the layer's projected 16,384-token input in vLLM's profile pass; that pass
# peaks higher in the MLP (about 1.7 GB), so the KV capacity vLLM derives from it does not
# change.
TUNE_PROMPTS = 4
TUNE_PROMPT_TOKENS = 1024

tuned_shapes: set[tuple[Any, ...]] = set()
"""The (heads, dims, dtype) this process tuned: every GDN layer of a model shares one."""


def tune_prefill_kernels(layer: Any, qkv_or_qkvz: torch.Tensor, v_dim: int) -> None:
    """Run `layer`'s FLA prefill once on `TUNE_PROMPTS` prompts, once per process and shape.

    Takes the arguments of vLLM's `_warmup_prefill_kernels`: the layer's projected input, whose
    last `v_dim` columns (z) are not part of the convolved q, k, v.
    """
    num_k_heads = layer.num_k_heads // layer.tp_size
    num_v_heads = layer.num_v_heads // layer.tp_size
    key = (num_k_heads, num_v_heads, layer.head_k_dim, layer.head_v_dim, qkv_or_qkvz.dtype)
    if key in tuned_shapes:
        return
    tuned_shapes.add(key)
    device, dtype = qkv_or_qkvz.device, qkv_or_qkvz.dtype
    tokens = TUNE_PROMPTS * TUNE_PROMPT_TOKENS
    q, k, v, g, beta = fused_post_conv_prep(
        conv_output=torch.randn(tokens, qkv_or_qkvz.shape[-1] - v_dim, device=device, dtype=dtype),
        a=torch.randn(tokens, num_v_heads, device=device, dtype=dtype),
        b=torch.randn(tokens, num_v_heads, device=device, dtype=dtype),
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        num_k_heads=num_k_heads,
        head_k_dim=layer.head_k_dim,
        head_v_dim=layer.head_v_dim,
        apply_l2norm=True,
        output_g_exp=False,
    )
    _, state_dtype = layer.get_state_dtype()
    states = torch.zeros(
        TUNE_PROMPTS,
        num_v_heads,
        layer.head_v_dim,
        layer.head_k_dim,
        device=device,
        dtype=state_dtype,
    )
    bounds = torch.arange(0, tokens + 1, TUNE_PROMPT_TOKENS, device=device, dtype=torch.int32)
    try:
        layer.chunk_gated_delta_rule(
            q=q.unsqueeze(0),
            k=k.unsqueeze(0),
            v=v.unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.unsqueeze(0),
            initial_state=states,
            output_final_state=True,
            cu_seqlens=bounds,
            chunk_indices=None,
            chunk_offsets=None,
            use_qk_l2norm_in_kernel=False,
            aiter_prefill_metadata=None,
        )
    except Exception:  # vLLM's own one-chunk warm-up runs next and tunes what is left
        logger.warning(
            "vllm_hpc: tuning the GDN prefill kernels on %d tokens failed for layer %s; "
            "vLLM's one-chunk warm-up tunes the rest",
            tokens,
            layer.prefix,
            exc_info=True,
        )
    else:
        logger.info(
            "vllm_hpc: GDN prefill kernels tuned on %d prompts of %d tokens",
            TUNE_PROMPTS,
            TUNE_PROMPT_TOKENS,
        )
    finally:
        del q, k, v, g, beta, states, bounds
        torch.accelerator.empty_cache()
