"""Test-only fault injection: named points in the cache's code that fail on purpose.

Off unless the environment variable `VLLM_HPC_FAULTS` names them (comma-separated, read once
when this module is imported), so production pays one set lookup where a point is reached.
Each point is documented where it fires; tests arm them in the processes they start.

- `host_alloc:N`: allocating (or pinning) host tier chunk N fails at start-up;
- `host_write`, `host_restore`: every write-through batch, or every restore and prefetch, fails
  in the worker before its copies are issued;
- `state_copy`: every copy between device state rows (a tap's or endpoint's capture, a resume
  from a snapshot slot) fails in the worker;
- `snapshot_corrupt`: every copy into a snapshot slot writes ones instead: silent corruption,
  for the cache audit to find (`--cache-audit-rate`);
- `host_slow`: every write-through batch is reported landed only `SLOW_COPY_STEPS` engine steps
  after it was issued, and on CUDA every host copy stream first sleeps `SLOW_COPY_CYCLES`, so a
  write, restore or prefetch is still in flight when a cancellation, an eviction or a reset
  lands;
- `host_issue_slow`: issuing every write-through batch first waits on the write issuer's thread
  (used on CPU too while armed) until `ISSUE_GATE` opens, at most `SLOW_ISSUE_SECONDS`, as when
  its copies fill the driver's launch queue behind a long forward pass (#48): the engine thread
  must go on stepping meanwhile. The gate starts closed; an in-process test opens it when the
  batches may land;
- `disk_write`, `disk_read`: every run of disk slabs a write or read batch moves fails with EIO
  in the disk store's thread (a write batch then reports an error, a read each record of it);
- `disk_bitflip`: every slab read from disk has a bit flipped before its CRC-32 is checked, so
  every record read reports a CRC mismatch;
- `disk_slow`: every run of disk slabs first sleeps `SLOW_DISK_SECONDS`, so batches stay in
  flight (the store's bound on batches, its drain on close, a second stop signal or a kill
  during the stop's writes).
"""

from __future__ import annotations

import os
import threading

FAULTS_ENV = "VLLM_HPC_FAULTS"
SLOW_COPY_STEPS = 8
SLOW_COPY_CYCLES = 100_000_000
"""GPU clock cycles `torch.cuda._sleep` spins: about 50 ms at 2 GHz."""
SLOW_ISSUE_SECONDS = 60.0
ISSUE_GATE = threading.Event()
SLOW_DISK_SECONDS = 0.05
_ARMED = frozenset(f for f in os.environ.get(FAULTS_ENV, "").split(",") if f)


class InjectedFault(RuntimeError):
    """A failure a test asked for (`VLLM_HPC_FAULTS`)."""


def armed(point: str) -> bool:
    """Whether the fault ``point`` (with its argument, e.g. ``host_alloc:1``) is armed."""
    return point in _ARMED
