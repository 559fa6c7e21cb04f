"""What one engine step must copy before its forward pass.

The scheduler side decides; the workers execute. Copies run in list order, before the step's
forward pass: a capture (an active state saved into a snapshot slot) planned before a restore
that reads the same slot is therefore seen by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Copy one state slot (every GDN layer, conv and recurrent state) into another."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy one attention KV page into another (a partial tail, copy-on-write)."""

    src: int
    dst: int


@dataclass(slots=True)
class StepPlan:
    """The copies of one step, in execution order."""

    state_copies: list[StateCopy] = field(default_factory=list)
    page_copies: list[PageCopy] = field(default_factory=list)
