"""Opener and structural tap hints for vLLM requests, from the model's tokenizer (§7.1): the
glue half of `vllm_hpc.runtime.template_hints`.

The front end renders the chat template and tokenizes; the scheduler sees token ids only, so the
chat format's special tokens are read once from the tokenizer at start-up and each prompt is
scanned once, on its first lookup.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.tokenizers import cached_tokenizer_from_config

from vllm_hpc.index import TapHint
from vllm_hpc.runtime.template_hints import ChatMarkers

logger = logging.getLogger("vllm.vllm_hpc")


def chat_markers(model_config: Any) -> ChatMarkers | None:
    """The chat format's markers from the model's tokenizer, for opener and structural taps.

    The engine sees token ids only; without a tokenizer (``--skip-tokenizer-init``) or with a
    non-ChatML one there are no template hints (client breakpoints still apply).
    """
    if model_config.skip_tokenizer_init:
        logger.info("hybrid-prefix template taps: off (--skip-tokenizer-init)")
        return None
    try:
        markers = ChatMarkers.from_tokenizer(cached_tokenizer_from_config(model_config))
    except Exception:  # a tokenizer that fails here fails loudly in the front end already
        logger.warning("hybrid-prefix template taps: off (tokenizer failed)", exc_info=True)
        return None
    if markers is None:
        logger.info("hybrid-prefix template taps: off (the tokenizer has no <|im_start|>)")
    else:
        logger.info(
            "hybrid-prefix template taps: on (ChatML, <|im_start|> = %d)", markers.message_start
        )
    return markers


def prompt_hints(markers: ChatMarkers | None, request: Any) -> tuple[TapHint, ...]:
    """The generation opener and system-block end of a request's prompt; nothing on failure."""
    if markers is None or request.prompt_token_ids is None:
        return ()
    try:
        return markers.hints(request.prompt_token_ids)
    except Exception:  # a request must never stop the engine
        logger.warning("request %s: no template taps", request.request_id, exc_info=True)
        return ()
