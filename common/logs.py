"""Logging setup shared by the processes: text for people, JSON lines for collectors.

A line about a request carries its ids as fields, passed with `extra=`:

    log.info("request queued", extra=request_fields(request_id, session_id))

JSON lines hold them as keys (`grep '"request_id": "r1"'` follows a request
through gateway, scheduler and executor logs); text lines end with `key=value`.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# The `extra=` fields written on a line when a log call sets them.
CONTEXT_FIELDS = ("request_id", "session_id", "executor_id")


def request_fields(request_id: str, session_id: str | None = None) -> dict[str, str]:
    """The `extra=` of a line about one request; session_id only when there is one."""
    fields = {"request_id": request_id}
    if session_id:
        fields["session_id"] = session_id
    return fields


def context_of(record: logging.LogRecord) -> dict[str, str]:
    """The context fields a log call attached to `record`."""
    return {name: getattr(record, name) for name in CONTEXT_FIELDS if hasattr(record, name)}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, process, logger, msg, context fields, exc."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": self.process_name,
            "logger": record.name,
            "msg": record.getMessage(),
            **context_of(record),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    """A line for people: time, process, level, logger, message, then key=value context."""

    def __init__(self, process_name: str) -> None:
        super().__init__(f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = " ".join(f"{name}={value}" for name, value in context_of(record).items())
        if not context:
            return line
        head, newline, rest = line.partition("\n")
        return f"{head} {context}{newline}{rest}"


def setup_logging(process_name: str, level: str = "info", log_format: str = "json") -> None:
    """Configure the root logger once for a process; Python warnings go through it too.

    Args:
        process_name: "gateway", "scheduler", "executor", ...: shown on every line.
        level: debug, info, warning or error.
        log_format: "text" or "json".
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(TextFormatter(process_name))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)


def add_log_context(**fields: str) -> None:
    """Put `fields` (CONTEXT_FIELDS) on every line the process logs from now on; a line's own
    value of a field wins. Call after setup_logging: an executor adds its executor_id."""

    def fill(record: logging.LogRecord) -> bool:
        for name, value in fields.items():
            if not hasattr(record, name):
                setattr(record, name, value)
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(fill)
