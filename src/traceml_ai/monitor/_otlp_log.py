"""Why OTLP exports fail, in a few words: the OpenTelemetry SDK's log messages kept off
the terminal (its exporters log per retry) and read back for the one failure line, or
one connection attempt to the endpoint when they name no cause."""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from collections import deque
from collections.abc import Sequence

__all__ = ["SdkLog", "failure_reason", "quiet_sdk_logs"]

_log = logging.getLogger("traceml_ai.monitor")


class SdkLog(logging.Handler):
    """Takes the OpenTelemetry SDK's log records off the terminal: the exporters log a
    warning per retry and an error per failed export, with tracebacks for some. They go
    to this module's logger at debug level; the latest few are kept so that the one
    failure line can say why."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: deque[str] = deque(maxlen=8)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        if record.levelno >= logging.WARNING:
            self.messages.append(message)
        _log.debug("opentelemetry: %s", message)


_sdk_log: SdkLog | None = None
_sdk_log_lock = threading.Lock()


def quiet_sdk_logs() -> SdkLog:
    """Route the ``opentelemetry`` loggers to :class:`SdkLog` (once per process: the
    aggregator is its own process, and an abandoned export thread may still log after
    the sink closed)."""
    global _sdk_log
    with _sdk_log_lock:
        if _sdk_log is None:
            _sdk_log = SdkLog()
            logger = logging.getLogger("opentelemetry")
            logger.addHandler(_sdk_log)
            logger.propagate = False
        return _sdk_log


def failure_reason(messages: Sequence[str], endpoint: str | None = None) -> str:
    """A short cause of a failed export: from the SDK's messages, else (its last message
    after retries names no cause) from one connection attempt to the endpoint."""
    text = " ".join(messages)
    lowered = text.lower()
    for needle, reason in (
        ("connection refused", "connection refused"),
        ("read timed out", "timed out"),
        ("timed out", "timed out"),
        ("deadline_exceeded", "timed out"),
        ("unavailable", "receiver unavailable"),
        ("name or service not known", "unknown host"),
        ("nodename nor servname", "unknown host"),
        ("connection reset", "connection reset"),
        ("remotedisconnected", "connection closed by the receiver"),
        ("connection aborted", "connection closed by the receiver"),
    ):
        if needle in lowered:
            return reason
    for message in messages:
        marker = "code: "
        if marker in message:
            code = message.split(marker, 1)[1].split(",", 1)[0].strip()
            if code.isdigit():
                return f"HTTP {code}"
    probed = _probe(endpoint) if endpoint else None
    if probed is not None:
        return probed
    first = messages[0].strip().splitlines() if messages else []
    return first[0][:160] if first else "the exporter gave no reason"


def _probe(endpoint: str) -> str | None:
    """Why a TCP connection to the endpoint fails, or None when it succeeds (then the
    receiver answered too slowly or wrongly). Runs once, on the export thread."""
    url = endpoint if "://" in endpoint else "http://" + endpoint
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return None
    except socket.gaierror:
        return "unknown host"
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return "no answer from the receiver's host"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()[:80]
