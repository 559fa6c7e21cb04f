"""The near-tie rule: where an answer served from the cache may part from a cold run's.

A request resumed from the cache must produce the greedy tokens of the same prompt run cold
(alone, no cache). Two computations of one prefix that differ only in how the work was cut
(a batch of other shapes, a state computed while decoding rather than by a prefill) can round
a bf16 logit the other way, so a parting is accepted where the cold run's top-1 margin is below
`NEAR_TIE`, and only there. The tests, the benchmarks and the demo all judge by this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NEAR_TIE = 0.5
"""Nats: below this top-1 margin two logits are a few bf16 ulps apart (the tiny model's logits
are ~16-32, where one ulp is 0.125-0.25), and batching alone can flip the greedy choice."""


@dataclass(frozen=True)
class Parting:
    """The first position where an answer differs from the cold run's."""

    position: int
    cold_margin: float
    """The cold run's logprob gap between its top two tokens there."""

    @property
    def near_tie(self) -> bool:
        return self.cold_margin < NEAR_TIE

    def describe(self) -> str:
        verdict = "a near-tie" if self.near_tie else "NOT a near-tie"
        return f"differs at token {self.position} (cold margin {self.cold_margin:.3f}: {verdict})"


def top1_margins(logprobs: Sequence[Mapping[Any, Any]]) -> list[float]:
    """Per generated token, the gap between the two best logprobs (vLLM's `logprobs=2`)."""
    margins = []
    for step in logprobs:
        best = sorted((entry.logprob for entry in step.values()), reverse=True)
        margins.append(best[0] - best[1])
    return margins


def first_parting(
    tokens: Sequence[int], cold_tokens: Sequence[int], cold_margins: Sequence[float]
) -> Parting | None:
    """Where ``tokens`` first differ from the cold run's, or None when they are the same."""
    for position, (got, want) in enumerate(zip(tokens, cold_tokens, strict=True)):
        if got != want:
            return Parting(position, cold_margins[position])
    return None
