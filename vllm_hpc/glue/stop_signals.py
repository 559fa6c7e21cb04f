"""Stop signals and the disk tier's stop (§5.5): one stop writes the queue behind and syncs the
journal, a second cuts it short.

A stop reaches a server's processes in several ways: SIGTERM or SIGINT to the API server alone
(`kill PID`, `docker stop`, Kubernetes), to the whole process group (Ctrl-C in a terminal,
`systemctl stop` with its default `KillMode=control-group`), to the engine core alone, or to
every process at once. Whichever it is, the disk tier is flushed once, and only a second signal
from the user means "stop now" (the writes stop; what the journal holds stays). Three rules
make that so:

- The front end stops its engine cores with `ORDERLY_STOP`, not SIGTERM
  (`glue/frontend/save_grace.py`), and an engine core acts on the first of SIGTERM, SIGINT and
  `ORDERLY_STOP` only (`stop_on_the_first_signal`): so a front end that received the same
  group signal is not a second signal. vLLM's handler is not reentrant, and the group's SIGINT
  and the front end's `ORDERLY_STOP` arrive within milliseconds: a second signal whose
  handler ran inside the first's `threading.Event.set` (its wakeup of the busy loop) waited
  for the lock that very thread held, and the engine core never stopped (seen once in CI:
  killed unsaved after the 30 s grace).
- A worker process defers its first SIGTERM or SIGINT (`defer_first_stop_signal`): the engine
  core flushes through it and then stops it (vLLM's executor closes its death pipe), so a group
  signal no longer kills the worker before it has written its slabs.
- While the flush runs, the engine core takes SIGTERM and SIGINT as the second signal
  (`stop_signals_caught`). vLLM puts the default handlers back before the engine core shuts
  down, so without them a second signal would kill the process in the middle of a journal
  write (harmless: a torn entry fails its CRC; but the log would say nothing).

An engine core still running when its grace ends is killed, with what it had not written. The
front end first sends it and its workers `STACK_DUMP` (`dump_stacks_on_request`): the log says
where each of their threads was, even one blocked outside Python, where no handler of Python
runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("vllm.vllm_hpc")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
ORDERLY_STOP = signal.SIGUSR2
"""What the front end sends an engine core to stop it, where vLLM sends SIGTERM."""
STACK_DUMP = signal.SIGUSR1
"""What the front end sends an engine core, and its workers, that outlived the stop's grace."""


def in_main_thread() -> bool:
    """Only the main thread may set signal handlers (and only it runs them)."""
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stop_signals_caught(on_signal: Callable[[int], None]) -> Iterator[threading.Event]:
    """An event set, and ``on_signal(signum)`` called, by each SIGTERM or SIGINT that arrives
    while the block runs; the previous handlers come back after it. Only the main thread
    takes signals: elsewhere the event is never set."""
    caught = threading.Event()
    if not in_main_thread():
        yield caught
        return

    def handler(signum: int, frame: Any) -> None:
        caught.set()
        on_signal(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_on_the_first_signal(stopping: Callable[[], bool]) -> None:
    """In an engine-core process, once vLLM's SIGTERM handler is in place: the first SIGTERM,
    SIGINT or `ORDERLY_STOP` stops the engine as that handler does, unless ``stopping()`` (the
    flush has begun, with handlers of its own); later ones, nested in it or not, do nothing."""
    stop = signal.getsignal(signal.SIGTERM)
    if not in_main_thread() or not callable(stop):
        return
    taken = False

    def handler(signum: int, frame: Any) -> None:
        nonlocal taken
        if taken or stopping():
            return
        taken = True  # before anything a nested handler could interrupt
        stop(signum, frame)

    for signum in (*STOP_SIGNALS, ORDERLY_STOP):
        signal.signal(signum, handler)


def send_orderly_stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, ORDERLY_STOP)


def dump_stacks_on_request() -> None:
    """`STACK_DUMP` writes every thread's Python stack to standard error, from the signal's own
    C handler (`faulthandler`): it works while the main thread is blocked in a C call."""
    faulthandler.register(STACK_DUMP, file=sys.stderr, all_threads=True)


def send_stack_dump(pid: int) -> None:
    """`STACK_DUMP` to process ``pid`` and every process below it."""
    import psutil

    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        for each in [process, *process.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                each.send_signal(STACK_DUMP)


_deferring: dict[int, Any] = {}
"""While `defer_first_stop_signal` holds: the handlers it replaced."""


def defer_first_stop_signal(process: str) -> None:
    """In a process that the engine core stops itself once it has flushed (a worker of the
    multiprocess executor): until `end_stop_deferral`, the first SIGTERM or SIGINT is only
    logged; a second one goes to the handler it replaced (vLLM's, which stops the process)."""
    if not in_main_thread() or _deferring:
        return
    _deferring.update({sig: signal.getsignal(sig) for sig in STOP_SIGNALS})
    deferred: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not deferred:
            deferred.append(signum)
            logger.info(
                "%s: %s deferred: the engine core writes the disk tier, then stops this "
                "process; a second signal stops it now",
                process,
                signal.Signals(signum).name,
            )
            return
        old = _deferring[signum]
        if callable(old):
            old(signum, frame)
        else:
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def end_stop_deferral() -> None:
    """The stop's writes are over (done, cut short or refused): stop signals act as vLLM set
    them again, so the SIGTERM that vLLM's executor sends a worker slow to exit stops it."""
    if in_main_thread():
        for sig, old in _deferring.items():
            signal.signal(sig, old)
        _deferring.clear()
