"""Wiring: the Batch API on a running gateway, opened when first needed.

A gateway opens its batch directory at start-up only if a database is already there (batches
to resume); otherwise on the first ``/v1/files`` or ``/v1/batches`` request. A gateway nobody
sends batches to creates no files and runs no runner.

A store that cannot be opened (read-only, damaged, empty over stored files) leaves the rest of
the gateway up: the Batch API answers 503 naming the problem (logged once per try), and the
store is tried again at most every ``RETRY_S`` once someone calls the Batch API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path

from kvflow.gateway.app import Gateway
from kvflow.gateway.batch.config import BatchConfig
from kvflow.gateway.batch.routes import PREFIXES, BatchApi
from kvflow.gateway.batch.runner import BatchRunner
from kvflow.gateway.batch.store import DB_NAME, AsyncStore, Store, StoreUnavailable
from kvflow.gateway.httpserver import Request, Responder
from kvflow.gateway.proxy import Exchange
from kvflow.gateway.workers import WORKER_ENV

log = logging.getLogger("kvflow.gateway.batch")

RETRY_S = 10.0
DIR_ENV = "KVFLOW_BATCH_DIR"
"""Overrides the default batch directory (not one given in a config file or with --batch-dir)."""


def batch_dir(config: BatchConfig) -> Path:
    if "dir" not in config.model_fields_set and os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    return Path(config.dir)


def replica_name(config: BatchConfig, host: str, port: int) -> str:
    """``HOST:PORT`` (and the worker index): the same on a restart with the same command."""
    if config.replica:
        return config.replica
    where = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
    worker = os.environ.get(WORKER_ENV)
    return f"{where}:{port}" + (f"/{worker}" if worker is not None else "")


class BatchService:
    def __init__(self, gateway: Gateway, config: BatchConfig) -> None:
        self.gateway, self.config = gateway, config
        self.dir = batch_dir(config)
        self.replica = ""
        """Set once the gateway listens (the name has its port)."""
        self.api: BatchApi | None = None
        self.runner: BatchRunner | None = None
        self.store: AsyncStore | None = None
        self.unavailable: str | None = None
        """Why the store could not be opened at the last try (None: open, or not tried yet)."""
        self._retry_at = 0.0
        self._opening = asyncio.Lock()
        for prefix in PREFIXES:
            gateway.mounts[prefix] = self.handle

    async def resume(self, replica: str) -> None:
        """Called once the gateway listens: reopen batches left by an earlier run, if any."""
        self.replica = replica
        if (self.dir / DB_NAME).exists():
            with contextlib.suppress(StoreUnavailable):  # logged; the rest of the gateway serves on
                await self.open()

    async def open(self) -> BatchApi:
        """The API over an open store; StoreUnavailable (a 503) when the store cannot be used."""
        async with self._opening:
            if self.api is not None:
                return self.api
            if self.unavailable is not None and time.monotonic() < self._retry_at:
                raise StoreUnavailable(self.unavailable)
            try:
                store = await asyncio.to_thread(Store, self.dir, self.gateway.auth.renamed_owners())
            except StoreUnavailable as exc:
                self.unavailable = f"the Batch API is unavailable: {exc.message}"
                self._retry_at = time.monotonic() + RETRY_S
                log.error("batch: %s (interactive requests are served as usual)", self.unavailable)
                raise StoreUnavailable(self.unavailable) from None
            self.unavailable = None
            self.store = AsyncStore(store)
            self.runner = BatchRunner(self.gateway, self.store, self.config, self.replica)
            await self.runner.start()
            self.api = BatchApi(self.gateway, self.store, self.runner, self.config)
            return self.api

    async def handle(self, request: Request, out: Responder, ex: Exchange) -> None:
        api = self.api or await self.open()
        await api.handle(request, out, ex)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
        if self.store is not None:
            await self.store.close()
