"""``--log-format json|text`` and ``--log-level`` (``cli.logsetup``): the same two flags on
every long-running command, JSON lines with ts, level, logger, msg and exc, a level that
filters, and a bad value refused as a usage error naming it. The end-to-end run of
``ckptctl serve --log-format json`` is in ``test_sdnotify.py``."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import warnings
from datetime import datetime

import pytest

from ckpt_controller.cli import build_parser
from ckpt_controller.cli.logsetup import setup_logging
from support.cli import ckptctl

#: every long-running command, with the arguments it requires
COMMANDS = [["serve", "--config", "c.toml"],
            ["engine", "serve", "--name", "e", "--api", "ipc:///tmp/x"],
            ["agent", "vllm", "--url", "http://127.0.0.1:8000"],
            ["agent", "vllm-launch", "--url", "http://127.0.0.1:8000", "--log-dir", "/tmp/l",
             "--control", "ipc:///tmp/c", "--", "vllm", "serve"]]


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:
        root.removeHandler(h)
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_every_long_running_command_takes_the_flags(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    assert (args.log_format, args.log_level) == ("text", "info")
    at = 1 if argv[0] == "serve" else 2  # right after the command's words
    args = parser.parse_args([*argv[:at], "--log-format", "json", "--log-level", "WARNING",
                              *argv[at:]])
    assert (args.log_format, args.log_level) == ("json", "warning")


@pytest.mark.parametrize("flag,value", [("--log-format", "yaml"), ("--log-level", "verbose")])
def test_a_bad_value_is_a_usage_error_naming_it(flag, value):
    out = ckptctl("serve", "--config", "c.toml", flag, value)
    assert out.returncode == 2 and f"invalid choice: '{value}'" in out.stderr


def test_json_lines_with_ts_level_logger_msg_and_exc(root_logging):
    stream = io.StringIO()
    setup_logging("json", "info", stream=stream)
    log = logging.getLogger("ckpt_controller.test")
    log.debug("not written")
    log.info("engine %s is %s", "llama-a", "running")
    try:
        raise ValueError("bad")
    except ValueError:  # policy: the record under test carries it
        log.exception("it failed")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert set(first) == {"ts", "level", "logger", "msg"}
    assert first["level"] == "info" and first["logger"] == "ckpt_controller.test"
    assert first["msg"] == "engine llama-a is running"
    assert datetime.fromisoformat(first["ts"]).utcoffset().total_seconds() == 0
    assert second["level"] == "error" and second["msg"] == "it failed"
    assert second["exc"].startswith("Traceback") and "ValueError: bad" in second["exc"]


def test_text_lines_and_the_level_filters(root_logging):
    stream = io.StringIO()
    setup_logging("text", "warning", stream=stream)
    setup_logging("text", "warning", stream=stream)  # again: one handler, not two
    log = logging.getLogger("ckpt_controller.test")
    log.info("quiet")
    log.warning("loud %d", 1)
    (line,) = stream.getvalue().splitlines()
    assert line.endswith(" WARNING ckpt_controller.test: loud 1")


def _json_lines(text: str) -> list[dict]:
    """Every line of ``text`` as a JSON object (a line that is not one fails the test)."""
    return [json.loads(line) for line in text.splitlines()]


def test_json_covers_what_escapes_the_loggers(root_logging):
    """With json, an exception no code caught (in the main thread or another one) and a
    warning are JSON lines too, multi-line messages and tracebacks inside one line each;
    text puts the default hooks back."""
    stream = io.StringIO()
    setup_logging("json", "info", stream=stream)
    try:
        try:
            raise RuntimeError("first line\nsecond line")
        except RuntimeError:  # policy: handed to the hook as Python would hand it
            sys.excepthook(*sys.exc_info())
        worker = threading.Thread(target=lambda: 1 / 0, name="doomed")
        worker.start()
        worker.join()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("careful\nnow", UserWarning, stacklevel=1)
        uncaught, thread, warned = _json_lines(stream.getvalue())
        assert uncaught["level"] == "error" and "RuntimeError: first line" in uncaught["msg"]
        assert "second line" in uncaught["exc"]
        assert thread["level"] == "error" and "doomed" in thread["msg"]
        assert "ZeroDivisionError" in thread["exc"]
        assert warned["level"] == "warning" and "careful" in warned["msg"]
    finally:
        setup_logging("text", "info", stream=io.StringIO())
    assert sys.excepthook is sys.__excepthook__
    assert threading.excepthook is threading.__excepthook__


def test_a_fatal_error_before_serving_is_a_json_line():
    """``serve --log-format json`` with a config it cannot read: exit 2, and stderr is JSON
    lines only (it was a plain ``ckptctl: ConfigError: ...`` line)."""
    out = ckptctl("serve", "--config", "/nonexistent/c.toml", "--log-format", "json")
    assert out.returncode == 2, out.stderr
    (line,) = _json_lines(out.stderr)
    assert line["level"] == "error" and line["logger"] == "ckptctl"
    assert line["msg"].startswith("ConfigError: /nonexistent/c.toml: cannot read the file")
