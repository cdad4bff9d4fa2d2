"""Logging: JSON lines on stderr, one per request plus lifecycle events (`_event`)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


log = logging.getLogger("collimate.server")


class JsonLines(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, and the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        d.update(getattr(record, "fields", {}))
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    for name in ("collimate", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level)
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # the request log below replaces it


def _event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    log.log(level, event, extra={"fields": fields})
