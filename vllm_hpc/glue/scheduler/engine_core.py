"""Hooks on vLLM's `EngineCore`: load the prefix cache file once the engine is built, save it
before the workers stop (§5.5).

Only the engine core reaches the workers (its executor's `collective_rpc`), and it shuts the
executor down before the scheduler (`EngineCore.shutdown`: executor, then scheduler and its
KV connector), so neither the scheduler nor the connector could still ask a worker for its
slab bytes in their own `shutdown`. So the file is saved in a wrapper of `EngineCore.shutdown`,
which every orderly stop reaches in every executor (uniproc, multiprocess): `LLM` and
`AsyncLLM` shutdown or deletion (in process or not), and `vllm serve` on SIGTERM or SIGINT
(vLLM's engine-core process turns the signal into an orderly exit whose `finally` calls
`shutdown`). An engine core that died of an error (`_send_engine_dead`) or whose executor
failed saves nothing. Its busy loop takes the front end's `ORDERLY_STOP` as it takes SIGTERM,
until the save begins (`glue/stop_signals.py`).

The file is loaded once the engine core is built and before it takes a request. An engine core
in this process (`LLM` with VLLM_ENABLE_V1_MULTIPROCESSING=0) is built after the plugin loaded:
a wrapper of `EngineCore.__init__` loads it. A fresh engine-core process loads the plugin from
inside `EngineCore.__init__` (vLLM's `load_general_plugins`), too late to wrap that call: there
the wrapper of `EngineCoreProc.run_busy_loop` loads it, before the loop reads its first request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_hpc.glue import InstallOnce
from vllm_hpc.glue.scheduler.save_load import PrefixCacheFile
from vllm_hpc.glue.stop_signals import accept_orderly_stop

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
        _restore_once(self)

    for cls in (EngineCoreProc, DPEngineCoreProc):  # each defines its own loop
        cls.run_busy_loop = _before_the_busy_loop(cls.run_busy_loop)

    def shutdown(self: Any) -> None:
        cache_file = _cache_file(self)
        if cache_file is not None and not getattr(self, "_hpc_saved", False):
            self._hpc_saved = True
            try:
                _finish_requests(self)
                cache_file.save(partial(_rpc, self), partial(_idle_step, self), _failure(self))
            except Exception:  # the stop goes on: the previous file stays
                logger.exception("prefix cache not saved: the previous file stays")
        original_shutdown(self)

    def _send_engine_dead(self: Any) -> None:
        self._hpc_engine_dead = True
        original_dead(self)

    EngineCore.__init__ = __init__
    EngineCore.shutdown = shutdown
    EngineCoreProc._send_engine_dead = _send_engine_dead


def _before_the_busy_loop(run_busy_loop: Callable[[Any], None]) -> Callable[[Any], None]:
    def wrapper(self: Any) -> None:
        _restore_once(self)
        if _cache_file(self) is not None:
            accept_orderly_stop(lambda: getattr(self, "_hpc_saved", False))
        run_busy_loop(self)

    return wrapper


def _restore_once(core: Any) -> None:
    cache_file = _cache_file(core)
    if cache_file is not None and not getattr(core, "_hpc_restored", False):
        core._hpc_restored = True
        cache_file.restore(partial(_rpc, core))
        core.scheduler.publish_kv_events()  # the restored blocks, before the first request


def _cache_file(core: Any) -> PrefixCacheFile | None:
    """The engine's prefix cache file: only vllm_hpc's scheduler has one."""
    cache_file = getattr(getattr(core, "scheduler", None), "prefix_cache_file", None)
    return cache_file if isinstance(cache_file, PrefixCacheFile) else None


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
    its committed blocks and endpoint are written through before the save."""
    from vllm.v1.request import RequestStatus

    if core.scheduler.get_num_unfinished_requests():
        core.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)


def _idle_step(core: Any) -> None:
    """One engine step with no tokens, as vLLM runs after requests finish: the workers run the
    copies the cache planned, and report the host writes that landed."""
    output = core.scheduler.schedule()
    result = core.model_executor.execute_model(output)
    if result is None:
        result = core.model_executor.sample_tokens(None)
    core.scheduler.update_from_output(output, result)
