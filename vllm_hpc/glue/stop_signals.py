"""A second stop signal during a save of `--prefix-cache-file` abandons the save (§5.5).

vLLM turns the first SIGTERM or SIGINT into an orderly stop and puts the default handlers
back before the engine core shuts down, so a second one would kill the process in the middle
of the save (the previous file would stay, a temporary file beside it). While a save runs, the
engine core (which waits for its workers) and each worker (which writes the file) take the
signal instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_caught(on_signal: Callable[[int], None]) -> Iterator[threading.Event]:
    """An event set, and ``on_signal(signum)`` called, by each SIGTERM or SIGINT that arrives
    while the block runs; the previous handlers come back after it. Only the main thread
    takes signals: elsewhere the event is never set."""
    caught = threading.Event()
    if threading.current_thread() is not threading.main_thread():
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
