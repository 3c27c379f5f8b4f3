"""``--log-format json|text`` and ``--log-level`` for every long-running command (``serve``,
``engine serve``, ``agent vllm``, ``agent vllm-launch``), set up in one place.

``text`` is one line per record (``TIME LEVEL LOGGER: MESSAGE``, a traceback after it);
``json`` is one JSON object per line with ``ts`` (ISO 8601, UTC), ``level`` (lower case, as
the flag spells it), ``logger``, ``msg`` (the message with its arguments), and ``exc`` (the
formatted traceback) when the record carries an exception. Both go to stderr, which journald
keeps under systemd. With ``json`` nothing bypasses the format: an exception no code caught
(in any thread) and a Python warning are records too (``sys.excepthook``,
``threading.excepthook``, ``logging.captureWarnings``), and a command that ends with an error
before or after logging was set up says it in a JSON line (``fatal_line``).
Standard library only: building the parser loads nothing more.
Neighbours: ``cli.controller_cmds``, ``cli.engine_cmds``, ``cli.agent_cmds``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from datetime import datetime, timezone
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _level(text: str) -> str:
    """A level, in either case (``INFO`` as ``serve`` took it before): argparse's "invalid
    choice" message lists the lower-case words."""
    return text.lower()


def add_log_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--log-format", choices=FORMATS, default="text",
                    help="text: one line per record; json: one JSON object per line with "
                         "ts, level, logger, msg and exc (default text)")
    sp.add_argument("--log-level", type=_level, choices=LEVELS, default="info",
                    help="the least severe records written (default info)")


class JsonFormatter(logging.Formatter):
    """A record as one JSON line: ts, level, logger, msg, and exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": datetime.fromtimestamp(record.created, timezone.utc)
                             .isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str)


def setup_logging(fmt: str = "text", level: str = "info", stream: TextIO | None = None) -> None:
    """The root logger writes ``level`` and above to ``stream`` (stderr) in ``fmt``; a handler
    set up before (by an earlier call) is replaced, so the last call wins. ``json`` also routes
    uncaught exceptions and warnings through it; ``text`` leaves Python's own hooks."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    as_json = fmt == "json"
    sys.excepthook = _log_uncaught if as_json else sys.__excepthook__
    threading.excepthook = _log_thread_exception if as_json else threading.__excepthook__
    logging.captureWarnings(as_json)


def _log_uncaught(exc_type, exc, tb) -> None:
    """``sys.excepthook`` under json: the traceback as one record, not lines of text."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("ckptctl").error("uncaught %s: %s", exc_type.__name__, exc,
                                       exc_info=(exc_type, exc, tb))


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook`` under json: a thread's end by an exception, as one record."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("ckptctl").error("thread %s ended by %s: %s", name,
                                       args.exc_type.__name__, args.exc_value,
                                       exc_info=(args.exc_type, args.exc_value,
                                                 args.exc_traceback))


def fatal_line(message: str) -> str:
    """The JSON line a command that ends with an error prints on stderr under
    ``--log-format json`` (an ``error`` record of the ``ckptctl`` logger), whether or not
    logging was set up yet."""
    record = logging.makeLogRecord({"name": "ckptctl", "levelno": logging.ERROR,
                                    "levelname": "ERROR", "msg": message})
    return JsonFormatter().format(record)


def setup_from_args(args: argparse.Namespace) -> None:
    setup_logging(args.log_format, args.log_level)


def log_args(args: argparse.Namespace) -> list[str]:
    """The flags again, for a child that runs with the same logging (the launcher's
    sidecar)."""
    return ["--log-format", args.log_format, "--log-level", args.log_level]
