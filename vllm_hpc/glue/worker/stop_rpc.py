"""The workers' part in an orderly stop (§5.5): what the engine core asks each worker, through
its executor's `collective_rpc`, while it writes the disk tier's queue behind
(`glue/scheduler/stop_flush.py`)."""

from __future__ import annotations

from typing import Any

from vllm_hpc.glue.stop_signals import end_stop_deferral
from vllm_hpc.glue.worker.connector_worker import worker_connector


def copy_failure(worker: Any) -> str | None:
    """The copy error this worker stopped on, if any: then nothing more is written to disk
    (what a failed copy left in the host slabs and the index is not known to agree)."""
    failed = worker_connector().failed
    return None if failed is None else str(failed)


def land_host_writes(worker: Any) -> None:
    """Block until this worker's write-through batches have landed, so the snapshots they
    carry can be written behind."""
    worker_connector().land_writes()


def stop_over(worker: Any) -> None:
    """The stop's writes are over (done, cut short or refused): stop signals act as vLLM set
    them again, so the SIGTERM that vLLM's executor sends a worker slow to exit stops it."""
    end_stop_deferral()
