"""Per-request cache hints in `SamplingParams.extra_args`, validated where vLLM validates
requests, so a bad hint is the client's 400 error and never reaches the engine: their form with
the sampling parameters, their range once the prompt's length is known.

    SamplingParams(..., extra_args={"cache_breakpoints": [1024, 2048]})
    # OpenAI API: {"vllm_xargs": {"cache_breakpoints": [1024, 2048]}}

`cache_breakpoints` are token positions where the client wants the cache to keep a snapshot
(like Anthropic's `cache_control` or OpenAI prompt-cache breakpoints): exact Boundary taps
(§7.1), shared by every conversation that continues from them.
"""

from __future__ import annotations

from typing import Any

from vllm_hpc.glue import InstallOnce

BREAKPOINTS_KEY = "cache_breakpoints"
MAX_BREAKPOINTS = 64


def parse_breakpoints(extra_args: Any) -> tuple[int, ...]:
    """The breakpoints of a request; ValueError (naming the key) when they are malformed."""
    if not extra_args or BREAKPOINTS_KEY not in extra_args:
        return ()
    value = extra_args[BREAKPOINTS_KEY]
    if not isinstance(value, list | tuple) or len(value) > MAX_BREAKPOINTS:
        raise ValueError(
            f"{BREAKPOINTS_KEY} must be a list of at most {MAX_BREAKPOINTS} token positions"
        )
    if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in value):
        raise ValueError(f"{BREAKPOINTS_KEY} must hold positive integer token positions")
    return tuple(sorted(set(value)))


def breakpoints_beyond(breakpoints: tuple[int, ...], prompt_len: int) -> str | None:
    """Why ``breakpoints`` cannot mark a prompt of ``prompt_len`` tokens, or None."""
    if not breakpoints or breakpoints[-1] <= prompt_len:
        return None
    return (
        f"{BREAKPOINTS_KEY} position {breakpoints[-1]} is beyond the prompt's {prompt_len} tokens"
    )


@InstallOnce
def install_sampling_params_hook() -> None:
    """Check the hints' form when vLLM checks a request's sampling parameters, and their range
    when it has made the request of a prompt."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.utils import length_from_prompt_token_ids_or_embeds
    from vllm.v1.engine.input_processor import InputProcessor

    original_verify = SamplingParams._verify_args
    original_process = InputProcessor.process_inputs

    def verify_args(self: Any) -> None:
        original_verify(self)
        try:
            parse_breakpoints(self.extra_args)
        except ValueError as error:
            raise VLLMValidationError(str(error), parameter=BREAKPOINTS_KEY) from None

    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = original_process(self, *args, **kwargs)
        if request.sampling_params is not None:
            reason = breakpoints_beyond(
                parse_breakpoints(request.sampling_params.extra_args),
                length_from_prompt_token_ids_or_embeds(
                    request.prompt_token_ids, request.prompt_embeds
                ),
            )
            if reason is not None:
                raise VLLMValidationError(reason, parameter=BREAKPOINTS_KEY)
        return request

    SamplingParams._verify_args = verify_args
    InputProcessor.process_inputs = process_inputs
