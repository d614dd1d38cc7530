"""The JSON access log: one line per request, handed to the ``kvflow.gateway.access`` logger in
batches.

Per request the gateway only encodes its line (msgspec, far cheaper than ``json.dumps``) and appends it to
a buffer; the buffer goes to the logger as one record of several lines when it holds
``MAX_LINES`` or ``DELAY`` seconds after its first line, and when the gateway stops. A
``logging`` record and a write to stderr per request cost more than the rest of the gateway's
bookkeeping together. Lines are the same JSON objects as before, at most ``DELAY`` late.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import msgspec

MAX_LINES = 256
DELAY = 0.1

_encode = msgspec.json.Encoder().encode


class AccessLog:
    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._lines: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def write(self, record: dict[str, Any]) -> None:
        raw = _encode(record)
        # msgspec writes UTF-8 as is; json.dumps escapes it, which a non-UTF-8 stderr needs
        line = raw.decode() if raw.isascii() else json.dumps(record)
        self._lines.append(line)
        if len(self._lines) >= MAX_LINES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(DELAY, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._lines:
            text = "\n".join(self._lines)
            self._lines.clear()
            self.logger.info(text)
