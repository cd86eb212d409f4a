"""Logging setup for the gixl implementation of the ``nixl`` Python layer.

``get_logger(name)`` returns the logger ``nixl.<name without leading
underscores>``. The ``nixl`` parent logger writes to standard output and does
not propagate to the root logger.

Environment:

* ``NIXL_LOG_LEVEL``: one of TRACE, DEBUG, INFO, WARN, ERROR, FATAL
  (case-insensitive). Anything else is reported and ignored.
* ``NIXL_DEBUG_LOGGING``: ``true``/``1``/``yes`` turns
  :data:`logging.raiseExceptions` on; otherwise it is turned off, as NIXL does.

gixl's own lines (the route chosen for each peer at INFO, a fall-back such as
"cross-memory attach denied, using TCP" at WARNING) come from the native
library through the ``nixl.gixl`` logger, once ``nixl`` is imported.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

__all__ = ["get_logger", "setup_logging"]

_NATIVE_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

_ROOT_NAME = "nixl"
_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}
_FORMAT = "%(asctime)s NIXL %(levelname)-7s %(name)s: %(message)s"

_lock = threading.Lock()
_configured = False


class _StdoutHandler(logging.StreamHandler):
    """A stream handler that always writes to the *current* ``sys.stdout``."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _apply_env_level(root: logging.Logger) -> None:
    wanted = os.environ.get("NIXL_LOG_LEVEL")
    if not wanted:
        return
    level = _LEVELS.get(wanted.strip().upper())
    if level is None:
        root.warning("Ignoring unknown NIXL_LOG_LEVEL %r", wanted)
        return
    root.setLevel(level)


def setup_logging() -> None:
    """Configure the ``nixl`` logger once per process."""
    global _configured
    with _lock:
        if _configured:
            return
        root = logging.getLogger(_ROOT_NAME)
        if not root.handlers:  # keep a handler someone (or NIXL itself) already installed
            handler = _StdoutHandler()
            handler.setLevel(logging.DEBUG)
            handler.setFormatter(logging.Formatter(_FORMAT, "%Y-%m-%d %H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
        _apply_env_level(root)
        logging.raiseExceptions = os.environ.get("NIXL_DEBUG_LOGGING", "").strip().lower() in (
            "true",
            "1",
            "yes",
        )
        _configured = True


def get_logger(name: str) -> logging.Logger:
    """Return the ``nixl.<name>`` logger, configuring the hierarchy on first use."""
    setup_logging()
    short = name.lstrip("_") if name else name
    return logging.getLogger(f"{_ROOT_NAME}.{short}" if short else _ROOT_NAME)


def install_native_sink(native) -> None:
    """Send the native library's log lines to the ``nixl.gixl`` logger (once per process)."""
    log = get_logger("gixl")

    def sink(level: int, message: str) -> None:
        log.log(_NATIVE_LEVELS.get(level, logging.INFO), "%s", message)

    if native._set_log_sink(sink):
        # Lines logged while the interpreter shuts down go to stderr instead.
        atexit.register(native._log_detach)
