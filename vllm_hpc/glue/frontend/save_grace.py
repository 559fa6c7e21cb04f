"""Time for the engine core to write the disk tier's queue behind before vLLM kills it (§5.5).

On a stop, the front end's process manager (`CoreEngineProcManager.shutdown`) sends the
engine-core process SIGTERM and kills it after the shutdown timeout: none at all for
`vllm serve` with its default `--shutdown-timeout 0`, 5 s for an `LLM`. Writing a large host
tier's queue takes longer. With a disk tier (`--disk-cache-dir`, `--prefix-cache-file`) the
manager first sends `ORDERLY_STOP` instead of SIGTERM (an engine core already writing, because
the user's signal reached it too, ignores it: `glue/stop_signals.py`) and waits up to the
stop's grace (`derived.save_grace_seconds`); an engine core that stops sooner ends the wait
sooner. One still running at the grace's end is asked for its threads' stacks (written to the
log: where it was stuck), then gets vLLM's SIGTERM, which ends its writes, and is killed: what
the journal held stays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm_hpc.derived import disk_tier_spec, save_grace_seconds
from vllm_hpc.glue import InstallOnce
from vllm_hpc.glue.stop_signals import send_orderly_stop, send_stack_dump
from vllm_hpc.options import PluginOptions

logger = logging.getLogger("vllm.vllm_hpc")

STACK_DUMP_SECONDS = 1.0
"""How long the stacks of an engine core killed at the grace's end get to be written."""


@InstallOnce
def install_save_grace() -> None:
    """Wrap the process manager's `__init__` (to read the options) and `shutdown`, once."""
    from vllm.v1.engine.utils import CoreEngineProcManager

    original_init: Callable[..., None] = CoreEngineProcManager.__init__
    original_shutdown: Callable[..., None] = CoreEngineProcManager.shutdown

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config")  # vLLM 0.32 passes it by name everywhere
        options = PluginOptions.from_additional_config(
            getattr(vllm_config, "additional_config", None)
        )
        self._hpc_save_grace = (
            save_grace_seconds(options.host_tier_mib) if disk_tier_spec(options) else None
        )
        original_init(self, *args, **kwargs)

    def shutdown(self: Any, timeout: float | None = None) -> None:
        grace = getattr(self, "_hpc_save_grace", None)
        running = [p for p in self.processes if p.is_alive()]
        if grace is not None and running:
            wait = max(grace, timeout or 0.0)
            logger.info(
                "prefix cache: the engine core gets up to %.0f s to write the disk tier before "
                "it is killed",
                wait,
            )
            self.manager_stopped.set()  # an engine core that exits now is not a failure
            deadline = time.monotonic() + wait
            for process in running:
                send_orderly_stop(process.pid)
            # Polled, not joined: two of vLLM's threads run this at a stop, and a join of the
            # engine core was seen to return 12 s into its 30 s with the process still alive.
            while any(p.is_alive() for p in running) and time.monotonic() < deadline:
                time.sleep(0.1)
            stuck = [p for p in running if p.is_alive()]
            if stuck:
                logger.warning(
                    "prefix cache: %s still running after %.0f s, killed with what it had not "
                    "written; its threads' stacks follow",
                    ", ".join(p.name for p in stuck),
                    wait,
                )
                for process in stuck:
                    send_stack_dump(process.pid)
                time.sleep(STACK_DUMP_SECONDS)
        original_shutdown(self, timeout)

    CoreEngineProcManager.__init__ = __init__
    CoreEngineProcManager.shutdown = shutdown
