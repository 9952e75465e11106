"""systemd's notify protocol (``Type=notify``): READY, WATCHDOG, STOPPING and STATUS messages.

One datagram per message to the AF_UNIX socket named in ``$NOTIFY_SOCKET``, written with the
standard library so running under systemd adds no dependency. Outside systemd (no
``$NOTIFY_SOCKET``: launchd, a terminal, tests) every method does nothing. A failed send is
logged and swallowed: losing a notification must never take the service down.

It lives in the protocol package because the worker and the gateway (which installs without
the worker) both run under systemd this way; like the rest of the package it logs through the
standard library's ``logging``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

# A blocked send would stall the event loop; systemd drains its socket at once, so a second is
# generous and still bounds the damage when something else sits on the other end.
SEND_TIMEOUT = 1.0


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.address = _socket_address(environ.get("NOTIFY_SOCKET", ""))
        self._watchdog_usec = _watchdog_usec(environ)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between keep-alive pings (half of ``WatchdogSec``, as systemd advises), or
        None when no watchdog is armed for this process."""
        if self._watchdog_usec is None or not self.enabled:
            return None
        return self._watchdog_usec / 2_000_000

    def ready(self, status: str | None = None) -> None:
        """Start-up is complete: systemd's start job finishes and the watchdog is armed."""
        self._send("READY=1", status)

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> None:
        """Shutdown has begun (drain), so ``systemctl status`` shows 'deactivating'."""
        self._send("STOPPING=1", status)

    async def keep_alive(self, healthy: Callable[[], bool]) -> None:
        """Ping the watchdog every ``watchdog_interval()`` while ``healthy()``; returns at once
        when no watchdog is armed, else runs until cancelled.

        Running as a task on the event loop is the point: a blocked or dead loop stops the
        pings, and so does a worker that reports itself unhealthy; either way systemd kills
        and restarts it after ``WatchdogSec``.
        """
        interval = self.watchdog_interval()
        if interval is None:
            return
        withheld = False
        while True:
            if healthy():
                self.watchdog()
                withheld = False
            elif not withheld:
                log.error("watchdog_ping_withheld", extra={"reason": "unhealthy"})
                withheld = True
            await asyncio.sleep(interval)

    def status(self, text: str) -> None:
        self._send(f"STATUS={_one_line(text)}")

    def _send(self, assignment: str, status: str | None = None) -> None:
        if self.address is None:
            return
        # One datagram, so systemd applies the state change and its status text together.
        message = assignment if status is None else f"{assignment}\nSTATUS={_one_line(status)}"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(SEND_TIMEOUT)
                sock.sendto(message.encode(), self.address)
        except OSError as exc:
            log.warning(
                "sd_notify_failed",
                extra={"notification": message.split("\n", 1)[0], "error": str(exc)},
            )


def _socket_address(raw: str) -> str | bytes | None:
    """The socket address of ``$NOTIFY_SOCKET``: a path, or ``@name`` for Linux's abstract
    namespace (a leading NUL byte on the wire)."""
    if not raw:
        return None
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    # systemd also knows vsock:... addresses (VMs); they are not for a service on the host.
    log.warning("sd_notify_unsupported_socket", extra={"notify_socket": raw})
    return None


def _watchdog_usec(environ: Mapping[str, str]) -> int | None:
    """``$WATCHDOG_USEC`` when it is meant for this process (``$WATCHDOG_PID`` unset or ours)."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # inherited from a parent that systemd watches, not us
    return usec if usec > 0 else None


def _one_line(text: str) -> str:
    """A newline would end the assignment and start another one."""
    return " ".join(text.splitlines())
