"""The cache audit (`--cache-audit-rate`) on the real engine: every resumed prompt (rate 1) is
recomputed from the root behind the queue and compared with the same prompt served from the
cache. With nothing wrong, every comparison agrees; with snapshot slots silently corrupted
(`snapshot_corrupt`, `vllm_hpc.faults`), the audit counts and logs the parting. The audit's own
runs never reach the caller."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from engine_support import (
    cache_of,
    greedy,
    greedy_params,
    random_prompt,
    running_llm,
    settle_and_audit,
    tokens,
)

from vllm_hpc import faults
from vllm_hpc.exactness import NEAR_TIE, top1_margins

pytestmark = pytest.mark.engine

AUDITED = {
    "kv_cache_manager": "hybrid-prefix",
    "host_cache_mib": 0,
    "cache_audit_rate": 1.0,
    "cache_audit_tokens": 8,
}


@pytest.fixture(scope="module")
def audited(tiny_model_dir: Any) -> Iterator[Any]:
    with running_llm(in_process=True, additional_config=AUDITED, max_model_len=4096) as llm:
        yield llm


def _audited_after(llm: Any, checked: int) -> Any:
    """Run short requests until the audit has compared ``checked`` prompts in all."""
    audits = cache_of(llm).audits
    for seed in range(500, 520):
        if audits.audit_checked >= checked:
            break
        greedy(llm, [random_prompt(seed=seed, length=70)], 2)
    assert audits.audit_checked >= checked, audits
    return audits


def test_the_audit_finds_nothing_wrong_with_a_sound_cache(audited: Any) -> None:
    prompt = random_prompt(seed=1, length=1000)
    greedy(audited, [prompt], 8)
    again = greedy(audited, [prompt], 8)  # runs beside the audit's runs
    assert len(again) == 1 and again[0].num_cached_tokens == 960  # only the caller's output
    audits = _audited_after(audited, 1)
    assert audits.audit_diverged_device == audits.audit_diverged_host == 0
    settle_and_audit(audited)


FIRST_PROMPT = 200
FIRST_ANSWER = 80
"""The first turn: its prompt-tail tap lies at floor64(199) = 192, and its answer ends 87
tokens past it, so its endpoint is kept (64+ past the newest snapshot, §7.7)."""


def _turns_without_near_ties(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A first turn run with `snapshot_corrupt` armed (its snapshots are captured as ones),
    and the next turn, whose cold answer has no near-tie in the tokens the audit compares: a
    parting at a near-tie is no finding (`vllm_hpc.exactness`), and where one falls depends on
    the tiny model's random weights. The next turn's prompt. The first turn's prompt is short:
    only the next turn's last three tokens run on the corrupted endpoint, and a longer prompt
    would only lengthen the prefills of every try (several are tried before one passes)."""
    for seed in range(2, 40, 2):
        monkeypatch.setattr(faults, "_ARMED", frozenset({"snapshot_corrupt"}))
        prompt = random_prompt(seed=seed, length=FIRST_PROMPT)
        first = greedy(llm, [prompt], FIRST_ANSWER)[0]
        monkeypatch.setattr(faults, "_ARMED", frozenset())
        turn = prompt + tokens(first) + random_prompt(seed=seed + 1, length=2)
        cold = llm.generate(
            [{"prompt_token_ids": turn, "cache_salt": f"margins-{seed}"}],
            greedy_params(AUDITED["cache_audit_tokens"], logprobs=2),
            use_tqdm=False,
        )[0].outputs[0]
        if min(top1_margins(cold.logprobs)) >= NEAR_TIE:
            return turn
    raise AssertionError("every next turn tried has a near-tie in its first tokens")


def test_the_audit_catches_a_corrupted_snapshot(
    audited: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next turn resumes from the first turn's endpoint with three tokens to compute, so
    the corrupted state decides its answer (the tiny model forgets a wrong state within tens of
    tokens: a resume from a tap 40 tokens back answers as the root run does)."""
    audits = cache_of(audited).audits
    turn = _turns_without_near_ties(audited, monkeypatch)
    checked, diverged = audits.audit_checked, audits.audit_diverged_device
    monkeypatch.setattr(faults, "_ARMED", frozenset({"snapshot_corrupt"}))
    assert greedy(audited, [turn], 8)[0].num_cached_tokens == len(turn) - 3
    _audited_after(audited, checked + 1)
    assert audits.audit_diverged_device > diverged
    monkeypatch.setattr(faults, "_ARMED", frozenset())
    settle_and_audit(audited)
