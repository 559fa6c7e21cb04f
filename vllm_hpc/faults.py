"""Test-only fault injection: named points in the cache's code that fail on purpose.

Off unless the environment variable `VLLM_HPC_FAULTS` names them (comma-separated, read once
when this module is imported), so production pays one set lookup where a point is reached.
Each point is documented where it fires; tests arm them in the processes they start.

- `host_alloc:N`: allocating (or pinning) host tier chunk N fails at start-up;
- `host_write`, `host_restore`: every write-through batch, or every restore and prefetch, fails
  in the worker before its copies are issued;
- `state_copy`: every copy between device state slots (a tap's or endpoint's capture, a resume
  from a snapshot slot) fails in the worker;
- `snapshot_corrupt`: every copy into a snapshot slot writes ones instead: silent corruption,
  for the cache audit to find (`--cache-audit-rate`).
"""

from __future__ import annotations

import os

FAULTS_ENV = "VLLM_HPC_FAULTS"
_ARMED = frozenset(f for f in os.environ.get(FAULTS_ENV, "").split(",") if f)


class InjectedFault(RuntimeError):
    """A failure a test asked for (`VLLM_HPC_FAULTS`)."""


def armed(point: str) -> bool:
    """Whether the fault ``point`` (with its argument, e.g. ``host_alloc:1``) is armed."""
    return point in _ARMED
