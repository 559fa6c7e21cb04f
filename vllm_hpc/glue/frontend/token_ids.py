"""Prompt token ids checked against the model's vocabulary, also without a tokenizer.

vLLM checks a prompt's token ids against its tokenizer only (`BaseRenderer.validate_token_ids`
returns at once when there is none): with `--skip-tokenizer-init` a prompt holding an id beyond
the vocabulary reaches the embedding kernel, whose out-of-bounds read kills the engine core, and
every later request fails until a restart. For models served by hybrid-prefix the check runs
against the model's vocabulary size there too, so such a prompt is the client's 400 error
naming the id, and the server keeps serving.

On CPU, a one-token prompt stops the engine as well, with vLLM's own caching too: vLLM's CPU
Gated DeltaNet convolution (`causal_conv1d_fwd_cpu`) refuses to prefill one token from an
empty state. For hybrid-prefix's classes it is refused the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hpc.glue import InstallOnce
from vllm_hpc.glue.architecture import ARCHITECTURES


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> str | None:
    """Why ``token_ids`` cannot be a prompt of a model with ``vocab_size`` tokens, or None."""
    if not token_ids:
        return None
    low, high = min(token_ids), max(token_ids)
    bad = low if low < 0 else high if high >= vocab_size else None
    if bad is None:
        return None
    return f"token id {bad} is out of the model's vocabulary (ids 0 to {vocab_size - 1})"


ONE_TOKEN_ON_CPU = (
    "a one-token prompt: vLLM's CPU Gated DeltaNet kernel cannot prefill a single token from an "
    "empty state (it stops the engine, also with vLLM's own caching); send at least two tokens"
)


@InstallOnce
def install_token_id_check() -> None:
    """Run the vocabulary check where vLLM skips it, for hybrid-prefix's model classes."""
    from vllm.exceptions import VLLMValidationError
    from vllm.platforms import current_platform
    from vllm.renderers.base import BaseRenderer

    ours = set(ARCHITECTURES.values())
    original = BaseRenderer.validate_token_ids

    def validate_token_ids(
        self: Any, token_ids: Sequence[int], *, parameter: str | None = None
    ) -> None:
        original(self, token_ids, parameter=parameter)
        if self.model_config.architecture not in ours:
            return
        reason = None
        if self.tokenizer is None:
            reason = check_token_ids(token_ids, self.model_config.get_vocab_size())
        if reason is None and len(token_ids) == 1 and current_platform.is_cpu():
            reason = ONE_TOKEN_ON_CPU
        if reason is not None:
            raise VLLMValidationError(reason, parameter=parameter or "prompt")

    BaseRenderer.validate_token_ids = validate_token_ids
