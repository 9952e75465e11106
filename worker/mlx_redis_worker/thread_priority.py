"""Threads that do one tenant's side work (grammar compiles, media decoding) at the lowest
CPU priority, so on a machine short of cores the engine thread's steps (every tenant's
tokens) and the event loop come first."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Final

LOWEST_NICENESS: Final = 19


def lower_this_thread() -> None:
    """A thread pool's initializer: this thread at ``LOWEST_NICENESS``. Linux only, where
    niceness is per thread and a thread id names the thread (elsewhere it could name another
    process)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_NICENESS)
