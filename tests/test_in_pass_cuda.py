"""In-pass taps on the real engine (CUDA only: vLLM's FLA prefill kernel is what provides them).

A snapshot saved inside a prefill pass must hold the state a pass ending there would have left
(up to the rounding a different batch shape gives), must be the state at its own position (not a
neighbouring 64-token chunk's), and a request resumed from it must decode what a cold run does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_support import (
    BF16_STATE,
    HYBRID,
    assert_same_up_to_near_tie,
    cache_of,
    cold_reference,
    greedy,
    greedy_params,
    random_prompt,
    running_llm,
)

from vllm_hpc.index import SnapshotKind

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHUNK = 4096
"""Prefill chunk: dense flexible taps then fall every 2048 tokens, inside chunks too."""
TAP = 640
"""A client breakpoint on a block boundary, inside a prefill chunk."""


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> Iterator[Any]:
    with running_llm(
        in_process=True, additional_config=HYBRID, max_num_batched_tokens=CHUNK, **BF16_STATE
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Any) -> Iterator[Any]:
    """The module's own reference: its prompts need the tiny model's full 8192-token context."""
    with cold_reference(**BF16_STATE) as engine:
        yield engine


def _slot_state(worker: Any, slot: int) -> list[torch.Tensor]:
    """Runs in the worker: every GDN layer's conv and recurrent state in pool slot ``slot``."""
    from vllm_hpc.glue.worker.model import HybridPrefixGDN

    layers = worker.vllm_config.compilation_config.static_forward_context.values()
    pool = next(layer for layer in layers if isinstance(layer, HybridPrefixGDN)).state_pool
    return [t[slot].float().cpu() for name in pool.layer_names for t in pool.layer(name)]


def snapshot_state(llm: Any, frontier: int, kind: SnapshotKind) -> list[torch.Tensor]:
    """The state of the snapshot at ``frontier``, once its copies ran: an endpoint's copy is in
    the plan of the engine's next step, so one more short request runs first."""
    greedy(llm, [random_prompt(70, 8)], max_tokens=1)
    cache = cache_of(llm)
    found = [s for s in cache.index.store.snapshots if s.frontier == frontier and s.kind is kind]
    assert len(found) == 1 and found[0].slot is not None, f"no {kind} snapshot at {frontier}"
    slot = cache.index.slot_row(found[0].slot)
    return llm.collective_rpc(_slot_state, args=(slot,))[0]


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest relative difference over the layers' state tensors."""
    return max(float((x - y).norm() / y.norm().clamp_min(1e-6)) for x, y in zip(a, b, strict=True))


def test_the_engine_plans_in_pass_taps(llm: Any) -> None:
    assert cache_of(llm).config.in_pass_taps


def test_an_in_pass_state_is_the_state_at_its_position(llm: Any) -> None:
    prompt = random_prompt(71, 1000)
    finals = {}
    for end in (TAP - 64, TAP, TAP + 64):
        # A prompt that ends at ``end`` leaves its final state as an endpoint snapshot.
        llm.reset_prefix_cache()
        greedy(llm, [prompt[:end]], max_tokens=1)
        finals[end] = snapshot_state(llm, end, SnapshotKind.ENDPOINT)
    llm.reset_prefix_cache()
    greedy(llm, [prompt], max_tokens=1, breakpoints=[TAP])
    captured = snapshot_state(llm, TAP, SnapshotKind.BOUNDARY)
    here = distance(captured, finals[TAP])
    print(f"in-pass state at {TAP}: {here:.5f} from the final state there", end="")
    assert here < 0.05, f"in-pass state is {here:.4f} away from the final state at {TAP}"
    for end in (TAP - 64, TAP + 64):
        away = distance(captured, finals[end])
        print(f", {away:.5f} from the one at {end}", end="")
        assert away > 5 * max(here, 1e-3), f"closer to the state at {end}"


def test_resume_from_an_in_pass_tap_beside_a_decode(llm: Any, cold: Any) -> None:
    """The long prompt's tap is saved in its second chunk, a pass that also decodes the short
    request, so its row sits behind a decode token; a branch from it resumes there exactly."""
    llm.reset_prefix_cache()
    short, long = random_prompt(72, 64), random_prompt(73, 6000)
    tap = 4480  # the long prompt's second chunk is [4032, 6000)
    params = [greedy_params(64), greedy_params(1, breakpoints=[tap])]
    llm.generate([{"prompt_token_ids": p} for p in (short, long)], params, use_tqdm=False)
    branch = long[:tap] + random_prompt(74, 200)
    out = greedy(llm, [branch], max_tokens=24)[0]
    assert out.num_cached_tokens == tap
    assert_same_up_to_near_tie(out, cold, branch, 24)


def test_dense_in_pass_taps_serve_deep_edits(llm: Any, cold: Any) -> None:
    """Without breakpoints: a long prompt leaves flexible taps inside its chunks, and edits at
    several depths each resume from the nearest one below, as a cold run decodes."""
    llm.reset_prefix_cache()
    history = random_prompt(75, 7000)  # taps at 2048, 2880 (ladder), 4096, 6144 and 6976
    greedy(llm, [history], max_tokens=1)
    for seed, cut in enumerate((2500, 3500, 5000, 6500)):
        edit = history[:cut] + random_prompt(80 + seed, 100)
        out = greedy(llm, [edit], max_tokens=16)[0]
        assert cut - 1024 < out.num_cached_tokens <= cut, (cut, out.num_cached_tokens)
        assert_same_up_to_near_tie(out, cold, edit, 16)
    cache_of(llm).audit()


def test_a_chunk_short_of_a_block_waits_for_the_next_step(
    llm: Any, cold: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts arrive together and the first leaves 36 tokens of the step's budget: the
    second does not take them (its next chunk would start off the 64-token grid, where no tap
    is saved in the pass) but waits for the next step; both decode as cold runs do."""
    llm.reset_prefix_cache()
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    limits: list[tuple[int, int, int]] = []
    chunk_limit = manager.chunk_limit

    def recorded(request: Any, start: int, num_new_tokens: int) -> int:
        size = chunk_limit(request, start, num_new_tokens)
        limits.append((start, num_new_tokens, size))
        return size

    monkeypatch.setattr(manager, "chunk_limit", recorded)
    prompts = [random_prompt(76, CHUNK - 36), random_prompt(77, 3000)]
    params = [greedy_params(8), greedy_params(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert (0, 36, 0) in limits
    assert not [s for s in limits if s[0] == 0 and 0 < s[2] < 64], limits
    for out, prompt in zip(outs, prompts, strict=True):
        assert_same_up_to_near_tie(out, cold, prompt, 8)
    cache_of(llm).audit()
