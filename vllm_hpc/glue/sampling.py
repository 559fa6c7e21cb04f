"""Per-request cache hints in `SamplingParams.extra_args`, validated where vLLM validates
requests, so a bad hint is the client's 400 error and never reaches the engine.

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


@InstallOnce
def install_sampling_params_hook() -> None:
    """Check the hints when vLLM checks a request's sampling parameters."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._verify_args

    def verify_args(self: Any) -> None:
        original(self)
        try:
            parse_breakpoints(self.extra_args)
        except ValueError as error:
            raise VLLMValidationError(str(error), parameter=BREAKPOINTS_KEY) from None

    SamplingParams._verify_args = verify_args
