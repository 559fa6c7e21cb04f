"""Time for the engine core to save `--prefix-cache-file` before vLLM kills it (§5.5).

On a stop, the front end's process manager (`CoreEngineProcManager.shutdown`) sends the
engine-core process SIGTERM and kills it after the shutdown timeout: none at all for
`vllm serve` with its default `--shutdown-timeout 0`, 5 s for an `LLM`. A save of a large host
tier takes longer. With a prefix cache file the wait is stretched to the save's grace
(`derived.save_grace_seconds`); an engine core that stops sooner ends the wait sooner. A save
still running at the grace's end is killed, and the previous file stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_hpc.derived import save_grace_seconds
from vllm_hpc.glue import InstallOnce
from vllm_hpc.options import PluginOptions

logger = logging.getLogger("vllm.vllm_hpc")


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
            save_grace_seconds(options.host_tier_mib) if options.prefix_cache_file else None
        )
        original_init(self, *args, **kwargs)

    def shutdown(self: Any, timeout: float | None = None) -> None:
        grace = getattr(self, "_hpc_save_grace", None)
        if grace is not None and (timeout is None or timeout < grace):
            logger.info(
                "prefix cache file: the engine core gets up to %.0f s to save before it is killed",
                grace,
            )
            timeout = grace
        original_shutdown(self, timeout)

    CoreEngineProcManager.__init__ = __init__
    CoreEngineProcManager.shutdown = shutdown
