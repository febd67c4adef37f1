"""Logging setup shared by the processes: text for people, JSON lines for collectors."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, process, logger, msg and exc when there is one."""

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
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(process_name: str, level: str = "info", log_format: str = "text") -> None:
    """Configure the root logger once for a process.

    Args:
        process_name: "gateway", "scheduler", "executor", ...: shown on every line.
        level: debug, info, warning or error.
        log_format: "text" or "json".
    """
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(process_name))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
