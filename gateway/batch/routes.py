"""The Batch API's HTTP routes: OpenAI's ``/v1/files`` and ``/v1/batches``.

    POST   /v1/files                  upload (multipart: file, purpose=batch)
    GET    /v1/files                  list (purpose, limit, after, order)
    GET    /v1/files/{id}             retrieve
    GET    /v1/files/{id}/content     the bytes
    DELETE /v1/files/{id}
    POST   /v1/batches                create {input_file_id, endpoint, completion_window, metadata}
    GET    /v1/batches                list (limit, after)
    GET    /v1/batches/{id}           retrieve
    POST   /v1/batches/{id}/cancel

Files and batches belong to the API key that made them (``ApiKey.owner``: the operator's name
for the key, or a digest of it; ``anonymous`` on an open gateway): a key sees only its own. The
gateway's ``handle`` maps every error raised here to OpenAI's JSON; the store failing (a disk
turned read-only, a file's bytes gone) is a 503 naming it. File contents stream to the client
in ``CHUNK`` pieces, never read whole into memory.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from kvflow.errors import InvalidRequestError
from kvflow.gateway.app import Gateway, RouteError, parse_json
from kvflow.gateway.batch.forms import parse_form
from kvflow.gateway.batch.lines import ENDPOINTS, check_upload
from kvflow.gateway.batch.config import BatchConfig
from kvflow.gateway.batch.runner import BatchRunner
from kvflow.gateway.batch.states import (
    BatchRecord, FileRecord, Status, batch_object, check_metadata, file_object, window_seconds,
)
from kvflow.gateway.batch.store import AsyncStore, StoreUnavailable, new_id
from kvflow.gateway.httpserver import Request, Responder
from kvflow.gateway.proxy import Exchange, send_json

log = logging.getLogger("kvflow.gateway.batch")

PREFIXES = ("/v1/files", "/v1/batches")
CHUNK = 1 << 20
Handler = Callable[[Request, Responder, Exchange, str, list[str]], Awaitable[None]]


class BatchApi:
    def __init__(self, gateway: Gateway, store: AsyncStore, runner: BatchRunner | None,
                 config: BatchConfig | None = None) -> None:
        self.gateway, self.store, self.runner = gateway, store, runner
        self.config = config or BatchConfig()
        self.db = store.store
        # (collection, number of path parts after it, method) -> handler
        self.table: dict[tuple[str, int, str], Handler] = {
            ("files", 0, "POST"): self.upload, ("files", 0, "GET"): self.list_files,
            ("files", 1, "GET"): self.get_file, ("files", 1, "DELETE"): self.delete_file,
            ("files", 2, "GET"): self.content,
            ("batches", 0, "POST"): self.create, ("batches", 0, "GET"): self.list_batches,
            ("batches", 1, "GET"): self.get_batch, ("batches", 2, "POST"): self.cancel,
        }

    async def handle(self, request: Request, out: Responder, ex: Exchange) -> None:
        parts = request.path.strip("/").split("/")[1:]  # ["files", id, "content"]
        collection, rest = parts[0], parts[1:]
        if len(rest) == 2 and rest[1] != ("content" if collection == "files" else "cancel"):
            raise RouteError(404, f"no route for {request.path}")
        methods = {m for (c, n, m) in self.table if c == collection and n == len(rest)}
        if not methods or any(not p for p in rest):
            raise RouteError(404, f"no route for {request.path}")
        handler = self.table.get((collection, len(rest), request.method))
        if handler is None:
            raise RouteError(405, f"{request.path} takes {' or '.join(sorted(methods))}, not {request.method}")
        key = self.gateway.auth.check(request.headers.get("authorization"))
        ex.key = key.name
        try:
            await handler(request, out, ex, key.owner or key.name, rest)
        except (sqlite3.Error, OSError) as exc:
            if isinstance(exc, ConnectionError) or out.started:
                raise  # the client left, or the answer is half sent: nothing to tell it
            log.error("batch: the store failed on %s %s: %s", request.method, request.path, exc)
            raise StoreUnavailable(f"the batch store failed: {_why(exc)}") from None

    # --- files ---------------------------------------------------------------------------

    async def upload(self, request: Request, out: Responder, ex: Exchange, owner: str, _: list[str]) -> None:
        form = parse_form(request.headers.get("content-type"), request.body)
        purpose = form["purpose"].data.decode(errors="replace") if "purpose" in form else None
        if purpose != "batch":
            raise InvalidRequestError(f"purpose must be 'batch' (the only purpose this gateway stores), not {purpose!r}",
                                      param="purpose")
        upload = form.get("file")
        if upload is None or upload.filename is None:
            raise InvalidRequestError("the form has no 'file' field with a filename", param="file")
        await asyncio.to_thread(check_upload, upload.data, self.config.max_file_lines)
        stored = await self.store.run(self.db.stored_bytes, owner)
        if stored + len(upload.data) > self.config.owner_quota_bytes:
            raise InvalidRequestError(f"this key's files take {stored} bytes; {len(upload.data)} more would pass its"
                                      f" quota of {self.config.owner_quota_bytes}: delete files first", param="file")
        rec = FileRecord(new_id("file-"), owner, upload.filename, purpose, len(upload.data), int(time.time()))
        await self.store.run(self.db.add_file, rec, upload.data)
        send_json(out, 200, file_object(rec), ex.request_id)

    async def list_files(self, request: Request, out: Responder, ex: Exchange, owner: str, _: list[str]) -> None:
        query = _query(request)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order must be 'asc' or 'desc'", param="order")
        records, more = await self.store.run(self.db.list_files, owner, query.get("purpose"), query.get("after"),
                                             _limit(query, 10000), order == "desc")
        send_json(out, 200, _page([file_object(r) for r in records], more), ex.request_id)

    async def get_file(self, request: Request, out: Responder, ex: Exchange, owner: str, rest: list[str]) -> None:
        send_json(out, 200, file_object(await self.store.run(self.db.get_file, owner, rest[0])), ex.request_id)

    async def delete_file(self, request: Request, out: Responder, ex: Exchange, owner: str, rest: list[str]) -> None:
        await self.store.run(self.db.delete_file, owner, rest[0])
        send_json(out, 200, {"id": rest[0], "object": "file", "deleted": True}, ex.request_id)

    async def content(self, request: Request, out: Responder, ex: Exchange, owner: str, rest: list[str]) -> None:
        path = await self.store.run(self.db.owned_path, owner, rest[0])
        f = await asyncio.to_thread(path.open, "rb")  # opened before the answer starts: a missing file is a 503
        try:
            out.start(200, [("Content-Type", "application/jsonl"), ("X-Request-Id", ex.request_id)])
            while chunk := await asyncio.to_thread(f.read, CHUNK):
                await out.write(chunk)  # waits while the client is slower than the disk
            out.end()
        finally:
            await asyncio.to_thread(f.close)

    # --- batches -------------------------------------------------------------------------

    async def create(self, request: Request, out: Responder, ex: Exchange, owner: str, _: list[str]) -> None:
        body = parse_json(request.body)
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise InvalidRequestError(f"endpoint must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}",
                                      param="endpoint")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise InvalidRequestError("input_file_id is required", param="input_file_id")
        window = body.get("completion_window", "24h")
        now = int(time.time())
        rec = BatchRecord(new_id("batch_"), owner, endpoint, file_id, window, Status.VALIDATING, now,
                          now + window_seconds(window), check_metadata(body.get("metadata")))
        await self.store.run(self.db.add_batch, rec)
        if self.runner is not None:
            self.runner.wake()
        send_json(out, 200, batch_object(rec), ex.request_id)

    async def list_batches(self, request: Request, out: Responder, ex: Exchange, owner: str, _: list[str]) -> None:
        query = _query(request)
        records, more = await self.store.run(self.db.list_batches, owner, query.get("after"), _limit(query, 20))
        send_json(out, 200, _page([batch_object(r) for r in records], more), ex.request_id)

    async def get_batch(self, request: Request, out: Responder, ex: Exchange, owner: str, rest: list[str]) -> None:
        send_json(out, 200, batch_object(await self.store.run(self.db.get_batch, owner, rest[0])), ex.request_id)

    async def cancel(self, request: Request, out: Responder, ex: Exchange, owner: str, rest: list[str]) -> None:
        rec = await self.store.run(self.db.cancel, owner, rest[0], int(time.time()))
        if self.runner is not None:
            self.runner.wake()
        send_json(out, 200, batch_object(rec), ex.request_id)


def _why(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__


def _query(request: Request) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(request.query).items()}


def _limit(query: dict[str, str], most: int) -> int:
    text = query.get("limit", str(most))
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise InvalidRequestError(f"limit must be between 1 and {most}", param="limit")
    return int(text)


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


__all__ = ["BatchApi", "PREFIXES"]
