"""The most tokens one request's prefill chunk gets in a step, from vLLM's own scheduler config
(`glue/scheduler/kv_manager.prefill_chunk_tokens`): a chunk that cannot reach a block boundary
waits for the next step only when this is at least a block, so it must not overstate it."""

from __future__ import annotations

from vllm.config import SchedulerConfig

from vllm_hpc.glue.scheduler.kv_manager import prefill_chunk_tokens


def config(**overrides: int) -> SchedulerConfig:
    fields = {"max_num_batched_tokens": 8192, "max_num_seqs": 64, "max_model_len": 32768}
    return SchedulerConfig(is_encoder_decoder=False, **(fields | overrides))


def test_the_step_budget() -> None:
    assert prefill_chunk_tokens(config()) == 8192


def test_a_smaller_scheduled_token_cap() -> None:
    assert prefill_chunk_tokens(config(max_num_scheduled_tokens=4096)) == 4096


def test_the_long_prefill_threshold() -> None:
    assert prefill_chunk_tokens(config(long_prefill_token_threshold=48)) == 48
