"""Stopping a long run early without losing it.

``genspec bench`` and ``genspec tradeoff`` catch ``KeyboardInterrupt`` and write what they measured so
far. A run started in the background of a non-interactive shell (``cmd &``) inherits SIGINT *ignored*,
so Python never raises ``KeyboardInterrupt`` there, and SIGTERM (what ``kill`` and schedulers send) ends
the process without a word: a 50-minute tradeoff run stopped either way would write nothing.
:func:`stoppable` makes both signals raise ``KeyboardInterrupt`` for the duration of the run.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


def _interrupt(signum, frame):  # noqa: ARG001 - the signal handler's signature
    raise KeyboardInterrupt


@contextmanager
def stoppable():
    """Within the block, SIGINT and SIGTERM raise ``KeyboardInterrupt``; the previous handlers come back
    after it. Outside the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
