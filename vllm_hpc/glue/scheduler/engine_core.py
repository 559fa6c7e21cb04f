"""Hooks on vLLM's `EngineCore`: with a disk tier (`--disk-cache-dir` or its alias
`--prefix-cache-file`), write its queue behind and sync its journal before the workers stop
(§5.5, `stop_flush.py`).

Only the engine core reaches the workers (its executor's `collective_rpc`), and it shuts the
executor down before the scheduler (`EngineCore.shutdown`: executor, then scheduler and its
KV connector), so neither the scheduler nor the connector could still run a step that lets the
workers write in their own `shutdown`. So the flush runs in a wrapper of `EngineCore.shutdown`,
which every orderly stop reaches in every executor (uniproc, multiprocess): `LLM` and
`AsyncLLM` shutdown or deletion (in process or not), and `vllm serve` on SIGTERM or SIGINT
(vLLM's engine-core process turns the signal into an orderly exit whose `finally` calls
`shutdown`). An engine core that died of an error (`_send_engine_dead`) or whose executor
failed writes nothing more. Its busy loop takes the first of SIGTERM, SIGINT and the front
end's `ORDERLY_STOP` as vLLM takes SIGTERM, until the flush begins (`glue/stop_signals.py`).

The journal is replayed when the scheduler is built (`DiskTier`); the entries it brings back
are published as KV events before the first request: in a wrapper of `EngineCore.__init__` for
an engine core in this process (`LLM` with VLLM_ENABLE_V1_MULTIPROCESSING=0), and of
`EngineCoreProc.run_busy_loop` in an engine-core process, which loads the plugin from inside
`EngineCore.__init__` (vLLM's `load_general_plugins`), too late to wrap that call. That wrapper
also tells the scheduler when the busy loop is asked to stop (vLLM's `shutdown_state`), so that
the start-up read, which keeps an idle engine core stepping, never holds a stop back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_hpc.derived import save_grace_seconds
from vllm_hpc.glue import InstallOnce
from vllm_hpc.glue.scheduler.disk_tier import DiskTier
from vllm_hpc.glue.scheduler.stop_flush import flush_at_stop
from vllm_hpc.glue.stop_signals import dump_stacks_on_request, stop_on_the_first_signal
from vllm_hpc.options import PluginOptions

logger = logging.getLogger("vllm.vllm_hpc")


@InstallOnce
def install_engine_core_hooks() -> None:
    """Wrap the methods once per process (vLLM calls `register` more than once)."""
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCore, EngineCoreProc

    original_init: Callable[..., None] = EngineCore.__init__
    original_shutdown: Callable[[Any], None] = EngineCore.shutdown
    original_dead: Callable[[Any], None] = EngineCoreProc._send_engine_dead

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _published_once(self)

    for cls in (EngineCoreProc, DPEngineCoreProc):  # each defines its own loop
        cls.run_busy_loop = _before_the_busy_loop(cls.run_busy_loop)

    def shutdown(self: Any) -> None:
        disk = _disk_tier(self)
        if disk is not None and not getattr(self, "_hpc_saved", False):
            self._hpc_saved = True
            try:
                _finish_requests(self)
                flush_at_stop(
                    disk,
                    partial(_rpc, self),
                    partial(_idle_step, self),
                    _failure(self),
                    _grace_seconds(self),
                )
            except Exception:  # the stop goes on: the journal keeps what it held
                logger.exception("prefix cache: the stop's writes failed; the journal stays")
        original_shutdown(self)

    def _send_engine_dead(self: Any) -> None:
        self._hpc_engine_dead = True
        original_dead(self)

    EngineCore.__init__ = __init__
    EngineCore.shutdown = shutdown
    EngineCoreProc._send_engine_dead = _send_engine_dead


def _before_the_busy_loop(run_busy_loop: Callable[[Any], None]) -> Callable[[Any], None]:
    def wrapper(self: Any) -> None:
        _published_once(self)
        if _disk_tier(self) is not None:
            stop_on_the_first_signal(lambda: getattr(self, "_hpc_saved", False))
            dump_stacks_on_request()
            self.scheduler.stop_requested = partial(_stop_requested, self)
        run_busy_loop(self)

    return wrapper


def _stop_requested(core: Any) -> bool:
    """Whether vLLM's busy loop was asked to stop (a stop signal, the front end's stop): it
    then runs only until no work is left, and the start-up read is no longer work
    (`HybridPrefixScheduler.has_requests`)."""
    state = getattr(core, "shutdown_state", None)
    return state is not None and state.name != "RUNNING"


def _published_once(core: Any) -> None:
    """Publish the KV events of what the journal brought back, before the first request."""
    if _disk_tier(core) is not None and not getattr(core, "_hpc_published", False):
        core._hpc_published = True
        core.scheduler.publish_kv_events()


def _disk_tier(core: Any) -> DiskTier | None:
    """The engine's disk tier: only vllm_hpc's KV cache manager has one."""
    manager = getattr(getattr(core, "scheduler", None), "kv_cache_manager", None)
    disk = getattr(manager, "disk_tier", None)
    return disk if isinstance(disk, DiskTier) else None


def _grace_seconds(core: Any) -> float:
    options = PluginOptions.from_additional_config(core.vllm_config.additional_config)
    return save_grace_seconds(options.host_tier_mib)


def _rpc(core: Any, function: Callable[..., Any], *args: Any) -> list[Any]:
    return list(core.model_executor.collective_rpc(function, args=args))


def _failure(core: Any) -> str | None:
    if getattr(core, "_hpc_engine_dead", False):
        return "the engine core stopped on an error"
    if getattr(core.model_executor, "is_failed", False):
        return "a worker failed"
    return None


def _finish_requests(core: Any) -> None:
    """Abort what still runs (vLLM already did, unless the engine is shut down directly), so
    its committed blocks and endpoint are written through and then behind."""
    from vllm.v1.request import RequestStatus

    if core.scheduler.get_num_unfinished_requests():
        core.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)


def _idle_step(core: Any) -> None:
    """One engine step with no tokens, as vLLM runs after requests finish: the workers run the
    copies the cache planned, and report the host and disk writes that landed."""
    output = core.scheduler.schedule()
    result = core.model_executor.execute_model(output)
    if result is None:
        result = core.model_executor.sample_tokens(None)
    core.scheduler.update_from_output(output, result)
